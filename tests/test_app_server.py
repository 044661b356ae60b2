"""The web server: /health while loading and when ready, login from ISAGI_AUTH,
nothing built at import time. The real engine on a tiny model; FastAPI's test client (no socket)."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from isagi.app.server import create_app, parse_auth
from isagi.config import load_settings
from isagi.errors import ConfigError
from tests.tiny_engine import tiny_engine


def test_parse_auth():
    assert parse_auth(None) is None
    assert parse_auth("  ") is None
    assert parse_auth("ann:secret, bob:p:w") == [("ann", "secret"), ("bob", "p:w")]
    for bad in ("ann", "ann:", ":pw"):
        with pytest.raises(ConfigError):
            parse_auth(bad)


def test_health_ready(tmp_path):
    from fastapi.testclient import TestClient

    engine = tiny_engine(tmp_path)
    app = create_app(engine, engine.settings)
    with TestClient(app) as client:
        r = client.get("/health")
        assert r.status_code == 200
        body = r.json()
        assert body["status"] == "ok" and body["model"] == "tiny/llama-random" and body["sessions"] == 0
        app.state.isagi_registry.create()
        assert client.get("/health").json()["sessions"] == 1
        page = client.get("/")
        assert page.status_code == 200 and "<html" in page.text.lower()


def test_health_while_loading_then_ready(tmp_path):
    from fastapi.testclient import TestClient

    settings = load_settings(environ={}, home=tmp_path)
    gate = threading.Event()

    def factory(progress):
        progress("Calibrating the profile", 3, 10)
        gate.wait(30)
        return tiny_engine(tmp_path)

    app = create_app(factory, settings)
    with TestClient(app) as client:
        r = client.get("/health")
        assert r.status_code == 503
        body = r.json()
        assert body["status"] == "loading" and body["stage"] == "Calibrating the profile"
        assert (body["done"], body["total"]) == (3, 10)
        assert client.get("/").status_code == 200  # the page answers while loading
        gate.set()
        assert app.state.isagi_holder.wait(30)
        assert client.get("/health").json()["status"] == "ok"


def test_health_reports_a_failed_load(tmp_path):
    from fastapi.testclient import TestClient

    settings = load_settings(environ={}, home=tmp_path)

    def factory(progress):
        raise ConfigError("model 'nope' does not exist")

    app = create_app(factory, settings)
    with TestClient(app) as client:
        app.state.isagi_holder.wait(30)
        r = client.get("/health")
        assert r.status_code == 503 and r.json() == {"status": "failed", "error": "model 'nope' does not exist"}


def test_login_required_when_auth_is_set(tmp_path):
    from fastapi.testclient import TestClient

    engine = tiny_engine(tmp_path, auth="ann:secret")
    app = create_app(engine, engine.settings)
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200  # the container's check needs no login
        cfg = client.get("/config")
        assert cfg.status_code in (401, 403) or "auth_required" in cfg.text
        bad = client.post("/login", data={"username": "ann", "password": "wrong"})
        assert bad.status_code >= 400
        ok = client.post("/login", data={"username": "ann", "password": "secret"})
        assert ok.status_code == 200
        assert client.get("/config").status_code == 200


def test_importing_the_app_builds_nothing():
    code = (
        "import sys; import isagi.app.server, isagi.app.ui, isagi.session.registry, isagi.app.plots, isagi.app.loader; "
        "print('gradio' in sys.modules, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


@pytest.mark.parametrize("host, auth, warned", [
    ("0.0.0.0", None, True), ("192.168.1.5", None, True),
    ("0.0.0.0", "ann:secret", False), ("127.0.0.1", None, False), ("localhost", None, False),
])
def test_serve_on_a_non_loopback_host_without_a_login_warns(tmp_path, monkeypatch, capsys, host, auth, warned):
    """``isagi web --host`` off loopback without ISAGI_AUTH says who can use it and how to
    require a login; with a login or on loopback it does not (nothing is loaded or bound)."""
    import isagi.app.server as server
    import isagi.app.shutdown as shutdown
    ran: list[str] = []
    monkeypatch.setattr(server, "check_port_free", lambda h, p: None)
    monkeypatch.setattr(server, "create_app", lambda *a, **k: "the app")
    monkeypatch.setattr(shutdown, "run_server", lambda app, host, port, **kw: ran.append(host))
    settings = load_settings(environ={}, home=tmp_path, auth=auth)
    server.serve(settings, host=host, port=7999)
    err = " ".join(capsys.readouterr().err.split())
    assert ran == [host]
    risk = f"Listening on {host} without a login: anyone who can reach this machine can use it"
    assert (risk in err and "ISAGI_AUTH=user:password" in err) is warned, err
    if auth and host not in server.LOOPBACK:
        assert "login required" in err


def test_a_draining_server_says_so_names_its_replica_and_starts_nothing_new(tmp_path):
    """SIGTERM's drain (app.shutdown runs app.state.isagi_drain): /health answers 503 draining,
    the idle session is saved and dropped, and a turn, new or in that session, is a 503 the
    balancer retries elsewhere; every response names the replica (ISAGI_REPLICA)."""
    from fastapi.testclient import TestClient

    engine = tiny_engine(tmp_path)
    settings = engine.settings.with_overrides(api_keys="alice:k1", replica="isagi-7")
    app = create_app(engine, settings)
    auth = {"Authorization": "Bearer k1"}
    body = {"model": "tiny/llama-random", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    with TestClient(app) as client:
        first = client.post("/v1/chat/completions", json=body, headers=auth)
        assert first.status_code == 200 and first.headers["X-Isagi-Replica"] == "isagi-7"
        sid = first.headers["X-Isagi-Session"]
        drained = app.state.isagi_drain(lambda: False)
        assert drained.released == [sid] and drained.left == []
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "draining"
        assert health.headers["X-Isagi-Replica"] == "isagi-7"
        for headers in (auth, {**auth, "X-Isagi-Session": sid}):
            r = client.post("/v1/chat/completions", json=body, headers=headers)
            assert r.status_code == 503 and r.json()["error"]["code"] == "server_draining", r.text
            assert r.headers["Retry-After"] == "1"
    rows = engine.store.get_turns(sid, owner="alice")  # the refused turns kept nothing
    assert [(r.role, r.text) for r in rows][:1] == [("user", "hello")] and len(rows) == 2
