"""isagi.pipeline.keeping.TurnKeeper on a real SQLite history store: one store write per turn, the
file path told to the store when it is new to it, and again after the session row is gone."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from isagi.pipeline.keeping import TurnKeeper
from isagi.session.state import Session
from isagi.session.turn import Turn
from isagi.storage.history import HistoryStore


def _session(tmp_path: Path) -> Session:
    from isagi.manifold.cog import Metric
    from isagi.manifold.memory import TrajectoryMemory
    from isagi.manifold.ugt import Basis

    basis = Basis(np.eye(8, 4, dtype=np.float32), np.zeros(8, np.float32), np.ones(4, np.float32), 0.5)
    s = Session(id="s1", basis=basis, metric=Metric(4), memory=TrajectoryMemory(4))
    s.miku_path = tmp_path / "s1.miku"
    return s


def test_the_store_is_told_the_file_path_once_per_session_row(tmp_path: Path, monkeypatch) -> None:
    store = HistoryStore(f"sqlite:///{tmp_path / 'h.sqlite3'}")
    saved: list[Path] = []
    told: list[str] = []
    real = store.set_miku_path
    monkeypatch.setattr(store, "set_miku_path", lambda sid, path, owner, **kw: told.append(path) or real(sid, path, owner=owner, **kw))
    keep = TurnKeeper(store, lambda session, path: saved.append(path), model_id="m")
    session = _session(tmp_path)
    for i in range(3):
        keep(session, Turn(user_text=f"q{i}", reply_text=f"a{i}"))
    assert len(saved) == 3 and told == [str(session.miku_path)]
    assert store.get_session("s1", owner=session.owner).miku_path == str(session.miku_path)
    assert len(store.get_turns("s1", owner=session.owner)) == 6
    store.delete_session("s1", owner=session.owner)  # deleted from the history while still open
    keep(session, Turn(user_text="q3", reply_text="a3"))
    assert told == [str(session.miku_path)] * 2
    assert store.get_session("s1", owner=session.owner).miku_path == str(session.miku_path)
    store.close()


# --------------------------------------------------------------------------- the file first, then the history


class _Engine:
    """What isagi.pipeline.keeping reads of an engine (no model needed to write a file)."""

    def __init__(self) -> None:
        from types import SimpleNamespace

        from isagi.session.files import SessionFrame

        self.lm = SimpleNamespace(model_id="tiny/test", fingerprint="f" * 64, hidden_size=8)
        self.frame = SessionFrame(model_id="tiny/test", model_fingerprint="f" * 64, hidden_size=8, layer=1,
                                  profile_key="p", system_prompt="Be brief.")


def _real_session(sessions: Path, owner: str = "local") -> Session:
    from isagi.ids import new_session_id

    s = _session(sessions)
    s.id, s.owner = new_session_id(), owner
    s.miku_path = sessions / f"{s.id}.miku"
    return s


def _file_turns(path: Path) -> list[tuple[str, str]]:
    from isagi.session.turn import turns_from_messages
    from isagi.storage.miku import read_miku

    return [(t.user_text, t.reply_text) for t in turns_from_messages(read_miku(path).conversation)]


def _history_turns(store: HistoryStore, s: Session) -> list[tuple[str, str]]:
    rows = store.get_turns(s.id, owner=s.owner)
    return [(u.text, a.text) for u, a in zip(rows[0::2], rows[1::2], strict=True)]


class Disk:
    """A real "database or disk is full" from SQLite: ``PRAGMA max_page_count`` at the file's size."""

    def __init__(self, store: HistoryStore) -> None:
        from sqlalchemy import event

        self.store, self.pages = store, None
        event.listen(store.engine, "connect", self._on_connect)

    def _on_connect(self, conn, _record) -> None:
        if self.pages:
            conn.execute(f"PRAGMA max_page_count={self.pages}")

    def fill(self) -> None:
        with self.store.engine.connect() as c:
            self.pages = c.exec_driver_sql("PRAGMA page_count").scalar()
        self.store.engine.dispose()

    def free(self) -> None:
        self.pages = None
        self.store.engine.dispose()


def _keeper(store: HistoryStore) -> TurnKeeper:
    from isagi.session.files import save_session

    engine = _Engine()
    return TurnKeeper(store, lambda session, path: save_session(engine.frame, session, path), model_id="tiny/test")


def _turn(session: Session, keep: TurnKeeper, i: int, *, replaces_last: bool = False) -> str | None:
    """A turn joins ``session`` and is kept; ``replaces_last``: in the place of the last one, which the
    caller took out of the session first (Regenerate)."""
    t = Turn(user_text=f"q{i} " + "x" * 2000, reply_text=f"a{i} " + "y" * 2000)
    session.turns.append(t)
    return keep(session, t, replaces_from=len(session.turns) - 1 if replaces_last else None)


def test_the_file_is_written_before_the_history(tmp_path: Path) -> None:
    """When a turn's file is written, the history does not hold that turn yet (so a kill
    between the two leaves the history behind the file, never ahead)."""
    store = HistoryStore(f"sqlite:///{tmp_path / 'h.sqlite3'}")
    seen: list[int] = []
    keep = _keeper(store)
    inner = keep.save
    keep.save = lambda session, path: (seen.append(store.exchange_count(session.id, owner="local")),
                                       inner(session, path))
    s = _real_session(tmp_path)
    for i in range(3):
        assert _turn(s, keep, i) is None
    assert seen == [0, 1, 2]
    assert _history_turns(store, s) == _file_turns(s.miku_path)
    store.close()


def test_turns_made_while_the_history_is_full_are_recorded_once_it_has_room(tmp_path: Path) -> None:
    store = HistoryStore(f"sqlite:///{tmp_path / 'h.sqlite3'}")
    disk = Disk(store)
    keep = _keeper(store)
    s = _real_session(tmp_path)
    assert _turn(s, keep, 0) is None
    disk.fill()
    notices = [_turn(s, keep, i) for i in (1, 2)]
    for n in notices:  # plain words, no path, no URL
        assert n is not None and "the disk is full" in n and "next message" in n
        assert "/" not in n and "sqlite" not in n
    assert "These 2 turns are" in notices[1]
    assert len(_file_turns(s.miku_path)) == 3  # the file has every turn
    assert len(_history_turns(store, s)) == 1 and keep.waiting(s) == 2
    assert keep.retry() == 2  # still full: they wait, nothing is lost or doubled
    disk.free()
    assert keep.retry() == 0  # room again: written without a new turn, in order
    assert _history_turns(store, s) == _file_turns(s.miku_path)
    disk.fill()
    assert _turn(s, keep, 3) is not None
    disk.free()
    assert _turn(s, keep, 4) is None  # the next turn writes the waiting one first
    assert [u[:2] for u, _ in _history_turns(store, s)] == ["q0", "q1", "q2", "q3", "q4"]
    store.close()


def test_a_turn_whose_file_cannot_be_written_waits_for_it_in_memory(tmp_path: Path) -> None:
    """The history never gets ahead of the file: while the file cannot be written, the
    history is not written either; the next save writes both."""
    from isagi.errors import StorageError

    store = HistoryStore(f"sqlite:///{tmp_path / 'h.sqlite3'}")
    keep = _keeper(store)
    real_save, broken = keep.save, [True]

    def save(session, path):
        if broken[0]:
            raise StorageError(f"Could not save the session to {path}: No space left on device.")
        real_save(session, path)

    keep.save = save
    s = _real_session(tmp_path)
    broken[0] = False
    _turn(s, keep, 0)
    broken[0] = True
    notice = _turn(s, keep, 1)
    assert notice is not None and "could not be saved (the disk is full)" in notice and str(tmp_path) not in notice
    assert len(_history_turns(store, s)) == 1 and keep.retry() == 1  # the history waits for the file
    broken[0] = False
    assert _turn(s, keep, 2) is None
    assert len(_file_turns(s.miku_path)) == 3 and _history_turns(store, s) == _file_turns(s.miku_path)
    store.close()


def test_a_loaded_session_gets_its_earlier_turns_recorded_and_regenerate_replaces(tmp_path: Path) -> None:
    store = HistoryStore(f"sqlite:///{tmp_path / 'h.sqlite3'}")
    keep = _keeper(store)
    s = _real_session(tmp_path)
    s.turns = [Turn(user_text=f"old{i}", reply_text=f"r{i}") for i in range(3)]  # e.g. an uploaded file
    assert _turn(s, keep, 3) is None
    assert len(_history_turns(store, s)) == 4 and _history_turns(store, s) == _file_turns(s.miku_path)
    s.turns.pop()  # Regenerate: undo the last turn, the new one replaces it
    assert _turn(s, keep, 9, replaces_last=True) is None
    assert _history_turns(store, s) == _file_turns(s.miku_path) and len(_file_turns(s.miku_path)) == 4
    store.close()


def test_a_long_loaded_session_is_recorded_in_a_few_transactions_in_order(tmp_path: Path, monkeypatch) -> None:
    """A loaded file's earlier turns reach the history in batches of FLUSH_BATCH (one transaction
    each), not one transaction per turn: the first turn after loading a long session must not
    grow with it; the order and the Regenerate after it stay right."""
    from isagi.pipeline import keeping

    monkeypatch.setattr(keeping, "FLUSH_BATCH", 7)
    store = HistoryStore(f"sqlite:///{tmp_path / 'h.sqlite3'}")
    calls: list[int] = []
    inner = store.record_exchanges
    monkeypatch.setattr(store, "record_exchanges", lambda sid, records, **kw: (calls.append(len(records)),
                                                                            inner(sid, records, **kw))[1])
    keep = _keeper(store)
    s = _real_session(tmp_path)
    s.turns = [Turn(user_text=f"old{i}", reply_text=f"r{i}") for i in range(20)]
    assert _turn(s, keep, 20) is None
    assert calls == [7, 7, 7]  # 21 exchanges, 7 a transaction
    assert _history_turns(store, s) == _file_turns(s.miku_path) and len(_history_turns(store, s)) == 21
    s.turns.pop()
    assert _turn(s, keep, 99, replaces_last=True) is None
    assert calls == [7, 7, 7]  # a Regenerate is its own single write
    assert _history_turns(store, s) == _file_turns(s.miku_path) and _history_turns(store, s)[-1][0].startswith("q99")
    store.close()


# --------------------------------------------------------------------------- the start-up repair


def test_reconcile_adds_what_the_history_lacks_from_the_files(tmp_path: Path) -> None:
    from isagi.pipeline.keeping import reconcile_history
    from isagi.session.files import save_session

    store = HistoryStore(f"sqlite:///{tmp_path / 'h.sqlite3'}")
    keep = _keeper(store)
    sessions = tmp_path / "sessions"
    behind, regen, unknown, ahead, fine = (_real_session(sessions, owner) for owner in
                                           ("local", "local", "alice", "local", "local"))
    for s in (behind, regen, ahead, fine):
        for i in range(2):
            _turn(s, keep, i)
    engine = _Engine()
    # a kill after the file, before the history: two more turns only in the file
    behind.turns += [Turn(user_text="only in the file", reply_text="r"), Turn(user_text="and this", reply_text="r")]
    save_session(engine.frame, behind, behind.miku_path)
    # a Regenerate killed between the two: the file's last exchange is new
    regen.turns[-1] = Turn(user_text=regen.turns[-1].user_text, reply_text="a regenerated reply")
    save_session(engine.frame, regen, regen.miku_path)
    # a new session killed before its first history row: the file names its owner
    unknown.turns = [Turn(user_text="first", reply_text="r")]
    save_session(engine.frame, unknown, unknown.miku_path)
    # the history ahead (an older version wrote it first): reported, nothing deleted
    ahead.turns = ahead.turns[:1]
    save_session(engine.frame, ahead, ahead.miku_path)
    report = reconcile_history(store, sessions)
    assert report.added == {behind.id: 2, unknown.id: 1} and report.replaced == [regen.id]
    assert report.history_ahead == {ahead.id: 1} and report.disagree == [] and report.skipped == {}
    assert report.checked == 4  # the in-step file, written before its last record, is not even read
    for s in (behind, regen, unknown, fine):
        assert _history_turns(store, s) == _file_turns(s.miku_path), s.id
    assert store.get_session(unknown.id, owner="alice").miku_path == str(unknown.miku_path)
    assert len(_history_turns(store, ahead)) == 2
    assert any("added from the files" in line for line in report.lines())
    again = reconcile_history(store, sessions)  # idempotent: nothing more to do
    assert again.added == {} and again.replaced == []
    store.close()


def test_the_keeper_holds_no_session_once_its_history_is_level(tmp_path: Path) -> None:
    """Issue 37's memory that did not come back: the keeper kept every session it had ever
    recorded (up to 4,096 of them, each with its memory and cached states) in its backlogs. A
    session whose exchanges are all written is forgotten; its next turn needs no store count."""
    import gc
    import weakref

    from tests.tiny_engine import tiny_engine

    engine = tiny_engine(tmp_path)
    refs = []
    for i in range(5):
        s = engine.new_session()
        engine.turn(s, f"question number {i}")
        refs.append(weakref.ref(s))
    kept = engine.new_session()
    engine.turn(kept, "a session that stays open")
    del s
    gc.collect()
    assert all(r() is None for r in refs), "a closed session is not kept alive by the keeper"
    counts = []
    original = engine.store.exchange_count
    engine.store.exchange_count = lambda *a, **k: counts.append(1) or original(*a, **k)
    engine.turn(kept, "and its next turn")
    assert counts == [] and engine.store.exchange_count(kept.id, owner=kept.owner) == 2
    engine.store.close()
