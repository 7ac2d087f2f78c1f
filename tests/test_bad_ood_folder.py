"""``captioner data ood --out`` on a folder that holds another data set (the generated scenes, the default
--dataset) or an unreadable dataset_scenes.json: refused naming the file, nothing replaced (the scenes' JSON and
images were overwritten by the OOD set's)."""

from __future__ import annotations

import json

import pytest

from captioner.models.data.ood import OOD_VERSION
from captioner.service.cli import main

from .conftest import cli_error


@pytest.mark.parametrize("content", [b'{"dataset": "scenes", "images": []}', b"[1]", b"\xff\xfe", b'{"images": [',
                                     b'{"images": []}'])  # the last: a user's own Karpathy JSON, naming no data set
def test_the_ood_set_never_replaces_another_files_data_set(content, tmp_path, capsys):
    json_path = tmp_path / "dataset_scenes.json"
    json_path.write_bytes(content)
    message = cli_error(capsys, "data", "ood", "--out", str(tmp_path), "--images", "1")
    assert message.startswith(f"error: {json_path}")
    assert json_path.read_bytes() == content
    assert not (tmp_path / "images").exists()


def test_the_ood_set_is_written_again_over_an_older_ood_set(tmp_path, capsys):
    json_path = tmp_path / "dataset_scenes.json"
    json_path.write_text('{"dataset": "ood", "ood_version": 0, "images": []}')
    main(["data", "ood", "--out", str(tmp_path), "--images", "1"])
    assert '"ood_version": 0' not in json_path.read_text()


def test_an_older_ood_set_of_the_same_seed_and_size_is_written_again(tmp_path):
    """Only this version's set is up to date: an older renderer's images are drawn again, even for the seed and size
    asked for."""
    json_path = tmp_path / "dataset_scenes.json"
    json_path.write_text('{"dataset": "ood", "ood_version": 0, "seed": 0, "size": 1, "images": []}')
    main(["data", "ood", "--out", str(tmp_path), "--images", "1"])
    written = json.loads(json_path.read_text())
    assert written["ood_version"] == OOD_VERSION and len(written["images"]) == 1
