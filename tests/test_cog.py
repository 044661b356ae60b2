"""COG metric: update rule, eigenvalue floor, distance properties, tiers, state."""

from __future__ import annotations

import numpy as np
import pytest

from isagi.manifold.cog import Metric, Tier, TierThresholds


def _cos_dist(x: np.ndarray, y: np.ndarray) -> float:
    return 1.0 - float(x @ y) / (np.linalg.norm(x) * np.linalg.norm(y))


def test_first_update_grows_exactly_eta_whatever_the_scale_of_x() -> None:
    rng = np.random.default_rng(1)
    for scale in (1e-3, 1.0, 250.0):
        m = Metric(16)
        x = scale * rng.standard_normal(16)
        m.update(x)
        assert m.growth == pytest.approx(0.012, rel=1e-9)
        u = x / np.linalg.norm(x)
        np.testing.assert_allclose(m.M, np.eye(16) + 0.012 * np.outer(u, u), atol=1e-12)
        assert m.version == 1


def test_update_weight_scales_the_step_and_repeated_updates_add_linearly() -> None:
    m = Metric(8)
    x = np.arange(1.0, 9.0)
    m.update(x, weight=0.25)
    assert m.growth == pytest.approx(0.25 * 0.012, rel=1e-9)
    m.update(3 * x, weight=0.75)  # same direction: rank one, norms add
    assert m.growth == pytest.approx(0.012, rel=1e-9)
    assert m.version == 2


def test_zero_vector_and_zero_weight_leave_the_metric_unchanged() -> None:
    m = Metric(4)
    m.update(np.zeros(4))
    m.update(np.ones(4), weight=0.0)
    assert m.version == 0
    np.testing.assert_array_equal(m.M, np.eye(4))
    with pytest.raises(ValueError):
        m.update(np.ones(4), weight=-1.0)
    with pytest.raises(ValueError):
        m.update(np.ones(5))


def test_eigenvalue_floor_kicks_in_below_the_floor() -> None:
    M0 = np.diag([1.0, 1.0, 1e-4])
    m = Metric(3, M=M0)
    x = np.array([1.0, 0.0, 0.0])  # does not touch the tiny direction
    m.update(x)
    expected = M0 + 0.012 * np.outer(x, x) + 0.01 * np.eye(3)
    np.testing.assert_allclose(m.M, expected, atol=1e-12)
    assert m.floor_events == 1
    assert m.min_eigenvalue == pytest.approx(1e-4 + 0.01)
    # once above the floor it is not added again
    m.update(x)
    assert m.floor_events == 1


def test_floor_not_added_when_smallest_eigenvalue_is_at_or_above_floor() -> None:
    m = Metric(3, M=np.diag([1.0, 1.0, 0.01]))
    m.update(np.array([0.0, 1.0, 0.0]))
    assert m.floor_events == 0
    assert m.min_eigenvalue == pytest.approx(0.01)


def test_constructor_rejects_non_spd_metrics() -> None:
    with pytest.raises(ValueError):
        Metric(2, M=np.array([[1.0, 2.0], [0.0, 1.0]]))
    with pytest.raises(ValueError):
        Metric(2, M=np.diag([1.0, -1.0]))
    with pytest.raises(ValueError):
        Metric(2, M=np.eye(3))


def _grown_metric(k: int = 12, seed: int = 0, n: int = 200) -> Metric:
    rng = np.random.default_rng(seed)
    m = Metric(k, eta=0.2)
    for _ in range(n):
        m.update(rng.standard_normal(k) * np.linspace(0.1, 3.0, k))
    return m


def test_distance_symmetry_scale_invariance_and_range() -> None:
    m = _grown_metric()
    rng = np.random.default_rng(3)
    for _ in range(50):
        x, y = rng.standard_normal(12), rng.standard_normal(12)
        d = m.distance(x, y)
        assert 0.0 <= d <= 2.0
        assert d == pytest.approx(m.distance(y, x), abs=1e-12)
        a, b = rng.uniform(0.01, 100.0, size=2)
        assert m.distance(a * x, b * y) == pytest.approx(d, abs=1e-10)
        assert m.distance(x, x) == pytest.approx(0.0, abs=1e-12)
        assert m.distance(x, -x) == pytest.approx(2.0, abs=1e-12)


def test_distance_reduces_to_cosine_at_identity() -> None:
    m = Metric(10)
    rng = np.random.default_rng(4)
    for _ in range(20):
        x, y = rng.standard_normal(10), rng.standard_normal(10)
        assert m.distance(x, y) == pytest.approx(_cos_dist(x, y), abs=1e-12)


def test_metric_changes_distances_and_equals_cosine_in_cholesky_frame() -> None:
    m = _grown_metric()
    L = m.cholesky_factor()
    np.testing.assert_allclose(L @ L.T, m.M, atol=1e-10)
    rng = np.random.default_rng(5)
    changed = 0
    for _ in range(30):
        x, y = rng.standard_normal(12), rng.standard_normal(12)
        d = m.distance(x, y)
        assert d == pytest.approx(_cos_dist(L.T @ x, L.T @ y), abs=1e-10)
        changed += abs(d - _cos_dist(x, y)) > 1e-3
    assert changed > 20  # M really is used in the distance


def test_vectorised_distances_match_scalar_and_handle_zero_vectors() -> None:
    m = _grown_metric()
    rng = np.random.default_rng(6)
    x = rng.standard_normal(12)
    Y = rng.standard_normal((40, 12)).astype(np.float32)
    Y[7] = 0.0
    d = m.distances(x, Y)
    assert d.shape == (40,)
    for i in range(40):
        assert d[i] == pytest.approx(m.distance(x, Y[i]), abs=1e-9)
    assert d[7] == 1.0
    np.testing.assert_array_equal(m.distances(np.zeros(12), Y), np.ones(40))
    assert m.distance(np.zeros(12), x) == 1.0


def test_cholesky_factor_cached_per_version() -> None:
    m = Metric(5)
    L0 = m.cholesky_factor()
    assert m.cholesky_factor() is L0
    m.update(np.ones(5))
    L1 = m.cholesky_factor()
    assert L1 is not L0
    np.testing.assert_allclose(L1 @ L1.T, m.M, atol=1e-12)


def test_saturation_and_growth_reporting() -> None:
    m = Metric(6)
    assert m.growth == 0.0 and m.saturation == pytest.approx(0.0)
    for _ in range(50):
        m.update(np.array([1.0, 0, 0, 0, 0, 0]))
    ev = np.linalg.eigvalsh(m.M)
    assert m.saturation == pytest.approx(1 - ev[0] / ev[-1])
    assert 0.0 < m.saturation < 1.0
    assert m.growth_rate == pytest.approx(0.012, rel=1e-6)  # aligned updates: eta each
    assert m.growth == pytest.approx(50 * 0.012, rel=1e-9)


def test_state_round_trip() -> None:
    m = _grown_metric(n=30)
    s = m.to_state()
    m2 = Metric.from_state(s)
    np.testing.assert_array_equal(m2.M, m.M)
    assert (m2.version, m2.updates, m2.eta, m2.eig_floor) == (m.version, m.updates, m.eta, 0.01)
    assert m2.growth_rate == pytest.approx(m.growth_rate)
    x, y = np.ones(12), np.arange(12.0)
    assert m2.distance(x, y) == m.distance(x, y)
    with pytest.raises(ValueError):
        Metric.from_state({"k": 2})


def test_m_is_read_only_from_outside() -> None:
    m = Metric(3)
    with pytest.raises(ValueError):
        m.M[0, 0] = 5.0


def test_tier_thresholds_classify_boundaries() -> None:
    t = TierThresholds()
    assert t.classify(0.0) is Tier.RETRIEVE
    assert t.classify(0.0499) is Tier.RETRIEVE
    assert t.classify(0.05) is Tier.AUGMENT
    assert t.classify(0.1999) is Tier.AUGMENT
    assert t.classify(0.20) is Tier.EXPAND
    assert t.classify(0.4999) is Tier.EXPAND
    assert t.classify(0.50) is Tier.EXPLORE
    assert t.classify(2.0) is Tier.EXPLORE
    assert t.classify(float("nan")) is Tier.EXPLORE
    assert Tier.RETRIEVE == "RETRIEVE"
    with pytest.raises(ValueError):
        TierThresholds(retrieve=0.3, augment=0.2)
