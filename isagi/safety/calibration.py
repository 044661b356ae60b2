"""Snipe, the construction the prompt guard used before its probe (issue 36), with its
cross-validation; and the ROC helpers the profile build uses (:func:`roc_auc`, :func:`roc_sweep`,
:func:`thin_roc`) and Safe OGD's window margin (``REPLY_MARGIN``).

No turn and no build fits Snipe any more (:mod:`isagi.safety.build` fits the probe); it stays
with its tests as the documented earlier construction, whose held-out figures
docs/measurements.md sets beside the probe's ("The probe over several layers", the "before"
row). Removing it changes the profile key's code digest: do it with a re-key
(isagi/profiles/README.md).

Why the construction is not the research code's: that code took the top
|mean difference| coordinates of an SVD basis of 10 prompts; on held-out
prompts it separates harmful from benign barely better than chance. Snipe
here learns directions instead:

1. Per-category probing: for each category a shrinkage-regularised LDA
   direction ``w_k ∝ (Σ + λ·tr(Σ)/d·I)⁻¹ (μ_harm,k − μ_benign)`` with the pooled
   within-class covariance ``Σ`` of the calibration states; plus one pooled
   direction (all harmful vs all benign). Each is scored by cross-validated
   ROC AUC on its category.
2. Greedy selection under an explicit benign budget: directions are added
   (Gram–Schmidt against those chosen) in the order that most improves the
   training ROC AUC of TEH; a direction is admissible only while the total
   share of benign variance the subspace captures,
   ``mean_benign ‖Qᵀ(h − μ_b)‖² / ‖h − μ_b‖²``, stays within ``benign_budget``.
   A direction that carries ordinary content would both raise false positives
   and make ``P_safe`` remove ordinary meaning; the budget forbids it.
3. The centre: a ratio of norms is only monotone in the probe score when the
   centre sits on the benign side of the decision boundary. ``c = μ_b − Q t``
   where ``t_i = offset · σ_i`` (σ_i the benign spread along column i, the
   columns signed so harmful states project positively). ``offset`` is a
   hyper-parameter; cross-validation on the calibration set chose 1 (see
   the table at ``DEFAULT_OFFSET``). Benign prompts far on the benign side of
   the probe otherwise get a high TEH from a norm that ignores the sign.

Thresholds say what they cost. The prompt threshold lets ``FPR_BUDGET`` of the
borderline benign calibration prompts' *out-of-fold* TEH lie above it (5-fold
CV: each prompt scored by a fit that never saw it), so the budget is a
statement about prompts the fit has not seen. The borderline rows are the hard
negatives (requests that look alarming and should be answered); the everyday
instruction tasks of the calibration set (``kind`` ``ordinary_task``: "Write a
poem ...", "Summarize this email: ...") are fitted on, so the guard learns
that the imperative form of "Write a script that ..." is not the harm, but
they are left out of the budget: counted in it, a few hundred easy rows would
pull the threshold down until more than the budget of borderline prompts is
refused. ``details["cv"]`` reports the TPR at 1 % and at 5 % FPR and the share
of everyday tasks over the threshold, out of fold.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from isagi.safety.runtime import (
    _EPS,
    teh,
)

# Snipe's hyper-parameters, chosen by an earlier cross-validation on the project's own rows
# (docs/measurements.md, "Safety hyper-parameters"); the baseline keeps them.
DEFAULT_SHRINKAGE = 0.2
DEFAULT_OFFSET = 1.0
DEFAULT_BENIGN_BUDGET = 0.05
DEFAULT_MAX_DIMS = 4
FPR_BUDGET = 0.02  # the baseline's threshold: this share of the look-alike benign rows above it
# Safe OGD's window threshold: this factor above the largest check point of any benign reply
REPLY_MARGIN = 1.05


# --------------------------------------------------------------------------- ROC


def roc_auc(scores_pos: np.ndarray, scores_neg: np.ndarray) -> float:
    """P(score_pos > score_neg) + ½ P(tie) (Mann–Whitney)."""
    pos = np.asarray(scores_pos, dtype=np.float64).ravel()
    neg = np.asarray(scores_neg, dtype=np.float64).ravel()
    if len(pos) == 0 or len(neg) == 0:
        return float("nan")
    from scipy.stats import rankdata

    ranks = rankdata(np.concatenate([pos, neg]))
    return float((ranks[: len(pos)].sum() - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg)))


def roc_sweep(scores_harmful: np.ndarray, scores_benign: np.ndarray) -> dict[str, Any]:
    """ROC curve (flagged means score > threshold) and the chosen threshold.

    The threshold is the one with the highest F1 among thresholds that flag no
    benign score; candidates are every distinct score (a threshold equal to a
    score does not flag it) plus one just below the lowest score.
    """
    pos = np.asarray(scores_harmful, dtype=np.float64).ravel()
    neg = np.asarray(scores_benign, dtype=np.float64).ravel()
    allv = np.unique(np.concatenate([pos, neg]))
    cands = np.concatenate([[allv[0] - 1e-9 if len(allv) else 0.0], allv])[::-1]  # high -> low
    tpr = np.array([(pos > t).mean() if len(pos) else 0.0 for t in cands])
    fpr = np.array([(neg > t).mean() if len(neg) else 0.0 for t in cands])
    tp = tpr * len(pos)
    fp = fpr * len(neg)
    fn = len(pos) - tp
    f1 = np.where(tp > 0, 2 * tp / np.maximum(2 * tp + fp + fn, _EPS), 0.0)
    zero_fp = fp == 0
    if zero_fp.any():
        idx = np.flatnonzero(zero_fp)
        best = idx[np.argmax(f1[idx])]  # argmax takes the highest threshold among ties
    else:
        best = 0
    return {
        "thresholds": cands.tolist(),
        "tpr": tpr.tolist(),
        "fpr": fpr.tolist(),
        "auc": roc_auc(pos, neg),
        "threshold": float(cands[best]),
        "f1": float(f1[best]),
        "tpr_at_threshold": float(tpr[best]),
        "fpr_at_threshold": float(fpr[best]),
    }


def thin_roc(roc: dict[str, Any], points: int = 200) -> dict[str, Any]:
    """The same ROC with at most ``points`` points kept (for storing in the profile)."""
    n = len(roc["thresholds"])
    if n <= points:
        return dict(roc)
    keep = np.unique(np.linspace(0, n - 1, points).round().astype(int))
    out = dict(roc)
    for key in ("thresholds", "tpr", "fpr"):
        out[key] = [roc[key][i] for i in keep]
    return out


# --------------------------------------------------------------------------- Snipe


def _pooled_cov(groups: Sequence[np.ndarray]) -> np.ndarray:
    centred = [g - g.mean(axis=0) for g in groups if len(g) > 1]
    X = np.concatenate(centred)
    return X.T @ X / max(len(X) - len(centred), 1)


def _shrunk_inverse_apply(cov: np.ndarray, shrinkage: float, vecs: np.ndarray) -> np.ndarray:
    d = cov.shape[0]
    target = np.trace(cov) / d
    S = (1.0 - shrinkage) * cov + shrinkage * target * np.eye(d)
    return np.linalg.solve(S, vecs)


def _unit(v: np.ndarray) -> np.ndarray:
    return v / max(float(np.linalg.norm(v)), _EPS)


def _benign_energy(Q: np.ndarray, Xb: np.ndarray) -> float:
    """Mean share of benign variance (about the benign mean) that span(Q) captures."""
    if Q.shape[1] == 0:
        return 0.0
    num = np.sum((Xb @ Q) ** 2, axis=1)
    den = np.maximum(np.sum(Xb**2, axis=1), _EPS)
    return float(np.mean(num / den))


def _signed_centre(Q: np.ndarray, mu_b: np.ndarray, Hh: np.ndarray, Hb: np.ndarray, offset: float) -> tuple[np.ndarray, np.ndarray]:
    """Flip columns so harmful states project positively; centre = μ_b − Q·(offset·σ_b)."""
    Q = Q.copy()
    sign = np.sign((Hh.mean(axis=0) - mu_b) @ Q)
    sign[sign == 0] = 1.0
    Q = Q * sign
    sigma = np.std((Hb - mu_b) @ Q, axis=0)
    centre = mu_b - Q @ (offset * sigma)
    return Q, centre


def snipe(
    H_harm_by_cat: dict[str, np.ndarray],
    H_benign_by_cat: dict[str, np.ndarray],
    *,
    benign_budget: float = DEFAULT_BENIGN_BUDGET,
    max_dims: int = DEFAULT_MAX_DIMS,
    shrinkage: float = DEFAULT_SHRINKAGE,
    offset: float = DEFAULT_OFFSET,
) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """Per-category probing + greedy selection under a benign budget.

    Returns ``(Q, centre, details)``: ``Q`` (d, m) orthonormal, ``centre`` (d,),
    and ``details`` with the candidate directions, their in-sample AUCs, the
    order of selection, the benign energy each step used and the budget.
    """
    cats = [c for c in H_harm_by_cat if len(H_harm_by_cat[c])]
    Hh_all = np.concatenate([np.asarray(H_harm_by_cat[c], dtype=np.float64) for c in cats])
    Hb_all = np.concatenate([np.asarray(v, dtype=np.float64) for v in H_benign_by_cat.values() if len(v)])
    mu_b = Hb_all.mean(axis=0)
    Xb = Hb_all - mu_b
    cov = _pooled_cov([np.asarray(H_harm_by_cat[c], dtype=np.float64) for c in cats] + [Hb_all])
    diffs = np.stack([np.asarray(H_harm_by_cat[c], dtype=np.float64).mean(axis=0) - mu_b for c in cats]
                     + [Hh_all.mean(axis=0) - mu_b])
    W = _shrunk_inverse_apply(cov, shrinkage, diffs.T).T
    names = [*cats, "pooled"]
    cand = np.stack([_unit(w) for w in W])
    cand_auc = {}
    for name, w, in zip(names, cand, strict=True):
        Hh = Hh_all if name == "pooled" else np.asarray(H_harm_by_cat[name], dtype=np.float64)
        cand_auc[name] = roc_auc(Hh @ w, Hb_all @ w)

    d = Hb_all.shape[1]
    Q = np.zeros((d, 0))
    chosen: list[dict[str, Any]] = []
    current_auc = 0.5
    remaining = list(range(len(names)))
    while remaining and Q.shape[1] < max_dims:
        best: tuple[float, int, np.ndarray, float] | None = None
        for i in remaining:
            q = cand[i] - Q @ (Q.T @ cand[i])
            norm = float(np.linalg.norm(q))
            if norm < 1e-6:
                continue
            Qn = np.column_stack([Q, q / norm])
            energy = _benign_energy(Qn, Xb)
            if energy > benign_budget:
                continue
            Qs, c = _signed_centre(Qn, mu_b, Hh_all, Hb_all, offset)
            # teh of rows is an array (its annotation also allows one row's float; a digested module (isagi.profile.DIGESTED_MODULES): its code, annotations too, keys the shipped profiles)
            auc = roc_auc(teh((Qs, c), Hh_all), teh((Qs, c), Hb_all))  # type: ignore[arg-type]
            if best is None or auc > best[0]:
                best = (auc, i, Qn, energy)
        if best is None or (Q.shape[1] > 0 and best[0] <= current_auc + 1e-4):
            break
        current_auc, i, Q, energy = best
        remaining.remove(i)
        chosen.append({"direction": names[i], "train_auc": current_auc, "benign_energy": energy})
    if Q.shape[1] == 0:  # nothing fits the budget: fall back to the single best probe, reported as such
        i = int(np.argmax([cand_auc[n] for n in names]))
        Q = cand[i][:, None].copy()
        chosen.append({"direction": names[i], "train_auc": cand_auc[names[i]],
                       "benign_energy": _benign_energy(Q, Xb), "over_budget": True})
    Q, centre = _signed_centre(Q, mu_b, Hh_all, Hb_all, offset)
    details = {
        "candidates": names,
        "candidate_auc": cand_auc,
        "selected": chosen,
        "benign_budget": benign_budget,
        "benign_energy_used": _benign_energy(Q, Xb),
        "max_dims": max_dims,
        "shrinkage": shrinkage,
        "offset": offset,
        "category_directions": cand[: len(cats)],
        "category_bias": -(cand[: len(cats)] @ mu_b),
        "categories": cats,
    }
    return Q, centre, details


def probe_category_bias(directions: np.ndarray, H_harm_by_cat: dict[str, np.ndarray], cats: list[str]) -> np.ndarray:
    """Offsets that put each category's harmful mean at score 0 relative to the others.

    ``category_of`` compares probes of different categories; centring each
    probe on its own category's harmful mean makes their scores comparable.
    """
    return np.array([-(directions[i] @ np.asarray(H_harm_by_cat[c], dtype=np.float64).mean(axis=0))
                     for i, c in enumerate(cats)])


# --------------------------------------------------------------------------- cross-validation


def _folds(n: int, k: int, rng: np.random.Generator) -> list[np.ndarray]:
    return np.array_split(rng.permutation(n), k)


def budget_threshold(benign_scores: np.ndarray, budget: float) -> float:
    """The lowest threshold that flags at most ``budget`` of ``benign_scores`` (flagged: score > threshold)."""
    b = np.sort(np.asarray(benign_scores, dtype=np.float64).ravel())
    if len(b) == 0:
        raise ValueError("no benign scores to set a threshold on")
    allowed = int(np.floor(budget * len(b) + 1e-9))  # benign scores that may lie above the threshold
    return float(b[len(b) - 1 - allowed])


def tpr_at_fpr(scores_pos: np.ndarray, scores_neg: np.ndarray, fpr: float) -> float:
    """Share of ``scores_pos`` flagged at the threshold that flags at most ``fpr`` of ``scores_neg``."""
    return float((np.asarray(scores_pos) > budget_threshold(scores_neg, fpr)).mean())


def _counted(labels: np.ndarray, ordinary: np.ndarray | None) -> np.ndarray:
    """The benign rows an FPR budget is stated over: all benign rows but the ordinary tasks."""
    benign = np.asarray(labels) == 0
    return benign if ordinary is None else benign & ~np.asarray(ordinary, dtype=bool)


def _held_out(H: np.ndarray, labels: np.ndarray, cats: np.ndarray, test: np.ndarray, params: dict[str, Any],
              budget: float, counted: np.ndarray) -> tuple[np.ndarray, float]:
    """Fit Snipe on all rows but ``test``: TEH of the ``test`` rows, and the threshold at ``budget`` of the
    training rows' ``counted`` benign scores."""
    train = np.setdiff1d(np.arange(len(H)), test)
    Q, c, _ = snipe(*split_by_category(H[train], labels[train], cats[train]), **params)
    # teh of rows is an array (its annotation also allows one row's float; a digested module (isagi.profile.DIGESTED_MODULES): its code, annotations too, keys the shipped profiles)
    threshold = budget_threshold(teh((Q, c), H[train][counted[train]]), budget)  # type: ignore[arg-type]
    return teh((Q, c), H[test]), threshold  # type: ignore[return-value]


def _pooled_report(H: np.ndarray, labels: np.ndarray, cats: np.ndarray, folds: list[np.ndarray],
                   params: dict[str, Any], budget: float,
                   ordinary: np.ndarray | None) -> tuple[dict[str, Any], np.ndarray, list[float]]:
    """Out-of-fold TEH of every row (each scored by a fit that never saw it) and what it says.

    Every figure is against the benign rows the budget counts (the borderline ones); the
    ordinary tasks, when ``ordinary`` marks some, are reported apart (``ordinary_fpr``)."""
    harm = labels == 1
    counted = _counted(labels, ordinary)
    oof = np.zeros(len(H))
    flagged = np.zeros(len(H), dtype=bool)
    thresholds = []
    for test in folds:
        scores, threshold = _held_out(H, labels, cats, test, params, budget, counted)
        oof[test] = scores
        flagged[test] = scores > threshold
        thresholds.append(threshold)
    report = {
        "auc": roc_auc(oof[harm], oof[counted]),
        "tpr_at_1pct_fpr": tpr_at_fpr(oof[harm], oof[counted], 0.01),
        "tpr_at_5pct_fpr": tpr_at_fpr(oof[harm], oof[counted], 0.05),
        # each fold's own threshold (``budget`` of its training rows' benign scores), on its held-out rows
        "tpr": float(flagged[harm].mean()),
        "fpr": float(flagged[counted].mean()),
        "budget": budget,
    }
    extra = (labels == 0) & ~counted
    if extra.any():
        report["ordinary_fpr"] = float(flagged[extra].mean())
    return report, oof, thresholds


def cross_validate(
    H: np.ndarray,
    labels: np.ndarray,
    cats: np.ndarray,
    *,
    k: int = 5,
    seed: int = 0,
    budget: float = 0.0,
    ordinary: np.ndarray | None = None,
    **params: Any,
) -> dict[str, Any]:
    """Unstratified k-fold CV of Snipe+TEH on calibration states.

    Pooled over the folds' held-out rows: ROC AUC, TPR at 1 % and at 5 % FPR,
    and TPR/FPR at each fold's threshold set at ``budget`` on its training
    rows' benign scores. ``ordinary`` marks the benign everyday tasks, which
    are fitted on but left out of the budget and the figures (``ordinary_fpr``
    reports them apart). ``oof`` holds every row's out-of-fold TEH.
    """
    rng = np.random.default_rng(seed)
    report, oof, _ = _pooled_report(H, labels, cats, _folds(len(H), k, rng), params, budget, ordinary)
    return {**report, "folds": k, "oof": oof}


def leave_one_category_out(H: np.ndarray, labels: np.ndarray, cats: np.ndarray, *, budget: float = 0.0,
                           ordinary: np.ndarray | None = None, **params: Any) -> dict[str, Any]:
    """Train on all categories but one, test on that one, for each category.

    A harder test than k-fold: the held-out category's kind of harm was never
    seen in training, as with new prompts in use. ``auc`` is the mean over
    categories of the held-out AUC (each category's harmful against its own
    benign rows); ``pooled_auc``, TPR at 1 %/5 % FPR and TPR/FPR at the
    training rows' ``budget`` threshold pool every held-out row (``ordinary`` as in
    :func:`cross_validate`).
    """
    names = sorted(set(cats.tolist()))
    folds = [np.flatnonzero(cats == c) for c in names]
    report, oof, thresholds = _pooled_report(H, labels, cats, folds, params, budget, ordinary)
    harm = labels == 1
    counted = _counted(labels, ordinary)
    per = {}
    for c, test, threshold in zip(names, folds, thresholds, strict=True):
        s_h, s_b = oof[test][harm[test]], oof[test][counted[test]]
        per[c] = {"auc": roc_auc(s_h, s_b), "tpr": float((s_h > threshold).mean()),
                  "fpr": float((s_b > threshold).mean()) if len(s_b) else None}
    # an "auc" is always a float (only "fpr" may be None; a digested module (isagi.profile.DIGESTED_MODULES): its code, annotations too, keys the shipped profiles)
    aucs = [v["auc"] for v in per.values() if not np.isnan(v["auc"])]  # type: ignore[arg-type]
    return {**report, "pooled_auc": report["auc"], "auc": float(np.mean(aucs)), "per_category": per}  # type: ignore[arg-type]


def split_by_category(H: np.ndarray, labels: np.ndarray, cats: np.ndarray) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(harmful by category, benign by category) from flat arrays (label 1 = harmful)."""
    harm: dict[str, np.ndarray] = {}
    ben: dict[str, np.ndarray] = {}
    for c in sorted(set(cats.tolist())):
        m = cats == c
        if (m & (labels == 1)).any():
            harm[c] = H[m & (labels == 1)]
        if (m & (labels == 0)).any():
            ben[c] = H[m & (labels == 0)]
    return harm, ben



def calibrate_reply_threshold(benign_reply_scores: Sequence[np.ndarray], prompt_threshold: float) -> tuple[float, dict[str, Any]]:
    """Window threshold (Safe OGD's check of steered replies; the reply guard of a profile fitted
    without an exchange guard): above every check-point TEH of the benign calibration replies.

    ``REPLY_MARGIN`` × the largest benign check-point score, and never below the
    prompt threshold: an ordinary reply must never be withheld on the data we
    have, and a reply is held to at least the prompt's standard.
    """
    flat = np.concatenate([np.asarray(s, dtype=np.float64) for s in benign_reply_scores if len(s)]) if benign_reply_scores else np.zeros(0)
    top = float(flat.max()) if len(flat) else 0.0
    value = max(prompt_threshold, top * REPLY_MARGIN)
    return value, {"benign_reply_max": top, "benign_reply_checks": int(len(flat)), "margin": REPLY_MARGIN}
