"""The paper's construction of the forbidden coordinates, kept as the baseline that
``isagi eval safety`` measures the shipped guard against."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from isagi.safety.runtime import _EPS


def seed_construction(H_harm: np.ndarray, H_benign: np.ndarray, *, k: int = 64, m: int = 5) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """The research code's forbidden coordinates, fitted on the same calibration data.

    SVD basis B (top-k left singular vectors of the centred calibration states,
    centre μ their mean); forbidden coordinates = the m basis coordinates with
    the largest |mean(harmful) − mean(benign)|. Returns ``(B, mu, F)`` where
    TEH_seed(h) = ‖x_F‖ / ‖x‖ × 100, x = Bᵀ(h − μ) (energy fraction in the basis).
    """
    H = np.concatenate([H_harm, H_benign]).astype(np.float64)
    mu = H.mean(axis=0)
    U, S, _ = np.linalg.svd((H - mu).T, full_matrices=False)
    k = min(k, int(np.sum(S[0] * 1e-6 < S)))
    B = U[:, :k]
    diff = np.abs(((H_harm - mu) @ B).mean(axis=0) - ((H_benign - mu) @ B).mean(axis=0))
    F = np.argsort(-diff)[:m]
    return B, mu, {"k": k, "m": m, "coordinates": F.tolist()}


def seed_teh(B: np.ndarray, mu: np.ndarray, F: Sequence[int], h: np.ndarray) -> np.ndarray:
    X = (np.atleast_2d(np.asarray(h, dtype=np.float64)) - mu) @ B
    return 100.0 * np.linalg.norm(X[:, list(F)], axis=1) / np.maximum(np.linalg.norm(X, axis=1), _EPS)
