"""Generation with hidden-state capture and no wasted compute.

Owns the decoding loop of a turn. A :class:`Generation` runs the prompt's
prefill once with a capture hook on layer L and returns ``h`` (the hidden
state at the last prompt token). The caller then decides what to do (answer
from memory, refuse, or generate); if it generates, decoding continues from
the prefill's KV cache, so no token is computed twice, and the same hook keeps
each reply token's hidden state for the streaming safety check.

Also owns batched hidden states of many prompts (calibration) and streaming
text that never splits a UTF-8 character.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from isagi.engines.base import GenerationOptions, TokenEvent
from isagi.engines.hf.hooks import LayerCapture, capture_layer, steer_layer
from isagi.engines.hf.model import LoadedModel
from isagi.manifold.pooling import last_token, span_mean

__all__ = ["Generation", "GenerationOptions", "TokenEvent", "left_padded", "mask_positions", "pad_id",
           "prompt_hidden_states", "prompt_hidden_states_at"]


@dataclass
class _Detokenizer:
    """Turns a growing list of ids into text deltas, holding back partial characters."""

    tokenizer: Any
    ids: list[int] = field(default_factory=list)
    emitted: str = ""

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for more bytes
            return ""
        delta = text[len(self.emitted) :] if text.startswith(self.emitted) else text
        self.emitted = text
        return delta


def _logits_processors(options: GenerationOptions) -> Any:
    from transformers import (
        LogitsProcessorList,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    procs = LogitsProcessorList()
    if options.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(options.repetition_penalty))
    if options.do_sample:
        procs.append(TemperatureLogitsWarper(options.temperature))
        if options.top_k > 0:
            procs.append(TopKLogitsWarper(options.top_k))
        if options.top_p < 1.0:
            procs.append(TopPLogitsWarper(options.top_p))
    return procs


class Generation:
    """One reply: a single prefill, then decoding from its KV cache.

    Use as a context manager; the capture (and optional steering) hooks live
    exactly as long as the ``with`` block::

        with Generation(lm, ids, layer, options) as gen:
            h = gen.prefill()
            for event in gen.stream():
                ...
    """

    def __init__(
        self,
        lm: LoadedModel,
        input_ids: torch.Tensor,
        layer: int,
        options: GenerationOptions | None = None,
        *,
        steer: torch.Tensor | None = None,
        also_capture: tuple[int, ...] = (),
    ) -> None:
        self.lm = lm
        self.also_capture = tuple(sorted({int(x) for x in also_capture} - {int(layer)}))
        self.input_ids = input_ids
        self.layer = layer
        self.options = options or GenerationOptions()
        self.steer = steer
        self.new_ids: list[int] = []
        self.finish_reason: str | None = None
        self.context_shifted = False  # transformers evaluates every prompt whole
        self._stop = threading.Event()
        self._stack = ExitStack()
        self._capture: LayerCapture | None = None
        self._captures: dict[int, LayerCapture] = {}
        self._cache: Any = None
        self._logits: torch.Tensor | None = None
        self._detok = _Detokenizer(lm.tokenizer)

    def __enter__(self) -> Generation:
        # The whole prompt is kept at every captured layer: pooling happens above the engine seam.
        self._capture = self._stack.enter_context(capture_layer(self.lm.model, self.layer, keep_prefill=True))
        self._captures = {self.layer: self._capture}
        for extra in self.also_capture:  # same forward passes, one more hook each: no extra compute
            # The whole prompt is kept at these layers: the safety state pools over the message.
            self._captures[extra] = self._stack.enter_context(capture_layer(self.lm.model, extra, keep_prefill=True))
        if self.steer is not None:
            self._stack.enter_context(steer_layer(self.lm.model, self.layer, self.steer))
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()
        self._cache = None

    @property
    def prompt_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def text(self) -> str:
        return self._detok.emitted

    def stop(self) -> None:
        """Ask the decoding loop to end after the current token (thread-safe)."""
        self._stop.set()

    def prefill(self) -> np.ndarray:
        """Run the prompt once; return h (d,) at the last prompt token as float32."""
        from transformers import DynamicCache

        assert self._capture is not None, "use Generation inside a with block"
        self._cache = DynamicCache()
        with torch.inference_mode():
            out = self.lm.model(
                input_ids=self.input_ids, past_key_values=self._cache, use_cache=True, logits_to_keep=1
            )
        self._logits = out.logits[:, -1, :]
        return self._capture.last[-1][0].cpu().numpy()

    def last_hidden(self) -> np.ndarray:
        """Hidden state at the newest position seen (the last token fed to the model)."""
        assert self._capture is not None
        return self._capture.last[-1][0].cpu().numpy()

    def _capture_of(self, layer: int | None) -> LayerCapture:
        assert self._capture is not None, "use Generation inside a with block"
        if layer is None or layer == self.layer:
            return self._capture
        if layer not in self._captures:
            raise ValueError(f"layer {layer} is not captured: pass it in also_capture")
        return self._captures[layer]

    def prompt_states(self, layer: int | None = None) -> np.ndarray:
        """States (T, d) of every prompt token at ``layer`` (the main layer by default), after prefill."""
        cap = self._capture_of(layer)
        assert cap.prefill is not None, "call prefill() first"
        return cap.prefill[0].cpu().numpy()

    def prompt_state(self, layer: int | None = None, span: tuple[int, int] | None = None) -> np.ndarray:
        """h (d,) of the prompt at ``layer``: the last token's state, or the mean over ``span``
        (``[start, end)``, e.g. :meth:`LoadedModel.content_span`)."""
        states = self.prompt_states(layer)
        return last_token(states) if span is None else span_mean(states, span)

    def reply_hidden(self, layer: int | None = None) -> np.ndarray:
        """Hidden states (n, d) of the reply tokens fed so far (excludes the prompt), at ``layer``."""
        states = self._capture_of(layer).last[1:]
        if not states:
            return np.zeros((0, self.lm.hidden_size), dtype=np.float32)
        return torch.cat(states).cpu().numpy()

    def _next_token(self, procs: Any, all_ids: torch.Tensor, logits: torch.Tensor, generator: Any) -> torch.Tensor:
        """The next token from the last logits: processors, then argmax or a sample."""
        opts = self.options
        scores = procs(all_ids, logits.float()) if len(procs) else logits
        if opts.ignore_eos:
            scores = scores.clone()
            scores[:, list(self.lm.stop_token_ids)] = float("-inf")
        if opts.do_sample:
            probs = torch.softmax(scores.float(), dim=-1)
            return torch.multinomial(probs, 1, generator=generator)[0, 0]
        return torch.argmax(scores, dim=-1)[0]

    def stream(self) -> Iterator[TokenEvent]:
        """Decode from the prefill's cache, one token at a time, until a stop condition."""
        if self._logits is None:
            self.prefill()
        opts = self.options
        procs = _logits_processors(opts)
        generator = None
        if opts.do_sample:
            generator = torch.Generator(device=self.input_ids.device)
            generator.manual_seed(opts.seed if opts.seed is not None else torch.seed())
        stop_ids = set() if opts.ignore_eos else self.lm.stop_token_ids
        all_ids = self.input_ids
        logits = self._logits
        while True:
            if self._stop.is_set():
                self.finish_reason = "cancelled"
                return
            if len(self.new_ids) >= opts.max_new_tokens:
                self.finish_reason = "length"
                return
            with torch.inference_mode():
                # the prefill above set the logits (a digested module (isagi.profile.DIGESTED_MODULES): its code, annotations too, keys the shipped profiles)
                token = self._next_token(procs, all_ids, logits, generator)  # type: ignore[arg-type]
            token_id = int(token)
            if token_id in stop_ids:
                self.finish_reason = "stop"
                return
            self.new_ids.append(token_id)
            next_input = token.view(1, 1)
            if len(procs):
                all_ids = torch.cat([all_ids, next_input], dim=1)
            yield TokenEvent(self._detok.push(token_id), token_id)
            if len(self.new_ids) >= opts.max_new_tokens or self._stop.is_set():
                continue  # no forward pass for a token that will not be continued
            # Inference mode per forward pass, never around a ``yield``: grad mode is
            # thread-local, and a web server may run each step of this generator
            # on a different worker thread.
            with torch.inference_mode():
                out = self.lm.model(
                    input_ids=next_input, past_key_values=self._cache, use_cache=True, logits_to_keep=1
                )
            logits = out.logits[:, -1, :]


def pad_id(lm: LoadedModel) -> int:
    tok = lm.tokenizer
    return tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id


def left_padded(lm: LoadedModel, chats: list[list[dict[str, str]]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask (batch, width) of ``chats``, padded on the left."""
    rows = [lm.chat_ids(m)[0] for m in chats]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id(lm), dtype=torch.long, device=lm.device)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = r
        mask[i, width - len(r) :] = 1
    return ids, mask


def mask_positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids that ignore left padding, so a padded prompt matches the prompt alone."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


def prompt_hidden_states(
    lm: LoadedModel,
    prompts: list[list[dict[str, str]]],
    layer: int,
    *,
    batch_size: int = 16,
    progress: Any = None,
    pool: str = "last",
) -> np.ndarray:
    """h (n, d) of each chat at ``layer``, batched with left padding.

    ``pool="last"``: the state at the last prompt token (the memory's h).
    ``pool="content"``: the mean of the states over the last message's tokens
    (:meth:`LoadedModel.content_span`; the safety state, :mod:`isagi.safety.runtime`).
    Positions are computed from the attention mask so a padded prompt gets the
    same hidden state as the prompt alone (up to float tolerance).
    """
    return prompt_hidden_states_at(lm, prompts, [layer], batch_size=batch_size, progress=progress, pool=pool)[layer]


def prompt_hidden_states_at(
    lm: LoadedModel,
    prompts: list[list[dict[str, str]]],
    layers: list[int],
    *,
    batch_size: int = 16,
    progress: Any = None,
    pool: str = "last",
) -> dict[int, np.ndarray]:
    """:func:`prompt_hidden_states` at several layers from the same forward passes."""
    if pool not in ("last", "content"):
        raise ValueError(f"pool={pool!r}: use 'last' or 'content'")
    out: dict[int, list[np.ndarray]] = {layer: [] for layer in layers}
    with ExitStack() as stack, torch.inference_mode():
        caps = {layer: stack.enter_context(capture_layer(lm.model, layer, keep_all=pool == "content"))
                for layer in layers}
        for start in range(0, len(prompts), batch_size):
            chunk = prompts[start : start + batch_size]
            ids, mask = left_padded(lm, chunk)
            for cap in caps.values():
                cap.clear()
            lm.model(input_ids=ids, attention_mask=mask, position_ids=mask_positions(mask), logits_to_keep=1)
            if pool == "content":
                pads = (ids.shape[1] - mask.sum(dim=1)).tolist()
                spans = [lm.content_span(messages) for messages in chunk]
            for layer, cap in caps.items():
                if pool == "last":
                    out[layer].append(cap.last[-1].cpu().numpy())
                    continue
                states = cap.full[-1]
                out[layer] += [states[row, pad + a : pad + b].mean(dim=0, keepdim=True).cpu().numpy()
                               for row, (pad, (a, b)) in enumerate(zip(pads, spans, strict=True))]
            if progress is not None:
                progress(len(chunk))
    return {layer: np.concatenate(v).astype(np.float32) if v else np.zeros((0, lm.hidden_size), dtype=np.float32)
            for layer, v in out.items()}
