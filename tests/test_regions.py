"""Precomputed region features (bottom-up style): the .npz format, padding and masks, the scene stand-in, and a
model trained on regions that never attends to padding."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from captioner.models.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from captioner.models.data.karpathy import CaptionedImage, load_karpathy
from captioner.models.data.regions import RegionStore, read_regions, save_regions, scene_regions, write_scene_regions
from captioner.models.data.scenes import Variation, generate
from captioner.models.data.stores import open_feature_store
from captioner.models.decoding import beam_search
from captioner.models.encoder import EncoderSpec
from captioner.models.export.onnx import ExportUnsupported, export_checkpoints
from captioner.models.inference import torch_runtime
from captioner.models.protocol import Geometry
from captioner.models.training import TrainConfig, train
from captioner.service.runtime import load_runtimes

from .serving_helpers import TINY_SPEC, VOCAB, tiny_model

# tiny tensors gain nothing from a second thread, and on a busy machine waiting for it dominates
pytestmark = pytest.mark.usefixtures("one_thread")

REGION_ENCODER = EncoderSpec(image_size=128)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("features")


@pytest.fixture(scope="module")
def scene_regions_dir(scenes, cache, tmp_path_factory):
    return write_scene_regions(scenes.parent, tmp_path_factory.mktemp("regions"), REGION_ENCODER, cache,
                               progress=False)


def _image(i: int) -> CaptionedImage:
    return CaptionedImage(image_id=100 + i, path=Path(f"/data/images/img_{i}.jpg"), split="train", references=[["a"]])


def test_loader_pads_and_masks_varying_region_counts(tmp_path):
    rng = np.random.default_rng(0)
    images, saved = [_image(i) for i in range(4)], []
    images[3].info["cocoid"] = 391895  # a Karpathy JSON's photo: its own id, and COCO's
    for i, n in enumerate([2, 5, 3, 1]):
        features = rng.normal(size=(n, 4)).astype(np.float32)
        xy = rng.uniform(0, 300, size=(n, 2))
        boxes = np.concatenate([xy, xy + rng.uniform(5, 100, size=(n, 2))], axis=1).astype(np.float32)
        size = (640 + i, 480 - i)
        # the file name, the image id, or COCO's id
        name = f"img_{i}.npz" if i < 2 else f"{images[i].image_id}.npz" if i == 2 else "391895.npz"
        save_regions(tmp_path / name, features, boxes, size)
        saved.append((features, boxes, size))
    store = RegionStore(tmp_path, images)
    vis = store.batch([im.key for im in images])
    assert store.feat_dim == 4 and vis.feats.shape == (4, 5, 4)
    assert vis.mask.tolist() == [[True] * 2 + [False] * 3, [True] * 5, [True] * 3 + [False] * 2,
                                 [True] + [False] * 4]
    for row, (features, boxes, size) in enumerate(saved):
        n = len(features)
        assert torch.equal(vis.feats[row, :n], torch.from_numpy(features))
        assert torch.all(vis.feats[row, n:] == 0)
        geometry = vis.geometry[row]
        assert geometry.kind == "regions" and geometry.grid_hw is None and geometry.image_size == size
        assert np.array_equal(geometry.boxes, boxes)  # one box per real region, in original-image pixels
        assert np.allclose(geometry.to_json()["boxes"], boxes, atol=0.005)
    # the same batch in another order: every image keeps its own regions
    again = store.batch([images[2].key, images[0].key])
    assert again.feats.shape == (2, 3, 4) and torch.equal(again.feats[0], vis.feats[2, :3])
    # moved to the evaluation's device (captioner eval, grounding), the batch keeps its boxes: without them
    # grounding placed the regions' weights on the encoder's grid cells
    moved = vis.to("cpu")
    assert [(g.kind, g.image_size) for g in moved.geometry] == [("regions", size) for _, _, size in saved]
    assert all(np.array_equal(g.boxes, boxes) for g, (_, boxes, _) in zip(moved.geometry, saved))


def test_a_region_geometry_says_it_has_no_grid_in_json():
    """A region batch's geometry has no grid: its JSON (the answers' ``geometry``) says ``"grid_hw": null``, the
    value a client tests to tell regions from a grid, not an empty list."""
    boxes = np.array([[1.0, 2.0, 30.5, 40.25]], dtype=np.float32)
    assert Geometry("regions", (64, 48), None, boxes).to_json() == {
        "kind": "regions", "image_size": [64, 48], "grid_hw": None, "boxes": [[1.0, 2.0, 30.5, 40.25]]}
    assert Geometry("grid", (64, 48), (2, 3), boxes).to_json()["grid_hw"] == [2, 3]


def test_a_save_interrupted_mid_write_leaves_the_old_region_file_whole(tmp_path, monkeypatch):
    """save_regions's promise ("an interrupted writer never leaves half a file"): a save killed half-way through its
    bytes (Ctrl-C, a full disk) leaves the file it was replacing readable, and no temporary file beside it."""
    path = tmp_path / "img_0.npz"
    save_regions(path, np.ones((3, 4)), np.zeros((3, 4)), (10, 10))

    def half_then_interrupted(self, data):
        with open(self, "wb") as file:
            file.write(data[: len(data) // 2])
        raise KeyboardInterrupt

    monkeypatch.setattr(Path, "write_bytes", half_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_regions(path, np.zeros((5, 4)), np.zeros((5, 4)), (20, 20))
    monkeypatch.undo()
    features, geometry = read_regions(path)
    assert np.array_equal(features, np.ones((3, 4))) and geometry.image_size == (10, 10)
    assert [p.name for p in tmp_path.iterdir()] == ["img_0.npz"]


def test_missing_and_malformed_region_files_are_reported(tmp_path):
    with pytest.raises(ValueError, match="boxes must be"):
        save_regions(tmp_path / "img_0.npz", np.zeros((3, 4)), np.zeros((2, 4)), (10, 10))
    save_regions(tmp_path / "img_0.npz", np.zeros((3, 4)), np.zeros((3, 4)), (10, 10))
    with pytest.raises(FileNotFoundError, match="img_1.npz"):
        RegionStore(tmp_path, [_image(0), _image(1)])
    save_regions(tmp_path / "img_1.npz", np.zeros((2, 6)), np.zeros((2, 4)), (10, 10))
    store = RegionStore(tmp_path, [_image(0), _image(1)])
    with pytest.raises(ValueError, match="6-d features"):
        store.batch([_image(0).key, _image(1).key])
    # a mistyped regions:DIR is said to be missing, not taken for a folder of which every file is missing
    with pytest.raises(FileNotFoundError, match=f"region feature folder {tmp_path / 'bottom-up'} does not exist"):
        RegionStore(tmp_path / "bottom-up", [_image(0)])


def test_a_features_value_that_is_neither_grid_nor_a_region_folder_is_refused(tmp_path):
    """``--features`` is ``grid`` or ``regions:DIR``: another word, a folder after ``grid`` or none after ``regions``
    is a mistake to say, not a run on the grid features (extracted first, for hours on COCO)."""
    for value in ("bogus", "grid:/data/bottom-up", "regions:"):
        with pytest.raises(ValueError, match=f"--features must be 'grid' or 'regions:DIR', got '{value}'"):
            open_feature_store(value, [], REGION_ENCODER, tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


def test_scene_stand_in_has_one_region_per_object_plus_background(scenes, scene_regions_dir):
    manifest = json.loads((scene_regions_dir / "regions.json").read_text())
    assert manifest["feat_dim"] == 320 and manifest["encoder"]["image_size"] == 128
    images = load_karpathy(scenes)
    assert len(list(scene_regions_dir.glob("*.npz"))) == len(images)
    counts = set()
    for im in images[:12]:
        features, geometry = read_regions(scene_regions_dir / f"{im.path.stem}.npz")
        objects = im.info["objects"]
        assert len(features) == len(objects) + 5 and np.isfinite(features.astype(np.float32)).all()
        assert geometry.image_size == (256, 256)
        for obj, (x1, y1, x2, y2) in zip(objects, geometry.boxes):  # object regions come first, in order
            (cx, cy), r = obj["center"], obj["radius"]
            assert x1 <= cx <= x2 and y1 <= cy <= y2
            assert cx - r - 2 <= x1 and x2 <= cx + r + 2 and cy - r - 2 <= y1 and y2 <= cy + r + 2
        assert geometry.boxes[len(objects)].tolist() == [0, 0, 256, 256]  # then the whole image
        counts.add(len(features))
    assert len(counts) > 1  # N varies from image to image


def test_sat_trains_on_regions_and_never_attends_to_padding(scenes, scene_regions_dir, cache, tmp_path):
    features = f"regions:{scene_regions_dir}"
    best = train(TrainConfig(dataset=str(scenes), out=str(tmp_path / "run"), features=features, epochs=1,
                             batch_size=16, lr=3e-3, train_limit=16, val_limit=4, cache_dir=str(cache),
                             model_args=dict(embed_dim=32, hidden_dim=48, attn_dim=32), progress=False))
    ckpt = load_checkpoint(best)
    assert ckpt.meta["train_config"]["features"] == features and ckpt.model.feat_dim == 320
    images = load_karpathy(scenes, splits=("val",))
    vis = RegionStore(scene_regions_dir, images).batch([im.key for im in images])
    assert not vis.mask.all()
    for row, hyps in enumerate(beam_search(ckpt.model, vis, k=2, max_len=8)):
        attention = hyps[0].attention
        assert torch.all(attention[:, ~vis.mask[row]] == 0)
        torch.testing.assert_close(attention[:, vis.mask[row]].sum(-1), torch.ones(len(attention)))


def test_a_checkpoint_trained_on_regions_refuses_to_caption_photos(tmp_path):
    """A photo gives grid features: a region checkpoint would caption them without complaint, and wrongly, so the
    photo-captioning paths (the CLI's caption, the service) refuse it and say how to evaluate it instead."""
    save_checkpoint(tmp_path / "weights" / "grid", tiny_model("sat"), VOCAB, TINY_SPEC)
    save_checkpoint(tmp_path / "weights" / "regions", tiny_model("sat"), VOCAB, TINY_SPEC,
                    meta={"train_config": {"features": "regions:/data/bottom-up"}})
    with pytest.raises(CheckpointError, match="--features regions:DIR"):
        torch_runtime(tmp_path / "weights" / "regions")
    assert list(load_runtimes(tmp_path / "weights", [], device_name="cpu", default_backend="torch")) == ["grid"]


def test_export_refuses_a_checkpoint_trained_on_region_features_and_goes_on_with_the_others(tmp_path):
    """``captioner export`` crashed on one (a matrix shape error from the grid its graph was traced on), and stopped
    the whole batch (the ONNX audit)."""
    save_checkpoint(tmp_path / "regions", tiny_model("sat"), VOCAB, TINY_SPEC,
                    meta={"train_config": {"features": "regions:/data/bottom-up"}})
    save_checkpoint(tmp_path / "grid", tiny_model("sat"), VOCAB, TINY_SPEC)
    results = export_checkpoints({"regions": tmp_path / "regions", "grid": tmp_path / "grid"}, tmp_path / "onnx")
    assert isinstance(results["regions"], ExportUnsupported) and "trained on region features" in str(results["regions"])
    assert not isinstance(results["grid"], ExportUnsupported) and not (tmp_path / "onnx" / "regions").exists()


def test_a_files_own_name_is_found_before_the_image_id_and_a_folders_width_must_be_a_count(tmp_path):
    save_regions(tmp_path / "img_0.npz", np.ones((2, 4)), np.zeros((2, 4)), (10, 10))
    save_regions(tmp_path / "100.npz", np.zeros((3, 4)), np.zeros((3, 4)), (10, 10))  # an older layout's, beside it
    assert RegionStore(tmp_path, [_image(0)]).batch([_image(0).key]).feats.tolist() == [[[1.0] * 4] * 2]
    for feat_dim in (True, 0):
        (tmp_path / "regions.json").write_text(json.dumps({"feat_dim": feat_dim}))
        with pytest.raises(ValueError, match=f"feat_dim is {feat_dim}, not a feature width"):
            RegionStore(tmp_path, [_image(0)])
    save_regions(tmp_path / "img_1.npz", np.ones((2, 1)), np.zeros((2, 4)), (10, 10))
    (tmp_path / "regions.json").write_text(json.dumps({"feat_dim": 1}))  # the least width: one number a region
    assert RegionStore(tmp_path, [_image(1)]).batch([_image(1).key]).feats.shape == (1, 2, 1)


def test_a_photo_that_records_its_coco_id_takes_that_file_never_the_one_its_karpathy_number_names(tmp_path):
    """Karpathy's dataset_coco.json numbers its photos 0..123286 (``imgid``) beside COCO's id (``cocoid``), and a
    bottom-up folder names its files after COCO's id: there about one Karpathy number in five is another photo's COCO
    id, whose regions were loaded in silence."""
    photo = _image(0)  # Karpathy's number 100
    photo.info["cocoid"] = 391895
    save_regions(tmp_path / "100.npz", np.zeros((2, 4)), np.zeros((2, 4)), (10, 10))  # COCO's photo 100: another
    save_regions(tmp_path / "391895.npz", np.ones((3, 4)), np.zeros((3, 4)), (10, 10))
    assert RegionStore(tmp_path, [photo]).batch([photo.key]).feats.tolist() == [[[1.0] * 4] * 3]
    (tmp_path / "391895.npz").unlink()
    with pytest.raises(FileNotFoundError, match="1 image"):  # missing, rather than another photo's
        RegionStore(tmp_path, [photo])


@pytest.mark.parametrize("features, boxes, size, message", [
    (np.zeros((0, 4)), np.zeros((0, 4)), (10, 10), r"features must be \[N >= 1, D\]"),
    (np.zeros((2, 4)), np.zeros((2, 4)), (10, 10, 3), r"image_size must be \(width, height\)")])
def test_a_region_file_without_regions_or_of_another_size_shape_is_refused(tmp_path, features, boxes, size, message):
    with pytest.raises(ValueError, match=message):
        save_regions(tmp_path / "img_0.npz", features, boxes, size)


def test_scene_regions_are_each_objects_box_and_features_weighted_by_coverage_then_the_image_and_quadrants():
    # a 64×32 scene on a 4×4 grid (cells 16×8): object 1 fills cell 0 and half of cell 1, object 2 cell 15
    labels = np.zeros((32, 64), np.uint8)
    labels[0:8, 0:24] = 1
    labels[24:32, 48:64] = 2
    grid = np.eye(16, dtype=np.float32)  # cell i's feature is the i-th unit vector: a region's feature, its weights
    features, boxes = scene_regions(labels, grid, EncoderSpec(image_size=128))
    assert boxes.tolist() == [[0, 0, 24, 8], [48, 24, 64, 32], [0, 0, 64, 32], [0, 0, 32, 16], [32, 0, 64, 16],
                              [0, 16, 32, 32], [32, 16, 64, 32]]
    expected = np.zeros((7, 16), np.float32)
    expected[0, [0, 1]] = [2 / 3, 1 / 3]
    expected[1, 15] = 1
    expected[2] = 1 / 16
    expected[3, [1, 4, 5]] = [0.2, 0.4, 0.4]  # the top-left quadrant's background: around object 1
    expected[4, [2, 3, 6, 7]] = 0.25
    expected[5, [8, 9, 12, 13]] = 0.25
    expected[6, [10, 11, 14]] = 1 / 3  # the bottom-right quadrant's: around object 2
    np.testing.assert_allclose(features, expected, atol=3e-3)  # coverage is read from an 8-bit resized mask
    # a centre crop (the middle 32×32) sees neither object 1's cells past x = 16 nor object 2 beyond it: an object
    # outside what the encoder sees is left out
    labels[:] = 0
    labels[0:8, 0:8] = 1
    labels[24:32, 24:40] = 2
    _, boxes = scene_regions(labels, grid, EncoderSpec(image_size=128, resize="center_crop", resize_to=128))
    assert boxes[0].tolist() == [24, 24, 40, 32] and len(boxes) == 1 + 1 + 4


def test_a_region_file_records_its_scenes_size_as_width_and_height(tmp_path, cache):
    # varied scenes have canvases of every aspect ratio, portrait included: a swapped pair would lay the boxes askew
    dataset = generate(tmp_path / "varied", {"train": 6}, seed=2, progress=False, variation=Variation(classic_share=0))
    folder = write_scene_regions(dataset.parent, tmp_path / "regions", REGION_ENCODER, cache, progress=False)
    sizes = []
    for image in load_karpathy(dataset):
        with Image.open(image.path) as picture:
            sizes.append(picture.size)
        assert read_regions(folder / f"{image.path.stem}.npz")[1].image_size == sizes[-1]
    assert any(width != height for width, height in sizes)


def test_a_data_set_without_object_masks_is_refused_before_any_feature_is_extracted(scenes, tmp_path):
    """Flickr8k or COCO given to ``captioner data regions``: refused at once, not after extracting every photo's
    features (hours on COCO) to fail then at the first photo's mask."""
    data = json.loads(scenes.read_text())
    data["images"] = data["images"][:4]
    for entry in data["images"]:
        del entry["mask"]
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "images").symlink_to(scenes.parent / "images")
    dataset = tmp_path / "photos" / "dataset_scenes.json"
    dataset.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=f"{dataset} has no object masks"):
        write_scene_regions(dataset, tmp_path / "regions", REGION_ENCODER, tmp_path / "cache", progress=False)
    assert not (tmp_path / "cache").exists() and not (tmp_path / "regions").exists()


def test_a_data_set_without_images_is_refused_as_one_without_object_masks(tmp_path):
    """An empty data set file (every image filtered out, or one still being written) given to ``captioner data
    regions`` gets the command's refusal, not an IndexError traceback from looking for its first image's mask."""
    dataset = tmp_path / "dataset_scenes.json"
    dataset.write_text(json.dumps({"dataset": "scenes", "images": []}))
    with pytest.raises(ValueError, match=f"{dataset} has no object masks"):
        write_scene_regions(tmp_path, tmp_path / "regions", REGION_ENCODER, tmp_path / "cache", progress=False)
    assert not (tmp_path / "regions").exists()


def test_writing_a_scene_region_folder_again_keeps_the_files_it_has(scenes, scene_regions_dir, cache, capsys):
    files = sorted(scene_regions_dir.glob("*.npz"))
    stamps = [path.stat().st_mtime_ns for path in files]
    # the folders as strings, as `captioner data regions` passes them; no progress bar where none is asked for
    write_scene_regions(str(scenes.parent), str(scene_regions_dir), REGION_ENCODER, cache, progress=False)
    assert [path.stat().st_mtime_ns for path in files] == stamps  # a rerun resumes
    assert capsys.readouterr().err == ""


def test_writing_a_scene_region_folder_shows_its_progress_unless_told_not_to(scenes, scene_regions_dir, cache, capsys):
    """``captioner data regions`` leaves ``progress`` to its default: a run over every scene (or a large generated
    set) says how far it has come rather than nothing until it ends."""
    write_scene_regions(scenes.parent, scene_regions_dir, REGION_ENCODER, cache)
    assert "writing regions" in capsys.readouterr().err


def test_a_region_file_written_by_another_tool_is_checked_when_read(tmp_path):
    """A bottom-up conversion writes its .npz itself, not through save_regions: a file whose boxes do not pair with
    its regions is refused when read, not padded into a batch whose heatmaps take the wrong boxes."""
    np.savez(tmp_path / "img_0.npz", features=np.zeros((3, 4), np.float16), boxes=np.zeros((2, 4)),
             image_size=np.array([10, 10]))
    with pytest.raises(ValueError, match=r"boxes must be \[N, 4\] = \[3, 4\], got \(2, 4\)"):
        read_regions(tmp_path / "img_0.npz")


def test_images_without_region_files_are_counted_and_the_first_three_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"^4 image\(s\) have no region file in .*, e\.g\. img_0\.npz, "
                                                r"img_1\.npz, img_2\.npz \(named"):
        RegionStore(tmp_path, [_image(i) for i in range(4)])
