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
from captioner.models.evaluation.bootstrap import percentile_interval, resample_counts, resampled_ratios
from captioner.models.evaluation.compare import bleu_4, bleu_statistics, compare_captions, corpus_bleu, \
    paired_corpus_difference
from captioner.models.evaluation.metrics import score_captions
from captioner.models.evaluation.zoo_f8k import title
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
    args, _, _, document = zoo
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
    sat, _, _, hard_paper, aoanet, xlan = (row.split(" | ") for row in rows)
    assert sat[5] == "24.12" and sat[8] == "unavailable" and sat[9:13] == ["1.23", "17", "87.5 %", "6.2"]
    assert sat[-2:] == ["—", "— |"]  # the baseline has no difference from itself
    assert hard_paper[1:6] == ["67", "45.7", "31.4", "21.3", "20.30"]
    assert aoanet[1] == "100.0" and aoanet[-2].endswith("†") and aoanet[-1].endswith("† |")
    assert xlan[-2:] == ["+0.0 [+0.0, +0.0]", "+0.0 [+0.0, +0.0] |"]  # the same captions as sat: no †
    low, high = (float(v) for v in aoanet[7].split(" [")[1].rstrip("]").split(", "))
    assert low <= float(aoanet[7].split(" [")[0]) <= high
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


def test_a_checkpoint_title_comes_from_its_config():
    config = {"arch": "sparsecap", "model": {"attention": "tvmax"}, "meta": {"phase": "scst"}}
    assert title("sparsecap-tvmax", config) == "SparseCap (TVmax) + SCST `sparsecap-tvmax`"
    assert title("sat", {"arch": "sat"}) == "SAT soft `sat`"
    supervised = {"arch": "sat", "meta": {"train_config": {"attention_supervision": "entities:DIR"}}}
    assert title("sat-supervised", supervised) == "SAT soft, supervised attention `sat-supervised`"


def test_without_reports_nothing_needs_the_data_set(tmp_path):
    weights = tmp_path / "weights"
    write_checkpoint(weights, "sat", "sat")
    main(["zoo-f8k", "--weights-dir", str(weights), "--results", str(tmp_path / "none"),
          "--document", str(tmp_path / "doc.md")])
    text = (tmp_path / "doc.md").read_text()
    assert "SAT soft `sat`: not measured" in text and "no checkpoint measured yet" in text
    assert "- AoANet `aoanet`" not in text and "- `aoanet`: not shipped yet" in text


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
])
def test_bad_input_is_a_one_line_error(zoo, break_it, message):
    args, _, results, _ = zoo
    break_it(results)
    with pytest.raises(SystemExit, match=r"^error: .*" + message) as raised:
        main(args)
    assert "\n" not in str(raised.value)


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
