"""Running ISAGI's images in the container tests (``tests/test_docker_containers.py``).

Owns: whether Docker can run here (and why not), the image under test, and one
container's life: ``docker run`` on the host's network with a free port
(``ISAGI_PORT``), waiting for ``/health`` and for Docker's own health status,
``docker stop``/``rm -f``, named volumes made and removed by the tests, and the Compose v2
command the compose tests use. The
daemon ``make docker-test`` starts has no bridge network, so every container
runs with ``--network host``: it listens on 127.0.0.1 at the port it is given.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CPU_IMAGE = os.environ.get("ISAGI_DOCKER_IMAGE", "isagi:cpu")
GPU_IMAGE = os.environ.get("ISAGI_DOCKER_GPU_IMAGE", "isagi:gpu")
# docker/compose.yaml's replicas profile on images built here from the local base (docker/build.sh
# haproxy|postgres), where Docker Hub's haproxy and postgres images cannot be pulled
HAPROXY_IMAGE = os.environ.get("ISAGI_DOCKER_HAPROXY_IMAGE", "isagi-haproxy:bookworm")
POSTGRES_IMAGE = os.environ.get("ISAGI_DOCKER_POSTGRES_IMAGE", "isagi-postgres:bookworm")
START_TIMEOUT_S = float(os.environ.get("ISAGI_DOCKER_START_TIMEOUT", "600"))


def docker(*args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``docker ARGS``, text output captured; raises with its stderr when ``check`` and it fails."""
    proc = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args)} exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    return proc


def why_not(image: str) -> str | None:
    """None when Docker answers here and ``image`` exists; else the reason, for the skip."""
    if shutil.which("docker") is None:
        return "no docker command here (make docker-test installs Debian's docker.io)"
    try:
        info = docker("info", "--format", "{{json .ServerVersion}}", check=False, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"docker does not answer: {exc}"
    if info.returncode != 0:
        return f"no Docker daemon answers ({info.stderr.strip()[:200]}); make docker-test starts one"
    if docker("image", "inspect", image, check=False, timeout=30).returncode != 0:
        return f"image {image} is not built here (make docker-test builds it)"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def health(url: str) -> tuple[int, dict]:
    """(status code, JSON body) of ``GET url/health``; (0, {}) when nothing answers."""
    try:
        with urllib.request.urlopen(url + "health", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")
    except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError):
        return 0, {}


def record_figure(name: str, value: object) -> None:
    """Add a measured figure to the JSON file ``make docker-test`` prints (ISAGI_DOCKER_FIGURES)."""
    path = os.environ.get("ISAGI_DOCKER_FIGURES")
    if not path:
        return
    p = Path(path)
    data = json.loads(p.read_text()) if p.exists() else {}
    data[name] = value
    p.write_text(json.dumps(data, indent=1))


@dataclass
class Container:
    """One ISAGI container on the host's network, listening on 127.0.0.1:``port``."""

    name: str
    port: int
    started_at: float
    ready_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    def inspect(self) -> dict:
        return json.loads(docker("inspect", self.name).stdout)[0]

    def logs(self) -> str:
        out = docker("logs", "--tail", "60", self.name, check=False)
        return (out.stdout + out.stderr)[-6000:]

    def exec(self, *argv: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return docker("exec", self.name, *argv, timeout=timeout)

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> float:
        """Seconds from ``docker run`` until ``/health`` says ok; fails with the logs otherwise."""
        deadline = self.started_at + timeout
        while time.monotonic() < deadline:
            code, body = health(self.url)
            if code == 200 and body.get("status") == "ok":
                self.ready_s = round(time.monotonic() - self.started_at, 1)
                return self.ready_s
            if body.get("status") == "failed":
                raise AssertionError(f"the model failed to load: {body}\n{self.logs()}")
            state = self.inspect()["State"]
            if not state["Running"]:
                raise AssertionError(f"the container exited ({state['ExitCode']}):\n{self.logs()}")
            time.sleep(0.5)
        raise AssertionError(f"/health not ok after {timeout:.0f} s:\n{self.logs()}")

    def wait_healthy(self, timeout: float = START_TIMEOUT_S) -> float:
        """Seconds from ``docker run`` until Docker's HEALTHCHECK says ``healthy``."""
        deadline = self.started_at + timeout
        status = None
        while time.monotonic() < deadline:
            health_state = self.inspect()["State"].get("Health") or {}
            status = health_state.get("Status")
            if status == "healthy":
                return round(time.monotonic() - self.started_at, 1)
            if status == "unhealthy":
                raise AssertionError(f"unhealthy: {health_state.get('Log')}\n{self.logs()}")
            time.sleep(0.5)
        raise AssertionError(f"health status {status!r} after {timeout:.0f} s:\n{self.logs()}")


def run_container(image: str, *, volumes: dict[str, str] | None = None, env: dict[str, str] | None = None,
                  extra: tuple[str, ...] = (), command: tuple[str, ...] = ()) -> Container:
    """``docker run -d`` of ``image`` on the host's network at a free port (its own ISAGI_PORT,
    bound to 127.0.0.1), with named ``volumes`` (name -> path) and ``env``."""
    name = f"isagi-test-{uuid.uuid4().hex[:10]}"
    port = free_port()
    argv = ["run", "-d", "--name", name, "--network", "host",
            "-e", f"ISAGI_PORT={port}", "-e", "ISAGI_HOST=127.0.0.1"]
    for vol, path in (volumes or {}).items():
        argv += ["-v", f"{vol}:{path}"]
    for key, value in (env or {}).items():
        argv += ["-e", f"{key}={value}"]
    argv += [*extra, image, *command]
    started = time.monotonic()
    docker(*argv)
    return Container(name=name, port=port, started_at=started)


def remove(container: Container) -> None:
    docker("rm", "-f", container.name, check=False)


@contextlib.contextmanager
def container(image: str, **kwargs) -> Iterator[Container]:
    """A running container (see :func:`run_container`), removed at the end."""
    c = run_container(image, **kwargs)
    try:
        yield c
    finally:
        remove(c)


@contextlib.contextmanager
def volumes(*roles: str) -> Iterator[dict[str, str]]:
    """Fresh named volumes, one per role (e.g. "data", "models"), removed at the end."""
    names = {role: f"isagi-test-{role}-{uuid.uuid4().hex[:8]}" for role in roles}
    for name in names.values():
        docker("volume", "create", name)
    try:
        yield names
    finally:
        for name in names.values():
            docker("volume", "rm", "-f", name, check=False)


def compose_command() -> list[str] | None:
    """A Compose v2 command: ``docker compose`` (plugin), or a ``docker-compose`` v2 on PATH
    or in .isagi/docker-tools/ (docker/compose.sh puts it there); None otherwise."""
    candidates = [["docker", "compose"]]
    for path in (shutil.which("docker-compose"), str(REPO / ".isagi" / "docker-tools" / "docker-compose")):
        if path and os.access(path, os.X_OK):
            candidates.append([path])
    for cmd in candidates:
        out = subprocess.run([*cmd, "version", "--short"], capture_output=True, text=True)
        if out.returncode == 0 and out.stdout.strip().lstrip("v")[:1].isdigit() \
                and int(out.stdout.strip().lstrip("v").split(".")[0]) >= 2:
            return cmd
    return None
