"""``captioner`` subcommands that need only the models package: data, train, eval, caption, params.

The console script itself lives in :mod:`service.cli`, which adds ``serve`` on top of these, so that models/
never imports service/.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

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
    from .data.scenes import generate

    sizes = {"train": args.train, "val": args.val, "test": args.test, "heldout": args.heldout}
    path = generate(args.out, sizes, seed=args.seed, workers=args.workers)
    print(f"wrote {path}")


def cmd_train(args: argparse.Namespace) -> None:
    from .training import TrainConfig, train
    from .training.xe import TrainingInterrupted

    model_args = _key_values(args.set)
    if args.attention:
        model_args["attention"] = args.attention
    dataset = Path(args.dataset)
    if dataset.is_dir():
        dataset = dataset / "dataset_scenes.json"
    cfg = TrainConfig(dataset=str(dataset), out=args.out, model=args.model, model_args=model_args,
                      image_root=args.image_root, encoder=_key_values(args.encoder), cache_dir=args.cache_dir,
                      epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, min_count=args.min_count,
                      label_smoothing=args.label_smoothing, seed=args.seed, device=args.device,
                      threads=args.threads, max_steps=args.max_steps, train_limit=args.train_limit,
                      val_limit=args.val_limit, select_metric=args.select_metric)
    try:
        best = train(cfg, resume=args.resume)
    except TrainingInterrupted as exc:
        print(exc, file=sys.stderr)
        raise SystemExit(130) from None
    print(f"best checkpoint: {best}")


def cmd_eval(args: argparse.Namespace) -> None:
    from .checkpoint import load_checkpoint
    from .data.features import extract_features
    from .data.karpathy import load_karpathy
    from .device import resolve_device, set_threads
    from .metrics import ALL_METRICS, UNAVAILABLE
    from .training import evaluate_checkpoint

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
        store = extract_features(images, ckpt.encoder, args.cache_dir, device=str(device))
        metrics = [m for m in ALL_METRICS if not (args.no_meteor and m == "METEOR")]
        scores, captions = evaluate_checkpoint(ckpt, images, store, args.beam_size, args.max_len, metrics,
                                               device=str(device))
        if images[0].info.get("objects") is not None:
            from .data.scenes import object_naming_accuracy

            scores["objects_named"] = object_naming_accuracy(
                [(captions[im.image_id], im.info["objects"]) for im in images])
        report[split] = {"images": len(images), **{k: round(v, 4) for k, v in scores.items()}}
        report[split]["SPICE"] = f"unavailable: {UNAVAILABLE['SPICE']}"
        for im in images[: args.show]:
            print(f"  {im.path.name}: {' '.join(captions[im.image_id])}", file=sys.stderr)
    text = json.dumps(report, indent=2)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")


def cmd_caption(args: argparse.Namespace) -> None:
    from .device import resolve_device, set_threads
    from .encoder import ImageDecodeError
    from .pipeline import Pipeline
    from .render import RenderError, caption_figure, overlay

    set_threads(args.threads)
    pipeline = Pipeline(args.checkpoint, resolve_device(args.device))
    try:
        results = pipeline(args.images, beam_size=args.beam_size, max_len=args.max_len)
    except (ImageDecodeError, FileNotFoundError) as exc:
        raise SystemExit(f"error: {exc}") from None
    for path, result in zip(args.images, results):
        hyp = result.hypothesis
        if args.json:
            print(json.dumps({"image": str(path), "caption": " ".join(result.words), "tokens": result.tokens,
                              "token_logprobs": [round(v, 5) for v in hyp.token_logprobs],
                              "geometry": result.geometry.to_json(),
                              "attention": [[round(v, 6) for v in row] for row in hyp.attention.tolist()]}))
        else:
            print(f"{path}: {' '.join(result.words)}")
    if args.overlay:
        if len(results) != 1:
            raise SystemExit("error: --overlay takes exactly one image")
        result = results[0]
        try:
            if args.token is None:
                picture = caption_figure(result.image, result.tokens, result.hypothesis.attention.numpy(),
                                         result.geometry, args.mode, args.cmap, args.alpha)
            else:
                if not 0 <= args.token < len(result.tokens):
                    raise RenderError(f"--token {args.token} is out of range (0..{len(result.tokens) - 1})")
                picture = overlay(result.image, result.hypothesis.attention[args.token].numpy(), result.geometry,
                                  args.mode, args.cmap, args.alpha)
        except RenderError as exc:
            raise SystemExit(f"error: {exc}") from None
        picture.save(args.overlay)
        print(f"wrote {args.overlay}", file=sys.stderr)


def cmd_params(args: argparse.Namespace) -> None:
    from .params import parameter_table

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

    tr = sub.add_parser("train", help="XE training with validation, best-checkpoint selection and resume")
    tr.add_argument("--model", default="sat", help="registered model name (see `captioner models`)")
    tr.add_argument("--attention", help="attention normaliser for models that take one (softmax/sparsemax/tvmax)")
    tr.add_argument("--dataset", default=DEFAULT_DATA, help="Karpathy-split JSON, or a folder holding dataset_scenes.json")
    tr.add_argument("--image-root", help="folder the JSON's filepath/filename are relative to (default: the JSON's)")
    tr.add_argument("--out", required=True, help="run directory (best/, last/, train_state.*)")
    tr.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="model hyper-parameter")
    tr.add_argument("--encoder", action="append", default=[], metavar="KEY=VALUE", help="EncoderSpec field")
    tr.add_argument("--cache-dir", default=".cache/features")
    tr.add_argument("--epochs", type=int, default=20)
    tr.add_argument("--batch-size", type=int, default=64)
    tr.add_argument("--lr", type=float, default=4e-4)
    tr.add_argument("--min-count", type=int, default=1, help="keep words seen at least this often")
    tr.add_argument("--label-smoothing", type=float, default=0.0)
    tr.add_argument("--select-metric", help="validation metric for the best checkpoint (default: the model's)")
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
    ev.add_argument("--device", default="auto")
    ev.add_argument("--threads", type=int)
    ev.add_argument("--output", help="also write the JSON report here")
    ev.set_defaults(func=cmd_eval, split=None)

    cap = sub.add_parser("caption", help="caption image files, optionally rendering the attention (no server)")
    cap.add_argument("images", nargs="+")
    cap.add_argument("--checkpoint", default="weights/sat-scenes")
    cap.add_argument("--beam-size", type=int, default=3)
    cap.add_argument("--max-len", type=int, default=20)
    cap.add_argument("--overlay", metavar="OUT.png", help="write the per-word figure (or one word with --token)")
    cap.add_argument("--token", type=int, help="render only this token's heatmap")
    cap.add_argument("--mode", help="grid_smooth, grid_blocks, region_sum, top1_box (default: by model)")
    cap.add_argument("--cmap", default="jet")
    cap.add_argument("--alpha", type=float, default=0.5)
    cap.add_argument("--json", action="store_true", help="print the full result as JSON lines")
    cap.add_argument("--device", default="auto")
    cap.add_argument("--threads", type=int)
    cap.set_defaults(func=cmd_caption)

    pa = sub.add_parser("params", help="parameter counts of every model at the papers' sizes")
    pa.add_argument("--vocab-size", type=int, default=10369)
    pa.set_defaults(func=cmd_params)

    ls = sub.add_parser("models", help="list registered model architectures")
    ls.set_defaults(func=cmd_models)


def cmd_models(args: argparse.Namespace) -> None:
    from .registry import available

    print("\n".join(available()))
