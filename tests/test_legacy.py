"""Import of the research code's miku-v1 pair (JSON + .pt), safely."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from isagi.errors import MikuError, StorageError
from storage.legacy import import_legacy, read_legacy, tensor_path, write_legacy
from storage.miku import read_miku
from tests.test_miku import make_state


def v1_pair(tmp_path: Path, n: int = 3, k: int = 4, d: int = 8) -> tuple[Path, dict, dict]:
    """A v1 pair written by hand from the layout documented in storage/legacy.py."""
    g = torch.Generator().manual_seed(0)
    tensors = {
        "metric": torch.eye(k, dtype=torch.float64) + 0.01,
        "basis": torch.randn(d, k, generator=g),
        "mu": torch.randn(d, generator=g),
        "trajectory_coords": torch.randn(n, k, generator=g),
        "response_coords": torch.randn(n, k, generator=g),
    }
    doc = {
        "version": "1.0",
        "model": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "created": "2025-03-01T12:00:00",
        "layer": 18,
        "metric_growth": 0.04,
        "settings": {"tau": 0.35, "tiers": ["RETRIEVE", "EXPLORE"]},
        "conversation": [
            {"role": "user", "content": f"question {i} — ü 🤖", "timestamp": 100.0 + i}
            for i in range(n)
        ]
        + [{"role": "assistant", "content": "answer"}],
        "trajectories": [
            {
                "query": f"question {i} — ü 🤖",
                "response": f"answer {i}",
                "tier": "EXPLORE",
                "timestamp": 100.0 + i,
                "hits": i,
                "cluster": 2,
            }
            for i in range(n)
        ],
    }
    path = tmp_path / "old.miku"
    path.write_text(json.dumps(doc, ensure_ascii=False), encoding="utf-8")
    torch.save(tensors, tensor_path(path))
    return path, doc, tensors


def test_hand_made_v1_pair_imports_to_v2(tmp_path: Path) -> None:
    old, doc, tensors = v1_pair(tmp_path)
    new = tmp_path / "new.miku"
    state = import_legacy(old, new, model_fingerprint="abc")
    back = read_miku(new, expected_fingerprint="abc")
    assert back.header["model_id"] == doc["model"]
    assert back.header["layer"] == 18 and back.header["d"] == 8 and back.header["k"] == 4
    assert back.header["created"] == "2025-03-01T12:00:00"
    np.testing.assert_array_equal(back.tensors["metric"], tensors["metric"].numpy())
    np.testing.assert_array_equal(back.tensors["basis"], tensors["basis"].numpy())
    np.testing.assert_array_equal(
        back.trajectories["query_x"], tensors["trajectory_coords"].numpy()
    )
    np.testing.assert_array_equal(back.trajectories["reply_x"], tensors["response_coords"].numpy())
    assert back.trajectories["query_text"] == [t["query"] for t in doc["trajectories"]]
    assert back.trajectories["reply_text"] == [t["response"] for t in doc["trajectories"]]
    assert back.trajectories["hits"].tolist() == [0, 1, 2]
    assert back.trajectories["cluster"].tolist() == [2, 2, 2]
    assert [m["text"] for m in back.conversation] == [m["content"] for m in doc["conversation"]]
    assert "created" not in back.conversation[-1]  # absent timestamp stays absent
    assert back.extra["settings"] == doc["settings"]
    assert back.extra["legacy"]["metric_growth"] == 0.04
    assert state.header == back.header


def test_write_legacy_then_read_legacy_keeps_content(tmp_path: Path) -> None:
    state = make_state()
    path = tmp_path / "l.miku"
    write_legacy(path, state)
    assert json.loads(path.read_text(encoding="utf-8"))["version"] == "1.0"
    back = read_legacy(path)
    for name in ("query_text", "reply_text", "tier"):
        assert back.trajectories[name] == state.trajectories[name]
    np.testing.assert_array_equal(back.trajectories["query_x"], state.trajectories["query_x"])
    np.testing.assert_array_equal(back.tensors["metric"], state.tensors["metric"])
    assert [m["text"] for m in back.conversation] == [m["text"] for m in state.conversation]


class Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # what a malicious file smuggles in
        return (exec, (f"open({str(self.marker)!r}, 'w').write('pwned')",))


@pytest.mark.parametrize("container", ["torch_zip", "raw_pickle"])
def test_malicious_tensor_file_is_refused_not_executed(tmp_path: Path, container: str) -> None:
    old, _, tensors = v1_pair(tmp_path)
    marker = tmp_path / "PWNED"
    payload = {**tensors, "metric": Evil(marker)}
    if container == "torch_zip":
        torch.save(payload, tensor_path(old))
    else:
        tensor_path(old).write_bytes(pickle.dumps(payload))
    # sanity: the file really would run code under full unpickling
    with pytest.raises(MikuError, match="refused"):
        import_legacy(old, tmp_path / "new.miku")
    assert not marker.exists()
    assert not (tmp_path / "new.miku").exists()
    if container == "raw_pickle":
        pickle.loads(tensor_path(old).read_bytes())
        assert marker.exists()  # proves the payload was live


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda p, d, t: tensor_path(p).unlink(), "does not exist"),
        (lambda p, d, t: p.write_text("{not json"), "not UTF-8 JSON"),
        (lambda p, d, t: p.write_text(json.dumps([1, 2])), "JSON object"),
        (lambda p, d, t: p.write_text(json.dumps({**d, "version": "2.0"})), "not 1.x"),
        (
            lambda p, d, t: p.write_text(json.dumps({**d, "trajectories": d["trajectories"][:2]})),
            "trajectory_coords",
        ),
        (lambda p, d, t: p.write_text(json.dumps({**d, "model": 5})), "'model'"),
        (lambda p, d, t: torch.save({**t, "metric": torch.eye(3)}, tensor_path(p)), "do not fit"),
        (lambda p, d, t: torch.save([1, 2], tensor_path(p)), "expected a dict"),
        (lambda p, d, t: tensor_path(p).write_bytes(b"garbage"), "refused"),
    ],
)
def test_damaged_v1_pairs_raise_mikuerror(tmp_path: Path, damage, message: str) -> None:
    old, doc, tensors = v1_pair(tmp_path)
    damage(old, doc, tensors)
    with pytest.raises(MikuError, match=message):
        read_legacy(old)


def test_import_refuses_to_overwrite_the_v1_file(tmp_path: Path) -> None:
    old, _, _ = v1_pair(tmp_path)
    before = old.read_bytes()
    with pytest.raises(StorageError, match="overwrite"):
        import_legacy(old, old)
    assert old.read_bytes() == before
