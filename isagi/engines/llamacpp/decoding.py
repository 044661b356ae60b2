"""One reply in the llama.cpp engine's context: its prefill, then decoding from its KV cache.

Owns a decoding's life (:class:`LlamaCppDecoding`, a context manager): the
prompt evaluated once with its states read at the layers asked for, then one
reply token at a time fed back and read at the same layers; the next token is
the argmax of the logits (plain greedy decoding, as llama.cpp's greedy sampler)
or llama.cpp's sampler chain (sampling, penalties, a banned end of text);
cancelling between tokens (and the turn's Stop ending the prompt's evaluation,
:mod:`isagi.engines.llamacpp.abort`); steering; and, with several slots, the sequence it
holds and its own copy of its last logits. What it takes it gives back in
``__exit__`` (a ``finally``): the control vector and the sampler freed, its KV
cache kept as a prefix (:mod:`isagi.engines.llamacpp.sequences`) and emptied,
its sequence freed. Kept apart from the engine because one engine runs many
decodings, one after another or (several slots) at once.

Steering: ``llama_set_adapter_cvec`` adds a vector to ``l_out-<il>`` for
``il_start <= il <= il_end``; its buffer starts at ``il = 1`` (block 0 has no
control tensor), so ISAGI's layer ``L`` (>= 2) is slot ``L - 2`` of the
buffer. The captured state at a steered layer is read after the vector is
added; the decoding subtracts it again, so states mean what the transformers
engine's capture hook sees (before its steering hook). The control vector acts
on the whole context, so with several slots a steered decoding holds them all.
"""

from __future__ import annotations

import ctypes
import math
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from isagi.engines.base import GenerationOptions, PrefillStopped, TokenEvent
from isagi.engines.llamacpp.abort import StopWatch
from isagi.engines.llamacpp.text import Utf8Stream
from isagi.manifold.pooling import last_token, span_mean


class LlamaCppDecoding:
    """One reply in the engine's context: a single prefill, then decoding from its KV cache."""

    def __init__(
        self,
        engine: Any,  # the LlamaCppEngine (its module imports this one; imports stay acyclic)
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
        stop: threading.Event | None = None,
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
        self.context_shifted = False  # the prefill's saved cache had a gap cut out (Sequences._cut)
        self._stop = threading.Event()
        self._turn_stop = stop  # the turn's Stop: also ends the prompt's evaluation between chunks
        self._prompt: dict[int, np.ndarray] | None = None
        self._reply: dict[int, list[np.ndarray]] = {layer: [] for layer in self.layers}
        self._utf8 = Utf8Stream()
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
        handed_over = False  # the slot goes back once the llama.cpp thread has saved and emptied it
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
                e._close_slot_later(self, self.seq, (self.ids + self.new_ids)[: self._kv_len] if keep else None)
                handed_over = True
            elif not self._multi and e.owner is self:
                if keep:
                    e._save_prefix((self.ids + self.new_ids)[: self._kv_len])
                e._clear(None)
        finally:
            if self._multi:
                if not handed_over:
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

    def _stopped(self) -> bool:
        return self._stop.is_set() or (self._turn_stop is not None and self._turn_stop.is_set())

    @contextmanager
    def _watching(self) -> Iterator[StopWatch | None]:
        """Around the prompt's evaluation: with the turn's Stop, a watch that ends it, between
        batches or inside one (:mod:`isagi.engines.llamacpp.abort`). A Stop ends it as
        :class:`PrefillStopped`, with nothing of the half-evaluated prompt kept as a prefix
        (``__exit__`` clears it)."""
        try:
            if self._turn_stop is None:
                yield None
            else:
                with self.engine._abort.watch(self._stopped) as stop:
                    yield stop
        except PrefillStopped:
            self._kv_len = 0
            self.finish_reason = "cancelled"
            raise

    def prefill(self) -> np.ndarray:
        assert self._entered, "use the decoding inside a with block"
        if self._multi:
            return self._prefill_slot()
        e = self.engine
        e._clear(self)
        shifts = e.context_shifts
        start = e._restore_prefix(self.ids, self.reuse_prefix, shift=self.context_shift) if self.reuse_prefix else 0
        self.context_shifted = e.context_shifts != shifts
        with self._watching() as stop:
            states = e._decode(self.ids[start:], start, capture=e._names(self.layers), truncate=self.states_only,
                               stop=stop)
        self._prompt_start, self._kv_len = start, len(self.ids)
        self._prompt = {layer: self._unsteer(layer, s) for layer, s in states.items()}
        return last_token(self._prompt[self.layer])

    def _prefill_slot(self) -> np.ndarray:
        """:meth:`prefill` in a sequence of its own (several slots), through the engine's step runner."""
        from isagi.engines.llamacpp_steps import Step

        e = self.engine
        if self.seq is None:  # (a steered decoding holds its slots from __enter__)
            self.seq = e._take_slot(self)
        seq = self.seq
        shifted: list[bool] = []

        def reuse() -> int:
            """On the llama.cpp thread: the sequence holds the reused prefix, else nothing (whatever
            it held before is dropped); how many leading tokens need no evaluation."""
            if not self.reuse_prefix:
                return e._empty(seq)
            shifts = e.context_shifts
            held = int(e._restore_prefix(self.ids, self.reuse_prefix, shift=self.context_shift, seq=seq))
            shifted.append(e.context_shifts != shifts)
            return held

        with self._watching() as stop:
            step = e.steps.run(Step(seq, list(self.ids), 0, logits="none" if self.states_only else "last",
                                    capture=e._names(self.layers), truncate=self.states_only, stop=stop,
                                    reuse=reuse))
        self.context_shifted = any(shifted)
        start = step.start
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
            e.steps.open(self.seq)  # the step runner waits (a moment) for this sequence's tokens
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
                e.steps.close(self.seq)

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
        assert self.seq is not None  # several slots: a decoding that feeds tokens holds one
        step = e.steps.run(Step(self.seq, [token], pos, capture=names))
        assert step.out_logits is not None
        self._next_logits = step.out_logits[-1]
        return step.out_states
