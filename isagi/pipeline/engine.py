"""The turn pipeline (docs/architecture.md, One turn) and what every session shares.

Owns :class:`Engine` (settings, the model, the per-model profile, the history
store, a lock that serialises generation on one device, and the callable that
persists each turn) and the turn itself, as named stages (the turn's prompt, its
validation and its history window are :class:`isagi.pipeline.prompts.Prompts`):

1. **prepare**: validate the message (once: a :class:`~isagi.session.turn.Message` is
   already valid), read it: prefill [system, message] and capture h at layer L
   and the safety layer's state in the same forward pass (an exact repeat of a
   prompt already seen in this session reuses its states, a deterministic
   function of the prompt, and skips this prefill); after some history, the
   reply's own prompt is read first and the message alone only when that
   reading is not clearly safe (:meth:`Engine._read_in_conversation`); project
   to UGT coordinates, route to a zone;
2. **guard**: TEH of the prompt; over the threshold the turn is refused
   without generating;
3. **decide**: the two-stage lookup under the session's metric, then the pure
   tier rule :func:`isagi.manifold.decide.decide`;
4. **generate**: RETRIEVE returns the stored reply; otherwise decode from the
   prefill's KV cache with the streaming reply guard (Stop ends it);
5. **learn**: an accepted generated reply updates the metric and the memory;
6. **record**: the :class:`~isagi.session.turn.Turn` joins the session and is
   persisted by the engine's ``keep`` callable (autosave, then history rows,
   :class:`isagi.pipeline.keeping.TurnKeeper`), which this module never imports; what
   it could not keep yet comes back as the "done" event's ``notice``. Once the
   turn has joined the session nothing takes it back: a failure to persist it
   (even an unexpected one) is such a notice, never an exception.

The engine owns every change of a session by a turn, and its undo: each turn
starts from a :meth:`~isagi.session.state.Session.checkpoint`; a turn that fails (or
is closed) before it is recorded is rolled back to it, so the session is as it
was; a recorded turn keeps it as ``session.undo``. :meth:`Engine.regenerate`
(the page's Regenerate, the terminal's ``/regenerate``) puts that back and runs
the last question again; the new turn replaces the old one in the file and the
history store, and if it fails the old one is put back. A Regenerate of an
answer from memory (RETRIEVE) generates a new reply and stores it in place of
the remembered one.

All model work of a turn is in :func:`_prefill`, :meth:`Engine._read_in_conversation`
and :func:`_generate`, on the turn's one :class:`_OpenGeneration`.

The lookup embedding is the query *alone* (system prompt + message) when it is
read alone, and its reading after the history otherwise; a repeated question
is recognised either way (the exact sameness check, and the calibration pairs
read in two conversations stay within the retrieve cap: docs/measurements.md). Context is handled by
a separate, exact check: a message that needs its conversation to be
understood ("And Germany?", see :func:`isagi.manifold.sameness.depends_on_context`) is
stored with the key of the message before it, and is only answered from
memory under that same context. (Measured first: the hidden-state shift
between a message alone and in context does not separate follow-ups from
self-contained questions on SmolLM2-135M; the profile report keeps that
measurement under "context".)
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict

import numpy as np

from isagi.config import Settings
from isagi.engines.base import REUSE_ANY, Decoding, GenerationOptions, PrefillStopped, within_limits
from isagi.errors import InputError, not_saved_notice
from isagi.ids import new_session_id
from isagi.manifold.cog import Metric, Tier, TierThresholds, learn_weight
from isagi.manifold.decide import Candidate, Decision, decide
from isagi.manifold.distance_scale import SEED as SEED_SCALE
from isagi.manifold.memory import TrajectoryMemory
from isagi.manifold.pooling import decoding_state
from isagi.manifold.sameness import content_key
from isagi.manifold.ugt import Basis, project, route
from isagi.pipeline.events import Decided, Done, Refused, Token, TurnEvent, Withheld
from isagi.pipeline.model_turns import ModelTurns
from isagi.pipeline.prompts import Prompts
from isagi.session.files import SessionFrame
from isagi.session.folder import SessionFiles
from isagi.session.state import PROMPT_STATE_CACHE, Checkpoint, Session
from isagi.session.turn import CONTINUE_TEXT, Message, Turn
from isagi.session.versions import ReplyVersions

if TYPE_CHECKING:
    from isagi.engines.base import ModelEngine
    from isagi.pipeline.keeping import Keeper
    from isagi.profile import Profile, Progress
    from isagi.safety.runtime import ReplyGuard
    from isagi.storage.history import HistoryStore

__all__ = ["NOT_CUT", "PROMPT_STATE_CACHE", "Engine", "Message", "Session", "Turn", "TurnEvent"]

log = logging.getLogger(__name__)


RETRIEVE_CANDIDATES = 8  # nearest records checked for an exact match before RETRIEVE
# How far below the prompt guard's threshold (TEH points) a message's reading in its conversation
# must be for the read alone to be skipped (Engine._read_in_conversation). Chosen on calibration
# rows out of fold, margins 0-20 tried: at 10, 10 of the 4,252 harmful rows the read alone refuses
# read below it in the training conversations (0 of 1,423 in held-out ones), and the read alone
# is skipped for 93.5 % of ordinary requests (docs/measurements.md, "Reading the message in its
# conversation first").
CONVERSATION_MARGIN = 10.0
NOT_CUT = "Nothing to continue: the last reply was not cut at the token limit."

@dataclass
class Prepared:
    """What the prepare stage knows of a message: its coordinates, zone and safety state."""

    text: str
    x: np.ndarray  # UGT coordinates of the message's reading (alone, or in its conversation)
    h_safety: np.ndarray  # the safety layer's state of the message
    zone: str | None
    context_key: str  # content key of the message before this one
    prompt_tokens: int
    history: list[dict[str, str]] | None  # the exchanges that fit beside the message; None: not worked out
    in_conversation: bool = False  # read after its history (Engine._read_in_conversation), not alone


@dataclass
class Generated:
    """What the generate stage produced."""

    reply: str
    verdict: str  # ok | withheld | cancelled
    teh_reply: float | None
    reply_states: np.ndarray  # hidden states at layer L of the reply tokens
    prompt_tokens: int
    new_tokens: int
    cut: bool = False  # an accepted reply that ended at the token limit (Continue can extend it)


class Classification(TypedDict):
    """The tier a message would get (:meth:`Engine.classify`)."""

    tier: str
    distance: float | None
    nearest_query: str | None
    context_dependent: bool


class Engine:
    """What all sessions share: settings, model, profile, history store, turn persistence."""

    def __init__(
        self, settings: Settings, lm: ModelEngine, profile: Profile, store: HistoryStore | None = None,
        keep: Keeper | None = None,
    ) -> None:
        self.settings = settings
        self.lm = lm
        self.profile = profile
        self.store = store
        self.keep = keep  # persists each recorded turn; None keeps turns in memory only
        self.thresholds = TierThresholds()
        # turns in the model at once: one per sequence slot of the model engine
        self.model_turns = ModelTurns(lm.slots)
        self.prompts = Prompts(settings, lm)  # validation, token counts, the history window

    @classmethod
    def start(
        cls,
        settings: Settings,
        *,
        with_store: bool = True,
        progress: Progress | None = None,
        lm: ModelEngine | None = None,
        profile: Profile | None = None,
    ) -> Engine:
        """Load the model engine and its profile (calibrating on first use) and open the history store.

        ``lm`` (a :class:`~isagi.engines.base.ModelEngine`) and ``profile`` replace the loaded
        ones (tests pass a tiny model); the engine persists turns with
        :func:`isagi.pipeline.keeping.default_keeper`.
        """
        from isagi.pipeline.keeping import default_keeper

        if lm is None:
            from isagi.engines import load_engine

            lm = load_engine(settings)
        if profile is None:
            from isagi.profile import load_or_build_profile

            profile = load_or_build_profile(lm, settings, progress=progress)
        store = None
        if with_store:
            from isagi.storage.history import HistoryStore

            store = HistoryStore(settings.resolved_database_url)
        from isagi.session.store import session_files

        engine = cls(settings, lm, profile, store)
        engine.keep = default_keeper(lambda: engine.frame, store, model_id=engine.lm.model_id,
                                     files=session_files(settings))
        return engine

    @property
    def layer(self) -> int:
        return self.profile.layer

    @property
    def frame(self) -> SessionFrame:
        """What a session file of this engine records and must match (``isagi.session.files``)."""
        return SessionFrame(model_id=self.lm.model_id, model_fingerprint=self.lm.fingerprint,
                            hidden_size=int(self.lm.hidden_size), layer=int(self.profile.layer),
                            profile_key=self.profile.key, system_prompt=self.settings.system_prompt)

    def new_session(self, session_id: str | None = None, *, autosave: bool = True) -> Session:
        k = int(self.profile.basis.B.shape[1])
        sid = session_id or new_session_id()
        session = Session(id=sid, basis=self.profile.basis, metric=Metric(k), memory=TrajectoryMemory(k))
        if autosave:
            session.miku_path = SessionFiles(self.settings.sessions_dir).path(sid)
        return session

    # -- validation --------------------------------------------------------------

    def check(self, message: str | Message) -> Message:
        """``message`` validated (:meth:`isagi.pipeline.prompts.Prompts.validate`); a :class:`Message` is valid already."""
        return message if isinstance(message, Message) else Message(self.prompts.validate(message))


    # -- the turn ---------------------------------------------------------------

    def turn(
        self, session: Session, message: str | Message, *, options: GenerationOptions | None = None,
        stop: threading.Event | None = None, record: bool = True, replaces_last: bool = False, fresh: bool = False,
    ) -> Turn:
        """Run a whole turn and return it (no streaming); the arguments are :meth:`stream_turn`'s."""
        turn = None
        for event in self.stream_turn(session, message, options=options, stop=stop, record=record,
                                      replaces_last=replaces_last, fresh=fresh):
            if isinstance(event, Done):
                turn = event.turn
        assert turn is not None
        return turn

    def stream_turn(
        self,
        session: Session,
        message: str | Message,
        *,
        options: GenerationOptions | None = None,
        stop: threading.Event | None = None,
        record: bool = True,
        replaces_last: bool = False,
        fresh: bool = False,
        before_record: Callable[[Turn], None] | None = None,
    ) -> Generator[TurnEvent, None, None]:
        """One turn: the decision, the reply's text deltas, then the finished :class:`Turn`.

        The message is validated here, at the call (an :class:`InputError` before
        any event), unless it is a :class:`Message` already. ``record=False``
        keeps the turn in the session only (evaluations); ``replaces_last``
        persists it in place of the session's last exchange (:meth:`regenerate`,
        which undid that turn in the session first). ``fresh``: never answer from
        memory; a RETRIEVE generates a new reply, which replaces the stored one.
        ``before_record``: called with the finished turn just before it joins the session and is
        persisted (Regenerate keeps the reply it replaced with it).

        A turn that raises, or whose events are closed, before it is recorded leaves
        the session as it was (rolled back to the checkpoint taken at its start).
        """
        text = self.check(message).text
        if record and not replaces_last:
            _check_room(session)
        return self._run(session, text, options, stop, record=record, replaces_last=replaces_last, fresh=fresh,
                         before_record=before_record)

    def regenerate(
        self,
        session: Session,
        *,
        options: GenerationOptions | None = None,
        stop: threading.Event | None = None,
    ) -> Generator[TurnEvent, None, None]:
        """Run the session's last question again; the new turn replaces the last one everywhere.

        The session is put back as it was before its last turn (``session.undo``: metric,
        memory, turns), the question runs again (:meth:`stream_turn`, never from memory:
        an answer from memory is generated anew and the new reply replaces the stored one),
        and the new turn takes the old one's place in the file and the history store. If it
        fails (or its events are closed) before it is recorded, the old turn and its undo are
        put back. An :class:`InputError` at the call when there is nothing to regenerate.
        """
        if not session.can_regenerate:
            raise InputError("Nothing to regenerate: send a message first.")
        if session.turns[-1].continues:  # a continuation is generated again from the reply it continued
            return self._recontinue(session, options, stop)
        return self._regenerate(session, options, stop)

    def _regenerate(
        self, session: Session, options: GenerationOptions | None, stop: threading.Event | None
    ) -> Generator[TurnEvent, None, None]:
        undo = session.undo
        assert undo is not None
        last = session.turns[-1]
        at = len(session.turns) - 1
        kept = session.versions.get(at) or ReplyVersions([last], 0)  # the replies this turn has had
        now = session.checkpoint()  # with the turn being replaced: put back if the new one fails
        session.rollback(undo)

        def keep_versions(turn: Turn) -> None:  # before it is persisted: the file holds them too
            session.versions[at] = kept.with_new(turn)

        yield from _or_put_back(session, now, undo, self.stream_turn(
            session, Message(last.user_text), options=options, stop=stop, replaces_last=True, fresh=True,
            before_record=keep_versions))

    def switch_version(self, session: Session, to: int) -> str | None:
        """Make version ``to`` (0 the oldest) of the last turn's replies the current one: the chat
        continues from it, the file and the history hold it, and memory answers with it (its text
        replaces the stored reply of the turn's record; the map keeps the newest reply's place).
        No model work. Returns the keeper's notice (None: all kept). An :class:`InputError` when
        the last turn has no such version."""
        at = len(session.turns) - 1
        versions = session.versions.get(at)
        if versions is None or not isinstance(to, int) or not 0 <= to < len(versions.replies):
            raise InputError("This reply has no other version: Regenerate makes one.")
        if to == versions.current:
            return None
        current, chosen = session.turns[at], versions.replies[to]
        rid = current.memory_id
        if rid is not None and rid in session.memory and chosen.accepted:
            session.memory.replace_reply(rid, session.memory.get(rid)["reply_x"], chosen.reply_text)
            chosen.memory_id = rid
        session.turns[at] = chosen
        versions.current = to
        session.version += 1
        if self.keep is None:
            return None
        try:
            return self.keep(session, chosen, replaces_from=at)
        except Exception as exc:  # as _record: the switch stands, the next save retries
            log.exception("could not persist a version switch of session %s", session.id)
            return not_saved_notice(f"an unexpected error, {type(exc).__name__}")

    def edit(
        self,
        session: Session,
        index: int,
        message: str | Message,
        *,
        options: GenerationOptions | None = None,
        stop: threading.Event | None = None,
    ) -> Generator[TurnEvent, None, None]:
        """Resend an edited question in place of turn ``index``: the conversation is cut there
        (:func:`isagi.pipeline.rewind.rewind`: those turns, the memory records they stored and their
        metric updates go), the edited question runs as a new turn, and it replaces the cut
        exchanges in the file and the history store. If it fails (or its events are closed) before
        it is recorded, the session is put back as it was, cut turns included. An
        :class:`InputError` at the call for a position the session does not have or an invalid message.
        """
        if not isinstance(index, int) or not 0 <= index < len(session.turns):
            raise InputError("That message is no longer in this chat: reload the page and edit it again.")
        text = self.check(message).text
        return self._edit(session, index, text, options, stop)

    def _edit(
        self, session: Session, index: int, text: str, options: GenerationOptions | None, stop: threading.Event | None
    ) -> Generator[TurnEvent, None, None]:
        from isagi.pipeline.rewind import rewind

        before, undo = session.checkpoint(), session.undo
        rewind(session, index)
        yield from _or_put_back(session, before, undo,
                                self._run(session, text, options, stop, record=True, replaces_last=True))

    # -- Continue -----------------------------------------------------------------

    @staticmethod
    def can_continue(session: Session) -> bool:
        """Whether the session's last turn is a reply cut at the token limit (Continue can extend it)."""
        return _cut_reply(session) is not None

    def continue_reply(
        self, session: Session, options: GenerationOptions | None = None, stop: threading.Event | None = None,
    ) -> Generator[TurnEvent, None, None]:
        """Continue the session's last reply, cut at the token limit, as a new turn (Continue).

        The model gets the prompt of the question that reply answers (its history, the question,
        ready to answer) with the reply so far as the open beginning of its message, and decodes
        on (``ModelEngine.generation(reply_prefix=...)``). The new turn is recorded as a
        continuation (:attr:`Turn.continues`, request :data:`~isagi.session.turn.CONTINUE_TEXT`,
        its reply the continuation alone); the reply guard judges the reply as one (the last
        states of the reply so far in front of the new ones). It is not a new question: the
        metric does not move; accepted, it extends the reply of the question's memory record, so
        the memory answers with the whole reply. The events are a turn's (:meth:`stream_turn`).
        An :class:`InputError` at the call when the last turn is no cut reply (:data:`NOT_CUT`).
        """
        if _cut_reply(session) is None:
            raise InputError(NOT_CUT)
        _check_room(session)
        return self._continue(session, options, stop, replaces_last=False)

    def _recontinue(
        self, session: Session, options: GenerationOptions | None, stop: threading.Event | None
    ) -> Generator[TurnEvent, None, None]:
        """Regenerate of a continuation: the session as before it, then Continue again in its place
        (if that fails before it is recorded, the old continuation and its undo are put back)."""
        undo = session.undo
        assert undo is not None
        now = session.checkpoint()
        session.rollback(undo)
        if _cut_reply(session) is None:  # cannot happen for a recorded continuation; say so plainly
            session.rollback(now)
            session.undo = undo
            raise InputError(NOT_CUT)
        yield from _or_put_back(session, now, undo, self._continue(session, options, stop, replaces_last=True))

    def _continue(
        self, session: Session, options: GenerationOptions | None, stop: threading.Event | None, *,
        replaces_last: bool,
    ) -> Generator[TurnEvent, None, None]:
        """:meth:`_run` for a continuation: the same limits, undo, timing and recording."""
        return self._run(session, CONTINUE_TEXT, options, stop, record=True, replaces_last=replaces_last,
                         locked=lambda limited: self._continue_locked(session, limited, stop))

    def _continue_locked(
        self, session: Session, options: GenerationOptions, stop: threading.Event | None
    ) -> Generator[TurnEvent, None, Turn]:
        """Decode the continuation of the cut reply and extend the question's memory record."""
        import dataclasses

        from isagi.safety.runtime import ReplyGuard

        found = _cut_reply(session)
        assert found is not None
        at, reply = found
        asked = session.turns[at]
        # the session as the question found it: its history window is the continuation's
        earlier = dataclasses.replace(session, turns=session.turns[:at])
        messages = self.prompts.continuation(earlier, asked.user_text, reply)
        safety = self.profile.safety
        turn = Turn(user_text=CONTINUE_TEXT, reply_text="", tier=asked.tier, zone=asked.zone,
                    teh_prompt=asked.teh_prompt, context_dependent=asked.context_dependent,
                    cluster=asked.cluster, continues=True, new_tokens=0)
        yield Decided(asked.tier)
        with _OpenGeneration(self.lm, self.layer, options, also_capture=tuple(safety.read_layers), stop=stop) as slot:
            try:
                # the question's safety state (the guard judges the reply with it): as its turn had it
                lookup = self.prompts.build(earlier, asked.user_text, None, with_history=False)
                key = _prompt_key(lookup)
                known = session.cached_states(key)
                h, h_safety, _ = _prefill(slot, self.lm, lookup, safety.read_layers, known, states_only=True)
                if known is None:
                    session.cache_states(key, h, h_safety)
                # the reply's last tokens are evaluated (their states go to the guard); everything
                # before them may come from a saved KV cache (the cut turn's prompt and reply)
                n_open = len(self.lm.chat_tokens(messages))
                n_all = n_open + self.lm.count_tokens(reply)
                guard = ReplyGuard(safety, h_safety)
                tail = min(guard.window, n_all - n_open)
                gen = slot.open(messages, reuse_prefix=n_all - max(tail, 1), reply_prefix=reply,
                                context_shift=self.settings.context_shift)
                gen.prefill()
            except PrefillStopped:  # Stop before the continuation began: nothing said
                turn.verdict = "cancelled"
                return turn
            before = np.stack([np.concatenate([gen.prompt_state(layer, (i, i + 1)) for layer in guard.layers])
                               for i in range(n_all - tail, n_all)]) if tail else None
            out = yield from _generate(slot, None, guard, stop, before=before)
            if out.verdict == "withheld":
                from isagi.safety.runtime import REFUSAL_TEMPLATE

                turn.category = self._category(h_safety)
                out.reply = "[reply withheld] " + REFUSAL_TEMPLATE.format(category=turn.category.replace("_", " "))
                yield Withheld("\n\n" + out.reply)
        turn.reply_text, turn.verdict, turn.teh_reply, turn.cut = out.reply, out.verdict, out.teh_reply, out.cut
        turn.prompt_tokens, turn.new_tokens, turn.generated = out.prompt_tokens, out.new_tokens, True
        if out.verdict == "ok":
            self._extend_memory(session, at, reply, out)
        return turn

    def _extend_memory(self, session: Session, at: int, reply: str, out: Generated) -> None:
        """The memory record of the question at turn ``at`` (whose reply so far is ``reply``) gets
        the whole reply: its text, and as coordinates the token-weighted mean of the reply so far's
        and the continuation's (the projection is affine: the mean of the whole reply's states).
        A record no longer there (evicted, or never stored) is left alone."""
        record_id = _record_of(session, at, reply)
        if record_id is None:
            return
        old = session.memory.get(record_id)
        n_old = sum(int(t.new_tokens or 0) for t in session.turns[at:])
        n_new = len(out.reply_states)
        reply_x = np.asarray(old["reply_x"], dtype=np.float64)
        if n_new:
            new_x = project(session.basis, out.reply_states.mean(axis=0))
            reply_x = (reply_x * n_old + new_x * n_new) / (n_old + n_new) if n_old else new_x
        session.memory.replace_reply(record_id, reply_x, reply + out.reply)

    def _run(
        self,
        session: Session,
        text: str,
        options: GenerationOptions | None,
        stop: threading.Event | None,
        *,
        record: bool,
        replaces_last: bool,
        fresh: bool = False,
        before_record: Callable[[Turn], None] | None = None,
        locked: Callable[[GenerationOptions], Generator[TurnEvent, None, Turn]] | None = None,
    ) -> Generator[TurnEvent, None, None]:
        """A turn's frame around its model work (``locked``, by default :meth:`_turn_locked`; a
        continuation's own): the server's limits, the checkpoint it rolls back to, its timing,
        and its recording."""
        started, asked_at = time.perf_counter(), time.time()
        # the server's limits win over whatever the front end asked for (ISAGI_MAX_NEW_TOKENS)
        options = within_limits(options or GenerationOptions(max_new_tokens=self.settings.max_new_tokens),
                                self.settings.max_new_tokens)
        before = session.checkpoint()
        try:
            with self.model_turns:
                turn = yield from (locked(options) if locked is not None
                                   else self._turn_locked(session, text, options, stop, fresh=fresh))
            turn.latency_s = time.perf_counter() - started
            turn.metric_growth = session.metric.growth
            turn.asked_at, turn.answered_at = asked_at, time.time()
        except BaseException:  # a bug, a lost model, Ctrl-C, or the events closed: as before the turn
            session.rollback(before)
            raise
        if before_record is not None:
            before_record(turn)
        notice = self._record(session, turn, persist=record, replaces=replaces_last)
        session.undo = before
        yield Done(turn, notice)

    def _turn_locked(
        self, session: Session, text: str, options: GenerationOptions, stop: threading.Event | None,
        *, fresh: bool = False,
    ) -> Generator[TurnEvent, None, Turn]:
        """Prepare, guard, decide, generate and learn, as one of the model turns (``model_turns``); returns the Turn."""
        safety = self.profile.safety
        # At most one Generation of this turn is open at a time (so it holds at most one slot).
        # The safety layer's states come from the same forward passes (one more hook).
        with _OpenGeneration(self.lm, self.layer, options, also_capture=tuple(safety.read_layers), stop=stop) as slot:
            try:
                p = self._prepare(session, text, slot)
            except PrefillStopped:  # Stop during the message's evaluation: nothing decided, nothing said
                yield Decided(None)
                return Turn(user_text=text, reply_text="", verdict="cancelled", new_tokens=0)
            teh_prompt, refusal = self._guard(p)
            d = self._decide(session, text, p.x, p.context_key) if refusal is None else None
            if d is not None and d.tier is not Tier.RETRIEVE and p.in_conversation \
                    and session.memory.may_hold_question(content_key(text)):
                # asked before, maybe stored as read alone: RETRIEVE compares readings of one kind,
                # so the message is read alone too, and that reading decides (guard included)
                try:
                    p = self._prepare(session, text, slot, alone=True)
                except PrefillStopped:
                    yield Decided(None)
                    return Turn(user_text=text, reply_text="", verdict="cancelled", new_tokens=0)
                teh_prompt, refusal = self._guard(p)
                d = self._decide(session, text, p.x, p.context_key) if refusal is None else None
            if refusal is not None:
                yield Decided(None)
                yield Refused(refusal.reply_text)
                return refusal
            assert d is not None
            yield Decided(d.tier.value, d.distance)
            turn = Turn(
                user_text=text, reply_text="", tier=d.tier.value, distance=d.distance,
                nearest_query=d.record["query_text"] if d.record is not None else None, zone=p.zone,
                teh_prompt=teh_prompt, context_dependent=d.context_dependent,
                prompt_tokens=p.prompt_tokens, new_tokens=0,
            )
            replacing = None
            if d.tier is Tier.RETRIEVE and fresh:
                # Regenerate of an answer from memory: generate anew (as EXPAND would, without the
                # stored reply in the prompt) and put the new reply in the stored one's place.
                replacing = d.nearest
                d = Decision(Tier.EXPAND, d.nearest, d.context_dependent)
                turn.tier = d.tier.value
            if d.tier is Tier.RETRIEVE:
                assert d.nearest is not None
                session.memory.record_hit(d.nearest.id)
                turn.reply_text, turn.cluster = d.nearest.record["reply_text"], int(d.nearest.record["cluster"])
                yield Token(turn.reply_text)
                return turn
            out = yield from self._generate(session, text, d, slot, stop, p.h_safety, p.history)
            if out.verdict == "withheld":
                from isagi.safety.runtime import REFUSAL_TEMPLATE

                turn.category = self._category(p.h_safety)
                out.reply = "[reply withheld] " + REFUSAL_TEMPLATE.format(category=turn.category.replace("_", " "))
                yield Withheld("\n\n" + out.reply)
        turn.reply_text, turn.verdict, turn.teh_reply = out.reply, out.verdict, out.teh_reply
        turn.prompt_tokens, turn.new_tokens, turn.generated = out.prompt_tokens, out.new_tokens, True
        turn.cut = out.cut
        if out.verdict == "ok" and replacing is not None:
            # the question is not new: no metric update, the stored record gets the new reply
            reply_x = project(session.basis, out.reply_states.mean(axis=0)) if len(out.reply_states) \
                else np.zeros_like(p.x)
            session.memory.replace_reply(replacing.id, reply_x, out.reply)
            turn.cluster = int(replacing.record["cluster"])
        elif out.verdict == "ok":
            turn.cluster, turn.memory_id = self._learn(session, p, out.reply, out.reply_states, d)
        return turn

    # -- stages -----------------------------------------------------------------

    def _prepare(self, session: Session, text: str, slot: _OpenGeneration, *, alone: bool = False) -> Prepared:
        """Read the message (in its conversation first unless ``alone``, else alone; an exact
        repeat's states are reused), project, route."""
        lookup_prompt = self.prompts.build(session, text, None, with_history=False)
        key = _prompt_key(lookup_prompt)
        cached = session.cached_states(key)
        history = self.prompts.fitting_history(session, text) if cached is None else None
        read = self._read_in_conversation(text, history, slot) if history and not alone else None
        if read is not None:
            h, h_safety, n_prompt = read
        else:
            # With history the reply is decoded from another prompt (or AUGMENT's), never from this
            # one: its prefill only has to reach the captured layers. (An exact repeat prefills
            # nothing here.)
            h, h_safety, n_prompt = _prefill(slot, self.lm, lookup_prompt, self.profile.safety.read_layers, cached,
                                             states_only=bool(history))
            if cached is None:
                session.cache_states(key, h, h_safety)
        x = project(session.basis, h)
        # Zones live in the profile's coordinates; a session may carry its own basis
        # (an imported research session with another k), so route in the profile's.
        zone_x = x if session.basis is self.profile.basis else project(self.profile.basis, h)
        zone, _ = route(self.profile.zones, zone_x)
        return Prepared(text, x, h_safety, zone, session.last_user_key(), n_prompt, history,
                        in_conversation=read is not None)

    def _read_in_conversation(
        self, text: str, history: list[dict[str, str]], slot: _OpenGeneration
    ) -> tuple[np.ndarray, np.ndarray, int] | None:
        """The message read after its history by the reply's own prefill (which the reply is then
        decoded from), or None when the message must be read alone as well: its reading there is
        not :data:`CONVERSATION_MARGIN` points below the prompt guard's threshold, or its tokens
        came from a saved KV cache (a resend of the same prompt), or ``read_in_conversation`` is off.

        The probe was fitted on messages read alone, and a history moves a message's reading
        towards refusal, rarely the other way: out of fold on the calibration rows, 10 of the
        4,252 harmful rows the read alone refuses read more than the margin below the threshold
        in a conversation (docs/measurements.md, "Reading the message in its conversation
        first"). So the prompt guard's verdicts are nearly always those of the read alone, while
        most turns skip its prefill. Also read alone: a history restored with a gap cut out
        (``context_shifted``: its states are not exact), and a profile without a probe (the
        margin was measured on one). The states kept for the tier lookup and the memory are
        this reading's."""
        if not self.settings.read_in_conversation or self.profile.safety.weights is None:
            return None
        messages = self.prompts.messages(text, None, history)
        gen = slot.open(messages, reuse_prefix=REUSE_ANY, context_shift=self.settings.context_shift)
        h = gen.prefill()
        if gen.context_shifted:  # the history's cache came from a prompt with more before it: not exact
            return None
        span = self.lm.content_span(messages)
        try:
            h_safety = _safety_state(gen, self.profile.safety.read_layers, span)
        except ValueError:  # the message's tokens came from a saved KV cache: no states to read
            return None
        if self._teh(h_safety) > self.profile.safety.threshold - CONVERSATION_MARGIN:
            return None
        return h, h_safety, gen.prompt_tokens

    def _teh(self, h_safety: np.ndarray) -> float:
        from isagi.safety.runtime import teh

        return float(teh(self.profile.safety, h_safety))

    def _category(self, h_safety: np.ndarray) -> str:
        from isagi.safety.runtime import category_of

        return category_of(self.profile.safety, h_safety)

    def _guard(self, p: Prepared) -> tuple[float, Turn | None]:
        """The prompt's TEH, and the refused turn when it is over the threshold (else None)."""
        from isagi.safety.runtime import REFUSAL_TEMPLATE

        teh_prompt = self._teh(p.h_safety)
        if teh_prompt <= self.profile.safety.threshold:
            return teh_prompt, None
        category = self._category(p.h_safety)
        return teh_prompt, Turn(
            user_text=p.text, reply_text=REFUSAL_TEMPLATE.format(category=category.replace("_", " ")),
            zone=p.zone, teh_prompt=teh_prompt, verdict="refused", category=category,
            prompt_tokens=p.prompt_tokens, new_tokens=0,
        )

    def _decide(self, session: Session, text: str, x: np.ndarray, context_key: str) -> Decision:
        """Look the nearest stored exchanges up and apply the tier rule (:func:`isagi.manifold.decide.decide`)."""
        hits = session.memory.search(x, session.metric, top=RETRIEVE_CANDIDATES) if len(session.memory) else []
        candidates = [Candidate(int(h.id), float(h.distance), session.memory.get(h.id)) for h in hits]
        return decide(candidates, text, context_key, self.profile.distance_scale or SEED_SCALE, self.thresholds)

    def _generate(
        self, session: Session, text: str, d: Decision, slot: _OpenGeneration, stop: threading.Event | None,
        h_safety: np.ndarray, history: list[dict[str, str]] | None,
    ) -> Generator[TurnEvent, None, Generated]:
        """Decode the reply with the reply guard (which judges it with the message's safety state
        ``h_safety``), from the open prefill whenever the prompt is the same (no ``history``, or the
        message was read in this prompt)."""
        from isagi.safety.runtime import ReplyGuard

        if d.tier is Tier.AUGMENT:
            prompt: list[dict[str, str]] | None = self.prompts.build(session, text, d.record, history=history)
        else:
            if history is None:
                history = self.prompts.fitting_history(session, text)
            prompt = self.prompts.messages(text, None, history) if history else None
        if prompt is not None and slot.current is not None and prompt == slot.messages and not slot.states_only:
            prompt = None  # the message was read in this very prompt: decode from its prefill
        return (yield from _generate(slot, prompt, ReplyGuard(self.profile.safety, h_safety), stop,
                                     context_shift=self.settings.context_shift))

    def _learn(
        self, session: Session, p: Prepared, reply: str, reply_states: np.ndarray, d: Decision
    ) -> tuple[int, int]:
        """Metric update and memory store for a generated, accepted reply; returns its cluster and
        its memory record's id."""
        return _learn(session, p.text, reply, p.x, reply_states, d, p.context_key)

    def _record(self, session: Session, turn: Turn, *, persist: bool, replaces: bool) -> str | None:
        """The turn joins the session; the engine's ``keep`` persists it (autosave + history).

        Returns ``keep``'s notice (something had to wait, e.g. on a full disk), else None.
        Never raises: the turn has happened and stays in the session whatever the storage
        does; an unexpected failure of ``keep`` is logged and becomes such a notice.
        """
        session.add_turn(turn)
        if persist and self.keep is not None:
            try:
                # the turn takes the place of what it replaces (Regenerate, an edit): from its position on
                return self.keep(session, turn, replaces_from=len(session.turns) - 1 if replaces else None)
            except Exception as exc:  # a bug in persisting: the turn stands, the next save retries
                log.exception("could not persist a turn of session %s", session.id)
                return not_saved_notice(f"an unexpected error, {type(exc).__name__}")
        return None

    def keep_loaded(self, session: Session) -> str | None:
        """Persist a session just opened from a file under a new id (its own file, and every turn
        into the history store) with the engine's keeper, before any new turn; returns its notice
        (None: all kept, or nothing to keep). Never raises, as :meth:`_record`."""
        if self.keep is None or not session.turns:
            return None
        try:
            return self.keep.adopted(session)
        except Exception as exc:  # the session stays open in memory; its next turn saves it again
            log.exception("could not persist the loaded session %s", session.id)
            return not_saved_notice(f"an unexpected error, {type(exc).__name__}")

    # -- without generating --------------------------------------------------------

    def _coords(self, messages: list[dict[str, str]], basis: Basis) -> np.ndarray:
        from isagi.manifold.pooling import prompt_hidden_states

        with self.model_turns:
            H = prompt_hidden_states(self.lm, [messages], self.layer, batch_size=1)
        return project(basis, H[0])

    def classify(self, session: Session, message: str) -> Classification:
        """The tier a message would get, without generating or changing the session."""
        text = self.prompts.validate(message)
        x = self._coords(self.prompts.build(session, text, None, with_history=False), session.basis)
        d = self._decide(session, text, x, session.last_user_key())
        return {
            "tier": d.tier.value,
            "distance": d.distance,
            "nearest_query": d.record["query_text"] if d.record is not None else None,
            "context_dependent": d.context_dependent,
        }

    def remember(self, session: Session, message: str, reply: str) -> None:
        """Store an exchange in the session's memory as a generated turn would (for evaluations)."""
        text = self.prompts.validate(message)
        x = self._coords(self.prompts.build(session, text, None, with_history=False), session.basis)
        context_key = session.last_user_key()
        d = self._decide(session, text, x, context_key)
        cluster, memory_id = _learn(session, text, reply, x, np.zeros((0, x.shape[0])), d, context_key)
        now = time.time()
        session.add_turn(Turn(user_text=text, reply_text=reply, tier=d.tier.value, verdict="ok",
                              cluster=cluster, memory_id=memory_id, asked_at=now, answered_at=now))


def _or_put_back(
    session: Session, before: Checkpoint, undo: Checkpoint | None, events: Generator[TurnEvent, None, None]
) -> Generator[TurnEvent, None, None]:
    """``events`` of a turn that replaces others (Regenerate, an edit), passed on; if they raise, or
    are closed, before the new turn is recorded (its ``Done``), the session is put back to
    ``before`` with its ``undo``: the turns it was to replace stay. Once recorded, nothing takes it back."""
    recorded = False
    try:
        for event in events:
            recorded = recorded or isinstance(event, Done)
            yield event
    except BaseException:
        events.close()  # first: the turn undoes its own part, then the session is put back whole
        if not recorded:
            session.rollback(before)
            session.undo = undo
        raise


def _learn(
    session: Session, text: str, reply: str, x: np.ndarray, reply_states: np.ndarray, d: Decision, context_key: str
) -> tuple[int, int]:
    """The learn stage: metric update (lighter for AUGMENT) and the exchange into memory; returns
    its cluster and its memory record's id."""
    session.metric.update(x, weight=learn_weight(d.tier.value))
    if d.tier is Tier.EXPLORE or d.record is None:
        cluster = session.memory.next_cluster_id()
    else:
        cluster = int(d.record["cluster"])
    reply_x = project(session.basis, reply_states.mean(axis=0)) if len(reply_states) else np.zeros_like(x)
    memory_id = session.memory.add(
        x, reply_x, text, reply, d.tier.value, cluster,
        context_key=context_key if d.context_dependent else "",
        content_key=content_key(text),
    )
    return cluster, memory_id


def _cut_reply(session: Session) -> tuple[int, str] | None:
    """(position of the question turn, the reply so far) when the session's last turn is an
    accepted reply cut at the token limit (the question's reply and any continuations of it, all
    accepted); None otherwise."""
    turns = session.turns
    if not turns or not (turns[-1].cut and turns[-1].generated and turns[-1].accepted):
        return None
    parts: list[str] = []
    for i in range(len(turns) - 1, -1, -1):
        t = turns[i]
        if not t.accepted:
            return None
        parts.append(t.reply_text)
        if not t.continues:
            return i, "".join(reversed(parts))
    return None


def _record_of(session: Session, at: int, reply: str) -> int | None:
    """The id of the memory record holding turn ``at``'s question with ``reply``: the turn's own
    ``memory_id``, else (a regenerated answer from memory replaced another record's reply) the
    record with that question and reply; None when there is none."""
    asked = session.turns[at]
    memory = session.memory
    if asked.memory_id is not None:
        try:
            record = memory.get(asked.memory_id)
        except KeyError:
            return None
        return int(asked.memory_id) if record["reply_text"] == reply else None
    if not len(memory):
        return None
    cols = memory.to_columns()
    for rid, query, stored in zip(cols["id"], cols["query_text"], cols["reply_text"], strict=True):
        if query == asked.user_text and stored == reply:
            return int(rid)
    return None


def _prompt_key(messages: list[dict[str, str]]) -> str:
    """The exact chat (roles and texts) as a short key."""
    return hashlib.blake2b(json.dumps(messages, ensure_ascii=False).encode(), digest_size=16).hexdigest()


def _prefill(
    slot: _OpenGeneration, lm: ModelEngine, messages: list[dict[str, str]], safety_layers: list[int],
    known: tuple[np.ndarray, np.ndarray] | None, *, states_only: bool = False,
) -> tuple[np.ndarray, np.ndarray, int]:
    """Open the lookup prompt and prefill it unless its states are ``known``: (h at layer L,
    safety state, prompt tokens).

    The safety state is the read-out at each of ``safety_layers``, side by side (the profile's
    :attr:`~isagi.safety.runtime.SafetyProfile.read_layers`).

    With ``known`` states (an exact repeat: same prompt, same states) nothing runs yet: a later
    generation from this prompt prefills on demand. ``states_only``: no reply will be
    decoded from this prompt (the engine may stop after the captured layers).
    """
    span = lm.content_span(messages)
    # The tokens before the message (system prompt, template) may come from a saved KV cache:
    # the safety state is read over the message's own tokens and the template's tokens after it
    # (isagi.manifold.pooling), h at the last one.
    gen = slot.open(messages, reuse_prefix=span[0], states_only=states_only and known is None)
    if known is not None:
        return known[0], known[1], gen.prompt_tokens
    h = gen.prefill()
    return h, _safety_state(gen, safety_layers, span), gen.prompt_tokens


def _safety_state(gen: Decoding, safety_layers: list[int], span: tuple[int, int]) -> np.ndarray:
    """The safety state of the message at ``span`` of a prefilled decoding: the read-out at each
    of ``safety_layers``, side by side; ValueError when its tokens came from a saved KV cache."""
    from isagi.safety.runtime import SAFETY_POOL

    return np.concatenate([decoding_state(gen, layer, SAFETY_POOL, span) for layer in safety_layers])


def _generate(
    slot: _OpenGeneration,
    messages: list[dict[str, str]] | None,
    guard: ReplyGuard,
    stop: threading.Event | None,
    *,
    context_shift: bool = False,
    before: np.ndarray | None = None,
) -> Generator[TurnEvent, None, Generated]:
    """Decode a reply (from ``messages``, or the prompt already open), yielding its text deltas.

    ``before``: the states at the guard's layers of the reply this one continues (Continue), which the
    guard sees in front of the new ones: it judges the reply as one.

    ``context_shift``: the prompt's history may come from a saved KV cache with the exchanges the
    history window dropped cut out of it (see ``ModelEngine.generation``).

    The reply guard (:class:`isagi.safety.runtime.ReplyGuard`) checks the newest reply
    states every ``guard.every`` tokens and at the end; over its threshold the
    reply is ``withheld``. Stop (``stop`` set) ends decoding after the current
    token: ``cancelled``. Returns a :class:`Generated`.
    """
    # A prompt other than the lookup one (history, a related exchange) is only decoded from:
    # the engine may reuse the KV cache of an earlier turn's prompt and reply that it extends.
    gen = slot.open(messages, reuse_prefix=REUSE_ANY, context_shift=context_shift) if messages is not None \
        else slot.current
    assert gen is not None
    teh_reply: float | None = None
    verdict = "ok"
    checked = 0
    stream = gen.stream()
    try:
        # Stop before or during the prompt's evaluation (its first step): an empty cancelled reply
        if stop is not None and stop.is_set():
            raise PrefillStopped
        first = next(stream, None)
    except PrefillStopped:
        return Generated("", "cancelled", None, gen.reply_hidden(), gen.prompt_tokens, 0)
    for event in itertools.chain(() if first is None else (first,), stream):
        if stop is not None and stop.is_set():
            gen.stop()
        if len(gen.new_ids) - checked >= guard.every:
            checked = len(gen.new_ids)
            over, teh_reply = guard.check(_joined(before, _guard_states(gen, guard)))
            if over:
                verdict = "withheld"
                break
        if event.text:
            yield Token(event.text)
    if gen.finish_reason == "cancelled" and verdict == "ok":
        verdict = "cancelled"
    if verdict == "ok" and len(gen.new_ids) > checked:
        over, teh_reply = guard.check(_joined(before, _guard_states(gen, guard)))
        if over:
            verdict = "withheld"
    return Generated(gen.text, verdict, teh_reply, gen.reply_hidden(), gen.prompt_tokens, len(gen.new_ids),
                     cut=verdict == "ok" and gen.finish_reason == "length")


def _guard_states(gen: Decoding, guard: ReplyGuard) -> np.ndarray:
    """The newest ``guard.window`` reply states at the guard's layers, side by side
    (:attr:`ReplyGuard.layers`): all a check reads, with the Continue's ``before`` in front."""
    return np.concatenate([gen.reply_hidden(layer)[-guard.window:] for layer in guard.layers], axis=1)


def _joined(before: np.ndarray | None, states: np.ndarray) -> np.ndarray:
    return states if before is None or not len(before) else np.concatenate([before, states])


class _OpenGeneration:
    """Holds the one open :class:`~isagi.engines.base.Decoding` of a turn; opening another closes the previous."""

    def __init__(self, lm: ModelEngine, layer: int, options: GenerationOptions,
                 also_capture: tuple[int, ...] = (), stop: threading.Event | None = None) -> None:
        self.lm, self.layer, self.options = lm, layer, options
        self.also_capture = also_capture
        self.stop = stop  # the turn's Stop, which also ends a prompt's evaluation
        self.current: Decoding | None = None
        self.messages: list[dict[str, str]] | None = None
        self.states_only = False  # the open prompt's graph may stop after the captured layers: never decoded from

    def open(self, messages: list[dict[str, str]], *, reuse_prefix: int = 0, states_only: bool = False,
             context_shift: bool = False, reply_prefix: str = "") -> Decoding:
        self.close()
        self.current = self.lm.generation(messages, self.layer, self.options, also_capture=self.also_capture,
                                          reuse_prefix=reuse_prefix, states_only=states_only,
                                          context_shift=context_shift, stop=self.stop,
                                          reply_prefix=reply_prefix)
        self.current.__enter__()
        self.messages = messages
        self.states_only = states_only
        return self.current

    def close(self) -> None:
        if self.current is not None:
            current, self.current = self.current, None
            current.__exit__(None, None, None)

    def __enter__(self) -> _OpenGeneration:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_room(session: Session) -> None:
    """Refuse a turn its session's file could not hold (before any work): the
    ``.miku`` format keeps at most :data:`storage.miku.MAX_TURNS` turns, and a turn
    past them would be answered and recorded but never autosaved."""
    from isagi.storage.miku import MAX_TURNS

    if len(session.turns) >= MAX_TURNS:
        raise InputError(
            f"This session has reached {MAX_TURNS:,} turns, as many as a session file holds; "
            "start a new chat to go on (this one stays in your history)."
        )
