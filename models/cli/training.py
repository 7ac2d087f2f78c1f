"""``captioner train``, ``captioner tune-decoding`` and ``captioner ensemble``: training runs, the decoding defaults
they keep, and ensembles of their checkpoints."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Mapping

from ..attention import NORMALISERS
from ..evaluation.tuning import DEFAULT_PENALTIES
from ..files import write_atomically
from .common import (CommandGroup, add_cache_option, add_dataset_options, add_device_options, add_search_options,
                     add_threads_option, dataset_file, key_values, length_penalty, output_file,
                     positive_int, refuse_input_as_output, refuse_overwrite, split_with_features, yes_or_no)

_group = CommandGroup()
#: add_commands (commands.py) calls register(sub, name) for each of this module's subcommands
register = _group.register


def _config_fields():
    from dataclasses import fields

    from ..training import TrainConfig
    from ..training.config import declared_types

    hints = declared_types()
    return [(f, hints[f.name]) for f in fields(TrainConfig) if f.metadata.get("cli", True)]


def _bounded(meta: Mapping[str, Any], hint: Any) -> Callable[[str], Any]:
    """argparse type of one value of a field: its scalar type, and the field's bounds (``least``, ``within``:
    :func:`~captioner.models.training.config.bound_problem`) as a usage error naming the option."""
    from ..training.config import bound_problem, declared_item

    scalar, _ = declared_item(hint)
    if meta.get("least") is None and meta.get("within") is None:
        return scalar

    def parse(text: str):
        try:
            value = scalar(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'a whole number' if scalar is int else 'a number'}") \
                from None
        problem = bound_problem(meta, value)
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return value
    return parse


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
            parser.add_argument(flag, action="append", type=_bounded(meta, hint), metavar=meta.get("metavar"), **common)
        elif kind == "pair":
            parser.add_argument(flag, nargs=2, type=_bounded(meta, hint), metavar=("B1", "B2"), **common)
        elif kind == "false":
            parser.add_argument(flag, action="store_false", **common)
        elif kind == "true":
            parser.add_argument(flag, action="store_true", **common)
        else:  # a number outside its bounds (``least``, ``within``) is a usage error, as for every command's counts
            parser.add_argument(flag, type=meta.get("parse") or _bounded(meta, hint), choices=meta.get("choices"),
                                metavar=meta.get("metavar"), required=meta.get("required", False), **common)


def given_options(args: argparse.Namespace) -> set[str]:
    """The TrainConfig fields this command gave: the namespace holds only those (``argparse.SUPPRESS``), and
    ``--attention`` is a model argument."""
    return {f.name for f, _ in _config_fields()
            if hasattr(args, f.name)} | ({"model_args"} if args.attention else set())


def train_config_from_args(args: argparse.Namespace):
    """Config defaults ← the recipe (``--recipe``) ← the flags given."""
    from ..training import TrainConfig, load_recipe

    given = {name: getattr(args, name) for name in given_options(args) if hasattr(args, name)}
    for name in ("model_args", "encoder"):
        if name in given:
            given[name] = key_values(given[name])
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
    from ..checkpoint import read_config
    from ..data.features import DEFAULT_SHARD_SIZE, distributed_rank
    from ..training import TrainingDiverged, TrainingInterrupted, train
    from ..training.distributed import shutdown_distributed
    from ..training.state import STATE_JSON

    cfg = train_config_from_args(args)
    best = None

    def terminated(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    # a kill while the run is prepared (its features encoded) stops it as Ctrl-C does: a note, and no empty --out
    # left behind (the training loop takes SIGTERM over with SIGINT, to save its state first)
    signal.signal(signal.SIGTERM, terminated)
    try:  # on --resume only the options given change the run
        best = train(cfg, resume=args.resume, explicit=given_options(args))
    except TrainingInterrupted as exc:
        print(exc, file=sys.stderr)
        raise SystemExit(130) from None
    except TrainingDiverged as exc:
        raise SystemExit(f"error: {exc}") from None
    except FileNotFoundError as exc:
        if args.resume and not {"dataset", "image_root"} & given_options(args):  # the run's data has moved?
            raise SystemExit(f"error: {exc} (the run's data moved? --resume takes --dataset and --image-root naming "
                             "where it is now)") from None
        raise
    except KeyboardInterrupt:  # Ctrl-C while the run is prepared (encoding features), or a second one in training
        if (Path(cfg.out) / STATE_JSON).exists():
            print(f"aborted: {cfg.out} keeps its last saved state (--checkpoint-every); rerun with --resume to "
                  "continue from it", file=sys.stderr)
        else:
            # features are written a shard at a time: the shard being encoded is lost, the finished ones are not
            print("interrupted before the first step was saved: nothing to resume; the features of every finished "
                  f"shard of {DEFAULT_SHARD_SIZE:,} photos stay cached, so the same command continues from the "
                  "first unfinished one", file=sys.stderr)
        raise SystemExit(130) from None
    finally:
        shutdown_distributed(meet_first=best is not None)
    if distributed_rank() != 0:  # under torchrun the main process speaks for the run
        return
    if best.exists():
        meta = read_config(best).get("meta", {})
        measure, scores = meta.get("selected_by"), meta.get("val_scores", {})
        why = (f" (selected by validation {measure} {scores[measure]:.4f}, epoch {meta.get('best_epoch')})"
               if measure in scores else "")
        print(f"best checkpoint: {best}{why}")
    else:  # --max-steps or an early stop ended the run before its first validation saved one
        print(f"no checkpoint yet: the run stopped before its first validation; --resume with more steps or "
              f"epochs continues it (its state is in {best.parent})")


@_group.command("train")
def _add_train(sub: argparse._SubParsersAction) -> None:
    tr = sub.add_parser("train", help="XE or SCST training with validation, best-checkpoint selection and resume; "
                        "paper schedules with --recipe; data-parallel under torchrun")
    add_train_config_arguments(tr)
    tr.add_argument("--attention", help="attention normaliser for models that take one (SparseCap): "
                    f"{', '.join(NORMALISERS)}")
    tr.add_argument("--resume", action="store_true", help="continue the run in --out where it stopped")
    tr.set_defaults(func=cmd_train)


def cmd_tune_decoding(args: argparse.Namespace) -> None:
    from ..checkpoint import load_checkpoint, update_meta
    from ..data.datasets import resolve_dataset, train_split_captions
    from ..device import resolve_device, set_threads
    from ..evaluation.tuning import best_row, decoding_grid, markdown_table, rules_of

    if args.write and args.split == "test":
        raise SystemExit("error: --write keeps the rules chosen on this split as the checkpoint's defaults: choose "
                         "them on validation data (--split val) and report on test")
    refuse_input_as_output({"--output": args.output}, [dataset_file(args.dataset)], [args.checkpoint])
    set_threads(args.threads)
    device = resolve_device(args.device)
    ckpt = load_checkpoint(args.checkpoint, device)
    dataset = resolve_dataset(args.dataset)
    images, store = split_with_features(ckpt, dataset, args.image_root, args.split, args.limit, args.cache_dir,
                                        str(device))
    training_captions = train_split_captions(dataset, args.image_root)
    rows = decoding_grid(ckpt, images, store, args.length_penalties, args.block_trigrams, args.beam_size,
                         args.max_len, device=str(device), training_captions=training_captions,
                         doubled_options=args.block_doubled_words)
    chosen = best_row(rows, args.metric)
    best, score = rules_of(chosen), chosen[args.metric]
    columns = ["BLEU-1", "BLEU-4", "ROUGE-L", "CIDEr-D", "REP", "distinct_words", "novel_captions", "mean_length"]
    table = markdown_table(rows, columns)
    print(table)
    print(f"best by {args.metric} on {args.split}: length_penalty={best.length_penalty:g}, "
          f"block_trigrams={best.block_trigrams}, block_doubled_words={best.block_doubled_words}")
    if args.output:
        choice = {"checkpoint": str(args.checkpoint), "dataset": str(dataset), "split": args.split,
                  "beam_size": args.beam_size, "metric": args.metric, "best": asdict(best), "rows": rows}
        write_atomically(Path(args.output), json.dumps(choice, indent=2) + "\n")
    if args.write:
        update_meta(args.checkpoint, decoding=asdict(best),
                    decoding_chosen_on={"dataset": str(dataset), "split": args.split, "metric": args.metric,
                                        "beam_size": args.beam_size, "images": len(images),
                                        "score": score,
                                        "storage": ckpt.storage})
        print(f"stored as the defaults of {args.checkpoint}")


def cmd_ensemble(args: argparse.Namespace) -> None:
    from ..checkpoint import load_checkpoint, save_checkpoint
    from ..ensemble import build_ensemble, select_members

    if args.select_on == "test":
        raise SystemExit("error: members are chosen on validation data (--select-on val); test is for reporting")
    if Path(args.out).resolve() in {Path(path).resolve() for path in args.checkpoints}:
        raise SystemExit(f"error: {args.out} is one of the members: write the ensemble to a folder of its own")
    refuse_overwrite(args.out, args.force, "OUT")
    try:
        checkpoints = [load_checkpoint(path, "cpu") for path in args.checkpoints]
        if args.select_on:
            checkpoints = select_members(checkpoints, _split_scorer(args, checkpoints[0]), args.max_members,
                                         args.min_gain, report=print)
            if len(checkpoints) == 1:
                raise SystemExit(f"error: no candidate raised {checkpoints[0].name}'s {args.select_on} CIDEr-D by "
                                 f"--min-gain {args.min_gain:g}; no ensemble written")
        ensemble = build_ensemble(checkpoints)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    first = checkpoints[0]
    members = [_member_record(c) for c in checkpoints]
    meta: dict[str, Any] = {
        "dataset": first.meta.get("dataset", ""), "phase": "ensemble",
        "trained_on": "an ensemble of " + "; ".join(dict.fromkeys(
            f"{m['name']} ({m['trained_on'] or 'data set not recorded'})" for m in members)),
        "ensemble_of": members,
        # what `captioner eval` reads of a training run: the data set and visual items the members were trained on
        "train_config": {key: first.meta.get("train_config", {}).get(key)
                         for key in ("dataset", "image_root", "features")},
    }
    if args.select_on:
        meta["members_chosen_on"] = {"split": args.select_on, "metric": "CIDEr-D", "beam_size": args.beam_size,
                                     "max_members": args.max_members, "min_gain": args.min_gain,
                                     "dataset": str(args.dataset)}
    save_checkpoint(args.out, ensemble, first.vocab, first.encoder, meta, storage=args.storage)
    print(f"{args.out}: an ensemble of {', '.join(m['name'] for m in members)}")


def _member_record(ckpt) -> dict[str, Any]:
    """What a built ensemble records of one member checkpoint (its card and ``GET /models``' data set come from it)."""
    from ..evaluation.card import total_train_seconds

    return {"name": ckpt.name, "arch": ckpt.model.arch, "checksum": ckpt.checksum,
            "trained_on": ckpt.meta.get("trained_on", ""), "dataset": ckpt.meta.get("dataset", ""),
            # with the runs a warm start began from: what the member cost to train
            "train_seconds": total_train_seconds(ckpt.meta)}


def _split_scorer(args: argparse.Namespace, first):
    """CIDEr-D of a captioner's beam-search captions of ``--select-on``, over features extracted once."""
    from ..data.datasets import resolve_dataset
    from ..device import set_threads
    from ..evaluation.evaluate import caption_dataset, score_dataset

    set_threads(args.threads)
    images, store = split_with_features(first, resolve_dataset(args.dataset), args.image_root, args.select_on,
                                        args.limit, args.cache_dir)

    def score(model) -> float:
        captions = caption_dataset(model, first.vocab, images, store, args.beam_size, progress=True)
        return score_dataset(captions, images, ("CIDEr-D",))["CIDEr-D"]
    return score


@_group.command("ensemble")
def _add_ensemble(sub: argparse._SubParsersAction) -> None:
    en = sub.add_parser("ensemble", help="one checkpoint that decodes several trained ones as an ensemble (the mean "
                        "of their next-word probabilities); --select-on val picks the members greedily")
    en.add_argument("out", help="the ensemble's checkpoint folder (a new or empty one)")
    en.add_argument("--force", action="store_true", help="replace the checkpoint already at OUT (never a member)")
    en.add_argument("checkpoints", nargs="+", help="member checkpoints (same vocabulary and encoder spec); with "
                    "--select-on, the first is where the selection starts and the rest are candidates")
    en.add_argument("--select-on", metavar="SPLIT", help="choose the members by greedy forward selection on this "
                    "split's CIDEr-D (beam search, no decoding rules)")
    add_dataset_options(en)
    en.add_argument("--max-members", type=positive_int, default=4, help="most members the greedy search adds "
                    "(default 4)")
    en.add_argument("--min-gain", type=float, default=0.005, help="stop when the best addition gains less "
                    "(default 0.005)")
    en.add_argument("--beam-size", type=positive_int, default=3, help="beam width of the search's scoring "
                    "(default 3)")
    en.add_argument("--limit", type=positive_int, help="score only the first N images of the split")
    add_cache_option(en)
    add_threads_option(en)
    en.add_argument("--storage", choices=("float32", "float16"), default="float32",
                    help="dtype of the stored weights (float16 halves them; members stored so lose nothing)")
    en.set_defaults(func=cmd_ensemble)


@_group.command("tune-decoding")
def _add_tune_decoding(sub: argparse._SubParsersAction) -> None:
    td = sub.add_parser("tune-decoding", help="score every combination of decoding rules of a grid on a split; "
                        "--write keeps the best as the checkpoint's defaults")
    td.add_argument("checkpoint", help="checkpoint folder (with --write, its config.json takes the defaults)")
    add_dataset_options(td)
    td.add_argument("--split", default="val", help="split to score (default: val; --write refuses test)")
    td.add_argument("--length-penalties", type=length_penalty, nargs="+", default=list(DEFAULT_PENALTIES),
                    metavar="ALPHA", help="GNMT length penalties to try (default: "
                    f"{' '.join(f'{alpha:g}' for alpha in DEFAULT_PENALTIES)})")
    td.add_argument("--block-trigrams", type=yes_or_no, nargs="+",
                    default=[False, True], metavar="BOOL", help="trigram blocking off and/or on (default: both)")
    td.add_argument("--block-doubled-words", type=yes_or_no, nargs="+", default=[False], metavar="BOOL",
                    help="doubled-word blocking off and/or on (default: off only)")
    td.add_argument("--metric", default="CIDEr-D", choices=("BLEU-1", "BLEU-4", "ROUGE-L", "CIDEr-D"),
                    help="the score the best combination is chosen by (default CIDEr-D)")
    add_search_options(td, rules=False)
    td.add_argument("--limit", type=positive_int, help="score only the first N images of the split")
    add_cache_option(td)
    add_device_options(td)
    td.add_argument("--output", type=output_file, help="also write the rows as JSON here")
    td.add_argument("--write", action="store_true", help="store the best pair as the checkpoint's decoding defaults")
    td.set_defaults(func=cmd_tune_decoding)
