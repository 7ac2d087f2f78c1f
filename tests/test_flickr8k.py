"""Flickr8k as its publishers distribute it (models/data/flickr.py) and the one entry point every command uses to
read a data set (models/data/datasets.py): hand-written files in the official layout, and, where ``../shared``
holds the real data set, agreement with its Karpathy JSON."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from captioner.models.checkpoint import save_checkpoint
from captioner.models.data.datasets import CITATIONS, ENTITIES_CITATION, dataset_name, load_captioned, \
    named_by_path, resolve_dataset, train_split_captions, trained_on
from captioner.models.data.flickr import flickr_layout, load_flickr
from captioner.service.cli import main

from .conftest import FLICKR8K_DIR as SHARED
from .serving_helpers import TINY_SPEC, VOCAB, tiny_model


@pytest.fixture
def official(tmp_path) -> Path:
    """The publishers' layout: Flickr8k_text/ (token file + split lists) beside Flicker8k_Dataset/ (photos)."""
    text, photos = tmp_path / "Flickr8k_text", tmp_path / "Flicker8k_Dataset"
    text.mkdir()
    photos.mkdir()
    names = {"train": ["10_a.jpg", "11_b.jpg"], "val": ["20_c.jpg"], "test": ["30_d.jpg"]}
    lines = []
    for i, name in enumerate(n for split in names.values() for n in split):
        Image.fromarray(np.full((8, 8, 3), i * 40, dtype=np.uint8)).save(photos / name)
        # the captions of a photo are not in order in the file, and the raw text has capitals and punctuation
        lines += [f"{name}#{n}\tA Dog, number {i} caption {n} ." for n in (4, 0, 3, 1, 2)]
    lines.append("2258277193_586949ec62.jpg.1#0\tA key with no photo , as in the published file .")
    lines.append("99_unsplit.jpg#0\tA photo in no split list .")
    (text / "Flickr8k.token.txt").write_text("\n".join(lines) + "\n")
    for split, file in (("train", "Flickr_8k.trainImages.txt"), ("val", "Flickr_8k.devImages.txt"),
                        ("test", "Flickr_8k.testImages.txt")):
        (text / file).write_text("\n".join(names[split]) + "\n")
    return text


@pytest.fixture
def photos(official) -> Path:
    """:func:`official`'s photo folder."""
    return official.parent / "Flicker8k_Dataset"


def test_official_files_give_splits_references_and_photos(official, photos):
    images = load_flickr(official)
    assert [(im.split, im.path.name) for im in images] == [("train", "10_a.jpg"), ("train", "11_b.jpg"),
                                                           ("val", "20_c.jpg"), ("test", "30_d.jpg")]
    assert images[0].path == (photos / "10_a.jpg").resolve()
    # five references in caption-number order, tokenised like the Karpathy JSON (lower case, no punctuation)
    assert [r[-1] for r in images[1].references] == ["0", "1", "2", "3", "4"]
    assert images[1].references[0] == ["a", "dog", "number", "1", "caption", "0"]
    # the raw texts beside them, in the same order (what coco-caption's PTB tokenizer reads: eval --ptb)
    assert images[1].raw_references[:2] == ["A Dog, number 1 caption 0 .", "A Dog, number 1 caption 1 ."]
    # ids number the three lists in order, so a photo keeps its id whichever splits are loaded
    test_only = load_flickr(official / "Flickr8k.token.txt", splits=("test",))
    assert [im.image_id for im in test_only] == [3] and [im.image_id for im in images] == [0, 1, 2, 3]
    assert len(load_flickr(official, limit=2)) == 2


def test_max_refs_keeps_each_photos_first_captions_by_number(official):
    images = load_flickr(official, max_refs=2)
    assert [[r[-1] for r in im.references] for im in images] == [["0", "1"]] * 4
    assert images[0].raw_references == ["A Dog, number 0 caption 0 .", "A Dog, number 0 caption 1 ."]


def test_the_photos_folder_is_found_from_the_photos_of_the_asked_splits(official, photos):
    """Only the test photos copied over (to evaluate): the folder is found from them, not from the first photos of a
    train list longer than the probe."""
    for name in ("10_a.jpg", "11_b.jpg", "20_c.jpg"):
        (photos / name).unlink()
    (official / "Flickr_8k.trainImages.txt").write_text("".join(f"1{i}_x.jpg\n" for i in range(10)))
    images = load_flickr(official, splits=("test",))
    assert [im.path for im in images] == [(photos / "30_d.jpg").resolve()]


def test_of_two_folders_holding_the_photos_the_first_place_of_the_layout_wins(official, photos):
    # images/ beside the token file comes before ../Flicker8k_Dataset in FLICKR8K's list of places
    shutil.copytree(photos, official / "images")
    assert load_flickr(official)[0].path == (official / "images" / "10_a.jpg").resolve()


#: where FLICKR8K looks for the photos, relative to Flickr8k_text/ (written out here, not read from the layout, so
#: that a place misspelt in the layout fails): the archive's folder (sic) and its corrected spelling, inside the text
#: folder or beside it, a common copy's images/, and the text folder itself
PHOTO_PLACES = ("Flicker8k_Dataset", "Flickr8k_Dataset", "images", "../Flicker8k_Dataset", "../Flickr8k_Dataset", ".")


@pytest.mark.parametrize("place", PHOTO_PLACES)
def test_the_photos_are_found_in_each_place_a_copy_of_the_data_set_puts_them(official, photos, place):
    # a user who unpacked the archives another way is told to pass --image-root only where no known place holds them
    where = (official / place).resolve()
    if where != photos.resolve():
        shutil.copytree(photos, where, dirs_exist_ok=True)
        shutil.rmtree(photos)
    assert [im.path for im in load_flickr(official)][::3] == [where / "10_a.jpg", where / "30_d.jpg"]


def test_names_and_lines_are_read_without_the_spaces_around_them(official):
    # a hand-edited list with trailing spaces: "10_a.jpg " would be a photo with no caption
    train = official / "Flickr_8k.trainImages.txt"
    train.write_text("10_a.jpg \n  11_b.jpg\t\n")
    token = official / "Flickr8k.token.txt"
    token.write_text("".join(f" {line}  \n" for line in token.read_text().splitlines()))
    images = load_flickr(official, splits=("train",))
    assert [im.path.name for im in images] == ["10_a.jpg", "11_b.jpg"]
    assert images[0].raw_references[0] == "A Dog, number 0 caption 0 ."


def test_a_photo_name_holding_a_hash_keeps_its_captions(official, photos):
    """The caption number is what follows the key's last ``#``."""
    (photos / "30_d.jpg").rename(photos / "30#d.jpg")
    token = official / "Flickr8k.token.txt"
    token.write_text(token.read_text().replace("30_d.jpg#", "30#d.jpg#"))
    (official / "Flickr_8k.testImages.txt").write_text("30#d.jpg\n")
    image = load_flickr(official, splits=("test",))[0]
    assert image.path.name == "30#d.jpg" and [r[-1] for r in image.references] == ["0", "1", "2", "3", "4"]


@pytest.mark.parametrize("suffix", [".png", ".jpeg"])
def test_a_listed_photo_with_another_extension_keeps_its_name(official, photos, suffix):
    """Only a name without any extension (Flickr30k Entities' bare ids) gains ``.jpg``: a copy whose photos were saved
    as ``.png`` or ``.jpeg``, its lists and token file renamed alike, is read, not refused for "30_d.png.jpg"."""
    (photos / "30_d.jpg").rename(photos / f"30_d{suffix}")
    token = official / "Flickr8k.token.txt"
    token.write_text(token.read_text().replace("30_d.jpg#", f"30_d{suffix}#"))
    (official / "Flickr_8k.testImages.txt").write_text(f"30_d{suffix}\n")
    image = load_flickr(official, splits=("test",))[0]
    assert image.path == (photos / f"30_d{suffix}").resolve() and len(image.references) == 5


def test_a_file_that_is_no_flickr_token_file_is_refused_by_name(official, tmp_path):
    assert flickr_layout(str(official / "Flickr8k.token.txt")).name == "flickr8k"  # a string path too
    assert flickr_layout(str(official)).name == "flickr8k" and flickr_layout(tmp_path) is None
    with pytest.raises(ValueError, match="dataset_coco.json is neither Flickr8k.token.txt nor results_20130124.token"):
        load_flickr(tmp_path / "dataset_coco.json")


def test_errors_name_what_is_missing(official, photos, tmp_path):
    photos.rename(tmp_path / "elsewhere")
    with pytest.raises(FileNotFoundError, match="looked for 10_a.jpg and the next listed in .*: pass --image-root"):
        load_flickr(official)
    assert load_flickr(official, image_root=tmp_path / "elsewhere")[0].path.parent == tmp_path / "elsewhere"
    with pytest.raises(ValueError, match="not test2"):
        load_flickr(official, splits=("test2",), image_root=tmp_path / "elsewhere")
    (official / "Flickr_8k.devImages.txt").unlink()
    with pytest.raises(FileNotFoundError, match="Flickr_8k.devImages.txt"):
        load_flickr(official, image_root=tmp_path / "elsewhere")


def test_one_entry_point_reads_every_kind_of_data_set(official, photos, tmp_path):
    assert resolve_dataset(official).name == "Flickr8k.token.txt" and dataset_name(official) == "flickr8k"
    assert [im.split for im in load_captioned(official, splits=("val", "test"))] == ["val", "test"]
    karpathy = tmp_path / "dataset_flickr8k.json"
    karpathy.write_text(json.dumps({"dataset": "flickr8k", "images": [
        {"filename": "10_a.jpg", "split": "train", "imgid": 0, "sentences": [{"tokens": ["a", "dog"]}]}]}))
    assert dataset_name(karpathy) == "flickr8k"
    # a Karpathy JSON away from its photos is refused at once, naming the photo and the option
    with pytest.raises(FileNotFoundError, match="10_a.jpg .*--image-root"):
        load_captioned(karpathy)
    assert load_captioned(karpathy, photos)[0].path.is_file()
    assert load_captioned(karpathy, check_images=False)[0].references == [["a", "dog"]]
    with pytest.raises(FileNotFoundError, match="neither dataset_scenes.json"):
        resolve_dataset(tmp_path / "Flicker8k_Dataset")


def test_the_data_set_is_named_by_what_the_karpathy_loader_reads(tmp_path):
    """``dataset_name`` reads a Karpathy JSON through its loader's reader: a file the loader takes (here saved with a
    byte-order mark, as Windows editors save it) is named by its ``dataset`` field, not by its file name."""
    karpathy = tmp_path / "captions.json"
    karpathy.write_bytes("\ufeff".encode() + json.dumps({"dataset": "flickr8k", "images": [
        {"filename": "10_a.jpg", "split": "train", "imgid": 0, "sentences": [{"tokens": ["a", "dog"]}]}]}).encode())
    assert load_captioned(karpathy, check_images=False)[0].references == [["a", "dog"]]
    assert dataset_name(karpathy) == "flickr8k"
    # a file that is no Karpathy JSON (a list) is named by its file name, as a JSON that does not parse is
    karpathy.write_text("[]")
    assert dataset_name(karpathy) == "captions"


def test_a_karpathy_jsons_dataset_field_wins_over_its_file_name(tmp_path):
    """The docstring's order: the JSON's own ``dataset`` field first, the file's name only without one (a Flickr8k
    file saved under another data set's Karpathy name is still Flickr8k)."""
    karpathy = tmp_path / "dataset_coco.json"
    karpathy.write_text(json.dumps({"dataset": "flickr8k", "images": []}))
    assert dataset_name(karpathy) == "flickr8k"


def test_a_missing_data_set_file_is_named_as_missing(tmp_path):
    # not left to a reader's bare "No such file or directory" further on
    for missing in (tmp_path / "dataset_flickr8k.json", tmp_path / "Flickr8k.token.txt"):
        with pytest.raises(FileNotFoundError, match=r"dataset .*" + missing.name + " does not exist"):
            resolve_dataset(missing)
        with pytest.raises(FileNotFoundError, match=r"dataset .*" + missing.name + " does not exist"):
            load_captioned(missing, check_images=False)


def test_a_karpathy_json_without_a_dataset_field_is_named_by_its_file_name(tmp_path):
    karpathy = tmp_path / "dataset_flickr30k.json"
    karpathy.write_text(json.dumps({"images": []}))
    assert dataset_name(karpathy) == "flickr30k"
    karpathy.write_text("{torn")  # nor when it does not parse
    assert dataset_name(karpathy) == "flickr30k"


def test_trained_on_names_the_data_set_with_its_citation():
    assert trained_on({"trained_on": "X, train split"}) == "X, train split"
    assert trained_on({"dataset": ".cache/scenes-varied/dataset_scenes.json"}).startswith("generated scenes")
    assert trained_on({"dataset": "data/dataset_flickr8k.json"}).startswith("Flickr8k (Hodosh")
    assert trained_on({"dataset": "f8k/Flickr8k_text/Flickr8k.token.txt"}).startswith("Flickr8k (Hodosh")
    assert "AoANet" in trained_on({"imported_from": {"code": "github.com/husthuaan/AoANet"}})


def test_a_run_record_wins_over_the_import_it_started_from_and_an_import_without_its_code_points_to_the_card():
    """``trained_on``'s order: a training run's own record first (a model fine-tuned from imported weights was
    trained on its run's data), then where imported weights came from, with the card as the fallback source."""
    imported = {"code": "github.com/husthuaan/AoANet"}
    assert trained_on({"trained_on": "X, train split", "imported_from": imported}) == "X, train split"
    assert trained_on({"imported_from": {}}) == "the authors' released weights (see its model card)"


def test_the_citations_are_the_papers_the_shipped_cards_cite():
    """Each data set's citation as the shipped Flickr8k cards print it: Entities' venue is IJCV 2017 (its arXiv
    number alone stays the same across versions, so it does not show a wrong venue)."""
    card = (Path(__file__).parents[1] / "docs" / "cards" / "flickr8k" / "sat-supervised.md").read_text()
    flat = " ".join(card.split())
    assert CITATIONS["flickr8k"] in flat and "Flickr8k (Hodosh, Young & Hockenmaier, JAIR 2013)" in flat
    assert ENTITIES_CITATION == "Flickr30k Entities (Plummer et al., IJCV 2017, arXiv:1505.04870)"
    assert "(Plummer et al., IJCV 2017, arXiv:1505.04870" in flat


def test_a_scene_set_is_cited_without_a_split():
    assert trained_on({"dataset": ".cache/scenes/dataset_scenes.json"}) == CITATIONS["scenes"]


def test_a_recorded_path_is_cited_as_its_train_split_and_no_path_as_not_recorded():
    # a checkpoint saved before runs recorded "trained_on": GET /models and the cards read its dataset path
    assert trained_on({"dataset": "coco/annotations/captions_train2014.json"}) == f"{CITATIONS['coco']}, train split"
    assert trained_on({"dataset": "f30k/results_20130124.token"}) == f"{CITATIONS['flickr30k']}, train split"
    assert trained_on({"dataset": "data/my_captions.json"}) == "my_captions.json, train split"
    assert trained_on({}) == trained_on({"dataset": None}) == "not recorded"
    # COCO's own file names, matched whole: a Karpathy JSON or a backup whose name holds one is not COCO's file
    assert named_by_path("data/my_captions_train2014.json") is None
    assert named_by_path("coco/annotations/captions_val2014.json.bak") is None
    assert trained_on({"dataset": "data/my_captions_train2014.json"}) == "my_captions_train2014.json, train split"


def test_a_karpathy_json_of_a_data_set_without_a_citation_is_cited_by_its_own_name():
    """A run trained on ``dataset_NAME.json`` of a data set the project has no citation for: ``GET /models`` and the
    card name the data set (``NAME``), not the JSON's file name."""
    assert trained_on({"dataset": "data/dataset_vizwiz.json"}) == "vizwiz, train split"


def test_the_training_captions_are_the_train_splits_read_without_its_photos(official, photos):
    """The captions the share of novel ones is counted against: the train split's alone, and read when only the
    evaluated photos are on disk."""
    for name in ("10_a.jpg", "11_b.jpg"):
        (photos / name).unlink()
    captions = train_split_captions(official, photos)
    # "a dog number <photo> caption <n>": the five of each of photos 0 and 1
    assert sorted((c[3], c[5]) for c in captions) == [(photo, n) for photo in "01" for n in "01234"]


@pytest.mark.skipif(not (SHARED / "Flickr8k.token.txt").is_file(), reason="../shared/data/flickr8k is not here")
def test_the_official_files_and_the_karpathy_json_agree_on_the_real_data_set():
    official = {im.path.name: im for im in load_flickr(SHARED)}
    karpathy = {im.path.name: im for im in load_captioned(SHARED / "dataset_flickr8k.json", SHARED / "images")}
    assert len(official) == len(karpathy) == 8000
    assert all(official[n].split == karpathy[n].split for n in official)
    assert sum(im.split == "train" for im in official.values()) == 6000
    # the same ids too, so results files written from either layout can be compared
    assert all(official[n].image_id == karpathy[n].image_id for n in official)
    same_refs = sum(official[n].references == karpathy[n].references for n in official)
    assert same_refs == 8000, f"{8000 - same_refs} photos' references differ"


# The files as a researcher brings them: saved by a Windows editor, still compressed, concatenated twice, a photo
# in two splits. Each reads right or is refused in one line naming the file and line, never a silently wrong set.

def test_a_byte_order_mark_is_ignored(official):
    for name in ("Flickr8k.token.txt", "Flickr_8k.trainImages.txt"):
        (official / name).write_bytes("\ufeff".encode() + (official / name).read_bytes())
    images = load_flickr(official)
    # the first photo keeps its caption #0 (it was filed under "\ufeff10_a.jpg") and is found on disk
    assert images[0].path.name == "10_a.jpg" and len(images[0].references) == 5


def test_a_compressed_token_file_or_a_folder_is_named_for_what_it_is(official, tmp_path):
    token = official / "Flickr8k.token.txt"
    token.write_bytes(gzip.compress(token.read_bytes()))
    with pytest.raises(ValueError, match="Flickr8k.token.txt is gzip-compressed: unpack it"):
        load_flickr(official)
    folder = tmp_path / "dataset_coco.json"
    folder.mkdir()
    with pytest.raises(FileNotFoundError, match="dataset_coco.json is a folder, not the data set's file"):
        resolve_dataset(folder)


def test_repeated_captions_and_a_photo_in_two_splits_are_refused_with_their_lines(official):
    token = official / "Flickr8k.token.txt"
    text = token.read_text()
    token.write_text(text + text)  # each photo's first captions would have counted twice
    with pytest.raises(ValueError, match=r"Flickr8k.token.txt:\d+: 10_a.jpg#4 is already on line 1"):
        load_flickr(official)
    token.write_text(text)
    test_list = official / "Flickr_8k.testImages.txt"
    test_list.write_text(test_list.read_text() + "10_a.jpg\n")  # a training photo tested on
    with pytest.raises(ValueError, match=r"testImages.txt:2: 10_a.jpg is already listed at .*trainImages.txt:1"):
        load_flickr(official)


def test_an_empty_split_list_and_a_bad_line_are_named(official):
    token = official / "Flickr8k.token.txt"
    text = token.read_text()
    token.write_text(text + "no tab or number here\n")
    with pytest.raises(ValueError, match=r"Flickr8k.token.txt:\d+: not a '<image>#<n>"):
        load_flickr(official)
    token.write_text(text)
    (official / "Flickr_8k.trainImages.txt").write_text("")
    with pytest.raises(ValueError, match="trainImages.txt is empty"):
        load_flickr(official, splits=("test",))


def test_blank_lines_in_the_split_lists_and_the_token_file_are_skipped(official):
    # a list or token file hand-edited or pasted together has blank lines: each was a photo named ".jpg" with no
    # caption, or a token line without its '#<n>', refusing the whole data set
    test_list = official / "Flickr_8k.testImages.txt"
    test_list.write_text("\n  \n30_d.jpg\n\n")
    token = official / "Flickr8k.token.txt"
    token.write_text("\n" + token.read_text().replace("\n", "\n \n"))
    images = load_flickr(official)
    assert [im.path.name for im in images] == ["10_a.jpg", "11_b.jpg", "20_c.jpg", "30_d.jpg"]
    assert all(len(im.references) == 5 for im in images)


def test_a_photo_listed_twice_in_one_split_is_refused_with_both_lines(official):
    # kept, it would be scored twice in the test split's BLEU and CIDEr
    (official / "Flickr_8k.testImages.txt").write_text("30_d.jpg\n30_d.jpg\n")
    with pytest.raises(ValueError, match=r"testImages.txt:2: 30_d.jpg is already listed at .*testImages.txt:1"):
        load_flickr(official, splits=("test",))


def test_caption_numbers_past_nine_are_read_whole_and_ordered_as_numbers(official):
    # a token file in Flickr's format with more than ten captions a photo: "#10" is caption 10, after caption 9,
    # not a caption 0 of a photo named "30_d.jpg#1", nor sorted before "#2" as text
    token = official / "Flickr8k.token.txt"
    token.write_text(token.read_text() + "".join(f"30_d.jpg#{n}\tcaption {n}\n" for n in range(5, 12)))
    image = load_flickr(official, splits=("test",), max_refs=12)[0]
    assert [r[-1] for r in image.references] == [str(n) for n in range(12)]


def test_a_listed_photo_without_captions_names_its_list_and_line(official):
    (official / "Flickr_8k.devImages.txt").write_text("20_c.jpg\n77_none.jpg\n")
    with pytest.raises(ValueError, match=r"devImages.txt:2: 77_none.jpg is in the val list but has no caption"):
        load_flickr(official)


def test_a_caption_number_that_is_not_a_number_is_refused_with_its_line(official):
    token = official / "Flickr8k.token.txt"
    text = token.read_text()
    token.write_text(text + "10_a.jpg#x\tA Dog with a letter for its number .\n")
    # int("x") raised "invalid literal for int()", naming neither the file nor the line
    line = len(text.splitlines()) + 1
    with pytest.raises(ValueError, match=rf"Flickr8k.token.txt:{line}: not a '<image>#<n>\\t<caption>' line"):
        load_flickr(official)


def test_a_photos_captions_are_kept_in_number_order_whatever_their_text(official):
    # the fixture's texts sort as their numbers do; here caption #0 comes last alphabetically
    token = official / "Flickr8k.token.txt"
    text = token.read_text()
    for n in range(5):
        text = text.replace(f"10_a.jpg#{n}\tA Dog, number 0 caption {n} .", f"10_a.jpg#{n}\t{'edcba'[n]} dog")
    token.write_text(text)
    assert load_flickr(official, splits=("train",))[0].raw_references == ["e dog", "d dog", "c dog", "b dog", "a dog"]


def test_a_caption_without_a_word_is_not_a_reference(official):
    token = official / "Flickr8k.token.txt"
    token.write_text(token.read_text().replace("30_d.jpg#0\tA Dog, number 3 caption 0 .", "30_d.jpg#0\t..."))
    # kept, it would be an empty reference in the place of caption #0
    image = load_flickr(official, splits=("test",))[0]
    assert image.raw_references == [f"A Dog, number 3 caption {n} ." for n in range(1, 5)]


def test_a_test_photo_listed_for_training_too_is_refused_when_only_test_is_read(official):
    # evaluating alone must not hide that the model was trained on the photo it is scored on
    test_list = official / "Flickr_8k.testImages.txt"
    test_list.write_text(test_list.read_text() + "10_a.jpg\n")
    with pytest.raises(ValueError, match=r"testImages.txt:2: 10_a.jpg is already listed at .*trainImages.txt:1"):
        load_flickr(official, splits=("test",))


def test_the_photos_folder_is_found_from_the_first_listed_photos(official, photos):
    """Only the first training photos copied over (to try a run with --limit): the folder is found from the
    first photos of the list, not its last."""
    names = ["10_a.jpg", *(f"1{i}_x.jpg" for i in range(1, 10))]
    (official / "Flickr_8k.trainImages.txt").write_text("".join(f"{name}\n" for name in names))
    token = official / "Flickr8k.token.txt"
    token.write_text(token.read_text() + "".join(f"{name}#0\tA photo not copied .\n" for name in names[1:]))
    images = load_flickr(official, splits=("train",), limit=1)
    assert [im.path for im in images] == [(photos / "10_a.jpg").resolve()]


def test_a_relative_image_root_is_read_from_the_working_folder(official, photos, monkeypatch):
    # as the command line gives it (--image-root Flicker8k_Dataset), not from the token file's folder
    monkeypatch.chdir(photos.parent)
    images = load_captioned(official, image_root="Flicker8k_Dataset", splits=("test",))
    assert [im.path for im in images] == [Path("Flicker8k_Dataset", "30_d.jpg")]


def test_one_missing_photo_does_not_hide_the_folder_that_holds_the_rest(official, photos):
    (photos / "10_a.jpg").unlink()  # the first training photo, which alone decided the folder before
    assert load_flickr(official)[1].path == (photos / "11_b.jpg").resolve()
    with pytest.raises(FileNotFoundError, match=r"10_a.jpg of .* does not exist"):
        load_captioned(official)


def test_a_missing_photo_after_the_first_is_named_before_anything_slow(official, photos):
    # every photo is looked for, not the first alone: training would otherwise stop at it mid-extraction
    (photos / "30_d.jpg").unlink()
    with pytest.raises(FileNotFoundError, match=r"30_d.jpg of .* does not exist"):
        load_captioned(official)


def test_a_folder_holding_the_scenes_and_a_token_file_is_read_as_the_scenes(official):
    # resolve_dataset's order: dataset_scenes.json first, then the Flickr token files, then COCO's
    (official / "dataset_scenes.json").write_text(json.dumps({"dataset": "scenes", "images": []}))
    assert resolve_dataset(official) == official / "dataset_scenes.json"


def test_the_folder_holding_both_unpacked_archives_is_read(official):
    assert resolve_dataset(official.parent) == official / "Flickr8k.token.txt"
    assert len(load_captioned(official.parent)) == 4


def test_an_image_root_that_is_not_a_folder_says_what_it_should_be(official):
    with pytest.raises(FileNotFoundError, match="--image-root .*token.txt is not a folder: it should be the folder "
                                                "of the photos themselves"):
        load_captioned(official, image_root=official / "Flickr8k.token.txt")


def test_eval_without_a_dataset_names_the_one_the_checkpoint_was_trained_on(official, tmp_path, monkeypatch,
                                                                            capsys):
    trained = save_checkpoint(tmp_path / "trained", tiny_model("sat"), VOCAB, TINY_SPEC,
                              meta={"train_config": {"dataset": str(official)}})
    monkeypatch.chdir(tmp_path)  # where the default scene set was never generated
    with pytest.raises(SystemExit):
        main(["eval", str(trained)])
    assert f"was trained on {official}): give --dataset" in capsys.readouterr().err
