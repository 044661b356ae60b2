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


def test_one_holder_then_a_takeover_with_every_finished_turn(world) -> None:
    engine, files, (a, b), _ = world
    sid = a.create()
    talk(engine, a, sid, "first question", "second question")
    assert files.find(sid) is not None  # the autosave went to the shared store
    with pytest.raises(SessionBusy, match="open on another ISAGI server"):
        take(b, sid)
    assert sid not in b
    assert a.release(sid, park=True)
    assert take(b, sid) == sid
    turns = b.entry(sid).session.turns
    assert [t.user_text for t in turns] == ["first question", "second question"]
    talk(engine, b, sid, "third question")
    with pytest.raises(SessionBusy, match=BUSY_ELSEWHERE):  # a's parked id: now b's
        a.entry(sid)


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
        assert len(won) == 1 and len(busy) == 1, (round_, won, busy)
        holders = [i for i in (0, 1) if sid in regs[i]]
        assert holders == won and [leases[i].confirm(sid) for i in (0, 1)].count(True) == 1
        assert regs[won[0]].release(sid)


def test_shutdown_gives_the_leases_back(world) -> None:
    engine, _files, (a, b), _ = world
    sid = a.create()
    talk(engine, a, sid, "kept")
    a.save_all()
    a.close()
    assert take(b, sid) == sid and len(b.entry(sid).session.turns) == 1

