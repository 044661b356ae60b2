"""One turn of a live session, as every front end runs it (the page, the API).

Owns what the page (:mod:`app.handlers.chat`) and the OpenAI-compatible API
(:mod:`app.api`) share once they hold a session's lock
(:meth:`app.sessions.SessionRegistry.using`): the entry's Stop and notice
reset for a new turn (:func:`begin`), the engine's events of a new message or
of Regenerate (:func:`open_events`), and the end of a turn whose consumer left
before it ended (:func:`abandon`). Everything else of a turn (tiers, RETRIEVE,
the guard, recording, autosave, history) is the engine's
(:meth:`isagi.pipeline.engine.Engine.stream_turn`), so both front ends get all of it.

A turn left before its end ends one of two ways: *kept* (the page's Stop and a
lost browser: the stop event is set, the engine ends after its current token
and records the partial reply as a ``cancelled`` turn), or *dropped* (an API
client that disconnected: the events are closed, and the engine puts the
session back as it was before the turn, so no turn is recorded anywhere).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)


def begin(entry: Any) -> None:
    """Reset ``entry``'s Stop, its timing and its notice for a new turn (its lock held)."""
    entry.stop.clear()
    entry.stop_requested_at = entry.stop_latency_s = None
    entry.notice = None


def open_events(engine: Any, entry: Any, message: Any, options: Any, *, regenerate: bool = False) -> Iterator[Any]:
    """The engine's turn events for ``entry``'s session: ``message`` (checked by
    :meth:`isagi.pipeline.engine.Engine.check`), or Regenerate of its last question; Stop is the entry's."""
    if regenerate:
        return engine.regenerate(entry.session, options=options, stop=entry.stop)
    return engine.stream_turn(entry.session, message, options=options, stop=entry.stop)


def abandon(entry: Any, events: Iterator[Any], *, keep: bool) -> None:
    """End a turn whose consumer left before its ``done`` event (call it from the thread that
    iterates ``events``, never while another thread is inside them).

    ``keep=True``: stop it after the current token and let the engine record the partial
    reply as a cancelled turn (the page's Stop). ``keep=False``: close the events; the
    engine rolls the turn back, so it leaves nothing behind (an API client gone).
    """
    if not keep:
        try:
            events.close()  # type: ignore[attr-defined]
        except Exception as exc:  # never mask the caller's own end
            log.warning("closing an abandoned turn failed: %s", exc)
        return
    if not entry.stop.is_set():
        entry.stop_requested_at = time.monotonic()
    entry.stop.set()
    try:
        for _ in events:
            pass
    except Exception as exc:  # never mask the close
        log.warning("draining a cancelled turn failed: %s", exc)
