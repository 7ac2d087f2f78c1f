"""The model-side commands' flags reach the work they name, with their documented defaults, and what the commands
write; the work itself is stubbed (its own tests run it), so each test is a parse and a call."""

import argparse
import dataclasses
import inspect
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from PIL import Image

from captioner.models import checkpoint as checkpoint_module
from captioner.models import device as device_module
from captioner.models import ensemble as ensemble_module
from captioner.models import pipeline as pipeline_module
from captioner.models import training as training_module
from captioner.models import zoo
from captioner.models.checkpoint import load_checkpoint, save_checkpoint
from captioner.models.cli import training as training_cli
from captioner.models.cli.common import DEFAULT_DATA, at_least, count, figure_file, key_values, length_penalty, \
    load_split, output_file, positive_int, refuse_input_as_output, refuse_overwrite, yes_or_no
from captioner.models.data import datasets as datasets_module
from captioner.models.data import features as features_module
from captioner.models.data import ood as ood_module
from captioner.models.data import regions as regions_module
from captioner.models.data import scenes as scenes_module
from captioner.models.data.scenes import DEFAULT_SIZES, VARIATIONS
from captioner.models.device import resolve_device
from captioner.models.evaluation import card as card_module
from captioner.models.evaluation import grounding_doc as grounding_doc_module
from captioner.models.evaluation import params as params_module
from captioner.models.evaluation import phrase_grounding as phrase_grounding_module
from captioner.models.evaluation import report as report_module
from captioner.models.evaluation import resolution as resolution_module
from captioner.models.evaluation import tuning as tuning_module
from captioner.models.evaluation import zoo_table as zoo_table_module
from captioner.models.export import onnx as onnx_module
from captioner.models.placement import DEFAULT_WEIGHTS_DIR
from captioner.models.training import curves as curves_module
from captioner.models.training import distributed as distributed_module
from captioner.service.cli import build_parser, main

from .conftest import SCENE_SIZES, cli_error
from .serving_helpers import TINY_SPEC, VOCAB, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def _recording_report(calls: list, section: dict | None = None):
    """An ``evaluation_report`` that records its call, announces one scored split of two images (whose report
    section is ``section``) and returns a report and COCO results of its own."""
    def evaluation_report(checkpoint, dataset, splits, **options):
        calls.append({"checkpoint": checkpoint, "dataset": dataset, "splits": splits, **options})
        options["on_split"](SimpleNamespace(images=[SimpleNamespace(path=Path("p/one.png"), image_id=1),
                                                    SimpleNamespace(path=Path("p/two.png"), image_id=2)],
                                            captions={1: ["a", "cat"], 2: ["a", "dog"]}, section=section or {}))
        return SimpleNamespace(report={"test": {"BLEU-1": 0.5}}, coco_results=[{"image_id": 1, "caption": "a cat"}])
    return evaluation_report


def test_eval_hands_every_flag_to_the_report_and_writes_both_files(tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(report_module, "evaluation_report", _recording_report(calls))
    out, results = tmp_path / "report.json", tmp_path / "results.json"
    for path in (out, results):
        path.write_text("an earlier run's")
    earlier = {path: path.stat().st_ino for path in (out, results)}
    main(["eval", str(tmp_path / "ckpt"), "--dataset", str(tmp_path / "data.json"), "--image-root", "photos",
          "--split", "val", "--split", "test", "--beam-size", "5", "--max-len", "7", "--length-penalty", "1.5",
          "--block-trigrams", "--no-block-doubled-words", "--limit", "4", "--no-meteor", "--ptb", "--misses", "3",
          "--features", "regions:r", "--cache-dir", "c", "--device", "cpu", "--threads", "1",
          "--encoder-precision", "int8", "--onnx-dir", "o", "--grounding", "--grounding-resamples", "50",
          "--no-progress", "--show", "1", "--output", str(out), "--results-json", str(results)])
    (call,) = calls
    call.pop("on_split")
    assert call == {"checkpoint": str(tmp_path / "ckpt"), "dataset": str(tmp_path / "data.json"),
                    "splits": ["val", "test"], "image_root": "photos", "beam_size": 5, "max_len": 7,
                    "length_penalty": 1.5, "block_trigrams": True, "block_doubled_words": False, "limit": 4,
                    "meteor": False, "ptb": True, "misses": 3, "features": "regions:r", "cache_dir": "c",
                    "device": "cpu", "encoder_precision": "int8", "onnx_dir": "o", "threads": 1,
                    "grounding": "scenes", "grounding_resamples": 50, "progress": False}
    printed = capsys.readouterr()
    assert json.loads(printed.out) == {"test": {"BLEU-1": 0.5}}
    # --show 1: the first image's caption only, on stderr (stdout is the report)
    assert "  one.png: a cat" in printed.err and "two.png" not in printed.err
    assert out.read_text() == json.dumps({"test": {"BLEU-1": 0.5}}, indent=2) + "\n"
    assert results.read_text() == json.dumps([{"image_id": 1, "caption": "a cat"}]) + "\n"
    assert f"wrote 1 captions to {results}\n" in printed.err  # how many captions went where, beside the report
    # each replaced whole (a new file renamed over the old), never rewritten in place: a failed write would leave half
    assert all(path.stat().st_ino != inode for path, inode in earlier.items())


def test_eval_defaults_are_the_documented_ones(tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(report_module, "evaluation_report", _recording_report(calls))
    main(["eval", str(tmp_path / "ckpt")])
    (call,) = calls
    assert call["splits"] == ["test"] and call["dataset"] is None
    assert {key: call[key] for key in ("beam_size", "max_len", "length_penalty", "block_trigrams",
                                       "block_doubled_words", "limit", "meteor", "ptb", "misses", "features",
                                       "cache_dir", "device", "encoder_precision", "grounding",
                                       "grounding_resamples", "progress")} == {
        "beam_size": 3, "max_len": 20, "length_penalty": None, "block_trigrams": None, "block_doubled_words": None,
        "limit": None, "meteor": True, "ptb": False, "misses": 0, "features": None, "cache_dir": ".cache/features",
        "device": "auto", "encoder_precision": "float32", "grounding": None, "grounding_resamples": 2000,
        "progress": True}
    assert "one.png" not in capsys.readouterr().err  # no captions shown unless asked


def test_an_entities_grounding_prints_its_tables_on_stderr_as_each_split_is_scored(tmp_path, monkeypatch, capsys):
    """``--grounding entities:DIR`` shows the checkpoint's Flickr30k Entities tables under its name; stdout stays
    the JSON report, and the scenes' grounding (in the report alone) prints no tables."""
    grounding = {"photos": 2}
    monkeypatch.setattr(report_module, "evaluation_report", _recording_report([], {"grounding": grounding}))
    monkeypatch.setattr(phrase_grounding_module, "summary_table", lambda reports: f"summary of {reports}")
    monkeypatch.setattr(phrase_grounding_module, "type_table", lambda reports: f"types of {reports}")
    main(["eval", str(tmp_path / "ckpt"), "--grounding", f"entities:{tmp_path}"])
    printed = capsys.readouterr()
    assert json.loads(printed.out) == {"test": {"BLEU-1": 0.5}}
    tables = [("ckpt", grounding)]
    assert "Flickr30k Entities (Plummer et al., arXiv:1505.04870), 2 photos" in printed.err
    assert f"summary of {tables}" in printed.err and f"types of {tables}" in printed.err
    main(["eval", str(tmp_path / "ckpt"), "--grounding"])
    assert "summary of" not in capsys.readouterr().err


def test_the_library_calls_defaults_are_the_commands(tmp_path, monkeypatch):
    """evaluation_report's keywords are captioner eval's flags, one for one: a library caller who gives none gets
    the report the bare command writes."""
    defaults = {name: parameter.default for name, parameter in
                inspect.signature(report_module.evaluation_report).parameters.items()
                if parameter.default is not inspect.Parameter.empty}
    calls = []
    monkeypatch.setattr(report_module, "evaluation_report", _recording_report(calls))
    main(["eval", str(tmp_path / "ckpt")])
    (call,) = calls
    assert list(defaults.pop("splits")) == call["splits"] and defaults.pop("on_split") is None
    # the command reads CAPTIONER_ONNX_DIR itself; the library call reads it where it makes the graph
    assert defaults.pop("onnx_dir") is None
    assert defaults == {key: call[key] for key in defaults}


#: (a command line, the documented defaults it parses to): each as its help says
DEFAULTS = [
    (["caption", "p.png"], {"beam_size": 3, "max_len": 20, "cmap": "jet", "alpha": 0.5, "device": "auto",
                            "length_penalty": None, "block_trigrams": None, "block_doubled_words": None,
                            "readers": 2}),
    (["eval", "c"], {"show": 0, "misses": 0, "grounding_resamples": 2000, "cache_dir": ".cache/features",
                     "encoder_precision": "float32"}),
    (["eval", "c", "--grounding"], {"grounding": "scenes"}),
    (["resolution-check", "c", "--full-root", "f"], {"split": "test", "beam_size": 3, "max_len": 20}),
    (["compare", "a.json", "b.json"], {"split": "test", "resamples": 2000}),
    (["plot", "run"], {"out": "curves.png"}),
    (["params"], {"vocab_size": 10369}),
    # the pages' generators: `make zoo-f8k` gives only the data set, so the Flickr8k section is read from and written
    # to where these say; zoo-table and grounding-doc run bare (the pages name the commands) read the same folders
    (["zoo-table"], {"weights_dir": "weights", "results": "docs/results", "document": "docs/model_zoo.md",
                     "figure": "docs/figures/grounding.png", "dataset": DEFAULT_DATA, "baseline": "sat"}),
    (["zoo-f8k"], {"weights_dir": str(DEFAULT_WEIGHTS_DIR), "results": "docs/results/flickr8k",
                   "document": "docs/model_zoo.md", "baseline": "sat", "split": "test", "resamples": 2000}),
    (["grounding-doc"], {"weights_dir": str(DEFAULT_WEIGHTS_DIR), "results": "docs/results/grounding",
                         "document": "docs/grounding.md", "figure": "docs/figures/grounding_entities.png",
                         "examples": "docs/figures/grounding_entities_heatmaps.png", "scene_results": "docs/results"}),
    # the grid docs/decisions.md gives: α ∈ {0, 0.5, 1} × trigram blocking off and on
    (["tune-decoding", "c"], {"split": "val", "length_penalties": [0.0, 0.5, 1.0], "block_trigrams": [False, True],
                              "block_doubled_words": [False], "metric": "CIDEr-D", "beam_size": 3, "max_len": 20}),
    (["ensemble", "out", "a", "b"], {"max_members": 4, "min_gain": 0.005, "beam_size": 3, "storage": "float32"}),
    (["data", "generate"], {"out": DEFAULT_DATA, "seed": 0, "workers": 2, **DEFAULT_SIZES}),
    (["data", "generate", "--varied"], {"varied": "standard"}),
    (["data", "ood"], {"out": ".cache/ood", "images": 500, "seed": 0}),
    (["data", "features"], {"batch_size": 32, "shard_size": 1024, "cache_dir": ".cache/features"}),
    (["data", "regions", "--out", "r"], {"dataset": DEFAULT_DATA, "encoder": [], "cache_dir": ".cache/features",
                                         "device": "auto", "threads": None}),
]


@pytest.mark.parametrize("argv, defaults", DEFAULTS, ids=[" ".join(argv) for argv, _ in DEFAULTS])
def test_each_option_left_out_takes_the_default_its_help_states(argv, defaults):
    parsed = vars(build_parser().parse_args(argv))
    assert {key: parsed[key] for key in defaults} == defaults


def test_train_without_cache_dir_reads_the_feature_cache_the_other_commands_fill():
    """docs/feature_store.md: one store serves every command (``captioner data features`` run once "serves training
    and ``captioner eval``"). A training run given no ``--cache-dir`` must look in the folder ``data features``,
    ``eval`` and ``tune-decoding`` fill by default, or it encodes every photo again (hours on COCO) into a second copy.
    ``train`` parses no defaults of its own (its config has them), so the DEFAULTS table above cannot hold it."""
    parser = build_parser()
    trained = training_cli.train_config_from_args(parser.parse_args(["train", "--out", "x"])).cache_dir
    commands = (["data", "features"], ["eval", "c"], ["tune-decoding", "c"], ["data", "regions", "--out", "r"])
    others = {" ".join(argv): parser.parse_args(argv).cache_dir for argv in commands}
    assert others == dict.fromkeys(others, trained)


def test_data_features_shards_photos_as_training_does_so_each_resumes_the_others_extraction():
    """``captioner data features`` and the stores training, evaluation and region features extract (through
    ``extract_features``'s default) cut shards of one size, 1,024 photos as docs/feature_store.md says: a store cut
    short by one and extracted again by the other keeps its finished shards only under the same size, so a library
    default of its own made the second discard every finished shard (hours of COCO's encoding) as another layout's."""
    parsed = build_parser().parse_args(["data", "features"])
    library_default = inspect.signature(features_module.extract_features).parameters["shard_size"].default
    assert parsed.shard_size == library_default == features_module.DEFAULT_SHARD_SIZE


def test_a_scene_data_set_is_skipped_when_current_and_written_with_the_flags_when_not(tmp_path, monkeypatch, capsys):
    written, current = [], [True]
    monkeypatch.setattr(scenes_module, "describes", lambda held, sizes, seed, variation, only: current[0])
    monkeypatch.setattr(scenes_module, "generate", lambda out, sizes, **options: written.append((sizes, options))
                        or Path(out) / "dataset_scenes.json")
    argv = ["data", "generate", "--out", str(tmp_path), "--train", "5", "--val", "1", "--test", "2", "--heldout", "0",
            "--seed", "3", "--workers", "1", "--varied", "small-objects"]
    main([*argv, "--if-stale"])
    assert written == [] and "is up to date" in capsys.readouterr().out
    main(argv)  # without --if-stale a current data set is written again
    assert f"wrote {tmp_path / 'dataset_scenes.json'}\n" in capsys.readouterr().out
    current[0] = False
    main([*argv, "--if-stale", "--only", "test"])
    sizes = {"train": 5, "val": 1, "test": 2, "heldout": 0}
    assert written == [(sizes, {"seed": 3, "workers": 1, "variation": VARIATIONS["small-objects"], "only": None}),
                       (sizes, {"seed": 3, "workers": 1, "variation": VARIATIONS["small-objects"], "only": ["test"]})]


class Store(list):
    """What ``extract_features`` returns, as far as ``captioner data features`` reads it."""
    folder = "c"


def test_the_ood_set_and_the_feature_store_get_their_flags(tmp_path, monkeypatch, scenes, capsys):
    drawn, extracted = [], []
    monkeypatch.setattr(ood_module, "generate_ood", lambda out, images, seed: drawn.append((out, images, seed)) or out)
    main(["data", "ood", "--out", str(tmp_path), "--images", "3", "--seed", "4"])
    assert drawn == [(str(tmp_path), 3, 4)] and f"wrote {tmp_path}\n" in capsys.readouterr().out

    def extract(images, spec, cache_dir, **options):
        extracted.append(({im.split for im in images}, spec, cache_dir, options))
        return Store(images)
    monkeypatch.setattr(features_module, "extract_features", extract)
    threads = []
    monkeypatch.setattr(device_module, "set_threads", lambda count, interop=None: threads.append(count))
    main(["data", "features", "--dataset", str(scenes), "--split", "val", "--split", "test", "--encoder",
          "image_size=64", "--cache-dir", "c", "--batch-size", "5", "--shard-size", "7", "--no-progress",
          "--device", "cpu", "--threads", "2"])
    ((splits, spec, cache_dir, options),) = extracted
    assert splits == {"val", "test"} and spec.image_size == 64 and cache_dir == "c" and threads == [2]
    assert options == {"batch_size": 5, "device": "cpu", "shard_size": 7, "progress": False}
    counted = SCENE_SIZES["val"] + SCENE_SIZES["test"]
    assert capsys.readouterr().out == f"{counted} images in c\n"
    with pytest.raises(SystemExit) as refused:
        main(["data", "features", "--dataset", str(scenes), "--split", "nope", "--split", "nah"])
    assert refused.value.code == 2
    assert f"error: no images in split 'nope' or 'nah' of {scenes}\n" in capsys.readouterr().err
    empty = tmp_path / "dataset_empty.json"
    empty.write_text(json.dumps({"images": []}))
    with pytest.raises(SystemExit) as refused:
        main(["data", "features", "--dataset", str(empty)])
    assert refused.value.code == 2 and f"error: {empty} holds no images\n" in capsys.readouterr().err


def test_the_feature_store_is_extracted_on_the_device_auto_resolves_to(monkeypatch, scenes, capsys):
    """``captioner data features`` without --device: the extractor gets the device "auto" stands for, named as torch
    names it ("cpu", "cuda"), not "auto", which torch.device refuses."""
    devices = []
    monkeypatch.setattr(features_module, "extract_features", lambda images, spec, cache_dir, **options:
                        devices.append(options["device"]) or Store(images))
    main(["data", "features", "--dataset", str(scenes), "--split", "val", "--cache-dir", "c"])
    assert devices == [str(resolve_device("auto"))]
    assert capsys.readouterr().out == f"{SCENE_SIZES['val']} images in c\n"


def test_the_feature_store_reads_the_photos_under_image_root(tmp_path, monkeypatch, scenes, capsys):
    """``captioner data features --dataset JSON --image-root PHOTOS``, as for COCO's or Flickr's photos kept apart
    from their captions' file: the photos are read under --image-root.  Looked for beside the JSON instead, every
    photo was said to be missing and no store could be extracted ahead of a multi-machine training run."""
    captions = tmp_path / "captions" / scenes.name  # the data set's JSON alone, its photos left where they were
    captions.parent.mkdir()
    captions.write_bytes(scenes.read_bytes())
    photos = []
    monkeypatch.setattr(features_module, "extract_features", lambda images, spec, cache_dir, **options:
                        photos.extend(im.path for im in images) or Store(images))
    main(["data", "features", "--dataset", str(captions), "--image-root", str(scenes.parent), "--split", "val",
          "--cache-dir", "c", "--device", "cpu"])
    assert len(photos) == SCENE_SIZES["val"] and all(path.is_relative_to(scenes.parent) for path in photos)
    assert capsys.readouterr().out == f"{SCENE_SIZES['val']} images in c\n"


def test_region_features_get_their_flags_and_say_how_to_train_on_them(tmp_path, monkeypatch, capsys):
    written, threads = [], []
    monkeypatch.setattr(device_module, "set_threads", lambda count, interop=None: threads.append(count))
    monkeypatch.setattr(regions_module, "write_scene_regions", lambda dataset, out, spec, cache_dir, **options:
                        written.append((dataset, out, spec, cache_dir, options)) or Path(out))
    main(["data", "regions", "--dataset", "d", "--out", str(tmp_path), "--encoder", "image_size=64", "--cache-dir",
          "c", "--threads", "2"])
    ((dataset, out, spec, cache_dir, options),) = written
    # the device named, not "auto": the writer takes a torch device's name
    assert (dataset, out, spec.image_size, cache_dir, options, threads) == (
        "d", str(tmp_path), 64, "c", {"device": str(resolve_device("auto"))}, [2])
    assert capsys.readouterr().out == (f"wrote region features to {tmp_path}; train on them with --features "
                                       f"regions:{tmp_path}\n")
    with pytest.raises(SystemExit) as refused:  # no folder of its own: the .npz files would go nowhere known
        main(["data", "regions"])
    assert refused.value.code == 2 and "--out" in capsys.readouterr().err


def test_data_without_its_command_unknown_names_or_counts_below_one_are_usage_errors(tmp_path, capsys):
    one_scene = ["data", "generate", "--out", str(tmp_path), "--train", "0", "--val", "0", "--heldout", "0", "--test",
                 "1"]  # where a mutant takes what it should refuse, it draws one scene, not thousands
    for argv, said in ((["data"], "required: COMMAND"),
                       (["data", "generate", "--varied", "nope"], "invalid choice: 'nope'"),
                       (["data", "generate", "--out", str(tmp_path), "--only", "tset"], "invalid choice: 'tset'"),
                       (["data", "ood", "--out", str(tmp_path), "--images", "0"], "argument --images"),
                       (["data", "features", "--dataset", str(tmp_path), "--batch-size", "0"],
                        "argument --batch-size"),
                       ([*one_scene, "--workers", "0"], "argument --workers"),
                       ([*one_scene, "--only"], "argument --only: expected at least one argument")):
        with pytest.raises(SystemExit) as refused:
            main(argv)
        assert refused.value.code == 2 and said in capsys.readouterr().err, argv
    # while a seed of 0 is one to give, as the Makefile's commands do
    assert build_parser().parse_args(["data", "generate", "--seed", "0"]).seed == 0


def test_card_plot_params_and_zoo_table_hand_on_their_flags(tmp_path, monkeypatch, capsys):
    cards, plots, tables, zoos = [], [], [], []
    monkeypatch.setattr(card_module, "load_report", lambda path: {"test": {"BLEU-4": 0.1}})
    monkeypatch.setattr(card_module, "check_report_scores", lambda report, path, checkpoint: None)
    monkeypatch.setattr(card_module, "write_card", lambda *args: cards.append(args) or "card")
    (tmp_path / "notes.md").write_text("measured twice")
    main(["card", "ckpt", "--report", "r.json", "--title", "Mine", "--notes", str(tmp_path / "notes.md")])
    assert cards == [("ckpt", {"test": {"BLEU-4": 0.1}}, "Mine", "measured twice")]
    monkeypatch.setattr(curves_module, "plot_runs", lambda runs, out, labels: plots.append((runs, out, labels)))
    main(["plot", "a", "b", "--label", "A", "--label", "B", "--out", str(tmp_path / "c.png")])
    assert plots == [(["a", "b"], str(tmp_path / "c.png"), ["A", "B"])]
    monkeypatch.setattr(params_module, "parameter_table", lambda vocab_size: tables.append(vocab_size) or {"m": 12})
    main(["params", "--vocab-size", "9"])
    assert tables == [9] and capsys.readouterr().out.splitlines()[-1] == "m                            12"
    monkeypatch.setattr(zoo_table_module, "write_zoo", lambda *args: zoos.append(args) or "table")
    (tmp_path / "scenes").mkdir()
    main(["zoo-table", "--dataset", str(tmp_path / "scenes")])
    assert zoos[0][4] == tmp_path / "scenes" / "dataset_scenes.json"


def test_resolution_check_hands_its_flags_to_the_check_and_writes_its_report(tmp_path, stub_pipeline, scenes,
                                                                             monkeypatch, capsys):
    """``captioner resolution-check``: the split's copies, the originals' folder, the beam, length and rules asked
    for reach the check; its report is printed, and written to ``--output`` only when one is given."""
    checked = []
    monkeypatch.setattr(resolution_module, "resolution_check", lambda pipeline, images, full_root, beam, longest,
                        rules: checked.append(({im.split for im in images}, len(images), full_root, beam, longest,
                                               rules)) or {"images": len(images)})
    out = tmp_path / "report.json"
    argv = ["resolution-check", "ckpt", "--dataset", str(scenes), "--full-root", str(tmp_path / "full"),
            "--split", "val", "--beam-size", "5", "--max-len", "7", "--length-penalty", "1", "--device", "cpu"]
    main([*argv, "--output", str(out)])
    ((splits, images, full_root, beam, longest, rules),) = checked
    assert stub_pipeline.opened == ["ckpt"] and (splits, images, full_root, beam, longest) == (
        {"val"}, SCENE_SIZES["val"], tmp_path / "full", 5, 7)
    assert rules.length_penalty == 1.0
    report = json.dumps({"images": SCENE_SIZES["val"]}, indent=2)
    assert capsys.readouterr().out == report + "\n" and out.read_text() == report + "\n"
    out.unlink()
    main(argv)
    assert capsys.readouterr().out == report + "\n" and not out.exists()


def test_grounding_doc_without_its_checkpoints_folder_is_one_line(tmp_path, capsys):
    # every file it writes named below tmp_path: a regression must not rewrite the checkout's docs
    written = {option: str(tmp_path / name) for option, name in (("--results", "results"), ("--document", "g.md"),
               ("--figure", "g.png"), ("--examples", "e.png"), ("--scene-results", "scene"))}
    with pytest.raises(SystemExit) as refused:
        main(["grounding-doc", "--weights-dir", str(tmp_path / "none"), *(x for pair in written.items() for x in pair)])
    assert refused.value.code == 2 and capsys.readouterr().err.strip() == \
        f"error: {tmp_path / 'none'} is not a folder of checkpoints"


def test_grounding_doc_lists_its_checkpoints_or_writes_the_page_on_the_device_and_threads_asked_for(
        tmp_path, monkeypatch, capsys):
    """``--list`` only names the real-photo checkpoints (what ``make grounding`` evaluates first) and writes nothing;
    otherwise the page is written from the folders given, on the device asked for, or the one "auto" stands for."""
    monkeypatch.setattr(grounding_doc_module, "real_photo_checkpoints", lambda weights: [weights / "a", weights / "b"])
    written, threads = [], []
    monkeypatch.setattr(grounding_doc_module, "write_grounding_doc", lambda *args: written.append(args) or "page")
    monkeypatch.setattr(device_module, "set_threads", lambda count, interop=None: threads.append(count))
    folders = {option: tmp_path / name for option, name in (("--results", "results"), ("--document", "g.md"),
               ("--figure", "g.png"), ("--examples", "e.png"), ("--scene-results", "scene"))}
    argv = ["grounding-doc", "--weights-dir", str(tmp_path), *(str(x) for pair in folders.items() for x in pair)]
    main([*argv, "--list"])
    assert capsys.readouterr().out == f"{tmp_path / 'a'}\n{tmp_path / 'b'}\n" and written == threads == []
    main([*argv, "--device", "cpu", "--threads", "2"])
    assert written == [(tmp_path, *folders.values(), "cpu")] and threads == [2]
    assert capsys.readouterr().out == "page\n"
    main(argv)  # the writer takes a torch device's name, not "auto"
    assert written[-1][-1] == str(resolve_device("auto"))


class Captioned:
    """A ``CaptionResult`` as far as ``captioner caption`` reads it: its caption and what it draws."""

    def __init__(self, drawn: list):
        self.caption, self.drawn = "a cat", drawn

    def figure(self, image, mode, **style):
        self.drawn.append(("figure", mode, style))
        return image

    def overlay(self, image, token, mode, **style):
        self.drawn.append(("overlay", token, mode, style))
        return image


@pytest.fixture
def stub_pipeline(monkeypatch):
    """``Pipeline`` replaced: the checkpoints opened, the searches asked for and the pictures drawn are recorded."""
    record = SimpleNamespace(opened=[], searched=[], drawn=[])

    class Pipeline:
        def __init__(self, checkpoint, device):
            record.opened.append(checkpoint)
            self.ckpt = SimpleNamespace(meta={})

        def __call__(self, images, beam_size, max_len, rules):
            record.searched.append((len(images), beam_size, max_len, rules))
            return [Captioned(record.drawn) for _ in images]
    monkeypatch.setattr(pipeline_module, "Pipeline", Pipeline)
    return record


def test_caption_hands_its_flags_to_the_search_and_the_figure(tmp_path, stub_pipeline, capsys):
    photo = tmp_path / "p.png"
    Image.new("RGB", (4, 4)).save(photo)
    main(["caption", str(photo), "--checkpoint", "a", "--beam-size", "5", "--max-len", "7", "--length-penalty", "1",
          "--block-trigrams", "--overlay", str(tmp_path / "f.png"), "--token", "0", "--mode", "grid_blocks",
          "--cmap", "gray", "--alpha", "0.25", "--device", "cpu"])
    ((images, beam, longest, rules),) = stub_pipeline.searched
    assert (images, beam, longest, rules.length_penalty, rules.block_trigrams) == (1, 5, 7, 1.0, True)
    assert stub_pipeline.drawn == [("overlay", 0, "grid_blocks", {"cmap": "gray", "alpha": 0.25})]
    assert capsys.readouterr().out == f"{photo}: a cat\n"  # one checkpoint: no label
    main(["caption", str(photo), "--checkpoint", "x/a", "--checkpoint", "y/a", "--device", "cpu"])
    assert capsys.readouterr().out.splitlines() == [f"{photo} [x/a]: a cat", f"{photo} [y/a]: a cat"]


def test_caption_prints_each_images_caption_beside_its_own_path(tmp_path, monkeypatch, capsys):
    """Several images captioned in one batch: each line's path is the image whose caption it gives (a caption
    printed beside another file's path is a wrong answer that reads as a right one)."""
    photos = [tmp_path / f"{width}.png" for width in (4, 6, 8)]
    for photo in photos:
        Image.new("RGB", (int(photo.stem), 4)).save(photo)

    class Pipeline:
        def __init__(self, checkpoint, device):
            self.ckpt = SimpleNamespace(meta={})

        def __call__(self, images, beam_size, max_len, rules):
            return [SimpleNamespace(caption=f"{image.width} wide") for image in images]

    monkeypatch.setattr(pipeline_module, "Pipeline", Pipeline)
    main(["caption", *map(str, photos), "--checkpoint", "a", "--device", "cpu"])
    assert capsys.readouterr().out.splitlines() == [f"{photo}: {photo.stem} wide" for photo in photos]


def test_caption_refuses_what_cannot_draw_before_any_model_loads(tmp_path, stub_pipeline, capsys):
    photo = tmp_path / "p.png"
    Image.new("RGB", (4, 4)).save(photo)
    figure = str(tmp_path / "f.png")
    for argv, message in (([str(photo), str(photo), "--overlay", figure], "--overlay takes exactly one image"),
                          ([str(photo), "--overlay", figure, "--token", "0", "--checkpoint", "a", "--checkpoint", "b"],
                           "--token renders one checkpoint's word"),
                          ([str(photo), "--overlay", figure, "--mode", "nope"], "nope"),
                          ([str(photo), "--overlay", figure, "--cmap", "nope"], "colormap 'nope'"),
                          ([str(photo), "--overlay", str(photo)], "--overlay")):
        with pytest.raises(SystemExit) as refused:
            main(["caption", *argv, "--device", "cpu"])
        assert refused.value.code == 2 and message in capsys.readouterr().err, argv
    assert stub_pipeline.opened == []


def test_caption_never_draws_its_overlay_over_a_file_of_a_checkpoint_it_reads(tmp_path, stub_pipeline, capsys):
    """``--overlay`` naming a file already in a ``--checkpoint`` folder (a figure kept beside the model) is refused
    before any model loads, as eval's outputs are: written over, the file no longer matched the checkpoint's
    manifest, and the checkpoint then refused to load."""
    photo, ckpt = tmp_path / "p.png", tmp_path / "ckpt"
    Image.new("RGB", (4, 4)).save(photo)
    ckpt.mkdir()
    kept = ckpt / "attention.png"
    kept.write_bytes(b"the figure the checkpoint keeps")
    with pytest.raises(SystemExit) as refused:
        main(["caption", str(photo), "--checkpoint", str(ckpt), "--overlay", str(kept), "--device", "cpu"])
    assert refused.value.code == 2 and f"is a file of {ckpt}" in capsys.readouterr().err
    assert stub_pipeline.opened == [] and kept.read_bytes() == b"the figure the checkpoint keeps"


@pytest.mark.parametrize("text, value", [("1", True), ("true", True), ("Yes", True), (" ON ", True), ("0", False),
                                         ("false", False), ("NO", False), ("off", False)])
def test_a_boolean_of_a_grid_is_read_in_each_spelling_and_any_case(text, value):
    assert yes_or_no(text) is value


def test_counts_take_their_least_and_most_and_refuse_one_beyond():
    assert (count("0"), positive_int("1"), at_least(1, 3)("3")) == (0, 1, 3)
    for parse, text, message in ((count, "-1", "at least 0"), (positive_int, "0", "at least 1"),
                                 (at_least(1, 3), "4", "at most 3"), (yes_or_no, "maybe", "neither on nor off")):
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            parse(text)


def test_a_count_or_a_length_penalty_that_is_not_a_number_is_a_usage_error_naming_the_text():
    """``--beam-size three`` or ``--length-penalty high`` is argparse's usage error naming what was typed; a type
    that let the text through without a value would fail inside itself, which argparse passes on as a traceback."""
    cases = (
        (positive_int, "three", "'three' is not a whole number"),
        (at_least(0, 5), "2.5", "'2.5' is not a whole number"),
        (length_penalty, "high", "'high' is not a number"),
    )
    for parse, text, message in cases:
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            parse(text)


def test_an_output_is_a_file_in_a_folder_that_exists_and_a_figure_has_a_pictures_extension(tmp_path):
    assert output_file(str(tmp_path / "r.json")) == str(tmp_path / "r.json")
    assert figure_file(str(tmp_path / "f.PNG")) == str(tmp_path / "f.PNG")
    for parse, text, message in ((output_file, tmp_path, "is a folder"),
                                 (output_file, tmp_path / "none" / "r.json", "does not exist"),
                                 (figure_file, tmp_path / "f.txt", "give a picture's file name")):
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            parse(str(text))


def test_a_checkpoint_is_written_only_into_a_new_or_empty_folder_unless_forced(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "config.json").write_text("{}")
    (tmp_path / "file").write_text("x")
    for out in ("new", "empty"):
        refuse_overwrite(tmp_path / out, force=False)
    for out in ("full", "file"):
        with pytest.raises(SystemExit, match="already exists: choose another OUT, or pass --force"):
            refuse_overwrite(tmp_path / out, force=False, what="OUT")
        refuse_overwrite(tmp_path / out, force=True)


def test_an_output_may_not_be_an_input_a_file_of_a_folder_read_or_another_output(tmp_path):
    data, checkpoint = tmp_path / "data.json", tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    refuse_input_as_output({"--output": checkpoint / "new.json", "--other": None}, [data], [checkpoint])
    for outputs, message in (({"--output": data}, "--output .*data.json is one of the command's inputs"),
                             ({"--output": checkpoint / "config.json"}, "is a file of .*ckpt"),
                             ({"--output": tmp_path / "r.json", "--results-json": tmp_path / "r.json"},
                              "--output and --results-json both name")):
        with pytest.raises(SystemExit, match=message):
            refuse_input_as_output(outputs, [data], [checkpoint])


def test_an_output_given_relative_is_refused_over_an_input_or_a_file_of_a_folder_read(tmp_path, monkeypatch):
    """``captioner tune-decoding --checkpoint weights/sat --output weights/sat/config.json`` and ``eval --dataset
    data.json --results-json ./data.json``: paths as typed, relative to the working folder, must meet the same
    refusal as absolute ones, or the result replaces the checkpoint's config or the data set it was made from."""
    monkeypatch.chdir(tmp_path)
    Path("ckpt").mkdir()
    Path("ckpt/config.json").write_text("{}")
    Path("data.json").write_text("{}")
    with pytest.raises(SystemExit, match="--output ckpt/config.json is a file of ckpt"):
        refuse_input_as_output({"--output": "ckpt/config.json"}, ["data.json"], ["ckpt"])
    with pytest.raises(SystemExit, match="--results-json data.json is one of the command's inputs"):
        refuse_input_as_output({"--results-json": "./data.json"}, ["data.json"], ["ckpt"])


def test_key_values_read_json_and_python_literals_with_dashes_as_underscores():
    assert key_values(["pre-norm=False", "d_model=256", "name=sat", "drop=None", "sizes=[1, 2]", "ok=true"]) == {
        "pre_norm": False, "d_model": 256, "name": "sat", "drop": None, "sizes": [1, 2], "ok": True}
    with pytest.raises(SystemExit, match="expected KEY=VALUE, got 'd_model'"):
        key_values(["d_model"])


def test_a_value_holding_an_equals_sign_is_kept_whole():
    """Only the first ``=`` splits a pair: ``--set cache_dir=runs/lr=0.1`` (a folder named after a sweep's setting)
    is that folder, not a key ``cache_dir=runs/lr`` that the command would refuse or ignore."""
    assert key_values(["cache_dir=runs/lr=0.1", "name=a=b"]) == {"cache_dir": "runs/lr=0.1", "name": "a=b"}


def test_a_split_the_data_set_lacks_is_a_one_line_error_naming_the_splits_it_has(scenes):
    """``captioner eval --split nope`` (or tune-decoding's, or any command reading a split) stops with the splits
    the data set has, not with a traceback from inside the data set reader."""
    assert len(load_split(scenes, None, "val")) == SCENE_SIZES["val"]
    with pytest.raises(SystemExit, match="^error: split 'nope' of .* is empty; its splits are heldout, test, train"):
        load_split(scenes, None, "nope")


def test_tune_decoding_scores_its_grid_and_stores_the_best_by_the_metric_asked_with_what_it_was_chosen_on(
        tmp_path, monkeypatch, capsys):
    """The grid and the checkpoint stubbed: what reaches the grid, and what the command records of its choice."""
    grids, stored = [], []
    rows = [{"length_penalty": 0.0, "block_trigrams": False, "block_doubled_words": False, "BLEU-4": 0.3,
             "CIDEr-D": 0.9, "novel_captions": 0.5},
            {"length_penalty": 1.0, "block_trigrams": True, "block_doubled_words": False, "BLEU-4": 0.4,
             "CIDEr-D": 0.8}]
    monkeypatch.setattr(checkpoint_module, "load_checkpoint", lambda path, device: SimpleNamespace(storage="float16"))
    monkeypatch.setattr(checkpoint_module, "update_meta", lambda path, **fields: stored.append((path, fields)))
    monkeypatch.setattr(datasets_module, "resolve_dataset", lambda dataset: dataset)
    monkeypatch.setattr(datasets_module, "train_split_captions", lambda dataset, image_root: [["a", "cat"]])
    monkeypatch.setattr(training_cli, "split_with_features", lambda ckpt, dataset, root, split, limit, cache, device:
                        (["one", "two", "three"][:limit], "store"))

    def grid(ckpt, images, store, penalties, trigrams, beam, longest, **options):
        grids.append((images, penalties, trigrams, beam, longest, options))
        return rows
    monkeypatch.setattr(tuning_module, "decoding_grid", grid)
    out = tmp_path / "rows.json"
    out.write_text("an earlier search's")
    earlier = out.stat().st_ino
    main(["tune-decoding", "ckpt", "--dataset", "d.json", "--limit", "5", "--length-penalties", "0", "1",
          "--block-trigrams", "off", "on", "--block-doubled-words", "no", "--beam-size", "4", "--max-len", "9",
          "--metric", "BLEU-4", "--device", "cpu", "--output", str(out), "--write"])
    assert grids == [(["one", "two", "three"], [0.0, 1.0], [False, True], 4, 9,
                      {"device": "cpu", "training_captions": [["a", "cat"]], "doubled_options": [False]})]
    best = {"length_penalty": 1.0, "block_trigrams": True, "block_doubled_words": False}
    assert stored == [("ckpt", {"decoding": best, "decoding_chosen_on": {
        "dataset": "d.json", "split": "val", "metric": "BLEU-4", "beam_size": 4, "images": 3, "score": 0.4,
        "storage": "float16"}})]
    assert json.loads(out.read_text()) == {"checkpoint": "ckpt", "dataset": "d.json", "split": "val", "beam_size": 4,
                                           "metric": "BLEU-4", "best": best, "rows": rows}
    printed = capsys.readouterr().out
    assert "best by BLEU-4 on val: length_penalty=1" in printed
    # the printed table has a column for each measure a row may hold, the novelty of the captions included (a
    # column the rows lack comes out empty, so a misnamed one drops its measure from the table without a word)
    assert ("| length penalty α | block trigrams | block doubled words | BLEU-1 | BLEU-4 | ROUGE-L | CIDEr-D | REP | "
            "distinct_words | novel_captions | mean_length |\n") in printed
    assert "| 0 | no | no |  | 0.3 |  | 0.9 |  |  | 0.5 |  |\n" in printed
    assert out.stat().st_ino != earlier  # replaced whole, not rewritten in place
    # the test split may be scored for a report: only keeping what was chosen on it (--write) is refused
    main(["tune-decoding", "ckpt", "--dataset", "d.json", "--split", "test", "--limit", "1"])
    assert len(grids) == 2 and grids[1][0] == ["one"] and len(stored) == 1
    assert "best by CIDEr-D on test: length_penalty=0" in capsys.readouterr().out


def test_export_searches_the_weights_folder_beside_named_checkpoints_only_with_all(tmp_path, monkeypatch, capsys):
    searched, found = [], {"a": Path("x/a")}
    monkeypatch.delenv("CAPTIONER_CHECKPOINTS", raising=False)
    monkeypatch.delenv("CAPTIONER_PREFIXED_WEIGHTS_DIRS", raising=False)
    monkeypatch.setattr(checkpoint_module, "find_checkpoints", lambda weights_dir, extra, prefixed, on_replaced:
                        searched.append(weights_dir) or found)
    monkeypatch.setattr(onnx_module, "export_checkpoints", lambda found, out, log: {})
    for argv in (["x/a"], ["x/a", "--all"], []):
        main(["export", *argv, "--weights-dir", "w", "--out", str(tmp_path)])
    assert searched == [None, "w", "w"]
    found.clear()
    with pytest.raises(SystemExit) as refused:
        main(["export", "--weights-dir", "w", "--out", str(tmp_path)])
    assert refused.value.code == 2 and "error: no checkpoint found in w" in capsys.readouterr().err


def test_export_of_named_checkpoints_leaves_the_services_other_folders_to_all(tmp_path, monkeypatch):
    """``captioner export CKPT`` exports that checkpoint: the folders CAPTIONER_PREFIXED_WEIGHTS_DIRS and
    CAPTIONER_CHECKPOINTS give the service (set in its container, say) join only with --all or no checkpoint named,
    rather than minutes of exports, and files written, that were not asked for."""
    searched, mine, scenes = [], tmp_path / "mine", tmp_path / "scenes"
    monkeypatch.setenv("CAPTIONER_PREFIXED_WEIGHTS_DIRS", json.dumps({"scenes-": str(scenes)}))
    monkeypatch.setenv("CAPTIONER_CHECKPOINTS", json.dumps([str(mine)]))

    def find_checkpoints(weights_dir, extra, prefixed, on_replaced):
        searched.append((weights_dir, extra, prefixed))
        return {"a": Path("x/a")}

    monkeypatch.setattr(checkpoint_module, "find_checkpoints", find_checkpoints)
    monkeypatch.setattr(onnx_module, "export_checkpoints", lambda found, out, log: {})
    for argv in (["x/a"], ["x/a", "--all"]):
        main(["export", *argv, "--weights-dir", "w", "--out", str(tmp_path)])
    assert searched == [(None, ["x/a"], {}), ("w", ["x/a", str(mine)], {"scenes-": scenes})]


def test_export_exits_1_for_a_model_it_cannot_export_only_when_strict(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint_module, "find_checkpoints", lambda *args, **options: {"a": Path("x/a")})
    monkeypatch.setattr(onnx_module, "export_checkpoints",
                        lambda found, out, log: {"a": onnx_module.ExportUnsupported("a loop the graph cannot hold")})
    main(["export", "--weights-dir", "w", "--out", str(tmp_path)])
    with pytest.raises(SystemExit) as failed:
        main(["export", "--weights-dir", "w", "--out", str(tmp_path), "--strict"])
    assert failed.value.code == 1


def test_a_strict_export_that_exported_every_model_exits_0(tmp_path, monkeypatch):
    """``--strict`` is for a script or CI step that must stop when a model was left out: when every model was
    exported it must succeed, or a deploy gated on it fails for nothing."""
    monkeypatch.setattr(checkpoint_module, "find_checkpoints", lambda *args, **options: {"a": Path("x/a")})
    monkeypatch.setattr(onnx_module, "export_checkpoints", lambda found, out, log: {"a": object()})
    main(["export", "--weights-dir", "w", "--out", str(tmp_path), "--strict"])  # no SystemExit(1)


def test_export_reports_each_models_files_and_differences_or_why_not_and_which_of_two_names_it_took(
        tmp_path, monkeypatch, capsys):
    def found(weights_dir, extra, prefixed, on_replaced):
        on_replaced("a", Path("y/a"), Path("x/a"))
        return {"a": Path("y/a"), "b": Path("x/b")}

    def export_checkpoints(found, out, log):
        (out / "a").mkdir(parents=True)
        for name, size in ((onnx_module.ENCODER_FILE, 1_500_000), (onnx_module.HEAD_FILE, 250_000),
                           (onnx_module.STEP_FILE, 40_000)):
            (out / "a" / name).write_bytes(bytes(size))
        results = {"a": SimpleNamespace(max_abs_diff={"step": 1e-6, "head": 2e-5}, growing_dims={"h": [1], "c": []}),
                   "b": onnx_module.ExportUnsupported("a loop the graph cannot hold")}
        for name, result in results.items():
            log(name, result)
        return results

    monkeypatch.setattr(checkpoint_module, "find_checkpoints", found)
    monkeypatch.setattr(onnx_module, "export_checkpoints", export_checkpoints)
    main(["export", "--weights-dir", "w", "--out", str(tmp_path)])
    printed = capsys.readouterr()
    assert printed.out.splitlines() == [
        f"a: {tmp_path / 'a'} ({onnx_module.ENCODER_FILE} 1.5 MB, {onnx_module.HEAD_FILE} 0.2 MB, "
        f"{onnx_module.STEP_FILE} 0.0 MB); verified against PyTorch, max |diff|: head 2.0e-05, step 1.0e-06; "
        "growing state dims {'h': [1]}",
        "b: NOT EXPORTED: a loop the graph cannot hold"]
    assert printed.err.strip() == (f"note: {Path('y/a')} is exported as a, not {Path('x/a')} (the service too serves "
                                   "the checkpoint named last)")


def test_export_refuses_named_checkpoints_that_share_a_name_before_exporting_any(tmp_path, monkeypatch, capsys):
    """Exports are named after the checkpoint: the second of two folders named alike would replace the first's."""
    folders = [save_checkpoint(tmp_path / place / "sat", tiny_model("sat"), VOCAB, TINY_SPEC) for place in "xy"]
    exported = []
    monkeypatch.setattr(onnx_module, "export_checkpoints", lambda found, out, log: exported.append(found) or {})
    with pytest.raises(SystemExit) as refused:
        main(["export", *map(str, folders), "--out", str(tmp_path / "onnx")])
    assert refused.value.code == 2 and exported == []
    assert capsys.readouterr().err.strip() == (f"error: {folders[0]}, {folders[1]} share the name sat, which names "
                                               "their exports: export them one at a time, each with its own --out")


#: each importer's command line in full: the authors' files it reads and the folder it writes
IMPORTS = {"aoanet": ["--weights", "w.pth", "--infos", "i.pkl", "--out", "o"],
           "xlan": ["--checkpoint", "c.pth", "--vocab", "v.txt", "--out", "o"],
           "xtransformer": ["--checkpoint", "c.pth", "--vocab", "v.txt", "--out", "o"]}


@pytest.mark.parametrize("kind, flag", [(kind, flag) for kind, argv in IMPORTS.items() for flag in argv[::2]])
def test_an_import_without_a_file_it_reads_or_writes_is_a_usage_error_naming_the_flag(kind, flag, capsys):
    """Not a traceback from the converter opening ``None``."""
    argv = IMPORTS[kind]
    at = argv.index(flag)
    with pytest.raises(SystemExit) as refused:
        build_parser().parse_args(["import", kind, *argv[:at], *argv[at + 2:]])
    assert refused.value.code == 2 and f"the following arguments are required: {flag}" in capsys.readouterr().err


def test_an_import_without_the_authors_kind_is_a_usage_error_naming_it(capsys):
    """``captioner import`` alone (the user has yet to learn the kinds): argparse's usage error asking for KIND, not
    an AttributeError traceback from a command that no kind chose."""
    assert "the following arguments are required: KIND" in cli_error(capsys, "import")


def test_models_lists_one_name_a_line_and_a_models_options_with_the_required_ones_said(monkeypatch, capsys):
    main(["models"])
    assert capsys.readouterr().out.splitlines() == zoo.available()
    monkeypatch.setattr(zoo, "options", lambda name: {"vocab_size": zoo.REQUIRED, "depth": zoo.REQUIRED, "width": 8,
                                                      "norm": "layer", "bias": None})
    main(["models", "anything"])
    assert capsys.readouterr().out.splitlines() == [
        "depth  (required)", "width=8", 'norm="layer"', "bias=null",
        f"# from the data set and the encoder, not --set: {', '.join(zoo.PROTOCOL_ARGUMENTS)}"]


def test_train_takes_attention_as_a_model_option_given_so_a_resume_changes_it():
    args = build_parser().parse_args(["train", "--out", "x", "--attention", "tvmax", "--lr", "0.1"])
    assert training_cli.given_options(args) == {"out", "lr", "model_args"}  # no --set: --attention alone counts
    args = build_parser().parse_args(["train", "--out", "x", "--attention", "tvmax", "--set", "depth=2"])
    assert training_cli.train_config_from_args(args).model_args == {"depth": 2, "attention": "tvmax"}


def test_train_reads_an_earlier_precision_name_as_todays_and_refuses_an_unknown_one_as_a_usage_error(capsys):
    # README: "fp32, bf16, fp16 still read"; the choices list today's names only, so the name is read before them
    args = build_parser().parse_args(["train", "--out", "x", "--precision", "bf16"])
    assert training_cli.train_config_from_args(args).precision == "bfloat16"
    assert "argument --precision: invalid choice: 'fp8'" in cli_error(capsys, "train", "--out", "x", "--precision",
                                                                      "fp8")


def test_train_collects_each_repeated_lr_drop_into_the_schedules_list():
    """``--lr-drop`` is repeatable (its help says so), each a milestone of the schedule; taken as one value, the last
    flag given replaced the others, and a lone drop was a number, not the list the schedule and the card read."""
    args = build_parser().parse_args(["train", "--out", "x", "--lr-drop", "5", "--lr-drop", "7"])
    assert training_cli.train_config_from_args(args).lr_drops == [5, 7]
    args = build_parser().parse_args(["train", "--out", "x", "--lr-drop", "3"])
    assert training_cli.train_config_from_args(args).lr_drops == [3]


def test_each_switch_of_train_takes_no_value_and_turns_its_default_around():
    # `--extend-vocab` and the other switches are kind "true" or "false": without the kind each would ask for a value
    switches = [f for f in dataclasses.fields(training_module.TrainConfig) if isinstance(f.default, bool)]
    assert len(switches) >= 4
    for field in switches:
        flag = field.metadata.get("flag") or "--" + field.name.replace("_", "-")
        args = build_parser().parse_args(["train", "--out", "x", flag])
        assert getattr(training_cli.train_config_from_args(args), field.name) is (not field.default), flag


def test_trains_help_states_each_options_default_the_training_config_has_its_factorys_included():
    """Each flag's help says the TrainConfig default it leaves standing (a field made by a factory, such as
    ``adam_betas``, included); a switch's help says none."""
    (train,) = [action.choices["train"] for action in build_parser()._actions
                if isinstance(action, argparse._SubParsersAction)]
    helps = {action.dest: action.help for action in train._actions}
    assert helps["epochs"].endswith("(default: 20)") and helps["adam_betas"].endswith("(default: [0.9, 0.999])")
    for field in dataclasses.fields(training_module.TrainConfig):
        if field.name in helps and field.metadata.get("kind") in ("false", "true"):
            # a switch takes no value: "(default: False)" in --extend-vocab's help reads as if it took one
            assert "(default:" not in helps[field.name], field.name
        elif field.name in helps:
            default = field.default_factory() if field.default is dataclasses.MISSING else field.default
            stated = f"(default: {default})"
            assert helps[field.name].endswith(stated) == (default not in (None, [], {})), (field.name, stated)


def test_train_stops_at_a_recipe_it_cannot_read_rather_than_training_without_it():
    """A misspelt ``--recipe`` is a one-line error: passed over, the run trained the config defaults, hours of a
    schedule no paper used, under the recipe's name."""
    args = build_parser().parse_args(["train", "--recipe", "nope", "--out", "x"])
    with pytest.raises(SystemExit, match="^error: unknown recipe 'nope'; choose from "):
        training_cli.train_config_from_args(args)


def test_a_model_option_set_on_the_command_line_wins_over_the_recipes():
    args = build_parser().parse_args(["train", "--recipe", "sat", "--out", "x", "--set", "dropout=0.1"])
    assert training_cli.train_config_from_args(args).model_args == {"doubly_stochastic": 1.0, "dropout": 0.1}


def test_an_interrupted_run_exits_130_a_diverged_one_errs_and_moved_data_is_hinted_only_when_not_given(monkeypatch,
                                                                                                   capsys):
    monkeypatch.setattr(training_cli.signal, "signal", lambda signum, handler: None)  # pytest's SIGTERM stays

    def interrupted(cfg, resume, explicit):
        raise training_module.TrainingInterrupted("stopped after step 3: --resume continues it")
    monkeypatch.setattr(training_module, "train", interrupted)
    with pytest.raises(SystemExit) as stopped:
        main(["train", "--out", "x"])
    assert stopped.value.code == 130 and "stopped after step 3" in capsys.readouterr().err

    def diverged(cfg, resume, explicit):
        raise training_module.TrainingDiverged("the loss became nan at epoch 2, step 5")
    monkeypatch.setattr(training_module, "train", diverged)
    with pytest.raises(SystemExit) as stopped:  # said as an error, without a traceback
        main(["train", "--out", "x"])
    assert stopped.value.code == 2 and str(stopped.value) == "error: the loss became nan at epoch 2, step 5"

    def data_gone(cfg, resume, explicit):
        raise FileNotFoundError("photos/1.png")
    monkeypatch.setattr(training_module, "train", data_gone)
    # a resume that named the photos' new folder did what the hint asks: it would send the user in a circle
    for given, hinted in (([], True), (["--dataset", "d.json"], False), (["--image-root", "photos"], False)):
        with pytest.raises(SystemExit):
            main(["train", "--out", "x", "--resume", *given])
        said = capsys.readouterr().err
        assert "photos/1.png" in said and ("the run's data moved?" in said) is hinted, given


def test_under_torchrun_only_the_main_process_reports_the_runs_outcome(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(training_cli.signal, "signal", lambda signum, handler: None)  # pytest's SIGTERM stays
    monkeypatch.setattr(training_module, "train", lambda cfg, resume, explicit: tmp_path / "run" / "best")
    for rank in ("1", "0"):
        monkeypatch.setenv("RANK", rank)  # torchrun's, read where no process group is up
        main(["train", "--out", str(tmp_path / "run")])
        said = capsys.readouterr().out
        assert said.startswith("no checkpoint yet: the run stopped") if rank == "0" else said == "", (rank, said)


def _two_members(folder: Path, metas: tuple[dict, dict] = ({}, {})) -> list[Path]:
    """Two tiny SAT checkpoints of different seeds, ``a`` and ``b`` in ``folder``, each saved with its meta."""
    return [save_checkpoint(folder / name, tiny_model("sat", seed=seed), VOCAB, TINY_SPEC, meta)
            for seed, (name, meta) in enumerate(zip(("a", "b"), metas))]


def test_a_run_meets_its_other_ranks_before_leaving_their_group_only_if_it_ended_well(tmp_path, monkeypatch, capsys):
    """Under torchrun a finished run meets its other ranks at a barrier, so none tears its connections down while
    another is still inside a collective; a failed one must not wait there, since a rank may be gone and the barrier
    would never open (the run would hang rather than exit with its error)."""
    monkeypatch.setattr(training_cli.signal, "signal", lambda signum, handler: None)  # pytest's SIGTERM stays
    met = []
    monkeypatch.setattr(distributed_module, "shutdown_distributed", lambda meet_first: met.append(meet_first))
    monkeypatch.setattr(training_module, "train", lambda cfg, resume, explicit: tmp_path / "run" / "best")
    main(["train", "--out", str(tmp_path / "run")])

    def diverged(cfg, resume, explicit):
        raise training_module.TrainingDiverged("the loss became nan at epoch 2, step 5")
    monkeypatch.setattr(training_module, "train", diverged)
    with pytest.raises(SystemExit):
        main(["train", "--out", str(tmp_path / "run")])
    assert met == [True, False]


def test_an_ensemble_records_the_data_and_visual_items_its_first_member_was_trained_on(tmp_path, capsys):
    trained = {"dataset": "d.json", "image_root": "photos", "features": "regions:boxes", "lr": 0.1}
    members = _two_members(tmp_path, ({"train_config": trained},) * 2)
    main(["ensemble", str(tmp_path / "both"), *map(str, members)])
    assert load_checkpoint(tmp_path / "both").meta["train_config"] == {
        "dataset": "d.json", "image_root": "photos", "features": "regions:boxes"}


def test_an_ensemble_records_what_each_member_cost_to_train_with_the_runs_it_started_from(tmp_path, capsys):
    """Its card's members table reads it: each member's training time, its warm start's runs counted, or none."""
    members = _two_members(tmp_path, ({"train_seconds": 60.0, "started_from": {"train_seconds": 120.0}}, {}))
    main(["ensemble", str(tmp_path / "both"), *map(str, members)])
    recorded = load_checkpoint(tmp_path / "both").meta["ensemble_of"]
    assert [member["train_seconds"] for member in recorded] == [180.0, None]
    rows = [line.split(" | ") for line in card_module.write_card(tmp_path / "both", {}).read_text().splitlines()
            if line.startswith("| `")]
    assert [row[3] for row in rows] == ["3.0 min", "not recorded"]  # the members table's training time column


def test_an_ensemble_is_stored_in_either_dtype_storage_names_the_default_spelt_out_included(tmp_path, capsys):
    """``--storage float32``, the default written out (as a script that names each option does), must be taken as
    float16 is: a choice list that lost it refused it with a usage error while the default still parsed."""
    members = _two_members(tmp_path)
    for storage in ("float32", "float16"):
        main(["ensemble", str(tmp_path / storage), *map(str, members), "--storage", storage])
        assert load_checkpoint(tmp_path / storage).storage == storage


def test_an_ensembles_member_selection_scores_on_the_threads_asked_for(tmp_path, monkeypatch, capsys):
    members = _two_members(tmp_path)
    threads = []
    monkeypatch.setattr(device_module, "set_threads", threads.append)
    monkeypatch.setattr(datasets_module, "resolve_dataset", lambda dataset: dataset)
    monkeypatch.setattr(training_cli, "split_with_features", lambda *args: ([], None))
    monkeypatch.setattr(ensemble_module, "select_members", lambda candidates, *args, **options: candidates)
    main(["ensemble", str(tmp_path / "both"), *map(str, members), "--select-on", "val", "--threads", "3"])
    assert threads == [3]


def test_an_ensembles_member_selection_scores_the_images_asked_for_and_records_their_data_set(tmp_path, monkeypatch,
                                                                                                capsys):
    """``--limit N`` bounds the selection's captioning to the split's first N images (a whole COCO val split is hours
    of beam search), and the ensemble records the data set its members were chosen on (its split alone says little:
    every data set has a val split)."""
    members = _two_members(tmp_path)
    read = []
    monkeypatch.setattr(datasets_module, "resolve_dataset", lambda dataset: dataset)
    monkeypatch.setattr(training_cli, "split_with_features", lambda first, *args: read.append(args) or ([], None))
    monkeypatch.setattr(ensemble_module, "select_members", lambda candidates, *args, **options: candidates)
    main(["ensemble", str(tmp_path / "both"), *map(str, members), "--select-on", "val", "--dataset", "d.json",
          "--image-root", "photos", "--limit", "5", "--cache-dir", "c"])
    assert read == [("d.json", "photos", "val", 5, "c")]
    assert load_checkpoint(tmp_path / "both").meta["members_chosen_on"]["dataset"] == "d.json"


def test_an_ensemble_of_runs_named_alike_names_each_member_and_data_set_once(tmp_path, capsys):
    """Members are often one recipe's run under several seeds (``seed1/sat/best``, ``seed2/sat/best``, both named
    ``sat``): their ensemble is trained on "an ensemble of sat (that data set)", as ``GET /models`` and its card say,
    not the same words once a member."""
    meta = {"trained_on": "Flickr8k, train split"}
    members = [save_checkpoint(tmp_path / f"seed{seed}" / "sat" / "best", tiny_model("sat", seed=seed), VOCAB,
                               TINY_SPEC, meta) for seed in (1, 2)]
    main(["ensemble", str(tmp_path / "both"), *map(str, members)])
    assert load_checkpoint(tmp_path / "both").meta["trained_on"] == "an ensemble of sat (Flickr8k, train split)"


def test_an_ensemble_selection_from_a_single_checkpoint_is_refused_in_one_line(tmp_path, monkeypatch):
    """``--select-on`` given one checkpoint (a glob that matched one folder) has no candidate to add: the scorer is
    built on that start, and the command says no ensemble was written, where one built on a second member stopped
    with an IndexError's traceback."""
    member, _ = _two_members(tmp_path)
    monkeypatch.setattr(datasets_module, "resolve_dataset", lambda dataset: dataset)
    monkeypatch.setattr(training_cli, "split_with_features", lambda *args: ([], None))
    monkeypatch.setattr(ensemble_module, "select_members", lambda candidates, *args, **options: candidates)
    with pytest.raises(SystemExit, match="no candidate raised a's val CIDEr-D by --min-gain 0.005; no ensemble"):
        main(["ensemble", str(tmp_path / "one"), str(member), "--select-on", "val"])
    assert not (tmp_path / "one").exists()
