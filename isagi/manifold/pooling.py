"""Pooling per-token states into one vector, above the engine seam.

Owns the choice of positions: the engines hand back every prompt token's
state (:mod:`isagi.engines.base`); these functions pick the last token (the
memory's h) or means over token spans (the safety state), so the safety code
can change its positions without touching a backend.

The read-outs (``how``), for a prompt of ``T`` tokens whose last message is
the span ``[a, b)``:

- ``last``: the state at ``T - 1``;
- ``content``: the mean over the message, ``[a, b)``;
- ``post``: the mean over the post-instruction tokens ``[b, T)``, the chat
  template's end of the message and the opening of the assistant's turn;
- ``content+post``: the average of the two means above (the safety state:
  :data:`isagi.safety.runtime.SAFETY_POOL` says why).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np


def last_token(states: np.ndarray) -> np.ndarray:
    """The state (d,) at the last position of ``states`` (T, d)."""
    return np.asarray(states[-1], dtype=np.float32)


def span_mean(states: np.ndarray, span: tuple[int, int]) -> np.ndarray:
    """The mean (d,) of ``states`` (T, d) over positions ``[start, end)``."""
    start, end = span
    return np.asarray(states[start:end], dtype=np.float32).mean(axis=0)


POOLS: tuple[str, ...] = ("last", "content", "post", "content+post")


def pool_spans(how: str, span: tuple[int, int] | None, n_tokens: int) -> list[tuple[int, int]]:
    """The token spans whose means the read-out ``how`` averages (module docstring)."""
    if how == "last":
        return [(n_tokens - 1, n_tokens)]
    if how not in POOLS:
        raise ValueError(f"pool={how!r}: use one of {', '.join(POOLS)}")
    if span is None:
        raise ValueError(f"pool={how!r} needs the message's token span")
    # a template with nothing after the message: its last token stands for the post-instruction tokens
    post = (span[1], n_tokens) if span[1] < n_tokens else (n_tokens - 1, n_tokens)
    return {"content": [span], "post": [post], "content+post": [span, post]}[how]


def pool_states(states: np.ndarray, how: str, span: tuple[int, int] | None = None) -> np.ndarray:
    """The read-out ``how`` (d,) of a prompt's states (T, d); ``span`` is the message's tokens."""
    parts = [span_mean(states, s) for s in pool_spans(how, span, len(states))]
    return np.mean(parts, axis=0).astype(np.float32)


def decoding_state(gen: Any, layer: int, how: str, span: tuple[int, int] | None) -> np.ndarray:
    """:func:`pool_states` read from an open, prefilled decoding (the turn's own prefill)."""
    parts = [gen.prompt_state(layer, span=s) for s in pool_spans(how, span, int(gen.prompt_tokens))]
    return np.mean(parts, axis=0).astype(np.float32)


def prompt_hidden_states_at(
    engine: Any,
    chats: list[list[dict[str, str]]],
    layers: list[int],
    *,
    batch_size: int = 16,
    progress: Callable[[int], None] | None = None,
    pool: str = "last",
) -> dict[int, np.ndarray]:
    """One pooled state per chat at each of ``layers``: {layer: (n, d)}, from any engine.

    ``pool`` is a read-out of the module docstring: ``"last"`` is the memory's h;
    the others use the last message's span (``engine.content_span``).
    """
    if pool not in POOLS:
        raise ValueError(f"pool={pool!r}: use one of {', '.join(POOLS)}")
    d = int(engine.hidden_size)
    out = {layer: np.zeros((len(chats), d), dtype=np.float32) for layer in layers}
    # shortest first: a batched engine pads each batch to its longest prompt, so prompts of like
    # length share a batch; the rows go back to the callers' order
    order = sorted(range(len(chats)), key=lambda i: sum(len(m["content"]) for m in chats[i]))
    states = engine.iter_prompt_states([chats[i] for i in order], list(layers), batch_size=batch_size,
                                       progress=progress)
    for i, per_layer in zip(order, states, strict=True):
        span = engine.content_span(chats[i]) if pool != "last" else None
        for layer in layers:
            out[layer][i] = pool_states(per_layer[layer], pool, span)
    return out


def prompt_hidden_states(
    engine: Any,
    chats: list[list[dict[str, str]]],
    layer: int,
    *,
    batch_size: int = 16,
    progress: Callable[[int], None] | None = None,
    pool: str = "last",
) -> np.ndarray:
    """:func:`prompt_hidden_states_at` at one layer: (n, d)."""
    return prompt_hidden_states_at(engine, chats, [layer], batch_size=batch_size, progress=progress, pool=pool)[layer]
