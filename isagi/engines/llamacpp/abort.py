"""Stop inside a prompt's ``llama_decode``: the context's abort callback, compiled, and what arms it.

Owns :class:`PromptAbort`, the llama.cpp context's ``abort_callback``. A Stop checked only
between the ``llama_decode`` calls of a prompt waits for the call running: on a busy CPU one
call of 64 tokens was seen to take 2.4 s where it usually takes 0.24 s (docs/measurements.md,
"Stop during a long prompt's evaluation"). llama.cpp's CPU backend asks the abort callback
after every node of the graph and, on True, ends the compute; ``llama_decode`` then returns 2
and removes the cut batch's positions from the KV cache. So Stop ends a prompt's evaluation
within one node, whatever the CPU's load.

The callback is compiled (numba ``cfunc``, as the eval callback of
:mod:`isagi.engines.layer_capture`): it is asked after every node of every decode, replies'
tokens included, and a Python callback would need the interpreter lock each time. It reads
a two-word control array: the key of the stoppable prompt whose ``llama_decode`` runs (0:
none), and whether to abort. A turn's Stop is a :class:`threading.Event` the engine is not
told about, so a stoppable prompt has a watcher thread (:meth:`PromptAbort.watch`) that
polls it and, once it is set, asks for the abort while that prompt's decode runs, and only
then: with one sequence several turns' prompts may wait for the engine's lock, and a Stop
of a waiting one must not end another's decode.

The same callback cuts a decode that runs past a deadline (:meth:`PromptAbort.arm_deadline`):
the thread count's policy (:mod:`isagi.engines.llamacpp.threads`) gives one to decodes on
several threads, which a busy CPU can slow many times over. The callback reads the monotonic
clock itself (``clock_gettime``, every few nodes, and only while a deadline is armed), so no
thread has to wake to cut a decode; it notes that the deadline cut it, so a cut is not taken
for a Stop.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from llvmlite import ir
from numba import carray, cfunc, types
from numba.core import cgutils
from numba.extending import intrinsic

# the control array's words: the running stoppable prompt's key, whether to abort it, the
# deadline (CLOCK_MONOTONIC nanoseconds, 0: none), whether the deadline cut the decode, and
# the nodes asked about since the deadline was armed
_RUNNING, _ABORT, _DEADLINE, _EXPIRED, _NODES = range(5)
_CTL_LEN = 5
_CLOCK_EVERY = 8  # nodes between two readings of the clock (a node takes microseconds)
_CLOCK_MONOTONIC = 1  # as in <time.h> on Linux; time.monotonic_ns reads the same clock
ABORTED = 2  # llama_decode's status when the abort callback ended the compute
POLL_S = 0.02  # how often a watcher looks at its Stop: what it may add to a Stop's latency


@intrinsic
def _monotonic_ns(typingctx: Any) -> Any:
    """``clock_gettime(CLOCK_MONOTONIC)`` in nanoseconds, called by name (so numba can cache
    the compiled callback; a ctypes function would be a dynamic global)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        i32, i64 = ir.IntType(32), ir.IntType(64)
        ts = cgutils.alloca_once(builder, ir.ArrayType(i64, 2))  # struct timespec
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i32, [i32, cgutils.voidptr_t]),
                                            "clock_gettime")
        builder.call(fn, [ir.Constant(i32, _CLOCK_MONOTONIC), builder.bitcast(ts, cgutils.voidptr_t)])
        sec = builder.load(builder.gep(ts, [ir.Constant(i32, 0), ir.Constant(i32, 0)]))
        nsec = builder.load(builder.gep(ts, [ir.Constant(i32, 0), ir.Constant(i32, 1)]))
        return builder.add(builder.mul(sec, ir.Constant(i64, 1_000_000_000)), nsec)

    return types.int64(), codegen


def _callback(user: Any) -> bool:
    ctl = carray(user, (_CTL_LEN,), np.int64)
    if ctl[_ABORT] != 0:
        return True
    if ctl[_DEADLINE] == 0:
        return False
    ctl[_NODES] += 1
    if ctl[_NODES] % _CLOCK_EVERY != 0:
        return False
    # numba's stub types an @intrinsic with its typing context as the first argument, which
    # compiled code never passes
    if _monotonic_ns() > ctl[_DEADLINE]:  # type: ignore[call-arg]
        ctl[_EXPIRED] = 1
        return True
    return False


_COMPILED: Any = None


def compiled_callback() -> Any:
    """The ``cfunc`` of the callback: compiled on first use in a process (or loaded from numba's cache)."""
    global _COMPILED
    if _COMPILED is None:
        signature = types.boolean(types.voidptr)
        try:
            _COMPILED = cfunc(signature, nopython=True, cache=True)(_callback)  # type: ignore[call-arg]
        except RuntimeError:  # numba found no writable cache directory: compile for this process only
            _COMPILED = cfunc(signature, nopython=True)(_callback)  # type: ignore[call-arg]
    return _COMPILED


@dataclass
class StopWatch:
    """A stoppable prompt: its key, and whether its Stop has been pressed."""

    key: int
    stopped: Callable[[], bool]
    done: threading.Event = field(default_factory=threading.Event, repr=False)


class PromptAbort:
    """The abort callback's state: which stoppable prompt's decode runs, and whether to end it."""

    def __init__(self) -> None:
        self.ctl = np.zeros(_CTL_LEN, dtype=np.int64)
        self.pointer = compiled_callback().address  # llama.cpp's abort_callback
        self.user_data = int(self.ctl.ctypes.data)  # and its data: the control array
        self._lock = threading.Lock()
        self._keys = itertools.count(1)

    @contextmanager
    def watch(self, stopped: Callable[[], bool]) -> Iterator[StopWatch]:
        """A :class:`StopWatch` for a prompt evaluated inside the block: a thread polls
        ``stopped`` every :data:`POLL_S` and, once it says True, aborts the prompt's decode
        whenever one runs (:meth:`running`); it ends with the block."""
        watch = StopWatch(next(self._keys), stopped)

        def poll() -> None:
            while not watch.done.wait(POLL_S):
                if watch.stopped():
                    with self._lock:
                        if int(self.ctl[_RUNNING]) == watch.key:
                            self.ctl[_ABORT] = 1

        thread = threading.Thread(target=poll, name="isagi-stop-watch", daemon=True)
        thread.start()
        try:
            yield watch
        finally:
            watch.done.set()  # the thread wakes at once and ends; it never writes after this

    @contextmanager
    def running(self, watch: StopWatch | None) -> Iterator[None]:
        """Around one ``llama_decode`` of ``watch``'s prompt: its Stop may end it."""
        if watch is None:
            yield
            return
        with self._lock:
            self.ctl[_RUNNING], self.ctl[_ABORT] = watch.key, int(watch.stopped())
        try:
            yield
        finally:
            with self._lock:
                self.ctl[_RUNNING], self.ctl[_ABORT] = 0, 0

    def arm_deadline(self, seconds: float) -> None:
        """The next ``llama_decode`` (on this thread) is cut ``seconds`` from now, unless it ends before."""
        ctl = self.ctl
        ctl[_EXPIRED], ctl[_NODES] = 0, 0
        ctl[_DEADLINE] = time.monotonic_ns() + max(1, int(seconds * 1e9))

    def disarm_deadline(self) -> bool:
        """No deadline any more; whether it cut the decode."""
        ctl = self.ctl
        ctl[_DEADLINE] = 0
        return bool(ctl[_EXPIRED])
