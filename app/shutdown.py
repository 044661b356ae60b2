"""Ending the web server: promptly at Ctrl-C (SIGINT), after a drain at SIGTERM, tabs open or not.

Owns running the app under uvicorn (:func:`run_server`, behind ``isagi web``,
``isagi serve`` and the browser tests' fake server, so all three shut down
the same way) and the two things that let it end at once instead of after
uvicorn's graceful timeout:

- Every open tab holds long-lived responses: Gradio's heartbeat stream and its
  queue's event stream (each open until the tab closes), and an API client may
  hold a streamed completion. uvicorn waits for them to end, then cancels them
  after ``timeout_graceful_shutdown`` with a traceback per response. When the
  shutdown begins, :class:`EndStreamsAtShutdown` tells each response still
  open that its client went away (the ASGI ``http.disconnect`` message, what
  Starlette's streaming responses listen for), and the Gradio app's own
  ``stop_event`` (what its heartbeat waits on) is set: they end within a
  moment, the heartbeat running the page's unload handler as when a tab
  closes, so each tab's session is parked as usual.
- The app's lifespan shutdown then runs as before (live sessions saved, the
  data directory released): nothing it did is skipped.

SIGTERM (what ``docker stop``, Kubernetes and systemd send) first *drains* the server, while it
still listens: the app's ``isagi_drain`` (:func:`app.server.create_app`) makes ``/health`` answer
``503 {"status": "draining"}``, so a balancer takes this replica out, refuses new turns (an API
request gets a 503 the balancer retries on another replica), lets the turns in flight finish
(their streams go on) and saves each session and gives its lease back as soon as its turn ends,
so another replica takes it over at once; bounded by ``ISAGI_DRAIN_S``, cut short by a second
signal. With nothing in flight the drain ends at once. Ctrl-C does not wait for turns: it stops
them (they are recorded as stopped), as before.

The tabs left open then show the banner of :data:`app.layout.SERVER_GONE` (the server is gone).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
import sys
from types import FrameType
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

GRACE_S = 5  # uvicorn's last resort: what is still open after this is cancelled


class EndStreamsAtShutdown:
    """ASGI middleware: once ``stopping`` is set, a response waiting on its client is told the
    client went away, so a stream open for as long as its tab (Gradio's heartbeat, its event
    stream, a streamed API reply) ends instead of holding the server's shutdown."""

    def __init__(self, app: ASGIApp, stopping: asyncio.Event) -> None:
        self.app = app
        self.stopping = stopping

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        stopping = self.stopping

        async def receive_until_stopping() -> Message:
            if stopping.is_set():
                return {"type": "http.disconnect"}
            message = asyncio.ensure_future(receive())
            stop = asyncio.ensure_future(stopping.wait())
            try:
                await asyncio.wait({message, stop}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                stop.cancel()
                if not message.done():
                    message.cancel()
            if message.done() and not message.cancelled():
                return message.result()
            return {"type": "http.disconnect"}

        await self.app(scope, receive_until_stopping, send)


def stopping_event(app: Any) -> asyncio.Event:
    """The event :class:`EndStreamsAtShutdown` of ``app`` watches (made on first use)."""
    event = getattr(app.state, "isagi_stopping", None)
    if event is None:
        event = app.state.isagi_stopping = asyncio.Event()
    return event


def begin_shutdown(app: Any) -> None:
    """Tell ``app``'s open responses that the server is stopping (called in the event loop as
    the shutdown begins): streams end, Gradio's heartbeats end and park their tabs' sessions."""
    stopping_event(app).set()
    gradio_app = getattr(app.state, "isagi_gradio_app", None)
    if gradio_app is not None:
        gradio_app.stop_event.set()


async def drain(app: Any, stop: Any) -> None:
    """Run ``app``'s drain (``app.state.isagi_drain(stop)``, in a worker thread so the server
    keeps answering meanwhile: ``/health``, the streams of the turns in flight); no drain: nothing."""
    run = getattr(app.state, "isagi_drain", None)
    if run is not None:
        await asyncio.to_thread(run, stop)


def run_server(app: Any, host: str, port: int, **options: Any) -> None:
    """Serve ``app`` with uvicorn until SIGINT or SIGTERM, ending its open streams as the
    shutdown begins (``options``: more of uvicorn's settings, e.g. its proxy headers)."""
    import uvicorn

    app.add_middleware(EndStreamsAtShutdown, stopping=stopping_event(app))

    class Server(uvicorn.Server):
        signals: list[int]

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            self.signals = [*getattr(self, "signals", []), sig]
            super().handle_exit(sig, frame)

        async def shutdown(self, sockets: Any = None) -> None:
            received = getattr(self, "signals", [])
            if received[:1] == [signal.SIGTERM]:  # drain first (a second signal cuts it short)
                await drain(app, lambda: len(self.signals) > 1 or self.force_exit)
            begin_shutdown(app)
            await super().shutdown(sockets)

    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=GRACE_S,
                            **options)
    # As uvicorn.run: a second Ctrl-C quits at once; the first ends the serving loop cleanly.
    server = Server(config)
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    if not server.started:
        sys.exit(3)  # as uvicorn.run: it could not start (it logged why)
    # The sessions are saved (the lifespan's shutdown ran); what is left is the interpreter's
    # exit, whose last collections walk every object the page, Gradio and the model made (seconds
    # on a busy CPU) only to free memory the ending process gives back anyway.
    gc.freeze()
