"""Request batcher: one per model; collects concurrent requests into batches for the runtime.

The worker never waits for a batch to fill: it takes whatever is queued when the previous batch finishes
(so an idle server adds no latency) and runs the runtime in one dedicated thread, keeping the event loop free.
A bounded queue gives back-pressure: when it is full, :class:`QueueFull` is raised and the route answers 429.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from .runtime import CaptionResult, ModelRuntime, Prepared

log = logging.getLogger("captioner.batcher")


class QueueFull(RuntimeError):
    pass


@dataclass
class _Job:
    prepared: Prepared
    beam_size: int
    max_len: int
    future: asyncio.Future = field(repr=False)


class Batcher:
    def __init__(self, runtime: ModelRuntime, max_batch: int = 16, queue_size: int = 64):
        self.runtime = runtime
        self.max_batch = max_batch
        self.queue: asyncio.Queue[_Job] = asyncio.Queue(maxsize=queue_size)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"runtime-{runtime.name}")
        self._worker: asyncio.Task | None = None

    def start(self) -> None:
        self._worker = asyncio.create_task(self._run(), name=f"batcher-{self.runtime.name}")

    async def stop(self) -> None:
        """Finish every queued request, then stop the worker (graceful shutdown)."""
        await self.queue.join()
        if self._worker:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
        self._executor.shutdown(wait=True)

    async def submit(self, prepared: Prepared, beam_size: int, max_len: int) -> CaptionResult:
        job = _Job(prepared, beam_size, max_len, asyncio.get_running_loop().create_future())
        try:
            self.queue.put_nowait(job)
        except asyncio.QueueFull:
            raise QueueFull(f"model {self.runtime.name!r} has {self.queue.qsize()} requests waiting") from None
        return await job.future

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            jobs = [await self.queue.get()]
            while len(jobs) < self.max_batch and not self.queue.empty():
                jobs.append(self.queue.get_nowait())
            groups: dict[tuple[int, int], list[_Job]] = {}
            for job in jobs:
                if not job.future.cancelled():
                    groups.setdefault((job.beam_size, job.max_len), []).append(job)
            for (beam_size, max_len), group in groups.items():
                try:
                    results = await loop.run_in_executor(
                        self._executor, self.runtime.caption, [j.prepared for j in group], beam_size, max_len)
                except Exception as exc:  # a failing batch must not kill the worker
                    log.exception("captioning failed")
                    for job in group:
                        if not job.future.done():
                            job.future.set_exception(exc)
                    continue
                for job, result in zip(group, results):
                    if not job.future.done():
                        job.future.set_result(result)
            for _ in jobs:
                self.queue.task_done()
