"""Profile of one beam-search decoder step at 3, 96 and 256 rows (1, 32 and ~85 images at beam 3) for the shipped
SAT, AoANet and SparseCap-TVmax checkpoints: time per step, per row, and the operators that dominate.

Encoder states are made once from random features with the checkpoint's grid and expanded to the rows, exactly
as the batcher's tables hold them; the step is the model's own ``step`` plus its ``reorder`` (what the batcher
runs each step).  Usage: ``python benchmarks/profile_decoder_step.py [--threads N]``; prints a Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import checkpoint, decoder_models  # noqa: E402

ROWS = (3, 96, 256)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=decoder_models()[:3],
                        help="checkpoints: folders under weights/ or paths (default: SAT, AoANet, SparseCap-TVmax)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--top", type=int, default=3, help="operators listed per model and row count")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for line in profile_table(args.repeats, args.top, args.models):
        print(line, flush=True)


def profile_table(repeats: int = 7, top_ops: int = 3, models: list[str] | None = None) -> list[str]:
    """The Markdown table (one line per model and row count), at the current torch thread count; ``models``:
    checkpoint names or folders (default: SAT, AoANet, SparseCap-TVmax)."""
    from torch.profiler import profile

    from captioner.models.checkpoint import load_checkpoint
    from captioner.models.decoding import expand_rows
    from captioner.models.encoder import grid_geometry
    from captioner.models.protocol import VisualBatch

    lines = ["| model | rows | ms/step (median) | µs/row | top operators (self CPU share) |",
             "|---|---:|---:|---:|---|"]
    for name in models or decoder_models()[:3]:
        ckpt = load_checkpoint(checkpoint(name), "cpu")
        model, spec = ckpt.model.eval(), ckpt.encoder
        rows_, cols = spec.grid_hw
        geometry = grid_geometry(spec, (spec.image_size, spec.image_size))
        for rows in ROWS:
            images = max(1, rows // 3)
            feats = torch.randn(images, rows_ * cols, model.feat_dim)
            with torch.inference_mode():
                enc = expand_rows(model.encode(VisualBatch.from_features(feats, [geometry] * images)),
                                  [rows // images + (i < rows % images) for i in range(images)])
                state = model.init_state(enc)
                prev = torch.full((rows,), model.bos_id, dtype=torch.long)
                pointer = torch.arange(rows).flip(0)

                def one_step(state):
                    logprobs, new_state, _ = model.step(prev, state, enc)
                    return model.reorder(new_state, pointer)

                for _ in range(2):
                    state = one_step(state)
                times = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    state = one_step(state)
                    times.append(time.perf_counter() - t0)
                with profile() as prof:
                    one_step(state)
            total = sum(e.self_cpu_time_total for e in prof.key_averages()) or 1
            top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top_ops]
            ops = ", ".join(f"{e.key} {100 * e.self_cpu_time_total / total:.0f}%" for e in top)
            ms = statistics.median(times) * 1000
            lines.append(f"| {name} | {rows} | {ms:.2f} | {ms * 1000 / rows:.0f} | {ops} |")
    return lines


if __name__ == "__main__":
    sys.exit(main())
