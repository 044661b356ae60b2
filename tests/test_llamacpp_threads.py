"""isagi.engines.llamacpp.threads without a model: the thread-count policy on a fake clock and
made-up timings (it drops to one thread when decodes slow down, tries the full count again
and goes back once it is fast, stays put on a quiet machine), and AdaptiveThreads on a
stand-in for llama.cpp (a decode cut at its deadline is made again on one thread, a Stop's
abort is not). The compiled callback's deadline is checked on its own."""

from __future__ import annotations

import ctypes
import threading

import pytest

from isagi.engines.llamacpp import threads as th
from isagi.engines.llamacpp.abort import ABORTED, PromptAbort
from isagi.engines.llamacpp.threads import AdaptiveThreads, Choice, ThreadPolicy, kind_of

ONE = kind_of(1)
FAST, ON_ONE = 0.006, 0.009  # seconds per token: the full count and one thread on a quiet machine


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _step(policy: ThreadPolicy, clock: Clock, full_s: float, one_s: float, n: int = 1) -> Choice:
    """One decode of ``n`` tokens taking ``full_s`` per token on the full count and ``one_s``
    on one thread; a full-count decode past its deadline is cut and made again on one thread,
    as AdaptiveThreads does. The clock moves by what it took."""
    kind = kind_of(n)
    choice = policy.choose(n, kind)
    took = (full_s if choice.threads > 1 else one_s) * n
    if choice.deadline_s is not None and took > choice.deadline_s:
        clock.now += choice.deadline_s
        policy.record(choice, n, kind, choice.deadline_s, cut=True)
        clock.now += one_s * n
        policy.record(Choice(1), n, kind, one_s * n)
    else:
        clock.now += took
        policy.record(choice, n, kind, took)
    return choice


def _run(policy: ThreadPolicy, clock: Clock, seconds: float, full_s: float, one_s: float) -> list[Choice]:
    end = clock.now + seconds
    out = []
    while clock.now < end:
        out.append(_step(policy, clock, full_s, one_s))
    return out


def test_a_quiet_machine_keeps_the_full_count():
    clock = Clock()
    policy = ThreadPolicy(2, clock=clock)
    choices = _run(policy, clock, 60.0, FAST, ON_ONE)
    assert policy.threads == 2 and policy.drops == 0
    assert choices[0] == Choice(1)  # the first decode, with nothing to bound it by
    on_one = [c for c in choices[1:] if c.threads == 1]
    assert on_one and all(c.probe for c in on_one)  # then only the comparisons, now and then...
    assert len(on_one) <= 60.0 / th.CHECK_S + 1  # ...at most one per CHECK_S
    assert all(c.deadline_s is not None for c in choices[1:] if c.threads == 2)


def test_on_a_quiet_machine_comparisons_grow_rarer_and_a_slow_decode_brings_the_next_one_soon():
    """A comparison is a decode on the slower count: each one the full count wins doubles the
    wait for the next (up to CHECK_MAX_S); a decode cut as slow brings the next one within CHECK_S."""
    clock = Clock()
    policy = ThreadPolicy(2, clock=clock)
    at = []
    end = clock.now + 120.0
    while clock.now < end:
        now = clock.now
        if _step(policy, clock, FAST, ON_ONE).probe:
            at.append(now)
    gaps = [b - a for a, b in zip(at, at[1:], strict=False)]
    assert gaps and all(b >= a - 0.05 for a, b in zip(gaps, gaps[1:], strict=False))  # never closer again
    assert gaps[0] < 2.5 * th.CHECK_S and th.CHECK_MAX_S - 0.1 <= gaps[-1] <= th.CHECK_MAX_S + 0.1
    assert len(at) <= 120.0 / th.CHECK_MAX_S + 4  # (a comparison a second would be 120)
    assert policy.threads == 2 and policy.drops == 0
    cut_at = clock.now
    assert _step(policy, clock, 40 * FAST, ON_ONE).threads == 2  # cut at its deadline, made again on one
    while not _step(policy, clock, FAST, ON_ONE).probe:
        assert clock.now - cut_at <= th.CHECK_S + 0.1
    assert policy.threads == 2 and policy.drops == 0  # one slow decode moves nothing


def test_a_busy_core_drops_to_one_thread_within_a_few_decodes():
    clock = Clock()
    policy = ThreadPolicy(2, clock=clock)
    _run(policy, clock, 5.0, FAST, ON_ONE)
    hog = []
    while policy.threads == 2 and len(hog) < 2 * th.STRIKES:
        hog.append(_step(policy, clock, 40 * FAST, 1.3 * ON_ONE))
    assert policy.threads == 1 and policy.drops == 1
    on_full = [c for c in hog if c.threads == 2]
    assert len(on_full) == th.STRIKES  # STRIKES cut decodes in a row (a comparison may come between)
    # each slow decode was cut at its deadline: SLOW times the quiet time, not 40 times
    assert all(c.deadline_s is not None and c.deadline_s <= th.SLOW * FAST * 1.01 for c in on_full)


def test_one_slow_decode_is_not_enough_to_drop():
    clock = Clock()
    policy = ThreadPolicy(2, clock=clock)
    _run(policy, clock, 5.0, FAST, ON_ONE)
    for _ in range(5):
        for _ in range(th.STRIKES - 1):
            _step(policy, clock, 40 * FAST, ON_ONE)
        while _step(policy, clock, FAST, ON_ONE).threads != 2:  # one fast decode on the full count
            pass
    assert policy.threads == 2 and policy.drops == 0


def test_on_one_thread_it_tries_the_full_count_and_goes_back_once_the_core_is_free():
    clock = Clock()
    policy = ThreadPolicy(2, clock=clock)
    _run(policy, clock, 5.0, FAST, ON_ONE)
    _run(policy, clock, 60.0, 40 * FAST, 1.3 * ON_ONE)  # a minute beside a busy loop
    assert policy.threads == 1 and policy.drops == 1 and policy.returns == 0
    tried = _run(policy, clock, 60.0, 40 * FAST, 1.3 * ON_ONE)
    probes = [c for c in tried if c.probe]
    # tries of the full count, further apart after each failure, each cut at one thread's time
    assert 60.0 / th.PROBE_MAX_S - 1 <= len(probes) <= 60.0 / th.PROBE_MAX_S + 2
    assert all(c.threads == 2 and c.deadline_s is not None and c.deadline_s < 1.3 * ON_ONE for c in probes)
    _run(policy, clock, th.PROBE_MAX_S + 1.0, FAST, ON_ONE)  # the busy loop ends
    assert policy.threads == 2 and policy.returns == 1


def test_a_machine_loaded_from_the_start_moves_to_one_thread_by_comparing():
    """Slow all along: no decode is slow against its own recent times, the comparison moves it."""
    clock = Clock()
    policy = ThreadPolicy(2, clock=clock)
    _run(policy, clock, 10.0, 3 * FAST, 1.2 * ON_ONE)
    assert policy.threads == 1
    _run(policy, clock, 30.0, 3 * FAST, 1.2 * ON_ONE)
    assert policy.threads == 1 and policy.returns == 0


def test_kinds_are_timed_apart_and_an_untimed_kind_is_bounded_by_the_others():
    clock = Clock()
    policy = ThreadPolicy(2, clock=clock)
    first = policy.choose(40, kind_of(40))
    assert first == Choice(1)  # nothing known yet: one thread, which nothing can stall
    for _ in range(8):
        _step(policy, clock, FAST, ON_ONE, n=1)
    # a 40-token prompt on the full count, never timed: bounded by one thread's time for it and by
    # the single tokens' time (a token costs no less alone than in a batch); the least of them
    policy.record(first, 40, kind_of(40), 40 * ON_ONE / 8)
    choice = policy.choose(40, kind_of(40))
    assert choice.threads == 2
    assert choice.deadline_s == pytest.approx(th.SLOW * 40 * ON_ONE / 8)
    policy.record(choice, 40, kind_of(40), 40 * FAST / 10)  # prompts cost less per token
    assert policy.estimate(2, kind_of(40)) == pytest.approx(FAST / 10)
    assert policy.estimate(2, ONE) == pytest.approx(FAST)
    assert policy.choose(40, kind_of(40)).deadline_s == pytest.approx(th.SLOW * 40 * FAST / 10)
    # a truncated graph is bounded by the whole one; a whole graph is not bounded by a truncated one
    assert policy._bound(40, kind_of(40, truncated=True)) == pytest.approx(40 * FAST / 10)
    fresh = ThreadPolicy(2, clock=clock)
    fresh.record(Choice(2), 1, kind_of(1, truncated=True), FAST / 2)
    assert fresh.choose(1, ONE) == Choice(1)
    # a decode smaller than any timed one costs no more than the smallest decode of that kind
    fresh.record(Choice(2), 40, kind_of(40), 40 * FAST / 10)
    assert fresh._bound(3, kind_of(3)) == pytest.approx(32 * FAST / 10)


def test_one_thread_or_no_adapting_never_changes_anything():
    clock = Clock()
    policy = ThreadPolicy(1, clock=clock)
    assert all(c == Choice(1) for c in _run(policy, clock, 10.0, FAST, ON_ONE))
    assert not policy.adapting and policy.drops == 0


# -- AdaptiveThreads on a stand-in for llama.cpp ------------------------------------------------------


class _Batch:
    """A llama_batch stand-in: ``n`` tokens, with positions and sequences (``pos`` None: they
    follow sequence 0, as ``llama_batch_get_one``'s)."""

    def __init__(self, n: int, pos: list[int] | None = None, seqs: list[int] | None = None) -> None:
        self.n, self.pos = n, pos
        self.seq_id = [[s] for s in seqs] if seqs is not None else None


class _Llama:
    """llama_decode stand-in: each call takes what the test says for its thread count; a call
    past the armed deadline is cut as the compiled callback would (status 2). It keeps the KV
    cache's positions per sequence as llama.cpp does: a batch runs in micro-batches of
    ``UBATCH`` tokens, a cut removes only the positions of the one it was cut in, and a batch
    whose positions do not follow a sequence's is refused (status -1)."""

    UBATCH = 2

    def __init__(self, abort: PromptAbort, clock: Clock, per_token: dict[int, float]) -> None:
        self.abort, self.clock, self.per_token = abort, clock, per_token
        self.threads = 2
        self.calls: list[int] = []  # the thread count of each llama_decode
        self.stop_next = False
        self.kv: dict[int, list[int]] = {}  # sequence: its positions, in order

    def llama_set_n_threads(self, ctx: object, n: int, n_batch: int) -> None:
        assert n == n_batch
        self.threads = n

    def llama_get_memory(self, ctx: object) -> str:
        return "mem"

    def llama_memory_seq_pos_max(self, mem: str, seq: int) -> int:
        return self.kv[seq][-1] if self.kv.get(seq) else -1

    def llama_memory_seq_rm(self, mem: str, seq: int, p0: int, p1: int) -> bool:
        assert p1 == -1
        self.kv[seq] = [p for p in self.kv.get(seq, []) if p < p0]
        return True

    def _tokens(self, batch: _Batch) -> list[tuple[int, int]]:
        if batch.pos is None:
            start = self.llama_memory_seq_pos_max("mem", 0) + 1
            return [(0, start + i) for i in range(batch.n)]
        assert batch.seq_id is not None
        return [(batch.seq_id[i][0], batch.pos[i]) for i in range(batch.n)]

    def llama_decode(self, ctx: object, batch: _Batch) -> int:
        self.calls.append(self.threads)
        tokens = self._tokens(batch)
        for seq in {s for s, _ in tokens}:
            first = min(p for s, p in tokens if s == seq)
            if first != self.llama_memory_seq_pos_max("mem", seq) + 1:
                return -1  # llama.cpp: "inconsistent sequence positions"
        if self.stop_next:  # a Stop pressed while this decode ran
            self.stop_next = False
            return ABORTED
        took = self.per_token[self.threads] * batch.n
        ctl = self.abort.ctl
        deadline_s = (int(ctl[2]) - _now_ns()) / 1e9 if int(ctl[2]) else None
        ubatches = [tokens[i:i + self.UBATCH] for i in range(0, len(tokens), self.UBATCH)]
        if deadline_s is not None and took > deadline_s:
            ctl[3] = 1  # what the compiled callback notes when it cuts
            self.clock.now += deadline_s
            done = max(1, int(len(ubatches) * deadline_s / took))  # cut in this micro-batch
            for ub in ubatches[:done]:
                for seq, pos in ub:
                    self.kv.setdefault(seq, []).append(pos)
            for seq in {s for s, _ in ubatches[done - 1]}:  # llama.cpp removes only the cut one's
                self.llama_memory_seq_rm("mem", seq, min(p for s, p in ubatches[done - 1] if s == seq), -1)
            return ABORTED
        for seq, pos in tokens:
            self.kv.setdefault(seq, []).append(pos)
        self.clock.now += took
        return 0


class _Capture:
    def __init__(self) -> None:
        self.restarts = 0

    def restart(self) -> None:
        self.restarts += 1


def _now_ns() -> int:
    import time

    return time.monotonic_ns()


def test_a_decode_cut_at_its_deadline_is_made_again_on_one_thread(monkeypatch):
    clock = Clock()
    abort = PromptAbort()
    ll = _Llama(abort, clock, {2: FAST, 1: ON_ONE})
    capture = _Capture()
    # the stand-in's decodes take no real time: time them on the fake clock
    monkeypatch.setattr(th.time, "perf_counter", clock)
    dec = AdaptiveThreads(ll, object(), abort, capture, 2, clock=clock)
    for _ in range(10):
        assert dec.decode(_Batch(1), 1) == 0
    assert ll.calls[0] == 1 and set(ll.calls[1:]) == {2} and capture.restarts == 0
    ll.per_token[2] = 40 * FAST  # a busy core
    ll.calls.clear()
    for _ in range(th.STRIKES):
        assert dec.decode(_Batch(1), 1) == 0
    assert ll.calls == [2, 1] * th.STRIKES and capture.restarts == th.STRIKES
    assert dec.threads == 1
    ll.calls.clear()
    assert dec.decode(_Batch(1), 1) == 0 and ll.calls == [1]


@pytest.mark.parametrize("kind", ["sequence 0", "several sequences"])
def test_a_batch_cut_after_some_micro_batches_is_made_again_with_each_position_once(monkeypatch, kind):
    """llama.cpp removes only the positions of the micro-batch a cut ended in; the ones before
    it stay in the KV cache, and the batch made again would find them (refused: status -1) or,
    following sequence 0, be put after them. The decoder removes what the batch wrote first."""
    clock = Clock()
    abort = PromptAbort()
    ll = _Llama(abort, clock, {2: FAST, 1: ON_ONE})
    monkeypatch.setattr(th.time, "perf_counter", clock)
    dec = AdaptiveThreads(ll, object(), abort, _Capture(), 2, clock=clock)
    n = 8  # four micro-batches
    if kind == "sequence 0":
        for _ in range(5):
            assert dec.decode(_Batch(n), n) == 0
        start = ll.kv[0][-1] + 1
        ll.per_token[2] = 3 * FAST  # past SLOW times its usual: cut in its third micro-batch
        assert dec.decode(_Batch(n), n) == 0
        assert ll.calls[-2:] == [2, 1]
        assert ll.kv[0] == list(range(start + n))  # each position once, in order
    else:
        seqs, pos = [0, 1, 2, 3] * 2, [0] * 4 + [1] * 4
        for k in range(5):
            assert dec.decode(_Batch(n, [p + 2 * k for p in pos], seqs), n) == 0
        ll.per_token[2] = 3 * FAST
        assert dec.decode(_Batch(n, [p + 10 for p in pos], seqs), n) == 0
        assert ll.calls[-2:] == [2, 1]
        assert all(ll.kv[s] == list(range(12)) for s in range(4))


def test_a_stop_is_not_taken_for_a_deadline(monkeypatch):
    clock = Clock()
    abort = PromptAbort()
    ll = _Llama(abort, clock, {2: FAST, 1: ON_ONE})
    monkeypatch.setattr(th.time, "perf_counter", clock)
    dec = AdaptiveThreads(ll, object(), abort, _Capture(), 2, clock=clock)
    for _ in range(5):
        dec.decode(_Batch(1), 1)
    ll.calls.clear()
    ll.stop_next = True
    assert dec.decode(_Batch(8), 8) == ABORTED  # returned as it is: the caller raises PrefillStopped
    assert ll.calls == [2] and dec.policy.drops == 0


def test_not_adapting_calls_llama_decode_on_the_full_count_only():
    clock = Clock()
    abort = PromptAbort()
    ll = _Llama(abort, clock, {2: 40 * FAST, 1: ON_ONE})
    dec = AdaptiveThreads(ll, object(), abort, _Capture(), 2, adapt=False, clock=clock)
    for _ in range(20):
        assert dec.decode(_Batch(1), 1) == 0
    assert set(ll.calls) == {2} and dec.threads == 2


def test_the_compiled_callback_cuts_only_past_an_armed_deadline():
    abort = PromptAbort()
    ask = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p)(abort.pointer)

    def says_abort(times: int = 64) -> bool:  # llama.cpp asks after every node
        return any(ask(abort.user_data) for _ in range(times))

    assert not says_abort()
    abort.arm_deadline(60.0)
    assert not says_abort()
    assert not abort.disarm_deadline()
    abort.arm_deadline(0.001)
    threading.Event().wait(0.01)
    assert says_abort()
    assert abort.disarm_deadline()  # it was the deadline...
    assert not says_abort()  # ...and with none armed, nothing is cut
    stop = threading.Event()
    stop.set()
    with abort.watch(stop.is_set) as watch, abort.running(watch):
        abort.arm_deadline(60.0)
        assert says_abort(1)  # a Stop aborts at once...
        assert not abort.disarm_deadline()  # ...and is not a deadline's cut


def test_comparisons_and_tries_take_small_decodes_unless_only_prompts_come():
    clock = Clock()
    policy = ThreadPolicy(2, clock=clock)
    prompt = kind_of(50)
    for _ in range(4):
        _step(policy, clock, FAST, ON_ONE, n=1)
        _step(policy, clock, FAST / 5, ON_ONE / 4, n=50)
    clock.now += th.CHECK_S + 1.0  # a pause: the comparison is due, and a turn's prompt comes first
    assert not policy.choose(50, prompt).probe
    assert policy.choose(1, ONE).probe
    clock.now += 10 * th.PROBE_MAX_S  # a long pause (the user reads, types): still not the prompt
    assert not policy.choose(50, prompt).probe
    # only prompts, back to back, for a long while (calibration): once overdue, they take it
    probes = []
    end = clock.now + 2 * th.PROBE_MAX_S
    while clock.now < end:
        probes.append(_step(policy, clock, FAST / 5, ON_ONE / 4, n=50).probe)
    assert any(probes) and not probes[0]


def test_a_core_taken_now_and_then_moves_the_mean_and_the_policy():
    """One full-count decode in three slowed (under its deadline, so never cut) leaves the
    median where it was; the comparison reads the mean, what a reply waits for, and moves."""
    clock = Clock()
    policy = ThreadPolicy(2, clock=clock)
    _run(policy, clock, 5.0, FAST, ON_ONE)
    slow = 2.4 * FAST  # under SLOW times the quiet time: not cut
    end = clock.now + 4 * th.CHECK_S
    k = 0
    while clock.now < end and policy.threads == 2:
        _step(policy, clock, slow if k % 3 == 2 else FAST, 1.1 * FAST)
        k += 1
    assert policy.estimate(2, ONE) == pytest.approx(FAST)  # the median did not move
    assert policy.threads == 1 and policy.drops == 1
