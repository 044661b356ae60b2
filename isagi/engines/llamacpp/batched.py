"""Several prompts in one ``llama_decode``: the calibration's prompt states and greedy replies.

Owns evaluating a group of prompts side by side in the one-slot engine's context, for the
batched passes a profile build makes by the thousand (:meth:`LlamaCppEngine.iter_prompt_states`,
:meth:`LlamaCppEngine.reply_states`). Everyday decodings use sequence 0 alone; the context is
opened with :data:`GROUP_SEQS` sequences over one unified KV cache
(:func:`isagi.engines.llamacpp.load.open_context`) so that these passes can use the others.

A group's common prefix (the system prompt and the chat template's opening at least) is
evaluated once in sequence 0, and kept there from one group to the next while it stays the
same. ``llama_memory_seq_cp`` lends its cells to the group's other sequences: in a unified
cache a cell carries a set of sequences, so nothing is copied. Each prompt's own tokens then
go into one batch, each in its own sequence; llama.cpp's attention mask keeps a sequence to
its own cells, so a prompt's states and logits are those it gets alone, up to the rounding of
a larger matrix product. Greedy replies then advance one token per sequence per
``llama_decode``, each sequence dropping out at its stop token or its length.

Why: a prompt's tokens cost about as much in a batch of 16 as in one of 500 on the CPU
(prefill is compute-bound), so grouping prompts saves only the per-call work; a reply's
tokens, one per ``llama_decode``, read every weight for one token, and 16 replies side by
side read them once. The figures are in docs/measurements.md ("The build in batches").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from isagi.engines.kv_prefix import shared_prefix
from isagi.engines.llama_thread import on_llama_thread

GROUP_SEQS = 16  # sequences of the one-slot context: prompts evaluated side by side
MAX_BATCH = 512  # the context's n_batch: tokens of one llama_decode


def common_prefix(token_lists: Sequence[Sequence[int]]) -> int:
    """The number of leading tokens every list shares."""
    first = tuple(token_lists[0])
    return min((shared_prefix(first, list(other)) for other in token_lists[1:]), default=len(first))


def groups(token_lists: Sequence[Sequence[int]], *, width: int, cells: int, extra: int = 0) -> Iterator[list[int]]:
    """Consecutive indices of ``token_lists`` in groups of at most ``width`` that fit the KV cache's
    ``cells``: their common prefix once, then each prompt's own tokens and ``extra`` more (a
    reply's). A prompt that fits no group alone is a group of one."""
    group: list[int] = []
    for i in range(len(token_lists)):
        trial = [*group, i]
        p = group_prefix([token_lists[j] for j in trial])
        need = p + sum(len(token_lists[j]) - p + extra for j in trial)
        if group and (len(trial) > width or need > cells):
            yield group
            group = [i]
        else:
            group = trial
    if group:
        yield group


def group_prefix(token_lists: Sequence[Sequence[int]]) -> int:
    """The group's prefix evaluated once: its common prefix, leaving each prompt one token of its own
    (the token whose logits a reply starts from); none for a prompt alone, which is then evaluated
    in one piece, exactly as a decoding evaluates it."""
    if len(token_lists) == 1:
        return 0
    return min(common_prefix(token_lists), min(len(t) for t in token_lists) - 1)


@dataclass
class HeldPrefix:
    """What sequence 0 holds between groups: a prefix's tokens, their states (when captured),
    whether its graph was cut after the captured layers, and the owner mark it was made under
    (another decoding in between takes the cache, and the prefix is evaluated again)."""

    owner: object = field(default_factory=object)
    ids: list[int] = field(default_factory=list)
    states: dict[int, np.ndarray] = field(default_factory=dict)
    names: dict[bytes, int] | None = None
    truncated: bool = False


class BatchedPasses:
    """The grouped passes of :class:`~isagi.engines.llamacpp.engine.LlamaCppEngine` (a mixin: the
    engine's ``__init__`` and :class:`~isagi.engines.llamacpp.forward.ForwardPasses` give the
    attributes named here)."""

    _ll: Any
    _mem: Any
    _capture: Any
    _n_ctx: int
    _n_embd: int
    decoder: Any
    lock: Any
    owner: object | None
    _evaluated: int
    _check: Callable[[int, dict[bytes, int] | None], None]
    _clear: Callable[[object | None], None]
    _logits: Callable[..., np.ndarray]

    def _hold_prefix(self, batch: Any, target: list[int], names: dict[bytes, int] | None, truncate: bool,
                     held: HeldPrefix, n: int) -> dict[int, np.ndarray]:
        """Sequence 0 holding ``target`` and sequences 1..n-1 sharing it, nothing after it in any
        sequence (held: the lock); the states of ``target``'s tokens at the ``names`` layers.
        What sequence 0 held before and ``target`` share is not evaluated again."""
        ll = self._ll
        if self.owner is not held.owner or held.truncated != truncate or held.names != names:
            self._clear(held.owner)
            held.ids, held.states, held.names, held.truncated = [], {}, names, truncate
        q = common_prefix([held.ids, target]) if held.ids else 0
        ll.llama_memory_seq_rm(self._mem, -1, q, -1)
        states = {layer: s[:q] for layer, s in held.states.items()}
        if q < len(target):
            new = self._batch_decode(batch, [(t, q + i, 0, False) for i, t in enumerate(target[q:])], names, truncate)
            states = {layer: np.concatenate([states[layer], got]) if q else got for layer, got in new.items()}
        held.ids, held.states = list(target), states
        if target:
            for seq in range(1, n):
                ll.llama_memory_seq_cp(self._mem, 0, seq, 0, len(target))
        return states

    def _batch_decode(self, batch: Any, items: list[tuple[int, int, int, bool]], names: dict[bytes, int] | None,
                      truncate: bool, logits_of: dict[int, np.ndarray] | None = None) -> dict[int, np.ndarray]:
        """``llama_decode`` of ``items`` (token, position, sequence, logits?) in batches of
        :data:`MAX_BATCH` (held: the lock): the states at the ``names`` layers, one row per item;
        the logits asked for go into ``logits_of`` by sequence."""
        parts: dict[int, list[np.ndarray]] = {}
        for off in range(0, len(items), MAX_BATCH):
            chunk = items[off : off + MAX_BATCH]
            for i, (token, pos, seq, logits) in enumerate(chunk):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, logits
                batch.seq_id[i][0] = seq
            batch.n_tokens = len(chunk)
            if names:
                self._capture.start(names, len(chunk), truncate=truncate)
            try:
                status = on_llama_thread(self.decoder.decode, batch, len(chunk), truncate)
            finally:
                self._capture.stop()
            self._check(status, names)
            self._evaluated += len(chunk)
            for layer, got in (self._capture.rows().items() if names else ()):
                parts.setdefault(layer, []).append(got)
            if logits_of is not None:
                for i, (_t, _p, seq, logits) in enumerate(chunk):
                    if logits:
                        logits_of[seq] = self._logits(i).copy()
        return {layer: np.concatenate(p) if len(p) > 1 else p[0] for layer, p in parts.items()}

    def in_groups(self, token_lists: list[list[int]], *, width: int, extra: int,
                  run: Callable[[list[list[int]], HeldPrefix], list[dict[int, np.ndarray]]],
                  ) -> Iterator[tuple[list[int], list[dict[int, np.ndarray]]]]:
        """``run`` (:meth:`grouped_prompt_states` or :meth:`grouped_replies`) on each group of
        :func:`groups` in turn, with one :class:`HeldPrefix` from group to group: (the group's
        indices, what ``run`` gave). The KV cache is cleared afterwards if this still holds it
        (a truncated prefix holds no layer above the captured ones)."""
        held = HeldPrefix()
        try:
            for group in groups(token_lists, width=min(width, GROUP_SEQS), cells=self._n_ctx, extra=extra):
                yield group, run([token_lists[i] for i in group], held)
        finally:
            if self.owner is held.owner:
                self._clear(None)

    def grouped_prompt_states(self, token_lists: list[list[int]], names: dict[bytes, int], held: HeldPrefix,
                              ) -> list[dict[int, np.ndarray]]:
        """Every token's states of each prompt of one group (:func:`groups`) at the ``names``
        layers, as each gets alone; the graph stops after the last of them."""
        p = group_prefix(token_lists)
        batch = self._ll.llama_batch_init(MAX_BATCH, 0, 1)
        try:
            with self.lock:
                prefix = self._hold_prefix(batch, token_lists[0][:p], names, True, held, len(token_lists))
                items = [(t, p + i, seq, False) for seq, ids in enumerate(token_lists) for i, t in enumerate(ids[p:])]
                rows = self._batch_decode(batch, items, names, truncate=True)
        finally:
            self._ll.llama_batch_free(batch)
        out, at = [], 0
        for ids in token_lists:
            k = len(ids) - p
            out.append({layer: np.concatenate([prefix[layer], got[at : at + k]]) if p else got[at : at + k].copy()
                        for layer, got in rows.items()})
            at += k
        return out

    def grouped_replies(self, token_lists: list[list[int]], names: dict[bytes, int], max_new_tokens: int,
                        stops: set[int], held: HeldPrefix, tokens: list[list[int]] | None = None,
                        ) -> list[dict[int, np.ndarray]]:
        """Greedy replies to one group's prompts, side by side: the states at the ``names`` layers
        of each reply token fed back, as :meth:`LlamaCppDecoding.stream` reads them for a reply
        alone (the argmax of the logits; a token of ``stops`` ends a reply and is not fed back,
        nor is the last token of a reply that reached ``max_new_tokens``). ``tokens``: each
        reply's tokens are appended to it."""
        n = len(token_lists)
        made_ids: list[list[int]] = [[] for _ in range(n)]
        p = group_prefix(token_lists)
        got: list[dict[int, list[np.ndarray]]] = [{layer: [] for layer in names.values()} for _ in range(n)]
        batch = self._ll.llama_batch_init(MAX_BATCH, 0, 1)
        try:
            with self.lock:
                self._hold_prefix(batch, token_lists[0][:p], None, False, held, n)
                logits: dict[int, np.ndarray] = {}
                items = [(t, p + i, seq, i == len(ids) - p - 1)
                         for seq, ids in enumerate(token_lists) for i, t in enumerate(ids[p:])]
                self._batch_decode(batch, items, None, False, logits)
                pos = {seq: len(ids) for seq, ids in enumerate(token_lists)}
                while logits:
                    feed = []
                    for seq, row in logits.items():
                        token = int(np.argmax(row))
                        if token in stops:
                            continue
                        made_ids[seq].append(token)
                        if len(made_ids[seq]) >= max_new_tokens or pos[seq] >= self._n_ctx:
                            continue
                        feed.append((token, pos[seq], seq, True))
                        pos[seq] += 1
                    logits = {}
                    if feed:
                        rows = self._batch_decode(batch, feed, names, False, logits)
                        for i, (_t, _p, seq, _w) in enumerate(feed):
                            for layer, r in rows.items():
                                got[seq][layer].append(r[i : i + 1])
                self._ll.llama_memory_seq_rm(self._mem, -1, p, -1)
        finally:
            self._ll.llama_batch_free(batch)
        if tokens is not None:
            tokens += made_ids
        return [{layer: np.concatenate(parts) if parts else np.zeros((0, self._n_embd), np.float32)
                 for layer, parts in g.items()} for g in got]
