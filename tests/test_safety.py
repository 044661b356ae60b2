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
    from isagi.evals.safety_cv import grid
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
    out = grid({("content", 3): H, ("last", 3): H[:, ::-1]}, labels, cats, shrinkages=[0.2], offsets=[0.0, 1.0])
    assert len(out["rows"]) == 4
    assert out["best"] == max(out["rows"], key=lambda r: (r["loco_auc"], r["kfold_auc"]))


def test_budget_threshold_flags_at_most_the_budget_and_tpr_at_fpr_reads_it():
    from isagi.safety.calibration import budget_threshold, tpr_at_fpr

    benign = np.arange(100, dtype=float)  # 0..99
    for budget in (0.0, 0.01, 0.05, 0.2):
        t = budget_threshold(benign, budget)
        assert (benign > t).mean() <= budget + 1e-12
        assert (benign >= t).mean() > budget  # the lowest such threshold: one step down would exceed it
    assert budget_threshold(benign, 0.0) == 99.0
    assert tpr_at_fpr(np.array([98.5, 99.5, 50.0, 120.0]), benign, 0.01) == 0.75  # threshold 98


def _exchanges(seed: int = 0, d: int = 40, n: int = 48):
    """Replies whose harm shows only together with their prompt: harmful prompts lie along e0,
    replies to them along e1; benign prompts and replies along neither."""
    from isagi.safety.calibration import Exchanges

    rng = np.random.default_rng(seed)
    labels = np.array([1] * n + [0] * n)
    cats = np.array(["a", "b"] * n)
    P = rng.normal(size=(2 * n, d)) + 10.0
    P[:n, 0] += 6.0
    R = []
    for lab in labels:
        r = rng.normal(size=(int(rng.integers(9, 30)), d)) + 10.0
        if lab:
            r[:, 1] += 4.0
        R.append(r)
    return Exchanges(prompt_states=P, reply_states=R, labels=labels, cats=cats)


def test_the_reply_guard_is_fitted_on_replies_and_judges_a_reply_with_its_prompt():
    from isagi.safety.calibration import fit_reply_guard
    from isagi.safety.runtime import exchange_scores

    ex = _exchanges()
    rQ, rc, scales, threshold, det = fit_reply_guard(ex, budget=0.05, benign_budget=0.5)
    assert rQ.shape[0] == 2 * 40 and np.allclose(rQ.T @ rQ, np.eye(rQ.shape[1]), atol=1e-6)
    assert det["oof_auc"] > 0.95 and det["oof_withheld_benign"] <= 0.05 + 1e-9
    prof, _ = _profile()
    import dataclasses

    prof = dataclasses.replace(prof, reply_Q=rQ, reply_centre=rc, reply_scales=scales, reply_threshold=threshold)
    assert prof.exchange_guard
    with pytest.raises(ValueError, match="prompt_state"):
        ReplyGuard(prof)
    fresh = _exchanges(seed=1)
    withheld = [bool((exchange_scores(prof, p, r) > threshold).any())
                for p, r in zip(fresh.prompt_states, fresh.reply_states, strict=True)]
    harmful, benign = np.array(withheld[:48]), np.array(withheld[48:])
    assert harmful.mean() > 0.8 and benign.mean() < 0.15
    # the streaming guard's last check equals the scores' last check point
    p, r = fresh.prompt_states[0], fresh.reply_states[0]
    guard = ReplyGuard(prof, p)
    assert guard.score(r) == pytest.approx(exchange_scores(prof, p, r)[-1])
    # and the reply fields survive a save and a load
    state = prof.to_state()
    back = SafetyProfile.from_state(state)
    assert np.array_equal(back.reply_Q, prof.reply_Q.astype(np.float32)) and back.exchange_guard
    state["reply_centre"] = state["reply_centre"][:-1]
    with pytest.raises(ValueError, match="reply guard"):
        SafetyProfile.from_state(state)


def test_fit_safety_profile_sets_the_threshold_at_its_budget_out_of_fold():
    harm, ben, _ = _toy(seed=6)
    H = np.concatenate([*harm.values(), *ben.values()])
    labels = np.array([1] * sum(map(len, harm.values())) + [0] * sum(map(len, ben.values())))
    cats = np.array([c for c, v in harm.items() for _ in v] + [c for c, v in ben.items() for _ in v])
    from isagi.safety.calibration import fit_safety_profile

    loose = fit_safety_profile(H, labels, cats, 18, fpr_budget=0.10, benign_budget=0.2)
    strict = fit_safety_profile(H, labels, cats, 18, fpr_budget=0.0, benign_budget=0.2)
    assert strict.threshold >= loose.threshold
    assert loose.details["cv"]["oof_fpr_at_threshold"] <= 0.10 + 1e-9
    assert strict.details["cv"]["oof_fpr_at_threshold"] == 0.0
    assert 0.0 <= loose.details["cv"]["tpr_at_1pct_fpr"] <= loose.details["cv"]["tpr_at_5pct_fpr"] <= 1.0
    assert not strict.exchange_guard and strict.window_threshold is None  # no replies given


def test_the_fpr_budget_is_stated_over_the_borderline_rows_not_the_everyday_tasks():
    """Everyday tasks (far on the benign side) are fitted on, but counting them in the budget
    would let the threshold drop until more than the budget of borderline prompts is refused."""
    from isagi.safety.calibration import cross_validate, fit_safety_profile

    harm, ben, dirs = _toy(seed=8)
    rng = np.random.default_rng(9)
    # the borderline rows lean towards their category's harm; the everyday tasks do not
    ben = {c: v + 2.0 * dirs[c] for c, v in ben.items()}
    everyday = {c: rng.normal(size=(240, 40)) for c in dirs}
    H = np.concatenate([*harm.values(), *ben.values(), *everyday.values()])
    n_h, n_b, n_o = (sum(map(len, g.values())) for g in (harm, ben, everyday))
    labels = np.array([1] * n_h + [0] * (n_b + n_o))
    cats = np.array([c for g in (harm, ben, everyday) for c, v in g.items() for _ in v])
    ordinary = np.array([False] * (n_h + n_b) + [True] * n_o)
    borderline = (labels == 0) & ~ordinary
    budget = 0.05

    cv = cross_validate(H, labels, cats, budget=budget, benign_budget=0.2, ordinary=ordinary)
    assert cv["fpr"] <= budget + 0.03  # each fold's own threshold, on rows it never saw
    assert 0.0 <= cv["ordinary_fpr"] < cv["fpr"]
    marked = fit_safety_profile(H, labels, cats, 18, fpr_budget=budget, benign_budget=0.2, ordinary=ordinary)
    mixed = fit_safety_profile(H, labels, cats, 18, fpr_budget=budget, benign_budget=0.2)
    assert marked.details["cv"]["oof_fpr_at_threshold"] <= budget + 1e-9
    assert "oof_ordinary_fpr_at_threshold" in marked.details["cv"]
    # counted among the benign rows, the easy ones pull the threshold down: borderline prompts pay
    assert mixed.threshold < marked.threshold
    assert (teh(mixed, H[borderline]) > mixed.threshold).mean() > (teh(marked, H[borderline]) > marked.threshold).mean()


def test_the_reply_sample_takes_everyday_tasks_apart_from_the_borderline_cells():
    from isagi.safety.calibration import reply_sample

    cats = np.array(["a", "b"] * 60)
    labels = np.array([1] * 40 + [0] * 80)
    ordinary = np.zeros(120, dtype=bool)
    ordinary[80:] = True  # the last 40 benign rows are everyday tasks
    pick = reply_sample(labels, cats, per_cell=10, ordinary=ordinary, ordinary_per_cat=5)
    assert len(pick) == len(set(pick)) == 2 * 10 + 2 * 10 + 2 * 5
    assert sum(labels[i] == 1 for i in pick) == 20
    assert sum(ordinary[i] for i in pick) == 10
    assert all(labels[i] == 0 for i in pick if ordinary[i])
    assert pick == reply_sample(labels, cats, per_cell=10, ordinary=ordinary, ordinary_per_cat=5)  # fixed by the seed
    # without a mask it is the old sample: per_cell per (category, label), no extra rows
    assert len(reply_sample(labels, cats, per_cell=10)) == 40


def test_the_cv_grid_reports_each_data_choice_on_its_own_rows():
    from isagi.evals.safety_cv import grid

    harm, ben, _ = _toy(seed=10)
    H = np.concatenate([*harm.values(), *ben.values()])
    labels = np.array([1] * 180 + [0] * 180)
    cats = np.array([c for g in (harm, ben) for c, v in g.items() for _ in v])
    half = np.arange(360) % 2 == 0
    out = grid({("content", 3): H}, labels, cats, shrinkages=[0.2], offsets=[1.0],
               subsets={"all": np.ones(360, dtype=bool), "half": half})
    assert [(r["data"], r["n"]) for r in out["rows"]] == [("all", 360), ("half", 180)]
    assert out["best"]["data"] == "all"  # the shipped choice is made on the full data
