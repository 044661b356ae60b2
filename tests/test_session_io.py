"""Session <-> .miku mapping, without a model: exact round trip and clear refusals."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from isagi.agent import Session
from isagi.cog import Metric
from isagi.errors import MikuError
from isagi.ids import new_session_id
from isagi.memory import TrajectoryMemory
from isagi.session_io import load_session, save_session
from isagi.ugt import fit_basis


def _engine(fingerprint: str = "fp-1", d: int = 32) -> SimpleNamespace:
    return SimpleNamespace(
        lm=SimpleNamespace(model_id="tiny", fingerprint=fingerprint, hidden_size=d),
        profile=SimpleNamespace(key="profile-key", layer=3),
        settings=SimpleNamespace(system_prompt="be brief"),
    )


def _session(d: int = 32, k: int = 8) -> Session:
    rng = np.random.default_rng(0)
    basis = fit_basis(rng.normal(size=(50, d)).astype(np.float32), k)
    s = Session(id=new_session_id(), basis=basis, metric=Metric(k), memory=TrajectoryMemory(k))
    for i in range(5):
        x = rng.normal(size=k).astype(np.float32)
        s.metric.update(x)
        s.memory.add(x, rng.normal(size=k).astype(np.float32), f"question {i} ✓", f"answer {i}", "EXPAND", i % 2,
                     content_key=f"question {i}")
        s.messages += [{"role": "user", "text": f"question {i} ✓", "time": 1.0 + i},
                       {"role": "assistant", "text": f"answer {i}", "tier": "EXPAND", "distance": 0.3, "verdict": "ok"}]
    s.title = "question 0"
    return s


def test_round_trip_is_exact(tmp_path: Path) -> None:
    s = _session()
    path = tmp_path / "nested" / "s.miku"
    save_session(_engine(), s, path)
    r = load_session(_engine(), path)
    assert r.id == s.id and r.title == s.title and r.messages == s.messages
    np.testing.assert_array_equal(r.metric.M, s.metric.M)
    np.testing.assert_array_equal(r.basis.B, s.basis.B)
    np.testing.assert_array_equal(r.basis.mu, s.basis.mu)
    a, b = s.memory.to_columns(), r.memory.to_columns()
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], np.ndarray):
            np.testing.assert_array_equal(a[key], b[key])
        else:
            assert list(a[key]) == list(b[key])
    q = np.random.default_rng(1).normal(size=8).astype(np.float32)
    assert s.memory.search(q, s.metric)[0] == r.memory.search(q, r.metric)[0]


def test_other_model_is_refused_unless_asked(tmp_path: Path) -> None:
    path = tmp_path / "s.miku"
    save_session(_engine("fp-1"), _session(), path)
    with pytest.raises(MikuError):
        load_session(_engine("fp-2"), path)
    with pytest.warns(UserWarning):
        load_session(_engine("fp-2"), path, allow_other_model=True)


def test_corrupted_file_is_one_clear_error_and_leaves_the_file(tmp_path: Path) -> None:
    path = tmp_path / "s.miku"
    save_session(_engine(), _session(), path)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(MikuError):
        load_session(_engine(), path)
    assert path.read_bytes() == bytes(data)


def test_hidden_size_mismatch_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "s.miku"
    save_session(_engine(), _session(), path)
    with pytest.raises(MikuError, match="hidden size"):
        load_session(_engine(d=64), path)
