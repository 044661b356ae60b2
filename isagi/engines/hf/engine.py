"""The transformers + bitsandbytes engine: hub ids, local HF directories, CUDA, NF4 or none.

Owns nothing new: it wraps :class:`isagi.engines.hf.model.LoadedModel` (loading, NF4,
device choice, chat template), :class:`isagi.engines.hf.generation.Generation` (prefill
with forward hooks, decoding from its KV cache) and the batched passes of
:mod:`isagi.engines.hf.generation` behind the :class:`~isagi.engines.base.ModelEngine`
protocol. Forward hooks stay inside ``with`` blocks (:mod:`isagi.engines.hf.hooks`).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, suppress
from typing import Any

import numpy as np

from isagi.engines.base import GenerationOptions, check_layer, layer_list


class TransformersEngine:
    """A :class:`~isagi.engines.hf.model.LoadedModel` (or a stand-in with the same attributes) as a ModelEngine."""

    backend = "transformers"
    slots = 1  # one turn at a time: a generation holds the model's one KV cache

    def __init__(self, loaded: Any, backend_reason: str = "") -> None:
        self.loaded = loaded
        self.backend_reason = backend_reason

    # -- facts ----------------------------------------------------------------
    @property
    def model(self) -> Any:
        """The torch module (hooks, tests, the OGD ablation evaluation)."""
        return self.loaded.model

    @property
    def tokenizer(self) -> Any:
        return self.loaded.tokenizer

    model_id = property(lambda self: getattr(self.loaded, "model_id", "model"))
    source = property(lambda self: getattr(self.loaded, "source", ""))
    fingerprint = property(lambda self: getattr(self.loaded, "fingerprint", ""))
    quant = property(lambda self: getattr(self.loaded, "quant", "none"))
    device_reason = property(lambda self: getattr(self.loaded, "device_reason", ""))

    @property
    def device(self) -> str:
        return str(self.loaded.device)

    @property
    def num_layers(self) -> int:
        return int(self.loaded.num_layers)

    @property
    def hidden_size(self) -> int:
        return int(self.loaded.hidden_size)

    @property
    def default_layer(self) -> int:
        return int(self.loaded.default_layer)

    @property
    def default_safety_layer(self) -> int:
        return int(getattr(self.loaded, "default_safety_layer", max(1, round(self.num_layers * 3 / 5))))

    @property
    def context_length(self) -> int | None:
        config = getattr(self.model, "config", None)
        n = getattr(config, "max_position_embeddings", None)
        return int(n) if isinstance(n, int) and n > 0 else None

    @property
    def stop_token_ids(self) -> set[int]:
        return set(self.loaded.stop_token_ids)

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    def footprint_bytes(self) -> int:
        return int(self.model.get_memory_footprint())

    # -- text -----------------------------------------------------------------
    def chat_tokens(self, messages: list[dict[str, str]]) -> list[int]:
        return [int(t) for t in self.loaded.chat_ids(messages)[0].tolist()]

    def content_span(self, messages: list[dict[str, str]]) -> tuple[int, int]:
        return self.loaded.content_span(messages)

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def detokenize(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    # -- compute --------------------------------------------------------------
    def generation(
        self,
        messages: list[dict[str, str]],
        layer: int,
        options: GenerationOptions | None = None,
        *,
        also_capture: tuple[int, ...] = (),
        steer: np.ndarray | None = None,
        reuse_prefix: int = 0,  # noqa: ARG002 - no KV cache kept between generations here
        states_only: bool = False,  # noqa: ARG002 - the forward pass here is the same either way
        context_shift: bool = False,  # noqa: ARG002 - no KV cache kept between generations here
        stop: threading.Event | None = None,  # noqa: ARG002 - the prompt is one forward pass: no chunk to stop between
        reply_prefix: str = "",
    ) -> Any:
        import torch

        from isagi.engines.hf.generation import Generation

        vec = None if steer is None else torch.as_tensor(np.asarray(steer, dtype=np.float32))
        ids = self.loaded.chat_ids(messages)
        if reply_prefix:  # an open reply (Continue): its own tokens after the prompt, no special tokens
            more = self.tokenizer(reply_prefix, add_special_tokens=False)["input_ids"]
            ids = torch.cat([ids, torch.tensor([list(more)], dtype=ids.dtype, device=ids.device)], dim=1)
        return Generation(self.loaded, ids, layer, options,
                          steer=vec, also_capture=also_capture)

    def iter_prompt_states(
        self,
        chats: list[list[dict[str, str]]],
        layers: list[int],
        *,
        batch_size: int = 16,
        progress: Callable[[int], None] | None = None,
    ) -> Iterator[dict[int, np.ndarray]]:
        import torch

        from isagi.engines.hf.generation import left_padded, mask_positions
        from isagi.engines.hf.hooks import capture_layer, stop_after_layer

        for layer in layers:
            check_layer(layer, self.num_layers)
        for start in range(0, len(chats), batch_size):
            chunk = chats[start : start + batch_size]
            with ExitStack() as stack, torch.inference_mode():
                caps = {layer: stack.enter_context(capture_layer(self.model, layer, keep_all=True)) for layer in layers}
                # after the capture hooks: the layers above the last one read are never run
                enough = stack.enter_context(stop_after_layer(self.model, max(layers)))
                ids, mask = left_padded(self.loaded, chunk)
                with suppress(enough):
                    self.model(input_ids=ids, attention_mask=mask, position_ids=mask_positions(mask), logits_to_keep=1)
                pads = (ids.shape[1] - mask.sum(dim=1)).tolist()
                full = {layer: cap.full[-1].float().cpu().numpy() for layer, cap in caps.items()}
            for row, pad in enumerate(pads):
                yield {layer: states[row, pad:] for layer, states in full.items()}
            if progress is not None:
                progress(len(chunk))

    def reply_states(
        self, chats: list[list[dict[str, str]]], layer: int | Sequence[int], *, max_new_tokens: int = 24,
        batch_size: int = 16,
    ) -> list[np.ndarray]:
        """Batched greedy replies with left padding, then one teacher-forced pass for the states
        (several layers: side by side, in their order)."""
        import torch

        from isagi.engines.hf.generation import left_padded, mask_positions, pad_id
        from isagi.engines.hf.hooks import capture_layer

        lm = self.loaded
        layers = layer_list(layer)
        stops = lm.stop_token_ids
        out: list[np.ndarray] = []
        for start in range(0, len(chats), batch_size):
            chunk = chats[start : start + batch_size]
            ids, mask = left_padded(lm, chunk)
            width = ids.shape[1]
            with torch.inference_mode():
                gen = lm.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                        do_sample=False, pad_token_id=pad_id(lm))
            new = gen[:, width:]
            full_mask = torch.cat([mask, torch.ones_like(new)], dim=1)
            lengths = []
            for i in range(len(chunk)):
                n = 0
                for t in new[i].tolist():
                    if t in stops:
                        break
                    n += 1
                lengths.append(n)
            with ExitStack() as stack, torch.inference_mode():
                caps = [stack.enter_context(capture_layer(lm.model, x, keep_all=True)) for x in layers]
                lm.model(input_ids=gen, attention_mask=full_mask, position_ids=mask_positions(full_mask), logits_to_keep=1)
                states = np.concatenate([cap.full[-1].float().cpu().numpy() for cap in caps], axis=-1)
            # the state at position p is the state "after feeding token p": reply tokens are fed at width..width+n-1
            out += [states[i, width : width + n] for i, n in enumerate(lengths)]
        return out

    def forget_saved_states(self) -> int:
        """Nothing to forget: this backend keeps no state of past conversations."""
        return 0

    def reply_nll(self, messages: list[dict[str, str]], reply_ids: list[int]) -> float:
        import torch

        if not reply_ids:
            return math.inf
        prompt = self.loaded.chat_ids(messages)
        reply = torch.tensor([list(reply_ids)], dtype=torch.long, device=prompt.device)
        full = torch.cat([prompt, reply], dim=1)
        with torch.inference_mode():
            logits = self.model(input_ids=full).logits[0].float()
        p = prompt.shape[1]
        logp = torch.log_softmax(logits[p - 1 : -1], dim=-1)
        return float(-logp.gather(1, reply[0].unsqueeze(1)).mean().item())
