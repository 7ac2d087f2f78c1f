"""The loader on a COCO-style Karpathy fixture (filepath folders, restval, raw-only sentences)."""

import hashlib
import json
import re

import numpy as np
import pytest
from PIL import Image

from captioner.models.cli.common import load_split
from captioner.models.data.datasets import load_captioned
from captioner.models.data.features import _cache_name, extract_features
from captioner.models.data.karpathy import karpathy_dataset_name, load_karpathy
from captioner.models.encoder import EncoderSpec
from captioner.models.vocab import tokenize


@pytest.fixture
def coco_fixture(tmp_path):
    rng = np.random.default_rng(0)
    images = []
    for i, (folder, split) in enumerate([("train2014", "train"), ("val2014", "restval"), ("val2014", "val"),
                                         ("val2014", "test")]):
        (tmp_path / folder).mkdir(exist_ok=True)
        name = f"COCO_{folder}_{i:012d}.jpg"
        Image.fromarray(rng.integers(0, 255, (40 + i, 60, 3), dtype=np.uint8)).save(tmp_path / folder / name)
        sentences = [{"tokens": ["a", "photo", str(i)], "raw": f"A photo {i}."} for _ in range(6)]
        sentences[0] = {"raw": "A Dog, running!"}  # raw only: tokenised by the shared tokenizer
        images.append({"filepath": folder, "filename": name, "imgid": i, "cocoid": 1000 + i, "split": split,
                       "sentences": sentences})
    path = tmp_path / "dataset_coco.json"
    path.write_text(json.dumps({"dataset": "coco", "images": images}))
    return path


def test_splits_paths_and_references(coco_fixture):
    train = load_karpathy(coco_fixture, splits=("train",))
    assert [im.image_id for im in train] == [0, 1], "restval is folded into train"
    assert train[1].path == coco_fixture.parent / "val2014" / "COCO_val2014_000000000001.jpg"
    assert len(train[0].references) == 5, "at most five references are kept"
    assert train[0].references[0] == ["a", "dog", "running"]
    assert train[0].raw_references[:2] == ["A Dog, running!", "A photo 0."]  # aligned with the references
    assert [im.split for im in load_karpathy(coco_fixture)] == ["train", "train", "val", "test"]


def test_feature_cache_round_trip(coco_fixture, tmp_path):
    images = load_karpathy(coco_fixture)
    spec = EncoderSpec(image_size=64)
    store = extract_features(images, spec, tmp_path / "cache", batch_size=3, progress=False)
    feats = store.get([images[2].key])
    assert feats.shape == (1, 4, 320) and feats.dtype.is_floating_point
    shards = list((tmp_path / "cache").glob("*/shard-*.npy"))
    assert len(shards) == 1 and not list((tmp_path / "cache").glob("*/*.partial.npy"))
    again = extract_features(images, spec, tmp_path / "cache", progress=False, encoder=object())  # no re-encoding
    assert np.array_equal(again.get([images[2].key]).numpy(), feats.numpy())


def test_missing_file_and_bad_layout(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_karpathy(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="Karpathy"):
        load_karpathy(tmp_path / "bad.json")


def test_feature_cache_key_is_unchanged_by_fields_added_at_their_old_value():
    keys = ["a.jpg", "b.jpg"]
    before = {"backbone": "efficientnet_lite0", "image_size": 256, "resize": "stretch", "resize_to": 256,
              "layer": "hypercolumn", "weights": None}  # EncoderSpec before grid_stride existed
    digest = hashlib.sha256(json.dumps([before, keys]).encode()).hexdigest()[:16]
    assert _cache_name(EncoderSpec(layer="hypercolumn"), keys).endswith(digest)
    assert not _cache_name(EncoderSpec(layer="hypercolumn", grid_stride=16), keys).endswith(digest)


@pytest.mark.parametrize("sentences", [[], [{"raw": "!!!"}]])
def test_an_image_without_a_caption_is_named_when_the_data_is_read(coco_fixture, sentences):
    # it was kept, and BLEU stopped at it with an AssertionError once the first epoch had trained
    data = json.loads(coco_fixture.read_text())
    data["images"][2]["sentences"] = sentences
    coco_fixture.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"image 2 \(COCO_val2014_000000000002.jpg\) has no caption"):
        load_karpathy(coco_fixture, splits=("val",))
    assert len(load_karpathy(coco_fixture, splits=("train",))) == 2  # the other splits' images are still read


def test_captions_without_a_word_do_not_count_towards_max_refs(coco_fixture):
    data = json.loads(coco_fixture.read_text())
    data["images"][0]["sentences"][:0] = [{"raw": "!!!"}, {"tokens": []}]  # two empty captions first, six after
    coco_fixture.write_text(json.dumps(data))
    image = load_karpathy(coco_fixture, splits=("train",))[0]
    assert len(image.references) == 5 and image.references[0] == ["a", "dog", "running"]
    assert image.raw_references[0] == "A Dog, running!" and len(image.raw_references) == 5


def test_a_byte_order_mark_is_ignored(coco_fixture):
    coco_fixture.write_bytes("\ufeff".encode() + coco_fixture.read_bytes())  # as Windows editors save it
    assert len(load_karpathy(coco_fixture)) == 4


def test_a_byte_that_is_not_utf8_is_named_by_its_line(tmp_path):
    path = tmp_path / "dataset_coco.json"
    path.write_bytes(b'\n{"images": [\n{"filename": "caf\xe9.jpg"}]}')  # Latin-1, on the third line
    with pytest.raises(ValueError, match=r"dataset_coco.json:3 is not UTF-8 text \(byte 31: invalid"):
        load_karpathy(path)


def test_tokens_must_be_words_and_follow_the_one_tokenizer(coco_fixture):
    data = json.loads(coco_fixture.read_text())
    data["images"][0]["sentences"][1]["tokens"] = ["A", "Man,", ".", "café"]
    coco_fixture.write_text(json.dumps(data))
    assert load_karpathy(coco_fixture)[0].references[1] == ["a", "man", "cafe"]
    data["images"][0]["sentences"][1]["tokens"] = "a dog runs"  # was read letter by letter
    coco_fixture.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="image 0 is not a Karpathy-split entry .*'tokens' must be a list of words"):
        load_karpathy(coco_fixture)


def test_ids_are_unique_and_restval_is_asked_for_as_train(coco_fixture):
    with pytest.raises(ValueError, match="'restval' is read as part of 'train'"):
        load_karpathy(coco_fixture, splits=("restval",))
    data = json.loads(coco_fixture.read_text())
    data["images"][3]["imgid"] = 0  # results are keyed by id: two photos would share a caption
    coco_fixture.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="images 0 and 3 have the same id 0"):
        load_karpathy(coco_fixture)


def test_the_same_photo_listed_twice_is_refused(coco_fixture):
    # in two splits a test photo would be trained on; in one it would count twice
    data = json.loads(coco_fixture.read_text())
    data["images"][3].update(filepath=data["images"][2]["filepath"], filename=data["images"][2]["filename"])
    coco_fixture.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"images 2 and 3 are the same photo \(.*COCO_val2014_000000000002.jpg\)"):
        load_karpathy(coco_fixture)


def test_a_folder_given_as_the_json_is_named_for_what_it_is(tmp_path):
    (tmp_path / "dataset_coco.json").mkdir()
    with pytest.raises(ValueError, match="dataset_coco.json is a folder, not a captions file"):
        load_karpathy(tmp_path / "dataset_coco.json")


def test_a_split_the_data_set_lacks_is_named_with_the_ones_it_has(coco_fixture):
    with pytest.raises(SystemExit, match="split 'dev' of .* is empty; its splits are test, train, val"):
        load_split(coco_fixture, None, "dev")


def test_accented_letters_keep_their_word():
    assert tokenize("A café, naïve dog’s Straße") == ["a", "cafe", "naive", "dog", "s", "strasse"]


def test_digits_are_words_and_compatibility_forms_fold_to_their_letters():
    # numbers are words, not punctuation ("2 dogs"); full-width letters and ligatures (text typed through an input
    # method, or copied from typeset pages) are the plain letters they stand for, not dropped as non-letters
    assert tokenize("2 dogs on 5th Ａｖｅｎｕｅ, ﬁghting") == ["2", "dogs", "on", "5th", "avenue", "fighting"]


def test_limit_keeps_exactly_that_many_images_of_the_asked_splits(coco_fixture):
    assert [im.image_id for im in load_karpathy(coco_fixture, limit=2)] == [0, 1]
    assert [im.image_id for im in load_karpathy(coco_fixture, splits=("val", "test"), limit=1)] == [2]
    # the limit counts the images kept, not the entries read: val's photo is the JSON's third entry
    assert [im.image_id for im in load_karpathy(coco_fixture, splits=("val", "test"), limit=2)] == [2, 3]


def test_an_entry_without_imgid_takes_its_cocoid_then_its_position(tmp_path):
    sentences = [{"tokens": ["a", "cat"]}]
    images = [{"filename": "a.jpg", "split": "train", "cocoid": 391895, "sentences": sentences},
              {"filename": "b.jpg", "split": "train", "sentences": sentences}]
    (tmp_path / "dataset_coco.json").write_text(json.dumps({"images": images}))
    assert [im.image_id for im in load_karpathy(tmp_path / "dataset_coco.json")] == [391895, 1]


def test_a_sentence_of_tokens_alone_has_them_joined_as_its_raw_text(tmp_path):
    # the raw texts are what coco-caption's PTB tokenizer reads (eval --ptb): an empty one would score nothing
    sentences = [{"tokens": ["a", "black", "cat"]}, {"tokens": ["a", "cat"], "raw": "A cat."}]
    (tmp_path / "dataset_coco.json").write_text(json.dumps({"images": [
        {"filename": "a.jpg", "split": "train", "sentences": sentences}]}))
    image = load_karpathy(tmp_path / "dataset_coco.json")[0]
    assert image.raw_references == ["a black cat", "A cat."]
    assert image.references == [["a", "black", "cat"], ["a", "cat"]]


def test_an_image_root_replaces_the_json_folder_below_the_filepath(coco_fixture, tmp_path):
    val = load_karpathy(coco_fixture, image_root=tmp_path / "photos", splits=("val",))
    assert [im.path for im in val] == [tmp_path / "photos" / "val2014" / "COCO_val2014_000000000002.jpg"]


@pytest.mark.parametrize("text, reason", [("{torn", "is not a data set's JSON"),
                                          ('{"images": {}}', "is not a Karpathy-split JSON")])
def test_a_file_that_is_not_karpathy_json_is_refused_with_its_path(tmp_path, text, reason):
    # --dataset may be any of several files: the error says which one it could not read
    path = tmp_path / "captions" / "dataset_coco.json"
    path.parent.mkdir()
    path.write_text(text)
    with pytest.raises(ValueError, match=re.escape(f"{path} {reason}")):
        load_karpathy(path)


def test_a_relative_image_root_is_read_from_the_working_folder(coco_fixture, tmp_path, monkeypatch):
    # as the command line gives it (--image-root photos), not from the JSON's folder
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    val = load_karpathy(coco_fixture, image_root="photos", splits=("val",))
    assert [im.key for im in val] == [str((tmp_path / "work" / "photos" / "val2014" / "COCO_val2014_000000000002.jpg")
                                          .resolve())]


def test_an_empty_split_is_named_when_the_other_splits_cannot_be_listed(coco_fixture):
    # listing the splits reads them all: a caption-less photo in one must not hide the empty split behind a crash
    data = json.loads(coco_fixture.read_text())
    data["images"][3]["sentences"] = []
    coco_fixture.write_text(json.dumps(data))
    with pytest.raises(SystemExit, match=r"split 'dev' of .* is empty$"):
        load_split(coco_fixture, None, "dev")


def test_an_empty_split_lists_the_splits_whose_photos_are_not_all_here(coco_fixture):
    # only some photos copied over: the splits are still listed, read without looking for their photos
    (coco_fixture.parent / "train2014" / "COCO_train2014_000000000000.jpg").unlink()
    with pytest.raises(SystemExit, match="split 'dev' of .* is empty; its splits are test, train, val"):
        load_split(coco_fixture, None, "dev")


def test_of_several_missing_photos_the_first_in_the_data_sets_order_is_named(coco_fixture):
    """A half-copied photo folder: the error names the first photo the data set lists that is not here, so the user
    knows where the copy stopped (the photos after it are missing too)."""
    for name in ("COCO_val2014_000000000001.jpg", "COCO_val2014_000000000003.jpg"):
        (coco_fixture.parent / "val2014" / name).unlink()
    with pytest.raises(FileNotFoundError, match=r"image \S*COCO_val2014_000000000001\.jpg of "):
        load_captioned(coco_fixture)


def test_an_entrys_extra_fields_are_kept_in_its_info(coco_fixture):
    # the generated scenes' objects and masks (object naming, grounding) and COCO's id (compare.py) are read from here
    data = json.loads(coco_fixture.read_text())
    data["images"][2].update(objects=["red circle"], mask="masks/2.png")
    coco_fixture.write_text(json.dumps(data))
    info = load_karpathy(coco_fixture, splits=("val",))[0].info
    assert info["objects"] == ["red circle"] and info["mask"] == "masks/2.png" and info["cocoid"] == 1002
    assert not {"filename", "filepath", "split"} & info.keys()


def test_the_data_sets_name_is_read_as_text(tmp_path):
    # a name that JSON writes as a number (a year's release) is still a name: it goes into file names and messages
    path = tmp_path / "captions.json"
    path.write_text(json.dumps({"dataset": 2017, "images": []}))
    assert karpathy_dataset_name(path) == "2017"
    path.write_text(json.dumps({"dataset": "", "images": []}))
    assert karpathy_dataset_name(path) is None
