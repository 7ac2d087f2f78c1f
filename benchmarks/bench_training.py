"""Training steps per second, XE and SCST, of the shipped Flickr8k checkpoints' models side by side: each model at its
checkpoint's sizes and vocabulary (``--init weights/flickr8k/NAME``), the XE step with the settings of the command
that trained it (its batch size, optimiser, label smoothing, grouping by image), the SCST step with its recipe's
``[scst]`` stage (SAT's recipe has none: 10 images × 5 samples, as AoANet's and X-Transformer's), on real Flickr8k
photos and captions (CPU, one thread). A step is what ``captioner train`` runs: the phase's loss (SCST: the greedy
baseline, the samples, their CIDEr-D rewards), the backward pass, clipping and the optimiser step.

``--baseline DIR`` also times the code of another checkout (a folder holding ``models/``, e.g. ``git worktree add
/tmp/before HEAD~1``), in turns with this one, and reports the ratio and whether the two trained the same losses from
the same seed. Every measurement runs in a process of its own, with ``captioner`` imported from its tree.

Usage: ``python benchmarks/bench_training.py [--models sat aoanet xtransformer] [--baseline DIR] [--quick]``; writes
``docs/benchmarks/training.md`` and prints it. The features of the ``--images`` training photos are extracted into
``--cache-dir`` first, once (the training runs' default cache, which later runs reuse).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, checkpoint, command_line, publish  # the script's folder is first on sys.path

OUT = ROOT / "docs" / "benchmarks" / "training.md"
#: where the Makefile's F8K_DATASET points by default (README, "Real data")
FLICKR8K = ROOT.parent / "shared" / "data" / "flickr8k" / "dataset_flickr8k.json"
MODELS = ["sat", "aoanet", "xtransformer"]
PHASES = ("xe", "scst")
#: SCST of a checkpoint whose recipe has no [scst] stage (SAT): AoANet's and X-Transformer's batch and samples
SCST_DEFAULTS = {"batch_size": 10, "scst_samples": 5, "lr": 2e-5}


def step_config(name: str, phase: str, args: argparse.Namespace, out: str):
    """The TrainConfig of ``phase`` for checkpoint ``name``: XE as its own run was configured, SCST as its recipe's
    [scst] stage, both warm-started from it (its sizes and vocabulary) on the first ``args.images`` photos."""
    from captioner.models.training.config import TrainConfig
    from captioner.models.training.recipes import load_recipe

    folder = checkpoint(f"flickr8k/{name}")
    trained = json.loads((folder / "config.json").read_text())["meta"]["train_config"]
    if phase == "xe":
        values = {k: v for k, v in TrainConfig.from_json(trained).to_json().items()
                  if k not in ("model", "model_args", "encoder", "min_count", "attention_supervision", "recipe")}
    else:
        values = {**SCST_DEFAULTS}
        try:
            values.update(load_recipe(trained["recipe"], "scst") if trained.get("recipe") else {})
        except ValueError:  # a recipe without an [scst] stage
            pass
        values = {k: v for k, v in values.items() if k not in ("model", "model_args", "recipe")}
    values.update(out=out, phase=phase, init=str(folder), dataset=str(args.dataset), image_root=args.image_root,
                  cache_dir=str(args.cache_dir), train_limit=args.images, val_limit=1, threads=1, device="cpu",
                  precision="float32", progress=False, seed=0, epochs=1, max_steps=None, checkpoint_every=0,
                  log_every=0)
    return TrainConfig.from_json(values)


def worker(spec: dict) -> dict:
    """Time ``spec["steps"]`` training steps after ``spec["warmup"]`` (in a process of its own); the losses of every
    step, for the comparison of two trees."""
    import torch

    import captioner.models
    from captioner.models.training.loop import _optimizer_step, prepare_run

    torch.set_num_threads(1)
    args = argparse.Namespace(**spec["args"])
    with tempfile.TemporaryDirectory() as out:
        run = prepare_run(step_config(spec["model"], spec["phase"], args, out))
        order, size = run.phase.epoch_order(0), run.cfg.batch_size
        batches = [order[(i * size) % len(order):][:size] for i in range(spec["warmup"] + spec["steps"])]
        torch.manual_seed(0)
        losses, started = [], None
        for i, batch in enumerate(batches):
            if i == spec["warmup"]:
                started = time.perf_counter()
            with run.precision.autocast(run.device):
                loss, _, _ = run.trainer(batch, batch)
            _optimizer_step(run, loss)
            losses.append(loss.item())
        seconds = (time.perf_counter() - started) / spec["steps"]
    return {"seconds": seconds, "losses": losses, "batch": size, "vocab": len(run.vocab),
            "samples": run.cfg.scst_samples if spec["phase"] == "scst" else None,
            "source": str(Path(captioner.models.__path__[0]).resolve())}


def measure(tree: Path, spec: dict, scratch: Path) -> dict:
    """Run :func:`worker` in a new process whose ``captioner`` is ``tree``'s ``models/`` and ``service/``."""
    package = scratch / str(abs(hash(str(tree)))) / "captioner"
    if not package.exists():
        package.mkdir(parents=True)
        for part in ("models", "service"):
            (package / part).symlink_to(tree / part)
    env = {**os.environ, "PYTHONPATH": str(package.parent), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], env=env, capture_output=True,
                          text=True, cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"{spec['model']} {spec['phase']} ({tree}) failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if Path(result["source"]) != (tree / "models").resolve():
        raise SystemExit(f"imported {result['source']}, not {tree / 'models'}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=MODELS,
                        help="checkpoints under weights/flickr8k (default: SAT, AoANet, X-Transformer)")
    parser.add_argument("--dataset", type=Path, default=FLICKR8K, help="Flickr8k's Karpathy JSON")
    parser.add_argument("--image-root", help="folder of the photos (default: beside the JSON, images/)")
    parser.add_argument("--images", type=int, default=100, help="training photos the steps draw their batches from")
    parser.add_argument("--cache-dir", type=Path, default=ROOT / ".cache" / "features")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per measurement")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2, help="measurements per (model, phase, tree); best kept")
    parser.add_argument("--baseline", type=Path, help="another checkout to time in turns with this one")
    parser.add_argument("--quick", action="store_true", help="SAT only, 2 steps, one repetition (smoke test)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    from bench_serving import machine

    generated_by = command_line("bench_training.py", parser, args)
    if args.quick:
        args.models, args.steps, args.warmup, args.repeats = ["sat"], 2, 1, 1
    if not args.dataset.is_file():
        raise SystemExit(f"no Flickr8k JSON at {args.dataset}: give --dataset (README, \"Real data\")")
    args.image_root = args.image_root or str(args.dataset.parent / "images")
    trees = ([args.baseline.resolve()] if args.baseline else []) + [ROOT]
    shared = {"dataset": str(args.dataset), "image_root": args.image_root, "images": args.images,
              "cache_dir": str(args.cache_dir)}
    started, host, clock = datetime.datetime.now(datetime.timezone.utc), machine(), time.perf_counter()
    results: dict[tuple, list[dict]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(args.repeats):
            for model in args.models:
                for phase in PHASES:
                    for tree in trees if repeat % 2 == 0 else trees[::-1]:  # in turns, the order swapped
                        spec = {"model": model, "phase": phase, "steps": args.steps, "warmup": args.warmup,
                                "args": shared}
                        result = measure(tree, spec, Path(scratch))
                        results.setdefault((model, phase, tree), []).append(result)
                        print(f"{model} {phase} {tree}: {result['seconds'] * 1000:.0f} ms/step", file=sys.stderr,
                              flush=True)

    def best(model: str, phase: str, tree: Path) -> dict:
        return min(results[model, phase, tree], key=lambda r: r["seconds"])

    rows = ["| model | phase | batch | vocabulary | s/step | steps/s | photos/s |",
            "|---|---|---:|---:|---:|---:|---:|"]
    for model in args.models:
        for phase in PHASES:
            r = best(model, phase, ROOT)
            what = f"{r['batch']} captions" if phase == "xe" else f"{r['batch']} photos × {r['samples']} samples"
            photos = r["batch"] / (5 if phase == "xe" else 1) / r["seconds"]  # Flickr8k: 5 captions a photo
            rows.append(f"| {model} | {phase} | {what} | {r['vocab']:,} | {r['seconds']:.3f} | "
                        f"{1 / r['seconds']:.2f} | {photos:.1f} |")
    lines = ["# Training steps", "",
             f"Generated by `{generated_by}` on {started:%Y-%m-%d %H:%M} UTC (one run; every number below comes "
             "from it).", "", f"Machine: {host}.", "",
             f"Each model at its shipped Flickr8k checkpoint's sizes and vocabulary (`--init weights/flickr8k/NAME`), "
             f"on the first {args.images} training photos of Flickr8k (Hodosh, Young & Hockenmaier, JAIR 2013) and "
             "their captions, CPU, float32, one thread. XE: the settings of the command that trained the checkpoint "
             "(batch of captions; grouped by image where it was), epoch 1's (no scheduled sampling yet). SCST: the "
             "recipe's `[scst]` stage (greedy baseline, 5 samples a photo, CIDEr-D reward; SAT's recipe has none: "
             "AoANet's batch and samples). A step is the phase's loss, its backward pass, clipping and the optimiser "
             f"step; {args.steps} steps timed after {args.warmup}, each measurement in a process of its own, best of "
             f"{args.repeats}. XE photos/s counts 5 captions a photo.", "", *rows, ""]
    if args.baseline:
        lines += ["## Against the baseline", "",
                  f"The same steps of `{args.baseline}` (the code before), timed in turns with this tree's in the same "
                  "run; losses: the largest relative difference between the two trees' losses, step by step, from "
                  "the same seed.", "",
                  "| model | phase | before (s/step) | after (s/step) | speed-up | each repetition | losses |",
                  "|---|---|---:|---:|---:|---|---:|"]
        for model in args.models:
            for phase in PHASES:
                before, after = best(model, phase, args.baseline.resolve()), best(model, phase, ROOT)
                pairs = zip(results[model, phase, args.baseline.resolve()], results[model, phase, ROOT])
                each = ", ".join(f"{b['seconds'] / a['seconds']:.2f}×" for b, a in pairs)
                diff = max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(before["losses"], after["losses"]))
                lines.append(f"| {model} | {phase} | {before['seconds']:.3f} | {after['seconds']:.3f} | "
                             f"**{before['seconds'] / after['seconds']:.2f}×** | {each} | {diff:.1e} |")
        lines.append("")
    publish(args.out, lines, clock)


if __name__ == "__main__":
    main()
