"""isagi.engines.llama_thread: every call runs on one thread, whoever calls, and comes back
with its result or its exception; a call from that thread runs in place (no deadlock)."""

from __future__ import annotations

import threading
import time

import pytest

from isagi.engines.llama_thread import on_llama_thread


def test_calls_from_many_threads_run_on_one_thread_that_is_none_of_theirs():
    ran: list[int] = []
    callers: list[int] = []

    def call() -> None:
        callers.append(threading.get_ident())
        assert on_llama_thread(lambda x: (ran.append(threading.get_ident()), x * 2)[1], 21) == 42

    threads = [threading.Thread(target=call) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    call()
    assert len(ran) == 7 and len(set(ran)) == 1
    assert not set(ran) & set(callers)


def test_an_exception_comes_back_to_the_caller_and_the_thread_goes_on():
    def boom() -> None:
        raise RuntimeError("llama_decode failed")

    with pytest.raises(RuntimeError, match="llama_decode failed"):
        on_llama_thread(boom)
    assert on_llama_thread(lambda: "still there") == "still there"


def test_a_call_made_on_the_llama_thread_runs_in_place():
    def outer() -> tuple[int, int]:
        return threading.get_ident(), on_llama_thread(threading.get_ident)

    here, inner = on_llama_thread(outer)
    assert here == inner


def test_calls_from_several_threads_never_overlap():
    inside, most = [0], [0]
    guard = threading.Lock()

    def slow() -> None:
        with guard:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        time.sleep(0.01)
        with guard:
            inside[0] -= 1

    threads = [threading.Thread(target=on_llama_thread, args=(slow,)) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most[0] == 1
