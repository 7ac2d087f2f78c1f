"""A full disk (ENOSPC) while the project writes: the error names the file (the CLI's ``error: PATH: reason``), is an
OS error and not another failure's (an ONNX graph "the tracer cannot record"), and leaves no half-written folder or
file behind taking the space that ran out."""

import errno
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import captioner.models.checkpoint as checkpoint_module
import captioner.models.data.features as features_module
import captioner.models.training.state as state_module
from captioner.models.checkpoint import load_checkpoint, save_checkpoint
from captioner.models.encoder import EncoderSpec
from captioner.models.evaluation.zoo_table import write_between_markers
from captioner.models.export.onnx import _trace_graphs, export_visual_encoder
from captioner.models.files import describe_os_error, write_atomically
from captioner.models.training import run_log
from captioner.models.training.state import STATE_JSON, STATE_TENSORS, load_state, save_state
from captioner.models.vocab import Vocabulary
from captioner.service import runtime
from captioner.service.archive import CaptionLines

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = Vocabulary([f"w{i}" for i in range(19)])


def full_disk(*args, **kwargs):
    """What ``write``/``flush`` raise on a full disk: the reason, and no file name."""
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_during_a_checkpoint_save_keeps_the_previous_one_and_leaves_no_folder_behind(
        tmp_path, tiny_sat, monkeypatch):
    path = save_checkpoint(tmp_path / "last", tiny_sat, VOCAB, EncoderSpec(image_size=128))
    monkeypatch.setattr(checkpoint_module, "write_manifest", full_disk)  # after the weights: a folder to leave
    with pytest.raises(OSError, match="No space left"):
        save_checkpoint(path, tiny_sat, VOCAB, EncoderSpec())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last"]  # no .last.tmp-* holding the weights' bytes
    assert load_checkpoint(path).encoder.image_size == 128


def test_a_full_disk_while_a_training_state_commits_keeps_the_previous_state_and_leaves_no_tensor_file(
        tmp_path, monkeypatch):
    save_state(tmp_path, {"progress": {"global_step": 1}, "model": {"w": torch.zeros(2)}})
    before = sorted(path.name for path in tmp_path.iterdir())
    monkeypatch.setattr(state_module, "write_atomically", full_disk)  # the new tensors are written, the JSON is not
    with pytest.raises(OSError, match="No space left"):
        save_state(tmp_path, {"progress": {"global_step": 2}, "model": {"w": torch.ones(2)}})
    assert sorted(path.name for path in tmp_path.iterdir()) == before  # no orphaned tensor file taking the space
    assert load_state(tmp_path)["progress"]["global_step"] == 1


def test_a_state_committed_before_its_write_failed_keeps_its_tensor_file(tmp_path, monkeypatch):
    # the rename happened, flushing the folder's entry did not: the JSON names the new tensors, which must stay
    save_state(tmp_path, {"progress": {"global_step": 1}, "model": {"w": torch.zeros(2)}})

    def committed_then_failed(*args, **kwargs):
        write_atomically(*args, **kwargs)
        full_disk()

    monkeypatch.setattr(state_module, "write_atomically", committed_then_failed)
    with pytest.raises(OSError, match="No space left"):
        save_state(tmp_path, {"progress": {"global_step": 2}, "model": {"w": torch.ones(2)}})
    assert load_state(tmp_path)["progress"]["global_step"] == 2


def test_a_state_commit_interrupted_by_ctrl_c_leaves_no_tensor_file(tmp_path, monkeypatch):
    """Ctrl-C (a KeyboardInterrupt, no Exception) while the JSON is written: the previous state stands, and the new
    tensors it never named are removed as on any other failure, not left taking a state's worth of space."""
    save_state(tmp_path, {"progress": {"global_step": 1}, "model": {"w": torch.zeros(2)}})
    before = sorted(path.name for path in tmp_path.iterdir())

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(state_module, "write_atomically", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_state(tmp_path, {"progress": {"global_step": 2}, "model": {"w": torch.ones(2)}})
    assert sorted(path.name for path in tmp_path.iterdir()) == before


def test_a_full_disk_over_a_state_whose_json_is_damaged_is_the_full_disks_error(tmp_path, monkeypatch):
    """After a failed commit, the check of which tensor file the JSON names reads a JSON that may not parse (altered
    by hand, say): that is "not committed", so the disk's error is the one raised and the new tensors go."""
    save_state(tmp_path, {"progress": {"global_step": 1}, "model": {"w": torch.zeros(2)}})
    (tmp_path / "train_state.json").write_text("{")
    before = sorted(path.name for path in tmp_path.iterdir())
    monkeypatch.setattr(state_module, "write_atomically", full_disk)
    with pytest.raises(OSError, match="No space left"):
        save_state(tmp_path, {"progress": {"global_step": 2}, "model": {"w": torch.ones(2)}})
    assert sorted(path.name for path in tmp_path.iterdir()) == before


@pytest.mark.parametrize("reference", ["left out", None], ids=["no-reference", "null-reference"])
def test_a_full_disk_over_a_single_file_state_of_older_runs_is_the_full_disks_error(tmp_path, monkeypatch, reference):
    """A run saved before the state's JSON named its tensor file (no ``__tensors__``, or a null one: both load) and
    resumed on a full disk: after the failed commit, the check of which tensor file the JSON names finds none, so the
    user is told the disk is full (not a KeyError or TypeError traceback), the previous state stands and the new
    tensors do not stay behind taking the space that ran out."""
    save_state(tmp_path, {"progress": {"global_step": 1}, "model": {"w": torch.zeros(2)}})
    skeleton = json.loads((tmp_path / STATE_JSON).read_text())
    os.replace(tmp_path / skeleton.pop("__tensors__")["file"], tmp_path / STATE_TENSORS)
    if reference is None:
        skeleton["__tensors__"] = None
    (tmp_path / STATE_JSON).write_text(json.dumps(skeleton))
    before = sorted(path.name for path in tmp_path.iterdir())
    monkeypatch.setattr(state_module, "write_atomically", full_disk)
    with pytest.raises(OSError, match="No space left"):
        save_state(tmp_path, {"progress": {"global_step": 2}, "model": {"w": torch.ones(2)}})
    assert sorted(path.name for path in tmp_path.iterdir()) == before
    assert load_state(tmp_path)["progress"]["global_step"] == 1


def test_an_atomic_write_on_a_full_disk_names_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(Path, "write_bytes", full_disk)
    with pytest.raises(OSError) as caught:
        write_atomically(tmp_path / "report.md", "text\n")
    assert describe_os_error(caught.value) == f"{tmp_path / 'report.md'}: No space left on device"
    assert list(tmp_path.iterdir()) == []


def test_a_generated_table_that_meets_a_full_disk_leaves_the_document_and_its_prose_as_they_were(tmp_path, monkeypatch):
    """``make zoo-table``/``zoo-f8k``/``grounding-doc`` rewrite a hand-written document around their block: written in
    place, a write cut off half-way left the prose after the cut gone."""
    document = tmp_path / "model_zoo.md"
    prose = "# Model zoo\n\nHand-written prose before.\n\n<!-- start -->\nold table\n<!-- end -->\n\nAnd after.\n"
    document.write_text(prose)
    original_write_bytes = Path.write_bytes

    def half_then_full(path, data):
        original_write_bytes(path, data[:len(data) // 2])  # what reached the disk before it filled
        full_disk()

    monkeypatch.setattr(Path, "write_bytes", half_then_full)
    monkeypatch.setattr(Path, "write_text", lambda path, text, *a, **k: half_then_full(path, text.encode()))
    with pytest.raises(OSError) as caught:
        write_between_markers(document, ["<!-- start -->", "new table", "<!-- end -->"])
    assert describe_os_error(caught.value) == f"{document}: No space left on device"
    assert document.read_bytes() == prose.encode() and list(tmp_path.iterdir()) == [document]


def test_a_full_disk_while_tracing_is_an_os_error_naming_the_graph_not_an_unexportable_model(tmp_path, monkeypatch):
    """Taken for ExportUnsupported, ``captioner export`` said "the tracer cannot record" (exit 0, or a traceback for
    the CNN's graph) and the service recorded the weights as unexportable."""
    monkeypatch.setattr(torch.onnx, "export", full_disk)
    graph = ("encoder", torch.nn.Linear(2, 2), (torch.zeros(1, 2),), "encoder.onnx", ["x"], ["y"], {})
    with pytest.raises(OSError) as caught:
        _trace_graphs("sat", [graph], tmp_path)
    assert describe_os_error(caught.value) == f"{tmp_path / 'encoder.onnx'}: No space left on device"
    with pytest.raises(OSError) as caught:
        export_visual_encoder(EncoderSpec(image_size=64), tmp_path / "onnx")
    assert describe_os_error(caught.value).endswith("visual.onnx: No space left on device")
    assert list((tmp_path / "onnx").iterdir()) == []


def test_a_full_disk_for_a_shard_header_names_the_shard(tmp_path, monkeypatch):
    monkeypatch.setattr(np.lib.format, "open_memmap", full_disk)
    shard = tmp_path / "shard-00000.partial.npy"
    with pytest.raises(OSError, match=f"no room for the feature shard {shard}"):
        features_module._new_shard(shard, (8, 9, 320))


def test_the_failure_record_of_an_extraction_does_not_hide_why_it_failed(tmp_path, monkeypatch):
    def shards_on_a_full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "no room for the feature shard shard-00000.partial.npy")

    def record(path, data):
        if path.name == features_module.FAILED:
            full_disk()

    monkeypatch.setattr(features_module, "_extract_shards", shards_on_a_full_disk)
    monkeypatch.setattr(features_module, "_write_json_atomically", record)
    with pytest.raises(OSError, match="no room for the feature shard"):
        features_module.extract_features([], EncoderSpec(), tmp_path, progress=False, rank=0)


class FullDiskFile:
    """A caption file whose disk filled: every flush fails as a write does, naming no file."""

    def __init__(self, file):
        self.file = file

    def __getattr__(self, name):
        return getattr(self.file, name)

    def flush(self):
        full_disk()


def test_a_caption_line_on_a_full_disk_names_the_output_file(tmp_path):
    out = tmp_path / "captions.jsonl"
    lines = CaptionLines(out, resume=False)
    lines._file = FullDiskFile(lines._file)
    with pytest.raises(OSError) as caught:
        lines.write({"path": "a.jpg", "caption": "a dog"})
    assert describe_os_error(caught.value) == f"{out}: No space left on device"
    with pytest.raises(OSError) as caught:  # what the command's `finally` runs next: the same words, not bare ones
        lines.close()
    assert describe_os_error(caught.value) == f"{out}: No space left on device"


def test_a_metrics_record_on_a_full_disk_names_the_log(tmp_path, monkeypatch):
    """`captioner train` said "error: No space left on device" and no file when the metrics log filled the disk."""
    class FullDisk:
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        write = staticmethod(full_disk)

    monkeypatch.setattr(run_log, "open", FullDisk, raising=False)
    with pytest.raises(OSError) as caught:
        run_log.append_record(tmp_path, run_log.EpochLog(epoch=1, step=3, lr=0.1, losses={}, scores={}, seconds=0.5))
    assert describe_os_error(caught.value) == f"{tmp_path / run_log.METRICS_LOG}: No space left on device"


def test_the_servers_log_names_the_graph_a_full_disk_stopped_not_its_temporary_folder(tmp_path, monkeypatch, caplog):
    """The model is served with PyTorch, and the log line says which file could not be written as the CLI would."""
    def export_on_a_full_disk(encoders, name, ckpt):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / ".sat.tmp-0badf00d" / "encoder.onnx"))

    monkeypatch.setattr(runtime, "onnx_folder", export_on_a_full_disk)
    with caplog.at_level("ERROR", logger=runtime.log.name):
        assert runtime._on_onnx_runtime("sat", None, "onnx", None, 1) is None
    assert f"({tmp_path / 'sat' / 'encoder.onnx'}: No space left on device); serving it with PyTorch" in caplog.text


def test_a_resume_trims_the_metrics_log_through_a_temporary_named_as_the_log(tmp_path, monkeypatch):
    """A run folder that cannot be written: the error names metrics.jsonl, not a ``.metrics.jsonl.trimmed``."""
    log = tmp_path / run_log.METRICS_LOG
    log.write_text('{"kind": "step", "step": 1}\n{"kind": "step", "step": 2}\n')

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(args[0]))

    monkeypatch.setattr(os, "replace", read_only)
    with pytest.raises(OSError) as caught:
        run_log.trim_metrics_log(log, 1)
    assert describe_os_error(caught.value).startswith(f"{log}")
    assert list(tmp_path.iterdir()) == [log] and log.read_text().count('"step":') == 2  # whole, and alone


def test_a_full_disk_for_a_shard_says_how_much_room_it_needed_in_mib(tmp_path, monkeypatch):
    """The size the message gives is what to free: 1,024 images of 16 cells × 320 float16 values are 10 MiB."""
    monkeypatch.setattr(np.lib.format, "open_memmap", full_disk)
    with pytest.raises(OSError, match=r"\(10\.0 MiB\): No space left"):
        features_module._new_shard(tmp_path / "shard-00000.partial.npy", (1024, 16, 320))
