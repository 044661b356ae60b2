"""Unit tests of the prompt probe and the reply guard's probe (no model): the readout's geometry,
the folds, the two-budget threshold, the build's fit on synthetic states and the CV grid."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from isagi.safety.build import Corpus, Exchanges, fit_reply_guard, fit_safety_profile, reply_sample
from isagi.safety.probe import (
    BenignKinds,
    fit_readout,
    group_folds,
    out_of_fold,
    quantile_threshold,
    two_budget_threshold,
)
from isagi.safety.runtime import (
    ReplyGuard,
    SafetyProfile,
    category_of,
    exchange_scores,
    exchange_states,
    project_safe,
    safe_point,
    teh,
)

D = 24  # one layer's width in these toy states
LAYERS = [6, 12]


def _corpus(seed: int = 0, n: int = 80) -> Corpus:
    """Two layers side by side. Harmful rows lean along e0 of the first layer and e1 of the second,
    by category; look-alikes lean a third of the way; ordinary rows do not lean; twin pairs share a group."""
    rng = np.random.default_rng(seed)
    rows, labels, cats, groups, kinds = [], [], [], [], []
    for i in range(n):
        cat = "ab"[i % 2]
        push = np.zeros(2 * D)
        push[0 if cat == "a" else 2] = 3.0
        push[D + 1] = 3.0
        for label, kind, scale in ((1, "", 1.0), (0, "lookalike", 0.3), (0, "ordinary", 0.0)):
            rows.append(rng.normal(size=2 * D) + scale * push)
            labels.append(label)
            cats.append(cat)
            groups.append(f"pair:{i}" if kind != "ordinary" else f"row:{i}")
            kinds.append(kind)
    kind = np.array(kinds)
    return Corpus(X=np.array(rows), labels=np.array(labels), cats=np.array(cats), groups=groups,
                  sources=np.array(["toy"] * len(rows)),
                  kinds=BenignKinds(ordinary=kind == "ordinary", lookalike=kind == "lookalike"))


def test_a_readout_is_a_probe_written_as_an_orthonormal_subspace():
    c = _corpus()
    r = fit_readout(c.X, c.labels, [D, D], C=1.0)
    assert r.Q.shape == (2 * D, 2) and np.allclose(r.Q.T @ r.Q, np.eye(2), atol=1e-9)
    assert np.allclose(r.Q[D:, 0], 0) and np.allclose(r.Q[:D, 1], 0)  # one column per layer, in its block
    assert np.all(r.weights > 0)
    # the probe found the harmful directions: most of each column's weight is on them
    assert abs(r.Q[D + 1, 1]) > 0.6 and np.hypot(r.Q[0, 0], r.Q[2, 0]) > 0.6
    # the logit is the sklearn probe's own decision function
    from sklearn.linear_model import LogisticRegression

    mean, scale = c.X.mean(0), c.X.std(0) + 1e-6
    ref = LogisticRegression(C=1.0, class_weight="balanced", max_iter=3000, tol=1e-5).fit((c.X - mean) / scale, c.labels)
    assert np.allclose(r.logits(c.X), ref.decision_function((c.X - mean) / scale), atol=1e-6)


def test_teh_depends_only_on_the_forbidden_coordinates_so_safe_steps_cannot_move_it():
    c = _corpus(1)
    r = fit_readout(c.X, c.labels, [D, D], C=1.0)
    rng = np.random.default_rng(2)
    H = rng.normal(size=(50, 2 * D)) * 3
    V = rng.normal(size=(50, 2 * D)) * 10
    before = teh(r, H)
    assert np.all((before > 0) & (before < 100))
    # Safe OGD's theorem for the probe: a step projected by P_safe = I - QQ^T leaves TEH unchanged ...
    assert np.allclose(teh(r, H + project_safe(r.Q, V)), before, atol=1e-9)
    # ... and the state with its forbidden component removed reads as the benign centre does
    assert np.allclose(teh(r, safe_point((r.Q, r.centre), H)), teh(r, r.centre), atol=1e-9)
    # while a step along Q moves it, in the direction of the weights
    assert np.all(teh(r, H + 5.0 * r.Q @ r.weights) > before)


def test_group_folds_keep_every_group_whole_and_cover_every_row():
    groups = [f"pair:{i // 3}" for i in range(30)] + [f"row:{i}" for i in range(20)]
    folds = group_folds(groups, 5)
    assert sorted(np.concatenate(folds).tolist()) == list(range(50))
    for fold in folds:
        inside = {groups[i] for i in fold}
        assert all(groups[j] not in inside for other in folds if other is not fold for j in other)
    assert [f.tolist() for f in folds] == [f.tolist() for f in group_folds(groups, 5)]  # fixed by the seed


def test_the_two_budget_threshold_holds_both_budgets_and_is_the_lowest_that_does():
    rng = np.random.default_rng(0)
    scores = np.concatenate([rng.normal(0, 1, 500), rng.normal(2, 1, 300)])  # ordinary, then look-alikes
    kinds = BenignKinds(ordinary=np.arange(800) < 500, lookalike=np.arange(800) >= 500)
    t, cost = two_budget_threshold(scores, kinds, ordinary_budget=0.02, lookalike_budget=0.10)
    assert cost["ordinary_fpr"] <= 0.02 and cost["lookalike_fpr"] <= 0.10
    assert t == max(quantile_threshold(scores[:500], 0.02), quantile_threshold(scores[500:], 0.10))
    assert cost["bound_by"] == "lookalike"  # the look-alikes sit higher: their budget binds
    # a budget over every benign row at once would let more look-alikes through than stated
    mixed = quantile_threshold(scores, 0.06)
    assert (scores[500:] > mixed).mean() > 0.10


def test_fit_safety_profile_sets_its_threshold_out_of_fold_and_round_trips():
    c = _corpus(3, n=120)
    prof = fit_safety_profile(c, LAYERS, C=0.5, ordinary_budget=0.02, lookalike_budget=0.10)
    assert prof.read_layers == LAYERS and prof.layer == 12 and prof.layer_width == D
    rule = prof.details["threshold_rule"]
    assert rule["ordinary_fpr"] <= 0.02 + 1e-9 and rule["lookalike_fpr"] <= 0.10 + 1e-9
    cv = prof.details["cv"]
    assert cv["oof_auc"] > 0.85 and cv["oof_tpr_at_threshold"] > 0.5
    assert set(cv["by_category"]) == {"a", "b"} and set(cv["by_source"]) == {"toy"}
    # the verdict is TEH over the threshold: the number shown and the refusal agree
    flagged = teh(prof, c.X) > prof.threshold
    assert flagged[c.labels == 1].mean() > 0.6 and flagged[c.kinds.ordinary].mean() < 0.1
    # categories of the refusal message
    assert category_of(prof, c.X[(c.labels == 1) & (c.cats == "a")].mean(0)) == "a"
    import json

    state = prof.to_state()
    arrays = {k: v for k, v in state.items() if isinstance(v, np.ndarray)}
    meta = json.loads(json.dumps({k: v for k, v in state.items() if not isinstance(v, np.ndarray)}))
    back = SafetyProfile.from_state({**meta, **arrays})
    assert back.read_layers == LAYERS and np.allclose(teh(back, c.X), teh(prof, c.X), atol=1e-3)
    state["Q"] = state["Q"][:-1]
    with pytest.raises(ValueError):
        SafetyProfile.from_state({**meta, **{**arrays, "Q": state["Q"], "centre": state["centre"][:-1]}})


def _replies(c: Corpus, rows: np.ndarray, seed: int) -> list[np.ndarray]:
    """Replies whose states (both read-out layers side by side) stay near their prompt's: a harmful
    prompt's reply leans as harmful rows do, a benign prompt's does not."""
    rng = np.random.default_rng(seed)
    return [c.X[i] + rng.normal(size=(int(rng.integers(9, 30)), c.X.shape[1])) * 0.5 for i in rows]


def _exchanges(c: Corpus, prof: SafetyProfile, seed: int = 0) -> Exchanges:
    rows = np.arange(seed % 2, len(c.labels), 2)
    logits = np.asarray(prof.readout().logits(c.X[rows]))
    return Exchanges(reply_states=_replies(c, rows, seed), prompt_logits=logits, labels=c.labels[rows], cats=c.cats[rows],
                     kinds=BenignKinds(ordinary=c.kinds.ordinary[rows], lookalike=c.kinds.lookalike[rows]))


def _with_reply_guard(prof: SafetyProfile, fitted: tuple) -> SafetyProfile:
    readout, scales, threshold, _ = fitted
    return dataclasses.replace(prof, reply_Q=readout.Q, reply_centre=readout.centre, reply_scales=scales,
                               reply_weights=readout.weights, reply_bias=readout.bias,
                               reply_threshold=100.0 / (1.0 + np.exp(-threshold)))


def test_the_reply_guard_reads_replies_through_the_prompt_probe_and_judges_them_with_their_prompt():
    c = _corpus(4)
    prof = fit_safety_profile(c, LAYERS, C=0.5)
    fitted = fit_reply_guard(_exchanges(c, prof), prof.readout(), ordinary_budget=0.05, lookalike_budget=0.05, C=1.0)
    readout, scales, threshold, det = fitted
    assert readout.Q.shape == (2, 2) and scales.shape == (2,)
    assert det["oof_auc"] > 0.95 and det["oof_withheld_benign"] <= 0.05 + 1e-9
    # each kind of benign reply within its own budget: the look-alikes lean toward harm, so
    # they bind the threshold and one budget over all benign replies would let twice as many go
    rule = det["threshold_rule"]
    assert rule["ordinary_fpr"] <= 0.05 + 1e-9 and rule["lookalike_fpr"] <= 0.05 + 1e-9
    assert rule["bound_by"] == "lookalike"
    guarded = _with_reply_guard(prof, fitted)
    assert guarded.exchange_guard
    with pytest.raises(ValueError, match="prompt_state"):
        ReplyGuard(guarded)
    # the exchange state: the probe's logit of each window, and of the prompt, at unit size
    p, r = c.X[1], _replies(c, np.array([1]), 9)[0]
    z = float(prof.readout().logits(p)[0])
    x = exchange_states(prof.readout(), r, z, scales)
    assert x.shape == (len(range(8, len(r) + 1, 8)) + (len(r) % 8 > 0), 2)
    assert np.allclose(x[:, 1], z / scales[1])
    assert x[0, 0] == pytest.approx(float(prof.readout().logits(r[:8].mean(axis=0))[0]) / scales[0])
    assert ReplyGuard(guarded, p).layers == LAYERS
    assert ReplyGuard(guarded, p).score(r) == pytest.approx(exchange_scores(guarded, p, r)[-1])
    assert ReplyGuard(guarded, p).score(r) == pytest.approx(teh(guarded.reply_readout(), x[-1]))
    # replies it never saw: those to harmful prompts withheld, those to benign ones let through
    rows = np.arange(len(c.labels))
    fresh = _replies(c, rows, 11)
    withheld = np.array([bool((exchange_scores(guarded, c.X[i], fresh[i]) > guarded.reply_threshold).any())
                         for i in rows])
    assert withheld[c.labels == 1].mean() > 0.8 and withheld[c.labels == 0].mean() < 0.15
    # Safe OGD at the profile's layer (the last block) projects out the probe's directions there,
    # which the reply guard reads too: a steered reply reads exactly as the unsteered one
    Q_L, _ = guarded.layer_subspace(guarded.layer)
    assert Q_L.shape[0] == D and np.allclose(Q_L.T @ Q_L, np.eye(Q_L.shape[1]), atol=1e-9)
    step = np.concatenate([np.zeros(D), project_safe(Q_L, np.random.default_rng(5).normal(size=D) * 20)])
    assert np.allclose(exchange_scores(guarded, p, r + step), exchange_scores(guarded, p, r), atol=1e-8)
    state = guarded.to_state()
    back = SafetyProfile.from_state(state)
    assert back.exchange_guard and back.reply_weights is not None
    assert ReplyGuard(back, p).score(r) == pytest.approx(ReplyGuard(guarded, p).score(r), abs=1e-3)
    state["reply_centre"] = state["reply_centre"][:-1]
    with pytest.raises(ValueError, match="reply guard"):
        SafetyProfile.from_state(state)


def test_the_reply_sample_takes_every_source_and_kind_and_is_fixed():
    harmful = {"label": "harmful", "benign_kind": None}
    look = {"label": "benign", "benign_kind": "lookalike"}
    ordinary = {"label": "benign", "benign_kind": "ordinary"}
    rows = ([{"source_group": "x", **harmful}] * 30 + [{"source_group": "x", **look}] * 30
            + [{"source_group": "x", **ordinary}] * 30 + [{"source_group": "y", **harmful}] * 5
            + [{"source_group": "y", **ordinary}] * 2)
    per = {"harmful": 10, "lookalike": 12, "ordinary": 4}
    pick = reply_sample(rows, per_source=per)
    assert len(pick) == len(set(pick)) == 10 + 12 + 4 + 5 + 2
    assert sum(rows[i]["benign_kind"] == "lookalike" for i in pick) == 12
    assert sum(rows[i]["benign_kind"] == "ordinary" for i in pick) == 4 + 2
    assert sum(rows[i]["source_group"] == "y" for i in pick) == 5 + 2
    assert pick == reply_sample(rows, per_source=per)


def test_out_of_fold_scores_come_from_probes_that_never_saw_the_row():
    """A row whose label contradicts its state is scored by its fold's probe, so out of fold it
    reads as its state says, while a probe fitted on it (in sample, weakly regularised) bends."""
    c = _corpus(5)
    y = c.labels.copy()
    odd = int(np.flatnonzero(c.kinds.ordinary)[0])
    y[odd] = 1
    oof = out_of_fold(c.X, y, [D, D], group_folds(c.groups), C=1.0)
    inside = fit_readout(c.X, y, [D, D], C=1.0).logits(c.X)
    assert oof[odd] < inside[odd]


def test_the_cv_grid_measures_every_setting_and_holds_each_source_and_category_out():
    from isagi.evals.safety_cv import grid

    c = _corpus(6, n=60)
    sources = np.array(["s1", "s2"] * (len(c.labels) // 2))
    c = dataclasses.replace(c, sources=sources)
    states = {6: c.X[:, :D], 12: c.X[:, D:]}
    from isagi.safety.probe import ProbeSpec

    out = grid(c, states, [[12], [6, 12]], [ProbeSpec("logistic", C=0.1), ProbeSpec("logistic", C=1.0)])
    assert [(r["layers"], r["probe"]) for r in out["rows"]] == [
        ("12", "logistic C=0.1"), ("12", "logistic C=1"), ("6+12", "logistic C=0.1"), ("6+12", "logistic C=1")]
    for r in out["rows"]:
        assert set(r["loso"]) == {"s1", "s2"} and set(r["loco"]) == {"a", "b"}
        assert 0.0 <= r["loso_harmful_flagged"] <= 1.0
    # the harm the two categories share lies in layer 12; layer 6 holds each category's own: a
    # category held out is found by layer 12 and missed once layer 6 is fitted to the other one,
    # so the held-out figures, not the in-sample ones, choose layer 12 alone
    alone = max(r["loco_harmful_flagged"] for r in out["rows"] if r["layers"] == "12")
    assert alone > max(r["loco_harmful_flagged"] for r in out["rows"] if r["layers"] == "6+12")
    assert out["best"]["layers"] == "12"


def _ring(seed: int = 0, n: int = 1500) -> Corpus:
    """Harm far from the centre along e0 of the first layer on *either* side; benign rows near it:
    no single direction separates them, a hidden layer does."""
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(2 * n, 2 * D)) * 0.5
    y = np.array([1] * n + [0] * n)
    X[:n, 0] += np.where(rng.random(n) < 0.5, -3.0, 3.0)
    kind = np.array([""] * n + ["ordinary"] * n)
    return Corpus(X=X, labels=y, cats=np.array(["a"] * (2 * n)), groups=[f"row:{i}" for i in range(2 * n)],
                  sources=np.array(["toy"] * (2 * n)),
                  kinds=BenignKinds(ordinary=kind == "ordinary", lookalike=np.zeros(2 * n, bool)))


def test_the_mlp_probe_reads_what_no_single_direction_can_through_an_orthonormal_block_subspace():
    from isagi.safety.calibration import roc_auc
    from isagi.safety.probe import ProbeSpec

    c, held = _ring(0), _ring(1)
    spec = ProbeSpec("mlp", alpha=1.0, hidden=4, members=3)
    mlp = fit_readout(c.X, c.labels, [D, D], spec=spec)
    linear = fit_readout(c.X, c.labels, [D, D], C=1.0)
    auc = lambda r: roc_auc(r.logits(held.X)[held.labels == 1], r.logits(held.X)[held.labels == 0])  # noqa: E731
    assert auc(mlp) > 0.95 and auc(linear) < 0.75
    # the forbidden subspace: orthonormal, block-diagonal, at most members x hidden directions a block
    Q = mlp.Q
    assert np.allclose(Q.T @ Q, np.eye(Q.shape[1]), atol=1e-9)
    first = np.linalg.norm(Q[:D], axis=0) > 1e-9
    assert np.all(first ^ (np.linalg.norm(Q[D:], axis=0) > 1e-9)) and first.sum() <= 12
    assert mlp.hidden is not None and mlp.hidden.shape == (Q.shape[1], 12)
    # Safe OGD's theorem holds for the MLP too: a projected step leaves TEH exactly where it was
    rng = np.random.default_rng(3)
    H, V = held.X[:40], rng.normal(size=(40, 2 * D)) * 10
    assert np.allclose(teh(mlp, H + project_safe(Q, V)), teh(mlp, H), atol=1e-9)
    assert np.allclose(teh(mlp, safe_point((Q, mlp.centre), H)), teh(mlp, mlp.centre), atol=1e-9)


def test_the_mlp_probes_members_are_their_seeds_networks_whatever_process_fits_them():
    """The members are fitted side by side in worker processes: member k must still be the network
    of seed ``seed + k`` on its own resample, so a probe of four members is exactly the average of
    the probe of members 0-1 and the probe of members 2-3 (a bug that gave two members one seed or
    one resample, or dropped a member's result, breaks the equality)."""
    from isagi.safety.probe import ProbeSpec

    c, held = _ring(0), _ring(1)
    spec = ProbeSpec("mlp", alpha=1.0, hidden=4, members=4)
    four = fit_readout(c.X, c.labels, [D, D], spec=spec)
    first = fit_readout(c.X, c.labels, [D, D], spec=dataclasses.replace(spec, members=2))
    second = fit_readout(c.X, c.labels, [D, D], spec=dataclasses.replace(spec, members=2, seed=2))
    assert np.allclose(four.logits(held.X), (first.logits(held.X) + second.logits(held.X)) / 2, atol=1e-9)
    assert not np.allclose(first.logits(held.X), second.logits(held.X), atol=1e-3)  # the seeds differ
    again = fit_readout(c.X, c.labels, [D, D], spec=spec)
    assert np.array_equal(again.logits(held.X), four.logits(held.X))  # fixed, run to run


def test_a_profile_with_the_mlp_probe_round_trips_and_scores_as_its_readout():
    from isagi.safety.probe import ProbeSpec

    c = _corpus(5, n=120)
    prof = fit_safety_profile(c, LAYERS, spec=ProbeSpec("mlp", alpha=1.0, hidden=4, members=2),
                              ordinary_budget=0.02, lookalike_budget=0.10)
    assert prof.hidden is not None and prof.details["probe"]["kind"] == "mlp"
    back = SafetyProfile.from_state(prof.to_state())
    assert np.allclose(teh(back, c.X), teh(prof, c.X), atol=1e-4)
    assert np.array_equal(teh(back, c.X) > back.threshold, teh(prof, c.X) > prof.threshold)
    broken = prof.to_state()
    broken["hidden"] = broken["hidden"][:-1]
    with pytest.raises(ValueError, match="hidden layer"):
        SafetyProfile.from_state(broken)


def test_a_profile_fitted_with_replies_of_its_corpus_rows_reads_their_out_of_fold_prompt_logits():
    """The build's path (replies named by their corpus rows): the reply head reads the prompt
    probe's out-of-fold logit of each row; the window check and Safe OGD's subspace still work."""
    c = _corpus(6)
    pick = np.arange(0, len(c.labels), 2)
    R = _replies(c, pick, 7)
    prof = fit_safety_profile(c, LAYERS, replies=(pick, R), C=0.5)
    assert prof.exchange_guard and prof.reply_scales is not None and prof.reply_scales.shape == (2,)
    assert prof.details["reply"]["calibrated"] is True and prof.details["reply"]["oof_auc"] > 0.9
    assert prof.window_threshold is not None and np.isfinite(prof.window_threshold)
    p, r = c.X[pick[0]], R[0]
    assert np.isfinite(ReplyGuard(prof, p).score(r))


def test_quantile_threshold_keeps_its_budget_on_scores_it_never_saw():
    """The threshold is a budget for *new* benign scores: over many draws of n scores and one more,
    the new one lands above the threshold at most ``budget`` of the time. The plain empirical
    quantile (at most budget·n of the n above) exceeds the budget by up to 1/(n+1): 2/162 = 1.2 %
    against a 1 % budget over 161 scores, as many as the reply guard once had look-alike replies."""
    rng = np.random.default_rng(0)
    n, budget, trials = 161, 0.01, 20000
    draws = rng.standard_normal((trials, n + 1))
    thresholds = np.array([quantile_threshold(row[:n], budget) for row in draws])
    over = (draws[:, n] > thresholds).mean()
    assert over <= budget  # expected 1/162 = 0.0062; the spread over 20000 trials is 0.0006
    # the empirical quantile the rule replaced: its expected rate is 2/162 = 0.0123
    plain = np.sort(draws[:, :n], axis=1)[:, n - 1 - int(np.floor(budget * n))]
    assert (draws[:, n] > plain).mean() > budget
    # within budget on the scores themselves too, and never above the largest
    assert all((row[:n] > t).mean() <= budget for row, t in zip(draws[:50], thresholds[:50], strict=True))
    assert quantile_threshold(np.arange(10.0), 0.001) == 9.0


def test_a_profiles_readout_is_cast_once_scores_as_a_fresh_one_and_follows_a_replaced_part():
    """Every prompt and reply check scores with the profile's read-out: it is kept with its arrays
    in float64 (made once, the same scores bit for bit as a read-out of the stored float32 arrays),
    and made again when the profile's probe is replaced."""
    from isagi.safety.probe import ProbeSpec
    from isagi.safety.runtime import Readout

    c = _corpus(7, n=120)
    prof = fit_safety_profile(c, LAYERS, spec=ProbeSpec("mlp", alpha=1.0, hidden=4, members=2),
                              ordinary_budget=0.02, lookalike_budget=0.10)
    prof = SafetyProfile.from_state(prof.to_state())  # as loaded: float32 arrays
    kept = prof.readout()
    assert isinstance(kept, Readout) and kept is prof.readout() and kept.Q.dtype == np.float64
    fresh = Readout(prof.Q, prof.centre, prof.weights, prof.bias, prof.hidden, prof.hidden_bias)
    assert np.array_equal(kept.logits(c.X), fresh.logits(c.X))
    prof.weights = -prof.weights
    flipped = prof.readout()
    assert flipped is not kept and np.allclose(flipped.logits(c.X), 2 * prof.bias - kept.logits(c.X), atol=1e-9)
