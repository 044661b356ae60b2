"""The llama.cpp engine's text: the chat template, and tokens to text and back.

Owns the GGUF's chat template (its own Jinja template, rendered as transformers
renders it, in a sandbox, then tokenised by llama.cpp, so a prompt is the same
tokens on either backend), tokenising (the latest texts' tokens cached: one turn tokenises its
conversation's prompt three or four times, to count, to find the message's span
and to evaluate it; docs/measurements.md, "Less Python per turn"), token pieces (cached: a reply decodes every token's piece) and the
UTF-8 stream that turns pieces into text deltas
without splitting a character. Kept apart from the forward passes because none
of it touches the context or its KV cache, only the model's vocabulary.
"""

from __future__ import annotations

import ctypes
import threading
from collections import OrderedDict
from typing import Any

from isagi.errors import ModelLoadError

TOKENIZED_KEPT = 64  # texts whose tokens are kept (the few a turn tokenises again, of a few turns at once)


def compile_template(source: str) -> Any:
    """A GGUF's chat template (Jinja source) compiled as transformers compiles one, in a sandbox
    (also what ``isagi bench serve`` renders to check the anchor's prompt against ISAGI's)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        from jinja2.exceptions import TemplateError

        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)


class ChatText:
    """The text methods of :class:`~isagi.engines.llamacpp.engine.LlamaCppEngine` (a mixin: the
    engine's ``__init__`` loads the model and sets the attributes named here)."""

    _ll: Any  # the llama_cpp module
    _model: Any
    _vocab: Any
    _template: Any  # the chat template, from _load_template
    _pieces: dict[int, bytes]  # token -> its piece as a reply shows it (special=False)
    _tokenized: OrderedDict[tuple[str, bool], tuple[int, ...]]  # (text, special) -> tokens, newest last
    _tokenized_lock: threading.Lock
    source: str  # the GGUF's path, for messages

    def _meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(1 << 16)
        n = self._ll.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace") if n >= 0 else None

    def _load_template(self) -> Any:
        source = self._ll.llama_model_chat_template(self._model, None)
        if not source:
            raise ModelLoadError(
                f"{self.source} has no chat template; ISAGI needs an instruction-tuned (chat) model."
            )
        return compile_template(source.decode("utf-8") if isinstance(source, bytes) else source)

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
        """``text``'s tokens (a new list: callers may extend it); the latest texts' are kept."""
        key = (text, special)
        with self._tokenized_lock:
            got = self._tokenized.get(key)
            if got is not None:
                self._tokenized.move_to_end(key)
                return list(got)
        ids = self._tokenize(text, special)
        with self._tokenized_lock:
            self._tokenized[key] = tuple(ids)
            while len(self._tokenized) > TOKENIZED_KEPT:
                self._tokenized.popitem(last=False)
        return ids

    def _tokenize(self, text: str, special: bool) -> list[int]:
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



class Utf8Stream:
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

