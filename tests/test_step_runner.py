"""isagi.engines.llamacpp_steps.StepRunner without a model: a stand-in for llama.cpp's
batch API records each ``llama_decode`` (its tokens and the thread that made it), so the
runner's scheduling can be checked in a moment. The real model's side (replies equal to
those decoded alone) is tests/test_llamacpp_steps.py."""

from __future__ import annotations

import ctypes
import threading
import time

import numpy as np
import pytest

from isagi.engines.llama_thread import on_llama_thread
from isagi.engines.llamacpp_steps import Step, StepRunner

VOCAB = 16


class _Batch:
    def __init__(self, n: int) -> None:
        self.token, self.pos, self.n_seq_id = [0] * n, [0] * n, [0] * n
        self.logits = [False] * n
        self.seq_id = [[0] for _ in range(n)]
        self.n_tokens = 0


class _Llama:
    """What StepRunner calls of llama-cpp-python's low-level API. A token's logits peak at
    (token + position) % VOCAB, so each output row can be traced to its input."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, list[tuple[int, int, int]]]] = []  # (thread, [(token, pos, seq)])
        self.fail_next = False
        self._logits = (ctypes.c_float * 1)()

    def llama_batch_init(self, n: int, embd: int, n_seq_max: int) -> _Batch:
        return _Batch(n)

    def llama_batch_free(self, batch: _Batch) -> None:
        pass

    def llama_decode(self, ctx: object, b: _Batch) -> int:
        items = [(b.token[i], b.pos[i], b.seq_id[i][0]) for i in range(b.n_tokens)]
        self.calls.append((threading.get_ident(), items))
        time.sleep(0.002)  # a decode takes a while: other threads' steps pile up meanwhile
        if self.fail_next:
            self.fail_next = False
            return 1
        rows = np.zeros((len(items), VOCAB), np.float32)
        for i, (token, pos, _) in enumerate(items):
            rows[i, (token + pos) % VOCAB] = 1.0
        self._logits = (ctypes.c_float * rows.size)(*rows.ravel())
        return 0

    def llama_get_logits_ith(self, ctx: object, i: int) -> int:
        return ctypes.addressof(self._logits) + 4 * VOCAB * i


class _NoCapture:
    def stop(self) -> None:
        pass


@pytest.fixture
def runner():
    ll = _Llama()
    r = StepRunner(ll, object(), _NoCapture(), VOCAB, n_seq_max=8, lock=threading.Lock(), n_batch=8)
    yield r, ll
    r.free()


def _reply(r: StepRunner, seq: int, n: int, out: dict[int, list[int]]) -> None:
    """A greedy 'reply' of ``n`` tokens in sequence ``seq``: a prompt step, then a token per step."""
    first = r.run(Step(seq, [seq, seq], 0))
    token, got = int(np.argmax(first.out_logits[-1])), []
    r.open(seq)
    try:
        for pos in range(2, 2 + n):
            got.append(token)
            token = int(np.argmax(r.run(Step(seq, [token], pos)).out_logits[-1]))
    finally:
        r.close(seq)
    out[seq] = got


def _expected(seq: int, n: int) -> list[int]:
    token, got = (seq + 1) % VOCAB, []
    for pos in range(2, 2 + n):
        got.append(token)
        token = (token + pos) % VOCAB
    return got


def test_every_decode_runs_on_the_llama_thread_and_replies_share_decodes(runner):
    r, ll = runner
    r.gather_s = 0.1  # (5 ms by default: a thread the machine delays longer would miss a shared step)
    out: dict[int, list[int]] = {}
    threads = [threading.Thread(target=_reply, args=(r, seq, 12, out)) for seq in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out == {seq: _expected(seq, 12) for seq in range(4)}  # each row went back to its own step
    llama_thread = on_llama_thread(threading.get_ident)
    assert {thread for thread, _ in ll.calls} == {llama_thread}
    assert llama_thread not in {t.ident for t in threads}
    assert max(len(items) for _, items in ll.calls) > 1  # some decode carried several sequences' tokens
    assert len(ll.calls) < 4 * 13  # fewer decodes than steps
    for _, items in ll.calls:  # a prompt (its two tokens at 0, 1) alone; else one token per sequence, ascending
        seqs, positions = [s for _, _, s in items], [p for _, p, _ in items]
        is_prompt = positions[:2] == [0, 1]
        assert (len(set(seqs)) == 1 and len(items) == 2) if is_prompt else seqs == sorted(set(seqs))


def test_a_prompt_longer_than_a_chunk_is_decoded_in_chunks_and_keeps_its_positions(runner):
    r, ll = runner
    tokens = list(range(20))
    step = r.run(Step(3, tokens, 5, logits="all"))
    assert [len(items) for _, items in ll.calls] == [8, 8, 4]
    assert [p for _, items in ll.calls for _, p, _ in items] == list(range(5, 25))
    assert step.out_logits.shape == (20, VOCAB)
    assert list(step.out_logits.argmax(axis=1)) == [(t + 5 + t) % VOCAB for t in tokens]


def test_a_failed_decode_reaches_its_caller_and_the_next_step_still_runs(runner):
    r, ll = runner
    ll.fail_next = True
    with pytest.raises(RuntimeError, match="llama_decode failed with status 1"):
        r.run(Step(0, [1], 0))
    assert int(np.argmax(r.run(Step(0, [1], 0)).out_logits[-1])) == 1


def test_a_step_asked_for_on_the_llama_thread_runs_there_in_place(runner):
    r, ll = runner
    step = on_llama_thread(r.run, Step(2, [7], 4))
    assert int(np.argmax(step.out_logits[-1])) == 11
    assert ll.calls[-1][0] == on_llama_thread(threading.get_ident)


def test_a_job_runs_on_the_llama_thread_between_decodes_and_its_caller_does_not_wait(runner):
    r, ll = runner
    ll_thread = on_llama_thread(threading.get_ident)
    started, release, ran = threading.Event(), threading.Event(), []
    decode = ll.llama_decode

    def slow_decode(ctx: object, b: _Batch) -> int:  # a decode that runs until released
        started.set()
        release.wait(5)
        return decode(ctx, b)

    ll.llama_decode = slow_decode
    prompt = threading.Thread(target=r.run, args=(Step(1, [3, 4, 5], 0),))
    prompt.start()
    assert started.wait(5)
    t0 = time.monotonic()
    r.later(lambda: ran.append((threading.get_ident(), len(ll.calls))))
    assert time.monotonic() - t0 < 0.5 and not ran  # queued: the caller went on while the decode runs
    release.set()
    prompt.join(5)
    deadline = time.monotonic() + 5
    while not ran and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ran == [(ll_thread, 1)]  # on the llama.cpp thread, after the decode that was running
    on_llama_thread(r.later, lambda: ran.append("inline"))
    assert ran[-1] == "inline"  # asked for on that thread: done at once


def test_a_prompts_reused_prefix_is_set_up_on_the_llama_thread_and_only_the_rest_is_decoded(runner):
    r, ll = runner
    where: list[int] = []

    def reuse() -> int:
        where.append(threading.get_ident())
        return 3  # the sequence already holds the first three tokens

    step = r.run(Step(2, [10, 11, 12, 13, 14], 0, reuse=reuse))
    assert where == [on_llama_thread(threading.get_ident)]
    assert ll.calls[-1][1] == [(13, 3, 2), (14, 4, 2)]  # the rest, at its positions
    assert (step.start, step.tokens) == (3, [13, 14])
    assert int(np.argmax(step.out_logits[-1])) == (14 + 4) % VOCAB
    r.run(Step(2, [10, 11], 0, reuse=lambda: 1))  # one token left: still a prompt, decoded alone
    assert ll.calls[-1][1] == [(11, 1, 2)]


def test_a_job_that_cannot_reach_the_llama_thread_is_not_queued(runner, monkeypatch):
    import isagi.engines.llamacpp_steps as steps

    r, _ll = runner

    def no_thread(*args: object) -> None:
        raise RuntimeError("cannot schedule new futures after interpreter shutdown")

    monkeypatch.setattr(steps, "submit_to_llama_thread", no_thread)
    with pytest.raises(RuntimeError):
        r.later(lambda: None)
    assert not r._jobs and not r._running  # nothing left to run later, and the next step starts a loop
    with pytest.raises(RuntimeError):  # a step likewise: taken back, not left waiting for a loop
        r.run(Step(0, [1], 0))
    assert not r._pending and not r._running
    monkeypatch.undo()
    assert int(np.argmax(r.run(Step(0, [1], 0)).out_logits[-1])) == 1
