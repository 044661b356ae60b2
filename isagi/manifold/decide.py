"""The tier rule of a turn (docs/architecture.md, One turn, step 6): a pure function, testable without a model.

Owns :func:`decide`: given the session memory's nearest records to the
message (the *candidates*, nearest first, with their metric distances), the
message, and the key of the message before it (its context), which tier the
turn gets and which stored exchange it leans on. Nothing here touches a
model, a session or a clock; :class:`isagi.pipeline.engine.Engine` looks the candidates
up and acts on the :class:`Decision`.

The rule: RETRIEVE needs the exact sameness check (same content words, and
the same context where the message depends on it or the record was stored
with one) on one of the candidates within the distance scale's
``retrieve_cap``; otherwise the nearest candidate's rescaled distance gives
AUGMENT, EXPAND or EXPLORE (a rescaled distance in RETRIEVE's band without
the exact match is a near miss: AUGMENT). An empty memory is EXPLORE.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from isagi.manifold.cog import Tier, TierThresholds
from isagi.manifold.distance_scale import DistanceScale
from isagi.manifold.sameness import content_key, depends_on_context

if TYPE_CHECKING:
    from isagi.manifold.memory import MemoryRecord  # (not at run time: it loads FAISS)


@dataclass(frozen=True)
class Candidate:
    """A stored exchange near the message: its memory id, metric distance and record."""

    id: int
    distance: float
    record: MemoryRecord  # TrajectoryMemory.get()


@dataclass(frozen=True)
class Decision:
    """What the turn does: its tier, the stored exchange it uses, and how far that lies."""

    tier: Tier
    nearest: Candidate | None  # the matched record (RETRIEVE) or the nearest one; None when memory is empty
    context_dependent: bool  # the message needs its conversation to be understood

    @property
    def distance(self) -> float | None:
        return None if self.nearest is None else self.nearest.distance

    @property
    def record(self) -> MemoryRecord | None:
        return None if self.nearest is None else self.nearest.record


def same_question(text: str, record: MemoryRecord, context_key: str, dependent: bool) -> bool:
    """The exact check before RETRIEVE: same content words, and the same context if it matters."""
    if content_key(text) != record["content_key"]:
        return False
    if dependent or record["context_key"]:
        # A context-dependent question is stored with the key of its context.
        return record["context_key"] == context_key
    return True


def decide(
    candidates: Sequence[Candidate],
    text: str,
    context_key: str,
    scale: DistanceScale,
    thresholds: TierThresholds | None = None,
) -> Decision:
    """The tier of ``text`` given its nearest stored exchanges (nearest first) and its context key."""
    thresholds = thresholds or TierThresholds()
    dependent = depends_on_context(text)
    if not candidates:
        return Decision(Tier.EXPLORE, None, dependent)
    for c in candidates:
        if c.distance <= scale.retrieve_cap and same_question(text, c.record, context_key, dependent):
            return Decision(Tier.RETRIEVE, c, dependent)
    nearest = candidates[0]
    tier = thresholds.classify(scale.rescale(nearest.distance))
    if tier is Tier.RETRIEVE:
        tier = Tier.AUGMENT  # close, but not the same question: a near miss
    return Decision(tier, nearest, dependent)
