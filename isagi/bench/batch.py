"""``isagi bench batch``: aggregate decoding speed with several replies at once.

In one run, on the same GGUF (the embedded default, or ``--model`` when it is a ``.gguf``),
the same thread count and attention kernel, greedy, for 1, 2, 4, 8 and 16 concurrent
replies to different prompts:

- ``anchor``: plain llama-cpp-python (its low-level API, no ISAGI code) decoding every
  reply in ONE multi-sequence batch: one context with a sequence per reply, each prompt
  prefilled into its sequence, then one ``llama_decode`` per step holding the next token of
  every reply still going (llama.cpp's server's continuous batching, without the server),
  from the llama.cpp thread (:mod:`isagi.engines.llama_thread`) where ISAGI's steps decode too;
- ``isagi``: ISAGI's llama.cpp engine as a turn uses it (the prefill capturing layer L and
  the safety layer, every reply token captured at both), the replies asked for at once
  from as many threads, each in a sequence slot of its own (the engine opened with as many
  slots as the widest width), their steps decoded together by its step runner.

``tokens_per_s`` is every reply's new tokens over the time from the first prefill to the
last token; ``decode_tokens_per_s`` the same over the decoding alone (after the prefills).
``vs_anchor`` is ISAGI's decode figure over the anchor's at the same width, and
``over_single`` each side's decode figure over its own at the narrowest width (1 by default). ``same_replies`` counts the
replies the anchor's batch decoded exactly as ISAGI's slots did (see
:data:`UNIFIED`). Widths alternate between the two sides, ``repeats`` times; medians are reported
with their range.
"""

from __future__ import annotations

import ctypes
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from isagi.config import Settings

# One KV stream per sequence (``kv_unified`` off), as ISAGI's batching will use: a sequence's
# cells then start at 0 in its own stream, as in a context of its own, and greedy replies
# come out identical to one-at-a-time decoding. With one unified cache (llama.cpp's server's
# default) the sequences' cells interleave, attention sums run over other sequences' masked
# cells, and replies drift from the one-at-a-time ones after 15-25 tokens (measured:
# docs/measurements.md).
UNIFIED = False
WIDTHS = (1, 2, 4, 8, 16)
Timed = tuple[list[list[int]], float, float]  # replies, prefill seconds, decode seconds
TOPICS = (
    "a lighthouse keeper's night", "how bread rises", "the water cycle", "a city at dawn",
    "learning to ride a bicycle", "why leaves change colour", "a train journey through mountains",
    "how bees make honey", "the first day at a new school", "a storm at sea", "how a bridge stays up",
    "an old library", "planting a vegetable garden", "the moon's phases", "a market on a Saturday",
    "how a compass works",
)


def prompts(system: str, n: int) -> list[list[dict[str, str]]]:
    """``n`` different chats (system prompt and one request each)."""
    return [[{"role": "system", "content": system},
             {"role": "user", "content": f"Write a few sentences about {TOPICS[i % len(TOPICS)]}."}]
            for i in range(n)]


class MultiSequenceAnchor:
    """Plain llama-cpp-python: one context with ``max_width`` sequences, every reply in one batch per step."""

    def __init__(self, path: str | Path, *, n_threads: int, n_ctx: int, max_width: int, flash_attn: int) -> None:
        import llama_cpp as ll

        self.ll = ll
        ll.llama_backend_init()
        self.model = ll.llama_model_load_from_file(str(path).encode(), ll.llama_model_default_params())
        self.n_vocab = int(ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self.model)))
        params = ll.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = params.n_ubatch = 512
        params.n_seq_max = max_width
        params.kv_unified = UNIFIED
        params.n_threads = params.n_threads_batch = n_threads
        params.flash_attn_type = flash_attn
        self.ctx = ll.llama_init_from_model(self.model, params)
        self.mem = ll.llama_get_memory(self.ctx)
        self.batch = ll.llama_batch_init(512, 0, max_width)

    def close(self) -> None:
        ll = self.ll
        ll.llama_batch_free(self.batch)
        ll.llama_free(self.ctx)
        ll.llama_model_free(self.model)

    def _argmax(self, i: int) -> int:
        ptr = self.ll.llama_get_logits_ith(self.ctx, i)
        return int(np.argmax(np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)),
                                                   shape=(self.n_vocab,))))

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> None:
        """One ``llama_decode`` of ``items`` (token, position, sequence, wants logits)."""
        b = self.batch
        for i, (token, pos, seq, logits) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
            b.seq_id[i][0] = seq
        b.n_tokens = len(items)
        status = int(self.ll.llama_decode(self.ctx, b))
        if status != 0:
            raise RuntimeError(f"llama_decode failed with status {status}")

    def replies(self, prompt_ids: list[list[int]], new_tokens: int, stop_ids: set[int]) -> Timed:
        """Greedy replies to every prompt, decoded together, with the seconds the prefills took
        and the seconds decoding took after them."""
        self.ll.llama_memory_clear(self.mem, True)
        start = time.perf_counter()
        nxt: dict[int, int] = {}
        for seq, ids in enumerate(prompt_ids):  # a prompt per decode (each fits one 512-token batch)
            self._decode([(t, j, seq, j == len(ids) - 1) for j, t in enumerate(ids)])
            nxt[seq] = self._argmax(len(ids) - 1)
        prefilled = time.perf_counter()
        pos = {seq: len(ids) for seq, ids in enumerate(prompt_ids)}
        out: dict[int, list[int]] = {seq: [] for seq in nxt}
        going = list(nxt)
        while going:
            step = []
            for seq in going:
                if nxt[seq] in stop_ids:
                    continue
                out[seq].append(nxt[seq])
                if len(out[seq]) < new_tokens:
                    step.append(seq)
            going = step
            if not going:
                break
            self._decode([(nxt[seq], pos[seq], seq, True) for seq in going])
            for i, seq in enumerate(going):
                pos[seq] += 1
                nxt[seq] = self._argmax(i)
        return [out[seq] for seq in range(len(prompt_ids))], prefilled - start, time.perf_counter() - prefilled


def _isagi_replies(engine: Any, chats: list[list[dict[str, str]]], new_tokens: int, layers: tuple[int, int]) -> Timed:
    """Every chat's greedy reply through ISAGI's engine, asked for at once from a thread each, as
    the web app's turns ask: each in a sequence slot of the engine, their steps decoded together
    by its step runner (one reply at a time when the engine has one slot).

    The prefill seconds run to the moment every reply has its first token (the prefills are then
    all done), the decode seconds from there to the last token, as the anchor counts them."""
    from isagi.bench.generate import timed_reply

    out: list[list[int]] = [[] for _ in chats]
    firsts: list[float] = [0.0] * len(chats)
    errors: list[BaseException] = []
    start = time.perf_counter()

    def reply(i: int) -> None:
        try:
            total, first, out[i] = timed_reply(engine, chats[i], new_tokens, layers)
            firsts[i] = time.perf_counter() - start - (total - first)  # its first token, from the start
        except BaseException as exc:  # re-raised in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=reply, args=(i,)) for i in range(len(chats))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    wall = time.perf_counter() - start
    prefilled = max(firsts)
    return out, prefilled, wall - prefilled


def _stats(values: list[float]) -> dict[str, Any]:
    return {"median": round(statistics.median(values), 2), "range": [round(min(values), 2), round(max(values), 2)]}


def run(settings: Settings, *, new_tokens: int = 48, repeats: int = 3, widths: tuple[int, ...] = WIDTHS) -> dict[str, Any]:
    from isagi.engines import load_engine
    from isagi.engines.llama_thread import on_llama_thread
    from isagi.engines.llamacpp import FLASH_ATTN, LlamaCppEngine
    from isagi.errors import InputError

    widths = tuple(sorted(set(widths)))
    if not widths or widths[0] < 1 or widths[-1] > len(TOPICS):
        raise InputError(f"--widths: give numbers of concurrent replies from 1 to {len(TOPICS)}, e.g. 1,2,4,8,16.")
    # ISAGI's engine with a sequence slot per reply of the widest width (ISAGI_PARALLEL's slots)
    engine = load_engine(settings.with_overrides(backend="llamacpp", parallel=max(widths)))
    assert isinstance(engine, LlamaCppEngine)  # the backend asked for
    layers = (settings.layer or engine.default_layer, settings.safety_layer or engine.default_safety_layer)
    chats = prompts(settings.system_prompt, max(widths))
    prompt_ids = [engine.chat_tokens(c) for c in chats]
    stops = engine.stop_token_ids
    anchor = MultiSequenceAnchor(engine.source, n_threads=engine.n_threads, max_width=max(widths),
                                 n_ctx=max(widths) * (max(len(p) for p in prompt_ids) + new_tokens + 64),
                                 flash_attn=FLASH_ATTN)
    speed: dict[str, dict[int, list[float]]] = {k: {w: [] for w in widths} for k in ("anchor", "isagi")}
    decode: dict[str, dict[int, list[float]]] = {k: {w: [] for w in widths} for k in ("anchor", "isagi")}
    same: dict[int, int] = {}
    try:
        # The anchor decodes on the llama.cpp thread, as ISAGI's step runner does: a second
        # thread's decodes would keep a second OpenMP team beside that one (isagi.engines.llama_thread).
        on_llama_thread(anchor.replies, prompt_ids[:2], 8, stops)  # warm-up, both sides
        _isagi_replies(engine, chats[:1], 8, layers)
        for _ in range(repeats):
            for w in widths:
                got = {"anchor": on_llama_thread(anchor.replies, prompt_ids[:w], new_tokens, stops),
                       "isagi": _isagi_replies(engine, chats[:w], new_tokens, layers)}
                for side, (replies, prefill_s, decode_s) in got.items():
                    n = sum(map(len, replies))
                    speed[side][w].append(n / (prefill_s + decode_s))
                    decode[side][w].append(n / decode_s)
                same[w] = sum(a == b for a, b in zip(got["anchor"][0], got["isagi"][0], strict=True))
    finally:
        anchor.close()
    med = {side: {w: statistics.median(v) for w, v in by_w.items()} for side, by_w in decode.items()}
    return {
        "model": engine.model_id,
        "gguf": engine.source,
        "n_threads": engine.n_threads,
        "max_new_tokens": new_tokens,
        "repeats": repeats,
        "widths": {
            str(w): {
                "anchor_tokens_per_s": _stats(speed["anchor"][w]),
                "isagi_tokens_per_s": _stats(speed["isagi"][w]),
                "anchor_decode_tokens_per_s": _stats(decode["anchor"][w]),
                "isagi_decode_tokens_per_s": _stats(decode["isagi"][w]),
                "vs_anchor": round(med["isagi"][w] / med["anchor"][w], 3),
                "anchor_over_single": round(med["anchor"][w] / med["anchor"][widths[0]], 3),
                "isagi_over_single": round(med["isagi"][w] / med["isagi"][widths[0]], 3),
                "same_replies": f"{same[w]}/{w}",
            }
            for w in widths
        },
        "note": "isagi: a thread per reply, each in a sequence slot, steps batched by the engine's step runner; "
                "anchor: one multi-sequence batch per step",
    }
