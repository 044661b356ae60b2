"""How many threads each ``llama_decode`` runs on, chosen while the engine runs.

llama.cpp's CPU backend (as llama-cpp-python builds it) runs a decode on an OpenMP team, and
its threads meet at a barrier after every node of the graph (hundreds per token). When
another program takes one of the cores, one of the team's threads waits for a core while the
others spin at the barrier: on the project's 2-core machine a one-core busy loop made
two-thread turns several times slower, where one thread kept near its usual speed
(docs/measurements.md, "A busy core beside the server"). No thread count is best for both:
on a quiet machine more threads decode faster. So the count is chosen by timing the decodes.

Owns :class:`ThreadPolicy`, the choice (no llama.cpp in it: a clock and the timings in, a
thread count and a deadline out), and :class:`AdaptiveThreads`, which makes each decode of
one context with the count chosen. The policy keeps, per kind of decode (its number of tokens
rounded to a power of two, and whether its graph stops after the captured layers), the recent
seconds per token with the full count (``ISAGI_THREADS``, every core by default) and with one
thread, and moves between the two:

- With the full count, each decode gets a deadline, :data:`SLOW` times its kind's recent
  time (a kind not timed yet is bounded by the others; the very first decode, bounded by
  nothing, runs on one thread); a decode past it is cut (the abort callback,
  :mod:`isagi.engines.llamacpp.abort`), the positions it wrote are removed from the KV cache
  (llama.cpp removes only those of the micro-batch it was cut in) and it is made again on
  one thread.
  :data:`STRIKES` such decodes in a row and the policy moves to one thread. Now and then
  one decode runs on one thread instead; when that is clearly faster
  (:data:`DROP_MARGIN`) than the mean of the full count's recent ones, the policy moves
  too: a machine loaded all along gives no slow decodes against its own recent times.
  The first comparison comes :data:`CHECK_S` after the start (or a move back); each one
  that finds the full count faster doubles the wait for the next, up to :data:`CHECK_MAX_S`,
  and a decode slower than usual (:data:`SUSPECT` times its kind's recent time, or cut)
  brings the next one within :data:`CHECK_S` again: a busy loop that starts beside a quiet
  server slows its decodes, and the comparison that finds it is then at most that far away. A comparison is a
  decode on the slower count: one a second kept a share of a busy server's decodes on one
  thread (docs/measurements.md, "Fewer comparisons on a quiet machine").
- On one thread, now and then (:data:`PROBE_S`, doubled after each failed try up to
  :data:`PROBE_MAX_S`) one decode tries the full count with a deadline at what one thread
  takes (:data:`BACK_MARGIN` of it): done in time, the policy moves back; cut, it is made
  again on one thread, so a try costs at most about one decode more.

Comparisons and tries take small decodes (:data:`PROBE_TOKENS`), not a turn's prompt.

The counts give the same numbers (llama.cpp splits each node's rows among the threads), so
moving changes no token. ``ISAGI_ADAPT_THREADS=0`` keeps the full count always.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from isagi.engines.llamacpp.abort import ABORTED

SLOW = 2.5  # a full-count decode past this many times its kind's recent seconds per token is cut
STRIKES = 3  # cut decodes in a row that move the policy to one thread
CHECK_S = 1.0  # with the full count: the first wait before one decode runs on one thread to compare
CHECK_MAX_S = 8.0  # ...doubled after each comparison the full count won, up to this
SUSPECT = 1.5  # a full-count decode this many times its kind's recent seconds per token: compare soon
DROP_MARGIN = 0.8  # ...and moves the policy when it took less than this share of the full count's time
PROBE_S = 1.0  # on one thread: the first wait before a decode tries the full count again
PROBE_MAX_S = 8.0  # ...doubled after each try that failed, up to this
BACK_MARGIN = 0.9  # a try moves back when it took less than this share of one thread's time
WINDOW = 16  # recent decodes kept per kind and count
# A comparison or a try runs on a decode of at most this many tokens (a reply's token, a few
# replies' tokens), where the other count's cost is small; on any decode once it is PROBE_MAX_S
# overdue while decodes keep coming (prompts only, back to back: calibration). Else the first
# decode after a pause, a turn's prompt, would take it and the reply's first token would come
# later: a user's next message comes after a pause longer than PROBE_MAX_S, so every turn's
# prompt ran on one thread and its first token came 1.7x later (docs/measurements.md, "The
# first decode after a pause").
PROBE_TOKENS = 8

log = logging.getLogger(__name__)

Kind = tuple[int, bool]  # (the number of tokens' bit length, whether the graph stops early)


def kind_of(n_tokens: int, truncated: bool = False) -> Kind:
    """A decode's kind: its tokens rounded down to a power of two, and whether it is truncated."""
    return max(1, int(n_tokens)).bit_length(), bool(truncated)


@dataclass(frozen=True)
class Choice:
    """How to run one decode: on ``threads`` threads, cut after ``deadline_s`` (None: never);
    ``probe``: a decode that runs on the other count to compare."""

    threads: int
    deadline_s: float | None = None
    probe: bool = False


class ThreadPolicy:
    """The thread count for each decode, from the timings of the ones before (the module's
    docstring). Not thread-safe: one context's decodes come one at a time."""

    def __init__(self, max_threads: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.full = max(1, int(max_threads))
        self.threads = self.full  # the count in use: the full count or 1
        self._clock = clock
        self._times: dict[tuple[int, Kind], deque[float]] = {}
        self._strikes = 0
        self._probe_wait = PROBE_S
        self._check_wait = CHECK_S
        self._next_probe = clock() + CHECK_S
        self._returned_at = -float("inf")
        self._last_at = -float("inf")  # when the last decode ended
        self.drops = 0  # moves to one thread (tests, benches)
        self.returns = 0  # moves back to the full count

    @property
    def adapting(self) -> bool:
        return self.full > 1

    def estimate(self, threads: int, kind: Kind) -> float | None:
        """The recent seconds per token of ``kind`` on ``threads`` threads (their median), if any."""
        got = self._times.get((threads, kind))
        return statistics.median(got) if got else None

    def mean(self, threads: int, kind: Kind) -> float | None:
        """The mean seconds per token of the recent decodes of ``kind`` on ``threads`` threads. A
        comparison reads this, not the median: a core taken now and then slows some decodes a lot
        and leaves the rest as they were, which moves the mean (what a reply waits for), not the median."""
        got = self._times.get((threads, kind))
        return statistics.fmean(got) if got else None

    def _bound(self, n_tokens: int, kind: Kind) -> float | None:
        """Seconds a full-count decode of ``n_tokens`` tokens of ``kind`` should take at most:
        from its kind's recent times; else the least of what bounds it: a kind with fewer tokens
        (a token costs no less in a smaller batch), the smallest decode of a kind with more (a
        decode costs no more than a larger one), one thread's time; a truncated graph is
        bounded by a whole one, not the other way round. None: nothing known yet."""
        exact = self.estimate(self.full, kind)
        if exact is not None:
            return exact * n_tokens
        bits, truncated = kind
        below: tuple[int, float] | None = None
        above: tuple[int, float] | None = None
        for (threads, (b, t)), got in self._times.items():
            if threads != self.full or not got or (t and not truncated):
                continue
            if b <= bits and (below is None or b > below[0]):
                below = (b, statistics.median(got))
            elif b > bits and (above is None or b < above[0]):
                above = (b, statistics.median(got))
        bounds = []
        if below is not None:
            bounds.append(below[1] * n_tokens)
        if above is not None:
            bounds.append(above[1] * 2 ** (above[0] - 1))
        one = self.estimate(1, kind)
        if one is not None:
            bounds.append(one * n_tokens)
        return min(bounds) if bounds else None

    def choose(self, n_tokens: int, kind: Kind) -> Choice:
        """How to run the next decode, of ``n_tokens`` tokens of ``kind``."""
        if self.full == 1:
            return Choice(1)
        now = self._clock()
        # decodes back to back (no pause since the last one): only then may a large one be the probe
        streaming = now - self._last_at < CHECK_S
        overdue = streaming and now >= self._next_probe + PROBE_MAX_S
        due = now >= self._next_probe and (n_tokens <= PROBE_TOKENS or overdue)
        if self.threads == self.full:
            if due and self.estimate(self.full, kind) is not None:
                return Choice(1, probe=True)
            bound = self._bound(n_tokens, kind)
            if bound is None:  # nothing to bound it by: one thread, which a busy core cannot stall
                return Choice(1)
            return Choice(self.full, SLOW * bound)
        one = self.estimate(1, kind)
        if due and one is not None:
            return Choice(self.full, BACK_MARGIN * one * n_tokens, probe=True)
        return Choice(1)

    def record(self, choice: Choice, n_tokens: int, kind: Kind, seconds: float, *, cut: bool = False) -> None:
        """What the decode made as ``choice`` took: ``seconds``, or ``cut`` at its deadline."""
        if self.full == 1:
            return
        now = self._clock()
        self._last_at = now
        per_token = seconds / max(1, n_tokens)
        if choice.threads == self.full and not choice.probe:
            usual = self.estimate(self.full, kind)
            if cut or (usual is not None and per_token > SUSPECT * usual):  # the machine may have changed
                self._check_wait = CHECK_S
                self._next_probe = min(self._next_probe, now + CHECK_S)
        if not cut:
            self._times.setdefault((choice.threads, kind), deque(maxlen=WINDOW)).append(per_token)
        if choice.threads == 1:
            if choice.probe:  # with the full count, one decode on one thread
                full = self.mean(self.full, kind)
                if full is not None and per_token < DROP_MARGIN * full:
                    self._drop(now)
                else:  # the full count won: the next comparison waits longer
                    self._check_wait = min(2 * self._check_wait, CHECK_MAX_S)
                    self._next_probe = now + self._check_wait
            return
        if choice.probe:  # on one thread, a try of the full count
            if cut:
                self._probe_wait = min(2 * self._probe_wait, PROBE_MAX_S)
                self._next_probe = now + self._probe_wait
            else:
                self.threads, self._strikes = self.full, 0
                self.returns += 1
                self._returned_at = now
                log.info("llama.cpp decodes back on %d threads (a try took %.1f ms per token)", self.full, per_token * 1e3)
                self._check_wait = CHECK_S
                self._next_probe = now + CHECK_S
            return
        if cut:
            self._strikes += 1
            if self._strikes >= STRIKES:
                self._drop(now)
        else:
            self._strikes = 0

    def _drop(self, now: float) -> None:
        log.info("llama.cpp decodes moved to 1 thread (%d threads ran slow: another program holds a core?)", self.full)
        self.threads, self._strikes = 1, 0
        self.drops += 1
        # back only a moment ago: that try was a fluke, so the wait goes on growing
        recent = now - self._returned_at < PROBE_MAX_S
        self._probe_wait = min(2 * self._probe_wait, PROBE_MAX_S) if recent else PROBE_S
        self._next_probe = now + self._probe_wait


class AdaptiveThreads:
    """``llama_decode`` of one context on the thread count :class:`ThreadPolicy` chooses.

    ``abort``: the context's :class:`~isagi.engines.llamacpp.abort.PromptAbort`, which cuts a
    decode at its deadline; ``capture``: the context's
    :class:`~isagi.engines.layer_capture.LayerCapture`, armed again for a decode made twice.
    ``adapt=False``: every decode on ``max_threads`` (the policy is not asked)."""

    def __init__(self, ll: Any, ctx: Any, abort: Any, capture: Any, max_threads: int, *, adapt: bool = True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._ll, self._ctx, self._abort, self._capture = ll, ctx, abort, capture
        self.policy = ThreadPolicy(max_threads if adapt else 1, clock=clock)
        self._set = max(1, int(max_threads))  # the context's count now (it is made with the full one)

    @property
    def threads(self) -> int:
        """The count decodes run on now (the full one when not adapting)."""
        return self.policy.threads if self.policy.adapting else self._set

    def _use(self, threads: int) -> None:
        if threads != self._set:
            self._ll.llama_set_n_threads(self._ctx, threads, threads)
            self._set = threads

    def decode(self, batch: Any, n_tokens: int, truncated: bool = False) -> int:
        """``llama_decode(ctx, batch)`` (``n_tokens`` tokens; ``truncated``: the graph stops after
        the captured layers); its status. A decode cut at its deadline is made again on one
        thread; one cut by a Stop returns llama.cpp's abort status as it would without this."""
        policy = self.policy
        if not policy.adapting:
            return int(self._ll.llama_decode(self._ctx, batch))
        kind = kind_of(n_tokens, truncated)
        choice = policy.choose(n_tokens, kind)
        self._use(choice.threads)
        abort = self._abort
        # a batch without positions follows sequence 0: where it starts, for a rollback (one
        # token is one micro-batch, which llama.cpp rolls back itself: no query per reply token)
        first = self._next_position(0) if choice.deadline_s is not None and not batch.pos and n_tokens > 1 else None
        if choice.deadline_s is not None:
            abort.arm_deadline(choice.deadline_s)
        start = time.perf_counter()
        try:
            status = int(self._ll.llama_decode(self._ctx, batch))
        finally:
            cut = abort.disarm_deadline() if choice.deadline_s is not None else False
        seconds = time.perf_counter() - start
        if not (cut and status == ABORTED):
            if status == 0:
                policy.record(choice, n_tokens, kind, seconds)
            return status
        policy.record(choice, n_tokens, kind, seconds, cut=True)
        self._roll_back(batch, n_tokens, first)
        again = Choice(1)
        self._use(1)
        self._capture.restart()
        start = time.perf_counter()
        status = int(self._ll.llama_decode(self._ctx, batch))
        if status == 0:
            policy.record(again, n_tokens, kind, time.perf_counter() - start)
        return status

    def _next_position(self, seq: int) -> int:
        return int(self._ll.llama_memory_seq_pos_max(self._ll.llama_get_memory(self._ctx), seq)) + 1

    def _roll_back(self, batch: Any, n_tokens: int, first: int | None) -> None:
        """Remove from the KV cache every position the cut ``batch`` may have written, so that it
        can be made again. llama.cpp removes only those of the micro-batch it was cut in; a batch
        of several sequences, or longer than a micro-batch, has written others before it."""
        ll = self._ll
        mem = ll.llama_get_memory(self._ctx)
        if not batch.pos:  # positions follow sequence 0 from where it stood (None: one token)
            if first is not None:
                ll.llama_memory_seq_rm(mem, 0, first, -1)
            return
        starts: dict[int, int] = {}
        for i in range(n_tokens):
            seq, pos = int(batch.seq_id[i][0]), int(batch.pos[i])
            starts[seq] = min(pos, starts.get(seq, pos))
        for seq, pos in starts.items():
            ll.llama_memory_seq_rm(mem, seq, pos, -1)
