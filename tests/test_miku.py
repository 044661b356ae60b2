"""The .miku v2 file: exact round trip, strict reading, atomic and crash-safe writing."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

from isagi.errors import MikuError, StorageError
from isagi.storage import miku
from isagi.storage.miku import (
    MikuState,
    encode_miku,
    inspect_miku,
    limits,
    new_header,
    read_miku,
    write_miku,
)

ROOT = Path(__file__).resolve().parents[1]
TEXTS = [
    "plain ascii",
    "",
    "Über naïve café — 意味 🤖🧠 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "combining e\u0301 and zero\u200bwidth, RTL עברית, \u2028line sep",
    "nul \x00 inside and \t tabs \n newlines",
    "x" * 5000,
]


def make_state(n: int = 6, k: int = 4, d: int = 8, seed: int = 0) -> MikuState:
    rng = np.random.default_rng(seed)
    texts = (TEXTS * (n // len(TEXTS) + 1))[:n]
    a = rng.standard_normal((k, k))
    metric = np.eye(k) + 0.1 * a @ a.T
    state = MikuState(
        header=new_header(
            model_id="org/model", model_fingerprint="f" * 64, d=d, k=k, layer=3, profile_ref="p1"
        ),
        tensors={
            "metric": metric,
            "basis": rng.standard_normal((d, k)).astype(np.float32),
            "mu": rng.standard_normal(d).astype(np.float32),
            "f16": np.array([0.0, -0.0, 1.5, np.inf, -np.inf, np.nan, 65504.0], np.float16),
            "f64_edge": np.array([np.nan, 5e-324, -1.7976931348623157e308, -0.0]),
            "i8": np.array([-128, 0, 127], np.int8),
            "i16": np.array([[-32768, 32767]], np.int16),
            "i32": np.arange(-5, 5, dtype=np.int32).reshape(2, 5),
            "i64": np.array([-(2**63), 2**63 - 1, 0], np.int64),
            "u8": np.arange(256, dtype=np.uint8),
            "flags": np.array([[True, False], [False, True]]),
            "empty": np.zeros((0, k), np.float32),
            "scalar": np.array(3.25, np.float64),
            "nd": rng.standard_normal((2, 1, 3, 2)).astype(np.float32),
        },
        trajectories={
            "id": np.arange(n, dtype=np.int64),
            "query_x": rng.standard_normal((n, k)).astype(np.float32),
            "reply_x": rng.standard_normal((n, k)).astype(np.float32),
            "query_text": texts,
            "reply_text": [t[::-1] for t in texts],
            "tier": ["RETRIEVE", "AUGMENT", "EXPAND", "EXPLORE", "AUGMENT", "RETRIEVE"][:n]
            + ["EXPLORE"] * max(0, n - 6),
            "cluster": rng.integers(-1, 5, n).astype(np.int32),
            "created": rng.uniform(0, 1e9, n),
            "hits": rng.integers(0, 9, n).astype(np.int32),
        },
        conversation=[
            {"role": "system", "text": "be kind"},
            *[
                m
                for i, t in enumerate(texts)
                for m in (
                    {
                        "role": "user",
                        "text": t,
                        "created": 1.5 + i,
                        "tier": None,
                        "n": i,
                        "ok": True,
                    },
                    {"role": "assistant", "text": t.upper(), "teh": float(i) / 3},
                )
            ],
        ],
        extra={
            "settings": {"tau": 0.5, "names": ["a", "ü"], "nested": {"x": [1, 2.5, None, True]}},
            "title": "🤖",
            "empty": {},
        },
    )
    return _with_common_fields(state)


def _with_common_fields(state: MikuState) -> MikuState:
    for i, m in enumerate(state.conversation):
        m["pos"] = i  # every message has it: stored without row numbers
        m["mixed"] = [None, 1, 2.5, "s", True][i % 5]  # mixed types: a plain list
    return state


def assert_same(a: MikuState, b: MikuState) -> None:
    assert a.header == b.header
    assert a.tensors.keys() == b.tensors.keys()
    for name, x in a.tensors.items():
        y = b.tensors[name]
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert x.tobytes() == y.tobytes(), name  # bit-exact (NaN, -0.0 included)
    assert a.trajectories.keys() == b.trajectories.keys()
    for name, x in a.trajectories.items():
        y = b.trajectories[name]
        if isinstance(x, np.ndarray):
            assert isinstance(y, np.ndarray) and x.dtype == y.dtype and x.shape == y.shape, name
            assert x.tobytes() == y.tobytes(), name
        else:
            assert list(x) == y, name
    assert a.conversation == b.conversation
    # keys present/absent exactly as written (None stays None, missing stays missing)
    assert [sorted(m) for m in a.conversation] == [sorted(m) for m in b.conversation]
    assert a.extra == b.extra


def test_round_trip_is_exact(tmp_path: Path) -> None:
    state = make_state()
    path = tmp_path / "s.miku"
    write_miku(path, state)
    back = read_miku(path)
    assert_same(state, back)
    assert type(back.conversation[1]["n"]) is int and back.conversation[1]["ok"] is True
    # arrays come back writable and in native byte order
    assert back.tensors["metric"].flags.writeable
    back.tensors["metric"][0, 0] += 1.0
    # a second round trip of what was read gives identical bytes (deterministic encoding)
    back2 = read_miku(path)
    assert encode_miku(back2) == path.read_bytes()


def test_big_endian_input_is_stored_little_endian(tmp_path: Path) -> None:
    state = make_state()
    be = np.arange(12, dtype=">f8").reshape(3, 4)
    state.tensors["be"] = be
    write_miku(tmp_path / "b.miku", state)
    back = read_miku(tmp_path / "b.miku")
    assert back.tensors["be"].dtype == np.float64
    np.testing.assert_array_equal(back.tensors["be"], be)


def test_empty_session_round_trips(tmp_path: Path) -> None:
    state = MikuState(header=new_header(model_id="m", model_fingerprint="x", d=2, k=1, layer=0))
    write_miku(tmp_path / "e.miku", state)
    back = read_miku(tmp_path / "e.miku")
    assert_same(state, back)
    assert back.n_trajectories == 0


def test_fingerprint_mismatch_needs_explicit_flag(tmp_path: Path) -> None:
    path = tmp_path / "s.miku"
    write_miku(path, make_state())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        read_miku(path, expected_fingerprint="f" * 64)  # same model: no warning
    with pytest.raises(MikuError, match="allow-other-model"):
        read_miku(path, expected_fingerprint="0" * 64)
    with pytest.warns(UserWarning, match="fingerprint"):
        state = read_miku(path, expected_fingerprint="0" * 64, allow_other_model=True)
    assert state.header["model_fingerprint"] == "f" * 64


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda s: s.header.update(d=True), "'d' must be int"),
        (lambda s: s.header.update(k=2.0), "'k' must be int"),
        (lambda s: s.header.pop("model_fingerprint"), "missing field 'model_fingerprint'"),
        (lambda s: s.header.update(created="yesterday"), "ISO-8601"),
        (lambda s: s.header.update(format_version=1), "format version 1"),
        (lambda s: s.header.update(extra_list=[1]), "must be a scalar"),
        (lambda s: s.tensors.update(metric=np.eye(5)), "does not match header"),
        (lambda s: s.tensors.update(c=np.array([1 + 2j])), "dtype complex128"),
        (lambda s: s.tensors.update(o=np.array(["a"], dtype=object)), "dtype object"),
        (lambda s: s.tensors.update(u=np.array([1], dtype=np.uint32)), "dtype uint32"),
        (lambda s: s.tensors.update(l=[1.0, 2.0]), "expected a numpy array"),
        (lambda s: s.trajectories.update(hits=np.zeros(2, np.int32)), "rows"),
        (lambda s: s.trajectories.update(tier=["x"] * 5), "rows"),
        (lambda s: s.trajectories.update(tier=[1] * 6), "must be a string"),
        (
            lambda s: s.trajectories.update(query_x=np.zeros((6, 3), np.float32)),
            "does not match header",
        ),
        (lambda s: s.conversation.append({"role": "user"}), "'text' must be a string"),
        (
            lambda s: s.conversation.append({"role": "user", "text": "x", "v": [1]}),
            "must be a scalar",
        ),
        (lambda s: s.extra.update(obj=object()), "unsupported value"),
        (lambda s: s.extra.update({1: "x"}), "invalid name"),
        (lambda s: s.conversation.append({"role": "user", "text": "\ud800"}), "cannot be encoded"),
    ],
)
def test_writer_refuses_invalid_state(tmp_path: Path, mutate, message: str) -> None:
    state = make_state()
    mutate(state)
    with pytest.raises(MikuError, match=message):
        write_miku(tmp_path / "bad.miku", state)
    assert list(tmp_path.iterdir()) == []  # nothing written, no temp file


def test_reader_messages_say_what_is_wrong(tmp_path: Path) -> None:
    good = tmp_path / "g.miku"
    write_miku(good, make_state())
    data = bytearray(good.read_bytes())

    with pytest.raises(MikuError, match="does not exist"):
        read_miku(tmp_path / "missing.miku")
    with pytest.raises(MikuError, match="directory"):
        read_miku(tmp_path)
    (tmp_path / "empty.miku").write_bytes(b"")
    with pytest.raises(MikuError, match="truncated or empty"):
        read_miku(tmp_path / "empty.miku")
    (tmp_path / "v1.miku").write_text(json.dumps({"version": "1.0"}))
    with pytest.raises(MikuError, match="import-legacy"):
        read_miku(tmp_path / "v1.miku")
    (tmp_path / "png.miku").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(100))
    with pytest.raises(MikuError, match="wrong magic"):
        read_miku(tmp_path / "png.miku")
    v3 = bytearray(data)
    v3[8] = 3
    (tmp_path / "v3.miku").write_bytes(v3)
    with pytest.raises(MikuError, match="format version 3"):
        read_miku(tmp_path / "v3.miku")
    flipped = bytearray(data)
    flipped[-10] ^= 0x01
    (tmp_path / "flip.miku").write_bytes(flipped)
    with pytest.raises(MikuError, match="checksum does not match"):
        read_miku(tmp_path / "flip.miku")
    (tmp_path / "cut.miku").write_bytes(data[: len(data) // 2])
    with pytest.raises(MikuError, match="checksum"):
        read_miku(tmp_path / "cut.miku")


def test_file_size_bound_is_checked_before_reading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "s.miku"
    write_miku(path, make_state())
    monkeypatch.setattr(limits, "MAX_MIKU_BYTES", path.stat().st_size - 1)
    with pytest.raises(MikuError, match="larger than the limit"):
        read_miku(path)


def test_inspect_reports_header_sizes_growth_and_checksum(tmp_path: Path) -> None:
    state = make_state()
    path = tmp_path / "s.miku"
    write_miku(path, state)
    info = inspect_miku(path)
    assert info["checksum"] == {"algo": miku.DEFAULT_CHECKSUM, "status": "ok"}
    assert info["header"] == state.header
    assert info["trajectories"] == 6
    assert info["messages"] == len(state.conversation)
    assert info["size_bytes"] == path.stat().st_size
    assert info["tensors"]["basis"] == {"dtype": "float32", "shape": [8, 4], "bytes": 8 * 4 * 4}
    expected = np.linalg.norm(state.tensors["metric"] - np.eye(4), "fro")
    assert info["metric_growth"] == pytest.approx(expected, rel=1e-12)
    # corrupt one byte inside a text: the payload still parses, the checksum does not match
    data = bytearray(path.read_bytes())
    i = data.index(b"plain ascii")
    data[i] = ord("P")
    path.write_bytes(data)
    assert inspect_miku(path)["checksum"]["status"] == "mismatch"
    with pytest.raises(MikuError, match="checksum does not match"):
        read_miku(path)


def test_sha256_files_are_read(tmp_path: Path) -> None:
    state = make_state()
    path = tmp_path / "s.miku"
    path.write_bytes(encode_miku(state, checksum="sha256"))
    assert_same(state, read_miku(path))
    assert inspect_miku(path)["checksum"]["algo"] == "sha256"


# --------------------------------------------------------------------------- disk full


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


def test_disk_full_during_write_keeps_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "s.miku"
    old = make_state(seed=1)
    write_miku(path, old)
    before = path.read_bytes()
    real_write = os.write
    calls = {"n": 0}

    def full_disk(fd: int, data) -> int:
        calls["n"] += 1
        if calls["n"] == 1:
            return real_write(fd, bytes(data)[: max(1, len(data) // 3)])  # partial write
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", full_disk)
    with pytest.raises(StorageError, match="disk is full") as info:
        write_miku(path, make_state(seed=2))
    assert not isinstance(info.value, MikuError)
    monkeypatch.undo()
    assert calls["n"] >= 2
    assert path.read_bytes() == before
    assert_same(old, read_miku(path))
    assert _leftovers(tmp_path) == []


def test_disk_full_at_fsync_keeps_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "s.miku"
    write_miku(path, make_state(seed=1))
    before = path.read_bytes()

    def no_space(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(StorageError, match="unchanged"):
        write_miku(path, make_state(seed=2))
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert _leftovers(tmp_path) == []


def test_unwritable_directory_is_a_storage_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(StorageError, match="Could not save"):
        write_miku(blocker / "s.miku", make_state())


# --------------------------------------------------------------------------- SIGKILL

_CHILD = textwrap.dedent(
    """
    import os, sys, time
    sys.path.insert(0, {root!r})
    from tests.test_miku import make_state
    from isagi.storage import miku
    from isagi.storage.miku import writer
    path, mode = sys.argv[1], sys.argv[2]
    state = make_state(n=int(sys.argv[3]), k=32, d=64, seed=7)
    if mode == "pause":
        # stop for good after the first chunk of the temp file is on disk
        real = os.write
        def write_then_pause(fd, data):
            n = real(fd, data)
            print("MID", flush=True)
            time.sleep(3600)
            return n
        writer._WRITE_CHUNK = 1 << 16
        os.write = write_then_pause
        miku.write_miku(path, state)
    else:
        print("LOOP", flush=True)
        i = 0
        while True:
            state.extra["i"] = i
            miku.write_miku(path, state)
            i += 1
    """
)


# the largest make_state a file may hold: its 2n + 1 messages within the limit
BIG = miku.MAX_TURNS - 1


def _spawn(tmp_path: Path, path: Path, mode: str, n: int) -> subprocess.Popen:
    script = tmp_path / "child.py"
    script.write_text(_CHILD.format(root=str(ROOT)))
    return subprocess.Popen(
        [sys.executable, str(script), str(path), mode, str(n)], stdout=subprocess.PIPE, text=True
    )


def test_sigkill_mid_write_leaves_previous_file_intact(tmp_path: Path) -> None:
    path = tmp_path / "s.miku"
    old = make_state(seed=3)
    write_miku(path, old)
    before = path.read_bytes()

    child = _spawn(tmp_path, path, "pause", BIG)
    try:
        assert child.stdout.readline().strip() == "MID"
        temps = _leftovers(tmp_path)
        assert len(temps) == 1 and (tmp_path / temps[0]).stat().st_size > 0  # really mid-write
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    assert path.read_bytes() == before
    assert_same(old, read_miku(path))
    # the partial temp file is not a valid .miku and the next save still works
    leftover = tmp_path / _leftovers(tmp_path)[0]
    with pytest.raises(MikuError):
        read_miku(leftover)
    new = make_state(seed=4)
    write_miku(path, new)
    assert_same(new, read_miku(path))
    assert _leftovers(tmp_path) == [leftover.name]  # too fresh: maybe another save's
    old_time = time.time() - 120
    os.utime(leftover, (old_time, old_time))
    write_miku(path, new)  # the next save of the same file removes what a killed one left
    assert _leftovers(tmp_path) == []


def test_stale_temp_files_of_a_directory_are_removed_and_nothing_else(tmp_path: Path) -> None:
    old_time = time.time() - 3600
    names = {
        ".a.miku.k2j3_x.tmp": True,  # a killed save's
        ".b c.miku.abc123.tmp": True,
        "a.miku": False,  # a session
        ".a.miku.fresh1.tmp": False,  # a save in progress
        "notes.tmp": False,  # not ours
        ".a.txt.k2j3.tmp": False,
    }
    for name in names:
        (tmp_path / name).write_bytes(b"x")
        if name != ".a.miku.fresh1.tmp":
            os.utime(tmp_path / name, (old_time, old_time))
    (tmp_path / ".d.miku.dir.tmp").mkdir()  # not a file
    os.utime(tmp_path / ".d.miku.dir.tmp", (old_time, old_time))
    removed = miku.remove_stale_temp_files(tmp_path)
    assert sorted(p.name for p in removed) == sorted(n for n, gone in names.items() if gone)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [n for n, gone in names.items() if not gone] + [".d.miku.dir.tmp"]
    )
    assert miku.remove_stale_temp_files(tmp_path / "missing") == []


def test_sigkill_at_random_moments_of_a_save_loop(tmp_path: Path) -> None:
    path = tmp_path / "s.miku"
    rng = np.random.default_rng(11)
    for _ in range(3):
        child = _spawn(tmp_path, path, "loop", BIG)
        try:
            assert child.stdout.readline().strip() == "LOOP"
            while not path.exists():
                time.sleep(0.01)
            time.sleep(float(rng.uniform(0.05, 0.6)))
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=30)
        state = read_miku(path)  # whatever was last renamed in is complete and valid
        assert state.n_trajectories == BIG
        assert state.trajectories["query_text"][:6] == make_state(n=6).trajectories["query_text"]


def test_benchmark_reports_measured_figures_for_both_formats() -> None:
    from isagi.bench.miku import run

    r = run(turns=300, k=8, d=16, repeats=1)
    assert r["turns"] == 300
    for key in ("save_s", "load_s", "legacy_save_s", "legacy_load_s"):
        assert r[key] > 0
    assert r["size_bytes"] > 0 and r["legacy_size_bytes"] > 0 and r["raw_bytes"] > 0
    assert r["size_ratio_vs_raw"] == round(r["size_bytes"] / r["raw_bytes"], 3)
    assert r["size_bytes"] <= 1.2 * r["raw_bytes"]  # structural: framing overhead is small


def test_interrupted_write_removes_its_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "s.miku"
    write_miku(path, make_state(seed=1))
    before = path.read_bytes()

    def interrupted(fd: int) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_miku(path, make_state(seed=2))
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert _leftovers(tmp_path) == []


def test_inspect_counts_tiers_turns_and_verdicts(tmp_path: Path) -> None:
    state = make_state()
    state.conversation[2]["verdict"] = "ok"
    state.conversation[4]["verdict"] = "refused"
    path = tmp_path / "s.miku"
    write_miku(path, state)
    info = inspect_miku(path)
    users = sum(1 for m in state.conversation if m["role"] == "user")
    assert info["turns"] == users and info["turns"] < info["messages"]
    assert info["tiers"] == {"AUGMENT": 2, "RETRIEVE": 2, "EXPAND": 1, "EXPLORE": 1}
    assert info["verdicts"] == {"ok": 1, "refused": 1}


def test_cli_inspect_prints_tables_in_plain_words_and_json_on_request(tmp_path: Path) -> None:
    import json

    from typer.testing import CliRunner

    from isagi.cli import app

    path = tmp_path / "s.miku"
    write_miku(path, loadable(make_state()))
    runner = CliRunner()
    shown = runner.invoke(app, ["inspect", "--any-model", str(path)], env={"COLUMNS": "120"})
    assert shown.exit_code == 0, shown.output
    assert "refused" not in shown.output
    for heading in ("File", "Header", "Contents", "Tensors", "field", "value"):
        assert heading in shown.output
    assert "2 answered from memory" in shown.output  # tiers in plain words
    assert "crc32: ok" in shown.output
    assert "{'" not in shown.output  # no raw Python dicts
    as_json = runner.invoke(app, ["inspect", "--any-model", str(path), "--json"])
    assert as_json.exit_code == 0
    data = json.loads(as_json.output)
    assert data["tiers"]["RETRIEVE"] == 2 and data["checksum"]["status"] == "ok"


def loadable(state: MikuState) -> MikuState:
    """``state`` completed into a session :func:`isagi.session.files.load_session` accepts."""
    state.tensors["singular_values"] = np.ones(state.header["k"], np.float32)
    state.trajectories["last_hit"] = state.trajectories["created"].copy()
    n = len(state.trajectories["created"])
    for column in ("query_text", "reply_text", "tier", "context_key", "content_key"):
        state.trajectories.setdefault(column, [""] * n)
    return state


def _inspect(*args: str):  # noqa: ANN202 - click's Result
    from typer.testing import CliRunner

    from isagi.cli import app

    return CliRunner().invoke(app, ["inspect", "--any-model", *args], env={"COLUMNS": "120"})


def test_cli_inspect_says_why_a_file_would_not_load_and_exits_1(tmp_path: Path) -> None:
    """A file the loader refuses, though it parses: the summary, then why, then exit 1."""
    import json

    from isagi.session.files import session_from_state

    good = tmp_path / "good.miku"
    write_miku(good, loadable(make_state()))
    session_from_state(read_miku(good))  # the loader accepts it (the tests below change one thing)
    cases = {  # name: (file contents, what stderr says)
        "damaged": (None, "the crc32 checksum does not match its contents"),
        "not a session": (make_state(), "has no 'singular_values' tensor"),
        "impossible value": (loadable(make_state()), "title must be a string of at most 1000 characters"),
    }
    cases["impossible value"][0].extra["title"] = "t" * 5000
    for name, (state, reason) in cases.items():
        path = tmp_path / f"{name}.miku"
        if state is None:
            data = bytearray(good.read_bytes())
            data[data.index(b"plain ascii")] ^= 0x20  # a text's byte: it still parses
            path.write_bytes(data)
        else:
            write_miku(path, state)
        shown = _inspect(str(path))
        assert shown.exit_code == 1, (name, shown.output)
        assert "Header" in shown.stdout  # the summary is still shown
        assert shown.stderr.startswith(f"refused: {path} would not load: ") and reason in shown.stderr
        assert shown.stderr.count("\n") == 1 and "Traceback" not in shown.output
        as_json = _inspect(str(path), "--json")
        assert as_json.exit_code == 1 and reason in json.loads(as_json.stdout)["refused"]
    assert json.loads(_inspect(str(good), "--json").stdout)["refused"] is None


def test_cli_inspect_of_a_file_over_a_limit_says_so_in_one_line_and_exits_2(tmp_path: Path) -> None:
    from tests import miku_bombs as B

    for name, data, reason in (
        ("long", B.long_session(30_000), f"60000 messages, more than the limit of {miku.MAX_MESSAGES} ({miku.MAX_TURNS} turns"),
        ("amplified", B.amplified(2_000), f"its texts add up to more than {miku.MAX_TEXT_CHARS} characters"),
    ):
        path = tmp_path / f"{name}.miku"
        path.write_bytes(data)
        shown = _inspect(str(path))
        assert shown.exit_code == 2, shown.output
        assert reason in shown.output and "is invalid" in shown.output
        assert shown.output.strip().count("\n") == 0 and "Traceback" not in shown.output


def test_cli_inspect_refuses_exactly_what_the_loader_refuses(tmp_path: Path) -> None:
    """One judgement of a file: a real session file, then files the loader refuses only once it
    builds the session (two exchanges under one id), refused by inspect too, with the loader's
    reason (inspect used to run only the checks before the building, and said nothing)."""
    import copy

    from isagi.session.files import load_session, session_state
    from tests.tiny_engine import tiny_engine

    engine = tiny_engine(tmp_path / "home", with_store=False)
    session = engine.new_session(autosave=False)
    for question in ("hello there", "what is the sea"):
        engine.turn(session, question)
    base = session_state(engine.frame, session)
    good = tmp_path / "good.miku"
    write_miku(good, base)
    assert load_session(engine.frame, good).turns and _inspect(str(good)).exit_code == 0
    same_id = copy.deepcopy(base)
    same_id.trajectories["id"] = np.zeros_like(same_id.trajectories["id"])
    for name, state in (("same-id", same_id),):
        path = tmp_path / f"{name}.miku"
        write_miku(path, state)
        with pytest.raises(MikuError) as refused:
            load_session(engine.frame, path)
        shown = _inspect(str(path))
        assert shown.exit_code == 1, (name, shown.output)
        reason = str(refused.value).split(": ", 1)[1]  # the loader's words after the file's name
        assert reason in shown.stderr.replace("\n", ""), (reason, shown.stderr)


def test_cli_inspect_refuses_a_file_of_another_model_as_chat_load_does(tmp_path: Path) -> None:
    """A sound file saved with another model: chat --load and the page refuse it (its geometry does
    not apply), so inspect exits 1 and says so (before: exit 0); --any-model judges the file alone."""
    import json

    from typer.testing import CliRunner

    from isagi.cli import app
    from isagi.config import load_settings
    from isagi.engines import model_fingerprint

    mine = model_fingerprint(load_settings(environ={}, home=tmp_path))
    assert mine and mine.startswith("gguf-sha256:")
    state = loadable(make_state())
    path = tmp_path / "other.miku"
    state.header["model_fingerprint"] = "0" * 64
    write_miku(path, state)
    runner = CliRunner()
    shown = runner.invoke(app, ["inspect", str(path), "--home", str(tmp_path)], env={"COLUMNS": "120"})
    assert shown.exit_code == 1 and "not the configured model" in shown.stderr, shown.output
    assert runner.invoke(app, ["inspect", "--any-model", str(path)]).exit_code == 0
    state.header["model_fingerprint"] = mine
    write_miku(path, state)
    same = runner.invoke(app, ["inspect", str(path), "--home", str(tmp_path), "--json"])
    assert same.exit_code == 0 and json.loads(same.stdout)["refused"] is None
