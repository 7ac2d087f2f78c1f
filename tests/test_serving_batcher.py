"""Continuous batching at unit level: a batcher driven step by step (or by its worker thread) must give every
request exactly the caption, log-probs and attention that ``beam_search`` gives the same image alone, whatever
joins or leaves around it; cancelled and expired requests free their rows; a full queue refuses."""

from __future__ import annotations

import asyncio

import pytest
import torch

from captioner.service.batcher import Batcher, DeadlineExceeded, NotAccepting, QueueFull
from captioner.service.metrics import Metrics
from captioner.models.inference import TorchRuntime

from .serving_helpers import all_architectures, assert_same_result, drive, random_images, shared_encoder, \
    tiny_checkpoint

# tiny tensors gain nothing from a second thread, and on a busy machine waiting for it dominates
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def encoder():
    return shared_encoder()


def runtime_for(arch: str, encoder, **overrides) -> TorchRuntime:
    return TorchRuntime(arch, tiny_checkpoint(arch, **overrides), encoder, torch.device("cpu"))


def solo(runtime: TorchRuntime, prepared, beam: int, max_len: int):
    return runtime.caption([prepared], beam, max_len)[0]


# (join step, image, beam, max_len): beams of 1..4 and lengths 2..9 joining at different step boundaries, some
# while others are mid-caption, one after everything else has left
SCHEDULE = [(0, 0, 3, 6), (0, 1, 1, 4), (1, 2, 4, 9), (2, 3, 2, 3), (2, 4, 3, 7), (5, 5, 1, 2), (6, 0, 2, 8),
            (30, 6, 3, 5)]


@pytest.mark.parametrize("arch", all_architectures())
def test_batched_captions_equal_solo_beam_search(arch, encoder):
    runtime = runtime_for(arch, encoder)
    images = [runtime.prepare(image) for image in random_images(7)]
    schedule = [(step, images[i], beam, max_len) for step, i, beam, max_len in SCHEDULE]
    batcher = Batcher(runtime, max_batch=3, queue_size=16, max_rows=256)
    batcher.start(worker=False)
    results = asyncio.run(drive(batcher, schedule))
    for (step, prepared, beam, max_len), got in zip(schedule, results):
        assert got.beam_size == beam and len(got.hypothesis.token_ids) <= max_len
        assert_same_result(got, solo(runtime, prepared, beam, max_len))
    assert batcher.active_rows == 0


def test_row_budget_is_respected_and_waiting_requests_join_later(encoder):
    runtime = runtime_for("sat", encoder)
    seen: list[int] = []
    step = runtime.step

    def counting_step(prev, state, enc):
        seen.append(prev.shape[0])
        return step(prev, state, enc)

    runtime.step = counting_step
    images = [runtime.prepare(image) for image in random_images(6, seed=3)]
    schedule = [(0, images[i], 2, 5) for i in range(6)]
    batcher = Batcher(runtime, max_batch=16, queue_size=16, max_rows=5)
    batcher.start(worker=False)
    results = asyncio.run(drive(batcher, schedule))
    assert max(seen) <= 5 and 4 in seen  # two requests of beam 2 at a time: the third waits for rows
    for (_, prepared, beam, max_len), got in zip(schedule, results):
        assert_same_result(got, solo(runtime, prepared, beam, max_len))


def test_cancelled_request_frees_its_rows_at_the_next_step_boundary(encoder):
    runtime = runtime_for("sat", encoder)
    metrics = Metrics()
    batcher = Batcher(runtime, max_batch=4, queue_size=8, max_rows=64, metrics=metrics)
    batcher.start(worker=False)
    prepared = [runtime.prepare(image) for image in random_images(2, seed=5)]

    async def scenario():
        stay = batcher.submit(prepared[0], 3, 30, 60)
        leave = batcher.submit(prepared[1], 4, 30, 60)
        batcher.run_once()
        batcher.run_once()
        assert batcher.active_rows == 7
        batcher.cancel(leave)  # what the route does when the client disconnects
        steps = batcher.steps
        batcher.run_once()
        # the very next boundary dropped it before stepping: that step ran on the 3 remaining rows only
        assert batcher.steps == steps + 1 and batcher.active_rows == 3
        assert metrics.freed.labels("sat", "cancelled")._value.get() == 4
        while not batcher.idle:
            batcher.run_once()
        await asyncio.sleep(0)
        assert not leave.future.done()  # nobody waits for it; it is never resolved
        return await stay.future

    result = asyncio.run(scenario())
    assert_same_result(result, solo(runtime, prepared[0], 3, 30))


def test_deadline_fails_the_request_and_frees_its_rows(encoder):
    runtime = runtime_for("sat", encoder)
    metrics = Metrics()
    batcher = Batcher(runtime, max_batch=4, queue_size=8, max_rows=64, metrics=metrics)
    batcher.start(worker=False)
    prepared = runtime.prepare(random_images(1)[0])

    async def scenario():
        running = batcher.submit(prepared, 3, 40, 0.05)
        batcher.run_once()
        assert batcher.active_rows == 3
        await asyncio.sleep(0.08)
        batcher.run_once()
        assert batcher.active_rows == 0
        with pytest.raises(DeadlineExceeded):
            await running.future
        assert metrics.freed.labels("sat", "deadline")._value.get() == 3
        queued = batcher.submit(prepared, 2, 40, 0.01)  # expires while still waiting: never gets rows
        await asyncio.sleep(0.03)
        batcher.run_once()
        with pytest.raises(DeadlineExceeded):
            await queued.future
        assert batcher.idle

    asyncio.run(scenario())


def test_full_queue_refuses_and_wide_beams_are_rejected(encoder):
    runtime = runtime_for("sat", encoder)
    batcher = Batcher(runtime, max_batch=4, queue_size=2, max_rows=4)
    prepared = runtime.prepare(random_images(1)[0])

    async def scenario():
        with pytest.raises(NotAccepting):
            batcher.submit(prepared, 1, 5, 10)  # not started
        batcher.start(worker=False)
        batcher.submit(prepared, 1, 5, 10)
        batcher.submit(prepared, 1, 5, 10)
        with pytest.raises(QueueFull):
            batcher.submit(prepared, 1, 5, 10)
        with pytest.raises(ValueError, match="row budget"):
            batcher.submit(prepared, 5, 5, 10)
        batcher.run_once()  # both admitted: the queue has room again
        batcher.submit(prepared, 1, 5, 10)

    asyncio.run(scenario())


@pytest.mark.parametrize("arch", ["sat", "area-transformer"])
def test_worker_thread_with_concurrent_callers_matches_solo(arch, encoder):
    """The real worker thread, requests arriving whenever asyncio gets to them (timing-dependent joins)."""
    runtime = runtime_for(arch, encoder)
    images = [runtime.prepare(image) for image in random_images(8, seed=11)]
    batcher = Batcher(runtime, max_batch=4, queue_size=32, max_rows=24)
    requests = [(images[i % 8], 1 + i % 4, 3 + (i * 5) % 7) for i in range(16)]

    async def scenario():
        batcher.start()

        async def one(i, prepared, beam, max_len):
            await asyncio.sleep(0.003 * (i % 5))
            return await batcher.caption(prepared, beam, max_len, 60)

        try:
            return await asyncio.gather(*(one(i, *r) for i, r in enumerate(requests)))
        finally:
            await batcher.stop(10)

    results = asyncio.run(scenario())
    for (prepared, beam, max_len), got in zip(requests, results):
        assert_same_result(got, solo(runtime, prepared, beam, max_len))


def test_stop_drains_running_and_queued_requests_then_refuses(encoder):
    runtime = runtime_for("sat", encoder)
    batcher = Batcher(runtime, max_batch=1, queue_size=8, max_rows=3)
    prepared = runtime.prepare(random_images(1)[0])

    async def scenario():
        batcher.start()
        pending = [asyncio.ensure_future(batcher.caption(prepared, 3, 10, 60)) for _ in range(3)]
        await asyncio.sleep(0)
        await batcher.stop(30)
        results = await asyncio.gather(*pending)
        with pytest.raises(NotAccepting):
            batcher.submit(prepared, 1, 5, 10)
        return results

    results = asyncio.run(scenario())
    assert len(results) == 3 and all(r.words == results[0].words for r in results)
