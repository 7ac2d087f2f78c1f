"""The shipped generated-scene checkpoints still write the captions their reports scored, and the reports' numbers are
those captions' scores, as tests/test_shipped_results.py holds the real-photo ones: each checkpoint of ``weights/``
(the ``scenes-NAME`` models) captions the first 50 test scenes with ``captioner eval``'s code as committed in
``docs/results/captions/NAME.json``, and those captions score, against the scenes' references, what
``docs/results/NAME.json`` says on every split they cover (``test``; ``heldout`` too where the run wrote its
captions).  The scenes are drawn again here (``captioner data generate --only test heldout``, about ten seconds of
one core): a generator change that moved an image or a reference fails too, as the reports would no longer be the
scenes `make data` writes.  METEOR is left out (it needs Java); the out-of-distribution reports keep no captions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from captioner.models.data.datasets import load_split
from captioner.models.data.scenes import DEFAULT_SIZES, generate
from captioner.models.evaluation.compare import read_results, result_id
from captioner.models.evaluation.evaluate import score_dataset
from captioner.models.evaluation.metrics import reported

from .conftest import ROOT, module_folder
from .shipped_reports import captions_unlike_the_committed

REPORTS = ROOT / "docs" / "results"
CAPTIONS = REPORTS / "captions"
CHECKPOINTS = sorted(path.parent for path in (ROOT / "weights").glob("*/model.safetensors"))
#: what the scene reports score besides METEOR (Java), SPICE (unavailable) and grounding (tests/test_grounding.py)
MEASURES = ("BLEU-1", "BLEU-2", "BLEU-3", "BLEU-4", "ROUGE-L", "CIDEr-D", "objects_named")


def test_every_shipped_scene_checkpoint_has_its_report_and_captions():
    assert CHECKPOINTS, "no checkpoint under weights/: the tests below would pass on nothing"
    names = [path.name for path in CHECKPOINTS]
    assert sorted(path.stem for path in CAPTIONS.glob("*.json")) == names
    assert all((REPORTS / f"{name}.json").is_file() for name in names)


@pytest.fixture(scope="module")
def drawn_scenes(request, tmp_path_factory) -> Path:
    """The test and held-out scenes of `make data`'s data set (its default sizes and seed), drawn again."""
    return generate(module_folder(request, tmp_path_factory, "scenes"), DEFAULT_SIZES, only=("test", "heldout"),
                    progress=False)


@pytest.fixture(scope="module")
def scene_splits(drawn_scenes: Path) -> dict[str, list]:
    """Those scenes by split, read once for every checkpoint."""
    return {split: load_split(drawn_scenes, drawn_scenes.parent, split) for split in ("test", "heldout")}


@pytest.fixture(scope="module")
def feature_cache(request, tmp_path_factory) -> Path:
    """One feature cache for the module: checkpoints of one encoder spec extract the scenes' grids once."""
    return module_folder(request, tmp_path_factory, "scene-features")


@pytest.mark.parametrize("checkpoint", CHECKPOINTS, ids=[path.name for path in CHECKPOINTS])
def test_the_checkpoint_writes_the_captions_of_its_report(checkpoint: Path, drawn_scenes: Path,
                                                          feature_cache: Path):
    differing = captions_unlike_the_committed(checkpoint, CAPTIONS / f"{checkpoint.name}.json", drawn_scenes,
                                              drawn_scenes.parent, feature_cache)
    assert not differing, f"{checkpoint.name}: (image id, caption now, caption committed) {differing}"


@pytest.mark.parametrize("checkpoint", CHECKPOINTS, ids=[path.name for path in CHECKPOINTS])
def test_the_reports_scores_are_its_captions_scores(checkpoint: Path, scene_splits: dict[str, list]):
    report = json.loads((REPORTS / f"{checkpoint.name}.json").read_text())
    by_id = read_results(CAPTIONS / f"{checkpoint.name}.json")
    scored = 0
    for split, images in scene_splits.items():
        covered = [result_id(im) in by_id for im in images]
        if split == "heldout" and not any(covered):
            continue  # this run wrote the test split's captions only
        assert all(covered), f"the captions miss {covered.count(False)} of the {split} scenes"
        captions = {im.image_id: by_id[result_id(im)].split() for im in images}
        scores = reported(score_dataset(captions, images, ("BLEU", "ROUGE-L", "CIDEr-D")))
        assert report[split]["images"] == len(images)
        assert {name: scores[name] for name in MEASURES} == {name: report[split][name] for name in MEASURES}, split
        scored += len(images)
    assert len(by_id) == scored, "the captions hold scenes of no split the report scores"
