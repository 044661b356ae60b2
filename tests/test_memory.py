"""Trajectory memory: two-stage lookup recall, drift, eviction, columns."""

from __future__ import annotations

import numpy as np
import pytest

from isagi.manifold.cog import Metric
from isagi.manifold.memory import TrajectoryMemory

K = 16


def _metric(seed: int = 0, n: int = 300, eta: float = 0.05) -> Metric:
    rng = np.random.default_rng(seed)
    m = Metric(K, eta=eta)
    for _ in range(n):
        m.update(rng.standard_normal(K) * np.geomspace(0.1, 3.0, K))
    return m


def _points(n: int, seed: int = 1) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((32, K))
    return (centres[rng.integers(0, 32, n)] + 0.5 * rng.standard_normal((n, K))).astype(np.float32)


def _fill(mem: TrajectoryMemory, X: np.ndarray, start: int = 0) -> list[int]:
    return [
        mem.add(x, -x, f"q{start + i}", f"r{start + i}", "EXPAND", (start + i) % 7)
        for i, x in enumerate(X)
    ]


def _brute(mem: TrajectoryMemory, metric: Metric, q: np.ndarray) -> tuple[int, float]:
    cols = mem.to_columns()
    d = metric.distances(q, cols["query_x"])
    i = int(np.argmin(d))
    return int(cols["id"][i]), float(d[i])


def _recall(mem: TrajectoryMemory, metric: Metric, Q: np.ndarray) -> float:
    ok = 0
    for q in Q:
        hit = mem.search(q, metric)[0]
        _, best = _brute(mem, metric, q)
        ok += hit.distance <= best + 1e-9
    return ok / len(Q)


def _queries(X: np.ndarray, n: int, seed: int = 2) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return X[rng.integers(0, len(X), n)] + 0.3 * rng.standard_normal((n, K))


def test_empty_memory_returns_nothing() -> None:
    assert TrajectoryMemory(K).search(np.ones(K), Metric(K)) == []


def test_exact_path_finds_the_true_nearest_and_sorts_ascending() -> None:
    X = _points(500)
    mem = TrajectoryMemory(K, exact_below=4096, candidates=16)
    _fill(mem, X)
    m = _metric()
    Q = _queries(X, 60)
    assert _recall(mem, m, Q) == 1.0
    assert mem._index_kind == "flat"
    hits = mem.search(Q[0], m, top=5)
    assert [h.distance for h in hits] == sorted(h.distance for h in hits)
    for h in hits:
        assert h.distance == pytest.approx(m.distance(Q[0], X[h.id]), abs=1e-9)
        assert h.id == int(mem.to_columns()["id"][h.index])


def test_stored_point_is_found_at_distance_zero() -> None:
    X = _points(300)
    mem = TrajectoryMemory(K)
    ids = _fill(mem, X)
    m = _metric()
    hit = mem.search(X[123], m)[0]
    assert hit.id == ids[123] and hit.distance == pytest.approx(0.0, abs=1e-6)


def test_hnsw_path_recall_against_brute_force() -> None:
    X = _points(3000)
    mem = TrajectoryMemory(K, exact_below=500, candidates=32)
    _fill(mem, X)
    m = _metric()
    assert _recall(mem, m, _queries(X, 150)) >= 0.98
    assert mem._index_kind == "hnsw"


def test_lookup_follows_the_current_metric_after_drift() -> None:
    """Stage 2 rescoring under the current M; results stay exact as M drifts."""
    for exact_below in (4096, 400):  # flat and HNSW index
        X = _points(1500, seed=5)
        mem = TrajectoryMemory(K, exact_below=exact_below, candidates=32)
        _fill(mem, X)
        m = Metric(K)
        Q = _queries(X, 80, seed=6)
        assert _recall(mem, m, Q) >= 0.98
        built = mem.rebuilds
        rng = np.random.default_rng(7)
        # drift below the rebuild bound: no rebuild, stale frame, still exact
        for _ in range(5):
            m.update(rng.standard_normal(K))
        assert 0 < mem.frame_drift(m) <= mem._drift_estimate(m, 1e9) < 0.25
        assert _recall(mem, m, Q) >= 0.98
        assert mem.rebuilds == built and mem.frame_drift(m) > 0
        # large drift: the index is rebuilt in the new frame
        for _ in range(2000):
            m.update(rng.standard_normal(K) * np.geomspace(0.05, 5.0, K))
            if mem.frame_drift(m) > 1.0:
                break
        assert mem.frame_drift(m) > 1.0
        assert _recall(mem, m, Q) >= 0.98
        assert mem.rebuilds > built
        assert mem.frame_drift(m) == pytest.approx(0.0, abs=1e-9)


def test_drift_estimate_is_an_upper_bound_of_the_exact_drift() -> None:
    X = _points(200)
    mem = TrajectoryMemory(K)
    _fill(mem, X)
    m = Metric(K)
    mem.search(X[0], m)
    rng = np.random.default_rng(8)
    for _ in range(20):
        m.update(rng.standard_normal(K))
        assert mem._drift_estimate(m, 1e9) >= mem.frame_drift(m) - 1e-12
    other = Metric(K, M=m.M.copy())  # a different object: the general bound applies
    assert mem._drift_estimate(other, 1e9) >= mem.frame_drift(other) - 1e-12


def test_scaled_metric_has_no_drift() -> None:
    X = _points(100)
    mem = TrajectoryMemory(K)
    _fill(mem, X)
    m = _metric()
    mem.search(X[0], m)
    assert mem.frame_drift(Metric(K, M=7.0 * m.M)) == pytest.approx(0.0, abs=1e-9)


def test_incremental_add_after_build_is_searchable_and_switches_to_hnsw() -> None:
    X = _points(900)
    mem = TrajectoryMemory(K, exact_below=500)
    m = _metric()
    ids = _fill(mem, X[:400])
    mem.search(X[0], m)
    assert mem._index_kind == "flat"
    ids += _fill(mem, X[400:], start=400)
    assert mem.search(X[850], m)[0].id == ids[850]
    assert mem._index_kind == "hnsw"
    assert _recall(mem, m, _queries(X, 60)) >= 0.98


def test_cap_eviction_keeps_ids_stable_and_index_consistent() -> None:
    X = _points(1200, seed=9)
    for exact_below in (4096, 200):
        mem = TrajectoryMemory(K, cap=400, exact_below=exact_below, evict_fraction=0.05)
        m = _metric()
        ids = _fill(mem, X[:400])
        mem.search(X[0], m)
        for i in range(0, 400, 3):  # used records survive eviction
            mem.record_hit(ids[i])
        ids += _fill(mem, X[400:], start=400)
        assert len(mem) <= 400
        assert mem.evicted >= 800
        alive = set(mem.ids.tolist())
        assert {ids[i] for i in range(0, 400, 3)} <= alive
        for i in range(400):
            if ids[i] in alive:
                rec = mem.get(ids[i])
                np.testing.assert_array_equal(rec["query_x"], X[i])
                assert rec["query_text"] == f"q{i}"
            else:
                with pytest.raises(KeyError):
                    mem.get(ids[i])
        # evicted records are never returned; recall still exact vs the alive set
        Q = _queries(X, 60, seed=10)
        for q in Q:
            for h in mem.search(q, m, top=3):
                assert h.id in alive
        assert _recall(mem, m, Q) >= 0.98
        assert len(set(mem.ids.tolist())) == len(mem)


def test_eviction_score_prefers_hits_then_recency() -> None:
    mem = TrajectoryMemory(K, cap=3, evict_fraction=0.01)
    x = np.ones(K)
    a = mem.add(x, x, "a", "", "EXPAND", 0, created=1000.0)
    b = mem.add(x, x, "b", "", "EXPAND", 0, created=2000.0)
    c = mem.add(x, x, "c", "", "EXPAND", 0, created=500.0)
    mem.record_hit(c, now=600.0)
    mem.add(x, x, "d", "", "EXPAND", 0, created=3000.0)  # evicts a (no hits, oldest)
    assert a not in mem and {b, c} <= set(mem.ids.tolist())
    s = mem.usefulness(now=3000.0)
    assert s.shape[0] >= 3


def test_record_hit_and_clusters() -> None:
    mem = TrajectoryMemory(K)
    x = np.ones(K)
    c0 = mem.next_cluster_id()
    i = mem.add(x, x, "q", "r", "EXPLORE", c0)
    c1 = mem.next_cluster_id()
    assert c1 != c0
    mem.add(x, x, "q2", "r2", "EXPAND", c0)
    mem.record_hit(i, now=123.0)
    rec = mem.get(i)
    assert rec["hits"] == 1 and rec["last_hit"] == 123.0
    assert mem.clusters == {c0: 2}
    with pytest.raises(KeyError):
        mem.record_hit(999)


def test_columns_round_trip() -> None:
    X = _points(300)
    mem = TrajectoryMemory(K, cap=250)
    ids = _fill(mem, X)  # 50 evicted
    mem.record_hit(ids[-1], now=42.0)
    cols = mem.to_columns()
    assert cols["id"].dtype == np.int64 and cols["query_x"].dtype == np.float32
    assert cols["query_x"].shape == (len(mem), K)
    assert cols["cluster"].dtype == np.int32 and cols["hits"].dtype == np.int32
    assert cols["created"].dtype == np.float64 and cols["last_hit"].dtype == np.float64
    for name in ("query_text", "reply_text", "tier", "context_key", "content_key"):
        assert isinstance(cols[name], list) and len(cols[name]) == len(mem)
    mem2 = TrajectoryMemory.from_columns(cols, K, cap=250)
    cols2 = mem2.to_columns()
    for key, val in cols.items():
        if isinstance(val, np.ndarray):
            np.testing.assert_array_equal(cols2[key], val)
        else:
            assert cols2[key] == val
    m = _metric()
    for q in _queries(X, 20):
        h1, h2 = mem.search(q, m)[0], mem2.search(q, m)[0]
        assert (h1.id, h1.distance) == (h2.id, pytest.approx(h2.distance))
    new = mem2.add(X[0], X[0], "n", "n", "EXPAND", 0)
    assert new > int(cols["id"].max())
    assert mem2.next_cluster_id() > int(cols["cluster"].max())


def test_from_columns_validates() -> None:
    mem = TrajectoryMemory(K)
    _fill(mem, _points(10))
    cols = mem.to_columns()
    bad = dict(cols, reply_text=cols["reply_text"][:-1])
    with pytest.raises(ValueError):
        TrajectoryMemory.from_columns(bad, K)
    bad = dict(cols, id=np.zeros(10, np.int64))
    with pytest.raises(ValueError):
        TrajectoryMemory.from_columns(bad, K)
    bad = {k: v for k, v in cols.items() if k != "tier"}
    with pytest.raises(ValueError):
        TrajectoryMemory.from_columns(bad, K)
    with pytest.raises(ValueError):
        TrajectoryMemory.from_columns(cols, K + 1)


def test_add_rejects_bad_coordinates() -> None:
    mem = TrajectoryMemory(K)
    with pytest.raises(ValueError):
        mem.add(np.ones(K + 1), np.ones(K), "", "", "EXPAND", 0)
    with pytest.raises(ValueError):
        mem.add(np.full(K, np.nan), np.ones(K), "", "", "EXPAND", 0)


def test_lookup_benchmark_small_run_reports_the_contract_keys() -> None:
    from isagi.bench import lookup

    r = lookup.run(n=3000, k=16, queries=40, seed=1, metric_updates=200, naive_queries=5)
    for key in ("n", "k", "p50_us", "p95_us", "recall_at_1", "speedup_vs_bruteforce"):
        assert key in r
    assert (r["n"], r["k"]) == (3000, 16)
    assert r["recall_at_1"] >= 0.95
    assert r["p95_us"] >= r["p50_us"] > 0


def test_cog_soak_small_run_keeps_the_metric_spd_and_the_memory_under_cap() -> None:
    from isagi.bench import cog

    r = cog.run(interactions=1200, k=16, seed=2, cap=150, exact_below=80, window=400)
    assert r["interactions"] == 1200
    assert r["symmetric"] is True
    assert r["min_eigenvalue"] >= 0.01
    assert r["memory_max_size"] <= 150 and r["memory_size"] <= 150
    assert r["evicted"] > 0
    assert len(r["growth"]) == len(r["saturation"]) == 3
    assert r["growth"] == sorted(r["growth"])  # M only grows
    for key in ("rss_mb_end", "p95_us_start", "p95_us_end"):
        assert r[key] > 0


# -- stage 2 under the current metric: the cached frame must never go stale --


def _assert_exact_distances(mem: TrajectoryMemory, m: Metric, X: np.ndarray, Q: np.ndarray) -> None:
    for q in Q:
        for h in mem.search(q, m, top=4):
            assert h.distance == pytest.approx(m.distance(q, X[h.id]), abs=1e-12)


@pytest.mark.parametrize("exact_below", [4096, 300])  # flat and HNSW index
def test_metric_update_invalidates_the_cached_frame(exact_below: int) -> None:
    """After an update below the rebuild bound, distances follow the new M.

    Before the update the memory uses the index frame (stage 1's ``Lᵀx`` and
    the stored ``1/‖Lᵀy‖``); a cache that outlived the update would return
    distances under the old M.
    """
    X = _points(800, seed=11)
    mem = TrajectoryMemory(K, exact_below=exact_below)
    _fill(mem, X)
    m = _metric()
    Q = _queries(X, 20, seed=12)
    _assert_exact_distances(mem, m, X, Q)  # builds the frame and fills the cache
    assert mem._query_frame(m)[1] is True
    built = mem.rebuilds
    old = Metric(K, M=m.M.copy())
    m.update(np.random.default_rng(13).standard_normal(K) * np.geomspace(3.0, 0.1, K))
    assert mem.rebuilds == built
    assert mem._query_frame(m)[1] is False
    _assert_exact_distances(mem, m, X, Q)
    assert mem.rebuilds == built  # no rebuild: the exactness came from stage 2
    # the update really moved the distances (else the test would prove nothing)
    moved = max(abs(m.distance(q, X[0]) - old.distance(q, X[0])) for q in Q)
    assert moved > 1e-6


def test_another_metric_at_the_same_version_is_not_served_the_frame() -> None:
    X = _points(600, seed=14)
    mem = TrajectoryMemory(K, exact_below=200)
    _fill(mem, X)
    m1 = _metric(seed=0)
    m2 = Metric.from_state(_metric(seed=3).to_state())  # other M, maybe same version
    m2.version = m1.version
    Q = _queries(X, 15, seed=15)
    _assert_exact_distances(mem, m1, X, Q)
    _assert_exact_distances(mem, m2, X, Q)
    _assert_exact_distances(mem, m1, X, Q)


def test_records_added_after_the_build_are_rescored_exactly() -> None:
    X = _points(900, seed=16)
    mem = TrajectoryMemory(K, exact_below=300)
    m = _metric()
    ids = _fill(mem, X[:600])
    mem.search(X[0], m)
    assert mem._index_kind == "hnsw"
    ids += _fill(mem, X[600:], start=600)
    for i in (600, 750, 899):
        hit = mem.search(X[i], m)[0]
        assert hit.id == ids[i] and hit.distance == pytest.approx(0.0, abs=1e-12)
    _assert_exact_distances(mem, m, X, _queries(X, 20, seed=17))


def test_zero_vectors_are_at_distance_one_on_the_index_path() -> None:
    X = _points(700, seed=18)
    X[5] = 0.0
    mem = TrajectoryMemory(K, exact_below=200)
    _fill(mem, X)
    m = _metric()
    mem.search(X[1], m)
    assert mem._query_frame(m)[1] is True
    hit = [h for h in mem.search(X[6], m, top=len(X)) if h.id == 5]
    assert hit and hit[0].distance == 1.0
    assert all(h.distance == 1.0 for h in mem.search(np.zeros(K), m, top=3))


@pytest.mark.parametrize("storage", ["sq8", "flat"])
def test_hnsw_storage_kinds_have_exact_results_and_recall(storage: str) -> None:
    X = _points(3000, seed=19)
    mem = TrajectoryMemory(K, exact_below=500, hnsw_storage=storage)
    _fill(mem, X)
    m = _metric()
    Q = _queries(X, 120, seed=20)
    assert _recall(mem, m, Q) >= 0.98
    assert mem._index_kind == "hnsw"
    kind = "IndexHNSWSQ" if storage == "sq8" else "IndexHNSWFlat"
    assert type(mem._index).__name__ == kind
    _assert_exact_distances(mem, m, X, Q[:10])


def test_bad_hnsw_storage_is_rejected() -> None:
    with pytest.raises(ValueError):
        TrajectoryMemory(K, hnsw_storage="pq")


def test_every_drift_estimate_stage_bounds_the_exact_drift() -> None:
    """The O(k²) bound, the ‖R − I‖_F bound and the exact check, each forced."""
    X = _points(600, seed=21)
    for exact_below in (4096, 200):
        mem = TrajectoryMemory(K, exact_below=exact_below)
        _fill(mem, X)
        m = Metric(K)
        mem.search(X[0], m)
        rng = np.random.default_rng(22)
        for _ in range(30):
            m.update(rng.standard_normal(K))
            exact = mem.frame_drift(m)
            for bound in (1e9, 0.05, 0.0):
                mem._drift_key = None  # recompute at this bound
                assert mem._drift_estimate(m, bound) >= exact - 1e-12
