"""The shipped real-photo checkpoints still write the captions their reports scored, and the reports' numbers are
those captions' scores: ``captioner eval``'s code, on the first batch of Flickr8k ``test`` photos, gives each
checkpoint of ``weights/flickr8k/`` the captions committed in ``docs/results/flickr8k/captions/NAME.json``
(``--results-json`` of the run its card quotes); the 1,000 committed captions score, against the photos'
references, what ``docs/results/flickr8k/NAME.json`` (the card's test row, tests/test_shipped_cards.py) says; and
``docs/model_zoo.md``'s Flickr8k section is what ``make zoo-f8k`` writes from those reports and captions today.

A change to a model, the beam search, the decoding rules, the encoder or the preprocessing that moves a single
caption of a shipped model fails here, on real photos, where the unit tests' tiny models cannot tell; a change
that is meant to move them (retrained weights, a new rule) scores them again (``captioner eval … --output
docs/results/flickr8k/NAME.json --results-json docs/results/flickr8k/captions/NAME.json``, as ``make ship-f8k-NAME``
does) and commits the report, the card and the captions together.  The photos are read from
``../shared/data/flickr8k`` (never committed): without it the test skips."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from captioner.models.data.datasets import load_split, train_split_captions
from captioner.models.evaluation.compare import result_id
from captioner.models.evaluation.evaluate import score_dataset
from captioner.models.evaluation.metrics import reported
from captioner.models.evaluation.compare import read_results
from captioner.models.evaluation.zoo_f8k import read_report, write_f8k_section

from .conftest import FLICKR8K_DIR as FLICKR8K, ROOT, module_folder
from .shipped_reports import captions_unlike_the_committed

REPORTS = ROOT / "docs" / "results" / "flickr8k"
CAPTIONS = REPORTS / "captions"
CHECKPOINTS = sorted(path.parent for path in (ROOT / "weights" / "flickr8k").glob("*/model.safetensors"))

pytestmark = pytest.mark.skipif(not (FLICKR8K / "dataset_flickr8k.json").is_file(),
                                reason="../shared/data/flickr8k is not here")


def test_every_shipped_real_photo_checkpoint_has_its_captions():
    assert CHECKPOINTS, "no checkpoint under weights/flickr8k: the test below would pass on nothing"
    assert sorted(path.stem for path in CAPTIONS.glob("*.json")) == [path.name for path in CHECKPOINTS]


@pytest.fixture(scope="module")
def feature_cache(request, tmp_path_factory) -> Path:
    """One feature cache for the module: checkpoints of one encoder spec extract the photos' grids once."""
    return module_folder(request, tmp_path_factory, "flickr8k-features")


@pytest.mark.parametrize("checkpoint", CHECKPOINTS, ids=[path.name for path in CHECKPOINTS])
def test_the_checkpoint_writes_the_captions_of_its_report(checkpoint: Path, feature_cache: Path):
    differing = captions_unlike_the_committed(checkpoint, CAPTIONS / f"{checkpoint.name}.json",
                                              FLICKR8K / "dataset_flickr8k.json", FLICKR8K / "images", feature_cache)
    assert not differing, f"{checkpoint.name}: (image id, caption now, caption committed) {differing}"


@pytest.fixture(scope="module")
def test_split():
    """Flickr8k's test photos with their references, and the training captions (for the share of novel ones)."""
    dataset, images = FLICKR8K / "dataset_flickr8k.json", FLICKR8K / "images"
    return load_split(dataset, images, "test"), train_split_captions(dataset, images)


@pytest.mark.parametrize("checkpoint", CHECKPOINTS, ids=[path.name for path in CHECKPOINTS])
def test_the_reports_scores_are_its_captions_scores(checkpoint: Path, test_split):
    images, training_captions = test_split
    by_id = read_results(CAPTIONS / f"{checkpoint.name}.json")
    assert sorted(by_id) == sorted(result_id(im) for im in images), "the captions are not one per test photo"
    captions = {im.image_id: by_id[result_id(im)].split() for im in images}
    # METEOR is left out: it needs Java, which the other scores do not
    scores = score_dataset(captions, images, ("BLEU", "ROUGE-L", "CIDEr-D"), training_captions)
    report = read_report(REPORTS / f"{checkpoint.name}.json", "test", None)
    assert report["images"] == len(images)
    assert reported(scores) == {name: report[name] for name in scores}


@pytest.mark.skipif(shutil.which("java") is None, reason="the section's PTB table needs Java")
def test_the_model_zoo_section_is_what_make_zoo_f8k_writes(tmp_path: Path, monkeypatch):
    document = tmp_path / "model_zoo.md"
    shutil.copyfile(ROOT / "docs" / "model_zoo.md", document)
    monkeypatch.chdir(ROOT)  # the section names its reports' folder as the command is given it, from the checkout
    write_f8k_section(Path("weights/flickr8k"), Path("docs/results/flickr8k"), document,
                      FLICKR8K / "dataset_flickr8k.json", FLICKR8K / "images")
    assert document.read_text() == (ROOT / "docs" / "model_zoo.md").read_text(), (
        "docs/model_zoo.md's Flickr8k section is not what `make zoo-f8k` writes from the committed reports")
