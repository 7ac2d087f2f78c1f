"""Paired comparison of two checkpoints' captions (models/evaluation/compare.py, `captioner compare`) on hand-built
captions whose answers are known."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from captioner.models.data.karpathy import CaptionedImage
from captioner.models.evaluation import compare as compare_module
from captioner.models.evaluation import metrics as metrics_module
from captioner.models.evaluation.bootstrap import percentile_interval, resample_counts
from captioner.models.evaluation.compare import bleu_4, bleu_statistics, compare_captions, corpus_bleu, \
    markdown, paired_corpus_difference, paired_difference, read_results
from captioner.models.evaluation.metrics import cider_d, score_captions
from captioner.models.evaluation.report import PTB_TOKENIZER, WORDS_TOKENIZER
from captioner.models.evaluation.zoo_table import paired_markdown
from captioner.service.cli import main

from .conftest import cli_error


def scene(image_id: int, objects: list[tuple[str, str]], reference: str) -> CaptionedImage:
    return CaptionedImage(image_id, Path(f"{image_id}.png"), "test", [reference.split()] * 5,
                          {"objects": [{"colour": c, "shape": s} for c, s in objects]})


IMAGES = [scene(0, [("red", "circle"), ("blue", "square")], "a red circle and a blue square"),
          scene(1, [("green", "triangle")], "a green triangle"),
          scene(2, [("orange", "diamond"), ("red", "square")], "an orange diamond and a red square"),
          scene(3, [("blue", "circle")], "a blue circle")]


def test_identical_sides_differ_by_exactly_nothing():
    stat = paired_difference([1.0, 2.0, 3.0], [1.0, 2.0, 3.0], [1, 1, 1])
    assert stat["difference"] == 0.0 and stat["ci95"] == [0.0, 0.0] and stat["share_not_above"] == 1.0
    rows = bleu_statistics(["a red circle", "a blue square"], [["a red circle"], ["a blue circle"]])
    stat = paired_corpus_difference(rows, rows, bleu_4)  # a tie is "not above" for corpus scores too
    assert stat["difference"] == 0.0 and stat["ci95"] == [0.0, 0.0] and stat["share_not_above"] == 1.0


def test_a_constant_gain_on_every_image_has_a_zero_width_interval():
    stat = paired_difference([2.0, 3.0, 7.0, 1.0], [1.0, 2.0, 6.0, 0.0], [1, 1, 1, 1])
    assert stat["a"] == pytest.approx(3.25) and stat["b"] == pytest.approx(2.25)
    assert stat["difference"] == pytest.approx(1.0) and stat["ci95"] == pytest.approx([1.0, 1.0])
    assert stat["share_not_above"] == 0.0


def test_ratio_of_counts_is_pooled_over_images_and_the_interval_covers_it():
    # A names 3 of 4 objects, B 1 of 4: the pooled difference is 0.5, not the mean of per-image ratios
    stat = paired_difference([2, 1], [0, 1], [3, 1], resamples=4000)
    assert stat["difference"] == pytest.approx(0.5)
    low, high = stat["ci95"]
    assert low <= 0.5 <= high and low >= 0.0 - 1e-12 and high <= 2 / 3 + 1e-12


def test_a_difference_that_comes_from_one_image_is_not_certain():
    rng = np.random.default_rng(0)
    b = rng.normal(1.0, 0.1, 200)
    a = b.copy()
    a[0] += 20.0  # one image carries the whole gain
    stat = paired_difference(a, b, np.ones(200))
    assert stat["difference"] == pytest.approx(0.1)
    assert stat["ci95"][0] == 0.0 and stat["share_not_above"] > 0.05


def test_nothing_to_compare_is_an_error_not_a_division_by_zero():
    # scenes with no objects at all: objects_named has no denominator
    with pytest.raises(ValueError, match="no images"):
        paired_difference([0.0, 0.0], [0.0, 0.0], [0, 0])
    with pytest.raises(ValueError, match="no images"):
        paired_corpus_difference(np.zeros((0, 10)), np.zeros((0, 10)), bleu_4)


def test_a_mean_score_gets_the_same_answer_through_either_paired_function():
    """paired_corpus_difference draws the same images as paired_difference (the same seed through
    bootstrap.resample_counts), so a score that is a mean of per-image values, given as sums and counts, has one
    difference, interval and share either way, defaults included; plain lists are accepted as rows."""
    rng = np.random.default_rng(1)
    a, b = rng.normal(1.0, 0.5, 30), rng.normal(0.9, 0.5, 30)
    by_images = paired_difference(a, b, np.ones(30))
    by_sums = paired_corpus_difference([[x, 1.0] for x in a], [[x, 1.0] for x in b], lambda s: s[..., 0] / s[..., 1])
    assert by_sums["difference"] == pytest.approx(by_images["difference"])
    assert by_sums["ci95"] == pytest.approx(by_images["ci95"])
    assert by_sums["share_not_above"] == by_images["share_not_above"]


def test_bleu_from_summed_statistics_is_coco_captions_corpus_bleu():
    """BLEU is not a mean of per-image scores: summed per-caption statistics must give pycocoevalcap's corpus
    BLEU-1..4 (what captioner eval reports), brevity penalty included (the short captions) and an empty caption
    scored as "<empty>"."""
    captions = {0: "a red circle", 1: "a green triangle", 2: "", 3: "a blue circle on a blue circle"}
    longer = {0: "a red circle and a blue square on a red circle", 1: "a green triangle on a green triangle",
              2: "an orange diamond and a red square", 3: "a blue circle"}  # longer than the references: no penalty
    refs = [[" ".join(r) for r in im.references] for im in IMAGES]
    wants = [score_captions(given, dict(enumerate(refs)), "BLEU") for given in (captions, longer)]
    for given, want in zip((captions, longer), wants):
        rows = bleu_statistics([given[i] or "<empty>" for i in range(4)], refs)
        assert corpus_bleu(rows.sum(0)) == pytest.approx([want[f"BLEU-{n}"] for n in range(1, 5)])
    result = compare_captions(captions, longer, IMAGES)["BLEU-4"]
    assert result["a"] == pytest.approx(wants[0]["BLEU-4"]) and result["b"] == pytest.approx(wants[1]["BLEU-4"])
    assert result["difference"] == pytest.approx(wants[0]["BLEU-4"] - wants[1]["BLEU-4"])


def test_bleu_4_of_a_corpus_without_four_grams_is_coco_captions_smoothed_value():
    """No caption has four words, so BLEU-4's 4-gram precision is pycocoevalcap's smoothing, 1e-15 / 1e-9, not 0:
    BLEU-4 is about 0.03 here, as captioner eval reports it, and each constant moves it."""
    captions = {0: "a red circle", 1: "a green triangle", 2: "an orange diamond", 3: "a blue circle"}
    refs = [[" ".join(r) for r in im.references] for im in IMAGES]
    want = score_captions(captions, dict(enumerate(refs)), "BLEU")
    rows = bleu_statistics([captions[i] for i in range(4)], refs)
    assert corpus_bleu(rows.sum(0)) == pytest.approx([want[f"BLEU-{n}"] for n in range(1, 5)])
    assert 0.01 < want["BLEU-4"] < 0.1


def test_bleu_of_many_corpora_at_once_is_each_corpus_bleu():
    """paired_corpus_difference hands corpus_bleu one row of sums per resample: each row must be scored as its own
    corpus (the product of precisions taken along n, never across the resamples), or BLEU-4's interval in
    ``captioner compare`` is of numbers that are no resample's BLEU."""
    captions = ["a red circle", "a green triangle on a green triangle", "<empty>", "a blue circle on a blue circle"]
    rows = bleu_statistics(captions, [[" ".join(r) for r in im.references] for im in IMAGES])
    corpora = np.stack([rows.sum(0), rows[:2].sum(0), rows[1:].sum(0), rows[[0, 0, 3]].sum(0)])
    assert corpus_bleu(corpora) == pytest.approx(np.stack([corpus_bleu(totals) for totals in corpora]))


def test_a_karpathy_coco_splits_references_are_cooked_once_for_both_sides():
    """Each image's cooked references are kept for the other side's captions, for a whole Karpathy COCO split
    (5,000 images): a cache one image smaller, read in the same order, evicts every image before it is read again
    and cooks each twice."""
    references = [[f"image{i} a red circle"] for i in range(5000)]
    compare_module._cooked_references.cache_clear()
    bleu_statistics(["a red circle"] * 5000, references)
    bleu_statistics(["a blue square"] * 5000, references)
    assert compare_module._cooked_references.cache_info().misses == 5000


def test_compare_captions_scores_both_sides_on_the_same_references():
    exact = {im.image_id: " ".join(im.references[0]) for im in IMAGES}
    wrong_colour = {**exact, 0: "a blue circle and a blue square", 2: "a red diamond and a red square"}
    result = compare_captions(exact, wrong_colour, IMAGES)
    refs = [[" ".join(r) for r in im.references] for im in IMAGES]
    want_a = cider_d([exact[i] for i in range(4)], refs).mean()
    want_b = cider_d([wrong_colour[i] for i in range(4)], refs).mean()
    assert result["CIDEr-D"]["a"] == pytest.approx(want_a) and result["CIDEr-D"]["b"] == pytest.approx(want_b)
    assert result["CIDEr-D"]["difference"] > 0
    # the interval is the paired bootstrap of the per-image scores, with paired_difference's defaults
    assert result["CIDEr-D"] == paired_difference(cider_d([exact[i] for i in range(4)], refs),
                                                  cider_d([wrong_colour[i] for i in range(4)], refs), np.ones(4))
    named = result["objects_named"]
    assert named["a"] == 1.0 and named["b"] == pytest.approx(4 / 6) and named["difference"] == pytest.approx(2 / 6)


@pytest.mark.skipif(shutil.which("java") is None, reason="the PTB tokenizer needs Java")
def test_ptb_comparison_tokenizes_both_sides_as_coco_caption_does():
    """``ptb``: both sides' captions go through coco-caption's PTB tokenizer before they are scored, so capitals and
    a final full stop cost nothing there, and do cost on the project's own tokens."""
    exact = {im.image_id: " ".join(im.references[0]) for im in IMAGES}
    written = {k: caption.capitalize() + "." for k, caption in exact.items()}
    tokenized = compare_captions(written, exact, IMAGES, ptb=True)
    assert tokenized["CIDEr-D"]["difference"] == 0.0 and tokenized["BLEU-4"]["difference"] == 0.0
    assert compare_captions(written, exact, IMAGES)["CIDEr-D"]["difference"] < 0


@pytest.mark.skipif(shutil.which("java") is None, reason="the PTB tokenizer needs Java")
def test_ptb_comparison_scores_each_side_on_its_own_captions_against_the_raw_references():
    """With ``ptb`` the references are the data set's raw texts through the PTB tokenizer, not the project's tokens
    of them (which here say something else), and each side is scored on its own tokenized captions: A writes the
    raw texts word for word (BLEU-4 of 1), B one short caption for every image."""
    images = [CaptionedImage(im.image_id, im.path, "test", ["a picture of something here".split()] * 5, im.info,
                             [" ".join(im.references[0]).capitalize() + "."] * 5) for im in IMAGES]
    raw = {im.image_id: im.raw_references[0] for im in images}
    short = {im.image_id: "a red circle" for im in images}
    result = compare_captions(raw, short, images, ptb=True)
    assert result["BLEU-4"]["a"] == pytest.approx(1.0) and result["BLEU-4"]["b"] < 0.5
    assert result["CIDEr-D"]["difference"] > 1


def test_the_interval_and_the_draws_follow_the_level_seed_and_resamples_asked_for():
    """Both paired functions name their interval by ``level`` and take it at that level, from ``resamples`` draws
    made with ``seed`` (the same draws ``bootstrap.resample_counts`` makes), not at the defaults."""
    rng = np.random.default_rng(2)
    a, b = rng.normal(1.0, 0.5, 30), rng.normal(0.9, 0.5, 30)
    counts = resample_counts(30, 50, 7)
    want = percentile_interval(counts @ a / 30 - counts @ b / 30, 0.5)
    stat = paired_difference(a, b, np.ones(30), resamples=50, seed=7, level=0.5)
    assert stat["ci50"] == pytest.approx(list(want))
    assert stat["share_not_above"] == np.mean(counts @ a <= counts @ b)
    by_sums = paired_corpus_difference([[x, 1.0] for x in a], [[x, 1.0] for x in b], lambda s: s[..., 0] / s[..., 1],
                                       resamples=50, seed=7, level=0.5)
    assert by_sums["ci50"] == pytest.approx(list(want))
    assert by_sums["share_not_above"] == stat["share_not_above"]


def test_compare_captions_hands_its_resamples_and_seed_to_every_measure():
    exact = {im.image_id: " ".join(im.references[0]) for im in IMAGES}
    short = {im.image_id: "a red circle" for im in IMAGES}
    refs = [[" ".join(r) for r in im.references] for im in IMAGES]
    sides = [[given[i] for i in range(4)] for given in (exact, short)]
    result = compare_captions(exact, short, IMAGES, resamples=40, seed=5)
    assert result["CIDEr-D"] == paired_difference(cider_d(sides[0], refs), cider_d(sides[1], refs), np.ones(4),
                                                  resamples=40, seed=5)
    assert result["BLEU-4"] == paired_corpus_difference(bleu_statistics(sides[0], refs),
                                                        bleu_statistics(sides[1], refs), bleu_4, resamples=40, seed=5)
    assert result["objects_named"] == paired_difference([2, 1, 2, 1], [1, 0, 0, 0], [2, 1, 2, 1], resamples=40,
                                                        seed=5)


def test_captions_are_looked_up_by_an_images_coco_id_where_it_has_one():
    """``captioner eval --results-json`` writes a COCO image's ``cocoid``, not the data set's own id."""
    images = [CaptionedImage(im.image_id, im.path, "test", im.references, {**im.info, "cocoid": 1000 + im.image_id})
              for im in IMAGES]
    exact = {1000 + im.image_id: " ".join(im.references[0]) for im in IMAGES}
    assert compare_captions(exact, exact, images, resamples=10)["objects_named"]["a"] == 1.0


def test_objects_named_is_pooled_over_a_scene_set_that_holds_a_scene_without_objects():
    """A scene with nothing in it adds no object to either side's count; the measure is still reported."""
    images = [*IMAGES, scene(4, [], "an empty picture")]
    exact = {im.image_id: " ".join(im.references[0]) for im in images}
    named = compare_captions(exact, {**exact, 0: "a red circle"}, images, resamples=10)["objects_named"]
    assert named["a"] == 1.0 and named["b"] == pytest.approx(5 / 6)


@pytest.mark.parametrize("content", ['{"image_id": 1, "caption": "a cat"}', "[1, 2]", '[{"caption": "a cat"}]',
                                     '[{"image_id": "one", "caption": "a cat"}]'])
def test_a_results_file_of_another_shape_is_a_value_error_naming_it(tmp_path, content):
    """An object, a list of numbers, a record without its id or with a word for one: each the one-line refusal
    the CLI prints, never a TypeError or KeyError from inside the reader."""
    path = tmp_path / "results.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=r"results\.json is not a COCO results file"):
        read_results(path)


def test_a_missing_caption_is_an_error_not_a_silent_drop():
    exact = {im.image_id: " ".join(im.references[0]) for im in IMAGES}
    with pytest.raises(ValueError, match=r"^1 of 4 images have no caption on one side \(first: id 2\)$"):
        compare_captions(exact, {k: v for k, v in exact.items() if k != 2}, IMAGES)


def test_the_table_prints_each_interval_low_to_high():
    result = {"images": {"count": 4}, "CIDEr-D": {"a": 1.0, "b": 0.5, "difference": 0.5, "ci95": [-0.25, 1.5],
                                                  "share_not_above": 0.125}}
    assert markdown(result, "A", "B").splitlines() == [
        "| measure (4 images) | A | B | difference [95 % CI] | resamples with A not above |",
        "|---|---:|---:|---|---:|",
        "| CIDEr-D | 1.000 | 0.500 | +0.500 [-0.250, +1.500] | 12.5% |"]


def write_dataset(folder: Path) -> Path:
    folder.mkdir()
    (folder / "dataset_scenes.json").write_text(json.dumps({"images": [
        {"imgid": im.image_id, "split": "test", "filepath": "", "filename": im.path.name,
         "sentences": [{"tokens": r} for r in im.references], "objects": im.info["objects"]} for im in IMAGES]}))
    return folder / "dataset_scenes.json"


def test_cli_reads_coco_results_and_writes_the_report(tmp_path, capsys):
    data = write_dataset(tmp_path / "scenes").parent
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps([{"image_id": im.image_id, "caption": " ".join(im.references[0])} for im in IMAGES]))
    b.write_text(json.dumps([{"image_id": im.image_id, "caption": "a red circle"} for im in IMAGES]))
    main(["compare", str(a), str(b), "--dataset", str(data), "--names", "exact", "short",
          "--output", str(tmp_path / "out.json")])
    assert "| objects_named | 1.000 | 0.167 |" in capsys.readouterr().out
    report = json.loads((tmp_path / "out.json").read_text())
    assert report["a"] == "exact" and report["objects_named"]["difference"] == pytest.approx(5 / 6)
    b.write_text("not json")
    with pytest.raises(SystemExit, match="not a COCO results file"):
        main(["compare", str(a), str(b), "--dataset", str(data)])
    with pytest.raises(SystemExit, match=r"none\.json is missing: write the captions with captioner eval"):
        main(["compare", str(a), str(tmp_path / "none.json"), "--dataset", str(data)])


def test_cli_hands_its_flags_to_the_comparison_and_names_the_sides_and_tokenizer(tmp_path, monkeypatch):
    """--resamples, --limit and --ptb reach the comparison (stubbed, as is the Java check); the report names A and B
    by their files' stems, in order, and the tokenizer the scores used."""
    data = write_dataset(tmp_path / "scenes").parent
    a, b = tmp_path / "first.json", tmp_path / "second.json"
    for path in (a, b):
        path.write_text(json.dumps([{"image_id": im.image_id, "caption": "a red circle"} for im in IMAGES]))
    calls = []

    def compared(captions_a, captions_b, images, resamples, ptb=False):
        calls.append((len(images), resamples, ptb))
        return compare_captions(captions_a, captions_b, images, 20)
    monkeypatch.setattr(compare_module, "compare_captions", compared)
    monkeypatch.setattr(metrics_module, "check_ptb_tokenizer", lambda: None)
    out = tmp_path / "out.json"
    main(["compare", str(a), str(b), "--dataset", str(data), "--resamples", "7", "--limit", "3", "--output", str(out)])
    report = json.loads(out.read_text())
    assert (report["a"], report["b"], report["tokenizer"]) == ("first", "second", WORDS_TOKENIZER)
    main(["compare", str(a), str(b), "--dataset", str(data), "--ptb", "--output", str(out)])
    assert json.loads(out.read_text())["tokenizer"] == PTB_TOKENIZER
    assert calls == [(3, 7, False), (4, 2000, True)]


def test_the_report_names_the_data_set_file_and_split_whose_references_scored_both_sides(tmp_path):
    """A comparison's JSON is read long after it was made: it names the data set's file (a folder given resolved to
    the file read) and the split, so a difference measured on the test split is not taken for one on another."""
    data = write_dataset(tmp_path / "scenes")
    a, out = tmp_path / "a.json", tmp_path / "out.json"
    a.write_text(json.dumps([{"image_id": im.image_id, "caption": "a red circle"} for im in IMAGES]))
    main(["compare", str(a), str(a), "--dataset", str(data.parent), "--resamples", "5", "--output", str(out)])
    report = json.loads(out.read_text())
    assert (report["dataset"], report["split"]) == (str(data), "test")


def test_cli_refuses_ptb_scoring_without_java_in_one_line_before_comparing(tmp_path, monkeypatch, capsys):
    data = write_dataset(tmp_path / "scenes").parent
    a = tmp_path / "a.json"
    a.write_text(json.dumps([{"image_id": im.image_id, "caption": "a red circle"} for im in IMAGES]))
    calls = []
    monkeypatch.setattr(compare_module, "compare_captions", lambda *args, **kwargs: calls.append(args))
    monkeypatch.setattr(metrics_module.shutil, "which", lambda name: None)  # no Java on PATH
    message = cli_error(capsys, "compare", str(a), str(a), "--dataset", str(data), "--ptb")
    assert "PTB tokenizer needs Java" in message and calls == []


def test_zoo_table_compares_every_checkpoint_with_the_baseline_image_by_image(tmp_path):
    dataset = write_dataset(tmp_path / "scenes")
    folder = tmp_path / "results" / "captions"
    assert paired_markdown(tmp_path / "results", dataset, "sat") == []  # no captions yet: no section
    folder.mkdir(parents=True)
    exact = [{"image_id": im.image_id, "caption": " ".join(im.references[0])} for im in IMAGES]
    (folder / "sat.json").write_text(json.dumps(exact))
    (folder / "short.json").write_text(json.dumps([{**r, "caption": "a red circle"} for r in exact]))
    (folder / "same.json").write_text(json.dumps(exact))
    lines = paired_markdown(tmp_path / "results", dataset, "sat")
    rows = {line.split(" | ")[0].strip("| "): line for line in lines
            if line.startswith("| ") and not line.startswith("| checkpoint") and "] |" in line}
    assert set(rows) == {"same", "short"}
    assert lines[4:6] == ["| checkpoint | CIDEr-D − sat [95 % CI] | objects_named − sat [95 % CI] |", "|---|---|---|"]
    assert "| +0.000 [+0.000, +0.000] | +0.000 [+0.000, +0.000] |" in rows["same"]
    assert "| -0.833 [" in rows["short"]  # objects_named 1/6 against 6/6
    for cell in rows["short"].strip("| ").split(" | ")[1:]:  # each interval low to high, around its difference
        difference, low, high = (float(v) for v in cell.replace(" [", ", ").rstrip("]").split(", "))
        assert low <= difference <= high and low < high
    assert paired_markdown(tmp_path / "results", tmp_path / "none.json", "sat") == []  # no data set: no section
    # `captioner zoo-table` writes the section, given the data set's folder, with no grounding figure to draw
    (tmp_path / "weights").mkdir()
    main(["zoo-table", "--weights-dir", str(tmp_path / "weights"), "--results", str(tmp_path / "results"),
          "--document", str(tmp_path / "zoo.md"), "--figure", str(tmp_path / "grounding.png"),
          "--dataset", str(dataset.parent)])
    text = (tmp_path / "zoo.md").read_text()
    assert "\n".join(lines) in text and "grounding" not in text.split("### Against")[1]
    assert not (tmp_path / "grounding.png").exists()


def test_the_zoo_tables_comparison_scores_the_split_it_is_asked_for(tmp_path):
    """``paired_markdown(..., split=...)`` heads its section with that split: a library caller asking for the
    validation scenes must get differences on them, not on the test split's under the validation split's name."""
    dataset = write_dataset(tmp_path / "scenes")
    data = json.loads(dataset.read_text())
    data["images"][3]["split"] = "val"  # the blue circle alone
    dataset.write_text(json.dumps(data))
    folder = tmp_path / "results" / "captions"
    folder.mkdir(parents=True)
    exact = [{"image_id": im.image_id, "caption": " ".join(im.references[0])} for im in IMAGES]
    (folder / "sat.json").write_text(json.dumps(exact))
    (folder / "short.json").write_text(json.dumps([{**r, "caption": "a red circle"} for r in exact]))
    lines = paired_markdown(tmp_path / "results", dataset, "sat", split="val")
    assert lines[0] == "### Against `sat`, image by image (val split, 1 scenes)"
    assert lines[-1].startswith("| short | ") and "| -1.000 [-1.000, -1.000] |" in lines[-1]  # its one object missed
