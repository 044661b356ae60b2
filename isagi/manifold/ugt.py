"""UGT basis: the k-dimensional coordinates every query is reduced to.

This module owns the linear algebra of the basis (docs/architecture.md, Definitions): the centred SVD
of calibration hidden states, projection ``x = Bᵀ(h − μ)``, knowledge-zone
centroids and routing, a zone-separation score, and an optional Riemannian
refinement of the basis on the Stiefel manifold. It is pure numpy: the model
code (capturing hidden states) and the profile cache live elsewhere.

Two rules the research code broke and this module keeps:

* the basis is never padded with random columns — ``k`` is reduced to the
  numerical rank of the centred data, with a warning;
* every returned basis has orthonormal columns (tests check ``BᵀB = I``).
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)

__all__ = [
    "Basis",
    "Zones",
    "fit_basis",
    "project",
    "fit_zones",
    "route",
    "zone_separation",
    "refine_basis",
]


@dataclass
class Basis:
    """An orthonormal basis of the principal directions of hidden states.

    ``B`` is ``(d, k)`` float32 with orthonormal columns, ``mu`` the ``(d,)``
    mean subtracted before projecting, ``singular_values`` the ``k`` singular
    values of the centred data along the columns of ``B`` (descending), and
    ``explained`` the share of the centred data's total variance that the
    ``k`` columns capture (0..1).
    """

    B: np.ndarray
    mu: np.ndarray
    singular_values: np.ndarray
    explained: float

    @property
    def d(self) -> int:
        return int(self.B.shape[0])

    @property
    def k(self) -> int:
        return int(self.B.shape[1])


@dataclass
class Zones:
    """Knowledge-zone centroids in UGT coordinates: ``centroids[i]`` is zone ``names[i]``."""

    names: list[str]
    centroids: np.ndarray


def _as_matrix(H: np.ndarray, name: str = "H") -> np.ndarray:
    H = np.asarray(H)
    if H.ndim != 2:
        raise ValueError(f"{name} must be a 2-D array (n, d), got shape {H.shape}")
    if H.shape[0] < 2:
        raise ValueError(f"{name} needs at least 2 rows to fit a centred basis, got {H.shape[0]}")
    if not np.all(np.isfinite(H)):
        raise ValueError(f"{name} contains NaN or infinite values")
    return H


def _numerical_rank(s: np.ndarray, shape: tuple[int, int], dtype: np.dtype) -> int:
    """Rank as numpy's ``matrix_rank`` defines it, with the input's precision.

    Tolerance ``s_max · max(n, d) · eps`` where ``eps`` is the machine epsilon of
    the *input* dtype (float32 hidden states carry float32 rounding noise).
    """
    if s.size == 0 or s[0] == 0.0:
        return 0
    eps = np.finfo(dtype).eps if np.issubdtype(dtype, np.floating) else np.finfo(np.float64).eps
    tol = s[0] * max(shape) * eps
    return int(np.count_nonzero(s > tol))


def _fix_signs(B: np.ndarray) -> np.ndarray:
    """Deterministic column signs: the largest-magnitude entry of each column is positive."""
    idx = np.argmax(np.abs(B), axis=0)
    signs = np.sign(B[idx, np.arange(B.shape[1])])
    signs[signs == 0] = 1.0
    return B * signs


def fit_basis(H: np.ndarray, k: int) -> Basis:
    """Fit the UGT basis: top-``k`` principal directions of the centred rows of ``H``.

    ``H`` is ``(n, d)`` (one hidden state per row). The columns of ``B`` are the
    top left singular vectors of the centred ``Hᵀ`` (equivalently the right
    singular vectors of the centred ``H``). If the centred data has numerical
    rank ``r < k`` the basis has ``r`` columns, never random padding, and a
    warning says so.
    """
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    H = _as_matrix(H)
    in_dtype = H.dtype if np.issubdtype(H.dtype, np.floating) else np.dtype(np.float64)
    H64 = H.astype(np.float64, copy=False)
    mu = H64.mean(axis=0)
    Hc = H64 - mu
    _, s, Vt = np.linalg.svd(Hc, full_matrices=False)
    rank = _numerical_rank(s, Hc.shape, in_dtype)
    if rank == 0:
        raise ValueError("the centred data is all zeros: every row of H is the same vector")
    k_eff = min(k, rank)
    if k_eff < k:
        msg = (
            f"UGT basis reduced from k={k} to k={k_eff}: the centred data has numerical "
            f"rank {rank} (n={H.shape[0]}, d={H.shape[1]}); no random columns are added"
        )
        warnings.warn(msg, RuntimeWarning, stacklevel=2)
        log.warning(msg)
    B = _fix_signs(Vt[:k_eff].T)
    total = float(np.sum(s**2))
    explained = float(np.sum(s[:k_eff] ** 2) / total) if total > 0 else 0.0
    return Basis(
        B=np.ascontiguousarray(B, dtype=np.float32),
        mu=mu.astype(np.float32),
        singular_values=s[:k_eff].astype(np.float32),
        explained=explained,
    )


def project(basis: Basis, h: np.ndarray) -> np.ndarray:
    """UGT coordinates ``x = Bᵀ(h − μ)`` of one state ``(d,)`` or many ``(n, d)`` (float32)."""
    h = np.asarray(h, dtype=np.float32)
    if h.shape[-1] != basis.d:
        raise ValueError(f"hidden state has dimension {h.shape[-1]}, the basis expects {basis.d}")
    return (h - basis.mu) @ basis.B


def _group(X: np.ndarray, labels) -> tuple[list[str], np.ndarray]:
    labels = np.asarray([str(lab) for lab in labels])
    if labels.shape[0] != X.shape[0]:
        raise ValueError(f"{X.shape[0]} rows but {labels.shape[0]} labels")
    names = sorted(set(labels.tolist()))
    inv = np.searchsorted(np.asarray(names), labels)
    return names, inv


def fit_zones(X: np.ndarray, labels) -> Zones:
    """Zone centroids: the mean UGT coordinates of each label (names sorted)."""
    X = np.asarray(X, dtype=np.float64)
    if X.ndim != 2:
        raise ValueError(f"X must be (n, k), got shape {X.shape}")
    names, inv = _group(X, labels)
    C = np.zeros((len(names), X.shape[1]))
    np.add.at(C, inv, X)
    C /= np.bincount(inv, minlength=len(names))[:, None]
    return Zones(names=names, centroids=C.astype(np.float32))


def route(zones: Zones, x: np.ndarray) -> tuple[str, float]:
    """Nearest zone centroid by cosine distance ``1 − cos(x, c)``: ``(zone, distance)``.

    A zero vector is at distance 1.0 from every centroid (the first zone is returned).
    """
    x = np.asarray(x, dtype=np.float64).reshape(-1)
    C = zones.centroids.astype(np.float64)
    nx = np.linalg.norm(x)
    nc = np.linalg.norm(C, axis=1)
    denom = nx * nc
    with np.errstate(invalid="ignore", divide="ignore"):
        cos = np.where(denom > 0, (C @ x) / np.where(denom > 0, denom, 1.0), 0.0)
    dist = 1.0 - cos
    i = int(np.argmin(dist))
    return zones.names[i], float(dist[i])


def _scatter_traces(X: np.ndarray, inv: np.ndarray, z: int) -> tuple[float, float]:
    counts = np.bincount(inv, minlength=z).astype(np.float64)
    C = np.zeros((z, X.shape[1]))
    np.add.at(C, inv, X)
    C /= np.maximum(counts, 1.0)[:, None]
    mean = X.mean(axis=0)
    between = float(np.sum(counts * np.sum((C - mean) ** 2, axis=1)))
    within = float(np.sum((X - C[inv]) ** 2))
    return between, within


def zone_separation(X: np.ndarray, labels) -> float:
    """Fisher-style zone separation: ``tr(S_B) / tr(S_W)``.

    ``S_B = Σ_z n_z (c_z − c)(c_z − c)ᵀ`` (between-zone scatter of the zone
    centroids ``c_z`` around the overall mean ``c``) and
    ``S_W = Σ_i (x_i − c_{z(i)})(x_i − c_{z(i)})ᵀ`` (within-zone scatter).
    Larger is better; it is invariant to rotating or uniformly scaling ``X``.
    ``inf`` when every zone is a single point and zones differ.
    """
    X = np.asarray(X, dtype=np.float64)
    names, inv = _group(X, labels)
    between, within = _scatter_traces(X, inv, len(names))
    if within == 0.0:
        return float("inf") if between > 0 else 0.0
    return between / within


def _orthonormal_qr(A: np.ndarray) -> np.ndarray:
    """QR retraction with a positive diagonal of R (unique, continuous)."""
    Q, R = np.linalg.qr(A)
    s = np.sign(np.diag(R))
    s[s == 0] = 1.0
    return Q * s


def refine_basis(
    H: np.ndarray,
    labels,
    basis: Basis,
    steps: int = 100,
    lr: float = 0.1,
) -> tuple[Basis, dict]:
    """Riemannian ascent of zone separation over the Stiefel manifold ``St(d, k)``.

    Objective: ``f(B) = tr(Bᵀ S_B B) / tr(Bᵀ S_W B)`` (the separation of the
    projected calibration states, see :func:`zone_separation`), with ``S_B``
    and ``S_W`` the between- and within-zone scatter of ``H`` in ``R^d``
    (never formed as ``d × d`` matrices; products go through the data).
    Each step: Euclidean gradient ``G``; Riemannian gradient
    ``G − B sym(BᵀG)``; QR retraction ``B ← qf(B + t·ξ)``. The step ``t``
    starts at ``lr`` (relative to ``‖B‖_F / ‖ξ‖_F``) and is halved until the
    objective does not decrease (Armijo-free backtracking), so separation
    never goes down; a step that cannot improve ends the loop early.

    Returns the refined basis (``mu`` unchanged; ``singular_values`` are those
    of the centred data projected on the new columns, ``explained`` its
    variance share) and ``{"separation_before", "separation_after", "steps"}``
    where ``steps`` counts accepted steps.
    """
    H = _as_matrix(H)
    H64 = H.astype(np.float64, copy=False)
    if H64.shape[1] != basis.d:
        raise ValueError(f"H has dimension {H64.shape[1]}, the basis expects {basis.d}")
    names, inv = _group(H64, labels)
    z = len(names)
    if z < 2:
        raise ValueError("refinement needs at least two zones")
    counts = np.bincount(inv, minlength=z).astype(np.float64)
    C = np.zeros((z, H64.shape[1]))
    np.add.at(C, inv, H64)
    C /= counts[:, None]
    mean = H64.mean(axis=0)
    Db = (C - mean) * np.sqrt(counts)[:, None]  # S_B = Dbᵀ Db
    Dw = H64 - C[inv]  # S_W = Dwᵀ Dw

    def objective(B: np.ndarray) -> tuple[float, float, np.ndarray, np.ndarray]:
        PB = Db @ B
        PW = Dw @ B
        a = float(np.sum(PB**2))
        b = float(np.sum(PW**2))
        return (a / b if b > 0 else float("inf")), b, PB, PW

    B = basis.B.astype(np.float64)
    f0, b, PB, PW = objective(B)
    f = f0
    accepted = 0
    if np.isfinite(f0):
        t = lr
        for _ in range(int(steps)):
            G = 2.0 * (Db.T @ PB - f * (Dw.T @ PW)) / b
            BtG = B.T @ G
            xi = G - B @ (0.5 * (BtG + BtG.T))
            nxi = np.linalg.norm(xi)
            if nxi < 1e-12:
                break
            scale = np.linalg.norm(B) / nxi
            improved = False
            for _ in range(30):
                Bn = _orthonormal_qr(B + t * scale * xi)
                fn, bn, PBn, PWn = objective(Bn)
                if np.isfinite(fn) and fn >= f:
                    improved = True
                    break
                t *= 0.5
            if not improved or fn - f <= 1e-12 * max(1.0, abs(f)):
                if improved:
                    B, f, b, PB, PW = Bn, fn, bn, PBn, PWn
                    accepted += 1
                break
            B, f, b, PB, PW = Bn, fn, bn, PBn, PWn
            accepted += 1
            t = min(t * 1.5, lr)
    Hc = H64 - basis.mu.astype(np.float64)
    proj = Hc @ B
    sv = np.sqrt(np.sum(proj**2, axis=0))
    order = np.argsort(-sv)
    B = B[:, order]
    total = float(np.sum(Hc**2))
    refined = Basis(
        B=np.ascontiguousarray(B, dtype=np.float32),
        mu=basis.mu.copy(),
        singular_values=sv[order].astype(np.float32),
        explained=float(np.sum(sv**2) / total) if total > 0 else 0.0,
    )
    report = {"separation_before": float(f0), "separation_after": float(f), "steps": accepted}
    return refined, report
