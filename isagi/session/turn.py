"""One turn of a conversation: the single record every part of ISAGI shares.

Owns :class:`Turn`, the shape of one exchange (the user's message, the reply,
and every figure of what the manifold and the safety layer did with it). The
same record is what :meth:`isagi.pipeline.engine.Engine.stream_turn` returns, what a
:class:`~isagi.session.state.Session` keeps, what the history store writes as its
two rows (``storage.history``), what the ``.miku`` file holds (as two message
dicts, the on-disk form since format 2: :meth:`Turn.to_messages` and
:func:`turns_from_messages` are the one pair that maps between them), what the
web page shows and what exports print.

Also :class:`Message`, a message that has passed the engine's validation
(so a caller that validated it first does not have it validated twice).

Values read from a file are untrusted: :meth:`Turn.from_messages` keeps a
field only if it has the field's type (finite numbers, strings), so a damaged
or hostile file cannot put a list where a number belongs; the page escapes
every text again when it renders it.
"""

from __future__ import annotations

import math
import types
from dataclasses import asdict, dataclass, fields
from typing import Any, get_args, get_type_hints

VERDICTS = ("ok", "refused", "withheld", "cancelled")
# The user side of a continuation turn (:attr:`Turn.continues`): what the file, the history store and
# exports show as its request (the flag, never this text, is what marks a continuation).
CONTINUE_TEXT = "[Continue]"


@dataclass(frozen=True)
class Message:
    """A message as the turn uses it: validated and cleaned by ``Prompts.validate`` (isagi.pipeline.prompts)."""

    text: str


@dataclass
class Turn:
    """One exchange and what the turn did (docs/architecture.md, One turn, step 8).

    ``verdict`` is ``ok`` (an accepted reply), ``refused`` (TEH of the prompt
    over the threshold: nothing generated), ``withheld`` (the reply guard
    stopped the reply) or ``cancelled`` (Stop). Only ``ok`` turns with a
    reply ever enter a later prompt.
    """

    user_text: str
    reply_text: str
    tier: str | None = None  # RETRIEVE | AUGMENT | EXPAND | EXPLORE; None when refused
    distance: float | None = None  # to the nearest stored query, under the session's metric
    nearest_query: str | None = None
    zone: str | None = None
    teh_prompt: float | None = None
    teh_reply: float | None = None
    verdict: str = "ok"
    category: str | None = None  # the harm category of a refused or withheld turn
    latency_s: float | None = None
    prompt_tokens: int | None = None
    new_tokens: int | None = None
    metric_growth: float | None = None  # ||M - I|| after the turn
    context_dependent: bool = False
    cluster: int | None = None  # the memory cluster the exchange was stored in
    memory_id: int | None = None  # the id of the memory record the exchange stored (None: it stored none)
    generated: bool = False  # the reply was decoded (not RETRIEVEd, not refused)
    cut: bool = False  # decoding ended at the token limit, not on an end of sequence: Continue can extend it
    # Continue: this turn goes on with the reply before it (its reply_text is the continuation only,
    # its user_text CONTINUE_TEXT); that reply and its continuations are one reply in every prompt
    continues: bool = False
    asked_at: float | None = None  # seconds since 1970
    answered_at: float | None = None

    @property
    def accepted(self) -> bool:
        """May this exchange enter a later prompt? (an ``ok`` verdict and a reply)."""
        return self.verdict == "ok" and bool(self.reply_text)

    def to_dict(self) -> dict[str, Any]:
        """Every field, as plain values (for JSON and tests)."""
        return asdict(self)

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name != "_messages":
            object.__setattr__(self, "_messages", None)  # a changed field: to_messages builds anew

    def to_messages(self) -> list[dict[str, Any]]:
        """The turn as the file's two message dicts (user, then assistant with the figures).

        Built once per change of the turn and shared by every reader (the autosave, the
        page's chat and plots): read them, do not change them.
        """
        cached = self.__dict__.get("_messages")
        if cached is None:
            cached = self._build_messages()
            object.__setattr__(self, "_messages", cached)
        return list(cached)

    def _build_messages(self) -> list[dict[str, Any]]:
        user: dict[str, Any] = {"role": "user", "text": self.user_text}
        reply: dict[str, Any] = {"role": "assistant", "text": self.reply_text}
        if self.asked_at is not None:
            user["time"] = self.asked_at
        if self.answered_at is not None:
            reply["time"] = self.answered_at
        for name in _REPLY_FIELDS:
            value = getattr(self, name)
            if value is not None:
                reply[name] = value
        return [user, reply]

    @classmethod
    def from_messages(cls, user: dict[str, Any] | None, reply: dict[str, Any] | None) -> Turn:
        """The turn of a user message and its reply as read from a file (either may be missing).

        A user message without a reply (a turn that never finished) becomes a
        ``cancelled`` turn with an empty reply, so it never enters a prompt.
        """
        user = user or {}
        values: dict[str, Any] = {}  # field -> a value of its type (checked by _typed)
        if reply is None:
            values["verdict"] = "cancelled"
        else:
            for name in _REPLY_FIELDS:
                v = _typed(name, reply.get(name))
                if v is not None:
                    values[name] = v
        return cls(
            user_text=_text(user.get("text")),
            reply_text=_text((reply or {}).get("text")),
            asked_at=_time(user),
            answered_at=_time(reply or {}),
            **values,
        )


def turns_to_messages(turns: list[Turn]) -> list[dict[str, Any]]:
    """A session's turns as the file's message list."""
    return [m for t in turns for m in t.to_messages()]


def turns_from_messages(messages: list[dict[str, Any]]) -> list[Turn]:
    """Pair a file's messages into turns (user, then its reply), in order.

    Files ISAGI writes alternate user and assistant messages. Others are read
    as well as they can be: a user message not followed by a reply is a
    turn that never finished, a reply without a user message gets an empty
    question, and system messages (an imported research session) are not part
    of any turn.
    """
    turns: list[Turn] = []
    pending: dict[str, Any] | None = None
    for m in messages:
        role = m.get("role")
        if role == "user":
            if pending is not None:
                turns.append(Turn.from_messages(pending, None))
            pending = m
        elif role == "assistant":
            turns.append(Turn.from_messages(pending, m))
            pending = None
    if pending is not None:
        turns.append(Turn.from_messages(pending, None))
    return turns


TURN_FIELDS = tuple(f.name for f in fields(Turn))
# Fields the file keeps elsewhere than under their own names on the assistant message: the two
# texts (each message's "text") and the two times (each message's "time").
_MESSAGE_FIELDS = frozenset({"user_text", "reply_text", "asked_at", "answered_at"})
# Turn fields stored on the assistant message of the file, under the same names, in field order.
_REPLY_FIELDS = tuple(name for name in TURN_FIELDS if name not in _MESSAGE_FIELDS)


def _field_kinds() -> dict[str, type]:
    """Each field's type of value, without its ``None`` (``float | None``: float)."""
    hints = get_type_hints(Turn)
    kinds: dict[str, type] = {}
    for name in TURN_FIELDS:
        hint = hints[name]
        kinds[name] = next(a for a in get_args(hint) if a is not type(None)) if isinstance(hint, types.UnionType) \
            else hint
    return kinds


_KINDS = _field_kinds()
_FLOATS = frozenset(n for n in _REPLY_FIELDS if _KINDS[n] is float)
_INTS = frozenset(n for n in _REPLY_FIELDS if _KINDS[n] is int)
_BOOLS = frozenset(n for n in _REPLY_FIELDS if _KINDS[n] is bool)
_TEXTS = frozenset(n for n in _REPLY_FIELDS if _KINDS[n] is str)


def _text(v: object) -> str:
    return v if isinstance(v, str) else ""


def _time(m: dict[str, Any]) -> float | None:
    for key in ("time", "created"):  # "created": messages imported from miku v1
        v = _float(m.get(key))
        if v is not None:
            return v
    return None


def _float(v: object) -> float | None:
    """``v`` as a float if it is a finite number (not a bool), else None."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    try:
        return float(v) if math.isfinite(float(v)) else None
    except OverflowError:  # an integer too large for a float
        return None


def _typed(name: str, v: object) -> str | int | float | bool | None:
    """``v`` if it has the type of field ``name`` (finite numbers only), else None."""
    if v is None:
        return None
    if name in _BOOLS:
        return v if isinstance(v, bool) else None
    if isinstance(v, bool):
        return None
    if name in _INTS:
        if isinstance(v, int):
            return v
        if isinstance(v, float) and math.isfinite(v) and v.is_integer():
            return int(v)
        return None
    if name in _FLOATS:
        return _float(v)
    if name in _TEXTS:
        return v if isinstance(v, str) else None
    return None
