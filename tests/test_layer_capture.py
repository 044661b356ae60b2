"""The compiled eval callback (isagi.engines.layer_capture) driven as llama.cpp's scheduler
drives it, on hand-made ``struct ggml_tensor`` values: which nodes it asks for, what it copies,
when it ends a graph, and what it refuses."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from isagi.engines.layer_capture import GGML_TYPE_F32, GgmlTensor, LayerCapture, name_words

WIDTH = 6
CALLBACK = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_bool, ctypes.c_void_p)


def _tensor(name: bytes, data: np.ndarray, kind: int = GGML_TYPE_F32) -> GgmlTensor:
    t = GgmlTensor()
    t.type = kind
    t.ne[0], t.ne[1], t.ne[2], t.ne[3] = data.shape[1], data.shape[0], 1, 1
    t.data = data.ctypes.data
    t.name = name
    return t


@pytest.fixture
def cap():
    c = LayerCapture(WIDTH)
    c.call = lambda t, ask: bool(CALLBACK(c.pointer)(ctypes.addressof(t), ask, c.user_data))
    return c


def test_it_asks_for_exactly_the_wanted_names(cap) -> None:
    wanted = {b"l_out-17": 18, b"l_out-19": 20}
    cap.start(wanted, 2)
    rows = np.zeros((2, WIDTH), np.float32)
    for name, want in [(b"l_out-17", True), (b"l_out-19", True), (b"l_out-1", False), (b"l_out-170", False),
                       (b"l_out-18", False), (b"ffn_out-17", False), (b"", False)]:
        assert cap.call(_tensor(name, rows), True) is want, name
    cap.stop()
    assert cap.call(_tensor(b"l_out-17", rows), True) is False  # nothing asked for once stopped


def test_a_name_that_only_starts_like_a_wanted_one_is_not_taken_for_it() -> None:
    """Names are compared up to their NUL: leftover bytes after it do not matter, a longer name does."""
    w0, w1, m0, m1 = name_words(b"l_out-9")
    raw = np.frombuffer(b"l_out-9\0garbage!", dtype="<i8")
    assert (int(raw[0]) & m0) == w0 and (int(raw[1]) & m1) == w1
    longer = np.frombuffer(b"l_out-99\0\0\0\0\0\0\0\0", dtype="<i8")
    assert (int(longer[0]) & m0) != w0


def test_it_copies_the_wanted_rows_and_ends_a_truncated_graph_after_the_last(cap) -> None:
    wanted = {b"l_out-17": 18, b"l_out-19": 20}
    a = np.arange(3 * WIDTH, dtype=np.float32).reshape(3, WIDTH)
    b = -a
    cap.start(wanted, 3, truncate=True)
    assert cap.call(_tensor(b"l_out-17", a), False) is True  # go on: one layer still to come
    assert not cap.complete()
    assert cap.call(_tensor(b"l_out-19", b), False) is False  # every layer read: stop the graph
    assert cap.complete()
    got = cap.rows()
    np.testing.assert_array_equal(got[18], a)
    np.testing.assert_array_equal(got[20], b)
    a[:] = 7  # the result is a copy, not a view of llama.cpp's (reused) memory
    assert got[18][0, 0] == 0
    cap.start(wanted, 3)  # without truncation the graph always goes on
    assert cap.call(_tensor(b"l_out-17", a), False) is True
    assert cap.call(_tensor(b"l_out-19", b), False) is True


def test_unexpected_data_is_reported_not_copied(cap) -> None:
    wanted = {b"l_out-17": 18}
    rows = np.ones((2, WIDTH), np.float32)
    cap.start(wanted, 2)
    cap.call(_tensor(b"l_out-17", rows, kind=1), False)  # an f16 tensor
    assert not cap.complete()
    cap.start(wanted, 1)
    cap.call(_tensor(b"l_out-17", rows), False)  # more rows than the batch has tokens
    assert not cap.complete()
    cap.start(wanted, 2)
    cap.call(_tensor(b"l_out-17", np.ones((2, WIDTH + 1), np.float32)), False)  # another width
    assert not cap.complete()
    cap.start(wanted, 2)
    cap.call(_tensor(b"l_out-17", rows), False)
    assert cap.complete()


def test_buffers_grow_for_a_longer_batch_and_too_many_layers_are_refused(cap) -> None:
    wanted = {b"l_out-3": 4}
    big = np.random.default_rng(0).standard_normal((700, WIDTH)).astype(np.float32)
    cap.start(wanted, 700)
    cap.call(_tensor(b"l_out-3", big), False)
    assert cap.complete()
    np.testing.assert_array_equal(cap.rows()[4], big)
    with pytest.raises(ValueError, match="at most"):
        cap.start({f"l_out-{i}".encode(): i + 1 for i in range(5)}, 1)
    with pytest.raises(ValueError, match="longer than 15"):
        name_words(b"a" * 16)


def test_without_a_writable_numba_cache_the_callback_is_compiled_for_the_process(monkeypatch) -> None:
    import isagi.engines.layer_capture as lc

    real = lc.cfunc

    def no_cache(signature, **kw):
        if kw.get("cache"):
            raise RuntimeError("cannot cache function '_callback': no locator available")
        return real(signature, **kw)

    monkeypatch.setattr(lc, "cfunc", no_cache)
    monkeypatch.setattr(lc, "_COMPILED", None)
    assert lc.compiled_callback().address
