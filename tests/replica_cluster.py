"""Several ISAGI replicas behind HAProxy on loopback, for the ``replicas`` tests.

Real processes: a fresh schema on the PostgreSQL server of ``ISAGI_TEST_POSTGRES_URL`` (the
history and the session files of every replica: ``ISAGI_DATABASE_URL`` and
``ISAGI_SESSIONS_URL``), two replicas (``isagi serve`` or ``isagi web``, each with a data
directory of its own and ``ISAGI_REPLICA`` naming it in every response), and Debian's
``haproxy`` (``.ci/haproxy.sh``) started from the shipped ``docker/haproxy/haproxy.cfg`` with
the replicas listed in its environment (ISAGI_REPLICA_1, ISAGI_REPLICA_2) and free ports.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests import history_db

ROOT = Path(__file__).resolve().parent.parent
HAPROXY_CFG = ROOT / "docker" / "haproxy" / "haproxy.cfg"
HAPROXY = os.environ.get("ISAGI_HAPROXY", "/usr/sbin/haproxy")
START_S = 300.0  # a replica's start to a ready /health (the default model loads in seconds)
REPLICA = "X-Isagi-Replica"
SESSION = "X-Isagi-Session"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def health(url: str) -> tuple[int, dict]:
    """``GET url/health``: its status and JSON body (a 503 has one too)."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def needs_services() -> str:
    """The PostgreSQL URL, or the test skipped saying what is missing."""
    if not history_db.PG_URL:
        pytest.skip("ISAGI_TEST_POSTGRES_URL is not set (make services starts PostgreSQL)")
    if not Path(HAPROXY).exists() and not shutil.which(HAPROXY):
        pytest.skip(f"no haproxy at {HAPROXY}: run `bash .ci/haproxy.sh` (installs Debian's haproxy)")
    return history_db.PG_URL


@dataclass
class Replica:
    """One ``isagi serve`` / ``isagi web`` process on a fixed loopback port."""

    name: str
    command: str  # "serve" or "web"
    port: int
    home: Path
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen | None = None
    starts: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        self.starts += 1
        log = open(self.log_path, "a")  # noqa: SIM115 - the process writes it; closed with the file handle below
        try:
            log.write(f"\n===== start {self.starts}\n")
            log.flush()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "isagi.cli", self.command, "--port", str(self.port)], cwd=ROOT,
                env={**self.env, "ISAGI_HOME": str(self.home), "ISAGI_REPLICA": self.name},
                stdout=log, stderr=subprocess.STDOUT)
        finally:
            log.close()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                pytest.fail(f"replica {self.name} exited with {self.proc.returncode}:\n{self.log()}")
            with contextlib.suppress(OSError, ValueError):
                code, body = health(self.url)
                if code == 200 and body.get("status") == "ok":
                    return
            time.sleep(0.3)
        pytest.fail(f"replica {self.name} was not ready after {START_S:g} s:\n{self.log()}")

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: nothing of it runs on (its PostgreSQL connections end with it)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def terminate(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        if self.running:
            assert self.proc is not None
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path.exists() else ""


@dataclass
class Cluster:
    """Two replicas and the balancer in front of them, on one fresh schema."""

    db_url: str
    replicas: dict[str, Replica]
    lb_port: int
    stats_port: int
    lb_log: Path
    lb: subprocess.Popen | None = None
    sessions_dir: Path = field(default_factory=lambda: Path("/nonexistent/sessions"))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.lb_port}"

    def replica(self, name: str) -> Replica:
        return self.replicas[name]

    def up(self) -> None:
        """Every replica running and ready, and the balancer seeing each of them up."""
        for r in self.replicas.values():
            if not r.running:
                r.start()
        for r in self.replicas.values():
            r.wait_ready()
        self.wait_servers(set(self.replicas), "UP")

    def server_states(self) -> dict[tuple[str, str], str]:
        """(backend, server name) -> its state on HAProxy's statistics page (UP, DOWN, ...)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.stats_port}/;csv", timeout=5) as r:
            rows = r.read().decode().lstrip("# ").splitlines()
        head = rows[0].split(",")
        out = {}
        for row in rows[1:]:
            cells = dict(zip(head, row.split(","), strict=False))
            if cells.get("svname") not in ("FRONTEND", "BACKEND"):
                out[(cells["pxname"], cells["svname"])] = cells["status"]
        return out

    def server_of(self, name: str) -> str:
        """The balancer's name of replica ``name`` (r1, r2: their order)."""
        return f"r{list(self.replicas).index(name) + 1}"

    def wait_servers(self, names: set[str], state: str, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        want = {self.server_of(n) for n in names}
        states: dict[tuple[str, str], str] = {}
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                states = self.server_states()
                if all(v.startswith(state) for (_, s), v in states.items() if s in want) and states:
                    return
            time.sleep(0.2)
        pytest.fail(f"the balancer did not see {sorted(names)} {state} in {timeout_s:g} s: {states}")

    def start_balancer(self) -> None:
        env = {**os.environ, "ISAGI_LB_BIND": f"127.0.0.1:{self.lb_port}",
               "ISAGI_LB_STATS_BIND": f"127.0.0.1:{self.stats_port}"}
        for i, r in enumerate(self.replicas.values(), 1):
            env[f"ISAGI_REPLICA_{i}"] = f"127.0.0.1:{r.port}"
        check = subprocess.run([HAPROXY, "-c", "-f", str(HAPROXY_CFG)], env=env, capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
        log = open(self.lb_log, "w")  # noqa: SIM115 - handed to the process
        try:
            self.lb = subprocess.Popen([HAPROXY, "-db", "-f", str(HAPROXY_CFG)], env=env, stdout=log,
                                       stderr=subprocess.STDOUT)
        finally:
            log.close()

    def stop(self) -> None:
        for r in self.replicas.values():
            r.stop()
        if self.lb is not None and self.lb.poll() is None:
            self.lb.terminate()
            self.lb.wait(30)


@contextlib.contextmanager
def cluster(tmp: Path, command: str, *, names: tuple[str, str] = ("a", "b"),
            env: dict[str, str] | None = None) -> Iterator[Cluster]:
    """Two replicas running ``isagi <command>`` and HAProxy in front, on a fresh schema; all
    stopped and the schema dropped afterwards."""
    needs_services()
    schema, url = history_db.fresh_pg_schema()
    base = {k: v for k, v in os.environ.items() if not k.startswith("ISAGI_")}
    base.update({"PYTHONPATH": str(ROOT), "ISAGI_DATABASE_URL": url, "ISAGI_SESSIONS_URL": url,
                 # two replicas share this machine's cores: one llama.cpp thread each
                 "ISAGI_THREADS": "1", **(env or {})})
    replicas = {n: Replica(n, command, free_port(), tmp / f"home-{n}", base, tmp / f"replica-{n}.log")
                for n in names}
    c = Cluster(url, replicas, free_port(), free_port(), tmp / "haproxy.log", sessions_dir=tmp / "sessions")
    try:
        c.start_balancer()
        c.up()
        yield c
    finally:
        c.stop()
        history_db.drop_pg_schema(schema)


def lease_is_free(db_url: str, sid: str) -> bool:
    """Whether no process holds session ``sid``'s lease now (taken and given back at once)."""
    import sqlalchemy as sa

    from isagi.session.lease import lease_key

    engine = sa.create_engine(db_url)
    try:
        with engine.connect() as conn:
            free = bool(conn.execute(sa.text("SELECT pg_try_advisory_lock(:k)"), {"k": lease_key(sid)}).scalar())
            if free:
                conn.execute(sa.text("SELECT pg_advisory_unlock(:k)"), {"k": lease_key(sid)})
            return free
    finally:
        engine.dispose()


def history_exchanges(db_url: str, sid: str, owner: str = "local") -> list[tuple[str, str]]:
    """(question, reply) of each exchange of ``sid`` in the shared history."""
    from isagi.storage.history import HistoryStore

    store = HistoryStore(db_url)
    try:
        rows = store.get_turns(sid, owner=owner)
    finally:
        store.close()
    assert [r.role for r in rows] == ["user", "assistant"] * (len(rows) // 2)
    return [(q.text, a.text) for q, a in zip(rows[::2], rows[1::2], strict=True)]


def file_turns(db_url: str, sid: str, sessions_dir: Path) -> list:
    """The turns of ``sid``'s ``.miku`` in the shared session store."""
    from isagi.session.dbstore import DatabaseSessionFiles
    from isagi.session.turn import turns_from_messages

    files = DatabaseSessionFiles(db_url, sessions_dir)
    try:
        path = files.find(sid)
        assert path is not None, f"no session file of {sid} in the shared store"
        return turns_from_messages(files.read(path, allow_other_model=True).conversation)
    finally:
        files.close()
