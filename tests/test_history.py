"""The SQL history store on a SQLite file and on a real PostgreSQL server."""

from __future__ import annotations

import json
import threading
from dataclasses import fields
from pathlib import Path
from typing import get_type_hints

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from isagi.errors import StorageError
from isagi.session.turn import Turn
from isagi.storage.history import (
    FIGURES,
    ROW_FIGURES,
    TEXT_OF,
    Base,
    HistoryStore,
    TurnRecord,
    TurnRow,
)
from isagi.storage.migrations import head_revision, upgrade_to_head
from isagi.storage.owners import LOCAL_OWNER
from isagi.storage.titles import make_title


def rec(i: int, **kw) -> Turn:
    return Turn(user_text=f"question {i}", reply_text=f"answer {i}", **kw)


# --------------------------------------------------------------------------- schema


def _schema(engine: sa.Engine) -> dict:
    insp = sa.inspect(engine)
    out = {}
    for table in sorted(insp.get_table_names()):
        out[table] = {
            "columns": {
                c["name"]: (type(c["type"]).__name__, c["nullable"])
                for c in insp.get_columns(table)
            },
            "pk": insp.get_pk_constraint(table)["constrained_columns"],
            "fks": sorted(
                (tuple(f["constrained_columns"]), f["referred_table"])
                for f in insp.get_foreign_keys(table)
            ),
            "unique": sorted(tuple(u["column_names"]) for u in insp.get_unique_constraints(table)),
            "indexes": sorted(
                (tuple(i["column_names"]), bool(i["unique"])) for i in insp.get_indexes(table)
            ),
        }
    return out


def test_blank_database_migrates_to_exactly_the_models(db_url: str) -> None:
    HistoryStore(db_url).close()
    engine = sa.create_engine(db_url)
    try:
        schema = _schema(engine)
        assert set(schema) == {"alembic_version", "sessions", "session_files", "session_leases", "turns"}
        for table in Base.metadata.sorted_tables:
            cols = schema[table.name]["columns"]
            assert list(cols) == [c.name for c in table.columns], table.name
            for c in table.columns:
                assert cols[c.name][1] == c.nullable, (table.name, c.name)
            assert schema[table.name]["pk"] == [c.name for c in table.primary_key.columns]
        assert schema["turns"]["fks"] == [(("session_id",), "sessions")]
        assert ("session_id", "seq") in schema["turns"]["unique"] or (
            (("session_id", "seq"), True) in schema["turns"]["indexes"]
        )
        with engine.connect() as conn:
            # Alembic's own comparison of the live schema with the models: no difference.
            diff = compare_metadata(
                MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata
            )
            assert diff == []
            version = (
                conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalars().all()
            )
        assert version == [head_revision()]
    finally:
        engine.dispose()


def test_migrating_twice_changes_nothing(db_url: str) -> None:
    s = HistoryStore(db_url)
    s.ensure_session("a", model_id="m", owner=LOCAL_OWNER)
    s.record_turn("a", rec(0), owner=LOCAL_OWNER)
    s.close()
    engine = sa.create_engine(db_url)
    try:
        before = _schema(engine)
        with engine.begin() as conn:
            upgrade_to_head(conn)
        HistoryStore(db_url).close()  # and opening again
        assert _schema(engine) == before
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM alembic_version")).scalar_one() == 1
            assert conn.execute(sa.text("SELECT count(*) FROM turns")).scalar_one() == 2
    finally:
        engine.dispose()


def test_sqlite_uses_wal_and_foreign_keys(tmp_path: Path) -> None:
    s = HistoryStore(f"sqlite:///{tmp_path}/h.db")
    with s.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() >= 1000
    s.close()


def test_the_record_its_rows_and_the_schema_name_the_same_fields() -> None:
    # the record the store takes: the rows' texts and the figures the columns declare
    record = get_type_hints(TurnRecord)
    assert set(record) == {*TEXT_OF.values(), *FIGURES}
    turn = get_type_hints(Turn)
    assert all(turn[name] == hint for name, hint in record.items()), "Turn has TurnRecord's field types"
    # every figure on at least one row; a stored message is its row's place, text and figures
    assert sorted({f for names in ROW_FIGURES.values() for f in names}) == sorted(FIGURES)
    assert [f.name for f in fields(TurnRow)] == ["seq", "role", "text", *FIGURES, "created_at"]


# --------------------------------------------------------------------------- behaviour


def test_record_and_read_back_a_session(store: HistoryStore) -> None:
    store.ensure_session("s1", model_id="org/model", owner=LOCAL_OWNER)
    full = Turn(
        user_text="  What is   a manifold?\nTell me.  ",
        reply_text="A space that looks flat up close.",
        tier="EXPLORE",
        distance=1.25,
        nearest_query="what is a metric",
        zone="safe",
        teh_prompt=3.5,
        teh_reply=1.0,
        verdict="ok",
        latency_s=0.42,
        prompt_tokens=17,
        new_tokens=33,
        metric_growth=0.08,
    )
    assert store.record_turn("s1", full, owner=LOCAL_OWNER) == 1
    assert store.record_turn("s1", rec(2, verdict="refused"), owner=LOCAL_OWNER) == 2
    turns = store.get_turns("s1", owner=LOCAL_OWNER)
    assert [(t.seq, t.role) for t in turns] == [
        (0, "user"),
        (1, "assistant"),
        (2, "user"),
        (3, "assistant"),
    ]
    u, a = turns[0], turns[1]
    assert (u.text, u.tier, u.distance, u.nearest_query, u.zone, u.teh_prompt, u.prompt_tokens) == (
        full.user_text,
        "EXPLORE",
        1.25,
        "what is a metric",
        "safe",
        3.5,
        17,
    )
    assert (a.text, a.teh_reply, a.latency_s, a.new_tokens, a.metric_growth, a.verdict) == (
        full.reply_text,
        1.0,
        0.42,
        33,
        0.08,
        "ok",
    )
    assert turns[2].verdict == turns[3].verdict == "refused"
    assert all(t.created_at.tzinfo is not None for t in turns)
    [summary] = store.list_sessions(owner=LOCAL_OWNER)
    assert summary.title == "What is a manifold? Tell me."  # first user message, one line
    assert summary.turns == 2 and summary.model_id == "org/model"
    assert summary.updated_at >= summary.created_at


def test_titles_are_truncated_and_explicit_titles_win(store: HistoryStore) -> None:
    store.ensure_session("long", model_id="m", owner=LOCAL_OWNER)
    store.record_turn("long", Turn(user_text="word " * 100, reply_text="r"), owner=LOCAL_OWNER)
    store.ensure_session("named", model_id="m", title="My title", owner=LOCAL_OWNER)
    store.record_turn("named", rec(0), owner=LOCAL_OWNER)
    titles = {s.id: s.title for s in store.list_sessions(owner=LOCAL_OWNER)}
    assert len(titles["long"]) <= 80 and titles["long"].endswith("…")
    assert titles["named"] == "My title"
    assert make_title("short") == "short"


def test_list_orders_by_recent_activity_and_pages(store: HistoryStore) -> None:
    for sid in ("a", "b", "c"):
        store.ensure_session(sid, model_id="m", owner=LOCAL_OWNER)
        store.record_turn(sid, rec(0), owner=LOCAL_OWNER)
    store.record_turn("a", rec(1), owner=LOCAL_OWNER)  # a is now the most recent
    assert [s.id for s in store.list_sessions(owner=LOCAL_OWNER)] == ["a", "c", "b"]
    assert [s.id for s in store.list_sessions(limit=1, offset=1, owner=LOCAL_OWNER)] == ["c"]
    assert {s.id: s.turns for s in store.list_sessions(owner=LOCAL_OWNER)} == {"a": 2, "b": 1, "c": 1}


def test_search_is_case_insensitive_substring(store: HistoryStore) -> None:
    store.ensure_session("s", model_id="m", owner=LOCAL_OWNER)
    store.record_turn(
        "s",
        Turn(user_text="Tell me about RIEMANN metrics", reply_text="Riemannian geometry…"),
        owner=LOCAL_OWNER,
    )
    store.record_turn(
        "s", Turn(user_text="100% sure? use_under_score", reply_text="nothing here"), owner=LOCAL_OWNER
    )
    hits = store.search("riemann", owner=LOCAL_OWNER)
    assert sorted((h.seq, h.role) for h in hits) == [(0, "user"), (1, "assistant")]
    assert all(h.session_id == "s" and h.session_title for h in hits)
    # LIKE wildcards in the query are literal characters
    assert [h.text for h in store.search("%", owner=LOCAL_OWNER)] == ["100% sure? use_under_score"]
    assert [h.text for h in store.search("e_u", owner=LOCAL_OWNER)] == ["100% sure? use_under_score"]
    assert store.search("x_y", owner=LOCAL_OWNER) == [] and store.search("nomatch", owner=LOCAL_OWNER) == []
    assert len(store.search("e", limit=2, owner=LOCAL_OWNER)) == 2


def test_search_folds_unicode_case_on_sqlite(tmp_path: Path) -> None:
    s = HistoryStore(f"sqlite:///{tmp_path}/h.db")
    s.ensure_session("u", model_id="m", owner=LOCAL_OWNER)
    s.record_turn("u", Turn(user_text="ÜBER Straße", reply_text="ok"), owner=LOCAL_OWNER)
    assert [h.text for h in s.search("über", owner=LOCAL_OWNER)] == ["ÜBER Straße"]
    assert [h.text for h in s.search("STRASSE", owner=LOCAL_OWNER)] == ["ÜBER Straße"]
    s.close()


def test_export_json_and_markdown(store: HistoryStore) -> None:
    store.ensure_session("e", model_id="org/model", title="Export me", owner=LOCAL_OWNER)
    store.record_turn(
        "e",
        Turn(
            user_text="Hi 🤖", reply_text="Hello!", tier="RETRIEVE", distance=0.1, teh_reply=2.0
        ),
        owner=LOCAL_OWNER,
    )
    doc = json.loads(store.export("e", "json", owner=LOCAL_OWNER))
    assert doc["session"]["id"] == "e" and doc["session"]["title"] == "Export me"
    assert [(m["role"], m["text"]) for m in doc["messages"]] == [
        ("user", "Hi 🤖"),
        ("assistant", "Hello!"),
    ]
    assert doc["messages"][0]["tier"] == "RETRIEVE" and doc["messages"][1]["teh_reply"] == 2.0
    md = store.export("e", "markdown", owner=LOCAL_OWNER)
    assert md.startswith("# Export me\n")
    assert "## Turn 1" in md and "Hi 🤖" in md and "Hello!" in md and "tier RETRIEVE" in md
    with pytest.raises(StorageError, match="format"):
        store.export("e", "html", owner=LOCAL_OWNER)  # type: ignore[arg-type]


def test_unknown_session_is_a_clear_error(store: HistoryStore) -> None:
    for call in (
        lambda: store.get_turns("nope", owner=LOCAL_OWNER),
        lambda: store.export("nope", "json", owner=LOCAL_OWNER),
        lambda: store.record_turn("nope", rec(0), owner=LOCAL_OWNER),
        lambda: store.set_miku_path("nope", "/x.miku", owner=LOCAL_OWNER),
    ):
        with pytest.raises(StorageError, match="No session 'nope'.*sessions list"):
            call()
    assert store.delete_session("nope", owner=LOCAL_OWNER) is False


def test_delete_removes_session_and_turns(store: HistoryStore) -> None:
    for sid in ("keep", "drop"):
        store.ensure_session(sid, model_id="m", owner=LOCAL_OWNER)
        store.record_turn(sid, rec(0), owner=LOCAL_OWNER)
    assert store.delete_session("drop", owner=LOCAL_OWNER) is True
    assert [s.id for s in store.list_sessions(owner=LOCAL_OWNER)] == ["keep"]
    assert store.search("question", owner=LOCAL_OWNER) and all(
        h.session_id == "keep" for h in store.search("question", owner=LOCAL_OWNER)
    )
    with store.engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM turns")).scalar_one() == 2


def test_miku_path_and_ensure_session_is_idempotent(store: HistoryStore) -> None:
    store.ensure_session("m", model_id="first", owner=LOCAL_OWNER)
    store.ensure_session("m", model_id="second", owner=LOCAL_OWNER)
    store.set_miku_path("m", "/data/sessions/m.miku", owner=LOCAL_OWNER)
    [s] = store.list_sessions(owner=LOCAL_OWNER)
    assert s.model_id == "first" and s.miku_path == "/data/sessions/m.miku"


def test_reopening_keeps_data(db_url: str) -> None:
    s = HistoryStore(db_url)
    s.ensure_session("p", model_id="m", owner=LOCAL_OWNER)
    s.record_turn("p", rec(0), owner=LOCAL_OWNER)
    s.close()
    s = HistoryStore(db_url)
    assert [t.text for t in s.get_turns("p", owner=LOCAL_OWNER)] == ["question 0", "answer 0"]
    s.close()


# --------------------------------------------------------------------------- concurrency


@pytest.mark.timeout(300)
def test_eight_threads_hundred_turns_each(db_url: str) -> None:
    """8 writers x 100 turns: each to its own session and all to one shared session,
    through one store and through separate stores (separate engines, like processes)."""
    stores = [HistoryStore(db_url) for _ in range(3)]
    for i in range(8):
        stores[0].ensure_session(f"own{i}", model_id="m", owner=LOCAL_OWNER)
    stores[0].ensure_session("shared", model_id="m", owner=LOCAL_OWNER)
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def writer(i: int) -> None:
        try:
            start.wait()
            mine = stores[i % len(stores)]
            for j in range(100):
                mine.record_turn(
                    f"own{i}", Turn(user_text=f"u{i}-{j}", reply_text=f"a{i}-{j}"), owner=LOCAL_OWNER
                )
                mine.record_turn(
                    "shared", Turn(user_text=f"u{i}-{j}", reply_text=f"a{i}-{j}"), owner=LOCAL_OWNER
                )
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    s = stores[0]
    for i in range(8):
        turns = s.get_turns(f"own{i}", owner=LOCAL_OWNER)
        assert [t.seq for t in turns] == list(range(200))
        assert [t.text for t in turns] == [
            x for j in range(100) for x in (f"u{i}-{j}", f"a{i}-{j}")
        ]
    shared = s.get_turns("shared", owner=LOCAL_OWNER)
    assert [t.seq for t in shared] == list(range(1600))
    pairs = [(shared[n].text, shared[n + 1].text) for n in range(0, 1600, 2)]
    assert all(u[0] == "u" and a == "a" + u[1:] for u, a in pairs)  # exchanges never interleave
    for i in range(8):  # each writer's turns appear in its own order
        mine = [u for u, _ in pairs if u.startswith(f"u{i}-")]
        assert mine == [f"u{i}-{j}" for j in range(100)]
    assert {x.id: x.turns for x in s.list_sessions(limit=100, owner=LOCAL_OWNER)}["shared"] == 800
    for st in stores:
        st.close()


# --------------------------------------------------------------------------- bad URLs


@pytest.mark.parametrize(
    "url, message",
    [
        ("not a url", "not valid"),
        ("nosuchdb://x/y", "Cannot open"),
        ("postgresql+psycopg://u:secret@127.0.0.1:1/db", "Cannot open.*server is running"),
    ],
)
def test_bad_database_urls_are_storage_errors(url: str, message: str) -> None:
    with pytest.raises(StorageError, match=message) as info:
        HistoryStore(url)
    assert "secret" not in str(info.value)  # passwords are never printed


def test_unwritable_sqlite_location_is_a_storage_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(StorageError, match="Cannot open"):
        HistoryStore(f"sqlite:///{blocker}/sub/h.db")


def test_migrations_do_not_depend_on_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # no alembic.ini, no repository around
    s = HistoryStore(f"sqlite:///{tmp_path / 'h.db'}")
    s.ensure_session("x", model_id="m", owner=LOCAL_OWNER)
    assert s.record_turn("x", rec(0), owner=LOCAL_OWNER) == 1
    s.close()


def test_in_memory_sqlite_works_across_threads() -> None:
    s = HistoryStore("sqlite://")
    s.ensure_session("m", model_id="m", owner=LOCAL_OWNER)
    t = threading.Thread(target=lambda: s.record_turn("m", rec(0), owner=LOCAL_OWNER))
    t.start()
    t.join()
    assert [r.text for r in s.get_turns("m", owner=LOCAL_OWNER)] == ["question 0", "answer 0"]
    s.close()


def test_record_exchange_creates_the_session_once_and_replaces_in_one_call(store: HistoryStore) -> None:
    """The agent's one write per turn: the session row on the first turn only, a Regenerate
    replacing the last exchange, and another owner's id left untouched."""
    assert store.record_exchange("s1", rec(1), owner="ann", model_id="m", title="first") == (1, True)
    assert store.record_exchange("s1", rec(2), owner="ann", model_id="m", title="other") == (2, False)
    assert store.record_exchange("s1", rec(3), owner="ann", model_id="m", replace_last=True) == (2, False)
    rows = store.get_turns("s1", owner="ann")
    assert [r.text for r in rows] == ["question 1", "answer 1", "question 3", "answer 3"]
    summary = store.get_session("s1", owner="ann")
    assert summary.title == "first" and summary.model_id == "m" and summary.turns == 2
    # a Regenerate as the very first write of a session is its first turn
    assert store.record_exchange("s2", rec(4), owner="ann", model_id="m", replace_last=True) == (1, True)
    with pytest.raises(StorageError, match="not found|No session"):
        store.record_exchange("s1", rec(5), owner="bob", model_id="m")
    assert len(store.get_turns("s1", owner="ann")) == 4


def test_record_exchanges_appends_many_in_order_after_the_existing_ones(store: HistoryStore) -> None:
    """Many exchanges in one call land after the session's last one, in order, numbered on;
    another owner's id is refused and gets nothing."""
    assert store.record_exchange("s1", rec(0), owner="ann", model_id="m", title="first") == (1, True)
    assert store.record_exchanges("s1", [rec(i) for i in range(1, 6)], owner="ann", model_id="m") == (6, False)
    rows = store.get_turns("s1", owner="ann")
    assert [r.text for r in rows] == [t for i in range(6) for t in (f"question {i}", f"answer {i}")]
    assert [r.seq for r in rows] == list(range(12))
    assert store.record_exchanges("s3", [rec(7), rec(8)], owner="ann", model_id="m") == (2, True)
    assert store.get_session("s3", owner="ann").title == "question 7"
    with pytest.raises(StorageError, match="not found|No session"):
        store.record_exchanges("s1", [rec(9)], owner="bob", model_id="m")
    assert store.exchange_count("s1", owner="ann") == 6


def test_repair_exchanges_brings_the_history_level_with_a_file_and_deletes_nothing_else(store):
    """The start-up repair's store half, on SQLite and PostgreSQL: a prefix is completed,
    a differing last exchange replaced, a longer history kept, an early difference left."""
    def turns(*pairs):
        return [Turn(user_text=u, reply_text=r) for u, r in pairs]

    file = turns(("q1", "a1"), ("q2", "a2"), ("q3", "a3"))
    assert store.exchange_count("s1", owner="alice") == 0
    assert store.repair_exchanges("s1", file, owner="alice", model_id="m") == ("added", 3)  # row created
    assert store.get_session("s1", owner="alice").turns == 3 and "s1" in store.session_times()
    assert store.session_times()["s1"][0] == "alice"
    assert store.repair_exchanges("s1", file, owner="alice", model_id="m") == ("in step", 0)
    more = file + turns(("q4", "a4"))
    assert store.repair_exchanges("s1", more, owner="alice", model_id="m") == ("added", 1)
    regen = file + turns(("q4", "another a4"))
    assert store.repair_exchanges("s1", regen, owner="alice", model_id="m") == ("replaced", 1)
    assert [t.text for t in store.get_turns("s1", owner="alice")][-2:] == ["q4", "another a4"]
    assert store.repair_exchanges("s1", file, owner="alice", model_id="m") == ("history ahead", 1)
    assert store.repair_exchanges("s1", turns(("x", "y")), owner="alice", model_id="m") == ("disagree", 0)
    assert store.exchange_count("s1", owner="alice") == 4  # nothing was deleted by the last two
    assert store.exchange_count("s1", owner="bob") == 0
    with pytest.raises(StorageError):  # another owner's session is "not found", never written
        store.repair_exchanges("s1", more, owner="bob", model_id="m")
