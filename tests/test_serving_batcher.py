"""Continuous batching at unit level: a batcher driven step by step (or by its worker thread) must give every
request exactly the caption, log-probs and attention that ``beam_search`` gives the same image alone, whatever
joins or leaves around it; cancelled and expired requests free their rows; a full queue refuses."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import math
import threading
import types
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

import captioner.service.row_table as row_table_module
from captioner.models.decoding import DecodingRules
from captioner.models.inference import TorchRuntime
from captioner.models.protocol import index_rows
from captioner.service.admission import ADMISSION_HEADROOM, RATE_SMOOTHING, AdmissionEstimate, WouldMissDeadline
from captioner.service.batcher import Batcher, DeadlineExceeded, NotAccepting, QueueFull
from captioner.service.memory import IdleTrimmer
from captioner.service.metrics import Metrics
from captioner.service.middleware import JsonFormatter, request_id_var
from captioner.service.row_table import Job, RowTable, fill_holes
from captioner.service.settings import Settings
from captioner.service.warmup import WARMUP_TIMEOUT_S, warm_up, warmup_sizes

from .serving_helpers import all_architectures, assert_same_result, count_encodes, count_step_rows, drive, \
    random_images, run_bounded, shared_encoder, tiny_checkpoint, watch_encodes

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
    results = run_bounded(drive(batcher, schedule))
    for (step, prepared, beam, max_len), got in zip(schedule, results):
        assert got.beam_size == beam and len(got.hypothesis.token_ids) <= max_len
        assert_same_result(got, solo(runtime, prepared, beam, max_len))
    assert batcher.active_rows == 0


def test_requests_with_their_own_decoding_rules_get_what_they_would_get_alone(encoder):
    """Length penalties, trigram and doubled-word blocking are per request: rows with and without rules share a
    table, join and leave it, and each request still gets its solo beam search with its own rules."""
    runtime = runtime_for("sat", encoder)
    images = [runtime.prepare(image) for image in random_images(5, seed=11)]
    trigrams, long, both = DecodingRules(block_trigrams=True), DecodingRules(length_penalty=2.0), \
        DecodingRules(length_penalty=1.0, block_trigrams=True)
    doubled = DecodingRules(length_penalty=1.0, block_doubled_words=True)
    schedule = [(0, images[0], 3, 14), (0, images[1], 2, 12, trigrams), (2, images[2], 3, 14, long),
                (3, images[3], 1, 10), (3, images[4], 3, 14, both), (9, images[0], 2, 14, trigrams),
                (9, images[2], 3, 14, doubled)]
    batcher = Batcher(runtime, max_batch=2, queue_size=16, max_rows=256)
    batcher.start(worker=False)
    results = run_bounded(drive(batcher, schedule))
    changed = 0
    for (_, prepared, beam, max_len, *rules), got in zip(schedule, results):
        assert_same_result(got, runtime.caption([prepared], beam, max_len, *rules)[0])
        changed += got.hypothesis.token_ids != solo(runtime, prepared, beam, max_len).hypothesis.token_ids
    assert changed  # the rules did change some captions, so the comparison above says something
    assert batcher.active_rows == 0


def test_doubled_word_blocking_holds_for_requests_joining_a_table_whose_rows_block_nothing(encoder):
    """A model that would say one word over and over: a request that blocks doubled words gets its solo caption,
    with no word after itself, when it joins a table whose rows have no rule or only a length penalty (their
    histories then block nothing) and when it shares one with rows that double words."""
    runtime = runtime_for("sat", encoder)
    with torch.no_grad():
        runtime.ckpt.model.out_word.bias[15] += 6.0
    images = [runtime.prepare(image) for image in random_images(4, seed=11)]
    doubled, long = DecodingRules(block_doubled_words=True), DecodingRules(length_penalty=1.0)
    schedule = [(0, images[0], 2, 10), (1, images[1], 2, 10, long), (2, images[2], 3, 10, doubled),
                (4, images[3], 2, 10, DecodingRules(length_penalty=1.0, block_doubled_words=True))]
    batcher = Batcher(runtime, max_batch=2, queue_size=8, max_rows=64)
    batcher.start(worker=False)
    results = run_bounded(drive(batcher, schedule))
    for (_, prepared, beam, max_len, *rules), got in zip(schedule, results):
        assert_same_result(got, runtime.caption([prepared], beam, max_len, *rules)[0])
        tokens = got.hypothesis.token_ids
        doubles = any(a == b for a, b in zip(tokens, tokens[1:]))
        # the model doubles words unless it is kept from it
        assert doubles != (bool(rules) and rules[0].block_doubled_words), tokens


def test_a_length_penalty_holds_for_a_request_that_starts_a_table_with_one_that_has_none(encoder):
    """Two requests taken together, one with a length penalty and one without: the table ranks the penalised
    request's rows by their penalty (a table whose rows have no penalty skips that arithmetic, so it must ask
    whether any of its requests has one, not whether all do), and each gets its solo caption."""
    runtime = runtime_for("sat", encoder)
    with torch.no_grad():  # captions that end at various lengths: ranking by the penalty at every step matters
        runtime.ckpt.model.out_word.bias[runtime.eos_id] += 1.0
    images = [runtime.prepare(image) for image in random_images(3, seed=5)]
    long = DecodingRules(length_penalty=2.0)
    schedule = [(0, images[0], 2, 12), (0, images[2], 2, 12, long)]
    batcher = Batcher(runtime, max_batch=2, queue_size=8, max_rows=64)
    batcher.start(worker=False)
    results = run_bounded(drive(batcher, schedule))
    for (_, prepared, beam, max_len, *rules), got in zip(schedule, results):
        assert_same_result(got, runtime.caption([prepared], beam, max_len, *rules)[0])
    # the penalty does change that caption, so the comparison above says something
    assert results[1].hypothesis.token_ids != solo(runtime, images[2], 2, 12).hypothesis.token_ids


def test_rows_joining_mid_table_never_end_on_their_first_token(encoder):
    """A model that would end every caption at once: rows joining a table whose other rows are mid-caption still
    choose a word first (the rule that keeps a beam search's caption from being empty holds row by row)."""
    runtime = runtime_for("sat", encoder)
    with torch.no_grad():
        runtime.ckpt.model.out_word.bias[runtime.eos_id] += 50.0
    images = [runtime.prepare(image) for image in random_images(3, seed=5)]
    schedule = [(0, images[0], 3, 6), (1, images[1], 2, 6), (2, images[2], 4, 6)]
    batcher = Batcher(runtime, max_batch=2, queue_size=8, max_rows=64)
    batcher.start(worker=False)
    for (_, prepared, beam, max_len), got in zip(schedule, run_bounded(drive(batcher, schedule))):
        assert got.tokens[-1] == "<eos>" and len(got.words) == 1, got.tokens
        assert_same_result(got, solo(runtime, prepared, beam, max_len))


def test_a_result_that_never_arrives_fails_its_scenario_instead_of_holding_the_run(encoder):
    """The bound every scenario here runs under (``run_bounded``): a request's future that is never resolved, as a
    batcher that lost a row would leave it, ends in a TimeoutError rather than in pytest-timeout's 600 s."""
    runtime = runtime_for("sat", encoder)
    batcher = Batcher(runtime, max_batch=2, queue_size=2, max_rows=8)
    batcher.start(worker=False)
    prepared = runtime.prepare(random_images(1, seed=9)[0])

    async def scenario():
        await batcher.submit(prepared, 1, 3, 60).future  # nobody steps this batcher

    with pytest.raises(TimeoutError):
        run_bounded(scenario(), timeout_s=0.2)


def test_row_budget_is_respected_and_waiting_requests_join_later(encoder):
    runtime = runtime_for("sat", encoder)
    seen = count_step_rows(runtime)
    encoded = count_encodes(runtime)
    images = [runtime.prepare(image) for image in random_images(6, seed=3)]
    schedule = [(0, images[i], 2, 5) for i in range(6)]
    batcher = Batcher(runtime, max_batch=16, queue_size=16, max_rows=5)
    batcher.start(worker=False)
    results = run_bounded(drive(batcher, schedule))
    assert max(seen) <= 5 and 4 in seen  # two requests of beam 2 at a time: the third waits for rows
    assert encoded[0] == 2 and sum(encoded) == 6  # the two admitted together are encoded together
    for (_, prepared, beam, max_len), got in zip(schedule, results):
        assert_same_result(got, solo(runtime, prepared, beam, max_len))


def test_waiting_requests_are_admitted_in_arrival_order_at_most_max_batch_per_boundary(encoder):
    """First come first served: with more requests waiting than a boundary admits, the oldest go first (a LIFO
    queue would leave the first arrivals waiting behind every later one), and a boundary admits ``max_batch``
    requests, not one more."""
    runtime = runtime_for("sat", encoder)
    encoded: list[int] = []
    watch_encodes(runtime, lambda batch: encoded.extend(id(prepared) for prepared in batch))
    images = [runtime.prepare(image) for image in random_images(5, seed=4)]
    batcher = Batcher(runtime, max_batch=2, queue_size=8, max_rows=64)
    batcher.start(worker=False)

    async def scenario():
        jobs = [batcher.submit(prepared, 1, 3, 60) for prepared in images]
        batcher.run_once()
        assert batcher.queued == 3 and encoded == [id(images[0]), id(images[1])]
        batcher.run_once()
        assert batcher.queued == 1
        while not batcher.idle:
            batcher.run_once()
        await asyncio.sleep(0)
        return [await job.future for job in jobs]

    results = run_bounded(scenario())
    assert encoded == [id(prepared) for prepared in images]
    for prepared, got in zip(images, results):
        assert_same_result(got, solo(runtime, prepared, 1, 3))


def test_a_wide_beam_at_the_head_of_the_queue_is_not_overtaken_by_narrower_ones(encoder):
    """Admission stops at the first waiting request whose rows do not fit: letting narrower requests behind it
    take the rows as they free would starve a wide beam for as long as narrow ones keep arriving."""
    runtime = runtime_for("sat", encoder)
    images = [runtime.prepare(image) for image in random_images(3, seed=6)]
    batcher = Batcher(runtime, max_batch=8, queue_size=8, max_rows=4)
    batcher.start(worker=False)

    async def scenario():
        running = batcher.submit(images[0], 2, 30, 60)
        batcher.run_once()
        wide = batcher.submit(images[1], 4, 3, 60)
        narrow = batcher.submit(images[2], 1, 3, 60)  # 2 rows are free: it would fit, but the wide one came first
        batcher.run_once()
        assert batcher.active_rows == 2 and batcher.queued == 2
        while not batcher.idle:
            batcher.run_once()
        await asyncio.sleep(0)
        return [await job.future for job in (running, wide, narrow)]

    results = run_bounded(scenario())
    for prepared, beam, max_len, got in zip(images, (2, 4, 1), (30, 3, 3), results):
        assert_same_result(got, solo(runtime, prepared, beam, max_len))


@contextlib.contextmanager
def _driven_with_an_encoder_thread(batcher, release: threading.Event):
    """``batcher`` driven one boundary at a time (``run_once``) with the encoder thread that ``start()`` gives a
    worker; afterwards the held encodings are released (``release``) and the thread is shut down."""
    batcher.start(worker=False)
    batcher._encoder = ThreadPoolExecutor(1)
    try:
        yield
    finally:
        release.set()
        batcher._encoder.shutdown()


def test_rows_being_encoded_count_against_the_row_budget(encoder):
    """With overlapped encoding, admitted requests are encoded while the table decodes: their rows are promised
    already, so a request arriving meanwhile must wait rather than push the table past ``max_rows``."""
    runtime = runtime_for("sat", encoder)
    rows_stepped = count_step_rows(runtime)
    images = [runtime.prepare(image) for image in random_images(3, seed=9)]
    release, _ = _held_encodings(runtime, images[1])  # admitted while the first decodes, encoded once released
    batcher = Batcher(runtime, max_batch=4, queue_size=8, max_rows=4)

    async def scenario():
        first = batcher.submit(images[0], 1, 40, 60)
        batcher.run_once()  # encoded in the encoder thread, waited for: nothing else to decode
        encoding = batcher.submit(images[1], 2, 3, 60)
        batcher.run_once()  # its encoding is held; the first request decodes on
        late = batcher.submit(images[2], 2, 3, 60)  # 1 + 2 rows taken: 1 free, too few for it
        batcher.run_once()
        assert batcher.queued == 1
        release.set()
        while not batcher.idle:
            batcher.run_once()
        await asyncio.sleep(0)
        return [await job.future for job in (first, encoding, late)]

    with _driven_with_an_encoder_thread(batcher, release):
        results = run_bounded(scenario())
    assert max(rows_stepped) <= 4
    for prepared, beam, max_len, got in zip(images, (1, 2, 2), (40, 3, 3), results):
        assert_same_result(got, solo(runtime, prepared, beam, max_len))


def test_a_failed_encoding_fails_every_request_of_its_batch_and_the_next_ones_are_served(encoder):
    runtime = runtime_for("sat", encoder)
    begin, calls = runtime.begin, []

    def failing_once(batch, widths):
        calls.append(len(batch))
        if len(calls) == 1:
            raise RuntimeError("the encoder broke")
        return begin(batch, widths)

    runtime.begin = failing_once
    images = [runtime.prepare(image) for image in random_images(3, seed=10)]
    batcher = Batcher(runtime, max_batch=4, queue_size=8, max_rows=16)
    batcher.start(worker=False)

    async def scenario():
        failed = [batcher.submit(prepared, 2, 4, 60) for prepared in images[:2]]
        batcher.run_once()
        await asyncio.sleep(0)
        for job in failed:  # each of the chunk's requests learns it failed: none is left waiting for ever
            assert job.future.done()
            with pytest.raises(RuntimeError, match="the encoder broke"):
                job.future.result()
        return await _finish(batcher, batcher.submit(images[2], 2, 4, 60))

    result = run_bounded(scenario())
    assert calls == [2, 1] and batcher.idle
    assert_same_result(result, solo(runtime, images[2], 2, 4))


async def stop_with_a_drain_that_times_out(batcher: Batcher, stuck: threading.Event) -> None:
    """Stop ``batcher`` with a drain too short for its work: once the worker is told to give up, the step it is
    stuck in (waiting on ``stuck``) goes on, and the stop and the failures it sends are done on return."""
    stopping = asyncio.ensure_future(batcher.stop(0.01))
    while not batcher._abort:  # the drain timed out: the worker is told to give up
        await asyncio.sleep(0.01)
    stuck.set()
    await stopping
    await asyncio.sleep(0)


def test_a_drain_that_times_out_fails_the_queued_requests_too(encoder):
    """After the drain timeout nothing will run again: the requests still waiting for rows must fail
    (:class:`NotAccepting`, the 503 of a stopping service) like the decoding ones, not wait for ever."""
    runtime = runtime_for("sat", encoder)
    step = runtime.step
    stepping, release = threading.Event(), threading.Event()

    def stuck_step(prev, state, enc):
        stepping.set()
        assert release.wait(30)
        return step(prev, state, enc)

    runtime.step = stuck_step
    prepared = runtime.prepare(random_images(1)[0])
    batcher = Batcher(runtime, max_batch=1, queue_size=8, max_rows=3)

    async def scenario():
        batcher.start()
        decoding = batcher.submit(prepared, 3, 30, 60)
        await asyncio.to_thread(stepping.wait, 30)  # its first step is running (and stuck)
        queued = batcher.submit(prepared, 3, 30, 60)  # no rows left for it
        await stop_with_a_drain_that_times_out(batcher, release)
        for job in (decoding, queued):
            assert job.future.done()
            with pytest.raises(NotAccepting):
                job.future.result()

    try:
        run_bounded(scenario())
    finally:
        release.set()


def test_a_drain_that_times_out_cancels_the_encoding_still_queued_for_the_encoder(encoder):
    """Once the drain has timed out its requests are failed: a chunk still waiting for the encoder thread is never
    encoded. Encoded after the worker has gone, it spent the CPU (or GPU) of a stopping server on images nobody
    will get a caption for, and held the process's exit, which joins the encoder thread, for as long."""
    runtime = runtime_for("sat", encoder)
    runtime.never_emitted = (*runtime.never_emitted, runtime.eos_id)  # the first request decodes on throughout
    images = [runtime.prepare(image) for image in random_images(3, seed=14)]
    release, _ = _held_encodings(runtime, images[1])
    held_begin, step = runtime.begin, runtime.step
    begun: list[int] = []

    def recording_begin(batch, widths):
        begun.extend(index for index, image in enumerate(images) if any(prepared is image for prepared in batch))
        return held_begin(batch, widths)

    steps, stepping, release_step = [], threading.Event(), threading.Event()

    def stuck_third_step(prev, state, enc):
        steps.append(len(steps))
        if len(steps) == 3:  # the second image is at the encoder (held), the third queued behind it
            stepping.set()
            assert release_step.wait(30)
        return step(prev, state, enc)

    runtime.begin, runtime.step = recording_begin, stuck_third_step
    batcher = Batcher(runtime, max_batch=1, queue_size=8, max_rows=16)  # one request admitted per boundary

    async def scenario():
        batcher.start()
        jobs = [batcher.submit(prepared, 1, 30, 60) for prepared in images]
        await asyncio.to_thread(stepping.wait, 30)
        assert len(batcher._encoding) == 2 and batcher.queued == 0
        await stop_with_a_drain_that_times_out(batcher, release_step)
        for job in jobs:
            with pytest.raises(NotAccepting):
                job.future.result()

    try:
        run_bounded(scenario())
    finally:
        release_step.set()
        release.set()
        batcher._encoder.shutdown(wait=True)  # the held encoding ends; a chunk left queued would be encoded now
    assert begun == [0, 1]


def test_rows_freed_by_a_cancellation_go_to_a_waiting_request_at_that_same_boundary(encoder):
    """A client that leaves between two boundaries: at the next one its rows are dropped before anyone is admitted
    and before the step, so a request waiting for rows gets them there and the step runs on the staying rows and the
    newcomer's, never on the cancelled ones; every row is then counted freed once, by its reason."""
    runtime = runtime_for("sat", encoder)
    stepped = count_step_rows(runtime)
    metrics = Metrics()
    batcher = Batcher(runtime, max_batch=4, queue_size=8, max_rows=7, metrics=metrics)
    batcher.start(worker=False)
    prepared = [runtime.prepare(image) for image in random_images(3, seed=5)]

    async def scenario():
        stay = batcher.submit(prepared[0], 3, 30, 60)
        leave = batcher.submit(prepared[1], 4, 30, 60)
        waiting = batcher.submit(prepared[2], 4, 30, 60)
        batcher.run_once()
        batcher.run_once()
        assert batcher.active_rows == 7 and batcher.queued == 1  # no room for the third
        batcher.cancel(leave)  # what the route does when the client disconnects
        stepped.clear()
        batcher.run_once()
        assert batcher.queued == 0 and batcher.active_rows == 7 and stepped == [7]  # 3 staying + 4 newcomer
        while not batcher.idle:
            batcher.run_once()
        await asyncio.sleep(0)
        assert not leave.future.done()  # nobody waits for it; it is never resolved
        return await stay.future, await waiting.future

    stayed, waited = run_bounded(scenario())
    assert_same_result(stayed, solo(runtime, prepared[0], 3, 30))
    assert_same_result(waited, solo(runtime, prepared[2], 4, 30))
    assert metrics.freed.labels("sat", "cancelled")._value.get() == 4
    assert metrics.freed.labels("sat", "finished")._value.get() == 3 + 4


def _two_images_for_three_rows(encoder):
    """A SAT batcher of three rows without its worker, two prepared images for it, and the list of the batches it
    encodes: one 3-beam request decodes while the other waits for rows."""
    runtime = runtime_for("sat", encoder)
    encoded: list = []
    watch_encodes(runtime, encoded.append)
    batcher = Batcher(runtime, max_batch=4, queue_size=8, max_rows=3)
    batcher.start(worker=False)
    return runtime, batcher, [runtime.prepare(image) for image in random_images(2, seed=6)], encoded


def test_a_request_whose_client_leaves_while_it_waits_leaves_the_queue_and_is_never_encoded(encoder):
    """Cancelled while waiting for rows: it leaves the queue at the next boundary (the queue limit counts it no
    more) and no encoding or decoding is spent on it, while the request decoding meanwhile is unaffected."""
    runtime, batcher, prepared, encoded = _two_images_for_three_rows(encoder)

    async def scenario():
        running = batcher.submit(prepared[0], 3, 12, 60)
        gone = batcher.submit(prepared[1], 3, 12, 60)
        batcher.run_once()
        assert batcher.queued == 1  # no rows for it yet
        batcher.cancel(gone)
        batcher.run_once()
        assert batcher.queued == 0
        while not batcher.idle:
            batcher.run_once()
        await asyncio.sleep(0)
        assert not gone.future.done()
        return await running.future

    result = run_bounded(scenario())
    assert [len(batch) for batch in encoded] == [1] and encoded[0][0] is prepared[0]
    assert_same_result(result, solo(runtime, prepared[0], 3, 12))


def test_requests_whose_awaiting_task_is_cancelled_leave_the_queue_and_their_rows_at_the_next_boundary(encoder):
    """The archive awaits ``job.future`` itself, so interrupting a run cancels the futures of the captions in flight
    without ``Batcher.cancel``: the next boundary must free the rows of the decoding one and drop the waiting one
    unencoded, or the interrupted run decodes captions nobody reads and its shutdown waits for them."""
    runtime, batcher, prepared, encoded = _two_images_for_three_rows(encoder)

    async def scenario():
        running = batcher.submit(prepared[0], 3, 30, 60)
        waiting = batcher.submit(prepared[1], 3, 30, 60)
        batcher.run_once()
        assert batcher.active_rows == 3 and batcher.queued == 1

        async def awaits(future):  # what the archive's caption_one does
            return await future

        awaiting = [asyncio.create_task(awaits(job.future)) for job in (running, waiting)]
        await asyncio.sleep(0)
        for task in awaiting:
            task.cancel()
        await asyncio.gather(*awaiting, return_exceptions=True)
        assert running.future.cancelled() and waiting.future.cancelled()
        batcher.run_once()
        return batcher.active_rows, batcher.queued, batcher.idle

    assert run_bounded(scenario()) == (0, 0, True)
    assert [len(batch) for batch in encoded] == [1] and encoded[0][0] is prepared[0]


def test_a_caller_that_leaves_or_times_out_frees_its_rows_under_its_own_label(encoder):
    """``caption()`` is what the routes await: a handler cancelled (its client left) and a wait that outlasts the
    deadline must both give the job's rows back at the next boundary, counted as "cancelled" and "deadline"."""
    runtime = runtime_for("sat", encoder)
    metrics = Metrics()
    # the batcher's clock stands still: only caption()'s own wait can notice the deadline, never the worker
    batcher = Batcher(runtime, max_batch=4, queue_size=8, max_rows=64, metrics=metrics, clock=FakeClock())
    batcher.start(worker=False)
    prepared = [runtime.prepare(image) for image in random_images(2, seed=8)]

    async def scenario():
        leaving = asyncio.ensure_future(batcher.caption(prepared[0], 3, 40, 60))
        late = asyncio.ensure_future(batcher.caption(prepared[1], 2, 40, 0.05))
        await asyncio.sleep(0)  # both submitted
        batcher.run_once()
        assert batcher.active_rows == 5
        leaving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await leaving
        batcher.run_once()
        assert batcher.active_rows == 2
        assert metrics.freed.labels("sat", "cancelled")._value.get() == 3
        with pytest.raises(DeadlineExceeded):
            await late  # no step runs meanwhile: caption()'s own deadline ends the wait
        batcher.run_once()
        assert batcher.active_rows == 0 and batcher.idle
        assert metrics.freed.labels("sat", "deadline")._value.get() == 2

    run_bounded(scenario())


def test_deadline_fails_the_request_and_frees_its_rows(encoder):
    runtime = runtime_for("sat", encoder)
    metrics = Metrics()
    # a clock that moves only when told: on a loaded machine a real step can take longer than any short deadline
    clock = FakeClock()
    batcher = Batcher(runtime, max_batch=4, queue_size=8, max_rows=64, metrics=metrics, clock=clock)
    batcher.start(worker=False)
    prepared = runtime.prepare(random_images(1)[0])

    async def scenario():
        running = batcher.submit(prepared, 3, 40, 0.05)
        batcher.run_once()
        assert batcher.active_rows == 3
        clock.now += 0.08
        batcher.run_once()
        assert batcher.active_rows == 0
        with pytest.raises(DeadlineExceeded):
            await running.future
        assert metrics.freed.labels("sat", "deadline")._value.get() == 3
        # steps take no time on this clock, so admission control has no estimate and admits it
        queued = batcher.submit(prepared, 2, 40, 0.01)  # expires while still waiting: never gets rows
        clock.now += 0.03
        batcher.run_once()
        # shed as overload (429 + Retry-After), not a 504: it never got rows
        with pytest.raises(WouldMissDeadline) as refused:
            await queued.future
        assert refused.value.retry_after_s >= 1
        assert batcher.idle

    run_bounded(scenario())


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

    run_bounded(scenario())


def test_the_check_ahead_of_an_upload_refuses_as_submit_would_while_the_batcher_is_not_accepting(encoder):
    """``check_admission`` runs before a request's image is decoded and must raise what ``submit`` would: a batcher
    not started or stopping refuses with NotAccepting (the service's 503), not with its queue's or its estimate's
    refusal (a 429 telling the client to retry a server that is going away), and never lets it through."""
    runtime = runtime_for("sat", encoder)
    batcher = Batcher(runtime, max_batch=4, queue_size=1, max_rows=4)
    prepared = runtime.prepare(random_images(1)[0])

    async def scenario():
        with pytest.raises(NotAccepting):
            batcher.check_admission(10, 1, 5)  # not started
        batcher.start(worker=False)
        batcher.submit(prepared, 1, 5, 10)
        with pytest.raises(QueueFull):
            batcher.check_admission(10, 1, 5)
        await batcher.stop()
        with pytest.raises(NotAccepting):
            batcher.check_admission(10, 1, 5)  # the queue is still full, but the batcher is stopping

    run_bounded(scenario())


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

    results = run_bounded(scenario())
    for (prepared, beam, max_len), got in zip(requests, results):
        assert_same_result(got, solo(runtime, prepared, beam, max_len))


def test_a_failing_step_fails_its_requests_by_id_and_the_worker_goes_on(encoder):
    """A step that raises fails the requests in its table, each logged with its request id (the worker thread's
    traceback names none: the operator audit), and the next request is captioned as usual."""
    runtime = runtime_for("sat", encoder)
    prepared = runtime.prepare(random_images(1)[0])
    real_step, broken = runtime.step, [True]

    def failing_while_broken(*args):
        # every step of the first two requests fails, whether they share a table or (on a slow machine, or under
        # asyncio's debug mode) the second joins after the first step
        if broken[0]:
            raise RuntimeError("a broken kernel")
        return real_step(*args)

    runtime.step = failing_while_broken
    lines = []

    class Kept(logging.Handler):  # formatted as the server's handler formats: in the record's own context
        def emit(self, record):
            lines.append(json.loads(JsonFormatter().format(record)))

    batcher_log = logging.getLogger("captioner.batcher")
    handler = Kept()
    batcher_log.addHandler(handler)
    batcher = Batcher(runtime, max_batch=2, queue_size=8, max_rows=16)

    async def one(request_id):
        request_id_var.set(request_id)  # each task runs in a copy of the context: as a request does
        return await batcher.caption(prepared, 2, 5, 60)

    async def scenario():
        batcher.start()
        try:
            failed = await asyncio.gather(one("first-a"), one("first-b"), return_exceptions=True)
            broken[0] = False
            return failed, await one("later")
        finally:
            await batcher.stop(10)

    try:
        failed, later = run_bounded(scenario())
    finally:
        batcher_log.removeHandler(handler)
    assert [type(f).__name__ for f in failed] == ["RuntimeError", "RuntimeError"]
    assert later.words == solo(runtime, prepared, 2, 5).words
    named = {line.get("request_id") for line in lines if "failed for this request" in line["msg"]}
    assert named == {"first-a", "first-b"}, lines


def test_a_caption_made_before_its_steps_bookkeeping_failed_still_goes_out(encoder, monkeypatch):
    """The results of a step go out after the step is measured, and also when what follows their collection fails
    (here freeing their rows): the request gets the caption that was made, not the error, nor a wait to its
    deadline; the worker goes on."""
    runtime = runtime_for("sat", encoder)
    prepared = runtime.prepare(random_images(1)[0])
    real_remove, broken = RowTable.remove, [True]

    def failing_once(table, jobs, runtime):
        if broken[0]:
            broken[0] = False
            raise RuntimeError("freeing the rows failed")
        return real_remove(table, jobs, runtime)

    monkeypatch.setattr(RowTable, "remove", failing_once)
    batcher = Batcher(runtime, max_batch=1, queue_size=8, max_rows=16)

    async def scenario():
        batcher.start()
        try:
            return await batcher.caption(prepared, 2, 5, 60), await batcher.caption(prepared, 2, 5, 60)
        finally:
            await batcher.stop(10)

    first, later = run_bounded(scenario())
    assert not broken[0], "the bookkeeping never failed: the test checked nothing"
    assert first.words == later.words == solo(runtime, prepared, 2, 5).words


def test_a_table_whose_results_cannot_be_collected_fails_its_requests_and_the_other_tables_get_theirs(
        encoder, monkeypatch):
    """Two requests of a Transformer finish at one step in two tables (each cohort has its own): when copying one
    table's results fails, its request fails with the error at that boundary, not at its deadline, its rows are
    freed there as a finished request's are, and the other table's request gets its own caption, never one shifted
    from the failed table's results."""
    runtime = runtime_for("area-transformer", encoder)
    images = [runtime.prepare(image) for image in random_images(2, seed=7)]
    real_results_of, jobs = RowTable.results_of, []

    def failing_for_the_first_request(table, finished, runtime):
        if jobs[0] in finished:
            raise RuntimeError("copying the results failed")
        return real_results_of(table, finished, runtime)

    monkeypatch.setattr(RowTable, "results_of", failing_for_the_first_request)
    batcher = Batcher(runtime, max_batch=4, queue_size=8, max_rows=16)
    batcher.start(worker=False)

    async def scenario():
        jobs.append(batcher.submit(images[0], 2, 4, 60))
        batcher.run_once()
        jobs.append(batcher.submit(images[1], 2, 3, 60))  # a step later: a cohort of its own, ending at one step
        while not batcher.idle:
            batcher.run_once()
            # both tables decode until one step finishes both, and that boundary frees every row, the failed table's
            # too (left in it, they would be decoded and fail again at every step)
            assert len(batcher._tables) in (0, 2)
        await asyncio.sleep(0)
        assert all(job.future.done() for job in jobs)
        return await asyncio.gather(*(job.future for job in jobs), return_exceptions=True)

    failed, second = run_bounded(scenario())
    assert isinstance(failed, RuntimeError) and "copying the results failed" in str(failed)
    assert_same_result(second, solo(runtime, images[1], 2, 3))


def test_a_failing_step_spares_the_requests_still_queued_and_a_failing_idle_hook_spares_the_worker(encoder):
    """A step that raised failed every request the batcher held, the queued ones that took no part in it too; and
    the hook the worker calls when it falls idle (the app's memory release) ran outside the worker's guard, so one
    that raised ended the worker while the batcher went on taking requests, each left to its deadline."""
    runtime = runtime_for("sat", encoder)
    prepared = runtime.prepare(random_images(1)[0])
    real_step, calls, idle_calls = runtime.step, [], []

    def failing_once(*args):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a broken kernel")
        return real_step(*args)

    def failing_hook():
        idle_calls.append(1)
        raise RuntimeError("no thread for the release")

    runtime.step = failing_once
    # rows for one beam of 2: the second request waits in the queue while the first one's step fails
    batcher = Batcher(runtime, max_batch=1, queue_size=8, max_rows=2, on_idle=failing_hook)

    async def scenario():
        batcher.start()
        try:
            first, queued = await asyncio.gather(batcher.caption(prepared, 2, 5, 60),
                                                 batcher.caption(prepared, 2, 5, 60), return_exceptions=True)
            await asyncio.sleep(0.2)  # the worker has fallen idle and called the hook
            return first, queued, await asyncio.wait_for(batcher.caption(prepared, 2, 5, 60), 30)
        finally:
            await batcher.stop(10)

    first, queued, later = run_bounded(scenario())
    assert isinstance(first, RuntimeError)
    assert queued.words == later.words == solo(runtime, prepared, 2, 5).words
    assert len(idle_calls) >= 1


def test_the_memory_release_never_fails_its_caller_and_is_tried_again(monkeypatch):
    """A timer that cannot start (no thread to be had) raised into the request or worker that asked for the
    release, and left it marked as scheduled, so that memory was never given back again."""
    started = []

    def no_thread(timer):
        raise RuntimeError("can't start new thread")

    trimmer = IdleTrimmer(interval_s=0.0)
    monkeypatch.setattr(threading.Timer, "start", no_thread)
    trimmer()  # does not raise
    monkeypatch.setattr(threading.Timer, "start", lambda timer: started.append(timer))
    trimmer()
    assert len(started) == 1  # asked again, it schedules the release


def test_the_memory_release_runs_once_per_interval_and_the_next_is_deferred_to_the_intervals_end(monkeypatch):
    """Asked while a release is scheduled, the trimmer schedules no other; once it has run, the next request
    schedules one again, deferred to the end of the interval that release began (not at once, not later)."""
    started = []
    monkeypatch.setattr(threading.Timer, "start", lambda timer: started.append(timer))
    trimmer = IdleTrimmer(interval_s=60.0)
    trimmer()
    trimmer()
    assert [timer.interval for timer in started] == [0.0]  # the first release is not deferred
    started[0].function()  # the release runs
    trimmer()
    assert len(started) == 2 and 0.0 < started[1].interval <= 60.0


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

    results = run_bounded(scenario())
    assert len(results) == 3 and all(r.words == results[0].words for r in results)


class FakeClock:
    """A clock that only moves when the fake slow runtime works: admission decisions become deterministic."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class StepCost:
    """Fake seconds a decoding step takes, changed by a test to make the machine slower or faster mid-run."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds


def slow_runtime(encoder, clock: FakeClock, step_s: float | StepCost = 1.0,
                 encode_s: dict[int, float] | None = None, row_s: float = 0.0):
    """A real tiny SAT runtime whose steps (and encodings) take ``step_s`` plus ``row_s`` a row (``encode_s[batch]``)
    of fake time."""
    runtime = runtime_for("sat", encoder)
    step, begin = runtime.step, runtime.begin
    encoded: list[int] = []

    def slow_step(prev, state, enc):
        clock.now += (step_s.seconds if isinstance(step_s, StepCost) else step_s) + row_s * prev.shape[0]
        return step(prev, state, enc)

    def slow_begin(batch, widths):
        encoded.append(len(batch))
        clock.now += (encode_s or {}).get(len(batch), 0.0)
        return begin(batch, widths)

    runtime.step, runtime.begin = slow_step, slow_begin
    return runtime, encoded


def _finish(batcher, job):
    """Drive a worker-less batcher until ``job`` has its result."""
    async def run():
        while not job.future.done():
            batcher.run_once()
            await asyncio.sleep(0)
        return await job.future
    return run()


def test_admission_refuses_requests_that_would_miss_their_deadline_and_admitted_ones_meet_it(encoder):
    clock = FakeClock()
    runtime, _ = slow_runtime(encoder, clock)
    # one request at a time (3 rows): a queue of requests is served strictly one after another
    batcher = Batcher(runtime, max_batch=4, queue_size=16, max_rows=3, clock=clock)
    batcher.start(worker=False)
    prepared = runtime.prepare(random_images(1, seed=5)[0])

    async def scenario():
        await _finish(batcher, batcher.submit(prepared, 3, 6, 1000))  # nothing measured yet: admitted
        alone = batcher.expected_wait_s(3, 6)
        estimate = batcher.admission
        assert alone == estimate.steps_per_request * estimate.step_time_s  # its own steps at the measured step time
        timeout = 2.5 * alone / ADMISSION_HEADROOM  # room for this request and one ahead of it, not two
        admitted = [batcher.submit(prepared, 3, 6, timeout), batcher.submit(prepared, 3, 6, timeout)]
        assert batcher.expected_wait_s(3, 6) == pytest.approx(3 * alone)
        with pytest.raises(WouldMissDeadline) as refused:
            batcher.submit(prepared, 3, 6, timeout)
        assert isinstance(refused.value, QueueFull)
        # Retry-After: when the two ahead of it will be done, not when it would have been
        assert refused.value.retry_after_s == max(1, math.ceil(2 * alone))
        # expected to finish within its deadline but not within the headroom kept for what the estimate misses
        with pytest.raises(WouldMissDeadline):
            batcher.submit(prepared, 3, 6, 3 * alone / ((1 + ADMISSION_HEADROOM) / 2))
        for job in admitted:  # no DeadlineExceeded: the refused third one would have ended past its deadline
            assert (await _finish(batcher, job)).words

    run_bounded(scenario())


def test_admission_counts_the_requests_already_decoding_as_ahead(encoder):
    """With rows for everybody, the worker takes every waiting request into its table at the next boundary, so
    the queue stays empty however many are decoding; admission must still count their remaining work (a burst
    once filled the table until every request in it missed its deadline)."""
    clock = FakeClock()
    runtime, _ = slow_runtime(encoder, clock)
    # <eos> never emitted: every request runs to its length limit, so the work left is known exactly
    runtime.never_emitted = (*runtime.never_emitted, runtime.eos_id)
    batcher = Batcher(runtime, max_batch=8, queue_size=16, max_rows=64, clock=clock)
    batcher.start(worker=False)
    prepared = runtime.prepare(random_images(1, seed=5)[0])

    async def scenario():
        await _finish(batcher, batcher.submit(prepared, 3, 6, 1000))
        alone = batcher.expected_wait_s(3, 6)
        decoding = [batcher.submit(prepared, 3, 6, 1000) for _ in range(2)]
        batcher.run_once()  # both join the table: none is waiting any more
        assert batcher.queued == 0 and batcher.active_jobs == 2
        crowded = batcher.expected_wait_s(3, 6)
        # 2 × 3 rows × 5 steps left and 3 × 6 of its own, at the measured rows per second, against 6 steps alone
        assert crowded == pytest.approx((2 * 3 * 5 + 3 * 6) / batcher.admission.row_rate) and crowded > alone
        timeout = (alone + crowded) / 2 / ADMISSION_HEADROOM
        with pytest.raises(WouldMissDeadline):
            batcher.submit(prepared, 3, 6, timeout)
        with pytest.raises(WouldMissDeadline):  # the same answer without queueing anything
            batcher.check_admission(timeout, 3, 6)
        for job in decoding:
            await _finish(batcher, job)
        assert batcher.active_jobs == 0
        batcher.check_admission(timeout, 3, 6)  # the table is empty again: admitted

    run_bounded(scenario())


def test_a_slower_step_raises_the_estimate_before_any_request_finishes(encoder):
    """When the machine slows down (a burst keeping the event loop busy, another process on the cores), the next
    step says so: admission does not wait for a finished request to notice."""
    cost = StepCost(1.0)
    batcher, prepared = _variable_speed_batcher(encoder, cost)

    async def scenario():
        await _finish(batcher, batcher.submit(prepared, 3, 4, 1000))
        before = batcher.expected_wait_s(3, 4)
        slow = batcher.submit(prepared, 3, 20, 1000)
        cost.seconds = 4.0
        for _ in range(3):
            batcher.run_once()
        assert not slow.future.done() and batcher.expected_wait_s(3, 4) > 2 * before
        batcher.cancel(slow)
        batcher.run_once()

    run_bounded(scenario())


def _variable_speed_batcher(encoder, cost: StepCost, max_rows: int = 64):
    """A worker-less batcher on a fake clock whose steps take ``cost.seconds``; captions run to their length
    limit (<eos> never emitted), so the work left is known exactly."""
    clock = FakeClock()
    runtime, _ = slow_runtime(encoder, clock, step_s=cost)
    runtime.never_emitted = (*runtime.never_emitted, runtime.eos_id)
    batcher = Batcher(runtime, max_batch=4, queue_size=16, max_rows=max_rows, clock=clock)
    batcher.start(worker=False)
    return batcher, runtime.prepare(random_images(1, seed=5)[0])


def test_waiting_requests_that_cannot_finish_in_time_are_shed_before_getting_rows(encoder):
    """A request let in on one estimate can wait while the steps slow down; once its own steps no longer fit in the
    time it has left it is shed at a step boundary (429 + Retry-After), before its deadline passes, instead of
    ending as a 504."""
    cost = StepCost(0.01)
    batcher, prepared = _variable_speed_batcher(encoder, cost, max_rows=3)  # one request decodes at a time

    async def scenario():
        first = batcher.submit(prepared, 3, 40, 1000)
        batcher.run_once()
        waiting = batcher.submit(prepared, 3, 40, 1.0)  # 40 steps of 10 ms behind the first: let in
        assert batcher.queued == 1
        cost.seconds = 0.05  # the machine slows down: 40 steps now need 2 s
        while not waiting.future.done():
            own = batcher.admission.own_time_s
            hopeless = own is not None and own(waiting) > waiting.deadline - batcher.clock()
            batcher.run_once()
            await asyncio.sleep(0)  # the result reaches the future through the event loop
            assert waiting.future.done() or not hopeless  # shed at the first boundary where it cannot make it
        assert batcher.clock() < waiting.deadline  # shed early, not expired
        with pytest.raises(WouldMissDeadline) as refused:
            await waiting.future
        assert refused.value.retry_after_s >= 1
        assert not first.future.done() and batcher.active_jobs == 1  # the decoding request is untouched
        assert (await _finish(batcher, first)).words

    run_bounded(scenario())


def test_an_idle_model_admits_despite_an_old_estimate_and_its_steps_correct_it(encoder):
    """Estimates change only when steps run: refusing a request to an idle model on old ones would refuse for good
    (after a burst, the step time of a full table kept every request to that model out)."""
    cost = StepCost(5.0)  # a busy machine
    batcher, prepared = _variable_speed_batcher(encoder, cost)

    async def scenario():
        await _finish(batcher, batcher.submit(prepared, 3, 4, 1000))
        cost.seconds = 0.1  # the machine is free again; nothing has run since
        assert batcher.expected_wait_s(3, 4) > 10 / ADMISSION_HEADROOM  # 4 steps of 5 s: it would be refused
        assert (await _finish(batcher, batcher.submit(prepared, 3, 20, 10))).words  # idle: admitted
        # its 20 steps brought the estimate down, and a request arriving while another decodes is judged by it
        batcher.submit(prepared, 3, 4, 1000)
        batcher.run_once()
        assert batcher.active_jobs == 1 and batcher.expected_wait_s(3, 4) < 10 * ADMISSION_HEADROOM
        batcher.check_admission(10, 3, 4)

    run_bounded(scenario())


def test_a_failed_step_leaves_no_phantom_work_for_admission_control_to_count(encoder):
    """After a failing step the worker falls idle with no request left; admission control must see an idle model
    too.  Left counting the failed request as decoding, it would judge the next request by the old estimate with
    work ahead of it that nobody will do, and refuse a request an idle model serves at once."""
    clock = FakeClock()
    runtime, _ = slow_runtime(encoder, clock)
    runtime.never_emitted = (*runtime.never_emitted, runtime.eos_id)  # every request runs to its length limit
    real_step, steps = runtime.step, []

    def failing_at_the_second_requests_second_step(*args):
        steps.append(1)
        if len(steps) == 6:  # the first request took steps 1-4; the second one's first step succeeds
            raise RuntimeError("a broken kernel")
        return real_step(*args)

    runtime.step = failing_at_the_second_requests_second_step
    idle_calls = threading.Semaphore(0)  # the worker calls the hook after cleaning up a stretch of work
    batcher = Batcher(runtime, max_batch=4, queue_size=8, max_rows=16, clock=clock, on_idle=idle_calls.release)
    prepared = runtime.prepare(random_images(1, seed=5)[0])

    async def scenario():
        batcher.start()
        try:
            await batcher.caption(prepared, 3, 4, 1000)
            assert await asyncio.to_thread(idle_calls.acquire, timeout=10)
            assert batcher.expected_wait_s(3, 4) > 1  # an estimate that would refuse a deadline of 1 s
            with pytest.raises(RuntimeError, match="a broken kernel"):
                await batcher.caption(prepared, 3, 4, 1000)
            assert await asyncio.to_thread(idle_calls.acquire, timeout=10)
            assert batcher.idle and batcher.active_jobs == 0
            batcher.check_admission(1 / ADMISSION_HEADROOM, 3, 4)  # idle: admitted whatever the old estimate says
        finally:
            await batcher.stop(10)

    run_bounded(scenario())


def _estimate_job(beam: int, max_len: int, steps: int = 0, deadline: float = 100.0,
                  typical_length: bool = True, enqueued: float = 0.0) -> Job:
    """A job as admission control sees it (no image, no event loop: the estimate reads none)."""
    return Job(None, beam, max_len, deadline, None, None, enqueued=enqueued, steps=steps,
               typical_length=typical_length)


def test_the_estimate_averages_measured_samples_and_counts_a_decoding_job_at_least_one_step():
    """AdmissionEstimate alone, on numbers worked by hand: moving averages weighted by RATE_SMOOTHING, in which a
    step or an encoding that took no measurable time and a warm-up's artificial caption length are no samples; the
    work of a decoding job past its expected length is still one step of its rows; calibration's forget_rate and
    restore_rate."""
    assert RATE_SMOOTHING == 0.2  # the numbers below are worked with it: a new sample weighs a fifth
    estimate = AdmissionEstimate("m")
    estimate.measure_step(4, 0.0, [])
    estimate.measure_encode(0.0)
    assert (estimate.step_time_s, estimate.rows_per_step, estimate.encode_time_s) == (None, None, None)
    assert estimate.expected_wait_s([], 1, 5) is None and estimate.own_time_s is None
    warm_up = _estimate_job(1, 20, steps=99, typical_length=False)
    estimate.measure_step(4, 2.0, [_estimate_job(1, 20, steps=10), warm_up])
    assert (estimate.step_time_s, estimate.rows_per_step, estimate.steps_per_request) == (2.0, 4, 10)
    assert estimate.expected_wait_s([], 1, 5) == 5 * 2.0  # nothing admitted yet: its own 5 steps
    estimate.measure_step(8, 1.0, [_estimate_job(1, 20, steps=15)])
    estimate.measure_encode(0.5)
    estimate.measure_encode(1.5)
    assert estimate.step_time_s == pytest.approx(1.8)  # 0.8 · 2.0 + 0.2 · 1.0
    assert estimate.rows_per_step == pytest.approx(4.8)  # 0.8 · 4 + 0.2 · 8
    assert estimate.steps_per_request == pytest.approx(11.0)  # 0.8 · 10 + 0.2 · 15
    assert estimate.encode_time_s == pytest.approx(0.7)  # the first sample as it is, then 0.8 · 0.5 + 0.2 · 1.5
    assert estimate.row_rate == pytest.approx(4.8 / 1.8)  # the ratio of the averages
    assert estimate.own_time_s(_estimate_job(1, 20)) == pytest.approx(20.5)  # encoding 0.7 s, then 11 steps of 1.8 s

    # decoding: 3 rows 4 steps in, and 2 rows already past the expected length (still one step of work each)
    estimate.expect_work([_estimate_job(3, 20, steps=4), _estimate_job(2, 20, steps=16)])
    waiting = [_estimate_job(1, 20)]
    # 3 · (11 - 4) + 2 · 1 decoding, 1 · 11 waiting, 2 · 5 its own (beam 2, 5 steps): 44 row-steps at 8/3 rows a
    # second, 16.5 s (longer than its own 5 steps of 1.8 s), after two encodings of 0.7 s (the waiting one's, its own)
    assert estimate.expected_wait_s(waiting, 2, 5) == pytest.approx(17.9)

    saved = estimate.forget_rate()  # calibration: no request is refused until a step is measured again
    assert (estimate.step_time_s, estimate.rows_per_step) == (None, None)
    assert estimate.expected_wait_s(waiting, 2, 5) is None
    estimate.restore_rate(saved)  # nothing measured meanwhile: the rate it had
    assert (estimate.step_time_s, estimate.rows_per_step) == (pytest.approx(1.8), pytest.approx(4.8))
    saved = estimate.forget_rate()
    estimate.measure_step(2, 0.5, [])
    estimate.restore_rate(saved)  # a step measured meanwhile is newer: kept
    assert (estimate.step_time_s, estimate.rows_per_step) == (0.5, 2)


def test_refusals_retry_after_the_work_ahead_at_least_one_second_and_a_waiting_job_is_kept_while_it_can_finish():
    estimate = AdmissionEstimate("m")
    estimate.measure_step(10, 0.125, [])  # 80 rows per second; no caption length learnt: max_len steps
    estimate.expect_work([_estimate_job(1, 4)])
    # one decoding request of 4 steps: a new one alone needs its 4 steps (0.5 s), about all it is expected to wait
    estimate.check(0.55 / ADMISSION_HEADROOM, 1, 4, [], queue_size=4, active_jobs=1)  # in time: admitted
    with pytest.raises(WouldMissDeadline) as refused:
        estimate.check(0.45 / ADMISSION_HEADROOM, 1, 4, [], queue_size=4, active_jobs=1)
    assert refused.value.retry_after_s == 1  # nothing ahead of it to wait for: the least Retry-After
    crowded = AdmissionEstimate("m")
    crowded.measure_step(10, 0.125, [])
    crowded.expect_work([_estimate_job(1, 4) for _ in range(100)])  # 400 row-steps decoding: 5 s at 80 rows/s
    with pytest.raises(WouldMissDeadline) as refused:
        crowded.check(1.0, 1, 4, [], queue_size=4, active_jobs=100)
    # when the work ahead of it is done: its expected 5.05 s less the 0.5 s of its own steps
    assert refused.value.retry_after_s == math.ceil((400 + 4) / 80 - 4 * 0.125) == 5

    waiting = _estimate_job(1, 4, deadline=10.0)
    # a deadline passed before anything was measured: shed, with the least Retry-After
    assert AdmissionEstimate("m").shed(waiting, 10.5, None, [waiting]).retry_after_s == 1
    queue = [waiting] + [_estimate_job(1, 4) for _ in range(40)]
    own = estimate.own_time_s  # 0.5 s
    assert estimate.shed(waiting, 9.25, own, queue) is None  # 0.75 s left: it can finish
    assert estimate.shed(waiting, 9.5, None, queue) is None  # no step time to judge by: kept until its deadline
    for now, need in ((9.75, own), (10.5, None)):  # cannot finish in the 0.25 s left; its deadline has passed
        refusal = estimate.shed(waiting, now, need, queue)
        assert isinstance(refusal, WouldMissDeadline)
        wait = estimate.expected_wait_s(queue, 1, 4)
        assert wait > 1 and refusal.retry_after_s == math.ceil(wait)  # retry when the queue ahead has been served


def test_a_waiting_job_that_needs_exactly_the_time_it_has_left_is_kept_and_its_retry_after_counts_its_beam():
    """A waiting job is shed only when it *cannot* finish in the time it has left: one that needs exactly that time
    is kept, as a tie is admitted at the door. And a shed job's Retry-After is the wait of a request like it, its
    own beam's rows included: a wide request told to come back after a one-row request's wait is refused again."""
    estimate = AdmissionEstimate("m")
    estimate.measure_step(10, 0.125, [])  # 80 rows per second, 0.125 s a step; no caption length learnt: max_len
    waiting = _estimate_job(1, 4, deadline=10.0)
    # alone it needs 4 steps of 0.125 s, exactly the 0.5 s left at 9.5 (binary fractions: no rounding)
    assert estimate.own_time_s(waiting) == 0.5 == 10.0 - 9.5
    assert estimate.shed(waiting, 9.5, estimate.own_time_s, [waiting]) is None
    # judged by its deadline alone (an idle worker), it is kept at the deadline itself, which has not yet passed: as
    # a decoding request keeps its rows until ``now > deadline``
    assert estimate.shed(waiting, 10.0, None, [waiting]) is None
    wide = _estimate_job(40, 4, deadline=10.0)
    refusal = estimate.shed(wide, 10.5, None, [wide])
    # 40 rows · 4 steps waiting and the same again for a request like it: 320 row-steps at 80 a second, 4 s (a beam
    # of one would have made it 164 row-steps, 3 s)
    assert isinstance(refusal, WouldMissDeadline) and refusal.retry_after_s == 4


def test_a_request_that_would_just_make_its_deadline_is_admitted_and_one_just_past_it_refused():
    """Admitted when its expected finish is *within* the headroom's share of its time (a tie is admitted), refused
    just past it; Retry-After is rounded up to whole seconds, never down (a client told 4 s for 4.35 s of work ahead
    would come back too early and be refused again)."""
    estimate = AdmissionEstimate("m")
    estimate.measure_step(10, 0.125, [])  # 80 rows per second
    # 72 steps of 0.125 s alone: 9 s, exactly ADMISSION_HEADROOM of 10 s (0.9 · 10.0 == 9.0 in floating point)
    assert estimate.expected_wait_s([], 1, 72) == 9.0 == ADMISSION_HEADROOM * 10.0
    estimate.check(10.0, 1, 72, [], queue_size=4, active_jobs=1)
    with pytest.raises(WouldMissDeadline):
        estimate.check(9.99, 1, 72, [], queue_size=4, active_jobs=1)
    estimate.expect_work([_estimate_job(1, 4) for _ in range(96)])  # 384 row-steps decoding
    with pytest.raises(WouldMissDeadline) as refused:
        estimate.check(1.0, 1, 4, [], queue_size=4, active_jobs=96)
    # (384 + 4) / 80 = 4.85 s expected, less its own 4 steps of 0.125 s: 4.35 s of work ahead, so 5 s, not 4
    assert refused.value.retry_after_s == 5


def test_a_fresh_estimate_counts_no_decoding_work_before_anything_is_admitted():
    """Until the worker admits something, the work ahead of a newcomer is only the waiting requests' and its own:
    behind four waiting requests of one row and 5 steps, at one row a second, it waits 20 + 5 row-steps."""
    estimate = AdmissionEstimate("m")
    estimate.measure_step(1, 1.0, [])
    assert estimate.expected_wait_s([_estimate_job(1, 5) for _ in range(4)], 1, 5) == 25.0


def test_a_shed_requests_refusal_says_how_long_it_waited_and_never_a_negative_time_left():
    """The refusal's text is the 429's detail the client reads: the wait counts from when the request was queued,
    and a deadline already passed leaves 0 s, not a negative time."""
    estimate = AdmissionEstimate("m")
    estimate.measure_step(10, 0.125, [])
    waiting = _estimate_job(1, 4, deadline=10.0, enqueued=4.0)
    assert str(estimate.shed(waiting, 9.75, estimate.own_time_s, [waiting])) == (
        "model 'm' is overloaded: this request waited 5.75 s and cannot be captioned in the 0.25 s left to its "
        "deadline")
    assert "waited 6.50 s and cannot be captioned in the 0.00 s left" in str(estimate.shed(waiting, 10.5, None,
                                                                                             [waiting]))


def test_a_refusal_at_the_door_says_how_many_wait_and_decode_ahead_and_the_time_needed_against_the_time_left():
    """The door's refusals are the 429's detail too: a client (or the operator reading its complaint) learns from it
    how many requests are waiting and how many decoding, and how long this one would need against the time it had
    (the waiting and decoding counts, or the two times, swapped, tell them the wrong load)."""
    estimate = AdmissionEstimate("m")
    estimate.measure_step(10, 0.125, [])  # 80 rows per second; no caption length learnt: max_len steps
    estimate.expect_work([_estimate_job(1, 4) for _ in range(100)])  # 400 row-steps decoding
    pending = [_estimate_job(1, 4) for _ in range(2)]  # 8 row-steps waiting
    with pytest.raises(WouldMissDeadline) as refused:
        estimate.check(1.0, 1, 4, pending, queue_size=4, active_jobs=100)
    # (400 + 8 + 4) row-steps at 80 a second: 5.15 s
    assert str(refused.value) == (
        "model 'm' would need about 5.15 s for this request (2 waiting, 100 decoding), "
        "more than the 1.00 s left to its deadline"
    )
    with pytest.raises(QueueFull) as full:
        estimate.check(1.0, 1, 4, pending + pending, queue_size=4, active_jobs=100)
    assert str(full.value) == "model 'm' has 4 requests waiting" and not isinstance(full.value, WouldMissDeadline)


def test_calibration_picks_the_encoder_batch_with_the_lowest_time_per_image(encoder):
    clock = FakeClock()
    # fake encoder cost per call: 1.0 s/image alone, 0.8 at 2, 1.5 at 4 (a large batch leaving the cache)
    runtime, encoded = slow_runtime(encoder, clock, step_s=0.0, encode_s={1: 1.0, 2: 1.6, 4: 6.0})
    metrics = Metrics()
    batcher = Batcher(runtime, max_batch=4, queue_size=16, max_rows=64, clock=clock, metrics=metrics)
    batcher.start()
    prepared = runtime.prepare(random_images(1, seed=6)[0])

    async def scenario():
        await batcher.calibrate(prepared, 1, [1, 2, 4], max_len=2, timeout_s=60)
        assert batcher.encode_batch == 2
        assert metrics.encode_batch.labels(runtime.name)._value.get() == 2  # the gauge says what was chosen
        encoded.clear()
        with batcher._wake:  # four requests arriving together: admitted together, encoded two by two
            jobs = [batcher.submit(prepared, 1, 2, 60) for _ in range(4)]
        await asyncio.gather(*(job.future for job in jobs))
        assert encoded == [2, 2]
        # calibrated again, each size is still one batch, not the chunks of the encoder batch chosen before
        encoded.clear()
        await batcher.calibrate(prepared, 1, [4], max_len=2, timeout_s=60)
        assert encoded == [4, 4] and batcher.encode_batch == 4
        await batcher.stop()

    run_bounded(scenario())


@pytest.mark.parametrize("four_images_s, chosen", [(4.1, 4), (4.28, 2)], ids=["2.5 % slower", "7 % slower"])
def test_calibration_prefers_the_larger_batch_among_near_ties_only(encoder, four_images_s, chosen):
    """Within ``ENCODE_TOLERANCE`` of the lowest time per image a larger batch wins: it also shares per-call costs,
    and a near tie is measurement noise. The tolerance is the 5 % that docs/decisions.md and
    docs/benchmarks/encoder-without-vnni.md state: a batch 7 % slower per image is a real cost, and the smaller
    batch is kept."""
    clock = FakeClock()
    # per image: 1.0 s alone, 1.0 at 2, 1.025 or 1.07 at 4
    runtime, _ = slow_runtime(encoder, clock, step_s=0.0, encode_s={1: 1.0, 2: 2.0, 4: four_images_s})
    batcher = Batcher(runtime, max_batch=4, queue_size=16, max_rows=64, clock=clock)
    batcher.start()
    prepared = runtime.prepare(random_images(1, seed=6)[0])

    async def scenario():
        try:
            await batcher.calibrate(prepared, 1, [1, 2, 4], max_len=2, timeout_s=60)
        finally:
            await batcher.stop()

    run_bounded(scenario())
    assert batcher.encode_batch == chosen


def _failing_on_begin(runtime, calls: int):
    """``runtime`` with its ``calls``-th encoding (1-based) raising, as an encoder that runs out of memory would."""
    begin, count = runtime.begin, []

    def failing(batch, widths):
        count.append(len(batch))
        if len(count) == calls:
            raise RuntimeError("the encoder failed")
        return begin(batch, widths)

    runtime.begin = failing
    return runtime


@pytest.mark.parametrize("failing_call", [1, 4])  # before any step is measured; in the timed round (sizes 1, 2)
def test_a_failed_calibration_leaves_the_batcher_measuring_as_before(encoder, failing_call):
    """A warm-up that fails must not leave the batcher without the step time it had, deaf to caption lengths, or
    timing every encoding from then on."""
    clock = FakeClock()
    runtime = _failing_on_begin(slow_runtime(encoder, clock, step_s=1.0)[0], failing_call)
    batcher = Batcher(runtime, max_batch=2, queue_size=16, max_rows=64, clock=clock)
    batcher.admission.restore_rate((0.5, 4.0))
    prepared = runtime.prepare(random_images(1, seed=6)[0])

    async def scenario():
        batcher.start()
        try:
            with pytest.raises(RuntimeError, match="the encoder failed"):
                await batcher.calibrate(prepared, 1, [1, 2], max_len=2, timeout_s=60, calibrate_len=5)
            if failing_call == 1:  # nothing measured: the estimate it had before
                assert (batcher.admission.step_time_s, batcher.admission.rows_per_step) == (0.5, 4.0)
            assert batcher._encode_timings is None
            assert batcher.submit(prepared, 1, 2, 60).typical_length
        finally:
            await batcher.stop()

    run_bounded(scenario())


def test_the_estimate_counts_the_new_requests_own_encoding(encoder):
    clock = FakeClock()
    runtime, _ = slow_runtime(encoder, clock, step_s=0.1, encode_s={1: 0.5})
    runtime.never_emitted = (*runtime.never_emitted, runtime.eos_id)  # captions run to their length limit
    batcher = Batcher(runtime, max_batch=4, queue_size=16, max_rows=64, clock=clock)
    batcher.start(worker=False)
    prepared = runtime.prepare(random_images(1, seed=5)[0])

    async def scenario():
        await _finish(batcher, batcher.submit(prepared, 1, 6, 1000))
        estimate = batcher.admission
        assert estimate.encode_time_s == 0.5
        # alone on an idle model: its 6 steps at the measured step time, after its image is encoded
        assert batcher.expected_wait_s(1, 6) == pytest.approx(6 * estimate.step_time_s + 0.5)

    run_bounded(scenario())


def test_calibration_learns_caption_lengths_from_its_calibration_request_only(encoder):
    """The timed rounds decode two steps: a caption length learnt from them would make admission control expect
    every request to be many times shorter than it is."""
    clock = FakeClock()
    runtime, _ = slow_runtime(encoder, clock, step_s=1.0)
    runtime.never_emitted = (*runtime.never_emitted, runtime.eos_id)  # every caption runs to its length limit
    prepared = runtime.prepare(random_images(1, seed=6)[0])

    async def warm(calibrate_len):
        batcher = Batcher(runtime, max_batch=2, queue_size=16, max_rows=64, clock=clock)
        batcher.start()
        await batcher.calibrate(prepared, 3, [1, 2], max_len=2, timeout_s=60, calibrate_len=calibrate_len)
        await batcher.stop()
        return batcher

    plain, calibrated = run_bounded(warm(None)), run_bounded(warm(7))
    assert plain.admission.steps_per_request is None
    assert calibrated.admission.steps_per_request == 7
    # alone, a 7-step request is expected to take its 7 steps at the measured step time (1 s of fake time each)
    assert calibrated.expected_wait_s(3, 7) == pytest.approx(7.0)


def test_the_calibration_requests_step_time_is_measured_afresh_not_averaged_with_the_timed_rounds(encoder):
    """Where a step costs more with more rows, the timed rounds' steps (two requests of three beams) are slower than
    a lone request's: averaged in, they would make admission control expect a lone request to be slower than it is."""
    clock = FakeClock()
    runtime, _ = slow_runtime(encoder, clock, step_s=0.0, row_s=0.25)
    runtime.never_emitted = (*runtime.never_emitted, runtime.eos_id)  # every caption runs to its length limit
    prepared = runtime.prepare(random_images(1, seed=6)[0])

    async def warm(batch_sizes):
        batcher = Batcher(runtime, max_batch=2, queue_size=16, max_rows=64, clock=clock)
        batcher.start()
        await batcher.calibrate(prepared, 3, batch_sizes, max_len=2, timeout_s=60, calibrate_len=7)
        await batcher.stop()
        return batcher.admission

    alone, calibrated = run_bounded(warm([])), run_bounded(warm([1, 2]))
    assert alone.step_time_s is not None
    assert (calibrated.step_time_s, calibrated.rows_per_step) == (alone.step_time_s, alone.rows_per_step)


def test_a_calibration_size_is_queued_under_the_workers_lock_so_the_worker_takes_it_whole(encoder):
    """Between two of a size's requests the worker must not be able to take the first: that size would be encoded
    in pieces and timed as a smaller batch.  Whether it could depends on thread timing, so the test asks instead
    whether the lock the worker takes work under is still held when each request has been queued."""
    clock = FakeClock()
    runtime, encoded = slow_runtime(encoder, clock, step_s=0.0)
    batcher = Batcher(runtime, max_batch=4, queue_size=16, max_rows=64, clock=clock)
    prepared = runtime.prepare(random_images(1, seed=6)[0])
    submit, held_after = batcher.submit, []

    def submit_and_look(*args, **kwargs):
        job = submit(*args, **kwargs)
        held_after.append(batcher._wake._is_owned())  # by this thread: the condition's lock is an RLock
        return job

    batcher.submit = submit_and_look

    async def scenario():
        batcher.start()
        try:
            await batcher.calibrate(prepared, 1, [1, 3], max_len=2, timeout_s=60)
        finally:
            await batcher.stop()

    run_bounded(scenario())
    assert held_after == [True] * 8  # two rounds of 1 + 3 requests
    assert encoded == [1, 3, 1, 3]


def test_warm_up_runs_each_power_of_the_factor_below_the_largest_encoder_batch_and_the_largest_once():
    assert warmup_sizes(1) == [1]
    assert warmup_sizes(4) == [1, 2, 4]
    assert warmup_sizes(6) == [1, 2, 4, 6]
    assert warmup_sizes(16, 4) == [1, 4, 16]
    assert warmup_sizes(8, 4) == [1, 4, 8]
    assert warmup_sizes(4, 4) == [1, 4]


@pytest.mark.parametrize("pads", [True, False])
@pytest.mark.parametrize(("limits", "padded_sizes", "unpadded_sizes"), [
    (dict(max_batch_images=16, max_rows=64, queue_size=64), [1, 2, 4, 8, 16], [1, 4, 16]),
    (dict(max_batch_images=16, max_rows=13, queue_size=64), [1, 2, 4], [1, 4]),  # 13 rows hold 4 beams of 3
    (dict(max_batch_images=2, max_rows=64, queue_size=64), [1, 2], [1, 2]),
    (dict(max_batch_images=16, max_rows=64, queue_size=3), [1, 2, 3], [1, 3]),
    (dict(max_batch_images=16, max_rows=5, queue_size=64, max_beam_size=5), [1], [1]),  # one beam of 3 fits
])
def test_warm_up_requests_are_shaped_by_the_settings_and_never_larger_than_the_worker_encodes(
        encoder, limits, padded_sizes, unpadded_sizes, pads):
    """Warm-up pays first-use costs for the batches the worker will encode: the default beam and caption length,
    and encoder batches up to the most images the rows, the batch limit and the queue let it take at once; under
    the warm-up's own deadline, not a request's (a tiny CAPTIONER_REQUEST_TIMEOUT_S must not fail the start).  A
    runtime that pads its CNN batches to powers of two (a GPU's) is warmed at each of them; one that does not (a
    CPU's), at every other one."""
    calls = []

    async def calibrate(_prepared, beam_size, batch_sizes, **options):
        calls.append((beam_size, batch_sizes, options))

    runtime = runtime_for("sat", encoder)
    runtime.pad_batches = pads
    sizes = padded_sizes if pads else unpadded_sizes
    settings = Settings(default_beam_size=3, default_max_len=7, request_timeout_s=0.01, **limits)
    run_bounded(warm_up(types.SimpleNamespace(runtime=runtime, calibrate=calibrate), settings))
    assert calls == [(3, sizes, dict(timeout_s=WARMUP_TIMEOUT_S, calibrate_len=7))]


def test_the_worker_reports_idle_once_it_runs_out_of_work(encoder):
    runtime = runtime_for("sat", encoder)
    idle = []
    batcher = Batcher(runtime, max_batch=2, queue_size=8, max_rows=16, on_idle=lambda: idle.append(batcher.idle))
    prepared = runtime.prepare(random_images(1)[0])

    async def scenario():
        batcher.start()
        await asyncio.sleep(0.05)
        assert idle == []  # nothing done yet: nothing to give back
        await asyncio.gather(*(batcher.caption(prepared, 2, 5, 60) for _ in range(3)))
        for _ in range(200):
            if idle:
                break
            await asyncio.sleep(0.01)
        await batcher.stop()

    run_bounded(scenario())
    assert idle == [True]  # once per stretch of work, when the queue and the tables are empty


@pytest.mark.parametrize("precision", ["bfloat16"])
def test_lower_precision_runs_through_the_batcher_with_float32_scores(encoder, precision):
    """CAPTIONER_PRECISION: autocast changes the network's arithmetic, not the search: log-probs and attention
    reach beam search in float32, batched answers equal the same runtime's fixed-batch answers, and the captions
    are valid (same vocabulary, attention rows summing to one)."""
    ckpt = tiny_checkpoint("sat")
    runtime = TorchRuntime("sat", ckpt, encoder, torch.device("cpu"), precision=precision)
    images = [runtime.prepare(image) for image in random_images(3, seed=8)]
    batcher = Batcher(runtime, max_batch=2, queue_size=8, max_rows=64)
    batcher.start(worker=False)
    results = run_bounded(drive(batcher, [(0, images[0], 3, 6), (1, images[1], 2, 5), (2, images[2], 3, 7)]))
    for prepared, beam, max_len, got in zip(images, (3, 2, 3), (6, 5, 7), results):
        want = runtime.caption([prepared], beam, max_len)[0]
        assert got.words == want.words
        attention = got.hypothesis.attention
        assert attention.dtype == torch.float32 and torch.allclose(attention.sum(-1), torch.ones(1), atol=1e-2)
    with pytest.raises(ValueError, match="precision"):
        TorchRuntime("sat", ckpt, encoder, torch.device("cpu"), precision="int4")


def test_a_lower_precision_step_hands_the_search_float32_log_probs(encoder):
    """The log-probs beam search accumulates stay float32 under autocast (``TorchRuntime``'s docstring): summed
    in bfloat16, with its 8-bit mantissa, a caption's score would lose its later words' log-probs."""
    runtime = TorchRuntime("sat", tiny_checkpoint("sat"), encoder, torch.device("cpu"), precision="bfloat16")
    enc, state = runtime.begin([runtime.prepare(random_images(1, seed=8)[0])], [2])
    logprobs, _, attn = runtime.step(torch.full((2,), runtime.bos_id), state, enc)
    assert logprobs.dtype == attn.primary.dtype == torch.float32


def test_a_lower_precision_step_hands_the_search_float32_extras(encoder):
    """An area model's ``areas`` extra, like its attention, reaches the search and the result in float32 under
    autocast: the ``area_topk`` rendering and the answer's weights read it as the float32 the docstring promises."""
    runtime = TorchRuntime("area", tiny_checkpoint("area-transformer"), encoder, torch.device("cpu"),
                           precision="bfloat16")
    enc, state = runtime.begin([runtime.prepare(random_images(1, seed=8)[0])], [2])
    _, _, attn = runtime.step(torch.full((2,), runtime.bos_id), state, enc)
    assert attn.extras and {name: extra.dtype for name, extra in attn.extras.items()} == dict.fromkeys(
        attn.extras, torch.float32)


def test_fill_holes_moves_only_the_blocks_past_the_new_end():
    # beam 3 everywhere; the job at rows 3-5 left: the last job moves into its place, the others stay
    assert fill_holes([(0, 3), (6, 3), (9, 3)]) == [(0, 0), (2, 3), (1, 6)]
    # the first job left
    assert fill_holes([(3, 3), (6, 3), (9, 3)]) == [(2, 0), (0, 3), (1, 6)]
    assert fill_holes([(0, 2), (2, 4)]) == [(0, 0), (1, 2)]  # nothing left before the end: nothing moves
    assert fill_holes([(0, 1), (2, 1), (4, 2)]) is None  # a block of 2 cannot fill two holes of 1


@pytest.mark.parametrize("seed", range(60))
def test_fill_holes_tiles_the_compacted_rows_or_declines(seed):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 5 if seed % 2 else 2, rng.integers(1, 12)) * (1 if seed % 2 else 3)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    staying = [(int(o), int(s)) for o, s in zip(offsets, sizes) if rng.random() < 0.6]
    placed = fill_holes(staying)
    if seed % 2 == 0:
        assert placed is not None  # equal widths always fit
    if placed is None:
        return
    total = sum(size for _, size in staying)
    assert sorted(i for i, _ in placed) == list(range(len(staying)))
    cursor = 0
    for i, new in placed:  # in new order, tiling [0, total) without gaps
        assert new == cursor
        cursor += staying[i][1]
        old, size = staying[i]
        if old + size <= total:
            assert new == old  # blocks inside the compacted length keep their rows
    assert cursor == total


def test_a_job_whose_event_loop_has_closed_is_resolved_without_an_error():
    """A library user's ``asyncio.run`` can end while one of its requests still decodes on the worker thread, so its
    result has no loop left to go to. Resolving it must not raise: the worker thread resolves it, and would die there
    (and again in its failure handler, which resolves every job in flight), leaving later requests unanswered."""
    loop = asyncio.new_event_loop()
    future = loop.create_future()
    loop.close()
    job = Job(prepared=None, beam_size=1, max_len=5, deadline=math.inf, loop=loop, future=future)
    job.resolve("a caption")
    job.resolve(error=RuntimeError("the step failed"))
    assert not future.done()


def test_a_job_resolved_again_or_after_its_caller_left_keeps_its_first_outcome_and_logs_no_loop_error():
    """The worker may resolve a job whose future is already done: its caller left (the request's task cancelled, and
    the future with it) before a failing step resolves every job in flight, or a result went out before the
    bookkeeping failed. The first outcome stands, and the event loop meets no ``InvalidStateError`` in the callback
    (which asyncio logs at ERROR as "Exception in callback")."""
    async def scenario() -> tuple[list[dict], asyncio.Future, asyncio.Future]:
        loop = asyncio.get_running_loop()
        errors = []
        loop.set_exception_handler(lambda _, context: errors.append(context))
        answered, left = loop.create_future(), loop.create_future()
        left.cancel()  # its caller went away
        for future in (answered, left):
            job = Job(prepared=None, beam_size=1, max_len=5, deadline=math.inf, loop=loop, future=future)
            job.resolve("a caption")
            job.resolve(error=RuntimeError("the step failed"))
        for _ in range(3):
            await asyncio.sleep(0)  # the callbacks run
        return errors, answered, left

    errors, answered, left = asyncio.run(scenario())
    assert errors == [] and answered.result() == "a caption" and left.cancelled()


def test_the_encoder_buffers_double_as_jobs_join_one_by_one():
    """The rows of joining jobs are written into encoder buffers with room to grow, which double when full: 31 jobs
    of one row joining a one-row table one at a time reallocate them 5 times (to 2, 4, 8, 16 and 32 rows), each row
    copied O(1) times on average, not at every admission (the whole table's image features copied per boundary)
    nor when the new rows fit exactly; every row keeps its features."""
    def job() -> Job:
        return Job(prepared=None, beam_size=1, max_len=5, deadline=0.0, loop=None, future=None)

    def buffer_rows(table: RowTable) -> tuple[int, int]:
        # the table's features are a view of the first rows of its buffer: the storage under the view is the buffer
        storage = table.enc["feats"].untyped_storage()
        return storage.data_ptr(), storage.nbytes() // (3 * 4)

    table = RowTable([job()], {"feats": torch.zeros(1, 3)}, {"h": torch.zeros(1, 2)}, bos_id=1)
    buffers = [buffer_rows(table)]
    for i in range(1, 32):
        table.add([job()], {"feats": torch.full((1, 3), float(i))}, {"h": torch.zeros(1, 2)}, bos_id=1)
        if buffer_rows(table)[0] != buffers[-1][0]:
            buffers.append(buffer_rows(table))
    assert [rows for _, rows in buffers] == [1, 2, 4, 8, 16, 32]
    assert torch.equal(table.enc["feats"], torch.arange(32.0)[:, None].expand(32, 3))


def test_rows_share_a_table_only_when_their_tensors_agree_in_shape_past_the_row_axis_and_in_dtype():
    """The row count may differ (rows of any number of jobs join one table), but a tensor of another dtype may not:
    ``torch.cat`` would promote the table's state in silence rather than refuse."""
    def signature(rows: int, feats_dtype=torch.float32, state_width: int = 2) -> tuple:
        return RowTable.signature({"feats": torch.zeros(rows, 3, dtype=feats_dtype)},
                                  {"h": torch.zeros(rows, state_width)})

    assert signature(1) == signature(7)
    assert signature(1) != signature(1, feats_dtype=torch.float16)
    assert signature(1) != signature(1, state_width=3)


def test_begin_and_step_called_outside_inference_mode_run_inside_one(encoder):
    """The batcher's worker runs every step inside ``torch.inference_mode()`` and the runtime opens none there
    (``in_inference_mode``); any other caller of ``begin`` and ``step`` (a benchmark, a library user) still gets one
    around the call: no autograd graph over the encoder's features and the decoder's states, whose tensors are
    inference tensors."""
    runtime = runtime_for("sat", encoder)
    assert not torch.is_inference_mode_enabled()
    enc, state = runtime.begin([runtime.prepare(random_images(1)[0])], [2])
    logprobs, state, attn = runtime.step(torch.full((2,), runtime.bos_id), state, enc)
    assert all(tensor.is_inference() for tensor in (*enc.values(), *state.values(), logprobs, attn.primary))


def test_a_leaving_jobs_rows_are_filled_by_whole_blocks_never_selected_row_by_row(encoder, monkeypatch):
    runtime = runtime_for("sat", encoder)
    images = [runtime.prepare(image) for image in random_images(5, seed=4)]
    batcher = Batcher(runtime, max_batch=8, queue_size=8, max_rows=64)
    batcher.start(worker=False)
    # equal beams, the second request shortest: it leaves first and the last request's rows take its place
    schedule = [(0, images[0], 3, 9), (0, images[1], 3, 2), (0, images[2], 3, 9), (0, images[3], 3, 9),
                (0, images[4], 3, 9)]
    selections = []

    def index_rows(state, index):
        selections.append(index)
        return state

    monkeypatch.setattr(row_table_module, "index_rows", index_rows)
    results = run_bounded(drive(batcher, schedule))
    assert selections == []  # the encoder state was never selected row by row, only the moved blocks copied
    for (_, prepared, beam, max_len), got in zip(schedule, results):
        assert_same_result(got, solo(runtime, prepared, beam, max_len))


def test_a_leaving_job_costs_a_copy_of_the_rows_that_move_and_no_others(monkeypatch):
    """Four jobs of two rows each and the second leaves: only the last job's rows are written, into the hole it
    left (rows 2-3); the first and third keep their rows and are not copied onto themselves (a quarter of a
    96-row step, under load at almost every boundary)."""
    jobs = [_estimate_job(2, 5) for _ in range(4)]
    table = RowTable(jobs, {"feats": torch.arange(8.0)[:, None]}, {"h": torch.zeros(8, 1)}, bos_id=1)
    written, index_copy = [], torch.Tensor.index_copy_

    def noting_copy(buffer, dim, index, source):
        written.append(index.tolist())
        return index_copy(buffer, dim, index, source)

    monkeypatch.setattr(torch.Tensor, "index_copy_", noting_copy)
    table.remove({jobs[1]}, types.SimpleNamespace(reorder=index_rows))
    assert written == [[2, 3]]
    assert table.jobs == [jobs[0], jobs[3], jobs[2]] and table.enc["feats"][:, 0].tolist() == [0, 1, 6, 7, 4, 5]


def test_a_step_finishes_the_jobs_whose_beams_all_ended_or_that_ran_their_length_but_not_a_cancelled_one(encoder):
    """A job cancelled while a step ran leaves as cancelled (its rows freed under that reason at the boundary), not
    as finished: nothing collects a result nobody waits for."""
    runtime = runtime_for("sat", encoder)
    prepared = runtime.prepare(random_images(1, seed=5)[0])
    jobs = [Job(prepared, 2, max_len, math.inf, None, None) for max_len in (8, 8, 2, 2)]
    with torch.inference_mode():
        enc, state = runtime.begin([prepared] * len(jobs), [2] * len(jobs))
        table = RowTable(jobs, enc, state, runtime.bos_id)
        table.step(runtime)
        table.step(runtime)
    jobs[3].cancelled = True
    assert table.finished_jobs([True, False, False, True]) == [jobs[0], jobs[2]]
    assert table.finished_jobs([False, False, False, False]) == [jobs[2]]


def test_jobs_that_leave_in_two_removals_at_one_boundary_keep_the_others_histories(encoder):
    """At one step boundary the batcher can drop rows twice (the jobs that finished, then those cancelled or expired
    meanwhile) before the next step: the rows moved by the second removal must continue the rows the first one
    moved there, so every job still decoding gets the caption it gets alone."""
    runtime = runtime_for("sat", encoder)
    prepared = [runtime.prepare(image) for image in random_images(5, seed=5)]
    jobs = [Job(p, 2, 8, math.inf, None, None) for p in prepared]
    results = {}
    with torch.inference_mode():  # as in the batcher's worker: its buffers are written in place
        enc, state = runtime.begin(prepared, [2] * len(jobs))
        table = RowTable(jobs, enc, state, runtime.bos_id)
        table.step(runtime)
        table.step(runtime)
        table.remove({jobs[0]}, runtime)  # the last job's rows move into the first one's
        table.remove({jobs[1]}, runtime)  # and the fourth's into the second's
        assert table.jobs == [jobs[4], jobs[3], jobs[2]]
        while table.jobs:
            finished = table.finished_jobs(table.step(runtime))
            if finished:
                results.update(zip(finished, table.results_of(finished, runtime)))
                table.remove(set(finished), runtime)
    for job in jobs[2:]:
        assert_same_result(results[job], solo(runtime, job.prepared, 2, 8))


def test_a_table_that_never_empties_keeps_only_the_steps_its_remaining_jobs_took_part_in(encoder):
    """Under steady load a table may never empty: each step's record (its tokens, back-pointers and attention over
    every row) goes once no job left in the table took part in it, or a server's memory grows with every step it
    runs. The job that stays still gets the caption it gets alone."""
    runtime = runtime_for("sat", encoder)
    prepared = [runtime.prepare(image) for image in random_images(2, seed=6)]
    first, second = (Job(p, 2, 8, math.inf, None, None) for p in prepared)
    with torch.inference_mode():  # as in the batcher's worker: its buffers are written in place
        table = RowTable([first], *runtime.begin(prepared[:1], [2]), runtime.bos_id)
        for _ in range(3):
            table.step(runtime)
        table.add([second], *runtime.begin(prepared[1:], [2]), runtime.bos_id)  # it takes part from record 3 on
        table.step(runtime)
        table.remove({first}, runtime)
        assert (table.records_base, len(table.records)) == (3, 1)
        while not (finished := table.finished_jobs(table.step(runtime))):
            pass
        (result,) = table.results_of(finished, runtime)
    assert finished == [second]
    assert_same_result(result, solo(runtime, second.prepared, 2, 8))


def test_a_batcher_built_without_settings_has_the_servers_defaults():
    # a library user's Batcher(runtime) batches, queues and overlaps as `captioner serve` does by default
    parameters = inspect.signature(Batcher).parameters
    fields = Settings.model_fields
    for argument, setting in (("max_batch", "max_batch_images"), ("queue_size", "queue_size"),
                              ("max_rows", "max_rows"), ("overlap_encoding", "overlap_encoding")):
        assert parameters[argument].default == fields[setting].default, argument


def test_one_row_one_image_and_one_waiting_request_are_budgets_a_batcher_accepts_and_zero_is_refused(encoder):
    """The settings allow ``max_rows``, ``max_batch_images`` and ``queue_size`` of 1 (a beam-1 service on the
    smallest machine); a batcher must caption with them, and refuse a budget of 0, which could never admit anyone."""
    runtime = runtime_for("sat", encoder)
    prepared = runtime.prepare(random_images(1)[0])
    for budgets in (dict(max_rows=0), dict(max_batch=0), dict(queue_size=0)):
        with pytest.raises(ValueError, match="must be positive"):
            Batcher(runtime, **{"max_rows": 1, "max_batch": 1, "queue_size": 1, **budgets})
    batcher = Batcher(runtime, max_batch=1, queue_size=1, max_rows=1)
    batcher.start(worker=False)

    async def scenario():
        return await _finish(batcher, batcher.submit(prepared, 1, 5, 60))

    assert_same_result(run_bounded(scenario()), solo(runtime, prepared, 1, 5))


def _held_encodings(runtime, held) -> tuple[threading.Event, threading.Event]:
    """Hold the encoding of image ``held`` until the first event is set (5 s at most, so that a worker that waits for
    it goes on and the test fails on what it checks); the second is set once that encoding is done."""
    begin = runtime.begin
    release, encoded = threading.Event(), threading.Event()

    def held_begin(batch, widths):
        if not any(prepared is held for prepared in batch):
            return begin(batch, widths)
        release.wait(5)
        try:
            return begin(batch, widths)
        finally:
            encoded.set()

    runtime.begin = held_begin
    return release, encoded


def test_an_idle_worker_waits_for_the_oldest_encoding_only_and_decodes_on_while_the_next_is_encoded(encoder):
    """With the encoder thread (``overlap_encoding``), a boundary with nothing to decode waits for the oldest
    encoding (not spinning, not stepping an empty table), then decodes its rows at once without waiting for the
    chunks encoded after it; and later boundaries step on while an image is still being encoded."""
    runtime = runtime_for("sat", encoder)
    runtime.never_emitted = (*runtime.never_emitted, runtime.eos_id)  # captions run to their length limit
    stepped = count_step_rows(runtime)
    images = [runtime.prepare(image) for image in random_images(2, seed=12)]
    release, encoded = _held_encodings(runtime, images[1])
    batcher = Batcher(runtime, max_batch=2, queue_size=8, max_rows=16)
    batcher.encode_batch = 1  # the two admitted together are encoded one by one: two chunks

    async def scenario():
        jobs = [batcher.submit(images[0], 2, 6, 60), batcher.submit(images[1], 1, 6, 60)]
        batcher.run_once()
        assert stepped == [2] and not encoded.is_set()  # the first image's rows decode; the second is held
        batcher.run_once()
        assert stepped == [2, 2] and not encoded.is_set()
        release.set()
        while not batcher.idle:
            batcher.run_once()
        await asyncio.sleep(0)
        return [await job.future for job in jobs]

    with _driven_with_an_encoder_thread(batcher, release):
        results = run_bounded(scenario())
    for prepared, beam, got in zip(images, (2, 1), results):
        assert_same_result(got, solo(runtime, prepared, beam, 6))


def test_the_encoder_keeps_one_chunk_queued_behind_the_one_it_encodes_and_no_more(encoder):
    """A request admitted while an image is encoded is queued for the encoder behind it, so that the encoder
    thread never idles until the worker's next boundary; a third chunk waits in the queue (it could start no
    sooner, and admitted early it would hold rows and escape the queue's shedding)."""
    runtime = runtime_for("sat", encoder)
    runtime.never_emitted = (*runtime.never_emitted, runtime.eos_id)
    images = [runtime.prepare(image) for image in random_images(4, seed=13)]
    release, _ = _held_encodings(runtime, images[1])
    batcher = Batcher(runtime, max_batch=1, queue_size=8, max_rows=16)  # one request admitted per boundary

    async def scenario():
        first = batcher.submit(images[0], 1, 8, 60)
        batcher.run_once()  # encoded, waited for (nothing else to decode), decoding
        later = [batcher.submit(prepared, 1, 3, 60) for prepared in images[1:]]
        batcher.run_once()  # the second is admitted; its encoding is held
        assert batcher.queued == 2
        batcher.run_once()  # the third is admitted and queued for the encoder behind it
        assert batcher.queued == 1
        batcher.run_once()  # two chunks at the encoder: the fourth waits
        assert batcher.queued == 1
        release.set()
        while not batcher.idle:
            batcher.run_once()
        await asyncio.sleep(0)
        return [await job.future for job in (first, *later)]

    with _driven_with_an_encoder_thread(batcher, release):
        results = run_bounded(scenario())
    for prepared, max_len, got in zip(images, (8, 3, 3, 3), results):
        assert_same_result(got, solo(runtime, prepared, 1, max_len))


def test_requests_leaving_the_queue_count_as_decoding_before_they_reach_the_encoder(encoder):
    """Between leaving the queue and being handed to the encoder, admitted requests are neither waiting nor in a
    table: admission control must count them as decoding all along, or a request arriving in that window would
    find the model idle and be let in whatever the estimate says."""
    runtime = runtime_for("sat", encoder)
    counted: list[int] = []

    class Watching(Metrics):
        def observe_queue(self, model, seconds):  # called for each admitted request, before its encoding
            counted.append(batcher.active_jobs)
            super().observe_queue(model, seconds)

    batcher = Batcher(runtime, max_batch=4, queue_size=8, max_rows=16, metrics=Watching())
    batcher.start(worker=False)
    prepared = [runtime.prepare(image) for image in random_images(3, seed=14)]

    async def scenario():
        running = batcher.submit(prepared[0], 2, 8, 60)
        batcher.run_once()
        jobs = [batcher.submit(p, 2, 8, 60) for p in prepared[1:]]
        batcher.run_once()
        await asyncio.sleep(0)
        return [await _finish(batcher, job) for job in (running, *jobs)]

    run_bounded(scenario())
    assert counted == [1, 3, 3]  # the one decoding and the two being admitted


def test_requests_whose_images_are_being_encoded_count_as_decoding_until_they_join_a_table(encoder):
    """With the encoder thread, an admitted request whose image is still being encoded is neither waiting nor in a
    table: every boundary's recount must keep counting it as decoding (``active_jobs``, and the work admission
    control expects), or a request arriving while a slow image is encoded would be judged against too little work."""
    runtime = runtime_for("sat", encoder)
    runtime.never_emitted = (*runtime.never_emitted, runtime.eos_id)  # the first caption runs to its length limit
    images = [runtime.prepare(image) for image in random_images(2, seed=15)]
    release, encoded = _held_encodings(runtime, images[1])
    batcher = Batcher(runtime, max_batch=4, queue_size=8, max_rows=16)

    async def scenario():
        first = batcher.submit(images[0], 1, 8, 60)
        batcher.run_once()  # encoded, waited for (nothing else to decode), decoding
        held = batcher.submit(images[1], 2, 3, 60)
        batcher.run_once()  # admitted; its encoding is held while the first decodes on
        during = batcher.active_jobs, encoded.is_set()
        batcher.run_once()  # a boundary with the encoding still held recounts the same
        during_next = batcher.active_jobs, encoded.is_set()
        release.set()
        while not batcher.idle:
            batcher.run_once()
        await asyncio.sleep(0)
        await asyncio.gather(first.future, held.future)
        return during, during_next

    with _driven_with_an_encoder_thread(batcher, release):
        during, during_next = run_bounded(scenario())
    assert during == (2, False) and during_next == (2, False)
    assert batcher.active_jobs == 0


def test_an_encodings_time_includes_the_wait_for_the_device(encoder):
    """On a GPU ``begin`` only queues kernels: the encoding's cost shows once the device is synchronised, and
    admission control must learn that cost (without the wait, encodings would look nearly free)."""
    clock = FakeClock()
    runtime, _ = slow_runtime(encoder, clock, step_s=0.1)

    def device_wait():  # what a CUDA device's synchronize costs after an encoding's kernels were queued
        clock.now += 0.5

    runtime.synchronize = device_wait
    batcher = Batcher(runtime, max_batch=4, queue_size=16, max_rows=64, clock=clock)
    batcher.start(worker=False)
    prepared = runtime.prepare(random_images(1, seed=5)[0])

    async def scenario():
        await _finish(batcher, batcher.submit(prepared, 1, 6, 1000))

    run_bounded(scenario())
    assert batcher.admission.encode_time_s == 0.5


def test_a_failed_steps_requests_leave_with_it_whether_decoding_or_being_encoded(encoder):
    """A step that raises fails the requests decoding and those whose images are being encoded: their rows are
    neither decoded again nor joined to a table when the encoding ends, and never counted as freed by a client
    that left (they have their error already)."""
    runtime = runtime_for("sat", encoder)
    runtime.never_emitted = (*runtime.never_emitted, runtime.eos_id)  # the first request decodes until the failure
    stepped = count_step_rows(runtime)
    images = [runtime.prepare(image) for image in random_images(3, seed=15)]
    release, _ = _held_encodings(runtime, images[1])
    holding = threading.Event()
    held_begin, counted_step, failed_at = runtime.begin, runtime.step, []

    def noting_begin(batch, widths):
        if any(prepared is images[1] for prepared in batch):
            holding.set()
        return held_begin(batch, widths)

    def failing_once_held(*args):
        if holding.is_set() and not failed_at:  # the second image is being encoded: this step fails
            failed_at.append(len(stepped))
            raise RuntimeError("a broken kernel")
        return counted_step(*args)

    runtime.begin, runtime.step = noting_begin, failing_once_held
    metrics = Metrics()
    batcher = Batcher(runtime, max_batch=1, queue_size=8, max_rows=16, metrics=metrics)

    async def scenario():
        batcher.start()
        try:
            decoding = asyncio.ensure_future(batcher.caption(images[0], 2, 60, 60))
            while not stepped:
                await asyncio.sleep(0.001)
            encoding = asyncio.ensure_future(batcher.caption(images[1], 3, 60, 60))
            for job in (decoding, encoding):
                with pytest.raises(RuntimeError, match="a broken kernel"):
                    await job
            release.set()
            return await batcher.caption(images[2], 1, 4, 60)
        finally:
            release.set()
            await batcher.stop(10)

    later = run_bounded(scenario())
    assert later.words == solo(runtime, images[2], 1, 4).words
    assert failed_at and set(stepped[failed_at[0]:]) == {1}, stepped  # only the later request's row decoded since
    assert metrics.freed.labels("sat", "cancelled")._value.get() == 0
    assert metrics.freed.labels("sat", "finished")._value.get() == 1


def test_run_once_refuses_a_batcher_whose_worker_thread_runs_the_steps(encoder):
    """Two threads stepping one batcher would run its tables at once: ``run_once`` is for ``start(worker=False)``."""
    batcher = Batcher(runtime_for("sat", encoder), max_batch=1, queue_size=8, max_rows=4)

    async def scenario():
        batcher.start()
        try:
            with pytest.raises(RuntimeError, match="without a worker thread"):
                batcher.run_once()
        finally:
            await batcher.stop(10)

    run_bounded(scenario())


@pytest.mark.parametrize("overlap", [True, False])
def test_images_are_encoded_in_the_encoder_thread_only_when_encoding_overlaps(encoder, overlap):
    """``overlap_encoding`` (CAPTIONER_OVERLAP_ENCODING): a worker encodes admitted images in a thread of its own,
    so that on a CPU the CNN and the decoding steps use two cores; without, the worker encodes them itself."""
    runtime = runtime_for("sat", encoder)
    threads: list[str] = []
    watch_encodes(runtime, lambda batch: threads.append(threading.current_thread().name))
    batcher = Batcher(runtime, max_batch=2, queue_size=8, max_rows=16, overlap_encoding=overlap)
    prepared = runtime.prepare(random_images(1)[0])

    async def scenario():
        batcher.start()
        try:
            await batcher.caption(prepared, 2, 4, 60)
        finally:
            await batcher.stop(10)

    run_bounded(scenario())
    assert [name.split("_")[0] for name in threads] == ["encoder-sat" if overlap else "batcher-sat"]


def test_a_worker_encodes_its_chunks_one_at_a_time_in_a_single_encoder_thread(encoder):
    """The encoder is one thread beside the worker (the CNN on one core, the steps on another): two chunks admitted
    at one boundary are encoded one after the other, never at once.  A second encoding thread would take a third
    core from a server sized for two, and calibration would time the encoder batches while they compete."""
    runtime = runtime_for("sat", encoder)
    images = [runtime.prepare(image) for image in random_images(2, seed=15)]
    begin, lock = runtime.begin, threading.Lock()
    inside, most_at_once, second_started = [0], [0], threading.Event()

    def counted_begin(batch, widths):
        with lock:
            inside[0] += 1
            most_at_once[0] = max(most_at_once[0], inside[0])
            if batch[0] is images[1]:
                second_started.set()
        try:
            if batch[0] is images[0]:  # held until the second chunk starts, or 1 s: long enough for a free thread
                second_started.wait(1)
            return begin(batch, widths)
        finally:
            with lock:
                inside[0] -= 1

    runtime.begin = counted_begin
    batcher = Batcher(runtime, max_batch=2, queue_size=8, max_rows=16)
    batcher.encode_batch = 1  # the two admitted together are two chunks

    async def scenario():
        batcher.start()
        try:
            with batcher._wake:  # the worker takes both at its first boundary
                jobs = [batcher.submit(prepared, 1, 3, 60) for prepared in images]
            return [await job.future for job in jobs]
        finally:
            await batcher.stop(10)

    results = run_bounded(scenario())
    assert most_at_once[0] == 1
    for prepared, got in zip(images, results):
        assert_same_result(got, solo(runtime, prepared, 1, 3))


def test_a_drain_that_finishes_ends_the_worker_without_waiting_out_its_timeout(encoder):
    """``stop()`` ends the worker as soon as the drained batcher is idle: a worker that waited for more work instead
    would hold every shutdown of the service for its whole drain timeout, then log that the drain timed out and
    failed the remaining requests, when none remained."""
    runtime = runtime_for("sat", encoder)
    prepared = runtime.prepare(random_images(1)[0])
    batcher = Batcher(runtime, max_batch=1, queue_size=8, max_rows=4)
    warnings = []

    class Kept(logging.Handler):
        def emit(self, record):
            warnings.append(record.getMessage())

    batcher_log, handler = logging.getLogger("captioner.batcher"), Kept(logging.WARNING)

    async def scenario():
        batcher.start()
        running = asyncio.ensure_future(batcher.caption(prepared, 1, 4, 60))
        await asyncio.sleep(0)
        await batcher.stop(10)
        return await running

    batcher_log.addHandler(handler)
    try:
        result = run_bounded(scenario())
    finally:
        batcher_log.removeHandler(handler)
    assert result.words == solo(runtime, prepared, 1, 4).words
    assert not [line for line in warnings if "drain timed out" in line]


def test_a_stopped_batcher_leaves_no_encoder_thread_behind_and_a_workerless_one_stops_too(encoder):
    """An app made and closed in a longer process (a test run, a library user) must not keep an idle encoder thread
    per model it served; and ``stop()`` on a batcher driven by ``run_once`` just stops taking requests."""
    runtime = runtime_for("sat", encoder)
    prepared = runtime.prepare(random_images(1)[0])
    batcher, workerless = (Batcher(runtime, max_batch=1, queue_size=8, max_rows=4) for _ in range(2))
    before = set(threading.enumerate())

    async def scenario():
        batcher.start()
        await batcher.caption(prepared, 1, 4, 60)
        await batcher.stop(10)
        workerless.start(worker=False)
        await workerless.stop()
        with pytest.raises(NotAccepting):
            workerless.submit(prepared, 1, 4, 60)

    run_bounded(scenario())
    started = [thread for thread in threading.enumerate() if thread not in before
               and thread.name.startswith(("batcher-sat", "encoder-sat"))]
    for thread in started:  # the worker is joined by stop(); the encoder thread ends soon after it
        thread.join(5)
    assert not [thread.name for thread in started if thread.is_alive()]


def test_the_queue_time_metric_is_the_wait_from_submission_to_admission(encoder):
    """``captioner_queue_time_seconds``: how long each request waited for rows, on the batcher's clock."""
    clock = FakeClock()
    metrics = Metrics()
    runtime = runtime_for("sat", encoder)
    batcher = Batcher(runtime, max_batch=4, queue_size=8, max_rows=16, metrics=metrics, clock=clock)
    batcher.start(worker=False)
    prepared = runtime.prepare(random_images(1)[0])

    async def scenario():
        job = batcher.submit(prepared, 1, 4, 60)
        clock.now += 2.5
        return await _finish(batcher, job)

    run_bounded(scenario())
    assert metrics.queue_time.labels("sat")._sum.get() == 2.5


def test_the_load_gauges_are_the_rows_decoding_and_the_requests_waiting_for_rows(encoder):
    """``captioner_active_rows`` and ``captioner_queued_requests`` (what docker/k8s/base/hpa.yaml scales on) are set
    at each boundary from the batcher's own counts, and are back at 0 once it is idle."""
    metrics = Metrics()
    runtime = runtime_for("sat", encoder)
    batcher = Batcher(runtime, max_batch=4, queue_size=8, max_rows=4, metrics=metrics)
    batcher.start(worker=False)
    prepared = [runtime.prepare(image) for image in random_images(2, seed=5)]

    def gauges() -> tuple[float, float]:
        return metrics.active_rows.labels("sat")._value.get(), metrics.queued.labels("sat")._value.get()

    async def scenario():
        jobs = [batcher.submit(one, 4, 30, 60) for one in prepared]
        batcher.run_once()
        batcher.run_once()
        assert (batcher.active_rows, batcher.queued) == (4, 1)  # no room for the second
        during = gauges()
        while not batcher.idle:
            batcher.run_once()
        await asyncio.gather(*(job.future for job in jobs))
        return during

    assert run_bounded(scenario()) == (4, 1)
    assert gauges() == (0, 0)


def _metered_drive(encoder, counter, seed, plan):
    """A SAT batcher with its own metrics, driven step by step through ``plan`` (one ``(arrival step, beam, length)``
    per random image): the metrics, and what ``counter`` noted of the runtime's calls."""
    metrics = Metrics()
    runtime = runtime_for("sat", encoder)
    noted = counter(runtime)
    batcher = Batcher(runtime, max_batch=2, queue_size=8, max_rows=16, metrics=metrics)
    batcher.start(worker=False)
    images = [runtime.prepare(image) for image in random_images(len(plan), seed=seed)]
    run_bounded(drive(batcher, [(step, image, beam, length) for image, (step, beam, length) in zip(images, plan)]))
    return metrics, noted


def test_every_decoding_step_is_observed_with_the_rows_it_decoded(encoder):
    """``captioner_rows_per_step`` and ``captioner_step_time_seconds``: one observation per decoding step the
    batcher runs, of all the rows of all its tables (how full the steps run is what a dashboard reads from them)."""
    metrics, stepped = _metered_drive(encoder, count_step_rows, 16, [(0, 3, 6), (2, 2, 5)])

    def count(histogram) -> float:
        return sum(bucket.get() for bucket in histogram.labels("sat")._buckets)

    assert stepped and metrics.rows_per_step.labels("sat")._sum.get() == sum(stepped)
    assert count(metrics.rows_per_step) == count(metrics.step_time) == len(stepped)


def test_calibrations_timed_rounds_decode_two_steps_unless_told_otherwise(encoder):
    """The warm-up leaves the timed rounds' length to ``calibrate``'s default: two steps, a few only, as
    docs/decisions.md ("A calibration request at warm-up") states; the calibration request that follows has its own
    length. A longer default would make every model's start-up decode steps that measure nothing more."""
    runtime = runtime_for("sat", encoder)
    batcher = Batcher(runtime, max_batch=2, queue_size=16, max_rows=64)
    lengths, submit = [], batcher.submit

    def noting_submit(prepared, beam_size, max_len, timeout_s, *rules):
        lengths.append(max_len)
        return submit(prepared, beam_size, max_len, timeout_s, *rules)

    batcher.submit = noting_submit
    batcher.start()
    prepared = runtime.prepare(random_images(1, seed=6)[0])

    async def scenario():
        try:
            await batcher.calibrate(prepared, 1, [1, 2], timeout_s=60, calibrate_len=5)
        finally:
            await batcher.stop()

    run_bounded(scenario())
    assert lengths == [2] * 6 + [5]  # two rounds of one and two requests, then the calibration request


def test_every_encoding_is_observed_with_the_images_it_encoded_together(encoder):
    """``captioner_encoder_batch_size``: one observation per encoder call, of the images it encoded together (how
    often the chosen encoder batch fills is what a dashboard reads from it)."""
    metrics, encoded = _metered_drive(encoder, count_encodes, 17, [(0, 2, 4), (0, 1, 4), (0, 2, 4)])
    histogram = metrics.encoder_batch.labels("sat")
    assert encoded == [2, 1]  # two arrive together, the third waits for the next boundary
    assert histogram._sum.get() == 3 and sum(bucket.get() for bucket in histogram._buckets) == 2


def test_a_deadline_that_passes_during_a_step_frees_its_rows_at_the_end_of_that_step(encoder):
    """Deadlines that pass while a step runs free their rows when it ends, not at the next boundary: until then the
    load gauge, and admission control's count of requests decoding ahead of a new one, would hold a request whose
    time is up, and its client would wait for its 504 one step longer."""
    clock = FakeClock()
    runtime, _ = slow_runtime(encoder, clock, step_s=1.0)
    runtime.never_emitted = (*runtime.never_emitted, runtime.eos_id)  # the caption cannot end before its deadline
    metrics = Metrics()
    batcher = Batcher(runtime, max_batch=2, queue_size=8, max_rows=16, metrics=metrics, clock=clock)
    batcher.start(worker=False)
    prepared = runtime.prepare(random_images(1, seed=18)[0])

    async def scenario():
        job = batcher.submit(prepared, 3, 20, 1.5)
        batcher.run_once()  # its first step ends at 1 s of fake time, within its deadline
        assert batcher.active_rows == 3 and not job.future.done()
        batcher.run_once()  # its second ends at 2 s, past it
        assert batcher.active_rows == batcher.active_jobs == 0
        assert metrics.active_rows.labels("sat")._value.get() == 0
        assert metrics.freed.labels("sat", "deadline")._value.get() == 3
        with pytest.raises(DeadlineExceeded):
            await job.future

    run_bounded(scenario())
