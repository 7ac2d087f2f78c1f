"""``captioner resolution-check``: the originals of a split's photos against the data set's small copies, captioned
by the service's own preprocessing and scored against the same references."""

import json

import numpy as np
import pytest
from PIL import Image
from skimage import data

from captioner.models.data.karpathy import load_karpathy
from captioner.models.evaluation.resolution import resolution_check
from captioner.models.pipeline import Pipeline

from .conftest import ROOT


def test_originals_are_matched_by_name_and_scored_beside_their_copies(tmp_path):
    copies, originals = tmp_path / "copies", tmp_path / "full"
    copies.mkdir()
    originals.mkdir()
    photos = {"cat.jpg": data.chelsea(), "astronaut.jpg": data.astronaut(), "coffee.jpg": data.coffee()}
    entries = []
    for i, (name, pixels) in enumerate(photos.items()):
        image = Image.fromarray(pixels)
        image.resize((224, 224)).save(copies / name)  # squashed, like the public Flickr8k copies
        if name != "coffee.jpg":  # one photo has no original: it is left out
            image.save(originals / name)
        # COCO's Karpathy JSON: a cocoid, which results files (and the bootstrap) key the images by
        entries.append({"filename": name, "imgid": i, "cocoid": 391895 + i, "split": "test",
                        "sentences": [{"tokens": ["a", "photo", "of", name[:-4]]}]})
    (tmp_path / "dataset.json").write_text(json.dumps({"dataset": "tiny", "images": entries}))
    # a model trained on photos, whose captions see the squashing (a tiny random one captioned both sides alike)
    pipeline = Pipeline(ROOT / "weights" / "flickr8k" / "sat-supervised")
    images = load_karpathy(tmp_path / "dataset.json", copies, ("test",))
    report = resolution_check(pipeline, images, originals, beam_size=2, max_len=5)
    assert report["images"] == 2 and report["copies"].keys() == report["originals"].keys()

    # each side's captions made here, apart from the check: the originals were read (captioning the copies twice
    # passed every other assertion of this test)
    names = ("cat.jpg", "astronaut.jpg")
    made = {side: [r.caption for r in pipeline([folder / name for name in names], beam_size=2, max_len=5)]
            for side, folder in (("copy", copies), ("original", originals))}
    assert report["examples"] == [{"image": name, "copy": copy, "original": original}
                                  for name, copy, original in zip(names, made["copy"], made["original"])
                                  if copy != original]
    assert report["examples"] and report["same_caption"] == 2 - len(report["examples"])
    bleu = report["originals_minus_copies"]["BLEU-4"]
    assert round(bleu["difference"], 4) == pytest.approx(round(report["originals"]["BLEU-4"]
                                                               - report["copies"]["BLEU-4"], 4), abs=1e-4)
    assert report["originals_minus_copies"]["CIDEr-D"]["difference"] == \
        report["originals_minus_copies"]["CIDEr-D"]["a"] - report["originals_minus_copies"]["CIDEr-D"]["b"]
    # the same files on both sides: the same captions, no difference
    same = resolution_check(pipeline, images, copies, beam_size=2, max_len=5)
    assert same["same_caption"] == same["images"] == 3 and same["originals_minus_copies"]["BLEU-4"]["difference"] == 0
    assert np.isclose(same["originals_minus_copies"]["CIDEr-D"]["difference"], 0.0)
