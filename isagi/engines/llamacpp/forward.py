"""The llama.cpp engine's forward passes in one sequence, with layer outputs read as they run.

Owns evaluating tokens in sequence 0 (a prompt in batches of 512, which a Stop
ends between or inside them (:mod:`isagi.engines.llamacpp.abort`), a fed-back
reply token alone on a lean path of its own), reading the layer outputs asked
for while the graph runs, and the logits. With several slots the step runner
(:mod:`isagi.engines.llamacpp_steps`) makes the passes instead, with the same
capture and the same layer names (:meth:`ForwardPasses._names`). Every
``llama_decode`` runs on the llama.cpp thread (:mod:`isagi.engines.llama_thread`)
under the engine's lock, on the thread count the engine's decoder chooses
(:mod:`isagi.engines.llamacpp.threads`). The capture is armed for one ``llama_decode`` and
disarmed in a ``finally``; the callback itself is a parameter of the context,
installed when it is made (:mod:`isagi.engines.llamacpp.load`).

Layer outputs. llama.cpp names the residual stream after block ``il``
(0-based) ``l_out-<il>``; that is transformers' ``hidden_states[il + 1]``,
so ISAGI's layer ``L`` is ``l_out-<L-1>`` (checked numerically by the
model-tier test against transformers fp32 on the dequantised GGUF). They are
read in the scheduler's eval callback (``llama_context_params.cb_eval``):
on the ``ask`` call the callback says which nodes it wants; the scheduler
then splits the graph after each wanted node and calls back with the data,
which on the CPU backend is host memory. The callback is compiled machine
code (:mod:`isagi.engines.layer_capture`), so asking about every node of
every token's graph costs no Python call.

One context. What reading reply states costs is what ``isagi bench generate``
reports as ``capture_ratio`` (against llama-cpp-python's own ``Llama`` with
the same attention kernel: ``llamacpp_vs_plain``); the figures, for a Python
(ctypes) callback and the compiled one, are in docs/measurements.md. The
alternative with no callback on the decode context at all -- a second context
holding the KV cache that re-evaluates each guard window of reply tokens as
one batch to capture them -- was slower still, as a batch of a few tokens
costs several single-token steps on the CPU. So ISAGI uses ONE context with
the callback installed; the prefill is evaluated exactly once and every reply
token once, with its states at the layers asked for.

Prompt states alone (calibration, and a turn's lookup prompt when the reply
is decoded from another prompt: ``states_only``, ``truncate`` here) go one
step further: once the last wanted layer is copied the callback answers
``False`` on the data call, which ends the graph's compute, so the later
blocks and the output head (a large share of a small model's weights) are
skipped. Such a context's KV cache above those layers is left unwritten, so
it is cleared before any other use and never saved as a prefix.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from isagi.engines.base import PrefillStopped
from isagi.engines.llama_thread import on_llama_thread
from isagi.engines.llamacpp.abort import ABORTED, StopWatch


class ForwardPasses:
    """The forward passes of :class:`~isagi.engines.llamacpp.engine.LlamaCppEngine` (a mixin:
    the engine's ``__init__`` makes the context and sets the attributes named here)."""

    _ll: Any  # the llama_cpp module
    _ctx: Any
    _capture: Any  # isagi.engines.layer_capture.LayerCapture, the context's eval callback
    _abort: Any  # isagi.engines.llamacpp.abort.PromptAbort, the context's abort callback
    decoder: Any  # isagi.engines.llamacpp.threads.AdaptiveThreads: llama_decode on the chosen thread count
    lock: Any  # threading.Lock: one llama_decode at a time
    _one_id: Any  # the batch of one fed-back reply token, made once
    _one_batch: Any
    _evaluated: int  # tokens this path ran
    _n_ctx: int
    _n_vocab: int
    _logit_views: dict[int | None, np.ndarray]

    def _decode(self, ids: list[int], start: int, *, capture: dict[bytes, int] | None, all_logits: bool = False,
                truncate: bool = False, stop: StopWatch | None = None) -> dict[int, np.ndarray]:
        """Evaluate ``ids`` at positions ``start...`` in sequence 0; states (n, d) of the captured layers.

        ``all_logits``: logits for every token, readable (:meth:`_logits`) only for the last
        chunk of 512, the outputs of the last ``llama_decode`` (``reply_logits`` reads them a
        chunk at a time).
        ``truncate``: stop computing once the captured layers are read; the KV cache
        above them and the logits are then left unwritten, so only for states alone.
        ``stop``: a prompt a Stop may end (:meth:`~isagi.engines.llamacpp.abort.PromptAbort.watch`),
        before a batch or inside one (the abort callback); then
        :class:`~isagi.engines.base.PrefillStopped` is raised (the cache then holds part of the
        prompt: the caller clears it).
        """
        with self.lock:
            return self._decode_locked(ids, start, capture=capture, all_logits=all_logits, truncate=truncate,
                                       stop=stop)

    def _decode_token(self, token: int, capture: dict[bytes, int] | None) -> dict[int, np.ndarray]:
        """:meth:`_decode` of one token at the sequence's next position (a fed-back reply token),
        without the batching: the per-token path of every reply, kept lean."""
        cap = self._capture
        with self.lock:
            if capture:
                cap.start(capture, 1)
            self._one_id[0] = token
            try:
                status = on_llama_thread(self.decoder.decode, self._one_batch, 1)
            finally:
                cap.stop()
            self._check(status, capture)
            self._evaluated += 1
            return cap.rows() if capture else {}

    def _check(self, status: int, capture: dict[bytes, int] | None) -> None:
        if status != 0:
            raise RuntimeError(f"llama_decode failed with status {status} (context {self._n_ctx} tokens)")
        if capture and not self._capture.complete():  # pragma: no cover - a graph without these nodes
            raise RuntimeError(f"llama.cpp's graph gave no whole {sorted(capture)} outputs")

    def _decode_locked(self, ids: list[int], start: int, *, capture: dict[bytes, int] | None, all_logits: bool,
                       truncate: bool = False, stop: StopWatch | None = None) -> dict[int, np.ndarray]:
        rows: dict[int, list[np.ndarray]] = {layer: [] for layer in (capture or {}).values()}
        n_batch = 512
        for off in range(0, len(ids), n_batch):
            if stop is not None and stop.stopped():
                raise PrefillStopped
            chunk = ids[off : off + n_batch]
            if capture:
                self._capture.start(capture, len(chunk), truncate=truncate)
            try:
                with self._abort.running(stop):
                    status = self._run_batch(chunk, start + off, all_logits=all_logits, truncate=truncate)
            finally:
                self._capture.stop()
            if status == ABORTED and stop is not None:
                raise PrefillStopped  # llama.cpp removed the cut batch's positions from the cache
            self._check(status, capture)
            self._evaluated += len(chunk)
            for layer, got in (self._capture.rows().items() if capture else ()):
                rows[layer].append(got)
        return {layer: np.concatenate(parts) if len(parts) > 1 else parts[0] for layer, parts in rows.items() if parts}

    def _run_batch(self, chunk: list[int], pos: int, *, all_logits: bool, truncate: bool) -> int:
        ll = self._ll
        if not all_logits:  # positions follow the sequence; logits for the last token only
            arr = (ll.llama_token * len(chunk))(*chunk)
            return on_llama_thread(self.decoder.decode, ll.llama_batch_get_one(arr, len(chunk)), len(chunk), truncate)
        batch = ll.llama_batch_init(len(chunk), 0, 1)
        try:
            for i, tok in enumerate(chunk):
                batch.token[i] = tok
                batch.pos[i] = pos + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = True
            batch.n_tokens = len(chunk)
            return on_llama_thread(self.decoder.decode, batch, len(chunk), truncate)
        finally:
            ll.llama_batch_free(batch)

    @staticmethod
    def _names(layers: list[int]) -> dict[bytes, int]:
        return {f"l_out-{layer - 1}".encode(): layer for layer in layers}

    def _logits(self, i: int = -1) -> np.ndarray:
        """A view (no copy) of the logits of output ``i``, valid until the next decode."""
        ptr = self._ll.llama_get_logits_ith(self._ctx, i)
        address = ctypes.cast(ptr, ctypes.c_void_p).value
        view = self._logit_views.get(address)
        if view is None:  # the context's logits buffer stays put: one view per output slot
            if len(self._logit_views) > 64:
                self._logit_views.clear()
            view = self._logit_views[address] = np.ctypeslib.as_array(ptr, shape=(self._n_vocab,))
        return view
