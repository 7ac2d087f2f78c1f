"""The shipped real-photo checkpoints still write the captions their reports scored: ``captioner eval``'s code, on
the first batch of Flickr8k ``test`` photos, gives each checkpoint of ``weights/flickr8k/`` the captions committed in
``docs/results/flickr8k/captions/NAME.json`` (``--results-json`` of the run its card quotes).

A change to a model, the beam search, the decoding rules, the encoder or the preprocessing that moves a single
caption of a shipped model fails here, on real photos, where the unit tests' tiny models cannot tell; a change
that is meant to move them (retrained weights, a new rule) scores them again (``captioner eval … --output
docs/results/flickr8k/NAME.json --results-json docs/results/flickr8k/captions/NAME.json``, as ``make ship-f8k-NAME``
does) and commits the report, the card and the captions together.  The photos are read from
``../shared/data/flickr8k`` (never committed): without it the test skips."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from captioner.models.evaluation.report import evaluation_report

from .conftest import FLICKR8K_DIR as FLICKR8K, ROOT, module_folder

CAPTIONS = ROOT / "docs" / "results" / "flickr8k" / "captions"
#: ``captioner eval`` captions 50 photos at a time (models/evaluation/evaluate.py): the first 50 are decoded in the
#: same batch as when the report was made, so the comparison is exact rather than up to batch-size rounding
PHOTOS = 50
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
    rows = json.loads((CAPTIONS / f"{checkpoint.name}.json").read_text())
    committed = {row["image_id"]: row["caption"] for row in rows}
    written = evaluation_report(checkpoint, FLICKR8K / "dataset_flickr8k.json", ["test"],
                                image_root=FLICKR8K / "images", limit=PHOTOS, meteor=False, cache_dir=feature_cache,
                                device="cpu", progress=False)
    assert len(written.coco_results) == PHOTOS
    differing = [(row["image_id"], row["caption"], committed.get(row["image_id"])) for row in written.coco_results
                 if row["caption"] != committed.get(row["image_id"])]
    assert not differing, f"{checkpoint.name}: (image id, caption now, caption committed) {differing}"
