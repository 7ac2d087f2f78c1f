"""Bounded thread-pool work: a budget for one kind of work (the pixels of the uploads being decoded, the number of
overlays being rendered), the work beyond it waiting on the event loop within its deadline.

A decode holds about seven bytes per pixel of the upload until the image is preprocessed (a 36-megapixel JPEG:
about 250 MB) and a 4,096-px overlay render about a gigabyte, while Starlette's thread pool runs up to 40 calls at
once: a burst of large uploads took a server to 10 GiB, and 50 outstanding renders filled the pool so that
captions waited half a minute for a thread (docs/decisions.md, "The service under concurrent traffic, audited").
Budgeting decodes by pixels rather than by count keeps a burst of ordinary photos decoding together (so that the
batcher gets them together) while two images at the pixel limit already fill it.

Waiters are served in arrival order, so a large piece is not overtaken forever by small ones; a piece larger than
the whole budget runs alone.  A waiter gives up at its deadline; work that has started runs to its end and gives
its share back then, whether or not anyone still waits for its result.

:class:`UploadBudget` bounds the step before: the bytes of the uploads still arriving, which do not wait (a chunk
that does not fit is refused with 429).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

# Every blocking call in service/ leaves the event loop through Starlette's run_in_threadpool (anyio's worker
# threads), never asyncio.to_thread or a loop's default executor: it is the pool FastAPI already runs sync
# dependencies in, so one limit (anyio's 40 threads) bounds all of the service's thread work. Like to_thread, it
# does not stop a call that has started when its caller is cancelled: run() below therefore lets the call give its
# share back itself, from its thread. Only the archive command keeps executors of its own, sized for its readers and
# its one pyplot thread.
from starlette.concurrency import run_in_threadpool

from .errors import UploadsBusy

T = TypeVar("T")


class WorkSlots:
    """A budget of ``capacity`` units of thread-pool work; ``on_idle`` is called when the last running piece ends
    (the app returns the memory that work freed: :class:`~captioner.service.memory.IdleTrimmer`).  Only the event
    loop's thread touches the accounting."""

    def __init__(self, capacity: int, on_idle: Callable[[], None] | None = None):
        self.capacity = capacity
        self._used = 0
        self._running = 0
        self._waiters: deque[tuple[int, asyncio.Future]] = deque()
        self._on_idle = on_idle

    @property
    def running(self) -> int:
        return self._running

    @property
    def waiting(self) -> int:
        """Pieces of work waiting for their share."""
        return len(self._waiters)

    async def run(self, fn: Callable[..., T], *args: object, cost: int = 1, timeout: float | None = None) -> T:
        """``fn(*args)`` in the thread pool once ``cost`` units are free; :class:`TimeoutError` when they are not
        within ``timeout`` seconds (nothing ran)."""
        cost = max(1, min(cost, self.capacity))
        async with asyncio.timeout(timeout):
            await self._acquire(cost)
        loop = asyncio.get_running_loop()
        started = False

        def work() -> T:
            nonlocal started
            started = True
            try:
                return fn(*args)
            finally:
                loop.call_soon_threadsafe(self._release, cost)

        self._running += 1
        try:
            return await run_in_threadpool(work)
        finally:
            # cancelled before the thread took the call: it never runs, so its share is given back here (once it
            # runs, it gives its share back itself when it ends, whether or not anyone still waits for it)
            if not started:
                self._release(cost)

    async def _acquire(self, cost: int) -> None:
        if not self._waiters and self._used + cost <= self.capacity:
            self._used += cost
            return
        granted = asyncio.get_running_loop().create_future()
        entry = (cost, granted)
        self._waiters.append(entry)
        try:
            await granted
        except BaseException:
            if granted.done() and not granted.cancelled():
                self._used -= cost  # granted just as the waiter gave up: give it back
            elif entry in self._waiters:
                self._waiters.remove(entry)
            self._wake()
            raise

    def _release(self, cost: int) -> None:
        self._used -= cost
        self._running -= 1
        self._wake()
        if self._running == 0 and self._on_idle is not None:
            self._on_idle()

    def _wake(self) -> None:
        while self._waiters and self._used + self._waiters[0][0] <= self.capacity:
            cost, granted = self._waiters.popleft()
            if granted.done():  # its waiter was cancelled and has not run its clean-up yet
                continue
            self._used += cost
            granted.set_result(None)


class UploadBudget:
    """The bytes of the uploads held at once, across requests, against ``capacity``: a request takes its body's
    chunks as they arrive (:meth:`hold`) and gives them all back when it ends, answered or failed, since its bytes
    stay in memory until then (waiting for a decode slot, decoding).  A chunk that does not fit is refused
    (:class:`UploadsBusy`, 429): per request the body is bounded by the upload limit and the deadline, but many
    bodies at once were bounded by nothing.  Only the event loop's thread touches it."""

    def __init__(self, capacity: int | None, retry_after_s: int = 1):
        self.capacity, self.retry_after_s = capacity, retry_after_s  # None: no budget, nothing counted
        self.held = 0

    def take(self, size: int) -> None:
        if self.capacity is None:
            return
        if self.held + size > self.capacity:
            raise UploadsBusy(f"the uploads being handled hold the service's budget of {self.capacity} bytes "
                              "(CAPTIONER_UPLOAD_BUDGET_BYTES); retry", self.retry_after_s)
        self.held += size

    def give(self, size: int) -> None:
        if self.capacity is not None:
            self.held -= size

    @contextmanager
    def hold(self) -> Iterator["UploadHold"]:
        """One request's share: what it takes while the block runs is given back when the block ends."""
        share = UploadHold(self)
        try:
            yield share
        finally:
            self.give(share.size)


class UploadHold:
    """The bytes one request has taken from an :class:`UploadBudget`."""

    def __init__(self, budget: UploadBudget):
        self.budget, self.size = budget, 0

    def take(self, size: int) -> None:
        self.budget.take(size)
        self.size += size


#: no budget: a caller that reads one body alone (tests, tools)
UNLIMITED = UploadBudget(None)
