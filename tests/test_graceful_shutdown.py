"""Graceful shutdown of a real ``captioner serve`` process (service/lifecycle.py): on SIGTERM ``/readyz`` turns
503 at once, new requests get 503 + ``Retry-After``, the request admitted before the signal still gets its
caption, and the process exits 0 — the contract the Kubernetes manifests (docker/k8s/) rely on.

"In flight" is made deterministic by the client, not by a slow model: the admitted request uploads half of its
body, the test sends SIGTERM and checks the other endpoints, then the upload finishes."""

from __future__ import annotations

import contextlib
import io
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from PIL import Image

from captioner.models.checkpoint import save_checkpoint

from .serving_helpers import TINY_SPEC, VOCAB, ServerProcess, tiny_model


@pytest.fixture(scope="module")
def tiny_weights(tmp_path_factory):
    root = tmp_path_factory.mktemp("shutdown-weights")
    save_checkpoint(root / "tiny", tiny_model("sat"), VOCAB, TINY_SPEC)
    return root


def png_bytes() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (64, 48), (30, 160, 90)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_sigterm_drains_admitted_requests_rejects_new_ones_and_exits_0(tiny_weights, tmp_path):
    server = ServerProcess(tiny_weights, {"CAPTIONER_DEFAULT_MODEL": "tiny", "CAPTIONER_DEVICE": "cpu",
                                          "CAPTIONER_WARMUP": "false", "CAPTIONER_DRAIN_TIMEOUT_S": "20"},
                           tmp_path / "server.log")
    try:
        server.wait_ready(timeout_s=120)
        body, content_type = png_bytes(), "image/png"  # the raw-bytes form of POST /caption
        half_sent, finish_upload = threading.Event(), threading.Event()

        def slow_upload():
            yield body[: len(body) // 2]
            half_sent.set()
            finish_upload.wait(timeout=30)
            yield body[len(body) // 2:]

        admitted: dict = {}

        def send_admitted_request():
            try:
                admitted["response"] = httpx.post(f"{server.url}/caption", content=slow_upload(), timeout=60,
                                                  headers={"content-type": content_type})
            except httpx.HTTPError as exc:  # reported by the assertion below
                admitted["error"] = exc

        client = threading.Thread(target=send_admitted_request)
        client.start()
        assert half_sent.wait(timeout=30)
        time.sleep(0.3)  # the headers and the first half are at the server: the request is admitted

        signalled = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        readiness = None
        while time.monotonic() - signalled < 5:
            readiness = httpx.get(f"{server.url}/readyz", timeout=5)
            if readiness.status_code == 503:
                break
            time.sleep(0.01)
        flipped_after_s = time.monotonic() - signalled
        assert readiness is not None and readiness.status_code == 503, readiness and readiness.text
        assert flipped_after_s < 1.0  # "at once": one signal delivery and one event-loop turn
        assert readiness.headers["retry-after"] == "5"

        rejected = httpx.post(f"{server.url}/caption", content=body, headers={"content-type": content_type},
                              timeout=10)
        assert rejected.status_code == 503
        assert rejected.headers["retry-after"] == "5"
        assert rejected.headers["content-type"] == "application/problem+json"
        assert rejected.json()["status"] == 503 and rejected.json()["type"] == "/problems/not-ready"
        # liveness and monitoring keep answering while draining: the orchestrator must not restart the process
        assert httpx.get(f"{server.url}/healthz", timeout=5).status_code == 200
        assert server.proc.poll() is None  # still draining: the admitted request has not finished

        finish_upload.set()
        client.join(timeout=60)
        assert "error" not in admitted, admitted.get("error")
        response = admitted["response"]
        assert response.status_code == 200, response.text
        assert response.json()["model"] == "tiny" and response.json()["tokens"]

        assert server.proc.wait(timeout=30) == 0, server.log()
        log = server.log_path.read_text()
        assert "draining" in log and "Application shutdown complete" in log
    finally:
        finish_upload_event = locals().get("finish_upload")
        if finish_upload_event is not None:
            finish_upload_event.set()
        server.stop()


def test_sigusr1_writes_every_threads_stack_and_the_server_keeps_serving(tiny_weights, tmp_path):
    server = ServerProcess(tiny_weights, {"CAPTIONER_DEFAULT_MODEL": "tiny", "CAPTIONER_DEVICE": "cpu",
                                          "CAPTIONER_WARMUP": "false"}, tmp_path / "server.log")
    try:
        server.wait_ready(timeout_s=120)
        server.proc.send_signal(signal.SIGUSR1)
        # faulthandler's dump: the batcher's worker thread waiting for requests, and the event loop's thread. It is
        # written thread by thread, in no order the test can rely on: wait for every part (a loaded machine may not
        # schedule the dump for seconds), not for one of them (CI once read it after the main thread's stack alone)
        expected = ("service/batcher.py", "in _run", "in cmd_serve")
        deadline = time.monotonic() + 30
        while not all(part in server.log_path.read_text() for part in expected) and time.monotonic() < deadline:
            time.sleep(0.05)
        log = server.log_path.read_text()
        assert all(part in log for part in expected), log[-2000:]
        response = httpx.post(f"{server.url}/caption", content=png_bytes(), headers={"content-type": "image/png"},
                              timeout=30)
        assert response.status_code == 200, response.text
        assert server.proc.poll() is None
    finally:
        server.stop()


def _children_of(pid: int) -> set[int]:
    children = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:  # the field after the state is the parent's pid
                children.add(int(stat.parent.name))
    return children


def test_a_signal_while_the_models_load_exits_at_once_and_stops_the_export_child(tmp_path):
    """uvicorn looked at a SIGTERM only once start-up had finished (the operator audit: 25 s of exports and loading
    after the signal, then exit 143), so docker stop and a pod's deletion ended in SIGKILL."""
    weights = tmp_path / "weights"
    for seed in range(12):  # enough first-start exports that the signal comes while the child makes them
        save_checkpoint(weights / f"tiny-{seed}", tiny_model("sat", seed=seed), VOCAB, TINY_SPEC)
    server = ServerProcess(weights, {"CAPTIONER_DEFAULT_MODEL": "tiny-0", "CAPTIONER_DEVICE": "cpu",
                                     "CAPTIONER_ONNX_DIR": str(tmp_path / "onnx")}, tmp_path / "server.log")
    try:
        deadline = time.monotonic() + 120
        while "their ONNX exports are made in a child process" not in server.log_path.read_text():
            assert server.proc.poll() is None and time.monotonic() < deadline, server.log()
            time.sleep(0.1)
        deadline = time.monotonic() + 30
        while not (children := _children_of(server.proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert children, "the export child did not start"
        signalled = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=20) == 0, server.log()
        assert time.monotonic() - signalled < 10
        assert "during start-up: exiting before serving" in server.log()
        deadline = time.monotonic() + 10
        while any(Path(f"/proc/{pid}").exists() for pid in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(Path(f"/proc/{pid}").exists() for pid in children), "the export child outlived the server"
    finally:
        server.stop()
