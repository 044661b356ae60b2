"""Fitting the guards' probes, offline: a standardised logistic regression written as a forbidden subspace.

Owns turning labelled states into a :class:`isagi.safety.runtime.Readout` (the form a turn
scores with), the folds that keep related rows together, and the threshold rule whose
false-positive budgets are stated over two kinds of benign request apart. The profile build
(:mod:`isagi.safety.calibration`) and ``isagi eval safety-cv`` call it; a turn imports none of it.

Why a probe over several layers: on the calibration corpus, held out by source and by
category, a logistic regression over the safety read-out (``content+post``) of layers 12, 18
and 24 side by side flagged more harmful rows than one over layer 18 alone
(``isagi eval safety-cv``; docs/measurements.md keeps the grid), and on the public sets it
caught more harm than the Snipe subspace it replaced (the same page, "before" against
"shipped"). The probe is linear, so its decision depends on the state only through one
direction per layer: those directions are the forbidden subspace, and TEH is the probe's
reading of the state's coordinates in it (docs/architecture.md, Definitions).

The threshold rule. Benign requests come in two kinds that a single budget mixes badly:
*ordinary* requests (everyday tasks, incomplete or unsupported requests: nothing in them
looks like harm) and *look-alikes* (requests built or chosen to resemble harm: homonyms,
safety education, the twins a word away from a harmful request). A budget stated only over
look-alikes pushes the threshold up until the guard misses plain harm; one stated only over
ordinary requests lets it refuse most look-alikes. The threshold is the lowest that keeps
both: at most ``ordinary_budget`` of the ordinary and ``lookalike_budget`` of the look-alike
rows' *out-of-fold* scores above it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from isagi.safety.runtime import Readout

# The probe's L2 strength (scikit-learn's C: smaller is stronger), chosen by `isagi eval safety-cv`
# on the calibration corpus only (docs/measurements.md, "The probe over several layers"): 0.01 and
# 0.03 tied on layers 12+18+24, 0.003 and 0.1 did worse.
DEFAULT_C = 0.03
# Product choices, stated, not fitted: at most 2 in 100 ordinary requests and 5 in 100 look-alikes
# refused, out of fold (each row scored by a fit that never saw it, nor its twins). Each sits below
# the product's target for its kind (3 % of ordinary tasks, 8 % of look-alikes refused) by about a
# third, for the shift from calibration rows to what people type.
ORDINARY_BUDGET = 0.02
LOOKALIKE_BUDGET = 0.05
K_FOLDS = 5


def fit_readout(X: np.ndarray, y: np.ndarray, blocks: Sequence[int], *, C: float = DEFAULT_C,
                sample_weight: np.ndarray | None = None) -> Readout:
    """A standardised, class-balanced L2 logistic regression on ``X`` (n, D), as a :class:`Readout`.

    ``blocks`` are the widths of the parts of ``X`` (one per layer, or per half of an exchange
    state): the probe's raw-space weight vector is cut into them, each part's direction becomes a
    unit column of ``Q`` and its norm that column's weight. The centre is the benign mean, the
    bias moved so the logit is unchanged.
    """
    from sklearn.linear_model import LogisticRegression

    X = np.asarray(X, dtype=np.float64)
    y = np.asarray(y, dtype=int)
    if sum(blocks) != X.shape[1]:
        raise ValueError(f"blocks {list(blocks)} do not add up to the state's length {X.shape[1]}")
    mean = X.mean(axis=0)
    scale = X.std(axis=0) + 1e-6
    clf = LogisticRegression(C=C, class_weight="balanced", max_iter=3000, tol=1e-5)
    clf.fit((X - mean) / scale, y, sample_weight=sample_weight)
    u = clf.coef_[0] / scale  # the probe in raw coordinates: logit = u·(x − mean) + b
    centre = X[y == 0].mean(axis=0)
    bias = float(clf.intercept_[0] + u @ (centre - mean))
    Q = np.zeros((X.shape[1], len(blocks)))
    weights = np.zeros(len(blocks))
    start = 0
    for j, width in enumerate(blocks):
        part = u[start:start + width]
        norm = float(np.linalg.norm(part))
        if norm > 0:
            Q[start:start + width, j] = part / norm
        weights[j] = norm
        start += width
    return Readout(Q=Q, centre=centre, weights=weights, bias=bias)


def group_folds(groups: Sequence[Any], k: int = K_FOLDS, seed: int = 0) -> list[np.ndarray]:
    """``k`` folds of row indices that never split a group (a twin pair, or a row alone)."""
    names = sorted(set(groups), key=str)
    order = np.random.default_rng(seed).permutation(len(names))
    fold_of = {names[i]: n % k for n, i in enumerate(order)}
    assignment = np.array([fold_of[g] for g in groups])
    return [np.flatnonzero(assignment == f) for f in range(k)]


def out_of_fold(X: np.ndarray, y: np.ndarray, blocks: Sequence[int], folds: Sequence[np.ndarray], *,
                C: float = DEFAULT_C) -> np.ndarray:
    """Each row's logit from a probe fitted on the other folds."""
    oof = np.zeros(len(X))
    every = np.arange(len(X))
    for test in folds:
        train = np.setdiff1d(every, test)
        oof[test] = fit_readout(X[train], y[train], blocks, C=C).logits(X[test])
    return oof


def quantile_threshold(benign: np.ndarray, budget: float) -> float:
    """The lowest threshold with at most ``budget`` of ``benign`` above it (flagged: score > threshold)."""
    b = np.sort(np.asarray(benign, dtype=np.float64).ravel())
    if len(b) == 0:
        raise ValueError("no benign scores to set a threshold on")
    allowed = int(np.floor(budget * len(b) + 1e-9))
    return float(b[len(b) - 1 - allowed])


@dataclass(frozen=True)
class BenignKinds:
    """Which benign rows are ordinary requests and which are look-alikes (module docstring)."""

    ordinary: np.ndarray  # bool (n,)
    lookalike: np.ndarray  # bool (n,)


def two_budget_threshold(scores: np.ndarray, kinds: BenignKinds, *, ordinary_budget: float = ORDINARY_BUDGET,
                         lookalike_budget: float = LOOKALIKE_BUDGET) -> tuple[float, dict[str, float]]:
    """The lowest threshold within both budgets, and what each kind costs at it."""
    scores = np.asarray(scores, dtype=np.float64)
    parts = {}
    if kinds.ordinary.any():
        parts["ordinary"] = quantile_threshold(scores[kinds.ordinary], ordinary_budget)
    if kinds.lookalike.any():
        parts["lookalike"] = quantile_threshold(scores[kinds.lookalike], lookalike_budget)
    if not parts:
        raise ValueError("no benign rows to set a threshold on")
    threshold = max(parts.values())
    cost = {f"{name}_fpr": float((scores[mask] > threshold).mean())
            for name, mask in (("ordinary", kinds.ordinary), ("lookalike", kinds.lookalike)) if mask.any()}
    return threshold, {**cost, "bound_by": max(parts, key=lambda n: parts[n])}


def logit_to_teh(z: float) -> float:
    """TEH (percent) of a probe logit: ``100 σ(z)``."""
    return float(100.0 / (1.0 + np.exp(-np.clip(z, -60.0, 60.0))))
