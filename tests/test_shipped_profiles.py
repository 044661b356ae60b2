"""The profiles that ship with the package (isagi/profiles): current, found, and reproducible.

Fast: each shipped profile's key is the key today's code, corpora and default
settings give the embedded model on its backend (so a change to the calibration
code or data that forgets to remake them fails here, not as a silent recalibration
on every user's first start), and a profile in the shipped directory is used
without calibrating. Model tier: rebuilding each one from scratch agrees with
the shipped file (prompt threshold within 2 %, each reply threshold above the other's
benign replies, basis subspace close).
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
# what the model tier rebuilds: both calibrations, 8 min 28 s (llama.cpp, one prompt at a time)
# and 4 min 51 s (NF4, batched) alone on 2 cores
REBUILT_IN_TESTS = ("llamacpp", "transformers")


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


@pytest.mark.model
@pytest.mark.timeout(3600)  # the whole calibration: 9 min 16 s alone on 2 cores (llama.cpp); transformers NF4 took over 18 min on a slower machine of this kind
@pytest.mark.parametrize("backend", REBUILT_IN_TESTS)
def test_rebuilding_a_shipped_profile_agrees_with_it(backend, tmp_path):
    from isagi.engines import load_engine
    from isagi.profile import build_for, load_profile

    path = _shipped().get(backend)
    assert path is not None, "no current shipped profile for " + backend
    shipped = load_profile(shipped_profiles_dir(), path.name)
    home = Path(__import__("os").environ.get("ISAGI_TEST_HOME") or tmp_path)
    settings = load_settings(environ={}, home=home, device="cpu", backend=backend)
    rebuilt = build_for(load_engine(settings), settings)
    assert rebuilt.key == shipped.key
    a, b = rebuilt.safety.threshold, shipped.safety.threshold
    assert abs(a - b) <= 0.02 * abs(b), ("threshold", a, b)
    # The window threshold (Safe OGD's check of steered replies) is REPLY_MARGIN x the largest
    # check-point TEH of the benign greedy replies, an extreme value of generated text: another
    # llama.cpp build (CPU features) decodes a few replies differently and moved it by 3.9 %
    # once (12.08 rebuilt against 12.57 shipped). What it promises is that no benign
    # calibration reply is over it, so each must clear the other build's benign replies.
    for mine, other in ((rebuilt.safety, shipped.safety), (shipped.safety, rebuilt.safety)):
        benign_max = other.details["reply"]["window"]["benign_reply_max"]
        assert mine.window_threshold > benign_max, (mine.window_threshold, benign_max)
    # The reply guard: its threshold is a quantile (1 %) of out-of-fold scores of the same
    # greedy replies, less extreme than their maximum; its held-out figures must agree too.
    r, s_ = rebuilt.safety, shipped.safety
    assert r.exchange_guard and s_.exchange_guard
    assert abs(r.reply_threshold - s_.reply_threshold) <= 0.05 * s_.reply_threshold, (r.reply_threshold, s_.reply_threshold)
    for key, tol in (("oof_auc", 0.02), ("oof_withheld_harmful", 0.08)):
        assert abs(r.details["reply"][key] - s_.details["reply"][key]) <= tol, (key, r.details["reply"][key],
                                                                               s_.details["reply"][key])
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
