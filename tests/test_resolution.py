"""``captioner resolution-check``: the originals of a split's photos against the data set's small copies, captioned
by the service's own preprocessing and scored against the same references."""

import inspect
import json
import re
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image
from skimage import data

from captioner.models.data.karpathy import CaptionedImage, load_karpathy
from captioner.models.decoding import DecodingRules
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


def test_a_folder_holding_none_of_the_originals_is_refused_before_anything_is_captioned(tmp_path):
    """A wrong ``--full-root`` (or one whose files are named otherwise) would score nothing against nothing: it is
    refused naming the folder, before any photo is captioned."""
    images = [SimpleNamespace(path=tmp_path / "copies" / name) for name in ("cat.jpg", "dog.jpg")]
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "cat.png").write_bytes(b"")  # the same photo under another name is not its original
    pipeline = SimpleNamespace(runtime=SimpleNamespace(default_rules=None))  # not callable: it captions nothing
    refusal = re.escape(f"none of the 2 photos has an original in {tmp_path / 'full'}")
    with pytest.raises(FileNotFoundError, match=refusal):
        resolution_check(pipeline, images, tmp_path / "full")


class RecordingPipeline:
    """A pipeline that records how it is called and captions an original by its file's name, a copy as a blur."""

    runtime = SimpleNamespace(default_rules=DecodingRules())

    def __init__(self):
        self.calls = []

    def __call__(self, paths, beam_size, max_len, rules):
        self.calls.append(([f"{path.parent.name}/{path.name}" for path in paths], beam_size, max_len, rules))
        return [SimpleNamespace(caption=f"a {path.stem}" if path.parent.name == "full" else "a blur") for path in paths]


def _copies_with_originals(tmp_path, names: tuple[str, ...], originals: tuple[str, ...] | None = None) -> list:
    """Test photos ``names`` as empty files under ``copies/``, each referenced as "a <its name>", and the originals
    ``originals`` (default: every one) under ``full/``."""
    for folder, present in (("copies", names), ("full", names if originals is None else originals)):
        (tmp_path / folder).mkdir()
        for name in present:
            (tmp_path / folder / name).write_bytes(b"")
    return [CaptionedImage(i, tmp_path / "copies" / name, "test", [["a", name[:-4]]]) for i, name in enumerate(names)]


def test_each_side_is_captioned_as_asked_in_batches_and_the_difference_is_originals_minus_copies(tmp_path):
    """``captioner resolution-check`` passes the checkpoint's rules or the ones asked for on the command line
    (``--length-penalty``, ``--block-trigrams``): each side is captioned with them, the beam and length asked for,
    and every photo once, in batches of ``batch`` (three photos in batches of two); the difference reported is
    the originals' score minus the copies'."""
    images = _copies_with_originals(tmp_path, ("cat.jpg", "dog.jpg", "owl.jpg"))
    asked, pipeline = DecodingRules(length_penalty=0.5, block_trigrams=True), RecordingPipeline()
    report = resolution_check(pipeline, images, tmp_path / "full", beam_size=4, max_len=7, rules=asked, batch=2)
    assert pipeline.calls == [(["copies/cat.jpg", "copies/dog.jpg"], 4, 7, asked), (["copies/owl.jpg"], 4, 7, asked),
                              (["full/cat.jpg", "full/dog.jpg"], 4, 7, asked), (["full/owl.jpg"], 4, 7, asked)]
    assert report["images"] == 3 and report["same_caption"] == 0 and len(report["examples"]) == 3
    # originals − copies, not the other way round: the originals' captions name the photos, the copies' do not
    cider = report["originals_minus_copies"]["CIDEr-D"]
    assert cider["difference"] > 0 and report["originals"]["CIDEr-D"] > report["copies"]["CIDEr-D"]
    assert cider["difference"] == pytest.approx(report["originals"]["CIDEr-D"] - report["copies"]["CIDEr-D"],
                                                abs=1e-4)


def test_a_photo_without_an_original_before_the_others_leaves_their_references_in_place(tmp_path):
    """The references are the matched photos' own: a photo left out for want of an original, listed first, must
    not shift every later photo onto its neighbour's references.  Originals are matched by the whole file name,
    whatever its suffix, and only captions that differ are examples."""
    images = _copies_with_originals(tmp_path, ("cat.jpg", "dog.png", "owl.jpg"), originals=("dog.png", "owl.jpg"))
    report = resolution_check(RecordingPipeline(), images, tmp_path / "full", beam_size=2, max_len=5)
    assert report["images"] == 2
    # each original is captioned "a <its name>", which is its reference word for word
    assert report["originals"]["BLEU-1"] == pytest.approx(1.0) and report["copies"]["BLEU-1"] == pytest.approx(0.5)
    # the copies given as their own originals: the same captions on both sides, so no examples
    same = resolution_check(RecordingPipeline(), images, tmp_path / "copies")
    assert same["same_caption"] == 3 and same["examples"] == []


def test_the_report_shows_the_first_ten_photos_whose_captions_differ_not_every_one(tmp_path):
    """On a test split of a thousand photos most captions may differ; the printed report (and ``--output``) shows
    ten of them in the split's order as examples, not a thousand entries that bury the scores above them."""
    names = tuple(f"photo{i:02d}.jpg" for i in range(12))
    report = resolution_check(RecordingPipeline(), _copies_with_originals(tmp_path, names), tmp_path / "full")
    assert report["images"] == 12 and report["same_caption"] == 0
    shown = [{"image": name, "copy": "a blur", "original": f"a {name[:-4]}"} for name in names[:10]]
    assert report["examples"] == shown


def test_a_library_callers_check_captions_as_the_pipeline_and_the_command_do_by_default(tmp_path):
    """``resolution_check(pipeline, images, root)`` with no beam or length captions each side as ``Pipeline`` and
    ``captioner resolution-check`` do by default (a beam of 3, at most 20 words): a check of another length scores
    captions cut elsewhere than the ones the model's other reports score."""
    defaults = inspect.signature(Pipeline.__call__).parameters
    pipeline = RecordingPipeline()
    resolution_check(pipeline, _copies_with_originals(tmp_path, ("cat.jpg",)), tmp_path / "full")
    asked = {(beam, longest) for _, beam, longest, _ in pipeline.calls}
    assert asked == {(defaults["beam_size"].default, defaults["max_len"].default)} == {(3, 20)}


def test_the_ten_examples_are_ten_differing_photos_even_after_ones_captioned_alike(tmp_path):
    """The examples are the first ten photos whose captions differ: a photo captioned alike among the first ten
    (``blur.jpg``'s original is captioned "a blur", as every copy is) must not leave only nine shown."""
    names = ("blur.jpg", *(f"photo{i:02d}.jpg" for i in range(11)))
    report = resolution_check(RecordingPipeline(), _copies_with_originals(tmp_path, names), tmp_path / "full")
    assert report["same_caption"] == 1
    assert [example["image"] for example in report["examples"]] == list(names[1:11])


def test_a_folder_named_like_a_photo_is_not_its_original(tmp_path):
    """Originals are files: a folder under ``--full-root`` named like a photo (an unpacked archive's folder) is no
    original, so its photo is left out as one without an original, not captioned and the check stopped on it."""
    images = _copies_with_originals(tmp_path, ("cat.jpg", "owl.jpg"), originals=("owl.jpg",))
    (tmp_path / "full" / "cat.jpg").mkdir()
    pipeline = RecordingPipeline()
    report = resolution_check(pipeline, images, tmp_path / "full")
    assert report["images"] == 1 and [paths for paths, *_ in pipeline.calls] == [["copies/owl.jpg"], ["full/owl.jpg"]]
