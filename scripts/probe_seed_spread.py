"""How much the prompt probe's verdicts depend on its members' seeds, on calibration rows only.

The prompt guard's MLP probe (:data:`isagi.safety.probe.DEFAULT_PROBE`) averages several small
networks, member k fitted with seed ``seed + k``. This script fits the build's out-of-fold
scores (the build's folds, :func:`isagi.safety.probe.out_of_fold`) with ``--sets`` disjoint sets
of ``--base`` members (seeds 0 to base-1, base to 2·base-1, ...), then averages neighbouring sets
into probes of 2·base and 3·base members (a probe's logit is its members' mean, so the average of
two sets' logits *is* the larger probe's). For each size it prints, per seed set, the build's
threshold (the two budgets, :func:`~isagi.safety.probe.two_budget_threshold`) and the share of
harmful rows above it, and between every two sets of one size the rows whose verdict differs.

No evaluation set is read. The states are the build's (``states.npy`` in ``--cache``, the file
``scripts/reply_guard_sources.py`` writes there; computed and saved now when it is missing,
about 8 minutes on 2 cores). Figures: docs/measurements.md, "Ten members".

    python scripts/probe_seed_spread.py --cache .isagi/reply-guard-sources
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
from pathlib import Path

import numpy as np

from isagi.config import DEFAULT_SYSTEM_PROMPT, load_settings
from isagi.data.safety import load_safety_corpus
from isagi.safety.build import Corpus, chat, read_layers, safety_states
from isagi.safety.probe import (
    DEFAULT_PROBE,
    BenignKinds,
    group_folds,
    logit_to_teh,
    out_of_fold,
    two_budget_threshold,
)


def states(cache: Path) -> np.ndarray:
    """The corpus's safety states, from ``cache`` or computed now (plain arrays, no pickle)."""
    path = cache / "states.npy"
    if path.exists():
        return np.load(path, allow_pickle=False)
    from isagi.engines import load_engine

    lm = load_engine(load_settings())
    rows = load_safety_corpus()
    X = safety_states(lm, [chat(DEFAULT_SYSTEM_PROMPT, r["text"]) for r in rows],
                      read_layers(lm.num_layers, lm.default_safety_layer))
    cache.mkdir(parents=True, exist_ok=True)
    np.save(path, X)
    return X


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", type=Path, required=True, help="folder holding (or to hold) states.npy")
    ap.add_argument("--base", type=int, default=5, help="members in one seed set (default 5)")
    ap.add_argument("--sets", type=int, default=6, help="disjoint seed sets fitted (default 6)")
    args = ap.parse_args()
    X = states(args.cache)
    corpus = Corpus.of(X, load_safety_corpus())
    blocks = [X.shape[1] // 3] * 3  # the build reads three layers side by side
    folds = group_folds(corpus.groups)
    spec = dataclasses.replace(DEFAULT_PROBE, members=args.base)
    oof = [out_of_fold(corpus.X, corpus.labels, blocks, folds, spec=dataclasses.replace(spec, seed=i * args.base))
           for i in range(args.sets)]
    y, benign = corpus.labels, corpus.labels == 0
    kinds = BenignKinds(ordinary=corpus.kinds.ordinary[benign], lookalike=corpus.kinds.lookalike[benign])
    print(f"{len(y)} calibration rows ({int(y.sum())} harmful), {args.sets} seed sets of {args.base} members")
    for times in (1, 2, 3):
        sets = [np.mean(oof[i:i + times], axis=0) for i in range(0, args.sets - times + 1, times)]
        verdicts, lines = [], []
        for logits in sets:
            threshold, cost = two_budget_threshold(logits[benign], kinds)
            verdicts.append(logits > threshold)
            lines.append(f"threshold {logit_to_teh(threshold):.2f} %, harmful above {np.mean(logits[y == 1] > threshold):.4f}, "
                         f"ordinary {cost['ordinary_fpr']:.4f}, look-alike {cost['lookalike_fpr']:.4f}")
        differ = [int((a != b).sum()) for a, b in itertools.combinations(verdicts, 2)]
        print(f"{times * args.base} members:")
        for line in lines:
            print("  " + line)
        print(f"  rows whose verdict differs between two seed sets: {differ}")


if __name__ == "__main__":
    main()
