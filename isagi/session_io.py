"""Mapping between a live :class:`~isagi.agent.Session` and a ``.miku`` v2 file.

Owns what a session file holds: the conversation log, the metric M, the
trajectory memory as columns, and the session's own UGT basis (so a session
restores exactly even if the model's profile is recalibrated later). The file
format itself (validation, checksums, atomic writes) is ``storage.miku``'s.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from isagi import __version__
from isagi.cog import Metric
from isagi.errors import MikuError
from isagi.memory import TrajectoryMemory
from isagi.ugt import Basis

if TYPE_CHECKING:
    from isagi.agent import Engine, Session

FORMAT_VERSION = 2


def session_state(engine: Engine, session: Session) -> Any:
    """The session as a :class:`storage.miku.MikuState`."""
    from storage.miku import MikuState

    b = session.basis
    metric_state = session.metric.to_state()
    tensors = {
        "metric": np.asarray(session.metric.M, dtype=np.float64),
        "basis": np.asarray(b.B, dtype=np.float32),
        "mu": np.asarray(b.mu, dtype=np.float32),
        "singular_values": np.asarray(b.singular_values, dtype=np.float32),
    }
    extra: dict[str, Any] = {
        "session_id": session.id,
        "title": session.title or "",
        "profile_key": engine.profile.key,
        "basis_explained": float(b.explained),
        "metric": {k: v for k, v in metric_state.items() if not isinstance(v, np.ndarray)},
        "system_prompt": engine.settings.system_prompt,
    }
    header = {
        "format_version": FORMAT_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(session.created)),
        "isagi_version": __version__,
        "model_id": engine.lm.model_id,
        "model_fingerprint": engine.lm.fingerprint,
        "d": int(b.B.shape[0]),
        "k": int(b.B.shape[1]),
        "layer": int(engine.profile.layer),
    }
    conversation = [
        {k: v for k, v in m.items() if v is None or isinstance(v, str | int | float | bool)}
        for m in session.messages
    ]
    return MikuState(
        header=header,
        tensors=tensors,
        trajectories=session.memory.to_columns(),
        conversation=conversation,
        extra=extra,
    )


def save_session(engine: Engine, session: Session, path: Path) -> None:
    """Write the session atomically to ``path`` (parent directories are created)."""
    from storage.miku import write_miku

    path.parent.mkdir(parents=True, exist_ok=True)
    write_miku(path, session_state(engine, session))


def load_session(engine: Engine, path: Path, *, allow_other_model: bool = False) -> Session:
    """Restore a session from ``path``; raise :class:`MikuError` if it does not fit this engine."""
    from isagi.agent import Session
    from storage.miku import read_miku

    state = read_miku(
        path, expected_fingerprint=engine.lm.fingerprint, allow_other_model=allow_other_model
    )
    header, tensors, extra = state.header, state.tensors, state.extra
    for name in ("metric", "basis", "mu", "singular_values"):
        if name not in tensors:
            raise MikuError(f"{path}: the session file has no {name!r} tensor; it is not an ISAGI session.")
    k, d = int(header["k"]), int(header["d"])
    if d != engine.lm.hidden_size:
        raise MikuError(
            f"{path}: the session was made with hidden size {d}, this model has "
            f"{engine.lm.hidden_size}; load it with the model it was saved with."
        )
    if tensors["basis"].shape != (d, k) or tensors["metric"].shape != (k, k):
        raise MikuError(f"{path}: basis or metric shape does not match d={d}, k={k}.")
    basis = Basis(
        B=tensors["basis"],
        mu=tensors["mu"],
        singular_values=tensors["singular_values"],
        explained=float(extra.get("basis_explained", 0.0)),
    )
    metric_state: dict[str, Any] = dict(extra.get("metric", {}))
    metric_state["M"] = tensors["metric"]
    try:
        metric = Metric.from_state(metric_state)
        memory = TrajectoryMemory.from_columns(state.trajectories, k)
    except (KeyError, ValueError, TypeError) as exc:
        raise MikuError(f"{path}: the trajectories or the metric are inconsistent ({exc}).") from exc
    created = time.time()
    session = Session(
        id=str(extra.get("session_id") or path.stem),
        basis=basis,
        metric=metric,
        memory=memory,
        messages=state.conversation,  # fresh dicts from the reader, owned by nobody else
        created=created,
        title=str(extra.get("title") or "") or None,
    )
    return session
