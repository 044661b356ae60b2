"""How many turns use the model at once.

A model engine with several sequence slots (llama.cpp with ``ISAGI_PARALLEL`` above 1,
:mod:`isagi.engines.llamacpp_steps`) decodes that many replies together, each in its own
slot; any other engine (one slot: the transformers backend, llama.cpp with one slot) runs one
turn at a time. :class:`ModelTurns` admits that many turns into the model and makes the rest
wait, in the order they came (a thread waiting here holds no slot, so nothing waits on it).
"""

from __future__ import annotations

import threading


class ModelTurns:
    """A counting gate in front of the model: ``with turns:`` around any model work."""

    def __init__(self, slots: int = 1) -> None:
        self.slots = max(1, int(slots))
        self._gate = threading.BoundedSemaphore(self.slots)
        self._count = threading.Lock()
        self._inside = 0

    def __enter__(self) -> ModelTurns:
        self._gate.acquire()
        with self._count:
            self._inside += 1
        return self

    def __exit__(self, *exc: object) -> None:
        with self._count:
            self._inside -= 1
        self._gate.release()

    @property
    def inside(self) -> int:
        """Turns using the model now."""
        return self._inside

    def locked(self) -> bool:
        """True while any turn uses the model (as ``threading.Lock.locked`` for one slot)."""
        return self._inside > 0
