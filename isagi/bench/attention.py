"""Which attention kernel ISAGI's llama.cpp context uses on the CPU, measured.

Owns one measurement: the time to decode one token after ``n`` tokens already
in the KV cache, with llama.cpp's flash-attention kernel and without it, on the
same GGUF and thread count as ISAGI's engine (llama-cpp-python's own ``Llama``,
no ISAGI code). A chat turn late in a session decodes after ~1,000-2,000 history
tokens, so this is the cost that decides the engine's choice
(:data:`isagi.engines.llamacpp.FLASH_ATTN`); ``isagi bench attention`` prints it.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

CONTEXTS = (50, 300, 700, 1300, 2500)


def _decode_ms(llm: Any, ids: list[int], context: int, steps: int) -> float:
    """Milliseconds per single-token decode with ``context`` tokens already evaluated."""
    llm.reset()
    llm.eval(ids[:context])
    start = time.perf_counter()
    for i in range(steps):
        llm.eval([ids[context + i]])
    return (time.perf_counter() - start) / steps * 1000


def run(settings: Any, *, contexts: tuple[int, ...] = CONTEXTS, steps: int = 32, repeats: int = 3) -> dict[str, Any]:
    from llama_cpp import Llama

    from isagi.engines import load_engine
    from isagi.engines.llamacpp import LlamaCppEngine

    engine = load_engine(settings.with_overrides(backend="llamacpp"))
    assert isinstance(engine, LlamaCppEngine)  # the backend asked for
    text = " ".join(f"Exchange {i}: what did the lighthouse keeper find in the bottle on day {i}?" for i in range(400))
    ids = engine.tokenize(text)
    need = max(contexts) + steps
    if len(ids) < need:
        raise ValueError(f"the filler text is {len(ids)} tokens, {need} needed")
    result: dict[str, Any] = {"gguf": engine.source, "n_threads": engine.n_threads, "steps": steps, "repeats": repeats}
    for flash in (True, False):
        llm = Llama(model_path=str(engine.source), n_threads=engine.n_threads, n_threads_batch=engine.n_threads,
                    n_ctx=need + 64, n_batch=512, flash_attn=flash, verbose=False)
        result["flash_on" if flash else "flash_off"] = {
            str(c): round(statistics.median(_decode_ms(llm, ids, c, steps) for _ in range(repeats)), 2) for c in contexts}
        del llm
    result["off_vs_on_speedup"] = {str(c): round(result["flash_on"][str(c)] / result["flash_off"][str(c)], 3) for c in contexts}
    return result
