"""Every history and file command of the CLI through typer's runner, on a real chat.

``isagi chat`` (piped) runs the real engine on the tiny random model (injected
through ``Engine.start(lm=..., profile=...)``) with the real history database
and autosave under a temporary ISAGI home; then ``sessions list|show|search|
export|delete``, ``inspect`` and ``import-legacy`` (+ ``chat --load``) are
checked against the database rows and the file.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import isagi.cli as cli
from isagi.config import load_settings
from isagi.pipeline.engine import Engine
from isagi.session.files import load_session
from isagi.storage.history import HistoryStore
from tests.tiny_engine import tiny_lm, tiny_profile

WATER = "What is the boiling point of water?"
PLANTS = "How do plants make food?"


def _tiny_start(settings: Any, *, with_store: bool = True) -> Engine:
    return Engine.start(settings, with_store=with_store, lm=tiny_lm(), profile=tiny_profile())


def invoke(*args: str, input: str | None = None) -> Any:
    return CliRunner().invoke(cli.app, list(args), input=input)


@pytest.fixture(scope="module")
def chatted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A home with one piped chat of three lines (the second a repeat of the first)."""
    home = tmp_path_factory.mktemp("cli-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cli, "_engine", _tiny_start)
        result = invoke("chat", "--home", str(home), "--max-new-tokens", "8", input=f"{WATER}\n{WATER}\n{PLANTS}\n")
    assert result.exit_code == 0, result.output
    store = HistoryStore(load_settings(environ={}, home=home).resolved_database_url)
    (summary,) = store.list_sessions(owner="local")
    return {"home": home, "store": store, "id": summary.id, "stdout": result.stdout, "summary": summary}


def test_piped_chat_prints_one_line_per_reply_and_records_every_turn(chatted: dict[str, Any]) -> None:
    store, sid = chatted["store"], chatted["id"]
    rows = store.get_turns(sid, owner="local")
    assert [r.role for r in rows] == ["user", "assistant"] * 3
    assert [r.text for r in rows if r.role == "user"] == [WATER, WATER, PLANTS]
    assert [r.tier for r in rows[::2]][:2] == ["EXPLORE", "RETRIEVE"] and rows[4].tier != "RETRIEVE"
    assert {r.verdict for r in rows} == {"ok"}
    replies = [r.text.replace("\r", " ").replace("\n", " ").strip() for r in rows if r.role == "assistant"]
    assert chatted["stdout"].splitlines() == replies and all(replies)
    assert rows[3].text == rows[1].text and rows[3].new_tokens == 0, "the repeat is the stored reply"
    assert chatted["summary"].turns == 3 and chatted["summary"].title == WATER
    # the autosaved file holds the same three turns
    engine = _tiny_start(load_settings(environ={}, home=chatted["home"]), with_store=False)
    session = load_session(engine.frame, Path(chatted["summary"].miku_path))
    assert [(t.user_text, t.tier, t.verdict) for t in session.turns] == [(r.text, r.tier, r.verdict) for r in rows[::2]]
    assert [t.reply_text for t in session.turns] == [r.text for r in rows[1::2]]


def test_sessions_list_as_text_and_json(chatted: dict[str, Any]) -> None:
    home, sid = str(chatted["home"]), chatted["id"]
    text = invoke("sessions", "list", "--home", home)
    assert text.exit_code == 0 and sid in text.output and "What is the boiling" in text.output
    header = next(line for line in text.output.splitlines() if "title" in line)
    assert all(h in header for h in ("id", "owner", "title", "turns", "updated (UTC)")), text.output
    assert ".5" not in text.output.split(sid, 1)[1].splitlines()[0], "dates without microseconds"
    data = json.loads(invoke("sessions", "list", "--home", home, "--json").stdout)
    assert [(d["id"], d["turns"], d["title"]) for d in data] == [(sid, 3, WATER)]


def test_sessions_show_prints_every_turn_and_unknown_ids_are_one_line(chatted: dict[str, Any]) -> None:
    home, sid = str(chatted["home"]), chatted["id"]
    shown = invoke("sessions", "show", sid, "--home", home)
    assert shown.exit_code == 0
    out = shown.output
    assert all(f"## Turn {i}" in out for i in (1, 2, 3)) and "## Turn 4" not in out
    assert out.count(WATER) >= 2 and PLANTS in out and "tier RETRIEVE" in out and "tier EXPLORE" in out
    missing = invoke("sessions", "show", "0123456789ab", "--home", home)
    assert missing.exit_code == 2 and "No session" in missing.output and "Traceback" not in missing.output
    assert len(missing.output.strip().splitlines()) == 1


def test_sessions_search_finds_the_messages(chatted: dict[str, Any]) -> None:
    home, sid = str(chatted["home"]), chatted["id"]
    hits = invoke("sessions", "search", "BOILING point", "--home", home)
    assert hits.exit_code == 0
    lines = hits.output.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith(f"{sid}  [user]") for line in lines)
    none = invoke("sessions", "search", "no such words here", "--home", home)
    assert none.exit_code == 0 and none.output.strip() == ""


def test_sessions_export_json_and_markdown_match_the_store(chatted: dict[str, Any], tmp_path: Path) -> None:
    home, sid, store = str(chatted["home"]), chatted["id"], chatted["store"]
    target = tmp_path / "out.json"
    assert invoke("sessions", "export", sid, "--format", "json", "-o", str(target), "--home", home).exit_code == 0
    doc = json.loads(target.read_text())
    rows = store.get_turns(sid, owner="local")
    assert doc["session"]["id"] == sid and doc["session"]["turns"] == 3
    assert [(m["seq"], m["role"], m["text"], m["tier"], m["verdict"]) for m in doc["messages"]] == [
        (r.seq, r.role, r.text, r.tier, r.verdict) for r in rows]
    md = invoke("sessions", "export", sid, "--home", home)
    assert md.exit_code == 0 and md.stdout == store.export(sid, "markdown", owner="local")
    bad = invoke("sessions", "export", sid, "--format", "xml", "--home", home)
    assert bad.exit_code == 2 and "json or markdown" in bad.output


def test_inspect_reads_the_autosaved_file(chatted: dict[str, Any]) -> None:
    path = chatted["summary"].miku_path
    # saved by the tests' tiny model: judged alone (the configured default model would refuse it)
    data = json.loads(invoke("inspect", "--any-model", path, "--json").stdout)
    assert (data["turns"], data["messages"], data["trajectories"]) == (3, 6, 2)
    assert data["verdicts"] == {"ok": 3} and data["checksum"]["status"] == "ok"
    table = invoke("inspect", "--any-model", path)
    assert table.exit_code == 0 and re.search(r"turns\s+│\s+3\s", table.output)
    assert "3 answered" in table.output and "a new topic" in table.output  # plain words, not enum names
    missing = invoke("inspect", str(Path(path).with_name("nope.miku")))
    assert missing.exit_code == 2 and "Traceback" not in missing.output


def _one_chat(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, HistoryStore, Any]:
    """A data directory with one chat of the tiny model about plants: (its path, its history
    store, the session's summary)."""
    monkeypatch.setattr(cli, "_engine", _tiny_start)
    home = str(tmp_path)
    assert invoke("chat", "--home", home, "--max-new-tokens", "4", input=f"{PLANTS}\n").exit_code == 0
    store = HistoryStore(load_settings(environ={}, home=tmp_path).resolved_database_url)
    (summary,) = store.list_sessions(owner="local")
    return home, store, summary


def test_sessions_delete_removes_the_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home, store, summary = _one_chat(tmp_path, monkeypatch)
    assert invoke("sessions", "delete", summary.id, "--home", home).exit_code == 0
    assert store.list_sessions(owner="local") == [] and store.search("plants", owner="local") == []
    assert invoke("sessions", "delete", summary.id, "--home", home).exit_code == 1  # nothing left to delete


def test_sessions_rename_retitles_the_history_and_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from isagi.storage.miku import read_miku

    home, store, summary = _one_chat(tmp_path, monkeypatch)
    done = invoke("sessions", "rename", summary.id, "  Plants\nand light ", "--home", home)
    assert done.exit_code == 0, done.output
    assert store.get_session(summary.id, owner="local").title == "Plants and light"
    assert read_miku(Path(summary.miku_path), allow_other_model=True).extra["title"] == "Plants and light"
    empty = invoke("sessions", "rename", summary.id, "   ", "--home", home)
    assert empty.exit_code != 0 and "at least one character" in empty.output
    assert invoke("sessions", "rename", "nosuchsession", "x", "--home", home).exit_code == 1


def test_import_legacy_then_chat_with_the_imported_session(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.test_legacy import v1_pair

    monkeypatch.setattr(cli, "_engine", _tiny_start)
    old, doc, _ = v1_pair(tmp_path, d=tiny_lm().hidden_size, k=8)
    new = tmp_path / "imported.miku"
    done = invoke("import-legacy", str(old), str(new))
    assert done.exit_code == 0 and str(new) in done.output.replace("\n", "")
    bad = invoke("import-legacy", str(tmp_path / "missing.miku"), str(tmp_path / "x.miku"))
    assert bad.exit_code == 2 and "Traceback" not in bad.output and not (tmp_path / "x.miku").exists()
    saved = tmp_path / "continued.miku"
    with pytest.warns(UserWarning, match="another model was allowed"):
        chat = invoke("chat", "--home", str(tmp_path / "home"), "--load", str(new), "--allow-other-model",
                      "--save", str(saved), "--max-new-tokens", "6", input=f"{WATER}\n")
    assert chat.exit_code == 0 and len(chat.stdout.splitlines()) == 1
    engine = _tiny_start(load_settings(environ={}, home=tmp_path / "home"), with_store=False)
    session = load_session(engine.frame, saved)
    assert [t.user_text for t in session.turns] == [m["content"] for m in doc["conversation"] if m["role"] == "user"] + [WATER]
    assert session.turns[-1].verdict == "ok" and session.turns[-1].distance is not None
    store = HistoryStore(load_settings(environ={}, home=tmp_path / "home").resolved_database_url)
    # the history holds the session's whole conversation, as its file does: the imported
    # turns are recorded with the first new one
    [summary] = store.list_sessions(owner="local")
    assert summary.turns == len(session.turns)
    assert [t.text for t in store.get_turns(summary.id, owner="local") if t.role == "user"] == \
        [t.user_text for t in session.turns]


def test_web_takes_host_and_port_from_the_environment_and_flags_override_them(monkeypatch) -> None:
    """``ISAGI_HOST``/``ISAGI_PORT`` choose where ``isagi web`` listens (the Docker images set
    them; a container on the host's network is given a free port this way); a flag wins."""
    import isagi.app.server
    calls: list[tuple[str, int]] = []
    monkeypatch.setattr(isagi.app.server, "serve", lambda settings, host, port: calls.append((host, port)))
    monkeypatch.setenv("ISAGI_HOST", "0.0.0.0")
    monkeypatch.setenv("ISAGI_PORT", "7999")
    assert invoke("web").exit_code == 0
    assert invoke("web", "--port", "8001", "--host", "127.0.0.1").exit_code == 0
    monkeypatch.delenv("ISAGI_HOST")
    monkeypatch.delenv("ISAGI_PORT")
    assert invoke("web").exit_code == 0
    assert calls == [("0.0.0.0", 7999), ("127.0.0.1", 8001), ("127.0.0.1", 7860)]


def test_serve_runs_the_api_without_the_page(monkeypatch) -> None:
    """``isagi serve`` is ``isagi web`` without the page (the same host and port settings)."""
    import isagi.app.server
    calls: list[tuple[str, int, bool]] = []
    monkeypatch.setattr(isagi.app.server, "serve", lambda settings, host, port, page=True: calls.append((host, port, page)))
    assert invoke("serve", "--port", "8002").exit_code == 0
    assert invoke("web").exit_code == 0
    assert calls == [("127.0.0.1", 8002, False), ("127.0.0.1", 7860, True)]
