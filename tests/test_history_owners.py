"""Owners in the history store: one owner never reads, finds, exports, extends or
deletes another's session (the answer is the same as for an id that does not
exist), and the migration to revision 0002 makes every existing row ``local``,
on a real SQLite file made at revision 0001 and on PostgreSQL."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic import command

from isagi.errors import StorageError
from isagi.session.turn import Turn
from isagi.storage.history import HistoryStore
from isagi.storage.migrations import alembic_config, head_revision
from isagi.storage.owners import LOCAL_OWNER


def _two_owners(store: HistoryStore) -> None:
    store.ensure_session("a1", owner="alice", model_id="m", title="alice secret plan")
    store.record_turn("a1", Turn(user_text="alice secret question", reply_text="alice answer"),
                      owner="alice")
    store.set_miku_path("a1", "/data/sessions/a1.miku", owner="alice")
    store.ensure_session("b1", owner="bob", model_id="m")
    store.record_turn("b1", Turn(user_text="bob question", reply_text="bob answer"), owner="bob")


def test_each_owner_sees_only_their_own(store: HistoryStore) -> None:
    _two_owners(store)
    assert [s.id for s in store.list_sessions(owner="alice")] == ["a1"]
    assert [s.id for s in store.list_sessions(owner="bob")] == ["b1"]
    assert store.list_sessions(owner=LOCAL_OWNER) == []
    assert store.list_sessions(owner="alice")[0].owner == "alice"
    # search: bob finds nothing of alice's, even for words only she wrote
    assert store.search("secret", owner="bob") == []
    assert store.search("question", owner="bob")[0].session_id == "b1"
    assert {h.session_id for h in store.search("question", owner="alice")} == {"a1"}
    assert store.get_session("a1", owner="alice").turns == 1


def test_another_owners_id_is_not_found_like_an_unknown_id(store: HistoryStore) -> None:
    _two_owners(store)
    calls = {
        "get_session": lambda sid: store.get_session(sid, owner="bob"),
        "get_turns": lambda sid: store.get_turns(sid, owner="bob"),
        "export json": lambda sid: store.export(sid, "json", owner="bob"),
        "export markdown": lambda sid: store.export(sid, "markdown", owner="bob"),
        "record_turn": lambda sid: store.record_turn(sid, Turn("bob writes", "into it"), owner="bob"),
        "set_miku_path": lambda sid: store.set_miku_path(sid, "/tmp/x.miku", owner="bob"),
    }
    for name, call in calls.items():
        with pytest.raises(StorageError) as theirs:
            call("a1")
        with pytest.raises(StorageError) as unknown:
            call("zz")
        # the same message, the id aside: nothing tells bob that a1 exists
        assert str(theirs.value).replace("a1", "ID") == str(unknown.value).replace("zz", "ID"), name
    assert store.delete_session("a1", owner="bob") is False
    assert store.delete_session("zz", owner="bob") is False
    # ids are global (server-made, random): taking alice's id is refused, nothing written
    with pytest.raises(StorageError, match="No session 'a1'"):
        store.ensure_session("a1", owner="bob", model_id="m", title="mine now")
    # alice's session is exactly as it was: turns, title, file, owner
    info = store.get_session("a1", owner="alice")
    assert (info.turns, info.title, info.miku_path, info.owner) == (
        1, "alice secret plan", "/data/sessions/a1.miku", "alice")
    assert [t.text for t in store.get_turns("a1", owner="alice")] == ["alice secret question", "alice answer"]
    assert store.delete_session("a1", owner="alice") is True
    assert store.list_sessions(owner="alice") == []
    assert [s.id for s in store.list_sessions(owner="bob")] == ["b1"]


@pytest.mark.parametrize("owner", ["", "x" * 65, None, 3])
def test_an_unusable_owner_is_refused(store: HistoryStore, owner: object) -> None:
    with pytest.raises(StorageError, match="owner"):
        store.list_sessions(owner=owner)  # type: ignore[arg-type]
    with pytest.raises(StorageError, match="owner"):
        store.ensure_session("s", owner=owner, model_id="m")  # type: ignore[arg-type]


def test_owner_is_required_by_every_call(store: HistoryStore) -> None:
    with pytest.raises(TypeError):
        store.list_sessions()  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        store.search("x")  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        store.delete_session("x")  # type: ignore[call-arg]


# --------------------------------------------------------------------------- migration


def _at_revision_0001_with_rows(url: str) -> None:
    """A database migrated only to 0001 (the schema before owners), with rows in it."""
    if url.startswith("sqlite:///"):
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            command.upgrade(alembic_config(connection=conn), "0001_initial")
            now = dt.datetime(2026, 11, 20, 12, 0, tzinfo=dt.UTC)
            for sid in ("old1", "old2"):
                conn.execute(sa.text(
                    "INSERT INTO sessions (id, title, model_id, created_at, updated_at, miku_path) "
                    "VALUES (:id, :t, 'm', :now, :now, NULL)"), {"id": sid, "t": f"title {sid}", "now": now})
                for seq, role in ((0, "user"), (1, "assistant")):
                    conn.execute(sa.text(
                        "INSERT INTO turns (session_id, seq, role, text, verdict, created_at) "
                        "VALUES (:sid, :seq, :role, :text, 'ok', :now)"),
                        {"sid": sid, "seq": seq, "role": role, "text": f"{role} text of {sid}", "now": now})
            version = conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalar_one()
            assert version == "0001_initial"
            cols = {c["name"] for c in sa.inspect(conn).get_columns("sessions")}
            assert "owner" not in cols
    finally:
        engine.dispose()


def test_migration_0002_makes_existing_rows_local(db_url: str) -> None:
    _at_revision_0001_with_rows(db_url)
    s = HistoryStore(db_url)  # opening migrates to the newest revision
    try:
        assert head_revision() == "0004_session_leases"  # 0002 made the rows local; 0003, 0004 added tables
        assert sorted(x.id for x in s.list_sessions(owner=LOCAL_OWNER)) == ["old1", "old2"]
        assert {x.owner for x in s.list_sessions(owner=LOCAL_OWNER)} == {LOCAL_OWNER}
        assert [t.text for t in s.get_turns("old1", owner=LOCAL_OWNER)] == [
            "user text of old1", "assistant text of old1"]
        assert {h.session_id for h in s.search("text of", owner=LOCAL_OWNER)} == {"old1", "old2"}
        assert s.list_sessions(owner="alice") == [] and s.search("text", owner="alice") == []
        # the old sessions keep working: a new turn goes on after the old rows
        assert s.record_turn("old1", Turn("new", "turn"), owner=LOCAL_OWNER) == 2
        with s.engine.connect() as conn:
            owners = conn.execute(sa.text("SELECT DISTINCT owner FROM turns")).scalars().all()
            assert owners == [LOCAL_OWNER]
            assert conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalar_one() == head_revision()
    finally:
        s.close()


def test_migration_0002_downgrades_and_upgrades_again(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'h.db'}"
    _at_revision_0001_with_rows(url)
    HistoryStore(url).close()
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            command.downgrade(alembic_config(connection=conn), "0001_initial")
            assert "owner" not in {c["name"] for c in sa.inspect(conn).get_columns("turns")}
            assert conn.execute(sa.text("SELECT count(*) FROM turns")).scalar_one() == 4
    finally:
        engine.dispose()
    s = HistoryStore(url)
    assert len(s.list_sessions(owner=LOCAL_OWNER)) == 2
    s.close()
