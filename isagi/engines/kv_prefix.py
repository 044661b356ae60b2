"""Saved KV caches of earlier decodings, found again by the longest shared token prefix.

Owns one thing for the llama.cpp engine: a bounded, least-recently-used store
of ``token ids -> the KV-cache bytes of those tokens`` (llama.cpp's
``llama_state_seq_get_data`` of sequence 0), and the lookup of the entry that
shares the longest prefix with a new prompt. A chat turn's prompt is the
previous turn's prompt plus that turn's reply and the new message, so without
this every turn of a long conversation prefilled the whole history again
(docs/measurements.md, the llama.cpp engine): with it a turn
evaluates only the tokens after the shared prefix. Several sessions
interleave on one model, so one entry per recent conversation is kept, not
just the last KV cache.

Also the lookup for a context shift (:meth:`PrefixStore.best_shift`): when the
history window has dropped the oldest exchanges (:mod:`isagi.manifold.window`), the new
prompt is an entry with a gap cut out after the system prompt; the engine
cuts it out of the restored cache and moves the rest down.

A restored prefix holds what llama.cpp computed for those tokens inside the
earlier prompt's batch, and its CPU kernels round a batch of 64 tokens or
more differently from a shorter one: the same system prompt's states differ
slightly inside a long and a short prompt (docs/measurements.md), both as
close to transformers fp32. So a reply decoded
after a restore may part, in later tokens, from one decoded with nothing
saved; tests that compare against a whole evaluation clear the store first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

# The saved bytes: llama.cpp's state of sequence 0, kept as the uint8 array it was copied into.
KvData = bytes | np.ndarray

# A shorter shared prefix is not worth a restore (a chat template's opening alone is ~5 tokens).
MIN_SHARED_TOKENS = 8
DEFAULT_BUDGET_BYTES = 256 * 1024**2
# A context shift (see :class:`Shift`) is worth it only for a long run of reused tokens; the run is
# found from its first PROBE_TOKENS tokens.
MIN_SHIFTED_TOKENS = 64
PROBE_TOKENS = 16


def shared_prefix(a: tuple[int, ...], b: list[int]) -> int:
    """How many leading token ids ``a`` and ``b`` have in common."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if len(diff) else n


@dataclass(frozen=True)
class Shift:
    """A saved entry reused with a gap cut out of it (a context shift): its first ``head`` tokens
    are the new prompt's first ``head``; tokens ``head..cut`` of the entry are removed; its tokens
    ``cut..cut+run`` are the prompt's next ``run`` tokens, moved down to follow the head."""

    tokens: tuple[int, ...]
    data: KvData
    head: int
    cut: int
    run: int

    @property
    def reused(self) -> int:
        """Leading prompt tokens the shifted entry stands in for."""
        return self.head + self.run


def shifted_run(key: tuple[int, ...], tokens: list[int], head: int) -> tuple[int, int]:
    """(cut, run): the longest ``key[cut:cut+run] == tokens[head:head+run]`` with ``cut > head``,
    i.e. how ``tokens`` continues after their shared ``head`` further on in ``key``; (0, 0) if it does not."""
    probe = np.asarray(tokens[head : head + PROBE_TOKENS])
    rest = np.asarray(key[head + 1 :])
    if len(probe) < PROBE_TOKENS or len(rest) < PROBE_TOKENS:
        return 0, 0
    windows = np.lib.stride_tricks.sliding_window_view(rest, PROBE_TOKENS)
    best = (0, 0)
    for at in np.flatnonzero((windows == probe).all(axis=1)) + head + 1:
        run = shared_prefix(key[at:], tokens[head:])
        if run > best[1]:
            best = (int(at), run)
    return best


class PrefixStore:
    """``tokens -> KV bytes`` entries, least recently used dropped first beyond ``budget_bytes``."""

    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        self.budget_bytes = int(budget_bytes)
        self._entries: OrderedDict[tuple[int, ...], KvData] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def put(self, tokens: list[int], data: KvData) -> None:
        """Keep ``data`` for ``tokens``; entries that are a prefix of ``tokens`` are superseded."""
        key = tuple(tokens)
        if not key or len(data) > self.budget_bytes:
            return
        for old in [k for k in self._entries if len(k) <= len(key) and key[: len(k)] == k]:
            self._drop(old)
        self._entries[key] = data
        self._bytes += len(data)
        while self._bytes > self.budget_bytes:
            self._drop(next(iter(self._entries)))

    def best(self, tokens: list[int]) -> tuple[tuple[int, ...], KvData, int] | None:
        """The entry sharing the longest prefix with ``tokens`` (at least MIN_SHARED_TOKENS):
        (its tokens, its bytes, the shared length); it becomes the most recently used."""
        found: tuple[tuple[int, ...], int] | None = None
        for key in self._entries:
            n = shared_prefix(key, tokens)
            if n >= MIN_SHARED_TOKENS and (found is None or n > found[1]):
                found = (key, n)
        if found is None:
            return None
        self._entries.move_to_end(found[0])
        return found[0], self._entries[found[0]], found[1]

    def best_shift(self, tokens: list[int]) -> Shift | None:
        """The entry that stands in for the most leading tokens of ``tokens`` once a gap is cut out of
        it (:class:`Shift`: at least MIN_SHARED_TOKENS kept at the front, MIN_SHIFTED_TOKENS moved);
        it becomes the most recently used."""
        found: Shift | None = None
        for key, data in self._entries.items():
            head = shared_prefix(key, tokens)
            if head < MIN_SHARED_TOKENS:
                continue
            cut, run = shifted_run(key, tokens, head)
            if run >= MIN_SHIFTED_TOKENS and (found is None or head + run > found.reused):
                found = Shift(key, data, head, cut, run)
        if found is not None:
            self._entries.move_to_end(found.tokens)
        return found

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0

    def _drop(self, key: tuple[int, ...]) -> None:
        self._bytes -= len(self._entries.pop(key))
