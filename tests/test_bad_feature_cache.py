"""A feature cache damaged on disk (index.json or layout.json torn, not UTF-8 or of the wrong shape; a shard cut
short): the store is extracted again in its place, or a shard that cannot be read is named with what to do (they
were an AttributeError/KeyError traceback, or a JSON or mmap message naming no file)."""

from __future__ import annotations

import json
import shutil

import pytest

from captioner.models.data.features import FeatureStore
from captioner.service.cli import main


def extract(scenes, cache):
    """``captioner data features`` of the session's scene data set's val split into ``cache``."""
    main(["data", "features", "--dataset", str(scenes.parent), "--split", "val", "--cache-dir", str(cache),
          "--device", "cpu", "--threads", "1", "--no-progress"])


@pytest.fixture(scope="module")
def extracted(scenes, tmp_path_factory):
    cache = tmp_path_factory.mktemp("features")
    extract(scenes, cache)
    (store,) = cache.iterdir()
    return cache, store.name


@pytest.mark.parametrize("file, content", [("index.json", b'{"format": '), ("index.json", b"[1]"),
                                           ("index.json", b"\xff"), ("index.json", b"{}"),
                                           ("layout.json", b"[1]"), ("layout.json", b'{"shard')])
def test_a_damaged_store_is_extracted_again(file, content, extracted, scenes, tmp_path, capsys):
    cache = shutil.copytree(extracted[0], tmp_path / "cache")
    store = cache / extracted[1]
    if file == "layout.json":
        (store / "index.json").unlink()
    if file == "index.json" and content == b"{}":
        index = json.loads((store / "index.json").read_text())
        del index["shards"]
        content = json.dumps(index).encode()
    (store / file).write_bytes(content)
    extract(scenes, cache)
    assert json.loads((store / "index.json").read_text())["shards"]


def test_a_shard_cut_short_is_named(extracted, scenes, tmp_path, capsys):
    store = FeatureStore(shutil.copytree(extracted[0], tmp_path / "cache") / extracted[1])
    shard = store.shard_files[0]
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(ValueError, match=f"{shard} is not a whole feature shard"):
        store.shard(0)
