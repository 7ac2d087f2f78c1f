"""The gauges of the pressure outside the batchers (``Metrics.watch_pressure``) read the real counters at scrape
time: a render backlog was invisible in /metrics (the concurrency audit found 58 renders waiting for slots)."""

from __future__ import annotations

import asyncio
import threading

from captioner.service.metrics import Metrics
from captioner.service.work_slots import UploadBudget, WorkSlots

from .serving_helpers import parse_metrics, run_bounded


def test_pressure_gauges_follow_the_slots_and_the_upload_budget():
    metrics, budget = Metrics(), UploadBudget(1000)
    in_flight = [0]

    async def scenario() -> dict[str, float]:
        slots = WorkSlots(1)
        metrics.watch_pressure(lambda: in_flight[0], lambda: budget.held, {"render": slots})
        release = threading.Event()
        first = asyncio.create_task(slots.run(release.wait))
        waiting = [asyncio.create_task(slots.run(lambda: None)) for _ in range(3)]
        try:
            while slots.running == 0 or slots.waiting < 3:
                await asyncio.sleep(0.01)
            budget.take(600)
            in_flight[0] = 4
            during = parse_metrics(metrics.render().decode())
        finally:  # a failure above must not leave the pool's thread waiting: the test process would never exit
            release.set()
        await asyncio.gather(first, *waiting)
        return during

    during = run_bounded(scenario())
    assert during['captioner_work_running{pool="render"}'] == 1
    assert during['captioner_work_waiting{pool="render"}'] == 3
    assert during["captioner_upload_bytes_held"] == 600 and during["captioner_requests_in_flight"] == 4
    budget.give(600)
    in_flight[0] = 0
    after = parse_metrics(metrics.render().decode())
    assert after['captioner_work_running{pool="render"}'] == 0 and after['captioner_work_waiting{pool="render"}'] == 0
    assert after["captioner_upload_bytes_held"] == 0 and after["captioner_requests_in_flight"] == 0
