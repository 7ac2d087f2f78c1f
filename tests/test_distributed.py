"""Data-parallel training under torchrun: 2 CPU processes (gloo) on a tiny run hold identical weights after their
steps, equal the single-process run with the same global batch, resume under torchrun, and only rank 0 writes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from captioner.models.data.karpathy import load_karpathy
from captioner.models.data.stores import open_feature_store
from captioner.models.encoder import EncoderSpec
from captioner.models.training import TrainConfig, train
from captioner.models.training.state import load_state

pytestmark = pytest.mark.usefixtures("one_thread")

DRIVER = Path(__file__).with_name("ddp_driver.py")
# float32 all-reduce sums the two halves of a batch in another order than one process does, so gradients agree to
# rounding (~1e-7 relative) and four Adam steps at lr 3e-3 agree to 2e-5 (under 1% of one step), while a wrong
# normalisation (per-rank means of unequal token counts, a missing all-reduce) moves weights by whole steps.
TOLERANCE = 2e-5
# The attention score's bias has a zero gradient in exact arithmetic (softmax ignores a shift shared by all items):
# it receives rounding noise only, which Adam divides by sqrt(v) ~ |noise| and turns into updates of up to ~10% of a
# step, differently in each run.  It is excluded from the comparison.
GRADIENT_FREE = {"attend.score.bias"}


def _config(scenes, cache, out, **overrides):
    # dropout 0: the ranks draw different dropout masks than one process would, which is right for training but
    # would make the runs incomparable
    cfg = dict(dataset=str(scenes), out=str(out), cache_dir=str(cache), encoder={"image_size": 96},
               model_args=dict(embed_dim=16, hidden_dim=24, attn_dim=16, dropout=0.0), train_limit=6, val_limit=2,
               epochs=1, batch_size=10, lr=3e-3, progress=False, checkpoint_every=0, device="cpu", threads=1)
    cfg.update(overrides)
    return cfg


def _torchrun(cfg: dict, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(DRIVER), json.dumps(cfg), *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def test_two_gloo_ranks_equal_one_process_with_the_same_global_batch_and_resume(scenes, tmp_path):
    cache = tmp_path / "features"
    images = load_karpathy(scenes, None, ("train",), limit=6) + \
        load_karpathy(scenes, None, ("val",), limit=2)
    open_feature_store(None, images, EncoderSpec(image_size=96), cache, progress=False)  # the ranks share the cache

    # 6 images × 5 captions = 30 captions: 3 steps of 10 per epoch, 5 captions per rank per step
    single = train(TrainConfig(**_config(scenes, cache, tmp_path / "single", max_steps=4, epochs=2)))
    ddp = tmp_path / "ddp"
    _torchrun(_config(scenes, cache, ddp, max_steps=2, epochs=2))  # stops mid-epoch 1 ...
    assert load_state(ddp)["progress"]["global_step"] == 2
    # each rank seeded apart: with one seed, every rank drew the same random numbers for its share of a batch (the
    # same dropout masks, SCST's samples drawn alike), correlating what should be independent draws
    assert (ddp / "rank0.seed").read_text() != (ddp / "rank1.seed").read_text()
    _torchrun(_config(scenes, cache, ddp, max_steps=4, epochs=2), "resume")  # ... and resumes under torchrun
    assert load_state(ddp)["progress"]["global_step"] == 4

    rank0, rank1 = load_file(ddp / "rank0.safetensors"), load_file(ddp / "rank1.safetensors")
    reference = load_state(tmp_path / "single")["model"]
    saved = load_state(ddp)["model"]
    diffs = {}
    for key in rank0:
        assert torch.equal(rank0[key], rank1[key]), f"the ranks hold different {key}"
        assert torch.equal(rank0[key], saved[key]), f"rank 0 saved another {key} than it trained"
        if key not in GRADIENT_FREE:
            diffs[key] = float((rank0[key] - reference[key]).abs().max())
    worst = max(diffs, key=diffs.get)
    assert diffs[worst] <= TOLERANCE, f"DDP differs from one process by {diffs[worst]:.2e} in {worst}: {diffs}"
    # only rank 0 wrote: one metrics log, one best/ and last/, and the epoch record is there once
    epochs = [json.loads(line) for line in (ddp / "metrics.jsonl").read_text().splitlines()
              if json.loads(line)["kind"] == "epoch"]
    assert [e["epoch"] for e in epochs] == [1] and (ddp / "best" / "manifest.json").exists()
    assert single.exists()
