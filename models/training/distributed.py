"""Data parallelism under ``torchrun``: process-group setup, how a global batch is split across ranks, and the
few collectives the loop needs (a stop flag, validation results, RNG states).

A run started by ``torchrun --nproc_per_node N`` sees ``WORLD_SIZE``/``RANK``/``LOCAL_RANK`` in its environment
and joins a process group (NCCL on CUDA, gloo on CPU); without them everything here is a no-op on one process.

Splitting: every rank draws the same seeded permutation of the epoch, and global batch ``b`` (``batch_size``
examples) is dealt out round-robin, rank ``r`` taking ``batch[r::N]``.  Unlike ``torch.utils.data.DistributedSampler``,
which pads the epoch by repeating examples so every rank gets the same count, this visits every caption exactly
once per epoch, and the global batch is the same whatever ``N`` is, so an N-process run follows the single-process
run with the same ``batch_size`` (the phases normalise their loss by the global batch, see ``Phase.loss``).
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistContext:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1

    def shard(self, batch: np.ndarray) -> np.ndarray:
        """This rank's share of a global batch (photo indices)."""
        return batch[self.rank::self.world] if self.active else batch

    def barrier(self) -> None:
        if self.active:
            dist.barrier()

    def any(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on any (a Ctrl-C seen by one rank stops all at the same step)."""
        if not self.active:
            return flag
        value = torch.tensor([1.0 if flag else 0.0], device=_collective_device())
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    def from_main(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.active:
            return obj
        box = [obj if self.is_main else None]
        dist.broadcast_object_list(box, src=0, device=_collective_device())
        return box[0]

    def gather(self, obj: Any) -> list[Any]:
        """``obj`` of every rank, in rank order, on every rank."""
        if not self.active:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out


def _collective_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def init_distributed(device: str) -> tuple[DistContext, str]:
    """Join the ``torchrun`` process group if there is one; returns the context and the device this rank uses
    (``cuda:LOCAL_RANK`` under NCCL)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistContext(), device
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = device != "cpu" and torch.cuda.is_available()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = f"cuda:{local_rank}"
    else:
        device = "cpu"
    return DistContext(rank=rank, world=world, local_rank=local_rank), device


def shutdown_distributed(meet_first: bool = False) -> None:
    """Leave the process group, if this process is in one, while the interpreter is fully alive.

    ``meet_first`` (a run that ended normally on every rank) makes the ranks meet at a barrier first, so no rank
    tears its connections down while another is still inside a collective; an error path passes False, since a
    rank may be gone. Either way, garbage that still holds the group (a finished ``Run``'s
    DistributedDataParallel wrapper and reducer, when reference cycles keep them) is collected before the group is
    destroyed, not during interpreter finalisation, when gloo's objects can abort the process (the failure
    described in pytorch/pytorch#179291; a CI run once lost a rank to ``terminate called without an active
    exception`` at the end of a two-rank run)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    if meet_first:
        dist.barrier()
    gc.collect()
    dist.destroy_process_group()
