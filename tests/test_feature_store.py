"""The sharded float16 feature store: reads equal the encoder's output, an interrupted extraction resumes from
its finished shards and ends byte-identical to an uninterrupted one, and non-zero DDP ranks wait for rank 0."""

import errno
import fcntl
import hashlib
import json
import os
import shutil
import threading
import time
import types
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from captioner.models.data.features import INDEX, FeatureStore, FeatureStoreError, NewerFeatureStore, \
    UnreadablePhotos, _cache_name, distributed_rank, extract_features, find_covering_store, photo_file_bytes, \
    shard_name
from captioner.models.data.karpathy import CaptionedImage
from captioner.models.encoder import EncoderSpec, GridEncoder, preprocess
from captioner.models.images import load_image

pytestmark = pytest.mark.usefixtures("one_thread")

SPEC = EncoderSpec(image_size=64)  # a 2×2 grid of 320-d features: small and fast, the real encoder


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    folder = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    out = []
    for i in range(7):
        path = folder / f"img{i}.png"
        Image.fromarray(rng.integers(0, 255, (48, 40 + 3 * i, 3), dtype=np.uint8)).save(path)
        out.append(CaptionedImage(image_id=i, path=path, split="train", references=[["a", "b"]]))
    return out


@pytest.fixture(scope="module")
def encoder():
    return GridEncoder(SPEC).eval()


class CountingEncoder(torch.nn.Module):
    """The real encoder, counting the images it encodes and failing after ``fail_after`` batches."""

    def __init__(self, inner, fail_after=None):
        super().__init__()
        self.inner, self.fail_after, self.batches, self.images = inner, fail_after, 0, 0

    def forward(self, pixels):
        if self.fail_after is not None and self.batches >= self.fail_after:
            raise RuntimeError("simulated crash during extraction")
        self.batches += 1
        self.images += pixels.shape[0]
        return self.inner(pixels)


def test_reads_equal_the_encoder_output(images, encoder, tmp_path):
    store = extract_features(images, SPEC, tmp_path, batch_size=2, encoder=encoder, progress=False, shard_size=3)
    assert len(list(store.folder.glob("shard-*.npy"))) == 3 and len(store) == 7
    with torch.no_grad():
        expected = encoder(torch.stack([preprocess(load_image(im.path), SPEC)[0] for im in images]))
    keys = [images[i].key for i in (6, 0, 4, 3)]  # across shards, out of order
    got = store.get(keys)
    assert got.dtype == torch.float32 and got.shape == (4, 4, encoder.feat_dim)
    torch.testing.assert_close(got, expected[[6, 0, 4, 3]], rtol=1e-3, atol=1e-3)  # float16 storage
    assert store.batch(keys).mask.all()
    # a shard is a plain .npy: loading it refuses pickles and maps rather than reads
    shard = np.load(store.folder / shard_name(0), mmap_mode="r", allow_pickle=False)
    assert isinstance(shard, np.memmap) and shard.dtype == np.float16


def test_interrupted_extraction_resumes_and_matches_a_fresh_store(images, encoder, tmp_path):
    fresh = extract_features(images, SPEC, tmp_path / "fresh", batch_size=1, encoder=encoder, progress=False,
                             shard_size=2)
    crashing = CountingEncoder(encoder, fail_after=5)  # shards of 2 images, 1 per batch: dies inside shard 2
    with pytest.raises(RuntimeError, match="simulated crash"):
        extract_features(images, SPEC, tmp_path / "resumed", batch_size=1, encoder=crashing, progress=False,
                         shard_size=2)
    folder = tmp_path / "resumed" / _cache_name(SPEC, [im.key for im in images])
    assert sorted(p.name for p in folder.glob("shard-*.npy")) == ["shard-00000.npy", "shard-00001.npy",
                                                                  "shard-00002.partial.npy"]
    assert not (folder / INDEX).exists(), "an unfinished store has no completion marker"
    with pytest.raises(FeatureStoreError, match="not a finished"):
        FeatureStore(folder)
    assert json.loads((folder / "failed.json").read_text())["error"].startswith("RuntimeError")

    resuming = CountingEncoder(encoder)
    resumed = extract_features(images, SPEC, tmp_path / "resumed", batch_size=1, encoder=resuming,
                               progress=False, shard_size=2)
    assert resuming.images == 3, "only the unfinished shards (images 4–6) are encoded again"
    assert not (folder / "failed.json").exists() and not list(folder.glob("*.partial.npy"))
    for number in range(4):
        assert (fresh.folder / shard_name(number)).read_bytes() == (folder / shard_name(number)).read_bytes()
    assert (fresh.folder / INDEX).read_text() == (folder / INDEX).read_text()
    keys = [im.key for im in images]
    assert np.array_equal(fresh.get_numpy(keys), resumed.get_numpy(keys))


def resumed_after_a_crash(images, encoder, cache: Path, crashed_shard_size: int, fail_after: int, shard_size: int,
                          between=lambda: None) -> tuple[FeatureStore, int]:
    """An extraction into ``cache`` with shards of ``crashed_shard_size`` that crashes after ``fail_after`` images,
    then (after ``between``) resumed with shards of ``shard_size``: the store, and how many images the resume
    encoded."""
    with pytest.raises(RuntimeError, match="simulated crash"):
        extract_features(images, SPEC, cache, batch_size=1, encoder=CountingEncoder(encoder, fail_after),
                         progress=False, shard_size=crashed_shard_size)
    between()
    resuming = CountingEncoder(encoder)
    resumed = extract_features(images, SPEC, cache, batch_size=1, encoder=resuming, progress=False,
                               shard_size=shard_size)
    return resumed, resuming.images


@pytest.mark.parametrize("crashed_shard_size,fail_after", [
    (2, 5),  # shards of 2 done, then a crash
    # shards 0, 1 and 2 of one image done: shard 2 of one image each (the third photo) and shard 2 of three each (the
    # seventh, alone) hold as many images, so their row counts cannot tell them apart; the shard size the first
    # run recorded (layout.json) does
    (1, 3),
])
def test_resuming_with_another_shard_size_re_encodes_rather_than_misplacing_images(images, encoder, tmp_path,
                                                                                   crashed_shard_size, fail_after):
    fresh = extract_features(images, SPEC, tmp_path / "fresh", batch_size=1, encoder=encoder, progress=False,
                             shard_size=3)
    resumed, encoded = resumed_after_a_crash(images, encoder, tmp_path / "resumed", crashed_shard_size, fail_after,
                                             shard_size=3)
    assert encoded == len(images), f"the shards of size {crashed_shard_size} hold other images than shards of size 3"
    keys = [im.key for im in images]
    assert np.array_equal(fresh.get_numpy(keys), resumed.get_numpy(keys))


def test_shards_an_extraction_begun_without_a_layout_record_left_are_kept_only_where_they_fit(images, encoder,
                                                                                              tmp_path):
    """An extraction an earlier version began recorded no shard size (no layout.json): a finished shard is kept
    where it holds as many images as its place under this run's size (its work is not lost), and not read as if
    it held other images where it does not."""
    fresh = extract_features(images, SPEC, tmp_path / "fresh", batch_size=1, encoder=encoder, progress=False,
                             shard_size=3)
    keys = [im.key for im in images]
    for cache, shard_size, encoded in (("same", 2, 3), ("other", 3, len(images))):
        layout = tmp_path / cache / _cache_name(SPEC, keys) / "layout.json"
        resumed, resumed_images = resumed_after_a_crash(images, encoder, tmp_path / cache, 2, 5, shard_size,
                                                        between=layout.unlink)  # shards of 2 done, then a crash
        assert resumed_images == encoded, f"resumed with shards of {shard_size}"
        assert np.array_equal(fresh.get_numpy(keys), resumed.get_numpy(keys))


def test_other_ranks_wait_for_rank_zero(images, encoder, tmp_path):
    results = {}

    def rank_one():
        results["store"] = extract_features(images, SPEC, tmp_path, rank=1, progress=False, encoder=object(),
                                            wait_timeout_s=60)

    waiter = threading.Thread(target=rank_one)
    waiter.start()
    time.sleep(0.5)
    assert waiter.is_alive(), "rank 1 waits while nothing is extracted"
    mine = extract_features(images, SPEC, tmp_path, rank=0, progress=False, encoder=encoder, shard_size=4)
    waiter.join(timeout=30)
    assert np.array_equal(results["store"].get_numpy([images[5].key]), mine.get_numpy([images[5].key]))


def test_the_rank_is_the_process_groups_once_it_is_up(tmp_path, monkeypatch):
    """Under torchrun the process group says which rank extracts: a rank it did not give (none) would make rank 0
    wait for itself, for good."""
    monkeypatch.delenv("RANK", raising=False)
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'group'}", rank=0, world_size=1)
    try:
        assert distributed_rank() == 0
    finally:
        torch.distributed.destroy_process_group()


def test_waiting_rank_stops_when_rank_zero_fails(images, encoder, tmp_path):
    with pytest.raises(RuntimeError):
        extract_features(images, SPEC, tmp_path, rank=0, progress=False, encoder=CountingEncoder(encoder, 0))
    with pytest.raises(FeatureStoreError, match="failed on rank 0: RuntimeError"):
        extract_features(images, SPEC, tmp_path, rank=1, progress=False)


def test_a_store_of_all_images_serves_any_subset(images, encoder, tmp_path):
    everything = extract_features(images, SPEC, tmp_path, progress=False, encoder=encoder)
    subset = extract_features(images[2:5], SPEC, tmp_path, progress=False, encoder=object())  # nothing to encode
    assert subset.folder == everything.folder
    assert np.array_equal(subset.get_numpy([images[3].key]), everything.get_numpy([images[3].key]))


def test_stores_of_other_photos_in_one_cache_are_kept_apart(images, encoder, tmp_path):
    """A store's folder is named by its photos too: the validation split's store is not the training split's,
    which holds none of its photos."""
    first = extract_features(images[:3], SPEC, tmp_path, encoder=encoder, progress=False)
    second = extract_features(images[3:], SPEC, tmp_path, encoder=encoder, progress=False)
    assert second.folder != first.folder and all(im.key in second for im in images[3:])


def _photos_copied(images, folder):
    """The images, their photos copied into ``folder``: photos a test may replace or remove."""
    folder.mkdir()
    copies = []
    for image in images:
        shutil.copy(image.path, folder / image.path.name)
        copies.append(replace(image, path=folder / image.path.name))
    return copies


def test_a_store_of_photos_since_replaced_at_their_paths_is_extracted_again_and_not_waited_on(images, encoder,
                                                                                             tmp_path):
    """A data set regenerated in place keeps its photos' paths, which name its store: that store held the old
    photos' features.  Its index records each photo's size, so a store whose photos now have other sizes is
    encoded again in its place, and a waiting rank does not take it for the new one."""
    copies = _photos_copied(images, tmp_path / "photos")
    store = extract_features(copies, SPEC, tmp_path / "cache", encoder=encoder, progress=False)
    assert store.file_bytes[copies[0].key] == images[0].path.stat().st_size
    shutil.copy(images[6].path, copies[0].path)  # another photo, of another size, at the first one's path
    with pytest.raises(FeatureStoreError, match="waited 0 s for rank 0"):
        extract_features(copies, SPEC, tmp_path / "cache", rank=1, progress=False, wait_timeout_s=0)
    counting = CountingEncoder(encoder)
    again = extract_features(copies, SPEC, tmp_path / "cache", encoder=counting, progress=False)
    assert again.folder == store.folder and counting.images == len(copies)
    assert np.array_equal(again.get_numpy([copies[0].key]), again.get_numpy([copies[6].key]))  # one photo now


def test_a_store_of_a_local_weights_file_is_found_again_only_while_its_content_is_unchanged(images, encoder,
                                                                                           tmp_path):
    """A store is taken for another set of images only when its weights files have the spec's content: one of a
    local ImageNet file was found again after the file was rewritten (its index recorded the path alone)."""
    weights = tmp_path / "imagenet.pth"
    weights.write_bytes(b"first weights")
    written = weights.stat()
    spec = replace(SPEC, weights=str(weights))  # the spec names the file; the real encoder stands in for its network
    store = extract_features(images, spec, tmp_path / "cache", encoder=encoder, progress=False)
    keys = [im.key for im in images[:3]]
    assert find_covering_store(tmp_path / "cache", spec, keys).folder == store.folder
    weights.write_bytes(b"other weights")
    os.utime(weights, ns=(written.st_atime_ns, written.st_mtime_ns))
    assert find_covering_store(tmp_path / "cache", spec, keys) is None
    assert extract_features(images, spec, tmp_path / "cache", encoder=encoder, progress=False).folder != store.folder
    assert FeatureStore(store.folder).weights_sha256 == {"weights": hashlib.sha256(b"first weights").hexdigest()}


def test_a_store_of_the_same_network_fed_another_way_never_stands_in(images, encoder, tmp_path):
    """Stores are looked through by backbone, layer and input size alone (their folders' names): one whose photos
    reached the network another way (a centre crop here) holds other features under the same keys."""
    extract_features(images, SPEC, tmp_path, encoder=encoder, progress=False)
    assert find_covering_store(tmp_path, SPEC, [im.key for im in images[:3]]) is not None
    cropped = replace(SPEC, resize="center_crop", resize_to=72)
    assert find_covering_store(tmp_path, cropped, [im.key for im in images[:3]]) is None


def test_a_store_written_before_local_weights_files_were_known_by_content_keeps_its_tuned_stages(images, encoder,
                                                                                                 tmp_path):
    """Stores of fine-tuned stages recorded their file's sha256 as ``tuned_sha256``: they are still found."""
    store = extract_features(images, SPEC, tmp_path, encoder=encoder, progress=False)
    index = json.loads((store.folder / INDEX).read_text())
    (store.folder / INDEX).write_text(json.dumps({**index, "tuned_sha256": "ab" * 32}))
    assert FeatureStore(store.folder).weights_sha256 == {"tuned_weights": "ab" * 32}


def test_a_store_another_version_wrote_is_extracted_again_in_its_place(images, encoder, tmp_path):
    """The folder's name does not hold the store's format: after an upgrade that changes it, the old store sat
    under the same name refusing every run ("unknown feature store format") until deleted by hand."""
    store = extract_features(images, SPEC, tmp_path, encoder=encoder, progress=False)
    index = json.loads((store.folder / INDEX).read_text())
    (store.folder / INDEX).write_text(json.dumps({**index, "format": "attention-captioner-features/0"}))
    counting = CountingEncoder(encoder)
    again = extract_features(images, SPEC, tmp_path, encoder=counting, progress=False)
    assert again.folder == store.folder and counting.images == len(images)
    assert [p.name for p in tmp_path.iterdir()] == [store.folder.name]


def test_a_store_a_newer_version_wrote_is_refused_not_extracted_again(images, encoder, tmp_path):
    """Two versions sharing a cache folder would otherwise each extract the other's store again, for good."""
    store = extract_features(images, SPEC, tmp_path, encoder=encoder, progress=False)
    index = json.loads((store.folder / INDEX).read_text())
    newer = {**index, "format": "attention-captioner-features/99"}
    (store.folder / INDEX).write_text(json.dumps(newer))
    with pytest.raises(NewerFeatureStore, match="newer version"):
        extract_features(images, SPEC, tmp_path, encoder=CountingEncoder(encoder), progress=False)
    assert json.loads((store.folder / INDEX).read_text()) == newer  # left as that version wrote it


def test_an_encoder_whose_grid_is_not_the_specs_is_refused_and_writes_no_store(images, encoder, tmp_path):
    """The store's shape comes from the encoder's output (an ONNX session has no ``feat_dim``): one of another
    grid (say, the CNN of another input size) must not be stored under this spec."""
    with pytest.raises(ValueError, match="5 grid cells per image, where .* has 2×2"):
        extract_features(images, SPEC, tmp_path, encoder=lambda pixels: torch.zeros(len(pixels), 5, 320),
                         progress=False)
    assert not list(tmp_path.glob("*/index.json"))
    # a plain callable (not a module) of the right grid is an encoder like any other
    store = extract_features(images, SPEC, tmp_path, encoder=lambda pixels: encoder(pixels), progress=False)
    assert store.get_numpy([images[0].key]).shape == (1, 4, encoder.feat_dim) == (1, 4, store.feat_dim)


def test_one_photo_has_one_key_however_its_data_set_is_spelt(images, encoder, tmp_path, monkeypatch):
    """A run resumed from another folder, or a data set given through a link, named the same photos by other
    strings: their features were encoded again into a second store (hours and tens of GB on COCO)."""
    folder = images[0].path.parent
    (tmp_path / "linked").symlink_to(folder)
    monkeypatch.chdir(folder.parent)
    counting = CountingEncoder(encoder)
    stores = [extract_features([replace(im, path=spelt / im.path.name) for im in images], SPEC, tmp_path / "cache",
                               batch_size=4, encoder=counting, progress=False)
              for spelt in (folder, tmp_path / "linked", Path(folder.name))]  # absolute, a link, relative
    assert {store.folder for store in stores} == {stores[0].folder}
    assert counting.images == len(images)  # encoded once


def test_a_disk_too_full_for_a_shard_is_an_error_naming_it_not_a_bus_error(images, encoder, tmp_path, monkeypatch):
    """The shard was a sparse memory-mapped file: a disk too full for it killed the process with SIGBUS, no
    message, on the first write it could not hold. Its bytes are reserved first; a failed reservation is said."""
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError, match=r"no room for the feature shard .*shard-00000\.partial\.npy .*No space left"):
        extract_features(images, SPEC, tmp_path, batch_size=4, encoder=encoder, progress=False)
    assert not list(tmp_path.rglob("*.partial.npy"))


def test_a_shards_every_byte_is_reserved_on_the_disk_before_it_is_written(images, encoder, tmp_path, monkeypatch):
    """A write into the mapped shard past what was reserved can still find the disk full: a SIGBUS."""
    reserved, real_fallocate = [], os.posix_fallocate

    def fallocate(fd, offset, length):
        reserved.append((os.readlink(f"/proc/self/fd/{fd}"), offset, length))
        real_fallocate(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    store = extract_features(images, SPEC, tmp_path, batch_size=4, encoder=encoder, progress=False, shard_size=4)
    shards = [store.folder / shard_name(j) for j in range(2)]
    assert [(Path(path).name, offset, length) for path, offset, length in reserved] == [
        (f"shard-{j:05d}.partial.npy", 0, shard.stat().st_size) for j, shard in enumerate(shards)]


def test_unreadable_photos_are_named_ten_at_most_and_the_rest_counted():
    failures = [f"photo{i}.jpg: truncated" for i in range(12)]
    message = str(UnreadablePhotos(failures, encoded=0, total=12))
    assert "12 photo(s) could not be read" in message and "photo9.jpg" in message and "photo10.jpg" not in message
    assert "\n  and 2 more\n" in message
    assert "\n  and 1 more\n" in str(UnreadablePhotos(failures[:11], encoded=0, total=11))
    assert "more" not in str(UnreadablePhotos(failures[:10], encoded=0, total=10))  # all ten named


def test_every_torn_photo_is_named_in_one_run_and_the_shards_without_one_are_kept(images, encoder, tmp_path):
    """A torn photo stopped the extraction at the first: hours of a large data set could pass between finding one
    and the next.  The extraction goes on past each, names them all, keeps every shard holding none, and a run after
    they are mended encodes only the other shards."""
    fresh = extract_features(images, SPEC, tmp_path / "fresh", batch_size=2, encoder=encoder, progress=False,
                             shard_size=2)
    copies = []
    for image in images:
        shutil.copy(image.path, tmp_path / image.path.name)
        copies.append(CaptionedImage(image_id=image.image_id, path=tmp_path / image.path.name, split="train",
                                     references=image.references))
    for torn in (copies[1], copies[4]):  # in shards 0 and 2 of 4
        torn.path.write_bytes(torn.path.read_bytes()[:60])
    with pytest.raises(UnreadablePhotos) as raised:
        extract_features(copies, SPEC, tmp_path / "cache", batch_size=2, encoder=encoder, progress=False,
                         shard_size=2)
    first, second = raised.value.failures
    assert str(copies[1].path) in first and str(copies[4].path) in second
    assert "the 3 of 7 images encoded in the others are kept" in str(raised.value)
    folder = tmp_path / "cache" / _cache_name(SPEC, [im.key for im in copies])
    assert sorted(p.name for p in folder.glob("shard-*")) == ["shard-00001.npy", "shard-00003.npy"]

    for image, copy in zip(images, copies):
        shutil.copy(image.path, copy.path)
    counting = CountingEncoder(encoder)
    mended = extract_features(copies, SPEC, tmp_path / "cache", batch_size=2, encoder=counting, progress=False,
                              shard_size=2)
    assert counting.images == 4, "only the two shards that held a torn photo are encoded again"
    assert np.array_equal(mended.get_numpy([im.key for im in copies]), fresh.get_numpy([im.key for im in images]))


def test_a_spec_at_a_later_fields_first_value_names_its_store_as_before_that_field_existed():
    """Stores extracted before ``grid_stride`` was a field of the spec were named without it: a spec at the stride
    every one of them was made with must name the same folder, or every existing cache is extracted again.  Any other
    field of the spec (here the resize) names another store."""
    whole = SPEC.to_json()
    earlier = types.SimpleNamespace(backbone=SPEC.backbone, layer=SPEC.layer, image_size=SPEC.image_size,
                                    to_json=lambda: {k: v for k, v in whole.items() if k != "grid_stride"})
    assert whole["grid_stride"] == 32
    assert _cache_name(SPEC, ["photo.jpg"], {}) == _cache_name(earlier, ["photo.jpg"], {})
    assert _cache_name(replace(SPEC, grid_stride=16, layer="hypercolumn"), ["photo.jpg"], {}) != \
        _cache_name(replace(SPEC, layer="hypercolumn"), ["photo.jpg"], {})
    cropped = replace(SPEC, resize="center_crop", resize_to=72)
    assert _cache_name(cropped, ["photo.jpg"], {}) != _cache_name(SPEC, ["photo.jpg"], {})


def test_a_process_extracting_into_a_store_keeps_a_second_one_out_until_it_is_done(images, encoder, tmp_path):
    """``extract.lock`` is what keeps two unrelated processes (two runs sharing a cache) from writing the same
    shards: held here as another process would hold it, the extraction does not start encoding."""
    folder = tmp_path / _cache_name(SPEC, [im.key for im in images])
    folder.mkdir()
    started = threading.Event()

    def encoding(pixels):
        started.set()
        return encoder(pixels)

    with open(folder / "extract.lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        worker = threading.Thread(target=extract_features, args=(images, SPEC, tmp_path),
                                  kwargs=dict(encoder=encoding, progress=False))
        worker.start()
        assert not started.wait(2.0), "the extraction encoded while another process held the store's lock"
        fcntl.flock(held, fcntl.LOCK_UN)
    worker.join(timeout=60)
    assert started.is_set() and (folder / INDEX).exists()


def test_an_extraction_without_bars_says_what_it_encodes_shard_by_shard(images, encoder, tmp_path, capsys):
    """Without progress bars (logs, CI) a line per finished shard says how far it is: minutes passed silent."""
    extract_features(images, SPEC, tmp_path, encoder=encoder, progress=False, shard_size=4, view="hflip")
    err = capsys.readouterr().err
    assert f"encoding 7 images (hflip) into {tmp_path}" in err
    assert "  4 of 7 images encoded\n" in err and "  7 of 7 images encoded\n" in err
    extract_features(images, SPEC, tmp_path, encoder=encoder, progress=False, shard_size=4, view="hflip")
    assert capsys.readouterr().err == "", "a finished store encodes nothing and says nothing"


def test_a_store_of_no_images_is_a_finished_empty_store(encoder, tmp_path):
    """An empty split extracts to a store holding nothing, not an error."""
    store = extract_features([], SPEC, tmp_path, encoder=encoder, progress=False)
    assert len(store) == 0 and (store.folder / INDEX).exists() and store.item_shape == (4, 0)


def test_a_store_written_before_photo_sizes_were_recorded_is_used_as_before(images, encoder, tmp_path):
    """Its index has no ``bytes``: it cannot tell a replaced photo, so it is read as it always was rather than
    extracted again (hours on COCO)."""
    store = extract_features(images, SPEC, tmp_path, encoder=encoder, progress=False)
    index = json.loads((store.folder / INDEX).read_text())
    del index["bytes"]
    (store.folder / INDEX).write_text(json.dumps(index))
    counting = CountingEncoder(encoder)
    again = extract_features(images, SPEC, tmp_path, encoder=counting, progress=False)
    assert again.folder == store.folder and counting.images == 0
    assert find_covering_store(tmp_path, SPEC, [im.key for im in images[:3]],
                               sizes={im.key: 1 for im in images[:3]}).folder == store.folder


def test_a_finished_store_serves_photos_no_longer_on_this_machine(images, encoder, tmp_path):
    """Photos missing here (features extracted, then the photos removed or never copied) have no size to compare:
    the store that holds them is used, not a FileNotFoundError."""
    copies = _photos_copied(images, tmp_path / "photos")
    store = extract_features(copies, SPEC, tmp_path / "cache", encoder=encoder, progress=False)
    copies[2].path.unlink()
    counting = CountingEncoder(encoder)
    again = extract_features(copies, SPEC, tmp_path / "cache", encoder=counting, progress=False)
    assert again.folder == store.folder and counting.images == 0
    assert copies[2].key not in photo_file_bytes(copies) and copies[3].key in photo_file_bytes(copies)


def test_a_failure_marker_older_than_the_wait_is_not_taken_for_rank_zeros_failure(images, tmp_path):
    """A ``failed.json`` an earlier run left (rank 0 clears it when it starts again) must not stop the ranks that
    wait for this run's rank 0."""
    folder = tmp_path / _cache_name(SPEC, [im.key for im in images])
    folder.mkdir()
    (folder / "failed.json").write_text(json.dumps({"error": "RuntimeError: an earlier run"}))
    old = time.time() - 120
    os.utime(folder / "failed.json", (old, old))
    with pytest.raises(FeatureStoreError, match="waited 0 s for rank 0"):
        extract_features(images, SPEC, tmp_path, rank=1, progress=False, wait_timeout_s=0)


def test_an_extraction_stopped_by_ctrl_c_tells_the_waiting_ranks(images, encoder, tmp_path):
    """A KeyboardInterrupt is no Exception: the waiting ranks must still learn that rank 0 stopped."""
    def interrupted(pixels):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        extract_features(images, SPEC, tmp_path, rank=0, progress=False, encoder=interrupted)
    with pytest.raises(FeatureStoreError, match="failed on rank 0: KeyboardInterrupt"):
        extract_features(images, SPEC, tmp_path, rank=1, progress=False, wait_timeout_s=5)


def test_outside_a_process_group_the_rank_is_torchruns_rank_variable(images, tmp_path, monkeypatch):
    """Before the process group is up (or without one) ``RANK`` says which process extracts: rank 1 waits."""
    monkeypatch.setenv("RANK", "1")
    assert distributed_rank() == 1
    with pytest.raises(FeatureStoreError, match="waited 0 s for rank 0"):
        extract_features(images, SPEC, tmp_path, progress=False, wait_timeout_s=0)


def test_a_resume_whose_layout_record_is_torn_keeps_none_of_its_shards(images, encoder, tmp_path):
    """A torn ``layout.json`` cannot say which shard size its shards were written with: shards of one image each
    (the third photo's at place 2) would otherwise be read as shards of three (the seventh photo's at place 2)."""
    fresh = extract_features(images, SPEC, tmp_path / "fresh", batch_size=1, encoder=encoder, progress=False,
                             shard_size=3)
    layout = tmp_path / "resumed" / _cache_name(SPEC, [im.key for im in images]) / "layout.json"
    resumed, encoded = resumed_after_a_crash(images, encoder, tmp_path / "resumed", 1, 3, shard_size=3,
                                             between=lambda: layout.write_text('{"shard'))
    assert encoded == len(images)
    keys = [im.key for im in images]
    assert np.array_equal(fresh.get_numpy(keys), resumed.get_numpy(keys))


def test_a_store_another_process_finished_while_this_one_waited_for_the_lock_is_taken_not_encoded_again(
        images, encoder, tmp_path, monkeypatch):
    """Two runs sharing a cache both find the store missing; the second waits for the first's lock, and then must
    take the store the first finished rather than remove it and encode every photo again (hours on COCO, with the
    first run's shards pulled from under it)."""
    done = extract_features(images, SPEC, tmp_path / "elsewhere", encoder=encoder, progress=False)
    folder = tmp_path / "cache" / done.folder.name
    folder.mkdir(parents=True)
    counting, results, asked = CountingEncoder(encoder), {}, threading.Event()
    locking = fcntl.flock

    def flock_noting_the_second_run(handle, operation):
        if threading.current_thread() is worker and operation == fcntl.LOCK_EX:
            asked.set()  # it found no store: a lock held elsewhere makes it wait, however late it gets here
        return locking(handle, operation)

    monkeypatch.setattr(fcntl, "flock", flock_noting_the_second_run)
    with open(folder / "extract.lock", "a+") as held:  # the first run, extracting
        locking(held, fcntl.LOCK_EX)
        worker = threading.Thread(target=lambda: results.update(store=extract_features(
            images, SPEC, tmp_path / "cache", encoder=counting, progress=False)))
        worker.start()
        assert asked.wait(60), "the second run never asked for the extraction lock"
        for file in done.folder.iterdir():  # what the first run writes, its index last
            if file.name not in (INDEX, "extract.lock"):
                shutil.copy(file, folder / file.name)
        shutil.copy(done.folder / INDEX, folder / INDEX)
        locking(held, fcntl.LOCK_UN)
    worker.join(timeout=60)
    assert results["store"].folder == folder and counting.images == 0


def test_a_batch_is_copied_as_float16_the_stores_own_precision(images, encoder, tmp_path):
    """``get_numpy`` hands back the stored float16 rows (half of float32's memory for a batch of grids)."""
    store = extract_features(images, SPEC, tmp_path, encoder=encoder, progress=False)
    assert store.get_numpy([images[1].key, images[0].key]).dtype == np.float16


def test_an_index_torn_on_disk_is_named_as_a_feature_stores_index(images, encoder, tmp_path):
    """A library caller opening a store whose index.json was cut short learns which file it is and what it should
    have been, not a bare JSON message (every store this project opens itself is extracted again instead)."""
    store = extract_features(images, SPEC, tmp_path, encoder=encoder, progress=False)
    (store.folder / INDEX).write_text('{"format": ')
    with pytest.raises(FeatureStoreError, match=rf"{store.folder.name}/index\.json is not a feature store's index \("):
        FeatureStore(store.folder)


def test_a_crashed_extraction_is_not_finished_by_the_same_photos_listed_in_another_order(images, encoder, tmp_path):
    """Shard ``j`` holds the photos at places ``j·S …`` of the list it was started with: a run given the same photos
    in another order (a data set read again, a split rebuilt) must not keep those shards, which would hand it other
    photos' features under every key, silently."""
    fresh = extract_features(images, SPEC, tmp_path / "fresh", batch_size=1, encoder=encoder, progress=False,
                             shard_size=2)
    with pytest.raises(RuntimeError, match="simulated crash"):  # shards 0 and 1 finished, then a crash
        extract_features(images, SPEC, tmp_path / "cache", batch_size=1, encoder=CountingEncoder(encoder, 5),
                         progress=False, shard_size=2)
    reordered = images[::-1]
    store = extract_features(reordered, SPEC, tmp_path / "cache", batch_size=1, encoder=encoder, progress=False,
                             shard_size=2)
    keys = [im.key for im in images]
    assert np.array_equal(store.get_numpy(keys), fresh.get_numpy(keys))


def test_a_store_maps_its_shards_rather_than_reading_them_into_memory(images, encoder, tmp_path):
    """Shards are mapped, and only a batch's rows copied: a store of COCO is tens of GB, which every shard read
    whole (and kept) would hold in each training process's memory."""
    store = extract_features(images, SPEC, tmp_path, encoder=encoder, progress=False, shard_size=4)
    store.get_numpy([images[5].key])
    assert isinstance(store.shard(1), np.memmap)


def test_a_crash_while_the_index_is_written_keeps_every_finished_shard(images, encoder, tmp_path, monkeypatch):
    """The index is the completion marker: one cut short by a crash or a full disk reads as a damaged store, whose
    shards are all removed and encoded again (hours on COCO).  Written whole or not at all, it is simply missing, and
    the next run keeps every shard and writes it."""
    def cut_short(write):
        def writing(path, data, *args, **kwargs):
            if INDEX in path.name:
                half = len(data) // 2
                write(path, data[:half], *args, **kwargs)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return write(path, data, *args, **kwargs)
        return writing

    with monkeypatch.context() as patched, pytest.raises(OSError):
        patched.setattr(Path, "write_bytes", cut_short(Path.write_bytes))
        patched.setattr(Path, "write_text", cut_short(Path.write_text))
        extract_features(images, SPEC, tmp_path, encoder=encoder, progress=False, shard_size=4)
    counting = CountingEncoder(encoder)
    store = extract_features(images, SPEC, tmp_path, encoder=counting, progress=False, shard_size=4)
    assert counting.images == 0 and len(store) == len(images)


def test_a_fault_that_is_not_a_photos_stops_the_extraction_rather_than_blaming_every_photo(images, encoder, tmp_path,
                                                                                           monkeypatch):
    """Only a photo that cannot be decoded is set aside and named at the end: any other error (here the
    preprocessing's own) would otherwise have every photo encoded as a blank, for hours, and then called unreadable."""
    def broken(image, spec):
        raise RuntimeError("a fault in the preprocessing")

    monkeypatch.setattr("captioner.models.data.features.preprocess", broken)
    counting = CountingEncoder(encoder)
    with pytest.raises(RuntimeError, match="a fault in the preprocessing"):
        extract_features(images, SPEC, tmp_path, encoder=counting, progress=False)
    assert counting.images == 0
