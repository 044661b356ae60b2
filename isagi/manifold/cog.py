"""COG metric: the Riemannian metric M that grows with novelty, and the tiers.

This module owns the metric and the distance of docs/architecture.md (Definitions), exactly:

* ``M₀ = I`` (k × k). On a novel query ``M ← M + w·η · x xᵀ / ‖x xᵀ‖_F``
  (``η = 0.012``; ``w = 1`` for EXPAND/EXPLORE, the caller passes a lighter
  ``w`` for AUGMENT). If the smallest eigenvalue is then below the floor
  (0.01) the floor is added: ``M ← M + 0.01·I``.
* Distance: the metric cosine distance
  ``d(x, y) = 1 − ⟨x, y⟩_M / (‖x‖_M ‖y‖_M)``, ``⟨x, y⟩_M = xᵀ M y``, in [0, 2].
  A zero vector is at distance 1.0 from everything.
* Tiers: RETRIEVE ``d < 0.05``, AUGMENT ``< 0.20``, EXPAND ``< 0.50``,
  EXPLORE otherwise (seed defaults; a profile may calibrate a monotone
  rescaling of ``d`` before classifying — that lives in the profile).

With ``M = L Lᵀ`` (Cholesky), ``d(x, y)`` is the plain cosine distance of
``Lᵀx`` and ``Lᵀy``; the memory uses this "metric frame" for its FAISS index.

Reported figures:

* ``growth = ‖M − I‖_F``.
* ``saturation = 1 − λ_min(M) / λ_max(M)`` ∈ [0, 1): how anisotropic the
  metric has become. The cosine distance is invariant to scaling ``M``, so
  only the *spread* of M's eigenvalues changes distances: 0 means distances
  are still plain cosine; values near 1 mean a few directions dominate
  every distance (the metric is saturated by what it has seen).
* ``growth_rate``: mean growth gained per update over the last
  ``window`` updates (how much novelty still changes M).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

__all__ = ["Tier", "TierThresholds", "Metric"]

_BLOCK = 128  # rows per matmul block in Metric.distances


class Tier(StrEnum):
    """What a turn does with its nearest stored trajectory (docs/architecture.md, One turn, step 6)."""

    RETRIEVE = "RETRIEVE"
    AUGMENT = "AUGMENT"
    EXPAND = "EXPAND"
    EXPLORE = "EXPLORE"


@dataclass(frozen=True)
class TierThresholds:
    """Upper bounds (exclusive) of the RETRIEVE, AUGMENT and EXPAND tiers."""

    retrieve: float = 0.05
    augment: float = 0.20
    expand: float = 0.50

    def __post_init__(self) -> None:
        if not (0.0 <= self.retrieve <= self.augment <= self.expand):
            raise ValueError(
                "tier thresholds must satisfy 0 <= retrieve <= augment <= expand, got "
                f"{self.retrieve}, {self.augment}, {self.expand}"
            )

    def classify(self, d: float) -> Tier:
        """The tier of a distance ``d`` to the nearest stored trajectory."""
        if d != d:  # NaN: nothing comparable is stored
            return Tier.EXPLORE
        if d < self.retrieve:
            return Tier.RETRIEVE
        if d < self.augment:
            return Tier.AUGMENT
        if d < self.expand:
            return Tier.EXPAND
        return Tier.EXPLORE


LIGHT_UPDATE = 0.25  # AUGMENT's metric update weight, relative to a full update


def learn_weight(tier: str) -> float:
    """The weight of the metric update an exchange of ``tier`` makes when it is learned (AUGMENT,
    a question related to one stored, moves M less): the one rule, which the turn's learn stage
    and a rewind's replay of the memory both follow."""
    return LIGHT_UPDATE if tier == Tier.AUGMENT.value else 1.0


class Metric:
    """The COG metric tensor ``M`` (float64, symmetric positive definite)."""

    def __init__(
        self,
        k: int,
        eta: float = 0.012,
        eig_floor: float = 0.01,
        M: np.ndarray | None = None,
        *,
        window: int = 1000,
    ) -> None:
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        if eta <= 0 or eig_floor <= 0:
            raise ValueError("eta and eig_floor must be positive")
        self.k = int(k)
        self.eta = float(eta)
        self.eig_floor = float(eig_floor)
        if M is None:
            M = np.eye(self.k)
        else:
            M = np.array(M, dtype=np.float64)
            if M.shape != (self.k, self.k):
                raise ValueError(f"M must be ({k}, {k}), got {M.shape}")
            if not np.all(np.isfinite(M)):
                raise ValueError("M contains NaN or infinite values")
            if not np.allclose(M, M.T, rtol=1e-10, atol=1e-12):
                raise ValueError("M must be symmetric")
            M = 0.5 * (M + M.T)
            if np.linalg.eigvalsh(M)[0] <= 0:
                raise ValueError("M must be positive definite")
        self._M = M
        self._lmin_lb = float(np.linalg.eigvalsh(M)[0])  # lower bound of λ_min(M)
        self.version = 0
        self.updates = 0
        self.floor_events = 0
        self._window: deque[float] = deque(maxlen=int(window))
        self._chol: tuple[int, np.ndarray] | None = None
        self._eig: tuple[int, np.ndarray] | None = None

    # -- state -------------------------------------------------------------
    @property
    def M(self) -> np.ndarray:
        """The metric (read-only view; change it only through :meth:`update`)."""
        v = self._M.view()
        v.flags.writeable = False
        return v

    def _eigvals(self) -> np.ndarray:
        if self._eig is None or self._eig[0] != self.version:
            self._eig = (self.version, np.linalg.eigvalsh(self._M))
        return self._eig[1]

    @property
    def growth(self) -> float:
        """``‖M − I‖_F``."""
        return float(np.linalg.norm(self._M - np.eye(self.k)))

    @property
    def min_eigenvalue(self) -> float:
        return float(self._eigvals()[0])

    @property
    def max_eigenvalue(self) -> float:
        return float(self._eigvals()[-1])

    @property
    def saturation(self) -> float:
        """``1 − λ_min/λ_max`` ∈ [0, 1): 0 = isotropic (plain cosine), → 1 = saturated."""
        ev = self._eigvals()
        return float(1.0 - ev[0] / ev[-1])

    @property
    def window(self) -> int:
        """How many recent updates :attr:`growth_rate` averages over."""
        return self._window.maxlen or 0

    @property
    def growth_rate(self) -> float:
        """Mean growth gained per update over the last ``window`` updates (0 before any)."""
        return float(np.mean(self._window)) if self._window else 0.0

    def cholesky_factor(self) -> np.ndarray:
        """Lower-triangular ``L`` with ``M = L Lᵀ`` (cached per version)."""
        if self._chol is None or self._chol[0] != self.version:
            self._chol = (self.version, np.linalg.cholesky(self._M))
        return self._chol[1]

    # -- distances ---------------------------------------------------------
    def inner(self, x: np.ndarray, y: np.ndarray) -> float:
        """``xᵀ M y``."""
        x = np.asarray(x, dtype=np.float64)
        y = np.asarray(y, dtype=np.float64)
        return float(x @ self._M @ y)

    def distance(self, x: np.ndarray, y: np.ndarray) -> float:
        """Metric cosine distance in [0, 2]; 1.0 when either vector is zero."""
        x = np.asarray(x, dtype=np.float64)
        y = np.asarray(y, dtype=np.float64)
        Mx = self._M @ x
        nx = float(x @ Mx)
        ny = float(y @ self._M @ y)
        if nx <= 0.0 or ny <= 0.0:
            return 1.0
        d = 1.0 - float(y @ Mx) / np.sqrt(nx * ny)
        return min(2.0, max(0.0, d))

    def distances(self, x: np.ndarray, Y: np.ndarray) -> np.ndarray:
        """``d(x, Y[i])`` for every row of ``Y`` (n, k), float64, vectorised."""
        x = np.asarray(x, dtype=np.float64)
        Y = np.asarray(Y, dtype=np.float64)
        if Y.ndim == 1:
            Y = Y[None, :]
        Mx = self._M @ x
        nx = float(x @ Mx)
        if nx <= 0.0:
            return np.ones(Y.shape[0])
        n = Y.shape[0]
        if n <= _BLOCK:
            YM = Y @ self._M
        else:  # row blocks keep OpenBLAS single-threaded (see isagi.manifold.memory)
            YM = np.empty((n, self.k))
            for s in range(0, n, _BLOCK):
                np.matmul(Y[s : s + _BLOCK], self._M, out=YM[s : s + _BLOCK])
        ny = np.einsum("ij,ij->i", YM, Y)
        ny *= nx
        num = Y @ Mx
        if ny.min() > 0.0:  # the common case: no zero rows
            d = 1.0 - num / np.sqrt(ny, out=ny)
        else:
            ok = ny > 0.0
            d = np.ones(n)
            d[ok] = 1.0 - num[ok] / np.sqrt(ny[ok])
        return np.clip(d, 0.0, 2.0, out=d)

    # -- update ------------------------------------------------------------
    def update(self, x: np.ndarray, weight: float = 1.0) -> None:
        """``M ← M + weight·η·x xᵀ/‖x xᵀ‖_F``, then the eigenvalue floor.

        A zero ``x`` or ``weight == 0`` leaves ``M`` (and ``version``) unchanged.
        """
        if not (weight >= 0.0) or not np.isfinite(weight):
            raise ValueError(f"weight must be a finite number >= 0, got {weight}")
        x = np.asarray(x, dtype=np.float64).reshape(-1)
        if x.shape[0] != self.k:
            raise ValueError(f"x has dimension {x.shape[0]}, the metric is {self.k}-dimensional")
        if not np.all(np.isfinite(x)):
            raise ValueError("x contains NaN or infinite values")
        sq = float(x @ x)  # ‖x xᵀ‖_F = ‖x‖²
        if sq == 0.0 or weight == 0.0:
            return
        before = self.growth
        M = self._M + (weight * self.eta / sq) * np.outer(x, x)
        M = 0.5 * (M + M.T)
        # Adding a PSD term never lowers the smallest eigenvalue, so the
        # eigen-decomposition is needed only while the last known lower
        # bound is under the floor.
        if self._lmin_lb < self.eig_floor:
            lmin = float(np.linalg.eigvalsh(M)[0])
            if lmin < self.eig_floor:
                M = M + self.eig_floor * np.eye(self.k)
                lmin += self.eig_floor
                self.floor_events += 1
            self._lmin_lb = lmin
        self._M = M
        self.version += 1
        self.updates += 1
        self._window.append(self.growth - before)

    # -- persistence -------------------------------------------------------
    def to_state(self) -> dict[str, np.ndarray | float | int]:
        """Plain arrays and numbers (for ``.miku`` files)."""
        return {
            "k": self.k,
            "eta": self.eta,
            "eig_floor": self.eig_floor,
            "M": self._M.copy(),
            "version": self.version,
            "updates": self.updates,
            "floor_events": self.floor_events,
            "window": self._window.maxlen or 0,
            "recent_growth": np.asarray(self._window, dtype=np.float64),
        }

    @classmethod
    def from_state(cls, state: dict) -> Metric:
        """Inverse of :meth:`to_state` (validates ``M``: symmetric positive definite)."""
        try:
            k = int(state["k"])
            m = cls(
                k,
                eta=float(state["eta"]),
                eig_floor=float(state["eig_floor"]),
                M=np.asarray(state["M"], dtype=np.float64).reshape(k, k),
                window=int(state.get("window", 1000)) or 1000,
            )
        except KeyError as exc:
            raise ValueError(f"metric state is missing {exc.args[0]!r}") from exc
        m.version = int(state.get("version", 0))
        m.updates = int(state.get("updates", 0))
        m.floor_events = int(state.get("floor_events", 0))
        m._window.extend(np.asarray(state.get("recent_growth", []), dtype=np.float64).tolist())
        return m

    def __repr__(self) -> str:
        return (
            f"Metric(k={self.k}, eta={self.eta}, version={self.version}, "
            f"growth={self.growth:.4f}, min_eig={self.min_eigenvalue:.4f})"
        )
