"""Evaluation and reporting subcommands: eval, resolution-check, compare, card, plot, params, the docs' tables."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..data.karpathy import DATASET_FORMATS
from ..evaluation.report import PTB_TOKENIZER, WORDS_TOKENIZER
from ..files import read_text_file, write_atomically
from ..placement import DEFAULT_WEIGHTS_DIR, onnx_dir_from_env
from .common import (DEFAULT_DATA, IMAGE_ROOT_HELP, CommandGroup, add_cache_option,
                     add_dataset_options, add_device_options, add_search_options, count, dataset_file, figure_file,
                     decoding_rules, load_split, output_file, positive_int, refuse_input_as_output)

_group = CommandGroup()
#: add_commands (commands.py) calls register(sub, name) for each of this module's subcommands
register = _group.register


def add_ptb_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ptb", action="store_true",
                        help="score as coco-caption does: Stanford's PTB tokenizer over the raw references and the "
                        "captions (needs Java); default: the project's one tokenizer on both")


def cmd_eval(args: argparse.Namespace) -> None:
    """``captioner eval``: :func:`~captioner.models.evaluation.report.evaluation_report` on the flags; the report to
    stdout (and ``--output``), captions (``--show``) and the Entities tables to stderr, ``--results-json``."""
    from ..checkpoint import checkpoint_name
    from ..device import set_threads
    from ..evaluation.report import ScoredSplit, evaluation_report

    def print_split(scored: ScoredSplit) -> None:  # as each split is scored, not after the last one
        if (args.grounding or "").startswith("entities:"):
            _print_entities_tables(checkpoint_name(args.checkpoint), scored.section["grounding"])
        for im in scored.images[: args.show]:
            print(f"  {im.path.name}: {' '.join(scored.captions[im.image_id])}", file=sys.stderr)

    refuse_input_as_output({"--output": args.output, "--results-json": args.results_json},
                           [dataset_file(args.dataset or DEFAULT_DATA)], [args.checkpoint])
    set_threads(args.threads)
    evaluation = evaluation_report(
        args.checkpoint, args.dataset, args.split or ["test"], image_root=args.image_root, beam_size=args.beam_size,
        max_len=args.max_len, length_penalty=args.length_penalty, block_trigrams=args.block_trigrams,
        block_doubled_words=args.block_doubled_words,
        limit=args.limit, meteor=not args.no_meteor, ptb=args.ptb, misses=args.misses, features=args.features,
        cache_dir=args.cache_dir, device=args.device, encoder_precision=args.encoder_precision,
        onnx_dir=args.onnx_dir, threads=args.threads, grounding=args.grounding,
        grounding_resamples=args.grounding_resamples, progress=args.progress, on_split=print_split)
    report = evaluation.report
    text = json.dumps(report, indent=2)
    print(text)
    if args.output:
        write_atomically(Path(args.output), text + "\n")
    if args.results_json:  # the COCO caption-evaluation results format
        write_atomically(Path(args.results_json), json.dumps(evaluation.coco_results) + "\n")
        print(f"wrote {len(evaluation.coco_results)} captions to {args.results_json}", file=sys.stderr)


def _print_entities_tables(name: str, section: dict) -> None:
    """A split's Flickr30k Entities grounding as tables, on stderr (stdout stays the JSON)."""
    from ..evaluation.phrase_grounding import summary_table, type_table

    print(f"\nattention grounding, Flickr30k Entities (Plummer et al., arXiv:1505.04870), {section['photos']} photos:\n"
          f"{summary_table([(name, section)])}\n\nper phrase type, references teacher-forced:\n"
          f"{type_table([(name, section)])}\n", file=sys.stderr)


@_group.command("eval")
def _add_eval(sub: argparse._SubParsersAction) -> None:
    ev = sub.add_parser("eval", help="BLEU-1..4, METEOR, ROUGE-L, CIDEr-D of a checkpoint on a split")
    ev.add_argument("checkpoint", help="checkpoint folder")
    ev.add_argument("--dataset", help=f"{DATASET_FORMATS} (default: {DEFAULT_DATA}; with --grounding "
                    "entities:DIR, the data set the checkpoint was trained on)")
    ev.add_argument("--image-root", help=IMAGE_ROOT_HELP)
    ev.add_argument("--split", action="append", help="split(s) to score (default: test)")
    add_search_options(ev)
    ev.add_argument("--limit", type=positive_int, help="score only the first N images of each split")
    ev.add_argument("--no-meteor", action="store_true", help="skip METEOR (needs Java)")
    add_ptb_option(ev)
    ev.add_argument("--show", type=count, default=0, help="print this many captions")
    ev.add_argument("--misses", type=count, default=0, metavar="N",
                    help="also report the N caption words that BLEU-1 most often leaves uncredited")
    add_cache_option(ev)
    ev.add_argument("--features", metavar="grid|regions:DIR", help="visual items (default: the training run's)")
    add_device_options(ev)
    ev.add_argument("--encoder-precision", choices=("float32", "int8"), default="float32",
                    help="int8: grid features from the CNN quantized for ONNX Runtime, as the service computes them "
                    "with CAPTIONER_ENCODER_PRECISION=int8 (default: the float PyTorch CNN)")
    ev.add_argument("--onnx-dir", default=str(onnx_dir_from_env()),
                    help="where the ONNX CNN is exported and quantized (with --encoder-precision int8)")
    ev.add_argument("--output", type=output_file, help="also write the JSON report here")
    ev.add_argument("--no-progress", dest="progress", action="store_false",
                    help="no progress bars (for logs and CI), as captioner train")
    ev.add_argument("--results-json", metavar="FILE", type=output_file,
                    help='also write the captions in the COCO results format [{"image_id", "caption"}] here')
    ev.add_argument("--grounding", nargs="?", const="scenes", metavar="entities:DIR",
                    help="also score attention grounding: alone, on the scenes' object masks (mass in object, "
                         "pointing hit, area-normalised ratio per word class); entities:DIR, on the Flickr30k "
                         "Entities boxes of real photos (attention correctness, pointing hit, ratio per phrase type; "
                         "references teacher-forced and the model's own captions); 95%% bootstrap intervals and "
                         "chance rows either way")
    ev.add_argument("--grounding-resamples", type=positive_int, default=2000, help="bootstrap resamples over images "
                    "(default 2000)")
    ev.set_defaults(func=cmd_eval, split=None)


def cmd_resolution_check(args: argparse.Namespace) -> None:
    from ..data.datasets import resolve_dataset
    from ..device import resolve_device, set_threads
    from ..evaluation.resolution import resolution_check
    from ..pipeline import Pipeline

    refuse_input_as_output({"--output": args.output}, [dataset_file(args.dataset)], [args.checkpoint])
    set_threads(args.threads)
    pipeline = Pipeline(args.checkpoint, resolve_device(args.device))
    images = load_split(resolve_dataset(args.dataset), args.image_root, args.split)
    report = resolution_check(pipeline, images, Path(args.full_root), args.beam_size, args.max_len,
                              decoding_rules(pipeline.ckpt, args))
    text = json.dumps(report, indent=2)
    print(text)
    if args.output:
        write_atomically(Path(args.output), text + "\n")


@_group.command("resolution-check")
def _add_resolution_check(sub: argparse._SubParsersAction) -> None:
    rc = sub.add_parser("resolution-check", help="caption the full-size originals of a split's photos and their "
                        "small copies with the service's preprocessing; scores of both against the same references")
    rc.add_argument("checkpoint", help="checkpoint folder")
    add_dataset_options(rc, image_root_help="the data set's copies of the photos")
    rc.add_argument("--full-root", required=True, help="folder of full-size originals, matched by file name")
    rc.add_argument("--split", default="test", help="split whose photos are compared (default test)")
    add_search_options(rc)
    add_device_options(rc)
    rc.add_argument("--output", type=output_file, help="also write the JSON report here")
    rc.set_defaults(func=cmd_resolution_check)


def cmd_compare(args: argparse.Namespace) -> None:
    from ..data.datasets import resolve_dataset
    from ..evaluation.compare import compare_captions, markdown, read_results
    from ..evaluation.metrics import check_ptb_tokenizer

    refuse_input_as_output({"--output": args.output}, [*args.results, dataset_file(args.dataset)])
    if args.ptb:
        check_ptb_tokenizer()
    dataset = resolve_dataset(args.dataset)
    images = load_split(dataset, args.image_root, args.split, check_images=False, limit=args.limit)
    try:
        sides = [read_results(Path(path)) for path in args.results]
        result = compare_captions(sides[0], sides[1], images, args.resamples, ptb=args.ptb)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}")
    names = args.names or [Path(p).stem for p in args.results]
    report = {"dataset": str(dataset), "split": args.split, "a": names[0], "b": names[1],
              "tokenizer": PTB_TOKENIZER if args.ptb else WORDS_TOKENIZER, **result}
    print(markdown(result, *names))
    if args.output:
        write_atomically(Path(args.output), json.dumps(report, indent=2) + "\n")


@_group.command("compare")
def _add_compare(sub: argparse._SubParsersAction) -> None:
    cmp = sub.add_parser("compare", help="paired comparison of two checkpoints' captions of the same split: CIDEr-D, "
                         "BLEU-4 and (generated scenes) objects_named of each, and the difference with a "
                         "paired-bootstrap 95%% interval")
    cmp.add_argument("results", nargs=2, metavar="RESULTS.json",
                     help="captions of A and of B, as `captioner eval --results-json` writes them")
    cmp.add_argument("--names", nargs=2, metavar=("A", "B"), help="names for the table (default: the file names)")
    add_dataset_options(cmp)
    cmp.add_argument("--split", default="test", help="split the captions describe (default test)")
    cmp.add_argument("--resamples", type=positive_int, default=2000, help="bootstrap resamples over images "
                     "(default 2000)")
    cmp.add_argument("--limit", type=positive_int, help="compare the split's first N images only, as captioner eval "
                     "--limit N captioned them")
    add_ptb_option(cmp)
    cmp.add_argument("--output", type=output_file, help="also write the JSON here")
    cmp.set_defaults(func=cmd_compare)


def cmd_card(args: argparse.Namespace) -> None:
    """Write a checkpoint's MODEL_CARD.md from its training record and a `captioner eval --output` report."""
    from ..evaluation.card import check_report_scores, load_report, merge_reports, write_card

    notes = read_text_file(args.notes) if args.notes else ""
    reports = [load_report(path) for path in args.report]
    for path, report in zip(args.report, reports):
        check_report_scores(report, path, args.checkpoint)
    report = merge_reports(reports)
    print(f"wrote {write_card(args.checkpoint, report, args.title, notes)}")


@_group.command("card")
def _add_card(sub: argparse._SubParsersAction) -> None:
    cd = sub.add_parser("card", help="write a checkpoint's MODEL_CARD.md from its training record and an eval report")
    cd.add_argument("checkpoint", help="checkpoint folder, whose MODEL_CARD.md is written")
    cd.add_argument("--report", required=True, action="append",
                    help="the JSON written by `captioner eval --output` (repeatable: e.g. test + held-out, then the "
                         "OOD set; a later report's split replaces an earlier one of the same name)")
    cd.add_argument("--title", help="the card's heading (default: the checkpoint's name)")
    cd.add_argument("--notes", metavar="FILE", help="a Markdown file appended as the card's Notes section")
    cd.set_defaults(func=cmd_card)


def cmd_plot(args: argparse.Namespace) -> None:
    """Loss, learning rate and validation metrics of one or more training runs, overlaid, to a PNG."""
    from ..training.curves import plot_runs

    try:
        print(f"wrote {plot_runs(args.runs, args.out, args.label)}")
    except (FileNotFoundError, ValueError) as exc:
        raise SystemExit(f"error: {exc}") from None


@_group.command("plot")
def _add_plot(sub: argparse._SubParsersAction) -> None:
    pl = sub.add_parser("plot", help="training curves of runs (metrics.jsonl): loss, learning rate and validation "
                        "metrics per epoch, several runs overlaid, to PNG")
    pl.add_argument("runs", nargs="+", metavar="RUN", help="training run folders (--out of `captioner train`)")
    pl.add_argument("--out", default="curves.png", type=figure_file, help="picture to write (default curves.png; "
                    "replaced if it exists)")
    pl.add_argument("--label", action="append", help="legend name per run (default: the folder names)")
    pl.set_defaults(func=cmd_plot)


def cmd_params(args: argparse.Namespace) -> None:
    from ..evaluation.params import parameter_table

    for name, parameters in parameter_table(args.vocab_size).items():
        print(f"{name:16s} {parameters:>14,d}")


@_group.command("params")
def _add_params(sub: argparse._SubParsersAction) -> None:
    pa = sub.add_parser("params", help="parameter counts of every model at the papers' sizes")
    pa.add_argument("--vocab-size", type=positive_int, default=10369,
                    help="words of the output layer (default 10369, COCO's Karpathy vocabulary at count 5)")
    pa.set_defaults(func=cmd_params)


def _real_photo_page_options(parser: argparse.ArgumentParser, results: str, results_help: str, document: str,
                             markers: str) -> None:
    """The options of a page generated from the real-photo checkpoints' reports (zoo-f8k, grounding-doc)."""
    parser.add_argument("--weights-dir", default=str(DEFAULT_WEIGHTS_DIR),
                        help="the real-photo checkpoints' folder")
    parser.add_argument("--results", default=results, help=results_help)
    parser.add_argument("--document", default=document, help=f"written between its {markers} markers")


def cmd_zoo_table(args: argparse.Namespace) -> None:
    from ..evaluation.zoo_table import write_zoo

    dataset = Path(args.dataset)
    dataset = dataset / "dataset_scenes.json" if dataset.is_dir() else dataset
    print(write_zoo(Path(args.weights_dir), Path(args.results), Path(args.document), Path(args.figure), dataset,
                    args.baseline))


@_group.command("zoo-table")
def _add_zoo_table(sub: argparse._SubParsersAction) -> None:
    zt = sub.add_parser("zoo-table", help="write docs/model_zoo.md's table of every checkpoint (and the grounding "
                        "table and figure) from the checkpoints' training records and `captioner eval` reports")
    zt.add_argument("--weights-dir", default="weights", help="folder of the scene checkpoints (default weights)")
    zt.add_argument("--results", default="docs/results", help="folder of eval reports NAME.json / NAME.*.json")
    zt.add_argument("--document", default="docs/model_zoo.md", help="written between its zoo-table markers")
    zt.add_argument("--figure", default="docs/figures/grounding.png", help="the grounding figure written")
    zt.add_argument("--dataset", default=DEFAULT_DATA,
                    help="the scenes whose test split the captions in RESULTS/captions/ describe: every checkpoint "
                    "against --baseline, paired (skipped when missing)")
    zt.add_argument("--baseline", default="sat", help="scene checkpoint the others are compared with (default sat; a "
                    "name with no captions in RESULTS/captions/ leaves the paired table out)")
    zt.set_defaults(func=cmd_zoo_table)


def cmd_zoo_f8k(args: argparse.Namespace) -> None:
    from ..evaluation.zoo_f8k import write_f8k_section

    try:
        print(write_f8k_section(Path(args.weights_dir), Path(args.results), Path(args.document), args.dataset,
                                args.image_root, args.split, args.baseline, args.resamples))
    except (ValueError, OSError) as exc:
        raise SystemExit(f"error: {exc}") from None


@_group.command("zoo-f8k")
def _add_zoo_f8k(sub: argparse._SubParsersAction) -> None:
    zf = sub.add_parser("zoo-f8k", help="write docs/model_zoo.md's Flickr8k table (scores, the papers' rows, "
                        "paired-bootstrap differences from --baseline, the issue's floors) from `captioner eval` "
                        "reports and captions")
    _real_photo_page_options(zf, "docs/results/flickr8k", "folder of eval reports NAME.json and their captions "
                             "captions/NAME.json", "docs/model_zoo.md", "zoo-f8k")
    zf.add_argument("--baseline", default="sat", help="checkpoint the others are compared with")
    zf.add_argument("--dataset", help="the data set whose references the captions are scored against: "
                    f"{DATASET_FORMATS} (needed once a report exists)")
    zf.add_argument("--image-root", help=IMAGE_ROOT_HELP)
    zf.add_argument("--split", default="test", help="split the reports and captions describe (default test)")
    zf.add_argument("--resamples", type=positive_int, default=2000, help="bootstrap resamples over images")
    zf.set_defaults(func=cmd_zoo_f8k)


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


@_group.command("grounding-doc")
def _add_grounding_doc(sub: argparse._SubParsersAction) -> None:
    gd = sub.add_parser("grounding-doc", help="write docs/grounding.md's tables and figures (Flickr30k Entities "
                        "grounding of every real-photo checkpoint) from `captioner eval --grounding entities:DIR` "
                        "reports; `make grounding` runs those first")
    _real_photo_page_options(gd, "docs/results/grounding", "folder of the eval reports NAME.json",
                             "docs/grounding.md", "grounding")
    gd.add_argument("--list", action="store_true",
                    help="only print the real-photo checkpoints (trained on a Flickr Karpathy JSON), one a line")
    gd.add_argument("--figure", default="docs/figures/grounding_entities.png", help="the grounding figure written")
    gd.add_argument("--examples", default="docs/figures/grounding_entities_heatmaps.png",
                    help="the side-by-side heatmaps of the softmax, sparsemax and TVmax checkpoints")
    gd.add_argument("--scene-results", default="docs/results",
                    help="the scene reports whose SparseCap grounding the closing note compares with")
    add_device_options(gd)
    gd.set_defaults(func=cmd_grounding_doc)
