import json
import math

import numpy as np
from PIL import Image

from captioner.models.data.karpathy import load_karpathy
from captioner.models.data.scenes import COLOURS, HELDOUT_COMBOS, SHAPES, generate, named_objects, object_naming_accuracy


def test_generation_is_deterministic(tmp_path, scenes):
    again = generate(tmp_path / "again", {"train": 48, "val": 12, "test": 12, "heldout": 12}, seed=7, progress=False)
    first, second = json.loads(scenes.read_text()), json.loads(again.read_text())
    assert first == second
    for entry in first["images"][:10]:
        a = np.asarray(Image.open(scenes.parent / "images" / entry["filename"]))
        b = np.asarray(Image.open(again.parent / "images" / entry["filename"]))
        assert np.array_equal(a, b)


def test_other_seed_gives_other_scenes(tmp_path, scenes):
    other = generate(tmp_path / "other", {"train": 8}, seed=8, progress=False)
    assert json.loads(other.read_text())["images"][0]["objects"] != json.loads(scenes.read_text())["images"][0]["objects"]


def test_masks_match_objects(scenes):
    data = json.loads(scenes.read_text())
    for entry in data["images"]:
        mask = np.asarray(Image.open(scenes.parent / entry["mask"]))
        image = np.asarray(Image.open(scenes.parent / "images" / entry["filename"])).astype(int)
        assert set(np.unique(mask)) == set(range(len(entry["objects"]) + 1))
        for index, obj in enumerate(entry["objects"]):
            x, y = obj["center"]
            assert mask[int(round(y)), int(round(x))] == index + 1, "object centre lies inside its mask"
            pixels = mask == index + 1
            ys, xs = np.nonzero(pixels)
            assert abs(xs.mean() - x) < obj["radius"] * 0.5 and abs(ys.mean() - y) < obj["radius"] * 0.5
            assert pixels.sum() < math.pi * (obj["radius"] + 1.5) ** 2  # inside the circumcircle
            # the pixels under the mask have the object's colour (JPEG and jitter allow some slack)
            mean_colour = image[pixels].mean(0)
            assert np.abs(mean_colour - np.array(COLOURS[obj["colour"]])).max() < 45


def test_captions_name_objects_and_ground_words(scenes):
    for entry in json.loads(scenes.read_text())["images"]:
        assert len(entry["sentences"]) == 5
        assert len({" ".join(s["tokens"]) for s in entry["sentences"]}) == 5, "five different wordings"
        for sentence in entry["sentences"]:
            assert len(sentence["tokens"]) == len(sentence["token_objects"])
            for word, ids in zip(sentence["tokens"], sentence["token_objects"]):
                for i in ids:
                    obj = entry["objects"][i]
                    if word in COLOURS:
                        assert word == obj["colour"]
                    if word.rstrip("s").rstrip("e") in SHAPES or word in SHAPES:
                        assert word.startswith(obj["shape"])
        assert all(named_objects(entry["sentences"][0]["tokens"], entry["objects"]))


def test_heldout_combinations_only_in_heldout_split(scenes):
    for entry in json.loads(scenes.read_text())["images"]:
        combos = {(o["colour"], o["shape"]) for o in entry["objects"]}
        if entry["split"] == "heldout":
            assert combos & HELDOUT_COMBOS
        else:
            assert not combos & HELDOUT_COMBOS


def test_loader_reads_generated_dataset(scenes):
    train = load_karpathy(scenes, splits=("train",))
    assert len(train) == 48 and all(im.path.exists() for im in train)
    assert all(len(im.references) == 5 for im in train)


def test_object_naming_accuracy():
    objects = [{"colour": "red", "shape": "circle"}, {"colour": "blue", "shape": "square"},
               {"colour": "blue", "shape": "square"}]
    assert object_naming_accuracy([("a red circle and two blue squares".split(), objects)]) == 1.0
    assert object_naming_accuracy([("a red square and two blue circles".split(), objects)]) == 0.0
    assert object_naming_accuracy([("a red circle".split(), objects)]) == 1 / 3
