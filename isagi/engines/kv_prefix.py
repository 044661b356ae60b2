"""Saved KV caches of earlier decodings, found again by the longest shared token prefix.

Owns one thing for the llama.cpp engine: a bounded, least-recently-used store
of ``token ids -> the KV-cache bytes of those tokens`` (llama.cpp's
``llama_state_seq_get_data`` of sequence 0), and the lookup of the entry that
shares the longest prefix with a new prompt. A chat turn's prompt is the
previous turn's prompt plus that turn's reply and the new message, so without
this every turn of a long conversation prefilled the whole history again
(293 tokens, 0.62 s on 2 cores, for five short exchanges): with it a turn
evaluates only the tokens after the shared prefix. Several sessions
interleave on one model, so one entry per recent conversation is kept, not
just the last KV cache.

A restored prefix holds what llama.cpp computed for those tokens inside the
earlier prompt's batch, and its CPU kernels round a batch of 64 tokens or
more differently from a shorter one: the same system prompt evaluated inside
a 69-token history prompt and inside a 44-token prompt differs by ~2 % at
layer 18 (cosine to transformers fp32 0.9997 either way). So a reply decoded
after a restore may part, in later tokens, from one decoded with nothing
saved; tests that compare against a whole evaluation clear the store first.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

# The saved bytes: llama.cpp's state of sequence 0, kept as the uint8 array it was copied into.
KvData = bytes | np.ndarray

# A shorter shared prefix is not worth a restore (a chat template's opening alone is ~5 tokens).
MIN_SHARED_TOKENS = 8
DEFAULT_BUDGET_BYTES = 256 * 1024**2


def shared_prefix(a: tuple[int, ...], b: list[int]) -> int:
    """How many leading token ids ``a`` and ``b`` have in common."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if len(diff) else n


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

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0

    def _drop(self, key: tuple[int, ...]) -> None:
        self._bytes -= len(self._entries.pop(key))
