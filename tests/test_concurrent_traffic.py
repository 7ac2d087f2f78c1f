"""What an audit of the service under concurrent and hostile traffic found (docs/decisions.md, "The service under
concurrent traffic, audited"): bounded decode and render work (service/work_slots.py), clients that leave
mid-upload, requests refused before captioning in the latency metric, and the drain's answers (lifecycle.py).
Everything is made deterministic with events, not timings."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import signal
import threading
import time
import types
from pathlib import Path

import anyio.to_thread
import pytest
import uvicorn
from fastapi.testclient import TestClient
from PIL import Image
from prometheus_client import generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from captioner.models.checkpoint import save_checkpoint
from captioner.models.images import load_image
from captioner.service import lifecycle, rendering
from captioner.service.app import create_app
from captioner.service.captioning import observed_request, slot_deadline
from captioner.service.errors import PROBLEM_TYPES, ClientGone, DeadlinePassed, UploadsBusy, UploadTooLarge
from captioner.service.inputs import read_body
from captioner.service.lifecycle import DrainingServer, DrainMiddleware, ShutdownGate
from captioner.service.middleware import RequestContextMiddleware, request_id_var
from captioner.service.result_cache import ResultCache
from captioner.service.settings import Settings
from captioner.service.state import ServiceState
from captioner.service.work_slots import UploadBudget, WorkSlots

from .serving_helpers import TINY_SPEC, VOCAB, parse_metrics, run_bounded, serving_settings, tiny_model


async def _until(condition, timeout_s: float = 10.0) -> None:
    """Wait until ``condition()`` holds (a piece's thread has started), failing after ``timeout_s`` rather than
    hanging the suite."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        await asyncio.sleep(0.01)


def _png(size=(64, 48)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, (30, 160, 90)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_work_slots_bound_the_work_and_free_a_slot_however_it_ends():
    async def scenario():
        idle = []
        slots = WorkSlots(2, on_idle=lambda: idle.append(True))
        release, running, peak = threading.Event(), [0], [0]
        lock = threading.Lock()

        def work(value):
            with lock:
                running[0] += 1
                peak[0] = max(peak[0], running[0])
            release.wait(10)
            with lock:
                running[0] -= 1
            return value

        tasks = [asyncio.create_task(slots.run(work, i)) for i in range(5)]
        await asyncio.sleep(0.2)
        assert running[0] == 2 and slots.running == 2  # three wait on the loop, not in threads
        with pytest.raises(TimeoutError):  # a waiter gives up at its deadline, and nothing of it runs
            await slots.run(work, "late", timeout=0.05)
        tasks[4].cancel()  # a waiter that leaves takes no slot
        release.set()
        assert await asyncio.gather(*tasks[:4]) == [0, 1, 2, 3]
        assert peak[0] == 2 and slots.running == 0 and idle
        with pytest.raises(asyncio.CancelledError):
            await tasks[4]
        # every slot is free again: two pieces run at once
        release.clear()
        both = [asyncio.create_task(slots.run(work, i)) for i in range(2)]
        await asyncio.sleep(0.2)
        assert running[0] == 2
        release.set()
        assert await asyncio.gather(*both) == [0, 1]

    run_bounded(scenario())


def test_a_piece_that_raises_gives_its_share_back_and_ends_like_any_other():
    """A decode that fails (a torn upload, a 4xx) or a render that raises ends like a piece that answers: its share
    goes back and ``on_idle`` runs, or each failure shrinks the budget for good until every upload waits out its
    deadline (a 504 with nothing running)."""
    async def scenario():
        idle: list[int] = []
        slots = WorkSlots(2, on_idle=lambda: idle.append(slots.running))

        def torn():
            raise ValueError("a torn upload")

        with pytest.raises(ValueError, match="a torn upload"):
            await slots.run(torn, cost=2)
        await _until(lambda: slots.running == 0, timeout_s=2)  # the thread posts its release to the loop
        assert idle == [0]
        assert await slots.run(lambda: "whole", cost=2, timeout=5) == "whole"  # all of the budget is free

    run_bounded(scenario())


def test_a_wait_for_a_slot_past_the_deadline_is_the_services_504_naming_what_waited():
    async def scenario():
        slots, release = WorkSlots(1), threading.Event()
        busy = asyncio.create_task(slots.run(release.wait, 10))
        await asyncio.sleep(0.1)
        with pytest.raises(DeadlinePassed, match="request deadline passed while the overlay waited to be rendered"):
            with slot_deadline(Settings(request_timeout_s=7), "the overlay waited to be rendered"):
                await slots.run(lambda: None, timeout=0.05)
        with pytest.raises(ValueError):  # anything else passes through as it is
            with slot_deadline(Settings(), "the upload waited to be decoded"):
                raise ValueError("not a deadline")
        release.set()
        await busy

    run_bounded(scenario())
    assert PROBLEM_TYPES[DeadlinePassed][0] == 504


def test_a_budget_lets_small_pieces_run_together_and_a_large_one_alone_in_arrival_order():
    """Decodes are budgeted by pixels: many small photos decode together, a piece as large as the budget runs
    alone, and the small ones that came after it wait for it (it is never overtaken forever)."""
    async def scenario():
        slots = WorkSlots(10)
        gates = {name: threading.Event() for name in ("a", "b", "big", "c")}
        order = []

        def work(name):
            order.append(f"start {name}")
            gates[name].wait(10)
            return name

        a = asyncio.create_task(slots.run(work, "a", cost=3))
        b = asyncio.create_task(slots.run(work, "b", cost=3))
        await asyncio.sleep(0.2)
        big = asyncio.create_task(slots.run(work, "big", cost=10**9))  # above the budget: runs alone
        await asyncio.sleep(0.05)
        c = asyncio.create_task(slots.run(work, "c", cost=1))  # would fit now, but arrived after the big one
        await asyncio.sleep(0.2)
        assert sorted(order) == ["start a", "start b"]  # together: their threads start in either order
        gates["a"].set()
        await a
        assert slots.waiting == 2  # b still runs: the big one is not granted its share, and c stays behind it
        gates["b"].set()
        await b
        await asyncio.sleep(0.2)
        assert order[2:] == ["start big"]
        gates["big"].set()
        gates["c"].set()
        assert await asyncio.gather(big, c) == ["big", "c"]
        assert order[3:] == ["start c"] and slots.running == 0

    run_bounded(scenario())


def test_waiters_that_leave_together_give_back_nothing_they_did_not_take_and_the_budget_still_binds():
    """Two waiters cancelled at once: the first one's clean-up wakes the queue while the second, cancelled too, has
    not run its own yet; neither is granted a share, neither gives one back, and the running piece's share still
    bounds what starts next."""
    async def scenario():
        slots, release = WorkSlots(2), threading.Event()
        running = asyncio.create_task(slots.run(release.wait, 10))  # 1 of 2 units
        await _until(lambda: slots.running > 0)
        wide = asyncio.create_task(slots.run(lambda: "wide", cost=2))  # does not fit beside it: waits
        narrow = asyncio.create_task(slots.run(lambda: "narrow", cost=1))  # would fit, but arrived after it
        await asyncio.sleep(0)
        assert slots.waiting == 2
        wide.cancel()
        narrow.cancel()
        for task in (wide, narrow):
            with pytest.raises(asyncio.CancelledError):
                await task
        assert slots.waiting == 0 and slots.running == 1
        # the running piece's unit is still taken, and only it: a piece of 1 runs at once beside it, one of 2 waits
        assert await slots.run(lambda: "fits", cost=1, timeout=5) == "fits"
        again = asyncio.create_task(slots.run(lambda: "again", cost=2))
        await asyncio.sleep(0)
        assert slots.waiting == 1 and slots.running == 1
        release.set()
        assert await running and await again == "again"
        assert slots.running == 0 and slots.waiting == 0

    run_bounded(scenario())


def test_on_idle_is_called_once_the_last_running_piece_ends_and_not_before():
    async def scenario():
        idle: list[int] = []
        slots = WorkSlots(2, on_idle=lambda: idle.append(slots.running))
        gates = [threading.Event(), threading.Event()]
        pieces = [asyncio.create_task(slots.run(gate.wait, 10)) for gate in gates]
        await _until(lambda: slots.running == 2)
        gates[0].set()
        assert await pieces[0]
        assert idle == []  # the other piece still runs
        gates[1].set()
        assert await pieces[1]
        assert idle == [0]

    run_bounded(scenario())


def test_on_idle_is_called_when_the_last_piece_ends_even_with_waiters_still_queued():
    """Nothing running is the trimmer's cue, whatever still waits: a waiter left queued (behind a large piece just
    granted) may give up at its deadline, and then no piece would end to give the cue later."""
    async def scenario():
        queued: list[int] = []
        slots = WorkSlots(2, on_idle=lambda: queued.append(slots.waiting))
        gates = [threading.Event(), threading.Event()]
        first = asyncio.create_task(slots.run(gates[0].wait, 10, cost=2))
        await _until(lambda: slots.running == 1)
        second = asyncio.create_task(slots.run(gates[1].wait, 10, cost=2))
        small = asyncio.create_task(slots.run(lambda: "small", cost=1))
        try:
            await asyncio.sleep(0)
            assert slots.waiting == 2
            gates[0].set()
            assert await first
            await _until(lambda: queued, timeout_s=2)
            assert queued == [1]  # the second piece was granted the whole budget, the small one still waits
        finally:  # a failure above must not leave a pool thread waiting
            for gate in gates:
                gate.set()
        assert await second and await small == "small"
        assert queued[-1] == 0 and slots.running == 0

    run_bounded(scenario())


async def _a_waiter_to_be_cancelled_once_granted(*behind: int):
    """A budget of 2 taken whole by a piece that ends when ``release`` is set, a waiter of 2 queued (cancelled by
    ``on_idle`` as that piece ends, after its release granted the waiter the share), then one piece queued behind
    it for each cost in ``behind``: ``(slots, release, first, waiter, behind_tasks)``."""
    waiter: list[asyncio.Task] = []
    slots, release = WorkSlots(2, on_idle=lambda: waiter[0].cancel()), threading.Event()
    first = asyncio.create_task(slots.run(release.wait, 10, cost=2))
    await _until(lambda: slots.running > 0)
    waiter.append(asyncio.create_task(slots.run(lambda: "never", cost=2)))
    queued = [asyncio.create_task(slots.run(lambda: "behind", cost=cost)) for cost in behind]
    await asyncio.sleep(0)
    return slots, release, first, waiter[0], queued


def test_a_waiter_cancelled_just_after_its_share_was_granted_gives_the_share_back():
    """The share is granted (by the piece that ends) before the waiter's task resumes; cancelled in between, the
    waiter never runs and must hand the share back, or the budget shrinks for good."""
    async def scenario():
        slots, release, first, waiter, _ = await _a_waiter_to_be_cancelled_once_granted()
        assert slots.waiting == 1
        release.set()  # the first piece ends: its release grants the waiter, then on_idle cancels it
        await first
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert slots.waiting == 0 and slots.running == 0
        # the whole budget is free again: a piece of all of it starts without waiting
        assert await slots.run(lambda: "whole", cost=2, timeout=5) == "whole"

    run_bounded(scenario())


def test_a_share_given_back_by_a_waiter_cancelled_after_its_grant_lets_the_waiters_behind_it_in():
    """A waiter granted its share just as it gave up (its deadline, its client gone) hands the share back, and the
    waiters behind it must get it at once: otherwise a smaller decode queued behind it waits, with the whole budget
    free and nothing running, until its own deadline (a 504 from an idle service)."""

    async def scenario():
        slots, release, first, waiter, (behind,) = await _a_waiter_to_be_cancelled_once_granted(1)
        assert slots.waiting == 2
        release.set()  # the first piece ends: its release grants the waiter of 2 only, then on_idle cancels it
        await first
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert await asyncio.wait_for(behind, 2) == "behind"
        assert slots.waiting == 0 and slots.running == 0

    run_bounded(scenario())


def test_a_piece_cancelled_before_a_thread_takes_it_never_runs_and_gives_its_share_back():
    """A piece that has its share can still wait for a thread of Starlette's pool (all of them busy elsewhere);
    cancelled there it never runs, and its caller gives back its share and its count as running."""
    async def scenario():
        threads = anyio.to_thread.current_default_thread_limiter()  # this event loop's pool
        threads.total_tokens = 1
        slots, release, ran = WorkSlots(2), threading.Event(), []
        busy = asyncio.create_task(run_in_threadpool(release.wait, 10))  # the pool's one thread, outside the slots
        await _until(lambda: threads.borrowed_tokens > 0)
        piece = asyncio.create_task(slots.run(ran.append, "ran", cost=2))
        await _until(lambda: slots.running > 0)
        piece.cancel()
        with pytest.raises(asyncio.CancelledError):
            await piece
        assert slots.running == 0 and ran == []
        release.set()
        assert await busy
        assert await slots.run(lambda: "whole", cost=2, timeout=5) == "whole"  # all of the budget is free
        assert ran == []

    run_bounded(scenario())


def test_a_waiter_that_leaves_the_head_of_the_queue_lets_the_ones_behind_it_in():
    """A waiter that gives up (its deadline, its client gone) wakes the queue: a smaller piece behind it that fits
    beside the running one starts at once, rather than waiting for the running piece to end (or for its own
    deadline: a 504 while the budget had room)."""
    async def scenario():
        slots, release = WorkSlots(2), threading.Event()
        running = asyncio.create_task(slots.run(release.wait, 10))  # 1 of 2 units
        await _until(lambda: slots.running > 0)
        wide = asyncio.create_task(slots.run(lambda: "wide", cost=2))  # does not fit beside it: waits
        narrow = asyncio.create_task(slots.run(lambda: "narrow", cost=1))  # fits, but queued behind the wide one
        try:
            await asyncio.sleep(0)
            assert slots.waiting == 2
            wide.cancel()
            assert await asyncio.wait_for(narrow, 2) == "narrow"  # while the first piece still runs
            assert slots.running == 1
        finally:  # a failure above must not leave the pool's thread waiting: the test process would never exit
            release.set()
        assert await running
        with pytest.raises(asyncio.CancelledError):
            await wide

    run_bounded(scenario())


def test_a_piece_that_ends_lets_in_every_waiter_its_share_makes_room_for():
    """A large piece's end frees room for several small ones: all of them start together (a burst of ordinary
    photos decodes at once, as the module says), not one per release."""
    async def scenario():
        slots, release = WorkSlots(3), threading.Event()
        together = threading.Barrier(3, timeout=5)  # broken unless all three small pieces run at once

        def small(name):
            together.wait()
            return name

        large = asyncio.create_task(slots.run(release.wait, 10, cost=3))
        await _until(lambda: slots.running > 0)
        smalls = [asyncio.create_task(slots.run(small, i)) for i in range(3)]
        try:
            await asyncio.sleep(0)
            assert slots.waiting == 3
        finally:  # as above: a failure must not leave the large piece's thread waiting
            release.set()
        assert await large
        assert await asyncio.gather(*smalls) == [0, 1, 2]

    run_bounded(scenario())


def test_a_piece_that_got_its_share_in_time_runs_to_its_end_past_the_timeout():
    """``timeout`` bounds the wait for a share, not the work: a render or decode that started in time answers,
    rather than being abandoned at the deadline while its thread goes on anyway."""
    async def scenario():
        slots = WorkSlots(1)
        assert await slots.run(lambda: time.sleep(0.3) or "done", timeout=0.1) == "done"
        assert slots.running == 0

    run_bounded(scenario())


def test_an_upload_budget_holds_exactly_its_capacity_and_a_request_gives_back_all_it_took():
    budget = UploadBudget(1000, retry_after_s=3)
    with budget.hold() as share:
        share.take(600)
        share.take(400)  # exactly the capacity: held
        assert budget.held == share.size == 1000
        with pytest.raises(UploadsBusy) as refused:
            share.take(1)
        assert refused.value.retry_after_s == 3 and budget.held == share.size == 1000  # the refused chunk is not held
    assert budget.held == 0
    with pytest.raises(UploadsBusy):
        budget.take(1001)
    unlimited = UploadBudget(None)
    with unlimited.hold() as share:
        share.take(10**12)
    assert unlimited.held == 0


def test_a_request_that_fails_after_taking_bytes_gives_them_back():
    """A request refused after its body arrived (no image, a deadline passed) still ends: its bytes go back to the
    budget, or each such failure shrinks it for good until every upload is refused with 429."""
    budget = UploadBudget(1000)
    with pytest.raises(ValueError, match="no image"), budget.hold() as share:
        share.take(600)
        raise ValueError("the upload is no image")
    assert budget.held == 0


@pytest.fixture(scope="module")
def tiny_weights(tmp_path_factory):
    root = tmp_path_factory.mktemp("traffic-weights")
    save_checkpoint(root / "tiny", tiny_model("sat"), VOCAB, TINY_SPEC)
    return root


def _tiny_settings(weights_dir: Path, **settings) -> Settings:
    """An in-process server of the module's one tiny model, on the CPU in one thread."""
    return serving_settings(weights_dir=weights_dir, default_model="tiny", device="cpu", threads=1, **settings)


def test_renders_waiting_for_their_slots_never_hold_the_threads_captions_need(tiny_weights, monkeypatch):
    """More renders outstanding than the thread pool has threads (40): they wait for their two slots on the event
    loop, so a caption still gets a thread for its decode.  Before, every render took a pool thread and the
    caption waited for all of them."""
    blocked, entered = threading.Event(), threading.Semaphore(0)
    real_render = rendering._render

    def slow_render(*args):
        entered.release()
        blocked.wait(60)
        return real_render(*args)

    monkeypatch.setattr(rendering, "_render", slow_render)
    settings = _tiny_settings(tiny_weights, render_concurrency=2)
    renders, caption = [], {}
    with TestClient(create_app(settings)) as client:
        try:
            first = client.post("/caption", files={"file": ("a.png", _png(), "image/png")})
            assert first.status_code == 200
            overlay = f"/captions/{first.json()['id']}/overlay?token=0"  # a PNG: the renders are held, not slow
            renders = [threading.Thread(target=client.get, args=(overlay,)) for _ in range(45)]
            for render in renders:
                render.start()
            assert entered.acquire(timeout=30) and entered.acquire(timeout=30)
            captioning = threading.Thread(target=lambda: caption.update(
                response=client.post("/caption", files={"file": ("b.png", _png((80, 60)), "image/png")})))
            captioning.start()
            captioning.join(timeout=60)
            starved = captioning.is_alive()
            more_than_two = entered.acquire(timeout=0)
        finally:  # every request ends before the client closes, whatever was asserted
            blocked.set()
            for thread in [*renders, *([captioning] if "captioning" in locals() else [])]:
                thread.join(timeout=120)
    assert not starved, "the caption waited for the renders"
    assert caption["response"].status_code == 200
    assert not more_than_two, "only two renders may run while the others wait"


def _caption_request(receive, headers: list[tuple[bytes, bytes]] | None = None) -> Request:
    """A bare ``POST /caption`` whose body comes from ``receive``, for ``read_body`` outside the app."""
    return Request({"type": "http", "method": "POST", "path": "/caption", "headers": headers or []}, receive)


def test_a_body_announced_above_the_limit_is_refused_before_any_of_it_is_read():
    """A Content-Length above the upload limit is a 413 at once: none of the body is read or taken from the upload
    budget (a body without a length is counted as it arrives); a body of exactly the limit is read."""
    received = []

    async def receive():
        received.append(True)
        return {"type": "http.request", "body": b"x" * 1000, "more_body": False}

    def request(length: int) -> Request:
        return _caption_request(receive, [(b"content-length", str(length).encode())])

    budget = UploadBudget(10_000)
    with pytest.raises(UploadTooLarge):
        run_bounded(read_body(request(1001), 1000, budget=budget))
    assert received == [] and budget.held == 0
    assert run_bounded(read_body(request(1000), 1000, budget=budget)) == b"x" * 1000 and received == [True]


def test_a_body_without_a_length_is_refused_as_soon_as_it_passes_the_limit():
    """A chunked body (no Content-Length) is counted as it arrives: it is refused at the chunk that takes it past
    ``refused_at``, the rest never read, and one of exactly ``refused_at`` bytes is read whole.  Without the count,
    such an upload was held in memory whole, however large, and refused only afterwards by the image's size check."""
    def request(sizes: list[int], received: list[int]) -> Request:
        messages = [{"type": "http.request", "body": b"x" * size, "more_body": i < len(sizes) - 1}
                    for i, size in enumerate(sizes)]

        async def receive():
            received.append(len(messages[len(received)]["body"]))
            return messages[len(received) - 1]

        return _caption_request(receive, [(b"transfer-encoding", b"chunked")])

    whole: list[int] = []
    assert run_bounded(read_body(request([500, 500, 500], whole), 1000, refused_at=1500)) == b"x" * 1500
    assert whole == [500, 500, 500]
    over: list[int] = []
    with pytest.raises(UploadTooLarge) as refused:
        run_bounded(read_body(request([500, 500, 501, *[500] * 100], over), 1000, refused_at=1500))
    assert over == [500, 500, 501] and refused.value.limit == 1000  # named by the image's limit, not refused_at


def test_a_client_leaving_mid_upload_is_a_499_not_an_internal_error(tiny_weights):
    messages = [{"type": "http.request", "body": b"half of it", "more_body": True}]

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    request = _caption_request(receive)
    with pytest.raises(ClientGone, match="closed the connection"):
        run_bounded(read_body(request, 1000))
    # and through the app: counted as the client's 499 (an unmapped ClientGone would be a 500)
    settings = _tiny_settings(tiny_weights)
    with TestClient(create_app(settings)) as client:
        messages.append({"type": "http.request", "body": b"half of it", "more_body": True})
        sent = []

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/caption", "raw_path": b"/caption", "query_string": b"",
                 "headers": [(b"content-type", b"image/png"), (b"content-length", b"1000")], "http_version": "1.1",
                 "scheme": "http", "server": ("test", 80), "client": ("test", 1), "root_path": ""}
        client.portal.call(client.app, scope, receive, send)
        samples = parse_metrics(client.get("/metrics").text)
    statuses = {key for key in samples if key.startswith("captioner_request_latency_seconds_count")}
    assert statuses == {'captioner_request_latency_seconds_count{model="tiny",status="499"}'}, statuses


def test_a_request_whose_task_is_cancelled_is_the_clients_499_and_a_client_gone_reject(tiny_weights):
    """A client that leaves while its request waits (its task cancelled: no exception of the service's own) is the
    client's 499 in the latency metric, not a 200 that was never answered, and one ``client-gone`` reject: the
    counter operators watch for clients giving up (no handler answers it, so only the use case counts it)."""
    settings = _tiny_settings(tiny_weights)
    with TestClient(create_app(settings)) as client:
        with pytest.raises(asyncio.CancelledError):
            with observed_request(client.app.state.service, time.monotonic(), lambda: "tiny"):
                raise asyncio.CancelledError
        samples = parse_metrics(client.get("/metrics").text)
    statuses = {key for key in samples if key.startswith("captioner_request_latency_seconds_count")}
    assert statuses == {'captioner_request_latency_seconds_count{model="tiny",status="499"}'}, statuses
    assert samples.get('captioner_rejects_total{reason="client-gone"}') == 1, samples


@pytest.mark.parametrize("root_path", ["", "/vision"])
def test_requests_refused_before_captioning_are_in_the_latency_metric(tiny_weights, root_path):
    """Behind a proxy's prefix too: the caption routes are told by the path without it (paths.py)."""
    settings = _tiny_settings(tiny_weights, root_path=root_path)
    with TestClient(create_app(settings), root_path=root_path) as client:
        assert client.post(f"{root_path}/caption", content=b"x", headers={"content-type": "text/plain"}
                           ).status_code == 415
        assert client.post(f"{root_path}/caption", content=b"--x\r\nbroken", headers={
            "content-type": "multipart/form-data; boundary=x"}).status_code == 422
        # refused by FastAPI's validation of the query, before the endpoint ran: they were not counted
        assert client.post(f"{root_path}/caption", params={"beam_size": 0}, content=b"x").status_code == 422
        assert client.post(f"{root_path}/caption/overlay", params={"alpha": 2}, content=b"x").status_code == 422
        # not a caption request
        assert client.get(f"{root_path}/captions/nope/overlay", params={"alpha": 2}).status_code == 422
        samples = parse_metrics(client.get(f"{root_path}/metrics").text)
    count = {key: value for key, value in samples.items() if key.startswith("captioner_request_latency_seconds_count")}
    assert count.get('captioner_request_latency_seconds_count{model="tiny",status="415"}') == 1, count
    assert count.get('captioner_request_latency_seconds_count{model="tiny",status="422"}') == 3, count


def test_the_latency_metric_observes_how_long_each_request_took(tiny_weights):
    """A caption request's latency (the use case's ``observed_request``) and that of one FastAPI refused before the
    use case saw it (``observe_invalid``) are each the seconds since it arrived: within the wall time around the
    requests, not a reading of the clock."""
    settings = _tiny_settings(tiny_weights)
    with TestClient(create_app(settings)) as client:
        started = time.monotonic()
        assert client.post("/caption", params={"max_len": 2}, content=_png(),
                           headers={"content-type": "image/png"}).status_code == 200
        assert client.post("/caption", params={"beam_size": 0}, content=b"x").status_code == 422
        elapsed = time.monotonic() - started
        samples = parse_metrics(client.get("/metrics").text)
    for status in (200, 422):
        seconds = samples[f'captioner_request_latency_seconds_sum{{model="tiny",status="{status}"}}']
        assert 0 < seconds <= elapsed, (status, seconds, elapsed)


def _drain_scenario(app, messages):
    """Run ``app`` behind a draining gate: the messages the client sends, and what it is answered.  The client
    stays connected: once its messages are read, ``receive`` waits, as uvicorn's does until a disconnect."""
    sent, queue = [], list(messages)
    consumed = []

    async def receive():
        if not queue:
            await asyncio.Event().wait()
        message = queue.pop(0)
        consumed.append(message)
        return message

    async def send(message):
        sent.append(message)

    return sent, consumed, receive, send


def test_a_request_refused_while_draining_has_its_body_read_before_the_503():
    """A connection closed with unread data in it is reset: the client would see the reset, not the 503."""
    refused = []
    gate = ShutdownGate(retry_after_s=7, on_reject=lambda: refused.append(1))
    gate.begin_drain()
    middleware = DrainMiddleware(lambda *args: None, gate)
    chunks = [{"type": "http.request", "body": b"x" * 65536, "more_body": True} for _ in range(20)]
    chunks.append({"type": "http.request", "body": b"end", "more_body": False})
    sent, consumed, receive, send = _drain_scenario(middleware, chunks)
    run_bounded(middleware({"type": "http", "path": "/caption"}, receive, send))
    assert len(consumed) == 21 and consumed[-1]["body"] == b"end"
    assert sent[0]["status"] == 503 and json.loads(sent[1]["body"])["type"] == "/problems/not-ready"
    # counted as a refusal, retried after the gate's wait, on another connection (a load balancer's next replica)
    headers = dict(sent[0]["headers"])
    assert refused == [1] and headers[b"retry-after"] == b"7" and headers[b"connection"] == b"close"


def test_while_draining_liveness_and_metrics_reach_the_app_under_its_prefix_and_nothing_else_does():
    gate = ShutdownGate()
    gate.begin_drain()
    reached = []

    async def app(scope, receive, send):
        reached.append(scope["path"])

    middleware = DrainMiddleware(app, gate)
    for path in ("/healthz", "/metrics", "/vision/metrics", "/readyz", "/models", "/caption"):
        sent, _, receive, send = _drain_scenario(middleware, [{"type": "http.request", "more_body": False}])
        root = "/vision" if path.startswith("/vision/") else ""
        run_bounded(middleware({"type": "http", "path": path, "root_path": root}, receive, send))
        assert path in reached or sent[0]["status"] == 503, path
    assert reached == ["/healthz", "/metrics", "/vision/metrics"]


def test_the_drain_clock_starts_at_the_first_signal_and_leaves_at_least_a_second():
    gate = ShutdownGate()
    assert gate.time_left(30) == 30  # no drain: the whole budget
    gate.begin_drain()
    gate.drain_began -= 100  # the drain began long ago
    began = gate.drain_began
    gate.begin_drain()  # a second signal does not restart the clock
    assert gate.drain_began == began and gate.time_left(30) == 1.0


@pytest.fixture
def lifecycle_clock(monkeypatch):
    """lifecycle.py's monotonic clock, at 100 s until the test moves it (``clock.now``)."""
    clock = types.SimpleNamespace(now=100.0)
    monkeypatch.setattr(lifecycle, "time", types.SimpleNamespace(monotonic=lambda: clock.now))
    return clock


def _drain_then_exit_taking(server, clock, monkeypatch, seconds):
    """Run ``server``'s drain-then-exit after SIGTERM, its admitted requests taking ``seconds`` of the clock."""
    async def drain(timeout_s):
        clock.now += seconds
        return True

    monkeypatch.setattr(server.gate, "drain", drain)
    run_bounded(server._drain_then_exit(signal.SIGTERM))


def test_what_is_left_of_a_drain_budget_counts_from_when_the_drain_began(lifecycle_clock):
    """Midway through the budget (not only at its two ends): 12 s after the signal, 18 s of 30 are left."""
    gate = ShutdownGate()
    gate.begin_drain()
    lifecycle_clock.now += 12
    assert gate.time_left(30) == 18


def test_a_first_signal_refuses_new_requests_at_once_and_drains_outside_the_interrupted_requests_context():
    """The signal handler flips the gate itself (the drain task starts only when the loop next runs), and the drain
    it schedules must not inherit the request id of the request the signal interrupted: its log lines would name it."""
    server = DrainingServer(uvicorn.Config(app=None), ShutdownGate(), drain_timeout_s=30)
    server.started = True
    drains = []
    server._start_drain = lambda sig: drains.append((sig, request_id_var.get()))

    async def signal_during_a_request():
        server._loop = asyncio.get_running_loop()
        request_id_var.set("interrupted-request")
        server.handle_exit(signal.SIGTERM, None)
        draining_at_once = server.gate.draining
        await asyncio.sleep(0.01)  # the loop runs the scheduled start of the drain
        return draining_at_once

    assert run_bounded(signal_during_a_request()) is True
    assert drains == [(signal.SIGTERM, None)] and not server.skip_wait


@pytest.mark.parametrize("drain_took_s, left_s", [(12, 18), (45, 1.0)])
def test_a_drain_after_one_signal_leaves_uvicorn_what_is_left_of_its_budget_and_at_least_a_second(
        lifecycle_clock, monkeypatch, drain_took_s, left_s):
    """A server as made, with no second signal (the test below sets ``skip_wait`` itself either way); a drain that
    overran its budget still leaves uvicorn a second to close the connections."""
    server = DrainingServer(uvicorn.Config(app=None), ShutdownGate(), drain_timeout_s=30)
    _drain_then_exit_taking(server, lifecycle_clock, monkeypatch, drain_took_s)
    assert server.should_exit and server.config.timeout_graceful_shutdown == left_s


def test_a_drain_says_whether_every_admitted_request_finished_and_tells_its_owner_it_began():
    began = []
    gate = ShutdownGate(on_drain=lambda: began.append(1))
    gate.in_flight = 1
    assert run_bounded(gate.drain(0.05)) is False and gate.draining and began == [1]
    gate.in_flight = 0
    assert run_bounded(gate.drain(0.05)) is True


def test_a_drain_ends_as_soon_as_the_last_admitted_request_finishes_not_at_its_deadline(lifecycle_clock, monkeypatch):
    """``docker stop`` or a rolling update waits on the drain: an idle replica must exit at once, and a busy one when
    its last request ends, not after the whole drain budget (30 s a replica, idle, kept the update waiting)."""
    gate, polls = ShutdownGate(), []

    async def poll(seconds):  # each poll takes its time on the test's clock; the last request ends after the second
        polls.append(seconds)
        lifecycle_clock.now += seconds
        gate.in_flight = 0 if len(polls) == 2 else gate.in_flight

    monkeypatch.setattr(lifecycle, "asyncio", types.SimpleNamespace(sleep=poll))
    assert run_bounded(gate.drain(30)) is True and polls == []  # nothing in flight: no wait at all
    gate.in_flight = 1
    assert run_bounded(gate.drain(30)) is True and len(polls) == 2


@pytest.mark.parametrize("second_signal", [False, True])
def test_after_the_drain_uvicorn_waits_only_what_is_left_of_its_budget(second_signal, lifecycle_clock, monkeypatch):
    """The pod's grace period counts the drain and uvicorn's wait for connections together; after a second signal
    there is no wait at all."""
    server = DrainingServer(uvicorn.Config(app=None), ShutdownGate(), drain_timeout_s=30)
    server.skip_wait = second_signal
    server.config.timeout_graceful_shutdown = 0 if second_signal else 35
    _drain_then_exit_taking(server, lifecycle_clock, monkeypatch, 12)  # the admitted requests took 12 s of the 30
    assert server.should_exit and server.config.timeout_graceful_shutdown == (0 if second_signal else 18)


@pytest.mark.parametrize("uvicorn_stopping", [False, True])
def test_a_second_signal_ends_the_drain_and_uvicorns_wait_at_once(uvicorn_stopping):
    server = DrainingServer(uvicorn.Config(app=None), ShutdownGate(), drain_timeout_s=30)
    server.started, server.should_exit = True, uvicorn_stopping
    server.gate.begin_drain()  # the first signal's
    server.handle_exit(signal.SIGTERM, None)
    assert server.skip_wait and server.config.timeout_graceful_shutdown == 0 and server.should_exit
    assert server.force_exit == uvicorn_stopping


def test_a_signal_during_start_up_terminates_the_export_child_before_exiting_0(monkeypatch):
    """The end-to-end test (test_graceful_shutdown) cannot tell a terminated export child from one that dies at its
    next report into the closed pipe: with tiny models that comes within a second, with real ones after minutes of
    an ONNX export that holds the CPU and memory of a server already gone."""
    events = []
    child = types.SimpleNamespace(terminate=lambda: events.append("terminate"))
    monkeypatch.setattr(lifecycle.multiprocessing, "active_children", lambda: [child])

    def exit_(status):
        events.append(("exit", status))
        raise SystemExit(status)

    monkeypatch.setattr(lifecycle.os, "_exit", exit_)
    # os._exit skips logging's own flush at exit: the lines that say why the server stopped must be written first
    monkeypatch.setattr(lifecycle.logging, "shutdown", lambda: events.append("logs flushed"))
    with pytest.raises(SystemExit):
        DrainingServer._exit_before_serving(signal.SIGTERM)
    assert events == ["terminate", "logs flushed", ("exit", 0)]


def test_a_request_refused_while_draining_is_logged_with_its_request_id_and_the_metrics_say_not_ready(tiny_weights,
                                                                                                     caplog):
    """The drain's 503s pass through the request-context middleware: the access log records them (how an operator
    sees that a load balancer still sends traffic to a stopping replica) and each answer names its request id; the
    drain clears ``captioner_ready`` and counts each refusal as ``not-ready``."""
    app = create_app(_tiny_settings(tiny_weights))
    with TestClient(app) as client, caplog.at_level(logging.INFO, logger="captioner.access"):
        assert run_bounded(app.state.shutdown_gate.drain(0)) is True  # nothing in flight: what SIGTERM starts
        refused = client.get("/models", headers={"x-request-id": "draining-1"})
        samples = parse_metrics(client.get("/metrics").text)
    assert refused.status_code == 503 and refused.headers["x-request-id"] == "draining-1"
    logged = [record.fields for record in caplog.records if record.name == "captioner.access"]
    assert [(fields["path"], fields["status"]) for fields in logged][0] == ("/models", 503)
    assert samples["captioner_ready"] == 0 and samples['captioner_rejects_total{reason="not-ready"}'] == 1


def test_the_apps_idle_trimmer_counts_a_running_batcher_or_thread_pool_slot_as_work(tiny_weights):
    """The release the app's trimmer defers skips while work runs (memory.py): a slot's piece of work running in
    the thread pool, or a batcher with requests, is work; the app at rest is not."""
    app = create_app(_tiny_settings(tiny_weights))
    with TestClient(app) as client:
        state = app.state.service
        busy = state.at_work
        assert state.on_idle._busy == busy  # the app's trimmer asks the state
        assert busy() is False
        assert client.portal.call(state.decode_slots.run, busy) is True
        assert client.portal.call(state.render_slots.run, busy) is True
        state.batchers["at work"] = types.SimpleNamespace(idle=False)
        try:
            assert busy() is True
        finally:
            del state.batchers["at work"]  # the app's shutdown stops every batcher it holds
        assert busy() is False


def test_the_trimmers_look_at_the_batchers_survives_a_model_starting_meanwhile():
    """``at_work`` runs on the trimmer's thread while a model starting on the event loop adds its batcher: read from
    the live dict, the look fails with "dictionary changed size during iteration" (state.py copies it first). Here
    the first batcher's ``idle`` is read at the moment another one is added."""
    state = ServiceState(settings=Settings())

    class Starting:
        @property
        def idle(self) -> bool:
            state.batchers["started meanwhile"] = types.SimpleNamespace(idle=True)
            return True

    state.batchers["first"] = Starting()
    assert state.at_work() is False
    assert list(state.batchers) == ["first", "started meanwhile"]


def test_a_state_keeps_the_default_model_and_result_cache_it_is_given_and_takes_the_settings_otherwise():
    """The settings fill only what the state was not given: a given default model or result cache (one shared by
    two apps, say) is kept, not replaced by the settings' own."""
    settings = Settings(default_model="from-settings", result_cache_entries=3)
    cache = ResultCache(7)
    given = ServiceState(settings=settings, default_model="given", result_cache=cache)
    assert given.default_model == "given" and given.result_cache is cache
    made = ServiceState(settings=settings)
    assert made.default_model == "from-settings" and made.result_cache.max_entries == 3


@pytest.mark.parametrize("draining, answered", [(False, False), (True, True)])
def test_a_request_cancelled_outside_a_drain_or_once_answered_stays_cancelled(draining, answered):
    """A client that leaves (no drain) or a request whose answer has begun is cancelled work: a 503 then would be a
    second answer, or one nobody asked for."""
    gate = ShutdownGate()
    running = asyncio.Event()

    async def app(scope, receive, send):
        if answered:
            await send({"type": "http.response.start", "status": 200, "headers": []})
        running.set()
        await asyncio.sleep(3600)

    middleware = DrainMiddleware(app, gate)
    sent, _, receive, send = _drain_scenario(middleware, [])

    async def scenario():
        task = asyncio.create_task(middleware({"type": "http", "path": "/caption"}, receive, send))
        await running.wait()
        if draining:
            gate.begin_drain()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run_bounded(scenario())
    assert gate.in_flight == 0 and [m["status"] for m in sent if "status" in m] == ([200] if answered else [])


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_a_request_cancelled_when_the_drain_time_is_up_is_answered_with_the_503_problem(method):
    """Uvicorn cancels what still runs when the drain time is up; its own answer would be a plain-text 500.  A POST
    runs in a task of its own under the request-context middleware, which must let it answer."""
    gate = ShutdownGate()

    async def endless(scope, receive, send):
        await asyncio.sleep(3600)

    middleware = RequestContextMiddleware(DrainMiddleware(endless, gate), log_requests=False)
    sent, _, receive, send = _drain_scenario(middleware, [{"type": "http.request", "body": b"", "more_body": False}])

    async def scenario():
        task = asyncio.create_task(middleware({"type": "http", "method": method, "path": "/caption", "headers": []},
                                              receive, send))
        await asyncio.sleep(0.05)
        gate.begin_drain()
        task.cancel()
        await task  # answered, and ended without re-raising into uvicorn's "Exception in ASGI application"
        assert gate.in_flight == 0

    run_bounded(scenario())
    assert sent[0]["status"] == 503 and dict(sent[0]["headers"])[b"content-type"] == b"application/problem+json"
    assert "shut down before the request finished" in json.loads(sent[1]["body"])["detail"]


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_a_request_the_server_cancels_before_any_answer_stays_cancelled_under_the_request_context(method):
    """With nothing answered on the way out (no drain to answer 503), the request-context middleware passes the
    server's cancellation on rather than ending as if the request had been answered, with nothing sent."""
    running = asyncio.Event()

    async def endless(scope, receive, send):
        running.set()
        await asyncio.sleep(3600)

    middleware = RequestContextMiddleware(endless, log_requests=False)
    sent, _, receive, send = _drain_scenario(middleware, [{"type": "http.request", "body": b"", "more_body": False}])

    async def scenario():
        task = asyncio.create_task(middleware({"type": "http", "method": method, "path": "/caption", "headers": []},
                                              receive, send))
        await running.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run_bounded(scenario())
    assert sent == []


def test_overlays_decode_a_large_jpeg_at_a_fraction_of_its_size():
    """``reduce_to``: what an overlay of at most 2,048 px needs of a 6,000-px JPEG is its half-size decode (a
    quarter of the memory); the caption path never passes it."""
    buffer = io.BytesIO()
    Image.new("RGB", (6000, 4000), (10, 20, 30)).save(buffer, format="JPEG")
    assert load_image(buffer.getvalue(), reduce_to=2048).size == (3000, 2000)
    assert load_image(buffer.getvalue()).size == (6000, 4000)
    assert load_image(_png((300, 200)), reduce_to=100).size == (300, 200)  # PNG: no reduced decode exists


def test_a_request_refused_while_draining_is_not_counted_as_running():
    """The drain waits for the admitted requests only: a refused one counted as running would keep every shutdown
    waiting its whole budget once a single request was refused (and log them as cancelled)."""
    gate = ShutdownGate()
    gate.begin_drain()
    middleware = DrainMiddleware(lambda *args: None, gate)
    sent, _, receive, send = _drain_scenario(middleware, [{"type": "http.request", "body": b"", "more_body": False}])
    run_bounded(middleware({"type": "http", "path": "/caption"}, receive, send))
    assert sent[0]["status"] == 503 and gate.in_flight == 0
    assert run_bounded(gate.drain(0.05)) is True


def test_a_request_whose_answer_fails_is_no_longer_counted_as_running():
    """An error raised once the answer has started reaches the drain's middleware (the app's 500 handler passes it
    on, nothing more can be answered): counted as running for ever, it would keep every later shutdown waiting its
    whole drain budget, and log a request as cancelled that had long ended."""
    gate = ShutdownGate()

    async def failing(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        raise RuntimeError("the answer's body could not be sent")

    middleware = DrainMiddleware(failing, gate)
    sent, _, receive, send = _drain_scenario(middleware, [{"type": "http.request", "body": b"", "more_body": False}])
    with pytest.raises(RuntimeError, match="could not be sent"):
        run_bounded(middleware({"type": "http", "path": "/caption"}, receive, send))
    assert sent[0]["status"] == 200 and gate.in_flight == 0
    assert run_bounded(gate.drain(0.05)) is True


def test_the_apps_pool_gauges_read_its_own_decode_and_render_slots(tiny_weights):
    """A dashboard reads ``captioner_work_running`` by the README's pool names: a decode running must show under
    ``decode`` only, a render under ``render`` only (a swapped or misspelt pool hid which work backs up)."""
    app = create_app(_tiny_settings(tiny_weights))
    with TestClient(app) as client:
        state = app.state.service

        def running():
            samples = parse_metrics(generate_latest(state.metrics.registry).decode())
            return {pool: samples[f'captioner_work_running{{pool="{pool}"}}'] for pool in ("decode", "render")}

        assert client.portal.call(state.decode_slots.run, running) == {"decode": 1, "render": 0}
        assert client.portal.call(state.render_slots.run, running) == {"decode": 0, "render": 1}
