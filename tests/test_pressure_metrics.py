"""The gauges of the pressure outside the batchers (``Metrics.watch_pressure``) read the real counters at scrape
time: a render backlog was invisible in /metrics (the concurrency audit found 58 renders waiting for slots)."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

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


def test_each_recording_lands_under_the_readmes_name_and_labels():
    """Every recording method of ``Metrics`` puts its own value under the series README's ``GET /metrics`` row names,
    with the labels it lists (``{model,status}``, ``{reason}``, ``{model,reason}``, ``{model,outcome}``) and ``model``
    on each per-model series: dashboards and the HPA's adapter read these, so a label renamed or filled from another
    argument, or a value taken from the wrong one, would break them in silence. The latency histogram resolves
    requests up to the default 60-s deadline (``CAPTIONER_REQUEST_TIMEOUT_S``) in a finite bucket, and so does the queue
    time histogram: a request waits for rows at most until that deadline."""
    metrics = Metrics()
    metrics.observe_request("sat", 504, 45.0)
    metrics.observe_queue("sat", 1.5)
    metrics.observe_step("sat", rows=12, seconds=0.25)
    metrics.observe_encode("sat", 3)
    metrics.rows_freed("sat", "deadline", 5)
    metrics.set_load("sat", rows=7, queued=2)
    metrics.set_load("sat", rows=6, queued=1)  # gauges say what is now, not what has been
    metrics.set_encode_batch("sat", 8)  # the batcher's max_batch at construction, then warm-up's choice
    metrics.set_encode_batch("sat", 4)
    metrics.result_cache_lookup("sat", hit=True)
    for _ in range(2):
        metrics.result_cache_lookup("sat", hit=False)
    metrics.rejected("queue-full")
    samples = parse_metrics(metrics.render().decode())
    expected = {
        'captioner_request_latency_seconds_count{model="sat",status="504"}': 1.0,
        'captioner_request_latency_seconds_sum{model="sat",status="504"}': 45.0,
        'captioner_request_latency_seconds_bucket{le="60.0",model="sat",status="504"}': 1.0,
        'captioner_queue_time_seconds_sum{model="sat"}': 1.5,
        'captioner_queue_time_seconds_bucket{le="60.0",model="sat"}': 1.0,
        'captioner_rows_per_step_sum{model="sat"}': 12.0,
        'captioner_step_time_seconds_sum{model="sat"}': 0.25,
        'captioner_encoder_batch_size_sum{model="sat"}': 3.0,
        'captioner_rows_freed_total{model="sat",reason="deadline"}': 5.0,
        'captioner_active_rows{model="sat"}': 6.0,
        'captioner_queued_requests{model="sat"}': 1.0,
        'captioner_encoder_batch_limit{model="sat"}': 4.0,
        'captioner_result_cache_lookups_total{model="sat",outcome="hit"}': 1.0,
        'captioner_result_cache_lookups_total{model="sat",outcome="miss"}': 2.0,
        'captioner_rejects_total{reason="queue-full"}': 1.0,
    }
    assert {key: samples.get(key) for key in expected} == expected


def test_each_pool_gauge_reads_its_own_pool():
    """The app watches two pools (``decode`` and ``render``): each series must read its own pool's counts. A
    closure over the loop variable would make every pool report the last one's, hiding a decode backlog behind
    idle renders."""
    metrics = Metrics()
    pools = {"decode": SimpleNamespace(running=2, waiting=5), "render": SimpleNamespace(running=0, waiting=1)}
    metrics.watch_pressure(lambda: 0, lambda: 0, pools)
    samples = parse_metrics(metrics.render().decode())
    assert [samples[f'captioner_work_{kind}{{pool="{pool}"}}'] for pool in pools for kind in ("running", "waiting")] \
        == [2, 5, 0, 1]


def test_each_histogram_writes_its_thresholds_once_each_where_they_were():
    """Dashboards and alerts read a histogram by its ``le`` thresholds (the share of requests answered within 5 ms, of
    encoder batches of 2): a bound moved onto its neighbour writes that threshold twice and drops the one it left, so
    a query on it finds no series and the quantiles lose their resolution there, in silence."""
    metrics = Metrics()
    metrics.observe_request("sat", 200, 0.2)
    metrics.observe_queue("sat", 0.2)
    metrics.observe_step("sat", rows=3, seconds=0.2)
    metrics.observe_encode("sat", 3)
    thresholds: dict[str, list[str]] = {}
    for line in metrics.render().decode().splitlines():
        name, _, rest = line.partition('_bucket{le="')
        if not line.startswith("#") and rest:
            thresholds.setdefault(name, []).append(rest.partition('"')[0])
    seconds = "0.005 0.01 0.025 0.05 0.1 0.25 0.5 1.0 2.5 5.0 10.0 30.0 60.0 +Inf".split()
    assert thresholds == {
        "captioner_request_latency_seconds": seconds,
        "captioner_queue_time_seconds": seconds,
        "captioner_rows_per_step": "1.0 2.0 4.0 8.0 16.0 32.0 64.0 128.0 256.0 512.0 1024.0 +Inf".split(),
        "captioner_step_time_seconds": "0.0005 0.001 0.002 0.005 0.01 0.02 0.05 0.1 0.25 1.0 +Inf".split(),
        "captioner_encoder_batch_size": "1.0 2.0 4.0 8.0 16.0 32.0 64.0 +Inf".split(),
    }
