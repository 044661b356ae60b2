"""Fixtures for the end-to-end browser tests: a live ``isagi web`` and Debian's Chromium.

The server is the real command line (``python -m isagi.cli web --port FREE``) on
the default model, with ``ISAGI_HOME`` on a temporary directory, or on
``ISAGI_TEST_HOME`` to reuse a converted model and a calibrated profile between
runs (the first start converts and calibrates: minutes on a small CPU).
``ISAGI_E2E_URL`` points the tests at a server that is already running instead.
Chromium is ``/usr/bin/chromium`` (``.ci/browser.sh`` installs it), or
``ISAGI_CHROMIUM``. Screenshots go to ``artifacts/screenshots/``. The servers and
the browser live as long as this package's tests: they stop when the last of
them ends, instead of idling beside the rest of the suite.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCREENSHOTS = ROOT / "artifacts" / "screenshots"
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
START_TIMEOUT_S = float(os.environ.get("ISAGI_E2E_START_TIMEOUT", "2400"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _health(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url + "health", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def stop_process(proc: subprocess.Popen, grace_s: float) -> None:
    """Ask ``proc`` to end; kill it if it has not after ``grace_s`` seconds."""
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


@contextlib.contextmanager
def live_server(tmp_path_factory: pytest.TempPathFactory, *, auth: str | None = None,
                fake: bool = False, fake_args: tuple[str, ...] = (), home: Path | None = None,
                loaded: bool = True) -> Iterator[str]:
    """Start ``isagi web`` on a free port (with ``ISAGI_AUTH=auth`` when given) and
    yield its URL once ``/health`` says ready; stop it afterwards.

    ``fake=True`` serves the same app on the fake engine (:mod:`tests.e2e.fake_server`,
    a fresh home, ready in seconds, given ``fake_args``) instead of the default model.
    ``home``: the server's ``ISAGI_HOME`` (for a test that reads its history store).
    ``loaded=False``: yield as soon as ``/health`` answers, while the model may still load."""
    if home is None:
        if fake or not os.environ.get("ISAGI_TEST_HOME"):
            home = tmp_path_factory.mktemp("isagi-home")
        else:
            home = Path(os.environ["ISAGI_TEST_HOME"])
    home.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    log_path = tmp_path_factory.mktemp("isagi-web-log") / "server.log"
    env = {**os.environ, "ISAGI_HOME": str(home), "PYTHONPATH": str(ROOT)}
    env.pop("ISAGI_AUTH", None)
    if auth:
        env["ISAGI_AUTH"] = auth
    command = (["-m", "tests.e2e.fake_server", "--port", str(port), *fake_args] if fake
               else ["-m", "isagi.cli", "web", "--port", str(port)])
    log = open(log_path, "w")  # noqa: SIM115 - closed in the teardown
    proc = subprocess.Popen([sys.executable, *command], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/"
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"isagi web exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                code, body = _health(url)
                if code == 200 and body.get("status") == "ok":
                    break
                if not loaded and body.get("status") == "loading":
                    break
                if body.get("status") == "failed":
                    pytest.fail(f"isagi web could not load the model: {body}")
            except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"isagi web was not ready after {START_TIMEOUT_S:.0f} s:\n{log_path.read_text()[-3000:]}")
            time.sleep(1.0)
        yield url
    finally:
        stop_process(proc, 30)
        log.close()


@pytest.fixture(scope="package")
def base_url(tmp_path_factory: pytest.TempPathFactory):
    """URL (ending in /) of a live, ready ``isagi web`` server."""
    if url := os.environ.get("ISAGI_E2E_URL"):
        yield url.rstrip("/") + "/"
        return
    with live_server(tmp_path_factory) as url:
        yield url


@pytest.fixture(scope="package")
def fake_url(tmp_path_factory: pytest.TempPathFactory):
    """URL of a live app on the fake engine (fast: for tests of the page and its sessions,
    not of the model), or ``ISAGI_E2E_URL``'s running server (e.g. on the real model)."""
    if url := os.environ.get("ISAGI_E2E_URL"):
        yield url.rstrip("/") + "/"
        return
    with live_server(tmp_path_factory, fake=True) as url:
        yield url


@pytest.fixture(scope="package")
def fake_auth_url(tmp_path_factory: pytest.TempPathFactory):
    """URL of a live app on the fake engine with ``ISAGI_AUTH="alice:a,bob:b"``
    (or ``ISAGI_E2E_AUTH_URL``, a running server with those two users)."""
    if url := os.environ.get("ISAGI_E2E_AUTH_URL"):
        yield url.rstrip("/") + "/"
        return
    with live_server(tmp_path_factory, fake=True, auth=",".join(f"{u}:{p}" for u, p in TWO_USERS.items())) as url:
        yield url


def open_page(ctx, url: str):
    """A page of ``ctx`` on ``url``, once the app is ready (its banner counts live sessions)."""
    page = ctx.new_page()
    page.set_default_timeout(120_000)
    page.goto(url)
    wait_ready(page)
    return page


def wait_ready(page) -> None:
    """Wait until the page is usable: the load event has run and opened the input."""
    page.wait_for_selector("#isagi-input textarea:not([disabled])")
    page.wait_for_function(
        "() => { const e = document.querySelector('#isagi-status'); "
        "return !!e && e.innerText.includes('live session(s)'); }"
    )


TWO_USERS = {"alice": "a", "bob": "b"}


@pytest.fixture(scope="package")
def auth_url(tmp_path_factory: pytest.TempPathFactory):
    """URL of a live ``isagi web`` with ``ISAGI_AUTH="alice:a,bob:b"`` (or
    ``ISAGI_E2E_AUTH_URL``, a running server with those two users)."""
    if url := os.environ.get("ISAGI_E2E_AUTH_URL"):
        yield url.rstrip("/") + "/"
        return
    with live_server(tmp_path_factory, auth=",".join(f"{u}:{p}" for u, p in TWO_USERS.items())) as url:
        yield url


@pytest.fixture(scope="package")
def browser():
    exe = os.environ.get("ISAGI_CHROMIUM", "/usr/bin/chromium")
    if not (Path(exe).exists() or shutil.which(exe)):
        pytest.skip(f"no Chromium at {exe}: run `bash .ci/browser.sh` (installs Debian's chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def new_page(browser, base_url):
    """A factory of pages, each in its own browser context (its own cookies: its own session)."""
    contexts = []

    def make():
        ctx = browser.new_context(viewport={"width": 1440, "height": 1000}, accept_downloads=True)
        contexts.append(ctx)
        return open_page(ctx, base_url)

    yield make
    for ctx in contexts:
        ctx.close()


@pytest.fixture(scope="session")
def screenshot_dir() -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    return SCREENSHOTS


def shown_rows(page) -> list[dict[str, str]]:
    """The Sessions table as the page shows it now: one dict per row, keyed by its headers
    (id, title, turns, updated (UTC), state). Read cell by cell through the grid's ARIA
    roles, so a title holding an id or a date is never taken for another column (the
    hidden sizing row of Gradio's virtual table is not a row)."""
    headers = page.eval_on_selector_all("#isagi-sessions th[role=columnheader]",
                                        "hs => hs.map(h => h.getAttribute('title'))")
    rows = page.eval_on_selector_all(
        "#isagi-sessions [role=row]:has([role=gridcell])",
        "rs => rs.map(r => Array.from(r.querySelectorAll('[role=gridcell]')).map(c => c.textContent.trim()))")
    return [dict(zip(headers, r, strict=False)) for r in rows]


# Whether an event ran on an output: its progress tracker (Gradio's status-tracker, class
# "hide" when idle) was seen shown since the watch began.
_WATCH_RUN = """sel => { const el = document.querySelector(sel); window.__ran = false;
  const look = () => { for (const t of el.querySelectorAll('[data-testid=status-tracker]'))
    if (!t.classList.contains('hide')) window.__ran = true; };
  new MutationObserver(look).observe(el, {subtree: true, childList: true, attributes: true}); }"""
_RAN_AND_DONE = """sel => window.__ran && Array.from(document.querySelector(sel)
  .querySelectorAll('[data-testid=status-tracker]')).every(t => t.classList.contains('hide'))"""


def table_rows(page) -> list[dict[str, str]]:
    """The Sessions table's rows after a refresh (opens the Sessions tab). It waits for the
    refresh's event to run on the table and end: the note it writes may already be there from
    an earlier refresh, and the rows may rightly be the same as before."""
    from tests.e2e.test_web_e2e import open_tab

    open_tab(page, "Sessions")
    page.evaluate(_WATCH_RUN, "#isagi-sessions")
    page.click("#isagi-refresh")
    page.wait_for_function(_RAN_AND_DONE, arg="#isagi-sessions")
    page.wait_for_function("() => document.body.innerText.includes('most recent session(s)')")
    return shown_rows(page)


def table_ids(page) -> list[str]:
    """Session ids of the Sessions table after a refresh."""
    return [row["id"] for row in table_rows(page)]


@pytest.fixture
def context_of(browser):
    """Make browser contexts (a fresh profile each: its own storage, so its own session) at
    1440x1000, closed after the test."""
    contexts = []

    def make():
        ctx = browser.new_context(viewport={"width": 1440, "height": 1000})
        contexts.append(ctx)
        return ctx

    yield make
    for ctx in contexts:
        ctx.close()
