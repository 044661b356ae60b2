"""A live ``isagi web`` (or ``isagi serve``) in a child process, for the benchmarks that need one.

Owns starting the real command line (``python -m isagi.cli web``, or ``serve``
for the API alone) on a free loopback port with a chosen data directory and
environment, waiting for ``/health`` to say ``ok`` (timed from the moment the
process is spawned), and stopping it. Used by ``isagi bench web`` (load),
``isagi bench start`` (start time), ``isagi bench serve`` (ISAGI beside
llama-server) and ``isagi bench balancer`` (two ``isagi serve`` replicas).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def health(url: str) -> dict[str, Any]:
    """``GET /health`` as a dict (a 503 while loading still has a JSON body)."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=5) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        return json.loads(e.read() or b"{}")


@dataclass
class LiveServer:
    """A running ``isagi web`` (or ``serve``): its process, URL, log file and time to ready."""

    proc: subprocess.Popen
    url: str
    log: Path
    ready_s: float

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)


def start(home: Path | None, timeout_s: float, *, poll_s: float = 0.2, command: str = "web",
          env: dict[str, str] | None = None) -> LiveServer:
    """Spawn ``isagi web`` (or ``command``: ``serve``; data directory ``home``, else the
    environment's; ``env`` added to this process's environment) and wait until ready.

    ``ready_s`` runs from just before the spawn to the first ``/health`` that
    answers ``{"status": "ok"}``. Raises ``RuntimeError`` with the log's path
    when the server exits, fails to load, or is not ready in time.
    """
    port = free_port()
    env = {**os.environ, **(env or {})}
    if home is not None:
        env["ISAGI_HOME"] = str(home)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    log = Path(tempfile.mkstemp(prefix="isagi-live-server-", suffix=".log")[1])
    url = f"http://127.0.0.1:{port}/"
    t0 = time.monotonic()
    with log.open("w") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "isagi.cli", command, "--port", str(port)],
            cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT,
        )
    server = LiveServer(proc, url, log, 0.0)
    deadline = t0 + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"isagi {command} exited with {proc.returncode}; log: {log}")
        try:
            st = health(url)
        except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError):
            st = {}
        if st.get("status") == "ok":
            server.ready_s = time.monotonic() - t0
            return server
        if st.get("status") == "failed":
            server.stop()
            raise RuntimeError(f"isagi {command} could not load the model: {st.get('error')}; log: {log}")
        time.sleep(poll_s)
    server.stop()
    raise RuntimeError(f"isagi {command} was not ready after {timeout_s:.0f} s; log: {log}")
