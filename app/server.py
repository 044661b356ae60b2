"""The web server: a FastAPI app with ``/health``, the OpenAI-compatible API at
``/v1`` (:mod:`app.api`) and the Gradio page at ``/``.

Owns building the app (:func:`create_app`, nothing happens at import time)
and running it (:func:`serve`, behind ``isagi web``). The server binds at
once and loads the engine in a background thread: while it loads, ``/health``
answers ``503 {"status": "loading", "stage": ...}``, the page shows what is
happening and the terminal prints the progress, so a first start that
converts the model and calibrates it never looks frozen. Binds to loopback
unless told otherwise; optional login from ``settings.auth`` (each user sees
only their own sessions; failed logins back off per user name and per client
address, :mod:`app.login`); never a public share link. A client's address is
the address that connected: ``X-Forwarded-For`` is believed only from the
proxies ``ISAGI_TRUSTED_PROXIES`` names (:func:`uvicorn_options`).

Behind a balancer (docker/haproxy/haproxy.cfg): ``ISAGI_REPLICA`` names this process in every
response (:mod:`app.replica`), and SIGTERM drains it first (:mod:`app.shutdown`): ``/health``
answers ``503 {"status": "draining"}``, nothing new starts, the turns in flight finish and each
session is saved and its lease given back, within ``ISAGI_DRAIN_S``.

Before it binds, :func:`serve` opens the data directory
(:func:`isagi.datadir.open_data_dir`): one that cannot be written ends
``isagi web`` with one line (exit status 2); alone on it, the server removes
every temporary file killed saves left and adds to the history what a kill
kept from it (the session files are the source of truth). At shutdown it
saves live sessions (and their history), removes its temporary download
directory and releases the data directory. Messages for the browser name no
server path or URL (:mod:`app.public`); the log keeps them. Requests to
Gradio's API pass :class:`app.guard.GradioGuard` first: session hashes tied
to their login, file paths limited to the caller's own uploads, uploads
within each user's quota (:mod:`app.uploads`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import socket
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from isagi.config import Settings
from isagi.errors import ConfigError, PortInUseError
from isagi.session.service import LOCAL_OWNER, MAX_MIKU_BYTES

if TYPE_CHECKING:
    from gradio.routes import App as GradioApp

    from isagi.app.loader import EngineHolder
    from isagi.session.registry import Drained
    from isagi.session.retention import Pruned, RetentionTimer
    from isagi.session.service import SessionService

# The web upload limit is the .miku reader's own limit (64 MiB, 4.5x a measured
# 10,000-turn session): a larger upload is refused by Gradio before it is stored.
MAX_UPLOAD_BYTES = MAX_MIKU_BYTES
log = logging.getLogger(__name__)

DEFAULT_IDLE_MINUTES = 30.0
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def parse_auth(spec: str | None) -> list[tuple[str, str]] | None:
    """``"user:pass,user2:pass2"`` → ``[("user", "pass"), ...]``; ``None``/empty → no login."""
    if not spec or not spec.strip():
        return None
    pairs: list[tuple[str, str]] = []
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        user, sep, password = item.partition(":")
        user = user.strip()
        if not sep or not user or not password:
            raise ConfigError(
                f"ISAGI_AUTH entry {item.split(':')[0]!r}… is not user:password; "
                "write it as user:password,user2:password2."
            )
        if user == LOCAL_OWNER:
            raise ConfigError(
                f"ISAGI_AUTH: the user name {LOCAL_OWNER!r} is reserved (it owns what is made "
                "without a login, e.g. by the command line); pick another name."
            )
        if len(user) > 64:
            raise ConfigError(f"ISAGI_AUTH: the user name {user[:20]!r}… is longer than 64 characters.")
        if any(u == user for u, _ in pairs):
            raise ConfigError(f"ISAGI_AUTH: the user {user!r} is listed twice; keep one entry per user.")
        pairs.append((user, password))
    return pairs or None


def default_factory(settings: Settings) -> Callable[[Callable[[str, int, int], None]], Any]:
    """A factory that loads the real engine (model, profile, history store), reporting progress."""

    def factory(progress: Callable[[str, int, int], None]) -> Any:
        from isagi.app.loader import calibrating, first_stage
        from isagi.pipeline.engine import Engine

        progress(first_stage(settings), 0, 1)  # the profile's stages report only when it calibrates
        return Engine.start(settings, with_store=True, progress=calibrating(progress))

    return factory


def _retention_timer(settings: Settings, holder: EngineHolder, sessions: SessionService) -> RetentionTimer | None:
    """With ``ISAGI_SESSION_RETENTION``, the started timer that removes old sessions at start and
    daily (:mod:`isagi.session.retention`); never a session the server has open."""
    days = settings.session_retention_days
    if days is None:
        return None
    from isagi.session.retention import RetentionTimer

    def run() -> Pruned:
        return sessions.prune(days)

    timer = RetentionTimer(run, ready=holder.wait)
    timer.start()
    return timer


def create_app(
    engine_or_factory: Any,
    settings: Settings,
    *,
    idle_minutes: float | None = None,
    on_progress: Callable[[str, int, int], None] | None = None,
    reaper_interval_s: float = 60.0,
    data_dir: Any = None,
    page: bool = True,
) -> Any:
    """The FastAPI app: ``GET /health``, the API at ``/v1`` and the Gradio page mounted at ``/``.

    ``engine_or_factory``: a ready :class:`~isagi.pipeline.engine.Engine`, or a callable
    ``factory(progress) -> Engine`` run in the background when the app starts.
    ``idle_minutes``: idle sessions are saved and dropped after this long
    (default ``settings.web_idle_minutes`` if present, else 30).
    ``data_dir``: the :class:`isagi.datadir.DataDir` :func:`serve` opened
    (checked, locked, tidied, history repaired); without it the app opens it
    when it starts. Either way it is released at shutdown.
    ``page=False``: no page, only ``/health`` and the API (``isagi serve``).
    """
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    from isagi.app.api import mount_api
    from isagi.app.loader import EngineHolder
    from isagi.app.login import Backoff, Logins, LoginThrottleMiddleware
    from isagi.datadir import open_data_dir
    from isagi.session.service import SessionService

    if idle_minutes is None:
        idle_minutes = settings.web_idle_minutes
    pairs = parse_auth(settings.auth)
    user_backoff = Backoff(settings.login_max_failures, settings.login_backoff_s)
    client_backoff = Backoff(settings.login_max_failures, settings.login_backoff_s)
    auth = Logins(pairs, user_backoff) if pairs else None
    holder = EngineHolder(engine_or_factory, on_progress=on_progress)
    sessions = SessionService.start(lambda: holder.engine, idle_s=idle_minutes * 60.0,
                                    max_per_client=settings.max_sessions_per_client,
                                    max_total=settings.max_sessions)
    uploads = ui = None
    if page:
        from gradio.utils import get_upload_folder

        from isagi.app.ui import WebUI
        from isagi.app.uploads import MIB, UploadLedger

        uploads = UploadLedger(get_upload_folder(), settings.upload_quota_mb * MIB)
        ui = WebUI(holder, sessions, settings, uploads=uploads)

    @contextlib.asynccontextmanager
    async def lifespan(app_: Any):
        data = data_dir
        if data is None:
            data = open_data_dir(settings)
            for line in data.lines():
                log.warning("%s", line)
        app_.state.isagi_data_dir = data
        holder.start()
        sessions.start_reaper(reaper_interval_s)
        if uploads is not None:
            uploads.start_sweeper()
        retention = _retention_timer(settings, holder, sessions)
        try:
            yield
        finally:
            if uploads is not None:
                uploads.stop_sweeper()
                uploads.sweep(now=math.inf)  # uploads never opened go with the server
            sessions.stop_reaper()
            if retention is not None:
                retention.stop()
            if holder.ready:
                sessions.save_all()  # each file written brings its history up to it
                sessions.close()  # their leases go back: another replica takes them over at once
                if waiting := sessions.retry_history():
                    log.warning("%d exchange(s) could not be added to the history at shutdown; they are in "
                                "their session files, and the next start adds them", waiting)
            if ui is not None:
                ui.page.cleanup()
            data.close()

    app = FastAPI(title="ISAGI", lifespan=lifespan, docs_url=None, redoc_url=None)
    if auth is not None:
        app.add_middleware(LoginThrottleMiddleware, backoff=client_backoff)

    @app.get("/health")
    def health() -> Any:
        st = holder.status()
        if sessions.draining:  # SIGTERM: the balancer takes this replica out (app.shutdown)
            return JSONResponse(status_code=503, content={
                "status": "draining", "sessions": sessions.live_count(), "busy": sessions.busy_count()})
        if st["status"] == "ready":
            engine = holder.engine
            return {
                "status": "ok",
                "model": engine.lm.model_id,
                "sessions": sessions.live_count(),
                "uptime_s": round(time.monotonic() - holder.started_at, 1),
            }
        return JSONResponse(status_code=503, content=st)

    mount_api(app, holder, sessions, settings, client_backoff)  # before the page's mount at "/"
    if settings.replica:
        from isagi.app.replica import ReplicaHeader

        app.add_middleware(ReplicaHeader, name=settings.replica)

    def drain(stop: Callable[[], bool]) -> Drained:
        """SIGTERM (:func:`app.shutdown.run_server`): /health says draining, nothing new starts,
        the turns in flight finish and each session is saved and given back, within ISAGI_DRAIN_S."""
        drained = sessions.drain(settings.drain_s, stop)
        if drained.left:
            log.warning("draining: %d session(s) still busy after %g s (ISAGI_DRAIN_S); the shutdown goes on",
                        len(drained.left), settings.drain_s)
        return drained

    app.state.isagi_drain = drain
    app.state.isagi_holder = holder
    app.state.isagi_sessions = sessions
    app.state.isagi_registry = sessions.registry
    app.state.isagi_ui = ui
    app.state.isagi_logins = (user_backoff, client_backoff)
    app.state.isagi_uploads = uploads
    if ui is None or uploads is None:
        return app
    mount_page(app, ui, uploads, settings, auth)
    return app


def mount_page(app: Any, ui: Any, uploads: Any, settings: Settings, auth: Any) -> None:
    """Mount the Gradio page at ``/`` on ``app``, behind :class:`app.guard.GradioGuard`."""
    import gradio as gr
    from starlette.routing import Mount

    from isagi.app.event_shapes import EventShapes
    from isagi.app.guard import Bindings, GradioGuard, gradio_login
    from isagi.app.layout import HEAD, build_blocks, page_css
    from isagi.app.login import login_message

    blocks = build_blocks(ui)
    blocks.queue(default_concurrency_limit=8)
    # A handler's warning (gr.Warning) in an event called outside the queue (/gradio_api/run/...)
    # has no page to pop up on and falls back to Python's warnings: two log lines per refusal,
    # carrying whatever id the caller sent. Its text is in the event's own outputs already.
    warnings.filterwarnings("ignore", category=UserWarning, module=r"gradio\.helpers")
    gr.mount_gradio_app(
        app, blocks, path="/", auth=auth,
        auth_message=login_message(settings.login_max_failures, settings.login_backoff_s) if auth else None,
        # show_error=False: an exception no handler caught shows as a bare "Error", never its
        # text (which may name a server path); every expected failure is a handler's own warning.
        css=page_css(), head=HEAD, footer_links=["api", "settings"], show_error=False, ssr_mode=False,
        run_history=False, max_file_size=MAX_UPLOAD_BYTES,
    )
    gradio_app = cast("GradioApp", next(r.app for r in app.routes if isinstance(r, Mount)))  # the one mounted
    # What the guard reads of Gradio's app: a Gradio that changed it must stop here, not
    # run with session hashes tied to nobody or uploads recorded in the wrong place.
    if not (isinstance(getattr(gradio_app, "tokens", None), dict) and getattr(gradio_app, "cookie_id", None)):
        raise RuntimeError("this Gradio keeps its logins elsewhere: app.guard cannot tell who is logged in")
    if Path(gradio_app.uploaded_file_dir).resolve() != uploads.root:
        raise RuntimeError(f"Gradio uploads to {gradio_app.uploaded_file_dir}, not {uploads.root}")
    hashes, events = Bindings(), Bindings()
    app.add_middleware(GradioGuard, ledger=uploads, user_of=gradio_login(gradio_app), auth=auth is not None,
                       hashes=hashes, events=events, shapes=EventShapes.from_blocks(blocks))
    app.state.isagi_bindings = (hashes, events)
    app.state.isagi_gradio_app = gradio_app  # its stop_event ends its heartbeats at shutdown (app.shutdown)


class _TerminalProgress:
    """Prints loading progress to the terminal with rich: each stage, then every ~10 %."""

    def __init__(self) -> None:
        from rich.console import Console

        self.console = Console(stderr=True)
        self._last: dict[str, int] = {}
        self._t0 = time.monotonic()

    def __call__(self, stage: str, done: int, total: int) -> None:
        step = -1 if total <= 0 else int(10 * done / total)
        if self._last.get(stage) == step:
            return
        self._last[stage] = step
        elapsed = time.monotonic() - self._t0
        counts = f" {done}/{total}" if total > 1 else ""
        if stage == "ready":
            self.console.print(f"[bold green]✓ model ready[/] after {elapsed:.0f} s")
        elif stage.startswith("failed"):
            self.console.print(f"[bold red]✗ {stage}[/]")
        else:
            self.console.print(f"[cyan]…[/] {stage}{counts} [dim]({elapsed:.0f} s)[/]")


def check_port_free(host: str, port: int) -> None:
    """Raise :class:`PortInUseError` when ``host:port`` cannot be bound.

    Checked before the model loads, so a second ``isagi web`` on a taken port
    says so in one line at once instead of failing after the load.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise PortInUseError(
                f"cannot listen on {host}:{port} ({exc.strerror or exc}): another program "
                f"(perhaps another isagi web) uses it. Stop that program, or pick a free port: "
                f"isagi web --port {port + 1} (make web PORT={port + 1})."
            ) from None


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    """How uvicorn treats ``X-Forwarded-For``: believed only from ``ISAGI_TRUSTED_PROXIES``.

    uvicorn's own default believes it from loopback (``FORWARDED_ALLOW_IPS``,
    127.0.0.1 and ::1), so any client on the machine, or anything a tunnel
    forwards from it, could name its own address and slip past the caps and the
    login back-off that key on it. Without trusted proxies, forwarded headers
    are ignored and a client is the address that connected. With them, uvicorn's
    ``ProxyHeadersMiddleware`` rewrites the client only for a connection from
    one of them, to the rightmost address in ``X-Forwarded-For`` that is not a
    trusted proxy (a client's own entries to the left of its proxy's are never
    read). The app reads the client only from the ASGI scope, never from a header.
    """
    if settings.trusted_proxies:
        return {"proxy_headers": True, "forwarded_allow_ips": list(settings.trusted_proxies)}
    return {"proxy_headers": False}


def serve(settings: Settings, host: str = "127.0.0.1", port: int = 7860, *, idle_minutes: float | None = None,
          page: bool = True) -> None:
    """Run the web app with uvicorn until interrupted (``isagi web``; ``page=False``: the API
    alone, ``isagi serve``)."""
    from rich.console import Console

    from isagi.app.shutdown import run_server
    from isagi.datadir import open_data_dir

    settings = settings.for_server()  # the sequence slots a server runs unless told otherwise
    check_port_free(host, port)
    console = Console(stderr=True)
    # A data directory that cannot be written ends the command here (DataDirError: one line,
    # exit status 2); what the start-up check did is logged.
    data = open_data_dir(settings)
    for line in data.lines():
        log.warning("%s", line)
    progress = _TerminalProgress()
    app = create_app(default_factory(settings), settings, idle_minutes=idle_minutes, on_progress=progress,
                     data_dir=data, page=page)
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    url = f"http://{shown}:{port}/"
    console.print(f"[bold]ISAGI {'web' if page else 'serve'}[/] on [link={url}]{url}[/link]  (data: {settings.home})")
    if page:
        console.print("The page answers at once; it shows the model's loading progress until it is ready.")
    else:
        console.print("No page: /health and the API answer at once (503 until the model is ready).")
    if settings.api_keys:
        who = "Bearer keys of ISAGI_API_KEYS"
    elif settings.auth:
        who = "closed: set ISAGI_API_KEYS=user:KEY to give ISAGI_AUTH's users keys"
    else:
        who = "this machine only; set ISAGI_API_KEYS=user:KEY to open it to others"
    console.print(f"OpenAI-compatible API at {url}v1 ({who}; README, API).")
    if host not in LOOPBACK:
        if settings.auth:
            console.print(f"[yellow]Listening on {host}: reachable from other machines (login required).[/]")
        else:
            console.print(
                f"[bold yellow]Listening on {host} without a login: anyone who can reach this "
                "machine can use it. Set ISAGI_AUTH=user:password to require one.[/]"
            )
    if settings.trusted_proxies:
        console.print(f"Client addresses come from X-Forwarded-For of {', '.join(settings.trusted_proxies)} "
                      "(ISAGI_TRUSTED_PROXIES); from any other address the header is ignored.")
    run_server(app, host, port, **uvicorn_options(settings))
