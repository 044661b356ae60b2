"""Trajectory memory: stored exchanges and the two-stage metric lookup.

This module owns the records a session remembers (query and reply UGT
coordinates, texts, tier, cluster, times, hit counts) and how they are found
again (docs/architecture.md, One turn, step 5):

Stage 1 — FAISS over the stored query coordinates in the *metric frame*: with
``M = L Lᵀ`` the metric cosine distance of ``x`` and ``y`` is the plain cosine
distance of ``Lᵀx`` and ``Lᵀy``, so the index holds the unit vectors
``Lᵀy / ‖Lᵀy‖`` and is searched by inner product. The index is exact
(``IndexFlatIP``) while at most ``exact_below`` records are alive, HNSW beyond:
``IndexHNSWSQ`` (8-bit per-dimension scalar codes, inner product), or
``IndexHNSWFlat`` with ``hnsw_storage="flat"``. Stage 1 only proposes
candidates (the codes' rounding is undone by stage 2), and one 64-byte code per
vector instead of 256 bytes makes the graph walk, which is bound by memory
latency, faster with the same recall (docs/measurements.md).
Parameters (``hnsw_m`` 20, ``ef_construction`` 160, ``ef_search`` 32,
``candidates`` 16) were chosen by measurement on the lookup benchmark's data
(N = 100,000, k = 64, seeds 0–4): recall@1 ≥ 0.994 for both query kinds
(noisy copies of stored points, fresh draws) on every seed, at about the
latency of the lighter settings tried: ``ef_search`` 28 fell to 0.990 and
M = 16 with ``ef_construction`` 80 to 0.988 on some seeds. On harder synthetic
data (an anisotropic Gaussian without clusters; anisotropic clusters of mixed
size and spread) no HNSW setting up to ``ef_search`` 64 reached 0.99 on fresh
draws (copies: ≥ 0.99). An IVF index was faster on the benchmark's 256
Gaussian clusters but far worse on that harder data (0.5–0.95 on fresh
draws), so it is not used.

Stage 2 — the candidates are rescored exactly (float64) under the *current*
metric, ``d = 1 − xᵀMy / √(xᵀMx · yᵀMy)`` (as ``Metric.distances``, equal up
to rounding), and sorted ascending. Results are therefore exact among the
candidates even when the index frame is stale. While ``M`` is the one the
index was built in, ``Mx = L z`` reuses stage 1's ``z = Lᵀx`` and
``1/√(yᵀMy) = 1/‖Lᵀy‖`` is stored per record (computed when the frame is built
or the record added); otherwise ``M`` itself is applied to the candidates. Which
of the two applies is cached per metric object and version, so a metric
update is never served the stale frame.

Rebuild policy. ``L`` is frozen when the index is built. When the metric has
moved on, its drift from the build frame is measured as the spread of the
relative metric ``R = L⁻¹ M L⁻ᵀ``: ``drift = λ_max(R)/λ_min(R) − 1`` (0 when
``M`` is a positive multiple of the built metric — the cosine distance is
invariant to scaling ``M`` — and it bounds how far angles in the stale frame
can be from the true ones). While ``0 < drift ≤ bound`` the candidate count is
enlarged to ``candidates · (1 + drift/bound)``; past the bound the index is
rebuilt in the current frame (bound ``rebuild_drift_exact`` = 0.25 for the flat
index, ``rebuild_drift_hnsw`` = 1.0 for HNSW, whose rebuild is expensive).
The bounds are conservative: on the lookup benchmark's clustered data,
recall@1 against brute force stayed 1.0 (800 queries) with stale frames up to
drift 2.0 and no enlargement at all. Drift is estimated cheaply, from
``‖M − M_build‖_F`` first, then ``‖R − I‖_F`` (see ``_drift_estimate``).

Eviction. At most ``cap`` records are alive. Adding to a full memory first
evicts the ``evict_fraction·cap`` least useful records, by the score
``log2(1 + hits) − age / half_life`` with ``age = now − max(created, last_hit)``
(seconds; ties: least recently used first, then lowest id). Evicted records
are tombstoned: their ids are never reused, stage 1 skips them, and when a
quarter of the slots are tombstones the arrays are compacted and the index is
rebuilt. Record ids are stable for the life of the memory and across
``to_columns``/``from_columns``.

Not thread-safe: one session is used by one thread (the agent serialises
turns). ``search`` reuses per-memory query and result buffers, so two
concurrent searches on one memory would corrupt each other's results.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypedDict

import faiss
import numpy as np

from isagi.manifold.cog import Metric

__all__ = ["Hit", "MemoryRecord", "TrajectoryMemory"]

_BLOCK = 128
_SQ_RANGE_MARGIN = 0.1  # each side, as a fraction of a dimension's trained range
_TEXT_COLUMNS = ("query_text", "reply_text", "tier", "context_key", "content_key")


class MemoryRecord(TypedDict):
    """One stored exchange as :meth:`TrajectoryMemory.get` gives it: its figures and the
    text columns (:data:`_TEXT_COLUMNS`)."""

    id: int
    index: int  # its slot
    query_x: np.ndarray
    reply_x: np.ndarray
    cluster: int
    created: float
    last_hit: float
    hits: int
    query_text: str
    reply_text: str
    tier: str
    context_key: str
    content_key: str


@contextmanager
def _faiss_threads(n: int) -> Iterator[None]:
    """Run FAISS with ``n`` OpenMP threads in this block (a per-thread setting)."""
    before = faiss.omp_get_max_threads()
    if before == n:
        yield
        return
    faiss.omp_set_num_threads(n)
    try:
        yield
    finally:
        faiss.omp_set_num_threads(before)


@dataclass(slots=True)
class Hit:
    """One lookup result.

    ``index`` is the record's row in the memory's internal arrays (stable until
    the next compaction; use ``id`` for anything kept), ``distance`` the metric
    cosine distance under the metric passed to ``search``.
    """

    index: int
    id: int
    distance: float


class TrajectoryMemory:
    """Stored trajectories of one session, searchable under the COG metric."""

    def __init__(
        self,
        k: int,
        cap: int = 50_000,
        exact_below: int = 4096,
        candidates: int = 16,
        *,
        hnsw_m: int = 20,
        ef_construction: int = 160,
        ef_search: int = 32,
        hnsw_storage: str = "sq8",
        rebuild_drift_exact: float = 0.25,
        rebuild_drift_hnsw: float = 1.0,
        evict_fraction: float = 0.05,
        half_life_s: float = 7 * 24 * 3600.0,
    ) -> None:
        if k < 1 or cap < 1 or candidates < 1:
            raise ValueError("k, cap and candidates must be at least 1")
        if hnsw_storage not in ("sq8", "flat"):
            raise ValueError(f"hnsw_storage must be 'sq8' or 'flat', got {hnsw_storage!r}")
        self.k = int(k)
        self.cap = int(cap)
        self.exact_below = int(exact_below)
        self.candidates = int(candidates)
        self.hnsw_m = int(hnsw_m)
        self.ef_construction = int(ef_construction)
        self.ef_search = int(ef_search)
        self.hnsw_storage = hnsw_storage
        self.rebuild_drift_exact = float(rebuild_drift_exact)
        self.rebuild_drift_hnsw = float(rebuild_drift_hnsw)
        self.evict_fraction = float(evict_fraction)
        self.half_life_s = float(half_life_s)

        self._size = 0  # slots in use (alive + tombstones)
        self._alive_count = 0
        self._alloc(0)
        self._texts: dict[str, list[str]] = {c: [] for c in _TEXT_COLUMNS}
        self._id2slot: dict[int, int] = {}
        self._next_id = 0
        self._next_cluster = 0

        self._index: faiss.Index | None = None
        self._index_kind = ""
        self._frame_L: np.ndarray | None = None
        self._frame_Linv: np.ndarray | None = None
        self._frame_M: np.ndarray | None = None
        self._frame_lmin = 1.0
        self._frame_metric: Metric | None = None
        self._frame_version = -1
        self._drift_key: tuple[Metric, int] | None = None
        self._drift = 0.0
        self._cur_ef = -1
        self._qf_key: tuple[Metric, int] | None = None
        self._qf: tuple[np.ndarray, bool] = (np.eye(self.k), False)
        # stage-1 buffers, reused by every query (FAISS writes into them)
        self._qbuf = np.zeros((1, self.k), np.float32)
        self._qptr = faiss.swig_ptr(self._qbuf)
        self._alloc_stage1(max(64, self.candidates))
        self.rebuilds = 0
        self.evicted = 0
        # to_columns' result, built once per change of the records (None: changed since)
        self._columns: dict[str, np.ndarray | list[str]] | None = None

    def _alloc_stage1(self, ks: int) -> None:
        self._dists = np.empty((1, ks), np.float32)
        self._labels = np.empty((1, ks), np.int64)
        self._dptr = faiss.swig_ptr(self._dists)
        self._lptr = faiss.swig_ptr(self._labels)

    # -- storage -----------------------------------------------------------
    def _alloc(self, capacity: int) -> None:
        k = self.k
        self._ids = np.zeros(capacity, np.int64)
        self._qx = np.zeros((capacity, k), np.float32)
        self._rx = np.zeros((capacity, k), np.float32)
        self._cluster = np.zeros(capacity, np.int32)
        self._created = np.zeros(capacity, np.float64)
        self._last_hit = np.zeros(capacity, np.float64)
        self._hits = np.zeros(capacity, np.int32)
        self._alive = np.zeros(capacity, bool)
        self._finv = np.zeros(capacity, np.float64)  # 1/‖Lᵀy‖ in the index frame (0: zero row)

    _NUMERIC = (
        "_ids",
        "_qx",
        "_rx",
        "_cluster",
        "_created",
        "_last_hit",
        "_hits",
        "_alive",
        "_finv",
    )

    def _grow(self, need: int) -> None:
        cap_now = self._ids.shape[0]
        if need <= cap_now:
            return
        new = max(need, 2 * cap_now, 64)
        for name in self._NUMERIC:
            old = getattr(self, name)
            arr = np.zeros((new, *old.shape[1:]), old.dtype)
            arr[: self._size] = old[: self._size]
            setattr(self, name, arr)

    def __len__(self) -> int:
        return self._alive_count

    def __contains__(self, id: int) -> bool:
        return int(id) in self._id2slot

    @property
    def ids(self) -> np.ndarray:
        """Ids of the alive records, oldest first."""
        return self._ids[: self._size][self._alive[: self._size]].copy()

    @property
    def clusters(self) -> dict[int, int]:
        """Cluster id -> number of alive records in it."""
        c = self._cluster[: self._size][self._alive[: self._size]]
        u, n = np.unique(c, return_counts=True)
        return {int(a): int(b) for a, b in zip(u, n, strict=True)}

    def next_cluster_id(self) -> int:
        """A cluster id not used before in this memory (reserved on return)."""
        c = self._next_cluster
        self._next_cluster += 1
        return c

    def add(
        self,
        query_x: np.ndarray,
        reply_x: np.ndarray,
        query_text: str,
        reply_text: str,
        tier: str,
        cluster: int,
        *,
        context_key: str = "",
        content_key: str = "",
        created: float | None = None,
    ) -> int:
        """Store one trajectory; returns its id. Evicts first when the memory is full."""
        q = np.asarray(query_x, dtype=np.float32).reshape(-1)
        r = np.asarray(reply_x, dtype=np.float32).reshape(-1)
        if q.shape[0] != self.k or r.shape[0] != self.k:
            raise ValueError(
                f"coordinates must be {self.k}-dimensional, got {q.shape[0]} and {r.shape[0]}"
            )
        if not (np.all(np.isfinite(q)) and np.all(np.isfinite(r))):
            raise ValueError("coordinates contain NaN or infinite values")
        if self._alive_count >= self.cap:
            self._evict(max(1, math.ceil(self.evict_fraction * self.cap)))
        self._grow(self._size + 1)
        s = self._size
        rid = self._next_id
        self._next_id += 1
        self._ids[s] = rid
        self._qx[s] = q
        self._rx[s] = r
        self._cluster[s] = int(cluster)
        self._created[s] = time.time() if created is None else float(created)
        self._last_hit[s] = 0.0
        self._hits[s] = 0
        self._alive[s] = True
        for col, val in zip(
            _TEXT_COLUMNS,
            (query_text, reply_text, str(tier), context_key, content_key),
            strict=True,
        ):
            self._texts[col].append(str(val))
        self._size += 1
        self._alive_count += 1
        self._id2slot[rid] = s
        self._columns = None
        self._next_cluster = max(self._next_cluster, int(cluster) + 1)
        if self._index is not None:
            z, finv = self._frame_with_norms(q[None, :], self._built_L)
            self._finv[s] = finv[0]
            with _faiss_threads(1):
                self._index.add(z)
            if self._index_kind == "flat" and self._alive_count > self.exact_below:
                self._index = None  # switch to HNSW at the next search
        return rid

    def may_hold_question(self, content_key: str) -> bool:
        """Whether a stored question has this content key (:func:`isagi.manifold.sameness.content_key`);
        may answer True for a record evicted since, never False for one held."""
        return content_key in self._texts["content_key"]

    def get(self, id: int) -> MemoryRecord:
        """The record with this id (KeyError if unknown or evicted)."""
        s = self._id2slot[int(id)]
        texts = self._texts
        return {
            "id": int(self._ids[s]),
            "index": s,
            "query_x": self._qx[s].copy(),
            "reply_x": self._rx[s].copy(),
            "cluster": int(self._cluster[s]),
            "created": float(self._created[s]),
            "last_hit": float(self._last_hit[s]),
            "hits": int(self._hits[s]),
            "query_text": texts["query_text"][s],
            "reply_text": texts["reply_text"][s],
            "tier": texts["tier"][s],
            "context_key": texts["context_key"][s],
            "content_key": texts["content_key"][s],
        }

    def replace_reply(self, id: int, reply_x: np.ndarray, reply_text: str) -> None:
        """Give the record ``id`` a new reply (Regenerate of an answer from memory): its query,
        cluster and place in the index stay; only the reply's text and coordinates change."""
        s = self._id2slot[int(id)]
        r = np.asarray(reply_x, dtype=np.float32).reshape(-1)
        if r.shape[0] != self.k or not np.all(np.isfinite(r)):
            raise ValueError(f"reply coordinates must be {self.k} finite numbers")
        self._rx[s] = r
        self._texts["reply_text"][s] = str(reply_text)
        self._columns = None

    def record_hit(self, id: int, now: float | None = None) -> None:
        """Count a use of the record (a RETRIEVE answer or AUGMENT context)."""
        s = self._id2slot[int(id)]
        self._hits[s] += 1
        self._last_hit[s] = time.time() if now is None else float(now)
        self._columns = None

    # -- eviction ----------------------------------------------------------
    def usefulness(self, now: float | None = None) -> np.ndarray:
        """Eviction score of every slot (alive or not): higher is kept longer."""
        now = time.time() if now is None else float(now)
        n = self._size
        last_used = np.maximum(self._created[:n], self._last_hit[:n])
        age = np.maximum(0.0, now - last_used)
        return np.log2(1.0 + self._hits[:n]) - age / self.half_life_s

    def _evict(self, count: int) -> None:
        n = self._size
        alive = np.flatnonzero(self._alive[:n])
        if alive.size == 0:
            return
        count = min(count, alive.size)
        score = self.usefulness()[alive]
        last_used = np.maximum(self._created[alive], self._last_hit[alive])
        order = np.lexsort((self._ids[alive], last_used, score))
        victims = alive[order[:count]]
        self._alive[victims] = False
        self._columns = None
        for s in victims.tolist():
            del self._id2slot[int(self._ids[s])]
            for col in ("query_text", "reply_text"):
                self._texts[col][s] = ""
        self._alive_count -= count
        self.evicted += count
        if self._size - self._alive_count > self._size // 4:
            self._compact()

    def _compact(self) -> None:
        keep = np.flatnonzero(self._alive[: self._size])
        for name in self._NUMERIC:
            arr = getattr(self, name)
            setattr(self, name, arr[keep].copy())
        for col in _TEXT_COLUMNS:
            lst = self._texts[col]
            self._texts[col] = [lst[i] for i in keep.tolist()]
        self._size = keep.size
        self._id2slot = {int(i): s for s, i in enumerate(self._ids[: self._size].tolist())}
        self._index = None  # rebuilt (in the then-current frame) at the next search

    # -- index -------------------------------------------------------------
    @staticmethod
    def _frame(Y: np.ndarray, L: np.ndarray) -> np.ndarray:
        """Rows ``Lᵀy / ‖Lᵀy‖`` (float32, C-contiguous); zero rows stay zero."""
        return TrajectoryMemory._frame_with_norms(Y, L)[0]

    @staticmethod
    def _frame_with_norms(Y: np.ndarray, L: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`_frame` and the inverse norms ``1/‖Lᵀy‖`` (float64; 0 for zero rows)."""
        Y = np.asarray(Y, dtype=np.float64)
        # Row blocks of ≤128 keep OpenBLAS on the calling thread: its threaded
        # GEMM stalls for milliseconds when the CPU is shared, for no gain here.
        if Y.shape[0] <= _BLOCK:
            Z = Y @ L
        else:
            Z = np.empty((Y.shape[0], L.shape[1]))
            for s in range(0, Y.shape[0], _BLOCK):
                np.matmul(Y[s : s + _BLOCK], L, out=Z[s : s + _BLOCK])
        nrm = np.sqrt(np.einsum("ij,ij->i", Z, Z))
        inv = np.divide(1.0, nrm, out=np.zeros_like(nrm), where=nrm > 0)
        Z *= inv[:, None]
        return np.ascontiguousarray(Z, dtype=np.float32), inv

    def _build(self, metric: Metric) -> None:
        L = metric.cholesky_factor().copy()
        Z, inv = self._frame_with_norms(self._qx[: self._size], L)
        self._finv[: self._size] = inv
        index: faiss.Index
        if self._alive_count > self.exact_below:
            ip = faiss.METRIC_INNER_PRODUCT
            hnsw: faiss.IndexHNSW
            if self.hnsw_storage == "sq8":
                # faiss's stub types the second argument a ScalarQuantizer; SWIG takes its type (QT_8bit)
                hnsw = faiss.IndexHNSWSQ(self.k, faiss.ScalarQuantizer.QT_8bit, self.hnsw_m, ip)  # type: ignore[arg-type]
                # per-dimension ranges from the build, widened so that records
                # added later (new regions of the sphere) are rarely clipped
                # (downcast_index returns the concrete IndexScalarQuantizer; its stub says Index)
                faiss.downcast_index(hnsw.storage).sq.rangestat_arg = _SQ_RANGE_MARGIN  # type: ignore[attr-defined]
            else:
                hnsw = faiss.IndexHNSWFlat(self.k, self.hnsw_m, ip)
            hnsw.hnsw.efConstruction = self.ef_construction
            index = hnsw
            kind = "hnsw"
        else:
            index = faiss.IndexFlatIP(self.k)
            kind = "flat"
        # small builds: OpenMP threads cost more than they save on a shared CPU
        with _faiss_threads(1 if Z.shape[0] < 20_000 else faiss.omp_get_max_threads()):
            if not index.is_trained:
                index.train(Z)
            index.add(Z)
        self._index = index
        self._index_kind = kind
        self._frame_L = L
        self._frame_Linv = np.linalg.inv(L)
        self._frame_M = np.array(metric.M, dtype=np.float64)
        self._frame_lmin = metric.min_eigenvalue
        self._frame_metric = metric
        self._frame_version = metric.version
        self._drift_key = (metric, metric.version)
        self._drift = 0.0
        self._cur_ef = -1
        self._qf_key = None  # the query-side factor may have been this frame's
        self.rebuilds += 1

    @property
    def _built_L(self) -> np.ndarray:
        """The Cholesky factor L of the frame the index was built in (read only once built)."""
        assert self._frame_L is not None
        return self._frame_L

    @property
    def _built_Linv(self) -> np.ndarray:
        """``L⁻¹`` of the frame the index was built in (read only once built)."""
        assert self._frame_Linv is not None
        return self._frame_Linv

    def frame_drift(self, metric: Metric) -> float:
        """Exact drift ``λ_max/λ_min − 1`` of ``R = L⁻¹ M L⁻ᵀ`` (0 before any build)."""
        if self._frame_Linv is None:
            return 0.0
        Li = self._frame_Linv
        R = Li @ metric.M @ Li.T
        ev = np.linalg.eigvalsh(0.5 * (R + R.T))
        return max(0.0, float(ev[-1] / ev[0] - 1.0)) if ev[0] > 0 else float("inf")

    def _drift_estimate(self, metric: Metric, bound: float) -> float:
        """An upper bound of the drift, exact only when the cheap bounds exceed ``bound``.

        If every eigenvalue of ``R`` lies in ``[1 − f, 1 + f]`` then
        ``drift ≤ 2f/(1 − f)``; for the metric the index was built with, ``M``
        only ever grows by PSD terms (``Metric.update``), so ``R ⪰ I`` and
        ``drift ≤ f``. Two such ``f``, cheapest first: ``g = ‖M − M_b‖_F /
        λ_min(M_b)`` (``M_b`` the build metric; O(k²), since
        ``‖R − I‖₂ = ‖L⁻¹(M − M_b)L⁻ᵀ‖₂ ≤ ‖M − M_b‖₂ / λ_min(M_b)``), then the
        tighter ``‖R − I‖_F`` (two k × k products). For HNSW a k × k
        eigendecomposition (exact drift) is paid only past ``bound``; the flat
        index is rebuilt on the bound alone.
        """
        key = self._drift_key
        if key is not None and key[0] is metric and key[1] == metric.version:
            return self._drift
        monotone = self._frame_metric is metric and metric.version >= self._frame_version
        M = metric.M
        g = float(np.linalg.norm(M - self._frame_M)) / self._frame_lmin
        est = g if monotone else (2.0 * g / (1.0 - g) if g < 1.0 else float("inf"))
        if est > bound:
            Li = self._built_Linv
            R = Li @ M @ Li.T
            f = float(np.linalg.norm(R - np.eye(self.k)))
            est = f if monotone else (2.0 * f / (1.0 - f) if f < 1.0 else float("inf"))
        else:
            R = None
        if est > bound and self._index_kind == "hnsw":
            # An HNSW rebuild costs far more than an exact check (a flat
            # rebuild costs about the same, so the bound decides there).
            # Monotone case: λ_min(R) ≥ 1, so drift ≤ λ_max(R) − 1, and
            # λ_max(R) ≤ 1 + bound iff (1 + bound)·I − R is PSD: one Cholesky.
            try:
                if not monotone:
                    raise np.linalg.LinAlgError
                np.linalg.cholesky((1.0 + bound) * np.eye(self.k) - R)
                est = bound
            except np.linalg.LinAlgError:
                est = self.frame_drift(metric)
        self._drift_key = (metric, metric.version)
        self._drift = est
        return est

    def _prepare(self, metric: Metric) -> int:
        """Build or rebuild the index as needed; returns the stage-1 candidate count."""
        if self._index is None:
            self._build(metric)
            return self.candidates
        bound = self.rebuild_drift_hnsw if self._index_kind == "hnsw" else self.rebuild_drift_exact
        drift = self._drift_estimate(metric, bound)
        if drift <= 1e-12:
            return self.candidates
        if drift > bound:
            self._build(metric)
            return self.candidates
        return math.ceil(self.candidates * (1.0 + drift / bound))

    def _query_frame(self, metric: Metric) -> tuple[np.ndarray, bool]:
        """How stage 2 applies the current metric: ``(L, True)`` when the index
        frame ``L`` is the current metric's Cholesky factor (``M = L Lᵀ``
        unchanged since the build: stage 1's ``z = Lᵀx`` and the stored
        ``1/‖Lᵀy‖`` are reused), else ``(M, False)``.

        Cached per metric object and version: any :meth:`Metric.update` bumps
        the version, so the cache never serves the frame for a changed ``M``.
        """
        key = self._qf_key
        if key is not None and key[0] is metric and key[1] == metric.version:
            return self._qf
        current = self._frame_metric is metric and self._frame_version == metric.version
        self._qf_key = (metric, metric.version)
        self._qf = (self._built_L, True) if current else (metric.M, False)
        return self._qf

    def _stage1(self, z: np.ndarray, ks: int) -> np.ndarray:
        """Slots of the ``ks`` entries of largest inner product with ``z``.

        ``z`` need not be normalised: scaling the query by a positive factor
        scales every inner product alike, so the ranking and the HNSW walk are
        the same as for ``z / ‖z‖``.
        """
        if self._labels.shape[1] < ks:
            self._alloc_stage1(ks)
        self._qbuf[0] = z
        index = self._index
        assert index is not None  # built by _prepare before any search
        if self._index_kind == "hnsw":
            ef = max(self.ef_search, ks)
            if ef != self._cur_ef:
                assert isinstance(index, faiss.IndexHNSW)
                index.hnsw.efSearch = ef
                self._cur_ef = ef
        # One query never gains from more OpenMP threads (a per-thread setting).
        before = faiss.omp_get_max_threads()
        if before != 1:
            faiss.omp_set_num_threads(1)
        try:
            # SWIG's raw-pointer search (no array conversion); faiss's stub leaves it out
            index.search_c(1, self._qptr, ks, self._dptr, self._lptr)  # type: ignore[attr-defined]
        finally:
            if before != 1:
                faiss.omp_set_num_threads(before)
        return self._labels[0, :ks]

    def search(self, x: np.ndarray, metric: Metric, top: int = 1) -> list[Hit]:
        """The ``top`` nearest alive records to ``x`` under ``metric``, nearest first."""
        if metric.k != self.k:
            raise ValueError(f"metric is {metric.k}-dimensional, the memory {self.k}")
        if self._alive_count == 0 or top < 1:
            return []
        x = np.asarray(x, dtype=np.float64)
        if x.shape != (self.k,):
            x = x.reshape(-1)
            if x.shape[0] != self.k:
                raise ValueError(
                    f"x has dimension {x.shape[0]}, the memory is {self.k}-dimensional"
                )
        cand = max(self._prepare(metric), top)
        n = self._size
        z = np.dot(x, self._built_L)
        nz2 = float(z.dot(z))
        if self._alive_count <= cand or nz2 == 0.0:
            rows = np.flatnonzero(self._alive[:n])
        else:
            dead = n - self._alive_count
            ks = min(n, cand + (math.ceil(cand * dead / self._alive_count) if dead else 0))
            rows = self._stage1(z, ks)
            if rows[-1] < 0:  # fewer than ks found: FAISS pads the end with -1
                rows = rows[rows >= 0]
            if dead:
                rows = rows[self._alive[rows]]
            if rows.size == 0:
                rows = np.flatnonzero(self._alive[:n])
        d = self._rescore(x, z, nz2, metric, rows)
        if top == 1:
            i = int(d.argmin())
            s = rows.item(i)
            return [Hit(s, self._ids.item(s), min(2.0, max(0.0, d.item(i))))]
        order = np.argsort(d, kind="stable")[:top]
        ids = self._ids
        return [
            Hit(int(s), int(ids[s]), min(2.0, max(0.0, v)))
            for s, v in zip(rows[order].tolist(), d[order].tolist(), strict=True)
        ]

    def _rescore(
        self, x: np.ndarray, z: np.ndarray, nz2: float, metric: Metric, rows: np.ndarray
    ) -> np.ndarray:
        """Stage 2: exact metric cosine distances (float64, unclipped) of ``x`` to the rows.

        ``d = 1 − xᵀMy / √(xᵀMx · yᵀMy)`` as in :meth:`Metric.distances` (equal up
        to rounding; zero vectors are at 1). In the index's own frame (``M = L Lᵀ``
        unchanged since the build) ``1/√(yᵀMy) = 1/‖Lᵀy‖`` is stored per record
        and ``Mx = L z`` with ``z = Lᵀx`` from stage 1; otherwise ``M`` itself
        (:meth:`_query_frame`).
        """
        A, current = self._query_frame(metric)
        if current:
            if nz2 <= 0.0:
                return np.ones(rows.shape[0])
            # float32 rows, upcast exactly inside the product
            d = self._qx.take(rows, axis=0).dot(A.dot(z))
            d *= self._finv.take(rows)
            d *= -1.0 / math.sqrt(nz2)
            d += 1.0
            return d
        Mx = A.dot(x)
        nx = float(x.dot(Mx))
        if nx <= 0.0:
            return np.ones(rows.shape[0])
        Y = self._qx.take(rows, axis=0).astype(np.float64)
        num = Y.dot(Mx)
        ny = np.einsum("ij,ij->i", Y @ A, Y)
        ny *= nx
        if ny.min() > 0.0:
            num /= np.sqrt(ny, out=ny)
            return np.subtract(1.0, num, out=num)
        ok = ny > 0.0
        d = np.ones(rows.shape[0])
        d[ok] = 1.0 - num[ok] / np.sqrt(ny[ok])
        return d

    # -- columns -----------------------------------------------------------
    def to_columns(self) -> dict[str, np.ndarray | list[str]]:
        """Alive records as columns, oldest first: for the ``.miku`` file, Regenerate's snapshot
        and the page's map alike.

        Built once per change of the records and shared by every caller until the next
        change (a turn's autosave builds them, the page and the next turn's snapshot reuse
        them): the arrays are read-only, the text columns fresh lists.
        """
        if self._columns is None:
            self._columns = self._build_columns()
        cols = dict(self._columns)
        for col in _TEXT_COLUMNS:
            cols[col] = list(cols[col])
        return cols

    def _build_columns(self) -> dict[str, np.ndarray | list[str]]:
        keep = np.flatnonzero(self._alive[: self._size])
        cols: dict[str, np.ndarray | list[str]] = {
            "id": self._ids[keep].astype(np.int64),
            "query_x": self._qx[keep].astype(np.float32),
            "reply_x": self._rx[keep].astype(np.float32),
            "cluster": self._cluster[keep].astype(np.int32),
            "created": self._created[keep].astype(np.float64),
            "last_hit": self._last_hit[keep].astype(np.float64),
            "hits": self._hits[keep].astype(np.int32),
        }
        for arr in cols.values():
            arr.flags.writeable = False  # type: ignore[union-attr]
        idx = keep.tolist()
        for col in _TEXT_COLUMNS:
            lst = self._texts[col]
            cols[col] = [lst[i] for i in idx]
        return cols

    @classmethod
    def from_columns(cls, cols: Mapping[str, Any], k: int, cap: int = 50_000, **kwargs: Any) -> TrajectoryMemory:
        """Rebuild a memory from :meth:`to_columns` output (validated; index built lazily)."""
        mem = cls(k, cap=cap, **kwargs)
        try:
            ids = np.asarray(cols["id"], dtype=np.int64).reshape(-1)
            n = ids.shape[0]
            qx = np.asarray(cols["query_x"], dtype=np.float32).reshape(n, k)
            rx = np.asarray(cols["reply_x"], dtype=np.float32).reshape(n, k)
            numeric: dict[str, np.ndarray] = {
                "cluster": np.asarray(cols["cluster"], dtype=np.int32).reshape(n),
                "created": np.asarray(cols["created"], dtype=np.float64).reshape(n),
                "last_hit": np.asarray(cols["last_hit"], dtype=np.float64).reshape(n),
                "hits": np.asarray(cols["hits"], dtype=np.int32).reshape(n),
            }
            texts = {c: [str(v) for v in cols[c]] for c in _TEXT_COLUMNS}
        except KeyError as exc:
            raise ValueError(f"trajectory columns are missing {exc.args[0]!r}") from exc
        except ValueError as exc:
            raise ValueError(f"trajectory columns have inconsistent shapes: {exc}") from exc
        for c, lst in texts.items():
            if len(lst) != n:
                raise ValueError(f"column {c!r} has {len(lst)} rows, expected {n}")
        if n and (np.unique(ids).size != n or ids.min() < 0):
            raise ValueError("trajectory ids must be unique and non-negative")
        if not (np.all(np.isfinite(qx)) and np.all(np.isfinite(rx))):
            raise ValueError("trajectory coordinates contain NaN or infinite values")
        order = np.argsort(ids, kind="stable")
        mem._alloc(n)
        mem._ids[:] = ids[order]
        mem._qx[:] = qx[order]
        mem._rx[:] = rx[order]
        mem._cluster[:] = numeric["cluster"][order]
        mem._created[:] = numeric["created"][order]
        mem._last_hit[:] = numeric["last_hit"][order]
        mem._hits[:] = numeric["hits"][order]
        mem._alive[:] = True
        mem._texts = {c: [lst[i] for i in order.tolist()] for c, lst in texts.items()}
        mem._size = n
        mem._alive_count = n
        mem._id2slot = {int(i): s for s, i in enumerate(mem._ids.tolist())}
        mem._next_id = int(ids.max()) + 1 if n else 0
        mem._next_cluster = int(numeric["cluster"].max()) + 1 if n else 0
        if n > mem.cap:
            mem._evict(n - mem.cap)
        return mem
