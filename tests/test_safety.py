"""Unit tests of the geometric safety layer (no model): projector, TEH theorem, ROC rule, Snipe budget, state."""

from __future__ import annotations

import numpy as np
import pytest

from isagi.safety.baseline import seed_construction, seed_teh
from isagi.safety.calibration import calibrate_reply_threshold, roc_auc, roc_sweep, snipe
from isagi.safety.runtime import (
    ReplyGuard,
    SafetyProfile,
    category_of,
    project_safe,
    safe_point,
    safe_projector,
    teh,
)


def _orthonormal(d: int, m: int, seed: int = 0) -> np.ndarray:
    q, _ = np.linalg.qr(np.random.default_rng(seed).normal(size=(d, m)))
    return q


def _toy(seed: int = 0, d: int = 40, n: int = 60):
    """Benign states around 0, harmful states shifted along a category-specific direction."""
    rng = np.random.default_rng(seed)
    dirs = {c: v / np.linalg.norm(v) for c, v in zip("abc", rng.normal(size=(3, d)), strict=True)}
    harm = {c: rng.normal(size=(n, d)) + 6.0 * dirs[c] for c in dirs}
    ben = {c: rng.normal(size=(n, d)) for c in dirs}
    return harm, ben, dirs


def test_projector_is_symmetric_idempotent_and_kills_q():
    Q = _orthonormal(32, 5)
    P = safe_projector(Q)
    assert np.allclose(P, P.T)
    assert np.allclose(P @ P, P, atol=1e-12)
    assert np.allclose(P @ Q, 0.0, atol=1e-12)
    v = np.random.default_rng(1).normal(size=(7, 32))
    assert np.allclose(project_safe(Q, v), v @ P, atol=1e-12)


def test_teh_is_zero_after_safe_projection_for_random_states():
    rng = np.random.default_rng(2)
    Q = _orthonormal(64, 6, seed=3)
    c = rng.normal(size=64) * 3  # a centre with a forbidden component, as Snipe's is
    H = rng.normal(size=(200, 64)) * rng.uniform(0.1, 100, size=(200, 1))
    assert np.all(teh((Q, c), H) > 0)
    # Theorem, in the frame TEH is defined in: TEH(c + P_safe (h - c)) = 0.
    assert np.max(teh((Q, c), safe_point((Q, c), H))) < 1e-9
    assert np.max(teh((Q, c), c + (H - c) @ safe_projector(Q))) < 1e-9
    # With a centre that has no forbidden component, the raw form holds as well.
    c0 = project_safe(Q, c)
    assert np.max(teh((Q, c0), H @ safe_projector(Q))) < 1e-9


def test_teh_range_and_vectorisation():
    Q = _orthonormal(16, 2)
    c = np.zeros(16)
    assert teh((Q, c), Q[:, 0] * 5) == pytest.approx(100.0)
    H = np.random.default_rng(0).normal(size=(10, 16))
    vec = teh((Q, c), H)
    assert vec.shape == (10,) and np.all((vec >= 0) & (vec <= 100))
    assert vec[3] == pytest.approx(teh((Q, c), H[3]))


def test_roc_sweep_picks_best_f1_with_zero_false_positives():
    benign = np.array([1.0, 2.0, 3.0, 10.0])  # one benign outlier at 10
    harmful = np.array([4.0, 5.0, 6.0, 11.0, 12.0])
    roc = roc_sweep(harmful, benign)
    # Only thresholds >= 10 have zero FP; among them, 10 flags {11, 12}: F1 = 4/7 is the best.
    assert roc["threshold"] == pytest.approx(10.0)
    assert roc["tpr_at_threshold"] == pytest.approx(2 / 5)
    assert roc["fpr_at_threshold"] == 0.0
    # A lower threshold would have a better F1 but a false positive: the rule must refuse it.
    assert roc["f1"] < 2 * 5 / (2 * 5 + 1)
    assert roc["auc"] == pytest.approx(roc_auc(harmful, benign))
    assert roc["auc"] == pytest.approx(17 / 20)
    assert roc["tpr"][0] == 0.0 and roc["tpr"][-1] == 1.0 and roc["fpr"][-1] == 1.0


def test_roc_sweep_separable_case_flags_all_harmful():
    roc = roc_sweep(np.array([5.0, 6.0, 7.0]), np.array([1.0, 2.0]))
    assert roc["threshold"] == pytest.approx(2.0)
    assert roc["tpr_at_threshold"] == 1.0 and roc["auc"] == 1.0


def test_snipe_finds_separating_subspace_and_respects_budget():
    harm, ben, dirs = _toy()
    Q, c, det = snipe(harm, ben, benign_budget=0.2, max_dims=4)
    assert np.allclose(Q.T @ Q, np.eye(Q.shape[1]), atol=1e-9)
    assert det["benign_energy_used"] <= 0.2 + 1e-12
    for step in det["selected"]:
        assert step["benign_energy"] <= 0.2 + 1e-12
    # The true harmful directions lie (mostly) in span(Q).
    for v in dirs.values():
        assert np.linalg.norm(Q.T @ v) > 0.8
    H_h = np.concatenate(list(harm.values()))
    H_b = np.concatenate(list(ben.values()))
    assert roc_auc(teh((Q, c), H_h), teh((Q, c), H_b)) > 0.95


def test_snipe_budget_limits_dimensions():
    harm, ben, _ = _toy(seed=1)
    # Each direction captures ~1/d = 2.5 % of isotropic benign variance.
    _, _, tight = snipe(harm, ben, benign_budget=0.03, max_dims=4)
    _, _, loose = snipe(harm, ben, benign_budget=0.5, max_dims=4)
    assert len([s for s in tight["selected"] if not s.get("over_budget")]) <= 1
    assert tight["benign_energy_used"] <= 0.03 + 1e-12
    assert len(loose["selected"]) >= len(tight["selected"])


def test_snipe_centre_puts_benign_low():
    harm, ben, _ = _toy(seed=2)
    Q, c, _ = snipe(harm, ben, benign_budget=0.2, max_dims=3)
    H_b = np.concatenate(list(ben.values()))
    H_h = np.concatenate(list(harm.values()))
    assert np.median(teh((Q, c), H_h)) > np.median(teh((Q, c), H_b))


def _profile(seed: int = 0) -> SafetyProfile:
    harm, ben, dirs = _toy(seed)
    Q, c, det = snipe(harm, ben, benign_budget=0.2, max_dims=3)
    return SafetyProfile(
        Q=Q.astype(np.float32), centre=c.astype(np.float32), threshold=12.5, reply_threshold=20.0, layer=20,
        categories=list(det["categories"]), category_directions=det["category_directions"].astype(np.float32),
        category_bias=det["category_bias"].astype(np.float32),
        roc={"thresholds": [1.0, 0.5], "tpr": [0.0, 1.0], "fpr": [0.0, 1.0], "auc": 0.9},
        details={"selected": det["selected"], "nested": {"a": np.float64(1.5)}},
    ), dirs


def test_state_round_trip():
    prof, _ = _profile()
    state = prof.to_state()
    import json

    arrays = {k: v for k, v in state.items() if isinstance(v, np.ndarray)}
    meta = json.loads(json.dumps({k: v for k, v in state.items() if not isinstance(v, np.ndarray)}))
    back = SafetyProfile.from_state({**meta, **arrays})
    assert np.array_equal(back.Q, prof.Q) and np.array_equal(back.centre, prof.centre)
    assert back.threshold == prof.threshold and back.reply_threshold == prof.reply_threshold
    assert back.categories == prof.categories and back.layer == 20
    assert back.roc["auc"] == 0.9 and back.details["nested"]["a"] == 1.5
    h = np.random.default_rng(5).normal(size=prof.Q.shape[0])
    assert teh(back, h) == pytest.approx(teh(prof, h))


def test_from_state_rejects_mismatched_shapes():
    prof, _ = _profile()
    state = prof.to_state()
    state["centre"] = state["centre"][:-1]
    with pytest.raises(ValueError):
        SafetyProfile.from_state(state)


def test_category_of_names_the_shifted_category():
    prof, dirs = _profile(3)
    for name, v in dirs.items():
        assert category_of(prof, 6.0 * v) == name


def test_reply_guard_uses_threshold_and_window():
    prof, dirs = _profile(4)
    guard = ReplyGuard(prof, every=4)
    benign = np.zeros((12, prof.Q.shape[0]))
    over, value = guard.check(benign + prof.centre)  # exactly at the centre: TEH 0
    assert not over and value == 0.0
    harmful = np.tile(prof.centre + 50.0 * prof.Q[:, 0], (12, 1))
    over, value = guard.check(np.concatenate([benign + prof.centre, harmful]))
    assert over and value > prof.reply_threshold


def test_reply_threshold_is_above_every_benign_check_and_the_prompt_threshold():
    value, det = calibrate_reply_threshold([np.array([3.0, 7.0]), np.array([5.0])], prompt_threshold=4.0)
    assert value > 7.0 and det["benign_reply_max"] == 7.0
    value, _ = calibrate_reply_threshold([np.array([1.0])], prompt_threshold=4.0)
    assert value == 4.0


def test_seed_construction_picks_mean_difference_coordinates():
    rng = np.random.default_rng(0)
    d = 20
    ben = rng.normal(size=(50, d))
    harm = rng.normal(size=(50, d))
    harm[:, 3] += 8.0
    B, mu, det = seed_construction(harm, ben, k=10, m=1)
    assert B.shape == (d, 10) and np.allclose(B.T @ B, np.eye(10), atol=1e-9)
    col = B[:, det["coordinates"][0]]
    assert abs(col[3]) > 0.9  # the shifted axis is the top coordinate
    # Faithful to the research code: the centre is the pooled mean, so harmful and benign sit
    # symmetrically about it along that coordinate (one reason it fails out of sample).
    scores = seed_teh(B, mu, det["coordinates"], np.concatenate([harm, ben]))
    assert scores.shape == (100,) and np.all((scores >= 0) & (scores <= 100))


def test_leave_one_category_out_tests_each_category_on_a_fit_that_never_saw_it():
    """Category "b" is harmful along its own direction only: a fit without "b"
    does not know it, so its held-out AUC falls, while k-fold (which sees "b") does not."""
    from isagi.safety.calibration import cross_validate, leave_one_category_out

    rng = np.random.default_rng(0)
    d, n = 100, 60  # wide enough that a direction holds < 5 % of benign variance (the budget)
    benign = rng.normal(size=(2 * n, d))
    harm_a = rng.normal(size=(n, d)) + 4.0 * np.eye(d)[0]
    harm_b = rng.normal(size=(n, d)) + 4.0 * np.eye(d)[1]
    H = np.vstack([benign, harm_a, harm_b])
    labels = np.array([0] * (2 * n) + [1] * (2 * n))
    cats = np.array(["a"] * n + ["b"] * n + ["a"] * n + ["b"] * n)
    loco = leave_one_category_out(H, labels, cats)
    assert set(loco["per_category"]) == {"a", "b"}
    assert loco["per_category"]["b"]["auc"] < 0.8 < cross_validate(H, labels, cats)["auc"]
    assert loco["auc"] == pytest.approx(np.mean([v["auc"] for v in loco["per_category"].values()]))


def test_budget_threshold_flags_at_most_the_budget_and_tpr_at_fpr_reads_it():
    from isagi.safety.calibration import budget_threshold, tpr_at_fpr

    benign = np.arange(100, dtype=float)  # 0..99
    for budget in (0.0, 0.01, 0.05, 0.2):
        t = budget_threshold(benign, budget)
        assert (benign > t).mean() <= budget + 1e-12
        assert (benign >= t).mean() > budget  # the lowest such threshold: one step down would exceed it
    assert budget_threshold(benign, 0.0) == 99.0
    assert tpr_at_fpr(np.array([98.5, 99.5, 50.0, 120.0]), benign, 0.01) == 0.75  # threshold 98
