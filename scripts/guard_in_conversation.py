"""Can the prompt guard read a message inside its conversation? Calibration rows only.

Issue 41's gap to llama-server is the history-free lookup prefill: every turn with history
evaluates the message a second time, alone, for the tier lookup and the prompt guard. Reading
both from the reply's own prefill (the message after its history) would drop it, but the shipped
probe was fitted on messages read alone, and a history moves its reading towards refusal
(docs/measurements.md, "The guard read in the conversation instead"). This script measures
whether a probe *fitted* on messages read in conversations does as well, and whether it holds
on conversations it never saw:

- every calibration row (the build's corpus, :func:`isagi.data.safety.load_safety_corpus`) read
  alone, as the build reads it, and read after one of :data:`TRAIN_QUESTIONS`' conversations
  (12 histories of 1-3 everyday exchanges, the model's own greedy 48-token replies);
- a third of the rows read again after one of 6 held-out conversations, built from the
  serving bench's questions (:func:`isagi.bench.serve_load.question`), which no fit sees;
- the build's probe (:data:`~isagi.safety.probe.DEFAULT_PROBE`), folds (twin pairs whole) and
  threshold rule (:func:`~isagi.safety.probe.two_budget_threshold`), fitted on rows read alone,
  in conversations, both, or each row once (half of the rows each way, what a build of today's
  cost could read), with the build's folds and, for both reads, with folds that hold the training
  conversations whole (the threshold then comes from scores of conversations the fit did not
  see); every score out of fold, a held-out conversation's row scored by the fold that did not
  fit it;
- with ``--varied``, the training conversations are 36 of more registers instead (1-4 exchanges,
  openers of many kinds and follow-ups that lean on the exchange before, :func:`varied_conversations`),
  the held-out ones and their rows the same, and three of the fits (alone, both, both with
  conversation folds);
- with ``--lookup``, the tier lookup's side: the distance-scale calibration pairs
  (``isagi/data/pairs_calibration.jsonl``) read alone and in two different conversations, their
  distances in the shipped profile's frame against its distance scale.

No evaluation set is read. The states are cached in ``--cache`` (the alone reads in
``states.npy``, shared with ``scripts/reply_guard_sources.py``; about 22 minutes on 2 cores for
what is missing; ``--varied`` with nothing cached, 36 minutes of reads and 12 of fits on a
slower one). Figures: docs/measurements.md, "The guard fitted inside conversations".

    python scripts/guard_in_conversation.py --cache .isagi/reply-guard-sources [--lookup] [--varied]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from isagi.config import DEFAULT_SYSTEM_PROMPT, load_settings
from isagi.data.safety import load_safety_corpus
from isagi.safety.build import Corpus, chat, read_layers, safety_states
from isagi.safety.calibration import roc_auc
from isagi.safety.probe import (
    DEFAULT_PROBE,
    BenignKinds,
    fit_readout,
    group_folds,
    logit_to_teh,
    two_budget_threshold,
)
from isagi.safety.runtime import SAFETY_POOL

# Everyday requests the training conversations are made of (written for this script; none is a
# calibration or evaluation prompt).
TRAIN_QUESTIONS = (
    "What's a good way to start learning Spanish?", "Can you explain what a black hole is?",
    "Write a short poem about autumn leaves.", "How do I reverse a list in Python?",
    "What should I cook for dinner tonight with chicken and rice?", "Summarise the plot of Romeo and Juliet.",
    "What is 15% of 240?", "Recommend a few classic science fiction novels.",
    "How can I be more productive when working from home?", "What causes the seasons on Earth?",
    "Help me write an email asking my manager for a day off.", "What's the difference between a virus and a bacterium?",
    "How do I convert Celsius to Fahrenheit?", "Tell me a fun fact about octopuses.",
    "What are some tips for a first marathon?", "Explain recursion to a beginner.",
    "What is the capital of Australia?", "How do I make my resume stand out?",
    "Suggest a name for a small bakery.", "Why do cats purr?",
    "How does compound interest work?", "What are good exercises for back pain?",
    "Translate 'good morning' into French and German.", "What is photosynthesis?",
)
Chat = list[dict[str, str]]
TRAIN_CONVERSATIONS, VARIED_CONVERSATIONS, HELD_OUT_CONVERSATIONS = 12, 36, 6

# ``--varied``: more registers than TRAIN_QUESTIONS (written for this script too): openers of many
# kinds, and follow-ups that lean on the exchange before them, as people chat.
VARIED_OPENERS = TRAIN_QUESTIONS + (
    "hey, how's it going?", "I had a really long day at work and I'm exhausted.",
    "my sister's birthday is next week and I have no idea what to get her",
    "Can you check this sentence for grammar: 'Me and him goes to the store every Sunday.'",
    "What's the time complexity of binary search?", "Why does my JavaScript say undefined is not a function?",
    "Write a SQL query that counts orders per customer.", "What does a linear regression actually do?",
    "I'm nervous about a presentation tomorrow, any advice?", "How do I tell my roommate they're too loud?",
    "Plan a three-day trip to Lisbon for me.", "What should I pack for a week of hiking in the rain?",
    "Is it better to rent or buy a house in your twenties?", "How much water should I drink a day?",
    "Describe a sunset over the sea in two sentences.", "Write a limerick about a forgetful robot.",
    "Give me a riddle and don't tell me the answer yet.", "Who painted the ceiling of the Sistine Chapel?",
    "When did the Berlin Wall come down?", "What's the plot of The Hobbit in three sentences?",
    "Explain the offside rule in football.", "How do vaccines train the immune system?",
    "What's a healthy breakfast I can make in five minutes?", "My tomato plants have yellow leaves, what's wrong?",
    "Help me name my new puppy, she's a small black terrier.", "Can you recommend a board game for four adults?",
    "what's the diff between git merge and git rebase", "How do I center a div in CSS?",
    "Turn these notes into a short meeting summary: budget approved, launch moved to May, Sam owns testing.",
    "Rewrite this to sound more polite: 'Send me the report now.'",
)
VARIED_FOLLOW_UPS = (
    "Can you say that more simply?", "Give me another example.", "Thanks, that helps!",
    "Can you make it shorter?", "Why is that?", "What would you do in my place?",
    "Okay, and what if that doesn't work?", "Can you put that in a list?", "Tell me more about the second point.",
    "Hmm, I'm not sure I agree.", "Could you explain it like I'm ten?", "Great. One more question about that.",
)


def answered(lm: Any, asks: list[list[str]]) -> list[Chat]:
    """A history per list of user messages: each answered in turn by the model (greedy, 48 tokens)."""
    from isagi.engines.base import GenerationOptions

    out = []
    for messages in asks:
        msgs = [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}]
        for text in messages:
            msgs.append({"role": "user", "content": text})
            with lm.generation(msgs, lm.default_layer, GenerationOptions(max_new_tokens=48)) as gen:
                gen.prefill()
                for _ in gen.stream():
                    pass
                msgs.append({"role": "assistant", "content": gen.text.strip()})
        out.append(msgs)
    return out


def conversations(lm: Any, questions: list[str], n: int, seed: int) -> list[Chat]:
    """``n`` histories of 1-3 exchanges drawn from ``questions``, answered by the model (greedy)."""
    rng = np.random.default_rng(seed)
    return answered(lm, [[questions[q] for q in rng.choice(len(questions), size=int(rng.integers(1, 4)), replace=False)]
                         for _ in range(n)])


def varied_conversations(lm: Any, n: int, seed: int) -> list[Chat]:
    """``n`` histories of 1-4 exchanges: an opener of :data:`VARIED_OPENERS`, then each next
    message a follow-up or another opener, answered by the model (greedy, 48 tokens)."""
    rng = np.random.default_rng(seed)
    asks: list[list[str]] = []
    for _ in range(n):
        asks.append([])
        for k in range(int(rng.integers(1, 5))):
            pool = VARIED_FOLLOW_UPS if k and rng.random() < 0.5 else VARIED_OPENERS
            asks[-1].append(pool[int(rng.integers(len(pool)))])
    return answered(lm, asks)


def read_in(lm: Any, texts: list[str], history: np.ndarray, histories: list[Chat], layers: list[int]) -> np.ndarray:
    """The safety state of each text read after ``histories[history[i]]``: rows of one history are
    evaluated together, so the history is the group's shared prefix, evaluated once."""
    from isagi.manifold.pooling import pool_states

    chats = [histories[h] + [{"role": "user", "content": t}] for t, h in zip(texts, history, strict=True)]
    order = sorted(range(len(chats)), key=lambda i: (history[i], len(texts[i])))
    X = np.zeros((len(chats), len(layers) * lm.hidden_size), np.float32)
    for i, per_layer in zip(order, lm.iter_prompt_states([chats[i] for i in order], layers), strict=True):
        span = lm.content_span(chats[i])
        X[i] = np.concatenate([pool_states(per_layer[layer], SAFETY_POOL, span) for layer in layers])
    return X


def collect(cache: Path, *, varied: bool = False) -> dict[str, Any]:
    """Every read, from ``cache`` or computed now (plain arrays and JSON, no pickle). ``varied``:
    the training conversations are :func:`varied_conversations` instead of :func:`conversations`
    of :data:`TRAIN_QUESTIONS`; the held-out conversations and their rows are the same."""
    conv, meta = ("in_varied_conversation.npy", "varied_conversations.json") if varied else \
        ("in_conversation.npy", "conversations.json")
    files = {k: cache / f for k, f in (("alone", "states.npy"), ("conv", conv),
                                        ("held", "held_out_conversation.npy"), ("meta", meta))}
    if all(p.exists() for p in files.values()):
        meta_ = json.loads(files["meta"].read_text())
        return {"alone": np.load(files["alone"]), "conv": np.load(files["conv"]), "held": np.load(files["held"]),
                "held_rows": np.array(meta_["held_rows"]), "meta": meta_}
    from isagi.bench.serve_load import question
    from isagi.engines import load_engine

    lm = load_engine(load_settings())
    rows = load_safety_corpus()
    texts = [r["text"] for r in rows]
    layers = read_layers(lm.num_layers, lm.default_safety_layer)
    cache.mkdir(parents=True, exist_ok=True)
    if not files["alone"].exists():
        np.save(files["alone"], safety_states(lm, [chat(DEFAULT_SYSTEM_PROMPT, t) for t in texts], layers))
    train = (varied_conversations(lm, VARIED_CONVERSATIONS, seed=11) if varied
             else conversations(lm, list(TRAIN_QUESTIONS), TRAIN_CONVERSATIONS, seed=1))
    held = conversations(lm, [question(i) for i in range(300)], HELD_OUT_CONVERSATIONS, seed=2)  # (deterministic)
    rng = np.random.default_rng(0)
    # the first run's draws, in its order, whichever training conversations: the held-out rows stay the same
    history = rng.integers(0, TRAIN_CONVERSATIONS, size=len(rows))
    held_rows = np.sort(rng.choice(len(rows), size=len(rows) // 3, replace=False))
    held_history = rng.integers(0, HELD_OUT_CONVERSATIONS, size=len(held_rows))
    if varied:
        history = np.random.default_rng(10).integers(0, len(train), size=len(rows))
    if not files["held"].exists():
        np.save(files["held"], read_in(lm, [texts[i] for i in held_rows], held_history, held, layers))
    np.save(files["conv"], read_in(lm, texts, history, train, layers))
    files["meta"].write_text(json.dumps({"train": train, "held_out": held, "history": history.tolist(),
                                         "held_rows": held_rows.tolist(), "held_history": held_history.tolist()}))
    return collect(cache, varied=varied)


def guard(reads: dict[str, Any], only: tuple[str, ...] | None = None) -> None:
    """Out-of-fold figures of the probe fitted on each kind of read (``only`` those named), on every kind of read."""
    rows = load_safety_corpus()
    Xa, Xc, Xh = (np.asarray(reads[k], np.float64) for k in ("alone", "conv", "held"))
    held_rows = reads["held_rows"]
    corpus = Corpus.of(Xa, rows)
    y, n = corpus.labels, len(corpus.labels)
    blocks = [Xa.shape[1] // 3] * 3  # the build reads three layers side by side
    groups = np.array(corpus.groups, dtype=str)
    twin_folds = group_folds(corpus.groups)
    # the training conversations held out whole: a fold is every row read after some of them (the
    # alone reads of those rows too), and no twin of a row of the fold is fitted on
    conversation_folds = group_folds(reads["meta"]["history"])
    at_held = {int(r): k for k, r in enumerate(held_rows)}
    benign = y == 0
    once = np.random.default_rng(7).random(n) < 0.5  # "each row once": these rows read in a conversation

    def both(tr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return np.concatenate([Xa[tr], Xc[tr]]), np.concatenate([y[tr], y[tr]])

    trainings = {"alone": (lambda tr: (Xa[tr], y[tr]), twin_folds),
                 "in conversations": (lambda tr: (Xc[tr], y[tr]), twin_folds),
                 "both (every row twice)": (both, twin_folds),
                 "each row once (half in a conversation)": (lambda tr: (np.where(once[tr, None], Xc[tr], Xa[tr]), y[tr]),
                                                            twin_folds),
                 "both, folds holding conversations whole": (both, conversation_folds)}
    unknown = set(only or ()) - set(trainings)
    if unknown:
        raise ValueError(f"no fit named {sorted(unknown)}; the fits are {list(trainings)}")
    print(f"{n} calibration rows ({int(y.sum())} harmful); {len(held_rows)} read again in held-out conversations")
    for name, (data, folds) in trainings.items():
        if only is not None and name not in only:
            continue
        z = {"alone": np.zeros(n), "conv": np.zeros(n), "held": np.zeros(len(held_rows))}
        for test in folds:
            train = np.setdiff1d(np.arange(n), test)
            train = train[~np.isin(groups[train], groups[test])]  # twin pairs never straddle a fold
            probe = fit_readout(*data(train), blocks, spec=DEFAULT_PROBE)
            z["alone"][test], z["conv"][test] = probe.logits(Xa[test]), probe.logits(Xc[test])
            mine = [at_held[int(i)] for i in test if int(i) in at_held]
            z["held"][mine] = probe.logits(Xh[mine])
        # the threshold from the benign rows' scores as the fit read them (both reads when both)
        fitted = ([z["alone"]] if name == "alone" else [z["conv"]] if name == "in conversations"
                  else [np.where(once, z["conv"], z["alone"])] if name.startswith("each row once")
                  else [z["alone"], z["conv"]])
        kinds = BenignKinds(ordinary=np.concatenate([corpus.kinds.ordinary[benign]] * len(fitted)),
                            lookalike=np.concatenate([corpus.kinds.lookalike[benign]] * len(fitted)))
        threshold, _ = two_budget_threshold(np.concatenate([f[benign] for f in fitted]), kinds)
        print(f"fitted on rows read {name}: threshold {logit_to_teh(threshold):.2f} % (TEH)")
        for label, scores, at in (("read alone", z["alone"], slice(None)), ("in training conversations", z["conv"], slice(None)),
                                  ("in held-out conversations", z["held"], held_rows)):
            yy, ordinary, lookalike = y[at], corpus.kinds.ordinary[at], corpus.kinds.lookalike[at]
            print(f"  {label:26s} AUC {roc_auc(scores[yy == 1], scores[yy == 0]):.4f}, harmful above "
                  f"{np.mean(scores[yy == 1] > threshold):.3f}, ordinary above {np.mean(scores[ordinary] > threshold):.4f}, "
                  f"look-alike above {np.mean(scores[lookalike] > threshold):.4f}")


def cascade(reads: dict[str, Any]) -> None:
    """The shipped kind of probe (fitted on rows read alone, the build's folds and threshold) read in
    the conversation first, the message read alone only when that reading is not clearly below the
    threshold. Out of fold: how often the alone read could be skipped, by kind of row, and how
    many harmful rows the alone read refuses that the conversation's reading would let through
    (a "slip"), at several margins below the threshold."""
    rows = load_safety_corpus()
    Xa, Xc, Xh = (np.asarray(reads[k], np.float64) for k in ("alone", "conv", "held"))
    held_rows = reads["held_rows"]
    corpus = Corpus.of(Xa, rows)
    y, n = corpus.labels, len(corpus.labels)
    blocks = [Xa.shape[1] // 3] * 3
    groups = np.array(corpus.groups, dtype=str)
    at_held = {int(r): k for k, r in enumerate(held_rows)}
    z = {"alone": np.zeros(n), "conv": np.zeros(n), "held": np.zeros(len(held_rows))}
    for test in group_folds(corpus.groups):
        train = np.setdiff1d(np.arange(n), test)
        train = train[~np.isin(groups[train], groups[test])]
        probe = fit_readout(Xa[train], y[train], blocks, spec=DEFAULT_PROBE)
        z["alone"][test], z["conv"][test] = probe.logits(Xa[test]), probe.logits(Xc[test])
        mine = [at_held[int(i)] for i in test if int(i) in at_held]
        z["held"][mine] = probe.logits(Xh[mine])
    benign = y == 0
    kinds = BenignKinds(ordinary=corpus.kinds.ordinary[benign], lookalike=corpus.kinds.lookalike[benign])
    threshold, _ = two_budget_threshold(z["alone"][benign], kinds)
    tau = logit_to_teh(threshold)
    teh = {k: np.vectorize(logit_to_teh)(v) for k, v in z.items()}
    print(f"fitted on rows read alone: threshold {tau:.2f} % (TEH); out of fold")
    for label, conv, at in (("training conversations", teh["conv"], np.arange(n)),
                            ("held-out conversations", teh["held"], held_rows)):
        alone = teh["alone"][at]
        yy, ordinary, lookalike = y[at], corpus.kinds.ordinary[at], corpus.kinds.lookalike[at]
        shift = conv - alone
        print(f"  {label}: TEH in the conversation minus alone, harmful median {np.median(shift[yy == 1]):+.1f} "
              f"(share below 0: {np.mean(shift[yy == 1] < 0):.3f}), benign median {np.median(shift[yy == 0]):+.1f} "
              f"(share below 0: {np.mean(shift[yy == 0] < 0):.3f})")
        refused = (alone > tau) & (yy == 1)
        for margin in (0.0, 5.0, 10.0, 20.0):
            skip = conv <= tau - margin
            slips = int(np.sum(refused & skip))
            print(f"    margin {margin:4.1f} points: alone read skipped for ordinary {np.mean(skip[ordinary]):.3f}, "
                  f"look-alike {np.mean(skip[lookalike]):.3f}, harmful {np.mean(skip[yy == 1]):.3f}; "
                  f"slips {slips} of {int(refused.sum())} harmful rows refused alone "
                  f"({slips / max(1, int(refused.sum())):.4f})")


def lookup(meta: dict[str, Any]) -> None:
    """The calibration pairs' distances in the shipped profile's frame, read alone and in conversations."""
    from isagi.data import load_pairs
    from isagi.engines import load_engine
    from isagi.manifold.pooling import prompt_hidden_states
    from isagi.manifold.ugt import project
    from isagi.profile import load_or_build_profile

    settings = load_settings()
    lm = load_engine(settings)
    profile = load_or_build_profile(lm, settings)
    histories = meta["held_out"] + meta["train"]
    pairs = load_pairs("calibration")
    rng = np.random.default_rng(5)
    first_in = rng.integers(0, len(histories), len(pairs))
    second_in = (first_in + 1 + rng.integers(0, len(histories) - 1, len(pairs))) % len(histories)  # another one

    def read(key: str, where: np.ndarray | None) -> np.ndarray:
        alone = [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}]
        chats = [(histories[int(where[i])] if where is not None else alone) + [{"role": "user", "content": p[key]}]
                 for i, p in enumerate(pairs)]
        return np.asarray(project(profile.basis, prompt_hidden_states(lm, chats, profile.layer)))

    def distance(a: np.ndarray, b: np.ndarray) -> np.ndarray:  # the scale's metric-free cosine distance
        return np.asarray(1 - np.sum(a * b, 1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1) + 1e-12))

    scale = profile.distance_scale
    assert scale is not None
    relation = np.array([p["relation"] for p in pairs])
    print(f"distance scale: augment_at {scale.augment_at:.4f}, explore_at {scale.explore_at:.4f}, "
          f"retrieve_cap {scale.retrieve_cap:.4f}")
    for label, d in (("both alone", distance(read("first", None), read("second", None))),
                     ("in two different conversations", distance(read("first", first_in), read("second", second_in)))):
        print(label)
        for rel, check in (("duplicate", lambda v: f"within retrieve_cap {np.mean(v <= scale.retrieve_cap):.3f}"),
                           ("paraphrase", lambda v: f"below explore_at {np.mean(v < scale.explore_at):.3f}"),
                           ("near_miss", lambda v: ""), ("related", lambda v: ""),
                           ("unrelated", lambda v: f"above augment_at {np.mean(v > scale.augment_at):.3f}")):
            v = d[relation == rel]
            print(f"  {rel:10s} {len(v):3d} pairs, median {np.median(v):.4f} ({v.min():.4f}-{v.max():.4f}) {check(v)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", type=Path, required=True, help="folder for the states (states.npy is shared)")
    ap.add_argument("--lookup", action="store_true", help="also the tier lookup's pair distances (~7 minutes)")
    ap.add_argument("--varied", action="store_true",
                    help="training conversations of more registers (36, with follow-ups); three fits")
    ap.add_argument("--cascade", action="store_true",
                    help="instead of the fits: the shipped kind of probe read in the conversation first")
    args = ap.parse_args()
    reads = collect(args.cache, varied=args.varied)
    if args.cascade:
        cascade(reads)
        return
    guard(reads, only=("alone", "both (every row twice)", "both, folds holding conversations whole")
          if args.varied else None)
    if args.lookup:
        lookup(reads["meta"])


if __name__ == "__main__":
    main()
