"""One writer per session: two registries ("replicas" in one process, each with its own lease
connection) on one PostgreSQL session store (isagi.session.lease, isagi.session.registry)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from isagi.errors import SessionBusy
from isagi.session.files import load_session
from isagi.session.lease import BUSY_ELSEWHERE, AdvisoryLeases
from isagi.session.registry import SessionRegistry
from tests.tiny_engine import tiny_engine

pytestmark = pytest.mark.postgres


@pytest.fixture
def world(tmp_path: Path, pg_url: str):
    """One tiny engine, one shared store, two registries with their own lease connections."""
    from isagi.pipeline.keeping import default_keeper
    from isagi.session.dbstore import DatabaseSessionFiles

    engine = tiny_engine(tmp_path, with_store=False, max_new_tokens=4)
    files = DatabaseSessionFiles(pg_url, tmp_path / "sessions")
    engine.keep = default_keeper(lambda: engine.frame, None, model_id=engine.lm.model_id, files=files)
    leases = [AdvisoryLeases(pg_url), AdvisoryLeases(pg_url)]
    regs = [SessionRegistry(lambda: engine, files=files, leases=lease, lease_wait_s=0.3) for lease in leases]
    try:
        yield engine, files, regs, leases
    finally:
        for lease in leases:
            lease.close()
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


def test_a_session_asked_for_is_handed_over_once_its_turn_ends(world) -> None:
    engine, files, (a, b), _ = world
    sid = a.create()
    talk(engine, a, sid, "first question", "second question")
    assert files.find(sid) is not None  # the autosave went to the shared store
    with a.using(sid):  # a turn runs on a: b's bounded wait ends as busy, nothing of it is read
        with pytest.raises(SessionBusy, match="open on another ISAGI server"):
            take(b, sid)
        assert sid not in b
    # asked for while busy, a hands it over once the turn is done: b takes it over, every turn kept
    assert take(b, sid) == sid and sid not in a
    turns = b.entry(sid).session.turns
    assert [t.user_text for t in turns] == ["first question", "second question"]
    talk(engine, b, sid, "third question")
    # a's parked id asks b in turn: b, idle, hands it back with the turn it added
    talk(engine, a, sid, "fourth question")
    assert sid not in b
    assert [t.user_text for t in a.entry(sid).session.turns] == [
        "first question", "second question", "third question", "fourth question"]


def test_an_idle_holder_that_does_not_let_go_keeps_it(world) -> None:
    """A holder that never answers the request (a lease taken outside a registry) keeps the
    session: the other registry's wait ends as busy and it is not made live there."""
    engine, _files, (a, b), (lease_a, _) = world
    sid = a.create()
    talk(engine, a, sid, "kept")
    assert a.release(sid, park=True)
    assert lease_a.acquire(sid)  # held by a's connection, no live entry to hand over
    with pytest.raises(SessionBusy, match=BUSY_ELSEWHERE):
        take(b, sid)
    assert sid not in b
    lease_a.release(sid)
    assert take(b, sid) == sid


def test_a_dead_holders_lease_is_freed_and_it_writes_nothing_more(world) -> None:
    engine, _files, (a, b), (lease_a, _) = world
    sid = a.create()
    talk(engine, a, sid, "one", "two")
    lease_a.close()  # a's connection ends as when its process dies: PostgreSQL frees the lease
    assert take(b, sid) == sid
    assert [t.user_text for t in b.entry(sid).session.turns] == ["one", "two"]
    with pytest.raises(SessionBusy, match="taken over"):  # a still has it in memory: refused
        talk(engine, a, sid, "a stale write")
    assert sid not in a
    talk(engine, b, sid, "three")
    assert [t.user_text for t in b.entry(sid).session.turns] == ["one", "two", "three"]


def test_twenty_races_to_open_one_session_never_give_two_holders(world) -> None:
    """Both registries open it at once, 20 times: each either gets it (the second only once the
    first handed it over) or is told busy; at the end exactly one holds it, lease and all."""
    engine, _files, regs, leases = world
    sid = regs[0].create()
    talk(engine, regs[0], sid, "hello")
    regs[0].release(sid)
    for round_ in range(20):
        barrier = threading.Barrier(2)
        won: list[int] = []
        busy: list[int] = []

        def race(i: int, barrier: threading.Barrier = barrier, won: list[int] = won,
                 busy: list[int] = busy) -> None:
            barrier.wait()
            try:
                take(regs[i], sid)
                won.append(i)
            except SessionBusy:
                busy.append(i)

        threads = [threading.Thread(target=race, args=(i,)) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(won) + len(busy) == 2 and won, (round_, won, busy)
        holders = [i for i in (0, 1) if sid in regs[i]]
        assert len(holders) == 1 and holders[0] == won[-1], (round_, won, holders)
        assert [leases[i].confirm(sid) for i in (0, 1)] == [i == holders[0] for i in (0, 1)]
        assert [t.user_text for t in regs[holders[0]].entry(sid).session.turns] == ["hello"]
        assert regs[holders[0]].release(sid)


def test_drain_lets_the_turn_in_flight_finish_and_gives_every_session_back(world) -> None:
    from isagi.errors import ServerDraining

    engine, _files, (a, b), _ = world
    idle, busy = a.create(), a.create()
    talk(engine, a, idle, "idle one")
    talk(engine, a, busy, "busy one")
    turn_may_end = threading.Event()
    drained: list = []

    def turn() -> None:
        with a.using(busy) as entry:
            turn_may_end.wait(10)
            engine.turn(entry.session, "finished while draining")

    runner = threading.Thread(target=turn)
    runner.start()
    while not a.busy_count():
        threading.Event().wait(0.01)
    drainer = threading.Thread(target=lambda: drained.append(a.drain(30.0)))
    drainer.start()
    # the idle session is given back at once, while the other's turn still runs
    assert take(b, idle) == idle
    with pytest.raises(ServerDraining):  # nothing new starts on a
        a.create()
    with pytest.raises(ServerDraining):
        talk(engine, a, idle, "refused")
    assert drainer.is_alive()
    turn_may_end.set()
    runner.join(10)
    drainer.join(10)
    assert sorted(drained[0].released) == sorted([idle, busy]) and drained[0].left == []
    assert take(b, busy) == busy  # free at once, with the turn that finished during the drain
    assert [t.user_text for t in b.entry(busy).session.turns] == ["busy one", "finished while draining"]


def test_shutdown_gives_the_leases_back(world) -> None:
    engine, _files, (a, b), _ = world
    sid = a.create()
    talk(engine, a, sid, "kept")
    a.save_all()
    a.close()
    assert take(b, sid) == sid and len(b.entry(sid).session.turns) == 1



def test_repair_and_retention_leave_a_session_another_process_holds(world, pg_url: str) -> None:
    """The start-up repair and retention run in every replica over the shared store: a session
    live elsewhere (its lease held) is neither repaired nor removed; once free it is."""
    import time

    from isagi.pipeline.keeping import reconcile_history
    from isagi.session.retention import prune_sessions
    from isagi.storage.history import HistoryStore

    engine, files, (a, _b), _ = world
    sid = a.create()
    talk(engine, a, sid, "held elsewhere")  # the file is written; this engine keeps no history
    history = HistoryStore(pg_url)
    try:
        repaired = reconcile_history(history, files.root, files=files)
        assert repaired.held_elsewhere == [sid] and not repaired.added
        later = time.time() + 10 * 86_400
        pruned = prune_sessions(history, files, 1, now=later)
        assert pruned.kept_live == 1 and not pruned.sessions and files.find(sid) is not None
        assert a.release(sid)  # let go: now the passes may touch it
        assert reconcile_history(history, files.root, files=files).added == {sid: 1}
        assert prune_sessions(history, files, 1, now=later).sessions == [sid] and files.find(sid) is None
    finally:
        history.close()
