"""CIDEr-D benchmark: the vectorised :func:`captioner.models.evaluation.metrics.cider_d` against
``pycocoevalcap``'s ``Cider`` (coco-caption's CIDEr-D) on 5,000 captions with 5 references each, side by side
in one run on the same data; also the SCST-reward path (:class:`CiderD` with fixed document frequencies) on
mini-batches.  Writes ``docs/benchmarks/cider.md`` and prints it.

The captions are synthetic but COCO-shaped: 9–14 words (references) from a Zipf-distributed vocabulary of 10,000
words, so n-gram statistics (document frequencies, overlaps) resemble real captions.  Each timing is the best of
``--repeats`` runs (the other side's run in between; the thread count is the environment's, recorded as
OMP_NUM_THREADS).
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

import numpy as np
from pycocoevalcap.cider.cider import Cider

from captioner.models.evaluation.metrics import CiderD, cider_d

OUT = Path(__file__).resolve().parents[1] / "docs" / "benchmarks" / "cider.md"


def synthetic_captions(images: int, refs_per_image: int, seed: int = 0) -> tuple[list[str], list[list[str]]]:
    rng = np.random.default_rng(seed)
    vocabulary = np.array([f"w{i}" for i in range(10_000)])
    p = 1.0 / np.arange(1, len(vocabulary) + 1) ** 1.1
    p /= p.sum()

    def sentence() -> str:
        return " ".join(vocabulary[rng.choice(len(vocabulary), size=int(rng.integers(9, 15)), p=p)])

    refs = [[sentence() for _ in range(refs_per_image)] for _ in range(images)]
    # half the candidates reuse a reference's first half (as a trained model would overlap), half are fresh
    captions = [(" ".join(r[0].split()[:5]) + " " + sentence()) if i % 2 else sentence() for i, r in enumerate(refs)]
    return captions, refs


def best_of(repeats: int, run) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = run()
        times.append(time.perf_counter() - start)
    return min(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=5000)
    parser.add_argument("--refs", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()

    captions, refs = synthetic_captions(args.images, args.refs)
    gts, res = {i: r for i, r in enumerate(refs)}, {i: [c] for i, c in enumerate(captions)}
    t_theirs, (_, theirs) = best_of(args.repeats, lambda: Cider().compute_score(gts, res))
    t_ours, ours = best_of(args.repeats, lambda: cider_d(captions, refs))
    max_diff = float(np.abs(np.asarray(theirs) - ours).max())

    # the SCST reward: frequencies fixed from the training references, 10 images x 5 samples per mini-batch
    # (AoANet's batch), each image's reference list shared by its samples
    cider = CiderD(refs)
    batches = [list(range(b, b + 10)) for b in range(0, min(500, args.images) - 9, 10)]  # at most 50
    t_reward, _ = best_of(args.repeats, lambda: [cider.score([captions[i] for i in batch for _ in range(5)],
                                                             [refs[i] for i in batch for _ in range(5)])
                                                 for batch in batches])

    threads = os.environ.get("OMP_NUM_THREADS", "unset")
    table = f"""# CIDEr-D: vectorised vs pycocoevalcap

`python benchmarks/bench_cider.py` — {args.images:,} captions × {args.refs} references (synthetic, COCO-shaped: 9–14
words from a Zipf vocabulary of 10,000 words), both scorers on the same data in one run, best of {args.repeats},
{platform.processor() or platform.machine()}, Python {platform.python_version()}, OMP_NUM_THREADS={threads}.

| scorer | time for the corpus (s) | speed-up |
|---|---:|---:|
| `pycocoevalcap.cider.Cider().compute_score` | {t_theirs:.3f} | 1.0× |
| `captioner.models.evaluation.metrics.cider_d` (vectorised) | {t_ours:.3f} | **{t_theirs / t_ours:.1f}×** |

Largest per-caption difference between the two: {max_diff:.2e} (parity test: tests/test_cider.py, bound 1e-6).

SCST reward path (`CiderD(train refs).score`, fixed document frequencies): 50 mini-batches of 10 images × 5
samples in {t_reward:.3f} s, {t_reward / 50 * 1000:.1f} ms per mini-batch.
"""
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(table)
    print(table)


if __name__ == "__main__":
    main()
