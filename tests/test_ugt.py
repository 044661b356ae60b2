"""UGT basis: orthonormality, no random padding, projection, zones, refinement."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from isagi.manifold.ugt import fit_basis, fit_zones, project, refine_basis, route, zone_separation


def _zoned_data(seed: int = 0, n_per: int = 40, d: int = 30, zones: int = 4):
    rng = np.random.default_rng(seed)
    centres = 3.0 * rng.standard_normal((zones, d))
    H, labels = [], []
    for z in range(zones):
        H.append(centres[z] + rng.standard_normal((n_per, d)) * np.linspace(0.2, 2.5, d))
        labels += [f"zone{z}"] * n_per
    return np.concatenate(H).astype(np.float32), labels


def test_basis_is_orthonormal_and_matches_principal_directions() -> None:
    H, _ = _zoned_data()
    b = fit_basis(H, 8)
    assert b.B.shape == (30, 8) and b.B.dtype == np.float32
    np.testing.assert_allclose(b.B.T @ b.B, np.eye(8), atol=1e-5)
    np.testing.assert_allclose(b.mu, H.mean(axis=0), atol=1e-5)
    # top eigenvectors of the covariance span the same subspace
    Hc = H.astype(np.float64) - H.mean(axis=0)
    ev, V = np.linalg.eigh(Hc.T @ Hc)
    V8 = V[:, ::-1][:, :8]
    np.testing.assert_allclose(np.abs(b.B.T @ V8), np.eye(8), atol=1e-3)
    assert np.all(np.diff(b.singular_values) <= 0)
    assert b.explained == pytest.approx(ev[::-1][:8].sum() / ev.sum(), rel=1e-5)


def test_no_random_padding_when_rank_is_below_k() -> None:
    rng = np.random.default_rng(1)
    H = (rng.standard_normal((50, 3)) @ rng.standard_normal((3, 20))) + 5.0  # centred rank 3
    with pytest.warns(RuntimeWarning, match="reduced from k=10 to k=3"):
        b = fit_basis(H, 10)
    assert b.k == 3
    np.testing.assert_allclose(b.B.T @ b.B, np.eye(3), atol=1e-5)
    # every column lies in the data's span: projecting it out leaves nothing
    Hc = H - H.mean(axis=0)
    _, _, Vt = np.linalg.svd(Hc, full_matrices=False)
    span = Vt[:3].T
    resid = b.B - span @ (span.T @ b.B)
    assert np.abs(resid).max() < 1e-5
    assert b.explained == pytest.approx(1.0, abs=1e-6)


def test_rank_limited_by_number_of_rows() -> None:
    rng = np.random.default_rng(2)
    H = rng.standard_normal((5, 40))  # centred rank 4
    with pytest.warns(RuntimeWarning):
        b = fit_basis(H, 64)
    assert b.k == 4


def test_full_rank_k_has_no_warning() -> None:
    H, _ = _zoned_data()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fit_basis(H, 30).k == 30


def test_project_centres_and_handles_batches() -> None:
    H, _ = _zoned_data()
    b = fit_basis(H, 5)
    X = project(b, H)
    assert X.shape == (H.shape[0], 5)
    np.testing.assert_allclose(X.mean(axis=0), 0.0, atol=1e-4)  # centred by mu
    np.testing.assert_allclose(project(b, H[3]), X[3], atol=1e-5)
    np.testing.assert_allclose(project(b, b.mu), 0.0, atol=1e-6)
    with pytest.raises(ValueError):
        project(b, np.zeros(7))


def test_bad_inputs_are_rejected() -> None:
    with pytest.raises(ValueError):
        fit_basis(np.ones((10, 4)), 2)  # all rows equal
    with pytest.raises(ValueError):
        fit_basis(np.ones(4), 2)
    with pytest.raises(ValueError):
        fit_basis(np.array([[0.0, np.nan], [1.0, 2.0]]), 1)


def test_zones_route_to_nearest_centroid_by_cosine() -> None:
    H, labels = _zoned_data()
    b = fit_basis(H, 10)
    X = project(b, H)
    zones = fit_zones(X, labels)
    assert zones.names == ["zone0", "zone1", "zone2", "zone3"]
    np.testing.assert_allclose(zones.centroids[1], X[40:80].mean(axis=0), atol=1e-5)
    correct = sum(route(zones, x)[0] == lab for x, lab in zip(X, labels, strict=True))
    assert correct / len(labels) > 0.9
    name, d = route(zones, 2.0 * zones.centroids[2])
    assert name == "zone2" and d == pytest.approx(0.0, abs=1e-6)
    assert route(zones, np.zeros(10))[1] == 1.0


def test_zone_separation_definition() -> None:
    X = np.array([[0.0, 0.0], [0.0, 2.0], [10.0, 0.0], [10.0, 2.0]])
    labels = ["a", "a", "b", "b"]
    # between: 2·5² + 2·5² = 100 ; within: 4·1² = 4
    assert zone_separation(X, labels) == pytest.approx(25.0)
    Q, _ = np.linalg.qr(np.random.default_rng(0).standard_normal((2, 2)))
    assert zone_separation(3.0 * X @ Q, labels) == pytest.approx(25.0)


def test_refine_keeps_orthonormality_and_never_lowers_separation() -> None:
    H, labels = _zoned_data(seed=3)
    b = fit_basis(H, 4)
    sep0 = zone_separation(project(b, H), labels)
    r, report = refine_basis(H, labels, b, steps=60, lr=0.1)
    np.testing.assert_allclose(r.B.T @ r.B, np.eye(4), atol=1e-5)
    assert r.B.shape == b.B.shape
    np.testing.assert_array_equal(r.mu, b.mu)
    sep1 = zone_separation(project(r, H), labels)
    assert report["separation_before"] == pytest.approx(sep0, rel=1e-4)
    assert report["separation_after"] == pytest.approx(sep1, rel=1e-4)
    assert sep1 >= sep0 * (1 - 1e-5)
    # the top-variance directions are not the most separating ones here
    assert sep1 > 1.05 * sep0 and report["steps"] > 0
    assert 0.0 < r.explained <= 1.0


def test_refine_needs_two_zones() -> None:
    H, _ = _zoned_data()
    b = fit_basis(H, 3)
    with pytest.raises(ValueError):
        refine_basis(H, ["x"] * H.shape[0], b)
