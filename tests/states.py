"""Comparing hidden states in tests: the row-wise cosine of two (n, d) arrays."""

from __future__ import annotations

import numpy as np


def row_cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cosine of each row of ``a`` with the same row of ``b`` (any leading shape, last axis d)."""
    return np.sum(a * b, axis=-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))
