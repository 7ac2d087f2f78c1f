"""Continuous batching of beam search: one :class:`Batcher` (and one worker thread) per model.

Requests wait in a bounded queue (full: :class:`QueueFull`, which the use case turns into the service's 429 +
Retry-After).
At every step boundary the worker

1. drops waiting requests whose client is gone, sheds waiting requests that can no longer finish before their
   deadline (:class:`WouldMissDeadline`: 429 + Retry-After, like a refusal at the door: they never got rows), and
   removes the rows of running requests whose client is gone or whose deadline has passed (so a disconnect or a
   deadline frees rows before the next step runs);
2. admits waiting requests, first come first served, while their rows fit under ``max_rows``, up to
   ``max_batch`` images at a time, and has them encoded: by an encoder thread of its own while the worker
   goes on decoding (``overlap_encoding``, with a worker thread), or at once in the worker; encoded requests'
   (request, beam) rows join a row table at the next step boundary;
3. runs one decoding step over every row of every table (:class:`captioner.service.row_table.RowTable`), then one
   top-k per beam group
   (:func:`captioner.models.decoding.beam_step`, the function :func:`captioner.models.decoding.beam_search` uses);
4. hands finished requests their result (one backtrack per table for all requests that finished at this step, and
   one copy to the host of each of its maps: tokens, log-probabilities, attention, each extra, and the scores) and
   removes their rows.

So a request joins and leaves at step boundaries without waiting for anybody else's caption, each request keeps
its own beam width and length limit, and an idle worker sleeps on a condition variable: a request arriving at an
idle server starts at once.  Because every row's arithmetic is the same as in ``beam_search`` (the same step, the
same per-group top-k), batching changes nothing but speed.

Rows are grouped into tables by the shapes of their state (dim 0 aside): all rows of an LSTM captioner share
one table, while a Transformer whose cache grows every step gets one table per cohort that started together.
Per step the worker synchronises with the device once per table (to learn which requests finished), never per
request.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Callable

import torch
from starlette.concurrency import run_in_threadpool

from captioner.models.decoding import NO_RULES, DecodingRules
from captioner.models.inference import CaptionResult, Prepared, Runtime

from .admission import AdmissionEstimate, QueueFull
from .metrics import Metrics
from .row_table import Job, RowTable

__all__ = ["BeamTooWide", "Batcher", "DeadlineExceeded", "ENCODE_TOLERANCE", "NotAccepting", "QueueFull"]

log = logging.getLogger("captioner.batcher")


class NotAccepting(RuntimeError):
    """The batcher is shutting down (or not started) and takes no new requests."""


class DeadlineExceeded(TimeoutError):
    """The request's deadline passed before its caption was finished."""


class BeamTooWide(ValueError):
    """A beam wider than the row budget: it could never be given its rows."""


#: encoder batch sizes whose time per image is within this fraction of the lowest count as equally fast
ENCODE_TOLERANCE = 0.05


class Batcher:
    """Continuous-batching beam search for one model (see the module docstring).

    Two measurements steer it:

    * ``encode_batch``: images are encoded in chunks of this size (at most ``max_batch`` are admitted per step
      boundary).  It starts at ``max_batch``; :meth:`calibrate` times the encoder at each size and keeps the
      largest whose time per image is within ``ENCODE_TOLERANCE`` of the lowest, because a bigger batch is not
      always cheaper per image (on a CPU, the early activation maps of a large batch leave the cache:
      benchmarks/bench_encoder.py).
    * deadline-aware admission (``admission``, a :class:`~captioner.service.admission.AdmissionEstimate`):
      moving averages, updated at every step, of the time a step takes (encoding at that boundary included) and
      of the rows decoded per second, and of the steps a finished request took.  A new request whose expected
      finish (:meth:`expected_wait_s`) lies beyond its deadline is refused at once with
      :class:`WouldMissDeadline`, so that the requests that are admitted meet theirs.  Until the first
      measurement every request is admitted.
    """

    def __init__(self, runtime: Runtime, max_batch: int = 16, queue_size: int = 64, max_rows: int = 256,
                 metrics: Metrics | None = None, clock=time.monotonic, on_idle: Callable[[], None] | None = None,
                 overlap_encoding: bool = True):
        """``overlap_encoding``: with a worker thread, encode admitted images in a thread of their own while the
        worker decodes (the CNN and the decoding steps then use two cores; on a CPU the CNN is most of a
        request's cost); without, or with ``start(worker=False)``, the worker encodes them itself."""
        if max_rows < 1 or max_batch < 1 or queue_size < 1:
            raise ValueError("max_rows, max_batch and queue_size must be positive")
        self.runtime = runtime
        self.overlap_encoding = overlap_encoding
        self._encoder: ThreadPoolExecutor | None = None
        # chunks of admitted jobs being encoded by the encoder thread, oldest first: (jobs, future of (enc, state))
        self._encoding: deque[tuple[list[Job], Future]] = deque()
        self.max_batch, self.queue_size, self.max_rows = max_batch, queue_size, max_rows
        self.metrics = metrics or Metrics()
        self.clock = clock
        self.on_idle = on_idle  # called by the worker when it runs out of work (the app returns freed memory)
        self.encode_batch = max_batch
        self.metrics.set_encode_batch(runtime.name, max_batch)
        # admission control's measurements (written by the worker, read by submit): see expected_wait_s
        self.admission = AdmissionEstimate(runtime.name)
        self._learn_lengths = True  # False while calibrate submits captions of an artificial length
        self._encode_timings: dict[int, float] | None = None  # per-image encode seconds by batch size (calibrate)
        self._pending: deque[Job] = deque()
        self._tables: list[RowTable] = []
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._accepting = False
        self._stop_when_idle = False
        self._abort = False
        self.active_rows = 0
        self.active_jobs = 0  # admitted requests whose rows are in a table (written by the worker only)

    # -- event-loop side ------------------------------------------------------------------------------------
    def start(self, worker: bool = True) -> None:
        """Accept requests and start the worker thread; ``worker=False`` accepts requests but leaves the step
        loop to :meth:`run_once` (deterministic tests and benchmarks)."""
        self._accepting = True
        if worker:
            if self.overlap_encoding:
                self._encoder = ThreadPoolExecutor(1, thread_name_prefix=f"encoder-{self.runtime.name}")
            self._thread = threading.Thread(target=self._run, name=f"batcher-{self.runtime.name}", daemon=True)
            self._thread.start()

    def run_once(self) -> None:
        """One step boundary in the calling thread (expire, admit, one decoding step, hand out results).  Only
        for a batcher started with ``worker=False``."""
        if self._thread is not None:
            raise RuntimeError("run_once drives a batcher without a worker thread (start(worker=False))")
        with torch.inference_mode():
            self._iteration()

    @property
    def idle(self) -> bool:
        return not self._pending and not self._tables and not self._encoding

    @property
    def queued(self) -> int:
        return len(self._pending)

    def submit(self, prepared: Prepared, beam_size: int, max_len: int, timeout_s: float,
               rules: DecodingRules = NO_RULES) -> Job:
        """Queue a request; await ``job.future`` for its :class:`~captioner.models.inference.CaptionResult`.

        Raises :class:`QueueFull` when ``queue_size`` requests are already waiting, :class:`NotAccepting` while
        stopping, and :class:`BeamTooWide` for a beam wider than the row budget.
        """
        if not self._accepting:
            raise NotAccepting(f"model {self.runtime.name!r} is not accepting requests")
        if beam_size > self.max_rows:
            raise BeamTooWide(f"beam_size {beam_size} is above the row budget of {self.max_rows}")
        loop = asyncio.get_running_loop()
        now = self.clock()
        job = Job(prepared, beam_size, max_len, now + timeout_s, loop, loop.create_future(), enqueued=now,
                  typical_length=self._learn_lengths, rules=rules)
        with self._wake:
            self._check(timeout_s, beam_size, max_len)
            self._pending.append(job)
            self._wake.notify()
        return job

    def check_admission(self, timeout_s: float, beam_size: int, max_len: int) -> None:
        """Raise what :meth:`submit` would raise now for such a request with ``timeout_s`` left, without queueing
        anything: a caller can refuse a request before spending time on its image."""
        if not self._accepting:
            raise NotAccepting(f"model {self.runtime.name!r} is not accepting requests")
        with self._wake:
            self._check(timeout_s, beam_size, max_len)

    def _check(self, timeout_s: float, beam_size: int, max_len: int) -> None:
        """Admission control's refusals (:class:`QueueFull`, :class:`WouldMissDeadline`); under ``_wake``."""
        self.admission.check(timeout_s, beam_size, max_len, self._pending, self.queue_size, self.active_jobs)

    def expected_wait_s(self, beam_size: int, max_len: int) -> float | None:
        """Expected seconds from now until a new request (``beam_size`` rows, ``max_len`` steps at most) has its
        result, behind the ones waiting and the ones decoding (None before the first measurement): see
        :meth:`captioner.service.admission.AdmissionEstimate.expected_wait_s`."""
        return self.admission.expected_wait_s(self._pending, beam_size, max_len)

    def cancel(self, job: Job, reason: str = "cancelled") -> None:
        """The client is gone (or its deadline passed): free the job's rows at the next step boundary."""
        job.cancel_reason = reason
        job.cancelled = True
        with self._wake:
            self._wake.notify()

    async def caption(self, prepared: Prepared, beam_size: int, max_len: int, timeout_s: float,
                      rules: DecodingRules = NO_RULES) -> CaptionResult:
        """Submit and wait; on cancellation or timeout the job is cancelled so its rows are freed."""
        job = self.submit(prepared, beam_size, max_len, timeout_s, rules)
        try:
            return await asyncio.wait_for(asyncio.shield(job.future), timeout_s)
        except TimeoutError:
            self.cancel(job, "deadline")
            raise DeadlineExceeded(f"captioning took longer than {timeout_s:g} s") from None
        except asyncio.CancelledError:
            self.cancel(job)
            raise

    async def calibrate(self, prepared: Prepared, beam_size: int, batch_sizes: list[int], max_len: int = 2,
                        timeout_s: float = 600.0, calibrate_len: int | None = None) -> None:
        """Measure this batcher on the given requests before it serves: choose its encoder batch and give admission
        control its first estimates (the start-up's warm-up calls it, with requests shaped by the service's
        settings).

        Run ``max_len`` steps for each encoder batch size: the requests of one size are queued together (the
        worker cannot take any of them before the last is queued), so each size is encoded as one batch.  Each
        size runs twice; the first round pays first-use costs and the second is timed:
        ``encode_batch`` becomes the largest size whose time per image is within ``ENCODE_TOLERANCE`` of the
        lowest (a larger batch also shares per-call costs, and a near tie is measurement noise).

        Then, with ``calibrate_len``, one request of that length alone gives admission control its first
        estimates: the timed rounds decode a few steps only, many times fewer than a real caption, and estimates
        taken from them let a burst arriving right after start-up fill the table with requests that all miss
        their deadline.  Alone, a request's service time is its whole decoding time: no batching gain is
        assumed until one is measured."""
        saved = self.admission.forget_rate()  # calibration requests are never refused
        self.encode_batch = max(batch_sizes, default=self.max_batch)
        self._learn_lengths = False
        try:
            for measured in (False, True):
                self._encode_timings = {} if measured else None
                for size in batch_sizes:
                    with self._wake:
                        jobs = [self.submit(prepared, beam_size, max_len, timeout_s) for _ in range(size)]
                    await asyncio.wait_for(asyncio.gather(*(job.future for job in jobs)), timeout_s)
            timings, self._encode_timings = self._encode_timings or {}, None
            self._learn_lengths = True
            if calibrate_len:
                self.admission.forget_rate()
                await asyncio.wait_for(self.submit(prepared, beam_size, calibrate_len, timeout_s).future, timeout_s)
        finally:
            self._encode_timings = None
            self._learn_lengths = True
            self.admission.restore_rate(saved)  # no measurement (or a failed calibration): the estimate it had before
        if timings:
            lowest = min(timings.values())
            self.encode_batch = max(size for size, t in timings.items() if t <= lowest * (1 + ENCODE_TOLERANCE))
            self.metrics.set_encode_batch(self.runtime.name, self.encode_batch)
            log.info("%s: encoder batch %d (ms per image by batch size: %s)", self.runtime.name, self.encode_batch,
                     ", ".join(f"{size}: {seconds * 1000:.1f}" for size, seconds in sorted(timings.items())))

    async def stop(self, timeout_s: float = 30.0) -> None:
        """Graceful shutdown: take no new requests, finish the queued and running ones (up to ``timeout_s``),
        then stop the worker; whatever is left after the timeout fails with :class:`NotAccepting`."""
        self._accepting = False
        if self._thread is None:
            return
        with self._wake:
            self._stop_when_idle = True
            self._wake.notify()
        await run_in_threadpool(self._thread.join, timeout_s)
        if self._thread.is_alive():
            log.warning("%s: drain timed out after %g s; failing the remaining requests", self.runtime.name, timeout_s)
            with self._wake:
                self._abort = True
                self._wake.notify()
            await run_in_threadpool(self._thread.join)

    # -- worker thread ----------------------------------------------------------------------------------------
    def _run(self) -> None:
        worked = False
        with torch.inference_mode():
            while True:
                with self._wake:
                    idle = self.idle
                if idle and worked and self.on_idle is not None:
                    worked = False
                    try:
                        self.on_idle()
                    except Exception:  # memory not given back is no reason to stop captioning
                        log.exception("%s: the idle hook failed", self.runtime.name)
                with self._wake:
                    while self.idle and not self._stop_when_idle and not self._abort:
                        self._wake.wait()
                    if self._abort or (self._stop_when_idle and self.idle):
                        break
                try:
                    self._iteration()
                    worked = True
                except Exception as exc:  # a failing step must not kill the worker: fail its requests instead
                    log.exception("%s: decoding failed", self.runtime.name)
                    # the requests still queued took no part in it: they are captioned when their turn comes
                    self._fail_in_flight(exc, failed_in="decoding")
            self._fail_everything(NotAccepting("the service is shutting down"))
            if self._encoder is not None:
                self._encoder.shutdown(wait=False, cancel_futures=True)

    def _iteration(self) -> None:
        now = self.clock()
        self._expire_pending(now)
        self._drop_leavers(now)  # rows of cancelled or expired jobs never take part in another step
        self._admit()
        # encoded images join the tables; with nothing to decode, wait for the oldest encoding instead of spinning
        self._join_encoded(wait_for_one=not self._tables)
        if self._tables:
            self._step_tables(now)
        # cancellations and deadlines that arrived during the step free their rows now, not one step later
        self._drop_leavers(self.clock())
        self.metrics.set_load(self.runtime.name, self.active_rows, len(self._pending))

    def _step_tables(self, now: float) -> None:
        """One decoding step of every table; the requests it finished leave their tables with their captions, and
        admission control learns the step's time (``now``: when this iteration began)."""
        started = time.perf_counter()
        rows = sum(t.rows for t in self._tables)
        done = [table.step(self.runtime) for table in self._tables]
        self.metrics.observe_step(self.runtime.name, rows, time.perf_counter() - started)
        finished_now: list[Job] = []
        results_now: list[CaptionResult] = []
        try:
            for table, flags in zip(self._tables, done):
                finished = table.finished_jobs(flags)
                if not finished:
                    continue
                try:
                    results_now += table.results_of(finished, self.runtime)
                except Exception as exc:
                    log.exception("%s: collecting results failed", self.runtime.name)
                    self._fail(finished, exc, "collecting results")
                else:
                    finished_now += finished
                self.metrics.rows_freed(self.runtime.name, "finished", sum(j.beam_size for j in finished))
                table.remove(set(finished), self.runtime)
            self._tables = [t for t in self._tables if t.jobs]
            self.admission.measure_step(rows, self.clock() - now, finished_now)
        finally:
            # the results go out once their step is measured: a caller that acts on one at once (calibration
            # forgets the step time before its own request) must not have the step measured after it did.  And
            # they go out whatever fails after they were collected, never left to wait for their deadline
            for job, result in zip(finished_now, results_now):
                job.resolve(result)

    def _drop_leavers(self, now: float) -> None:
        """Remove the rows of jobs whose client is gone or whose deadline has passed (no device work)."""
        for table in self._tables:
            leaving: set[Job] = set()
            for job in table.jobs:
                if job.cancelled or job.future.done():
                    leaving.add(job)
                    self.metrics.rows_freed(self.runtime.name, job.cancel_reason, job.beam_size)
                elif now > job.deadline:
                    leaving.add(job)
                    self.metrics.rows_freed(self.runtime.name, "deadline", job.beam_size)
                    job.resolve(error=DeadlineExceeded("the deadline passed while decoding"))
            if leaving:
                table.remove(leaving, self.runtime)
        self._tables = [t for t in self._tables if t.jobs]
        self._count_active()

    def _count_active(self) -> None:
        """Rows in the decoding tables; requests and work of the tables and of the images being encoded (they
        are admitted: admission control counts them as decoding)."""
        self.active_rows = sum(t.rows for t in self._tables)
        jobs = [job for table in self._tables for job in table.jobs] + [j for chunk, _ in self._encoding for j in chunk]
        self.active_jobs = len(jobs)
        self.admission.expect_work(jobs)

    def _expire_pending(self, now: float) -> None:
        """Drop waiting jobs whose client is gone and shed those that cannot finish in the time they have left:
        encoding plus their own steps at the current step time.  Shedding here, before any work is spent on
        them, keeps a burst from ending in 504s: a request let in on the estimate made at its arrival can still
        wait too long when the steps slow down after it was let in (the overload run of ``make reliability`` had
        32 such requests time out in the queue)."""
        # only while rows are decoding: then the step time is current and the job has to wait behind them (an
        # idle worker starts its first waiting job at once; judging it by the steps of an old, fuller table would
        # refuse for good, as no step would run to correct the estimate)
        need = self.admission.own_time_s if self._tables else None
        with self._wake:
            keep = deque()
            for job in self._pending:
                if job.cancelled or job.future.done():
                    continue
                refusal = self.admission.shed(job, now, need, self._pending)
                if refusal is not None:
                    job.resolve(error=refusal)
                else:
                    keep.append(job)
            self._pending = keep

    def _admit(self) -> None:
        if len(self._encoding) > 1:
            return  # the encoder has its next chunk queued already: admit when it takes it
        free = self.max_rows - sum(t.rows for t in self._tables) - sum(
            job.beam_size for chunk, _ in self._encoding for job in chunk)
        admitted: list[Job] = []
        with self._wake:
            while self._pending and len(admitted) < self.max_batch and self._pending[0].beam_size <= free:
                job = self._pending.popleft()
                free -= job.beam_size
                admitted.append(job)
            # counted as decoding while they are encoded, so that admission control sees them all along
            self.active_jobs += len(admitted)
        if not admitted:
            return
        now = self.clock()
        for job in admitted:
            self.metrics.observe_queue(self.runtime.name, now - job.enqueued)
        # encoded in chunks of the measured best size: by the encoder thread, joining the tables as they are
        # done, or here, all of them joining at this boundary
        for start in range(0, len(admitted), self.encode_batch):
            chunk = admitted[start:start + self.encode_batch]
            if self._encoder is not None:
                self._encoding.append((chunk, self._encoder.submit(self._encode, chunk)))
            else:
                future: Future = Future()
                try:
                    future.set_result(self._encode(chunk))
                except Exception as exc:
                    future.set_exception(exc)
                self._encoding.append((chunk, future))
        self._count_active()

    def _encode(self, jobs: list[Job]) -> tuple[dict, dict]:
        """Encoder and initial decoder state of ``jobs`` (in the encoder thread, or the worker's)."""
        self.metrics.observe_encode(self.runtime.name, len(jobs))
        started = self.clock()
        with torch.inference_mode():  # thread-local: the encoder thread enters it too
            enc, state = self.runtime.begin([j.prepared for j in jobs], [j.beam_size for j in jobs])
            # the encoding's true cost on a GPU, for admission control and the warm-up's choice of encoder batch;
            # this thread waits, the worker's steps already queued run on
            self.runtime.synchronize()
        per_image = (self.clock() - started) / len(jobs)
        self.admission.measure_encode(per_image)
        if self._encode_timings is not None:
            self._encode_timings[len(jobs)] = min(per_image, self._encode_timings.get(len(jobs), per_image))
        return enc, state

    def _join_encoded(self, wait_for_one: bool) -> None:
        """Move finished encodings, oldest first, into the decoding tables (waiting for the oldest one when
        ``wait_for_one``); a failed encoding fails its requests."""
        while self._encoding:
            jobs, future = self._encoding[0]
            if not future.done():
                if not wait_for_one:
                    break
                wait([future])
            wait_for_one = False
            self._encoding.popleft()
            try:
                enc, state = future.result()
            except Exception as exc:
                log.exception("%s: encoding failed", self.runtime.name, exc_info=exc)
                self._fail(jobs, exc, "encoding")
                continue
            self._add_to_table(jobs, enc, state)
        self._count_active()

    def _add_to_table(self, jobs: list[Job], enc: dict, state: dict) -> None:
        signature = RowTable.signature(enc, state)
        for table in self._tables:
            if table.current_signature() == signature:
                table.add(jobs, enc, state, self.runtime.bos_id)
                break
        else:
            self._tables.append(RowTable(jobs, enc, state, self.runtime.bos_id))

    def _fail_everything(self, error: BaseException, failed_in: str | None = None) -> None:
        """Fail every request the batcher holds; ``failed_in`` names the work that failed, to be logged for each."""
        with self._wake:
            pending, self._pending = list(self._pending), deque()
        self._fail(pending, error, failed_in)
        self._fail_in_flight(error, failed_in)

    def _fail_in_flight(self, error: BaseException, failed_in: str | None = None) -> None:
        """Fail the requests being encoded or decoded (admitted: not the queued ones)."""
        encoding = [job for chunk, _ in self._encoding for job in chunk]
        self._encoding.clear()  # an encoding still running finishes unread
        self._fail(encoding + [j for t in self._tables for j in t.jobs], error, failed_in)
        self._tables = []
        self._count_active()

    def _fail(self, jobs: list[Job], error: BaseException, failed_in: str | None) -> None:
        """Fail ``jobs`` with ``error``; with ``failed_in``, one log line for each in its request's context (its
        request id: the traceback above is the worker thread's, which names no request)."""
        for job in jobs:
            if failed_in is not None:
                job.context.run(log.error, "%s: %s failed for this request (%s: %s)", self.runtime.name, failed_in,
                                type(error).__name__, error)
            job.resolve(error=error)
