"""Run by ``torchrun`` in tests/test_distributed.py: one rank of a training run, then this rank's weights to
``OUT/rank{R}.safetensors`` so the test can compare the ranks (only rank 0 writes the run's own files), and the seed
of its random numbers when the run was prepared to ``OUT/rank{R}.seed``."""

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from captioner.models.training import TrainConfig, fit, prepare_run
from captioner.models.training.distributed import shutdown_distributed


def main(config: str, resume: bool) -> None:
    # in a function, not at module level: the run (and the DistributedDataParallel wrapper holding the process
    # group) must be released before the group is destroyed, not during interpreter finalisation
    cfg = TrainConfig(**json.loads(config))
    run = prepare_run(cfg, resume=resume)
    assert run.dist.world == 2, "expected to run under torchrun --nproc_per_node 2"
    Path(cfg.out, f"rank{run.dist.rank}.seed").write_text(str(torch.initial_seed()))
    fit(run)
    save_file({k: v.contiguous() for k, v in run.model.state_dict().items()},
              f"{cfg.out}/rank{run.dist.rank}.safetensors")
    del run
    shutdown_distributed(meet_first=True)


if __name__ == "__main__":
    main(sys.argv[1], resume=len(sys.argv) > 2 and sys.argv[2] == "resume")
