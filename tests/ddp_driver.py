"""Run by ``torchrun`` in tests/test_distributed.py: one rank of a training run, then this rank's weights to
``OUT/rank{R}.safetensors`` so the test can compare the ranks (only rank 0 writes the run's own files)."""

import json
import sys

from safetensors.torch import save_file

from captioner.models.training import TrainConfig, fit, prepare_run
from captioner.models.training.distributed import shutdown_distributed

if __name__ == "__main__":
    cfg = TrainConfig(**json.loads(sys.argv[1]))
    run = prepare_run(cfg, resume=len(sys.argv) > 2 and sys.argv[2] == "resume")
    assert run.dist.world == 2, "expected to run under torchrun --nproc_per_node 2"
    fit(run)
    save_file({k: v.contiguous() for k, v in run.model.state_dict().items()}, f"{cfg.out}/rank{run.dist.rank}.safetensors")
    shutdown_distributed(run.dist)
