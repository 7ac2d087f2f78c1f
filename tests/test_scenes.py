import argparse
import colorsys
import hashlib
import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from captioner.models.cli.data import cmd_data_generate
from captioner.models.data import scenes as scenes_module
from captioner.models.data.karpathy import load_karpathy
from captioner.models.data.scenes import BACKGROUNDS, COLOURS, DEFAULT_SIZES, GENERATOR_VERSION, HELDOUT_COMBOS, \
    SHAPES, SIZES, VARIATIONS, SceneObject, Variation, article, captions_for, dataset_header, describe_dataset, \
    generate, generate_arguments, is_current, named_objects, object_naming_accuracy, read_dataset_header, \
    sample_scene, sample_varied_canvas, split_indices
from captioner.models.files import write_atomically
from captioner.service.cli import main

from .conftest import SCENE_SEED, SCENE_SIZES


def test_generation_is_deterministic(tmp_path, scenes):
    # the session's data set is drawn in this process; two spawned worker processes draw the same scenes
    again = generate(tmp_path / "again", SCENE_SIZES, seed=SCENE_SEED, progress=False, workers=2)
    first, second = json.loads(scenes.read_text()), json.loads(again.read_text())
    assert first == second
    for entry in first["images"][:10]:
        a = np.asarray(Image.open(scenes.parent / "images" / entry["filename"]))
        b = np.asarray(Image.open(again.parent / "images" / entry["filename"]))
        assert np.array_equal(a, b)


def test_other_seed_gives_other_scenes(tmp_path, scenes):
    other = generate(tmp_path / "other", {"train": 8}, seed=8, progress=False)
    assert (json.loads(other.read_text())["images"][0]["objects"]
            != json.loads(scenes.read_text())["images"][0]["objects"])


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
        first = 5 * entry["imgid"]  # sentence ids unique over the data set
        assert entry["sentids"] == [s["sentid"] for s in entry["sentences"]] == list(range(first, first + 5))


def test_references_name_counts_places_and_order_as_the_scene_holds_them():
    def obj(shape, colour, x, y):
        return SceneObject(shape, colour, "small", x, y, 10.0)

    def texts(objects, canvas=(256, 256)):
        return [" ".join(w for w, _ in words) for words in captions_for(objects, "plain", random.Random(0), canvas)]

    wide = (300, 150)  # a place is a third of the canvas's own width or height
    assert texts([obj("circle", "red", 150, 75)], wide)[2] == "a red circle in the centre"
    assert texts([obj("circle", "red", 30, 75)], wide)[2] == "a red circle on the left"
    assert texts([obj("circle", "red", 270, 20)], wide)[2] == "a red circle in the top right"
    assert texts([obj("circle", "red", 100, 100)], wide)[2] == "a red circle in the centre"  # on the thirds' lines
    # the upper group first, though it is the one further right
    assert texts([obj("circle", "red", 100, 200), obj("square", "blue", 110, 50)])[2] == \
        "a blue square above a red circle"
    crowd = [obj("square", "blue", 20, 128), *(obj("circle", "red", x, 128) for x in (100, 150, 200))]
    listing = "a blue square and three red circles"
    wordings = texts(crowd)
    assert wordings[:4] == [listing, f"{listing} on a plain background",
                            "a blue square to the left of three red circles", f"there is {listing} in the picture"]
    assert wordings[4].startswith("four shapes ") and wordings[4].endswith(" a small blue square and three small red "
                                                                           "circles")
    pair = texts([obj("circle", "red", 50, 128), obj("circle", "red", 150, 128)])
    assert pair[0] == "two red circles" and pair[3] == "there are two red circles in the picture"
    assert texts([obj("circle", "red", 30, 128), obj("square", "blue", 128, 128), obj("star", "green", 220, 128)])[2] \
        == "a red circle and a blue square and a green star from left to right"
    assert texts([obj("circle", "red", 90, 75)], wide)[2] == "a red circle on the left"  # within the first third
    assert texts([obj("circle", "red", 150, 45)], wide)[2] == "a red circle at the top"
    assert texts([obj("circle", "red", 150, 50)], wide)[2] == "a red circle in the centre"  # on a third's line
    # the count's wording joins its listing with either word
    assert {captions_for(crowd, "plain", random.Random(seed))[4][2][0] for seed in range(20)} == {"with", "showing"}
    # groups in the order of their mean x (the red circles' is 125), not of their leftmost object
    assert texts([obj("circle", "red", 20, 128), obj("square", "blue", 100, 128), obj("circle", "red", 230, 128)])[0] \
        == "a blue square and two red circles"
    # "above" only where the groups lie apart more than 1.5 times as far up as across
    assert texts([obj("circle", "red", 100, 100), obj("square", "blue", 150, 160)])[2] == \
        "a red circle to the left of a blue square"


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
    assert object_naming_accuracy([]) == 0.0  # no objects: nothing named, not a ZeroDivisionError
    # a fraction of all objects, not a mean over images: one named of four
    assert object_naming_accuracy([("a red circle".split(), objects[:1]), ("nothing".split(), objects)]) == 1 / 4
    assert named_objects("a circle red".split(), objects[:1]) == [False]  # the colour before the shape


def test_the_documented_vocabulary_splits_and_default_sizes():
    """docs/decisions.md's "Generated scenes": 5 shapes × 6 colours × 2 sizes on four backgrounds, the five
    held-out pairs, 6000 / 500 / 500 / 500 scenes numbered split after split (a shipped checkpoint's test scenes are
    6500–6999)."""
    assert SHAPES == ("circle", "square", "triangle", "star", "diamond")
    assert list(COLOURS) == ["red", "green", "blue", "yellow", "purple", "orange"] and list(SIZES) == ["small", "large"]
    assert BACKGROUNDS == ("plain", "striped", "checkered", "dotted")
    assert HELDOUT_COMBOS == {("red", "triangle"), ("green", "star"), ("blue", "diamond"), ("yellow", "circle"),
                              ("purple", "square")}
    assert split_indices(DEFAULT_SIZES) == {"train": range(0, 6000), "val": range(6000, 6500),
                                            "test": range(6500, 7000), "heldout": range(7000, 7500)}


def test_objects_lie_apart_inside_the_canvas_at_their_sizes():
    """Each object keeps 4 px from the canvas's edges and 8 px beyond its neighbours' circumcircles (its mask whole),
    on a wide canvas too; scenes hold 1 to 4 objects of both sizes, each radius in its size's range."""
    rng = random.Random(5)
    counts, sizes_seen = set(), set()
    for canvas in ((256, 256), (320, 200)):
        for index in range(150):
            objects, _ = sample_scene(rng, heldout=index % 4 == 0, canvas=canvas)
            counts.add(len(objects))
            for i, obj in enumerate(objects):
                sizes_seen.add(obj.size)
                assert SIZES[obj.size][0] <= obj.radius <= SIZES[obj.size][1]
                margin = obj.radius + 4
                assert margin <= obj.x <= canvas[0] - margin and margin <= obj.y <= canvas[1] - margin, (canvas, obj)
                for other in objects[i + 1:]:
                    assert math.hypot(obj.x - other.x, obj.y - other.y) > obj.radius + other.radius + 8
    assert counts == {1, 2, 3, 4} and sizes_seen == set(SIZES)


def test_each_image_is_a_karpathy_entry_with_its_mask_and_objects(scenes):
    for entry in json.loads(scenes.read_text())["images"]:
        name = f"scene_{entry['imgid']:06d}"
        assert entry["filepath"] == "images" and entry["filename"] == f"{name}.jpg"
        assert entry["mask"] == f"masks/{name}.png"
        for sentence in entry["sentences"]:
            assert sentence["raw"] == " ".join(sentence["tokens"]) and sentence["imgid"] == entry["imgid"]
    # places to a tenth of a pixel
    assert SceneObject("star", "red", "small", 12.34, 200.06, 19.94).to_json() == {
        "shape": "star", "colour": "red", "size": "small", "center": [12.3, 200.1], "radius": 19.9}


def test_each_background_draws_the_pattern_its_references_name():
    """"on a dotted background": plain is one shade, striped and checkered two shades about half and half, dotted a
    second shade in small dots (noise off, so the shades are exact)."""
    for kind in BACKGROUNDS:
        pixels = np.asarray(scenes_module._background(random.Random(2), kind, noise=(0.0, 0.0))).reshape(-1, 3)
        counts = np.unique(pixels, axis=0, return_counts=True)[1]
        share = counts.min() / counts.sum()
        if kind == "plain":
            assert len(counts) == 1
        else:
            assert len(counts) == 2 and (share < 0.25 if kind == "dotted" else 0.35 < share <= 0.5), (kind, share)


# ---------------------------------------------------------------------------------------------------------------
# Wording: articles
# ---------------------------------------------------------------------------------------------------------------
def test_article_for_every_word_that_can_follow_one():
    vowel_sound = {"orange"}  # the only generator word that starts with a vowel sound
    for word in [*COLOURS, *SHAPES, *SIZES, *BACKGROUNDS]:
        assert article(word) == ("an" if word in vowel_sound else "a"), word
    assert article("Orange") == "an" and article("umbrella") == "an"
    assert article("unit") == "a" and article("hour") == "an"  # sound, not spelling
    assert [article(word) for word in ("one", "unique", "uniform", "user", "honest")] == ["a", "a", "a", "a", "an"]


def test_references_use_an_before_vowel_sounds():
    rng = random.Random(3)
    seen_an = 0
    for index in range(300):
        objects, background = sample_scene(rng, heldout=index % 4 == 0)
        for words in captions_for(objects, background, rng):
            tokens = [w for w, _ in words]
            for before, after in zip(tokens, tokens[1:]):
                if before == "a":
                    assert after[0] not in "aeiou", " ".join(tokens)
                if before == "an":
                    seen_an += 1
                    assert after[0] in "aeiou", " ".join(tokens)
            assert "middle" not in tokens and "top centre" not in " ".join(tokens)
            # the article refers to the same objects as the words it introduces
            for (word, ids), (_, next_ids) in zip(words, words[1:]):
                if word in ("a", "an") and ids:
                    assert ids == next_ids
    assert seen_an > 20  # orange objects are common enough that "an" is exercised


def test_written_dataset_has_no_a_before_orange(scenes):
    for entry in json.loads(scenes.read_text())["images"]:
        for sentence in entry["sentences"]:
            assert "a orange" not in sentence["raw"]


def test_dataset_records_generator_version_and_staleness(tmp_path, scenes):
    data = json.loads(scenes.read_text())
    assert data["generator_version"] == GENERATOR_VERSION and data["dataset"] == "scenes"
    # the header alone: a checkpoint records it, and a card reads it, without the images
    assert set(read_dataset_header(scenes)) == {"dataset", "generator_version", "seed", "sizes", "variation"}
    sizes, seed = SCENE_SIZES, SCENE_SEED
    assert is_current(scenes.parent, sizes, seed=seed)
    assert not is_current(scenes.parent, sizes, seed=seed + 1)
    assert not is_current(scenes.parent, {**sizes, "train": 49}, seed=seed)
    # a dataset written by the previous generator (no version recorded) is stale
    old = tmp_path / "old"
    old.mkdir()
    (old / "dataset_scenes.json").write_text(json.dumps({"dataset": "scenes", "seed": 7, "images": []}))
    assert not is_current(old, sizes, seed=seed)
    # the same settings from another generator version: stale, and not a set this generator draws again
    same = read_dataset_header(scenes)
    (old / "dataset_scenes.json").write_text(json.dumps({**same, "images": []}))
    assert is_current(old, sizes, seed=seed)
    older = {**same, "generator_version": GENERATOR_VERSION - 1}
    (old / "dataset_scenes.json").write_text(json.dumps({**older, "images": []}))
    assert not is_current(old, sizes, seed=seed) and generate_arguments(older) is None
    (old / "dataset_scenes.json").write_text("{not json")  # a torn file: no data set, written again
    assert read_dataset_header(old / "dataset_scenes.json") is None and not is_current(old, sizes, seed=seed)


def test_some_splits_alone_are_the_whole_data_sets_scenes_and_never_taken_for_it(tmp_path, scenes):
    """``captioner data generate --only test heldout``: the scenes of those splits, numbered and drawn as in the whole
    data set (image for image, reference for reference); its header says which splits it holds, so ``--if-stale``
    neither takes it for the whole data set nor the whole data set for it, and a card names the command."""
    sizes, seed = SCENE_SIZES, SCENE_SEED
    part = generate(tmp_path / "part", sizes, seed=seed, progress=False, only=("heldout", "test"))
    whole = {entry["imgid"]: entry for entry in json.loads(scenes.read_text())["images"]}
    written = json.loads(part.read_text())["images"]
    assert [entry["imgid"] for entry in written] == list(range(60, 84))
    assert all(entry == whole[entry["imgid"]] for entry in written)
    for entry in written[::5]:
        assert np.array_equal(np.asarray(Image.open(part.parent / "images" / entry["filename"])),
                              np.asarray(Image.open(scenes.parent / "images" / entry["filename"])))
    assert sorted(path.name for path in (part.parent / "images").iterdir()) == [e["filename"] for e in written]
    assert is_current(part.parent, sizes, seed=seed, only=("test", "heldout"))
    assert not is_current(part.parent, sizes, seed=seed)
    assert not is_current(part.parent, sizes, seed=seed, only=("test",))
    assert not is_current(scenes.parent, sizes, seed=seed, only=("test", "heldout"))
    assert generate_arguments(read_dataset_header(part)) == [
        "--train", "48", "--val", "12", "--test", "12", "--heldout", "12", "--seed", "7", "--only", "test", "heldout"]
    assert generate_arguments(dataset_header(0, DEFAULT_SIZES, None)) == []  # `make data`'s set: no flag at all
    assert generate_arguments(dataset_header(1, DEFAULT_SIZES, None)) == ["--seed", "1"]
    # a card names `make data` for its set alone, not for another seed's
    assert describe_dataset(dataset_header(0, DEFAULT_SIZES, None)).endswith(
        ": `make data`, that is `captioner data generate`, no download)")
    assert describe_dataset(dataset_header(1, DEFAULT_SIZES, None)).endswith(
        ": `captioner data generate --seed 1`, no download)")


def test_unknown_splits_are_refused_and_the_annotations_written_atomically(tmp_path, monkeypatch):
    for sizes, only in (({"tset": 1}, None), ({"test": 1}, ("tset",))):
        with pytest.raises(ValueError, match=r"unknown split\(s\) \['tset'\]"):
            generate(tmp_path / "refused", sizes, progress=False, only=only)
    written = []
    monkeypatch.setattr(scenes_module, "write_atomically",
                        lambda path, text: written.append(path) or write_atomically(path, text))
    path = generate(tmp_path / "one", {"test": 1}, progress=False)
    assert written == [path] and len(json.loads(path.read_text())["images"]) == 1
    assert generate(tmp_path / "one", {"test": 2}, progress=False) == path  # drawn again into its folder


def test_a_progress_bar_only_where_asked(tmp_path, capsys):
    generate(tmp_path / "quiet", {"test": 1}, progress=False)
    assert capsys.readouterr().err == ""
    generate(tmp_path / "shown", {"test": 1}, progress=True)
    assert "generating scenes" in capsys.readouterr().err
    generate(tmp_path / "default", {"test": 1})  # a library caller's default
    assert "generating scenes" in capsys.readouterr().err


@pytest.mark.parametrize("only_held", [None, 5, [["test"]], [], ["test", ["heldout"]]],
                         ids=["whole", "altered", "altered-list", "altered-empty", "altered-mixed"])
def test_only_some_splits_never_replace_a_whole_data_set(only_held, tmp_path, scenes, capsys):
    """``--only`` into the folder of a whole data set would leave its training split without annotations: refused,
    the folder untouched.  A copy of the session's data set, which a regression would otherwise overwrite for every
    test after this one.  A header whose "only" is not a list of splits (altered by hand) reads as the whole set's
    (it was a TypeError traceback), one split name among other values included."""
    before = scenes.read_bytes()
    if only_held is not None:
        before = json.dumps({**json.loads(before), "only": only_held}).encode()
    whole = tmp_path / "whole"
    whole.mkdir()
    (whole / scenes.name).write_bytes(before)
    common = ["data", "generate", "--out", str(whole), "--seed", str(SCENE_SEED), "--workers", "1",
              *(arg for split, size in SCENE_SIZES.items() for arg in (f"--{split}", str(size)))]
    with pytest.raises(SystemExit) as refused:
        main([*common, "--only", "test", "heldout"])
    assert refused.value.code == 2
    assert (f"error: {whole} holds a data set with more splits than --only test heldout: give --out another folder\n"
            in capsys.readouterr().err)
    assert [path.name for path in whole.iterdir()] == [scenes.name] and (whole / scenes.name).read_bytes() == before


def test_the_splits_a_folder_holds_alone_are_written_into_it_again_as_is_the_whole_set(tmp_path, monkeypatch,
                                                                                        capsys):
    """A folder of ``--only test heldout``'s scenes takes the same command again (another seed, in any order) and
    the whole data set, --if-stale or not: only a split the folder holds beyond --only's is refused.  A folder whose
    header is the whole set's for these settings is left alone with --if-stale, and drawn again for another seed."""
    part, whole = tmp_path / "part", tmp_path / "whole"
    for folder, header in ((part, {"only": ["test", "heldout"]}), (whole, dataset_header(0, DEFAULT_SIZES, None))):
        folder.mkdir()
        (folder / "dataset_scenes.json").write_text(json.dumps({**header, "images": []}))
    written = []
    monkeypatch.setattr(scenes_module, "generate", lambda out, sizes, **options: written.append(options["only"])
                        or Path(out) / "dataset_scenes.json")
    main(["data", "generate", "--out", str(part), "--seed", "1", "--only", "heldout", "test"])
    main(["data", "generate", "--out", str(part), "--if-stale"])
    main(["data", "generate", "--out", str(whole), "--if-stale"])
    main(["data", "generate", "--out", str(whole), "--if-stale", "--seed", "1"])  # another seed's: drawn again
    assert written == [["heldout", "test"], None, None]
    assert capsys.readouterr().out == (f"wrote {part / 'dataset_scenes.json'}\n" * 2
                                       + f"{whole} is up to date (same generator version, seed, sizes, variation "
                                       f"and splits)\nwrote {whole / 'dataset_scenes.json'}\n")


def test_if_stale_with_only_leaves_a_folder_that_holds_those_splits_for_these_settings_alone(tmp_path, monkeypatch,
                                                                                            capsys):
    """``--if-stale --only test heldout`` run again (the splits a shipped checkpoint is scored on) into a folder that
    already holds those splits for these settings: up to date, nothing drawn.  --if-stale weighs the splits asked
    for, so the folder is not taken for a whole data set and drawn again every time."""
    header = dataset_header(0, DEFAULT_SIZES, None, only=("test", "heldout"))
    (tmp_path / "dataset_scenes.json").write_text(json.dumps({**header, "images": []}))
    written = []
    monkeypatch.setattr(scenes_module, "generate", lambda out, sizes, **options: written.append(options["only"])
                        or Path(out) / "dataset_scenes.json")
    main(["data", "generate", "--out", str(tmp_path), "--if-stale", "--only", "heldout", "test"])
    assert written == []
    assert capsys.readouterr().out == (f"{tmp_path} is up to date (same generator version, seed, sizes, variation "
                                       "and splits)\n")


def test_if_stale_weighs_the_variation_asked_for_against_the_one_the_folder_holds(tmp_path, monkeypatch, capsys):
    """``make data-varied`` (``--varied --if-stale``) into its folder of varied scenes, current: left alone, not its
    13,500 images drawn again every time; into a folder of the standard scenes (the ones the shipped checkpoints
    trained on) it draws the varied set, which a check blind to the variation took for up to date, so a training
    run asked for augmented scenes got plain ones."""
    varied, plain = tmp_path / "varied", tmp_path / "plain"
    for folder, variation in ((varied, VARIATIONS["standard"]), (plain, None)):
        folder.mkdir()
        (folder / "dataset_scenes.json").write_text(json.dumps({**dataset_header(0, DEFAULT_SIZES, variation),
                                                                "images": []}))
    written = []
    monkeypatch.setattr(scenes_module, "generate", lambda out, sizes, **options: written.append(options["variation"])
                        or Path(out) / "dataset_scenes.json")
    main(["data", "generate", "--out", str(varied), "--varied", "--if-stale"])
    main(["data", "generate", "--out", str(plain), "--varied", "--if-stale"])
    assert written == [VARIATIONS["standard"]]
    assert capsys.readouterr().out == (f"{varied} is up to date (same generator version, seed, sizes, variation "
                                       f"and splits)\nwrote {plain / 'dataset_scenes.json'}\n")


# ---------------------------------------------------------------------------------------------------------------
# Varied scenes (training-time augmentation)
# ---------------------------------------------------------------------------------------------------------------
def circular(a: float, b: float) -> float:
    return min(abs(a - b), 1 - abs(a - b))


def test_varied_scenes_vary_and_stay_consistent(tmp_path):
    path = generate(tmp_path / "v", {"train": 24, "test": 4}, seed=1, progress=False, variation=Variation())
    again = generate(tmp_path / "w", {"train": 24, "test": 4}, seed=1, progress=False, variation=Variation())
    data = json.loads(path.read_text())
    assert data == json.loads(again.read_text()) and data["variation"]["hue_jitter"] == 0.02
    canvases = {tuple(e["canvas"]) for e in data["images"]}
    assert len(canvases) > 5 and any(w < h for w, h in canvases) and any(w > h for w, h in canvases)
    assert (256, 256) in canvases  # a share of them on the classic canvas
    assert {obj["size"] for entry in data["images"] for obj in entry["objects"]} == set(SIZES)
    for entry in data["images"]:
        image = Image.open(path.parent / "images" / entry["filename"])
        mask = np.asarray(Image.open(path.parent / entry["mask"]))
        assert image.size == tuple(entry["canvas"]) == (mask.shape[1], mask.shape[0])
        pixels = np.asarray(image).astype(int)
        for index, obj in enumerate(entry["objects"]):
            x, y = obj["center"]
            assert mask[int(round(y)), int(round(x))] == index + 1
            inside = mask == index + 1
            # the jitter keeps each object's hue nearest to its own colour name's
            mean = pixels[inside].mean(0) / 255
            hue = colorsys.rgb_to_hsv(*mean)[0]
            nearest = min(COLOURS, key=lambda c: circular(colorsys.rgb_to_hsv(*np.array(COLOURS[c]) / 255)[0], hue))
            assert nearest == obj["colour"], (entry["filename"], mean * 255)
        assert all(named_objects(entry["sentences"][0]["tokens"], entry["objects"]))
    # the written varied dataset counts as current for the same settings (its ranges are JSON lists, not tuples),
    # so `make data-varied` does not redraw 13,500 images every time
    sizes = {"train": 24, "val": 0, "test": 4, "heldout": 0}
    assert is_current(path.parent, sizes, seed=1, variation=Variation())
    assert not is_current(path.parent, sizes, seed=1, variation=Variation(hue_jitter=0.05))


def test_small_objects_variation_draws_smaller_objects_and_leaves_the_standard_one_alone(tmp_path):
    """``--varied small-objects`` draws "small" objects below the standard variation's 4.5 % of the shorter side,
    down to 3 %; ``--varied`` alone still writes exactly the set the shipped checkpoints trained on."""
    assert VARIATIONS["standard"] == Variation()
    sizes = {"train": 60, "val": 0, "test": 0, "heldout": 0}
    for name in ("standard", "small-objects"):
        args = argparse.Namespace(out=tmp_path / name, seed=3, workers=1, varied=name, if_stale=False, only=None,
                                  **sizes)
        cmd_data_generate(args)
    assert is_current(tmp_path / "standard", sizes, seed=3, variation=Variation())

    def small_fractions(name: str) -> list[float]:
        data = json.loads((tmp_path / name / "dataset_scenes.json").read_text())
        return [obj["radius"] / min(entry["canvas"]) for entry in data["images"] for obj in entry["objects"]
                if obj["size"] == "small"]

    standard, smaller = small_fractions("standard"), small_fractions("small-objects")
    assert min(standard) >= 0.045 and min(smaller) >= 0.03 and max(smaller) <= 0.095
    assert sum(f < 0.045 for f in smaller) > len(smaller) / 20


def test_a_varied_scenes_mask_is_its_turned_footprint_and_its_edges_anti_aliased_when_supersampled():
    """At 1× without noise the pixels of the turned square are its mask's exactly; drawn at 4× and reduced with a
    box filter, its edges blend its colour into the background's."""
    square = SceneObject("square", "red", "large", 60.0, 60.0, 35.0)
    for k in (1, 4):
        variation = Variation(supersample=(k,), noise=(0.0, 0.0), rotation=30.0)
        image, mask = scenes_module.render_varied(
            [square], "plain", random.Random(0), (120, 120), variation)
        pixels = np.asarray(image)
        if k == 1:
            assert np.array_equal((pixels != pixels[0, 0]).any(-1), np.asarray(mask) == 1)
        else:
            assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 2


def test_varied_colours_are_darkened_and_brightened_by_the_value_jitter():
    """``Variation.value`` (×0.85 to 1.1) spreads each shade's brightness, so that a model trained on varied scenes has
    seen dimmer and brighter reds than the generator's one; a red at full brightness every time would leave it out."""
    rng = random.Random(0)
    for name in ("red", "blue"):
        brightest = [max(scenes_module._jittered_colour(rng, name, Variation())) for _ in range(100)]
        assert max(brightest) - min(brightest) > 40, (name, min(brightest), max(brightest))


def test_a_varied_canvas_is_never_below_64_pixels_a_side():
    tiny = Variation(classic_share=0.0, side=(20.0, 40.0))
    assert {sample_varied_canvas(random.Random(seed), tiny) for seed in range(5)} == {(64, 64)}


#: sha256 of the annotation files of a few classic and varied scenes of seed 0, by generator version: what a seed draws
#: changes only with GENERATOR_VERSION (so that `--if-stale` draws a data set again), and a new version records its own
FINGERPRINTS = {2: ("f13037b48d8508cbaaa673b33dde39716b1bb5526f367566e36fc9b527222180",
                    "d8b885980a8299548ec1f22a465b5571faeafd0d62e2d0b5338367c42f8dce17")}


def test_a_seed_draws_the_scenes_of_the_generator_version(tmp_path):
    classic = generate(tmp_path / "classic", {"train": 6, "heldout": 2}, progress=False)
    varied = generate(tmp_path / "varied", {"train": 6}, progress=False, variation=Variation())
    assert tuple(hashlib.sha256(path.read_bytes()).hexdigest() for path in (classic, varied)) == \
        FINGERPRINTS[GENERATOR_VERSION]


def test_each_shape_is_drawn_as_its_name_says():
    """An upright square fills its box, a diamond stands taller than wide, a triangle and a star point up (the star's
    five points fill less than three fifths of its circle)."""
    shapes = [SceneObject(shape, "red", "large", x, y, 35.0)
              for shape, x, y in (("square", 45.0, 64.0), ("diamond", 128.0, 64.0), ("triangle", 211.0, 64.0),
                                  ("star", 128.0, 180.0))]
    mask = np.asarray(scenes_module.render(shapes, "plain", random.Random(0))[1])
    square, diamond, triangle, star = (np.argwhere(mask == index + 1) for index in range(4))
    height, width = np.ptp(square, axis=0) + 1
    assert len(square) > 0.9 * height * width
    height, width = np.ptp(diamond, axis=0) + 1
    assert height > 1.5 * width
    rows = triangle[:, 0]
    assert (rows == rows.min()).sum() < (rows == rows.max()).sum() / 5
    assert len(star) < 0.6 * math.pi * 35.0 ** 2
    assert np.ptp(star[star[:, 0] <= star[:, 0].min() + 1, 1]) < 5  # one point at the top, not two


def test_a_shape_the_generator_cannot_draw_is_refused_by_its_name():
    """``render`` and ``render_varied`` are the library's drawing calls: a scene built by hand with a shape they do not
    draw (a typo, a shape of a newer generator) must be refused with that name, not fail inside PIL with "argument
    must be sequence", which names neither the shape nor the object."""
    hexagon = [SceneObject("hexagon", "red", "large", 64.0, 64.0, 20.0)]
    with pytest.raises(ValueError, match="hexagon"):
        scenes_module.render(hexagon, "plain", random.Random(0))
    with pytest.raises(ValueError, match="hexagon"):
        scenes_module.render_varied(hexagon, "plain", random.Random(0), (128, 128), Variation())
