"""Flickr30k and COCO as their publishers distribute them (models/data/flickr.py, models/data/coco.py): the generated
scenes written out in each publisher's layout must read back as the same photos with the same references as their
Karpathy JSON, and a run trained from COCO's own files must say it was trained on COCO."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from captioner.models.checkpoint import read_config
from captioner.models.data.datasets import dataset_name, load_captioned, resolve_dataset, trained_on
from captioner.models.data.coco import coco_captions_file, load_coco
from captioner.models.data.karpathy import load_karpathy
from captioner.models.training import TrainConfig, train
from captioner.service.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


def _raw(image) -> list[str]:
    return [s.get("raw") or " ".join(s["tokens"]) for s in image.info["sentences"]]


@pytest.fixture(scope="module")
def karpathy(scenes) -> dict[str, list]:
    return {split: load_karpathy(scenes, splits=(split,)) for split in ("train", "val", "test")}


@pytest.fixture
def coco(karpathy, tmp_path) -> Path:
    """cocodataset.org's layout: annotations/captions_{train,val}2014.json beside train2014/ and val2014/; COCO ids
    that are not the Karpathy ids, and the captions of a photo not in id order in the file."""
    root = tmp_path / "coco"
    (root / "annotations").mkdir(parents=True)
    for split in ("train", "val"):
        (root / f"{split}2014").mkdir()
        images, notes = [], []
        for image in karpathy[split]:
            cocoid = 1000 + image.image_id
            name = f"COCO_{split}2014_{cocoid:012d}.jpg"
            shutil.copy(image.path, root / f"{split}2014" / name)
            images.append({"id": cocoid, "file_name": name, "width": 1, "height": 1})
            for position, text in reversed(list(enumerate(_raw(image)))):
                notes.append({"image_id": cocoid, "id": 10 * cocoid + position, "caption": text})
        (root / "annotations" / f"captions_{split}2014.json").write_text(
            json.dumps({"info": {}, "licenses": [], "images": images, "annotations": notes}))
    return root


@pytest.fixture
def flickr30k(karpathy, tmp_path) -> Path:
    """The publishers' results_20130124.token with flickr30k-images/, and Flickr30k Entities' split lists (photo
    ids without .jpg) in flickr30k_entities/."""
    root = tmp_path / "flickr30k"
    (root / "flickr30k-images").mkdir(parents=True)
    (root / "flickr30k_entities").mkdir()
    lines = []
    for split, images in karpathy.items():
        ids = [str(5000 + image.image_id) for image in images]
        (root / "flickr30k_entities" / f"{split}.txt").write_text("\n".join(ids) + "\n")
        for flickr_id, image in zip(ids, images):
            shutil.copy(image.path, root / "flickr30k-images" / f"{flickr_id}.jpg")
            lines += [f"{flickr_id}.jpg#{n}\t{text}" for n, text in enumerate(_raw(image))]
    (root / "results_20130124.token").write_text("\n".join(lines) + "\n")
    return root


def test_coco_files_read_as_the_same_photos_and_references(coco, karpathy):
    assert resolve_dataset(coco) == coco / "annotations" / "captions_train2014.json"
    assert dataset_name(coco) == "coco"
    for split in ("train", "val"):
        images = load_captioned(coco, splits=(split,))
        assert [im.references for im in images] == [im.references for im in karpathy[split]]
        assert [im.image_id for im in images] == [1000 + im.image_id for im in karpathy[split]]
        assert all(im.path.parent == coco / f"{split}2014" and im.split == split for im in images)
    # the default is both published splits, and any captions file stands for its folder
    both = load_captioned(coco / "annotations" / "captions_val2014.json")
    assert [im.split for im in both] == ["train"] * len(karpathy["train"]) + ["val"] * len(karpathy["val"])
    assert len(load_captioned(coco, splits=("train",), limit=3)) == 3
    # the limit counts the photos of every split read, not of each split alone
    assert [im.split for im in load_captioned(coco, limit=3)] == ["train"] * 3


def test_coco_2017_files_read_their_photos_from_the_2017_folders(coco):
    for split in ("train", "val"):
        captions = coco / "annotations" / f"captions_{split}2014.json"
        captions.rename(captions.with_name(f"captions_{split}2017.json"))
        (coco / f"{split}2014").rename(coco / f"{split}2017")
    images = load_captioned(coco)
    assert [im.path.parent for im in images] == [coco / f"{im.split}2017" for im in images]
    assert {im.split for im in images} == {"train", "val"}


def test_a_folder_holding_both_years_reads_the_2014_files(coco):
    """2014 comes first, as coco_captions_file's docstring lists it: 2017's train holds most of val2014's photos, so
    a folder with both years read as 2017 would silently be another split."""
    for split in ("train", "val"):
        shutil.copy(coco / "annotations" / f"captions_{split}2014.json",
                    coco / "annotations" / f"captions_{split}2017.json")
    assert coco_captions_file(coco) == coco / "annotations" / "captions_train2014.json"
    assert {im.path.parent.name for im in load_coco(coco)} == {"train2014", "val2014"}


def test_val2014_alone_beside_both_2017_files_is_still_read_as_2014(coco):
    """The year decides before the split: a folder holding val2014's captions (kept for the Karpathy test photos)
    and the whole 2017 download evaluates ``--split val`` on val2014, not on val2017, another set of photos."""
    annotations = coco / "annotations"
    for split in ("train", "val"):
        shutil.copy(annotations / f"captions_{split}2014.json", annotations / f"captions_{split}2017.json")
    (annotations / "captions_train2014.json").unlink()
    assert coco_captions_file(coco) == annotations / "captions_val2014.json"
    assert {im.path.parent.name for im in load_coco(coco, splits=("val",))} == {"val2014"}


def test_a_file_named_like_a_captions_file_with_more_after_it_is_not_one(coco):
    # a backup (captions_val2014.json.bak) given by mistake was read as the captions_val2014.json beside it
    annotations = coco / "annotations"
    backup = shutil.copy(annotations / "captions_val2014.json", annotations / "captions_val2014.json.bak")
    assert coco_captions_file(backup) is None
    with pytest.raises(ValueError, match=r"captions_val2014.json.bak is not COCO's captions_train2014.json"):
        load_coco(backup, splits=("val",))


def test_a_path_given_as_text_reads_and_a_folder_without_captions_files_is_refused(coco, tmp_path):
    assert coco_captions_file(str(coco)) == coco / "annotations" / "captions_train2014.json"
    images = load_coco(str(coco / "annotations" / "captions_val2014.json"), splits=("val",))
    assert images and all(im.path.parent == coco / "val2014" for im in images)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty is not COCO's captions_train2014.json / captions_val2014.json nor a "
                                         "folder holding them"):
        load_coco(tmp_path / "empty")


def test_a_relative_image_root_is_read_from_the_working_folder(coco, tmp_path, monkeypatch):
    # as the command line gives it (--image-root coco), not from the captions files' folder
    monkeypatch.chdir(tmp_path)
    images = load_captioned(coco / "annotations", image_root="coco", splits=("val",))
    assert images and all(im.path.parent == Path("coco", "val2014") for im in images)


def test_captions_files_beside_the_photo_folders_find_them_there(coco):
    # not in an annotations/ folder: the photos' folders are looked for beside the captions files themselves
    for captions in (coco / "annotations").iterdir():
        captions.rename(coco / captions.name)
    images = load_captioned(coco / "captions_val2014.json", splits=("val",))
    assert images and all(im.path.parent == coco / "val2014" for im in images)


def test_coco_refuses_what_it_does_not_have(coco, tmp_path):
    with pytest.raises(ValueError, match="no test split .*dataset_coco.json"):
        load_captioned(coco, splits=("test",))
    # away from its photos: the first missing one is named, with the option that fixes it
    moved = tmp_path / "elsewhere"
    shutil.move(coco / "annotations", moved)
    with pytest.raises(FileNotFoundError, match="train2014.*no --image-root was given, so the photos were looked for "
                                                "from .*; give the folder that holds them as --image-root: the folder "
                                                "holding train2014/"):
        load_captioned(moved)
    assert load_captioned(moved, image_root=coco, splits=("val",))[0].path.is_file()
    # a COCO-format file under another name is not mistaken for Karpathy's JSON
    renamed = tmp_path / "my_captions.json"
    shutil.copy(moved / "captions_val2014.json", renamed)
    with pytest.raises(ValueError, match="COCO's own captions format"):
        load_captioned(renamed)
    (moved / "captions_val2014.json").unlink()
    with pytest.raises(FileNotFoundError, match="captions_val2014.json does not exist"):
        load_captioned(moved, image_root=coco)


def test_flickr30k_files_read_as_the_same_photos_and_references(flickr30k, karpathy):
    assert resolve_dataset(flickr30k).name == "results_20130124.token"
    assert dataset_name(flickr30k) == "flickr30k"
    images = load_captioned(flickr30k)
    expected = [im for split in ("train", "val", "test") for im in karpathy[split]]
    assert [(im.split, im.references) for im in images] == [(im.split, im.references) for im in expected]
    assert images[0].path == (flickr30k / "flickr30k-images" / f"{5000 + expected[0].image_id}.jpg").resolve()
    # ids number the three lists in order whichever splits are loaded
    test_only = load_captioned(flickr30k / "results_20130124.token", splits=("test",))
    assert [im.image_id for im in test_only] == [im.image_id for im in images if im.split == "test"]
    assert trained_on({"dataset": str(flickr30k / "results_20130124.token")}).startswith("Flickr30k (Young")


def test_flickr30k_without_split_lists_says_where_they_come_from(flickr30k):
    (flickr30k / "flickr30k_entities" / "val.txt").unlink()
    # every place a list is looked for is named
    with pytest.raises(FileNotFoundError, match=r"no val list for flickr30k \(looked for \S+/val.txt, \S+/"
                                                r"flickr30k_entities/val.txt, \S+/flickr30k_entities-master/val.txt"
                                                r"\): .*Flickr30k Entities' split lists"):
        load_captioned(flickr30k)


def test_a_flickr30k_split_list_beside_the_token_file_comes_first(flickr30k):
    """Of the places a split's list may be, the first that holds one wins: a list copied beside the token file (here
    naming the first test photo alone) is read rather than Flickr30k Entities' own."""
    entities = (flickr30k / "flickr30k_entities" / "test.txt").read_text().split()
    (flickr30k / "test.txt").write_text(entities[0] + "\n")
    assert [im.path.stem for im in load_captioned(flickr30k, splits=("test",))] == entities[:1]


@pytest.mark.parametrize("place", ["flickr30k-images", "images", "../flickr30k-images", "."])
def test_flickr30k_photos_are_found_in_each_place_a_copy_of_the_data_set_puts_them(flickr30k, place):
    """The publishers' flickr30k-images/ beside the token file or beside its folder, a copy's images/, or the token
    file's own folder (written out here, not read from the layout, so that a place misspelt there fails): anywhere
    else the user is told to pass --image-root."""
    photos, where = flickr30k / "flickr30k-images", (flickr30k / place).resolve()
    if where != photos:
        shutil.copytree(photos, where, dirs_exist_ok=True)
        shutil.rmtree(photos)
    assert {im.path.parent for im in load_captioned(flickr30k, splits=("test",))} == {where}


def test_a_run_trained_from_coco_files_records_coco(coco, tmp_path, capsys):
    out = tmp_path / "run"
    train(TrainConfig(dataset=str(coco), out=str(out), cache_dir=str(tmp_path / "cache"), epochs=1, batch_size=16,
                      model_args=dict(embed_dim=16, hidden_dim=24, attn_dim=16), encoder={"image_size": 128},
                      progress=False))
    meta = read_config(out / "best")["meta"]
    assert meta["trained_on"].startswith("MS COCO (Lin et al., ECCV 2014), train split")
    # evaluation defaults to test, which COCO's own files do not have: one line, exit status 2
    with pytest.raises(SystemExit) as exc:
        main(["eval", str(out / "best"), "--dataset", str(coco)])
    assert exc.value.code == 2 and "no test split" in capsys.readouterr().err
    # COCO's val file alone (its train file not downloaded) evaluates, without the share of novel captions
    (coco / "annotations" / "captions_train2014.json").unlink()
    main(["eval", str(out / "best"), "--dataset", str(coco / "annotations" / "captions_val2014.json"), "--split", "val",
          "--cache-dir", str(tmp_path / "cache"), "--no-meteor", "--output", str(tmp_path / "val.json")])
    assert "note: no share of novel captions" in capsys.readouterr().err
    assert "CIDEr-D" in json.loads((tmp_path / "val.json").read_text())["val"]


def test_a_captions_file_in_another_encoding_is_named(coco, flickr30k, scenes, tmp_path):
    # the bare codec message ("'utf-8' codec can't decode byte 0xe9 …") named no file
    karpathy = tmp_path / "dataset_latin1.json"
    karpathy.write_bytes(scenes.read_bytes().replace(b'"raw": "', b'"raw": "caf\xe9 ', 1))
    token = flickr30k / "results_20130124.token"
    token.write_bytes(token.read_bytes() + b"5000.jpg#5\tun caf\xe9\n")
    captions = coco / "annotations" / "captions_val2014.json"
    captions.write_bytes(captions.read_bytes().replace(b'"caption": "', b'"caption": "caf\xe9 ', 1))
    for dataset, named in ((karpathy, karpathy), (flickr30k, token), (coco / "annotations" / "captions_val2014.json",
                                                                      captions)):
        with pytest.raises(ValueError, match=f"{named}:\\d+ is not UTF-8 text .*save it as UTF-8"):
            load_captioned(dataset, splits=("val",))


def write_coco_json(path: Path, images: list[dict], annotations: list[dict]) -> Path:
    """A COCO annotations file (captions or instances) of these entries."""
    path.write_text(json.dumps({"images": images, "annotations": annotations}))
    return path


def test_entries_missing_a_field_or_repeated_are_named(tmp_path):
    annotations = tmp_path / "annotations"
    annotations.mkdir()
    images = [{"id": 1, "file_name": "a.jpg"}, {"id": 2, "file_name": "b.jpg"}]
    notes = [{"image_id": 1, "id": 10, "caption": "A dog."}, {"image_id": 2, "id": 11, "caption": None}]
    captions = write_coco_json(annotations / "captions_val2014.json", images, notes)
    with pytest.raises(ValueError, match="captions_val2014.json: annotation 1 has no str 'caption'"):
        load_coco(annotations, splits=("val",))  # a null caption was the reference "none"
    notes[1]["caption"] = "A cat."
    write_coco_json(captions, images + [images[0]], notes)
    with pytest.raises(ValueError, match="image 2 repeats the id 1"):
        load_coco(annotations, splits=("val",))
    instances = write_coco_json(tmp_path / "instances_val2014.json", images,
                                [{"image_id": 1, "id": 3, "bbox": [0, 0, 1]}])
    with pytest.raises(ValueError, match="COCO annotations file without captions"):
        load_karpathy(instances)


def test_an_image_entry_without_its_file_name_is_named_as_an_image(tmp_path):
    # the user is told which entry of which list to mend: the images list's, and the fields each image needs
    images = [{"id": 1, "file_name": "a.jpg"}, {"id": 2, "filename": "b.jpg"}]
    notes = [{"image_id": 1, "id": 10, "caption": "A dog."}, {"image_id": 2, "id": 11, "caption": "A cat."}]
    captions = write_coco_json(tmp_path / "captions_val2014.json", images, notes)
    named = f"{captions}: image 1 has no str 'file_name' (COCO's images each have 'id', 'file_name')"
    with pytest.raises(ValueError, match=re.escape(named)):
        load_coco(tmp_path, splits=("val",))


def test_an_id_of_true_is_not_read_as_the_number_one(tmp_path):
    # JSON's true is a Python bool, an int: it would give the caption to the photo of id 1
    images = [{"id": 1, "file_name": "a.jpg"}]
    notes = [{"image_id": 1, "id": 10, "caption": "A dog."}, {"image_id": True, "id": 11, "caption": "A cat."}]
    write_coco_json(tmp_path / "captions_val2014.json", images, notes)
    with pytest.raises(ValueError, match="captions_val2014.json: annotation 1 has no int 'image_id'"):
        load_coco(tmp_path, splits=("val",))


@pytest.mark.parametrize("text, reason", [("{torn", r"\(Expecting"), ('{"images": []}', ": it needs 'images' and"),
                                          ('{"annotations": []}', ": it needs"), ("[]", ": it needs"),
                                          ('{"images": {}, "annotations": []}', ": it needs")])
def test_a_captions_file_that_is_not_coco_json_is_named(tmp_path, text, reason):
    captions = tmp_path / "captions_val2014.json"
    captions.write_text(text)
    with pytest.raises(ValueError, match=f"captions_val2014.json is not COCO's captions JSON ?{reason}"):
        load_coco(captions, splits=("val",))


def test_the_first_captions_by_annotation_id_are_kept(tmp_path):
    # a few COCO photos have six or seven captions; max_refs keeps the first by annotation id, not by file order
    notes = [{"image_id": 1, "id": n, "caption": f"A dog {n}."} for n in range(17, 10, -1)]
    write_coco_json(tmp_path / "captions_val2014.json", [{"id": 1, "file_name": "a.jpg"}], notes)
    image = load_coco(tmp_path, splits=("val",))[0]
    assert [r[-1] for r in image.references] == ["11", "12", "13", "14", "15"]
    assert load_coco(tmp_path, splits=("val",), max_refs=2)[0].raw_references == ["A dog 11.", "A dog 12."]


def test_the_captions_of_photos_cut_from_the_images_list_are_left_out(tmp_path):
    """A smaller COCO made by cutting the ``images`` list keeps the cut photos' annotations: they are not read."""
    images = [{"id": 2, "file_name": "b.jpg"}]
    notes = [{"image_id": 1, "id": 10, "caption": "A dog."}, {"image_id": 2, "id": 11, "caption": "A cat."}]
    write_coco_json(tmp_path / "captions_val2014.json", images, notes)
    assert [(im.image_id, im.raw_references) for im in load_coco(tmp_path, splits=("val",))] == [(2, ["A cat."])]


def test_a_photo_without_a_caption_is_named(tmp_path):
    # it would be kept without references, and BLEU stop at it after an epoch of training
    images = [{"id": 1, "file_name": "a.jpg"}, {"id": 2, "file_name": "b.jpg"}]
    notes = [{"image_id": 1, "id": 10, "caption": "A dog."}, {"image_id": 2, "id": 11, "caption": "..."}]
    write_coco_json(tmp_path / "captions_train2014.json", images, notes)
    with pytest.raises(ValueError, match=r"image 2 \(b.jpg\) of .*captions_train2014.json has no caption"):
        load_coco(tmp_path, splits=("train",))


def test_a_split_coco_does_not_have_is_named_with_the_ones_it_has(coco):
    with pytest.raises(ValueError, match="COCO has the splits train, val, not dev, restval"):
        load_coco(coco, splits=("train", "dev", "restval"))
