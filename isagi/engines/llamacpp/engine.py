"""The llama.cpp engine: a GGUF on the CPU behind the ModelEngine protocol.

Owns :class:`LlamaCppEngine`, what the rest of ISAGI holds: it loads the model
and opens its one context (:mod:`isagi.engines.llamacpp.load`), states the
model's facts (layers, width, context, stop tokens, memory), opens decodings
(:mod:`isagi.engines.llamacpp.decoding`) and runs the batched passes that
calibration and the evaluations ask for: prompt states, greedy replies with
their states, a reply's mean negative log-likelihood. The engine's other
methods come from mixins that each own one part of the engine: its text
(:mod:`isagi.engines.llamacpp.text`), its forward passes with layer capture
(:mod:`isagi.engines.llamacpp.forward`) and the KV cache's sequences, slots
and saved prefixes (:mod:`isagi.engines.llamacpp.sequences`). An engine may
be used from several threads; ``lock`` keeps llama.cpp to one
``llama_decode`` (or KV cache change) at a time, and with several slots the
step runner (:mod:`isagi.engines.llamacpp_steps`) batches the replies' tokens.

Prompt states for calibration (:meth:`LlamaCppEngine.iter_prompt_states`)
keep, with one sequence, the KV cache of each prompt's leading tokens shared
with the previous prompt (the system prompt at least): a causal model's state
at a position depends only on the tokens up to it, so only the rest is
evaluated.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np

from isagi.engines.base import GenerationOptions, check_layer, layer_list
from isagi.engines.kv_prefix import PrefixStore
from isagi.engines.llamacpp.batched import BatchedPasses
from isagi.engines.llamacpp.decoding import LlamaCppDecoding
from isagi.engines.llamacpp.forward import ForwardPasses
from isagi.engines.llamacpp.load import load_model, model_quant, open_context, start_backend
from isagi.engines.llamacpp.sequences import Sequences
from isagi.engines.llamacpp.text import ChatText

log = logging.getLogger(__name__)

CLOSE_SETTLE_S = 10.0  # how long closing the engine waits for closed decodings' sequences to be emptied


class LlamaCppEngine(ChatText, ForwardPasses, Sequences, BatchedPasses):
    """A GGUF model in one llama.cpp context (the design: the docstrings of the modules of
    :mod:`isagi.engines.llamacpp`)."""

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
        adapt_threads: bool = True,
    ) -> None:
        import llama_cpp

        self._ll = ll = llama_cpp
        start_backend(ll)
        self.model_id, self.source, self.fingerprint = model_id, str(path), fingerprint
        self.backend_reason = backend_reason
        self.n_threads = int(n_threads or os.cpu_count() or 1)
        self.device_reason = f"llama.cpp runs GGUF models on the CPU ({self.n_threads} threads" + (
            ", one while decodes on them run slow)" if adapt_threads and self.n_threads > 1 else ")")
        self._model = load_model(ll, path)
        self._vocab = ll.llama_model_get_vocab(self._model)
        self._n_vocab = int(ll.llama_vocab_n_tokens(self._vocab))
        self._n_embd = int(ll.llama_model_n_embd(self._model))
        self._n_layer = int(ll.llama_model_n_layer(self._model))
        self._n_ctx_train = int(ll.llama_model_n_ctx_train(self._model))
        self.quant = model_quant(ll, self._model)
        from isagi.engines.layer_capture import LayerCapture

        self._capture = LayerCapture(self._n_embd)
        self._cb = ll.ggml_backend_sched_eval_callback(self._capture.pointer)  # kept alive with the engine
        from isagi.engines.llamacpp.abort import PromptAbort

        self._abort = PromptAbort()
        self._abort_cb = ll.ggml_abort_callback(self._abort.pointer)  # kept alive with the engine
        self._n_ctx = min(n_ctx, self._n_ctx_train) if self._n_ctx_train > 0 else n_ctx
        self.slots = max(1, int(slots))
        self._ctx = open_context(ll, self._model, n_ctx=self._n_ctx, slots=self.slots, n_threads=self.n_threads,
                                 cb_eval=self._cb, cb_eval_user_data=self._capture.user_data, path=path,
                                 abort=self._abort_cb, abort_user_data=self._abort.user_data)
        self._mem = ll.llama_get_memory(self._ctx)
        from isagi.engines.llamacpp.threads import AdaptiveThreads
        from isagi.engines.llamacpp_steps import StepRunner

        # every llama_decode of the context, by either path, on the count its policy chooses
        self.decoder = AdaptiveThreads(ll, self._ctx, self._abort, self._capture, self.n_threads, adapt=adapt_threads)

        self.lock = threading.Lock()  # one llama_decode at a time; never held across a yield
        self.steps = StepRunner(ll, self._ctx, self._capture, self._n_vocab, n_seq_max=self.slots, lock=self.lock,
                                abort=self._abort, decoder=self.decoder)
        # Free sequences, a heap (several slots only): a turn takes the lowest. llama.cpp's
        # attention over a batch spans every KV stream from its lowest sequence to its highest,
        # so the sequences in use are kept together at the bottom.
        self._free = list(range(self.slots))
        self._slot_owner: dict[int, object] = {}
        self._slots_cv = threading.Condition()
        self._wanting_all = 0  # steered decodings waiting for every slot
        self._closing: set[threading.Event] = set()
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
        self._tokenized: OrderedDict[tuple[str, bool], tuple[int, ...]] = OrderedDict()
        self._tokenized_lock = threading.Lock()
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
            # no job may use the context once it is freed: one still queued after the wait (at
            # interpreter exit the llama.cpp thread may be gone) keeps the context, not freed
            if getattr(self, "_closing", None) and not self.settle(timeout=CLOSE_SETTLE_S):
                log.warning("closing the llama.cpp engine: a closed decoding's KV cache upkeep is still queued; "
                            "the context is left as it is")
                return
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

    # -- decodings and batched passes -----------------------------------------
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
        stop: threading.Event | None = None,
        reply_prefix: str = "",
    ) -> LlamaCppDecoding:
        """See the protocol; ``capture_reply=False`` (benchmarks) decodes without reading reply states."""
        ids = self.chat_tokens(messages)
        if reply_prefix:  # an open reply (Continue): its own tokens after the prompt, no special tokens
            ids += self.tokenize(reply_prefix, special=False)
        return LlamaCppDecoding(self, ids, layer, options, also_capture=also_capture,
                                steer=steer, reuse_prefix=reuse_prefix, states_only=states_only,
                                context_shift=context_shift, capture_reply=capture_reply, stop=stop)

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
        # One slot: groups of prompts side by side, their common prefix evaluated once and kept
        # from group to group (isagi.engines.llamacpp.batched)
        token_lists = [self.chat_tokens(chat) for chat in chats]
        for group, states in self.in_groups(token_lists, width=batch_size, extra=0,
                                            run=lambda ids, held: self.grouped_prompt_states(ids, names, held)):
            yield from states
            if progress is not None:
                progress(len(group))

    def reply_states(
        self, chats: list[list[dict[str, str]]], layer: int | Sequence[int], *, max_new_tokens: int = 24,
        batch_size: int = 16,
    ) -> list[np.ndarray]:
        """Greedy replies to ``chats`` and their ``layer`` states (several layers: side by side).
        One slot: up to ``batch_size`` replies side by side in groups (:mod:`isagi.engines.llamacpp.batched`),
        each the same kind of reply as alone, not always the same bytes; several slots: a reply per
        slot at once (a thread each), each the reply it gets alone."""
        layers = layer_list(layer)
        if self.slots == 1:
            for layer_ in layers:
                self.check_layer(layer_)
            names, stops = self._names(layers), self.stop_token_ids
            replies = self.in_groups([self.chat_tokens(chat) for chat in chats], width=batch_size, extra=max_new_tokens,
                                     run=lambda ids, held: self.grouped_replies(ids, names, max_new_tokens, stops, held))
            return [np.concatenate([got[x] for x in layers], axis=1) for _group, part in replies for got in part]

        def one(chat: list[dict[str, str]]) -> np.ndarray:
            options = GenerationOptions(max_new_tokens=max_new_tokens)
            with self.generation(chat, layers[-1], options, also_capture=tuple(layers[:-1])) as gen:
                for _ in gen.stream():
                    pass
                return np.concatenate([gen.reply_hidden(x) for x in layers], axis=1)

        width = min(self.slots, len(chats))
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=width, thread_name_prefix="isagi-reply") as pool:
            return list(pool.map(one, chats))

    def reply_logits(self, messages: list[dict[str, str]], reply_ids: list[int]) -> np.ndarray:
        """The logits (len(reply_ids), vocab) each token of ``reply_ids`` follows after ``messages``:
        the prompt and the reply evaluated in one go (unsteered, float32 copies)."""
        prompt = self.chat_tokens(messages)
        ids = prompt + list(reply_ids)
        first = len(prompt) - 1
        if self.slots > 1:
            every = self._slot_eval(ids, capture=None, logits="all").out_logits
            assert every is not None
            return np.array(every[first:first + len(reply_ids)], dtype=np.float32)
        self._clear(None)
        self._decode(prompt[:-1], 0, capture=None)
        rows: list[np.ndarray] = []
        tail = ids[first : first + len(reply_ids)]  # the tokens whose logits choose the reply's
        for off in range(0, len(tail), 512):  # one llama_decode's outputs at a time
            chunk = tail[off : off + 512]
            with self.lock:
                self._decode_locked(chunk, first + off, capture=None, all_logits=True)
                rows += [self._logits(i).copy() for i in range(len(chunk))]
        return np.stack(rows)

    def reply_nll(self, messages: list[dict[str, str]], reply_ids: list[int]) -> float:
        if not reply_ids:
            return math.inf
        total = 0.0
        for tok, row in zip(reply_ids, self.reply_logits(messages, reply_ids), strict=True):
            logits = row.astype(np.float64)
            top = logits.max()
            total += float(top + math.log(np.exp(logits - top).sum()) - logits[tok])
        return total / len(reply_ids)
