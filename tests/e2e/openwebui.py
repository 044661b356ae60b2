"""Open WebUI in front of ISAGI's OpenAI-compatible API, for tests/e2e/test_openwebui.py.

Owns the parts of that test that are not assertions: a logging proxy between Open
WebUI and ISAGI's ``/v1`` (every request Open WebUI sends and ISAGI's status for it
are recorded, and its upstream can be switched between two ISAGI servers while
Open WebUI runs), Open WebUI's offline environment, and starting Open WebUI from
its own virtual environment (``make openwebui-test`` installs it with
``.ci/openwebui.sh``: 2.9 GB with the CPU torch, so it is not part of ``make test``).
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import json
import os
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path


class LoggingProxy(http.server.ThreadingHTTPServer):
    """Forwards every request to :attr:`upstream` (host, port), streaming responses through,
    and keeps one record per request in :attr:`log`."""

    daemon_threads = True

    def __init__(self, port: int, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.log: list[dict] = []
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", port), _ProxyHandler)


class _ProxyHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # stream through, end by closing

    def log_message(self, *a: object) -> None:
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
        client_left = False
        try:
            while chunk := resp.read1(65536):
                self.wfile.write(chunk)
                self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            client_left = True  # Open WebUI hung up (its Stop): hang up on ISAGI too
        finally:
            up.close()
        try:
            model = json.loads(body).get("model") if body else None
        except (ValueError, AttributeError):
            model = None
        with self.server.lock:
            self.server.log.append({"method": self.command, "path": self.path, "status": resp.status, "model": model,
                                    "session": resp.getheader("X-Isagi-Session"), "client_left": client_left})

    do_GET = do_POST = do_PUT = do_DELETE = _forward


def owui_env(data_dir: Path, api_base: str, model: str, port: int) -> dict[str, str]:
    """Open WebUI offline, without a login, with ISAGI's model as its only (and default) model,
    and with its background tasks off (each would send its own prompt: a session of its own)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "OLLAMA_"))}
    env.update({
        "DATA_DIR": str(data_dir), "PORT": str(port), "HOST": "127.0.0.1",
        "WEBUI_AUTH": "False", "WEBUI_SECRET_KEY": "e2e-not-secret-but-32-bytes-long!",
        "OFFLINE_MODE": "true", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "ENABLE_OLLAMA_API": "false", "ENABLE_OPENAI_API": "true",
        "OPENAI_API_BASE_URL": api_base, "OPENAI_API_BASE_URLS": api_base,
        "OPENAI_API_KEY": "anything", "OPENAI_API_KEYS": "anything", "DEFAULT_MODELS": model,
        # no model downloads at start
        "RAG_EMBEDDING_ENGINE": "openai", "RAG_EMBEDDING_MODEL_AUTO_UPDATE": "false",
        "RAG_RERANKING_MODEL_AUTO_UPDATE": "false", "WHISPER_MODEL_AUTO_UPDATE": "false",
        "BYPASS_EMBEDDING_AND_RETRIEVAL": "true",
        "ENABLE_VERSION_UPDATE_CHECK": "false", "ENABLE_COMMUNITY_SHARING": "false",
        "SCARF_NO_ANALYTICS": "true", "DO_NOT_TRACK": "true", "ANONYMIZED_TELEMETRY": "false",
    })
    env.update({k: "false" for k in (
        "ENABLE_TITLE_GENERATION", "ENABLE_FOLLOW_UP_GENERATION", "ENABLE_TAGS_GENERATION",
        "ENABLE_AUTOCOMPLETE_GENERATION", "ENABLE_SEARCH_QUERY_GENERATION", "ENABLE_RETRIEVAL_QUERY_GENERATION")})
    return env


def wait_http(url: str, timeout: float, proc: subprocess.Popen | None = None) -> float:
    """Seconds until ``url`` answers 200; raises after ``timeout`` or when ``proc`` exits."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode} before {url} answered")
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=5) as r:
            if r.status == 200:
                return time.monotonic() - t0
        time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer within {timeout:.0f} s")


@contextlib.contextmanager
def open_webui(venv: Path, work: Path, port: int, api_base: str, model: str, *,
               start_timeout: float = 600.0) -> Iterator[str]:
    """Run ``open-webui serve`` from ``venv`` on ``port`` (its data and log under ``work``);
    yield its URL once ``/health`` answers, and stop it afterwards."""
    data = work / "owui-data"
    data.mkdir(parents=True, exist_ok=True)
    log_path = work / "owui.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([str(venv / "bin" / "open-webui"), "serve", "--host", "127.0.0.1", "--port", str(port)],
                                cwd=work, env=owui_env(data, api_base, model, port), stdout=log,
                                stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}/"
            try:
                wait_http(url + "health", start_timeout, proc)
            except (RuntimeError, TimeoutError) as exc:
                raise RuntimeError(f"{exc}; its log ends:\n{log_path.read_text(errors='replace')[-3000:]}") from exc
            yield url
        finally:
            from tests.e2e.conftest import stop_process

            stop_process(proc, 20)
