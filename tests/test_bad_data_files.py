"""Data files a user gives that are damaged or of another kind: a region folder's manifest or ``.npz``, Flickr30k
Entities text that is not UTF-8.  Each is a ValueError naming the file (they were a KeyError, a BadZipFile, a
pickle refusal or the codec's message alone, none naming it)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from captioner.models.data.entities import EntitiesDataset
from captioner.models.data.karpathy import CaptionedImage
from captioner.models.data.regions import MANIFEST, RegionStore, read_regions, save_regions

from .leaks import nothing_left_open


def photo(number: int) -> CaptionedImage:
    return CaptionedImage(image_id=number, path=Path(f"/data/images/img_{number}.jpg"), split="train",
                          references=[["a"]])


@pytest.mark.parametrize("damage", ["not an npz", "cut short", "an array missing", "empty"])
def test_a_damaged_region_file_is_named(damage, tmp_path):
    path = tmp_path / "img_0.npz"
    save_regions(path, np.zeros((3, 4)), np.zeros((3, 4)), (10, 10))
    whole = path.read_bytes()
    if damage == "empty":  # a converter stopped before its first byte: numpy's EOFError names no file
        path.write_bytes(b"")
    elif damage == "not an npz":
        path.write_bytes(b"features, boxes\n1, 2\n")
    elif damage == "cut short":
        path.write_bytes(whole[: len(whole) // 2])
    else:
        np.savez(path, features=np.zeros((3, 4)), boxes=np.zeros((3, 4)))
    with nothing_left_open():  # numpy left a torn zip open
        with pytest.raises(ValueError, match=f"{path} is not a region file"):
            read_regions(path)


@pytest.mark.parametrize("manifest, reason", [(b"{torn", "not JSON"), (b"[4]", "not an object"),
                                              (b'{"feat_dim": "wide"}', "not a feature width")])
def test_a_damaged_region_manifest_is_named(manifest, reason, tmp_path):
    save_regions(tmp_path / "img_0.npz", np.zeros((3, 4)), np.zeros((3, 4)), (10, 10))
    (tmp_path / MANIFEST).write_bytes(manifest)
    with pytest.raises(ValueError, match=rf"{tmp_path / MANIFEST}.*{reason}"):
        RegionStore(tmp_path, [photo(0)])


def test_entities_text_that_is_not_utf8_is_named(tmp_path):
    for part in ("Sentences", "Annotations"):
        (tmp_path / part).mkdir()
    (tmp_path / "Sentences" / "1000.txt").write_bytes("[/EN#1/people A man] rides .\n".encode("utf-16"))
    (tmp_path / "Annotations" / "1000.xml").write_text("<annotation/>")
    with pytest.raises(ValueError, match=rf"{tmp_path / 'Sentences' / '1000.txt'}:1 is not UTF-8"):
        EntitiesDataset(tmp_path).load("images/1000_abc.jpg")
    (tmp_path / "UNRELATED_CAPTIONS").write_bytes(b"# format\n1000 1\n\xe9\n")
    with pytest.raises(ValueError, match=rf"{tmp_path / 'UNRELATED_CAPTIONS'}:3 is not UTF-8"):
        EntitiesDataset(tmp_path)
