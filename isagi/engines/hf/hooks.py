"""Forward hooks on decoder layers, always inside context managers.

Owns: capturing the residual stream after a decoder layer (the hidden state
``h`` of docs/architecture.md) and adding a steering vector to it (Safe OGD exploration).
Every hook is installed by a ``with`` block and removed in ``finally``, so an
exception anywhere in generation leaves no hook behind.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from isagi.engines.hf.model import decoder_layers


def _hidden(output: Any) -> torch.Tensor:
    """Decoder layers return a tensor (transformers 5) or a tuple whose first item is one."""
    return output[0] if isinstance(output, tuple) else output


def layer_module(model: Any, layer: int) -> torch.nn.Module:
    """The module whose output is ``hidden_states[layer]`` (layer 1..num_layers-1)."""
    layers = decoder_layers(model)
    if not 1 <= layer <= len(layers):
        from isagi.errors import ConfigError

        raise ConfigError(
            f"layer {layer} is out of range for this model: use 1..{len(layers)} "
            "(ISAGI_LAYER or --layer)."
        )
    return layers[layer - 1]


@dataclass
class LayerCapture:
    """Hidden states seen at one layer: the last position of each forward call;
    with ``keep_all`` every position of every call; with ``keep_prefill`` every
    position of the first call only (a generation's prompt)."""

    last: list[torch.Tensor] = field(default_factory=list)  # one (batch, d) per call
    keep_all: bool = False
    full: list[torch.Tensor] = field(default_factory=list)  # (batch, T, d) per call
    keep_prefill: bool = False
    prefill: torch.Tensor | None = None  # (batch, T, d) of the first call

    def clear(self) -> None:
        self.last.clear()
        self.full.clear()
        self.prefill = None


@contextmanager
def capture_layer(model: Any, layer: int, *, keep_all: bool = False, keep_prefill: bool = False) -> Iterator[LayerCapture]:
    """Record the output of decoder layer ``layer`` for every forward call in the block."""
    cap = LayerCapture(keep_all=keep_all, keep_prefill=keep_prefill)

    def hook(_module: torch.nn.Module, _inputs: Any, output: Any) -> None:
        hs = _hidden(output).detach()
        cap.last.append(hs[:, -1, :].float())
        if cap.keep_all:
            cap.full.append(hs.float())
        if cap.keep_prefill and cap.prefill is None:
            cap.prefill = hs.float()

    handle = layer_module(model, layer).register_forward_hook(hook)
    try:
        yield cap
    finally:
        handle.remove()


class _Enough(Exception):
    """Raised by :func:`stop_after_layer`'s hook: the states wanted are read, the rest is not run."""


@contextmanager
def stop_after_layer(model: Any, layer: int) -> Iterator[type[Exception]]:
    """End every forward call once decoder layer ``layer`` has run (hooks registered on it before
    this one have seen its output): for prompt states alone, the later layers and the output head
    are skipped. Yields the exception class the forward call then raises; catch it around the call."""

    def hook(_module: torch.nn.Module, _inputs: Any, _output: Any) -> None:
        raise _Enough

    handle = layer_module(model, layer).register_forward_hook(hook)
    try:
        yield _Enough
    finally:
        handle.remove()


@contextmanager
def steer_layer(model: Any, layer: int, vector: torch.Tensor) -> Iterator[None]:
    """Add ``vector`` (d,) to the residual stream after decoder layer ``layer``."""

    def hook(_module: torch.nn.Module, _inputs: Any, output: Any) -> Any:
        hs = _hidden(output)
        steered = hs + vector.to(dtype=hs.dtype, device=hs.device)
        if isinstance(output, tuple):
            return (steered, *output[1:])
        return steered

    handle = layer_module(model, layer).register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def count_forward_hooks(model: Any) -> int:
    """How many forward hooks are installed anywhere in ``model`` (for tests and checks)."""
    return sum(len(m._forward_hooks) for m in model.modules())
