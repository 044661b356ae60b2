"""The llama.cpp context's abort callback (isagi.engines.llamacpp.abort): a Stop ends the decode
of its own prompt only, and only while that decode runs; the compiled callback reads the flag."""

from __future__ import annotations

import ctypes
import threading

from isagi.engines.llamacpp.abort import PromptAbort


def _wait_for(predicate, seconds: float = 10.0) -> bool:
    """``predicate`` became true within ``seconds`` (a wait for the watcher thread, not a timing)."""
    done = threading.Event()
    for _ in range(int(seconds / 0.005)):
        if predicate():
            return True
        done.wait(0.005)
    return predicate()


def _callback_says(abort: PromptAbort) -> bool:
    """What llama.cpp would get from the compiled callback."""
    fn = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p)(abort.pointer)
    return bool(fn(abort.user_data))


def test_a_stop_aborts_its_own_running_decode_and_nothing_after_it():
    abort = PromptAbort()
    stop = threading.Event()
    with abort.watch(stop.is_set) as watch:
        with abort.running(watch):
            assert not _callback_says(abort)
            stop.set()
            assert _wait_for(lambda: _callback_says(abort))
        assert not _callback_says(abort)  # the decode ended: the next one (anyone's) runs whole
        with abort.running(watch):  # a stopped prompt's next batch is aborted at once
            assert _callback_says(abort)
    other = abort.watch(threading.Event().is_set)
    with other as watch, abort.running(watch):
        assert not _callback_says(abort)


def test_a_stop_of_a_waiting_prompt_does_not_abort_the_running_one():
    abort = PromptAbort()
    running_stop, waiting_stop = threading.Event(), threading.Event()
    asked_after_stop = []

    def waiting_stopped() -> bool:
        if waiting_stop.is_set():
            asked_after_stop.append(1)
        return waiting_stop.is_set()

    with abort.watch(running_stop.is_set) as running, abort.watch(waiting_stopped) as waiting:
        with abort.running(running):
            waiting_stop.set()
            # the waiting prompt's watcher has seen its Stop and gone round again (so it has had
            # its chance to write the flag)...
            assert _wait_for(lambda: len(asked_after_stop) >= 2)
            assert not _callback_says(abort)  # ...and the running prompt's decode goes on
            running_stop.set()
            assert _wait_for(lambda: _callback_says(abort))
        with abort.running(waiting):
            assert _callback_says(abort)
