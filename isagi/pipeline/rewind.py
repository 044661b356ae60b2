"""Rolling a session back to before one of its turns: what an edited message needs.

Owns :func:`rewind`. An edited message is resent in place of the original: the conversation
is cut at that message, and the session's manifold must not keep the exchanges the user edited
away (otherwise the old question would still be answered from memory, and M would still lean
towards it). So the turns from position ``n`` on leave the session, the memory records they
stored leave its memory, and the metric M is rebuilt by replaying, oldest first, the update each
remaining record made when it was learned (:func:`~isagi.manifold.cog.learn_weight` of its
tier, as the learn stage does). On a session that began at the identity and has evicted nothing,
that replay is the metric the session had before turn ``n`` (up to float32 rounding of the
stored coordinates); after evictions it is the metric of what the memory still holds.

Which records a turn stored: its ``memory_id``. Records are numbered in the order they were
stored, so every record from the first dropped turn's id on came from a dropped turn. A turn read
from a file older than that field has none; then the records created when or after the first
dropped turn was asked are dropped.
"""

from __future__ import annotations

import numpy as np

from isagi.manifold.cog import Metric, learn_weight
from isagi.session.state import Session


def rewind(session: Session, n: int) -> int:
    """Cut ``session`` back to its first ``n`` turns, memory and metric included; returns how many
    memory records were dropped. ``session.undo`` is cleared (the turn it would restore is gone).
    Raises ``ValueError`` for a position outside ``0..len(turns)``."""
    if not 0 <= n <= len(session.turns):
        raise ValueError(f"a session of {len(session.turns)} turns cannot be cut at turn {n}")
    dropped = session.turns[n:]
    cols = session.memory.to_columns()
    ids = np.asarray(cols["id"])
    keep = np.ones(ids.shape[0], dtype=bool)
    stored = [t.memory_id for t in dropped if t.memory_id is not None]
    if stored:
        keep &= ids < min(stored)
    elif any(t.generated and t.verdict == "ok" and t.asked_at is not None for t in dropped):
        asked = min(t.asked_at for t in dropped if t.asked_at is not None)  # an older file: by time
        keep &= np.asarray(cols["created"]) < asked
    session.turns[:] = session.turns[:n]
    session.versions = {i: v for i, v in session.versions.items() if i < n}
    session.undo = None
    session.version += 1
    gone = int((~keep).sum())
    if not gone:
        return 0
    kept = {name: (np.asarray(v)[keep] if isinstance(v, np.ndarray) else [x for x, k in zip(v, keep, strict=True) if k])
            for name, v in cols.items()}
    memory, metric = session.memory, session.metric
    session.memory = type(memory).from_columns(kept, memory.k, cap=memory.cap)
    replayed = Metric(metric.k, eta=metric.eta, eig_floor=metric.eig_floor, window=metric.window or 1000)
    for x, tier in zip(np.asarray(kept["query_x"]), kept["tier"], strict=True):
        replayed.update(np.asarray(x, dtype=np.float64), weight=learn_weight(str(tier)))
    session.metric = replayed
    return gone
