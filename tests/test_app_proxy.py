"""Forwarded headers: believed only from the proxies ISAGI_TRUSTED_PROXIES names.

A live server on loopback (uvicorn with the options ``isagi web`` gives it, in a
thread; the real app on the tiny engine), driven over HTTP with spoofed
``X-Forwarded-For``: without a trusted proxy the header changes nothing (the
per-client chat cap and the per-address login back-off hold); with loopback
trusted, the header's address is the client's.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from isagi.app.server import create_app, uvicorn_options
from isagi.config import load_settings
from isagi.errors import ConfigError
from tests.gradio_raw import RawGradio
from tests.tiny_engine import engine_for


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def live(settings) -> Iterator[tuple[str, object]]:
    """The app served by uvicorn on a free loopback port as ``serve`` configures it; yields (url, app)."""
    import uvicorn

    app = create_app(engine_for(settings), settings)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           **uvicorn_options(settings)))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}/", app
    finally:
        server.should_exit = True
        thread.join(15)


def _send(raw: RawGradio, text: str, spoof: str, session_hash: str) -> str:
    """Send ``text`` in a fresh chat with ``X-Forwarded-For: spoof``; returns the alert line."""
    send = next(d for d in raw.deps() if d.get("api_name") == "send")
    data = [raw.value_for(c, "") for c in send["inputs"]]
    data[0], data[1] = text, None  # the message; no session yet: this message makes one
    raw.http.headers["X-Forwarded-For"] = spoof
    res = raw.call(send, data, session_hash)
    assert res.get("success"), res
    return str(res["output"]["data"][3])


def test_uvicorn_believes_forwarded_headers_only_from_named_proxies():
    assert uvicorn_options(load_settings(environ={})) == {"proxy_headers": False}
    s = load_settings(environ={"ISAGI_TRUSTED_PROXIES": "10.0.0.7, 192.168.0.0/16"})
    assert uvicorn_options(s) == {"proxy_headers": True, "forwarded_allow_ips": ["10.0.0.7", "192.168.0.0/16"]}
    with pytest.raises(ConfigError, match="any client choose"):
        load_settings(environ={"ISAGI_TRUSTED_PROXIES": "*"})


@pytest.mark.parametrize("trusted", [False, True])
def test_spoofed_forwarded_for_and_the_chat_cap_on_a_live_server(tmp_path, trusted):
    import httpx

    settings = load_settings(environ={}, home=tmp_path, max_new_tokens=4, max_sessions_per_client=2,
                             trusted_proxies="127.0.0.1" if trusted else None)
    with live(settings) as (url, app), httpx.Client(base_url=url, timeout=60) as http:
        registry = app.state.isagi_registry
        raw = RawGradio(http, None)
        alerts = [_send(raw, f"hello {i}", f"203.0.113.{i}", f"hash{i}") for i in range(3)]
        clients = sorted(registry._entries[sid].client for sid in registry.live_ids())
        if not trusted:
            # three made-up addresses, one real one: the cap of 2 holds for it
            assert clients == ["127.0.0.1", "127.0.0.1"]
            assert "Too many open chats for this client (127.0.0.1)" in alerts[2], alerts
        else:
            assert clients == ["203.0.113.0", "203.0.113.1", "203.0.113.2"], clients
            assert not any("Too many" in a for a in alerts), alerts
            # the cap holds per forwarded address: a third chat from 203.0.113.5 is refused
            more = [_send(raw, f"again {i}", "203.0.113.5", f"more{i}") for i in range(3)]
            assert "Too many open chats for this client (203.0.113.5)" in more[2], more
            # the client's own entries left of what the proxy appended are not believed
            _send(raw, "chained", "198.51.100.9, 203.0.113.6", "chain")
            assert "203.0.113.6" in {e.client for e in registry._entries.values()}
            assert "198.51.100.9" not in {e.client for e in registry._entries.values()}


@pytest.mark.parametrize("trusted", [False, True])
def test_spoofed_forwarded_for_and_the_login_back_off_on_a_live_server(tmp_path, trusted):
    import httpx

    users = ",".join(f"u{i}:pw{i}" for i in range(6))
    settings = load_settings(environ={}, home=tmp_path, auth=users, login_max_failures=2, login_backoff_s=60,
                             trusted_proxies="127.0.0.1" if trusted else None)
    with live(settings) as (url, _app), httpx.Client(base_url=url, timeout=30) as http:
        def login(user: str, password: str, spoof: str) -> int:
            r = http.post("login", data={"username": user, "password": password},
                          headers={"X-Forwarded-For": spoof})
            return r.status_code

        # each user name fails once (no per-user lock), each from a "new" address
        codes = [login(f"u{i}", "wrong", f"198.51.100.{i}") for i in range(3)]
        if not trusted:
            assert codes == [400, 400, 429]  # the real address is locked after two failures
            assert login("u5", "pw5", "192.0.2.77") == 429  # even the right password from a new "address"
        else:
            assert codes == [400, 400, 400]  # three addresses, one failure each
            assert login("u3", "wrong", "198.51.100.0") == 400  # that address's second failure
            assert login("u4", "pw4", "198.51.100.0") == 429  # now locked: the header's address is the key
            assert login("u5", "pw5", "192.0.2.77") == 200  # another address is not
