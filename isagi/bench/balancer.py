"""What the balancer costs: the API through HAProxy in front of two replicas, beside one replica
reached directly, in the same run.

``isagi bench balancer --db URL --users 1,16 --json`` starts two ``isagi serve`` replicas on the
PostgreSQL database ``URL`` (history and session files, as ``ISAGI_DATABASE_URL`` and
``ISAGI_SESSIONS_URL``; each with a data directory of its own in a temporary folder) and Debian's
``haproxy`` on the repository's ``docker/haproxy/haproxy.cfg`` in front of them, all on
loopback, and stops them afterwards; ``--url LB --direct REPLICA`` measures a running setup
instead (the balancer, and one replica behind it).

Two figures:

- the balancer's own cost: ``GET /v1/models`` (answered without the model), ``probes`` times
  through the balancer and directly, alternating, one request at a time on a kept-alive
  connection each; p50 and p95 of both and the balancer's added p50;
- turns: for each number of users, concurrent API conversations (``isagi bench api``'s session
  driver: the official ``openai`` client, streamed, kept to their session by ``X-Isagi-Session``)
  through the balancer and directly to one replica, in ABBA order over ``rounds`` rounds;
  throughput (answered turns per second of the pass), p50 and p95 of the turn latency, and the
  balancer's added p50. Every pass asks questions no other pass asked (no answer from memory).

Through the balancer the conversations spread over both replicas; directly they all go to one.
Where both replicas share a machine's cores, the turns compare one process's queue with two
processes contending for the same cores: overhead, not speed-up (the output says how many cores).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from isagi.bench import live_server
from isagi.bench.api import _api_session
from isagi.bench.web import TOPICS, _drive, _figures, _percentile
from isagi.errors import ConfigError, InputError

HAPROXY_CFG = live_server.ROOT / "docker" / "haproxy" / "haproxy.cfg"
TARGETS = ("balancer", "direct")


def _haproxy() -> str:
    exe = shutil.which("haproxy") or "/usr/sbin/haproxy"
    if not Path(exe).exists():
        raise ConfigError("isagi bench balancer starts Debian's haproxy: install it (bash .ci/haproxy.sh, or "
                          "apt-get install haproxy), or measure a running setup with --url and --direct.")
    if not HAPROXY_CFG.exists():
        raise ConfigError(f"no {HAPROXY_CFG}: run the benchmark from a checkout of the repository.")
    return exe


def _servers_up(stats_url: str, want: int) -> bool:
    """Whether HAProxy's statistics page shows ``want`` servers UP in each backend."""
    try:
        with urllib.request.urlopen(stats_url + "/;csv", timeout=5) as r:
            rows = r.read().decode().lstrip("# ").splitlines()
    except OSError:
        return False
    head = rows[0].split(",")
    up: dict[str, int] = {}
    for row in rows[1:]:
        cells = dict(zip(head, row.split(","), strict=False))
        if cells.get("svname") not in ("FRONTEND", "BACKEND") and cells.get("status", "").startswith("UP"):
            up[cells["pxname"]] = up.get(cells["pxname"], 0) + 1
    return up.get("pages") == want and up.get("api") == want


@contextlib.contextmanager
def _setup(db_url: str, start_timeout_s: float) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """Two replicas on ``db_url`` and HAProxy in front: (balancer URL, replica 1's URL, facts)."""
    exe = _haproxy()
    cores = os.cpu_count() or 1
    threads = str(max(1, cores // 2))
    tmp = Path(tempfile.mkdtemp(prefix="isagi-bench-balancer-"))
    replicas: list[live_server.LiveServer] = []
    lb: subprocess.Popen[bytes] | None = None
    try:
        for name in ("r1", "r2"):
            replicas.append(live_server.start(tmp / name, start_timeout_s, command="serve", env={
                "ISAGI_DATABASE_URL": db_url, "ISAGI_SESSIONS_URL": db_url, "ISAGI_REPLICA": name,
                "ISAGI_THREADS": threads}))
        lb_port, stats_port = live_server.free_port(), live_server.free_port()
        env = {**os.environ, "ISAGI_LB_BIND": f"127.0.0.1:{lb_port}", "ISAGI_LB_STATS_BIND": f"127.0.0.1:{stats_port}",
               **{f"ISAGI_REPLICA_{i}": r.url.removeprefix("http://").rstrip("/") for i, r in enumerate(replicas, 1)}}
        with (tmp / "haproxy.log").open("w") as log:
            lb = subprocess.Popen([exe, "-db", "-f", str(HAPROXY_CFG)], env=env, stdout=log, stderr=subprocess.STDOUT)
        stats = f"http://127.0.0.1:{stats_port}"
        deadline = time.monotonic() + 60
        while not _servers_up(stats, len(replicas)):
            if lb.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"haproxy did not see both replicas up; its log: {tmp / 'haproxy.log'}")
            time.sleep(0.2)
        yield f"http://127.0.0.1:{lb_port}", replicas[0].url.rstrip("/"), {
            "started": "two isagi serve replicas (ISAGI_THREADS=" + threads + " each) and haproxy, here",
            "replica_start_s": [round(r.ready_s, 1) for r in replicas]}
    finally:
        if lb is not None and lb.poll() is None:
            lb.terminate()
            lb.wait(30)
        for r in replicas:
            r.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def _probe(lb: str, direct: str, probes: int) -> dict[str, Any]:
    """``GET /v1/models`` through the balancer and directly, alternating: the balancer's own cost."""
    import httpx

    times: dict[str, list[float]] = {t: [] for t in TARGETS}
    with httpx.Client(timeout=30) as via_lb, httpx.Client(timeout=30) as via_direct:
        for client, url in ((via_lb, lb), (via_direct, direct)):  # connections opened, first answers read
            client.get(url + "/v1/models").raise_for_status()
        for i in range(probes):
            for target in (TARGETS if i % 2 == 0 else TARGETS[::-1]):
                client, url = (via_lb, lb) if target == "balancer" else (via_direct, direct)
                t0 = time.perf_counter()
                client.get(url + "/v1/models").raise_for_status()
                times[target].append(time.perf_counter() - t0)
    p50 = {t: _percentile(times[t], 0.5) for t in TARGETS}
    out: dict[str, Any] = {t: {"p50_ms": _ms(p50[t]), "p95_ms": _ms(_percentile(times[t], 0.95))} for t in TARGETS}
    out["added_p50_ms"] = _ms((p50["balancer"] or 0) - (p50["direct"] or 0))
    out["note"] = f"GET /v1/models x {probes} each, alternating, one at a time, kept-alive connections"
    return out


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


def run(lb_url: str | None, direct_url: str | None, *, db_url: str | None = None, users: tuple[int, ...] = (1, 16),
        turns: int = 3, rounds: int = 2, max_new_tokens: int = 16, probes: int = 200,
        start_timeout_s: float = 600.0) -> dict[str, Any]:
    """The figures (module docstring), against ``lb_url`` and ``direct_url``, or a setup started
    here on the PostgreSQL database ``db_url``."""
    if (lb_url is None) != (direct_url is None):
        raise InputError("Give both --url (the balancer) and --direct (one replica behind it), or neither "
                         "(then --db: the benchmark starts its own).")
    if lb_url is None and not db_url:
        raise InputError("Without --url and --direct the benchmark starts two replicas and haproxy: give --db "
                         "postgresql+psycopg://user:pw@host/db (their shared history and sessions).")
    if not users or min(users) < 1 or turns < 1 or rounds < 1 or probes < 1:
        raise InputError("--users, --turns, --rounds and --probes must each be 1 or more.")
    try:
        import openai  # noqa: F401 - a dev dependency; said before anything is started
    except ImportError:
        raise ConfigError("isagi bench balancer drives the API with the official openai client; "
                          "install it first: pip install openai") from None
    with contextlib.ExitStack() as stack:
        facts: dict[str, Any] = {"started": "a running setup (--url, --direct)"}
        if lb_url is None:
            assert db_url is not None
            lb_url, direct_url, facts = stack.enter_context(_setup(db_url, start_timeout_s))
        assert direct_url is not None
        lb, direct = lb_url.rstrip("/"), direct_url.rstrip("/")
        out: dict[str, Any] = {"probe": _probe(lb, direct, probes)}
        number = len(TOPICS)  # each pass's first session number: every pass asks new questions
        warm = _drive(lb, 1, 1, max_new_tokens, None, first=number, session=_api_session)[0]["errors"]
        warm += _drive(direct, 1, 1, max_new_tokens, None, first=2 * number, session=_api_session)[0]["errors"]
        number *= 3
        for n in users:
            pooled: dict[str, dict[str, list[Any]]] = {
                t: {"latency": [], "queue_wait": [], "answered": [], "errors": []} for t in TARGETS}
            wall = dict.fromkeys(TARGETS, 0.0)
            order = [t for r in range(rounds) for t in (TARGETS if r % 2 == 0 else TARGETS[::-1])]
            for target in order:
                got, took = _drive(lb if target == "balancer" else direct, n, turns, max_new_tokens, None,
                                   first=number, session=_api_session)
                number += len(TOPICS) * -(-n // len(TOPICS))
                for key, values in got.items():
                    pooled[target][key] += values
                wall[target] += took
            figures = {t: _figures(pooled[t], wall[t], n * rounds, turns, max_new_tokens, None) for t in TARGETS}
            for t in TARGETS:
                figures[t]["throughput_turns_per_s"] = round(figures[t]["answered"] / wall[t], 3) if wall[t] else None
                for key in ("model", "note", "max_new_tokens"):
                    figures[t].pop(key, None)
            added = (figures["balancer"]["p50_s"] or 0) - (figures["direct"]["p50_s"] or 0)
            out[f"users_{n}"] = {**figures, "added_p50_ms": _ms(added), "order": order}
    return {
        **out,
        "setup": facts,
        "cores": os.cpu_count(),
        "warmup_errors": warm[:5],
        "note": (f"turns: {rounds} round(s) per target of N concurrent API conversations x {turns} turns, "
                 f"replies capped at {max_new_tokens} new tokens, greedy; through the balancer they spread "
                 "over both replicas, directly they all go to one. Both replicas on one machine share its "
                 f"{os.cpu_count()} cores: this shows the balancer's overhead, not a speed-up."),
    }
