"""Prometheus metrics of one app instance (its own registry, so several apps can live in one process)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.request_latency = Histogram("captioner_request_latency_seconds", "Caption request latency, end to end",
                                         ["model", "status"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("captioner_queue_time_seconds", "Time from queueing to admission into a step",
                                    ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.rows_per_step = Histogram("captioner_rows_per_step", "(request, beam) rows decoded in one step",
                                       ["model"], buckets=ROW_BUCKETS, registry=r)
        self.step_time = Histogram("captioner_step_time_seconds", "Wall time of one decoding step over all rows",
                                   ["model"], buckets=STEP_BUCKETS, registry=r)
        self.encoder_batch = Histogram("captioner_encoder_batch_size", "Images encoded together",
                                       ["model"], buckets=BATCH_BUCKETS, registry=r)
        self.rejects = Counter("captioner_rejects_total", "Requests answered with an error, by reason", ["reason"],
                               registry=r)
        self.freed = Counter("captioner_rows_freed_total", "Rows that left the decoding table, by reason",
                             ["model", "reason"], registry=r)
        self.active_rows = Gauge("captioner_active_rows", "Rows in the decoding tables now", ["model"], registry=r)
        self.queued = Gauge("captioner_queued_requests", "Requests waiting for rows", ["model"], registry=r)
        self.ready = Gauge("captioner_ready", "1 once every model is loaded and warm", registry=r)
        self.encode_batch = Gauge("captioner_encoder_batch_limit",
                                  "Images encoded in one call at most: the batch size measured fastest at warm-up",
                                  ["model"], registry=r)
        # read at scrape time from what holds them (watch_pressure): what a backlog outside the batcher looks like
        self.in_flight = Gauge("captioner_requests_in_flight", "Requests being answered now (the shutdown drain "
                               "waits for them)", registry=r)
        self.upload_held = Gauge("captioner_upload_bytes_held", "Upload bytes held in memory by the requests in "
                                 "flight (CAPTIONER_UPLOAD_BUDGET_BYTES bounds them)", registry=r)
        self.work_running = Gauge("captioner_work_running", "Image decodes or overlay renders running in the "
                                  "thread pool", ["pool"], registry=r)
        self.work_waiting = Gauge("captioner_work_waiting", "Image decodes or overlay renders waiting for a slot",
                                  ["pool"], registry=r)
        self.result_cache = Counter("captioner_result_cache_lookups_total",
                                    "Caption requests looked up in the result cache, by outcome (hit or miss)",
                                    ["model", "outcome"], registry=r)

    def watch_pressure(self, in_flight: Callable[[], int], upload_held: Callable[[], int],
                       pools: Mapping[str, object]) -> None:
        """The gauges read at scrape time: requests in flight, upload bytes held, and each work pool's running and
        waiting pieces (``pools``: name → :class:`~captioner.service.work_slots.WorkSlots`)."""
        self.in_flight.set_function(in_flight)
        self.upload_held.set_function(upload_held)
        for name, slots in pools.items():
            self.work_running.labels(name).set_function(lambda slots=slots: slots.running)
            self.work_waiting.labels(name).set_function(lambda slots=slots: slots.waiting)

    def observe_step(self, model: str, rows: int, seconds: float) -> None:
        self.rows_per_step.labels(model).observe(rows)
        self.step_time.labels(model).observe(seconds)

    def observe_queue(self, model: str, seconds: float) -> None:
        self.queue_time.labels(model).observe(seconds)

    def observe_encode(self, model: str, images: int) -> None:
        self.encoder_batch.labels(model).observe(images)

    def rows_freed(self, model: str, reason: str, rows: int) -> None:
        self.freed.labels(model, reason).inc(rows)

    def set_load(self, model: str, rows: int, queued: int) -> None:
        self.active_rows.labels(model).set(rows)
        self.queued.labels(model).set(queued)

    def set_encode_batch(self, model: str, images: int) -> None:
        self.encode_batch.labels(model).set(images)

    def result_cache_lookup(self, model: str, hit: bool) -> None:
        self.result_cache.labels(model, "hit" if hit else "miss").inc()

    def rejected(self, reason: str) -> None:
        self.rejects.labels(reason).inc()

    def observe_request(self, model: str, status: int, seconds: float) -> None:
        self.request_latency.labels(model, str(status)).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
