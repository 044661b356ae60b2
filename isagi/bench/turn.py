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
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from isagi.config import Settings
from isagi.engines.base import GenerationOptions

QUESTION = "Explain in a few sentences why the sky is blue."


def _teh_seconds(engine: Any, h_prompt: Any, reply_states: Any, every: int) -> float:
    from isagi.safety import ReplyGuard, teh

    guard = ReplyGuard(engine.profile.safety, h_prompt, every=every)
    start = time.perf_counter()
    teh(engine.profile.safety, h_prompt)
    for n in range(every, len(reply_states) + every, every):
        guard.check(reply_states[: min(n, len(reply_states))])
    return time.perf_counter() - start


def run(settings: Settings, *, new_tokens: int = 64, repeats: int = 9) -> dict[str, Any]:
    from isagi.agent import Engine
    from isagi.pooling import decoding_state
    from isagi.safety import SAFETY_POOL, ReplyGuard

    with tempfile.TemporaryDirectory(prefix="isagi-bench-") as tmp:
        engine = Engine.start(settings, with_store=False)
        from storage.history import HistoryStore

        engine.store = HistoryStore(f"sqlite:///{Path(tmp) / 'history.sqlite3'}")
        from isagi.persist import default_keeper

        engine.keep = default_keeper(engine, engine.store)  # the turn writes its history rows and its file
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
        safety_layer = engine.profile.safety.layer
        with lm.generation(messages, engine.layer, options, also_capture=(safety_layer,)) as gen:
            gen.prefill()
            for _ in gen.stream():
                pass
            pool_t = []  # the safety state itself: the message's token span and the means over its spans
            for _ in range(repeats):
                start = time.perf_counter()
                h = decoding_state(gen, safety_layer, SAFETY_POOL, lm.content_span(messages))
                pool_t.append(time.perf_counter() - start)
            states = gen.reply_hidden(safety_layer)
        teh_s = statistics.median(pool_t) + statistics.median(
            _teh_seconds(engine, h, states, ReplyGuard(engine.profile.safety, h).every) for _ in range(repeats))
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
