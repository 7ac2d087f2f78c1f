"""The ``captioner`` console script, run as a user would."""

import argparse
import json
import logging
import re
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from PIL import Image
from skimage import data

from captioner.models import checkpoint as checkpoint_module
from captioner.models import device as device_module
from captioner.models.checkpoint import convert_storage, load_checkpoint, recorded_checksum, save_checkpoint
from captioner.models.cli.common import checkpoint_labels
from captioner.models.data import datasets
from captioner.models.data import features as features_module
from captioner.models.data import stores as stores_module
from captioner.models.data.karpathy import load_karpathy
from captioner.models.data.scenes import GENERATOR_VERSION, generate, is_current, object_naming_accuracy, \
    read_dataset_header
from captioner.models.encoder import EncoderSpec
from captioner.models.evaluation import evaluate as evaluate_module
from captioner.models.evaluation import grounding as grounding_module
from captioner.models.evaluation import metrics
from captioner.models.evaluation import phrase_grounding as phrase_grounding_module
from captioner.models.evaluation.card import check_report_scores, load_report, merge_reports, total_train_seconds, \
    write_card
from captioner.models.evaluation.metrics import score_captions
from captioner.models.evaluation.report import WORDS_TOKENIZER, evaluated_dataset, evaluation_report, \
    grounding_benchmark
from captioner.models.export import quantize as quantize_module
from captioner.models.export import sessions as sessions_module
from captioner.models.export.quantize import int8_recipe
from captioner.models.pipeline import Pipeline
from captioner.models.rendering.heatmaps import overlay
from captioner.models.vocab import Vocabulary
from captioner.models.zoo import create
from captioner.service import app as service_app
from captioner.service import cli, lifecycle, middleware
from captioner.service.cli import build_parser, main, read_settings
from captioner.service.middleware import JsonFormatter, TextFormatter, configure_logging

from .conftest import DEFAULT_CHECKPOINT, DEMO_SAMPLES, ROOT, WEIGHTS, free_port
from .serving_helpers import TINY_SPEC, VOCAB, tiny_model


def command_parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """Every subcommand below ``parser``, depth first, as (its words, the help line its parent lists it with, its
    parser)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            listed = {choice.dest: choice.help for choice in action._choices_actions}
            for name, child in action.choices.items():
                yield (*path, name), listed.get(name), child
                yield from command_parsers(child, (*path, name))


def captioner(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "captioner.service.cli", *args],
                          cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    if check:
        assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_caption_with_overlay_figure_and_single_token(tmp_path):
    """The console script once; the same command's other forms in-process (``main``), sparing two starts."""
    photo = tmp_path / "cat.jpg"
    Image.fromarray(data.chelsea()).save(photo)
    done = captioner("caption", str(photo), "--checkpoint", str(DEFAULT_CHECKPOINT),
                     "--overlay", str(tmp_path / "fig.png"),
                     "--json")
    result = json.loads(done.stdout.splitlines()[0])
    assert result["caption"] and len(result["attention"]) == len(result["tokens"])
    # --json prints the record an archive's --output --attention writes: one format to parse
    main(["caption", str(photo), "--checkpoint", str(DEFAULT_CHECKPOINT), "--output", str(tmp_path / "o.jsonl"),
          "--attention", "--threads", "1"])
    (archived,) = [json.loads(line) for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert list(result) == list(archived) and result["path"] == archived["path"] == str(photo)
    assert result["tokens"] == archived["tokens"] and result["model"] == archived["model"]
    assert Image.open(tmp_path / "fig.png").width > 500
    main(["caption", str(photo), "--checkpoint", str(DEFAULT_CHECKPOINT), "--overlay", str(tmp_path / "w.png"),
          "--token", "0", "--mode", "grid_blocks", "--threads", "1"])
    assert Image.open(tmp_path / "w.png").size == (451, 300)


def test_compared_checkpoints_of_one_name_are_told_apart_in_json_lines(tmp_path, capsys):
    # the label that tells weights/sat from weights/flickr8k/sat was printed in text mode and dropped from --json,
    # whose two lines then both said "model": "sat"
    photo = tmp_path / "cat.jpg"
    Image.fromarray(data.chelsea()).save(photo)
    compared = [str(WEIGHTS / "sat"), str(WEIGHTS / "flickr8k" / "sat")]
    main(["caption", str(photo), "--json", "--threads", "1", *(f"--checkpoint={c}" for c in compared)])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["label"] for line in lines] == compared and {line["model"] for line in lines} == {"sat"}
    main(["caption", str(photo), "--json", "--threads", "1", f"--checkpoint={compared[0]}"])
    assert "label" not in json.loads(capsys.readouterr().out)


def test_caption_errors_are_clear(tmp_path):
    (tmp_path / "bad.jpg").write_bytes(b"nope")
    done = captioner("caption", str(tmp_path / "bad.jpg"), "--checkpoint", str(DEFAULT_CHECKPOINT), check=False)
    assert done.returncode != 0 and "cannot identify" in done.stderr and "Traceback" not in done.stderr


def test_models_and_data_generate(tmp_path):
    assert "sat" in captioner("models").stdout.split()
    captioner("data", "generate", "--out", str(tmp_path), "--train", "3", "--val", "1", "--test", "1", "--heldout", "1")
    assert len(json.loads((tmp_path / "dataset_scenes.json").read_text())["images"]) == 6


def test_eval_reports_all_metrics(tmp_path, scenes):
    out = tmp_path / "report.json"
    done = captioner("eval", str(DEFAULT_CHECKPOINT), "--dataset", str(scenes), "--split", "test", "--cache-dir",
                     str(tmp_path / "cache"), "--output", str(out), "--results-json", str(tmp_path / "results.json"),
                     "--no-progress")
    assert "it/s" not in done.stderr  # no bars in a log (train had --no-progress, eval had no way to say it)
    # which weights were scored, wherever the checkpoint is copied (captioner card checks it)
    assert json.loads(out.read_text())["weights_sha256"] == recorded_checksum(DEFAULT_CHECKPOINT)
    report = json.loads(out.read_text())["test"]
    results = json.loads((tmp_path / "results.json").read_text())  # the COCO results format
    test_ids = {im["imgid"] for im in json.loads(scenes.read_text())["images"] if im["split"] == "test"}
    assert {r["image_id"] for r in results} == test_ids and all(set(r) == {"image_id", "caption"} for r in results)
    assert all(isinstance(r["caption"], str) and r["caption"] for r in results)
    for metric in ("BLEU-1", "BLEU-4", "METEOR", "ROUGE-L", "CIDEr-D", "objects_named"):
        assert metric in report
    assert report["SPICE"].startswith("unavailable")
    # the scores are those of the captions it wrote, against the test split's references (not only present)
    test = {im.image_id: im for im in load_karpathy(scenes, splits=("test",))}
    captions = {r["image_id"]: r["caption"] for r in results}
    again = score_captions(captions, {i: [" ".join(ref) for ref in im.references] for i, im in test.items()},
                           ("BLEU", "ROUGE-L", "CIDEr-D"))
    for metric, value in again.items():
        assert report[metric] == pytest.approx(value, abs=1e-4), metric
    named = object_naming_accuracy([(captions[i].split(), im.info["objects"]) for i, im in test.items()])
    assert report["objects_named"] == pytest.approx(named, abs=1e-4)


def test_eval_writes_the_report_the_library_call_returns(tmp_path, scenes, one_thread):
    """``captioner eval`` is flags and printing around ``evaluation_report``: a Python user who calls it gets the
    report (and the COCO results) the command writes, byte for byte.  The scenes are given COCO ids, as a COCO
    Karpathy JSON holds them: the results are keyed by those, not by the data set's own ids."""
    dataset = json.loads(scenes.read_text())
    for entry in dataset["images"]:
        entry["cocoid"] = 1000 + entry["imgid"]
    coco = tmp_path / "dataset_coco.json"
    coco.write_text(json.dumps(dataset))
    out, results = tmp_path / "report.json", tmp_path / "results.json"
    captioner("eval", str(DEFAULT_CHECKPOINT), "--dataset", str(coco), "--image-root", str(scenes.parent), "--split",
              "val", "--split", "test", "--limit", "3", "--no-meteor", "--misses", "2", "--block-trigrams",
              "--threads", "1", "--cache-dir", str(tmp_path / "cache"), "--output", str(out), "--results-json",
              str(results))
    evaluation = evaluation_report(str(DEFAULT_CHECKPOINT), coco, ["val", "test"], image_root=scenes.parent, limit=3,
                                   meteor=False, misses=2, block_trigrams=True, cache_dir=tmp_path / "cache",
                                   progress=False)
    assert out.read_text() == json.dumps(evaluation.report, indent=2) + "\n"
    assert results.read_text() == json.dumps(evaluation.coco_results) + "\n"
    scored = [image for split in ("val", "test") for image in evaluation.images[split]]
    assert [result["image_id"] for result in evaluation.coco_results] == [1000 + im.image_id for im in scored]
    assert [len(evaluation.captions[split]) for split in ("val", "test")] == [3, 3]
    assert evaluation.report["test"]["BLEU-1 misses"]["caption_words"] == sum(
        len(words) for words in evaluation.captions["test"].values())
    # what a card and the zoo tables read to say which checkpoint, data set and decoding a report scored
    assert {key: evaluation.report[key] for key in ("checkpoint", "weights_sha256", "dataset", "beam_size",
                                                    "tokenizer", "encoder_precision")} == {
        "checkpoint": str(DEFAULT_CHECKPOINT), "weights_sha256": recorded_checksum(DEFAULT_CHECKPOINT),
        "dataset": str(coco), "beam_size": 3, "tokenizer": WORDS_TOKENIZER, "encoder_precision": "float32"}


def test_eval_grounding_takes_scenes_or_an_entities_folder_with_both_its_parts(tmp_path):
    assert grounding_benchmark(None) == (None, None) and grounding_benchmark("scenes") == ("scenes", None)
    entities, boxes_alone = tmp_path / "entities", tmp_path / "boxes-alone"
    (entities / "Sentences").mkdir(parents=True)
    (boxes_alone / "Annotations").mkdir(parents=True)
    for folder in (entities, boxes_alone):  # no Annotations/, then no Sentences/
        with pytest.raises(ValueError, match="is not a Flickr30k Entities folder"):
            grounding_benchmark(f"entities:{folder}")
    (entities / "Annotations").mkdir()
    assert grounding_benchmark(f"entities:{entities}") == ("entities", entities)
    for value in ("entities:", f"boxes:{entities}"):
        with pytest.raises(ValueError, match="takes no value"):
            grounding_benchmark(value)


def test_eval_scores_the_data_set_given_else_an_entities_checkpoints_own_else_the_scenes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where the default scene set was never generated
    trained = tmp_path / "trained.json"
    training = {"dataset": str(trained), "image_root": "its photos"}
    assert evaluated_dataset("ckpt", training, "given.json", "root", True) == ("given.json", "root")
    with pytest.raises(FileNotFoundError, match=r"trained on, .*trained\.json .* is not here"):
        evaluated_dataset("ckpt", training, None, None, True)
    trained.write_text("{}")
    assert evaluated_dataset("ckpt", training, None, None, True) == (str(trained), "its photos")
    assert evaluated_dataset("ckpt", training, None, "mine", True) == (str(trained), "mine")
    # not for Entities: the scenes, and where they are missing, the data set to give
    with pytest.raises(FileNotFoundError, match=r"default \.cache/scenes does not exist \(ckpt was trained on "):
        evaluated_dataset("ckpt", training, None, None, False)
    assert evaluated_dataset("ckpt", {}, None, "mine", False) == (datasets.DEFAULT_DATASET, "mine")
    # an Entities grounding of a checkpoint that recorded no data set: the scenes too
    assert evaluated_dataset("ckpt", {}, None, "mine", True) == (datasets.DEFAULT_DATASET, "mine")
    (tmp_path / datasets.DEFAULT_DATASET).mkdir(parents=True)
    assert evaluated_dataset("ckpt", training, None, None, False) == (datasets.DEFAULT_DATASET, None)


def test_eval_refuses_ptb_scoring_without_java_before_loading_the_checkpoint(monkeypatch):
    def no_java():
        raise ValueError("no Java here")

    monkeypatch.setattr(metrics, "check_ptb_tokenizer", no_java)
    with pytest.raises(ValueError, match="no Java here"):
        evaluation_report(ROOT / "no such checkpoint", ptb=True)


def test_eval_hands_its_options_to_its_parts_and_reports_the_words_bleu1_most_often_leaves_uncredited(tmp_path,
                                                                                                     monkeypatch):
    """``evaluation_report`` with its parts stubbed: the split read with its limit and image root, the features the
    checkpoint was trained on, the training captions of the data set scored; ``misses`` N: the N caption words BLEU-1
    most often leaves uncredited, each image's counted against its own references."""
    dataset = tmp_path / "dataset_x.json"
    dataset.write_text("{}")
    images = [SimpleNamespace(image_id=1, references=[["a", "red", "circle"]], info={}),
              SimpleNamespace(image_id=2, references=[["a", "blue", "square"], ["a", "star"]], info={})]
    calls = {}
    monkeypatch.setattr(checkpoint_module, "load_checkpoint", lambda path, device: SimpleNamespace(
        meta={}, checksum="sum", trained_features="regions:r", encoder="its encoder"))
    monkeypatch.setattr(datasets, "train_split_captions", lambda path, root: calls.setdefault("training", (path, root)))
    monkeypatch.setattr(datasets, "load_split", lambda path, root, split, limit=None:
                        calls.setdefault("split", (path, root, split, limit)) and images)
    monkeypatch.setattr(stores_module, "open_feature_store", lambda features, imgs, encoder, cache_dir, **options:
                        calls.setdefault("store", (features, encoder, cache_dir)))
    captions = {1: ["a", "red", "square", "square"], 2: ["a", "blue", "square", "star"]}
    # the beam's width and the caption's most words, when not given: captioner eval's defaults
    monkeypatch.setattr(evaluate_module, "evaluate_checkpoint", lambda ckpt, images, store, beam_size, max_len, *args,
                        **options: calls.setdefault("decode", (beam_size, max_len)) and ({}, captions))
    evaluation = evaluation_report("ckpt", dataset, ["test"], image_root=tmp_path, limit=2, misses=1, cache_dir="c",
                                   device="cpu", progress=False)
    assert calls == {"training": (dataset, tmp_path), "split": (dataset, tmp_path, "test", 2),
                     "store": ("regions:r", "its encoder", "c"), "decode": (3, 20)}
    # "square" twice beyond image 1's references; image 2's credit both "square" and "star", each by one of them
    assert evaluation.report["test"]["BLEU-1 misses"] == {"caption_words": 8, "uncredited": 2,
                                                         "most_uncredited": {"square": 2}}
    assert evaluation.report["encoder_precision"] == "float32" and evaluation.report["dataset"] == str(dataset)
    # the words' tokenizer named as the shipped reports name it
    shipped = json.loads((ROOT / "docs" / "results" / "flickr8k" / "sat.json").read_text())
    assert evaluation.report["tokenizer"] == shipped["tokenizer"]
    assert evaluation.coco_results == [{"image_id": 1, "caption": "a red square square"},
                                       {"image_id": 2, "caption": "a blue square star"}]


def test_eval_reports_only_the_n_words_bleu1_leaves_uncredited_most_often_and_counts_them_all(tmp_path, monkeypatch):
    """``--misses N`` lists the N words BLEU-1 most often leaves uncredited, the most frequent first, and no more; the
    total counts every uncredited word, listed or not."""
    dataset = tmp_path / "dataset_x.json"
    dataset.write_text("{}")
    stub_a_checkpoint_and_one_test_image(monkeypatch)
    monkeypatch.setattr(datasets, "load_split", lambda *args, **options: [
        SimpleNamespace(image_id=1, references=[["a", "red", "circle"]], info={})])
    monkeypatch.setattr(stores_module, "open_feature_store", lambda *args, **options: "store")
    # "square" twice beyond the references, "star" once
    monkeypatch.setattr(evaluate_module, "evaluate_checkpoint", lambda *args, **options: (
        {}, {1: ["a", "red", "square", "square", "star"]}))
    evaluation = evaluation_report("ckpt", dataset, misses=1, device="cpu", progress=False)
    assert evaluation.report["test"]["BLEU-1 misses"] == {"caption_words": 5, "uncredited": 3,
                                                         "most_uncredited": {"square": 2}}


def test_eval_without_a_dataset_scores_and_names_the_default_scenes_even_with_a_scenes_grounding(tmp_path,
                                                                                                 monkeypatch):
    """``captioner eval CKPT`` (and ``--grounding`` of the scenes' masks) without ``--dataset`` scores the generated
    scenes' file, takes the novel-caption share from their train split and names that file in the report (what a
    card cites), whatever data set the checkpoint was trained on: only an Entities grounding turns to that one."""
    monkeypatch.chdir(tmp_path)
    scenes = tmp_path / datasets.DEFAULT_DATASET
    scenes.mkdir(parents=True)
    (scenes / datasets.SCENES_FILE).write_text("{}")
    resolved = Path(datasets.DEFAULT_DATASET) / datasets.SCENES_FILE
    calls = {}
    stub_a_checkpoint_and_one_test_image(monkeypatch)
    monkeypatch.setattr(checkpoint_module, "load_checkpoint", lambda path, device: SimpleNamespace(
        meta={"train_config": {"dataset": "elsewhere/dataset_flickr8k.json"}}, checksum="sum",
        trained_features="grid", encoder="e"))
    monkeypatch.setattr(datasets, "train_split_captions", lambda path, root: calls.setdefault("training", path))
    monkeypatch.setattr(stores_module, "open_feature_store", lambda *args, **options: "store")
    monkeypatch.setattr(evaluate_module, "evaluate_checkpoint", lambda *args, **options: ({}, {1: ["a"]}))
    monkeypatch.setattr(grounding_module, "caption_with_attention", lambda *args, **options: [
        SimpleNamespace(tokens=["a"])])
    monkeypatch.setattr(evaluate_module, "score_dataset", lambda *args: {})
    monkeypatch.setattr(grounding_module, "grounding_report", lambda ckpt, images, results, folder, resamples:
                        calls.setdefault("masks", folder) and {})
    for grounding in (None, "scenes"):
        calls.clear()
        evaluation = evaluation_report("ckpt", meteor=False, grounding=grounding, device="cpu", progress=False)
        assert evaluation.report["dataset"] == str(resolved) and calls["training"] == resolved
    assert calls["masks"] == resolved.parent


def stub_a_checkpoint_and_one_test_image(monkeypatch) -> None:
    """``evaluation_report``'s checkpoint (trained on grid features) and data set (one test image) stubbed, for the
    tests of what it hands on to its work."""
    monkeypatch.setattr(checkpoint_module, "load_checkpoint", lambda path, device: SimpleNamespace(
        meta={}, checksum="sum", trained_features="grid", encoder="its encoder"))
    monkeypatch.setattr(datasets, "train_split_captions", lambda path, root: None)
    monkeypatch.setattr(datasets, "load_split", lambda *args, **options: [
        SimpleNamespace(image_id=1, references=[["a"]], info={})])


@pytest.mark.parametrize("kernels, suffix", [("u8s8", ""), ("u8u8", "-u8u8")])
def test_eval_of_the_int8_cnn_runs_its_graph_from_the_folder_given_and_caches_apart_from_the_float_features(
        tmp_path, monkeypatch, kernels, suffix):
    """The int8 CNN's weights' type follows the CPU (``quantize.int8_kernels``: u8u8 without VNNI), and its features'
    cache is named by it as its graph is: a cache folder shared by machines of both kinds never hands one kind the
    features the other's graph computed (whichever kind of CPU runs this test)."""
    dataset = tmp_path / "dataset_x.json"
    dataset.write_text("{}")
    calls = {}
    stub_a_checkpoint_and_one_test_image(monkeypatch)
    monkeypatch.setattr(quantize_module, "int8_kernels", lambda: kernels)
    monkeypatch.setattr(quantize_module, "visual_encoder_file", lambda encoder, out_dir, precision:
                        calls.setdefault("graph", (encoder, out_dir, precision)) and "graph.onnx")
    monkeypatch.setattr(sessions_module, "VisualSession", lambda path, device, threads:
                        calls.setdefault("session", (path, device, threads)))
    monkeypatch.setattr(features_module, "extract_features", lambda images, spec, cache_dir, **options:
                        calls.setdefault("features", (spec, cache_dir, options)))
    monkeypatch.setattr(evaluate_module, "evaluate_checkpoint", lambda *args, **options: ({}, {1: ["a"]}))
    evaluation = evaluation_report("ckpt", dataset, encoder_precision="int8", onnx_dir="o", threads=2, cache_dir="c",
                                   device="cpu", progress=False)
    session = ("graph.onnx", "cpu", 2)
    assert calls == {"graph": ("its encoder", "o", "int8"), "session": session,
                     "features": ("its encoder", Path("c") / f"onnx-int8-{int8_recipe()}",
                                  {"encoder": session})}
    assert calls["features"][1] == Path("c") / f"onnx-int8-{quantize_module.RECIPE}{suffix}"
    assert evaluation.report["encoder_precision"] == "int8"
    with pytest.raises(ValueError, match="^--encoder-precision applies to grid features, not regions:r$"):
        evaluation_report("ckpt", dataset, encoder_precision="int8", features="regions:r", device="cpu", progress=False)


def test_an_entities_grounding_is_scored_with_the_resamples_asked_for(tmp_path, monkeypatch):
    entities, dataset = tmp_path / "entities", tmp_path / "dataset_x.json"
    for part in ("Sentences", "Annotations"):
        (entities / part).mkdir(parents=True)
    dataset.write_text("{}")
    calls = {}
    stub_a_checkpoint_and_one_test_image(monkeypatch)
    monkeypatch.setattr(stores_module, "open_feature_store", lambda *args, **options: "store")
    monkeypatch.setattr(grounding_module, "caption_with_attention", lambda *args, **options: [
        SimpleNamespace(tokens=["a"])])
    monkeypatch.setattr(evaluate_module, "score_dataset", lambda *args: {})
    monkeypatch.setattr(phrase_grounding_module, "entities_grounding", lambda ckpt, images, store, folder, results,
                        **options: calls.setdefault("entities", (store, folder, options)) and {"boxes": 1})
    evaluation = evaluation_report("ckpt", dataset, grounding=f"entities:{entities}", grounding_resamples=7,
                                   device="cpu", progress=False)
    assert calls == {"entities": ("store", entities, {"resamples": 7, "device": "cpu", "progress": False})}
    assert evaluation.report["test"]["grounding"] == {"boxes": 1}


def test_a_grounded_evaluation_scores_its_captions_as_an_ungrounded_one_does(tmp_path, monkeypatch):
    """With ``--grounding`` the captions come from the beam search that also keeps the attention rows; they are
    scored with the same metrics, novel-caption share and tokenizer as without it: a ``--ptb`` report that names
    the PTB tokenizer must not hold scores of the project's own tokens."""
    dataset = tmp_path / "dataset_x.json"
    dataset.write_text("{}")
    scored, captioned = [], [SimpleNamespace(tokens=["a"])]  # (metrics, training captions, ptb) of each split scored

    def evaluate_checkpoint(ckpt, images, store, beam_size, max_len, measures, training_captions, ptb, **options):
        scored.append((measures, training_captions, ptb))
        return {}, {1: ["a"]}

    stub_a_checkpoint_and_one_test_image(monkeypatch)
    monkeypatch.setattr(datasets, "train_split_captions", lambda path, root: [["a", "star"]])
    monkeypatch.setattr(metrics, "check_ptb_tokenizer", lambda: None)  # stood in for: the tokenizer needs Java
    monkeypatch.setattr(stores_module, "open_feature_store", lambda *args, **options: "store")
    monkeypatch.setattr(grounding_module, "caption_with_attention", lambda *args, **options: captioned)
    monkeypatch.setattr(grounding_module, "grounding_report", lambda *args: {})
    monkeypatch.setattr(evaluate_module, "score_dataset", lambda captions, images, *args: scored.append(args) or {})
    monkeypatch.setattr(evaluate_module, "evaluate_checkpoint", evaluate_checkpoint)
    for grounding in (None, "scenes"):
        evaluation_report("ckpt", dataset, meteor=False, ptb=True, grounding=grounding, device="cpu", progress=False)
    asked = ([m for m in metrics.ALL_METRICS if m != "METEOR"], [["a", "star"]], True)
    assert scored == [asked, asked]


def test_eval_runs_each_part_on_the_resolved_device_quietly_where_asked(tmp_path, monkeypatch):
    """The device ``auto`` resolves to reaches the checkpoint, the features, the captioning and a scenes grounding
    (given the data set's folder, where its masks are), and ``progress=False`` silences each part."""
    dataset = tmp_path / "dataset_x.json"
    dataset.write_text("{}")
    calls = {}
    stub_a_checkpoint_and_one_test_image(monkeypatch)
    monkeypatch.setattr(device_module, "resolve_device", lambda device: "cuda:7")
    monkeypatch.setattr(checkpoint_module, "load_checkpoint", lambda path, device: calls.setdefault(
        "checkpoint", device) and SimpleNamespace(meta={}, checksum="sum", trained_features="grid", encoder="e"))
    monkeypatch.setattr(stores_module, "open_feature_store", lambda features, *args, **options: calls.setdefault(
        "store", (features, options)))
    monkeypatch.setattr(evaluate_module, "evaluate_checkpoint", lambda *args, device, progress, **options:
                        calls.setdefault("decode", (args[5], device, progress)) and ({}, {1: ["a"]}))
    # the features asked for, not the ones the checkpoint was trained on; no METEOR where it is not asked for
    evaluation_report("ckpt", dataset, meteor=False, progress=False, features="regions:r")
    assert calls == {"checkpoint": "cuda:7", "store": ("regions:r", {"device": "cuda:7", "progress": False}),
                     "decode": ([m for m in metrics.ALL_METRICS if m != "METEOR"], "cuda:7", False)}
    calls.clear()
    monkeypatch.setattr(grounding_module, "caption_with_attention", lambda *args, device, progress, **options:
                        calls.setdefault("attend", (device, progress)) and [SimpleNamespace(tokens=["a"])])
    monkeypatch.setattr(evaluate_module, "score_dataset", lambda *args: {})
    monkeypatch.setattr(grounding_module, "grounding_report", lambda ckpt, images, results, folder, resamples:
                        calls.setdefault("grounding", (folder, resamples)))
    evaluation_report("ckpt", dataset, meteor=False, progress=False, grounding="scenes", grounding_resamples=7)
    assert calls["attend"] == ("cuda:7", False) and calls["grounding"] == (tmp_path, 7)


def test_eval_shows_a_splits_captions_before_the_next_split_is_captioned(tmp_path, scenes, one_thread, monkeypatch,
                                                                        capsys):
    """``--show`` prints each split's captions as soon as it is scored: on a long split, a user sees the first
    split's captions without waiting for every other split."""
    loaded = datasets.load_split

    def announced(dataset, image_root, split, **options):  # marks on stderr where each split's work begins
        print(f"<loading {split}>", file=sys.stderr)
        return loaded(dataset, image_root, split, **options)

    monkeypatch.setattr(datasets, "load_split", announced)
    main(["eval", str(DEFAULT_CHECKPOINT), "--dataset", str(scenes), "--split", "val", "--split", "test", "--limit",
          "2", "--show", "1", "--no-meteor", "--threads", "1", "--cache-dir", str(tmp_path / "cache")])
    printed = capsys.readouterr()
    report = json.loads(printed.out)
    lines = [line.strip() for line in printed.err.splitlines() if line.startswith(("<", "  "))]
    shown = [line for line in lines if not line.startswith("<")]
    assert len(shown) == 2 and lines == ["<loading val>", shown[0], "<loading test>", shown[1]]
    assert report["val"]["images"] == report["test"]["images"] == 2


def test_eval_reports_diversity_and_follows_decoding_options(tmp_path, scenes):
    out = tmp_path / "report.json"
    captioner("eval", str(DEFAULT_CHECKPOINT), "--dataset", str(scenes.parent), "--split", "test", "--cache-dir",
              str(tmp_path / "cache"), "--output", str(out), "--no-meteor", "--length-penalty", "1.5",
              "--block-trigrams", "--block-doubled-words", "--beam-size", "2")
    report = json.loads(out.read_text())
    assert report["decoding"] == {"length_penalty": 1.5, "block_trigrams": True, "block_doubled_words": True}
    assert report["beam_size"] == 2 and report["tokenizer"] == WORDS_TOKENIZER
    assert report["dataset"] == str(scenes)  # the file read, not the folder given
    for measure in ("REP", "distinct_words", "novel_captions", "mean_length"):
        assert measure in report["test"], measure
    assert 0.0 <= report["test"]["novel_captions"] <= 1.0 and report["test"]["REP"] >= 0.0


def test_tune_decoding_scores_the_grid_and_stores_the_best_as_the_defaults(tmp_path, scenes, capsys):
    ckpt = tmp_path / "sat"
    shutil.copytree(DEFAULT_CHECKPOINT, ckpt)
    rows = tmp_path / "rows.json"
    common = ("--dataset", str(scenes), "--cache-dir", str(tmp_path / "cache"), "--length-penalties", "0", "2",
              "--output", str(rows))
    with pytest.raises(SystemExit, match="--split val"):  # in-process: the console script runs once, below
        main(["tune-decoding", str(ckpt), "--split", "test", "--write", *common])
    assert not rows.exists()
    done = captioner("tune-decoding", str(ckpt), "--split", "val", "--write", *common)
    grid = json.loads(rows.read_text())
    assert [(r["length_penalty"], r["block_trigrams"], r["block_doubled_words"]) for r in grid["rows"]] == [
        (0, False, False), (0, True, False), (2, False, False), (2, True, False)]  # doubled words: off unless asked
    best = max(grid["rows"], key=lambda r: (r["CIDEr-D"], -r["length_penalty"], not r["block_trigrams"]))
    stored = load_checkpoint(ckpt).meta  # rewritten with its manifest: it still loads and verifies
    assert stored["decoding"] == {"length_penalty": best["length_penalty"], "block_trigrams": best["block_trigrams"],
                                  "block_doubled_words": False}
    assert stored["decoding_chosen_on"]["split"] == "val" and "best by CIDEr-D" in done.stdout
    assert stored["decoding_chosen_on"]["score"] == best["CIDEr-D"]
    # doubled-word blocking is an axis of the grid where it is asked for (in-process, on two images, one combination)
    main(["tune-decoding", str(ckpt), "--split", "val", "--limit", "2", "--dataset", str(scenes), "--cache-dir",
          str(tmp_path / "cache"), "--length-penalties", "0", "--block-trigrams", "no", "--block-doubled-words", "yes",
          "--output", str(tmp_path / "doubled.json")])
    (row,) = json.loads((tmp_path / "doubled.json").read_text())["rows"]
    assert (row["length_penalty"], row["block_trigrams"], row["block_doubled_words"]) == (0, False, True)
    printed = capsys.readouterr().out
    assert "| 0 | no | yes |" in printed and "block_trigrams=False, block_doubled_words=True" in printed

    # stored as float16 afterwards: the card sets the val score of what ships beside the one the rules were chosen on
    half = convert_storage(ckpt, "float16", tmp_path / "sat16")
    card = write_card(half, {"beam_size": 3, "decoding": stored["decoding"],
                             "val": {"images": 4, "CIDEr-D": 1.2345}}).read_text()
    assert f"val CIDEr-D 1.2345, against {best['CIDEr-D']:.4f} with the float32 weights" in card
    # and its heading names the rules, doubled words only where they were blocked
    trigrams = "on" if best["block_trigrams"] else "off"
    assert f"(beam 3, length penalty α = {best['length_penalty']:g}, trigram blocking {trigrams})\n" in card


def test_caption_compares_checkpoints_side_by_side_with_area_boxes(tmp_path, capsys):
    area = tmp_path / "area-transformer"
    save_checkpoint(area, tiny_model("area-transformer"), VOCAB, TINY_SPEC)
    photo = tmp_path / "coffee.png"
    Image.fromarray(data.coffee()).save(photo)
    single = tmp_path / "single.png"
    main(["caption", str(photo), "--checkpoint", str(area), "--overlay", str(single), "--mode", "area_topk"])
    both = tmp_path / "both.png"
    capsys.readouterr()
    main(["caption", str(photo), "--checkpoint", str(DEFAULT_CHECKPOINT), "--checkpoint", str(area),
          "--overlay", str(both)])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and "[sat]" in lines[0] and "[area-transformer]" in lines[1]
    assert Image.open(both).height == 2 * 240  # one row per checkpoint, 2.4 in at 100 dpi each
    with pytest.raises(SystemExit) as refused:
        main(["caption", str(photo), "--checkpoint", str(area), "--checkpoint", str(area), "--token", "0",
              "--overlay", str(both)])
    assert refused.value.code != 0 and "--token" in capsys.readouterr().err


def test_caption_draws_a_sparse_models_attention_in_its_own_mode_by_default(tmp_path):
    """Without --mode the figure is drawn as the service draws it: a sparse model's attention in grid_blocks,
    whose exact zeros grid_smooth would blur away (it was drawn by the geometry alone, in grid_smooth)."""
    sparse = tmp_path / "sparsecap"
    save_checkpoint(sparse, tiny_model("sparsecap", attention="sparsemax"), VOCAB, TINY_SPEC)
    photo = tmp_path / "coffee.png"
    Image.fromarray(data.coffee()).save(photo)

    def drawn(*mode: str) -> bytes:  # in this process: the console script itself is run by the tests above
        out = tmp_path / f"{'-'.join(mode) or 'default'}.png"
        main(["caption", str(photo), "--checkpoint", str(sparse), "--overlay", str(out), "--token", "0", *mode])
        return Image.open(out).tobytes()

    default = drawn()
    assert default == drawn("--mode", "grid_blocks") and default != drawn("--mode", "grid_smooth")


def test_caption_draws_area_topk_from_the_areas_weights(tmp_path):
    """area_topk's boxes are the top areas of the ``areas`` extra, as the service draws them (the command drew the
    top cells' attention against the first area boxes, the single cells)."""
    area = tmp_path / "area-transformer"
    save_checkpoint(area, tiny_model("area-transformer"), VOCAB, TINY_SPEC)
    photo = tmp_path / "coffee.png"
    Image.fromarray(data.coffee()).save(photo)
    drawn = tmp_path / "areas.png"
    captioner("caption", str(photo), "--checkpoint", str(area), "--overlay", str(drawn), "--token", "1", "--mode",
              "area_topk", "--beam-size", "3")
    image = Image.open(photo).convert("RGB")
    (result,) = Pipeline(area)([image], beam_size=3)
    expected = overlay(image, result.hypothesis.extras["areas"][1].numpy(), result.geometry, "area_topk",
                       area_boxes=result.area_boxes)
    assert Image.open(drawn).tobytes() == expected.tobytes()


def test_card_is_written_from_the_training_record_and_an_eval_report(tmp_path):
    save_checkpoint(tmp_path / "ckpt", tiny_model("sat"), VOCAB, TINY_SPEC, meta={
        "dataset": "scenes/dataset_scenes.json", "phase": "xe", "selected_by": "BLEU-4", "best_epoch": 1,
        "train_seconds": 90.0, "history": [{"epoch": 1, "xe": 1.25, "CIDEr-D": 0.5}],
        "train_config": {"dataset": "scenes/dataset_scenes.json", "out": "runs/x",
                         "model": "sat", "epochs": 1, "threads": 1,
                         "model_args": {"hidden_dim": 24}, "encoder": {"layer": "hypercolumn"}}})
    report = {"beam_size": 3, "test": {"images": 10, "BLEU-4": 0.25, "CIDEr-D": 1.5, "objects_named": 0.9,
                                       "SPICE": "unavailable: no models", "length_ratio": 0.97},
              "decoding": {"length_penalty": 0.5, "block_trigrams": False, "block_doubled_words": True}}
    (tmp_path / "report.json").write_text(json.dumps(report))
    # a second report (the out-of-distribution set) adds its split to the card
    (tmp_path / "ood.json").write_text(json.dumps({"beam_size": 3, "ood": {"images": 4, "objects_named": 0.75}}))
    captioner("card", str(tmp_path / "ckpt"), "--report", str(tmp_path / "report.json"),
              "--report", str(tmp_path / "ood.json"))
    card = (tmp_path / "ckpt" / "MODEL_CARD.md").read_text()
    assert ("captioner train --dataset scenes/dataset_scenes.json --out runs/x --model sat --set hidden_dim=24 "
            "--encoder layer=hypercolumn --epochs 1 --threads 1`") in card
    # a measure the card does not know (one added to score_dataset) gets a column of its own after the known ones
    assert "| objects_named | SPICE | length_ratio |" in card
    # the heading names the decoding rules the report's numbers were measured with
    assert ("## Measured by `captioner eval` (beam 3, length penalty α = 0.5, trigram blocking off, doubled words "
            "blocked)") in card
    assert "| test (10 images) | — | — | — | 0.2500 | — | — | 1.5000 | 0.9000 | unavailable | 0.9700 |" in card
    assert "| 1 | 1.25 | 0.5 |" in card and "1.5 min" in card
    assert "| ood (4 images) | — | — | — | — | — | — | — | 0.7500 | — | — |" in card


def test_a_cards_heading_is_the_title_asked_for_or_else_the_name_the_checkpoint_is_served_under(tmp_path):
    """``captioner card --title`` (the Makefile titles every shipped card); without one, a run's ``best/`` is named
    after its run, as the service names it."""
    best = save_checkpoint(tmp_path / "sat-run" / "best", tiny_model("sat"), VOCAB, TINY_SPEC)
    assert write_card(best, {}, title="Tiny SAT").read_text().startswith("# Tiny SAT\n")
    assert write_card(best, {}).read_text().startswith("# sat-run\n")


def test_a_cards_epoch_table_marks_a_score_an_epoch_lacks_and_an_unrecorded_validation_beam_is_greedy(tmp_path):
    """An epoch without one of the table's columns shows "—", as the score table does, not "None"; a training record
    without ``val_beam`` (an older run's) validated greedily, TrainConfig's default, not with a beam of 0."""
    save_checkpoint(tmp_path / "ckpt", tiny_model("sat"), VOCAB, TINY_SPEC, meta={
        "history": [{"epoch": 1, "xe": 1.5}, {"epoch": 2, "xe": 1.25, "CIDEr-D": 0.5}]})
    card = write_card(tmp_path / "ckpt", {}).read_text()
    assert "| epoch | xe | CIDEr-D |\n|---|---|---|\n| 1 | 1.5 | — |\n| 2 | 1.25 | 0.5 |\n" in card
    assert "then validation scores (greedy decoding, the numbers the run selected on):" in card


def test_a_float32_checkpoints_card_compares_no_storage_but_a_float16_copys_does(tmp_path):
    """float32 checkpoints record no ``storage`` (their config stays byte-identical), so the card reads its absence
    as float32: a card claiming float16 weights, set against the float32 ones, would describe other weights."""
    chosen = {"dataset": "d.json", "split": "val", "metric": "CIDEr-D", "beam_size": 3, "images": 4, "score": 1.5,
              "storage": "float32"}  # what `tune-decoding --write` records
    save_checkpoint(tmp_path / "ckpt", tiny_model("sat"), VOCAB, TINY_SPEC, meta={"decoding_chosen_on": chosen})
    report = {"beam_size": 3, "val": {"images": 4, "CIDEr-D": 1.25}}
    assert "Weights stored as" not in write_card(tmp_path / "ckpt", report).read_text()
    half = convert_storage(tmp_path / "ckpt", "float16", tmp_path / "half")
    assert ("Weights stored as float16: val CIDEr-D 1.2500, against 1.5000 with the float32 weights"
            in write_card(half, report).read_text())


def test_a_checkpoints_training_time_counts_every_run_it_started_from_or_is_not_known():
    """The card's "min with the runs it started from" and the zoo table's training column: a warm start's time
    alone understated it, and a run whose time was never recorded cannot be counted as none."""
    chain = {"train_seconds": 60.0, "started_from": {"train_seconds": 120.0, "started_from": {"train_seconds": 30.0}}}
    assert total_train_seconds(chain) == 210.0
    chain["started_from"]["started_from"] = {"checkpoint": "an older run"}
    assert total_train_seconds(chain) is None


def test_a_later_reports_split_replaces_an_earlier_ones_of_the_same_name_under_the_first_reports_settings():
    """``captioner card --report A --report B``: B's splits are added to A's, and one B also scored (a re-run)
    replaces A's; the heading's settings stay A's."""
    first = {"beam_size": 3, "test": {"images": 10, "BLEU-4": 0.1}, "val": {"images": 5, "BLEU-4": 0.2}}
    later = {"beam_size": 5, "test": {"images": 10, "BLEU-4": 0.3}, "ood": {"images": 4, "BLEU-4": 0.4}}
    assert merge_reports([first, later]) == {"beam_size": 3, "test": later["test"], "val": first["val"],
                                             "ood": later["ood"]}


def test_a_report_whose_score_is_a_boolean_is_refused_naming_its_split_and_measure(tmp_path):
    """json's true is an int to isinstance: a card would print it as the score 1.0000."""
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"beam_size": 3, "test": {"images": 2, "CIDEr-D": True}}))
    with pytest.raises(ValueError, match="the test split's CIDEr-D is True, not a score"):
        load_report(report)


def test_a_file_that_is_no_eval_report_is_refused_naming_it_rather_than_carded_as_an_empty_table(tmp_path):
    """``captioner card --report`` given ``--results-json``'s captions (a list), or a JSON object with no scored
    split, is refused with an error naming the file: a card written from it would hold a score table with no row."""
    captions, unscored = tmp_path / "captions.json", tmp_path / "unscored.json"
    captions.write_text(json.dumps([{"image_id": 1, "caption": "a red circle"}]))
    unscored.write_text(json.dumps({"beam_size": 3, "checkpoint": "runs/x/best"}))
    for path in (captions, unscored):
        refusal = f"{path} is not a report of `captioner eval --output` (it holds no scored split"
        with pytest.raises(ValueError, match=f"^{re.escape(refusal)}"):
            load_report(path)


def test_a_scene_cards_data_line_is_the_command_that_draws_its_data_set_again(tmp_path, capsys):
    """The card names generated scenes by what their own dataset_scenes.json records: the generator's version and
    the `captioner data generate` command that writes the same data set again (here no Makefile target's: another
    seed and sizes); a data set that is not on this machine is named without them, and said so."""
    drawn = generate(tmp_path / "scenes", {"train": 2, "val": 1, "test": 0, "heldout": 0}, seed=3, progress=False)
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"beam_size": 1, "test": {"images": 1, "objects_named": 0.5}}))
    for dataset in (drawn, tmp_path / "gone" / "dataset_scenes.json"):
        save_checkpoint(tmp_path / "ckpt", tiny_model("sat"), VOCAB, TINY_SPEC, meta={"dataset": str(dataset)})
        main(["card", str(tmp_path / "ckpt"), "--report", str(report)])
        (data_line,) = [line for line in (tmp_path / "ckpt" / "MODEL_CARD.md").read_text().splitlines()
                        if line.startswith("- Data: ")]
        if dataset == drawn:
            assert f"models/data/scenes.py, version {GENERATOR_VERSION}: `captioner data generate " in data_line
            command = shlex.split(re.search(r"`(captioner data generate[^`]*)`", data_line).group(1))[1:]
            main([*command, "--out", str(tmp_path / "again")])
            header = read_dataset_header(tmp_path / "again" / "dataset_scenes.json")
            assert is_current(tmp_path / "scenes", header["sizes"], header["seed"], None)
        else:
            assert data_line.startswith("- Data: generated scenes (this project's generator): `")
            assert "gone/dataset_scenes.json is not here" in capsys.readouterr().err


def test_an_ensembles_card_gives_each_members_data_and_time_or_says_they_were_not_recorded(tmp_path):
    """The ensemble card's member table: a member's recorded data set and training time, and "not recorded" only
    where its record has none, so the card neither hides what was recorded nor fills in what was not."""
    citation = "Flickr8k (Hodosh, Young & Hockenmaier, JAIR 2013), train split"
    members = [
        {"name": "sat", "arch": "sat", "trained_on": citation, "train_seconds": 120.0, "checksum": "ab" * 32},
        {"name": "aoanet", "arch": "aoanet", "checksum": "cd" * 32},
    ]
    save_checkpoint(tmp_path / "ckpt", tiny_model("sat"), VOCAB, TINY_SPEC, meta={"ensemble_of": members})
    card = write_card(tmp_path / "ckpt", {}).read_text()
    assert f"\n| `sat` | `sat` | {citation} | 2.0 min | `{'ab' * 8}…` |\n" in card
    assert f"\n| `aoanet` | `aoanet` | not recorded | not recorded | `{'cd' * 8}…` |\n" in card


def test_an_ensembles_card_has_a_members_section_where_a_trained_checkpoints_has_its_training(tmp_path):
    """A reader finds an ensemble's members under the heading a trained checkpoint's card puts its training, by name:
    the card's sections are "## Members", then the scores. A substring check passed a heading with more after it."""
    members = [{"name": "sat", "arch": "sat", "checksum": "ab" * 32}]
    save_checkpoint(tmp_path / "ckpt", tiny_model("sat"), VOCAB, TINY_SPEC, meta={"ensemble_of": members})
    card = write_card(tmp_path / "ckpt", {"beam_size": 3}).read_text()
    headings = [line for line in card.splitlines() if line.startswith("## ")]
    assert headings == ["## Members", "## Measured by `captioner eval` (beam 3)"]


def test_a_photo_cards_data_line_cites_its_data_set_as_recorded_or_as_its_path_names_it(tmp_path):
    """A Flickr8k checkpoint's card names its data by citation (what ``GET /models`` says too): the run's own
    ``trained_on`` record, else, for a checkpoint trained before it was recorded, the data set its path names. A
    card naming only a path would not say which published data set the scores below are of."""
    recorded = "Flickr30k (Young, Lai, Hodosh & Hockenmaier, TACL 2014), train split"
    for meta, cited in (
        ({"dataset": "data/dataset_flickr8k.json"}, "Flickr8k (Hodosh, Young & Hockenmaier, JAIR 2013), train split"),
        ({"dataset": "data/dataset_flickr30k.json", "trained_on": recorded}, recorded),
    ):
        save_checkpoint(tmp_path / "ckpt", tiny_model("sat"), VOCAB, TINY_SPEC, meta=meta)
        card = write_card(tmp_path / "ckpt", {}).read_text()
        assert f"\n- Data: {cited}: `{meta['dataset']}` (training split;" in card


def _tables(card: str) -> list[list[str]]:
    """Each Markdown table of ``card``: its lines, header first."""
    tables, table = [], []
    for line in [*card.splitlines(), ""]:
        if line.startswith("|"):
            table.append(line)
        elif table:
            tables, table = [*tables, table], []
    return tables


def test_a_warm_started_runs_card_gives_its_lineage_times_threads_and_epoch_numbers_as_recorded(tmp_path):
    """The training section of a run that started from another checkpoint: the ancestor's line with its own minutes,
    this run's time and the total with the runs it started from (a minute exactly is "1.0 min"), the threads asked
    for, and each epoch's numbers to four decimals, a learning rate below 1e-3 in full; every table's separator row
    has as many cells as its header, or Markdown shows no table."""
    save_checkpoint(tmp_path / "ckpt", tiny_model("sat"), VOCAB, TINY_SPEC, meta={
        "train_seconds": 60.0, "train_config": {"threads": 2},
        "started_from": {"checkpoint": "runs/a/best", "arch": "sat", "epochs": 2, "phase": "xe", "dataset": "d.json",
                         "train_seconds": 600.0, "command": "captioner train --out runs/a"},
        "history": [{"epoch": 1, "xe": 2.345678, "lr": 0.00025}]})
    card = write_card(tmp_path / "ckpt", {"beam_size": 3, "test": {"images": 2, "BLEU-4": 0.25}}).read_text()
    assert ("- Started from `runs/a/best`: sat, epoch 2 of its xe run (its best) on `d.json`, 10.0 min to reach it: "
            "`captioner train --out runs/a`\n- Training time: 1.0 min of wall clock (11.0 min with the runs it started "
            "from)\n  on a ") in card
    assert "CPU, no GPU, 2 intra-op thread(s) (`--threads 2`)." in card
    assert "| epoch | xe | lr |\n|---|---|---|\n| 1 | 2.3457 | 0.00025 |\n" in card
    tables = _tables(card)
    assert len(tables) == 2 and all(table[1].count("|---") == table[0].count("|") - 1 for table in tables)
    # a run that started from nothing says nothing of other runs
    save_checkpoint(tmp_path / "alone", tiny_model("sat"), VOCAB, TINY_SPEC, meta={"train_seconds": 45.0})
    assert "- Training time: 45 s of wall clock\n" in write_card(tmp_path / "alone", {}).read_text()


def test_a_cards_lineage_gives_each_ancestor_its_own_data_set_epochs_and_time_nearest_first(tmp_path):
    """A run that started from a checkpoint that itself started from another (say Flickr8k fine-tuning of a COCO run
    warm-started from scenes): each line describes its own ancestor, not the nearest one's data set or numbers, and
    the nearest comes first. The shipped chains all trained on one data set, so a line borrowing another's would
    pass there."""
    chain = {"checkpoint": "runs/coco/best", "arch": "sat", "epochs": 4, "phase": "scst", "dataset": "coco.json",
             "train_seconds": 1200.0,
             "started_from": {"checkpoint": "runs/scenes/best", "arch": "sat", "epochs": 2, "phase": "xe",
                              "dataset": "scenes.json", "train_seconds": 300.0}}
    save_checkpoint(tmp_path / "ckpt", tiny_model("sat"), VOCAB, TINY_SPEC, meta={"started_from": chain})
    assert ("`\n- Started from `runs/coco/best`: sat, epoch 4 of its scst run (its best) on `coco.json`, 20.0 min to "
            "reach it\n"
            "- Started from `runs/scenes/best`: sat, epoch 2 of its xe run (its best) on `scenes.json`, 5.0 min to "
            "reach it\n- Training time: not recorded\n") in write_card(tmp_path / "ckpt", {}).read_text()


def test_a_card_names_the_split_measure_and_image_count_its_decoding_rules_were_chosen_on(tmp_path):
    """The line under the score table's heading is ``tune-decoding``'s record, not the report's: the rules were chosen
    on 4 val images, though the report below scored 250."""
    chosen = {"dataset": "d.json", "split": "val", "metric": "CIDEr-D", "beam_size": 3, "images": 4, "score": 1.5,
              "storage": "float32"}
    save_checkpoint(tmp_path / "ckpt", tiny_model("sat"), VOCAB, TINY_SPEC, meta={"decoding_chosen_on": chosen})
    card = write_card(tmp_path / "ckpt", {"beam_size": 3, "val": {"images": 250, "CIDEr-D": 1.25}}).read_text()
    assert ("\nThe decoding rules were chosen on the val split by CIDEr-D (`captioner tune-decoding`, 4 images); they "
            "are the checkpoint's defaults.\n") in card


def test_a_photo_cards_table_has_the_caption_columns_spice_included_then_the_diversity_measures(tmp_path):
    """A report of real photos (no ``objects_named``) gets the Flickr8k cards' columns: the caption metrics with
    SPICE among them (its cell says "unavailable" where the report says why it was not measured), then what
    diversity.py measures, ``distinct_words`` a whole count. No test regenerates the Flickr8k cards
    (test_card_regeneration covers the scene cards only), so these columns are pinned here."""
    save_checkpoint(tmp_path / "ckpt", tiny_model("sat"), VOCAB, TINY_SPEC)
    scores = {"BLEU-1": 0.6, "BLEU-2": 0.4, "BLEU-3": 0.3, "BLEU-4": 0.2, "METEOR": 0.19, "ROUGE-L": 0.45,
              "CIDEr-D": 0.5, "SPICE": "unavailable: no CoreNLP models", "REP": 1.5, "distinct_words": 42,
              "novel_captions": 0.25, "mean_length": 6.5}
    header, separator, row = _tables(write_card(tmp_path / "ckpt", {"beam_size": 3,
                                                                   "test": {"images": 2, **scores}}).read_text())[-1]
    assert header == ("| split | BLEU-1 | BLEU-2 | BLEU-3 | BLEU-4 | METEOR | ROUGE-L | CIDEr-D | SPICE | REP | "
                      "distinct_words | novel_captions | mean_length |")
    assert row == ("| test (2 images) | 0.6000 | 0.4000 | 0.3000 | 0.2000 | 0.1900 | 0.4500 | 0.5000 | unavailable | "
                   "1.5000 | 42 | 0.2500 | 6.5000 |")


def test_a_cards_storage_line_reads_an_unrecorded_storage_as_float32_and_says_what_was_not_measured_again(tmp_path):
    """A ``decoding_chosen_on`` record without ``storage`` (tune-decoding's before it recorded one) was chosen on
    float32 weights: a float32 card compares nothing, and a float16 copy's card whose reports lack the split the
    rules were chosen on says it was not measured again, rather than printing nothing or another split's score."""
    chosen = {"dataset": "d.json", "split": "val", "metric": "CIDEr-D", "beam_size": 3, "images": 4, "score": 1.5}
    save_checkpoint(tmp_path / "ckpt", tiny_model("sat"), VOCAB, TINY_SPEC, meta={"decoding_chosen_on": chosen})
    report = {"beam_size": 3, "test": {"images": 4, "CIDEr-D": 1.25}}
    assert "Weights stored as" not in write_card(tmp_path / "ckpt", report).read_text()
    half = convert_storage(tmp_path / "ckpt", "float16", tmp_path / "half")
    assert "\nWeights stored as float16; not re-measured on val.\n" in write_card(half, report).read_text()
    # and where the reports do score that split, the weights it is set against are the float32 ones
    remeasured = {"beam_size": 3, "val": {"images": 4, "CIDEr-D": 1.25}}
    compared = "\nWeights stored as float16: val CIDEr-D 1.2500, against 1.5000 with the float32 weights the rules"
    assert compared + " were chosen on.\n" in write_card(half, remeasured).read_text()


def test_a_report_of_other_weights_is_refused_and_one_for_a_checkpoint_without_a_manifest_passes(tmp_path):
    """``captioner card`` prints a report's numbers under the checkpoint's name only when the report scored its
    weights; a report (or a checkpoint) that records no sha256 cannot be compared, and passes."""
    ckpt = save_checkpoint(tmp_path / "ckpt", tiny_model("sat"), VOCAB, TINY_SPEC)
    own = recorded_checksum(ckpt)
    assert own
    check_report_scores({"weights_sha256": own}, "r.json", ckpt)
    check_report_scores({}, "r.json", ckpt)
    with pytest.raises(ValueError, match="whose weights are not"):
        check_report_scores({"weights_sha256": "0" * 64, "checkpoint": "other"}, "r.json", ckpt)
    (ckpt / "manifest.json").unlink()
    check_report_scores({"weights_sha256": "0" * 64}, "r.json", ckpt)


def test_card_refuses_a_report_of_other_weights_among_several_and_writes_no_card(tmp_path, capsys):
    """``captioner card`` checks every ``--report`` against the checkpoint, the later ones too: another model's
    numbers would otherwise reach the card under this one's name."""
    ckpt = save_checkpoint(tmp_path / "ckpt", tiny_model("sat"), VOCAB, TINY_SPEC)
    own, other = tmp_path / "own.json", tmp_path / "other.json"
    own.write_text(json.dumps({"beam_size": 3, "weights_sha256": recorded_checksum(ckpt),
                               "test": {"images": 2, "BLEU-4": 0.25}}))
    other.write_text(json.dumps({"beam_size": 3, "weights_sha256": "0" * 64, "checkpoint": "another",
                                 "ood": {"images": 1, "BLEU-4": 0.5}}))
    err = _one_line_error(capsys, ["card", str(ckpt), "--report", str(own), "--report", str(other)])
    assert f"{other} scores another, whose weights are not {ckpt}'s" in err
    assert not (ckpt / "MODEL_CARD.md").exists()


def test_a_boolean_in_a_report_gets_no_column_and_merging_reports_leaves_them_as_they_were(tmp_path):
    """A flag a report holds beside its scores is no measure: the card adds columns for numbers it does not know,
    not for true or false. Merging (``captioner card --report A --report B``) builds a new report: A is unchanged."""
    save_checkpoint(tmp_path / "ckpt", tiny_model("sat"), VOCAB, TINY_SPEC)
    report = {"beam_size": 3, "test": {"images": 2, "BLEU-4": 0.25, "ptb_tokenized": True, "length_ratio": 0.5}}
    header = _tables(write_card(tmp_path / "ckpt", report).read_text())[-1][0]
    assert header.endswith("| length_ratio |") and "ptb_tokenized" not in header
    first, later = {"beam_size": 3, "test": {"images": 1}}, {"beam_size": 5, "val": {"images": 2}}
    merge_reports([first, later])
    assert first == {"beam_size": 3, "test": {"images": 1}}


def _one_line_error(capsys, argv: list[str]) -> str:
    """``captioner ARGV`` as a user runs it, in this process: it must stop with a non-zero status and a short
    message on stderr, never a traceback."""
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2, argv  # the README's status for a mistake in the command
    err = capsys.readouterr().err + (stopped.value.code if isinstance(stopped.value.code, str) else "")
    assert "Traceback" not in err
    return err


def test_mistakes_in_a_command_are_one_line_errors(tmp_path, capsys, scenes, monkeypatch):
    sample = str(DEMO_SAMPLES / "chelsea.jpg")
    monkeypatch.chdir(ROOT)
    expected = [
        (["caption", sample, "--max-len", "0"], "--max-len: must be at least 1"),
        (["caption", sample, "--output", str(tmp_path / "o.jsonl"), "--beam-size", "0"], "--beam-size"),
        (["params", "--vocab-size", "0"], "--vocab-size"),
        (["caption", sample, "--device", "gpu"], "unknown device 'gpu'"),
        (["caption", sample, "--token", "1"], "add --overlay"),
        (["caption", sample, "--overlay", str(tmp_path / "f.png"), "--cmap", "nope"], "colormap 'nope'"),
        (["tune-decoding", str(DEFAULT_CHECKPOINT), "--block-trigrams", "maybe"], "neither on nor off"),
        (["train", "--model", "nosuch", "--dataset", str(scenes), "--out", str(tmp_path / "run")], "unknown model"),
        (["train", "--model", "sat", "--set", "bogus=1", "--dataset", str(scenes), "--out", str(tmp_path / "run")],
         "has no option 'bogus'"),
        (["eval", str(DEFAULT_CHECKPOINT), "--dataset", str(ROOT / "README.md")], "is not a data set's JSON"),
        (["caption", sample, "--output", str(tmp_path)], "is a folder"),
        (["caption", sample, "--output", str(tmp_path / "y.jsonl"), "--checkpoint", str(tmp_path / "nope")],
         "nope does not exist: give a checkpoint folder"),
        (["caption", sample, "--output", str(tmp_path / "y.jsonl"), "--checkpoint", str(tmp_path)],
         "config.json is missing"),
        (["export", "weights/sat", "weights/flickr8k/sat", "--out", str(tmp_path / "onnx")], "share the name sat"),
        (["train", "--recipe", "nope", "--dataset", str(scenes), "--out", str(tmp_path / "run")], "unknown recipe"),
        (["train", "--phase", "scst", "--dataset", str(scenes), "--out", str(tmp_path / "run")], "give --init"),
        (["train", "--model", "sparsecap", "--attention", "tvmax", "--features", "regions:/nowhere", "--dataset",
          str(scenes), "--out", str(tmp_path / "run")], "--attention tvmax needs grid features"),
        (["train", "--finetune-stages", "9", "--dataset", str(scenes), "--out", str(tmp_path / "run")],
         "--finetune-stages"),
    ]
    for argv, message in expected:
        assert message in _one_line_error(capsys, argv), argv
    assert not (tmp_path / "run").exists(), "a run that could not start leaves no empty folder"
    assert not (tmp_path / "y.jsonl").exists(), "nor an archive whose checkpoint is not one"
    report, copy = tmp_path / "captions.json", tmp_path / "sat"
    report.write_text('[{"image_id": 1, "caption": "a cat"}]')
    shutil.copytree(DEFAULT_CHECKPOINT, copy)  # were the report taken, the card it rewrites is a copy's
    assert "not a report of `captioner eval --output`" in _one_line_error(
        capsys, ["card", str(copy), "--report", str(report)])
    assert (copy / "MODEL_CARD.md").read_text() == (DEFAULT_CHECKPOINT / "MODEL_CARD.md").read_text()


def _command_that_raises(monkeypatch, error: BaseException) -> None:
    """``cli.main`` runs a command that stops with ``error``, whatever its arguments."""
    def command(args):
        raise error

    class Parser:
        def parse_args(self, argv):
            return argparse.Namespace(func=command)

    monkeypatch.setattr(cli, "build_parser", Parser)


def test_ctrl_c_in_a_command_is_one_line_and_status_130(capsys, monkeypatch):
    """Ctrl-C in a command without its own message (eval, export, …): the shell's status for an interrupt and one
    line, not a KeyboardInterrupt traceback (training and archive captioning say what they kept: their tests)."""
    _command_that_raises(monkeypatch, KeyboardInterrupt())
    monkeypatch.delenv("CAPTIONER_DEBUG", raising=False)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["eval"])
    assert exit_.value.code == 130
    assert capsys.readouterr().err == "interrupted\n"


def test_the_debug_switch_keeps_each_stops_traceback_for_a_bug_report(capsys, monkeypatch):
    monkeypatch.setenv("CAPTIONER_DEBUG", "1")
    _command_that_raises(monkeypatch, SystemExit("error: no such split"))  # a command's own message: both
    with pytest.raises(SystemExit) as exit_:
        cli.main(["eval"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("Traceback (most recent call last):")
    assert err.endswith("SystemExit: error: no such split\nerror: no such split\n")
    for error in (ValueError("bad value"), FileNotFoundError(2, "No such file or directory"), KeyboardInterrupt()):
        _command_that_raises(monkeypatch, error)  # Python's own stop, as raised
        with pytest.raises(type(error)):
            cli.main(["eval"])
        assert capsys.readouterr().err == ""


def test_serving_on_a_device_this_machine_lacks_is_one_line(capsys, monkeypatch):
    """``captioner serve --device cuda`` without a GPU: a one-line error before the server starts, not a lifespan
    traceback and uvicorn's "Application startup failed"."""
    if torch.cuda.is_available():
        pytest.skip("this machine has the GPU the test asks for")
    monkeypatch.delenv("CAPTIONER_DEBUG", raising=False)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", "--device", "cuda", "--port", "1"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == ("error: device 'cuda' was requested but no CUDA GPU is available (use auto or "
                                       "cpu)\n")


def test_a_file_error_names_the_path_and_the_reason_as_a_shell_tool_would(capsys, monkeypatch):
    """Python's ``[Errno 2] No such file or directory: '/proc/nope'`` becomes ``/proc/nope: No such file or
    directory`` (a folder no one can create files in, even the superuser CI runs as)."""
    monkeypatch.delenv("CAPTIONER_DEBUG", raising=False)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["data", "generate", "--out", "/proc/nope", "--train", "4"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == "error: /proc/nope: No such file or directory\n"


def test_an_output_file_in_a_folder_that_cannot_be_written_is_a_usage_error_before_any_work(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["plot", "runs/x", "--out", "/proc/curves.png"])
    assert exit_.value.code == 2
    assert ("argument --out: the folder of /proc/curves.png cannot be written (No such file or directory)"
            in capsys.readouterr().err)


def test_every_subcommands_help_opens_with_what_it_does(capsys):
    """argparse shows a subcommand's ``help`` only in its parent's list: ``captioner storage --help`` never said
    that the model card is left out, nor what the command is for."""
    found = list(command_parsers(cli.build_parser()))
    assert len(found) > 20
    for path, listed, child in found:  # as the list prints it: argparse %-formats a help line
        assert listed and child.description == listed.replace("%%", "%"), path
    with pytest.raises(SystemExit):
        cli.main(["storage", "--help"])
    assert "model card" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["compare", "--help"])
    assert "95% interval" in capsys.readouterr().out


def test_the_help_lists_every_command_once_in_the_order_users_know():
    """The order of ``captioner --help`` is older than the commands' split into modules (models/cli/commands.py
    gathers them back into it); ``serve`` comes last, from the service."""
    listed = [path[0] for path, _, _ in command_parsers(cli.build_parser()) if len(path) == 1]
    assert listed == ["data", "train", "eval", "tune-decoding", "ensemble", "resolution-check", "compare", "caption",
                      "export", "card", "plot", "manifest", "storage", "params", "zoo-table", "zoo-f8k",
                      "grounding-doc", "models", "import", "serve"]


def test_a_port_outside_1_to_65535_is_a_usage_error(capsys):
    # uvicorn took 99999 modulo 65536, listened on 34463 and logged 99999
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", "--port", "99999"])
    assert exit_.value.code == 2 and "must be at most 65535, got 99999" in capsys.readouterr().err


def test_serves_flags_are_the_settings_they_name_over_the_variables(monkeypatch):
    seen = []

    def stop(settings):  # before any model loads
        seen.append(settings)
        raise SystemExit("error: stopped")

    monkeypatch.setattr(cli, "check_something_to_serve", stop)
    for name in ("HOST", "WEIGHTS_DIR", "DEFAULT_MODEL", "DEVICE", "LOG_LEVEL", "ROOT_PATH"):
        monkeypatch.setenv(f"CAPTIONER_{name}", "/from-the-variable" if name == "ROOT_PATH" else "variable")
    port = free_port()
    with pytest.raises(SystemExit):
        main(["serve", "--host", "127.0.0.1", "--port", str(port), "--weights-dir", "w", "--model", "m",
              "--device", "cpu", "--log-level", "warning", "--root-path", "/vision"])
    (settings,) = seen
    assert (settings.host, settings.port, str(settings.weights_dir), settings.default_model, settings.device,
            settings.log_level, settings.root_path) == ("127.0.0.1", port, "w", "m", "cpu", "warning", "/vision")


def test_a_host_this_machine_cannot_listen_on_is_one_line_before_any_model_loads(monkeypatch, capsys):
    # a mistyped CAPTIONER_HOST loaded and warmed every model, then stopped with uvicorn's "[Errno -2] Name or
    # service not known" and status 3, naming no setting (the operator audit)
    monkeypatch.setattr(service_app, "create_app", lambda settings: pytest.fail("the app was made"))
    port = str(free_port())
    with pytest.raises(SystemExit) as stopped:
        main(["serve", "--host", "no-such-host.invalid", "--port", port])  # .invalid never resolves (RFC 6761)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot listen on no-such-host.invalid:{port} (") and "CAPTIONER_HOST" in err
    assert err.count("\n") == 1


def test_a_log_level_either_logger_would_refuse_is_a_settings_error(monkeypatch):
    # "warn" (Python's logging knows it) stopped uvicorn with a KeyError traceback after the settings were read;
    # "trace" (uvicorn knows it) stopped the server with "error: Unknown level: 'TRACE'", naming no setting
    for level in ("warn", "trace", "verbose"):
        monkeypatch.setenv("CAPTIONER_LOG_LEVEL", level)
        with pytest.raises(SystemExit) as stopped:
            read_settings()
        assert str(stopped.value.code).startswith("error: settings: CAPTIONER_LOG_LEVEL: ")
        assert "critical, error, warning, info, debug" in str(stopped.value.code)
    monkeypatch.setenv("CAPTIONER_LOG_LEVEL", "DEBUG")
    assert read_settings().log_level == "debug"  # any case, as both loggers are given it
    monkeypatch.setenv("CAPTIONER_LOG_LEVEL", " Warning ")  # and spaces around it (a quoted YAML value's) are no part
    assert read_settings().log_level == "warning"


def test_serving_with_exports_to_make_in_an_unwritable_onnx_folder_is_one_line(monkeypatch, capsys, tmp_path):
    # a read-only container without a writable /tmp: every export failed twice (the preparing child, then the
    # server) with a traceback apiece, and the models were served by PyTorch, slower to start and larger than the
    # memory limit was sized for, while the log said only "the onnx backend failed to load or run" (operator audit)
    save_checkpoint(tmp_path / "weights" / "tiny", tiny_model("sat"), VOCAB, TINY_SPEC)
    (tmp_path / "a-file").write_text("not a folder")
    monkeypatch.setenv("CAPTIONER_ONNX_DIR", str(tmp_path / "a-file" / "onnx"))  # unwritable even by root
    monkeypatch.setenv("CAPTIONER_DEFAULT_MODEL", "tiny")

    class PastTheChecks(Exception):
        pass

    def past_the_checks(*args, **kwargs):
        raise PastTheChecks

    monkeypatch.setattr(service_app, "create_app", lambda settings: pytest.fail("the app was made"))
    monkeypatch.setattr(cli.faulthandler, "register", past_the_checks)  # what cmd_serve does after its checks
    serve = ["serve", "--weights-dir", str(tmp_path / "weights"), "--port", str(free_port()), "--device", "cpu"]
    with pytest.raises(SystemExit) as stopped:
        main(serve)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: CAPTIONER_ONNX_DIR {tmp_path / 'a-file' / 'onnx'} cannot be written (")
    assert "ONNX exports of tiny" in err and "CAPTIONER_BACKEND=torch" in err and err.count("\n") == 1
    # a writable folder that is already there (onnx/ after an earlier start) is no mistake, exports still to make
    (tmp_path / "onnx").mkdir()
    monkeypatch.setenv("CAPTIONER_ONNX_DIR", str(tmp_path / "onnx"))
    with pytest.raises(PastTheChecks):
        main(serve)
    # nothing to export, nothing to write: PyTorch models start with the same folder
    monkeypatch.setenv("CAPTIONER_BACKEND", "torch")
    with pytest.raises(PastTheChecks):
        main(serve)


class _PastTheChecks(Exception):
    """Raised where ``cmd_serve`` goes on once its start-up checks have passed."""


def _serve_past_its_checks(monkeypatch, tmp_path):
    """``serve`` a tiny checkpoint until its start-up checks have passed, and no further."""
    save_checkpoint(tmp_path / "weights" / "tiny", tiny_model("sat"), VOCAB, TINY_SPEC)
    monkeypatch.setenv("CAPTIONER_DEFAULT_MODEL", "tiny")

    def past_the_checks(*args, **kwargs):
        raise _PastTheChecks

    monkeypatch.setattr(service_app, "create_app", lambda settings: pytest.fail("the app was made"))
    monkeypatch.setattr(cli.faulthandler, "register", past_the_checks)  # what cmd_serve does after its checks
    with pytest.raises(_PastTheChecks):
        main(["serve", "--weights-dir", str(tmp_path / "weights"), "--port", str(free_port()), "--device", "cpu"])


def test_an_onnx_folder_whose_parents_are_not_there_yet_is_made_at_start_not_refused(monkeypatch, tmp_path):
    """CAPTIONER_ONNX_DIR is "made when missing" (the settings' description): on a fresh volume its parents may be
    missing too (``cache/onnx``), and the start-up check makes them, as the exports would, rather than stopping a
    server whose folder can be written."""
    monkeypatch.setenv("CAPTIONER_ONNX_DIR", str(tmp_path / "cache" / "onnx"))
    _serve_past_its_checks(monkeypatch, tmp_path)
    assert (tmp_path / "cache" / "onnx").is_dir()


def test_an_onnx_folder_that_cannot_be_written_is_no_mistake_when_there_is_nothing_to_export(monkeypatch, tmp_path):
    """A read-only container whose exports are all made (or whose models run on PyTorch) never writes the ONNX
    folder: it starts, rather than being stopped for a folder it has no need to write."""
    (tmp_path / "a-file").write_text("not a folder")
    monkeypatch.setenv("CAPTIONER_ONNX_DIR", str(tmp_path / "a-file" / "onnx"))  # unwritable even by root
    monkeypatch.setenv("CAPTIONER_BACKEND", "torch")
    _serve_past_its_checks(monkeypatch, tmp_path)


def test_every_command_and_argument_says_what_it_is_for():
    # `captioner eval --help` listed `checkpoint`, `--image-root`, `--cache-dir` and 26 others with no word of help
    parser = build_parser()
    commands = list(command_parsers(parser))
    silent = [" ".join(["captioner", *words]) for words, listed, _ in commands if not listed]
    for words, _, command in [((), None, parser), *commands]:
        silent += [" ".join(["captioner", *words, action.option_strings[0] if action.option_strings else action.dest])
                   for action in command._actions
                   if not isinstance(action, argparse._SubParsersAction) and not action.help]
    assert not silent, silent


def documented_command_flags() -> list[tuple[str, list[str], str]]:
    """Every ``captioner SUBCOMMAND … --flag`` written in the README, docs/, docker/, the Makefile and CI, as
    (file, the subcommand's words, flag): continuation lines joined, a command ending at its code span, a pipe, ``&&``
    or ``;``."""
    files = [ROOT / "README.md", ROOT / "Makefile", ROOT / "Dockerfile",
             *(path for top in ("docs", "docker", ".ci") for path in sorted((ROOT / top).rglob("*")) if path.is_file())]
    found = []
    for path in files:
        try:
            text = re.sub(r"\\\n\s*", " ", path.read_text())
        except UnicodeDecodeError:  # figures
            continue
        for line in text.splitlines():
            for command in re.finditer(r"\bcaptioner((?:\s+[a-z][a-z0-9-]*)+)(.*)", line):
                rest = re.split(r"`|&&|\|\||;|\)", command.group(2))[0]
                for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", command.group(1) + rest):
                    found.append((str(path.relative_to(ROOT)), command.group(1).split(), flag))
    return found


def test_every_flag_the_docs_give_a_command_is_one_it_takes():
    """A flag renamed in argparse but not in the docs, the Makefile or CI sends users an argparse error (or, in a
    Makefile recipe, fails a target nobody runs in CI)."""
    def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
        return next((a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), {})

    wrong, checked = [], 0
    for file, words, flag in documented_command_flags():
        parser, path = build_parser(), []
        for word in words:  # the subcommand's words (`data features`), then its arguments
            if word not in subcommands(parser):
                break
            parser, path = subcommands(parser)[word], [*path, word]
        if not path:  # prose: "captioner trained on …"
            continue
        checked += 1
        if flag not in {option for action in parser._actions for option in action.option_strings}:
            wrong.append(f"{file}: captioner {' '.join(path)} {flag}")
    assert checked > 100, "the scan no longer finds the documented commands"
    assert not wrong, wrong


def test_checkpoints_whose_folders_share_a_name_are_labelled_by_their_paths():
    # `caption --checkpoint weights/sat --checkpoint weights/flickr8k/sat` printed "[sat]" twice
    assert checkpoint_labels(["weights/sat", "weights/flickr8k/sat", "runs/x/best", "runs/x/last"]) == [
        "weights/sat", "weights/flickr8k/sat", "x", "x-last"]
    assert checkpoint_labels(["weights/sat", "weights/aoanet"]) == ["sat", "aoanet"]


def test_serve_on_a_taken_port_is_one_line_before_any_model_loads(monkeypatch, capsys):
    # uvicorn binds after the app's start-up: every model was loaded and warmed up, then "address already in use"
    # came in uvicorn's own format with exit status 3
    monkeypatch.setattr(service_app, "create_app", lambda settings: pytest.fail("the app was made"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as stopped:
            main(["serve", "--host", "127.0.0.1", "--port", str(port)])
    assert stopped.value.code == 2
    err = capsys.readouterr().err  # what to do about a port in use, not about a host
    assert f"error: cannot listen on 127.0.0.1:{port}" in err and "choose another --port (CAPTIONER_PORT)" in err


def test_a_port_a_server_just_stopped_on_is_free_to_serve_on_again():
    """uvicorn binds with SO_REUSEADDR: a restart finds the last run's connections waiting in TIME_WAIT on its port,
    which uvicorn takes, so the check must not refuse it."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the last run's uvicorn bound it
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)):
            accepted, _ = listener.accept()
            accepted.close()  # the server closes first: its end of the connection waits out TIME_WAIT
    cli.check_port_free("127.0.0.1", port)


def test_serve_hands_uvicorn_the_prefix_and_timeouts_and_a_start_that_failed_exits_3(monkeypatch, tmp_path):
    """uvicorn's wait for connections outlasts the drain it follows; its keep-alive and prefix are the settings'."""
    handed = {}

    class NeverStarts:
        def __init__(self, config, gate, drain_timeout_s):
            handed.update(config=config, drain_timeout_s=drain_timeout_s)
            self.started = False

        def run(self):  # as uvicorn's when start-up fails (the port taken at the last moment)
            pass

    monkeypatch.setattr(lifecycle, "DrainingServer", NeverStarts)
    monkeypatch.setattr(cli, "check_something_to_serve", lambda settings: None)
    monkeypatch.setattr(cli.faulthandler, "register", lambda *args, **kwargs: None)
    monkeypatch.setattr(middleware, "configure_logging", lambda *args: None)  # the test process's logging stays
    monkeypatch.setenv("CAPTIONER_KEEP_ALIVE_S", "7")
    monkeypatch.setenv("CAPTIONER_DRAIN_TIMEOUT_S", "20")
    with pytest.raises(SystemExit) as stopped:
        main(["serve", "--port", str(free_port()), "--root-path", "/vision", "--weights-dir", str(tmp_path),
              "--device", "cpu"])
    assert stopped.value.code == 3
    config = handed["config"]
    assert (config.root_path, config.timeout_keep_alive, config.timeout_graceful_shutdown) == ("/vision", 7, 25)
    assert handed["drain_timeout_s"] == 20
    # the app writes the access line itself, with the request id: uvicorn's own would log every request twice, and
    # its logging config would undo the format configure_logging set (a JSON log's lines in uvicorn's plain text)
    assert (config.access_log, config.log_config) == (False, None)


def test_serve_with_nothing_to_serve_is_one_line_before_any_model_loads(monkeypatch, capsys, tmp_path):
    # a mistyped weights folder started a server that stayed live and never ready: a container's health check (on
    # liveness) called it healthy, and every caption got 503 (the operator audit)
    monkeypatch.setattr(service_app, "create_app", lambda settings: pytest.fail("the app was made"))
    (tmp_path / "notes").mkdir()
    port = str(free_port())
    with pytest.raises(SystemExit) as stopped:
        main(["serve", "--weights-dir", str(tmp_path / "wieghts"), "--port", port])
    assert stopped.value.code == 2
    assert f"error: no checkpoint found in {tmp_path / 'wieghts'}: nothing to serve" in capsys.readouterr().err
    # a checkpoint given as the folder of checkpoints, and the default folder read from another working folder:
    # each said only "no checkpoint found" (the training and docs audits)
    with pytest.raises(SystemExit):
        main(["serve", "--weights-dir", str(DEFAULT_CHECKPOINT), "--port", port])
    assert f"{DEFAULT_CHECKPOINT} is itself a checkpoint: serve it with CAPTIONER_CHECKPOINTS=" \
        in capsys.readouterr().err
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        main(["serve", "--port", port])
    assert f"is read from the working folder ({tmp_path}), which has none: run from the checkout" \
        in capsys.readouterr().err
    # the message names every folder looked in, the prefixed ones and CAPTIONER_CHECKPOINTS's too: naming only the
    # weights folder sent the operator to the one setting that was right
    monkeypatch.setenv("CAPTIONER_CHECKPOINTS", f'["{tmp_path / "notes"}"]')
    monkeypatch.setenv("CAPTIONER_PREFIXED_WEIGHTS_DIRS", f'{{"scenes-": "{tmp_path / "scenes"}"}}')
    with pytest.raises(SystemExit):
        main(["serve", "--weights-dir", str(tmp_path), "--port", port])
    assert f"no checkpoint found in {tmp_path}, {tmp_path / 'scenes'}, {tmp_path / 'notes'}: nothing to serve" \
        in capsys.readouterr().err


def test_the_working_folder_is_blamed_only_for_a_relative_weights_folder_not_there(monkeypatch, capsys, tmp_path):
    """A missing folder given by its full path, or a relative one that is there and holds no checkpoint, gets the
    general advice: sending the operator to change the working folder would not help either."""
    monkeypatch.setattr(service_app, "create_app", lambda settings: pytest.fail("the app was made"))
    (tmp_path / "empty").mkdir()
    monkeypatch.chdir(tmp_path)
    port = str(free_port())
    for folder in (str(tmp_path / "wieghts"), "empty"):
        with pytest.raises(SystemExit):
            main(["serve", "--weights-dir", folder, "--port", port])
        err = capsys.readouterr().err
        assert "nothing to serve (set CAPTIONER_WEIGHTS_DIR or --weights-dir to a folder of checkpoints" in err, err
        assert "working folder" not in err, err


def test_caption_with_the_default_checkpoint_works_from_any_folder(tmp_path):
    # the default was weights/flickr8k/sat-supervised below the working folder: the README's first command failed
    # anywhere but the checkout's root
    photo = tmp_path / "cat.jpg"
    Image.fromarray(data.chelsea()).save(photo)
    done = subprocess.run([sys.executable, "-m", "captioner.service.cli", "caption", str(photo), "--threads", "1"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith(f"{photo}: ") and len(done.stdout.split()) > 3


def test_an_option_is_never_read_as_a_longer_one_it_begins(capsys):
    # `captioner eval CKPT --encoder image_size=512` was read as --encoder-precision and refused with its choices
    with pytest.raises(SystemExit) as stopped:
        main(["eval", str(DEFAULT_CHECKPOINT), "--encoder", "image_size=512"])
    assert stopped.value.code == 2
    assert "unrecognized arguments: --encoder image_size=512" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # in nested subcommands too
        main(["data", "generate", "--out", "x", "--vari"])
    assert "unrecognized arguments: --vari" in capsys.readouterr().err


def test_export_of_a_training_run_names_the_checkpoints_it_holds(tmp_path, capsys):
    # "not a checkpoint folder: runs/karp" where eval and caption say which of the run's checkpoints to give
    shutil.copytree(DEFAULT_CHECKPOINT, tmp_path / "run" / "best")
    with pytest.raises(SystemExit) as stopped:
        main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "onnx")])
    assert stopped.value.code == 2
    assert f"{tmp_path / 'run'} is a training run, not a checkpoint: give {tmp_path / 'run' / 'best'}" \
        in capsys.readouterr().err
    assert not (tmp_path / "onnx").exists()


def test_no_output_option_writes_over_what_the_command_reads(tmp_path, capsys):
    """Only inputs named on the command line were guarded: ``eval --results-json`` wrote over the data set's JSON,
    ``eval --output`` over the checkpoint's weights, ``tune-decoding --output`` over its config.json (each exiting
    0), ``eval`` wrote its report and its captions to one file, and the archive answered an input given as its
    output with "already holds captions: … or remove it"."""
    torch.manual_seed(0)
    ckpt = save_checkpoint(tmp_path / "ckpt", create("sat", vocab_size=9, feat_dim=8, embed_dim=8, hidden_dim=8,
                                                     attn_dim=8), Vocabulary(["a", "b", "c", "d", "e"]),
                           EncoderSpec())
    dataset = tmp_path / "scenes" / "dataset_scenes.json"
    dataset.parent.mkdir()
    dataset.write_text("{}")
    photo = tmp_path / "photo.jpg"
    Image.fromarray(data.chelsea()).save(photo)
    kept = {path: path.read_bytes() for path in [dataset, photo, *ckpt.iterdir()]}
    report = tmp_path / "report.json"
    for args, said in [
        (["eval", ckpt, "--dataset", dataset.parent, "--results-json", dataset], "is one of the command's inputs"),
        (["eval", ckpt, "--dataset", dataset, "--output", ckpt / "model.safetensors"], f"is a file of {ckpt}"),
        (["eval", ckpt, "--dataset", dataset, "--output", report, "--results-json", report],
         f"--output and --results-json both name {report}"),
        # named by its flag as the command spells it: the user is told which option to change
        (["tune-decoding", ckpt, "--dataset", dataset, "--output", ckpt / "config.json"],
         f"error: --output {ckpt / 'config.json'} is a file of {ckpt}"),
        (["resolution-check", ckpt, "--dataset", dataset, "--full-root", tmp_path, "--output", ckpt / "vocab.json"],
         f"is a file of {ckpt}"),
        (["compare", report, tmp_path / "b.json", "--dataset", dataset, "--output", dataset],
         "is one of the command's inputs"),
        (["caption", photo, "--output", photo, "--checkpoint", ckpt], "one of the command's inputs"),
    ]:
        with pytest.raises(SystemExit):
            main([str(arg) for arg in args])
        assert said in capsys.readouterr().err, args
        assert {path: path.read_bytes() for path in kept} == kept, args


@pytest.fixture
def service_loggers():
    """The service's loggers as they were before the test configured them."""
    kept = {name: (logging.getLogger(name).handlers[:], logging.getLogger(name).level,
                   logging.getLogger(name).propagate) for name in middleware.SERVICE_LOGGERS}
    yield
    for name, (handlers, level, propagate) in kept.items():
        logger = logging.getLogger(name)
        logger.handlers, logger.propagate = handlers, propagate
        logger.setLevel(level)


def test_logging_is_configured_once_in_the_format_and_level_asked_for_uvicorn_too(service_loggers, capsys):
    for _ in range(2):  # idempotent: a second call leaves one handler, not two
        configure_logging("text", "warning")
    assert middleware.SERVICE_LOGGERS == ("captioner", "uvicorn")
    for name in middleware.SERVICE_LOGGERS:
        logger = logging.getLogger(name)
        (handler,) = logger.handlers
        assert isinstance(handler.formatter, TextFormatter) and not isinstance(handler.formatter, JsonFormatter)
        assert logger.level == logging.WARNING and logger.propagate is False
    # loggers of this test's own below each (uvicorn's may keep handlers an earlier test's server gave them)
    logging.getLogger("uvicorn.test-cli").info("not shown")
    logging.getLogger("uvicorn.test-cli").warning("shown")
    (line,) = capsys.readouterr().err.splitlines()  # once: not again through the root logger
    assert line.endswith(" WARNING uvicorn.test-cli: shown")
    configure_logging("json", "info")
    logging.getLogger("captioner.test-cli").info("hello")
    (record,) = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert (record["logger"], record["level"], record["msg"]) == ("captioner.test-cli", "info", "hello")
