"""What a turn streams, as a closed set of typed events (docs/architecture.md, One turn).

Owns the vocabulary between the turn pipeline (:class:`isagi.pipeline.engine.Engine`) and
every front end (the page, the API, the terminal): each front end only reads these events
and translates them (into page updates, OpenAI chunks, terminal lines); none inspects the
engine's internals or string tags. :data:`TurnEvent` is the union; ``isinstance`` (or
``match``) on its members tells them apart, and a type checker knows their fields.

A turn yields, in order: one :class:`Decided`; then either :class:`Refused` (the prompt
guard: the refusal is the whole reply), or the reply as :class:`Token` deltas, possibly ended
by :class:`Withheld` (the reply guard stopped it); and last :class:`Done` with the finished
turn. A turn that fails raises instead (the session is rolled back), so there is no error
event: the front end's ``except`` is the error path.
"""

from __future__ import annotations

from dataclasses import dataclass

from isagi.session.turn import Turn


@dataclass(frozen=True, slots=True)
class Decided:
    """The tier the turn took (None: refused before any lookup) and the distance that chose it."""

    tier: str | None
    distance: float | None = None


@dataclass(frozen=True, slots=True)
class Token:
    """A piece of the reply's text, in order."""

    text: str


@dataclass(frozen=True, slots=True)
class Refused:
    """The prompt guard refused the message: ``text`` is the whole reply (nothing was generated)."""

    text: str


@dataclass(frozen=True, slots=True)
class Withheld:
    """The reply guard stopped the reply: ``text`` is the notice that ends what was streamed."""

    text: str


@dataclass(frozen=True, slots=True)
class Done:
    """The finished, recorded turn, and what of it could not be saved yet (in words for the user)."""

    turn: Turn
    notice: str | None = None


TurnEvent = Decided | Token | Refused | Withheld | Done
"""Everything a turn streams."""


def shown_text(event: TurnEvent) -> str:
    """The text ``event`` adds to the reply as shown ('' for a decision or the end)."""
    return event.text if isinstance(event, Token | Refused | Withheld) else ""


__all__ = ["Decided", "Done", "Refused", "Token", "TurnEvent", "Withheld", "shown_text"]
