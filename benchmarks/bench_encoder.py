"""Encoder benchmark: per-image time of the visual encoder at batch 1, 4 and 16, PyTorch and ONNX Runtime, one run.

The encoder of a checkpoint (``--checkpoint``, default: the checkpoint the service answers with when a request
names no model, ``weights/flickr8k/sat-supervised``: EfficientNet-Lite0's last stage on an 8×8 grid at 256 px) is
timed as the service runs it: PyTorch channels-last with its BatchNorms folded into the convolutions
(``captioner.models.encoder.fold_batch_norm``), and the same network exported alone to ONNX and run by ONNX Runtime
(CPU execution provider here), float and int8 (static quantization, as CAPTIONER_ENCODER_PRECISION=int8 serves it;
and the int8 weights' type this CPU's service does not choose, for the record: docs/decisions.md, "int8 on CPUs
without VNNI").
Configurations are timed in turns, repetition by repetition, so that background load affects each alike; each cell
is the median of the repetitions' per-image times.  The PyTorch row "unfolded" is the encoder before BatchNorm
folding (BatchNorms as separate passes), for the record.  ``--also-backbone`` adds the PyTorch and ONNX Runtime rows
of another backbone on the same grid (for example ``efficientnet_lite2``: docs/decisions.md, "Flickr8k: a stronger
ImageNet encoder"), timed in the same turns.

Usage: ``python benchmarks/bench_encoder.py [--threads N] [--repeats R] [--also-backbone NAME ...]``; writes
``docs/benchmarks/encoder.md``.
"""

from __future__ import annotations

import argparse
import datetime
from dataclasses import replace
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "benchmarks" / "encoder.md"
BATCHES = (1, 4, 16)


def torch_runner(encoder):
    import torch

    def run(pixels):
        with torch.inference_mode():
            encoder(pixels.contiguous(memory_format=torch.channels_last))
    return run


def torch_encoders(spec):
    import captioner.models.encoder as encoder_module
    from captioner.models.inference import grid_encoder

    served = grid_encoder(spec, "cpu")
    fold = encoder_module.fold_batch_norm
    encoder_module.fold_batch_norm = lambda net: 0  # the encoder as it was before folding
    try:
        unfolded = grid_encoder(spec, "cpu")
    finally:
        encoder_module.fold_batch_norm = fold
    return {"torch (served: BN folded, channels-last)": torch_runner(served),
            "torch unfolded (before)": torch_runner(unfolded)}, served


def onnx_encoder(encoder, spec, threads: int, folder: Path, name: str = "encoder_only"):
    import torch

    from captioner.models.export.sessions import open_session

    path = folder / f"{name}.onnx"
    example = torch.randn(2, 3, spec.image_size, spec.image_size)
    torch.onnx.export(encoder, (example,), str(path), input_names=["pixels"], output_names=["features"],
                      dynamic_axes={"pixels": {0: "batch"}, "features": {0: "batch"}}, opset_version=17, dynamo=False)
    session = open_session(path, torch.device("cpu"), threads)
    want = encoder(example).numpy()
    got = session.run(None, {"pixels": example.numpy()})[0]
    error = float(abs(got - want).max())

    def run(pixels):
        session.run(None, {"pixels": pixels.numpy()})
    return run, error


def onnx_int8_encoder(encoder, spec, threads: int, folder: Path, kernels: str | None = None):
    """The served int8 CNN (models/export/quantize.py: static quantization of the same network); ``kernels``: the
    weights' type this CPU would not choose, for the record."""
    import torch

    from captioner.models.export.quantize import quantized_visual_encoder
    from captioner.models.export.sessions import open_session

    session = open_session(quantized_visual_encoder(spec, folder, encoder, kernels=kernels), torch.device("cpu"),
                           threads)

    def run(pixels):
        session.run(None, {"pixels": pixels.numpy()})
    return run


#: the /proc/cpuinfo flags of native bfloat16 and float16 arithmetic: x86's (AVX-512, AMX) and Arm's ("Features")
NATIVE_FLAGS = {"bfloat16": frozenset({"avx512_bf16", "amx_bf16", "bf16"}),
                "float16": frozenset({"avx512_fp16", "amx_fp16", "fphp", "asimdhp"})}


def half_precision_note() -> str:
    """What this CPU does with bfloat16 and float16, from its flags: the sentence was once written for one machine
    ("no native bfloat16/float16 arithmetic"), and a later machine had avx512_bf16."""
    from captioner.models.export.quantize import cpu_info

    listed = cpu_info("flags") or cpu_info("Features")
    if listed is None:
        return "This CPU's flags cannot be read; only parity is measured here, as the option is meant for GPUs."
    flags = set(listed.split())
    said = [f"{kind} natively ({', '.join(sorted(flags & names))})" if flags & names else f"{kind} emulated"
            for kind, names in NATIVE_FLAGS.items()]
    return f"This CPU runs {' and '.join(said)}; only parity is measured here, as the option is meant for GPUs."


def precision_parity(checkpoint: Path, count: int) -> dict[str, tuple[int, int]]:
    """Captions of ``count`` generated test scenes at each CAPTIONER_PRECISION vs float32: (identical, total)."""
    import json

    from PIL import Image

    from captioner.models.data.scenes import generate
    from captioner.models.inference import PRECISIONS, torch_runtime

    with tempfile.TemporaryDirectory() as tmp:
        dataset = json.loads(generate(Path(tmp), {"test": count}, seed=77, progress=False).read_text())
        images = [Image.open(Path(tmp) / "images" / entry["filename"]).convert("RGB") for entry in dataset["images"]]
        reference = torch_runtime(checkpoint)
        prepared = [reference.prepare(image) for image in images]
        want = [r.words for r in reference.caption(prepared, 3, 20)]
        parity = {}
        for precision in PRECISIONS:
            if precision == "float32":
                continue
            runtime = torch_runtime(checkpoint, precision=precision)
            got = [r.words for r in runtime.caption(prepared, 3, 20)]
            parity[precision] = (sum(g == w for g, w in zip(got, want)), len(want))
    return parity


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads of both backends")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--checkpoint", type=Path, default=None,
                        help="checkpoint folder or name under weights/ (default: the one the service answers with)")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--parity-images", type=int, default=12, help="test scenes of the precision parity check")
    parser.add_argument("--also-backbone", action="append", default=[], metavar="NAME",
                        help="also time this backbone on the same grid, PyTorch and ONNX Runtime (repeatable)")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import checkpoint, command_line, cpu_name, int8_kernels_text, served_default

    from captioner.models.export.quantize import int8_kernels

    generated_by = command_line("bench_encoder.py", parser, args)

    args.checkpoint = checkpoint(str(args.checkpoint or served_default()))
    import torch

    torch.set_num_threads(args.threads)
    from captioner.models.checkpoint import load_checkpoint

    spec = load_checkpoint(args.checkpoint, "cpu").encoder
    runners, served = torch_encoders(spec)
    from captioner.models.inference import grid_encoder

    others = {backbone: grid_encoder(replace(spec, backbone=backbone, weights=None, tuned_weights=None), "cpu")
              for backbone in args.also_backbone}  # the same grid and input; their own ImageNet weights
    for backbone, other in others.items():
        runners[f"torch (served) with `{backbone}`"] = torch_runner(other)
    with tempfile.TemporaryDirectory() as tmp:
        runners["onnx runtime"], onnx_error = onnx_encoder(served, spec, args.threads, Path(tmp))
        # accuracy of int8: benchmarks/bench_int8.py (captioner eval), docs/benchmarks/int8.md
        runners["onnx runtime int8"] = onnx_int8_encoder(served, spec, args.threads, Path(tmp))
        # the weights' type the service does not choose on this CPU: uint8 (u8u8) where int8 is right and fast (VNNI),
        # int8 where it saturates (docs/decisions.md, "int8 on CPUs without VNNI"), timed in the same turns
        other_kernels = "u8u8" if int8_kernels() == "u8s8" else "u8s8"
        runners[f"onnx runtime int8, {other_kernels} kernels (not served here)"] = onnx_int8_encoder(
            served, spec, args.threads, Path(tmp), other_kernels)
        for backbone, other in others.items():
            runners[f"onnx runtime with `{backbone}`"], _ = onnx_encoder(other, other.spec, args.threads, Path(tmp),
                                                                         backbone)
        inputs = {b: torch.randn(b, 3, spec.image_size, spec.image_size) for b in BATCHES}
        for run in runners.values():  # first-use costs (allocator, kernel choice) are not measured
            for pixels in inputs.values():
                run(pixels)
        times: dict[str, dict[int, list[float]]] = {name: {b: [] for b in BATCHES} for name in runners}
        started = datetime.datetime.now(datetime.timezone.utc)
        for _ in range(args.repeats):
            for batch, pixels in inputs.items():
                for name, run in runners.items():
                    t0 = time.perf_counter()
                    run(pixels)
                    times[name][batch].append((time.perf_counter() - t0) / batch * 1000)
    median = {name: {b: statistics.median(v) for b, v in per.items()} for name, per in times.items()}
    best = {name: min(BATCHES, key=lambda b: per[b]) for name, per in median.items()}
    lines = [
        "# Encoder: per-image time by batch size",
        "",
        f"`{generated_by}`, {started:%Y-%m-%d %H:%M} UTC, {cpu_name()}, {os.cpu_count()} CPU cores "
        f"shared with other work, {int8_kernels_text()} (numbers drift with the "
        f"load; compare within a row and within this run only). Encoder of `{args.checkpoint.name}`: "
        f"`{spec.backbone}` `{spec.layer}`, {spec.grid_hw[0]}×{spec.grid_hw[1]} grid at {spec.image_size} px. "
        f"Median of {args.repeats} repetitions, configurations in turns. ONNX Runtime vs PyTorch max |Δ| of the "
        f"features: {onnx_error:.1e}.",
        "",
        "| backend | " + " | ".join(f"batch {b} (ms/image)" for b in BATCHES) + " | fastest batch |",
        "|---|" + "---:|" * len(BATCHES) + "---:|",
    ]
    for name, per in median.items():
        lines.append(f"| {name} | " + " | ".join(f"{per[b]:.1f}" for b in BATCHES) + f" | {best[name]} |")
    parity = precision_parity(args.checkpoint, args.parity_images)
    lines += ["", "## Caption parity of lower precision (PyTorch autocast on this CPU, beam 3, max_len 20)", "",
              "| CAPTIONER_PRECISION | captions identical to float32 |", "|---|---:|",
              *[f"| {precision} | {same} / {total} |" for precision, (same, total) in parity.items()], "",
              half_precision_note()]
    lines += ["", "The service does not assume the largest batch is the cheapest: each batcher times its encoder at "
              "warm-up over the batch sizes it will use and encodes in chunks of the largest size whose per-image "
              "time is within 5% of the lowest (`Batcher.encode_batch`, logged at start-up and exported as "
              "`captioner_encoder_batch_limit`).", ""]
    text = "\n".join(lines)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)


if __name__ == "__main__":
    sys.exit(main())
