"""``captioner`` subcommands that need only the models package: data, train, eval, caption, export, params.

The console script itself lives in :mod:`service.cli`, which adds ``serve`` on top of these, so that models/
never imports service/.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

#: the checkpoint that ships with the repository and that `make serve` serves
DEFAULT_CHECKPOINT = "weights/sat-scenes"

DEFAULT_DATA = ".cache/scenes"


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _key_values(pairs: list[str]) -> dict[str, Any]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"error: expected KEY=VALUE, got {pair!r}")
        out[key.replace("-", "_")] = _parse_value(value)
    return out


# ----------------------------------------------------------------------------------------------------------------
def cmd_data_generate(args: argparse.Namespace) -> None:
    from ..data.scenes import generate

    sizes = {"train": args.train, "val": args.val, "test": args.test, "heldout": args.heldout}
    path = generate(args.out, sizes, seed=args.seed, workers=args.workers)
    print(f"wrote {path}")


def cmd_data_regions(args: argparse.Namespace) -> None:
    from ..data.regions import write_scene_regions
    from ..device import resolve_device
    from ..encoder import EncoderSpec

    out = write_scene_regions(args.dataset, args.out, EncoderSpec(**_key_values(args.encoder)), args.cache_dir,
                              device=str(resolve_device(args.device)))
    print(f"wrote region features to {out}; train on them with --features regions:{out}")


def cmd_train(args: argparse.Namespace) -> None:
    from ..training import TrainConfig, TrainingInterrupted, train

    model_args = _key_values(args.set)
    if args.attention:
        model_args["attention"] = args.attention
    dataset = Path(args.dataset)
    if dataset.is_dir():
        dataset = dataset / "dataset_scenes.json"
    cfg = TrainConfig(dataset=str(dataset), out=args.out, model=args.model, model_args=model_args,
                      image_root=args.image_root, encoder=_key_values(args.encoder), cache_dir=args.cache_dir,
                      epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, lr_drops=args.lr_drop,
                      lr_drop_factor=args.lr_drop_factor, min_count=args.min_count,
                      label_smoothing=args.label_smoothing, seed=args.seed, device=args.device,
                      threads=args.threads, max_steps=args.max_steps, train_limit=args.train_limit,
                      val_limit=args.val_limit, select_metric=args.select_metric, phase=args.phase,
                      init=args.init, features=args.features, scst_samples=args.scst_samples,
                      scst_baseline=args.scst_baseline)
    try:
        best = train(cfg, resume=args.resume)
    except TrainingInterrupted as exc:
        print(exc, file=sys.stderr)
        raise SystemExit(130) from None
    print(f"best checkpoint: {best}")


def cmd_eval(args: argparse.Namespace) -> None:
    from ..checkpoint import load_checkpoint
    from ..data.stores import open_feature_store
    from ..data.karpathy import load_karpathy
    from ..device import resolve_device, set_threads
    from ..evaluation.metrics import ALL_METRICS, UNAVAILABLE
    from ..training import evaluate_checkpoint

    set_threads(args.threads)
    device = resolve_device(args.device)
    ckpt = load_checkpoint(args.checkpoint, device)
    dataset = Path(args.dataset)
    if dataset.is_dir():
        dataset = dataset / "dataset_scenes.json"
    report: dict[str, Any] = {"checkpoint": str(args.checkpoint), "dataset": str(dataset), "beam_size": args.beam_size}
    for split in args.split or ["test"]:
        images = load_karpathy(dataset, args.image_root, (split,), limit=args.limit)
        if not images:
            raise SystemExit(f"error: split {split!r} of {dataset} is empty")
        # by default the features the model was trained on (grid, or regions:DIR)
        features = args.features or ckpt.meta.get("train_config", {}).get("features")
        store = open_feature_store(features, images, ckpt.encoder, args.cache_dir, device=str(device))
        metrics = [m for m in ALL_METRICS if not (args.no_meteor and m == "METEOR")]
        scores, captions = evaluate_checkpoint(ckpt, images, store, args.beam_size, args.max_len, metrics,
                                               device=str(device))
        report[split] = {"images": len(images), **{k: round(v, 4) for k, v in scores.items()}}
        report[split]["SPICE"] = f"unavailable: {UNAVAILABLE['SPICE']}"
        for im in images[: args.show]:
            print(f"  {im.path.name}: {' '.join(captions[im.image_id])}", file=sys.stderr)
    text = json.dumps(report, indent=2)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")


def _label(checkpoint: str | Path) -> str:
    """A checkpoint's short name: its folder, or ``run/best`` for the folders a training run writes."""
    path = Path(checkpoint)
    return f"{path.parent.name}/{path.name}" if path.name in ("best", "last") else path.name


def cmd_caption(args: argparse.Namespace) -> None:
    """Caption images with one checkpoint or several (``--checkpoint`` repeated: a side-by-side comparison)."""
    from ..device import resolve_device, set_threads
    from ..encoder import ImageDecodeError
    from ..pipeline import Pipeline
    from ..rendering.heatmaps import FigureRow, RenderError, caption_figure, comparison_figure, overlay

    set_threads(args.threads)
    checkpoints = args.checkpoint or [DEFAULT_CHECKPOINT]
    if args.overlay and len(args.images) != 1:
        raise SystemExit("error: --overlay takes exactly one image")
    if args.token is not None and len(checkpoints) > 1:
        raise SystemExit("error: --token renders one checkpoint's word; drop it to compare checkpoints")
    device = resolve_device(args.device)
    runs = []
    for checkpoint in checkpoints:
        try:
            results = Pipeline(checkpoint, device)(args.images, beam_size=args.beam_size, max_len=args.max_len)
        except (ImageDecodeError, FileNotFoundError) as exc:
            raise SystemExit(f"error: {exc}") from None
        runs.append((_label(checkpoint), results))
        for path, result in zip(args.images, results):
            hyp = result.hypothesis
            if args.json:
                print(json.dumps({"image": str(path), "checkpoint": str(checkpoint), "caption": " ".join(result.words),
                                  "tokens": result.tokens, "token_logprobs": [round(v, 5) for v in hyp.token_logprobs],
                                  "geometry": result.geometry.to_json(),
                                  "attention": [[round(v, 6) for v in row] for row in hyp.attention.tolist()]}))
            else:
                label = f" [{_label(checkpoint)}]" if len(checkpoints) > 1 else ""
                print(f"{path}{label}: {' '.join(result.words)}")
    if not args.overlay:
        return
    try:
        if len(runs) > 1:
            picture = comparison_figure(runs[0][1][0].image, [
                FigureRow(name, r.tokens, r.hypothesis.attention.numpy(), r.geometry, r.area_boxes, args.mode)
                for name, (r,) in runs], args.cmap, args.alpha)
        else:
            (result,) = runs[0][1]
            if args.token is None:
                picture = caption_figure(result.image, result.tokens, result.hypothesis.attention.numpy(),
                                         result.geometry, args.mode, args.cmap, args.alpha, area_boxes=result.area_boxes)
            else:
                if not 0 <= args.token < len(result.tokens):
                    raise RenderError(f"--token {args.token} is out of range (0..{len(result.tokens) - 1})")
                picture = overlay(result.image, result.hypothesis.attention[args.token].numpy(), result.geometry,
                                  args.mode, args.cmap, args.alpha, result.area_boxes)
    except RenderError as exc:
        raise SystemExit(f"error: {exc}") from None
    picture.save(args.overlay)
    print(f"wrote {args.overlay}", file=sys.stderr)


def cmd_export(args: argparse.Namespace) -> None:
    """Export every checkpoint (of ``--weights-dir`` plus the named folders) to ONNX, one folder per model."""
    from ..checkpoint import find_checkpoints
    from ..device import set_threads
    from ..export.onnx import ENCODER_FILE, STEP_FILE, ExportUnsupported, export_checkpoints

    set_threads(args.threads)
    weights_dir = None if args.checkpoints and not args.all else args.weights_dir
    found = find_checkpoints(weights_dir, args.checkpoints)
    missing = [c for c in args.checkpoints if Path(c).name not in found]
    if missing:
        raise SystemExit(f"error: not a checkpoint folder: {', '.join(missing)}")
    if not found:
        raise SystemExit(f"error: no checkpoint found in {args.weights_dir}")
    out = Path(args.out)

    def report(name: str, result) -> None:
        if isinstance(result, ExportUnsupported):
            print(f"{name}: NOT EXPORTED: {result}")
            return
        sizes = ", ".join(f"{f} {(out / name / f).stat().st_size / 1e6:.1f} MB" for f in (ENCODER_FILE, STEP_FILE))
        diffs = ", ".join(f"{k} {v:.1e}" for k, v in sorted(result.max_abs_diff.items()))
        grows = {k: v for k, v in result.growing_dims.items() if v}
        print(f"{name}: {out / name} ({sizes}); verified against PyTorch, max |diff|: {diffs}"
              + (f"; growing state dims {grows}" if grows else ""))

    results = export_checkpoints(found, out, log=report)
    failed = [name for name, result in results.items() if isinstance(result, ExportUnsupported)]
    if failed and args.strict:
        raise SystemExit(1)


def cmd_card(args: argparse.Namespace) -> None:
    """Write a checkpoint's MODEL_CARD.md from its training record and a `captioner eval --output` report."""
    from ..evaluation.card import write_card

    notes = Path(args.notes).read_text() if args.notes else ""
    print(f"wrote {write_card(args.checkpoint, json.loads(Path(args.report).read_text()), args.title, notes)}")


def cmd_params(args: argparse.Namespace) -> None:
    from ..evaluation.params import parameter_table

    for name, count in parameter_table(args.vocab_size).items():
        print(f"{name:16s} {count:>14,d}")


# ----------------------------------------------------------------------------------------------------------------
def add_commands(sub: argparse._SubParsersAction) -> None:
    data = sub.add_parser("data", help="datasets").add_subparsers(dest="data_command", required=True)
    gen = data.add_parser("generate", help="write the generated-scene dataset (Karpathy JSON + images + masks)")
    gen.add_argument("--out", default=DEFAULT_DATA)
    gen.add_argument("--train", type=int, default=6000)
    gen.add_argument("--val", type=int, default=500)
    gen.add_argument("--test", type=int, default=500)
    gen.add_argument("--heldout", type=int, default=500)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--workers", type=int, default=2)
    gen.set_defaults(func=cmd_data_generate)
    reg = data.add_parser("regions", help="region features (.npz per image) for the generated scenes: object "
                          "masks pooled over the frozen encoder's grid, a detector stand-in")
    reg.add_argument("--dataset", default=DEFAULT_DATA, help="scene folder or its dataset_scenes.json")
    reg.add_argument("--out", required=True, help="folder for the .npz files (then: train --features regions:OUT)")
    reg.add_argument("--encoder", action="append", default=[], metavar="KEY=VALUE", help="EncoderSpec field")
    reg.add_argument("--cache-dir", default=".cache/features")
    reg.add_argument("--device", default="auto")
    reg.set_defaults(func=cmd_data_regions)

    tr = sub.add_parser("train", help="XE training with validation, best-checkpoint selection and resume")
    tr.add_argument("--model", help="registered model name (see `captioner models`; default: sat, or --init's)")
    tr.add_argument("--phase", choices=("xe", "scst"), default="xe",
                    help="xe: cross-entropy (SAT-hard: its REINFORCE objective); scst: self-critical CIDEr-D")
    tr.add_argument("--init", metavar="CHECKPOINT", help="start from this checkpoint's model, vocabulary and encoder "
                    "(e.g. --phase scst --init runs/xe/best)")
    tr.add_argument("--features", metavar="grid|regions:DIR",
                    help="visual items: frozen-encoder grid (default) or precomputed region .npz files in DIR")
    tr.add_argument("--scst-samples", type=int, default=5, help="captions sampled per image in SCST")
    tr.add_argument("--scst-baseline", choices=("greedy", "mean"), default="greedy",
                    help="SCST baseline: the greedy caption's reward (SPEC) or the mean of the other samples'"),
    tr.add_argument("--attention", help="attention normaliser for models that take one (softmax/sparsemax/tvmax)")
    tr.add_argument("--dataset", default=DEFAULT_DATA, help="Karpathy-split JSON, or a folder holding dataset_scenes.json")
    tr.add_argument("--image-root", help="folder the JSON's filepath/filename are relative to (default: the JSON's)")
    tr.add_argument("--out", required=True, help="run directory (best/, last/, train_state.*)")
    tr.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="model hyper-parameter")
    tr.add_argument("--encoder", action="append", default=[], metavar="KEY=VALUE", help="EncoderSpec field")
    tr.add_argument("--cache-dir", default=".cache/features")
    tr.add_argument("--epochs", type=int, default=20)
    tr.add_argument("--batch-size", type=int, default=64, help="captions (xe) or images (scst) per batch")
    tr.add_argument("--lr", type=float, default=4e-4)
    tr.add_argument("--lr-drop", type=int, action="append", default=[], metavar="EPOCH",
                    help="after this many epochs multiply the learning rate by --lr-drop-factor (repeatable; "
                         "with --resume, drops may be added ahead of the run)")
    tr.add_argument("--lr-drop-factor", type=float, default=0.1)
    tr.add_argument("--min-count", type=int, default=1, help="keep words seen at least this often")
    tr.add_argument("--label-smoothing", type=float, default=0.0)
    tr.add_argument("--select-metric", help="validation metric that picks best/: BLEU-1..4, CIDEr-D, or objects_named "
                         "on generated scenes (default: the model's)")
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--device", default="auto")
    tr.add_argument("--threads", type=int)
    tr.add_argument("--max-steps", type=int, help="stop after this many steps (smoke tests)")
    tr.add_argument("--train-limit", type=int)
    tr.add_argument("--val-limit", type=int)
    tr.add_argument("--resume", action="store_true", help="continue the run in --out where it stopped")
    tr.set_defaults(func=cmd_train)

    ev = sub.add_parser("eval", help="BLEU-1..4, METEOR, ROUGE-L, CIDEr-D of a checkpoint on a split")
    ev.add_argument("checkpoint")
    ev.add_argument("--dataset", default=DEFAULT_DATA)
    ev.add_argument("--image-root")
    ev.add_argument("--split", action="append", help="split(s) to score (default: test)")
    ev.add_argument("--beam-size", type=int, default=3)
    ev.add_argument("--max-len", type=int, default=20)
    ev.add_argument("--limit", type=int)
    ev.add_argument("--no-meteor", action="store_true", help="skip METEOR (needs Java)")
    ev.add_argument("--show", type=int, default=0, help="print this many captions")
    ev.add_argument("--cache-dir", default=".cache/features")
    ev.add_argument("--features", metavar="grid|regions:DIR", help="visual items (default: the training run's)")
    ev.add_argument("--device", default="auto")
    ev.add_argument("--threads", type=int)
    ev.add_argument("--output", help="also write the JSON report here")
    ev.set_defaults(func=cmd_eval, split=None)

    cap = sub.add_parser("caption", help="caption image files, optionally rendering the attention (no server)")
    cap.add_argument("images", nargs="+")
    cap.add_argument("--checkpoint", action="append",
                     help=f"checkpoint folder (default {DEFAULT_CHECKPOINT}); repeat it to compare checkpoints side by "
                          "side, one figure row each")
    cap.add_argument("--beam-size", type=int, default=3)
    cap.add_argument("--max-len", type=int, default=20)
    cap.add_argument("--overlay", metavar="OUT.png", help="write the per-word figure (or one word with --token)")
    cap.add_argument("--token", type=int, help="render only this token's heatmap")
    cap.add_argument("--mode", help="grid_smooth, grid_blocks, region_sum, top1_box, area_topk (default: by model)")
    cap.add_argument("--cmap", default="jet")
    cap.add_argument("--alpha", type=float, default=0.5)
    cap.add_argument("--json", action="store_true", help="print the full result as JSON lines")
    cap.add_argument("--device", default="auto")
    cap.add_argument("--threads", type=int)
    cap.set_defaults(func=cmd_caption)

    ex = sub.add_parser("export", help="export checkpoints to ONNX (encoder graph + decoder-step graph) for the "
                        "service's ONNX Runtime backend")
    ex.add_argument("checkpoints", nargs="*", help="checkpoint folders (default: every one in --weights-dir)")
    ex.add_argument("--weights-dir", default=os.environ.get("CAPTIONER_WEIGHTS_DIR", "weights"),
                    help="export every checkpoint below it (CAPTIONER_WEIGHTS_DIR)")
    ex.add_argument("--all", action="store_true", help="with named checkpoints: also every one in --weights-dir")
    ex.add_argument("--out", default=os.environ.get("CAPTIONER_ONNX_DIR", ".cache/onnx"),
                    help="one folder per model is written below it (CAPTIONER_ONNX_DIR, where the service looks)")
    ex.add_argument("--strict", action="store_true", help="exit 1 when any model cannot be exported")
    ex.add_argument("--threads", type=int)
    ex.set_defaults(func=cmd_export)

    cd = sub.add_parser("card", help="write a checkpoint's MODEL_CARD.md from its training record and an eval report")
    cd.add_argument("checkpoint")
    cd.add_argument("--report", required=True, help="the JSON written by `captioner eval --output`")
    cd.add_argument("--title")
    cd.add_argument("--notes", metavar="FILE", help="a Markdown file appended as the card's Notes section")
    cd.set_defaults(func=cmd_card)

    pa = sub.add_parser("params", help="parameter counts of every model at the papers' sizes")
    pa.add_argument("--vocab-size", type=int, default=10369)
    pa.set_defaults(func=cmd_params)

    ls = sub.add_parser("models", help="list registered model architectures")
    ls.set_defaults(func=cmd_models)


def cmd_models(args: argparse.Namespace) -> None:
    from ..zoo import available

    print("\n".join(available()))
