"""Captioning and checkpoint subcommands: caption, export, import (authors' checkpoints), storage, manifest, models."""

from __future__ import annotations

import argparse
import json
import pickle
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ..placement import checkpoints_from_env, onnx_dir_from_env, prefixed_dirs_from_env, weights_dir_from_env
from .common import (DEFAULT_CHECKPOINT, CommandGroup, add_device_options, add_search_options, add_threads_option,
                     checkpoint_labels, decoding_rules, figure_file, refuse_input_as_output, refuse_overwrite)

if TYPE_CHECKING:
    from ..inference import CaptionResult

_group = CommandGroup()
#: add_commands (commands.py) calls register(sub, name) for each of this module's subcommands
register = _group.register


def print_caption(path: str, label: str, result: CaptionResult) -> None:
    """``captioner caption``'s line for one image: its path, the checkpoint's label when several are compared (else
    ``""``), and the caption."""
    print(f"{path} [{label}]: {result.caption}" if label else f"{path}: {result.caption}")


def caption_files(args: argparse.Namespace, show: Callable[[str, str, CaptionResult], None] = print_caption) -> None:
    """Caption images with one checkpoint or several (``--checkpoint`` repeated: a side-by-side comparison).
    ``show(path, label, result)`` prints each result (the console script's ``--json`` passes its own)."""
    from ..device import resolve_device, set_threads
    from ..images import ImageDecodeError, load_image
    from ..pipeline import Pipeline

    set_threads(args.threads)
    checkpoints = args.checkpoint or [DEFAULT_CHECKPOINT]
    _check_overlay_options(args, checkpoints)  # before any model is loaded
    device = resolve_device(args.device)
    try:  # decoded once: captioned by every checkpoint, and drawn on
        images = [load_image(path) for path in args.images]
    except ImageDecodeError as exc:
        raise SystemExit(f"error: {exc}") from None
    runs = []
    for checkpoint, name in zip(checkpoints, checkpoint_labels(checkpoints)):
        try:
            pipeline = Pipeline(checkpoint, device)
        except FileNotFoundError as exc:
            raise SystemExit(f"error: {exc}") from None
        results = pipeline(images, beam_size=args.beam_size, max_len=args.max_len,
                           rules=decoding_rules(pipeline.ckpt, args))
        runs.append((name, results))
        for path, result in zip(args.images, results):
            show(str(path), name if len(checkpoints) > 1 else "", result)
    if args.overlay:
        _draw_overlay(args, images[0], runs)


def _check_overlay_options(args: argparse.Namespace, checkpoints: list[str]) -> None:
    """Refuse ``--overlay``/``--token``/``--mode``/``--cmap`` combinations that cannot draw, in one line each."""
    from ..rendering.heatmaps import RenderError, check_mode, colormap

    if args.overlay and len(args.images) != 1:
        raise SystemExit("error: --overlay takes exactly one image")
    refuse_input_as_output({"--overlay": args.overlay}, args.images, checkpoints)
    if args.token is not None and len(checkpoints) > 1:
        raise SystemExit("error: --token renders one checkpoint's word; drop it to compare checkpoints")
    if args.token is not None and not args.overlay:
        raise SystemExit("error: --token picks the word --overlay draws: add --overlay FILE.png")
    if not args.overlay:
        return
    try:
        if args.mode is not None:
            check_mode(args.mode)
        colormap(args.cmap)
    except RenderError as exc:
        raise SystemExit(f"error: {exc}") from None


def _draw_overlay(args: argparse.Namespace, image, runs: list[tuple[str, list[CaptionResult]]]) -> None:
    """Write ``--overlay``: every word's heatmap (one row per checkpoint when several are compared), or the one word
    ``--token`` picks."""
    from ..rendering.heatmaps import RenderError, comparison_figure, save_picture

    style = {"cmap": args.cmap, "alpha": args.alpha}
    try:
        if len(runs) > 1:
            picture = comparison_figure(image, [r.figure_row(name, args.mode) for name, (r,) in runs], **style)
        elif args.token is None:
            picture = runs[0][1][0].figure(image, args.mode, **style)
        else:
            picture = runs[0][1][0].overlay(image, args.token, args.mode, **style)
    except RenderError as exc:
        raise SystemExit(f"error: {exc}") from None
    save_picture(picture, args.overlay)
    print(f"wrote {args.overlay}", file=sys.stderr)


@_group.command("caption")
def _add_caption(sub: argparse._SubParsersAction) -> None:
    cap = sub.add_parser("caption", help="caption image files, optionally rendering the attention (no server)")
    cap.add_argument("images", nargs="+", help="image files; with --output also folders of them and text files "
                     "listing them, one path a line")
    cap.add_argument("--checkpoint", action="append",
                     help=f"checkpoint folder (default {DEFAULT_CHECKPOINT}); repeat it to compare checkpoints side by "
                          "side, one figure row each")
    add_search_options(cap)
    cap.add_argument("--overlay", metavar="OUT.png", type=figure_file,
                     help="write the per-word figure (or one word with --token); the format follows the extension")
    cap.add_argument("--token", type=int, help="render only this token's heatmap")
    cap.add_argument("--mode", help="grid_smooth, grid_blocks, region_sum, top1_box, area_topk (default: by model)")
    cap.add_argument("--cmap", default="jet", help="matplotlib colormap of the heatmaps (default jet)")
    cap.add_argument("--alpha", type=float, default=0.5, help="heatmap opacity in [0, 1] (default 0.5)")
    add_device_options(cap)
    # the console script (service/cli.py) adds --output and --json, and its own command, which calls this one
    # for a few images and the archive use case for folders and lists
    cap.set_defaults(func=caption_files)


def cmd_export(args: argparse.Namespace) -> None:
    """Export every checkpoint (of ``--weights-dir`` plus the named folders) to ONNX, one folder per model."""
    from ..checkpoint import checkpoint_name, find_checkpoints, not_a_checkpoint
    from ..device import set_threads
    from ..export.folder import ENCODER_FILE, HEAD_FILE, STEP_FILE
    from ..export.onnx import ExportUnsupported, export_checkpoints

    set_threads(args.threads)
    weights_dir = None if args.checkpoints and not args.all else args.weights_dir
    # the service's prefixed folders and extra checkpoints too, under the same names, so that its exports are the
    # ones it looks for
    prefixed = prefixed_dirs_from_env() if weights_dir else {}
    extra = [*args.checkpoints, *(map(str, checkpoints_from_env()) if weights_dir else ())]
    names = [checkpoint_name(c) for c in args.checkpoints]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:  # exports are named after the checkpoint: the second would silently replace the first
        raise SystemExit(f"error: {', '.join(c for c in args.checkpoints if checkpoint_name(c) in twice)} share the "
                         f"name {', '.join(twice)}, which names their exports: export them one at a time, each "
                         "with its own --out")

    def replaced(name: str, winner: Path, loser: Path) -> None:
        print(f"note: {winner} is exported as {name}, not {loser} (the service too serves the checkpoint named last)",
              file=sys.stderr)

    found = find_checkpoints(weights_dir, extra, prefixed, on_replaced=replaced)
    missing = [c for c in args.checkpoints if checkpoint_name(c) not in found]
    if missing:  # each said as eval says it (a training run names the checkpoints it holds)
        raise SystemExit("error: " + "; ".join(str(not_a_checkpoint(Path(c))) for c in missing))
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


@_group.command("export")
def _add_export(sub: argparse._SubParsersAction) -> None:
    ex = sub.add_parser("export",
                        help="export checkpoints to ONNX (encoder, encoder-head and decoder-step graphs) for the "
                        "service's ONNX Runtime backend")
    ex.add_argument("checkpoints", nargs="*", help="checkpoint folders (default: every one in --weights-dir)")
    ex.add_argument("--weights-dir", default=str(weights_dir_from_env()),
                    help="export every checkpoint below it (CAPTIONER_WEIGHTS_DIR; also every one below the "
                    "folders of CAPTIONER_PREFIXED_WEIGHTS_DIRS and those CAPTIONER_CHECKPOINTS names, under the "
                    "service's names)")
    ex.add_argument("--all", action="store_true", help="with named checkpoints: also every one in --weights-dir")
    ex.add_argument("--out", default=str(onnx_dir_from_env()),
                    help="one folder per model is written below it (CAPTIONER_ONNX_DIR, where the service looks)")
    ex.add_argument("--strict", action="store_true", help="exit 1 when any model cannot be exported")
    add_threads_option(ex)
    ex.set_defaults(func=cmd_export)


def cmd_import(args: argparse.Namespace) -> None:
    from ..checkpoint import save_checkpoint
    from ..encoder import EncoderSpec
    from ..interop.aoanet import convert_aoanet
    from ..interop.common import ConversionError
    from ..interop.xlan import CONVERTERS

    from ..interop.sgrvinod import ENCODER_FILE, convert_sgrvinod, encoder_file

    refuse_overwrite(args.out, args.force)  # before the conversion: nothing slow runs for a command that stops here
    files, spec = {}, EncoderSpec()
    try:
        if args.kind == "aoanet":
            model, vocab, meta = convert_aoanet(args.weights, args.infos)
        elif args.kind == "sgrvinod":
            model, vocab, spec, trunk, meta = convert_sgrvinod(args.checkpoint, args.word_map)
            files = {ENCODER_FILE: encoder_file(trunk)}
        else:
            model, vocab, meta = CONVERTERS[args.kind](args.checkpoint, args.vocab)
    except (ConversionError, pickle.UnpicklingError, OSError) as error:
        raise SystemExit(f"error: {error}") from None
    out = save_checkpoint(args.out, model, vocab, spec, meta, files=files)
    if args.kind == "sgrvinod":  # images in, like the shipped checkpoints
        print(f"wrote {out} ({model.arch}, {len(vocab)} tokens, {spec.backbone} encoder); caption with "
              f"captioner caption IMAGE --checkpoint {out}, or serve its folder")
    else:
        print(f"wrote {out} ({model.arch}, {len(vocab)} tokens); evaluate it with "
              f"captioner eval {out} --features regions:DIR")


@_group.command("import")
def _add_import(sub: argparse._SubParsersAction) -> None:
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
        parser.add_argument("--out", required=True, help="checkpoint folder to write (a new or empty one)")
        parser.add_argument("--force", action="store_true",
                            help="replace the checkpoint already at --out (never a folder of anything else)")
        parser.set_defaults(func=cmd_import)


def cmd_storage(args: argparse.Namespace) -> None:
    from ..checkpoint import CARD, WEIGHTS, convert_storage

    if args.out is not None and Path(args.out).resolve() != Path(args.checkpoint).resolve():
        refuse_overwrite(args.out, args.force)
    had_card = (Path(args.checkpoint) / CARD).is_file()
    out = convert_storage(args.checkpoint, args.dtype, args.out)
    print(f"{out}: weights stored as {args.dtype}, {(out / WEIGHTS).stat().st_size / 2**20:.1f} MiB")
    if had_card and not (out / CARD).is_file():
        print(f"{out}: its {CARD} was left out: it named the weights as they were stored and what they measured "
              f"(captioner card {out} writes one for these)")


@_group.command("storage")
def _add_storage(sub: argparse._SubParsersAction) -> None:
    st = sub.add_parser("storage", help="write a checkpoint again with its weights stored as float16 (half the "
                        "bytes; loading casts them back) or float32; compare `captioner eval` before and after. Its "
                        "model card, which named the weights as they were, is left out (rewritten in place: "
                        "removed); `captioner card` writes one for the new weights")
    st.add_argument("checkpoint", help="checkpoint folder to read (and, without --out, to rewrite)")
    st.add_argument("dtype", choices=("float16", "float32"), help="how the weights are stored")
    st.add_argument("--out", help="write the result here instead of in place (a new or empty folder)")
    st.add_argument("--force", action="store_true", help="replace the checkpoint already at --out")
    st.set_defaults(func=cmd_storage)


def cmd_manifest(args: argparse.Namespace) -> None:
    """(Re)write the sha256 manifest of checkpoint folders whose files you trust (e.g. made before manifests)."""
    from ..checkpoint import (LOAD_ATTEMPTS, CheckpointError, folder_inode, is_checkpoint, load_checkpoint,
                              write_manifest)

    folders = list(map(Path, args.checkpoints))
    sealing = {}
    for folder in folders:  # every folder checked before any manifest is written: a mistake seals nothing
        if not is_checkpoint(folder):
            raise SystemExit(f"error: {folder} is not a checkpoint folder (needs config.json and model.safetensors); "
                             "no manifest was written")
        try:  # a manifest vouches for files that load: truncated or mismatched weights are refused, not sealed
            load_checkpoint(folder, verify=False)
        except CheckpointError as exc:
            raise SystemExit(f"error: {exc}; no manifest was written") from None
        sealing[folder] = _what_to_seal(folder, args.force)
    for folder in folders:
        # another process may replace the folder whole meanwhile (`captioner card`, a training run's save): the
        # digests read from the old folder, written into the new one, stopped it loading; so the folder must be the
        # one read from until the manifest is in it, else what is there now is read and sealed
        for _ in range(LOAD_ATTEMPTS):
            inode, records, changes = sealing[folder]
            try:
                written = write_manifest(folder, records)
            except FileNotFoundError:  # the folder it was writing into was swapped out and removed
                written = None
            if written is not None and folder_inode(folder) == inode:
                break
            # forced: the folder there now was sealed by the writer that swapped it in, and its model files differ
            # from its manifest only where this command's own stale write landed in it
            sealing[folder] = _what_to_seal(folder, force=True)
        else:
            raise SystemExit(f"error: {folder} was replaced {LOAD_ATTEMPTS} times while it was being sealed (a "
                             "training run or `captioner card` writing it?): run this again once it has moved on")
        changed = f" (changed since the last one: {', '.join(changes)})" if changes else ""
        print(f"wrote {written}{changed}")


def _what_to_seal(folder: Path, force: bool) -> tuple[tuple[int, int] | None, dict, list[str] | None]:
    """The folder's identity (:func:`~captioner.models.checkpoint.folder_inode`), its file records (hashed once:
    compared with the manifest there, then written) and what changed under its manifest, read in that order."""
    from ..checkpoint import file_records, folder_inode, manifest_changes, model_files

    inode = folder_inode(folder)
    records = file_records(folder)
    changes = manifest_changes(folder, records)
    # a card or a note edited beside the model is what resealing is for; the model's own files changing under
    # their manifest is what it exists to catch (a flipped byte then loaded as trusted weights)
    changed_model = sorted(set(changes or ()) & model_files(folder))
    if changed_model and not force:
        raise SystemExit(f"error: {', '.join(str(folder / name) for name in changed_model)} changed since "
                         f"{folder / 'manifest.json'} was written (altered or torn?): pass --force to record "
                         "the files as they are now; no manifest was written")
    return inode, records, changes


@_group.command("manifest")
def _add_manifest(sub: argparse._SubParsersAction) -> None:
    mf = sub.add_parser("manifest", help="write the sha256 manifest.json that load_checkpoint verifies, for "
                        "checkpoint folders whose files you trust")
    mf.add_argument("checkpoints", nargs="+", help="checkpoint folders")
    mf.add_argument("--force", action="store_true", help="record the files even where the model's own (the weights, "
                    "config.json, vocab.json, an encoder weight file kept in the folder) differ from the manifest "
                    "already there (without it, that is refused; a card or a note is resealed either way)")
    mf.set_defaults(func=cmd_manifest)


def cmd_models(args: argparse.Namespace) -> None:
    from ..zoo import PROTOCOL_ARGUMENTS, REQUIRED, available, options

    if args.name is None:
        print("\n".join(available()))
        return
    for option, default in options(args.name).items():
        if option not in PROTOCOL_ARGUMENTS:
            print(f"{option}  (required)" if default is REQUIRED else f"{option}={json.dumps(default)}")
    print(f"# from the data set and the encoder, not --set: {', '.join(PROTOCOL_ARGUMENTS)}")


@_group.command("models")
def _add_models(sub: argparse._SubParsersAction) -> None:
    ls = sub.add_parser("models", help="list registered model architectures, or one model's options")
    ls.add_argument("name", nargs="?", help="a model: print its options (captioner train --set OPTION=VALUE) with "
                    "their defaults, one OPTION=VALUE line each (values in JSON)")
    ls.set_defaults(func=cmd_models)
