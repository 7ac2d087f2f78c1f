"""Helpers shared by the serving tests: tiny models of every registered architecture, runtimes around them, a
deterministic driver for the batcher, result comparison, and real ``captioner serve`` processes."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from captioner.models.checkpoint import Checkpoint
from captioner.models.encoder import EncoderSpec, GridEncoder
from captioner.models.zoo import REQUIRED, available, create, options
from captioner.models.vocab import Vocabulary

ROOT = Path(__file__).resolve().parents[1]
FEAT_DIM = 320  # EfficientNet-Lite0 "blocks"
TINY_SPEC = EncoderSpec(image_size=96)  # a 3×3 grid: cheap, and big enough for 2×2 areas
VOCAB = Vocabulary([f"w{i}" for i in range(20)])

# small, fast configurations of the architectures we know; any other registered one is shrunk generically
TINY_CONFIGS: dict[str, dict] = {
    "sat": dict(embed_dim=16, hidden_dim=24, attn_dim=12),
    "sparsecap": dict(embed_dim=16, hidden_dim=24, visual_dim=16, attn_dim=12),
    "area-transformer": dict(d_model=32, n_heads=4, enc_layers=1, dec_layers=1, ffn_dim=64, area_layers=1),
}


def generic_tiny_config(arch: str) -> dict:
    """Shrink a constructor's integer sizes: widths → 32, heads → ≤ 2, layer counts → 1 (best effort)."""
    config: dict = {}
    for name, default in options(arch).items():
        if name in ("vocab_size", "feat_dim") or default is REQUIRED:
            continue
        if isinstance(default, bool):
            continue
        if isinstance(default, float) and "dropout" in name:
            config[name] = 0.0
        elif isinstance(default, int):
            if "head" in name:
                config[name] = min(default, 2)
            elif re.search(r"layers|depth|blocks|stack", name):
                config[name] = min(default, 1)
            elif default >= 64:
                config[name] = 32
    return config


#: the members of the tiny ensemble: a recurrent model and a Transformer, whose states differ in every way
ENSEMBLE_MEMBERS = ("sat", "area-transformer")


def tiny_model(arch: str, seed: int = 0, **overrides) -> nn.Module:
    """A tiny random ``arch`` on 320-d grid features, with sharpened word distributions: a random model's
    near-uniform log-probs would let float noise between batch compositions reorder beams, which says nothing
    about batching (a trained model's are far from uniform).  ``ensemble``: tiny ENSEMBLE_MEMBERS."""
    if arch == "ensemble":
        from captioner.models.ensemble import build_ensemble

        return build_ensemble([tiny_checkpoint(member, seed + i) for i, member in enumerate(ENSEMBLE_MEMBERS)])
    torch.manual_seed(seed)
    attempts = [{**TINY_CONFIGS[arch], "dropout": 0.0}] if arch in TINY_CONFIGS else []
    attempts += [generic_tiny_config(arch), {"dropout": 0.0}, {}]
    error: Exception | None = None
    for config in attempts:
        try:
            model = create(arch, vocab_size=len(VOCAB), feat_dim=FEAT_DIM, **{**config, **overrides}).eval()
            break
        except (TypeError, ValueError, RuntimeError) as exc:
            error = exc
    else:
        raise RuntimeError(f"cannot build a tiny {arch}: {error}")
    with torch.no_grad():
        outputs = [m for m in model.modules() if isinstance(m, nn.Linear) and m.out_features == len(VOCAB)]
        if outputs:
            outputs[-1].weight.mul_(6.0)
    return model


def tiny_checkpoint(arch: str, seed: int = 0, **overrides) -> Checkpoint:
    return Checkpoint(tiny_model(arch, seed, **overrides), VOCAB, TINY_SPEC, checksum=f"tiny-{arch}-{seed}")


def all_architectures() -> list[str]:
    return available()


def random_images(n: int, seed: int = 0) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    sizes = [(96, 96), (120, 80), (64, 150), (200, 200), (97, 61), (300, 120), (75, 75), (140, 90)]
    return [Image.fromarray(rng.integers(0, 256, (sizes[i % 8][1], sizes[i % 8][0], 3), dtype=np.uint8))
            for i in range(n)]


# -- batcher driving ----------------------------------------------------------------------------------------------
def serving_settings(**settings):
    """Settings of a test's in-process server: PyTorch and no warm-up, unless ``settings`` say otherwise.  The
    routes and every layer below them down to the runtime are the same on every backend (ONNX Runtime is compared
    with PyTorch, over HTTP too, in test_serving_onnx.py), and the default backend, ``auto``, first exports each
    model in a child process: two thirds of the time of the modules that test the HTTP contract."""
    from captioner.service.settings import Settings

    return Settings(**{"backend": "torch", "warmup": False, **settings})


def sent_problem_kinds() -> set[str]:
    """Every problem type the service can send: the table of service/errors.py, the kinds the handlers and
    middlewares name themselves, and those named by their status (the API-key refusal's 401, Starlette's 404 and
    405 of unknown paths and methods)."""
    from captioner.service.errors import PROBLEM_TYPES
    from captioner.service.problems import default_kind

    source = "\n".join(path.read_text(encoding="utf-8") for path in sorted((ROOT / "service").glob("*.py")))
    kinds = {kind for _, kind in PROBLEM_TYPES.values()} | set(re.findall(r'\bkind="([a-z-]+)"', source))
    assert {"internal", "invalid-request", "not-ready"} <= kinds, "the pattern no longer matches"
    return kinds | {default_kind(status) for status in (401, 404, 405)}


def watch_encodes(runtime, seen) -> None:
    """Wraps ``runtime.begin`` (every caption starts by encoding its images) so that each call first passes its
    batch of prepared images to ``seen``; ``del runtime.begin`` restores the class's method."""
    begin = runtime.begin

    def watched_begin(batch, widths):
        seen(batch)
        return begin(batch, widths)

    runtime.begin = watched_begin


def count_encodes(runtime) -> list[int]:
    """:func:`watch_encodes` that appends each call's number of images to the returned list."""
    calls: list[int] = []
    watch_encodes(runtime, lambda batch: calls.append(len(batch)))
    return calls


def count_step_rows(runtime) -> list[int]:
    """Wraps ``runtime.step`` so that each decoding step appends its number of rows to the returned list."""
    rows: list[int] = []
    step = runtime.step

    def counting_step(prev, state, enc):
        rows.append(prev.shape[0])
        return step(prev, state, enc)

    runtime.step = counting_step
    return rows


# far above any scenario's own time, even on a slow machine, and far below pytest-timeout's 600 s
SCENARIO_TIMEOUT_S = 120.0


def run_bounded(coroutine, timeout_s: float = SCENARIO_TIMEOUT_S):
    """``asyncio.run`` with a bound on the whole scenario: a result that never arrives (a future the batcher lost)
    fails its test in ``timeout_s`` with a TimeoutError raised at the wait that hung, where a bare ``await
    job.future`` held the test until pytest-timeout's 600 s stopped the whole run."""
    async def bounded():
        async with asyncio.timeout(timeout_s):
            return await coroutine
    return asyncio.run(bounded())


def record_event_loop_calls(monkeypatch, module, name: str) -> list[bool]:
    """Replace ``module.name`` by a wrapper that notes, call by call, whether it ran on the event loop (True) or in a
    worker thread (False, a thread has no running loop): work that blocks for long belongs off the loop, where it
    holds up no other request and no liveness probe."""
    on_loop, real = [], getattr(module, name)

    def recording(*args, **kwargs):
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:
            on_loop.append(False)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, recording)
    return on_loop


def call_bounded(timeout_s: float, function, *args):
    """``function(*args)`` in a thread of its own, failing the test after ``timeout_s`` rather than holding it until
    pytest-timeout's 600 s stop the whole run: an export that took its folder's lock exclusively, where a shared
    lock belongs, would wait forever on the shared one the test holds.  Once the test's failure releases that lock,
    the thread finishes."""
    pool = ThreadPoolExecutor(1)
    try:
        return pool.submit(function, *args).result(timeout=timeout_s)
    except TimeoutError:
        pytest.fail(f"{function.__name__} was still waiting after {timeout_s} s: on a lock the test holds?")
    finally:
        pool.shutdown(wait=False)


async def drive(batcher, schedule: list[tuple], timeout_s: float = 60.0) -> list:
    """Run a batcher started with ``worker=False`` step by step; ``schedule`` holds ``(step, prepared, beam,
    max_len)`` or ``(step, prepared, beam, max_len, rules)``: each request is submitted just before step boundary
    ``step``.  Returns the results in schedule order."""
    order = sorted(range(len(schedule)), key=lambda i: schedule[i][0])
    jobs: dict[int, object] = {}
    step = 0
    while len(jobs) < len(schedule) or not batcher.idle:
        for i in order:
            if i not in jobs and schedule[i][0] <= step:
                _, prepared, beam, max_len, *rules = schedule[i]
                jobs[i] = batcher.submit(prepared, beam, max_len, timeout_s, *rules)
        batcher.run_once()
        step += 1
        await asyncio.sleep(0)  # results arrive through call_soon_threadsafe
        assert step < 10_000
    await asyncio.sleep(0)
    return [await jobs[i].future for i in range(len(schedule))]


def assert_same_result(got, want, atol_attention: float = 1e-5, atol_logprob: float = 1e-4) -> None:
    """Batching must change nothing but speed: same tokens, and the same numbers up to float noise."""
    g, w = got.hypothesis, want.hypothesis
    assert got.words == want.words and g.token_ids == w.token_ids, f"{got.words} != {want.words}"
    assert g.ended_with_eos == w.ended_with_eos
    np.testing.assert_allclose(g.token_logprobs, w.token_logprobs, atol=atol_logprob)
    np.testing.assert_allclose(g.score, w.score, atol=atol_logprob * max(1, len(g.token_ids)))
    np.testing.assert_allclose(g.attention.numpy(), w.attention.numpy(), atol=atol_attention)
    assert set(g.extras) == set(w.extras)
    for name in g.extras:
        np.testing.assert_allclose(g.extras[name].numpy(), w.extras[name].numpy(), atol=atol_attention,
                                   err_msg=f"extra {name}")


def shared_encoder() -> GridEncoder:
    return GridEncoder(TINY_SPEC).to(memory_format=torch.channels_last)


# -- real server processes ----------------------------------------------------------------------------------------
class ServerProcess:
    """``captioner serve`` on a free localhost port with ``CAPTIONER_*`` settings from ``env``."""

    def __init__(self, weights_dir: Path, env: dict[str, str] | None = None, log_path: Path | None = None):
        from .conftest import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        environment = {**os.environ, "CAPTIONER_THREADS": "1", "CAPTIONER_LOG_FORMAT": "json", **(env or {})}
        self._log = open(log_path, "w") if log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen([sys.executable, "-m", "captioner.service.cli", "serve", "--port", str(self.port),
                                      "--weights-dir", str(weights_dir)], cwd=ROOT, env=environment,
                                     stdout=self._log, stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text()[-4000:] if self.log_path else ""

    def wait_ready(self, timeout_s: float = 180) -> "ServerProcess":
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.log()}")
            try:
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout_s} s: {self.log()}")

    def stop(self, timeout_s: float = 30) -> int | None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log is not subprocess.DEVNULL:
            self._log.close()
        return self.proc.returncode


def scrape(url: str) -> dict[str, float]:
    """``/metrics`` as {'name{labels}': value} (samples only)."""
    return parse_metrics(httpx.get(f"{url}/metrics", timeout=10).text)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text as {'name{labels}': value} (samples only)."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            values[key] = float(value)
    return values


def assert_every_architecture_round_trips(folder: Path, image: bytes, device: str = "auto",
                                          backend: str = "auto") -> None:
    """A tiny checkpoint of every registered architecture saved under ``folder``, served by one app on
    ``device`` and ``backend`` (its ONNX exports, if any, below ``folder`` too): each is listed on that device, and
    ``POST /caption`` of ``image`` (JPEG bytes) gives its caption with one attention distribution per token."""
    from fastapi.testclient import TestClient

    from captioner.models.checkpoint import save_checkpoint
    from captioner.service.app import create_app
    from captioner.service.settings import Settings

    for arch in available():
        save_checkpoint(folder / "weights" / arch, tiny_model(arch), VOCAB, TINY_SPEC)
    settings = Settings(weights_dir=folder / "weights", onnx_dir=folder / "onnx", default_model="sat", device=device,
                        backend=backend)
    with TestClient(create_app(settings)) as client:
        listed = client.get("/models").json()
        assert sorted(m["architecture"] for m in listed) == sorted(available())
        # the overlay modes each can be drawn in: area_topk where the model attends over areas, as the overlay says
        for m in listed:
            areas = "area_topk" in m["heatmap_modes"]
            assert set(m["heatmap_modes"]) - {"area_topk"} == {"grid_smooth", "grid_blocks", "region_sum",
                                                                "top1_box"}, m["name"]
            refused = client.post("/caption/overlay", params={"model": m["name"], "mode": "area_topk", "token": 0,
                                                             "max_len": 2, "beam_size": 1},
                                  files={"file": ("image.jpg", image, "image/jpeg")})
            assert (refused.status_code == 200) == areas, (m["name"], refused.text)
        if device != "auto":
            assert all(m["device"].startswith(device) for m in listed), listed
        for arch in available():
            response = client.post("/caption", params={"model": arch, "max_len": 4, "beam_size": 2},
                                   files={"file": ("image.jpg", image, "image/jpeg")})
            assert response.status_code == 200, (arch, response.text)
            body = response.json()
            assert body["model"] == arch and len(body["attention"]) == len(body["tokens"]) >= 1
            grid = body["geometry"]["grid_hw"]
            cells = grid[0] * grid[1] if grid else None
            rows = body["attention"]
            assert all(abs(sum(row) - 1) < 1e-4 and (cells is None or len(row) == cells) for row in rows), \
                f"{arch}: each attention row must be a distribution over the image's cells (AttnRecord, protocol.py)"
