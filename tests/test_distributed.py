"""Data-parallel training under torchrun: 2 CPU processes (gloo) on a tiny run hold identical weights after their
steps, equal the single-process run with the same global batch, resume under torchrun, and only rank 0 writes.
The context's own rules (a rank's share of a batch, torchrun's variables, what each collective answers on every rank,
leaving the group) are held in-process with stand-ins for the collectives."""

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from captioner.models.data.karpathy import load_karpathy
from captioner.models.data.stores import open_feature_store
from captioner.models.encoder import EncoderSpec
from captioner.models.training import TrainConfig, train
from captioner.models.training.distributed import DistContext, init_distributed, shutdown_distributed
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


def _torchrun(cfg: dict, temporary: Path, *extra: str) -> subprocess.CompletedProcess:
    # torchrun keeps its workers' logs in a folder of its own under the temporary folder, and never removes it:
    # the test's, which pytest does
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(temporary)}
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
    _torchrun(_config(scenes, cache, ddp, max_steps=2, epochs=2), tmp_path)  # stops mid-epoch 1 ...
    assert load_state(ddp)["progress"]["global_step"] == 2
    # each rank seeded apart: with one seed, every rank drew the same random numbers for its share of a batch (the
    # same dropout masks, SCST's samples drawn alike), correlating what should be independent draws
    assert (ddp / "rank0.seed").read_text() != (ddp / "rank1.seed").read_text()
    _torchrun(_config(scenes, cache, ddp, max_steps=4, epochs=2), tmp_path, "resume")  # ... and resumes under torchrun
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


def test_a_rank_takes_every_nth_example_of_the_global_batch_from_its_own_index_on():
    batch = np.arange(10, 20)
    shares = [DistContext(rank, 3).shard(batch) for rank in range(3)]
    assert [share.tolist() for share in shares] == [[10, 13, 16, 19], [11, 14, 17], [12, 15, 18]]
    assert DistContext(1, 2).shard(batch).tolist() == [11, 13, 15, 17, 19]
    assert DistContext() == DistContext(rank=0, world=1, local_rank=0) and DistContext().is_main
    assert DistContext().shard(batch).tolist() == batch.tolist()  # one process: the whole batch
    # the main rank is rank 0 of the run, not of its node: a second node's first process writes nothing
    assert not DistContext(rank=2, world=4, local_rank=0).is_main and DistContext(0, 4, local_rank=1).is_main


def test_torchruns_variables_give_the_rank_and_the_device_chooses_gloo_or_nccl(monkeypatch):
    joined = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", joined.append)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert init_distributed("cuda:1") == (DistContext(), "cuda:1")  # not under torchrun: nothing joined or moved
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert init_distributed("cpu") == (DistContext(), "cpu") and joined == []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")  # two nodes of one process each
    assert init_distributed("cpu") == (DistContext(rank=1, world=2, local_rank=0), "cpu")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")  # the second process of the second node
    assert init_distributed("auto") == (DistContext(rank=3, world=4, local_rank=1), "cpu")
    assert joined == ["gloo", "gloo"]
    # with a GPU, a rank asked for CUDA joins NCCL on its node's GPU; one asked for the CPU stays on gloo
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    assert init_distributed("cuda") == (DistContext(rank=3, world=4, local_rank=1), "cuda:1")
    assert init_distributed("cpu")[1] == "cpu" and joined[2:] == ["nccl", "gloo"] and chosen == [1]
    monkeypatch.delenv("LOCAL_RANK")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)  # a group already joined is not joined again
    assert init_distributed("cpu") == (DistContext(rank=3, world=4, local_rank=0), "cpu") and len(joined) == 4


def test_each_collective_gives_every_rank_the_same_answer(monkeypatch):
    """Stand-ins for gloo's collectives on rank 1 of 3, the other ranks' values given: a stop flag seen by any rank
    stops all, rank 0's object reaches every rank, and the gathered objects are in rank order."""
    others = {}

    def all_reduce(value, op=dist.ReduceOp.SUM):
        assert value.device.type == "cpu"
        for flag in others["flags"]:
            theirs = torch.tensor([float(flag)])
            value.copy_(torch.maximum(value, theirs) if op == dist.ReduceOp.MAX else
                        torch.minimum(value, theirs) if op == dist.ReduceOp.MIN else value + theirs)

    sent = []

    def broadcast_object_list(box, src, device):
        assert device.type == "cpu"
        sent.append(box[0])
        box[0] = {0: "rank 0's", 2: "rank 2's"}[src]

    def all_gather_object(out, obj):
        for rank, value in enumerate(["rank 0's", obj, "rank 2's"]):
            out[rank] = value  # as torch's does: the list must already hold a place for every rank

    met = []
    monkeypatch.setattr(dist, "get_backend", lambda: "gloo")
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(dist, "broadcast_object_list", broadcast_object_list)
    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    monkeypatch.setattr(dist, "barrier", lambda: met.append(True))
    ctx = DistContext(rank=1, world=3)
    for mine, theirs, stop in [(False, (False, False), False), (False, (True, False), True),
                               (True, (False, False), True), (True, (True, True), True)]:
        others["flags"] = theirs
        assert ctx.any(mine) is stop
    assert ctx.from_main("rank 1's") == "rank 0's"
    assert DistContext(rank=0, world=3).from_main("rank 0's") == "rank 0's" and sent[-1] == "rank 0's"
    assert ctx.gather("rank 1's") == ["rank 0's", "rank 1's", "rank 2's"]
    ctx.barrier()
    assert met == [True]
    # one process: no collective is called, and each answers with this process's own value
    for name in ("all_reduce", "broadcast_object_list", "all_gather_object", "barrier"):
        monkeypatch.setattr(dist, name, lambda *args, name=name, **kwargs: pytest.fail(f"{name} on one process"))
    alone = DistContext()
    assert alone.any(True) is True and alone.any(False) is False
    assert alone.from_main("mine") == "mine" and alone.gather("mine") == ["mine"]
    alone.barrier()


def test_leaving_the_group_meets_only_after_a_normal_end_and_collects_garbage_first(monkeypatch):
    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "barrier", lambda: calls.append("barrier"))
    monkeypatch.setattr(gc, "collect", lambda: calls.append("collect"))
    monkeypatch.setattr(dist, "destroy_process_group", lambda: calls.append("destroy"))
    shutdown_distributed()  # an error path: a rank may be gone, so no barrier
    assert calls == ["collect", "destroy"]
    calls.clear()
    shutdown_distributed(meet_first=True)
    assert calls == ["barrier", "collect", "destroy"]
    calls.clear()
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    shutdown_distributed(meet_first=True)  # not in a group: nothing to leave
    assert calls == []


def test_a_gpu_rank_run_with_the_default_device_joins_nccl_on_its_nodes_gpu(monkeypatch):
    """``--device`` defaults to ``auto``: on a GPU node a torchrun rank left at the default must join NCCL on its own
    GPU, as one asked for ``cuda`` does, not gloo on the CPU (the run would then train on CPU cores beside idle
    GPUs)."""
    joined, chosen = [], []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", joined.append)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert init_distributed("auto") == (DistContext(rank=3, world=4, local_rank=1), "cuda:1")
    assert joined == ["nccl"] and chosen == [1]


def test_under_nccl_the_objects_collectives_travel_through_this_ranks_own_gpu(monkeypatch):
    """NCCL moves only CUDA tensors: rank 0's validation scores reach the others through the GPU ``set_device`` gave
    this rank (here the second of its node), not the first GPU of the node, which every rank would then share, nor
    the CPU, which NCCL cannot send from."""
    used = []
    monkeypatch.setattr(dist, "get_backend", lambda: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(dist, "broadcast_object_list", lambda box, src, device: used.append(device))
    DistContext(rank=3, world=4, local_rank=1).from_main({"CIDEr-D": 0.5})
    assert used == [torch.device("cuda", 1)]
