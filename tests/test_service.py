"""HTTP end to end: real image bytes through FastAPI, problem responses, and a real uvicorn process."""

import asyncio
import base64
import gc
import inspect
import io
import json
import os
import threading
import time
import tomllib

import httpx
import numpy as np
import pytest
import torch
from fastapi import FastAPI
from fastapi.testclient import TestClient
from PIL import Image
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from skimage import data
from starlette.requests import Request

from captioner.models.checkpoint import save_checkpoint
from captioner.models.data.scenes import generate, named_objects
from captioner.models.encoder import EncoderSpec
from captioner.models.vocab import Vocabulary
from captioner.models.zoo import create
from captioner.service import app as app_module
from captioner.service import captioning, inputs, routes
from captioner.service.admission import WouldMissDeadline
from captioner.service.app import create_app
from captioner.service.batcher import Batcher, BeamTooWide, DeadlineExceeded, NotAccepting, QueueFull
from captioner.service.captioning import batcher_errors
from captioner.service.errors import ClientGone, DeadlinePassed, InvalidRequest, NotReady, Overloaded, UnknownResult
from captioner.service.inputs import drain_body
from captioner.service.onnx_exports import unprepared
from captioner.service.problems import install_problem_handlers, problem_of
from captioner.service.settings import Settings, json_body_bytes
from captioner.service.state import ServiceState

from .conftest import ROOT, WEIGHTS, module_folder
from .serving_helpers import assert_every_architecture_round_trips, parse_metrics, record_event_loop_calls


def _png(image: Image.Image, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def tiny_weights(request, tmp_path_factory):
    root = module_folder(request, tmp_path_factory, "weights")
    vocab = Vocabulary(["a", "red", "circle"])
    for seed, name in enumerate(("tiny-a", "tiny-b")):
        # seeded: unseeded, the weights (and how peaked their attention rows are) depended on which tests ran first
        torch.manual_seed(seed)
        model = create("sat", vocab_size=len(vocab), feat_dim=320, embed_dim=16, hidden_dim=16, attn_dim=8)
        save_checkpoint(root / name, model, vocab, EncoderSpec(image_size=96))
    (root / "not-a-checkpoint").mkdir()
    return root


@pytest.fixture(scope="module")
def client(tiny_weights):
    app = create_app(Settings(weights_dir=tiny_weights, default_model="tiny-a", max_upload_bytes=200_000,
                              max_pixels=1_000_000))
    with TestClient(app) as c:
        yield c


def _post(client, content: bytes, **params):
    return client.post("/caption", params=params, files={"file": ("upload", content, "application/octet-stream")})


def test_caption_json_follows_the_export_format(client):
    response = _post(client, _png(Image.fromarray(data.coffee()), "JPEG"), beam_size=2, max_len=5)
    assert response.status_code == 200
    body = response.json()
    assert body["model"] == "tiny-a" and body["beam_size"] == 2
    assert len(body["tokens"]) == len(body["attention"]) == len(body["token_logprobs"]) == len(body["is_eos"])
    assert body["geometry"]["grid_hw"] == [3, 3] and body["geometry"]["image_size"] == [600, 400]
    assert len(body["geometry"]["boxes"]) == 9 == len(body["attention"][0])
    assert all(abs(sum(row) - 1) < 1e-4 for row in body["attention"])
    assert body["caption"] == " ".join(t for t in body["tokens"] if t != "<eos>")


def test_models_are_listed_and_selectable(client):
    models = client.get("/models").json()
    assert [m["name"] for m in models] == ["tiny-a", "tiny-b"]
    assert models[0]["default"] and models[0]["architecture"] == "sat" and models[0]["checksum"].startswith("sha256:")
    assert _post(client, _png(Image.new("RGB", (50, 50))), model="tiny-b").json()["model"] == "tiny-b"


@pytest.mark.parametrize("content,status,kind", [
    (b"definitely not an image", 422, "invalid-image"),
    (b"", 422, "invalid-image"),
    (_png(Image.fromarray(data.astronaut()), "JPEG")[:3000], 422, "invalid-image"),
    (_png(Image.new("L", (40, 30)), "SPIDER"), 422, "invalid-image"),  # a valid file Pillow failed to decode: was a 500
    (_png(Image.new("RGB", (1100, 1000))), 413, "image-too-large"),
    (os.urandom(300_000), 413, "upload-too-large"),
])
def test_bad_uploads_get_problem_responses(client, content, status, kind):
    response = _post(client, content)
    assert response.status_code == status
    assert response.headers["content-type"].startswith("application/problem+json")
    body = response.json()
    assert body["status"] == status and body["type"].endswith(kind) and body["detail"]


def test_bad_parameters_get_problem_responses(client):
    image = _png(Image.new("RGB", (20, 20)))
    assert _post(client, image, model="nope").status_code == 404
    assert _post(client, image, beam_size=0).status_code == 422
    assert _post(client, image, beam_size=99).status_code == 422
    # an empty query value names no option, as an empty form field does (it was a 422 "unable to parse")
    assert _post(client, image, beam_size="", length_penalty="", block_trigrams="", model="").status_code == 200
    nan = _post(client, image, length_penalty="nan")  # was "Input should be less than or equal to 5"
    assert nan.status_code == 422 and "finite number" in nan.json()["detail"]
    missing = client.post("/caption")
    assert missing.status_code == 422 and missing.json()["errors"][0]["loc"] == ["body", "file"]


def test_health_and_readiness(client):
    assert client.get("/healthz").json() == {"status": "ok", "models": []}
    assert client.get("/readyz").json() == {"status": "ready", "models": ["tiny-a", "tiny-b"]}
    assert client.get("/metrics").headers["content-type"] == CONTENT_TYPE_LATEST
    assert "/caption" in client.get("/openapi.json").json()["paths"]


def test_the_routes_are_documented_with_their_summaries_and_answers(client):
    """What /docs and a generated client read: each route's summary and the schema of its 200 answer."""
    paths = client.get("/openapi.json").json()["paths"]
    documented = {path: (operation["summary"], operation["responses"]["200"]["content"])
                  for path in ("/caption", "/models", "/healthz", "/readyz", "/metrics")
                  for operation in paths[path].values()}
    health = {"application/json": {"schema": {"$ref": "#/components/schemas/Health"}}}
    assert documented == {
        "/caption": ("Caption an uploaded image, with per-word attention",
                     {"application/json": {"schema": {"$ref": "#/components/schemas/CaptionOut"}}}),
        "/models": ("Models this service can caption with", {"application/json": {"schema": {
            "items": {"$ref": "#/components/schemas/ModelOut"}, "type": "array", "title": "Response List Models"}}}),
        "/healthz": ("Liveness: the process answers (503 once loading failed)", health),
        "/readyz": ("Readiness: models are loaded and warm", health),
        "/metrics": ("Prometheus metrics", {"text/plain": {"schema": {"type": "string"}}})}


def test_every_reference_in_the_openapi_document_resolves(client):
    # the overlays' JSON answer (now the /heatmaps routes') inlined a schema whose "$ref": "#/$defs/HeatmapOut"
    # pointed at nothing: no validator or client generator could read it
    document = client.get("/openapi.json").json()

    def refs(node):
        if isinstance(node, dict):
            yield from ([node["$ref"]] if isinstance(node.get("$ref"), str) else [])
            for value in node.values():
                yield from refs(value)
        elif isinstance(node, list):
            for value in node:
                yield from refs(value)

    # and the headers the README promises are documented where they are sent
    overlay = document["paths"]["/caption/overlay"]["post"]["responses"]
    assert {"X-Request-ID", "X-Caption-Id", "X-Heatmap-Mode"} <= set(overlay["200"]["headers"])
    assert "Retry-After" in overlay["429"]["headers"] and "WWW-Authenticate" in overlay["401"]["headers"]
    found = set(refs(document))
    assert "#/components/schemas/HeatmapsOut" in found
    for ref in found:
        node = document
        for part in ref.removeprefix("#/").split("/"):
            assert isinstance(node, dict) and part in node, f"{ref} points at nothing"
            node = node[part]


# -- the shipped default checkpoint through a real server process (fixture `server` in conftest) ---------------
def test_default_model_names_the_objects_of_a_generated_test_scene(server, tmp_path):
    dataset = json.loads(generate(tmp_path, {"test": 6}, seed=123, progress=False).read_text())
    named = []
    for entry in dataset["images"]:
        content = (tmp_path / "images" / entry["filename"]).read_bytes()
        response = httpx.post(f"{server}/caption", files={"file": (entry["filename"], content, "image/jpeg")},
                              timeout=60)
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["model"] == "sat" and body["geometry"]["grid_hw"] == [16, 16]
        named += named_objects(body["tokens"], entry["objects"])
    assert np.mean(named) >= 0.75, f"only {np.mean(named):.0%} of objects named"


def test_default_model_captions_a_real_photo(server):
    response = httpx.post(f"{server}/caption", files={"file": ("cat.jpg", _png(Image.fromarray(data.chelsea()), "JPEG"),
                                                               "image/jpeg")}, timeout=60)
    assert response.status_code == 200
    body = response.json()
    assert body["caption"] and body["geometry"]["image_size"] == [451, 300]
    assert all(abs(sum(row) - 1) < 1e-4 for row in body["attention"])


def test_every_shipped_checkpoint_is_served_side_by_side(server, tmp_path):
    shipped = sorted(p.name for p in WEIGHTS.iterdir() if (p / "model.safetensors").exists())
    listed = {m["name"]: m for m in httpx.get(f"{server}/models").json()}
    assert sorted(listed) == shipped
    dataset = json.loads(generate(tmp_path, {"test": 1}, seed=5, progress=False).read_text())
    content = (tmp_path / "images" / dataset["images"][0]["filename"]).read_bytes()
    for name in shipped:
        response = httpx.post(f"{server}/caption", params={"model": name},
                              files={"file": ("scene.jpg", content, "image/jpeg")}, timeout=120)
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["model"] == name and body["caption"]
        assert all(abs(sum(row) - 1) < 1e-4 for row in body["attention"])
        if listed[name]["attention"] == "tvmax":
            assert any(0.0 in row for row in body["attention"]), "TVmax attention keeps exact zeros in the JSON"


def test_every_registered_architecture_round_trips_through_a_checkpoint_and_post_caption(tmp_path):
    """On PyTorch: each architecture's ONNX graphs are compared with PyTorch in test_serving_onnx.py, and the HTTP
    layers above the runtime are the same for every backend (exporting eight models here took two thirds of the
    test's time)."""
    assert_every_architecture_round_trips(tmp_path, _png(Image.fromarray(data.astronaut()), "JPEG"), backend="torch")


def test_start_up_objects_are_frozen_out_of_the_collector_while_serving(tiny_weights):
    """A full garbage collection holds the GIL while it walks every tracked object (about 400,000 after the
    imports and weights: 0.2 s on the 2-core CI machine), stalling every request; the app freezes what start-up
    left so that later collections walk only what serving allocated, and unfreezes at shutdown."""
    gc.unfreeze()
    with TestClient(create_app(Settings(weights_dir=tiny_weights, default_model="tiny-a", warmup=False))) as client:
        assert client.get("/readyz").status_code == 200
        frozen = gc.get_freeze_count()
        assert frozen > 10_000  # the modules, models and everything else alive at start-up
    assert gc.get_freeze_count() == 0


def test_a_default_model_that_is_not_here_is_replaced_by_the_first_by_name(tiny_weights):
    """A mistyped CAPTIONER_DEFAULT_MODEL serves the first checkpoint by name, not a 404 for every request that
    names no model."""
    settings = Settings(weights_dir=tiny_weights, default_model="nobody", warmup=False, backend="torch")
    with TestClient(create_app(settings)) as client:
        listed = {model["name"]: model["default"] for model in client.get("/models").json()}
    assert listed == {"tiny-a": True, "tiny-b": False}


def test_an_app_that_has_shut_down_is_not_ready(tiny_weights):
    """Its batchers are stopped: an app object that outlives its lifespan (a library user's, a mount's) must not
    answer ready."""
    with TestClient(create_app(Settings(weights_dir=tiny_weights, default_model="tiny-a", warmup=False,
                                        backend="torch"))) as client:
        assert client.get("/readyz").status_code == 200
    not_ready = client.get("/readyz")
    # a 503 says when to ask again: the 5 s the settings' table gives for 503 answers
    assert not_ready.status_code == 503 and not_ready.headers["retry-after"] == "5"
    assert not_ready.json()["type"] == "/problems/not-ready"


def test_readiness_names_the_loaded_models_sorted_whatever_order_they_were_loaded_in():
    """The runtimes hold the models in the order they were found (a weights folder's, then the listed checkpoints'),
    which need not be by name: /readyz lists them by name (the loaded ones here were found b first)."""
    state = ServiceState(settings=Settings(), ready=True, runtimes={"tiny-b": object(), "tiny-a": object()})
    assert asyncio.run(routes.readyz(state)).models == ["tiny-a", "tiny-b"]


def test_a_failed_background_load_is_logged_and_turns_liveness_503(tiny_weights, monkeypatch, caplog):
    """With load_in_background the server listens before loading; a load that fails must not leave a process
    that is live and never ready without a word: the error is logged at once and /healthz answers 503."""
    def broken(*args, **kwargs):
        raise RuntimeError("out of memory while loading")

    monkeypatch.setattr(app_module, "iter_runtimes", broken)
    settings = Settings(weights_dir=tiny_weights, default_model="tiny-a", load_in_background=True, warmup=False,
                        backend="torch")
    with caplog.at_level("ERROR", logger="captioner.app"), TestClient(create_app(settings)) as client:
        for _ in range(200):
            health = client.get("/healthz")
            if health.status_code != 200:
                break
            time.sleep(0.05)
        assert health.status_code == 503 and health.json()["type"] == "/problems/load-failed"
        # the error's type too: the message alone of a KeyError ('decoder.weight') or an OSError says little
        assert health.json()["detail"] == "loading the models failed: RuntimeError: out of memory while loading"
        assert client.get("/readyz").status_code == 503
    assert any("out of memory while loading" in r.getMessage() and r.exc_info for r in caplog.records)


def test_an_upload_refused_before_its_body_is_read_has_it_read_first(tiny_weights, monkeypatch):
    """Every refusal made before the body is read drains it (a connection closed with unread data in it is reset,
    and the client sees the reset instead of the answer): the 503 of a server not ready was left unread."""
    drained = []

    async def drain(request, limit):
        drained.append(limit)

    def broken(*args, **kwargs):
        raise RuntimeError("out of memory while loading")

    monkeypatch.setattr(inputs, "drain_body", drain)  # UnreadBodyMiddleware's, for every such answer
    monkeypatch.setattr(app_module, "iter_runtimes", broken)
    settings = Settings(weights_dir=tiny_weights, default_model="tiny-a", load_in_background=True, warmup=False,
                        backend="torch")
    with TestClient(create_app(settings)) as client:
        for _ in range(200):
            if client.get("/healthz").status_code != 200:
                break
            time.sleep(0.05)
        refused = client.post("/caption", files={"file": ("a.png", b"not read", "image/png")})
    assert refused.status_code == 503 and drained


def test_a_value_error_while_decoding_is_a_500_not_the_clients_422(tiny_weights, monkeypatch, caplog):
    """Only the batcher's own refusal of a too-wide beam is the client's 422: any other ValueError from the worker
    (a bug in decoding) reached the client as 422 invalid-request, with the internal message in it. The 500 tells
    the client nothing; the log tells whoever runs the server, traceback and all."""
    async def broken(*args, **kwargs):
        raise ValueError("need 1 <= n_best <= k")

    monkeypatch.setattr(Batcher, "caption", broken)
    app = create_app(Settings(weights_dir=tiny_weights, default_model="tiny-a", warmup=False))
    with caplog.at_level("ERROR", logger="captioner.app"), TestClient(app, raise_server_exceptions=False) as client:
        response = _post(client, _png(Image.fromarray(data.coffee()), "PNG"), beam_size=2, max_len=5)
        latency = parse_metrics(client.get("/metrics").text)
    assert response.status_code == 500 and "n_best" not in response.text
    assert [str(r.exc_info[1]) for r in caplog.records if r.name == "captioner.app" and r.exc_info] == [
        "need 1 <= n_best <= k"]
    # the latency metric counts it under the status it was answered with
    assert latency['captioner_request_latency_seconds_count{model="tiny-a",status="500"}'] == 1


def test_a_start_that_fails_in_the_foreground_stops_the_batchers_it_started(tiny_weights, monkeypatch):
    """A warm-up that fails (out of memory, say) ended the start before the lifespan's yield, and its shutdown
    code, after the yield, never ran: the batchers' threads and models stayed alive in the process."""
    async def failing_warm_up(batcher, settings):
        raise RuntimeError("out of memory while warming up")

    monkeypatch.setattr(app_module, "warm_up", failing_warm_up)
    app = create_app(Settings(weights_dir=tiny_weights, default_model="tiny-a", backend="torch"))
    with pytest.raises(RuntimeError, match="warming up"), TestClient(app):
        pass
    batchers = list(app.state.service.batchers.values())
    assert batchers and not any(b._thread.is_alive() for b in batchers)


def test_the_batchers_stop_within_what_is_left_of_the_drain_budget(tiny_weights, monkeypatch):
    """After a SIGTERM drain that used its budget, stopping the batchers waited the budget again (30 + 30 s against a
    pod's 45-s grace period): they get what is left of it."""
    given = []
    original = Batcher.stop

    async def recording_stop(self, timeout_s: float = 30.0):
        given.append(timeout_s)
        await original(self, timeout_s)

    monkeypatch.setattr(Batcher, "stop", recording_stop)
    settings = Settings(weights_dir=tiny_weights, default_model="tiny-a", backend="torch", warmup=False)
    app = create_app(settings)
    with TestClient(app):
        gate = app.state.shutdown_gate
        gate.begin_drain()
        gate.drain_began = time.monotonic() - (settings.drain_timeout_s - 2)  # the drain took all but 2 s
    assert given and all(1.0 <= t <= 2.5 for t in given), given
    assert create_app(settings).state.shutdown_gate.time_left(settings.drain_timeout_s) == settings.drain_timeout_s


@pytest.mark.parametrize("clean_up_steps", [0, 1], ids=["at-once", "awaiting-its-clean-up"])
def test_a_shutdown_while_the_models_load_in_the_background_cancels_the_load_first(tiny_weights, monkeypatch,
                                                                                  clean_up_steps):
    """A stop during a background start (a rollout that gives up, ``docker stop``) ends the load where it is, then
    stops the batchers: it neither waits for every model to be loaded and warmed up, nor stops the batchers while
    the load goes on (it could start another after them, left running). A load's cancellation can take more than
    one step of the event loop (a warm-up that cancels its captions in flight and awaits their ends): the shutdown
    waits for the load to be over, or it stopped the batchers while the load still used them."""
    warming, events = threading.Event(), []
    original_stop = Batcher.stop

    async def endless_warm_up(batcher, settings):
        warming.set()
        try:
            await asyncio.sleep(5)  # far longer than the test; a shutdown that waits for it is the bug
        except asyncio.CancelledError:
            for _ in range(clean_up_steps):  # its clean-up awaits, as a warm-up's captions in flight would be
                await asyncio.sleep(0)
            events.append(f"load of {batcher.runtime.name} cancelled")
            raise

    async def recording_stop(self, timeout_s: float = 30.0):
        events.append(f"batcher {self.runtime.name} stopped")
        await original_stop(self, timeout_s)

    monkeypatch.setattr(app_module, "warm_up", endless_warm_up)
    monkeypatch.setattr(Batcher, "stop", recording_stop)
    settings = Settings(weights_dir=tiny_weights, default_model="tiny-a", load_in_background=True, backend="torch")
    app = create_app(settings)
    with TestClient(app) as client:
        assert warming.wait(30)
        assert client.get("/readyz").status_code == 503
    assert events == ["load of tiny-a cancelled", "batcher tiny-a stopped"]
    assert not any(batcher._thread.is_alive() for batcher in app.state.service.batchers.values())


def test_the_ready_gauge_is_one_while_serving_and_zero_once_the_app_has_shut_down(tiny_weights):
    """``captioner_ready`` follows ``/readyz``: set once the models are warm, cleared by the shutdown (an app object
    that outlives its lifespan answers its metrics too)."""
    settings = Settings(weights_dir=tiny_weights, default_model="tiny-a", warmup=False, backend="torch")
    with TestClient(create_app(settings)) as client:
        assert parse_metrics(client.get("/metrics").text)["captioner_ready"] == 1
    assert parse_metrics(client.get("/metrics").text)["captioner_ready"] == 0


@pytest.fixture
def export_children(monkeypatch):
    """The child processes a first start makes for its ONNX exports, stood in for: each records the models it was
    given and how the start ended it (``stop`` or ``join``)."""
    made = []

    class RecordingPreparingChild:
        def __init__(self, weights_dir, checkpoints, only, **options):
            self.only, self.ended = only, []
            made.append(self)

        def wait_for(self, name: str) -> None:
            pass

        def stop(self) -> None:
            self.ended.append("stop")

        def join(self) -> None:
            self.ended.append("join")

    monkeypatch.setattr(app_module, "PreparingChild", RecordingPreparingChild)
    return made


@pytest.mark.parametrize("missing, warm_up_fails", [([], False), (["tiny-a"], False), (["tiny-a"], True)])
def test_a_first_starts_export_child_runs_only_for_missing_exports_and_is_stopped_when_the_start_fails(
        tiny_weights, monkeypatch, export_children, missing, warm_up_fails):
    """Models whose exports are made already need no child; otherwise the child that prepares them is joined once
    every model is served, and when the start fails (a warm-up out of memory, say) it is stopped at once, not
    waited for while it exports the models still to come, and the failure is the start's."""
    async def failing_warm_up(batcher, settings):
        raise RuntimeError("out of memory while warming up")

    monkeypatch.setattr(app_module, "unprepared", lambda *found, **placed: missing)
    if warm_up_fails:
        monkeypatch.setattr(app_module, "warm_up", failing_warm_up)
    app = create_app(Settings(weights_dir=tiny_weights, default_model="tiny-a", backend="torch", warmup=warm_up_fails))
    if warm_up_fails:
        with pytest.raises(RuntimeError, match="warming up"), TestClient(app):
            pass
    else:
        with TestClient(app) as client:
            assert client.get("/readyz").status_code == 200
    assert [(child.only, child.ended) for child in export_children] == (
        [] if not missing else [(missing, ["stop"] if warm_up_fails else ["join"])])


def test_a_background_load_that_succeeds_leaves_the_server_live_and_ready(tiny_weights):
    """Only a load that failed turns ``/healthz`` 503 (an orchestrator then restarts the process): one that
    succeeded, in the background, must leave it live for good."""
    settings = Settings(weights_dir=tiny_weights, default_model="tiny-a", load_in_background=True, warmup=False,
                        backend="torch")
    with TestClient(create_app(settings)) as client:
        for _ in range(600):
            if client.get("/readyz").status_code == 200:
                break
            time.sleep(0.05)
        assert client.get("/readyz").status_code == 200
        assert client.get("/healthz").status_code == 200
        assert client.app.state.service.load_failure is None


def test_the_app_sets_the_thread_counts_of_its_settings_before_loading(tiny_weights, monkeypatch):
    """CAPTIONER_THREADS and CAPTIONER_INTEROP_THREADS reach PyTorch when the app starts."""
    given = []
    monkeypatch.setattr(app_module, "set_threads", lambda threads, interop: given.append((threads, interop)))
    settings = Settings(weights_dir=tiny_weights, default_model="tiny-a", warmup=False, backend="torch", threads=1,
                        interop_threads=2)
    with TestClient(create_app(settings)):
        pass
    assert given == [(1, 2)]


def test_the_models_are_loaded_with_the_thread_count_and_device_of_the_settings():
    """CAPTIONER_THREADS reaches the ONNX Runtime sessions the models run in (``model_loading``), not only PyTorch's
    own count (test above): dropped on the way, an ONNX-served model took one thread per core whatever was set."""
    settings = Settings(threads=3, device="cpu", precision="bfloat16", encoder_precision="int8")
    loading = settings.model_loading()
    assert (loading["threads"], loading["device_name"]) == (3, "cpu")
    assert {name: loading[name] for name in settings.model_placement()} == settings.model_placement()


def test_the_placement_the_models_start_with_is_every_placement_setting_under_its_loaders_keyword(tmp_path):
    """``model_placement`` hands the settings to ``onnx_exports.unprepared`` and ``runtime.load_runtimes`` by
    keyword, and both default a keyword left out: a setting dropped on the way (CAPTIONER_ENCODER_PRECISION=int8)
    served float32 in silence.  Each is given a value other than its default here, so a dropped one shows."""
    settings = Settings(onnx_dir=tmp_path / "onnx", prefixed_weights_dirs={"p-": tmp_path / "w"},
                        backends={"a": "onnx"}, backend="hybrid", encoder_precision="int8", precision="bfloat16")
    assert settings.model_placement() == dict(onnx_dir=tmp_path / "onnx", prefixed={"p-": tmp_path / "w"},
                                              backends={"a": "onnx"}, default_backend="hybrid",
                                              encoder_precision="int8", precision="bfloat16")
    keywords = {name for name, parameter in inspect.signature(unprepared).parameters.items()
                if parameter.kind is inspect.Parameter.KEYWORD_ONLY}
    assert set(settings.model_placement()) == keywords


def test_the_app_loads_its_models_with_the_precision_of_its_settings(tiny_weights):
    """CAPTIONER_PRECISION reaches the models the app loads: dropped on the way, a server asked for bfloat16 served
    float32, at float32's speed and memory, and said nothing."""
    settings = Settings(weights_dir=tiny_weights, default_model="tiny-a", warmup=False, backend="torch",
                        precision="bfloat16")
    with TestClient(create_app(settings)) as client:
        runtimes = client.app.state.service.runtimes
        assert sorted(runtimes) == ["tiny-a", "tiny-b"]
        assert {runtime.precision for runtime in runtimes.values()} == {"bfloat16"}


@pytest.mark.parametrize("page_out", [False, True])
def test_the_gpu_libraries_are_paged_out_only_when_asked_and_no_gpu_can_use_them(tiny_weights, monkeypatch, page_out):
    """CAPTIONER_PAGE_OUT_GPU_LIBRARIES: after warm-up, the CUDA libraries' pages are given back on a machine that
    cannot run them, and left alone when the setting is off."""
    paged = []
    monkeypatch.setattr(app_module, "page_out_gpu_libraries", lambda: paged.append(1))
    monkeypatch.setattr(app_module, "release_memory", lambda: 0)
    settings = Settings(weights_dir=tiny_weights, default_model="tiny-a", warmup=False, backend="torch",
                        release_memory=True, page_out_gpu_libraries=page_out)
    with TestClient(create_app(settings)) as client:
        assert client.get("/readyz").status_code == 200
    assert paged == ([1] if page_out and not torch.cuda.is_available() else [])


@pytest.mark.parametrize("release", [False, True])
def test_the_allocator_is_tuned_and_warm_ups_memory_released_only_when_the_settings_ask(tiny_weights, monkeypatch,
                                                                                       release):
    """CAPTIONER_RELEASE_MEMORY: the allocator tuned as the app is made (before the batchers' threads exist), what
    warm-up freed handed back before the app reports ready, and an idle trimmer; none of it when the setting is off."""
    calls = []
    monkeypatch.setattr(app_module, "configure_allocator", lambda: calls.append("allocator"))
    monkeypatch.setattr(app_module, "release_memory", lambda: calls.append("release") or 0)
    settings = Settings(weights_dir=tiny_weights, default_model="tiny-a", warmup=False, backend="torch",
                        release_memory=release, page_out_gpu_libraries=False)
    app = create_app(settings)
    assert calls == (["allocator"] if release else [])
    with TestClient(app) as client:
        assert client.get("/readyz").status_code == 200
        assert calls == (["allocator", "release"] if release else [])
        assert (client.app.state.service.on_idle is not None) == release


def test_a_refused_requests_body_is_drained_for_seconds_not_for_as_long_as_it_trickles():
    """A request refused before its body is read (429, 503, a bad overlay option) read the body to its end whatever
    its pace: one byte every few seconds held the connection and an in-flight request open without limit."""
    async def trickle():
        await asyncio.sleep(0.2)
        return {"type": "http.request", "body": b"x", "more_body": True}  # never the last chunk

    async def drain() -> None:
        await asyncio.wait_for(drain_body(Request({"type": "http", "method": "POST", "headers": []}, trickle),
                                          limit=10**6, seconds=0.5), timeout=5)

    asyncio.run(drain())  # returns after its half second; without the bound, wait_for's TimeoutError


def test_an_uploads_header_is_parsed_off_the_event_loop(tiny_weights, monkeypatch):
    """The pixel count that budgets decoding was read on the event loop: a JPEG of millions of empty markers takes
    Pillow seconds to scan, and every other request (the liveness probe too) waited for it."""
    on_loop = record_event_loop_calls(monkeypatch, captioning, "open_image")
    app = create_app(Settings(weights_dir=tiny_weights, default_model="tiny-a", backend="torch", warmup=False))
    with TestClient(app) as client:
        assert _post(client, _png(Image.fromarray(data.coffee()), "PNG"), beam_size=2, max_len=4).status_code == 200
    assert on_loop == [False]


def test_an_uploads_header_is_parsed_once(tiny_weights, monkeypatch):
    """The pixel count that budgets decoding came from one parse of the upload's header and the decode from a
    second (a hostile JPEG's seconds-long marker scan, paid twice, the second time holding a decode slot): the
    image is opened once, and decoded from that."""

    upload = _png(Image.fromarray(data.coffee()), "JPEG")
    opened_upload = []
    pillow_open = Image.open

    def counting(fp, *args, **kwargs):
        if isinstance(fp, io.BytesIO) and fp.getvalue() == upload:
            opened_upload.append(True)
        return pillow_open(fp, *args, **kwargs)

    monkeypatch.setattr(Image, "open", counting)
    app = create_app(Settings(weights_dir=tiny_weights, default_model="tiny-a", backend="torch", warmup=False))
    with TestClient(app) as client:
        assert _post(client, upload, beam_size=2, max_len=4).status_code == 200
    assert len(opened_upload) == 1


def test_uploads_share_one_byte_budget_until_their_requests_end(tiny_weights, monkeypatch):
    """Each upload was bounded alone (size, deadline) but many at once by nothing: a thousand trickling 10-MB bodies
    held gigabytes. A request's bytes count against one budget from their arrival until it ends (they wait for a
    decode slot and decode in memory), however it ends; a budget too small for one upload is refused at start."""
    with pytest.raises(ValidationError, match="must hold at least one largest upload"):
        Settings(max_upload_bytes=12_000, upload_budget_bytes=12_000)
    settings = Settings(weights_dir=tiny_weights, default_model="tiny-a", backend="torch", warmup=False,
                        max_upload_bytes=12_000, upload_budget_bytes=json_body_bytes(12_000))
    app = create_app(settings)
    small = _png(Image.fromarray(data.coffee()).resize((40, 30)), "PNG")
    held_while_decoding = []
    decode = captioning.decode_and_prepare

    def recording(runtime, opened):
        held_while_decoding.append(app.state.service.upload_budget.held)
        return decode(runtime, opened)

    monkeypatch.setattr(captioning, "decode_and_prepare", recording)
    with TestClient(app) as client:
        budget = app.state.service.upload_budget
        budget.take(budget.capacity - 1000)  # other uploads, still arriving or decoding, hold nearly all of it
        refused = _post(client, small, beam_size=2, max_len=4)
        assert refused.status_code == 429 and refused.json()["type"] == "/problems/overloaded"
        assert "CAPTIONER_UPLOAD_BUDGET_BYTES" in refused.json()["detail"] and refused.headers["retry-after"]
        assert budget.held == budget.capacity - 1000  # the refused request gave back what it had taken
        budget.give(budget.capacity - 1000)
        assert _post(client, small, beam_size=2, max_len=4).status_code == 200
        assert held_while_decoding and held_while_decoding[-1] >= len(small)  # still counted while decoding
        assert budget.held == 0  # given back when the request ended


def test_settings_refuse_defaults_and_row_budgets_outside_their_limits():
    for bad in ({"default_max_len": 51}, {"default_beam_size": 11}, {"default_max_len": 8, "max_max_len": 7}):
        with pytest.raises(ValidationError, match="must not exceed max_beam_size and max_max_len"):
            Settings(**bad)
    with pytest.raises(ValidationError, match=r"max_rows \(9\) must be at least max_beam_size \(10\)"):
        Settings(max_rows=9)  # a request of the widest beam could never get its rows; the operator is told both
    limits = Settings(max_rows=10, default_beam_size=10, default_max_len=50)  # at the limits: accepted
    assert (limits.max_rows, limits.default_beam_size, limits.default_max_len) == (10, 10, 50)


@pytest.mark.parametrize("name, refused, accepted", [
    ("port", 0, 1), ("port", 65536, 65535), ("max_upload_bytes", 0, 1), ("max_pixels", 0, 1),
    ("default_beam_size", 0, 1), ("queue_size", 0, 1), ("threads", 0, 1), ("retry_after_s", -1, 0),
    ("results_cache_bytes", -1, 0), ("result_cache_entries", -1, 0), ("drain_timeout_s", -0.5, 0.0),
    ("request_timeout_s", 0.0, 0.001), ("keep_alive_s", 0.0, 0.001)])
def test_a_setting_one_past_its_bound_is_refused_and_the_bound_itself_accepted(name, refused, accepted):
    """CAPTIONER_* values are checked where they are read: a bound moved by one would start a service that
    refuses every upload (0 bytes), never times out, or cannot bind; 0 is a meaningful value where it is allowed
    (no Retry-After wait, no result cache, no drain)."""
    with pytest.raises(ValidationError, match=name):
        Settings(**{name: refused})
    assert getattr(Settings(**{name: accepted}), name) == accepted


@pytest.mark.parametrize("name, refused, accepted, others", [
    ("default_max_len", 0, 1, {}), ("max_max_len", 0, 1, {"default_max_len": 1}),
    ("max_beam_size", 0, 1, {"default_beam_size": 1}), ("max_batch_images", 0, 1, {}),
    ("max_rows", 0, 1, {"max_beam_size": 1, "default_beam_size": 1}), ("decode_pixels", 0, 1, {}),
    ("render_concurrency", 0, 1, {}), ("results_max_count", 0, 1, {}), ("results_max_age_s", 0.0, 0.001, {}),
    ("interop_threads", 0, 1, {})])
def test_the_other_bounds_are_refused_one_past_and_accepted_at_themselves(name, refused, accepted, others):
    """The other bounded settings, each with the settings its lowest value must agree with (the widest beam fits the
    rows, the defaults fit their limits): a bound moved by one refused ``CAPTIONER_MAX_BATCH_IMAGES=1``, the
    batch-size-1 serving the README gives, or ``CAPTIONER_DEFAULT_MAX_LEN=1``."""
    with pytest.raises(ValidationError, match=name):
        Settings(**{name: refused, **others})
    assert getattr(Settings(**{name: accepted, **others}), name) == accepted


def test_settings_come_from_the_environment_alone_not_a_dotenv_file(tmp_path, monkeypatch):
    """A .env file left in the working directory (a developer's, a build context's) does not configure the
    service: only CAPTIONER_* variables do."""
    monkeypatch.chdir(tmp_path)
    for name in ("CAPTIONER_PORT", "CAPTIONER_MAX_BEAM_SIZE"):
        monkeypatch.delenv(name, raising=False)  # what the environment says is not what this test asks about
    (tmp_path / ".env").write_text("CAPTIONER_PORT=9999\nCAPTIONER_MAX_BEAM_SIZE=2\n")
    settings = Settings()
    assert (settings.port, settings.max_beam_size) == (8000, 10)


def test_the_upload_budget_holds_the_largest_json_request():
    """A JSON request carries the image in base64 (4 bytes for 3) beside its options: the budget's floor
    (json_body_bytes) must hold the largest one the upload limit allows, or that request is told "429, retry" for
    ever."""
    for size in (1, 2, 3, 12_000, 10 * 1024 * 1024):
        body = json.dumps({"image": base64.b64encode(b"\xff" * size).decode(), "model": "m" * 200, "beam_size": 10,
                           "max_len": 50, "length_penalty": 1.5, "block_trigrams": True})
        assert len(body) <= json_body_bytes(size) <= len(body) + 4096  # and no more: it is the budget's floor
    with pytest.raises(ValidationError, match="must hold at least one largest upload") as refused:
        Settings(max_upload_bytes=12_000, upload_budget_bytes=12_000 + 4096)
    # the floor the operator is told to give is the one that is then accepted, not the upload limit itself
    assert f"as base64 JSON: {json_body_bytes(12_000)} bytes" in str(refused.value)
    assert Settings(max_upload_bytes=12_000, upload_budget_bytes=json_body_bytes(12_000)).upload_budget_bytes == \
        json_body_bytes(12_000)


def test_the_json_bound_counts_the_images_base64_rounded_up():
    """base64 takes 4 bytes for 3 and 2 or 3 for a last 1 or 2, so the bound counts them rounded up, and the 4,096
    bytes above them are the other members' whole: rounded down, a byte of theirs went to the image for an upload
    limit that is no multiple of 3 (the default 10 MiB is one), and a JSON request at the bound was refused 413."""
    for size in (1, 2, 3, 4, 5, 10 * 1024 * 1024):
        unpadded = base64.b64encode(b"\xff" * size).rstrip(b"=")
        assert json_body_bytes(size) == len(unpadded) + 4096, size


def test_a_typed_problem_has_an_errors_member_only_when_it_names_fields():
    """RFC 9457's members and no others for a failure without per-field errors (not ``"errors": null``)."""
    assert problem_of(UnknownResult("no result 'x'")).extra == {}
    assert problem_of(InvalidRequest("bad options")).extra == {}
    errors = [{"loc": ["beam_size"], "msg": "above the limit of 4"}]
    assert problem_of(InvalidRequest("beam_size 9 is above the limit of 4", errors)).extra == {"errors": errors}


def test_a_retry_after_of_zero_is_still_sent():
    """CAPTIONER_RETRY_AFTER_S may be 0 ("retry at once"): the header says so rather than vanishing."""
    assert problem_of(Overloaded("busy", 0)).headers == {"Retry-After": "0"}
    assert problem_of(Overloaded("busy", 3)).headers == {"Retry-After": "3"}


def test_a_failure_without_a_wait_sends_no_retry_after():
    """Only a failure that names a wait (429, 503) has the header: a 404 or a 422 has none, not ``Retry-After:
    None``."""
    assert problem_of(UnknownResult("no result 'x'")).headers is None
    assert problem_of(InvalidRequest("bad options")).headers is None
    assert problem_of(DeadlinePassed("captioning took longer than 10 s")).headers is None


def test_a_failure_that_names_its_own_title_is_answered_with_it_not_the_reason_phrase():
    """ClientGone's 499 is nginx's, not a status Python's http module knows: its problem takes the failure's own
    title.  Taking the reason phrase instead raised on 499, so a client leaving mid-upload became an internal error
    (a 500 and a traceback in the log) rather than the 499 the access log and the metrics count."""
    app = FastAPI()
    install_problem_handlers(app)

    @app.get("/gone")
    async def gone():
        raise ClientGone("the client closed the connection before its upload arrived")

    with TestClient(app) as client:
        answer = client.get("/gone")
    assert answer.status_code == 499, answer.text
    assert answer.json()["title"] == "Client Closed Request" and answer.json()["type"] == "/problems/client-gone"


@pytest.mark.parametrize("refusal,retry_after", [
    (QueueFull("busy"), 5),  # no estimate: the settings'
    (QueueFull("busy", retry_after_s=9.0), 9),  # a longer one: its own
    (WouldMissDeadline("would miss its deadline", 7.9), 7),  # in whole seconds
    (QueueFull("busy", retry_after_s=2.0), 5),  # a shorter one: never below the settings'
    (QueueFull("busy", retry_after_s=0.5), 5),
])
def test_a_batcher_refusal_is_a_429_suggesting_its_own_wait_in_whole_seconds_never_below_the_settings(
        refusal, retry_after):
    with pytest.raises(Overloaded) as refused:
        with batcher_errors(Settings(retry_after_s=5)):
            raise refusal
    assert refused.value.retry_after_s == retry_after and str(refused.value) == str(refusal)


@pytest.mark.parametrize("refusal,typed", [
    (NotAccepting("model 'tiny' is not accepting requests"), NotReady),
    (DeadlineExceeded("captioning took longer than 1 s"), DeadlinePassed),
    (BeamTooWide("beam_size 9 is above the row budget of 8"), InvalidRequest),
])
def test_the_batchers_other_refusals_leave_the_use_case_as_the_services_typed_errors(refusal, typed):
    """A batcher that is stopping, a caption past its deadline and a beam wider than the row budget are the app's
    503, 504 and 422: let through as they are they would be 500s, and swallowed the use case would answer None."""
    with pytest.raises(typed):
        with batcher_errors(Settings()):
            raise refusal


def test_a_shutdown_during_a_background_first_start_stops_the_export_child(tiny_weights, monkeypatch,
                                                                           export_children):
    """A stop while a first start loads in the background cancels the load (test above): the cancellation is no
    ``Exception``, and the child making the ONNX exports must be stopped with it, not left exporting the models to
    come (minutes of CPU and memory) for a server that is gone."""
    warming = threading.Event()

    async def endless_warm_up(batcher, settings):
        warming.set()
        await asyncio.sleep(5)  # far longer than the test: the shutdown cancels it

    monkeypatch.setattr(app_module, "unprepared", lambda *found, **placed: ["tiny-a"])
    monkeypatch.setattr(app_module, "warm_up", endless_warm_up)
    settings = Settings(weights_dir=tiny_weights, default_model="tiny-a", load_in_background=True, backend="torch")
    with TestClient(create_app(settings)):
        assert warming.wait(30)
    assert [ended for child in export_children for ended in child.ended] == ["stop"]


def test_the_result_store_and_batchers_take_their_bounds_from_the_settings(tiny_weights):
    """Each bound reaches what it bounds: the count and age of kept results swapped, overlays of a 10-minute-old
    caption were gone (or kept for hours), and a queue as long as the row budget refused far fewer requests."""
    kept = {"results_cache_bytes": 5_000, "results_max_count": 7, "results_max_age_s": 90.0}
    queued = {"max_batch_images": 3, "queue_size": 5, "max_rows": 40, "warmup": False, "backend": "torch"}
    app = create_app(Settings(weights_dir=tiny_weights, default_model="tiny-a", **kept, **queued))
    store = app.state.results
    assert (store.max_bytes, store.max_count, store.max_age_s) == (5_000, 7, 90.0)
    with TestClient(app):
        bounds = {(b.max_batch, b.queue_size, b.max_rows) for b in app.state.service.batchers.values()}
    assert bounds == {(3, 5, 40)}


def test_the_api_document_gives_the_packages_own_version():
    """A generated client and /docs show ``info.version``: it is the release's (pyproject.toml), not a number left
    behind when the package's moves on."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert create_app(Settings()).openapi()["info"]["version"] == project["version"]
