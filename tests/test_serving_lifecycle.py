"""Back-pressure and lifecycle against real ``captioner serve`` processes whose settings differ from the session
server's: a tiny queue (429 + Retry-After), a client that disconnects mid-caption (its rows are freed), a
tiny deadline (504, rows freed) and graceful shutdown (in-flight requests finish).

They serve a deliberately slow random model (a wide LSTM, 4000 words, never confident enough to stop early):
100 decoding steps of about 17 ms each on a 2-core CPU, so that "in flight" lasts long enough to act on, and a
caption cannot finish inside the deadline test's 0.4 s even on a machine several times faster (with a 1024-wide
LSTM it took about 0.4 s here, and on a quiet machine the first request sometimes finished in time)."""

from __future__ import annotations

import asyncio
import io
import json
import signal
import socket
import time

import httpx
import pytest
import torch
from PIL import Image

from captioner.models.checkpoint import save_checkpoint
from captioner.models.encoder import EncoderSpec
from captioner.models.vocab import Vocabulary
from captioner.models.zoo import create

from .conftest import module_folder
from .serving_helpers import ServerProcess, scrape

MAX_LEN = 100
MODEL = '{model="slow"}'
COMMON = {"CAPTIONER_DEFAULT_MODEL": "slow", "CAPTIONER_MAX_MAX_LEN": str(MAX_LEN), "CAPTIONER_MAX_BEAM_SIZE": "3",
          "CAPTIONER_MAX_ROWS": "3", "CAPTIONER_MAX_BATCH_IMAGES": "1", "CAPTIONER_DEVICE": "cpu",
          # the slowness above is PyTorch's: ONNX Runtime (the default `auto` backend) decodes it fast enough to
          # finish inside the tiny deadline
          "CAPTIONER_BACKEND": "torch"}


@pytest.fixture(scope="module")
def slow_weights(request, tmp_path_factory):
    root = module_folder(request, tmp_path_factory, "slow-weights")
    torch.manual_seed(0)
    vocab = Vocabulary([f"w{i}" for i in range(4000)])
    model = create("sat", vocab_size=len(vocab), feat_dim=320, embed_dim=64, hidden_dim=2048, attn_dim=64,
                   dropout=0.0)
    save_checkpoint(root / "slow", model, vocab, EncoderSpec(image_size=64))
    return root


@pytest.fixture(scope="module")
def servers(slow_weights, tmp_path_factory):
    """Both servers start together (their start-up overlaps): one with a queue of 1, one with a 0.4 s deadline."""
    logs = tmp_path_factory.mktemp("lifecycle-logs")
    small_queue = ServerProcess(slow_weights, {**COMMON, "CAPTIONER_QUEUE_SIZE": "1", "CAPTIONER_RETRY_AFTER_S": "2",
                                               "CAPTIONER_DRAIN_TIMEOUT_S": "30"}, logs / "queue.log")
    # no warm-up: admission control has no estimate before the first decoding step, so the deadline test's
    # requests are admitted and must be stopped by the deadline itself (the safety net behind admission control;
    # warmed up, they would be refused at once with 429, as they should be)
    deadline = ServerProcess(slow_weights, {**COMMON, "CAPTIONER_REQUEST_TIMEOUT_S": "0.4",
                                            "CAPTIONER_WARMUP": "false"}, logs / "deadline.log")
    second_signal = ServerProcess(slow_weights, {**COMMON, "CAPTIONER_DRAIN_TIMEOUT_S": "30",
                                                 "CAPTIONER_WARMUP": "false"}, logs / "second-signal.log")
    try:
        yield small_queue.wait_ready(), deadline.wait_ready(), second_signal.wait_ready()
    finally:
        small_queue.stop()
        deadline.stop()
        second_signal.stop()


@pytest.fixture(scope="module")
def png() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (80, 60), (200, 40, 90)).save(buffer, format="PNG")
    return buffer.getvalue()


def wait_for(condition, timeout_s: float = 15, every_s: float = 0.02):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError("condition not met in time")


def caption_params(max_len: int = MAX_LEN) -> dict:
    return {"beam_size": 3, "max_len": max_len}


def test_a_full_queue_answers_429_with_retry_after(servers, png):
    server = servers[0].url

    async def burst():
        async with httpx.AsyncClient(base_url=server, timeout=60) as client:
            return await asyncio.gather(*(client.post("/caption", params=caption_params(),
                                                      files={"file": ("a.png", png, "image/png")})
                                          for _ in range(8)))

    before = scrape(server).get('captioner_rejects_total{reason="overloaded"}', 0)
    responses = asyncio.run(burst())
    statuses = sorted(r.status_code for r in responses)
    # three rows = one request decoding, one more may wait (or none, when the burst arrives while the first request
    # still holds the queue's only slot): everyone else is turned away at once
    assert statuses.count(429) >= 5 and set(statuses) <= {200, 429} and statuses.count(200) >= 1, statuses
    for response in responses:
        if response.status_code == 429:
            assert response.headers["retry-after"] == "2"
            assert response.headers["content-type"].startswith("application/problem+json")
            assert response.json()["type"] == "/problems/overloaded"
    after = scrape(server)['captioner_rejects_total{reason="overloaded"}']
    assert after - before == statuses.count(429)


def test_a_client_that_disconnects_frees_its_rows_within_a_step(servers, png):
    server = servers[0].url
    before = scrape(server)

    async def start_then_hang_up():
        async with httpx.AsyncClient(base_url=server, timeout=60) as client:
            task = asyncio.create_task(client.post("/caption", params=caption_params(),
                                                   files={"file": ("a.png", png, "image/png")}))
            while scrape(server).get(f"captioner_active_rows{MODEL}") != 3:
                assert not task.done(), "the caption finished before the client could hang up"
                await asyncio.sleep(0.02)
            task.cancel()  # closes the connection mid-request
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(start_then_hang_up())
    after = wait_for(lambda: (m := scrape(server)).get(f"captioner_active_rows{MODEL}") == 0 and m)
    freed = after.get('captioner_rows_freed_total{model="slow",reason="cancelled"}', 0) - before.get(
        'captioner_rows_freed_total{model="slow",reason="cancelled"}', 0)
    steps = after[f"captioner_rows_per_step_count{MODEL}"] - before[f"captioner_rows_per_step_count{MODEL}"]
    assert freed == 3, "the request's three rows left the table as cancelled"
    assert steps < MAX_LEN - 10, f"decoding stopped early ({steps} of {MAX_LEN} steps), not at the end"
    assert after['captioner_rejects_total{reason="client-gone"}'] >= 1
    log = [json.loads(line) for line in servers[0].log_path.read_text().splitlines() if line.startswith("{")]
    gone = [e for e in log if e.get("path") == "/caption" and e.get("disconnected")]
    assert gone and gone[-1]["status"] == 499


def test_a_deadline_answers_504_and_frees_the_rows(servers, png):
    server = servers[1].url
    before = scrape(server)

    async def two():
        async with httpx.AsyncClient(base_url=server, timeout=60) as client:
            return await asyncio.gather(*(client.post("/caption", params=caption_params(),
                                                      files={"file": ("a.png", png, "image/png")})
                                          for _ in range(2)))

    started = time.monotonic()
    responses = asyncio.run(two())
    assert time.monotonic() - started < 5
    statuses = sorted(response.status_code for response in responses)
    # the first is admitted before anything is measured and times out while decoding; the second is either given
    # rows at the same boundary and times out too, or refused (429) by the estimate the first steps give (100 steps
    # cannot fit in 0.4 s): at the door, or shed while it waits for rows
    assert statuses in ([429, 504], [504, 504]), [r.text for r in responses]
    for response in responses:
        if response.status_code == 504:
            assert response.json()["type"] == "/problems/deadline"
        else:
            assert response.json()["type"] == "/problems/overloaded" and int(response.headers["retry-after"]) >= 1
    label = 'captioner_rows_freed_total{model="slow",reason="deadline"}'
    # the request that times out frees its 3 rows: at once when its deadline passes while it decodes, or at the
    # step boundary after it joins the table when the deadline passed while it was being encoded (the server's
    # first encode pays first-use costs, and rows being encoded are not yet counted as active, so "no active rows"
    # alone can be read before the rows are freed); on a loaded machine a second admitted one can get the rows
    # the first freed just before its own deadline passes, and then frees them in turn
    after = wait_for(lambda: (m := scrape(server)).get(f"captioner_active_rows{MODEL}") == 0
                     and m.get(label, 0) - before.get(label, 0) >= 3 and m)
    assert after.get(label, 0) - before.get(label, 0) in (3, 6)
    assert after['captioner_rejects_total{reason="deadline"}'] - before.get(
        'captioner_rejects_total{reason="deadline"}', 0) == statuses.count(504)
    # the freed rows are usable at once: a short caption fits in the deadline
    quick = httpx.post(f"{server}/caption", params=caption_params(max_len=2),
                       files={"file": ("a.png", png, "image/png")}, timeout=60)
    assert quick.status_code == 200, quick.text


def test_an_upload_slower_than_the_deadline_is_cut_off_with_408_and_never_decoded(servers, png):
    server = servers[1].url
    label = 'captioner_rows_freed_total{model="slow",reason="deadline"}'
    before = scrape(server)

    def trickle():  # the image in four parts, a quarter of a second apart: 0.75 s against the 0.4 s deadline
        step = -(-len(png) // 4)
        for start in range(0, len(png), step):
            yield png[start:start + step]
            time.sleep(0.25)

    response = httpx.post(f"{server}/caption", content=trickle(), headers={"content-type": "image/png"}, timeout=60)
    assert response.status_code == 408, response.text
    assert response.json()["type"] == "/problems/upload-timeout" and "0.4 s" in response.json()["detail"]
    after = scrape(server)
    assert after.get(label, 0) == before.get(label, 0)  # it never reached the decoding table


def test_a_stalled_upload_gets_its_408_at_the_deadline_not_after_waiting_for_the_rest(servers, png):
    """An answer given before the body is read waits while the rest is read and dropped (so that a proxy speaking
    HTTP/1.0 gets it, not a reset), but not the 408 of an upload that stopped arriving: its rest may never come."""
    port = int(servers[1].url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
        started = time.monotonic()
        client.sendall(f"POST /caption HTTP/1.0\r\nContent-Type: image/png\r\nContent-Length: {len(png)}\r\n\r\n"
                       .encode() + png[:len(png) // 2])
        status = client.makefile("rb").readline().decode()
        waited = time.monotonic() - started
    assert status.startswith("HTTP/1.1 408 ") and waited < 1.5, (status, waited)  # 0.4 s deadline, 2 s drain


def test_graceful_shutdown_finishes_in_flight_requests(servers, png):
    """Runs last in this module: it stops the small-queue server."""
    process = servers[0]

    async def caption_then_sigterm():
        async with httpx.AsyncClient(base_url=process.url, timeout=60) as client:
            task = asyncio.create_task(client.post("/caption", params=caption_params(),
                                                   files={"file": ("a.png", png, "image/png")}))
            while scrape(process.url).get(f"captioner_active_rows{MODEL}") != 3:
                await asyncio.sleep(0.02)
            process.proc.send_signal(signal.SIGTERM)
            return await task

    response = asyncio.run(caption_then_sigterm())
    assert response.status_code == 200 and len(response.json()["tokens"]) == MAX_LEN
    # uvicorn re-raises the SIGTERM it handled once it has shut down cleanly
    assert process.proc.wait(timeout=30) in (0, -signal.SIGTERM)
    assert "Application shutdown complete" in process.log_path.read_text()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{process.url}/healthz", timeout=2)


def test_a_second_signal_skips_the_rest_of_the_drain(servers):
    """An upload that never finishes holds the drain for its whole budget (30 s); a second SIGTERM ends the wait
    at once, where uvicorn's own handling of it waited its graceful-shutdown timeout, longer than the drain."""
    process = servers[2]
    with socket.create_connection(("127.0.0.1", process.port), timeout=10) as sock:
        sock.sendall(b"POST /caption HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\nContent-Length: 100000\r\n"
                     b"\r\n\x89PNG")  # and nothing more: in flight until its 60 s upload deadline
        time.sleep(0.5)
        process.proc.send_signal(signal.SIGTERM)
        time.sleep(1.5)
        assert process.proc.poll() is None, "the first signal drains: the upload in flight holds it"
        second = time.monotonic()
        process.proc.send_signal(signal.SIGTERM)
        process.proc.wait(timeout=20)
        assert time.monotonic() - second < 5, "the second signal ended the wait"
