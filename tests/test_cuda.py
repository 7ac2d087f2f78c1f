"""The CUDA code paths on a real GPU (skipped without one): every architecture's step against the CPU, the scene
checkpoint's captions and the served default's captions of the demo photos on the GPU, the batcher with its encoder
thread on the GPU, the runtimes' placement and the HTTP service with ``CAPTIONER_DEVICE=cuda``, and a few training
steps under the GPU's mixed precision.  What they select and how is tested on CPU elsewhere (test_precision.py,
test_serving_onnx.py); these run where a GPU is (docs/benchmarks/serving-gpu.md records the machine they last ran
on)."""

from __future__ import annotations

import asyncio
import io
import json

import pytest
import torch
from PIL import Image

from captioner.models.checkpoint import load_checkpoint
from captioner.models.data.scenes import generate
from captioner.models.decoding import NO_RULES, DecodingRules, expand_rows
from captioner.models.inference import torch_runtime
from captioner.models.placement import DEFAULT_CHECKPOINT as SERVED_CHECKPOINT
from captioner.models.protocol import VisualBatch
from captioner.models.training import TrainConfig, fit, prepare_run
from captioner.service.batcher import Batcher
from captioner.service.runtime import iter_runtimes

from .conftest import DEFAULT_CHECKPOINT, DEMO_SAMPLES, ROOT, WEIGHTS
from .serving_helpers import FEAT_DIM, TINY_SPEC, all_architectures, assert_every_architecture_round_trips, \
    assert_same_result, run_bounded, tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
GPU = torch.device("cuda")
# the same words, and numbers within what cuDNN's TF32 convolutions (PyTorch's default for them) and other kernels
# for other row counts move a log-prob: 2e-3 was the largest difference seen on an H200
CLOSE = dict(atol_attention=1e-2, atol_logprob=1e-2)
#: what a request that names no model gets (Flickr8k), and the photos the demo page offers it
SERVED_DEFAULT = ROOT / SERVED_CHECKPOINT
DEMO_PHOTOS = sorted(DEMO_SAMPLES.glob("*.jpg"))


@pytest.fixture(scope="module")
def scene_images(tmp_path_factory) -> list[Image.Image]:
    folder = tmp_path_factory.mktemp("scenes")
    dataset = json.loads(generate(folder, {"test": 6}, seed=11, progress=False).read_text())
    return [Image.open(folder / "images" / entry["filename"]).convert("RGB") for entry in dataset["images"]]


@pytest.mark.parametrize("arch", all_architectures())
def test_every_architecture_steps_on_the_gpu_as_on_the_cpu(arch):
    model = tiny_model(arch)
    torch.manual_seed(3)
    rows, cols = TINY_SPEC.grid_hw
    feats = torch.randn(2, rows * cols, FEAT_DIM)  # [images, cells, channels]

    def two_steps(device: torch.device) -> list[torch.Tensor]:
        on = model.to(device)
        with torch.inference_mode():
            enc = expand_rows(on.encode(VisualBatch.from_features(feats.to(device))), [3, 3])
            state = on.init_state(enc)
            prev = torch.full((6,), on.bos_id, dtype=torch.long, device=device)
            logprobs, state, attn = on.step(prev, state, enc)
            logprobs2, _, attn2 = on.step(logprobs.argmax(-1), state, enc)
        return [t.float().cpu() for t in (logprobs, attn.primary, logprobs2, attn2.primary)]

    want = two_steps(torch.device("cpu"))
    for got, want in zip(two_steps(GPU), want):
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-3)


def test_shipped_default_captions_on_the_gpu_as_on_the_cpu(scene_images):
    cpu, gpu = torch_runtime(DEFAULT_CHECKPOINT, "cpu"), torch_runtime(DEFAULT_CHECKPOINT, GPU)
    want = cpu.caption([cpu.prepare(image) for image in scene_images], 3, 20)
    prepared = [gpu.prepare(image) for image in scene_images]
    # 6 images: the CNN runs them padded to 8 (padded_batch), and the padding changes no caption
    assert gpu.pad_batches and gpu.pixels(prepared).shape[0] == 8
    got = gpu.caption(prepared, 3, 20)
    for g, w in zip(got, want, strict=True):
        assert len(g.hypothesis.attention) == len(g.tokens)
        assert_same_result(g, w, **CLOSE)


def test_served_default_captions_the_demo_photos_on_the_gpu_as_on_the_cpu():
    """The real-photo default with the decoding rules chosen for it (its length penalty, trigram blocking): the same
    words on the GPU, one attention row per token, and no ``<unk>`` (never emitted, on either device)."""
    assert len(DEMO_PHOTOS) == 3, DEMO_PHOTOS
    photos = [Image.open(path).convert("RGB") for path in DEMO_PHOTOS]
    cpu, gpu = torch_runtime(SERVED_DEFAULT, "cpu"), torch_runtime(SERVED_DEFAULT, GPU)
    rules = gpu.default_rules
    assert rules != NO_RULES  # chosen on Flickr8k's val split, so this compares the rules' GPU path too
    want = cpu.caption([cpu.prepare(photo) for photo in photos], 3, 20, rules)
    got = gpu.caption([gpu.prepare(photo) for photo in photos], 3, 20, rules)
    for g, w in zip(got, want, strict=True):
        assert len(g.hypothesis.attention) == len(g.tokens) and "<unk>" not in g.tokens, g.tokens
        assert_same_result(g, w, **CLOSE)


def test_runtimes_load_their_checkpoints_and_encoder_onto_the_gpu():
    """``CAPTIONER_DEVICE=cuda``: the service's runtimes hold the model's weights and its CNN on the GPU (the
    checkpoint loaded where the device setting says, not where a default would put it)."""
    ((_, runtime),) = iter_runtimes(WEIGHTS, [], device_name="cuda", only=[DEFAULT_CHECKPOINT.name])
    assert runtime.backend == "torch" and runtime.device.type == "cuda"
    assert {p.device.type for p in runtime.ckpt.model.parameters()} == {"cuda"}
    assert {p.device.type for p in runtime.encoder.parameters()} == {"cuda"}


def test_batcher_with_its_encoder_thread_on_the_gpu_gives_the_fixed_batch_results(scene_images):
    runtime = torch_runtime(DEFAULT_CHECKPOINT, GPU)
    prepared = [runtime.prepare(image) for image in scene_images]
    want = [runtime.caption([p], beam, 16)[0] for p, beam in zip(prepared, [1, 2, 3, 3, 2, 1])]

    async def run():
        batcher = Batcher(runtime, max_batch=4, queue_size=16, max_rows=64)
        batcher.start()  # the worker thread and the encoder thread, as the service runs them
        try:
            jobs = [batcher.submit(p, beam, 16, 120) for p, beam in zip(prepared, [1, 2, 3, 3, 2, 1])]
            return await asyncio.gather(*(job.future for job in jobs))
        finally:
            await batcher.stop()

    for got, expected in zip(run_bounded(run()), want):
        assert_same_result(got, expected, **CLOSE)


def test_decoding_rules_on_the_gpu_give_the_cpus_captions(scene_images):
    """Length penalty and trigram blocking keep their row histories on the device: the same captions as the CPU,
    alone and through the batcher beside requests without rules."""
    cpu, gpu = torch_runtime(DEFAULT_CHECKPOINT, "cpu"), torch_runtime(DEFAULT_CHECKPOINT, GPU)
    rules = [DecodingRules(1.5, True), NO_RULES, DecodingRules(0.0, True), DecodingRules(2.0, False)] * 2
    want = [cpu.caption([cpu.prepare(image)], 3, 20, r)[0] for image, r in zip(scene_images, rules)]
    prepared = [gpu.prepare(image) for image in scene_images]

    async def run():
        batcher = Batcher(gpu, max_batch=4, queue_size=16, max_rows=64)
        batcher.start()
        try:
            jobs = [batcher.submit(p, 3, 20, 120, r) for p, r in zip(prepared, rules)]
            return await asyncio.gather(*(job.future for job in jobs))
        finally:
            await batcher.stop()

    for got, expected in zip(run_bounded(run()), want, strict=True):
        assert (got.rules.length_penalty, got.rules.block_trigrams) == (expected.rules.length_penalty,
                                                                       expected.rules.block_trigrams)
        assert_same_result(got, expected, **CLOSE)


def test_http_service_on_the_gpu_captions_every_architecture(tmp_path):
    photo = io.BytesIO()
    Image.new("RGB", (160, 120), (200, 40, 40)).save(photo, "JPEG")
    assert_every_architecture_round_trips(tmp_path, photo.getvalue(), device="cuda")


def test_training_steps_on_the_gpu_under_its_mixed_precision(scenes, tmp_path):
    pytest.importorskip("pycocoevalcap")  # validation's BLEU (a dependency of the project, not of every GPU image)
    config = TrainConfig(dataset=str(scenes), cache_dir=str(tmp_path / "features"), encoder={"image_size": 96},
                         model_args=dict(embed_dim=16, hidden_dim=24, attn_dim=16, dropout=0.0), train_limit=8,
                         val_limit=4, batch_size=4, epochs=1, progress=False, log_every=1, device="cuda",
                         precision="auto", out=str(tmp_path / "run"))
    run = prepare_run(config)
    assert next(run.model.parameters()).device.type == "cuda"
    best = fit(run)  # two steps, then validation on the GPU
    losses = [json.loads(line)["xe"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
              if "xe" in line]
    assert losses and all(torch.isfinite(torch.tensor(losses)))
    ckpt = load_checkpoint(best, "cpu")  # a GPU-trained checkpoint loads on a CPU
    assert next(ckpt.model.parameters()).device.type == "cpu"
