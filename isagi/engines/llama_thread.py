"""The one thread of the process that runs llama.cpp's compute (``llama_decode``).

llama.cpp's CPU backend (as llama-cpp-python builds it) runs each decode on an OpenMP
team led by the thread that called ``llama_decode``, and libgomp keeps a team of worker
threads for every thread that has led one, as long as that thread lives. While two
threads had led a team, decodes from either ran markedly slower on the project's 2-core
machine than while only one had (docs/measurements.md, "One thread for llama.cpp"). A
likely cause, not measured apart: libgomp cuts its workers' spinning short once it
manages more threads than there are CPUs, so each decode then wakes them from sleep.
The web app and the API run each turn on a worker thread of their own.

:func:`on_llama_thread` runs a call on one thread owned here, started on first use, and
returns its result; called from that thread, it runs the call in place. A one-slot
llama.cpp engine decodes through it; so does the benches' plain llama-cpp-python baseline
(``isagi bench generate`` and ``bench turn``), so that both sides of a ratio decode on the
same thread. The step runner of an engine with several slots
(:mod:`isagi.engines.llamacpp_steps`) starts its loop here with
:func:`submit_to_llama_thread` and the loop runs while steps are pending: handing each
step over one by one instead cost, under eight busy turns, about what it saved (each
hand-off waits for the interpreter lock).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_executor: ThreadPoolExecutor | None = None
_thread_id: int | None = None
_fork_hook = False


def _mark() -> None:
    global _thread_id
    _thread_id = threading.get_ident()


def _forget() -> None:
    """In a forked child the thread is gone: the next call starts one of the child's own."""
    global _executor, _thread_id
    _executor, _thread_id = None, None


def _pool() -> ThreadPoolExecutor:
    global _executor, _fork_hook
    with _lock:
        if _executor is None:
            if not _fork_hook:
                os.register_at_fork(after_in_child=_forget)
                _fork_hook = True
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="isagi-llama", initializer=_mark)
        return _executor


def is_llama_thread() -> bool:
    """Whether the calling thread is the llama.cpp thread."""
    return threading.get_ident() == _thread_id


def submit_to_llama_thread(fn: Callable[..., T], *args: object) -> Future[T]:
    """Start ``fn(*args)`` on the llama.cpp thread and return at once (its future).

    For a loop that lives there while it has work (the step runner's); the caller must not
    be the llama.cpp thread and wait for it (that would wait for itself)."""
    return _pool().submit(fn, *args)


def on_llama_thread(fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)`` on the llama.cpp thread; its result, or what it raised.

    An interrupt (Ctrl-C) while waiting is raised only once the call has ended, so no
    other use of the context starts while this decode still runs.
    """
    if threading.get_ident() == _thread_id:
        return fn(*args)
    future: Future[T] = _pool().submit(fn, *args)
    try:
        return future.result()
    except BaseException:
        while not future.done():
            try:
                wait([future])
            except BaseException:  # a second interrupt: still wait for the decode
                continue
        raise
