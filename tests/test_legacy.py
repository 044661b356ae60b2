"""Import of the research code's miku-v1 pair (JSON + .pt), safely."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from isagi.errors import MikuError, StorageError
from isagi.session.files import import_legacy
from isagi.storage.miku import read_miku
from isagi.storage.miku.legacy import read_legacy, tensor_path, write_legacy
from tests.test_miku import make_state


def v1_pair(tmp_path: Path, n: int = 3, k: int = 4, d: int = 8) -> tuple[Path, dict, dict]:
    """A v1 pair written by hand from the layout documented in storage/miku/legacy.py."""
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


# --------------------------------------------------------------------------- resuming an import


def _frame(fingerprint: str, d: int):
    from isagi.session.files import SessionFrame

    return SessionFrame(model_id="m", model_fingerprint=fingerprint, hidden_size=d, layer=18, profile_key="p",
                        system_prompt="")


def test_an_imported_session_is_resumed_by_load_session(tmp_path: Path) -> None:
    from isagi.ids import is_session_id
    from isagi.manifold.sameness import content_key
    from isagi.session.files import load_session

    old, doc, tensors = v1_pair(tmp_path)
    new = tmp_path / "new.miku"
    import_legacy(old, new, model_fingerprint="fp")
    s = load_session(_frame("fp", 8), new)
    assert is_session_id(s.id)
    np.testing.assert_array_equal(s.metric.M, tensors["metric"].numpy())
    np.testing.assert_array_equal(s.basis.B, tensors["basis"].numpy())
    np.testing.assert_array_equal(s.basis.mu, tensors["mu"].numpy())
    assert s.metric.eta > 0 and s.metric.version == 0
    # Three questions, one answer: the unanswered ones load as cancelled turns (never in a prompt).
    assert [t.user_text for t in s.turns] == [m["content"] for m in doc["conversation"] if m["role"] == "user"]
    assert [(t.reply_text, t.verdict) for t in s.turns] == [("", "cancelled"), ("", "cancelled"), ("answer", "ok")]
    assert [t.asked_at for t in s.turns] == [100.0, 101.0, 102.0]
    assert s.chat_history() == [{"role": "user", "content": doc["conversation"][2]["content"]},
                                {"role": "assistant", "content": "answer"}]
    assert s.title == doc["conversation"][0]["content"]
    cols = s.memory.to_columns()
    assert cols["query_text"] == [t["query"] for t in doc["trajectories"]]
    assert cols["reply_text"] == [t["response"] for t in doc["trajectories"]]
    assert cols["content_key"] == [content_key(t["query"]) for t in doc["trajectories"]]
    np.testing.assert_array_equal(cols["query_x"], tensors["trajectory_coords"].numpy())
    np.testing.assert_array_equal(cols["reply_x"], tensors["response_coords"].numpy())
    assert cols["hits"].tolist() == [0, 1, 2]
    # the imported memory is searchable under the imported metric
    q = tensors["trajectory_coords"].numpy()[1]
    hit = s.memory.search(q, s.metric)[0]
    assert s.memory.get(hit.id)["query_text"] == doc["trajectories"][1]["query"]


def test_an_import_without_optional_tensors_still_resumes(tmp_path: Path) -> None:
    from isagi.session.files import load_session

    old, _, tensors = v1_pair(tmp_path)
    del tensors["mu"], tensors["response_coords"]
    torch.save(tensors, tensor_path(old))
    import_legacy(old, tmp_path / "new.miku", model_fingerprint="fp")
    s = load_session(_frame("fp", 8), tmp_path / "new.miku")
    assert not s.basis.mu.any() and not s.memory.to_columns()["reply_x"].any()


def _set_row(key: str, value):
    def damage(p: Path, d: dict, t: dict) -> None:
        d["trajectories"][0][key] = value
        p.write_text(json.dumps(d))

    return damage


def _raw_json(old: str, new: str):
    def damage(p: Path, d: dict, t: dict) -> None:
        p.write_text(p.read_text(encoding="utf-8").replace(old, new, 1), encoding="utf-8")

    return damage


def _tensor(name: str, make):
    def damage(p: Path, d: dict, t: dict) -> None:
        torch.save({**t, name: make(t[name])}, tensor_path(p))

    return damage


HOSTILE = {
    "NaN timestamp": (_raw_json('"timestamp": 100.0', '"timestamp": NaN'), "NaN"),
    "Infinity hits": (_raw_json('"hits": 0', '"hits": Infinity'), "Infinity"),
    "1e999 timestamp": (_raw_json('"timestamp": 100.0', '"timestamp": 1e999'), "out of the range"),
    "1e30 timestamp": (_set_row("timestamp", 1e30), "out of range"),
    "10**40 hits": (_set_row("hits", 10**40), "out of range"),
    "10**400 cluster": (_set_row("cluster", 10**400), "out of range"),
    "-5 hits": (_set_row("hits", -5), "out of range"),
    "1.5 hits": (_set_row("hits", 1.5), "whole number"),
    "1e30 metric_growth is fine, 1e999 is not": (
        _raw_json('"metric_growth": 0.04', '"metric_growth": 1e999'),
        "out of the range",
    ),
    "10**40 layer": (_raw_json('"layer": 18', '"layer": ' + str(10**40)), "'layer'"),
    "float8 basis": (_tensor("basis", lambda b: b.to(torch.float8_e4m3fn)), "float8_e4m3fn"),
    "int8 metric": (_tensor("metric", lambda m: m.to(torch.int8)), "dtype int8"),
    "bool coords": (_tensor("trajectory_coords", lambda x: x > 0), "dtype bool"),
    "complex basis": (_tensor("basis", lambda b: b.to(torch.complex64)), "complex64"),
    "NaN basis": (_tensor("basis", lambda b: b.fill_(float("nan"))), "NaN or infinite"),
    "Inf metric": (_tensor("metric", lambda m: m.fill_(float("inf"))), "NaN or infinite"),
    "1e40 float64 coords overflow float32": (
        _tensor("trajectory_coords", lambda x: x.to(torch.float64) * 1e40),
        "beyond the range of float32",
    ),
    "1e200 metric": (_tensor("metric", lambda m: m * 1e200), "beyond 1e"),
    "non-SPD metric": (_tensor("metric", lambda m: -m), "positive definite"),
    "asymmetric metric": (_tensor("metric", lambda m: m + torch.triu(torch.ones_like(m), 1)), "symmetric"),
    "3-d basis": (_tensor("basis", lambda b: b[None]), "dimensions"),
    "deep JSON": (lambda p, d, t: p.write_text("[" * 100_000 + "]" * 100_000), "not UTF-8 JSON"),
    "a million JSON objects": (
        lambda p, d, t: p.write_text(json.dumps({**d, "settings": {"x": [{}] * 1_000_000}})),
        "JSON objects and arrays",
    ),
    "unknown role": (_raw_json('"role": "assistant"', '"role": "<b>"'), "role"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_v1_pairs_give_one_line_and_write_nothing(tmp_path: Path, name: str) -> None:
    damage, message = HOSTILE[name]
    old, doc, tensors = v1_pair(tmp_path)
    damage(old, doc, tensors)
    new = tmp_path / "new.miku"
    with pytest.raises(MikuError, match=message) as info:
        import_legacy(old, new)
    assert "\n" not in str(info.value)
    assert not new.exists()


def test_cli_import_legacy_prints_one_line_not_a_traceback(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from isagi.cli import app

    old, doc, tensors = v1_pair(tmp_path)
    torch.save({**tensors, "basis": tensors["basis"].to(torch.float8_e5m2)}, tensor_path(old))
    result = CliRunner().invoke(app, ["import-legacy", str(old), str(tmp_path / "new.miku")])
    assert result.exit_code != 0
    assert "Traceback" not in result.output and "float8_e5m2" in result.output


def test_an_imported_session_chats_on_the_real_turn_and_its_counts_agree(tmp_path: Path) -> None:
    """import-legacy -> load_session -> a real turn (tiny model) -> autosave and history agree."""
    from typer.testing import CliRunner

    from isagi.cli import app
    from isagi.session.files import load_session
    from tests.tiny_engine import tiny_engine

    engine = tiny_engine(tmp_path / "home")
    old, doc, tensors = v1_pair(tmp_path, d=engine.lm.hidden_size, k=8)
    new = tmp_path / "imported.miku"
    result = CliRunner().invoke(app, ["import-legacy", str(old), str(new)])
    assert result.exit_code == 0 and f"wrote {new}" in result.output.replace("\n", "")
    with pytest.warns(UserWarning, match="another model was allowed"):  # the v1 pair names SmolLM2
        s = load_session(engine.frame, new, allow_other_model=True)
    s.miku_path = tmp_path / "resumed.miku"
    before = len(s.memory)
    turn = engine.turn(s, "What is the boiling point of water?")
    assert turn.verdict == "ok" and turn.tier in ("AUGMENT", "EXPAND", "EXPLORE") and turn.generated
    assert turn.distance is not None, "the imported memory was searched"
    assert len(s.memory) == before + 1 and len(s.turns) == 4
    again = load_session(engine.frame, s.miku_path)
    assert again.turns == s.turns
    # the history holds the whole session: the imported turns recorded with its first new one
    assert engine.store.get_session(s.id, owner="local").turns == 4
