"""Start-up benchmark: process start to a ready ``/health``, cold and warm.

``isagi bench start --json`` runs the real ``isagi web`` twice or more on one
fresh, empty data directory: the first start is *cold* (nothing converted,
nothing calibrated, no database: what a new user meets right after the
install), the later ones are *warm* (everything from the first start is
there). Each time runs from the spawn of the process to the first
``GET /health`` answering ``{"status": "ok"}``, i.e. the page can chat.
The model and backend are those of the environment (``ISAGI_MODEL``,
``ISAGI_BACKEND``, ...), as for ``isagi web``.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any

from isagi.bench import live_server


def run(*, warm_repeats: int = 2, timeout_s: float = 3600.0, keep_home: bool = False) -> dict[str, Any]:
    """Start ``isagi web`` on an empty data directory, then ``warm_repeats`` more times on it."""
    home = Path(tempfile.mkdtemp(prefix="isagi-bench-start-"))
    model = None
    try:
        cold = live_server.start(home, timeout_s)
        model = live_server.health(cold.url).get("model")
        cold.stop()
        warm: list[float] = []
        for _ in range(max(1, warm_repeats)):
            server = live_server.start(home, timeout_s)
            warm.append(server.ready_s)
            server.stop()
    finally:
        if not keep_home:
            shutil.rmtree(home, ignore_errors=True)
    return {
        "cold_s": round(cold.ready_s, 2),
        "warm_s": round(statistics.median(warm), 2),
        "warm_runs_s": [round(w, 2) for w in warm],
        "model": model,
        "note": "spawn of `isagi web` to the first /health {status: ok}; cold = empty data directory",
    }
