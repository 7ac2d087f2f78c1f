"""An ONNX export folder whose onnx.json, seal or a CNN's visual.json is damaged (not JSON, not an object, not
UTF-8): the export counts as not current and is made again, and the service starts (they were an AttributeError or
UnicodeDecodeError traceback out of export_is_current, intact and remove_replaced_encoders, which `captioner serve`
and `captioner export` call)."""

from __future__ import annotations

import pytest

from captioner.models.encoder import EncoderSpec
from captioner.models.export.folder import (ENCODER_FILE, HEAD_FILE, SEAL_SUFFIX, SPEC_FILE, STEP_FILE,
                                            VISUAL_SPEC_FILE, intact, seal)
from captioner.models.export.onnx import GraphSpec, export_is_current, remove_replaced_encoders


@pytest.mark.parametrize("content", [b"[1]", b"\xff", b'{"format": ', b"{}"])
def test_a_damaged_export_record_is_not_current(content, tmp_path):
    (tmp_path / SPEC_FILE).write_bytes(content)
    assert export_is_current(tmp_path, "abc") is False
    with pytest.raises(ValueError, match=str(tmp_path)):
        GraphSpec.load(tmp_path)


def test_an_export_record_of_another_format_is_not_current(tmp_path):
    """A record with every field this version reads, written by another version (another export format): its graphs
    are not taken for this version's, even sealed and made from the same weights."""
    GraphSpec(arch="sat", checksum="abc", encoder={}, enc_keys=[], state_keys=[], extra_keys=[],
              format="attention-captioner-onnx/99").save(tmp_path)
    for name in (ENCODER_FILE, HEAD_FILE, STEP_FILE):
        (tmp_path / name).write_bytes(b"graph")
        seal(tmp_path / name)
    assert export_is_current(tmp_path, "abc") is False
    with pytest.raises(ValueError, match="unknown ONNX export format 'attention-captioner-onnx/99'"):
        GraphSpec.load(tmp_path)


def test_a_seal_that_is_not_text_seals_nothing(tmp_path):
    graph = tmp_path / "encoder.onnx"
    graph.write_bytes(b"graph")
    graph.with_name(graph.name + SEAL_SUFFIX).write_bytes(b"\xff\xfe")
    assert intact(graph) is False


def test_a_cnn_folder_whose_record_is_not_an_object_is_left_alone(tmp_path):
    other = tmp_path / "visual-0000000000000000"
    other.mkdir()
    (other / VISUAL_SPEC_FILE).write_text("[1]")
    current = tmp_path / "visual-1111111111111111"
    current.mkdir()
    assert remove_replaced_encoders(tmp_path, EncoderSpec(), current) == []
    assert (other / VISUAL_SPEC_FILE).is_file()
