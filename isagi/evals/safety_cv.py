"""``isagi eval safety-cv``: the calibration-only choice of the prompt probe's layers and kind.

Owns the evidence behind the shipped defaults (:data:`isagi.safety.build.READ_DEPTHS`,
:data:`isagi.safety.probe.DEFAULT_PROBE`). It reads only the calibration corpus
(:func:`isagi.data.safety.load_safety_corpus`), never the evaluation sets.

Every setting (a set of read-out layers side by side × a probe, :class:`ProbeSpec`: logistic
at an L2 strength, or the averaged small MLPs) is measured three ways, each row scored by a
probe that never saw it:

- ``kfold``: 5 folds that keep each twin pair whole; the threshold is the two-budget rule
  (:func:`isagi.safety.probe.two_budget_threshold`) on the pooled out-of-fold logits, as the
  profile build sets it;
- ``loso``: leave one *source* out (the project's rows, HarmBench, the twins, CatQA, HarmfulQA,
  CoCoNot): the probe never saw a row of that source, the register of another corpus;
- ``loco``: leave one *category* out (twin pairs stay whole: a pair has one category).

In ``loso`` and ``loco`` the threshold of each held-out group comes from its training rows alone
(the two-budget rule on their own out-of-fold logits, 3 inner folds), so the figures are what a
profile fitted without that source or category would do on it. Per held-out group the report
gives the share of its rows on the right side of the threshold (harmful flagged, benign passed).

``best``: among the settings whose ``kfold`` ordinary and look-alike costs stay within the
budgets plus one point, those whose mean of the ``loso`` and ``loco`` harmful shares flagged is
within :data:`TIE` of the highest; of them the one reading fewest layers, then the highest mean.
(A difference below half a point is within what another seed of the folds moves.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import product
from typing import Any

import numpy as np

from isagi.safety.build import Corpus
from isagi.safety.calibration import roc_auc
from isagi.safety.probe import (
    LOOKALIKE_BUDGET,
    ORDINARY_BUDGET,
    BenignKinds,
    ProbeSpec,
    fit_readout,
    group_folds,
    out_of_fold,
    two_budget_threshold,
)

TIE = 0.005


def _subset(corpus: Corpus, keep: np.ndarray, X: np.ndarray) -> Corpus:
    return Corpus(X=X[keep], labels=corpus.labels[keep], cats=corpus.cats[keep],
                  groups=[g for g, k in zip(corpus.groups, keep, strict=True) if k], sources=corpus.sources[keep],
                  kinds=BenignKinds(ordinary=corpus.kinds.ordinary[keep], lookalike=corpus.kinds.lookalike[keep]))


def _held_out(corpus: Corpus, X: np.ndarray, blocks: list[int], by: np.ndarray, spec: ProbeSpec,
              budgets: tuple[float, float]) -> dict[str, Any]:
    """Leave each value of ``by`` out in turn: the share of its rows on the right side."""
    out: dict[str, Any] = {}
    for name in sorted(set(by.tolist())):
        test = by == name
        train = _subset(corpus, ~test, X)
        inner = out_of_fold(train.X, train.labels, blocks, group_folds(train.groups, 3), spec=spec)
        threshold, _ = two_budget_threshold(inner, train.kinds, ordinary_budget=budgets[0], lookalike_budget=budgets[1])
        z = fit_readout(train.X, train.labels, blocks, spec=spec).logits(X[test])
        y = corpus.labels[test]
        row: dict[str, Any] = {"n": int(test.sum())}
        if (y == 1).any():
            row["harmful_flagged"] = round(float((z[y == 1] > threshold).mean()), 4)
        if (y == 0).any():
            row["benign_passed"] = round(float((z[y == 0] <= threshold).mean()), 4)
        out[str(name)] = row
    return out


def measure(corpus: Corpus, states: dict[int, np.ndarray], layers: Sequence[int], spec: ProbeSpec, *,
            budgets: tuple[float, float] = (ORDINARY_BUDGET, LOOKALIKE_BUDGET), held_out: bool = True) -> dict[str, Any]:
    """The three cross-validations of one setting (module docstring)."""
    X = np.concatenate([states[layer] for layer in layers], axis=1).astype(np.float64)
    blocks = [states[layer].shape[1] for layer in layers]
    y = corpus.labels
    oof = out_of_fold(X, y, blocks, group_folds(corpus.groups), spec=spec)
    threshold, cost = two_budget_threshold(oof, corpus.kinds, ordinary_budget=budgets[0], lookalike_budget=budgets[1])
    row: dict[str, Any] = {"layers": "+".join(map(str, layers)), "probe": spec.label,
                           "kfold_auc": round(roc_auc(oof[y == 1], oof[y == 0]), 4),
                           "kfold_tpr": round(float((oof[y == 1] > threshold).mean()), 4),
                           "kfold_ordinary_fpr": round(cost.get("ordinary_fpr", 0.0), 4),
                           "kfold_lookalike_fpr": round(cost.get("lookalike_fpr", 0.0), 4),
                           "kfold_by_category": {
                               str(c): round(float(np.where(y == 1, oof > threshold, oof <= threshold)[corpus.cats == c].mean()), 4)
                               for c in sorted(set(corpus.cats.tolist()))}}
    if held_out:
        row["loso"] = _held_out(corpus, X, blocks, corpus.sources, spec, budgets)
        row["loco"] = _held_out(corpus, X, blocks, corpus.cats, spec, budgets)
        for key in ("loso", "loco"):
            flagged = [v["harmful_flagged"] for v in row[key].values() if "harmful_flagged" in v]
            passed = [v["benign_passed"] for v in row[key].values() if "benign_passed" in v]
            row[f"{key}_harmful_flagged"] = round(float(np.mean(flagged)), 4)
            row[f"{key}_benign_passed"] = round(float(np.mean(passed)), 4)
    return row


def grid(corpus: Corpus, states: dict[int, np.ndarray], layer_sets: list[list[int]], specs: list[ProbeSpec], *,
         progress: Callable[[str, int, int], None] | None = None) -> dict[str, Any]:
    """:func:`measure` for every layer set × probe, and the best row (module docstring)."""
    rows = []
    settings = list(product(layer_sets, specs))
    for i, (layers, spec) in enumerate(settings):
        if progress:
            progress("Cross-validating the probe settings", i, len(settings))
        rows.append(measure(corpus, states, layers, spec))
    if progress:
        progress("Cross-validating the probe settings", len(settings), len(settings))

    def within(r: dict[str, Any]) -> bool:
        return r["kfold_ordinary_fpr"] <= ORDINARY_BUDGET + 0.01 and r["kfold_lookalike_fpr"] <= LOOKALIKE_BUDGET + 0.01

    def score(r: dict[str, Any]) -> float:
        return (r["loso_harmful_flagged"] + r["loco_harmful_flagged"]) / 2

    usable = [r for r in rows if within(r)] or rows
    top = max(score(r) for r in usable)
    near = [r for r in usable if score(r) >= top - TIE]
    best = min(near, key=lambda r: (r["layers"].count("+"), -score(r)))
    return {"rows": rows, "best": best,
            "budgets": {"ordinary": ORDINARY_BUDGET, "lookalike": LOOKALIKE_BUDGET}}


def run(lm: Any, *, system_prompt: str, layer_sets: list[list[int]], specs: list[ProbeSpec],
        progress: Callable[[str, int, int], None] | None = None) -> dict[str, Any]:
    """The corpus's states at every layer the sets name (one forward pass per prompt reads at most
    four layers), then :func:`grid`."""
    from isagi.console.progress import counter
    from isagi.data.safety import load_safety_corpus
    from isagi.manifold.pooling import prompt_hidden_states_at
    from isagi.safety.build import chat
    from isagi.safety.runtime import SAFETY_POOL

    rows = load_safety_corpus()
    chats = [chat(system_prompt, r["text"]) for r in rows]
    wanted = sorted({layer for group in layer_sets for layer in group})
    states: dict[int, np.ndarray] = {}
    for start in range(0, len(wanted), 4):
        part = wanted[start:start + 4]
        tick = counter(progress, f"Calibration prompts at layers {', '.join(map(str, part))}", len(chats))
        states.update(prompt_hidden_states_at(lm, chats, part, pool=SAFETY_POOL, progress=tick))
    corpus = Corpus.of(np.zeros((len(rows), 1)), rows)
    out = grid(corpus, states, layer_sets, specs, progress=progress)
    out["n_calibration"] = len(rows)
    return out
