"""``isagi bench generate``: decoding speed per backend, and what hidden-state capture costs.

In one run, on the same prompt and the same GGUF (the embedded default, or
``--model`` when it is a ``.gguf`` file), greedy, a fixed number of new tokens:

- ``plain_llamacpp``: llama-cpp-python's own ``Llama`` generation, no ISAGI,
  same thread count as ISAGI's llama.cpp engine;
- ``backends.llamacpp``: ISAGI's llama.cpp engine as a turn uses it (prefill
  capturing layer L and the safety layer, every reply token captured at both);
  ``capture_ratio`` is its time over the same engine decoding without reading
  any reply state;
- ``backends.transformers``: ISAGI's transformers engine on the GGUF's
  dequantised weights in the configured quantisation (NF4 by default);
  ``capture_ratio`` is its time over plain ``model.generate``.

Runs alternate between the variants so drift on a shared machine hits all
alike; medians are reported, with each variant's min and max.
``tokens_per_s`` is new tokens over the whole call (prefill included);
``decode_tokens_per_s`` excludes the time to the first token.
``plain_llamacpp_vs_transformers`` is the ratio llama.cpp itself reaches
against the transformers path, the ceiling of ``llamacpp_vs_transformers``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from isagi.config import Settings
from isagi.engines.base import GenerationOptions

PROMPT = "Write a long, detailed story about a lighthouse keeper who finds a map in a bottle."

Timed = tuple[float, float, list[int]]  # (seconds, seconds to the first token, new ids)


def timed_reply(engine: Any, messages: list[dict[str, str]], n: int, layers: tuple[int, int], **kw: Any) -> Timed:
    """One greedy reply through ISAGI's engine as a turn decodes it (layer L and the safety layer
    captured): (seconds, seconds to the first token, new ids)."""
    start = time.perf_counter()
    first = None
    with engine.generation(messages, layers[0], GenerationOptions(max_new_tokens=n), also_capture=(layers[1],), **kw) as gen:
        gen.prefill()
        for _ in gen.stream():
            if first is None:
                first = time.perf_counter()
        ids = list(gen.new_ids)
    return time.perf_counter() - start, (first or time.perf_counter()) - start, ids


def _hf_generate(engine: Any, messages: list[dict[str, str]], n: int) -> Timed:
    import torch

    class _First:
        calls, first = 0, None

        def put(self, _value: Any) -> None:
            self.calls += 1
            if self.calls == 2 and self.first is None:  # call 1 is the prompt itself
                self.first = time.perf_counter()

        def end(self) -> None:
            pass

    ids = torch.tensor([engine.chat_tokens(messages)])
    timer = _First()
    start = time.perf_counter()
    with torch.inference_mode():
        out = engine.model.generate(ids, max_new_tokens=n, do_sample=False, streamer=timer)
    total = time.perf_counter() - start
    new = [t for t in out[0, ids.shape[1]:].tolist()]
    stops = engine.stop_token_ids
    cut = next((i for i, t in enumerate(new) if t in stops), len(new))
    return total, (timer.first or time.perf_counter()) - start, new[:cut]


def _summary(runs: list[Timed]) -> dict[str, Any]:
    med = statistics.median
    n = [len(r[2]) for r in runs]
    tps = [len(ids) / t for t, _f, ids in runs]
    dec = [(len(ids) - 1) / max(t - f, 1e-9) for t, f, ids in runs if len(ids) > 1]
    return {
        "tokens_per_s": round(med(tps), 2),
        "tokens_per_s_range": [round(min(tps), 2), round(max(tps), 2)],
        "decode_tokens_per_s": round(med(dec), 2) if dec else None,
        "ttft_s": round(med([r[1] for r in runs]), 4),
        "seconds": round(med([r[0] for r in runs]), 4),
        "new_tokens": int(med(n)),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a and b else None


def run(settings: Settings, *, new_tokens: int = 64, repeats: int = 5) -> dict[str, Any]:
    from isagi.bench.plain_llama import PlainLlama
    from isagi.engines import load_engine
    from isagi.engines.llamacpp import LlamaCppEngine

    gguf_settings = settings.with_overrides(backend="llamacpp")
    llama = load_engine(gguf_settings)
    assert isinstance(llama, LlamaCppEngine)  # the backend asked for
    hf = load_engine(settings.with_overrides(backend="transformers", model=settings.model))
    messages = [{"role": "system", "content": settings.system_prompt}, {"role": "user", "content": PROMPT}]
    layers = (settings.layer or llama.default_layer, settings.safety_layer or llama.default_safety_layer)
    prompt_ids = llama.chat_tokens(messages)
    plain = PlainLlama(llama.source, n_threads=llama.n_threads, n_ctx=llama.context_length)
    stops = llama.stop_token_ids
    variants: dict[str, Callable[[], Timed]] = {
        "plain_llamacpp": lambda: plain.generate(prompt_ids, new_tokens, stop_ids=stops),
        "llamacpp": lambda: timed_reply(llama, messages, new_tokens, layers),
        "llamacpp_no_capture": lambda: timed_reply(llama, messages, new_tokens, layers, capture_reply=False),
        "transformers": lambda: timed_reply(hf, messages, new_tokens, layers),
        "transformers_generate": lambda: _hf_generate(hf, messages, new_tokens),
    }
    for fn in variants.values():  # warm-up
        fn()
    runs: dict[str, list[Timed]] = {k: [] for k in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            runs[name].append(fn())
    s = {k: _summary(v) for k, v in runs.items()}
    med = statistics.median
    secs = {k: med([r[0] for r in v]) for k, v in runs.items()}
    same = runs["llamacpp"][0][2] == runs["plain_llamacpp"][0][2]
    result: dict[str, Any] = {
        "model": llama.model_id,
        "gguf": llama.source,
        "n_threads": llama.n_threads,
        "prompt": PROMPT,
        "prompt_tokens": len(prompt_ids),
        "max_new_tokens": new_tokens,
        "repeats": repeats,
        "layers": list(layers),
        "plain_llamacpp": s["plain_llamacpp"],
        "backends": {
            "llamacpp": {**s["llamacpp"], "capture_ratio": round(secs["llamacpp"] / secs["llamacpp_no_capture"], 4),
                         "no_capture": s["llamacpp_no_capture"]},
            "transformers": {**s["transformers"], "quant": hf.quant,
                             "capture_ratio": round(secs["transformers"] / secs["transformers_generate"], 4),
                             "generate": s["transformers_generate"]},
        },
        "llamacpp_vs_plain": _ratio(s["llamacpp"]["tokens_per_s"], s["plain_llamacpp"]["tokens_per_s"]),
        "llamacpp_vs_transformers": _ratio(s["llamacpp"]["tokens_per_s"], s["transformers"]["tokens_per_s"]),
        # the same ratio for llama.cpp with no ISAGI (what the engine's ratio can reach at most),
        # and for decoding alone (the time to the first token left out on both sides)
        "plain_llamacpp_vs_transformers": _ratio(s["plain_llamacpp"]["tokens_per_s"], s["transformers"]["tokens_per_s"]),
        "llamacpp_vs_transformers_decode": _ratio(s["llamacpp"]["decode_tokens_per_s"], s["transformers"]["decode_tokens_per_s"]),
        "same_tokens_as_plain_llamacpp": same,
    }
    result["capture_ratio"] = result["backends"]["llamacpp"]["capture_ratio"]
    return result
