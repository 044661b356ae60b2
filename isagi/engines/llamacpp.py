"""The llama.cpp engine: a GGUF on the CPU through llama-cpp-python's low-level API.

Owns loading a GGUF (the embedded default is read as it is, no conversion),
the chat template (the GGUF's own Jinja template, rendered as transformers
renders it, then tokenised by llama.cpp), reading layer outputs, decoding
(greedy: the argmax of the logits; sampling: llama.cpp's sampler chain),
steering through the control-vector API, and cancelling between tokens. The
context uses llama.cpp's plain attention kernel, not flash attention: on the
CPU, flash attention decodes slower once a chat's history fills the KV cache
(``isagi bench attention`` measures both; docs/measurements.md has the figures).

Layer outputs. llama.cpp names the residual stream after block ``il``
(0-based) ``l_out-<il>``; that is transformers' ``hidden_states[il + 1]``,
so ISAGI's layer ``L`` is ``l_out-<L-1>`` (checked numerically by the
model-tier test against transformers fp32 on the dequantised GGUF). They are
read in the scheduler's eval callback (``llama_context_params.cb_eval``):
on the ``ask`` call the callback says which nodes it wants; the scheduler
then splits the graph after each wanted node and calls back with the data,
which on the CPU backend is host memory. The callback is compiled machine
code (:mod:`isagi.engines.layer_capture`), so the ~936 asks per decoded token
cost no Python call each.

What reading reply states costs is what ``isagi bench generate`` reports as
``capture_ratio`` (against llama-cpp-python's own ``Llama`` with the same
attention kernel: ``llamacpp_vs_plain``); the figures, for a Python (ctypes)
callback and the compiled one, are in docs/measurements.md. The alternative
with no callback on the decode context at all -- a second context holding the
KV cache that re-evaluates each guard window of 8 reply tokens as one batch
to capture them -- was slower still (an 8-token batch costs several
single-token steps on two cores). So ISAGI uses ONE context with the callback
installed; the prefill is evaluated exactly once
and every reply token once, with its states at the layers asked for.

Prompt states alone (calibration, and a turn's lookup prompt when the reply
is decoded from another prompt: ``states_only``) go one step further: once
the last wanted layer is copied the callback answers ``False`` on the data
call, which ends the graph's compute, so the later blocks and the output head
(a third of SmolLM2's weights) are skipped; 621 of 936 nodes run for layers
18 and 20. Such a context's KV cache above those layers is left unwritten, so
it is cleared before any other use and never saved as a prefix.

Prompts that extend an earlier one. A decoding's KV cache (its prompt and
the reply tokens fed back) is saved when it closes (:mod:`isagi.engines.kv_prefix`);
a later decoding allowed to (``reuse_prefix``) loads the saved cache that
shares the longest prefix with its prompt and evaluates only the rest. A
chat turn's prompt is the previous turn's prompt, reply and the new message,
so a turn evaluates its new tokens only, whichever sessions ran in between.
Once a session's history passes the prompt budget, the history window drops
a block of the oldest exchanges (:mod:`isagi.manifold.window`) and the prompt no
longer starts as the previous one did. A decoding opened with
``context_shift`` then loads the previous turn's cache anyway, cuts the
dropped exchanges out of it (``llama_memory_seq_rm``) and moves the rest down
to follow the system prompt (``llama_memory_seq_add``; llama.cpp re-rotates
the moved keys at the next decode), as llama.cpp's own server does when a
chat outgrows its context, so that turn too evaluates only its new tokens.
The moved tokens' cache was computed after the exchanges now cut out, so it
is not exactly what a fresh evaluation of the new prompt gives
(``tests/test_window_model.py`` compares the replies and their states).

Under CPU contention (several processes on two cores) llama.cpp's threads
wait on each other at every node; ``ISAGI_THREADS=1`` then runs faster than
two threads. Benchmarks in this repository are rough for that reason.

Steering: ``llama_set_adapter_cvec`` adds a vector to ``l_out-<il>`` for
``il_start <= il <= il_end``; its buffer starts at ``il = 1`` (block 0 has no
control tensor), so ISAGI's layer ``L`` (>= 2) is slot ``L - 2`` of the
buffer. The captured state at a steered layer is read after the vector is
added; the engine subtracts it again, so states mean what the transformers
engine's capture hook sees (before its steering hook).
"""

from __future__ import annotations

import contextlib
import ctypes
import heapq
import math
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from isagi.engines.base import GenerationOptions, TokenEvent, check_layer
from isagi.engines.kv_prefix import PrefixStore, Shift
from isagi.engines.llama_thread import on_llama_thread
from isagi.errors import ModelLoadError
from isagi.manifold.pooling import last_token, span_mean

FLASH_ATTN = 0  # llama_flash_attn_type: -1 AUTO (llama.cpp's default: on for the CPU), 0 disabled, 1 enabled
_LOG_SILENCER: Any = None


def _silence_llama_log(llama_cpp: Any) -> None:
    """llama.cpp logs every load step to stderr; ISAGI reports its own errors."""
    global _LOG_SILENCER
    if _LOG_SILENCER is None:
        _LOG_SILENCER = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)(lambda *_a: None)
        llama_cpp.llama_log_set(_LOG_SILENCER, None)


class LlamaCppEngine:
    """A GGUF model in one llama.cpp context (see the module docstring for the design)."""

    backend = "llamacpp"
    device = "cpu"

    def __init__(
        self,
        path: Path,
        *,
        model_id: str,
        fingerprint: str,
        n_threads: int | None = None,
        n_ctx: int = 4096,
        backend_reason: str = "",
        slots: int = 1,
    ) -> None:
        import llama_cpp

        self._ll = ll = llama_cpp
        _silence_llama_log(ll)
        ll.llama_backend_init()
        self.model_id, self.source, self.fingerprint = model_id, str(path), fingerprint
        self.backend_reason = backend_reason
        self.n_threads = int(n_threads or os.cpu_count() or 1)
        self.device_reason = f"llama.cpp runs GGUF models on the CPU ({self.n_threads} threads)"
        params = ll.llama_model_default_params()
        self._model = ll.llama_model_load_from_file(str(path).encode(), params)
        if not self._model:
            raise ModelLoadError(
                f"llama.cpp could not load {path}: is it a complete GGUF file? Re-download it, or "
                "use --backend transformers with a Hugging Face model directory."
            )
        self._vocab = ll.llama_model_get_vocab(self._model)
        self._n_vocab = int(ll.llama_vocab_n_tokens(self._vocab))
        self._n_embd = int(ll.llama_model_n_embd(self._model))
        self._n_layer = int(ll.llama_model_n_layer(self._model))
        self._n_ctx_train = int(ll.llama_model_n_ctx_train(self._model))
        desc = ctypes.create_string_buffer(256)
        ll.llama_model_desc(self._model, desc, len(desc))
        # e.g. "llama ?B Q4_1": the GGUF's own quantisation, part of the profile key
        self.quant = "gguf-" + (desc.value.decode("utf-8", "replace").split() or ["unknown"])[-1]
        from isagi.engines.layer_capture import LayerCapture

        self._capture = LayerCapture(self._n_embd)
        self._cb = ll.ggml_backend_sched_eval_callback(self._capture.pointer)  # kept alive with the engine
        cparams = ll.llama_context_default_params()
        self._n_ctx = min(n_ctx, self._n_ctx_train) if self._n_ctx_train > 0 else n_ctx
        self.slots = max(1, int(slots))
        # several sequences: one KV stream each (kv_unified off), so each decodes as in a context
        # of its own (isagi.engines.llamacpp_steps); n_ctx is then the sum of the slots' contexts
        cparams.n_ctx = self._n_ctx * self.slots
        cparams.n_seq_max = self.slots
        cparams.kv_unified = self.slots == 1
        cparams.n_batch = cparams.n_ubatch = 512
        cparams.n_threads = cparams.n_threads_batch = self.n_threads
        cparams.cb_eval = self._cb
        cparams.cb_eval_user_data = self._capture.user_data
        # plain attention (see FLASH_ATTN); the benches' plain baseline uses the same kernel
        cparams.flash_attn_type = FLASH_ATTN
        self._ctx = ll.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            raise ModelLoadError(f"llama.cpp could not create a context of {self._n_ctx} tokens for {path}.")
        self._mem = ll.llama_get_memory(self._ctx)
        from isagi.engines.llamacpp_steps import StepRunner

        self.lock = threading.Lock()  # one llama_decode at a time; never held across a yield
        self.steps = StepRunner(ll, self._ctx, self._capture, self._n_vocab, n_seq_max=self.slots, lock=self.lock)
        # Free sequences, a heap (several slots only): a turn takes the lowest. llama.cpp's
        # attention over a batch spans every KV stream from its lowest sequence to its highest,
        # so the sequences in use are kept together at the bottom.
        self._free = list(range(self.slots))
        self._slot_owner: dict[int, object] = {}
        self._slots_cv = threading.Condition()
        self._wanting_all = 0  # steered decodings waiting for every slot
        self._template = self._load_template()
        self._stop_ids: set[int] | None = None
        self.owner: object | None = None  # the Decoding whose sequence the KV cache holds
        self._evaluated = 0  # tokens the one-sequence path ran (the step runner counts its own)
        self.prefixes = PrefixStore()  # KV caches of recent decodings, for prompts that extend them
        self.can_shift = bool(ll.llama_memory_can_shift(self._mem))  # the KV cache's positions can be moved
        self.context_shifts = 0  # saved KV caches reused with a gap cut out (tests)
        self._one_id = (ll.llama_token * 1)()  # the batch of one fed-back reply token, made once
        self._one_batch = ll.llama_batch_get_one(self._one_id, 1)
        self._pieces: dict[int, bytes] = {}
        self._logit_views: dict[int | None, np.ndarray] = {}

    # -- facts ----------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self._n_layer

    @property
    def hidden_size(self) -> int:
        return self._n_embd

    @property
    def default_layer(self) -> int:
        return max(1, round(self._n_layer * 2 / 3))

    @property
    def default_safety_layer(self) -> int:
        return max(1, round(self._n_layer * 3 / 5))

    @property
    def context_length(self) -> int:
        return self._n_ctx

    @property
    def vocab_size(self) -> int:
        return self._n_vocab

    @property
    def stop_token_ids(self) -> set[int]:
        if self._stop_ids is None:
            self._stop_ids = {t for t in range(self._n_vocab) if self._ll.llama_vocab_is_eog(self._vocab, t)}
        return set(self._stop_ids)

    def check_layer(self, layer: int) -> None:
        """Layers 1..num_layers-1: the last block's output holds only the logit rows in llama.cpp."""
        check_layer(layer, self._n_layer - 1)

    @property
    def evaluated_tokens(self) -> int:
        """Tokens run through the model (tests: no prompt token twice), by either path."""
        return self._evaluated + self.steps.evaluated_tokens

    def footprint_bytes(self) -> int:
        return int(self._ll.llama_model_size(self._model)) + int(self._ll.llama_state_get_size(self._ctx))

    def kv_cache_bytes(self) -> int:
        """What the KV cache of every slot takes once full: per slot, a context of keys and values
        (16-bit, llama.cpp's default) for each layer's key/value heads."""
        ll, m = self._ll, self._model
        head_dim = int(ll.llama_model_n_embd(m)) // int(ll.llama_model_n_head(m))
        per_token = int(ll.llama_model_n_layer(m)) * 2 * int(ll.llama_model_n_head_kv(m)) * head_dim * 2
        return self.slots * self._n_ctx * per_token

    def close(self) -> None:
        if getattr(self, "steps", None) is not None:
            self.steps.free()
        if getattr(self, "_ctx", None):
            self._ll.llama_free(self._ctx)
            self._ctx = None
        if getattr(self, "_model", None):
            self._ll.llama_model_free(self._model)
            self._model = None

    def __del__(self) -> None:  # pragma: no cover - interpreter shutdown order varies
        with contextlib.suppress(Exception):
            self.close()

    # -- text -----------------------------------------------------------------
    def _meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(1 << 16)
        n = self._ll.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace") if n >= 0 else None

    def _load_template(self) -> Any:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        source = self._ll.llama_model_chat_template(self._model, None)
        if not source:
            raise ModelLoadError(
                f"{self.source} has no chat template; ISAGI needs an instruction-tuned (chat) model."
            )

        def raise_exception(message: str) -> None:
            from jinja2.exceptions import TemplateError

            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = raise_exception
        return env.from_string(source.decode("utf-8") if isinstance(source, bytes) else source)

    def _piece(self, token: int, special: bool = False) -> bytes:
        if not special:
            got = self._pieces.get(token)
            if got is None:
                got = self._pieces[token] = self._piece_of(token, False)
            return got
        return self._piece_of(token, special)

    def _piece_of(self, token: int, special: bool) -> bytes:
        buf = ctypes.create_string_buffer(256)
        n = self._ll.llama_token_to_piece(self._vocab, int(token), buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = self._ll.llama_token_to_piece(self._vocab, int(token), buf, len(buf), 0, special)
        return buf.raw[:n]

    def tokenize(self, text: str, *, special: bool = True) -> list[int]:
        data = text.encode("utf-8", "surrogatepass")
        cap = len(data) + 16
        buf = (self._ll.llama_token * cap)()
        n = self._ll.llama_tokenize(self._vocab, data, len(data), buf, cap, False, special)
        if n < 0:
            cap = -n
            buf = (self._ll.llama_token * cap)()
            n = self._ll.llama_tokenize(self._vocab, data, len(data), buf, cap, False, special)
        return [int(t) for t in buf[:n]]

    def chat_text(self, messages: list[dict[str, str]]) -> str:
        eos = self._piece(self._ll.llama_vocab_eos(self._vocab), special=True).decode("utf-8", "replace")
        bos = self._piece(self._ll.llama_vocab_bos(self._vocab), special=True).decode("utf-8", "replace")
        return self._template.render(messages=messages, add_generation_prompt=True, bos_token=bos, eos_token=eos)

    def chat_tokens(self, messages: list[dict[str, str]]) -> list[int]:
        return self.tokenize(self.chat_text(messages), special=True)

    def content_span(self, messages: list[dict[str, str]]) -> tuple[int, int]:
        from isagi.engines.base import span_by_difference

        return span_by_difference(self.chat_tokens(messages),
                                  self.chat_tokens([*messages[:-1], {**messages[-1], "content": ""}]))

    def count_tokens(self, text: str) -> int:
        return len(self.tokenize(text, special=False))

    def detokenize(self, ids: list[int]) -> str:
        return b"".join(self._piece(t) for t in ids).decode("utf-8", "replace")

    # -- compute --------------------------------------------------------------
    def _clear(self, owner: object | None) -> None:
        # metadata only: zeroing the KV buffers (data=True) cost ~1 ms a call and nothing reads them
        self._ll.llama_memory_clear(self._mem, False)
        self.owner = owner

    # -- slots (several sequences: isagi.engines.llamacpp_steps) -------------------
    def _take_slot(self, owner: object, *, all_of_them: bool = False) -> int:
        """A free sequence for ``owner`` (waits until one is free), emptied; ``all_of_them``: every
        sequence (a steered decoding: the control vector acts on the whole context)."""
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
        seq = min(taken)
        with self.lock:
            self._ll.llama_memory_seq_rm(self._mem, seq, -1, -1)
        return seq

    def _slot_eval(self, ids: list[int], *, capture: dict[bytes, int] | None, truncate: bool = False,
                   logits: str = "none") -> Any:
        """Evaluate ``ids`` from position 0 in a free sequence, then empty and free it (several slots)."""
        from isagi.engines.llamacpp_steps import Step

        owner = object()
        seq = self._take_slot(owner)
        try:
            step = self.steps.run(Step(seq, ids, 0, logits=logits, capture=capture, truncate=truncate))
            return step
        finally:
            with self.lock:
                self._ll.llama_memory_seq_rm(self._mem, seq, -1, -1)
            self._give_slot(owner)

    def _give_slot(self, owner: object) -> None:
        """Every sequence ``owner`` holds, free again."""
        with self._slots_cv:
            for seq, held in list(self._slot_owner.items()):
                if held is owner:
                    del self._slot_owner[seq]
                    heapq.heappush(self._free, seq)
            self._slots_cv.notify_all()

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
        """Load the saved KV cache sharing the longest prefix with ``ids`` into the (cleared)
        sequence 0, cut to that prefix or ``limit`` tokens; returns how many leading tokens
        need no evaluation (never all of them: the last prompt token is evaluated for its logits).

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

    def _decode(self, ids: list[int], start: int, *, capture: dict[bytes, int] | None, all_logits: bool = False,
                truncate: bool = False) -> dict[int, np.ndarray]:
        """Evaluate ``ids`` at positions ``start...`` in sequence 0; states (n, d) of the captured layers.

        ``truncate``: stop computing once the captured layers are read; the KV cache
        above them and the logits are then left unwritten, so only for states alone.
        """
        with self.lock:
            return self._decode_locked(ids, start, capture=capture, all_logits=all_logits, truncate=truncate)

    def _decode_token(self, token: int, capture: dict[bytes, int] | None) -> dict[int, np.ndarray]:
        """:meth:`_decode` of one token at the sequence's next position (a fed-back reply token),
        without the batching: the per-token path of every reply, kept lean."""
        ll, cap = self._ll, self._capture
        with self.lock:
            if capture:
                cap.start(capture, 1)
            self._one_id[0] = token
            try:
                status = int(on_llama_thread(ll.llama_decode, self._ctx, self._one_batch))
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
                       truncate: bool = False) -> dict[int, np.ndarray]:
        rows: dict[int, list[np.ndarray]] = {layer: [] for layer in (capture or {}).values()}
        n_batch = 512
        for off in range(0, len(ids), n_batch):
            chunk = ids[off : off + n_batch]
            if capture:
                self._capture.start(capture, len(chunk), truncate=truncate)
            try:
                status = self._run_batch(chunk, start + off, all_logits=all_logits, last=off + len(chunk) == len(ids))
            finally:
                self._capture.stop()
            self._check(status, capture)
            self._evaluated += len(chunk)
            for layer, got in (self._capture.rows().items() if capture else ()):
                rows[layer].append(got)
        return {layer: np.concatenate(parts) if len(parts) > 1 else parts[0] for layer, parts in rows.items() if parts}

    def _run_batch(self, chunk: list[int], pos: int, *, all_logits: bool, last: bool) -> int:
        ll = self._ll
        if not all_logits:  # positions follow the sequence; logits for the last token only
            arr = (ll.llama_token * len(chunk))(*chunk)
            return int(on_llama_thread(ll.llama_decode, self._ctx, ll.llama_batch_get_one(arr, len(chunk))))
        batch = ll.llama_batch_init(len(chunk), 0, 1)
        try:
            for i, tok in enumerate(chunk):
                batch.token[i] = tok
                batch.pos[i] = pos + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = True
            batch.n_tokens = len(chunk)
            return int(on_llama_thread(ll.llama_decode, self._ctx, batch))
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

    def generation(
        self,
        messages: list[dict[str, str]],
        layer: int,
        options: GenerationOptions | None = None,
        *,
        also_capture: tuple[int, ...] = (),
        steer: np.ndarray | None = None,
        reuse_prefix: int = 0,
        states_only: bool = False,
        context_shift: bool = False,
        capture_reply: bool = True,
    ) -> LlamaCppDecoding:
        """See the protocol; ``capture_reply=False`` (benchmarks) decodes without reading reply states."""
        return LlamaCppDecoding(self, self.chat_tokens(messages), layer, options, also_capture=also_capture,
                                steer=steer, reuse_prefix=reuse_prefix, states_only=states_only,
                                context_shift=context_shift, capture_reply=capture_reply)

    def iter_prompt_states(
        self,
        chats: list[list[dict[str, str]]],
        layers: list[int],
        *,
        batch_size: int = 16,
        progress: Callable[[int], None] | None = None,
    ) -> Iterator[dict[int, np.ndarray]]:
        for layer in layers:
            self.check_layer(layer)
        names = self._names(layers)
        if self.slots > 1:
            for chat in chats:
                yield self._slot_eval(self.chat_tokens(chat), capture=names, truncate=True).out_states
                if progress is not None:  # one prompt at a time: progress moves with every prompt
                    progress(1)
            return
        # One sequence: each prompt's leading tokens shared with the previous prompt (the system
        # prompt at least) stay in the KV cache and keep their states (a causal model's state at a
        # position depends only on the tokens up to it), so only the rest is evaluated.
        prev: list[int] = []
        prev_states: dict[int, np.ndarray] = {}
        mine = object()  # the cache is this loop's while it owns it; a decode in between takes it
        try:
            for chat in chats:
                ids = self.chat_tokens(chat)
                if self.owner is not mine:
                    self._clear(mine)
                    prev = []
                shared = 0
                for a, b in zip(ids, prev, strict=False):
                    if a != b:
                        break
                    shared += 1
                if shared == len(ids):
                    states = {layer: v[:shared] for layer, v in prev_states.items()}
                else:
                    with self.lock:
                        self._ll.llama_memory_seq_rm(self._mem, 0, shared, -1)
                    new = self._decode(ids[shared:], shared, capture=names, truncate=True)
                    states = {layer: np.concatenate([prev_states[layer][:shared], new[layer]]) if shared else new[layer]
                              for layer in new}
                prev, prev_states = ids, states
                yield states
                if progress is not None:  # one prompt at a time: progress moves with every prompt
                    progress(1)
        finally:
            if self.owner is mine:
                self._clear(None)  # a truncated cache holds no layer above the captured ones

    def reply_states(
        self, chats: list[list[dict[str, str]]], layer: int, *, max_new_tokens: int = 24, batch_size: int = 16
    ) -> list[np.ndarray]:
        """Greedy replies to ``chats`` and their ``layer`` states; with several slots, up to one
        reply per slot decodes at once (a thread each), each the reply it gets alone."""

        def one(chat: list[dict[str, str]]) -> np.ndarray:
            with self.generation(chat, layer, GenerationOptions(max_new_tokens=max_new_tokens)) as gen:
                for _ in gen.stream():
                    pass
                return gen.reply_hidden(layer)

        width = min(self.slots, len(chats))
        if width <= 1:
            return [one(chat) for chat in chats]
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=width, thread_name_prefix="isagi-reply") as pool:
            return list(pool.map(one, chats))

    def reply_nll(self, messages: list[dict[str, str]], reply_ids: list[int]) -> float:
        if not reply_ids:
            return math.inf
        prompt = self.chat_tokens(messages)
        ids = prompt + list(reply_ids)
        if self.slots > 1:
            rows = self._slot_eval(ids, capture=None, logits="all").out_logits
            assert rows is not None
            logit_of = rows.__getitem__
        else:
            self._clear(None)
            self._decode(ids, 0, capture=None, all_logits=True)
            logit_of = self._logits
        total = 0.0
        for j, tok in enumerate(reply_ids):
            logits = logit_of(len(prompt) - 1 + j).astype(np.float64)
            top = logits.max()
            total += float(top + math.log(np.exp(logits - top).sum()) - logits[tok])
        return total / len(reply_ids)


class _Utf8Stream:
    """Bytes of token pieces to text deltas, holding back a split UTF-8 character."""

    def __init__(self) -> None:
        self.pending = b""
        self.text = ""

    def push(self, piece: bytes) -> str:
        data = self.pending + piece
        for cut in range(len(data), max(len(data) - 4, -1), -1):
            try:
                delta = data[:cut].decode("utf-8")
            except UnicodeDecodeError:
                continue
            self.pending = data[cut:]
            self.text += delta
            return delta
        delta = data.decode("utf-8", "replace")  # not a split character: genuinely invalid bytes
        self.pending = b""
        self.text += delta
        return delta


class LlamaCppDecoding:
    """One reply in the engine's context: a single prefill, then decoding from its KV cache."""

    def __init__(
        self,
        engine: LlamaCppEngine,
        ids: list[int],
        layer: int,
        options: GenerationOptions | None = None,
        *,
        also_capture: tuple[int, ...] = (),
        steer: np.ndarray | None = None,
        reuse_prefix: int = 0,
        states_only: bool = False,
        context_shift: bool = False,
        capture_reply: bool = True,
    ) -> None:
        engine.check_layer(layer)
        for extra in also_capture:
            engine.check_layer(int(extra))
        self.engine = engine
        self.ids = list(ids)
        self.layer = int(layer)
        self.layers = sorted({self.layer, *(int(x) for x in also_capture)})
        self.options = options or GenerationOptions()
        self.steer = None if steer is None else np.asarray(steer, dtype=np.float32).reshape(-1)
        self.new_ids: list[int] = []
        self.finish_reason: str | None = None
        self._stop = threading.Event()
        self._prompt: dict[int, np.ndarray] | None = None
        self._reply: dict[int, list[np.ndarray]] = {layer: [] for layer in self.layers}
        self._utf8 = _Utf8Stream()
        self._sampler: Any = None
        self._entered = False
        self._steering = False
        self.capture_reply = capture_reply
        # the prefill stops after the last captured layer: the KV cache above it and the logits
        # stay unwritten, so nothing is decoded from it and it is never saved as a prefix
        self.states_only = states_only
        # a saved KV cache may stand in for a shared prefix (never under steering: its KV differs)
        self.reuse_prefix = int(reuse_prefix) if self.steer is None else 0
        self.context_shift = context_shift
        self._prompt_start = 0  # prompt positions before this came from a saved KV cache
        self._kv_len = 0  # tokens (prompt, then fed-back reply) in the KV cache
        # several slots: this decoding's sequence, and the logits of its last evaluated token
        self._multi = engine.slots > 1
        self.seq: int | None = None
        self._next_logits: np.ndarray | None = None
        self._candidates: np.ndarray | None = None  # the sampler's token data (several slots)

    # -- lifetime -------------------------------------------------------------
    def __enter__(self) -> LlamaCppDecoding:
        self._entered = True
        try:
            if self.steer is not None:
                if self._multi:  # the control vector acts on the whole context: every slot
                    self.seq = self.engine._take_slot(self, all_of_them=True)
                self._set_steer(self.steer)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        """The context's control vector and the sampler released; the cache this decoding
        filled (its sequence) kept as a prefix for prompts that extend it, then emptied (with
        several slots, the sequence is freed for another decoding)."""
        if not self._entered:
            return
        e = self.engine
        try:
            if self._steering:
                e._ll.llama_set_adapter_cvec(e._ctx, None, 0, e.hidden_size, -1, -1)
                self._steering = False
            if self._sampler is not None:
                e._ll.llama_sampler_free(self._sampler)
                self._sampler = None
            # (steered or states only: no prefix either)
            keep = bool(self._kv_len) and self.steer is None and not self.states_only
            if self._multi and self.seq is not None:
                if keep:
                    e._save_prefix((self.ids + self.new_ids)[: self._kv_len], seq=self.seq)
                with e.lock:
                    e._ll.llama_memory_seq_rm(e._mem, self.seq, -1, -1)
            elif not self._multi and e.owner is self:
                if keep:
                    e._save_prefix((self.ids + self.new_ids)[: self._kv_len])
                e._clear(None)
        finally:
            if self._multi:
                e._give_slot(self)
                self.seq = None
            self._entered = False

    def _set_steer(self, vector: np.ndarray) -> None:
        e = self.engine
        if self.layer < 2:
            from isagi.errors import ConfigError

            raise ConfigError("llama.cpp cannot steer layer 1 (block 0 has no control vector); use a layer >= 2.")
        if vector.shape != (e.hidden_size,):
            raise ValueError(f"steering vector has shape {vector.shape}, expected ({e.hidden_size},)")
        il = self.layer - 1
        data = np.zeros(e.hidden_size * il, dtype=np.float32)  # slots for il = 1..il
        data[e.hidden_size * (il - 1) :] = vector
        ptr = data.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        if e._ll.llama_set_adapter_cvec(e._ctx, ptr, data.size, e.hidden_size, il, il) != 0:
            raise RuntimeError("llama.cpp refused the control vector")
        self._steering = True

    def _unsteer(self, layer: int, states: np.ndarray) -> np.ndarray:
        if self.steer is not None and layer == self.layer:
            return states - self.steer
        return states

    # -- the protocol ---------------------------------------------------------
    @property
    def prompt_tokens(self) -> int:
        return len(self.ids)

    @property
    def text(self) -> str:
        return self._utf8.text

    def stop(self) -> None:
        self._stop.set()

    def prefill(self) -> np.ndarray:
        assert self._entered, "use the decoding inside a with block"
        if self._multi:
            return self._prefill_slot()
        e = self.engine
        e._clear(self)
        start = e._restore_prefix(self.ids, self.reuse_prefix, shift=self.context_shift) if self.reuse_prefix else 0
        states = e._decode(self.ids[start:], start, capture=e._names(self.layers), truncate=self.states_only)
        self._prompt_start, self._kv_len = start, len(self.ids)
        self._prompt = {layer: self._unsteer(layer, s) for layer, s in states.items()}
        return last_token(self._prompt[self.layer])

    def _prefill_slot(self) -> np.ndarray:
        """:meth:`prefill` in a sequence of its own (several slots), through the engine's step runner."""
        from isagi.engines.llamacpp_steps import Step

        e = self.engine
        if self.seq is None:
            self.seq = e._take_slot(self)
        else:  # a steered decoding holds its slots from __enter__; a second prefill starts afresh
            with e.lock:
                e._ll.llama_memory_seq_rm(e._mem, self.seq, -1, -1)
        start = (e._restore_prefix(self.ids, self.reuse_prefix, shift=self.context_shift, seq=self.seq)
                 if self.reuse_prefix else 0)
        step = e.steps.run(Step(self.seq, self.ids[start:], start, logits="none" if self.states_only else "last",
                                capture=e._names(self.layers), truncate=self.states_only))
        self._next_logits = None if step.out_logits is None else step.out_logits[-1]
        self._prompt_start, self._kv_len = start, len(self.ids)
        self._prompt = {layer: self._unsteer(layer, st) for layer, st in step.out_states.items()}
        return last_token(self._prompt[self.layer])

    def _sample(self, logits: np.ndarray) -> int:
        """The sampler chain's token for ``logits`` (several slots: the context's own last logits
        belong to whichever step ran last, so the chain is applied to this decoding's copy)."""
        ll, n = self.engine._ll, self.engine.vocab_size
        if self._candidates is None:
            self._candidates = np.zeros(n, dtype=np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")]))
        cand = self._candidates
        cand["id"] = np.arange(n, dtype=np.int32)
        cand["logit"] = logits
        cand["p"] = 0.0
        arr = ll.llama_token_data_array(data=cand.ctypes.data_as(ctypes.POINTER(ll.llama_token_data)),
                                        size=n, selected=-1, sorted=False)
        ll.llama_sampler_apply(self._sampler, ctypes.byref(arr))
        token = int(arr.data[arr.selected].id)
        ll.llama_sampler_accept(self._sampler, token)
        return token

    def _evaluated_states(self, layer: int | None) -> np.ndarray:
        """States of the prompt positions this decoding evaluated (from ``_prompt_start``)."""
        assert self._prompt is not None, "call prefill() first"
        layer = self.layer if layer is None else int(layer)
        if layer not in self._prompt:
            raise ValueError(f"layer {layer} is not captured: pass it in also_capture")
        return self._prompt[layer]

    def prompt_states(self, layer: int | None = None) -> np.ndarray:
        states = self._evaluated_states(layer)
        if self._prompt_start:
            raise ValueError(f"the first {self._prompt_start} prompt tokens came from a saved KV cache "
                             "(reuse_prefix): their states were not computed")
        return states

    def prompt_state(self, layer: int | None = None, span: tuple[int, int] | None = None) -> np.ndarray:
        states = self._evaluated_states(layer)
        if span is None:
            return last_token(states)
        if span[0] < self._prompt_start:
            raise ValueError(f"span {span} starts inside the {self._prompt_start} prompt tokens taken from a "
                             "saved KV cache (reuse_prefix): their states were not computed")
        return span_mean(states, (span[0] - self._prompt_start, span[1] - self._prompt_start))

    def last_hidden(self) -> np.ndarray:
        got = self._reply[self.layer]
        return got[-1][0] if got else self.prompt_state()

    def reply_hidden(self, layer: int | None = None) -> np.ndarray:
        layer = self.layer if layer is None else int(layer)
        if layer not in self._reply:
            raise ValueError(f"layer {layer} is not captured: pass it in also_capture")
        got = self._reply[layer]
        if not got:
            return np.zeros((0, self.engine.hidden_size), dtype=np.float32)
        return np.concatenate(got)

    def _make_sampler(self) -> Any:
        ll, opts = self.engine._ll, self.options
        chain = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
        if opts.ignore_eos:
            stops = sorted(self.engine.stop_token_ids)
            bias = (ll.llama_logit_bias * len(stops))(*[ll.llama_logit_bias(t, -math.inf) for t in stops])
            ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_logit_bias(self.engine.vocab_size, len(stops), bias))
        if opts.repetition_penalty != 1.0:
            ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_penalties(64, opts.repetition_penalty, 0.0, 0.0))
        if opts.do_sample:
            if opts.top_k > 0:
                ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_top_k(opts.top_k))
            if opts.top_p < 1.0:
                ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_top_p(opts.top_p, 1))
            ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_temp(opts.temperature))
            seed = opts.seed if opts.seed is not None else int.from_bytes(os.urandom(4), "little")
            ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_dist(seed & 0xFFFFFFFF))
        else:
            ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_greedy())
        return chain

    def stream(self) -> Iterator[TokenEvent]:
        """Decode from the prefill's cache; every fed-back reply token is captured at the layers asked for."""
        assert self._entered, "use the decoding inside a with block"
        e = self.engine
        if self._prompt is None:
            self.prefill()
        owner = e._slot_owner.get(self.seq) if self._multi and self.seq is not None else e.owner
        if owner is not self:
            raise RuntimeError("another decoding used the model since this prefill; open a new one")
        if self.states_only:
            raise RuntimeError("this decoding was opened with states_only=True: open another to decode")
        opts = self.options
        # plain greedy decoding is the argmax of the logits (the first one on a tie, as llama.cpp's
        # greedy sampler); anything else goes through llama.cpp's sampler chain
        greedy = not (opts.do_sample or opts.ignore_eos or opts.repetition_penalty != 1.0)
        if self._sampler is None and not greedy:
            self._sampler = self._make_sampler()
        stop_ids = set() if opts.ignore_eos else e.stop_token_ids
        names = e._names(self.layers) if self.capture_reply else None
        pos = len(self.ids)
        if self._multi:
            e.steps.open(self.seq)  # type: ignore[arg-type]  # (_multi: seq is held) the step runner waits (a moment) for this sequence's tokens
        try:
            while True:
                if self._stop.is_set():
                    self.finish_reason = "cancelled"
                    return
                if len(self.new_ids) >= opts.max_new_tokens:
                    self.finish_reason = "length"
                    return
                token = self._next_token(greedy)
                if token in stop_ids:
                    self.finish_reason = "stop"
                    return
                self.new_ids.append(token)
                yield TokenEvent(self._utf8.push(e._piece(token)), token)
                if len(self.new_ids) >= opts.max_new_tokens or self._stop.is_set():
                    continue  # no forward pass for a token that will not be continued
                if pos >= e.context_length:
                    self.finish_reason = "length"
                    return
                states = self._feed(token, pos, names)
                pos += 1
                self._kv_len = pos
                for layer, st in states.items():
                    self._reply[layer].append(self._unsteer(layer, st))
        finally:
            if self._multi:
                e.steps.close(self.seq)  # type: ignore[arg-type]  # (_multi: seq is held)

    def _next_token(self, greedy: bool) -> int:
        """The next reply token: the argmax of the last logits, or the sampler chain's choice."""
        e = self.engine
        if self._multi:  # this sequence's own logits row (the context's belong to the last step)
            assert self._next_logits is not None, "a prefill with logits comes first"
            return int(np.argmax(self._next_logits)) if greedy else self._sample(self._next_logits)
        if greedy:
            return int(np.argmax(e._logits()))
        return int(e._ll.llama_sampler_sample(self._sampler, e._ctx, -1))

    def _feed(self, token: int, pos: int, names: dict[bytes, int] | None) -> dict[int, np.ndarray]:
        """Evaluate ``token`` at ``pos``; the states captured (several slots: one step of the
        engine's step runner, decoded in one batch with the other sequences' tokens)."""
        from isagi.engines.llamacpp_steps import Step

        e = self.engine
        if not self._multi:
            return e._decode_token(token, names)
        step = e.steps.run(Step(self.seq, [token], pos, capture=names))  # type: ignore[arg-type]  # (_multi: seq is held)
        assert step.out_logits is not None
        self._next_logits = step.out_logits[-1]
        return step.out_states
