"""One ``llama_decode`` for every sequence with a token to decode: the step runner of a
llama.cpp context with several sequence slots (``ISAGI_PARALLEL``).

Owns :class:`StepRunner`. Each decoding thread hands it a :class:`Step` (its sequence's
tokens at their positions, whether it wants logits and which layers' states) and waits.
The runner's loop lives on the llama.cpp thread (:mod:`isagi.engines.llama_thread`) while
steps are pending, so every decode of the context comes from that one thread (on the thread
count :mod:`isagi.engines.llamacpp.threads` chooses): it puts
every waiting single-token step into one batch (ascending sequence order), runs
``llama_decode`` once, copies each step's logits and captured rows out, and wakes their
threads. A prompt (more than one token) runs in chunks of its own, taking turns with the
replies' tokens (a reply waits at most one chunk, a prompt is not held back until every
reply has ended). A prompt a Stop may end (``Step.stop``) ends between its chunks, inside
one (the context's abort callback, :mod:`isagi.engines.llamacpp.abort`: a chunk holds this
sequence's tokens alone, so no other sequence's work is cut), or while it waits in the queue.
A prompt's reused prefix (``Step.reuse``: a saved KV cache loaded into its sequence) is set
up here too, just before its first chunk, and a closing decoding's sequence is saved and
emptied here between two decodes (:meth:`StepRunner.later`): done on a turn's own thread,
each waited for the engine's lock, that is for the decode running (eight busy turns: 84 ms
a close; docs/measurements.md, "KV cache upkeep on the llama.cpp thread").
A chunk never shares a batch with other sequences' tokens: with one KV
stream per sequence, llama.cpp cuts a batch into ubatches holding the same number of
tokens of each sequence (``split_equal``), so the mix would become many small ubatches,
and the eval callback runs once per ubatch.

The context must be made with ``n_seq_max`` = the slot count and ``kv_unified`` off: each
sequence then has its own KV stream starting at cell 0, and a sequence's greedy reply is
the same token for token as in a context of its own (``isagi bench batch``).
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from isagi.engines.base import PrefillStopped
from isagi.engines.llama_thread import is_llama_thread, submit_to_llama_thread
from isagi.engines.llamacpp.abort import ABORTED, POLL_S, PromptAbort, StopWatch

log = logging.getLogger(__name__)


@dataclass
class Step:
    """Tokens of one sequence to evaluate, and what the caller wants back."""

    seq: int
    tokens: list[int]
    start: int  # the position of tokens[0] in the sequence
    logits: str = "last"  # "last", "all" or "none"
    capture: dict[bytes, int] | None = None  # node name -> layer, as LayerCapture takes it
    truncate: bool = False  # states only: the graph may stop after the captured layers
    stop: StopWatch | None = None  # a prompt a Stop may end: between chunks, inside one, or while it waits
    # a prompt's KV cache set up on the llama.cpp thread before its first chunk: returns how many
    # leading tokens the sequence already holds (they are then not evaluated; ``start`` moves on)
    reuse: Callable[[], int] | None = None
    # filled in by the runner
    out_logits: np.ndarray | None = None  # (n, vocab): the logits asked for, in token order
    out_states: dict[int, np.ndarray] = field(default_factory=dict)  # layer -> (n, d)
    error: BaseException | None = None
    finished: threading.Event = field(default_factory=threading.Event, repr=False)  # its caller waits on it
    # a prompt's progress through its chunks (the runner's)
    evaluated: int = 0
    parts: dict[int, list[np.ndarray]] = field(default_factory=dict)
    logit_rows: list[np.ndarray] = field(default_factory=list)

    @property
    def single(self) -> bool:
        """One token to decode (batched with other sequences' tokens), not a prompt."""
        return len(self.tokens) == 1 and self.reuse is None

    @property
    def done(self) -> bool:
        return self.finished.is_set()

    def finish(self, error: BaseException | None = None) -> None:
        """Done (with ``error`` when its decode failed): its caller wakes."""
        if error is not None:
            self.error = error
        self.finished.set()


class StepRunner:
    """Runs the steps of every sequence of one context, batching single-token steps."""

    def __init__(self, ll: Any, ctx: Any, capture: Any, n_vocab: int, *, n_seq_max: int, lock: Any,
                 n_batch: int = 512, abort: PromptAbort | None = None, decoder: Any = None) -> None:
        """``lock``: the engine's, held around each ``llama_decode`` (and by its KV state reads and
        writes); ``abort``: the context's abort callback, which ends a stopped prompt's chunk;
        ``decoder``: what makes each ``llama_decode`` on the thread count chosen
        (:class:`~isagi.engines.llamacpp.threads.AdaptiveThreads`; None: ``ll.llama_decode`` as it is)."""
        self._ll, self._ctx, self._capture, self._n_vocab = ll, ctx, capture, n_vocab
        self._decoder = decoder
        self._abort = abort
        self._lock = lock
        self._n_batch = n_batch
        self._batch = ll.llama_batch_init(n_batch, 0, n_seq_max)
        self._pending: deque[Step] = deque()
        self._jobs: deque[Callable[[], None]] = deque()  # KV cache upkeep between decodes (later())
        self._cv = threading.Condition()
        self._running = False
        self._active: set[int] = set()  # sequences decoding a reply (open .. close)
        self.gather_s = 0.005  # how long a step waits for the other decoding sequences' tokens
        self.linger_s = 0.02  # how long the loop, with nothing pending, waits for a decoding sequence's next step
        # A prompt's tokens per llama_decode: replies decoding wait at most one chunk. The same
        # chunks as the engine's one-sequence path (512): llama.cpp's CPU kernels round a
        # batch's sums by its size, so other chunks would part a prompt's states (and, rarely, a
        # greedy reply) from the ones the same prompt gets alone.
        self.prompt_chunk = n_batch
        self._last_singles = False  # what the last group was (singles and prompt chunks alternate)
        self.decodes = 0  # llama_decode calls (tests: a step of N replies is one call)
        self.evaluated_tokens = 0  # tokens decoded here (every sequence's; only the runner counts)

    def free(self) -> None:
        if self._batch is not None:
            self._ll.llama_batch_free(self._batch)
            self._batch = None

    def later(self, job: Callable[[], None]) -> None:
        """Run ``job`` on the llama.cpp thread before the next decode, without waiting for it
        (at once when called there; raises, queuing nothing, when that thread cannot be
        started). For a closing decoding's upkeep of the KV cache (saving its sequence as a
        prefix, emptying it): done between two decodes, it waits for no decode, where the
        closing turn would wait for the engine's lock, that is for the decode running (a
        reply's step or a prompt's chunk), before its answer could end. Jobs run before any step
        queued after them. A job must not raise; what one raises is logged."""
        if is_llama_thread():
            self._run_job(job)
            return
        with self._cv:
            self._jobs.append(job)
            self._cv.notify_all()
            self._start_loop(self._jobs, job)

    def _start_loop(self, queue: deque[Any], item: Any) -> None:
        """(Held: the condition.) :meth:`_loop` started on the llama.cpp thread unless it runs;
        when that thread cannot be started (the interpreter is exiting), ``item`` is taken back
        out of ``queue`` and the error raised: nothing is left queued for a loop that never
        comes, and the next call tries again."""
        if self._running:
            return
        try:
            submit_to_llama_thread(self._loop)
        except BaseException:
            queue.remove(item)
            raise
        self._running = True

    @staticmethod
    def _run_job(job: Callable[[], None]) -> None:
        try:
            job()
        except Exception:  # pragma: no cover - a job ends in finally blocks of its own
            log.exception("a KV cache job failed")

    def open(self, seq: int) -> None:
        """Sequence ``seq`` is decoding: a step waits (a moment) for its next token."""
        with self._cv:
            self._active.add(seq)

    def close(self, seq: int) -> None:
        """Sequence ``seq`` has ended: nobody waits for it."""
        with self._cv:
            self._active.discard(seq)
            self._cv.notify_all()

    def _gather(self) -> None:
        """Wait up to :attr:`gather_s` for every decoding sequence's next token (held: the lock)."""
        deadline = time.monotonic() + self.gather_s
        while True:
            waiting = {s.seq for s in self._pending if s.single}
            if not waiting or self._active <= waiting:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._cv.wait(left)

    def run(self, step: Step) -> Step:
        """Evaluate ``step`` (in a batch with others' single tokens when it is one token) and
        return it with its logits and states; raises what its ``llama_decode`` raised.

        The steps run on the llama.cpp thread (:mod:`isagi.engines.llama_thread`): the first
        step to find no loop running starts :meth:`_loop` there, and the loop runs until no
        step is left. An interrupt while waiting takes the step back if it has not started,
        or waits for its decode to end."""
        on_thread = is_llama_thread()
        with self._cv:
            self._pending.append(step)
            self._cv.notify_all()  # a loop gathering tokens takes this one too
            if on_thread:  # a step asked for on the llama.cpp thread itself: run the loop here
                while not step.done:
                    self._loop_held()
            else:
                self._start_loop(self._pending, step)
        try:
            # its own event: a decode wakes only the threads it served; a stopped prompt that is
            # still queued (behind another prompt's chunk) is taken back at once
            while not step.finished.wait(None if step.stop is None else POLL_S):
                assert step.stop is not None
                if step.stop.stopped():
                    raise PrefillStopped
        except BaseException:
            with self._cv:
                taken_back = step in self._pending
                if taken_back:
                    self._pending.remove(step)
            while not taken_back and not step.done:  # its decode runs: the context is in use until it ends
                try:
                    step.finished.wait()
                except BaseException:
                    continue
            raise
        if step.error is not None:
            raise step.error
        return step

    def _loop(self) -> None:
        """On the llama.cpp thread: evaluate groups of steps until none is pending."""
        with self._cv:
            self._loop_held()

    def _loop_held(self) -> None:
        """:meth:`_loop` with the condition held (it is released around each decode)."""
        self._running = True
        try:
            while True:
                while self._jobs:  # before any decode: the closing turns waiting for them end sooner
                    job = self._jobs.popleft()
                    self._cv.release()
                    try:
                        self._run_job(job)
                    finally:
                        self._cv.acquire()
                if not self._pending:
                    # A reply decoding sends its next token in a moment: stay for it rather than
                    # end and be started again for each token.
                    if self._active:
                        self._cv.wait(self.linger_s)
                    if self._jobs:
                        continue
                    if not self._pending:
                        break
                self._gather()
                if self._jobs:  # queued while gathering: a closing turn's save goes before its next prompt
                    continue
                group = self._take()
                self._cv.release()
                try:
                    self._evaluate(group)
                finally:
                    self._cv.acquire()
        except BaseException as exc:  # a fault of the loop itself: no waiter may wait forever
            for s in self._pending:
                s.finish(exc)
            self._pending.clear()
            while self._jobs:  # (they give slots back)
                self._run_job(self._jobs.popleft())
            raise
        finally:
            self._running = False
            self._cv.notify_all()

    def _take(self) -> list[Step]:
        """The next group to evaluate: every pending single-token step (ascending sequence, at most
        one per sequence), or the oldest prompt's next chunk. Singles and a prompt's chunks take
        turns: replies keep going while a long prompt is evaluated, and a new prompt is not held
        back until every reply has ended."""
        singles: dict[int, Step] = {}
        prompt: Step | None = None
        for s in self._pending:
            if s.single:
                singles.setdefault(s.seq, s)
            elif prompt is None:
                prompt = s
        if prompt is not None and (not singles or self._last_singles):
            self._pending.remove(prompt)
            self._last_singles = False
            return [prompt]
        group = [singles[k] for k in sorted(singles)]
        for s in group:
            self._pending.remove(s)
        self._last_singles = True
        return group

    def _evaluate(self, group: list[Step]) -> None:
        """Evaluate ``group``; a prompt with chunks left goes back to the front of the queue."""
        finished = True
        try:
            if len(group) == 1 and not group[0].single:
                finished = self._prompt(group[0])
            else:
                self._singles(group)
        except BaseException as exc:  # every waiter learns it
            for s in group:
                s.error = exc
        if finished or group[0].error is not None:
            for s in group:
                s.finish()
        else:
            with self._cv:
                self._pending.appendleft(group[0])

    def _fill(self, items: list[tuple[int, int, int, bool]]) -> None:
        b = self._batch
        for i, (token, pos, seq, logits) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
            b.seq_id[i][0] = seq
        b.n_tokens = len(items)

    def _llama_decode(self, n: int, truncate: bool) -> int:
        if self._decoder is None:
            return int(self._ll.llama_decode(self._ctx, self._batch))
        return int(self._decoder.decode(self._batch, n, truncate))

    def _decode(self, n: int, capture: dict[bytes, int] | None, truncate: bool,
                stop: StopWatch | None = None) -> dict[int, np.ndarray]:
        cap = self._capture
        with self._lock:
            if capture:
                cap.start(capture, n, truncate=truncate)
            try:
                if stop is not None and self._abort is not None:
                    with self._abort.running(stop):
                        status = self._llama_decode(n, truncate)
                else:
                    status = self._llama_decode(n, truncate)
            finally:
                cap.stop()
        if status == ABORTED and stop is not None:
            raise PrefillStopped  # llama.cpp removed the cut chunk's positions from the cache
        if status != 0:
            raise RuntimeError(f"llama_decode failed with status {status}")
        if capture and not cap.complete():  # pragma: no cover - a graph without these nodes
            raise RuntimeError(f"llama.cpp's graph gave no whole {sorted(capture)} outputs")
        self.decodes += 1
        self.evaluated_tokens += n
        return {layer: rows[:n].copy() for layer, rows in cap.rows().items()} if capture else {}

    def _logits(self, i: int) -> np.ndarray:
        ptr = self._ll.llama_get_logits_ith(self._ctx, i)
        return np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(self._n_vocab,)).copy()

    def _singles(self, group: list[Step]) -> None:
        """One token of each sequence in one ``llama_decode``; rows in ascending sequence order."""
        capture: dict[bytes, int] = {}
        for s in group:
            capture.update(s.capture or {})
        self._fill([(s.tokens[0], s.start, s.seq, s.logits != "none") for s in group])
        rows = self._decode(len(group), capture or None, truncate=False)
        for i, s in enumerate(group):
            if s.logits != "none":
                s.out_logits = self._logits(i)[None, :]
            s.out_states = {layer: rows[layer][i : i + 1] for layer in (s.capture or {}).values()}

    def _prompt(self, s: Step) -> bool:
        """The next chunk (:attr:`prompt_chunk` tokens at most) of a prompt of one sequence;
        True once its last chunk is evaluated (its states and logits are then set)."""
        if s.stop is not None and s.stop.stopped():
            raise PrefillStopped
        if s.reuse is not None:  # here, not on the caller's thread: no wait for the decode running
            held, s.reuse = s.reuse(), None
            s.tokens, s.start = s.tokens[held:], s.start + held
        n = len(s.tokens)
        off = s.evaluated
        chunk = s.tokens[off : off + self.prompt_chunk]
        last_chunk = off + len(chunk) == n
        want = [s.logits == "all" or (s.logits == "last" and last_chunk and j == len(chunk) - 1)
                for j in range(len(chunk))]
        self._fill([(t, s.start + off + j, s.seq, w) for j, (t, w) in enumerate(zip(chunk, want, strict=True))])
        rows = self._decode(len(chunk), s.capture, s.truncate, s.stop)
        for layer, got in rows.items():
            s.parts.setdefault(layer, []).append(got)
        s.logit_rows += [self._logits(j) for j, w in enumerate(want) if w]
        s.evaluated = off + len(chunk)
        if not last_chunk:
            return False
        s.out_states = {layer: np.concatenate(p) for layer, p in s.parts.items() if p}
        s.out_logits = np.stack(s.logit_rows) if s.logit_rows else None
        s.parts, s.logit_rows = {}, []
        return True
