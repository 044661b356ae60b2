"""``isagi bench turn``: what the living manifold costs a turn, and what RETRIEVE saves.

In one run, on the configured model and backend: plain generation of a reply
to a question without ISAGI (``generate_s``: llama-cpp-python's own ``Llama``
on the llama.cpp backend, same GGUF and threads; ``model.generate`` on the
transformers backend); a full ISAGI turn producing the same reply in a
fresh session, with lookup, TEH on the prompt and on the streaming reply,
metric update, memory store, history row and ``.miku`` autosave
(``turn_s``); the same question asked again, answered from memory
(``retrieve_s``: an exact repeat, whose prompt states the session already
holds, so no forward pass runs), and once more with those cached states
dropped (``retrieve_prefill_s``: one prefill, as for a re-worded duplicate). Medians over ``repeats`` alternating runs;
``turn_ratio`` is the median over the repeats of each turn over the plain generation run just
before it (pairs drift together on a shared machine), ``turn_ratio_range`` their spread. ``teh_share`` is
the time spent computing TEH (the prompt's safety state, the mean over the
message's tokens, and its TEH, plus the streaming reply checks, replayed on
the turn's own hidden states) over ``turn_s``.

With ``--history N[,N...]`` (:func:`run_history`) it measures instead what a
turn costs late in a long session: one session per N holding N earlier
exchanges (short question-and-answer exchanges, stored as accepted turns so
the prompt's history window really holds them; their replies are written, not
generated), then ``turns`` new questions asked in each session in turn (no
question repeats, so none is RETRIEVEd), timed as whole turns with the history
row and the ``.miku`` autosave (the earlier exchanges are in the session's
turns, not in its trajectory memory: lookup at scale is ``bench lookup``'s
subject). The first new turn of each session has no
saved KV cache to start from (as after loading a session) and is reported
apart (``first_turn_s``); the rest are the steady state, turns on which the
history window drops a block of old exchanges among them (``drop_turns``;
on llama.cpp ``context_shifts`` counts those that reused the previous turn's
KV cache with the dropped exchanges cut out, ``ISAGI_CONTEXT_SHIFT``), so the
median, mean and max together show the amortised cost. ``evaluated_tokens``
are the tokens a turn ran through the model (llama.cpp). ``ratio_N_to_M``
are each N's figures over the smallest N's.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from isagi.config import Settings
from isagi.engines.base import GenerationOptions

QUESTION = "Explain in a few sentences why the sky is blue."


def _teh_seconds(engine: Any, h_prompt: Any, reply_states: Any, every: int) -> float:
    from isagi.safety.runtime import ReplyGuard, teh

    guard = ReplyGuard(engine.profile.safety, h_prompt, every=every)
    start = time.perf_counter()
    teh(engine.profile.safety, h_prompt)
    for n in range(every, len(reply_states) + every, every):
        guard.check(reply_states[: min(n, len(reply_states))])
    return time.perf_counter() - start


def run(settings: Settings, *, new_tokens: int = 64, repeats: int = 9) -> dict[str, Any]:
    from isagi.manifold.pooling import decoding_state
    from isagi.pipeline.engine import Engine
    from isagi.safety.runtime import SAFETY_POOL, ReplyGuard

    with tempfile.TemporaryDirectory(prefix="isagi-bench-") as tmp:
        engine = Engine.start(settings, with_store=False)
        from isagi.storage.history import HistoryStore

        engine.store = HistoryStore(f"sqlite:///{Path(tmp) / 'history.sqlite3'}")
        from isagi.pipeline.keeping import default_keeper

        engine.keep = default_keeper(lambda: engine.frame, engine.store, model_id=engine.lm.model_id)  # the turn writes its history rows and its file
        lm = engine.lm
        options = GenerationOptions(max_new_tokens=new_tokens)
        messages = [{"role": "system", "content": settings.system_prompt}, {"role": "user", "content": QUESTION}]
        plain = _plain_generator(lm, messages, new_tokens)

        plain()  # warm-up
        gen_t, turn_t, ret_t, ret_u = [], [], [], []
        same = True
        result = None
        for i in range(repeats):
            t, plain_ids = plain()
            gen_t.append(t)
            session = engine.new_session(f"bench-{i}", autosave=False)
            session.miku_path = Path(tmp) / f"bench-{i}.miku"
            _forget_prefixes(lm)  # the same work as the plain run's: no KV cache of an earlier run
            start = time.perf_counter()
            result = engine.turn(session, QUESTION, options=options)
            turn_t.append(time.perf_counter() - start)
            same = same and result.reply_text.strip() == lm.detokenize(plain_ids).strip()
            start = time.perf_counter()
            again = engine.turn(session, QUESTION, options=options)
            ret_t.append(time.perf_counter() - start)
            assert again.tier == "RETRIEVE", f"the repeated question was {again.tier}, not RETRIEVE"
            session.prompt_states.clear()  # as if the states had to be computed again: one prefill
            start = time.perf_counter()
            again = engine.turn(session, QUESTION, options=options)
            ret_u.append(time.perf_counter() - start)
            assert again.tier == "RETRIEVE", f"the repeated question was {again.tier}, not RETRIEVE"
        rows = engine.store.get_turns(session.id, owner=session.owner)
        assert len(rows) >= 3, f"the history store holds {len(rows)} rows of the last session's 3 turns"
        safety = engine.profile.safety
        with lm.generation(messages, engine.layer, options, also_capture=tuple(safety.read_layers)) as gen:
            gen.prefill()
            for _ in gen.stream():
                pass
            pool_t = []  # the safety state itself: the message's token span and the means over its spans, per layer
            for _ in range(repeats):
                start = time.perf_counter()
                h = np.concatenate([decoding_state(gen, layer, SAFETY_POOL, lm.content_span(messages))
                                    for layer in safety.read_layers])
                pool_t.append(time.perf_counter() - start)
            guard = ReplyGuard(safety, h)
            states = np.concatenate([gen.reply_hidden(layer) for layer in guard.layers], axis=1)
        teh_s = statistics.median(pool_t) + statistics.median(
            _teh_seconds(engine, h, states, guard.every) for _ in range(repeats))
    med = statistics.median
    pairs = [t / g for t, g in zip(turn_t, gen_t, strict=True)]
    return {
        "model": lm.model_id,
        "backend": lm.backend,
        "device": str(lm.device),
        "quant": lm.quant,
        "question": QUESTION,
        "new_tokens": result.new_tokens if result else None,
        "same_reply_as_generate": same,
        "generate_s": round(med(gen_t), 4),
        "turn_s": round(med(turn_t), 4),
        "turn_s_range": [round(min(turn_t), 4), round(max(turn_t), 4)],
        "generate_s_range": [round(min(gen_t), 4), round(max(gen_t), 4)],
        "turn_ratio": round(med(pairs), 4),
        "turn_ratio_range": [round(min(pairs), 4), round(max(pairs), 4)],
        "turn_ratio_of_medians": round(med(turn_t) / med(gen_t), 4),
        "retrieve_s": round(med(ret_t), 5),
        "retrieve_speedup": round(med(turn_t) / med(ret_t), 1),
        "retrieve_prefill_s": round(med(ret_u), 5),
        "retrieve_prefill_speedup": round(med(turn_t) / med(ret_u), 1),
        "teh_s": round(teh_s, 5),
        "teh_share": round(teh_s / med(turn_t), 5),
    }


# Earlier exchanges of a long session: short questions and written replies of a realistic length.
_HISTORY = (
    ("What is {a} times {b}?",
     "{a} times {b} is {ab}. You can check it by adding {a} to itself {b} times, which gives the same number."),
    ("How many minutes are there in {a} hours?",
     "There are {a60} minutes in {a} hours: every hour has 60 minutes, and {a} times 60 is {a60}."),
    ("Can you suggest a name for a cat that is {a} weeks old?",
     "A kitten of {a} weeks could be called Pepper, Miso or Biscuit. Short names with two syllables are easy "
     "for a cat to learn, so pick the one you like saying most."),
    ("Give me one tip for a {a}-minute workout.",
     "In {a} minutes you can do a full circuit: squats, push-ups and lunges, 40 seconds each with 20 seconds of "
     "rest, repeated as often as the time allows. Warm up for the first two minutes."),
    ("How far does light travel in {a} seconds?",
     "Light travels about 300,000 kilometres every second, so in {a} seconds it covers about {a300},000 "
     "kilometres."),
)

# New questions asked in every session; none repeats, and none is among the earlier exchanges.
NEW_QUESTIONS = (
    "Why do leaves change colour in autumn?",
    "How does a refrigerator keep food cold?",
    "What causes the tides in the ocean?",
    "Why is the sea salty?",
    "How do bees make honey?",
    "What is the difference between weather and climate?",
    "How does a compass find north?",
    "Why do we have leap years?",
    "How do vaccines train the immune system?",
    "What makes a rainbow appear after rain?",
    "How do airplanes stay in the air?",
    "Why does bread rise when it is baked?",
    "How do solar panels turn sunlight into electricity?",
    "What is the water cycle?",
    "Why do cats purr?",
    "How does a battery store energy?",
    "What causes earthquakes?",
    "Why is the night sky dark?",
    "How do plants drink water through their roots?",
    "What does the heart do in the human body?",
    "How do submarines dive and surface?",
    "Why do onions make people cry?",
    "How does soap clean dirty hands?",
    "What is a black hole?",
    "How do birds know where to migrate?",
)


def history_exchanges(n: int) -> list[tuple[str, str]]:
    """``n`` earlier exchanges (question, reply), all different, of the lengths a short chat has."""
    out = []
    for i in range(n):
        question, reply = _HISTORY[i % len(_HISTORY)]
        a, b = 2 + i // len(_HISTORY), 3 + i % 7
        values = {"a": a, "b": b, "ab": a * b, "a60": a * 60, "a300": a * 300}
        out.append((question.format(**values), reply.format(**values)))
    return out


def run_history(
    settings: Settings, histories: list[int], *, new_tokens: int = 64, turns: int = 16, lm: Any = None,
    profile: Any = None,
) -> dict[str, Any]:
    """Turn times after ``histories`` earlier exchanges (see the module docstring), measured in one run:
    the sessions take their turns in rotation, so a shared machine's drift falls on all of them alike.
    ``lm`` and ``profile`` replace the configured model and its profile (tests pass a tiny one)."""
    from isagi.errors import InputError
    from isagi.manifold.window import KEEP_SHARE
    from isagi.pipeline.engine import Engine
    from isagi.pipeline.keeping import default_keeper
    from isagi.session.turn import Turn
    from isagi.storage.history import HistoryStore

    histories = sorted(set(histories))
    if not histories or histories[0] < 0:
        raise InputError("--history: give one or more numbers of earlier exchanges, none negative.")
    if not 2 <= turns < len(NEW_QUESTIONS):
        raise InputError(f"--turns {turns}: give 2 to {len(NEW_QUESTIONS) - 1} new turns per session.")
    options = GenerationOptions(max_new_tokens=new_tokens)
    with tempfile.TemporaryDirectory(prefix="isagi-bench-") as tmp:
        engine = Engine.start(settings, with_store=False, lm=lm, profile=profile)
        engine.store = HistoryStore(f"sqlite:///{Path(tmp) / 'history.sqlite3'}")
        engine.keep = default_keeper(lambda: engine.frame, engine.store, model_id=engine.lm.model_id)
        lm = engine.lm
        _forget_prefixes(lm)
        sessions = {}
        for n in histories:
            session = engine.new_session(f"bench-history-{n}", autosave=False)
            session.miku_path = Path(tmp) / f"history-{n}.miku"
            now = time.time()
            session.turns += [Turn(user_text=q, reply_text=r, tier="EXPLORE", verdict="ok", generated=True,
                                   asked_at=now, answered_at=now) for q, r in history_exchanges(n)]
            sessions[n] = session
        times: dict[int, list[float]] = {n: [] for n in histories}
        evaluated: dict[int, list[int]] = {n: [] for n in histories}
        prompt_n: dict[int, list[int]] = {n: [] for n in histories}
        starts: dict[int, list[int]] = {n: [] for n in histories}
        shifts = dict.fromkeys(histories, 0)
        for question in NEW_QUESTIONS[: turns + 1]:
            for n, session in sessions.items():
                starts[n].append(engine.prompts.history_window(session, question)[0])
                counted, shifted = getattr(lm, "evaluated_tokens", None), getattr(lm, "context_shifts", 0)
                started = time.perf_counter()
                turn = engine.turn(session, question, options=options)
                times[n].append(time.perf_counter() - started)
                assert turn.tier != "RETRIEVE", f"{question!r} was answered from memory"
                if counted is not None:
                    evaluated[n].append(lm.evaluated_tokens - counted)
                if len(times[n]) > 1:
                    shifts[n] += getattr(lm, "context_shifts", 0) - shifted
                prompt_n[n].append(int(turn.prompt_tokens or 0))
        engine.store.close()
    base = histories[0]
    figures = {n: {**_history_figures(times[n], evaluated[n], prompt_n[n], starts[n]), "context_shifts": shifts[n]}
               for n in histories}
    return {
        "model": lm.model_id,
        "backend": lm.backend,
        "device": str(lm.device),
        "new_tokens": new_tokens,
        "turns": turns,
        "prompt_budget": engine.prompts.budget,
        "keep_share": KEEP_SHARE,
        "context_shift": settings.context_shift,
        **{f"history_{n}": figures[n] for n in histories},
        **{f"ratio_{n}_to_{base}": {k: round(figures[n][k] / figures[base][k], 3) for k in ("median_s", "mean_s", "max_s")}
           for n in histories[1:]},
    }


def _history_figures(times: list[float], evaluated: list[int], prompts: list[int], starts: list[int]) -> dict[str, Any]:
    """One session's figures: its first new turn apart, then the steady state's median, mean and max;
    ``drop_turns``: steady turns whose history window dropped a block of old exchanges."""
    steady = times[1:]
    dropped = [t for t, before, now in zip(steady, starts[:-1], starts[1:], strict=True) if now != before]
    med = statistics.median
    return {
        "first_turn_s": round(times[0], 4),
        "median_s": round(med(steady), 4),
        "mean_s": round(statistics.fmean(steady), 4),
        "max_s": round(max(steady), 4),
        "min_s": round(min(steady), 4),
        "drop_turns": len(dropped),
        "drop_turn_s": round(med(dropped), 4) if dropped else None,
        "prompt_tokens_median": int(med(prompts[1:])),
        "evaluated_tokens_median": int(med(evaluated[1:])) if evaluated else None,
        "evaluated_tokens_max": max(evaluated[1:]) if evaluated else None,
    }


def _forget_prefixes(lm: Any) -> None:
    """Drop the llama.cpp engine's saved KV caches (:mod:`isagi.engines.kv_prefix`): the plain
    baseline evaluates the whole prompt every run, so the timed turn must too."""
    prefixes = getattr(lm, "prefixes", None)
    if prefixes is not None:
        prefixes.clear()


def _plain_generator(lm: Any, messages: list[dict[str, str]], new_tokens: int) -> Any:
    """A callable timing one plain greedy generation of the reply, without ISAGI: (seconds, new ids)."""
    ids = lm.chat_tokens(messages)
    stops = lm.stop_token_ids
    if lm.backend == "llamacpp":
        from isagi.bench.plain_llama import PlainLlama

        llm = PlainLlama(lm.source, n_threads=lm.n_threads, n_ctx=lm.context_length)

        def plain_llama() -> tuple[float, list[int]]:
            seconds, _first, new = llm.generate(ids, new_tokens, stop_ids=stops)
            return seconds, new

        return plain_llama

    import torch

    prompt = torch.tensor([ids])

    def plain_hf() -> tuple[float, list[int]]:
        start = time.perf_counter()
        with torch.inference_mode():
            out = lm.model.generate(prompt, max_new_tokens=new_tokens, do_sample=False)
        new = out[0, prompt.shape[1]:].tolist()
        cut = next((i for i, t in enumerate(new) if t in stops), len(new))
        return time.perf_counter() - start, new[:cut]

    return plain_hf
