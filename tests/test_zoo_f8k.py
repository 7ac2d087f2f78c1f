"""`captioner zoo-f8k` (models/evaluation/zoo_f8k.py) and the corpus BLEU-4 paired bootstrap behind it
(models/evaluation/compare.py), on a hand-written Karpathy data set, checkpoint configs and reports."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from pycocoevalcap.bleu.bleu import Bleu

from captioner.models.checkpoint import FORMAT
from captioner.models.data.karpathy import load_karpathy
from captioner.models.evaluation import zoo_f8k
from captioner.models.evaluation.bootstrap import percentile_interval, resample_counts, resampled_ratios
from captioner.models.evaluation.compare import bleu_4, bleu_statistics, compare_captions, corpus_bleu, \
    paired_corpus_difference, scored_captions
from captioner.models.evaluation.metrics import cider_d, reference_texts, score_captions
from captioner.models.evaluation.zoo_f8k import add_ptb_scores, difference, floor_lines, markdown, model_row, \
    ordered_names, points, ptb_lines, read_report, title, write_f8k_section
from captioner.service.cli import main

# invented photos: five references each
SCENES = [
    ["a black dog runs across the green grass", "a dog running on a lawn", "the black dog is running outside",
     "a dog runs through the grass", "a black dog plays on the grass"],
    ["a man rides a red bicycle down the street", "a cyclist on a city street", "a man on a red bike",
     "a person riding a bicycle on the road", "a man is riding his bike in town"],
    ["two children swim in a blue pool", "kids swimming in the pool", "two kids play in the water",
     "children splash in a swimming pool", "two young children are in a pool"],
    ["a woman in a hat sits on a bench", "a woman sitting on a park bench", "a lady with a hat on a bench",
     "a woman rests on a wooden bench", "a woman wearing a hat is sitting down"],
    ["a boy throws a ball on the beach", "a child playing with a ball by the sea", "a boy on the sand with a ball",
     "a young boy throws a red ball", "a kid at the beach throwing a ball"],
    ["a brown horse stands in a field", "a horse in a grassy field", "a brown horse grazing",
     "a horse standing on the grass", "one brown horse in a meadow"],
    ["a girl in a pink dress jumps", "a little girl jumping in the air", "a girl wearing pink jumps up",
     "a young girl leaps on the sidewalk", "a girl in pink is jumping"],
    ["a climber scales a rock wall", "a man climbing a large rock", "a person rock climbing",
     "a climber on the side of a cliff", "a man climbs up a steep rock"],
]
TEST_IDS = list(range(len(SCENES)))
EXACT = {i: refs[0] for i, refs in enumerate(SCENES)}
GENERIC = {i: "a man is standing outside" for i in TEST_IDS}


def write_dataset(folder: Path) -> Path:
    images = [{"imgid": i, "split": "test", "filename": f"{i}.jpg", "sentences": [{"tokens": s.split()} for s in refs]}
              for i, refs in enumerate(SCENES)]
    images.append({"imgid": 99, "split": "train", "filename": "99.jpg",
                   "sentences": [{"tokens": "a dog on the grass".split()}]})
    path = folder / "dataset_flickr8k.json"
    path.write_text(json.dumps({"dataset": "flickr8k", "images": images}))
    return path


def write_checkpoint(weights: Path, name: str, arch: str, decoding: dict | None = None, **model) -> None:
    (weights / name).mkdir(parents=True)
    meta = {"phase": "xe", **({"decoding": decoding} if decoding else {})}
    (weights / name / "config.json").write_text(json.dumps({"format": FORMAT, "arch": arch, "model": model,
                                                            "meta": meta}))


def write_results(results: Path, name: str, captions: dict[int, str], meteor: float = 0.2,
                  decoding: dict | None = None, beam_size: int = 3) -> None:
    """A report as `captioner eval --output` writes it (scores of these captions, the rest hand-set) and the
    captions as `--results-json` writes them."""
    (results / "captions").mkdir(parents=True, exist_ok=True)
    scores = score_captions(captions, {i: SCENES[i] for i in TEST_IDS}, ("BLEU", "ROUGE-L", "CIDEr-D"))
    split = {"images": len(TEST_IDS), **{k: round(v, 4) for k, v in scores.items()}, "METEOR": meteor,
             "REP": 1.2345, "distinct_words": 17, "novel_captions": 0.875, "mean_length": 6.25,
             "SPICE": "unavailable: no download"}
    report = {"checkpoint": f"weights/flickr8k/{name}", "beam_size": beam_size,
              "decoding": decoding or {"length_penalty": 0.0, "block_trigrams": False}, "test": split}
    (results / f"{name}.json").write_text(json.dumps(report))
    (results / "captions" / f"{name}.json").write_text(
        json.dumps([{"image_id": i, "caption": c} for i, c in captions.items()]))


@pytest.fixture
def zoo(tmp_path):
    """weights/flickr8k with sat, sat-hard (not measured yet), aoanet and xlan; reports for three of them."""
    weights, results = tmp_path / "weights", tmp_path / "results"
    rules = {"length_penalty": 0.5, "block_trigrams": True}
    write_checkpoint(weights, "sat", "sat", rules)
    write_checkpoint(weights, "sat-hard", "sat-hard")
    write_checkpoint(weights, "aoanet", "aoanet")
    write_checkpoint(weights, "xlan", "xlan")
    write_results(results, "sat", GENERIC, meteor=0.2412, decoding=rules)
    write_results(results, "aoanet", EXACT, meteor=0.5)
    write_results(results, "xlan", GENERIC)
    document = tmp_path / "model_zoo.md"
    document.write_text("# Model zoo\n\nintro\n\n## Real photos: Flickr8k\n\n<!-- zoo-f8k:start -->\nold\n"
                        "<!-- zoo-f8k:end -->\n\n## Scenes\n\nkept\n")
    args = ["zoo-f8k", "--weights-dir", str(weights), "--results", str(results), "--document", str(document),
            "--dataset", str(write_dataset(tmp_path)), "--resamples", "500"]
    return args, weights, results, document


def edit_split(results: Path, name: str, change) -> None:
    """``change`` applied to the test split of ``results/NAME.json``."""
    report = json.loads((results / f"{name}.json").read_text())
    change(report["test"])
    (results / f"{name}.json").write_text(json.dumps(report))


# -- BLEU-4 from per-caption statistics --------------------------------------------------------------------------
def test_corpus_bleu_of_summed_statistics_is_pycocoevalcaps_bleu():
    captions = ["a dog runs on the grass", "a man", "two children play in the water at the beach", "<empty>",
                "a dog a dog a dog", "a cat sits"]  # a short one (brevity), a repeat (clipping), no 4-gram match
    references = [["a dog is running on the grass", "the brown dog runs through grass"],
                  ["a man in a red shirt stands", "a man is standing outside"],
                  ["two kids play in the water", "children playing at the beach in the water", "two children splash"],
                  ["a cat"], ["a dog plays", "dogs"], ["a cat sits on it", "the cat sat"]]  # a tie: 5 and 3 words
    for n in (2, 4, 6):
        gts = {i: refs for i, refs in enumerate(references[:n])}
        want, _ = Bleu(4).compute_score(gts, {i: [c] for i, c in enumerate(captions[:n])}, verbose=0)
        got = corpus_bleu(bleu_statistics(captions[:n], references[:n]).sum(0))
        assert got == pytest.approx(want, abs=1e-9, rel=0)


def test_resample_counts_draw_the_images_resampled_ratios_draws():
    values = np.random.default_rng(3).normal(size=50)
    counts = resample_counts(50, 300, seed=4)
    assert (counts.sum(1) == 50).all()
    assert counts @ values / 50 == pytest.approx(resampled_ratios(values, np.ones(50), 300, seed=4))


def test_percentile_interval_leaves_equal_tails_outside():
    """A ``level`` interval leaves (1 − level) / 2 of the resamples below it and as many above."""
    samples = np.random.default_rng(5).permutation(1001).astype(np.float64)  # the values 0 … 1000, shuffled
    assert percentile_interval(samples) == pytest.approx((25.0, 975.0))
    assert percentile_interval(samples, level=0.8) == pytest.approx((100.0, 900.0))


@pytest.fixture(scope="module")
def test_images(tmp_path_factory):
    return load_karpathy(write_dataset(tmp_path_factory.mktemp("f8k")), splits=("test",))


def test_bleu_difference_of_a_model_with_itself_is_exactly_zero(test_images):
    images = test_images
    refs = [[" ".join(r) for r in im.references] for im in images]
    stats = bleu_statistics([EXACT[im.image_id] for im in images], refs)
    stat = paired_corpus_difference(stats, stats, bleu_4, resamples=500)
    assert stat["difference"] == 0.0 and stat["ci95"] == [0.0, 0.0] and stat["share_not_above"] == 1.0


def test_clearly_better_captions_have_a_bleu_4_interval_above_zero(test_images):
    result = compare_captions(EXACT, GENERIC, test_images, resamples=500)
    want = score_captions(EXACT, {i: SCENES[i] for i in TEST_IDS}, ("BLEU",))["BLEU-4"]
    assert result["BLEU-4"]["a"] == pytest.approx(want, abs=1e-9)
    assert result["BLEU-4"]["ci95"][0] > 0 and result["BLEU-4"]["share_not_above"] == 0.0
    assert result["CIDEr-D"]["ci95"][0] > 0


# -- the section -------------------------------------------------------------------------------------------------
def test_the_section_lists_every_checkpoint_with_paper_rows_intervals_and_floors(zoo, capsys):
    args, weights, results, document = zoo
    (results / "sat.val.json").write_text("{}")  # another report of sat (zoo-table's NAME.SOMETHING.json): no row
    (weights / "drafts").mkdir()  # a folder without a config.json: no checkpoint
    main(args)
    text = document.read_text()
    assert text.startswith("# Model zoo\n\nintro\n\n## Real photos: Flickr8k\n\n<!-- zoo-f8k:start -->\n")
    assert text.endswith("<!-- zoo-f8k:end -->\n\n## Scenes\n\nkept\n") and "\nold\n" not in text
    table = text[:text.index("Paper rows:")]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| model")]
    assert [row.split(" | ")[0][2:] for row in rows] == [
        "SAT soft `sat`", "*Xu et al. 2015, soft attention (paper)*", "SAT hard `sat-hard`: not measured",
        "*Xu et al. 2015, hard attention (paper)*", "AoANet `aoanet`", "X-LAN `xlan`"]
    assert all(row.count(" | ") == 14 for row in rows)
    sat, soft_paper, _, hard_paper, aoanet, xlan = (row.split(" | ") for row in rows)
    assert sat[5] == "24.12" and sat[8] == "unavailable" and sat[9:13] == ["1.23", "17", "87.5 %", "6.2"]
    assert sat[-2:] == ["—", "— |"]  # the baseline has no difference from itself
    assert soft_paper[1:6] == ["67", "44.8", "29.9", "19.5", "18.93"]
    assert hard_paper[1:6] == ["67", "45.7", "31.4", "21.3", "20.30"]
    assert aoanet[1] == "100.0" and aoanet[-2].endswith("†") and aoanet[-1].endswith("† |")
    assert xlan[-2:] == ["+0.0 [+0.0, +0.0]", "+0.0 [+0.0, +0.0] |"]  # the same captions as sat: no †
    low, high = (float(v) for v in aoanet[7].split(" [")[1].rstrip("]").split(", "))
    assert low <= float(aoanet[7].split(" [")[0]) <= high
    # the interval over photos and the paired differences, drawn as the command's --resamples 500 draw them
    images = load_karpathy(Path(args[args.index("--dataset") + 1]), splits=("test",))
    per_image = cider_d(scored_captions(EXACT, TEST_IDS), reference_texts(images))
    low, high = percentile_interval(resampled_ratios(per_image, np.ones(len(per_image)), 500, seed=0))
    assert aoanet[7] == f"{points(per_image.mean())} [{100 * low:.1f}, {100 * high:.1f}]"
    against = compare_captions(EXACT, GENERIC, images, 500)
    assert aoanet[-2:] == [difference(against["CIDEr-D"]), f"{difference(against['BLEU-4'])} |"]
    assert "on the 8 test photos of Flickr8k (Hodosh, Young & Hockenmaier, JAIR 2013), beam 3" in text
    assert "SPICE is unavailable" in text
    assert "- SAT soft `sat`: **not met (short on BLEU-1, BLEU-2, BLEU-3, BLEU-4)**: " in text
    assert "METEOR 24.12 vs 20.30" in text and "- SAT hard `sat-hard`: not measured" in text
    assert "- AoANet `aoanet`: **met**: ΔCIDEr-D +" in text and "- X-LAN `xlan`: **not met**" in text
    assert "- `xtransformer`: not shipped yet" in text
    assert "The best model (by CIDEr-D) at CIDEr-D ≥ 70 and BLEU-4 ≥ 26: AoANet `aoanet`, **met**" in text
    if shutil.which("java") is not None:  # the same captions scored as coco-caption scores them, beside the table's
        assert "scored as coco-caption scores them (`captioner eval --ptb`)" in text
        table = text[text.index("| model | BLEU-4 | CIDEr-D | BLEU-4, PTB − above"):].split("\n\n")[0]
        assert [row.split(" | ")[0][2:] for row in table.splitlines()[2:]] == [
            "SAT soft `sat`", "AoANet `aoanet`", "X-LAN `xlan`"]
    assert "<!-- zoo-f8k:start -->" in capsys.readouterr().out
    main(args)
    assert document.read_text() == text  # the same inputs write the same section


def test_without_java_the_ptb_scores_are_said_to_be_missing(zoo, monkeypatch):
    """The PTB tokenizer needs Java; the table's own scores do not: without Java the table is made, and says what it
    leaves out."""
    args, _, _, document = zoo
    monkeypatch.setenv("PATH", "/nonexistent")
    main(args)
    assert "its PTB tokenizer): not here, where there is no Java to run it." in document.read_text()


def test_the_section_refuses_what_it_cannot_measure(zoo, tmp_path):
    args, _, _, _ = zoo

    def refused(argv: list[str], message: str) -> None:
        with pytest.raises(SystemExit, match=r"^error: .*" + message):
            main(argv)

    at, weights_at = args.index("--dataset"), args.index("--weights-dir")
    refused(args[:at] + args[at + 2:], "the paired bootstrap scores the captions against the references: pass "
            "--dataset")
    empty = tmp_path / "no_test.json"
    empty.write_text(json.dumps({"dataset": "flickr8k", "images": [
        {"imgid": 99, "split": "train", "filename": "99.jpg", "sentences": [{"tokens": ["a", "dog"]}]}]}))
    refused([*args[:at + 1], str(empty), *args[at + 2:]], r"split 'test' of .*no_test\.json is empty")
    refused([*args[:weights_at + 1], str(tmp_path / "none"), *args[weights_at + 2:]],
            r"none is not a folder of checkpoints")


def test_a_rows_cells_are_its_scores_times_100_and_its_differences_from_the_baseline():
    split = {"images": 8, "BLEU-1": 0.61234, "BLEU-2": 0.4, "BLEU-3": 0.3, "BLEU-4": 0.2, "METEOR": 0.19876,
             "ROUGE-L": 0.45, "CIDEr-D": 0.5, "SPICE": 0.123, "REP": 1.5, "distinct_words": 42, "novel_captions": 0.25,
             "mean_length": 9.04}
    row = {"name": "xlan", "title": "X-LAN `xlan`", "split": split, "CIDEr-D interval": (0.4, 0.61),
           "against baseline": {"CIDEr-D": {"difference": 0.0321, "ci95": [0.011, 0.054]},
                                "BLEU-4": {"difference": -0.03, "ci95": [-0.05, -0.012]}}}
    assert model_row(row, "sat") == ("| X-LAN `xlan` | 61.2 | 40.0 | 30.0 | 20.0 | 19.88 | 45.0 | 50.0 [40.0, 61.0] | "
                                     "12.3 | 1.50 | 42 | 25.0 % | 9.0 | +3.2 [+1.1, +5.4] † | -3.0 [-5.0, -1.2] † |")
    assert model_row({**row, "name": "sat"}, "sat").endswith(" | 9.0 | — | — |")
    assert difference({"difference": 0.01, "ci95": [-0.01, 0.03]}) == "+1.0 [-1.0, +3.0]"
    assert difference({"difference": 0.5, "ci95": [0.4, 0.6]}) == "+50.0 [+40.0, +60.0] †"  # × 100, not rounded away
    # a report older than a measure says nothing of it
    assert model_row({"name": "old", "title": "O", "split": {"images": 8}}, "sat") == \
        "| O | — | — | — | — | — | — | — | unavailable | — | — | — | — | — | — |"


def test_the_floors_are_met_at_their_numbers_and_need_both_differences_above_zero():
    def stat(value, low, high):
        return {"difference": value, "ci95": [low, high]}

    at_paper = {"BLEU-1": 0.67, "BLEU-2": 0.457, "BLEU-3": 0.314, "BLEU-4": 0.213, "METEOR": 0.2030, "CIDEr-D": 0.6}
    no_meteor = {key: value for key, value in at_paper.items() if key not in ("METEOR", "CIDEr-D")}
    rows = [{"name": "sat", "title": "S `sat`", "split": at_paper},
            {"name": "sat-supervised", "title": "SS `sat-supervised`", "split": no_meteor},
            {"name": "aoanet", "title": "A `aoanet`", "split": {"CIDEr-D": 0.69, "BLEU-4": 0.3},
             "against baseline": {"CIDEr-D": stat(0.05, 0.02, 0.08), "BLEU-4": stat(0.01, -0.01, 0.03)}},
            {"name": "xlan", "title": "X `xlan`", "split": {"CIDEr-D": 0.5, "BLEU-4": 0.2},
             "against baseline": {"CIDEr-D": stat(-0.05, -0.08, -0.02), "BLEU-4": stat(-0.02, -0.03, -0.01)}},
            {"name": "xtransformer", "title": "XT `xtransformer`", "split": None},
            {"name": "ensemble", "title": "E `ensemble`", "split": {"CIDEr-D": 0.70, "BLEU-4": 0.26}}]
    lines = floor_lines(rows, "sat")
    assert lines[0] == "Floors (issue): each SAT checkpoint at least the paper's hard-attention row (Xu et al. 2015, " \
                       "hard attention) on BLEU-1..4 and METEOR:"
    assert "Each of AoANet, X-LAN and X-Transformer above `sat` on CIDEr-D and BLEU-4, both 95 % intervals excluding " \
           "0:" in lines
    bleu = "BLEU-1 67.00 vs 67, BLEU-2 45.70 vs 45.7, BLEU-3 31.40 vs 31.4, BLEU-4 21.30 vs 21.3"
    assert f"- S `sat`: **met**: {bleu}, METEOR 20.30 vs 20.30" in lines  # at the paper's numbers: met
    assert f"- SS `sat-supervised`: **not met (short on METEOR)**: {bleu}, METEOR — vs 20.30" in lines
    assert "- `sat-hard`: not shipped yet" in lines
    assert "- A `aoanet`: **not met**: ΔCIDEr-D +5.0 [+2.0, +8.0] †, ΔBLEU-4 +1.0 [-1.0, +3.0]" in lines
    assert "- X `xlan`: **not met**: ΔCIDEr-D -5.0 [-8.0, -2.0] †, ΔBLEU-4 -2.0 [-3.0, -1.0] †" in lines
    assert "- XT `xtransformer`: not measured" in lines
    assert lines[-1] == "The best model (by CIDEr-D) at CIDEr-D ≥ 70 and BLEU-4 ≥ 26: E `ensemble`, **met**: CIDEr-D " \
                        "70.00, BLEU-4 26.00."
    rows[-1]["split"] = {"CIDEr-D": 0.69951, "BLEU-4": 0.26}  # 69.95 after the reports' rounding: short of 70
    assert floor_lines(rows, "sat")[-1].endswith("E `ensemble`, **not met**: CIDEr-D 69.95, BLEU-4 26.00.")
    assert "- A `aoanet`: no baseline to compare with (`sat`: not shipped yet)" in floor_lines(rows[1:], "sat")


def test_the_ptb_table_shows_each_rows_shift_from_the_tables_scores():
    measured = {"name": "xlan", "title": "X `xlan`", "split": {"BLEU-4": 0.2, "CIDEr-D": 1.0},
                "ptb": {"BLEU-4": 0.25, "CIDEr-D": 0.9}}
    assert ptb_lines([measured])[-3:] == ["| model | BLEU-4 | CIDEr-D | BLEU-4, PTB − above | CIDEr-D, PTB − above |",
                                          "|---|---:|---:|---:|---:|", "| X `xlan` | 25.0 | 90.0 | +5.00 | -10.00 |"]
    assert ptb_lines([{"name": "sat", "title": "S `sat`", "split": None}]) == []
    assert "no Java to run it" in ptb_lines([{key: measured[key] for key in ("name", "title", "split")}])[0]


@pytest.mark.skipif(shutil.which("java") is None, reason="the PTB tokenizer needs Java")
def test_the_ptb_scores_are_against_the_raw_references(tmp_path):
    """coco-caption scores against a data set's raw references (through the PTB tokenizer), not the project's tokens
    of them: here the tokens say something else, and the captions are the raw texts word for word."""
    images = [{"imgid": i, "split": "test", "filename": f"{i}.jpg",
               "sentences": [{"tokens": "a picture of something here".split(), "raw": refs[0]}]}
              for i, refs in enumerate(SCENES)]
    (tmp_path / "dataset_flickr8k.json").write_text(json.dumps({"dataset": "flickr8k", "images": images}))
    rows = [{"name": "exact"}]
    add_ptb_scores(rows, load_karpathy(tmp_path / "dataset_flickr8k.json", splits=("test",)), TEST_IDS,
                   {"exact": EXACT})
    assert rows[0]["ptb"]["BLEU-4"] == pytest.approx(1.0)


def test_rows_follow_the_table_order_then_the_others_by_name():
    shipped = ["sat", "sat-supervised", "sat-hard", "aoanet", "xlan", "xtransformer", "sparsecap-softmax",
               "sparsecap-sparsemax", "sparsecap-tvmax", "area-transformer", "ensemble"]
    others = ["zeta", "alpha", "mu", "beta", "omega", "kappa"]
    assert ordered_names({*others, *shipped}) == [*shipped, *sorted(others)]
    table = markdown([{"name": "kappa", "title": "K", "split": None}], "sat", "test", Path("results"))
    assert table[1] == "|---|" + "---:|" * 14  # Markdown's rule under the head: the model column left, scores right
    assert [line.split(" | ")[0][2:] for line in table[2:5]] == [
        "*Xu et al. 2015, soft attention (paper)*", "*Xu et al. 2015, hard attention (paper)*", "K: not measured"]


def test_a_checkpoint_title_comes_from_its_config():
    config = {"arch": "sparsecap", "model": {"attention": "tvmax"}, "meta": {"phase": "scst"}}
    assert title("sparsecap-tvmax", config) == "SparseCap (TVmax) + SCST `sparsecap-tvmax`"
    assert [title(name, {"arch": "sparsecap", "model": {"attention": name[10:]}})
            for name in ("sparsecap-softmax", "sparsecap-sparsemax")] == [
        "SparseCap (softmax) `sparsecap-softmax`", "SparseCap (sparsemax) `sparsecap-sparsemax`"]
    assert title("sat", {"arch": "sat"}) == "SAT soft `sat`"
    supervised = {"arch": "sat", "meta": {"train_config": {"attention_supervision": "entities:DIR"}}}
    assert title("sat-supervised", supervised) == "SAT soft, supervised attention `sat-supervised`"
    ensemble = {"arch": "ensemble", "meta": {"ensemble_of": [{"name": "sat"}, {"name": "aoanet"}]}}
    assert title("ensemble", ensemble) == "Ensemble of `sat` + `aoanet` `ensemble`"
    assert title("old", None) == "`old`"  # a report without its checkpoint


def test_without_reports_nothing_needs_the_data_set(tmp_path):
    weights = tmp_path / "weights"
    write_checkpoint(weights, "sat", "sat")
    main(["zoo-f8k", "--weights-dir", str(weights), "--results", str(tmp_path / "none"),
          "--document", str(tmp_path / "doc.md")])
    text = (tmp_path / "doc.md").read_text()
    assert "SAT soft `sat`: not measured" in text
    assert "\nThe best model (by CIDEr-D) at CIDEr-D ≥ 70 and BLEU-4 ≥ 26: no checkpoint measured yet.\n" in text
    assert "Every model row is `captioner eval` on the test photos of Flickr8k (" in text  # no report: no count
    # the paper's rows stand whether or not their checkpoint is shipped; no measured row, no PTB sentence
    assert "| *Xu et al. 2015, hard attention (paper)* |" in text and "PTB" not in text
    assert "- AoANet `aoanet`" not in text and "- `aoanet`: not shipped yet" in text


def test_a_report_without_its_checkpoint_is_a_measured_row_of_its_own(zoo):
    """``collect_rows``' promise, a row "per report ``NAME.json`` without [a checkpoint]": a model measured and then
    removed from the weights folder (or never downloaded there) keeps its numbers in the table, under its bare name,
    rather than leaving the table without a word, its floors then calling it "not shipped yet"."""
    args, weights, _, document = zoo
    shutil.rmtree(weights / "xlan")
    main(args)
    text = document.read_text()
    table = text.split("Paper rows:")[0]
    [row] = [line for line in table.splitlines() if line.startswith("| `xlan` |")]
    assert "not measured" not in row and row.endswith(" | +0.0 [+0.0, +0.0] | +0.0 [+0.0, +0.0] |")
    assert "- `xlan`: **not met**: ΔCIDEr-D +0.0 [+0.0, +0.0], ΔBLEU-4 +0.0 [+0.0, +0.0]" in text


@pytest.mark.parametrize("break_it, message", [
    (lambda r: (r / "captions" / "xlan.json").write_text(json.dumps([{"image_id": i, "caption": "a man"}
                                                                      for i in TEST_IDS[1:] + [42]])),
     r"captions/xlan\.json: its image ids do not match the 8 images of the 'test' split \(1 missing, 1 not in it"),
    (lambda r: (r / "captions" / "xlan.json").unlink(), r"captions/xlan\.json is missing"),
    (lambda r: write_results(r, "xlan", GENERIC, beam_size=5), r"xlan\.json was decoded with beam 5, not 3"),
    (lambda r: write_results(r, "xlan", GENERIC, decoding={"length_penalty": 1.0, "block_trigrams": False}),
     r"xlan\.json was decoded with .*not the checkpoint's defaults"),
    # a report decoded with a rule the checkpoint's defaults leave off
    (lambda r: write_results(r, "xlan", GENERIC, decoding={"length_penalty": 0.0, "block_trigrams": False,
                                                           "block_doubled_words": True}),
     r"xlan\.json was decoded with .*not the checkpoint's defaults"),
    (lambda r: (r / "captions" / "xlan.json").write_text(json.dumps([{"image_id": i, "caption": EXACT[i]}
                                                                      for i in TEST_IDS])),
     r"xlan\.json scores CIDEr-D .* not the captions of that report"),
    (lambda r: (r / "xlan.json").write_text("{not json"), r"xlan\.json is not a `captioner eval` report \(not JSON"),
    (lambda r: (r / "xlan.json").write_text("[1]"), r"xlan\.json is not a `captioner eval` report with a 'test' split"),
    (lambda r: edit_split(r, "xlan", lambda test: test.pop("images")),
     r"xlan\.json is not a `captioner eval` report with a 'test' split"),
    (lambda r: edit_split(r, "xlan", lambda test: test.update(images=7)),
     r"captions/xlan\.json: its image ids do not match .*\(0 missing, 0 not in it; the report scores 7\)"),
    # off by more than the report's rounding
    (lambda r: edit_split(r, "xlan", lambda test: test.update({"CIDEr-D": test["CIDEr-D"] + 0.0008})),
     r"xlan\.json scores CIDEr-D .* not the captions of that report"),
])
def test_bad_input_is_a_one_line_error(zoo, break_it, message):
    args, _, results, _ = zoo
    break_it(results)
    with pytest.raises(SystemExit, match=r"^error: .*" + message) as raised:
        main(args)
    assert "\n" not in str(raised.value)


def test_decoding_rules_are_checked_only_of_a_report_that_records_them_against_its_checkpoint(tmp_path):
    """A report without its checkpoint has no defaults to hold its rules to, and one written before reports
    recorded their rules has none to compare: both are read, not refused."""
    write_results(tmp_path, "xlan", GENERIC, decoding={"length_penalty": 1.0, "block_trigrams": True})
    assert read_report(tmp_path / "xlan.json", "test", None)["images"] == len(TEST_IDS)
    report = json.loads((tmp_path / "xlan.json").read_text())
    del report["decoding"]
    (tmp_path / "xlan.json").write_text(json.dumps(report))
    config = {"arch": "xlan", "meta": {"decoding": {"length_penalty": 0.5, "block_trigrams": True}}}
    assert read_report(tmp_path / "xlan.json", "test", config)["images"] == len(TEST_IDS)


def test_the_sections_own_default_is_the_commands_2000_resamples(tmp_path, monkeypatch):
    """test_shipped_results.py writes the section without a number of resamples to match what `make zoo-f8k` wrote
    with the command's default: the two are the same 2,000."""
    drawn = []
    monkeypatch.setattr(zoo_f8k, "collect_rows", lambda *args: drawn.append(args[-1]) or [])
    write_f8k_section(tmp_path / "weights", tmp_path / "results", tmp_path / "doc.md")
    assert drawn == [2000]


def test_a_report_of_other_weights_than_the_checkpoints_is_refused(zoo):
    """A report records the sha256 of the weights it scored: the table would otherwise print another model's
    numbers under this checkpoint's name (a checkpoint retrained in place, its report not made again)."""
    args, weights, results, _ = zoo
    (weights / "xlan" / "manifest.json").write_text(json.dumps(
        {"files": {"model.safetensors": {"sha256": "1" * 64, "bytes": 1}}}))
    report = json.loads((results / "xlan.json").read_text())
    (results / "xlan.json").write_text(json.dumps({**report, "weights_sha256": "1" * 64}))
    main(args)  # the same weights: measured
    (results / "xlan.json").write_text(json.dumps({**report, "weights_sha256": "2" * 64}))
    with pytest.raises(SystemExit, match=r"^error: .*xlan\.json scores weights/flickr8k/xlan, whose weights are not "):
        main(args)
