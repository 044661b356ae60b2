"""Sessions and the turn pipeline (DESIGN §3).

Owns :class:`Engine` (what every session shares: settings, the model, the
per-model profile, the history store, and a lock that serialises generation
on one device) and :class:`Session` (one conversation's living state: its
messages, its metric M, its trajectory memory). A Session is never shared.

One turn, in order: validate the message; prefill [system, message] once and
capture h at layer L and the safety layer's state (the same forward pass; an
exact repeat of a prompt already seen in this session reuses its states, a
deterministic function of the prompt, and skips this prefill); project to UGT coordinates; TEH on the prompt (refuse
without generating); two-stage lookup under the session's metric; tier;
RETRIEVE returns the stored reply (only after the exact sameness check),
otherwise decode from the prefill's KV cache with the streaming reply guard;
update the metric and memory; record the turn and autosave the ``.miku``.

The lookup embedding is the query *alone* (system prompt + message), so a
repeated question is recognised whatever came before it. Context is handled by
a separate, exact check: a message that needs its conversation to be
understood ("And Germany?", see :func:`isagi.sameness.depends_on_context`) is
stored with the key of the message before it, and is only answered from
memory under that same context. (Measured first: the hidden-state shift
between a message alone and in context does not separate follow-ups from
self-contained questions on SmolLM2-135M; the profile report keeps that
measurement under "context".)
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
import unicodedata
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from isagi.cog import Metric, Tier, TierThresholds
from isagi.config import Settings
from isagi.distance_scale import SEED as SEED_SCALE
from isagi.engines.base import Decoding, GenerationOptions
from isagi.errors import InputError
from isagi.ids import new_session_id
from isagi.memory import TrajectoryMemory
from isagi.sameness import content_key, depends_on_context
from isagi.ugt import Basis, project, route

LIGHT_UPDATE = 0.25  # AUGMENT's metric update weight, relative to a full update
RETRIEVE_CANDIDATES = 8  # nearest records checked for an exact match before RETRIEVE
PROMPT_STATE_CACHE = 256  # exact lookup prompts whose states a session keeps (~5 KB each at d=576)


@dataclass
class TurnResult:
    """What a turn did, for the UI, the history store and the tests."""

    reply: str
    tier: str | None
    distance: float | None
    nearest_query: str | None
    zone: str | None
    teh_prompt: float | None
    teh_reply: float | None
    verdict: str  # ok | refused | withheld | cancelled
    latency_s: float
    prompt_tokens: int
    new_tokens: int
    metric_growth: float
    generated: bool
    category: str | None = None
    context_dependent: bool = False
    cluster: int | None = None


@dataclass
class TurnEvent:
    """A streamed piece of a turn: the decision, a text delta, or the final result."""

    kind: str  # "decision" | "token" | "done"
    text: str = ""
    tier: str | None = None
    distance: float | None = None
    result: TurnResult | None = None


@dataclass
class Session:
    """One conversation's living state. Never shared between users."""

    id: str
    basis: Basis
    metric: Metric
    memory: TrajectoryMemory
    messages: list[dict[str, Any]] = field(default_factory=list)
    created: float = field(default_factory=time.time)
    title: str | None = None
    miku_path: Path | None = None
    # Prompt states already computed in this session, keyed by the exact lookup
    # prompt: an exact repeat skips its prefill (the states are a deterministic
    # function of the prompt). Derived data: never saved, never shared.
    prompt_states: OrderedDict[str, tuple[np.ndarray, np.ndarray]] = field(
        default_factory=OrderedDict, repr=False, compare=False
    )

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
    def turns(self) -> int:
        return sum(1 for m in self.messages if m["role"] == "user")

    def recent_exchanges(self) -> Iterator[list[dict[str, str]]]:
        """Earlier exchanges that may enter a prompt, newest first, as chat message pairs.

        Only accepted replies (verdict ``ok``, non-empty) with their user message:
        refused, withheld and cancelled (Stop) turns never enter a later prompt,
        or a stopped story would be continued by the next question. Walks from
        the end, so a caller that stops early never reads the whole session.
        """
        reply: dict[str, Any] | None = None
        for m in reversed(self.messages):
            if m.get("role") == "assistant":
                reply = m
            elif m.get("role") == "user" and reply is not None:
                if (reply.get("verdict") or "ok") == "ok" and reply.get("text"):
                    yield [
                        {"role": "user", "content": str(m.get("text", ""))},
                        {"role": "assistant", "content": str(reply["text"])},
                    ]
                reply = None

    def chat_history(self) -> list[dict[str, str]]:
        """Every accepted earlier exchange as chat messages, oldest first (no budget)."""
        return [m for exchange in reversed(list(self.recent_exchanges())) for m in exchange]

    def last_user_key(self) -> str:
        for m in reversed(self.messages):
            if m["role"] == "user":
                return content_key(m["text"])
        return ""


class Engine:
    """What all sessions share: settings, model, profile, history store."""

    def __init__(self, settings: Settings, lm: Any, profile: Any, store: Any = None) -> None:
        self.settings = settings
        self.lm = lm
        self.profile = profile
        self.store = store
        self.thresholds = TierThresholds()
        self.generation_lock = threading.Lock()

    @classmethod
    def start(cls, settings: Settings, *, with_store: bool = True, progress: Any = None) -> Engine:
        """Load the model and its profile (calibrating on first use) and open the history store."""
        from isagi.engines import load_engine
        from isagi.profile import load_or_build_profile

        lm = load_engine(settings)
        profile = load_or_build_profile(lm, settings, progress=progress)
        store = None
        if with_store:
            from storage.history import HistoryStore

            store = HistoryStore(settings.resolved_database_url)
        return cls(settings, lm, profile, store)

    @property
    def layer(self) -> int:
        return self.profile.layer

    def new_session(self, session_id: str | None = None, *, autosave: bool = True) -> Session:
        k = int(self.profile.basis.B.shape[1])
        sid = session_id or new_session_id()
        session = Session(id=sid, basis=self.profile.basis, metric=Metric(k), memory=TrajectoryMemory(k))
        if autosave:
            session.miku_path = self.settings.sessions_dir / f"{sid}.miku"
        return session

    # -- the turn -------------------------------------------------------------

    def validate(self, message: str) -> str:
        """The message as the turn uses it, or an :class:`InputError` saying what to change.

        Rejects undecodable text (lone surrogates, e.g. invalid UTF-8 on stdin),
        messages with nothing but control, format or blank characters, and messages
        over the character limit, the token limit, or the prompt budget on their own.
        Control characters other than newline and tab are removed from the rest.
        """
        text = clean_message(message)
        limit = self.settings.max_message_chars
        if len(text) > limit:
            raise InputError(
                f"The message has {len(text):,} characters; the limit is {limit:,}. "
                "Shorten it or split it into several messages."
            )
        n = count_tokens(self.lm, text)
        token_limit = self.settings.max_message_tokens
        if n > token_limit:
            raise InputError(
                f"The message is {n:,} tokens long; the limit is {token_limit:,} tokens. "
                "Shorten it or split it into several messages."
            )
        alone = prompt_tokens(self.lm, prompt_messages(self.settings.system_prompt, text))
        budget = prompt_budget(self.settings, self.lm)
        if alone > budget:
            raise InputError(
                f"The message and the system prompt take {alone:,} tokens; the prompt budget is {budget:,} "
                f"({self.settings.max_new_tokens:,} tokens are kept for the reply). Shorten the message."
            )
        return text

    # -- token accounting ------------------------------------------------------

    @property
    def prompt_budget(self) -> int:
        """Tokens a prompt may take (see :func:`prompt_budget`)."""
        return prompt_budget(self.settings, self.lm)

    def count_tokens(self, text: str) -> int:
        return count_tokens(self.lm, text)

    def prompt_tokens(self, messages: list[dict[str, str]]) -> int:
        return prompt_tokens(self.lm, messages)

    def _prompt(
        self, session: Session, text: str, related: dict[str, Any] | None, *, with_history: bool = True
    ) -> list[dict[str, str]]:
        """The chat for the model: system prompt, a related exchange (AUGMENT), history, message.

        History is the most recent accepted exchanges that fit :attr:`prompt_budget`
        with everything else (whole exchanges, dropped oldest first); older turns stay
        in the session, only not in the prompt.
        """
        if related is not None and self.prompt_tokens(self._prompt_messages(text, related, [])) > self.prompt_budget:
            related = None  # the related exchange does not fit beside the message: answer without it
        history = self.fitting_history(session, text, related) if with_history else []
        return self._prompt_messages(text, related, history)

    def _prompt_messages(
        self, text: str, related: dict[str, Any] | None, history: list[dict[str, str]]
    ) -> list[dict[str, str]]:
        return prompt_messages(self.settings.system_prompt, text, related, history)

    def fitting_history(
        self, session: Session, text: str, related: dict[str, Any] | None = None
    ) -> list[dict[str, str]]:
        """The newest exchanges of ``session`` that fit the budget beside the rest of the prompt."""
        base = self._prompt_messages(text, related, [])
        left = self.prompt_budget - self.prompt_tokens(base)
        bare = self.prompt_tokens([base[0], base[-1]])
        kept: list[list[dict[str, str]]] = []
        for exchange in session.recent_exchanges():
            # An exchange's cost in the template: the same chat with and without it.
            cost = self.prompt_tokens([base[0], *exchange, base[-1]]) - bare
            if cost > left:
                break
            left -= cost
            kept.append(exchange)
        history = [m for exchange in reversed(kept) for m in exchange]
        # Per-exchange costs add up exactly for concatenating templates; check the whole.
        while kept and self.prompt_tokens(self._prompt_messages(text, related, history)) > self.prompt_budget:
            kept.pop()
            history = [m for exchange in reversed(kept) for m in exchange]
        return history

    def turn(self, session: Session, message: str, **kwargs: Any) -> TurnResult:
        """Run a whole turn and return its result (no streaming)."""
        result = None
        for event in self.stream_turn(session, message, **kwargs):
            if event.kind == "done":
                result = event.result
        assert result is not None
        return result

    def stream_turn(
        self,
        session: Session,
        message: str,
        *,
        options: GenerationOptions | None = None,
        stop: threading.Event | None = None,
        record: bool = True,
    ) -> Iterator[TurnEvent]:
        """Run one turn, yielding the decision, the reply's text deltas, then the result."""
        text = self.validate(message)
        started = time.perf_counter()
        options = options or GenerationOptions(max_new_tokens=self.settings.max_new_tokens)
        with self.generation_lock:
            result = yield from self._turn_locked(session, text, options, stop, started)
        session.messages.append({"role": "user", "text": text, "time": time.time()})
        session.messages.append(
            {
                "role": "assistant",
                "text": result.reply,
                "time": time.time(),
                "tier": result.tier,
                "distance": result.distance,
                "nearest_query": result.nearest_query,
                "zone": result.zone,
                "teh_prompt": result.teh_prompt,
                "teh_reply": result.teh_reply,
                "verdict": result.verdict,
                "latency_s": result.latency_s,
                "new_tokens": result.new_tokens,
                "metric_growth": result.metric_growth,
            }
        )
        if session.title is None:
            session.title = text[:80]
        if record:
            self._record(session, text, result)
        yield TurnEvent("done", result=result)

    def _turn_locked(
        self,
        session: Session,
        text: str,
        options: GenerationOptions,
        stop: threading.Event | None,
        started: float,
    ) -> Iterator[TurnEvent]:
        from isagi.safety import REFUSAL_TEMPLATE, ReplyGuard, category_of, teh

        lm, safety = self.lm, self.profile.safety
        history = self.fitting_history(session, text)
        context_key = session.last_user_key()

        def finish(reply: str, **kw: Any) -> TurnResult:
            base: dict[str, Any] = dict(
                reply=reply, tier=None, distance=None, nearest_query=None, zone=None,
                teh_prompt=None, teh_reply=None, verdict="ok", prompt_tokens=0, new_tokens=0,
                metric_growth=session.metric.growth, generated=False,
            )
            base.update(kw)
            return TurnResult(latency_s=time.perf_counter() - started, **base)

        # At most one Generation (and so one capture hook) is open at a time.
        # The safety layer's states come from the same forward passes (one more hook).
        with _OpenGeneration(lm, self.layer, options, also_capture=(safety.layer,)) as slot:
            lookup_prompt = self._prompt(session, text, None, with_history=False)
            gen = slot.open(lookup_prompt)
            key = _prompt_key(lookup_prompt)
            cached = session.cached_states(key)
            if cached is None:
                h = gen.prefill()
                h_safety = gen.prompt_state(safety.layer, span=lm.content_span(lookup_prompt))
                session.cache_states(key, h, h_safety)
            else:  # an exact repeat: same prompt, same states; a generation prefills on demand
                h, h_safety = cached
            x = project(session.basis, h)
            zone, _ = route(self.profile.zones, x)
            teh_prompt = float(teh(safety, h_safety))
            if teh_prompt > safety.threshold:
                category = category_of(safety, h_safety)
                reply = REFUSAL_TEMPLATE.format(category=category.replace("_", " "))
                yield TurnEvent("decision", tier=None)
                yield TurnEvent("token", text=reply)
                return finish(reply, zone=zone, teh_prompt=teh_prompt, verdict="refused",
                              category=category, prompt_tokens=gen.prompt_tokens)

            tier, record, hit, distance, dependent = self._decide(session, text, x)
            yield TurnEvent("decision", tier=tier.value, distance=distance if record else None)
            nearest = record["query_text"] if record is not None else None
            common = dict(tier=tier.value, distance=distance if record is not None else None,
                          nearest_query=nearest, zone=zone, teh_prompt=teh_prompt,
                          context_dependent=dependent)
            if tier is Tier.RETRIEVE:
                session.memory.record_hit(hit.id)
                reply = record["reply_text"]
                yield TurnEvent("token", text=reply)
                return finish(reply, prompt_tokens=gen.prompt_tokens, cluster=int(record["cluster"]), **common)

            # Generate, from a prefill already computed whenever the prompt is the same one.
            if tier is Tier.AUGMENT:
                gen = slot.open(self._prompt(session, text, record))
            elif history:
                gen = slot.open(self._prompt_messages(text, None, history))
            else:
                gen = slot.current
            guard = ReplyGuard(safety)
            teh_reply: float | None = None
            verdict = "ok"
            checked = 0
            for event in gen.stream():
                if stop is not None and stop.is_set():
                    gen.stop()
                if len(gen.new_ids) - checked >= guard.every:
                    checked = len(gen.new_ids)
                    over, teh_reply = guard.check(gen.reply_hidden(safety.layer))
                    if over:
                        verdict = "withheld"
                        break
                if event.text:
                    yield TurnEvent("token", text=event.text)
            if gen.finish_reason == "cancelled" and verdict == "ok":
                verdict = "cancelled"
            reply = gen.text
            if verdict == "ok" and len(gen.new_ids) > checked:
                over, teh_reply = guard.check(gen.reply_hidden(safety.layer))
                if over:
                    verdict = "withheld"
            if verdict == "withheld":
                category = category_of(safety, h_safety)
                reply = "[reply withheld] " + REFUSAL_TEMPLATE.format(category=category.replace("_", " "))
                yield TurnEvent("token", text="\n\n" + reply)
            reply_states = gen.reply_hidden()
            prompt_tokens, new_tokens = gen.prompt_tokens, len(gen.new_ids)

        cluster = None
        if verdict == "ok":
            cluster = self._learn(session, text, reply, x, reply_states, tier, record, context_key, dependent)
        return finish(reply, teh_reply=teh_reply, verdict=verdict, prompt_tokens=prompt_tokens,
                      new_tokens=new_tokens, generated=True, cluster=cluster, **common)

    def _decide(
        self, session: Session, text: str, x: np.ndarray
    ) -> tuple[Tier, dict[str, Any] | None, Any, float, bool]:
        """Lookup, tier, and the exact checks: (tier, record, hit, distance, context dependent).

        RETRIEVE needs the exact sameness check (same content words, same
        context where the message depends on it) on one of the nearest
        records, within the profile's retrieve cap. Otherwise the nearest
        record's rescaled distance gives AUGMENT, EXPAND or EXPLORE.
        """
        dependent = depends_on_context(text)
        hits = session.memory.search(x, session.metric, top=RETRIEVE_CANDIDATES) if len(session.memory) else []
        if not hits:
            return Tier.EXPLORE, None, None, 1.0, dependent
        scale = self.profile.distance_scale or SEED_SCALE
        context_key = session.last_user_key()
        for hit in hits:
            record = session.memory.get(hit.id)
            if hit.distance <= scale.retrieve_cap and self._same_question(text, record, context_key, dependent):
                return Tier.RETRIEVE, record, hit, float(hit.distance), dependent
        hit = hits[0]
        record = session.memory.get(hit.id)
        distance = float(hit.distance)
        tier = self.thresholds.classify(scale.rescale(distance))
        if tier is Tier.RETRIEVE:
            tier = Tier.AUGMENT  # close, but not the same question: a near miss
        return tier, record, hit, distance, dependent

    def _coords(self, messages: list[dict[str, str]], basis: Basis) -> np.ndarray:
        from isagi.pooling import prompt_hidden_states

        with self.generation_lock:
            H = prompt_hidden_states(self.lm, [messages], self.layer, batch_size=1)
        return project(basis, H[0])

    def classify(self, session: Session, message: str) -> dict[str, Any]:
        """The tier a message would get, without generating or changing the session."""
        text = self.validate(message)
        x = self._coords(self._prompt(session, text, None, with_history=False), session.basis)
        tier, record, _hit, distance, dependent = self._decide(session, text, x)
        return {
            "tier": tier.value,
            "distance": distance if record is not None else None,
            "nearest_query": record["query_text"] if record is not None else None,
            "context_dependent": dependent,
        }

    def remember(self, session: Session, message: str, reply: str) -> None:
        """Store an exchange in the session's memory as a generated turn would (for evaluations)."""
        text = self.validate(message)
        x = self._coords(self._prompt(session, text, None, with_history=False), session.basis)
        tier, record, _hit, _d, dependent = self._decide(session, text, x)
        context_key = session.last_user_key()
        self._learn(session, text, reply, x, np.zeros((0, x.shape[0])), tier, record, context_key, dependent)
        session.messages.append({"role": "user", "text": text, "time": time.time()})
        session.messages.append({"role": "assistant", "text": reply, "time": time.time(), "tier": tier.value, "verdict": "ok"})

    @staticmethod
    def _same_question(text: str, record: dict[str, Any] | None, context_key: str, dependent: bool) -> bool:
        """The exact check before RETRIEVE: same content words, and the same context if it matters."""
        if record is None or content_key(text) != record["content_key"]:
            return False
        if dependent or record["context_key"]:
            # A context-dependent question is stored with the key of its context.
            return record["context_key"] == context_key
        return True

    def _learn(
        self,
        session: Session,
        text: str,
        reply: str,
        x: np.ndarray,
        reply_states: np.ndarray,
        tier: Tier,
        related: dict[str, Any] | None,
        context_key: str,
        dependent: bool,
    ) -> int:
        """Metric update and memory store for a generated, accepted reply."""
        weight = LIGHT_UPDATE if tier is Tier.AUGMENT else 1.0
        session.metric.update(x, weight=weight)
        if tier is Tier.EXPLORE or related is None:
            cluster = session.memory.next_cluster_id()
        else:
            cluster = int(related["cluster"])
        if len(reply_states):
            reply_x = project(session.basis, reply_states.mean(axis=0))
        else:
            reply_x = np.zeros_like(x)
        session.memory.add(
            x, reply_x, text, reply, tier.value, cluster,
            context_key=context_key if dependent else "",
            content_key=content_key(text),
        )
        return cluster

    def _record(self, session: Session, text: str, result: TurnResult) -> None:
        """History row and autosave; failures here never lose the turn in memory."""
        if self.store is not None:
            from storage.history import TurnRecord

            self.store.ensure_session(session.id, model_id=self.lm.model_id, title=session.title)
            self.store.record_turn(
                session.id,
                TurnRecord(
                    user_text=text, reply_text=result.reply, tier=result.tier, distance=result.distance,
                    nearest_query=result.nearest_query, zone=result.zone, teh_prompt=result.teh_prompt,
                    teh_reply=result.teh_reply, verdict=result.verdict, latency_s=result.latency_s,
                    prompt_tokens=result.prompt_tokens, new_tokens=result.new_tokens,
                    metric_growth=result.metric_growth,
                ),
            )
        if session.miku_path is not None:
            from isagi.session_io import save_session

            save_session(self, session, session.miku_path)
            if self.store is not None:
                self.store.set_miku_path(session.id, str(session.miku_path))


def clean_message(message: str | None) -> str:
    """A message with control characters removed, or an :class:`InputError`.

    Lone surrogates (undecodable input) are refused rather than repaired, so
    nothing the user typed is silently changed; NUL and other control
    characters except newline and tab are removed; a message with nothing
    left but blank or invisible (format) characters is empty.
    """
    raw = message or ""
    if any(0xD800 <= ord(c) <= 0xDFFF for c in raw):
        raise InputError(
            "The message contains bytes that are not valid text (e.g. invalid UTF-8); "
            "send it as UTF-8 text."
        )
    text = "".join(c for c in raw if c in "\n\t" or unicodedata.category(c) != "Cc").strip()
    if not any(not c.isspace() and unicodedata.category(c) not in ("Cf", "Zs", "Zl", "Zp") for c in text):
        raise InputError("The message is empty: type a question or a request first.")
    return text


def prompt_messages(
    system: str, text: str, related: dict[str, Any] | None = None, history: list[dict[str, str]] | None = None
) -> list[dict[str, str]]:
    """The chat for the model: system prompt, a related exchange, history, then the message."""
    msgs = [{"role": "system", "content": system}]
    if related is not None:
        msgs += [
            {"role": "user", "content": related["query_text"]},
            {"role": "assistant", "content": related["reply_text"]},
        ]
    msgs += history or []
    msgs.append({"role": "user", "content": text})
    return msgs


def count_tokens(lm: Any, text: str) -> int:
    """Tokens of ``text`` alone under the model's tokenizer (no template, no special tokens)."""
    return int(lm.count_tokens(text))


def prompt_tokens(lm: Any, messages: list[dict[str, str]]) -> int:
    """Exact tokens of a chat in the model's template, ready to answer."""
    return len(lm.chat_tokens(messages))


def prompt_budget(settings: Settings, lm: Any) -> int:
    """Tokens a prompt may take: the setting, capped at the model's context minus the reply's tokens."""
    budget = settings.prompt_token_budget
    context = model_context(lm)
    if context is not None:
        budget = min(budget, context - settings.max_new_tokens)
    return max(budget, 1)


def model_context(lm: Any) -> int | None:
    """The model's context length in tokens, when the engine knows one."""
    n = getattr(lm, "context_length", None)
    return int(n) if isinstance(n, int) and n > 0 else None


def _prompt_key(messages: list[dict[str, str]]) -> str:
    """The exact chat (roles and texts) as a short key."""
    return hashlib.blake2b(json.dumps(messages, ensure_ascii=False).encode(), digest_size=16).hexdigest()


class _OpenGeneration:
    """Holds the one open :class:`~isagi.engines.base.Decoding` of a turn; opening another closes the previous."""

    def __init__(self, lm: Any, layer: int, options: GenerationOptions, also_capture: tuple[int, ...] = ()) -> None:
        self.lm, self.layer, self.options = lm, layer, options
        self.also_capture = also_capture
        self.current: Decoding | None = None
        self.messages: list[dict[str, str]] | None = None

    def open(self, messages: list[dict[str, str]]) -> Decoding:
        self.close()
        self.current = self.lm.generation(messages, self.layer, self.options, also_capture=self.also_capture)
        self.current.__enter__()
        self.messages = messages
        return self.current

    def close(self) -> None:
        if self.current is not None:
            current, self.current = self.current, None
            current.__exit__(None, None, None)

    def __enter__(self) -> _OpenGeneration:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
