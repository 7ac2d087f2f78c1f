"""``captioner`` subcommands that need only the models package: data, train, eval, caption, export, params.

The console script itself lives in :mod:`captioner.service.cli`, which adds ``serve`` on top of these, so that models/
never imports service/.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

#: the checkpoint that `make serve` serves by default (SAT soft trained on Flickr8k photos; the generated-scene
#: SAT is weights/sat: docs/decisions.md, "Flickr8k: where the checkpoints live and which are served")
DEFAULT_CHECKPOINT = "weights/flickr8k/sat"

DEFAULT_DATA = ".cache/scenes"


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def add_decoding_options(parser: argparse.ArgumentParser) -> None:
    """The beam search's rules against short and repetitive captions (models/decoding.py, DecodingRules)."""
    parser.add_argument("--length-penalty", type=float, metavar="ALPHA",
                        help="GNMT length penalty α, 0 to 5 (default: the checkpoint's, chosen on validation by "
                             "`captioner tune-decoding`; 0: none)")
    parser.add_argument("--block-trigrams", action=argparse.BooleanOptionalAction, default=None,
                        help="never repeat a word trigram within a caption (default: the checkpoint's)")


def decoding_rules(ckpt, args: argparse.Namespace):
    from ..decoding import DecodingRules

    return DecodingRules.of_checkpoint(ckpt.meta).overridden(args.length_penalty, args.block_trigrams)


def _training_captions(dataset, image_root) -> list[list[str]]:
    """The captions a model was trained on (its data set's train split), for the share of its captions that are new."""
    from ..data.datasets import load_captioned

    return [r for im in load_captioned(dataset, image_root, ("train",), check_images=False) for r in im.references]


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
    from ..data.scenes import VARIATIONS, generate, is_current

    sizes = {"train": args.train, "val": args.val, "test": args.test, "heldout": args.heldout}
    variation = VARIATIONS[args.varied] if args.varied else None
    if args.if_stale and is_current(args.out, sizes, args.seed, variation):
        print(f"{args.out} is up to date (same generator version, seed, sizes and variation)")
        return
    path = generate(args.out, sizes, seed=args.seed, workers=args.workers, variation=variation)
    print(f"wrote {path}")


def cmd_data_ood(args: argparse.Namespace) -> None:
    from ..data.ood import generate_ood

    print(f"wrote {generate_ood(args.out, args.images, seed=args.seed)}")


def cmd_data_regions(args: argparse.Namespace) -> None:
    from ..data.regions import write_scene_regions
    from ..device import resolve_device
    from ..encoder import EncoderSpec

    out = write_scene_regions(args.dataset, args.out, EncoderSpec(**_key_values(args.encoder)), args.cache_dir,
                              device=str(resolve_device(args.device)))
    print(f"wrote region features to {out}; train on them with --features regions:{out}")


def _config_fields():
    from dataclasses import fields
    from typing import get_type_hints

    from ..training import TrainConfig

    hints = get_type_hints(TrainConfig)
    return [(f, hints[f.name]) for f in fields(TrainConfig) if f.metadata.get("cli", True)]


def _scalar_type(hint: Any) -> Any:
    """``int | None`` → int; ``list[int]`` → int."""
    import typing

    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is list:
        return args[0]
    return args[0] if args else hint


def add_train_config_arguments(parser: argparse.ArgumentParser) -> None:
    """One option per :class:`TrainConfig` field, help from the field's metadata; defaults are the dataclass's
    (shown, not restated): options left out are absent from the namespace, so a recipe's values stand unless a
    flag overrides them."""
    from dataclasses import MISSING

    for f, hint in _config_fields():
        meta = f.metadata
        flag = meta.get("flag") or "--" + f.name.replace("_", "-")
        default = f.default if f.default is not MISSING else (f.default_factory() if f.default_factory is not MISSING
                                                              else None)
        help_text = meta.get("help", "")
        if default not in (None, [], {}) and meta.get("kind") not in ("false", "true"):
            help_text += f" (default: {default})"
        kind = meta.get("kind")
        common = dict(dest=f.name, help=help_text, default=argparse.SUPPRESS)
        if kind == "keyvalue":
            parser.add_argument(flag, action="append", metavar="KEY=VALUE", **common)
        elif kind == "append":
            parser.add_argument(flag, action="append", type=_scalar_type(hint), metavar=meta.get("metavar"), **common)
        elif kind == "pair":
            parser.add_argument(flag, nargs=2, type=_scalar_type(hint), metavar=("B1", "B2"), **common)
        elif kind == "false":
            parser.add_argument(flag, action="store_false", **common)
        elif kind == "true":
            parser.add_argument(flag, action="store_true", **common)
        else:
            parser.add_argument(flag, type=_scalar_type(hint), choices=meta.get("choices"), metavar=meta.get("metavar"),
                                required=meta.get("required", False), **common)


def train_config_from_args(args: argparse.Namespace):
    """Config defaults ← the recipe (``--recipe``) ← the flags given."""
    from ..training import TrainConfig, load_recipe

    given = {f.name: getattr(args, f.name) for f, _ in _config_fields() if hasattr(args, f.name)}
    for name in ("model_args", "encoder"):
        if name in given:
            given[name] = _key_values(given[name])
    if args.attention:
        given.setdefault("model_args", {})["attention"] = args.attention
    values: dict[str, Any] = {}
    if given.get("recipe"):
        try:
            values = load_recipe(given["recipe"], given.get("phase"))
        except ValueError as exc:
            raise SystemExit(f"error: {exc}") from None
    model_args = {**values.get("model_args", {}), **given.get("model_args", {})}
    values.update(given)
    if model_args:
        values["model_args"] = model_args
    return TrainConfig(**values)


def cmd_train(args: argparse.Namespace) -> None:
    from ..training import TrainingInterrupted, train

    cfg = train_config_from_args(args)
    try:
        best = train(cfg, resume=args.resume)
    except TrainingInterrupted as exc:
        print(exc, file=sys.stderr)
        raise SystemExit(130) from None
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    print(f"best checkpoint: {best}")


def cmd_eval(args: argparse.Namespace) -> None:
    from ..checkpoint import load_checkpoint
    from ..data.stores import open_feature_store
    from ..data.datasets import load_captioned, resolve_dataset
    from ..device import resolve_device, set_threads
    from ..evaluation.metrics import ALL_METRICS, UNAVAILABLE
    from ..training import evaluate_checkpoint

    set_threads(args.threads)
    grounding, entities = _grounding_benchmark(args.grounding)
    device = resolve_device(args.device)
    ckpt = load_checkpoint(args.checkpoint, device)
    dataset, image_root = args.dataset or DEFAULT_DATA, args.image_root
    trained_on = ckpt.meta.get("train_config", {})
    if args.dataset is None and entities is not None and trained_on.get("dataset"):
        # Entities annotate the photos the model was trained on: by default its own data set's split
        dataset, image_root = trained_on["dataset"], image_root or trained_on.get("image_root")
    dataset = resolve_dataset(dataset)
    rules = decoding_rules(ckpt, args)
    report: dict[str, Any] = {"checkpoint": str(args.checkpoint), "dataset": str(dataset), "beam_size": args.beam_size,
                              "decoding": asdict(rules), "encoder_precision": args.encoder_precision}
    training_captions = _training_captions(dataset, image_root)
    coco_results: list[dict[str, Any]] = []
    for split in args.split or ["test"]:
        images = load_captioned(dataset, image_root, (split,), limit=args.limit)
        if not images:
            raise SystemExit(f"error: split {split!r} of {dataset} is empty")
        # by default the features the model was trained on (grid, or regions:DIR)
        features = args.features or ckpt.meta.get("train_config", {}).get("features")
        if args.encoder_precision == "float32":
            store = open_feature_store(features, images, ckpt.encoder, args.cache_dir, device=str(device))
        else:
            store = _onnx_feature_store(args, images, ckpt, features)
        metrics = [m for m in ALL_METRICS if not (args.no_meteor and m == "METEOR")]
        if grounding:
            # one beam search gives both the captions that are scored and the attention rows that are grounded
            from ..evaluation.evaluate import score_dataset
            from ..evaluation.grounding import caption_with_attention, grounding_report

            results = caption_with_attention(ckpt, images, store, args.beam_size, args.max_len, device=str(device),
                                             progress=True, rules=rules)
            captions = {im.image_id: r.tokens for im, r in zip(images, results)}
            scores = score_dataset(captions, images, metrics, training_captions)
        else:
            scores, captions = evaluate_checkpoint(ckpt, images, store, args.beam_size, args.max_len, metrics,
                                                   device=str(device), rules=rules,
                                                   training_captions=training_captions)
        report[split] = {"images": len(images), **{k: round(v, 4) for k, v in scores.items()}}
        report[split]["SPICE"] = f"unavailable: {UNAVAILABLE['SPICE']}"
        if grounding == "scenes":
            report[split]["grounding"] = grounding_report(ckpt, images, results, dataset.parent,
                                                          args.grounding_resamples)
        elif grounding == "entities":
            report[split]["grounding"] = _entities_section(ckpt, images, store, entities, results, args, str(device))
        for im in images[: args.show]:
            print(f"  {im.path.name}: {' '.join(captions[im.image_id])}", file=sys.stderr)
        # COCO's evaluation server and coco-caption key results by the COCO id (Karpathy's "cocoid"), not "imgid"
        coco_results += [{"image_id": int(im.info.get("cocoid", im.image_id)), "caption": " ".join(captions[im.image_id])}
                         for im in images]
    text = json.dumps(report, indent=2)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")
    if args.results_json:  # the COCO caption-evaluation results format
        Path(args.results_json).write_text(json.dumps(coco_results) + "\n")
        print(f"wrote {len(coco_results)} captions to {args.results_json}", file=sys.stderr)


def cmd_tune_decoding(args: argparse.Namespace) -> None:
    from ..checkpoint import load_checkpoint, update_meta
    from ..data.datasets import load_captioned, resolve_dataset
    from ..data.stores import open_feature_store
    from ..device import resolve_device, set_threads
    from ..evaluation.tuning import best_row, decoding_grid, markdown_table, rules_of

    if args.write and args.split == "test":
        raise SystemExit("error: --write keeps the rules chosen on this split as the checkpoint's defaults: choose "
                         "them on validation data (--split val) and report on test")
    set_threads(args.threads)
    device = resolve_device(args.device)
    ckpt = load_checkpoint(args.checkpoint, device)
    dataset = resolve_dataset(args.dataset)
    images = load_captioned(dataset, args.image_root, (args.split,), limit=args.limit)
    if not images:
        raise SystemExit(f"error: split {args.split!r} of {dataset} is empty")
    training_captions = _training_captions(dataset, args.image_root)
    features = ckpt.meta.get("train_config", {}).get("features")
    store = open_feature_store(features, images, ckpt.encoder, args.cache_dir, device=str(device))
    rows = decoding_grid(ckpt, images, store, args.length_penalties, args.block_trigrams, args.beam_size,
                         args.max_len, device=str(device), training_captions=training_captions)
    chosen = best_row(rows, args.metric)
    best, score = rules_of(chosen), chosen[args.metric]
    columns = ["BLEU-1", "BLEU-4", "ROUGE-L", "CIDEr-D", "REP", "distinct_words", "novel_captions", "mean_length"]
    table = markdown_table(rows, columns)
    print(table)
    print(f"best by {args.metric} on {args.split}: length_penalty={best.length_penalty:g}, "
          f"block_trigrams={best.block_trigrams}")
    if args.output:
        Path(args.output).write_text(json.dumps({"checkpoint": str(args.checkpoint), "dataset": str(dataset),
                                                 "split": args.split, "beam_size": args.beam_size,
                                                 "metric": args.metric, "best": asdict(best), "rows": rows},
                                                indent=2) + "\n")
    if args.write:
        update_meta(args.checkpoint, decoding=asdict(best),
                    decoding_chosen_on={"dataset": str(dataset), "split": args.split, "metric": args.metric,
                                        "beam_size": args.beam_size, "images": len(images),
                                        "score": score,
                                        "storage": ckpt.storage})
        print(f"stored as the defaults of {args.checkpoint}")


def cmd_resolution_check(args: argparse.Namespace) -> None:
    from ..data.datasets import load_captioned, resolve_dataset
    from ..device import resolve_device, set_threads
    from ..evaluation.resolution import resolution_check
    from ..pipeline import Pipeline

    set_threads(args.threads)
    pipeline = Pipeline(args.checkpoint, resolve_device(args.device))
    images = load_captioned(resolve_dataset(args.dataset), args.image_root, (args.split,))
    report = resolution_check(pipeline, images, Path(args.full_root), args.beam_size, args.max_len,
                              decoding_rules(pipeline.ckpt, args))
    text = json.dumps(report, indent=2)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")
def _grounding_benchmark(value: str | None) -> tuple[str | None, Path | None]:
    """``--grounding`` (the scenes' masks) or ``--grounding entities:DIR`` (Flickr30k Entities boxes), checked
    before any work is done."""
    if value is None or value == "scenes":
        return value, None
    kind, _, where = value.partition(":")
    if kind != "entities" or not where:
        raise SystemExit(f"error: --grounding takes no value (the scenes' masks) or entities:DIR, got {value!r}")
    if not ((Path(where) / "Sentences").is_dir() and (Path(where) / "Annotations").is_dir()):
        raise SystemExit(f"error: {where} is not a Flickr30k Entities folder (no Sentences/ and Annotations/)")
    return kind, Path(where)


def _entities_section(ckpt, images, store, entities: Path, results, args: argparse.Namespace, device: str) -> dict:
    """The Flickr30k Entities grounding of one split, its tables printed to stderr (stdout stays the JSON)."""
    from ..data.entities import EntitiesFormatError
    from ..evaluation.phrase_grounding import entities_grounding, summary_table, type_table

    try:
        section = entities_grounding(ckpt, images, store, entities, results, resamples=args.grounding_resamples,
                                     device=device)
    except (EntitiesFormatError, ValueError) as exc:
        raise SystemExit(f"error: {exc}") from None
    name = _label(args.checkpoint)
    print(f"\nattention grounding, Flickr30k Entities (Plummer et al., arXiv:1505.04870), {section['photos']} photos:\n"
          f"{summary_table([(name, section)])}\n\nper phrase type, references teacher-forced:\n"
          f"{type_table([(name, section)])}\n", file=sys.stderr)
    return section


def cmd_compare(args: argparse.Namespace) -> None:
    from ..data.datasets import load_captioned, resolve_dataset
    from ..evaluation.compare import compare_captions, markdown

    dataset = resolve_dataset(args.dataset)
    images = load_captioned(dataset, args.image_root, (args.split,), check_images=False)
    if not images:
        raise SystemExit(f"error: split {args.split!r} of {dataset} is empty")
    sides = []
    for path in args.results:
        try:
            sides.append({int(r["image_id"]): str(r["caption"]) for r in json.loads(Path(path).read_text())})
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise SystemExit(f"error: {path} is not a COCO results file [{{\"image_id\", \"caption\"}}]: {exc}")
    try:
        result = compare_captions(sides[0], sides[1], images, args.resamples)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}")
    names = args.names or [Path(p).stem for p in args.results]
    report = {"dataset": str(dataset), "split": args.split, "a": names[0], "b": names[1], **result}
    print(markdown(result, *names))
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=2) + "\n")


def _onnx_feature_store(args: argparse.Namespace, images, ckpt, features: str | None):
    """Grid features of the CNN at ``--encoder-precision`` on ONNX Runtime, as the service computes them with
    CAPTIONER_ENCODER_PRECISION; cached apart from the float features (the cache is keyed by spec, not by CNN)."""
    from ..data.features import extract_features
    from ..export.quantize import RECIPE, OnnxGridEncoder, visual_encoder_file

    if (features or "grid") != "grid":
        raise SystemExit("error: --encoder-precision applies to grid features, not " + str(features))
    path = visual_encoder_file(ckpt.encoder, args.onnx_dir, args.encoder_precision)
    return extract_features(images, ckpt.encoder, Path(args.cache_dir) / f"onnx-{args.encoder_precision}-{RECIPE}",
                            encoder=OnnxGridEncoder(path, ckpt.encoder, args.threads))


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
            pipeline = Pipeline(checkpoint, device)
            results = pipeline(args.images, beam_size=args.beam_size, max_len=args.max_len,
                               rules=decoding_rules(pipeline.ckpt, args))
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


def _prefixed_weights_dirs() -> dict[str, str]:
    """``CAPTIONER_PREFIXED_WEIGHTS_DIRS`` (a JSON object of name prefix → folder), or a clear error."""
    text = os.environ.get("CAPTIONER_PREFIXED_WEIGHTS_DIRS") or "{}"
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SystemExit(f"error: CAPTIONER_PREFIXED_WEIGHTS_DIRS is not JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise SystemExit(f'error: CAPTIONER_PREFIXED_WEIGHTS_DIRS must be a JSON object such as '
                         f'{{"scenes-": "weights"}}, not {text!r}')
    return value


def cmd_export(args: argparse.Namespace) -> None:
    """Export every checkpoint (of ``--weights-dir`` plus the named folders) to ONNX, one folder per model."""
    from ..checkpoint import find_checkpoints
    from ..device import set_threads
    from ..export.onnx import ENCODER_FILE, HEAD_FILE, STEP_FILE, ExportUnsupported, export_checkpoints

    set_threads(args.threads)
    weights_dir = None if args.checkpoints and not args.all else args.weights_dir
    # the service's prefixed folders too, under the same names, so that its exports are the ones it looks for (read
    # here, not through the service's Settings: models/ never imports service/)
    prefixed = _prefixed_weights_dirs() if weights_dir else {}
    found = find_checkpoints(weights_dir, args.checkpoints, prefixed)
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
        sizes = ", ".join(f"{f} {(out / name / f).stat().st_size / 1e6:.1f} MB"
                          for f in (ENCODER_FILE, HEAD_FILE, STEP_FILE))
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

    from ..evaluation.card import merge_reports

    notes = Path(args.notes).read_text() if args.notes else ""
    report = merge_reports([json.loads(Path(path).read_text()) for path in args.report])
    print(f"wrote {write_card(args.checkpoint, report, args.title, notes)}")


def cmd_plot(args: argparse.Namespace) -> None:
    """Loss, learning rate and validation metrics of one or more training runs, overlaid, to a PNG."""
    from ..training.curves import plot_runs

    try:
        print(f"wrote {plot_runs(args.runs, args.out, args.label)}")
    except FileNotFoundError as exc:
        raise SystemExit(f"error: {exc}") from None


def cmd_storage(args: argparse.Namespace) -> None:
    from ..checkpoint import WEIGHTS, restore

    out = restore(args.checkpoint, args.dtype, args.out)
    print(f"{out}: weights stored as {args.dtype}, {(out / WEIGHTS).stat().st_size / 2**20:.1f} MiB")


def cmd_manifest(args: argparse.Namespace) -> None:
    """(Re)write the sha256 manifest of checkpoint folders whose files you trust (e.g. made before manifests)."""
    from ..checkpoint import CheckpointError, is_checkpoint, read_config, write_manifest

    for folder in map(Path, args.checkpoints):
        if not is_checkpoint(folder):
            raise SystemExit(f"error: {folder} is not a checkpoint folder (needs config.json and model.safetensors)")
        try:
            read_config(folder)
        except CheckpointError as exc:
            raise SystemExit(f"error: {exc}") from None
        print(f"wrote {write_manifest(folder)}")


def cmd_params(args: argparse.Namespace) -> None:
    from ..evaluation.params import parameter_table

    for name, count in parameter_table(args.vocab_size).items():
        print(f"{name:16s} {count:>14,d}")


# ----------------------------------------------------------------------------------------------------------------
def _real_photo_page_options(parser: argparse.ArgumentParser, results: str, results_help: str, document: str,
                             markers: str) -> None:
    """The options of a page generated from the real-photo checkpoints' reports (zoo-f8k, grounding-doc)."""
    parser.add_argument("--weights-dir", default=str(Path(DEFAULT_CHECKPOINT).parent),
                        help="the real-photo checkpoints' folder")
    parser.add_argument("--results", default=results, help=results_help)
    parser.add_argument("--document", default=document, help=f"written between its {markers} markers")


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
    from ..data.scenes import VARIATIONS

    gen.add_argument("--varied", nargs="?", const="standard", choices=sorted(VARIATIONS), metavar="NAME",
                     help="varied scenes (canvas sizes and aspect ratios, colour jitter, noise, anti-aliasing, JPEG): "
                          "the training-time augmentation for robustness; write them to their own --out. NAME: "
                          f"{', '.join(sorted(VARIATIONS))} (default standard)")
    gen.add_argument("--if-stale", action="store_true",
                     help="do nothing when --out already holds this generator version's dataset for these settings")
    gen.set_defaults(func=cmd_data_generate)
    ood = data.add_parser("ood", help="the out-of-distribution test set: scenes drawn by a separate renderer "
                          "(other canvases, backgrounds, colours, anti-aliasing, JPEG); split 'ood'")
    ood.add_argument("--out", default=".cache/ood")
    ood.add_argument("--images", type=int, default=500)
    ood.add_argument("--seed", type=int, default=0)
    ood.set_defaults(func=cmd_data_ood)
    reg = data.add_parser("regions", help="region features (.npz per image) for the generated scenes: object "
                          "masks pooled over the frozen encoder's grid, a detector stand-in")
    reg.add_argument("--dataset", default=DEFAULT_DATA, help="scene folder or its dataset_scenes.json")
    reg.add_argument("--out", required=True, help="folder for the .npz files (then: train --features regions:OUT)")
    reg.add_argument("--encoder", action="append", default=[], metavar="KEY=VALUE", help="EncoderSpec field")
    reg.add_argument("--cache-dir", default=".cache/features")
    reg.add_argument("--device", default="auto")
    reg.set_defaults(func=cmd_data_regions)

    tr = sub.add_parser("train", help="XE or SCST training with validation, best-checkpoint selection and resume; "
                        "paper schedules with --recipe; data-parallel under torchrun")
    add_train_config_arguments(tr)
    tr.add_argument("--attention", help="attention normaliser for models that take one (softmax/sparsemax/tvmax)")
    tr.add_argument("--resume", action="store_true", help="continue the run in --out where it stopped")
    tr.set_defaults(func=cmd_train)

    ev = sub.add_parser("eval", help="BLEU-1..4, METEOR, ROUGE-L, CIDEr-D of a checkpoint on a split")
    ev.add_argument("checkpoint")
    ev.add_argument("--dataset", help=f"Karpathy JSON or scenes folder (default: {DEFAULT_DATA}; with --grounding "
                    "entities:DIR, the data set the checkpoint was trained on)")
    ev.add_argument("--image-root")
    ev.add_argument("--split", action="append", help="split(s) to score (default: test)")
    ev.add_argument("--beam-size", type=int, default=3)
    ev.add_argument("--max-len", type=int, default=20)
    add_decoding_options(ev)
    ev.add_argument("--limit", type=int)
    ev.add_argument("--no-meteor", action="store_true", help="skip METEOR (needs Java)")
    ev.add_argument("--show", type=int, default=0, help="print this many captions")
    ev.add_argument("--cache-dir", default=".cache/features")
    ev.add_argument("--features", metavar="grid|regions:DIR", help="visual items (default: the training run's)")
    ev.add_argument("--device", default="auto")
    ev.add_argument("--threads", type=int)
    ev.add_argument("--encoder-precision", choices=("float32", "int8"), default="float32",
                    help="int8: grid features from the CNN quantized for ONNX Runtime, as the service computes them "
                    "with CAPTIONER_ENCODER_PRECISION=int8 (default: the float PyTorch CNN)")
    ev.add_argument("--onnx-dir", default=os.environ.get("CAPTIONER_ONNX_DIR", ".cache/onnx"),
                    help="where the ONNX CNN is exported and quantized (with --encoder-precision int8)")
    ev.add_argument("--output", help="also write the JSON report here")
    ev.add_argument("--results-json", metavar="FILE",
                    help='also write the captions in the COCO results format [{"image_id", "caption"}] here')
    ev.add_argument("--grounding", nargs="?", const="scenes", metavar="entities:DIR",
                    help="also score attention grounding: alone, on the scenes' object masks (mass in object, "
                         "pointing hit, area-normalised ratio per word class); entities:DIR, on the Flickr30k "
                         "Entities boxes of real photos (attention correctness, pointing hit, ratio per phrase type; "
                         "references teacher-forced and the model's own captions); 95%% bootstrap intervals and "
                         "chance rows either way")
    ev.add_argument("--grounding-resamples", type=int, default=2000, help="bootstrap resamples over images")
    ev.set_defaults(func=cmd_eval, split=None)

    td = sub.add_parser("tune-decoding", help="score every (length penalty, trigram blocking) pair of a grid on a "
                        "split; --write keeps the best as the checkpoint's defaults")
    td.add_argument("checkpoint")
    td.add_argument("--dataset", default=DEFAULT_DATA)
    td.add_argument("--image-root")
    td.add_argument("--split", default="val", help="split to score (default: val; --write refuses test)")
    # above 1 the penalty lengthens Flickr8k captions mostly with repeats (decisions, "Flickr8k: BLEU-1 and the
    # brevity penalty": α = 2 took REP from 1.5 to 11): not worth a validation pass each
    td.add_argument("--length-penalties", type=float, nargs="+", default=[0.0, 0.5, 1.0],
                    metavar="ALPHA", help="GNMT length penalties to try")
    td.add_argument("--block-trigrams", type=lambda v: v.lower() in ("1", "true", "yes", "on"), nargs="+",
                    default=[False, True], metavar="BOOL", help="trigram blocking off and/or on")
    td.add_argument("--metric", default="CIDEr-D", choices=("BLEU-1", "BLEU-4", "ROUGE-L", "CIDEr-D"),
                    help="the score the best pair is chosen by")
    td.add_argument("--beam-size", type=int, default=3)
    td.add_argument("--max-len", type=int, default=20)
    td.add_argument("--limit", type=int, help="score only the first N images of the split")
    td.add_argument("--cache-dir", default=".cache/features")
    td.add_argument("--device", default="auto")
    td.add_argument("--threads", type=int)
    td.add_argument("--output", help="also write the rows as JSON here")
    td.add_argument("--write", action="store_true", help="store the best pair as the checkpoint's decoding defaults")
    td.set_defaults(func=cmd_tune_decoding)

    rc = sub.add_parser("resolution-check", help="caption the full-size originals of a split's photos and their "
                        "small copies with the service's preprocessing; scores of both against the same references")
    rc.add_argument("checkpoint")
    rc.add_argument("--dataset", default=DEFAULT_DATA)
    rc.add_argument("--image-root", help="the data set's copies of the photos")
    rc.add_argument("--full-root", required=True, help="folder of full-size originals, matched by file name")
    rc.add_argument("--split", default="test")
    rc.add_argument("--beam-size", type=int, default=3)
    rc.add_argument("--max-len", type=int, default=20)
    add_decoding_options(rc)
    rc.add_argument("--device", default="auto")
    rc.add_argument("--threads", type=int)
    rc.add_argument("--output", help="also write the JSON report here")
    rc.set_defaults(func=cmd_resolution_check)

    cmp = sub.add_parser("compare", help="paired comparison of two checkpoints' captions of the same split: CIDEr-D "
                         "and objects_named of each, and the difference with a paired-bootstrap 95%% interval")
    cmp.add_argument("results", nargs=2, metavar="RESULTS.json",
                     help="captions of A and of B, as `captioner eval --results-json` writes them")
    cmp.add_argument("--names", nargs=2, metavar=("A", "B"), help="names for the table (default: the file names)")
    cmp.add_argument("--dataset", default=DEFAULT_DATA)
    cmp.add_argument("--image-root")
    cmp.add_argument("--split", default="test")
    cmp.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples over images")
    cmp.add_argument("--output", help="also write the JSON here")
    cmp.set_defaults(func=cmd_compare)

    cap = sub.add_parser("caption", help="caption image files, optionally rendering the attention (no server)")
    cap.add_argument("images", nargs="+")
    cap.add_argument("--checkpoint", action="append",
                     help=f"checkpoint folder (default {DEFAULT_CHECKPOINT}); repeat it to compare checkpoints side by "
                          "side, one figure row each")
    cap.add_argument("--beam-size", type=int, default=3)
    cap.add_argument("--max-len", type=int, default=20)
    add_decoding_options(cap)
    cap.add_argument("--overlay", metavar="OUT.png", help="write the per-word figure (or one word with --token)")
    cap.add_argument("--token", type=int, help="render only this token's heatmap")
    cap.add_argument("--mode", help="grid_smooth, grid_blocks, region_sum, top1_box, area_topk (default: by model)")
    cap.add_argument("--cmap", default="jet")
    cap.add_argument("--alpha", type=float, default=0.5)
    cap.add_argument("--json", action="store_true", help="print the full result as JSON lines")
    cap.add_argument("--device", default="auto")
    cap.add_argument("--threads", type=int)
    cap.set_defaults(func=cmd_caption)

    ex = sub.add_parser("export", help="export checkpoints to ONNX (encoder, encoder-head and decoder-step graphs) for the "
                        "service's ONNX Runtime backend")
    ex.add_argument("checkpoints", nargs="*", help="checkpoint folders (default: every one in --weights-dir)")
    ex.add_argument("--weights-dir", default=os.environ.get("CAPTIONER_WEIGHTS_DIR", "weights/flickr8k"),
                    help="export every checkpoint below it (CAPTIONER_WEIGHTS_DIR; also every one below the "
                    "folders of CAPTIONER_PREFIXED_WEIGHTS_DIRS, under the service's names)")
    ex.add_argument("--all", action="store_true", help="with named checkpoints: also every one in --weights-dir")
    ex.add_argument("--out", default=os.environ.get("CAPTIONER_ONNX_DIR", ".cache/onnx"),
                    help="one folder per model is written below it (CAPTIONER_ONNX_DIR, where the service looks)")
    ex.add_argument("--strict", action="store_true", help="exit 1 when any model cannot be exported")
    ex.add_argument("--threads", type=int)
    ex.set_defaults(func=cmd_export)

    cd = sub.add_parser("card", help="write a checkpoint's MODEL_CARD.md from its training record and an eval report")
    cd.add_argument("checkpoint")
    cd.add_argument("--report", required=True, action="append",
                    help="the JSON written by `captioner eval --output` (repeatable: e.g. test + held-out, then the "
                         "OOD set; a later report's split replaces an earlier one of the same name)")
    cd.add_argument("--title")
    cd.add_argument("--notes", metavar="FILE", help="a Markdown file appended as the card's Notes section")
    cd.set_defaults(func=cmd_card)

    pl = sub.add_parser("plot", help="training curves of runs (metrics.jsonl): loss, learning rate and validation "
                        "metrics per epoch, several runs overlaid, to PNG")
    pl.add_argument("runs", nargs="+", metavar="RUN", help="training run folders (--out of `captioner train`)")
    pl.add_argument("--out", default="curves.png", help="PNG to write")
    pl.add_argument("--label", action="append", help="legend name per run (default: the folder names)")
    pl.set_defaults(func=cmd_plot)

    mf = sub.add_parser("manifest", help="write the sha256 manifest.json that load_checkpoint verifies, for "
                        "checkpoint folders whose files you trust")
    mf.add_argument("checkpoints", nargs="+")
    mf.set_defaults(func=cmd_manifest)

    st = sub.add_parser("storage", help="write a checkpoint again with its weights stored as float16 (half the "
                        "bytes; loading casts them back) or float32; compare `captioner eval` before and after")
    st.add_argument("checkpoint")
    st.add_argument("dtype", choices=("float16", "float32"))
    st.add_argument("--out", help="write the result here instead of in place")
    st.set_defaults(func=cmd_storage)

    pa = sub.add_parser("params", help="parameter counts of every model at the papers' sizes")
    pa.add_argument("--vocab-size", type=int, default=10369)
    pa.set_defaults(func=cmd_params)

    zt = sub.add_parser("zoo-table", help="write docs/model_zoo.md's table of every checkpoint (and the grounding "
                        "table and figure) from the checkpoints' training records and `captioner eval` reports")
    zt.add_argument("--weights-dir", default="weights")
    zt.add_argument("--results", default="docs/results", help="folder of eval reports NAME.json / NAME.*.json")
    zt.add_argument("--document", default="docs/model_zoo.md", help="written between its zoo-table markers")
    zt.add_argument("--figure", default="docs/figures/grounding.png")
    zt.add_argument("--dataset", default=DEFAULT_DATA,
                    help="the scenes whose test split the captions in RESULTS/captions/ describe: every checkpoint "
                    "against --baseline, paired (skipped when missing)")
    zt.add_argument("--baseline", default=Path(DEFAULT_CHECKPOINT).name, help="checkpoint the others are compared with")
    zt.set_defaults(func=cmd_zoo_table)

    zf = sub.add_parser("zoo-f8k", help="write docs/model_zoo.md's Flickr8k table (scores, the papers' rows, "
                        "paired-bootstrap differences from --baseline, the issue's floors) from `captioner eval` "
                        "reports and captions")
    _real_photo_page_options(zf, "docs/results/flickr8k", "folder of eval reports NAME.json and their captions "
                             "captions/NAME.json", "docs/model_zoo.md", "zoo-f8k")
    zf.add_argument("--baseline", default="sat", help="checkpoint the others are compared with")
    zf.add_argument("--dataset", help="the Karpathy JSON (or Flickr8k text folder) whose references the captions "
                    "are scored against")
    zf.add_argument("--image-root")
    zf.add_argument("--split", default="test")
    zf.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples over images")
    zf.set_defaults(func=cmd_zoo_f8k)

    gd = sub.add_parser("grounding-doc", help="write docs/grounding.md's tables and figures (Flickr30k Entities "
                        "grounding of every real-photo checkpoint) from `captioner eval --grounding entities:DIR` "
                        "reports; `make grounding` runs those first")
    _real_photo_page_options(gd, "docs/results/grounding", "folder of the eval reports NAME.json",
                             "docs/grounding.md", "grounding")
    gd.add_argument("--list", action="store_true",
                    help="only print the real-photo checkpoints (trained on a Flickr Karpathy JSON), one a line")
    gd.add_argument("--figure", default="docs/figures/grounding_entities.png")
    gd.add_argument("--examples", default="docs/figures/grounding_entities_heatmaps.png",
                    help="the side-by-side heatmaps of the softmax, sparsemax and TVmax checkpoints")
    gd.add_argument("--scene-results", default="docs/results",
                    help="the scene reports whose SparseCap grounding the closing note compares with")
    gd.add_argument("--device", default="auto")
    gd.add_argument("--threads", type=int)
    gd.set_defaults(func=cmd_grounding_doc)

    ls = sub.add_parser("models", help="list registered model architectures")
    ls.set_defaults(func=cmd_models)
    add_interop_commands(sub, data)


def add_interop_commands(sub: argparse._SubParsersAction, data: argparse._SubParsersAction) -> None:
    """``captioner import`` (the authors' checkpoints) and ``captioner data features`` (fill the feature store)."""
    im = sub.add_parser("import", help="convert an author-released checkpoint into this project's format")
    kinds = im.add_subparsers(dest="kind", required=True, metavar="KIND")
    ao = kinds.add_parser("aoanet", help="github.com/husthuaan/AoANet: model-best.pth + infos_*-best.pkl")
    ao.add_argument("--weights", required=True, help="the authors' .pth (read with torch.load(weights_only=True))")
    ao.add_argument("--infos", required=True, help="AoANet's infos_*.pkl (read with a restricted unpickler)")
    for kind, model in (("xlan", "X-LAN"), ("xtransformer", "X-Transformer")):
        xl = kinds.add_parser(kind, help=f"github.com/JDAI-CV/image-captioning {model}: caption_model_*.pth + "
                                         "coco_vocabulary.txt")
        xl.add_argument("--checkpoint", "--weights", required=True, dest="checkpoint",
                        help="the authors' caption_model_*.pth (read with torch.load(weights_only=True))")
        xl.add_argument("--vocab", required=True, help="their vocabulary text file, one word per line")
    sg = kinds.add_parser("sgrvinod", help="github.com/sgrvinod/a-PyTorch-Tutorial-to-Image-Captioning (Show, Attend "
                                           "and Tell): BEST_checkpoint_*.pth.tar + WORDMAP_*.json")
    sg.add_argument("checkpoint", metavar="CHECKPOINT", help="the tutorial's checkpoint (its pickled modules are read "
                                                            "with an allow-list of stand-ins, never run)")
    sg.add_argument("word_map", metavar="WORDMAP", help="its WORDMAP_*.json (word → index)")
    for parser in kinds.choices.values():
        parser.add_argument("--out", required=True, help="checkpoint folder to write")
        parser.set_defaults(func=cmd_import)
    fe = data.add_parser("features", help="extract frozen-encoder grid features into the sharded store (resumable; "
                                          "run once before multi-machine training)")
    fe.add_argument("--dataset", default=DEFAULT_DATA, help="Karpathy JSON, or a folder with dataset_scenes.json")
    fe.add_argument("--image-root")
    fe.add_argument("--split", action="append", help="split(s) to extract (default: all)")
    fe.add_argument("--encoder", action="append", default=[], metavar="KEY=VALUE", help="EncoderSpec field")
    fe.add_argument("--cache-dir", default=".cache/features")
    fe.add_argument("--batch-size", type=int, default=32)
    fe.add_argument("--shard-size", type=int, default=1024)
    fe.add_argument("--device", default="auto")
    fe.set_defaults(func=cmd_data_features)


def cmd_import(args: argparse.Namespace) -> None:
    from ..checkpoint import save_checkpoint
    from ..encoder import EncoderSpec
    from ..interop.aoanet import convert_aoanet
    from ..interop.common import ConversionError
    from ..interop.safe_pickle import UnsafePickleError
    from ..interop.xlan import CONVERTERS

    from ..interop.sgrvinod import ENCODER_FILE, convert_sgrvinod, encoder_file

    files, spec = {}, EncoderSpec()
    try:
        if args.kind == "aoanet":
            model, vocab, meta = convert_aoanet(args.weights, args.infos)
        elif args.kind == "sgrvinod":
            model, vocab, spec, trunk, meta = convert_sgrvinod(args.checkpoint, args.word_map)
            files = {ENCODER_FILE: encoder_file(trunk)}
        else:
            model, vocab, meta = CONVERTERS[args.kind](args.checkpoint, args.vocab)
    except (ConversionError, UnsafePickleError, OSError) as error:
        raise SystemExit(f"error: {error}") from None
    out = save_checkpoint(args.out, model, vocab, spec, meta, files=files)
    if args.kind == "sgrvinod":  # images in, like the shipped checkpoints
        print(f"wrote {out} ({model.arch}, {len(vocab)} tokens, {spec.backbone} encoder); caption with "
              f"captioner caption IMAGE --checkpoint {out}, or serve its folder")
    else:
        print(f"wrote {out} ({model.arch}, {len(vocab)} tokens); evaluate it with "
              f"captioner eval {out} --features regions:DIR")


def cmd_data_features(args: argparse.Namespace) -> None:
    from ..data.features import extract_features
    from ..data.datasets import load_captioned, resolve_dataset
    from ..device import resolve_device
    from ..encoder import EncoderSpec

    dataset = resolve_dataset(args.dataset)
    images = load_captioned(dataset, args.image_root, tuple(args.split) if args.split else None)
    store = extract_features(images, EncoderSpec(**_key_values(args.encoder)), args.cache_dir,
                             batch_size=args.batch_size, device=str(resolve_device(args.device)),
                             shard_size=args.shard_size)
    print(f"{len(store)} images in {store.folder}")


def cmd_zoo_table(args: argparse.Namespace) -> None:
    from ..evaluation.zoo_table import write_zoo

    dataset = Path(args.dataset)
    dataset = dataset / "dataset_scenes.json" if dataset.is_dir() else dataset
    print(write_zoo(Path(args.weights_dir), Path(args.results), Path(args.document), Path(args.figure), dataset,
                    args.baseline))


def cmd_zoo_f8k(args: argparse.Namespace) -> None:
    from ..evaluation.zoo_f8k import write_f8k_section

    try:
        print(write_f8k_section(Path(args.weights_dir), Path(args.results), Path(args.document), args.dataset,
                                args.image_root, args.split, args.baseline, args.resamples))
    except (ValueError, OSError) as exc:
        raise SystemExit(f"error: {exc}") from None


def cmd_grounding_doc(args: argparse.Namespace) -> None:
    from ..device import resolve_device, set_threads
    from ..evaluation.grounding_doc import real_photo_checkpoints, write_grounding_doc

    weights = Path(args.weights_dir)
    if not weights.is_dir():
        raise SystemExit(f"error: {weights} is not a folder of checkpoints")
    if args.list:
        print("\n".join(str(c) for c in real_photo_checkpoints(weights)))
        return
    set_threads(args.threads)
    print(write_grounding_doc(weights, Path(args.results), Path(args.document), Path(args.figure),
                              Path(args.examples), Path(args.scene_results), str(resolve_device(args.device))))


def cmd_models(args: argparse.Namespace) -> None:
    from ..zoo import available

    print("\n".join(available()))
