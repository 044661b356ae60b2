"""``isagi bench generate``: decoding speed, and what hidden-state capture costs.

For each quantisation (nf4, none) the same prompt is decoded greedily for a
fixed number of new tokens, by plain ``model.generate`` and by ISAGI's turn
decoding (prefill with the capture hook, then decoding from the prefill's KV
cache). Runs alternate between the two so drift on a shared machine hits both
alike; medians are reported. ``capture_ratio`` is ISAGI's time over plain
``generate`` time for the configured quantisation, measured in this run.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from isagi.config import Settings
from isagi.generation import Generation, GenerationOptions

PROMPT = "Write a long, detailed story about a lighthouse keeper who finds a map in a bottle."


class _FirstTokenTimer:
    """A transformers streamer that notes when the first new token arrives."""

    def __init__(self) -> None:
        self.calls = 0
        self.first: float | None = None

    def put(self, value: Any) -> None:
        self.calls += 1
        if self.calls == 2 and self.first is None:  # call 1 is the prompt itself
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def _plain(lm: Any, ids: torch.Tensor, n: int) -> tuple[float, float, list[int]]:
    timer = _FirstTokenTimer()
    start = time.perf_counter()
    with torch.inference_mode():
        out = lm.model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, streamer=timer)
    total = time.perf_counter() - start
    return total, (timer.first or time.perf_counter()) - start, out[0, ids.shape[1]:].tolist()


def _isagi(lm: Any, ids: torch.Tensor, n: int, layer: int) -> tuple[float, float, list[int]]:
    start = time.perf_counter()
    first = None
    opts = GenerationOptions(max_new_tokens=n, ignore_eos=True)
    with Generation(lm, ids, layer, opts) as gen:
        gen.prefill()
        for _ in gen.stream():
            if first is None:
                first = time.perf_counter()
    total = time.perf_counter() - start
    return total, (first or time.perf_counter()) - start, list(gen.new_ids)


def measure(lm: Any, layer: int, new_tokens: int, repeats: int, system_prompt: str) -> dict[str, Any]:
    ids = lm.chat_ids([{"role": "system", "content": system_prompt}, {"role": "user", "content": PROMPT}])
    _plain(lm, ids, 4)
    _isagi(lm, ids, 4, layer)  # warm-up
    plain_t, plain_ttft, isagi_t, isagi_ttft = [], [], [], []
    same = True
    for _ in range(repeats):
        t, f, a = _plain(lm, ids, new_tokens)
        plain_t.append(t)
        plain_ttft.append(f)
        t, f, b = _isagi(lm, ids, new_tokens, layer)
        isagi_t.append(t)
        isagi_ttft.append(f)
        same = same and a == b
    med = statistics.median
    return {
        "tokens_per_s": round(new_tokens / med(isagi_t), 2),
        "ttft_s": round(med(isagi_ttft), 4),
        "generate_tokens_per_s": round(new_tokens / med(plain_t), 2),
        "generate_ttft_s": round(med(plain_ttft), 4),
        "capture_ratio": round(med(isagi_t) / med(plain_t), 4),
        "same_tokens_as_generate": same,
    }


def run(settings: Settings, *, new_tokens: int = 64, repeats: int = 5) -> dict[str, Any]:
    from isagi.model import load_model

    result: dict[str, Any] = {"new_tokens": new_tokens, "repeats": repeats, "prompt": PROMPT}
    for quant in ("nf4", "none"):
        lm = load_model(settings.with_overrides(quant=quant))
        layer = settings.layer or lm.default_layer
        result["model"] = lm.model_id
        result["device"] = str(lm.device)
        result["layer"] = layer
        result[quant] = measure(lm, layer, new_tokens, repeats, settings.system_prompt)
        del lm
    result["capture_ratio"] = result[settings.quant]["capture_ratio"]
    result["capture_ratio_quant"] = settings.quant
    return result
