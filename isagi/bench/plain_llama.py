"""llama-cpp-python's own high-level ``Llama`` generation: the no-ISAGI baseline of the benches.

Owns one thing: greedy generation of a fixed prompt (token ids) with
``llama_cpp.Llama`` on the same GGUF, thread count and attention kernel as
ISAGI's llama.cpp engine, timed (total and time to first token), so ``isagi bench generate``
and ``isagi bench turn`` can say what ISAGI's engine costs against it.
"""

from __future__ import annotations

import time
from pathlib import Path


class PlainLlama:
    """A ``llama_cpp.Llama`` on ``path``; :meth:`generate` times one greedy reply."""

    def __init__(self, path: str | Path, *, n_threads: int, n_ctx: int = 4096) -> None:
        from llama_cpp import Llama

        # the attention kernel of ISAGI's context (isagi.engines.llamacpp.FLASH_ATTN): the same
        # arithmetic, so both produce the same greedy reply
        from isagi.engines.llamacpp import FLASH_ATTN

        self.llm = Llama(model_path=str(path), n_threads=n_threads, n_threads_batch=n_threads, n_ctx=n_ctx,
                         n_batch=512, flash_attn=FLASH_ATTN == 1, verbose=False)

    def generate(self, prompt_ids: list[int], max_tokens: int, *, stop_ids: set[int] | None = None) -> tuple[float, float, list[int]]:
        """(seconds, seconds to the first token, new token ids) of one greedy generation, on the
        thread ISAGI's engine decodes on (:mod:`isagi.engines.llama_thread`), as ISAGI's side runs."""
        from isagi.engines.llama_thread import on_llama_thread

        return on_llama_thread(self._generate, prompt_ids, max_tokens, stop_ids)

    def _generate(self, prompt_ids: list[int], max_tokens: int, stop_ids: set[int] | None) -> tuple[float, float, list[int]]:
        self.llm.reset()  # no prefix reuse from the previous run: the same work as ISAGI's prefill
        start = time.perf_counter()
        first: float | None = None
        ids: list[int] = []
        stops = stop_ids or set()
        for token in self.llm.generate(prompt_ids, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
            if first is None:
                first = time.perf_counter()
            if token in stops:
                break
            ids.append(int(token))
            if len(ids) >= max_tokens:
                break
        total = time.perf_counter() - start
        return total, (first or time.perf_counter()) - start, ids
