"""The profiles that ship with the package (isagi/profiles): current, found, and reproducible.

Fast: each shipped profile's key is the key today's code, corpora and default
settings give the embedded model on its backend (so a change to the calibration
code or data that forgets to remake them fails here, not as a silent recalibration
on every user's first start), and a profile in the shipped directory is used
without calibrating. Model tier: rebuilding each one from scratch agrees with
the shipped file (thresholds within 2 %, basis subspace close).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from isagi.config import DEFAULT_SYSTEM_PROMPT, load_settings
from isagi.profile import load_or_build_profile, profile_key, save_profile, shipped_profiles_dir

# (backend, the engine's quantisation name) of the embedded default model
BACKENDS = {"llamacpp": "gguf-Q4_1", "transformers": "nf4"}
# what ships: a profile for each backend of the embedded model
SHIPPED = ("llamacpp", "transformers")
# what the model tier rebuilds: the llama.cpp calibration takes minutes on 2 cores; the NF4
# one through bitsandbytes' CPU kernels 38 min, beyond any test's time (rebuild it by hand:
# isagi/profiles/README.md)
REBUILT_IN_TESTS = ("llamacpp",)


def _shipped() -> dict[str, Path]:
    """backend -> shipped profile directory, by recomputing each key from its recorded inputs."""
    found: dict[str, Path] = {}
    for path in sorted(p for p in shipped_profiles_dir().iterdir() if (p / "profile.json").is_file()):
        meta = json.loads((path / "profile.json").read_text())
        for backend, quant in BACKENDS.items():
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
    for name in ("threshold", "reply_threshold"):
        a, b = getattr(rebuilt.safety, name), getattr(shipped.safety, name)
        assert abs(a - b) <= 0.02 * abs(b), (name, a, b)
    # principal angles between the two UGT bases: the subspaces agree
    cos = np.linalg.svd(shipped.basis.B.T.astype(np.float64) @ rebuilt.basis.B.astype(np.float64), compute_uv=False)
    assert cos.min() > 0.99, cos.min()
    assert abs(rebuilt.context_threshold - shipped.context_threshold) <= 0.02 * abs(shipped.context_threshold) + 1e-6
