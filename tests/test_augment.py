"""Mirror-image augmentation (``captioner train --augment hflip``): the cached mirror images are the flipped photos
through the same encoder, the mixed store returns each key's own view, and an XE epoch shows every caption once,
in one seeded view, with left and right swapped where the photo is mirrored."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from captioner.models.data.features import FeatureStore, extract_features
from captioner.models.data.karpathy import load_karpathy
from captioner.models.data import stores
from captioner.models.data.stores import MirroredStore, mirrored_key, open_feature_store
from captioner.models.encoder import EncoderSpec, GridEncoder, preprocess
from captioner.models.images import load_image
from captioner.models.protocol import VisualBatch
from captioner.models.training import TrainConfig, train
from captioner.models.training.loop import prepare_run
from captioner.models.training.xe import mirror_words

pytestmark = pytest.mark.usefixtures("one_thread")

SPEC = EncoderSpec(image_size=128)
SMALL = dict(embed_dim=32, hidden_dim=48, attn_dim=32, dropout=0.3)


def _config(scenes, out, cache, **overrides):
    cfg = dict(dataset=str(scenes), out=str(out), model_args=SMALL, cache_dir=str(cache), epochs=2, batch_size=16,
               lr=3e-3, progress=False, encoder={"image_size": 128}, augment="hflip")
    cfg.update(overrides)
    return TrainConfig(**cfg)


def test_the_mirror_view_is_the_flipped_photo_through_the_same_encoder(scenes, tmp_path):
    images = load_karpathy(scenes, splits=("train",))[:3]
    plain = extract_features(images, SPEC, tmp_path, progress=False)
    mirrored = extract_features(images, SPEC, tmp_path, progress=False, view="hflip")
    assert mirrored.folder != plain.folder and mirrored.view == "hflip" and plain.view == ""
    pixels = torch.stack([preprocess(load_image(im.path), SPEC)[0] for im in images])
    with torch.no_grad():
        expected = GridEncoder(SPEC).eval()(pixels.flip(-1))
    keys = [im.key for im in images]
    torch.testing.assert_close(mirrored.get(keys), expected, atol=2e-3, rtol=2e-3)  # float16 storage
    assert (mirrored.get(keys) - plain.get(keys)).abs().max() > 0.1
    # a store of the photos never stands in for their mirror images, nor the other way round
    assert extract_features(images[:2], SPEC, tmp_path, progress=False, view="hflip").folder == mirrored.folder
    assert extract_features(images[:2], SPEC, tmp_path, progress=False).folder == plain.folder
    with pytest.raises(ValueError, match="unknown view"):
        extract_features(images, SPEC, tmp_path, view="vflip")


class _Constant:
    """A store whose features for key k are all ``value + ord(k[0])``, in ``dtype``; with ``geometry``, each item's
    geometry is its key."""

    feat_dim = 2

    def __init__(self, value, dtype=torch.float, geometry=False):
        self.value, self.dtype, self.geometry, self.asked = value, dtype, geometry, []

    def batch(self, keys):
        self.asked.append(list(keys))
        rows = [[[self.value + ord(key[0])] * 2] for key in keys]
        feats = torch.tensor(rows, dtype=self.dtype).reshape(len(keys), 1, 2)
        return VisualBatch.from_features(feats, list(keys) if self.geometry else None)


def test_the_mixed_store_answers_each_key_from_its_own_view_in_the_order_asked():
    plain, flipped = _Constant(0.0), _Constant(1000.0)
    store = MirroredStore(plain, flipped)
    vis = store.batch(["a", mirrored_key("b"), "c", mirrored_key("a")])
    assert vis.feats[:, 0, 0].tolist() == [97.0, 1098.0, 99.0, 1097.0] and vis.mask.all()
    assert plain.asked == [["a", "c"]] and flipped.asked == [["b", "a"]]
    assert store.batch(["c"]).feats[0, 0, 0] == 99.0 and flipped.asked == [["b", "a"]]


def test_a_mixed_store_of_mirror_images_with_features_of_another_width_is_refused():
    """The photos' and their mirror images' features go into one batch: stores of two encoders cannot."""
    wide = _Constant(1000.0)
    wide.feat_dim = 3
    with pytest.raises(ValueError, match="the mirrored store's features are 3-d, the photos' 2-d"):
        MirroredStore(_Constant(0.0), wide)


def test_a_mixed_batch_keeps_the_stores_dtype_and_geometry_only_where_every_item_has_some():
    """Both views' rows go into one batch as their stores made them: float16 stays float16 and each row keeps its own
    geometry; stores without geometry give none, not a list of None, which a model that checks for geometry would
    take for boxes."""
    store = MirroredStore(_Constant(0.0, torch.float16, geometry=True), _Constant(1000.0, torch.float16, geometry=True))
    vis = store.batch([mirrored_key("b"), "a", mirrored_key("c")])
    assert vis.feats.dtype == torch.float16 and vis.feats[:, 0, 0].tolist() == [1098.0, 97.0, 1099.0]
    assert vis.geometry == ["b", "a", "c"]
    assert MirroredStore(_Constant(0.0), _Constant(1000.0)).batch(["a", mirrored_key("a")]).geometry == []


def test_the_grid_store_is_extracted_as_asked_and_its_mirror_images_as_the_hflip_view(monkeypatch, tmp_path):
    """``open_feature_store`` hands the extraction the cache, device and progress asked for, shows progress unless told
    otherwise (``captioner tune-decoding`` asks for nothing, and an extraction of COCO runs for hours), and extracts
    the mirror images as the ``hflip`` view, never as more photos."""
    calls = []

    def extracting(images, spec, cache_dir, **options):
        calls.append((images, spec, cache_dir, options))
        return _Constant(1000.0 if options.get("view") == "hflip" else 0.0)

    monkeypatch.setattr(stores, "extract_features", extracting)
    photos, mirrors = ["photos"], ["mirrors"]  # stand-ins, only handed on
    assert isinstance(open_feature_store(None, photos, SPEC, tmp_path), _Constant)
    assert calls == [(photos, SPEC, tmp_path, {"device": "cpu", "progress": True})]
    calls.clear()
    store = open_feature_store("grid", photos, SPEC, tmp_path, device="cuda:1", progress=False, mirrored=mirrors)
    assert calls == [(photos, SPEC, tmp_path, {"device": "cuda:1", "progress": False}),
                     (mirrors, SPEC, tmp_path, {"device": "cuda:1", "progress": False, "view": "hflip"})]
    assert store.batch(["a", mirrored_key("a")]).feats[:, 0, 0].tolist() == [97.0, 1097.0]


def test_mirroring_a_caption_swaps_left_and_right_only():
    assert mirror_words("a dog on the left of a man holding a right glove".split()) == \
        "a dog on the right of a man holding a left glove".split()


def test_an_epoch_shows_each_caption_once_in_one_seeded_view_per_photo(scenes, tmp_path):
    cfg = _config(scenes, tmp_path / "run", tmp_path / "cache", group_by_image=True)
    phase = prepare_run(cfg).phase
    size, pairs = phase.size, phase.pairs
    assert len(pairs) == 2 * size
    orders = [phase.epoch_order(epoch) for epoch in range(4)]
    for order in orders:
        assert sorted(order % size) == list(range(size))  # every caption once, in one view
        image_of_pair = np.repeat(np.arange(len(phase.images)), np.diff(phase.starts))
        flipped = order >= size
        for image in range(len(phase.images)):  # an image's captions share its view
            assert len(set(flipped[image_of_pair[order % size] == image])) == 1
    np.testing.assert_array_equal(orders[0], phase.epoch_order(0))  # a resumed run sees the same views
    views = np.zeros((len(orders), size), bool)  # views[epoch, pair]: mirrored in that epoch
    for epoch, order in enumerate(orders):
        views[epoch, order % size] = order >= size
    assert 0.3 < views.mean() < 0.7 and not all((views[0] == views[e]).all() for e in range(1, len(orders)))
    for i in range(size):  # the mirror image's caption is the caption with left and right swapped
        key, ids = pairs[i]
        mirrored_key_, mirrored_ids = pairs[size + i]
        assert mirrored_key_ == mirrored_key(key)
        assert phase.vocab.decode(mirrored_ids) == mirror_words(phase.vocab.decode(ids))


def test_a_run_with_mirror_images_trains_and_resumes_exactly(scenes, tmp_path):
    cache = tmp_path / "cache"
    train(_config(scenes, tmp_path / "straight", cache))
    train(_config(scenes, tmp_path / "resumed", cache, max_steps=20))  # stops inside epoch 2
    # it did stop there: had it run to the end, the resume would train nothing and the weights match trivially
    progress = json.loads((tmp_path / "resumed" / "train_state.json").read_text())["progress"]
    assert progress["global_step"] == 20 and progress["epoch"] == 1 and 0 < progress["step_in_epoch"]
    train(_config(scenes, tmp_path / "resumed", cache), resume=True)
    a, b = (load_file(tmp_path / run / "last" / "model.safetensors") for run in ("straight", "resumed"))
    for key in a:
        torch.testing.assert_close(a[key], b[key], msg=f"{key} differs after resume")


def test_mirror_images_need_grid_features_and_the_xe_phase(scenes, tmp_path):
    with pytest.raises(ValueError, match="mirror images"):
        train(_config(scenes, tmp_path / "run", tmp_path / "cache", features="regions:/nowhere"))
    with pytest.raises(ValueError, match="--augment hflip applies to the xe phase"):
        train(_config(scenes, tmp_path / "run2", tmp_path / "cache", phase="scst"))


def test_mirror_images_go_through_fine_tuned_stages_too(scenes, tmp_path):
    best = train(_config(scenes, tmp_path / "run", tmp_path / "cache", finetune_stages=1, epochs=1))
    assert (best / "encoder_tuned.safetensors").exists()
    views = {}
    for index in (tmp_path / "cache").glob("*/index.json"):
        store = FeatureStore(index.parent)
        views[store.view] = store.encoder.get("stop_stages")
    assert views == {"": 1, "hflip": 1}  # both views cached before the tuned stage, which then sees both
