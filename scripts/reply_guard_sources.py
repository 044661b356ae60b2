"""Where the reply guard's false alarms come from, on calibration replies only.

Replays the build's reply head (:func:`isagi.safety.build.fit_reply_guard`'s design: logistic,
each check point a row, each reply weighted once, a reply's score its largest check point) on
more calibration replies than a build fits on, and prints, at several budgets (shares of the
benign replies' out-of-fold scores above the threshold) and at the build's own rule (a budget
for each kind of benign reply, :data:`isagi.safety.build.REPLY_ORDINARY_BUDGET` and
:data:`~isagi.safety.build.REPLY_LOOKALIKE_BUDGET`):

- out of fold (5 folds): the share of harmful and of benign replies withheld, the benign split
  into ordinary requests and look-alikes;
- each corpus source held out in turn: head and threshold from the other sources, scored on it;
- at the build's sample size, ``DRAWS`` draws of the cached replies by the build's own
  :func:`~isagi.safety.build.reply_sample` (seeds 1 to ``DRAWS``): head and threshold from the
  draw, scored on the replies it left out, one budget over all benign replies beside the
  build's two.

No evaluation set is read. The states (the whole corpus, for the prompt probe's out-of-fold
logits) and the replies are cached in ``--cache`` (about 22 minutes on 2 cores the first time).
Figures: docs/measurements.md, "Where the reply guard's false alarms come from".

    python scripts/reply_guard_sources.py --cache .isagi/reply-guard-sources
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from isagi.config import DEFAULT_SYSTEM_PROMPT, load_settings
from isagi.data.safety import load_safety_corpus
from isagi.safety.build import (
    REPLIES_PER_SOURCE,
    REPLY_CALIBRATION_TOKENS,
    REPLY_LOOKALIKE_BUDGET,
    REPLY_ORDINARY_BUDGET,
    Corpus,
    chat,
    generate_reply_states,
    read_layers,
    reply_sample,
    safety_states,
)
from isagi.safety.calibration import roc_auc
from isagi.safety.probe import (
    DEFAULT_C,
    DEFAULT_PROBE,
    BenignKinds,
    fit_readout,
    group_folds,
    out_of_fold,
    quantile_threshold,
    two_budget_threshold,
)
from isagi.safety.runtime import exchange_states

PER_SOURCE = {"harmful": 90, "lookalike": 150, "ordinary": 150}
BUDGETS = (0.01, 0.005, 0.0025)
DRAWS = 12


def collect(cache: Path) -> tuple[np.ndarray, dict]:
    """The corpus's safety states and the sampled replies' states, from ``cache`` or computed now.
    Plain arrays only (no pickle: a cache file is never code)."""
    states, replies = cache / "states.npy", cache / "replies.npz"
    if states.exists() and replies.exists():
        with np.load(replies, allow_pickle=False) as f:
            cuts = np.cumsum(f["lengths"])[:-1]
            return np.load(states, allow_pickle=False), {
                "pick": f["pick"].tolist(), "layers": f["layers"].tolist(), "R": np.split(f["states"], cuts)}
    from isagi.engines import load_engine

    lm = load_engine(load_settings())
    rows = load_safety_corpus()
    chats = [chat(DEFAULT_SYSTEM_PROMPT, r["text"]) for r in rows]
    layers = read_layers(lm.num_layers, lm.default_safety_layer)
    X = safety_states(lm, chats, layers)
    pick = reply_sample(rows, PER_SOURCE)
    R = generate_reply_states(lm, [chats[i] for i in pick], layers, max_new_tokens=REPLY_CALIBRATION_TOKENS)
    cache.mkdir(parents=True, exist_ok=True)
    np.save(states, X)
    np.savez(replies, pick=np.asarray(pick), layers=np.asarray(layers), lengths=np.array([len(r) for r in R]),
             states=np.concatenate(R))
    return X, {"pick": pick, "R": R, "layers": layers}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", type=Path, required=True, help="folder for the states and replies")
    args = ap.parse_args()
    X, got = collect(args.cache)
    rows = load_safety_corpus()
    corpus = Corpus.of(X, rows)
    blocks = [X.shape[1] // len(got["layers"])] * len(got["layers"])
    oof = out_of_fold(corpus.X, corpus.labels, blocks, group_folds(corpus.groups), spec=DEFAULT_PROBE)
    probe = fit_readout(corpus.X, corpus.labels, blocks, spec=DEFAULT_PROBE)
    pick = np.asarray(got["pick"])
    y, src = corpus.labels[pick], corpus.sources[pick]
    look, ordinary = corpus.kinds.lookalike[pick], corpus.kinds.ordinary[pick]
    raw = [exchange_states(probe, r, float(z), np.ones(2)) for r, z in zip(got["R"], oof[pick], strict=True)]
    read = np.concatenate([x[:, 0] for x in raw if len(x)])
    scales = np.array([np.abs(read).mean(), np.abs(oof[pick]).mean()])
    ex = [x / scales for x in raw]

    def fit(ids: np.ndarray):
        keep = [i for i in ids if len(ex[i])]
        w = np.concatenate([[1.0 / len(ex[i])] * len(ex[i]) for i in keep])
        return fit_readout(np.concatenate([ex[i] for i in keep]), np.concatenate([[y[i]] * len(ex[i]) for i in keep]),
                           [1, 1], C=DEFAULT_C, sample_weight=w * len(keep) / w.sum())

    def score(head, i: int) -> float:
        return float(head.logits(ex[i]).max()) if len(ex[i]) else -np.inf

    def out_of_fold_scores(ids: np.ndarray) -> np.ndarray:
        out: dict[int, float] = {}
        for f in group_folds([str(i) for i in ids], 5, 0):
            head = fit(np.setdiff1d(ids, ids[f]))
            out.update({int(i): score(head, int(i)) for i in ids[f]})
        return np.array([out[int(i)] for i in ids])

    every = np.arange(len(ex))
    s = out_of_fold_scores(every)
    print(f"{len(ex)} replies ({int(y.sum())} harmful), out-of-fold AUC {roc_auc(s[y == 1], s[y == 0]):.4f}")
    for budget in BUDGETS:
        t = quantile_threshold(s[y == 0], budget)
        print(f"budget {budget}: withheld harmful {np.mean(s[y == 1] > t):.3f}, benign {np.mean(s[y == 0] > t):.3f} "
              f"(ordinary {np.mean(s[(y == 0) & ordinary] > t):.3f}, look-alike {np.mean(s[(y == 0) & look] > t):.3f} "
              f"of {int(((y == 0) & look).sum())})")
    t, _ = two_budget_threshold(s, BenignKinds(ordinary=(y == 0) & ordinary, lookalike=(y == 0) & look),
                                ordinary_budget=REPLY_ORDINARY_BUDGET, lookalike_budget=REPLY_LOOKALIKE_BUDGET)
    print(f"the build's rule (ordinary {REPLY_ORDINARY_BUDGET}, look-alike {REPLY_LOOKALIKE_BUDGET}): withheld harmful "
          f"{np.mean(s[y == 1] > t):.3f}, benign {np.mean(s[y == 0] > t):.3f} (ordinary "
          f"{np.mean(s[(y == 0) & ordinary] > t):.3f}, look-alike {np.mean(s[(y == 0) & look] > t):.3f})")
    print("each source held out (head and threshold from the others):")
    for budget in BUDGETS:
        parts = []
        for source in sorted(set(src.tolist())):
            train, test = every[src != source], every[src == source]
            st = out_of_fold_scores(train)
            t = quantile_threshold(st[y[train] == 0], budget)
            head = fit(train)
            sc, yt = np.array([score(head, int(i)) for i in test]), y[test]
            tpr = f"{np.mean(sc[yt == 1] > t):.2f}" if (yt == 1).any() else "-"
            fpr = f"{np.mean(sc[yt == 0] > t):.3f}" if (yt == 0).any() else "-"
            parts.append(f"{source} harmful {tpr} benign {fpr}")
        print(f"budget {budget}: " + "; ".join(parts))
    print(f"the build's sample size ({REPLIES_PER_SOURCE} per source), {DRAWS} draws, scored on the replies left out "
          "(mean ± sd; look-alike max):")
    # the cached replies as rows reply_sample draws from, as the build draws from the corpus
    cached = [{"source_group": str(src[i]), "label": "harmful" if y[i] else "benign"} for i in every]
    rules = {"1 % of all benign": lambda sc, m: quantile_threshold(sc[m.ordinary | m.lookalike], 0.01),
             "the build's two budgets": lambda sc, m: two_budget_threshold(
                 sc, m, ordinary_budget=REPLY_ORDINARY_BUDGET, lookalike_budget=REPLY_LOOKALIKE_BUDGET)[0]}
    got_rule: dict[str, list[tuple[float, float, float]]] = {name: [] for name in rules}
    for seed in range(1, DRAWS + 1):
        draw = np.array(sorted(reply_sample(cached, REPLIES_PER_SOURCE, seed=seed)))
        rest = np.setdiff1d(every, draw)
        sd = out_of_fold_scores(draw)
        head = fit(draw)
        sr = np.array([score(head, int(i)) for i in rest])
        kinds = BenignKinds(ordinary=(y[draw] == 0) & ordinary[draw], lookalike=(y[draw] == 0) & look[draw])
        for name, rule in rules.items():
            t = rule(sd, kinds)
            got_rule[name].append((float(np.mean(sr[y[rest] == 1] > t)), float(np.mean(sr[(y[rest] == 0) & look[rest]] > t)),
                                   float(np.mean(sr[(y[rest] == 0) & ordinary[rest]] > t))))
    for name, figures in got_rule.items():
        a = np.array(figures)
        print(f"{name}: withheld harmful {a[:, 0].mean():.3f} ± {a[:, 0].std():.3f}, look-alike {a[:, 1].mean():.4f} ± "
              f"{a[:, 1].std():.4f} (max {a[:, 1].max():.3f}), ordinary {a[:, 2].mean():.4f}")


if __name__ == "__main__":
    main()
