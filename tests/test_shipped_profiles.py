"""The profiles that ship with the package (isagi/profiles): current, found, and reproducible.

Fast: each shipped profile's key is the key today's code, corpora and default
settings give the embedded model on its backend (so a change to the calibration
code or data that forgets to remake them fails here, not as a silent recalibration
on every user's first start), and a profile in the shipped directory is used
without calibrating. Model tier (CI): each shipped profile scores fresh states of a sample of
its corpora as it scored them when fitted, and on llama.cpp a sample of its reply guard's own
calibration replies, decoded again, as when fitted. ``make rebuild-test`` (marker ``rebuild``,
the longest test by far): rebuilding the default backend's (llama.cpp) from scratch agrees with the shipped
file (prompt threshold within 2 %, each window threshold above the other's benign replies, the
reply guard's held-out figures, basis subspace close).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from isagi.config import DEFAULT_SYSTEM_PROMPT, load_settings
from isagi.profile import (
    SHIPPED_QUANTS,
    load_or_build_profile,
    profile_key,
    save_profile,
    shipped_profiles_dir,
)

# what ships: a profile for each backend of the embedded model
SHIPPED = ("llamacpp", "transformers")


def _shipped() -> dict[str, Path]:
    """backend -> shipped profile directory, by recomputing each key from its recorded inputs."""
    found: dict[str, Path] = {}
    for path in sorted(p for p in shipped_profiles_dir().iterdir() if (p / "profile.json").is_file()):
        meta = json.loads((path / "profile.json").read_text())
        for backend, quant in SHIPPED_QUANTS.items():
            key = profile_key(meta["model_fingerprint"], quant, meta["layer"], meta["k"], DEFAULT_SYSTEM_PROMPT,
                              meta["safety"]["layer"], backend)
            if key == path.name:
                found[backend] = path
    return found


def test_the_default_backend_ships_a_current_profile_of_the_default_model():
    dirs = [p for p in shipped_profiles_dir().iterdir() if p.is_dir()]
    found = _shipped()
    assert set(found) == set(SHIPPED), (
        f"stale or missing shipped profiles ({[p.name for p in dirs]}): remake them as "
        "isagi/profiles/README.md says"
    )
    assert len(dirs) == len(SHIPPED), "only the current profiles ship"
    for path in found.values():
        assert sum(f.stat().st_size for f in path.iterdir()) < 2_000_000  # small package data


def test_a_shipped_profile_is_used_without_calibrating(tmp_path, monkeypatch):
    import isagi.profile as profile_mod
    from tests.tiny_engine import tiny_lm, tiny_profile, tiny_settings

    lm, settings = tiny_lm(), tiny_settings(tmp_path / "home")
    key = profile_mod.key_for(lm, settings)[0]
    shipped = tmp_path / "shipped"
    src = tiny_profile()
    save_profile(type(src)(**{**src.__dict__, "key": key}), shipped)
    monkeypatch.setattr(profile_mod, "shipped_profiles_dir", lambda: shipped)
    monkeypatch.setattr(profile_mod, "build_for", lambda *a, **k: pytest.fail("calibrated despite a shipped profile"))
    got = load_or_build_profile(lm, settings)
    assert got.key == key and np.allclose(got.basis.B, src.basis.B)
    assert not (settings.profiles_dir / key).exists()  # read in place, not copied into the data directory


def _rebuild(backend: str, tmp_path: Path):
    from isagi.engines import load_engine
    from isagi.profile import build_for

    home = Path(__import__("os").environ.get("ISAGI_TEST_HOME") or tmp_path)
    settings = load_settings(environ={}, home=home, device="cpu", backend=backend)
    return build_for(load_engine(settings), settings)


def _assert_prompt_side_agrees(rebuilt, shipped) -> None:
    """The parts fitted on prompts alone: the key, the prompt guard, the UGT basis, the context threshold."""
    assert rebuilt.key == shipped.key
    a, b = rebuilt.safety.threshold, shipped.safety.threshold
    assert abs(a - b) <= 0.02 * abs(b), ("threshold", a, b)
    assert rebuilt.safety.exchange_guard
    # Principal angles between the two UGT bases. The leading half of the directions agree
    # closely; the last ones have near-equal singular values (about 44, 43.6, 42.6 of 492 at
    # the top) and rotate among themselves between llama.cpp builds (the smallest cosine was
    # 0.88 between this machine's build and the shipped file's), so the whole subspace is held
    # to its mean squared cosine (0.979 there) instead of its worst angle.
    cos = np.linalg.svd(shipped.basis.B.T.astype(np.float64) @ rebuilt.basis.B.astype(np.float64), compute_uv=False)
    assert cos[: len(cos) // 2].min() > 0.99, cos
    assert (cos**2).mean() > 0.95, cos
    # the follow-up (context) threshold is an extreme value of the follow-up pairs' distances
    # too: 0.0985 rebuilt here against 0.0954 shipped (3.2 %)
    assert abs(rebuilt.context_threshold - shipped.context_threshold) <= 0.05 * abs(shipped.context_threshold)


@pytest.mark.model
@pytest.mark.rebuild
@pytest.mark.timeout(3600)  # the whole calibration (its time: isagi/profiles/README.md)
def test_rebuilding_the_default_backends_shipped_profile_agrees_with_it(tmp_path):
    """The whole calibration of the default backend (llama.cpp), replies included, from scratch."""
    from isagi.profile import load_profile

    path = _shipped().get("llamacpp")
    assert path is not None, "no current shipped profile for llamacpp"
    shipped = load_profile(shipped_profiles_dir(), path.name)
    rebuilt = _rebuild("llamacpp", tmp_path)
    _assert_prompt_side_agrees(rebuilt, shipped)
    # The window threshold (Safe OGD's check of steered replies) is REPLY_MARGIN x the largest
    # check-point TEH of the benign greedy replies, an extreme value of generated text: another
    # llama.cpp build (CPU features) decodes a few replies differently and moved it by 3.9 %
    # once (12.08 rebuilt against 12.57 shipped). What it promises is that no benign
    # calibration reply is over it, so each must clear the other build's benign replies.
    for mine, other in ((rebuilt.safety, shipped.safety), (shipped.safety, rebuilt.safety)):
        benign_max = other.details["reply"]["window"]["benign_reply_max"]
        assert mine.window_threshold > benign_max, (mine.window_threshold, benign_max)
    # The reply guard: its threshold is a quantile (1 %) of out-of-fold scores of each kind of
    # benign reply (the 2nd highest of 175 or of 161), so it moves with the few replies a build
    # decodes differently: transformers NF4 on another CPU moved it by 8 % (9.40 against 10.23).
    # What it promises is held instead: both withhold at most each kind's budget of benign
    # replies out of fold, and they separate harmful from benign replies alike.
    r, s_ = rebuilt.safety.details["reply"], shipped.safety.details["reply"]
    for det in (r, s_):
        rule = det["threshold_rule"]
        for kind in ("ordinary", "lookalike"):
            assert rule[f"{kind}_fpr"] <= rule[f"{kind}_budget"] + 1e-9, det
    for key, tol in (("oof_auc", 0.02), ("oof_withheld_harmful", 0.08)):
        assert abs(r[key] - s_[key]) <= tol, (key, r[key], s_[key])


@pytest.mark.model
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("backend", SHIPPED)
def test_a_shipped_profile_scores_fresh_states_of_its_corpora_as_when_fitted(backend: str, request: pytest.FixtureRequest):
    """What CI checks of each shipped profile on every run (the whole rebuild is
    ``make rebuild-test``, llama.cpp only; isagi/profiles/README.md says why).

    The hidden states of a fixed sample of the profile's own corpora, computed now, must be
    scored by it at least as well as its recorded out-of-fold ROC (these rows were fitted on),
    and its basis must explain the share of variance it recorded, within the sample's binomial
    error. On the
    default backend (llama.cpp) a sample of the reply guard's own calibration replies is
    decoded again too: no benign one may reach the window threshold, and the guard must
    separate them as it did out of fold. A profile fitted on another model, layer, pooling
    or backend (a wrong re-key: the NF4 profile on llama.cpp's states) fails here."""
    from isagi.data import load_zones
    from isagi.data.safety import load_safety_corpus
    from isagi.manifold.pooling import prompt_hidden_states
    from isagi.profile import load_profile
    from isagi.safety.build import REPLY_CALIBRATION_TOKENS, chat, reply_sample, safety_states
    from isagi.safety.calibration import roc_auc
    from isagi.safety.runtime import exchange_scores, reply_window_scores, teh, window_threshold

    path = _shipped().get(backend)
    assert path is not None, f"no current shipped profile for {backend}"
    shipped = load_profile(shipped_profiles_dir(), path.name)
    safety = shipped.safety
    lm = request.getfixturevalue("default_llama" if backend == "llamacpp" else "default_hf")
    rng = np.random.default_rng(0)

    def chats(texts: list[str]) -> list[list[dict[str, str]]]:
        return [chat(DEFAULT_SYSTEM_PROMPT, t) for t in texts]

    def within_binomial(got: float, want: float, n: int, slack: float) -> bool:
        return abs(got - want) <= 3 * np.sqrt(want * (1 - want) / n) + slack

    def binomial(want: float, n: int) -> float:
        return 3 * np.sqrt(max(want * (1 - want), 0.01) / n)

    rows = load_safety_corpus()
    y = np.array([r["label"] == "harmful" for r in rows])
    n = 100  # per label
    pick = np.concatenate([rng.choice(np.flatnonzero(y == label), size=n, replace=False) for label in (True, False)])
    H = safety_states(lm, chats([rows[i]["text"] for i in pick]), safety.read_layers)
    scores, yy = teh(safety, H), y[pick]
    # The profile records its figures out of fold; these rows were fitted on, so they must score
    # at least as well (a profile of another model, layer or backend scores far worse)
    roc = safety.roc
    assert roc_auc(scores[yy], scores[~yy]) >= roc["auc"] - 0.03, (roc_auc(scores[yy], scores[~yy]), roc["auc"])
    tpr, fpr = (scores[yy] > safety.threshold).mean(), (scores[~yy] > safety.threshold).mean()
    assert tpr >= roc["tpr_at_threshold"] - binomial(roc["tpr_at_threshold"], n) - 0.02, (tpr, roc)
    assert fpr <= roc["fpr_at_threshold"] + binomial(roc["fpr_at_threshold"], n) + 0.02, (fpr, roc)

    zones = load_zones()
    Z = prompt_hidden_states(lm, chats([zones[i]["text"] for i in rng.choice(len(zones), size=n, replace=False)]),
                             shipped.layer).astype(np.float64)
    Zc = Z - shipped.basis.mu.astype(np.float64)
    explained = float(np.sum((Zc @ shipped.basis.B.astype(np.float64)) ** 2) / np.sum(Zc**2))
    assert abs(explained - shipped.basis.explained) <= 0.06, (explained, shipped.basis.explained)

    if backend != "llamacpp":
        return  # NF4 decoding on 2 cores: the replies of the transformers profile are left to its rebuild
    labels = y.astype(int)
    fitted_on = np.array(reply_sample(rows))
    m = 24  # per label, among the calibration rows the reply guard was fitted on
    sample = np.concatenate([rng.choice(fitted_on[labels[fitted_on] == label], size=m, replace=False) for label in (1, 0)])
    asked = chats([rows[i]["text"] for i in sample])
    P = safety_states(lm, asked, safety.read_layers)
    R = lm.reply_states(asked, safety.read_layers, max_new_tokens=REPLY_CALIBRATION_TOKENS)
    harmful = labels[sample] == 1
    guard = np.array([exchange_scores(safety, p, r).max() for p, r in zip(P, R, strict=True)])
    d = safety.layer_width  # Safe OGD's window check reads the safety layer's block
    windows = np.array([reply_window_scores(safety, r[:, -d:]).max() for r, h in zip(R, harmful, strict=True) if not h])
    det = safety.details["reply"]
    assert windows.max() < window_threshold(safety), (windows.max(), window_threshold(safety))
    assert roc_auc(guard[harmful], guard[~harmful]) >= det["oof_auc"] - 0.08, (roc_auc(guard[harmful], guard[~harmful]), det)
    withheld = guard > safety.reply_threshold
    assert within_binomial(withheld[harmful].mean(), det["oof_withheld_harmful"], m, 0.05), (withheld[harmful].mean(), det)
    assert withheld[~harmful].sum() <= 1, (guard[~harmful], safety.reply_threshold)
