"""A fake engine for the web app's fast tests (no model): real Session, Metric and
TrajectoryMemory, real ``.miku`` save/load, a scripted token stream.

It follows the :class:`isagi.agent.Engine` contract the app relies on:
``validate``, ``new_session``, ``stream_turn`` (decision, tokens, done; the
generation lock held; ``stop`` honoured between tokens; the exchange appended
to ``session.messages``; autosave to ``session.miku_path``), ``settings``,
``lm``, ``profile``, ``store``. A repeated question (same text) is RETRIEVE.
"""

from __future__ import annotations

import hashlib
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from isagi.agent import Engine, Session, TurnEvent, TurnResult
from isagi.cog import Metric
from isagi.config import Settings
from isagi.memory import TrajectoryMemory
from isagi.ugt import Basis

D, K = 16, 8


class FakeTokenizer:
    """One token per UTF-8 byte: enough for the engine's token limits and budget."""

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": list(text.encode("utf-8"))}


@dataclass
class FakeLM:
    model_id: str = "fake/echo-model"
    fingerprint: str = "fake-fingerprint-1"
    hidden_size: int = D
    quant: str = "none"
    device: str = "cpu"
    tokenizer: FakeTokenizer = field(default_factory=FakeTokenizer)

    def chat_ids(self, messages: list[dict[str, str]]) -> np.ndarray:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        return np.asarray([list(text.encode("utf-8"))])


@dataclass
class FakeSafety:
    threshold: float = 50.0
    reply_threshold: float = 50.0


@dataclass
class FakeProfile:
    basis: Basis
    key: str = "fake-profile"
    layer: int = 3
    safety: FakeSafety = field(default_factory=FakeSafety)


def _vec(text: str) -> np.ndarray:
    seed = int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little")
    return np.random.default_rng(seed).standard_normal(K).astype(np.float32)


class FakeEngine:
    """See the module docstring. ``token_delay`` slows the stream (for Stop tests)."""

    def __init__(self, settings: Settings, *, token_delay: float = 0.0, store: Any = None) -> None:
        self.settings = settings
        self.lm = FakeLM()
        rng = np.random.default_rng(0)
        q, _ = np.linalg.qr(rng.standard_normal((D, K)))
        basis = Basis(B=q.astype(np.float32), mu=np.zeros(D, np.float32),
                      singular_values=np.linspace(2, 1, K).astype(np.float32), explained=0.5)
        self.profile = FakeProfile(basis=basis)
        self.store = store
        self.generation_lock = threading.Lock()
        self.token_delay = token_delay
        self.turns_run = 0

    @property
    def layer(self) -> int:
        return self.profile.layer

    def validate(self, message: str) -> str:
        return Engine.validate(self, message)  # the real rule: empty / over the limit

    def new_session(self, session_id: str | None = None, *, autosave: bool = True) -> Session:
        sid = session_id or uuid.uuid4().hex[:12]
        s = Session(id=sid, basis=self.profile.basis, metric=Metric(K), memory=TrajectoryMemory(K))
        if autosave:
            s.miku_path = self.settings.sessions_dir / f"{sid}.miku"
        return s

    def stream_turn(self, session: Session, message: str, *, options: Any = None,
                    stop: threading.Event | None = None, record: bool = True):
        text = self.validate(message)
        started = time.perf_counter()
        max_new = getattr(options, "max_new_tokens", 64) if options is not None else 64
        with self.generation_lock:
            self.turns_run += 1
            x = _vec(text)
            hit = None
            if len(session.memory):
                hit = session.memory.search(x, session.metric, top=1)[0]
            record_ = session.memory.get(hit.id) if hit else None
            same = record_ is not None and record_["query_text"] == text
            tier = "RETRIEVE" if same else ("EXPAND" if record_ is not None else "EXPLORE")
            distance = float(hit.distance) if hit else None
            yield TurnEvent("decision", tier=tier, distance=distance)
            verdict, new = "ok", 0
            if same:
                reply = record_["reply_text"]
                yield TurnEvent("token", text=reply)
            else:
                words = [f"w{i}" for i in range(max_new)]
                parts: list[str] = []
                for w in words:
                    if stop is not None and stop.is_set():
                        verdict = "cancelled"
                        break
                    if self.token_delay:
                        time.sleep(self.token_delay)
                    piece = ("" if not parts else " ") + w
                    parts.append(piece)
                    new += 1
                    yield TurnEvent("token", text=piece)
                reply = "".join(parts)
                if verdict == "ok":
                    session.metric.update(x)
                    cluster = session.memory.next_cluster_id()
                    session.memory.add(x, x, text, reply, tier, cluster)
            result = TurnResult(
                reply=reply, tier=tier, distance=distance,
                nearest_query=record_["query_text"] if record_ else None, zone="science",
                teh_prompt=1.0, teh_reply=None if same else 2.0, verdict=verdict,
                latency_s=time.perf_counter() - started, prompt_tokens=5, new_tokens=new,
                metric_growth=session.metric.growth, generated=not same,
            )
        session.messages.append({"role": "user", "text": text, "time": time.time()})
        session.messages.append({"role": "assistant", "text": reply, "tier": tier, "distance": distance,
                                 "nearest_query": result.nearest_query, "zone": "science",
                                 "teh_prompt": 1.0, "teh_reply": result.teh_reply, "verdict": verdict,
                                 "latency_s": result.latency_s, "new_tokens": new,
                                 "metric_growth": result.metric_growth})
        if session.title is None:
            session.title = text[:80]
        if record:
            Engine._record(self, session, text, result)  # the real rule: history row (owner) + autosave
        yield TurnEvent("done", result=result)
