"""``captioner data`` subcommands: the generated scenes, the OOD set, region features and the feature store."""

from __future__ import annotations

import argparse
from pathlib import Path

from .common import (DEFAULT_DATA, CommandGroup, add_cache_option, add_dataset_options, add_device_options, count,
                     key_values, positive_int)

_group = CommandGroup()
#: add_commands (commands.py) calls register(sub, name) for each of this module's subcommands
register = _group.register


def cmd_data_generate(args: argparse.Namespace) -> None:
    from ..data.scenes import VARIATIONS, describes, generate, read_dataset_header

    sizes = {"train": args.train, "val": args.val, "test": args.test, "heldout": args.heldout}
    variation = VARIATIONS[args.varied] if args.varied else None
    # the data set already there, read once and only where asked about (the whole JSON is parsed)
    held = read_dataset_header(Path(args.out) / "dataset_scenes.json") if args.if_stale or args.only else None
    if args.if_stale and describes(held, sizes, args.seed, variation, args.only):
        print(f"{args.out} is up to date (same generator version, seed, sizes, variation and splits)")
        return
    if args.only and held is not None and set(_splits_held(held)) - set(args.only):
        # the folder's data set would lose the other splits' annotations (a training run's data, `make data`'s)
        raise SystemExit(f"error: {args.out} holds a data set with more splits than --only {' '.join(args.only)}: "
                         "give --out another folder")
    path = generate(args.out, sizes, seed=args.seed, workers=args.workers, variation=variation, only=args.only)
    print(f"wrote {path}")


def _splits_held(header: dict) -> list[str]:
    """The splits a data set's header says it holds: its "only", else all; an "only" that is not a list of names
    (an altered header) reads as all, so the folder is never replaced by fewer splits."""
    only = header.get("only")
    if isinstance(only, list) and only and all(isinstance(split, str) for split in only):
        return only
    from ..data.scenes import SPLITS

    return list(SPLITS)


def cmd_data_ood(args: argparse.Namespace) -> None:
    from ..data.ood import generate_ood

    print(f"wrote {generate_ood(args.out, args.images, seed=args.seed)}")


def cmd_data_regions(args: argparse.Namespace) -> None:
    from ..data.regions import write_scene_regions
    from ..device import resolve_device, set_threads
    from ..encoder import EncoderSpec

    set_threads(args.threads)
    out = write_scene_regions(args.dataset, args.out, EncoderSpec.of(key_values(args.encoder)), args.cache_dir,
                              device=str(resolve_device(args.device)))
    print(f"wrote region features to {out}; train on them with --features regions:{out}")


def cmd_data_features(args: argparse.Namespace) -> None:
    from ..data.features import extract_features
    from ..data.datasets import load_captioned, resolve_dataset
    from ..device import resolve_device, set_threads
    from ..encoder import EncoderSpec

    set_threads(args.threads)
    dataset = resolve_dataset(args.dataset)
    images = load_captioned(dataset, args.image_root, tuple(args.split) if args.split else None)
    if not images:
        raise SystemExit(f"error: no images in split {' or '.join(map(repr, args.split))} of {dataset}" if args.split
                         else f"error: {dataset} holds no images")
    store = extract_features(images, EncoderSpec.of(key_values(args.encoder)), args.cache_dir,
                             batch_size=args.batch_size, device=str(resolve_device(args.device)),
                             shard_size=args.shard_size, progress=args.progress)
    print(f"{len(store)} images in {store.folder}")


@_group.command("data")
def _add_data(sub: argparse._SubParsersAction) -> None:
    data = sub.add_parser("data", help="datasets").add_subparsers(dest="data_command", required=True,
                                                                  metavar="COMMAND")
    gen = data.add_parser("generate", help="write the generated-scene dataset (Karpathy JSON + images + masks)")
    gen.add_argument("--out", default=DEFAULT_DATA, help=f"folder to write (default {DEFAULT_DATA})")
    from ..data.scenes import DEFAULT_SIZES, SPLITS, VARIATIONS

    for split, what in (("train", "training"), ("val", "validation"), ("test", "test"),
                        ("heldout", "held-out (colour-shape pairs never seen in training)")):
        gen.add_argument(f"--{split}", type=count, default=DEFAULT_SIZES[split],
                         help=f"{what} scenes (default {DEFAULT_SIZES[split]})")
    gen.add_argument("--seed", type=int, default=0, help="the generator's seed (default 0): the same seed and sizes "
                     "give the same files")
    gen.add_argument("--workers", type=positive_int, default=2, help="processes drawing scenes (default 2)")
    gen.add_argument("--varied", nargs="?", const="standard", choices=sorted(VARIATIONS), metavar="NAME",
                     help="varied scenes (canvas sizes and aspect ratios, colour jitter, noise, anti-aliasing, JPEG): "
                          "the training-time augmentation for robustness; write them to their own --out. NAME: "
                          f"{', '.join(sorted(VARIATIONS))} (default standard)")
    gen.add_argument("--only", nargs="+", choices=SPLITS, metavar="SPLIT",
                     help="write these splits alone, each scene the one the whole data set has (the sizes above "
                          "still number them): `--only test heldout` scores a shipped scene checkpoint without "
                          "drawing its training scenes")
    gen.add_argument("--if-stale", action="store_true",
                     help="do nothing when --out already holds this generator version's dataset for these settings")
    gen.set_defaults(func=cmd_data_generate)
    ood = data.add_parser("ood", help="the out-of-distribution test set: scenes drawn by a separate renderer "
                          "(other canvases, backgrounds, colours, anti-aliasing, JPEG); split 'ood'")
    ood.add_argument("--out", default=".cache/ood", help="folder to write (default .cache/ood)")
    ood.add_argument("--images", type=positive_int, default=500, help="scenes to draw (default 500)")
    ood.add_argument("--seed", type=int, default=0, help="the renderer's seed (default 0)")
    ood.set_defaults(func=cmd_data_ood)
    reg = data.add_parser("regions", help="region features (.npz per image) for the generated scenes: object "
                          "masks pooled over the frozen encoder's grid, a detector stand-in")
    reg.add_argument("--dataset", default=DEFAULT_DATA, help="scene folder or its dataset_scenes.json")
    reg.add_argument("--out", required=True, help="folder for the .npz files (then: train --features regions:OUT)")
    reg.add_argument("--encoder", action="append", default=[], metavar="KEY=VALUE", help="EncoderSpec field")
    add_cache_option(reg)
    add_device_options(reg)
    reg.set_defaults(func=cmd_data_regions)
    fe = data.add_parser("features", help="extract frozen-encoder grid features into the sharded store (resumable; "
                                          "run once before multi-machine training)")
    add_dataset_options(fe)
    fe.add_argument("--split", action="append", help="split(s) to extract (default: all)")
    fe.add_argument("--encoder", action="append", default=[], metavar="KEY=VALUE", help="EncoderSpec field")
    add_cache_option(fe)
    fe.add_argument("--batch-size", type=positive_int, default=32, help="photos encoded at once (default 32)")
    fe.add_argument("--shard-size", type=positive_int, default=1024, help="photos per shard file, the unit an "
                    "interrupted extraction keeps (default 1,024)")
    fe.add_argument("--no-progress", dest="progress", action="store_false",
                    help="no progress bar: a line per shard (for logs and CI), as captioner train")
    add_device_options(fe)
    fe.set_defaults(func=cmd_data_features)
