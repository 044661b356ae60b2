"""The engine seam: what a turn needs from a language model, and nothing more.

Owns the :class:`ModelEngine` protocol (one loaded model behind one backend)
and the :class:`Decoding` protocol (one reply: a prefill that keeps its KV
cache, then a streaming decode from it), plus the plain data types both
backends share (:class:`GenerationOptions`, :class:`TokenEvent`).

Everything above this seam (agent, profile, safety, explore, evals, benches)
talks only to these protocols; :mod:`isagi.engines.hf.engine` (transformers +
bitsandbytes) and :mod:`isagi.engines.llamacpp` (llama.cpp through
llama-cpp-python) implement them. States cross the seam *unpooled*: a prefill
hands back the per-token states of the prompt at the layers asked for, and
pooling (last token, mean over the message's span, ...) lives above it in
:mod:`isagi.manifold.pooling`, so the safety code chooses its positions without the
backends knowing.

Layer numbering is transformers' ``hidden_states`` convention everywhere:
layer ``L`` (1..num_layers) is the output of decoder block ``L - 1``.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

BACKENDS = ("llamacpp", "transformers")


class PrefillStopped(Exception):  # noqa: N818 - a Stop, not an error
    """The turn's Stop came while its prompt was being evaluated: nothing was decoded."""


@dataclass(frozen=True)
class GenerationOptions:
    """How to pick tokens. Greedy unless ``do_sample``."""

    max_new_tokens: int = 256
    do_sample: bool = False
    temperature: float = 0.7
    top_p: float = 0.9
    top_k: int = 50
    repetition_penalty: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False  # benchmarks only: decode exactly max_new_tokens


MAX_TEMPERATURE = 2.0  # the highest sampling temperature any front end may ask for (OpenAI's range)


def within_limits(options: GenerationOptions, max_new_tokens: int) -> GenerationOptions:
    """``options`` with every field inside what the server allows: at most ``max_new_tokens``
    (``ISAGI_MAX_NEW_TOKENS``) and at least one new token, temperature in [0, 2], top-p in (0, 1],
    top-k and the repetition penalty non-negative; a value that is not a finite number takes the
    default. Whatever a page, the API or a script sends, one reply holds the model no longer than
    the server's limit says."""
    from dataclasses import replace

    def number(value: Any, default: float, lo: float, hi: float) -> float:
        try:
            v = float(value)
        except (TypeError, ValueError):
            return default
        return min(max(v, lo), hi) if math.isfinite(v) else default

    default = GenerationOptions()
    return replace(
        options,
        max_new_tokens=int(number(options.max_new_tokens, max_new_tokens, 1, max_new_tokens)),
        temperature=number(options.temperature, default.temperature, 0.0, MAX_TEMPERATURE),
        top_p=number(options.top_p, default.top_p, 1e-6, 1.0),
        top_k=int(number(options.top_k, default.top_k, 0, 1 << 20)),
        repetition_penalty=number(options.repetition_penalty, default.repetition_penalty, 0.0, 10.0),
    )


REUSE_ANY = 1 << 62  # ``generation(reuse_prefix=...)``: any shared prefix may come from a saved KV cache


@dataclass
class TokenEvent:
    """One decoded token: the text it adds (possibly empty mid-character) and its id."""

    text: str
    token_id: int


@runtime_checkable
class Decoding(Protocol):
    """One reply: a single prefill, then decoding from its KV cache.

    Used as a context manager; whatever it installs on the model (hooks,
    callbacks, control vectors) lives exactly as long as the ``with`` block.
    """

    new_ids: list[int]
    finish_reason: str | None  # "stop", "length" or "cancelled" once the stream ends
    # the prefill reused a saved KV cache with a gap cut out (``context_shift``): the prompt
    # states it read are then not those of the prompt evaluated afresh
    context_shifted: bool

    def __enter__(self) -> Decoding: ...

    def __exit__(self, *exc: object) -> None: ...

    @property
    def prompt_tokens(self) -> int: ...

    @property
    def text(self) -> str: ...

    def prefill(self) -> np.ndarray:
        """Run the prompt once (keeping its KV cache); h (d,) at the main layer's last prompt token."""
        ...

    def prompt_states(self, layer: int | None = None) -> np.ndarray:
        """States (T, d) of every prompt token at ``layer`` (main layer by default), after prefill."""
        ...

    def prompt_state(self, layer: int | None = None, span: tuple[int, int] | None = None) -> np.ndarray:
        """The last prompt token's state, or the mean over ``span`` (pooled above the protocol)."""
        ...

    def stream(self) -> Iterator[TokenEvent]:
        """Decode from the prefill's cache until a stop token, the length limit or :meth:`stop`."""
        ...

    def stop(self) -> None:
        """End decoding after the current token (thread-safe; checked between tokens)."""
        ...

    def reply_hidden(self, layer: int | None = None) -> np.ndarray:
        """States (n, d) of the reply tokens fed back so far at ``layer`` (the guard's checkpoints)."""
        ...


@runtime_checkable
class ModelEngine(Protocol):
    """A loaded chat model behind one backend."""

    # Read-only to whoever holds the engine (an engine may answer with a property).
    @property
    def backend(self) -> str:
        """"llamacpp" or "transformers"."""

    @property
    def backend_reason(self) -> str:
        """Why this backend was chosen (``isagi info``)."""

    @property
    def model_id(self) -> str: ...

    @property
    def source(self) -> str: ...

    @property
    def fingerprint(self) -> str: ...

    @property
    def quant(self) -> str: ...

    @property
    def device(self) -> str: ...

    @property
    def device_reason(self) -> str: ...

    @property
    def slots(self) -> int:
        """Turns the engine can hold at once (its sequence slots; 1 without them)."""

    @property
    def num_layers(self) -> int: ...

    @property
    def hidden_size(self) -> int: ...

    @property
    def default_layer(self) -> int: ...

    @property
    def default_safety_layer(self) -> int: ...

    @property
    def context_length(self) -> int | None: ...

    @property
    def stop_token_ids(self) -> set[int]: ...

    def chat_tokens(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of ``messages`` in the model's chat template, ready to answer."""
        ...

    def content_span(self, messages: list[dict[str, str]]) -> tuple[int, int]:
        """Token positions ``[start, end)`` of the last message's text in :meth:`chat_tokens`."""
        ...

    def count_tokens(self, text: str) -> int:
        """Tokens of ``text`` alone (no template, no special tokens)."""
        ...

    def detokenize(self, ids: list[int]) -> str:
        """Text of ``ids`` without special tokens."""
        ...

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
        stop: threading.Event | None = None,
        reply_prefix: str = "",
    ) -> Decoding:
        """A reply to ``messages`` capturing ``layer`` (and ``also_capture``); ``steer`` adds a
        vector to the output of ``layer`` (explore only; captured states are read before it).

        ``reuse_prefix``: at most this many leading prompt tokens may come from the KV cache
        of an earlier decoding that shared them instead of being evaluated again (llama.cpp
        does; transformers ignores it). Their states are then not computed: ``prompt_states``
        refuses, and so does ``prompt_state`` with a span inside them; the last prompt token
        is always evaluated. 0 (the default) evaluates the whole prompt; :data:`REUSE_ANY`
        allows any shared prefix (the caller needs the reply, not the prompt's states).

        ``states_only``: the caller reads the prompt's states and decodes nothing from this
        decoding, so the engine may skip what only decoding needs (llama.cpp stops the prefill
        after the last captured layer: no later blocks, no output head); ``stream`` then refuses.

        ``context_shift`` (with ``reuse_prefix``): the reused tokens may also come from a saved KV
        cache in which a gap followed the shared start, e.g. the oldest exchanges the history
        window dropped: the gap is cut out and the positions after it move down (llama.cpp's
        context shift; transformers ignores it). Those tokens' cache then still reflects the
        tokens they followed when it was computed, so use it only where the prompt's own states
        are not read.

        ``stop``: the turn's Stop. Set while the prompt is evaluated, the evaluation ends between
        two chunks of the prompt and ``prefill`` (or ``stream``'s own) raises
        :class:`PrefillStopped` (llama.cpp; transformers evaluates a prompt in one pass and
        only checks it before); the engine's cache is left as if the prompt had never run.

        ``reply_prefix``: the beginning of the assistant's reply, left open (Continue of a reply
        cut at the token limit): the prompt is ``messages`` ready to answer, as the model saw
        them when it began the reply, followed by the tokens of ``reply_prefix`` alone (no
        special tokens: a reply's text never turns into a template token), so decoding goes on
        from there and ``text`` / ``new_ids`` hold what comes after it. Both engines tokenise it
        so: the prompt tokens are ``chat_tokens(messages)`` then the prefix's own tokens."""
        ...

    def iter_prompt_states(
        self,
        chats: list[list[dict[str, str]]],
        layers: list[int],
        *,
        batch_size: int = 16,
        progress: Callable[[int], None] | None = None,
    ) -> Iterator[dict[int, np.ndarray]]:
        """Per chat, in order: {layer: states (T, d) of every prompt token} (calibration)."""
        ...

    def reply_states(
        self, chats: list[list[dict[str, str]]], layer: int | Sequence[int], *, max_new_tokens: int = 24,
        batch_size: int = 16,
    ) -> list[np.ndarray]:
        """Greedy replies to ``chats`` and the ``layer`` states (n, d) of their tokens; given several
        layers, their states side by side (n, len(layer)·d) in that order."""
        ...

    def reply_nll(self, messages: list[dict[str, str]], reply_ids: list[int]) -> float:
        """Mean negative log-likelihood of ``reply_ids`` after ``messages`` (unsteered)."""
        ...

    @property
    def vocab_size(self) -> int: ...

    def footprint_bytes(self) -> int: ...

    def forget_saved_states(self) -> int:
        """Drop what the engine keeps of past conversations to speed up later ones (llama.cpp's
        saved KV prefixes); the bytes given back (0: it keeps none)."""
        ...


def layer_list(layer: int | Sequence[int]) -> list[int]:
    """``layer`` as a list: one layer, or several in the caller's order."""
    return [int(layer)] if isinstance(layer, (int, np.integer)) else [int(x) for x in layer]


def check_layer(layer: int, num_layers: int) -> None:
    """Raise :class:`~isagi.errors.ConfigError` for a layer outside 1..num_layers."""
    if not 1 <= layer <= num_layers:
        from isagi.errors import ConfigError

        raise ConfigError(
            f"layer {layer} is out of range for this model: use 1..{num_layers} (ISAGI_LAYER or --layer)."
        )


def span_by_difference(full: list[int], empty: list[int]) -> tuple[int, int]:
    """Token positions ``[start, end)`` of the last message's text in ``full``.

    ``empty`` is the same chat with the last message's text removed: what the
    two share at the front and at the back is the template; the rest is the
    message. Works for any chat template without parsing it. An empty message
    is stood for by the last prompt token.
    """
    start = 0
    while start < min(len(full), len(empty)) and full[start] == empty[start]:
        start += 1
    back = 0
    while back < min(len(full), len(empty)) - start and full[-1 - back] == empty[-1 - back]:
        back += 1
    end = len(full) - back
    if end <= start:
        return len(full) - 1, len(full)
    return start, end
