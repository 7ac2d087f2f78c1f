"""int8 CNN accuracy: ``captioner eval`` of each model with its float CNN and with the int8 CNN of ONNX Runtime
static quantization (``--encoder-precision int8``, what ``CAPTIONER_ENCODER_PRECISION=int8`` serves), on the same
test images, side by side in one run.  The aim: objects_named and CIDEr-D within 0.01 of float.

Writes ``docs/benchmarks/int8.md`` (the table) and ``docs/benchmarks/int8.json`` (the numbers, which
``bench_serving.py`` copies into docs/benchmarks/serving.md beside the int8 encoder's speed).

Usage: ``python benchmarks/bench_int8.py [--models NAME ...] [--dataset D [--image-root DIR]] [--limit N]``.  The
dataset is the scene set of ``make data`` (.cache/scenes) by default, whose objects_named is scored beside CIDEr-D;
on a real-photo data set (``make bench-int8-f8k``: the Flickr8k checkpoints on Flickr8k test) BLEU-4 takes its
place.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, checkpoint, cpu_name, default_model, int8_kernels_text, publish  # noqa: E402

from captioner.models.data.datasets import CITATIONS, dataset_name, load_captioned  # noqa: E402
from captioner.models.export.quantize import int8_recipe  # noqa: E402

OUT = ROOT / "docs" / "benchmarks" / "int8.md"
AIM = 0.01


def metrics_of(dataset: Path) -> tuple[str, str]:
    """The two scores compared: objects_named (which objects a scene's caption names) where the data set is the
    generated scenes, BLEU-4 on photos; CIDEr-D on both."""
    return ("objects_named", "CIDEr-D") if dataset_name(dataset) == "scenes" else ("BLEU-4", "CIDEr-D")


def evaluate(folder: Path, precision: str, args, tmp: Path) -> dict:
    """``captioner eval`` scores of ``folder`` with its CNN at ``precision``, with the captions under ``captions``
    (image id → caption)."""
    out, captions = tmp / f"{folder.name}-{precision}.json", tmp / f"{folder.name}-{precision}.captions.json"
    command = [sys.executable, "-m", "captioner.service.cli", "eval", str(folder), "--dataset", str(args.dataset),
               *(["--image-root", str(args.image_root)] if args.image_root else []), "--split", args.split,
               "--no-meteor", "--threads", "1", "--device", "cpu",
               "--encoder-precision", precision, "--output", str(out), "--results-json", str(captions)]
    if args.limit:
        command += ["--limit", str(args.limit)]
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    scores = json.loads(out.read_text())[args.split]
    scores["captions"] = {str(r["image_id"]): r["caption"] for r in json.loads(captions.read_text())}
    return scores


def compare(by: dict, images, metrics: tuple[str, str]) -> dict:
    """``by`` (precision → scores with captions) with the captions replaced by the share of images whose int8
    caption equals the float one, word for word (``identical``), and the paired-bootstrap 95 % interval of each
    difference over the images (``paired``: ``captioner compare``'s statistics, int8 − float)."""
    from captioner.models.evaluation.compare import compare_captions

    want, got = (by[p].pop("captions") for p in ("float32", "int8"))
    paired = compare_captions({int(k): v for k, v in got.items()}, {int(k): v for k, v in want.items()}, images)
    return {**by, "identical": sum(got.get(image) == caption for image, caption in want.items()) / len(want),
            "paired": {m: paired[m] for m in metrics}}


def table(results: dict, metrics: tuple[str, str]) -> list[str]:
    """Markdown rows of ``results`` (model → precision → eval scores, ``identical`` and ``paired``), with the
    differences against the aim."""
    lines = ["| model | images | identical captions | "
             + " | ".join(f"{m} float → int8 | Δ [95 % CI]" for m in metrics) + f" | Δ within {AIM} |",
             "|---|---:|---:|---|---|---|---|---|"]
    for model, by in results.items():
        deltas = {m: by["int8"][m] - by["float32"][m] for m in metrics}
        ok = all(abs(d) <= AIM for d in deltas.values())

        def interval(metric: str) -> str:
            if "paired" not in by:  # a table written before the intervals were measured
                return ""
            low, high = by["paired"][metric]["ci95"]
            return f"[{low:+.3f}, {high:+.3f}]"

        lines.append(f"| {model} | {by['float32']['images']} | {by['identical']:.1%} | "
                     + " | ".join(f"{by['float32'][m]:.3f} → {by['int8'][m]:.3f} | "
                                  f"{f'{deltas[m]:+.3f} {interval(m)}'.rstrip()}"
                                  for m in metrics)
                     + f" | {'met' if ok else '**not met**'} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=[default_model(), "sparsecap-tvmax"],
                        help="checkpoints: folders under weights/ or paths (default: the service's default model "
                        "and SparseCap-TVmax, the two CNN kinds shipped: hypercolumns and EfficientNet blocks)")
    parser.add_argument("--dataset", type=Path, default=ROOT / ".cache" / "scenes")
    parser.add_argument("--image-root", type=Path, help="the data set's photo folder (captioner eval's --image-root)")
    parser.add_argument("--split", default="test")
    parser.add_argument("--limit", type=int, help="first N images of the split (smoke test; not for the table)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    # captioner eval runs from the repository: paths given from elsewhere are made absolute first (and the table
    # names them as given)
    given = {"dataset": args.dataset, "image_root": args.image_root}
    args.dataset = args.dataset.resolve()
    args.image_root = args.image_root.resolve() if args.image_root else None
    started, clock = datetime.datetime.now(datetime.timezone.utc), time.perf_counter()
    results: dict[str, dict] = {}
    images = load_captioned(args.dataset, args.image_root, (args.split,), limit=args.limit)
    metrics = metrics_of(args.dataset)
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            folder = checkpoint(name)
            results[folder.name] = compare({p: evaluate(folder, p, args, Path(tmp)) for p in ("float32", "int8")},
                                           images, metrics)
            print(table({folder.name: results[folder.name]}, metrics)[-1], file=sys.stderr, flush=True)
    dataset = args.dataset.relative_to(ROOT) if args.dataset.is_relative_to(ROOT) else given["dataset"]
    command = "python benchmarks/bench_int8.py" + "".join(
        flag for flag, on in ((f" --models {' '.join(args.models)}", args.models != parser.get_default("models")),
                              (f" --dataset {dataset}", args.dataset != parser.get_default("dataset")),
                              (f" --image-root {given['image_root']}", args.image_root),
                              (f" --split {args.split}", args.split != "test"),
                              (f" --limit {args.limit}", args.limit)) if on)
    lines = [
        "# int8 CNN: accuracy against float",
        "",
        f"Generated by `{command}` on {started:%Y-%m-%d %H:%M} UTC (one run; every number below comes from it).",
        "",
        f"`captioner eval` on the `{args.split}` split of `{dataset}`"
        f"{f' ({CITATIONS[dataset_name(dataset)]})' if dataset_name(dataset) in CITATIONS else ''}, "
        "beam 3, max_len 20, CPU: once with the float CNN (PyTorch), once with `--encoder-precision int8` (the CNN "
        "statically quantized for ONNX Runtime past its stem and first two stages: 8-bit weights per output channel, "
        "uint8 activations calibrated on 32 generated scenes of a seed no split uses; models/export/quantize.py, "
        f"recipe `{int8_recipe()}`), the decoder float32 in both. CPU: {cpu_name()}, {int8_kernels_text()} "
        "(docs/decisions.md, \"int8 on CPUs without VNNI\"). "
        f"Aim: {' and '.join(metrics)} within {AIM} of float (docs/decisions.md, \"int8 CNN by ONNX Runtime static "
        "quantization\"). The interval of each difference is a paired bootstrap over the images (`captioner compare`): "
        "an interval that contains 0 is a difference the choice of test images could make. The last column reads "
        f"the differences Δ, not their intervals: where an interval reaches beyond ±{AIM}, this test set cannot "
        "confirm the aim, only fail to contradict it. Its speed is the "
        "`onnx int8` row of the encoder-only ceiling in docs/benchmarks/serving.md.",
        "",
        *table(results, metrics),
        "",
    ]
    publish(args.out, lines, clock)
    args.out.with_suffix(".json").write_text(json.dumps(
        {"command": command, "started": f"{started:%Y-%m-%d %H:%M} UTC", "split": args.split, "metrics": metrics,
         "results": results},
        indent=2) + "\n")


if __name__ == "__main__":
    main()
