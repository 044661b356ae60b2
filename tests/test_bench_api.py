"""``isagi bench api``: both parts against one live server on the tiny model (the app the page
runs on, served by uvicorn on loopback as in tests/test_api.py), 2 sessions x 2 turns."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
from typer.testing import CliRunner

from isagi.bench.api import first, order, run
from isagi.storage.owners import LOCAL_OWNER
from tests.test_api import Served, serve

pytest.importorskip("gradio_client")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    from tests.tiny_engine import tiny_engine

    with serve(tiny_engine(tmp_path_factory.mktemp("bench-api"))) as s:
        yield s


def _conversations(served: Served) -> dict[str, list[str]]:
    """Every stored session of the local owner: its id → its questions, in order."""
    store = served.engine.store
    return {s.id: [r.text for r in store.get_turns(s.id, owner=LOCAL_OWNER) if r.role == "user"]
            for s in store.list_sessions(limit=1000, owner=LOCAL_OWNER)}


def test_both_parts_alternate_on_one_server_and_every_turn_is_answered(served) -> None:
    before = set(_conversations(served))
    got = run(served.url + "/", sessions=2, turns=2, rounds=2)
    assert got["order"] == ["api", "web", "web", "api"] == order(2)
    for part in ("api", "web"):
        fig = got[part]
        assert fig["turns"] == 8 and fig["answered"] == 8 and fig["errors"] == 0, (part, fig["error_samples"])
        assert 0 < fig["p50_s"] <= fig["p95_s"] and fig["queue_wait_p50_s"] <= fig["p50_s"]
        # 32 asked, the server's cap (ISAGI_MAX_NEW_TOKENS) reported: what the turns ran under
        assert fig["max_new_tokens"] == min(32, served.engine.settings.max_new_tokens) and fig["model"] == served.model
    assert got["ratio_api_to_web"] == {k: round(got["api"][k] / got["web"][k], 3) for k in ("p50_s", "p95_s")}
    assert "X-Isagi-Session" in got["api_sessions_by"]

    assert got["warmup_errors"] == []

    # every pass's sessions are sessions of their own: 4 passes x 2 sessions, each holding its 2
    # turns (an API conversation kept to one session by the header), then one warm-up session
    # per part with one turn; no question asked twice
    new = {sid: qs for sid, qs in _conversations(served).items() if sid not in before}
    labels = {sid: {int(re.search(r"\(session (\d+),", q).group(1)) for q in qs} for sid, qs in new.items()}
    assert all(len(n) == 1 for n in labels.values()), "a session holds one conversation's questions"
    number = {sid: n.pop() for sid, n in labels.items()}
    passes = [first(k, 2) for k in range(4)]
    assert sorted(number.values()) == sorted([f + i for f in passes for i in range(2)] + [first(4, 2), first(4, 2) + 1])
    assert all(len(new[sid]) == (2 if n < first(4, 2) else 1) for sid, n in number.items()), new
    asked = [q for qs in new.values() for q in qs]
    assert len(set(asked)) == len(asked) == 18
    # and every pass asked the same topics in the same order: only the session numbers differ
    by_number = {n: new[sid] for sid, n in number.items()}
    topics = [[re.sub(r"\(session \d+,", "(session N,", q) for i in range(2) for q in by_number[f + i]]
              for f in passes]
    assert all(t == topics[0] for t in topics), topics


def test_the_command_prints_both_parts_and_the_ratio(served) -> None:
    import isagi.cli as cli

    result = CliRunner().invoke(cli.app, ["bench", "api", "--url", served.url + "/", "--sessions", "1",
                                          "--turns", "1", "--rounds", "1", "--json"])
    assert result.exit_code == 0, result.output
    got: dict[str, Any] = json.loads(result.output)
    assert got["order"] == ["api", "web"]
    assert got["api"]["answered"] == got["web"]["answered"] == 1
    assert set(got["ratio_api_to_web"]) == {"p50_s", "p95_s"}


@pytest.mark.parametrize("flag", ["--sessions", "--turns", "--rounds"])
def test_counts_below_one_get_a_one_line_error(flag: str) -> None:
    import isagi.cli as cli

    result = CliRunner().invoke(cli.app, ["bench", "api", "--url", "http://127.0.0.1:9/", flag, "0"])
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "must each be 1 or more" in result.output, result.output
