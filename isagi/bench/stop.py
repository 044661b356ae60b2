"""``isagi bench stop``: how long Stop takes to end a turn whose long prompt is being evaluated.

On the configured model and backend: one turn on a ~2,000-token message (a long pasted text)
runs to its end (``full_s``: the prompt's evaluation and a few reply tokens); then, in a fresh
session each time, the same turn is started and Stop is pressed at ``points`` fractions of
``full_s`` (during the prompt's evaluation), and the time from Stop to the turn's end is
measured (``stop_latency_s``: median, max, n, and each one). Every stopped turn must end
``cancelled`` with an empty reply; ``verdicts`` lists what each ended as (a point that came after
a faster turn had ended presses nothing and is not counted in ``n``). ``slots`` is the model's
sequence slots (``ISAGI_PARALLEL``: several go through the step runner); ``load_avg`` is the
machine's 1-minute load average before and after the run (the figures depend on what else runs).
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from typing import Any

from isagi.config import Settings
from isagi.engines.base import GenerationOptions
from isagi.session.turn import Message

POINTS = (0.05, 0.2, 0.36, 0.5, 0.65, 0.8)  # of full_s: early to late in the prompt's evaluation
PASTED = " ".join(f"Note {i}: the tomatoes in bed {i % 7} were watered in the morning, the beans were tied "
                  "to their poles and the lettuce was picked for lunch." for i in range(60))


def run(settings: Settings, *, points: tuple[float, ...] = POINTS) -> dict[str, Any]:
    from isagi.pipeline.engine import Engine

    load_before = os.getloadavg()[0]
    engine = Engine.start(settings, with_store=False)
    text = "Please summarise my garden notes: " + PASTED
    options = GenerationOptions(max_new_tokens=4)

    def turn(stop: threading.Event | None) -> tuple[Any, float]:
        session = engine.new_session(autosave=False)
        done = None
        for event in engine.stream_turn(session, Message(text), options=options, stop=stop):
            done = event
        return done.turn, time.monotonic()  # type: ignore[union-attr]  # the last event is Done

    t0 = time.monotonic()
    turn(None)
    full_s = time.monotonic() - t0
    latencies, verdicts = [], []
    for point in points:
        stop = threading.Event()
        pressed: list[float] = []

        def press(stop: threading.Event = stop, pressed: list[float] = pressed) -> None:
            pressed.append(time.monotonic())
            stop.set()

        timer = threading.Timer(point * full_s, press)
        timer.start()
        stopped, ended = turn(stop)
        timer.cancel()
        if pressed:
            latencies.append(ended - pressed[0])
        verdicts.append(f"{stopped.verdict}{'' if not stopped.reply_text else ' (with a reply)'}")
    return {
        "model": engine.lm.model_id,
        "backend": engine.lm.backend,
        "slots": int(getattr(engine.lm, "slots", 1)),
        "prompt_tokens": engine.lm.count_tokens(text),
        "full_s": round(full_s, 2),
        "stop_latency_median_s": round(statistics.median(latencies), 3) if latencies else None,
        "stop_latency_max_s": round(max(latencies), 3) if latencies else None,
        "n": len(latencies),
        "stop_latencies_s": [round(x, 3) for x in latencies],
        "stopped_at": list(points),
        "verdicts": verdicts,
        "load_avg": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }
