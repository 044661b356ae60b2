"""Two ``isagi serve`` replicas on one PostgreSQL store behind the shipped HAProxy config, on the
real default model (marker ``replicas``; :mod:`tests.replica_cluster` starts them).

- Failover: five turns through the balancer stick to one replica; it is killed (SIGKILL); the
  sixth turn, the first question again, is answered through the balancer by the other replica
  from memory (tier RETRIEVE: the living state moved, not only the text), and every finished
  turn is in the history and the session file.
- One writer: turns for one session sent to both replicas directly at once, 20 rounds: each is
  answered or told busy, never by two writers at once; the file and the history agree, with no
  turn lost or doubled.
- Draining: SIGTERM during a streamed reply: /health says draining, the reply finishes, the
  session is saved and its lease given back, and the other replica answers it at once.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.replica_cluster import (
    REPLICA,
    SESSION,
    Cluster,
    cluster,
    file_turns,
    health,
    history_exchanges,
    lease_is_free,
)

pytestmark = [pytest.mark.replicas, pytest.mark.model, pytest.mark.postgres]

MAX_TOKENS = 12  # replies kept short: these tests are about where a turn runs, not what it says
# The sixth turn after the kill: the balancer's retries (its health checks take the dead replica
# out within about 2 s), PostgreSQL freeing the dead replica's lease (at once: its connection
# ended with it) and the other replica reading the session and answering. The request's timeout.
FAILOVER_BOUND_S = 60.0
ROUNDS = 20
QUESTIONS = [
    "What is the capital of France?",
    "Name a large ocean.",
    "What colour is the sky on a clear day?",
    "How many legs does a spider have?",
    "What do bees make?",
]


@pytest.fixture(scope="module")
def lb(tmp_path_factory: pytest.TempPathFactory):
    # ISAGI_MAX_NEW_TOKENS: the cap of the drain test's long reply; the others ask for MAX_TOKENS
    with cluster(tmp_path_factory.mktemp("replicas-api"), "serve", env={"ISAGI_MAX_NEW_TOKENS": "160"}) as c:
        yield c


@pytest.fixture
def both(lb: Cluster) -> Cluster:
    """The cluster with both replicas up (a test before may have killed one)."""
    lb.up()
    return lb


def ask(url: str, text: str, sid: str | None = None, *, history: list[dict] | None = None,
        timeout: float = 120.0, key: str | None = None) -> httpx.Response:
    """One chat completion (not streamed), in session ``sid`` when given, with API key ``key``
    when given (replicas that answer more than loopback clients want one)."""
    body = {"model": model_of(url, key), "messages": [*(history or []), {"role": "user", "content": text}],
            "max_tokens": MAX_TOKENS, "temperature": 0}
    headers = {SESSION: sid} if sid else {}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=timeout)


_models: dict[str, str] = {}


def model_of(url: str, key: str | None = None) -> str:
    """The model the replicas serve (asked once)."""
    if "id" not in _models:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        _models["id"] = httpx.get(url + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
    return _models["id"]


def test_a_killed_replicas_conversation_goes_on_from_memory_on_the_other(both: Cluster) -> None:
    history: list[dict] = []
    sid: str | None = None
    served_by: list[str] = []
    for q in QUESTIONS:
        r = ask(both.url, q, sid, history=history)
        assert r.status_code == 200, r.text
        sid = sid or r.headers[SESSION]
        assert r.headers[SESSION] == sid
        served_by.append(r.headers[REPLICA])
        history += [{"role": "user", "content": q}, {"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]}]
    assert sid is not None
    assert len(set(served_by)) == 1, served_by  # the balancer kept the conversation on one replica
    holder = served_by[0]
    said = [(m["content"], a["content"]) for m, a in zip(history[::2], history[1::2], strict=True)]
    first_reply = said[0][1]

    both.replica(holder).kill()
    # every finished turn is kept: in the shared history and in the session file
    assert history_exchanges(both.db_url, sid) == said
    assert [(t.user_text, t.reply_text) for t in file_turns(both.db_url, sid, both.sessions_dir)] == said

    t0 = time.monotonic()
    r = ask(both.url, QUESTIONS[0], sid, history=history, timeout=FAILOVER_BOUND_S)
    took = time.monotonic() - t0
    assert r.status_code == 200, r.text
    body = r.json()
    assert r.headers[REPLICA] != holder and r.headers[SESSION] == sid
    assert body["isagi"]["tier"] == "RETRIEVE", body["isagi"]  # answered from the moved memory
    assert body["choices"][0]["message"]["content"] == first_reply
    print(f"failover: the sixth turn answered by {r.headers[REPLICA]} {took:.2f} s after the kill of {holder}")
    assert history_exchanges(both.db_url, sid) == [*said, (QUESTIONS[0], first_reply)]


def test_turns_sent_to_both_replicas_at_once_have_one_writer_at_a_time(both: Cluster) -> None:
    a, b = (both.replica(n) for n in ("a", "b"))
    first = ask(a.url, "Let us count rounds.")
    assert first.status_code == 200, first.text
    sid = first.headers[SESSION]
    answered: list[str] = []
    busy: list[str] = []
    writers: set[str] = set()
    for round_ in range(ROUNDS):
        results: dict[str, httpx.Response] = {}
        gate = threading.Barrier(2)

        def send(replica, text: str, gate: threading.Barrier = gate,
                 results: dict[str, httpx.Response] = results) -> None:
            gate.wait()
            results[text] = ask(replica.url, text, sid)

        texts = {f"Round {round_} through {r.name}.": r for r in (a, b)}
        threads = [threading.Thread(target=send, args=(r, t)) for t, r in texts.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        for text, r in results.items():
            if r.status_code == 200:
                assert r.headers[SESSION] == sid and r.headers[REPLICA] == texts[text].name
                answered.append(text)
                writers.add(r.headers[REPLICA])
            else:  # the other replica kept it past the bounded wait: refused, nothing of it kept
                assert r.status_code == 409 and r.json()["error"]["code"] == "session_busy", r.text
                busy.append(text)
        assert len(results) == 2, round_
    print(f"one writer: {len(answered)} turns answered, {len(busy)} refused as busy over {ROUNDS} rounds")
    assert writers == {"a", "b"}  # the session moved between them (each asked the other for it)
    kept = history_exchanges(both.db_url, sid)
    asked = [q for q, _ in kept[1:]]
    # no turn lost, none doubled: the history holds exactly the answered ones, each once
    assert sorted(asked) == sorted(answered) and len(set(asked)) == len(asked)
    # the session file (saved by whichever replica wrote last) holds the same exchanges in order
    turns = file_turns(both.db_url, sid, both.sessions_dir)
    assert [(t.user_text, t.reply_text) for t in turns] == kept
    # never two writers at once: each turn began after the one before it had ended
    for before, after in zip(turns, turns[1:], strict=False):
        assert after.asked_at >= before.answered_at, (before.user_text, after.user_text)


def test_sigterm_drains_a_replica_its_reply_finishes_and_the_other_takes_over(both: Cluster) -> None:
    start = ask(both.url, "Hello, who are you?")
    assert start.status_code == 200, start.text
    sid, holder = start.headers[SESSION], start.headers[REPLICA]
    other = next(n for n in both.replicas if n != holder)
    replica = both.replica(holder)
    body = {"model": model_of(both.url), "stream": True, "max_tokens": 160, "temperature": 0,
            "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]}
    seen: list[str] = []
    chunks: list[str] = []
    with httpx.stream("POST", replica.url + "/v1/chat/completions", json=body, headers={SESSION: sid},
                      timeout=120) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()
        for line in lines:  # the reply has begun: now the signal
            if line.startswith("data: {"):
                chunks.append(line)
                break
        replica.terminate()
        signalled = time.monotonic()
        code, state = health(replica.url)  # the drain begins within a tick of the server's loop
        while state.get("status") != "draining" and time.monotonic() < signalled + 5:
            time.sleep(0.05)
            code, state = health(replica.url)
        # draining, and the reply still in flight (its session busy) when it began; an earlier
        # test's session may still be busy too (a losing request of the 20 rounds waits up to 5 s
        # for the lease on this replica), so at least one
        seen.append(f"{code} {state.get('status')} busy={min(int(state.get('busy') or 0), 1)}")
        chunks += [line for line in lines if line.startswith("data: ")]
        finished = time.monotonic()
    assert seen == ["503 draining busy=1"], seen
    assert chunks[-1] == "data: [DONE]"
    finish = [c for c in chunks if '"finish_reason": "' in c]
    assert finish, chunks[-3:]  # the reply in flight was finished, not cut
    assert replica.proc is not None and replica.proc.wait(60) is not None
    print(f"drain: the reply ended {finished - signalled:.2f} s after SIGTERM, the process "
          f"{time.monotonic() - signalled:.2f} s after it (at most ISAGI_DRAIN_S, 30 s, plus the shutdown)")
    assert lease_is_free(both.db_url, sid)  # given back before the replica ended
    kept = history_exchanges(both.db_url, sid)
    assert [q for q, _ in kept] == ["Hello, who are you?", "Tell me a long story about a lighthouse keeper."]
    # the other replica takes it over at once, through the balancer
    r = ask(both.url, "Hello, who are you?", sid)
    assert r.status_code == 200, r.text
    assert r.headers[REPLICA] == other and r.json()["isagi"]["tier"] == "RETRIEVE"
    assert Path(replica.log_path).read_text().count("Traceback") == 0, replica.log()
