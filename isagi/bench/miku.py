"""Benchmark of the ``.miku`` v2 file against the legacy JSON + ``.pt`` pair.

Builds one synthetic session of ``turns`` exchanges (texts of 100-300
characters, k-dim query and reply coordinates, a (k, k) metric and a (d, k)
basis), then times saving and loading it in the v2 format and in the legacy
v1 format in the same run, on the same temporary directory. Each timing is
the best of ``repeats`` runs. No figures are hard-coded: everything returned
is measured here. ``isagi bench miku --turns N --json`` prints the dict.
"""

from __future__ import annotations

import gc
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np

_TEXT = (
    "the metric grows where queries are new and stays flat where they repeat; "
    "a trajectory remembers which question came with which answer, and the tier "
    "says whether to retrieve, augment, expand or explore. Über naïve café — "
    "geometry of meaning 意味 with safety margins and a careful model"
)
_WORDS = _TEXT.split()


def _text(rng: np.random.Generator, lo: int = 100, hi: int = 300) -> str:
    target = int(rng.integers(lo, hi + 1))
    out: list[str] = []
    length = 0
    while length < target:
        w = _WORDS[int(rng.integers(len(_WORDS)))]
        out.append(w)
        length += len(w) + 1
    return " ".join(out)[:target]


def synthetic_state(
    turns: int = 5_000, k: int = 64, d: int = 576, seed: int = 0, *, app_fields: bool = False
) -> Any:
    """A realistic ``MikuState`` of ``turns`` exchanges (deterministic for a seed).

    With ``app_fields`` it holds all that a session saved by the app holds:
    every field the app stores with a reply (a dozen, some of them None on the
    first turn), the key columns of the trajectories, the singular values.
    Without, only what the legacy v1 pair can also hold (the timing comparison).
    """
    from isagi.session.turn import Turn
    from isagi.storage.miku import MikuState, new_header

    rng = np.random.default_rng(seed)
    queries = [_text(rng) for _ in range(turns)]
    replies = [_text(rng) for _ in range(turns)]
    tiers = [
        ("RETRIEVE", "AUGMENT", "EXPAND", "EXPLORE")[int(i)] for i in rng.integers(0, 4, turns)
    ]
    a = rng.standard_normal((k, k)) * 0.05
    metric = np.eye(k) + a @ a.T
    basis, _ = np.linalg.qr(rng.standard_normal((d, k)))
    now = time.time()
    created = now - np.sort(rng.uniform(0, 86400 * 30, turns))[::-1]
    zones = ("science", "history", "code", "chat", None)
    conversation = []
    for i in range(turns):
        t = float(created[i])
        if not app_fields:
            conversation.append({"role": "user", "text": queries[i], "created": t})
            conversation.append(
                {"role": "assistant", "text": replies[i], "created": t + 1.0, "tier": tiers[i]}
            )
            continue
        first = i == 0  # nothing stored yet: no distance, no nearest query (as the app writes)
        turn = Turn(  # every field a turn stores (isagi.session.turn.Turn, as the app saves it)
            user_text=queries[i],
            reply_text=replies[i],
            tier=tiers[i],
            distance=None if first else float(rng.uniform(0, 1)),
            nearest_query=None if first else queries[int(rng.integers(i))],
            zone=zones[int(rng.integers(len(zones)))],
            teh_prompt=float(rng.uniform(0, 1)),
            teh_reply=float(rng.uniform(0, 1)),
            verdict="ok",
            latency_s=float(rng.uniform(0.2, 3)),
            prompt_tokens=int(rng.integers(20, 400)),
            new_tokens=int(rng.integers(8, 256)),
            metric_growth=float(i) * 1e-3,
            cluster=int(rng.integers(max(1, i))),
            generated=True,
            asked_at=t,
            answered_at=t + 1.0,
        )
        conversation.extend(turn.to_messages())
    state = MikuState(
        header=new_header(
            model_id="HuggingFaceTB/SmolLM2-135M-Instruct",
            model_fingerprint="bench-" + "0" * 58,
            d=d,
            k=k,
            layer=18,
        ),
        tensors={
            "metric": metric,
            "basis": basis.astype(np.float32),
            "mu": rng.standard_normal(d).astype(np.float32),
        },
        trajectories={
            "id": np.arange(turns, dtype=np.int64),
            "query_x": rng.standard_normal((turns, k)).astype(np.float32),
            "reply_x": rng.standard_normal((turns, k)).astype(np.float32),
            "query_text": queries,
            "reply_text": replies,
            "tier": tiers,
            "cluster": rng.integers(0, 32, turns).astype(np.int32),
            "created": created,
            "last_hit": created + 5.0,
            "hits": rng.integers(0, 10, turns).astype(np.int32),
        },
        conversation=conversation,
        extra={
            "settings": {"tau": 0.5, "k": k, "tiers": ["RETRIEVE", "AUGMENT", "EXPAND", "EXPLORE"]}
        },
    )
    if app_fields:
        state.tensors["singular_values"] = np.sort(rng.uniform(1, 50, k))[::-1].astype(np.float32)
        state.trajectories["context_key"] = [""] * turns
        state.trajectories["content_key"] = [q.lower() for q in queries]
    return state


def _best(fn: Any, repeats: int) -> tuple[float, Any]:
    """Best wall time of ``repeats`` calls, and the last result.

    The previous call's result is released *before* the clock starts: freeing
    a loaded session is not part of loading the next one (for either format).
    """
    best, result = float("inf"), None
    for _ in range(repeats):
        result = None
        gc.collect()
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


def run(turns: int = 5_000, k: int = 64, d: int = 576, repeats: int = 3) -> dict[str, Any]:
    """Measure v2 and legacy save/load of a ``turns``-turn session.

    Returns ``turns, save_s, load_s, size_bytes, raw_bytes, legacy_save_s,
    legacy_load_s, legacy_size_bytes, load_speedup_vs_legacy,
    size_ratio_vs_raw`` (seconds are the best of ``repeats``); then, for the
    same turns saved as the app saves them (``app_fields``), the file size,
    the peak memory of one load as traced by tracemalloc (and per byte of the
    file), and the upload limit ``MAX_MIKU_BYTES`` over that size.
    """
    from isagi.storage.miku import MAX_MIKU_BYTES, raw_size, read_miku, write_miku
    from isagi.storage.miku.legacy import read_legacy, tensor_path, write_legacy

    state = synthetic_state(turns, k, d)
    with tempfile.TemporaryDirectory(prefix="isagi-bench-miku-") as tmp:
        new = Path(tmp) / "bench.miku"
        old = Path(tmp) / "legacy" / "bench.miku"
        save_s, _ = _best(lambda: write_miku(new, state), repeats)
        load_s, loaded = _best(lambda: read_miku(new), repeats)
        if loaded.trajectories["query_text"] != state.trajectories["query_text"]:
            raise RuntimeError("benchmark round trip lost texts")  # sanity, never expected
        legacy_save_s, _ = _best(lambda: write_legacy(old, state), repeats)
        legacy_load_s, _ = _best(lambda: read_legacy(old), repeats)
        size = new.stat().st_size
        loaded = None
        # the largest real session: what the app saves, its size and load peak
        app = Path(tmp) / "app.miku"
        write_miku(app, synthetic_state(turns, k, d, app_fields=True))
        app_size = app.stat().st_size
        gc.collect()
        tracemalloc.start()
        try:
            read_miku(app)
            app_peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        legacy_size = old.stat().st_size + tensor_path(old).stat().st_size
    raw = raw_size(state)
    return {
        "turns": turns,
        "k": k,
        "d": d,
        "save_s": round(save_s, 4),
        "load_s": round(load_s, 4),
        "size_bytes": size,
        "raw_bytes": raw,
        "legacy_save_s": round(legacy_save_s, 4),
        "legacy_load_s": round(legacy_load_s, 4),
        "legacy_size_bytes": legacy_size,
        "load_speedup_vs_legacy": round(legacy_load_s / load_s, 2) if load_s > 0 else None,
        "size_ratio_vs_raw": round(size / raw, 3) if raw else None,
        "app_size_bytes": app_size,
        "app_load_peak_bytes": app_peak,
        "app_load_peak_per_file_byte": round(app_peak / app_size, 2),
        "max_miku_bytes": MAX_MIKU_BYTES,
        "limit_over_app_size": round(MAX_MIKU_BYTES / app_size, 2),
    }
