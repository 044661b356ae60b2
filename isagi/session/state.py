"""One conversation's living state (docs/architecture.md, Layout): :class:`Session`.

Owns what a single conversation holds: its turns (:class:`~isagi.session.turn.Turn`,
the one record of an exchange), its metric M, its trajectory memory, its own
UGT basis, and a cache of prompt states. A Session is never shared between
users. The pipeline that changes it is :class:`isagi.pipeline.engine.Engine`'s; the
file that stores it is :mod:`isagi.session.files`'s (neither is imported here).

Also the session's own undo: :meth:`Session.checkpoint` and
:meth:`Session.rollback` (a :class:`Checkpoint` of the metric, the memory, the
turns and the title). The engine takes one before every turn: a turn that
fails is rolled back to it, and it is kept as :attr:`Session.undo`, the state
before the last turn, which Regenerate puts back before it runs the question
again (:meth:`isagi.pipeline.engine.Engine.regenerate`). Nobody else rewrites a
session's turns, metric or memory.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from isagi.manifold.cog import Metric
from isagi.manifold.memory import TrajectoryMemory
from isagi.manifold.sameness import content_key
from isagi.manifold.ugt import Basis
from isagi.session.turn import Turn, turns_to_messages
from isagi.session.versions import ReplyVersions
from isagi.storage.fences import Fence
from isagi.storage.owners import LOCAL_OWNER
from isagi.storage.titles import session_title

PROMPT_STATE_CACHE = 256  # exact lookup prompts whose states a session keeps (~5 KB each at d=576)


@dataclass(frozen=True)
class Checkpoint:
    """A session's living state at one moment (:meth:`Session.checkpoint`): what
    :meth:`Session.rollback` puts back. Held in memory only, never saved."""

    metric_state: dict[str, Any]
    memory_columns: dict[str, Any]
    memory_cap: int
    turns: tuple[Turn, ...]
    title: str | None
    versions: dict[int, ReplyVersions]


@dataclass
class Session:
    """One conversation's living state. Never shared between users."""

    id: str
    basis: Basis
    metric: Metric
    memory: TrajectoryMemory
    turns: list[Turn] = field(default_factory=list)
    created: float = field(default_factory=time.time)
    title: str | None = None
    miku_path: Path | None = None
    # Who the session belongs to in the history store: the logged-in user of the
    # web app, LOCAL_OWNER without a login. Set by whoever opens the session;
    # never read from a file.
    owner: str = LOCAL_OWNER
    # Prompt states already computed in this session, keyed by the exact lookup
    # prompt: an exact repeat skips its prefill (the states are a deterministic
    # function of the prompt). Derived data: never saved, never shared.
    prompt_states: OrderedDict[str, tuple[np.ndarray, np.ndarray]] = field(
        default_factory=OrderedDict, repr=False, compare=False
    )
    # Token counts of exchanges in the prompt, keyed by (system prompt, message, reply), for the
    # history window (isagi.pipeline.prompts.Prompts.history_window): each exchange is counted once, not at
    # every turn. Derived data: never saved.
    token_counts: dict[tuple[str, str, str], tuple[int, int]] = field(default_factory=dict, repr=False, compare=False)
    # The state before the last turn (set by the engine when a turn is recorded): what Regenerate
    # puts back. None when there is nothing to regenerate (no turn yet, or a session just loaded).
    undo: Checkpoint | None = field(default=None, repr=False, compare=False)
    # The replies a turn has had, by the turn's position (a Regenerate keeps the one it replaced;
    # isagi.session.versions): only turns with more than one reply are here.
    versions: dict[int, ReplyVersions] = field(default_factory=dict, repr=False, compare=False)
    # Counts every change of the turns (a turn recorded, a rollback): a page showing the session
    # compares it with the count it last drew to know it is stale (another tab's turn).
    version: int = field(default=0, repr=False, compare=False)
    # The lease this process holds on the session where the session files are shared by several
    # processes (isagi.session.lease): every write of it carries this fence, and one that finds
    # the session taken over by another process writes nothing (isagi.storage.fences). Set by the
    # registry when the session becomes live; None without leases. Never saved.
    lease: Fence | None = field(default=None, repr=False, compare=False)

    # -- changes -----------------------------------------------------------------
    def checkpoint(self) -> Checkpoint:
        """The living state now (metric, memory, turns, title, reply versions), for :meth:`rollback`."""
        return Checkpoint(
            metric_state=self.metric.to_state(),
            memory_columns=self.memory.to_columns(),
            memory_cap=int(getattr(self.memory, "cap", 50_000)),
            turns=tuple(self.turns),
            title=self.title,
            versions=dict(self.versions),
        )

    def rollback(self, cp: Checkpoint) -> None:
        """Put the session back to ``cp``: its metric, memory, turns and title (the prompt-state
        caches stay: they are a function of the prompt alone)."""
        k = int(cp.metric_state["k"])
        self.metric = type(self.metric).from_state(cp.metric_state)
        self.memory = type(self.memory).from_columns(cp.memory_columns, k, cap=cp.memory_cap)
        self.turns[:] = cp.turns
        self.title = cp.title
        self.versions = dict(cp.versions)
        self.version += 1

    def add_turn(self, turn: Turn) -> None:
        """The turn joins the session (its first message names an untitled session)."""
        self.turns.append(turn)
        if self.title is None:
            self.title = session_title(None, turn.user_text)
        self.version += 1

    @property
    def can_regenerate(self) -> bool:
        """Whether :attr:`undo` is the state just before the last turn (Regenerate can replace it)."""
        undo = self.undo
        return (undo is not None and len(self.turns) == len(undo.turns) + 1
                and all(a is b for a, b in zip(self.turns, undo.turns, strict=False)))

    def cached_states(self, key: str) -> tuple[np.ndarray, np.ndarray] | None:
        states = self.prompt_states.get(key)
        if states is not None:
            self.prompt_states.move_to_end(key)
        return states

    def cache_states(self, key: str, h: np.ndarray, h_safety: np.ndarray) -> None:
        self.prompt_states[key] = (h, h_safety)
        self.prompt_states.move_to_end(key)
        while len(self.prompt_states) > PROMPT_STATE_CACHE:
            self.prompt_states.popitem(last=False)

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The turns as chat messages (user, assistant with its figures), a fresh list: read-only."""
        return turns_to_messages(self.turns)

    @property
    def last_turn(self) -> Turn | None:
        return self.turns[-1] if self.turns else None

    def recent_exchanges(self) -> Iterator[list[dict[str, str]]]:
        """Earlier exchanges that may enter a prompt, newest first, as chat message pairs.

        Only accepted turns (verdict ``ok``, a non-empty reply): refused,
        withheld and cancelled (Stop) turns never enter a later prompt, or a
        stopped story would be continued by the next question. A reply and its accepted
        continuations (:attr:`Turn.continues`) are one exchange. Walks from the
        end, so a caller that stops early never reads the whole session.
        """
        tail = ""  # the accepted continuations of the reply before them, in order
        for t in reversed(self.turns):
            if not t.accepted:
                tail = ""  # a continuation joins only a reply the prompt takes
            elif t.continues:
                tail = t.reply_text + tail
            else:
                yield [
                    {"role": "user", "content": t.user_text},
                    {"role": "assistant", "content": t.reply_text + tail},
                ]
                tail = ""

    def exchanges(self) -> list[list[dict[str, str]]]:
        """Every exchange that may enter a prompt (see :meth:`recent_exchanges`), oldest first."""
        return list(reversed(list(self.recent_exchanges())))

    def chat_history(self) -> list[dict[str, str]]:
        """Every accepted earlier exchange as chat messages, oldest first (no budget)."""
        return [m for exchange in reversed(list(self.recent_exchanges())) for m in exchange]

    def last_user_key(self) -> str:
        """The content key of the latest message (the context of the next one)."""
        asked = next((t for t in reversed(self.turns) if not t.continues), None)  # a Continue asks nothing
        return content_key(asked.user_text) if asked is not None else ""
