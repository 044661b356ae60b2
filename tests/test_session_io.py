"""Session <-> .miku mapping, without a model: exact round trip and clear refusals."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from isagi.errors import MikuError
from isagi.ids import new_session_id
from isagi.manifold.cog import Metric
from isagi.manifold.memory import TrajectoryMemory
from isagi.manifold.ugt import fit_basis
from isagi.session.files import SessionFrame, load_session, save_session
from isagi.session.state import Session
from isagi.session.turn import TURN_FIELDS, Turn
from isagi.storage.miku import read_miku, write_miku


def _frame(fingerprint: str = "fp-1", d: int = 32) -> SessionFrame:
    return SessionFrame(model_id="tiny", model_fingerprint=fingerprint, hidden_size=d, layer=3,
                        profile_key="profile-key", system_prompt="be brief")


def _turn(i: int) -> Turn:
    """A turn with every field set, none to its default (so a field that is lost shows)."""
    return Turn(
        user_text=f"question {i} ✓", reply_text=f"answer {i}\n<b>bold</b>", tier="EXPAND", distance=0.3 + i / 7,
        nearest_query=f"question {i - 1}", zone="science", teh_prompt=12.5 + i, teh_reply=3.25, verdict="ok",
        category="fraud", latency_s=0.125 * (i + 1), prompt_tokens=40 + i, new_tokens=9 + i,
        metric_growth=0.01 * i + 0.001, context_dependent=bool(i % 2), cluster=i % 2, generated=True,
        asked_at=1_700_000_000.5 + i, answered_at=1_700_000_001.25 + i,
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
        s.turns.append(_turn(i))
    s.title = "question 0"
    return s


def test_round_trip_is_exact(tmp_path: Path) -> None:
    s = _session()
    path = tmp_path / "nested" / "s.miku"
    save_session(_frame(), s, path)
    r = load_session(_frame(), path)
    assert r.id == s.id and r.title == s.title and r.turns == s.turns
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
    save_session(_frame("fp-1"), _session(), path)
    with pytest.raises(MikuError):
        load_session(_frame("fp-2"), path)
    with pytest.warns(UserWarning):
        load_session(_frame("fp-2"), path, allow_other_model=True)


def test_corrupted_file_is_one_clear_error_and_leaves_the_file(tmp_path: Path) -> None:
    path = tmp_path / "s.miku"
    save_session(_frame(), _session(), path)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(MikuError):
        load_session(_frame(), path)
    assert path.read_bytes() == bytes(data)


def test_hidden_size_mismatch_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "s.miku"
    save_session(_frame(), _session(), path)
    with pytest.raises(MikuError, match="hidden size"):
        load_session(_frame(d=64), path)


# --------------------------------------------------------------------------- every field, every bad value


def _metric_fields(m: Metric) -> dict:
    return {k: v for k, v in m.to_state().items() if not isinstance(v, np.ndarray)}


def test_every_field_survives_save_and_load(tmp_path: Path) -> None:
    s = _session()
    s.created = 1_700_000_123.456789  # sub-second: the header alone holds seconds
    s.title = "Über 🤖 <b>title</b>"
    s.turns[1].tier = "RETRIEVE"
    s.turns[2] = Turn(user_text="stopped", reply_text="Once upon", verdict="cancelled")  # fields left unset
    s.turns.append(Turn(user_text="bad", reply_text="I can't help", verdict="refused", category="fraud",
                        teh_prompt=80.0, zone="code"))
    s.metric.floor_events = 0
    path = tmp_path / "s.miku"
    save_session(_frame(), s, path)
    r = load_session(_frame(), path)
    assert (r.id, r.created, r.title, len(r.turns)) == (s.id, s.created, s.title, 6)
    for before, after in zip(s.turns, r.turns, strict=True):  # every field of every turn
        for name in TURN_FIELDS:
            assert getattr(after, name) == getattr(before, name), name
            assert type(getattr(after, name)) is type(getattr(before, name)), name
    assert r.messages == s.messages
    assert _metric_fields(r.metric) == _metric_fields(s.metric)
    assert r.metric.version == s.metric.version == 5 and r.metric.updates == 5
    np.testing.assert_array_equal(r.metric.M, s.metric.M)
    np.testing.assert_array_equal(r.basis.singular_values, s.basis.singular_values)
    assert r.basis.explained == s.basis.explained
    assert r.memory.to_columns().keys() == s.memory.to_columns().keys()
    assert len(r.memory) == len(s.memory) == 5
    assert r.miku_path is None


def test_created_of_a_file_without_the_exact_time_comes_from_the_header(tmp_path: Path) -> None:
    s = _session()
    s.created = 1_700_000_000.0
    path = tmp_path / "s.miku"
    save_session(_frame(), s, path)
    state = read_miku(path)
    del state.extra["created"]  # as files written before it was stored
    write_miku(path, state)
    assert load_session(_frame(), path).created == 1_700_000_000.0


@pytest.mark.parametrize("bad_id", ["../../x", "", None, 12, "ABCDEF123456", "abc123", "0123456789ab/"])
def test_a_missing_or_malformed_session_id_is_replaced(tmp_path: Path, bad_id) -> None:
    from isagi.ids import is_session_id

    path = tmp_path / "s.miku"
    save_session(_frame(), _session(), path)
    state = read_miku(path)
    if bad_id is None:
        del state.extra["session_id"]
    else:
        state.extra["session_id"] = bad_id
    write_miku(path, state)
    ids = {load_session(_frame(), path).id for _ in range(3)}
    assert all(is_session_id(i) for i in ids) and len(ids) == 3  # fresh each time
    assert str(bad_id) not in ids


def test_a_colliding_session_id_is_replaced(tmp_path: Path) -> None:
    s = _session()
    path = tmp_path / "s.miku"
    save_session(_frame(), s, path)
    assert load_session(_frame(), path, id_taken=lambda sid: False).id == s.id
    taken = load_session(_frame(), path, id_taken=lambda sid: sid == s.id).id
    assert taken != s.id and len(taken) == len(s.id)


def _metric(key, value):
    return lambda st: st.extra["metric"].__setitem__(key, value)


def _tensor(key, f):
    return lambda st: st.tensors.__setitem__(key, f(st.tensors[key]))


def _column(key, f):
    return lambda st: st.trajectories.__setitem__(key, f(st.trajectories[key]))


def _extra(key, value):
    return lambda st: st.extra.__setitem__(key, value)


def _poke(arr, value):
    arr = arr.copy()
    arr.flat[0] = value
    return arr


# name: (mutation of a saved session's state, what the one-line error says)
BAD = {
    "NaN basis": (_tensor("basis", lambda b: _poke(b, np.nan)), "basis holds NaN"),
    "Inf mean": (_tensor("mu", lambda m: _poke(m, np.inf)), "mu holds NaN"),
    "int8 basis": (_tensor("basis", lambda b: b.astype(np.int8)), "basis has dtype int8"),
    "bool basis": (_tensor("basis", lambda b: b > 0), "basis has dtype bool"),
    "float16 basis": (_tensor("basis", lambda b: b.astype(np.float16)), "basis has dtype float16"),
    "int64 metric": (_tensor("metric", lambda m: m.astype(np.int64)), "metric has dtype int64"),
    "NaN metric": (_tensor("metric", lambda m: _poke(m, np.nan)), "metric holds NaN"),
    "non-SPD metric": (_tensor("metric", lambda m: -m), "metric is not positive definite"),
    "asymmetric metric": (
        _tensor("metric", lambda m: m + np.triu(np.ones_like(m), 1)),
        "metric is not symmetric",
    ),
    "huge metric": (_tensor("metric", lambda m: m * 1e200), "metric has an entry beyond"),
    # finite, but every later turn's projection overflows to NaN (issue 37: loaded, then each turn failed)
    "huge mean": (_tensor("mu", lambda m: np.full_like(m, 3e38)), "mu holds a value beyond"),
    "huge basis": (_tensor("basis", lambda b: np.full_like(b, 3e38)), "basis holds a value beyond"),
    "huge singular value": (_tensor("singular_values", lambda v: _poke(v, 3e38)), "singular_values holds a value"),
    "huge query coordinates": (
        _column("query_x", lambda x: _poke(x, 3e38)),
        "trajectories query_x holds a value beyond",
    ),
    "singular values of the wrong length": (
        _tensor("singular_values", lambda v: np.append(v, 1.0).astype(np.float32)),
        "singular_values has shape",
    ),
    "negative singular value": (_tensor("singular_values", lambda v: _poke(v, -1.0)), "negative"),
    "no singular values": (lambda st: st.tensors.pop("singular_values"), "no 'singular_values'"),
    "eta NaN": (_metric("eta", float("nan")), "metric eta"),
    "eta 0": (_metric("eta", 0.0), "metric eta"),
    "eta -1": (_metric("eta", -1.0), "metric eta"),
    "eig_floor Inf": (_metric("eig_floor", float("inf")), "metric eig_floor"),
    "version inf": (_metric("version", float("inf")), "metric version"),
    "version NaN": (_metric("version", float("nan")), "metric version"),
    "version 1.5": (_metric("version", 1.5), "metric version"),
    "version -1": (_metric("version", -1), "metric version"),
    "version 10**18": (_metric("version", 10**18), "metric version"),
    "version a string": (_metric("version", "7"), "metric version"),
    "updates above version": (_metric("updates", 99), "metric counts are inconsistent"),
    "window 10**9": (_metric("window", 10**9), "metric window"),
    "metric for another k": (_metric("k", 3), "metric k"),
    "metric settings not a map": (_extra("metric", [1, 2]), "extra.metric"),
    "NaN query coordinates": (
        _column("query_x", lambda x: _poke(x, np.nan)),
        "trajectories query_x holds NaN",
    ),
    "int reply coordinates": (
        _column("reply_x", lambda x: x.astype(np.int32)),
        "trajectories reply_x has dtype",
    ),
    "float cluster ids": (_column("cluster", lambda c: c.astype(np.float32)), "trajectories cluster"),
    "negative hits": (_column("hits", lambda h: _poke(h, -3)), "trajectories hits"),
    "Inf in the created column": (_column("created", lambda c: _poke(c, np.inf)), "trajectories created"),
    "created Inf": (_extra("created", float("inf")), "created"),
    "created in the year 30 million": (_extra("created", 1e15), "created"),
    "explained share 2": (_extra("basis_explained", 2.0), "basis_explained"),
    "title a number": (_extra("title", 5), "title"),
    "title of a megabyte": (_extra("title", "x" * 2**20), "title"),
    "unknown role": (lambda st: st.conversation[0].__setitem__("role", "<script>"), "message 0 has role"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_impossible_values_give_one_line_naming_the_field_and_load_nothing(
    tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import isagi.session.files

    mutate, message = BAD[name]
    path = tmp_path / "s.miku"
    save_session(_frame(), _session(), path)
    state = read_miku(path)
    mutate(state)
    write_miku(path, state)  # a real file carrying the bad value
    before = path.read_bytes()
    built = []
    real = isagi.session.files.Session
    monkeypatch.setattr(isagi.session.files, "Session", lambda *a, **kw: built.append(1) or real(*a, **kw))
    with pytest.raises(MikuError) as info:
        load_session(_frame(), path)
    text = str(info.value)
    assert message in text, text
    assert "\n" not in text and len(text) < 300
    assert built == []  # nothing half-loaded: no session was made
    assert path.read_bytes() == before
    save_session(_frame(), _session(), path)  # the same place still loads a good file
    load_session(_frame(), path)
    assert built == [1]


def test_the_check_accepts_what_save_session_writes(tmp_path: Path) -> None:
    from isagi.session.files import check_session_state, session_state

    check_session_state(session_state(_frame(), _session()))  # raises if not
    empty = Session(id=new_session_id(), basis=_session().basis, metric=Metric(8), memory=TrajectoryMemory(8))
    save_session(_frame(), empty, tmp_path / "e.miku")
    assert load_session(_frame(), tmp_path / "e.miku").turns == []


def test_save_refuses_what_load_would_refuse_and_keeps_the_file(tmp_path: Path) -> None:
    """A title longer than the loader allows (set by code, not by the title rule) is
    refused at save with one line, and the earlier file is left as it was."""
    from isagi.session.files import MAX_TITLE_CHARS

    path = tmp_path / "s.miku"
    session = _session()
    save_session(_frame(), session, path)
    before = path.read_bytes()
    session.title = "t" * (MAX_TITLE_CHARS + 1)
    with pytest.raises(MikuError, match="title") as err:
        save_session(_frame(), session, path)
    assert "\n" not in str(err.value)
    assert path.read_bytes() == before
    assert load_session(_frame(), path).title != session.title
