"""Fenced writes: a process whose session lease was lost while it lived on writes nothing of that
session once another process has taken it (isagi.storage.fences, isagi.session.lease).

The lease connection is ended with ``pg_terminate_backend``, as a PostgreSQL restart, a network
cut or a long pause past keepalive would end it, while the process and its live copy go on.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.pool import NullPool

from isagi.bench.miku import synthetic_state
from isagi.errors import MOVED, MOVED_SAVED, SessionMoved
from isagi.ids import new_session_id
from isagi.session.files import load_session
from isagi.session.lease import AdvisoryLeases, lease_key
from isagi.session.registry import SessionRegistry
from isagi.session.turn import Turn
from isagi.storage.fences import check
from isagi.storage.history import HistoryStore
from isagi.storage.owners import LOCAL_OWNER
from tests.tiny_engine import tiny_engine

pytestmark = pytest.mark.postgres

WAIT_S = 30.0  # the most any wait here takes (each ends as soon as what it waits for is seen)


def _lock_holder(conn: sa.Connection, sid: str) -> int | None:
    key = lease_key(sid) & 0xFFFF_FFFF_FFFF_FFFF
    return conn.execute(sa.text(
        "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 1 "
        "AND classid::bigint = :hi AND objid::bigint = :lo"), {"hi": key >> 32, "lo": key & 0xFFFF_FFFF}).scalar()


def cut(url: str, sid: str) -> None:
    """End the connection that holds ``sid``'s lease (PostgreSQL frees the lock with it); the
    process that holds it is not told."""
    engine = sa.create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            pid = _lock_holder(conn, sid)
            assert pid is not None, "nobody holds the lease"
            # with a timeout, it returns once the backend is gone (and its locks with it)
            assert conn.execute(sa.text("SELECT pg_terminate_backend(:pid, :ms)"),
                                {"pid": pid, "ms": int(WAIT_S * 1000)}).scalar()
            assert _lock_holder(conn, sid) is None
    finally:
        engine.dispose()


def _state(sid: str, turns: int, seed: int):
    state = synthetic_state(turns, k=4, d=8, seed=seed, app_fields=True)
    state.extra["session_id"] = sid
    return state


def _texts(state) -> list[str]:
    return [m["text"] for m in state.conversation]


@pytest.fixture
def stores(tmp_path: Path, pg_url: str):
    """The shared session files, the history (one database, as shipped) and two processes' leases."""
    from isagi.session.dbstore import DatabaseSessionFiles

    files = DatabaseSessionFiles(pg_url, tmp_path / "sessions")
    history = HistoryStore(pg_url)
    history.use_leases(files.engine)
    leases = [AdvisoryLeases(pg_url), AdvisoryLeases(pg_url)]
    try:
        yield files, history, leases
    finally:
        for lease in leases:
            lease.close()
        history.close()
        files.close()


def test_a_stale_holders_save_and_history_write_fail_and_leave_the_new_holders_state(stores, pg_url: str) -> None:
    files, history, (lease_a, lease_b) = stores
    sid = new_session_id()
    path = files.path(sid)
    assert lease_a.acquire(sid)
    fence_a = lease_a.fence(sid)
    assert fence_a is not None and fence_a.session_id == sid
    files.write(path, _state(sid, 1, seed=1), fence=fence_a)
    history.record_exchange(sid, Turn("a asked", "a answered"), owner=LOCAL_OWNER, model_id="m", fence=fence_a)

    cut(pg_url, sid)
    assert lease_a.held(sid)  # a does not know: only its next query on that connection would tell it
    assert lease_b.acquire(sid)
    fence_b = lease_b.fence(sid)
    assert fence_b is not None and fence_b.epoch == fence_a.epoch + 1
    b_state = _state(sid, 3, seed=2)
    files.write(path, b_state, fence=fence_b)
    history.record_exchange(sid, Turn("b asked", "b answered"), owner=LOCAL_OWNER, model_id="m", fence=fence_b)

    # every write a still makes with its lease is refused, with the "moved" words
    with pytest.raises(SessionMoved, match="taken over by another ISAGI server"):
        files.write(path, _state(sid, 2, seed=3), fence=fence_a)
    assert fence_a.lost and not fence_b.lost
    with pytest.raises(SessionMoved):
        history.record_exchange(sid, Turn("a again", "stale"), owner=LOCAL_OWNER, model_id="m", fence=fence_a)
    with pytest.raises(SessionMoved):  # an edit's cut (the exchanges from one on replaced) too
        history.record_exchange(sid, Turn("a edits", "stale"), owner=LOCAL_OWNER, model_id="m", replace_from=0,
                                fence=fence_a)
    with pytest.raises(SessionMoved):
        history.record_exchanges(sid, [Turn("a", "stale")], owner=LOCAL_OWNER, model_id="m", fence=fence_a)
    with pytest.raises(SessionMoved):
        history.rename_session(sid, "a's title", owner=LOCAL_OWNER, fence=fence_a)
    with pytest.raises(SessionMoved):
        history.set_miku_path(sid, "/elsewhere.miku", owner=LOCAL_OWNER, fence=fence_a)
    # the file and the history hold b's state only
    assert _texts(files.read(path)) == _texts(b_state)
    assert [(r.role, r.text) for r in history.get_turns(sid, owner=LOCAL_OWNER)] == [
        ("user", "a asked"), ("assistant", "a answered"), ("user", "b asked"), ("assistant", "b answered")]
    assert history.get_session(sid, owner=LOCAL_OWNER).title != "a's title"
    # b's own writes go on
    history.rename_session(sid, "b's title", owner=LOCAL_OWNER, fence=fence_b)
    assert history.get_session(sid, owner=LOCAL_OWNER).title == "b's title"


def test_a_write_in_progress_is_read_by_the_next_holder_and_none_after_its_lease(stores, pg_url: str) -> None:
    """The orderable pair: a takeover waits for a write that passed its check to commit (and then
    reads it); the writer's next write, after the takeover, is refused."""
    from sqlalchemy.dialects.postgresql import insert

    from isagi.storage.history import SessionFileModel
    from isagi.storage.miku import encode_miku

    files, _history, (lease_a, lease_b) = stores
    sid = new_session_id()
    path = files.path(sid)
    assert lease_a.acquire(sid)
    fence_a = lease_a.fence(sid)
    assert fence_a is not None
    files.write(path, _state(sid, 1, seed=1), fence=fence_a)
    cut(pg_url, sid)
    late = _state(sid, 4, seed=5)
    took: list[bool] = []
    with files.engine.begin() as conn:
        check(conn, fence_a)  # a's save has passed its check when the lease goes
        taker = threading.Thread(target=lambda: took.append(lease_b.acquire(sid)))
        taker.start()
        _wait_for_a_lock_wait(conn)  # b has the lock, and its epoch bump waits for this save
        conn.execute(insert(SessionFileModel).values(name=path.name, data=encode_miku(late), updated_at=sa.func.now())
                     .on_conflict_do_update(index_elements=[SessionFileModel.name],
                                            set_={"data": encode_miku(late)}))
    taker.join(WAIT_S)
    assert took == [True]
    assert _texts(files.read(path)) == _texts(late)  # what b loads holds a's last save
    with pytest.raises(SessionMoved):
        files.write(path, _state(sid, 2, seed=6), fence=fence_a)
    assert _texts(files.read(path)) == _texts(late)


def _wait_for_a_lock_wait(conn: sa.Connection) -> None:
    """Until another backend waits for a row lock on ``session_leases`` held by ``conn``'s."""
    import time

    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        with conn.engine.connect() as look:
            waiting = look.execute(sa.text(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND :me = ANY(pg_blocking_pids(pid)) AND query LIKE '%session_leases%'"),
                {"me": conn.execute(sa.text("SELECT pg_backend_pid()")).scalar()}).scalar()
        if waiting:
            return
        time.sleep(0.02)
    raise AssertionError("the takeover never waited for the save in progress")


def test_with_the_history_in_another_database_its_writes_are_fenced_from_the_store(stores, tmp_path: Path,
                                                                                  pg_url: str) -> None:
    files, _history, (lease_a, lease_b) = stores
    elsewhere = HistoryStore(f"sqlite:///{tmp_path / 'history.db'}")
    try:
        elsewhere.use_leases(files.engine)
        sid = new_session_id()
        assert lease_a.acquire(sid)
        fence_a = lease_a.fence(sid)
        elsewhere.record_exchange(sid, Turn("a asked", "a answered"), owner=LOCAL_OWNER, model_id="m",
                                  fence=fence_a)
        cut(pg_url, sid)
        assert lease_b.acquire(sid)
        with pytest.raises(SessionMoved):
            elsewhere.record_exchange(sid, Turn("a again", "stale"), owner=LOCAL_OWNER, model_id="m",
                                      fence=fence_a)
        elsewhere.record_exchange(sid, Turn("b asked", "b answered"), owner=LOCAL_OWNER, model_id="m",
                                  fence=lease_b.fence(sid))
        assert [r.text for r in elsewhere.get_turns(sid, owner=LOCAL_OWNER)] == [
            "a asked", "a answered", "b asked", "b answered"]
    finally:
        elsewhere.close()


# -- two replicas in one process: a turn in flight when its lease goes ------------------------------


@pytest.fixture
def replicas(tmp_path: Path, pg_url: str):
    """Two engines (each its own keeper and history connection, as two processes have) and two
    registries with their own lease connections, on one shared store and one history."""
    from isagi.pipeline.keeping import default_keeper
    from isagi.session.dbstore import DatabaseSessionFiles

    files = DatabaseSessionFiles(pg_url, tmp_path / "sessions")
    made = []
    for _ in ("a", "b"):
        engine = tiny_engine(tmp_path, with_store=False, max_new_tokens=4)  # its sessions folder is the store's
        history = HistoryStore(pg_url)
        engine.store = history
        engine.keep = default_keeper(lambda engine=engine: engine.frame, history, model_id=engine.lm.model_id,
                                     files=files)
        leases = AdvisoryLeases(pg_url)
        registry = SessionRegistry(lambda engine=engine: engine, files=files, leases=leases, lease_wait_s=0.3)
        made.append((engine, registry, history, leases))
    try:
        yield files, made
    finally:
        for _engine, _registry, history, leases in made:
            leases.close()
            history.close()
        files.close()


def take(reg: SessionRegistry, sid: str) -> str:
    """What the service does for a reload or a Resume: the lease first, then its last save."""
    with reg.leased(sid):
        session = load_session(reg.engine.frame, reg.files.path(sid), session_id=sid, files=reg.files)
        return reg.reopen(session)


def talk(engine, reg: SessionRegistry, sid: str, *texts: str) -> None:
    for text in texts:
        with reg.using(sid) as entry:
            engine.turn(entry.session, text)


def _kept(files, history: HistoryStore, sid: str) -> tuple[list[str], list[str]]:
    """The questions of the session's file and of its history."""
    state = files.read(files.path(sid))
    asked = [m["text"] for m in state.conversation if m["role"] == "user"]
    return asked, [r.text for r in history.get_turns(sid, owner=LOCAL_OWNER) if r.role == "user"]


def _pause(obj, name: str) -> tuple[threading.Event, threading.Event]:
    """Make ``obj.name`` wait when called (a long pause of its process just before a write):
    (arrived, go_on)."""
    arrived, go_on = threading.Event(), threading.Event()
    real = getattr(obj, name)

    def paused(*args, **kwargs):
        arrived.set()
        assert go_on.wait(WAIT_S)
        return real(*args, **kwargs)

    setattr(obj, name, paused)
    return arrived, go_on


def _turn_in_thread(engine, reg: SessionRegistry, sid: str, text: str) -> tuple[threading.Thread, list]:
    done: list = []

    def run() -> None:
        from isagi.pipeline.events import Done

        with reg.using(sid) as entry:
            for event in engine.stream_turn(entry.session, text):
                if isinstance(event, Done):
                    done.append(event)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, done


def test_a_turn_whose_lease_went_before_its_save_is_not_kept_and_the_new_holders_turns_are(replicas,
                                                                                         pg_url: str) -> None:
    files, ((engine_a, a, _h, lease_a), (engine_b, b, history, _)) = replicas
    sid = a.create()
    talk(engine_a, a, sid, "one", "two")
    arrived, go_on = _pause(engine_a.keep, "save")
    runner, done = _turn_in_thread(engine_a, a, sid, "three, on a")
    assert arrived.wait(WAIT_S)  # a's turn is generated; its save has not begun
    cut(pg_url, sid)
    assert take(b, sid) == sid  # b takes it over from its last save
    talk(engine_b, b, sid, "three, on b")
    go_on.set()
    runner.join(WAIT_S)
    assert not runner.is_alive() and len(done) == 1
    assert done[0].notice == MOVED  # a's user is told the chat moved (the page shows it as a warning)
    assert sid not in a and not lease_a.held(sid)  # a dropped its copy
    assert _kept(files, history, sid) == (["one", "two", "three, on b"],) * 2
    talk(engine_b, b, sid, "four, on b")
    assert _kept(files, history, sid) == (["one", "two", "three, on b", "four, on b"],) * 2
    assert [t.user_text for t in b.entry(sid).session.turns] == ["one", "two", "three, on b", "four, on b"]


def test_a_turn_whose_lease_went_between_its_file_and_its_history_is_written_once(replicas, pg_url: str) -> None:
    """The file was written while a held the lease, so b loads that turn; a's history write after
    b took over is refused, and b's keeper writes the turn to the history once."""
    files, ((engine_a, a, history_a, _), (engine_b, b, history, _)) = replicas
    sid = a.create()
    talk(engine_a, a, sid, "one")
    arrived, go_on = _pause(history_a, "record_exchanges")
    runner, done = _turn_in_thread(engine_a, a, sid, "two, on a")
    assert arrived.wait(WAIT_S)  # its file is written, its history rows not yet
    cut(pg_url, sid)
    assert take(b, sid) == sid
    assert [t.user_text for t in b.entry(sid).session.turns] == ["one", "two, on a"]
    talk(engine_b, b, sid, "three, on b")
    go_on.set()
    runner.join(WAIT_S)
    assert not runner.is_alive() and done[0].notice == MOVED_SAVED and sid not in a  # b has the turn
    assert _kept(files, history, sid) == (["one", "two, on a", "three, on b"],) * 2


def test_a_save_outside_a_turn_after_the_lease_went_drops_the_session_unsaved(replicas, pg_url: str) -> None:
    """The idle round (or a page closed) saves a session whose lease went unnoticed: refused,
    the session is dropped here, and the new holder's file stays."""
    files, ((engine_a, a, _h, _), (engine_b, b, history, _)) = replicas
    sid = a.create()
    talk(engine_a, a, sid, "one")
    a._save_fn()
    arrived, go_on = _pause(a, "_save")  # the save has passed the check at its start when the lease goes
    saver = threading.Thread(target=lambda: a.release(sid, park=True, owner=None))
    saver.start()
    assert arrived.wait(WAIT_S)
    cut(pg_url, sid)
    assert take(b, sid) == sid
    talk(engine_b, b, sid, "two, on b")
    go_on.set()
    saver.join(WAIT_S)
    assert sid not in a and not a.is_live(sid)
    assert _kept(files, history, sid) == (["one", "two, on b"],) * 2


def test_a_rename_is_refused_once_the_lease_went_and_one_of_a_chat_not_live_takes_the_lease(replicas,
                                                                                          pg_url: str) -> None:
    from isagi.session.service import SessionService

    files, ((engine_a, a, _h, lease_a), (engine_b, b, history, _)) = replicas
    service_a = SessionService(a)
    sid = a.create()
    talk(engine_a, a, sid, "one")
    cut(pg_url, sid)
    assert take(b, sid) == sid
    with pytest.raises(SessionMoved):
        service_a.rename(sid, LOCAL_OWNER, "a's title")
    assert sid not in a
    assert b.release(sid, park=True)  # live nowhere now: a rename takes its lease while it writes
    assert service_a.rename(sid, LOCAL_OWNER, "the new title") == "the new title"
    assert files.read(files.path(sid)).extra["title"] == "the new title"
    assert history.get_session(sid, owner=LOCAL_OWNER).title == "the new title"
    assert not lease_a.held(sid) and sid not in a
    talk(engine_b, b, sid, "two, on b")  # b resumes it from that save
    assert b.entry(sid).session.title == "the new title"


# -- deletes, the start-up repair and retention: fenced like the saves -----------------------------


def test_a_stale_holders_delete_and_repair_write_nothing(stores, pg_url: str) -> None:
    files, history, (lease_a, lease_b) = stores
    sid = new_session_id()
    path = files.path(sid)
    assert lease_a.acquire(sid)
    fence_a = lease_a.fence(sid)
    files.write(path, _state(sid, 1, seed=1), fence=fence_a)
    history.record_exchange(sid, Turn("a asked", "a answered"), owner=LOCAL_OWNER, model_id="m", fence=fence_a)
    cut(pg_url, sid)
    assert lease_b.acquire(sid)
    b_state = _state(sid, 2, seed=2)
    files.write(path, b_state, fence=lease_b.fence(sid))
    history.record_exchange(sid, Turn("b asked", "b answered"), owner=LOCAL_OWNER, model_id="m",
                            fence=lease_b.fence(sid))

    with pytest.raises(SessionMoved):
        history.delete_session(sid, owner=LOCAL_OWNER, fence=fence_a)
    with pytest.raises(SessionMoved):
        files.remove(sid, path, fence=fence_a)
    with pytest.raises(SessionMoved):  # the repair's rewrite of a last exchange
        history.repair_exchanges(sid, [Turn("a asked", "a answered"), Turn("b asked", "a's other reply")],
                                 owner=LOCAL_OWNER, model_id="m", fence=fence_a)
    assert files.find(sid) == path and _texts(files.read(path)) == _texts(b_state)
    assert [r.text for r in history.get_turns(sid, owner=LOCAL_OWNER)] == [
        "a asked", "a answered", "b asked", "b answered"]
    # the holder's own delete goes through
    assert history.delete_session(sid, owner=LOCAL_OWNER, fence=lease_b.fence(sid))
    assert files.remove(sid, path, fence=lease_b.fence(sid)) == [path] and files.find(sid) is None


def test_a_retention_pass_whose_lease_went_removes_nothing_of_the_session(stores, pg_url: str) -> None:
    """The pass holds the session's lease (its own connection) when that connection is cut and
    another process takes the session: its delete is refused, the session counted as kept."""
    import time

    from isagi.session.retention import prune_sessions

    files, history, (_lease_a, lease_b) = stores
    sid = new_session_id()
    files.write(files.path(sid), _state(sid, 1, seed=1))
    history.record_exchange(sid, Turn("asked", "answered"), owner=LOCAL_OWNER, model_id="m")

    def taken_over_meanwhile(seen: str) -> bool:  # called while the pass holds seen's lease
        cut(pg_url, seen)
        assert lease_b.acquire(seen)
        return False

    pruned = prune_sessions(history, files, 1, now=time.time() + 10 * 86_400, is_live=taken_over_meanwhile)
    assert pruned.sessions == [] and pruned.files == [] and pruned.kept_live == 1
    assert files.find(sid) is not None
    assert [r.text for r in history.get_turns(sid, owner=LOCAL_OWNER)] == ["asked", "answered"]


def test_a_repair_whose_lease_went_adds_no_row_after_the_new_holders(stores, pg_url: str, monkeypatch) -> None:
    from isagi.pipeline.keeping import reconcile_history

    files, history, (_lease_a, lease_b) = stores
    sid = new_session_id()
    state = _state(sid, 2, seed=1)
    state.extra["owner"] = LOCAL_OWNER
    files.write(files.path(sid), state)  # a file with no history yet: the repair would add both
    real_read = files.read

    def read_then_lose_the_lease(path, **kwargs):  # the repair holds the lease while it reads
        cut(pg_url, sid)
        assert lease_b.acquire(sid)
        history.record_exchange(sid, Turn("b asked", "b answered"), owner=LOCAL_OWNER, model_id="m",
                                fence=lease_b.fence(sid))
        return real_read(path, **kwargs)

    monkeypatch.setattr(files, "read", read_then_lose_the_lease)
    report = reconcile_history(history, files.root, files=files)
    assert report.held_elsewhere == [sid] and not report.added and not report.skipped
    assert [r.text for r in history.get_turns(sid, owner=LOCAL_OWNER)] == ["b asked", "b answered"]
    assert history.get_session(sid, owner=LOCAL_OWNER).miku_path is None


def test_a_delete_takes_the_lease_from_an_idle_holder_and_is_refused_while_its_turn_runs(replicas) -> None:
    """Deleting a chat that another replica has open: that replica is asked to let go; while a
    turn runs there it cannot, the delete answers busy and deletes nothing; once idle it hands
    the chat over and the delete removes the file and the history for good."""
    from isagi.errors import SessionBusy
    from isagi.session.lease import BUSY_ELSEWHERE
    from isagi.session.service import SessionService

    files, ((engine_a, a, _h, lease_a), (_engine_b, b, history, lease_b)) = replicas
    service_b = SessionService(b)
    sid = a.create()
    talk(engine_a, a, sid, "one")
    arrived, go_on = _pause(engine_a.keep, "save")
    runner, done = _turn_in_thread(engine_a, a, sid, "two")
    assert arrived.wait(WAIT_S)
    with pytest.raises(SessionBusy, match=BUSY_ELSEWHERE):
        service_b.delete(sid, LOCAL_OWNER)
    assert not lease_b.held(sid)
    go_on.set()
    runner.join(WAIT_S)
    assert len(done) == 1 and done[0].notice != MOVED
    assert _kept(files, history, sid) == (["one", "two"],) * 2  # nothing was deleted
    removed = service_b.delete(sid, LOCAL_OWNER)  # a is idle now: it hands the chat over
    assert removed == [files.path(sid)] and files.find(sid) is None
    assert history.list_sessions(owner=LOCAL_OWNER) == []
    assert sid not in a and not lease_a.held(sid) and not lease_b.held(sid)


def _cli_beside_a_holder(stores, tmp_path: Path, pg_url: str, monkeypatch) -> tuple[Any, str, str]:
    """The CLI on the shared store while a server (lease a) holds a session with one saved turn:
    (a function running it, the session id, the --home it runs with)."""
    from typer.testing import CliRunner

    from isagi.cli import app

    files, history, (lease_a, _lease_b) = stores
    monkeypatch.setenv("ISAGI_SESSIONS_URL", pg_url)
    monkeypatch.setenv("ISAGI_DATABASE_URL", pg_url)
    sid = new_session_id()
    assert lease_a.acquire(sid)
    files.write(files.root / f"{sid}.miku", _state(sid, 1, seed=1), fence=lease_a.fence(sid))
    history.record_exchange(sid, Turn("asked", "answered"), owner=LOCAL_OWNER, model_id="m",
                            fence=lease_a.fence(sid))
    return (lambda *args: CliRunner().invoke(app, list(args))), sid, str(tmp_path / "home")


def test_the_cli_delete_is_refused_while_a_server_holds_the_session(stores, tmp_path: Path, pg_url: str,
                                                                     monkeypatch) -> None:
    """`isagi sessions delete` beside servers on the shared store: refused, saying where to delete
    it, while one holds the session's lease (nothing deleted); done once it is free."""
    files, history, (lease_a, _lease_b) = stores
    cli, sid, home = _cli_beside_a_holder(stores, tmp_path, pg_url, monkeypatch)
    refused = cli("sessions", "delete", sid, "--home", home)
    assert refused.exit_code != 0 and "is open on an ISAGI server" in refused.output, refused.output
    assert files.find(sid) is not None and len(history.get_turns(sid, owner=LOCAL_OWNER)) == 2
    lease_a.release(sid)
    done = cli("sessions", "delete", sid, "--home", home)
    assert done.exit_code == 0, done.output
    assert files.find(sid) is None and history.list_sessions(owner=LOCAL_OWNER) == []


def test_the_cli_rename_is_refused_while_a_server_holds_the_session(stores, tmp_path: Path, pg_url: str,
                                                                     monkeypatch) -> None:
    """`isagi sessions rename` beside servers on the shared store: refused while one holds the
    session's lease (the title unchanged in the file and the history: the server's open copy
    would save its own title over it); done, in both, once it is free."""
    files, history, (lease_a, _lease_b) = stores
    cli, sid, home = _cli_beside_a_holder(stores, tmp_path, pg_url, monkeypatch)
    before = history.get_session(sid, owner=LOCAL_OWNER).title
    refused = cli("sessions", "rename", sid, "A new name", "--home", home)
    assert refused.exit_code != 0 and "is open on an ISAGI server" in refused.output, refused.output
    assert history.get_session(sid, owner=LOCAL_OWNER).title == before
    assert files.read(files.find(sid), allow_other_model=True).extra.get("title") != "A new name"
    lease_a.release(sid)
    done = cli("sessions", "rename", sid, "A new name", "--home", home)
    assert done.exit_code == 0, done.output
    assert history.get_session(sid, owner=LOCAL_OWNER).title == "A new name"
    assert files.read(files.find(sid), allow_other_model=True).extra["title"] == "A new name"
