"""Loading the shared engine in the background, with visible progress.

Owns the life cycle *loading → ready | failed* of the one :class:`Engine` the
web app shares. The server binds at once, so ``/health`` can answer
``503 {"status": "loading", "stage": ...}`` and the page can show what is
happening; progress is also printed to the terminal.

What the banner says is what the loader does for the model in use
(:func:`first_stage`, :func:`calibrating`): it loads the model; it says it converts
only when it does (the embedded model on the transformers backend, not yet converted),
and that it calibrates only when no cached or shipped profile fits (the profile's own
stages then report, each prefixed :data:`CALIBRATING`). The embedded model on llama.cpp
ships its profile: its start only loads.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from isagi.app.public import public_text

log = logging.getLogger(__name__)

ProgressFn = Callable[[str, int, int], None]

LOADING = "Loading the model"
CONVERTING = "Converting the embedded model for the transformers backend (once; later starts reuse it)"
CALIBRATING = "Calibrating the model for these settings (once, minutes on a CPU; later starts reuse it)"
_OWN_STAGES = (LOADING, CONVERTING, CALIBRATING)


def first_stage(settings: Any) -> str:
    """What loading ``settings``' model does first: :data:`CONVERTING` when the embedded model
    goes to the transformers backend and has no converted copy yet, else :data:`LOADING`."""
    if getattr(settings, "model", None) != "default":
        return LOADING
    try:
        from isagi.engines import choose_backend

        backend, _ = choose_backend(settings)
    except Exception:  # an impossible setting: loading says why
        return LOADING
    models = getattr(settings, "models_dir", None)
    converted = models is not None and any(models.glob("smollm2-135m-instruct-*/model.safetensors"))
    return CONVERTING if backend == "transformers" and not converted else LOADING


def calibrating(progress: ProgressFn) -> ProgressFn:
    """``progress`` for the profile's stages, which report only when it calibrates (none fits)."""
    return lambda stage, done, total: progress(f"{CALIBRATING}: {stage}", done, total)


class EngineLoading(RuntimeError):
    """The engine is not ready yet (the message says what it is doing)."""


class EngineHolder:
    """Holds the engine, or the state of its loading.

    ``source`` is either a ready engine or a factory ``factory(progress) ->
    engine``; a factory runs in a daemon thread started by :meth:`start`.
    ``on_progress`` (optional) also receives every progress report, e.g. to
    print it to the terminal.
    """

    def __init__(self, source: Any, *, on_progress: ProgressFn | None = None) -> None:
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._engine: Any = None
        self._factory: Callable[[ProgressFn], Any] | None = None
        self.error: str | None = None
        self.stage = "starting"  # /health's word until the loader reports
        self.done = 0
        self.total = 0
        self.started_at = time.monotonic()
        self.ready_at: float | None = None
        self._on_progress = on_progress
        self._thread: threading.Thread | None = None
        if callable(source) and not hasattr(source, "stream_turn"):
            self._factory = source
        else:
            self._set_engine(source)

    # -- state -------------------------------------------------------------
    def _set_engine(self, engine: Any) -> None:
        with self._lock:
            self._engine = engine
            self.stage = "ready"
            self.ready_at = time.monotonic()
        self._ready.set()

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self._engine is not None

    @property
    def failed(self) -> bool:
        return self.error is not None

    def progress(self, stage: str, done: int, total: int) -> None:
        with self._lock:
            self.stage, self.done, self.total = stage, int(done), int(total)
        if self._on_progress is not None:
            self._on_progress(stage, done, total)

    def status(self) -> dict[str, Any]:
        """A JSON-able summary: status loading | ready | failed, the stage and counts."""
        with self._lock:
            if self.error is not None:
                return {"status": "failed", "error": self.error}
            if self._engine is not None:
                return {"status": "ready"}
            out: dict[str, Any] = {"status": "loading", "stage": self.stage}
            if self.total:
                out["done"], out["total"] = self.done, self.total
            out["elapsed_s"] = round(time.monotonic() - self.started_at, 1)
            return out

    def describe(self) -> str:
        """One line for the page: what the loader is doing."""
        st = self.status()
        if st["status"] == "failed":
            return f"The model could not be loaded: {st['error']}"
        if st["status"] == "ready":
            return "ready"
        counts = f" ({st['done']}/{st['total']})" if "total" in st else ""
        stage = str(st["stage"])
        if stage == "starting":
            what = LOADING
        elif stage.startswith(_OWN_STAGES):
            what = stage
        else:
            what = f"{LOADING}: {stage}"
        return f"{what}{counts}, {st['elapsed_s']:.0f} s so far"

    @property
    def engine(self) -> Any:
        """The engine; raises :class:`EngineLoading` (with what is happening) until ready."""
        if self._engine is None:
            raise EngineLoading(self.describe() + ". Try again once the model is ready.")
        return self._engine

    # -- loading -----------------------------------------------------------
    def start(self) -> None:
        """Start the factory in a background thread (no-op if ready or already started)."""
        if self._factory is None or self._thread is not None:
            return
        factory = self._factory

        def run() -> None:
            try:
                engine = factory(self.progress)
            except Exception as exc:  # shown on the page and by /health, without server paths
                msg = str(exc) or type(exc).__name__
                log.error("loading the engine failed: %s", msg)
                with self._lock:
                    self.error = public_text(msg)
                    self.stage = "failed"
                if self._on_progress is not None:  # the terminal: the operator's, with the detail
                    self._on_progress(f"failed: {msg}", 0, 0)
                self._ready.set()
                return
            self._set_engine(engine)
            if self._on_progress is not None:
                self._on_progress("ready", 1, 1)

        self._thread = threading.Thread(target=run, name="isagi-engine-loader", daemon=True)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until loading ended (ready or failed); True if ready."""
        self._ready.wait(timeout)
        return self.ready
