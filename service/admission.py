"""Deadline-aware admission control for one model's :class:`~captioner.service.batcher.Batcher`.

An :class:`AdmissionEstimate` keeps moving averages, updated at every step, of the time a step takes (encoding at
that boundary included), of the rows it decoded and of the time an image takes to encode, and of the steps a
finished request took.  From them it estimates when a new request would have its result
(:meth:`AdmissionEstimate.expected_wait_s`) and refuses one that would miss its deadline (:class:`WouldMissDeadline`,
429 + Retry-After) at the door, or sheds a waiting one at a step boundary once it can no longer make it even alone.
Until the first measurement every request is admitted.

The batcher's worker (the encoding time: whichever thread encodes) writes the measurements without a lock, each
one a single attribute assignment, and the event loop reads them; the admission checks run under the batcher's
condition lock, which guards the queue handed in here.  This module takes no lock of its own.
"""

from __future__ import annotations

import math
from typing import Callable, Collection, Iterable

from .row_table import Job

#: weight of the newest sample in the moving averages of the service rate (admission control)
RATE_SMOOTHING = 0.2
#: admission control admits a request only when its expected finish is within this fraction of the time it has
#: left: the rest is for what the estimate does not see (sending the answer, an event loop busy with a burst,
#: the estimate's own noise), so that an admitted request meets its deadline at the client too
ADMISSION_HEADROOM = 0.9


class QueueFull(RuntimeError):
    """Too many requests are waiting for this model; the client should retry later (``retry_after_s``: a
    suggested wait in seconds, or None for the service default)."""

    def __init__(self, detail: str, retry_after_s: float | None = None):
        super().__init__(detail)
        self.retry_after_s = retry_after_s


class WouldMissDeadline(QueueFull):
    """Admission control: at the measured service rate the request would not be finished before its deadline, so
    it is refused (429 + Retry-After) instead of being given rows to fail later with a 504: at the door by
    :meth:`~captioner.service.batcher.Batcher.submit`, or at a step boundary while it still waits (the load grew
    after it was let in)."""


def _smooth(old: float | None, new: float) -> float:
    return new if old is None else (1 - RATE_SMOOTHING) * old + RATE_SMOOTHING * new


class AdmissionEstimate:
    """The measured service rate of one model's batcher and the admission decisions taken from it (see the module
    docstring).  ``model`` names the model in refusals."""

    def __init__(self, model: str):
        self.model = model
        # written by the worker (encode_time_s: by the thread that encodes), read by the event loop: see
        # expected_wait_s
        self.step_time_s: float | None = None
        self.rows_per_step: float | None = None
        self.encode_time_s: float | None = None
        self.steps_per_request: float | None = None
        self._active_work = 0.0  # row-steps the requests in the tables still need, as expected

    # -- measurements (the worker and its encoder thread) -----------------------------------------------------
    def measure_step(self, rows: int, seconds: float, finished: list[Job]) -> None:
        """Update the moving averages (see :meth:`expected_wait_s`) after a step of ``rows`` rows that took
        ``seconds`` with this boundary's encoding, at which ``finished`` got their results."""
        if seconds > 0:
            self.step_time_s = _smooth(self.step_time_s, seconds)
            self.rows_per_step = _smooth(self.rows_per_step, rows)
        for job in finished:
            if job.typical_length:
                self.steps_per_request = _smooth(self.steps_per_request, job.steps)

    def measure_encode(self, per_image: float) -> None:
        """Update the moving average of an image's encoding time (``per_image`` seconds in the latest batch)."""
        if per_image > 0:
            self.encode_time_s = _smooth(self.encode_time_s, per_image)

    def expect_work(self, jobs: Iterable[Job]) -> None:
        """The admitted ``jobs`` (decoding or being encoded): the row-steps they still need, as expected."""
        self._active_work = sum(job.beam_size * max(1.0, self.expected_steps(job.max_len) - job.steps) for job in jobs)

    def forget_rate(self) -> tuple[float | None, float | None]:
        """Drop the step time and rows per step (no request is refused until a step is measured again); returns
        them for :meth:`restore_rate`."""
        saved = self.step_time_s, self.rows_per_step
        self.step_time_s = self.rows_per_step = None
        return saved

    def restore_rate(self, saved: tuple[float | None, float | None]) -> None:
        """Put back what :meth:`forget_rate` returned, unless a step has been measured since."""
        if self.step_time_s is None:
            self.step_time_s, self.rows_per_step = saved

    # -- estimates ------------------------------------------------------------------------------------------
    def expected_steps(self, max_len: int) -> float:
        """Decoding steps a request of this length limit is expected to take."""
        return max_len if self.steps_per_request is None else min(max_len, self.steps_per_request)

    def expected_wait_s(self, pending: Collection[Job], beam_size: int, max_len: int) -> float | None:
        """Expected seconds from now until a new request (``beam_size`` rows, ``max_len`` steps at most) has its
        result, behind the ones waiting (``pending``) and the ones decoding (None before the first measurement).

        Every request in the system shares the worker with it: continuous batching takes a newcomer into the
        table at once, but each row added makes every step slower.  So the newcomer finishes about when the work
        of everyone ahead of it and its own is done — ``(rows × steps still needed, summed) / rows decoded per
        second`` — and never sooner than its own steps at the current step time; plus the encoding of the images
        queued before it and its own.  Both rates are measured at every step, so a slower machine (a burst
        keeping the event loop busy, another process taking the cores) raises the estimate at the next step,
        not after a request finishes.  (Estimates from finished requests alone lagged a burst by a whole
        deadline: the table filled until every request in it missed.)"""
        if self.step_time_s is None or not self.rows_per_step:
            return None
        queued_work = sum(job.beam_size * self.expected_steps(job.max_len) for job in pending)
        own = self.expected_steps(max_len)
        work = self._active_work + queued_work + beam_size * own
        encoding = (len(pending) + 1) * (self.encode_time_s or 0.0)
        return max(own * self.step_time_s, work / self.row_rate) + encoding

    @property
    def row_rate(self) -> float:
        """Rows decoded per second: the two averages' ratio (an average of per-step ratios would let the many
        quick steps hide the slow ones, those with an encoding, and overstate the rate several times)."""
        return self.rows_per_step / self.step_time_s if self.step_time_s and self.rows_per_step else 0.0

    @property
    def own_time_s(self) -> Callable[[Job], float] | None:
        """Seconds a waiting job is expected to need once admitted, ignoring everyone else: its encoding and its
        expected steps at the current step time (None before the first measurement).  Ignoring the others keeps
        it on the side of admitting: a job is shed only when it cannot make it even alone."""
        if self.step_time_s is None:
            return None
        step, encode = self.step_time_s, self.encode_time_s or 0.0
        return lambda job: encode + self.expected_steps(job.max_len) * step

    # -- decisions (the caller holds the batcher's lock) ------------------------------------------------------
    def check(self, timeout_s: float, beam_size: int, max_len: int, pending: Collection[Job], queue_size: int,
              active_jobs: int) -> None:
        """Raise :class:`QueueFull` when ``queue_size`` requests are ``pending`` already, and
        :class:`WouldMissDeadline` when a new request with ``timeout_s`` left would not finish in time behind them
        and the ``active_jobs`` admitted ones."""
        queued = len(pending)
        if queued >= queue_size:
            raise QueueFull(f"model {self.model!r} has {queued} requests waiting")
        if not queued and not active_jobs:
            # an idle worker starts it at once, and the only evidence against it is old steps, taken with other
            # rows in the table: refusing on them would refuse for good, since no step would run to correct them
            # (after a burst, the step time of a full table kept refusing every request to an idle model)
            return
        expected = self.expected_wait_s(pending, beam_size, max_len)
        if expected is not None and expected > ADMISSION_HEADROOM * timeout_s:
            alone = self.expected_steps(max_len) * (self.step_time_s or 0.0)
            raise WouldMissDeadline(
                f"model {self.model!r} would need about {expected:.2f} s for this request ({queued} waiting, "
                f"{active_jobs} decoding), more than the {timeout_s:.2f} s left to its deadline",
                retry_after_s=max(1.0, math.ceil(expected - alone)))

    def shed(self, job: Job, now: float, need: Callable[[Job], float] | None,
             pending: Collection[Job]) -> WouldMissDeadline | None:
        """The refusal of waiting ``job`` at a step boundary at time ``now``, or None to keep it: it is shed when
        its deadline has passed or ``need`` (:attr:`own_time_s` taken at that boundary, None to judge by the
        deadline alone) says it cannot finish in the time it has left."""
        left = job.deadline - now
        if left < 0 or (need is not None and need(job) > left):
            wait = self.expected_wait_s(pending, job.beam_size, job.max_len) or 0.0
            return WouldMissDeadline(
                f"model {self.model!r} is overloaded: this request waited {now - job.enqueued:.2f} s and cannot "
                f"be captioned in the {max(left, 0.0):.2f} s left to its deadline",
                retry_after_s=max(1.0, math.ceil(wait)))
        return None
