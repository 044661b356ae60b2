"""What a replica tells the balancer and its clients about itself: its name on every response.

With ``ISAGI_REPLICA`` set (a name such as ``isagi-1``), every HTTP response of the server (the
page, the API, ``/health``) carries ``X-Isagi-Replica: <name>``: which of several replicas
behind a balancer answered (docker/haproxy/haproxy.cfg, docs/architecture.md "Several
replicas"). Unset, no header is sent. Draining at SIGTERM is :mod:`app.shutdown`'s.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

REPLICA_HEADER = "X-Isagi-Replica"


class ReplicaHeader:
    """ASGI middleware: ``X-Isagi-Replica: name`` on every HTTP response."""

    def __init__(self, app: ASGIApp, name: str) -> None:
        self.app = app
        self.header = (REPLICA_HEADER.lower().encode("latin-1"), name.encode("latin-1"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_named(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, send_named)
