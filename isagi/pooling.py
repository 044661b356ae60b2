"""Pooling per-token states into one vector, above the engine seam.

Owns the choice of positions: the engines hand back every prompt token's
state (:mod:`isagi.engines.base`); these functions pick the last token (the
memory's h) or the mean over a token span (the safety state over the user's
message), so the safety code can change its positions without touching a
backend.
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


def pool_states(states: np.ndarray, how: str, span: tuple[int, int] | None = None) -> np.ndarray:
    """``how="last"``: :func:`last_token`; ``how="content"``: :func:`span_mean` over ``span``."""
    if how == "last":
        return last_token(states)
    if how == "content":
        if span is None:
            raise ValueError("pool='content' needs the message's token span")
        return span_mean(states, span)
    raise ValueError(f"pool={how!r}: use 'last' or 'content'")


POOLS: dict[str, Callable[..., np.ndarray]] = {"last": last_token, "content": span_mean}


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

    ``pool="last"``: the state at the last prompt token (the memory's h).
    ``pool="content"``: the mean over the last message's tokens
    (``engine.content_span``; the safety state, :mod:`isagi.safety`).
    """
    if pool not in POOLS:
        raise ValueError(f"pool={pool!r}: use 'last' or 'content'")
    out: dict[int, list[np.ndarray]] = {layer: [] for layer in layers}
    states = engine.iter_prompt_states(chats, list(layers), batch_size=batch_size, progress=progress)
    for chat, per_layer in zip(chats, states, strict=True):
        span = engine.content_span(chat) if pool == "content" else None
        for layer in layers:
            out[layer].append(pool_states(per_layer[layer], pool, span))
    d = int(engine.hidden_size)
    return {layer: np.stack(v).astype(np.float32) if v else np.zeros((0, d), dtype=np.float32) for layer, v in out.items()}


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
