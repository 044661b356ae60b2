"""Fitting the guards' probes, offline: a probe on the safety state written as a forbidden subspace.

Owns turning labelled states into a :class:`isagi.safety.runtime.Readout` (the form a turn
scores with), the folds that keep related rows together, and the threshold rule whose
false-positive budgets are stated over two kinds of benign request apart. The profile build
(:mod:`isagi.safety.build`) and ``isagi eval safety-cv`` call it; a turn imports none of it.

Why a probe over several layers: on the calibration corpus, held out by source and by
category, a probe over the safety read-out (``content+post``) of several layers side by side
flagged more harmful rows than one over the safety layer alone (``isagi eval safety-cv``;
docs/measurements.md keeps the grid). Why a small MLP: at the same two budgets, out of fold,
an average of five small ReLU networks flagged more harmful rows than the logistic probe
(:data:`DEFAULT_PROBE`). Either way the decision depends on the state only through a few
directions per layer (one for the logistic probe, the span of the networks' input weights for
the MLP): those directions are the forbidden subspace, and TEH is the probe's reading of the
state's coordinates in it (docs/architecture.md, Definitions).

The threshold rule. Benign requests come in two kinds that a single budget mixes badly:
*ordinary* requests (everyday tasks, incomplete or unsupported requests: nothing in them
looks like harm) and *look-alikes* (requests built or chosen to resemble harm: homonyms,
safety education, the twins a word away from a harmful request). A budget stated only over
look-alikes pushes the threshold up until the guard misses plain harm; one stated only over
ordinary requests lets it refuse most look-alikes. The threshold is the lowest that keeps
both, read off the rows' *out-of-fold* scores: a new ordinary request lands above it with
probability at most ``ordinary_budget`` and a new look-alike at most ``lookalike_budget``
(:func:`quantile_threshold`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from isagi.safety.runtime import Readout

# The logistic probes' L2 strength (scikit-learn's C: smaller is stronger): the reply guard's, and
# the prompt guard's when it is logistic. Chosen by `isagi eval safety-cv` on the calibration
# corpus only (docs/measurements.md, "The probe over several layers"): 0.01 and 0.03 tied on
# layers 12+18+24, 0.003 and 0.1 did worse.
DEFAULT_C = 0.03
# Product choices, stated, not fitted: at most 2 in 100 ordinary requests and 5 in 100 look-alikes
# refused, out of fold (each row scored by a fit that never saw it, nor its twins). Each sits below
# the product's target for its kind (3 % of ordinary tasks, 8 % of look-alikes refused) by about a
# third, for the shift from calibration rows to what people type.
ORDINARY_BUDGET = 0.02
LOOKALIKE_BUDGET = 0.05
K_FOLDS = 5


@dataclass(frozen=True)
class ProbeSpec:
    """What kind of probe reads the safety state, and how strongly it is regularised.

    ``logistic``: a standardised, class-balanced L2 logistic regression (strength ``C``).
    ``mlp``: ``members`` one-hidden-layer ReLU networks of ``hidden`` units each (L2 ``alpha``),
    each fitted on a class-balanced resample of the rows, their logits averaged: the average is
    itself one network of ``members × hidden`` units, so it reads as a :class:`Readout` too.
    Member k draws its resample and its initial weights with seed ``seed + k``.
    """

    kind: str = "logistic"
    C: float = 0.03
    alpha: float = 3.0
    hidden: int = 64
    members: int = 5
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("logistic", "mlp"):
            raise ValueError(f"unknown probe kind {self.kind!r}: use 'logistic' or 'mlp'")

    @property
    def label(self) -> str:
        if self.kind == "logistic":
            return f"logistic C={self.C:g}"
        return f"mlp {self.members}x{self.hidden} alpha={self.alpha:g}"

    @classmethod
    def parse(cls, text: str) -> ProbeSpec:
        """``logistic:C`` or ``mlp:HIDDEN`` (the default probe's members and alpha), as ``isagi eval safety-cv --probe`` takes them."""
        kind, _, value = text.strip().partition(":")
        try:
            if kind == "logistic":
                spec = cls("logistic", C=float(value or DEFAULT_C))
                ok = spec.C > 0
            elif kind == "mlp":
                spec = cls("mlp", hidden=int(value or DEFAULT_PROBE.hidden), members=DEFAULT_PROBE.members)
                ok = spec.hidden > 0
            else:
                ok = False
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(f"probe {text!r}: write logistic:C (e.g. logistic:0.03) or mlp:UNITS (e.g. mlp:8)")
        return spec

    def as_dict(self) -> dict[str, Any]:
        if self.kind == "logistic":
            return {"kind": "logistic", "C": self.C, "standardised": True, "class_weight": "balanced"}
        return {"kind": "mlp", "alpha": self.alpha, "hidden": self.hidden, "members": self.members, "seed": self.seed,
                "standardised": True, "class_balance": "resampled"}


# The prompt guard's probe, chosen on the calibration corpus only by its 5-fold figures
# (docs/measurements.md, "The MLP probe"): five networks of 8 ReLU units flagged more harmful rows
# out of fold than the logistic probe at the same two budgets, as many as networks of 32 or 64
# units did; 8 units keep the forbidden subspace small (40 directions per layer at five members), which is what
# Safe OGD projects out of a step. Said plainly: `isagi eval safety-cv`'s own rule (held out by
# source and by category) ranks the logistic probe on layers 12+18+24 above it (0.691 against
# 0.669); that grid finished after this choice was built and shipped (issue 36 stays open).
# Ten members, not five: out of fold on the calibration rows, two sets of five seeds gave 2.3 % of
# the rows (235 of 10,018 on average) different verdicts, and the threshold moved from 75.4 % to
# 77.7 % between six seed sets; with ten, 1.5-1.7 % and 75.8-76.0 % (docs/measurements.md,
# "Ten members"). A row's verdict should not be a draw of seeds. The cost: 80 directions per layer.
DEFAULT_PROBE = ProbeSpec("mlp", alpha=3.0, hidden=8, members=10)


def fit_readout(X: np.ndarray, y: np.ndarray, blocks: Sequence[int], *, C: float = DEFAULT_C,
                sample_weight: np.ndarray | None = None, spec: ProbeSpec | None = None) -> Readout:
    """A probe fitted on ``X`` (n, D), written as a :class:`Readout` (a forbidden subspace and a head).

    ``blocks`` are the widths of the parts of ``X`` (one per layer, or per half of an exchange
    state). ``spec`` (default: logistic at strength ``C``) says which probe (:class:`ProbeSpec`).
    """
    spec = spec or ProbeSpec("logistic", C=C)
    X = np.asarray(X, dtype=np.float64)
    y = np.asarray(y, dtype=int)
    if sum(blocks) != X.shape[1]:
        raise ValueError(f"blocks {list(blocks)} do not add up to the state's length {X.shape[1]}")
    if spec.kind == "mlp":
        if sample_weight is not None:
            raise ValueError("the MLP probe balances by resampling: it takes no sample weights")
        return _fit_mlp(X, y, blocks, spec)
    return _fit_logistic(X, y, blocks, spec.C, sample_weight)


def _fit_logistic(X: np.ndarray, y: np.ndarray, blocks: Sequence[int], C: float,
                  sample_weight: np.ndarray | None) -> Readout:
    """The linear probe: its raw-space weight vector is cut into ``blocks``, each part's direction
    becomes a unit column of ``Q`` and its norm that column's weight. The centre is the benign
    mean, the bias moved so the logit is unchanged."""
    from sklearn.linear_model import LogisticRegression

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


def _fit_mlp(X: np.ndarray, y: np.ndarray, blocks: Sequence[int], spec: ProbeSpec) -> Readout:
    """The averaged networks of ``spec`` as one network read through a forbidden subspace.

    Member k computes ``relu(z W_k + b_k)·v_k + e_k`` on the standardised state ``z = (x − μ)/σ``.
    In raw coordinates around the benign centre ``c`` its hidden layer is ``(x − c) W'_k + b'_k``
    with ``W'_k = W_k / σ`` and ``b'_k = b_k + (c − μ) W'_k``. The average of the members is the
    network with every member's hidden units side by side and ``v_k / members``. The state enters
    only through ``(x − c) W'``; each block of ``W'`` spans a subspace of that block, and ``Q``
    holds an orthonormal basis of each (block-diagonal), so ``W' = Q Qᵀ W'`` and the head reads the
    coordinates ``Qᵀ (x − c)`` through ``hidden = Qᵀ W'``.
    """
    from joblib import Parallel, cpu_count, delayed

    mean = X.mean(axis=0)
    scale = X.std(axis=0) + 1e-6
    Z = (X - mean) / scale
    centre = X[y == 0].mean(axis=0)
    # class balance by resampling: each class is drawn as often as the other
    w = np.where(y == 1, (y == 0).sum() / max(int((y == 1).sum()), 1), 1.0)
    # The members are independent (each draws with its own seed), so they are fitted side by side,
    # one process per core: the same networks in any order, in about 1/cores of the time.
    nets = Parallel(n_jobs=min(spec.members, cpu_count()))(
        delayed(_fit_member)(Z, y, w / w.sum(), spec, spec.seed + k) for k in range(spec.members))
    W, b, v, e = [], [], [], []
    for W0, b0, v0, e0 in nets:
        Wk = W0 / scale[:, None]
        W.append(Wk)
        b.append(b0 + (centre - mean) @ Wk)
        v.append(v0 / spec.members)
        e.append(e0 / spec.members)
    Wall = np.concatenate(W, axis=1)
    bases, start = [], 0
    for width in blocks:
        part = Wall[start:start + width]
        U, sv, _ = np.linalg.svd(part, full_matrices=False)
        bases.append(U[:, sv > 1e-9 * max(float(sv.max()), 1e-300)])
        start += width
    Q = np.zeros((X.shape[1], sum(B.shape[1] for B in bases)))
    row = col = 0
    for B in bases:
        Q[row:row + B.shape[0], col:col + B.shape[1]] = B
        row, col = row + B.shape[0], col + B.shape[1]
    return Readout(Q=Q, centre=centre, weights=np.concatenate(v), bias=float(sum(e)),
                   hidden=Q.T @ Wall, hidden_bias=np.concatenate(b))


def _fit_member(Z: np.ndarray, y: np.ndarray, p: np.ndarray, spec: ProbeSpec,
                seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """A member of the MLP probe on the standardised states ``Z``: a network fitted on rows drawn
    with the class-balancing probabilities ``p`` (``seed`` draws them and the initial weights).
    Returns its input weights, hidden biases, output weights and output bias."""
    import warnings

    from sklearn.exceptions import ConvergenceWarning
    from sklearn.neural_network import MLPClassifier

    rows = np.random.default_rng(seed).choice(len(Z), size=len(Z), p=p)
    net = MLPClassifier(hidden_layer_sizes=(spec.hidden,), alpha=spec.alpha, max_iter=300, random_state=seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        net.fit(Z[rows], y[rows])
    return net.coefs_[0], net.intercepts_[0], net.coefs_[1][:, 0], float(net.intercepts_[1][0])


def group_folds(groups: Sequence[Any], k: int = K_FOLDS, seed: int = 0) -> list[np.ndarray]:
    """``k`` folds of row indices that never split a group (a twin pair, or a row alone)."""
    names = sorted(set(groups), key=str)
    order = np.random.default_rng(seed).permutation(len(names))
    fold_of = {names[i]: n % k for n, i in enumerate(order)}
    assignment = np.array([fold_of[g] for g in groups])
    return [np.flatnonzero(assignment == f) for f in range(k)]


def out_of_fold(X: np.ndarray, y: np.ndarray, blocks: Sequence[int], folds: Sequence[np.ndarray], *,
                C: float = DEFAULT_C, spec: ProbeSpec | None = None) -> np.ndarray:
    """Each row's logit from a probe fitted on the other folds."""
    oof = np.zeros(len(X))
    every = np.arange(len(X))
    for test in folds:
        train = np.setdiff1d(every, test)
        oof[test] = fit_readout(X[train], y[train], blocks, C=C, spec=spec).logits(X[test])
    return oof


def quantile_threshold(benign: np.ndarray, budget: float) -> float:
    """The lowest threshold at which a *new* benign score, drawn as ``benign`` were, lands above it
    (is flagged: score > threshold) with probability at most ``budget``.

    With the n scores sorted, a new exchangeable score exceeds the k-th largest with probability
    k/(n+1) (ties aside): the threshold is the k-th largest for the largest k with
    k/(n+1) <= ``budget`` (split-conformal). The share of ``benign`` itself above it is lower,
    (k-1)/n. Taking the empirical quantile instead, at most ``budget``·n of the scores above,
    exceeds the budget on new scores by up to 1/(n+1), which matters for the reply guard's few
    hundred replies. When even the largest score gives 1/(n+1) > ``budget`` the largest is taken.
    """
    b = np.sort(np.asarray(benign, dtype=np.float64).ravel())
    if len(b) == 0:
        raise ValueError("no benign scores to set a threshold on")
    k = max(1, int(np.floor(budget * (len(b) + 1) + 1e-9)))
    return float(b[len(b) - min(k, len(b))])


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
    # "bound_by" names a budget among the float figures; the annotation is left as it is (a digested module (isagi.profile.DIGESTED_MODULES): its code, annotations too, keys the shipped profiles)
    return threshold, {**cost, "bound_by": max(parts, key=lambda n: parts[n])}  # type: ignore[dict-item]


def logit_to_teh(z: float) -> float:
    """TEH (percent) of a probe logit: ``100 σ(z)``."""
    return float(100.0 / (1.0 + np.exp(-np.clip(z, -60.0, 60.0))))
