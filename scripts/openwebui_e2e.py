"""End to end: Open WebUI as a front end for ISAGI's OpenAI-compatible API.

Starts ISAGI's fake-engine server (tests/e2e/fake_server.py: the real app on the tiny
random model, replies scripted with --reply), a small logging proxy in front of its /v1
(so every request Open WebUI sends, and ISAGI's status for it, is recorded), and Open
WebUI (offline, no auth) pointed at the proxy; then drives Open WebUI with Playwright on
Debian's Chromium: pick the ISAGI model, send a message, wait for the reply text, take a
screenshot, and check ISAGI's history database recorded the turn.

    python3 -m venv /tmp/owui-venv && /tmp/owui-venv/bin/pip install open-webui torch==2.13.0
    .venv/bin/python scripts/openwebui_e2e.py [--shot artifacts/openwebui.png] [--stop]

Needs: an Open WebUI venv (--owui-venv, default /tmp/owui-venv: 2.9 GB with the CPU torch,
about 5 minutes to install here, so not part of `make test`), this checkout (--isagi-root)
with its test tools (Playwright), and /usr/bin/chromium.
Prints a JSON summary; exit status 0 when the chat worked and the turn was recorded.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import http.server
import json
import os
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPLY = "Hello from ISAGI through Open WebUI."
MESSAGE = "What is the capital of France?"
FOLLOW_UP = "And the capital of Germany?"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float, proc: subprocess.Popen | None = None) -> float:
    """Seconds until ``url`` answers 200 (raises after ``timeout`` or if ``proc`` exits)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except Exception:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer within {timeout:.0f} s")


def rss_mib(pid: int) -> float:
    """Resident memory of ``pid`` and its descendants, MiB."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
            for t in Path(f"/proc/{p}/task").iterdir():
                kids = (t / "children").read_text().split()
                todo.extend(int(k) for k in kids)
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total / 1024


class LoggingProxy(http.server.ThreadingHTTPServer):
    """Forwards everything to ``upstream`` (host, port), streaming responses through,
    and keeps (method, path, request body, status, response body head) of each request."""

    daemon_threads = True

    def __init__(self, port: int, upstream: tuple[str, int]) -> None:
        self.upstream, self.log, self.lock = upstream, [], threading.Lock()
        super().__init__(("127.0.0.1", port), _ProxyHandler)


class _ProxyHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # stream through, end by closing

    def log_message(self, *a) -> None:
        pass

    def _forward(self) -> None:
        n = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(n) if n else b""
        headers = {k: v for k, v in self.headers.items()
                   if k.lower() not in ("host", "connection", "transfer-encoding", "accept-encoding")}
        up = http.client.HTTPConnection(*self.server.upstream, timeout=120)
        up.request(self.command, self.path, body=body or None, headers=headers)
        resp = up.getresponse()
        self.send_response(resp.status)
        for k, v in resp.getheaders():
            if k.lower() not in ("transfer-encoding", "connection", "content-length", "date", "server"):
                self.send_header(k, v)
        self.send_header("Connection", "close")
        self.end_headers()
        head, client_left = b"", False
        try:
            while chunk := resp.read1(65536):
                head += chunk if len(head) < 4000 else b""
                self.wfile.write(chunk)
                self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            client_left = True  # Open WebUI hung up (its Stop): hang up on ISAGI too
        finally:
            up.close()
        with self.server.lock:
            self.server.log.append({"method": self.command, "path": self.path,
                                    "body": body.decode("utf-8", "replace"), "status": resp.status,
                                    "session": resp.getheader("X-Isagi-Session"), "client_left": client_left,
                                    "response_head": head[:4000].decode("utf-8", "replace")})

    do_GET = do_POST = do_PUT = do_DELETE = _forward


def owui_env(data_dir: Path, api_base: str, model: str, port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "OLLAMA_"))}
    env.update({
        "DATA_DIR": str(data_dir), "PORT": str(port), "HOST": "127.0.0.1",
        "WEBUI_AUTH": "False", "WEBUI_SECRET_KEY": "e2e-not-secret-but-32-bytes-long!",
        "OFFLINE_MODE": "true", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "ENABLE_OLLAMA_API": "false", "ENABLE_OPENAI_API": "true",
        "OPENAI_API_BASE_URL": api_base, "OPENAI_API_BASE_URLS": api_base,
        "OPENAI_API_KEY": "anything", "OPENAI_API_KEYS": "anything",
        # No model downloads at start; no side requests that would become ISAGI sessions.
        "RAG_EMBEDDING_ENGINE": "openai", "RAG_EMBEDDING_MODEL_AUTO_UPDATE": "false",
        "RAG_RERANKING_MODEL_AUTO_UPDATE": "false", "WHISPER_MODEL_AUTO_UPDATE": "false",
        "BYPASS_EMBEDDING_AND_RETRIEVAL": "true",
        "ENABLE_VERSION_UPDATE_CHECK": "false", "ENABLE_COMMUNITY_SHARING": "false",
        "SCARF_NO_ANALYTICS": "true", "DO_NOT_TRACK": "true", "ANONYMIZED_TELEMETRY": "false",
    })
    if os.environ.get("E2E_OWUI_TASKS", "0") != "1":  # Open WebUI's side requests, each a new ISAGI session
        env.update({k: "false" for k in (
            "ENABLE_TITLE_GENERATION", "ENABLE_FOLLOW_UP_GENERATION", "ENABLE_TAGS_GENERATION",
            "ENABLE_AUTOCOMPLETE_GENERATION", "ENABLE_SEARCH_QUERY_GENERATION", "ENABLE_RETRIEVAL_QUERY_GENERATION")})
    if os.environ.get("E2E_DEFAULT_MODEL", "1") == "1":
        env["DEFAULT_MODELS"] = model
    return env


def drive_browser(url: str, model: str, shot: str, timeout_s: float) -> dict:
    from playwright.sync_api import sync_playwright

    out: dict = {}
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path="/usr/bin/chromium", headless=True,
                                     args=["--no-sandbox", "--disable-dev-shm-usage"])
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(url, wait_until="domcontentloaded", timeout=timeout_s * 1000)
        box = page.locator("#chat-input")
        box.wait_for(state="visible", timeout=timeout_s * 1000)
        for _ in range(3):  # a "what's new" dialog may cover the page on first start
            page.keyboard.press("Escape")
        # The chat box's model selector names the chosen model; choose ISAGI's if it is not.
        composer = page.locator("form, #message-input-container").filter(has=box).first
        shown = composer.get_by_text(model, exact=True)
        out["model_preselected"] = shown.count() > 0
        # Open the model selector and pick ISAGI's model from its list, as a user does.
        opener = shown.first if out["model_preselected"] else page.get_by_text("Select a model").first
        opener.click()
        page.wait_for_timeout(700)
        items = page.locator('[role="option"], [role="menuitem"], [role="dialog"] button, [role="menu"] button')
        items = items.filter(has_text=model)
        out["selector_items"] = items.count()
        page.screenshot(path=shot.replace(".png", "-selector.png"))
        if items.count():
            items.first.click()
        else:
            page.keyboard.press("Escape")
        page.get_by_text(model, exact=True).first.wait_for(state="visible", timeout=10_000)
        for n, text in enumerate((MESSAGE, FOLLOW_UP), start=1):
            box.click()
            page.keyboard.type(text)
            page.keyboard.press("Enter")
            t0 = time.monotonic()
            try:  # every reply is REPLY (the fake engine's --reply): wait for the n-th
                page.wait_for_function(
                    "([t, n]) => document.body.innerText.split(t).length - 1 >= n",
                    arg=[REPLY, n], timeout=timeout_s * 1000)
                out[f"reply_{n}_s"] = round(time.monotonic() - t0, 1)
            except Exception as exc:
                out[f"reply_{n}_error"] = str(exc).splitlines()[0]
                break
            page.wait_for_timeout(1000)  # the stream's end settles before the next message
        out["reply_seen"] = "reply_2_s" in out
        page.wait_for_timeout(1500)  # let the stream's end settle before the screenshot
        page.screenshot(path=shot, full_page=False)
        out["page_errors"] = errors[:5]
        browser.close()
    return out


def summarize(req: dict) -> dict:
    """A logged request with its tool definitions cut to their names and the response head short."""
    out = dict(req, response_head=req["response_head"][:300])
    try:
        body = json.loads(req["body"]) if req["body"] else None
    except ValueError:
        return out
    if isinstance(body, dict) and isinstance(body.get("tools"), list):
        body["tools"] = [t.get("function", {}).get("name") for t in body["tools"]]
    out["body"], out["body_bytes"] = body, len(req["body"])
    return out


def drive_stop(url: str, shot: str, timeout_s: float) -> dict:
    """Send a message, press Open WebUI's stop button while the reply streams, and see what stays."""
    from playwright.sync_api import sync_playwright

    out: dict = {}
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path="/usr/bin/chromium", headless=True,
                                     args=["--no-sandbox", "--disable-dev-shm-usage"])
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        page.goto(url, wait_until="domcontentloaded", timeout=timeout_s * 1000)
        box = page.locator("#chat-input")
        box.wait_for(state="visible", timeout=timeout_s * 1000)
        page.wait_for_timeout(1000)
        for _ in range(3):  # the first start's "what's new" dialog covers the page
            page.keyboard.press("Escape")
        box.click()
        page.keyboard.type(MESSAGE)
        page.keyboard.press("Enter")
        page.wait_for_function("t => document.body.innerText.includes(t)", arg=REPLY[:4],
                               timeout=timeout_s * 1000)  # the reply has started streaming
        stop = page.locator("button[aria-label='Stop'], button:has(svg) >> nth=-1").first
        out["stop_label"] = stop.get_attribute("aria-label")
        stop.click()
        page.wait_for_timeout(3000)
        out["page_text_after_stop"] = page.locator("body").inner_text()[-400:]
        page.screenshot(path=shot.replace(".png", "-stop.png"))
        # Open WebUI keeps the cut reply in its chat; ISAGI kept no turn. Go on talking.
        box.click()
        page.keyboard.type(FOLLOW_UP)
        page.keyboard.press("Enter")
        try:
            page.wait_for_function("t => document.body.innerText.includes(t)", arg=REPLY, timeout=timeout_s * 1000)
            out["follow_up_reply_seen"] = True
            # the stream goes on to max_new_tokens (0.5 s each): wait until Open WebUI shows it ended
            page.locator("button[aria-label='Stop']").wait_for(state="detached", timeout=timeout_s * 1000)
        except Exception as exc:
            out["follow_up_reply_seen"], out["follow_up_error"] = False, str(exc).splitlines()[0]
        page.wait_for_timeout(1000)
        page.screenshot(path=shot.replace(".png", "-after-stop.png"))
        browser.close()
    return out


def recorded_turns(home: Path) -> list[tuple]:
    db = home / "history.sqlite3"
    if not db.exists():
        return []
    with sqlite3.connect(db) as c:
        return c.execute("SELECT session_id, seq, role, text, verdict FROM turns ORDER BY id").fetchall()


class _Done(Exception):
    """The --stop run has its result."""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--owui-venv", default="/tmp/owui-venv")
    p.add_argument("--isagi-root", default=str(Path(__file__).resolve().parents[1]))
    p.add_argument("--shot", default="artifacts/openwebui.png")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds for each wait")
    p.add_argument("--stop", action="store_true", help="instead: press Stop mid-reply; ISAGI must keep no turn")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds for Open WebUI to start")
    args = p.parse_args()

    work = Path(tempfile.mkdtemp(prefix="owui-e2e-"))
    home, data = work / "isagi-home", work / "owui-data"
    home.mkdir(), data.mkdir()
    p_isagi, p_proxy, p_owui = free_port(), free_port(), free_port()
    result: dict = {"workdir": str(work)}
    procs: list[subprocess.Popen] = []
    logs = contextlib.ExitStack()
    proxy = None
    try:
        isagi = subprocess.Popen(
            [f"{args.isagi_root}/.venv/bin/python", "-m", "tests.e2e.fake_server", "--port", str(p_isagi),
             "--reply", REPLY, "--token-delay-s", "0.5" if args.stop else "0.02"],
            cwd=args.isagi_root, env={**os.environ, "ISAGI_HOME": str(home)},
            stdout=logs.enter_context(open(work / "isagi.log", "wb")),  # noqa: SIM115 - the stack closes it
            stderr=subprocess.STDOUT)
        procs.append(isagi)
        result["isagi_start_s"] = round(wait_http(f"http://127.0.0.1:{p_isagi}/v1/models", args.timeout, isagi), 1)
        with urllib.request.urlopen(f"http://127.0.0.1:{p_isagi}/v1/models") as r:
            model = json.load(r)["data"][0]["id"]
        result["model"] = model

        proxy = LoggingProxy(p_proxy, ("127.0.0.1", p_isagi))
        threading.Thread(target=proxy.serve_forever, daemon=True).start()

        owui_bin = Path(args.owui_venv) / "bin" / "open-webui"
        owui = subprocess.Popen(
            [str(owui_bin), "serve", "--host", "127.0.0.1", "--port", str(p_owui)],
            cwd=work, env=owui_env(data, f"http://127.0.0.1:{p_proxy}/v1", model, p_owui),
            stdout=logs.enter_context(open(work / "owui.log", "wb")),  # noqa: SIM115 - the stack closes it
            stderr=subprocess.STDOUT)
        procs.append(owui)
        result["owui_start_s"] = round(wait_http(f"http://127.0.0.1:{p_owui}/health", args.start_timeout, owui), 1)
        result["owui_rss_mib_ready"] = round(rss_mib(owui.pid))

        if args.stop:
            result["browser"] = drive_stop(f"http://127.0.0.1:{p_owui}/", args.shot, args.timeout)
            time.sleep(2)
            result["isagi_turns"] = recorded_turns(home)
            result["isagi_requests"] = [summarize(r) for r in proxy.log]
            # The stopped turn is not kept; the follow-up is (in whichever session ISAGI matched).
            kept = [(r, t) for _, _, r, t, _ in result["isagi_turns"]]
            result["ok"] = kept == [("user", FOLLOW_UP), ("assistant", REPLY)]
            raise _Done
        result["browser"] = drive_browser(f"http://127.0.0.1:{p_owui}/", model, args.shot, args.timeout)
        result["owui_rss_mib_after_chat"] = round(rss_mib(owui.pid))
        time.sleep(1)
        turns = recorded_turns(home)
        result["isagi_turns"] = turns
        result["isagi_requests"] = [summarize(r) for r in proxy.log]
        # Both messages and replies recorded, as one ISAGI session (the conversation continued).
        want = [("user", MESSAGE), ("assistant", REPLY), ("user", FOLLOW_UP), ("assistant", REPLY)]
        ok_turn = any([(r, t) for s, _, r, t, _ in turns if s == sid] == want for sid in {t[0] for t in turns})
        result["isagi_sessions"] = len({t[0] for t in turns})
        result["turn_recorded"] = ok_turn
        result["ok"] = bool(result["browser"].get("reply_seen")) and ok_turn
    except _Done:
        pass
    except Exception as exc:
        result["ok"], result["error"] = False, f"{type(exc).__name__}: {exc}"
        if proxy is not None:
            result["isagi_requests"] = [summarize(r) for r in proxy.log]
    finally:
        for proc in reversed(procs):
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
        if proxy is not None:
            proxy.shutdown()
        logs.close()
    print(json.dumps(result, indent=2, default=str))
    return 0 if result.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
