"""The llama.cpp engine's KV cache by sequence: who holds it, the slots, the saved prefixes.

Owns which decoding the KV cache holds (one sequence: the engine's ``owner``,
cleared before anything else uses it); the slots (several sequences, one KV
stream each: a decoding takes a free one and frees it when it closes, the
llama.cpp thread saving and emptying it between two decodes); and
moving KV caches between llama.cpp and the prefix store: saved from a sequence
when its decoding closes, restored into one for a prompt that extends them,
with a gap cut out where the history window dropped exchanges. Which saved
cache fits a prompt best is the store's (:mod:`isagi.engines.kv_prefix`); the
forward passes in a slot are the step runner's (:mod:`isagi.engines.llamacpp_steps`).

Slots. llama.cpp's attention over a batch spans every KV stream from its
lowest sequence to its highest, so a decoding takes the lowest free sequence
(a heap) and the sequences in use stay together at the bottom. The control
vector acts on the whole context, so a steered decoding takes every slot;
while it waits for them no other decoding takes one (else a steady flow of
chat turns would keep it waiting for ever).

Prompts that extend an earlier one. A decoding's KV cache (its prompt and
the reply tokens fed back) is saved when it closes; a later decoding allowed
to (``reuse_prefix``) loads the saved cache that shares the longest prefix
with its prompt and evaluates only the rest. A chat turn's prompt is the
previous turn's prompt, reply and the new message, so a turn evaluates its
new tokens only, whichever sessions ran in between. Once a session's history
passes the prompt budget, the history window drops a block of the oldest
exchanges (:mod:`isagi.manifold.window`) and the prompt no longer starts as
the previous one did. A decoding opened with ``context_shift`` then loads the
previous turn's cache anyway, cuts the dropped exchanges out of it
(``llama_memory_seq_rm``) and moves the rest down to follow the system prompt
(``llama_memory_seq_add``; llama.cpp re-rotates the moved keys at the next
decode), as llama.cpp's own server does when a chat outgrows its context, so
that turn too evaluates only its new tokens. The moved tokens' cache was
computed after the exchanges now cut out, so it is not exactly what a fresh
evaluation of the new prompt gives (``tests/test_window_model.py`` compares
the replies and their states).
"""

from __future__ import annotations

import ctypes
import heapq
import threading
import time
from typing import Any

import numpy as np

from isagi.engines.kv_prefix import Shift


class Sequences:
    """The KV cache's sequences of :class:`~isagi.engines.llamacpp.engine.LlamaCppEngine` (a
    mixin: the engine's ``__init__`` makes the context and sets the attributes named here)."""

    _ll: Any  # the llama_cpp module
    _ctx: Any
    _mem: Any  # the context's memory (its KV cache)
    lock: Any  # threading.Lock: one llama_decode (or KV cache change) at a time
    owner: object | None  # one sequence: the decoding whose tokens the KV cache holds
    slots: int
    steps: Any  # isagi.engines.llamacpp_steps.StepRunner: the forward passes of several slots
    _free: list[int]  # free sequences, a heap
    _slot_owner: dict[int, object]
    _slots_cv: Any  # threading.Condition over _free and _slot_owner
    _wanting_all: int  # steered decodings waiting for every slot
    _closing: set[threading.Event]  # closing decodings whose sequence is not yet saved and emptied
    prefixes: Any  # isagi.engines.kv_prefix.PrefixStore
    can_shift: bool
    context_shifts: int

    # -- the one sequence -----------------------------------------------------
    def _clear(self, owner: object | None) -> None:
        # metadata only: zeroing the KV buffers (data=True) cost ~1 ms a call and nothing reads them
        self._ll.llama_memory_clear(self._mem, False)
        self.owner = owner

    # -- slots (several sequences: isagi.engines.llamacpp_steps) -------------------
    def _take_slot(self, owner: object, *, all_of_them: bool = False) -> int:
        """A free sequence for ``owner`` (waits until one is free); ``all_of_them``: every
        sequence (a steered decoding: the control vector acts on the whole context). It may
        still hold tokens (a forward pass of the one-sequence path writes sequence 0): its
        prompt's evaluation empties it (:meth:`_restore_prefix`, :meth:`_empty`), so taking
        one waits for no decode."""
        with self._slots_cv:
            if all_of_them:
                # while it waits, no reply starts: the replies running end and it goes next
                # (else a steady flow of chat turns would keep it waiting for ever)
                self._wanting_all += 1
                try:
                    self._slots_cv.wait_for(lambda: len(self._free) == self.slots)
                finally:
                    self._wanting_all -= 1
                taken = list(self._free)
                self._free.clear()
            else:
                self._slots_cv.wait_for(lambda: bool(self._free) and not self._wanting_all)
                taken = [heapq.heappop(self._free)]
        for seq in taken:
            self._slot_owner[seq] = owner
        return min(taken)

    def _empty(self, seq: int) -> int:
        """Sequence ``seq`` emptied; 0, the tokens it still holds (a ``Step.reuse`` of a prompt
        evaluated from its start, run on the llama.cpp thread: no wait for the decode running)."""
        with self.lock:
            self._ll.llama_memory_seq_rm(self._mem, seq, -1, -1)
        return 0

    def _slot_eval(self, ids: list[int], *, capture: dict[bytes, int] | None, truncate: bool = False,
                   logits: str = "none") -> Any:
        """Evaluate ``ids`` from position 0 in a free sequence, then empty and free it (several slots)."""
        from isagi.engines.llamacpp_steps import Step

        owner = object()
        seq = self._take_slot(owner)
        try:
            step = self.steps.run(Step(seq, ids, 0, logits=logits, capture=capture, truncate=truncate,
                                       reuse=lambda: self._empty(seq)))
            return step
        finally:
            self._empty(seq)
            self._give_slot(owner)

    def _close_slot_later(self, owner: object, seq: int, tokens: list[int] | None) -> None:
        """Sequence ``seq`` of a closing decoding: its KV cache kept as a prefix when it holds
        exactly ``tokens`` (None: not kept), then emptied, and every slot of ``owner`` given
        back, on the llama.cpp thread between two decodes (:meth:`StepRunner.later`), so the
        closing turn does not wait for the decode running. Until then the slot stays taken; the
        job runs before any prompt queued after it (:meth:`StepRunner.later`), so the next turn
        of the conversation finds the cache saved."""
        done = threading.Event()
        with self._slots_cv:
            self._closing.add(done)

        def job() -> None:
            try:
                if tokens is not None:
                    self._save_prefix(tokens, seq=seq)
            finally:
                try:
                    self._empty(seq)
                finally:
                    self._give_slot(owner)
                    with self._slots_cv:
                        self._closing.discard(done)
                    done.set()

        try:
            self.steps.later(job)
        except RuntimeError:  # no llama.cpp thread to run it (the interpreter is exiting): here, now
            job()

    def settle(self, timeout: float | None = None) -> bool:
        """Wait until the closing decodings' sequences queued so far are saved and emptied
        (:meth:`_close_slot_later`; at most until the decode running ends, or ``timeout``
        seconds in all); whether they are. For what reads the store or the slots from another
        thread (forgetting the saved caches, closing the engine, tests); a prompt needs no wait,
        its KV cache is set up on the llama.cpp thread after the jobs queued before it."""
        from isagi.engines.llama_thread import is_llama_thread

        if is_llama_thread():  # its jobs run there at once: none is waiting
            return True
        with self._slots_cv:
            pending = list(self._closing)
        end = None if timeout is None else time.monotonic() + timeout
        return all(done.wait(None if end is None else max(0.0, end - time.monotonic())) for done in pending)

    def _give_slot(self, owner: object) -> None:
        """Every sequence ``owner`` holds, free again."""
        with self._slots_cv:
            for seq, held in list(self._slot_owner.items()):
                if held is owner:
                    del self._slot_owner[seq]
                    heapq.heappush(self._free, seq)
            self._slots_cv.notify_all()

    # -- saved prefixes (isagi.engines.kv_prefix) -----------------------------
    def forget_saved_states(self) -> int:
        """Drop every saved KV prefix (no open conversation needs one: the server is idle); the
        bytes given back. Under the engine's lock, as every use of the store."""
        self.settle()
        with self.lock:
            freed = int(self.prefixes.nbytes)
            self.prefixes.clear()
        return freed

    def _save_prefix(self, tokens: list[int], seq: int = 0) -> None:
        """Keep the KV cache of sequence ``seq``, which holds exactly ``tokens``, in :attr:`prefixes`."""
        ll = self._ll
        with self.lock:  # the store too: one engine may be used from several threads
            size = int(ll.llama_state_seq_get_size(self._ctx, seq))
            buf = np.empty(size, dtype=np.uint8)  # kept as it is: no second copy into bytes
            got = int(ll.llama_state_seq_get_data(self._ctx, buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)),
                                                  size, seq))
            if got:
                self.prefixes.put(tokens, buf[:got])

    def _restore_prefix(self, ids: list[int], limit: int, *, shift: bool = False, seq: int = 0) -> int:
        """Load the saved KV cache sharing the longest prefix with ``ids`` into sequence ``seq``
        (whatever it held is dropped), cut to that prefix or ``limit`` tokens; returns how many
        leading tokens need no evaluation (never all of them: the last prompt token is
        evaluated for its logits); 0: none, and the sequence is empty.

        ``shift``: a saved cache that holds more of ``ids`` once a gap is cut out of it
        (:meth:`~isagi.engines.kv_prefix.PrefixStore.best_shift`) is taken instead, and the
        gap is cut out with the positions after it moved down (a context shift)."""
        ll = self._ll
        with self.lock:
            found = self.prefixes.best(ids[:limit])
            moved = self.prefixes.best_shift(ids[:limit]) if shift and self.can_shift else None
            if moved is not None and (found is None or moved.reused > found[2]):
                data, shared = moved.data, moved.reused
            elif found is not None:
                moved, (_tokens, data, shared) = None, found
            else:
                ll.llama_memory_seq_rm(self._mem, seq, -1, -1)  # nothing to reuse: an empty sequence
                return 0
            buf = np.frombuffer(data, dtype=np.uint8)  # llama.cpp copies from it, no copy here
            if not int(ll.llama_state_seq_set_data(self._ctx, buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)),
                                                   len(buf), seq)):
                ll.llama_memory_seq_rm(self._mem, seq, -1, -1)
                return 0
            if moved is not None and not self._cut(moved, seq):
                ll.llama_memory_seq_rm(self._mem, seq, -1, -1)
                return 0
            start = min(shared, len(ids) - 1)
            ll.llama_memory_seq_rm(self._mem, seq, start, -1)
        return start

    def _cut(self, moved: Shift, seq: int = 0) -> bool:
        """Cut the gap of ``moved`` out of sequence ``seq`` and move the run after it down to follow
        the head (llama.cpp re-rotates the moved keys at the next decode); False if refused."""
        ll, mem = self._ll, self._mem
        if not (ll.llama_memory_seq_rm(mem, seq, moved.cut + moved.run, -1)
                and ll.llama_memory_seq_rm(mem, seq, moved.head, moved.cut)):
            return False
        ll.llama_memory_seq_add(mem, seq, moved.cut, -1, moved.head - moved.cut)
        self.context_shifts += 1
        return True
