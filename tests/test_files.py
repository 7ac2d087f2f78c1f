"""models/files.py: a file is replaced whole or not at all, and a failed write leaves nothing beside it."""

import errno
import os

import pytest

from captioner.models.files import (temporaries_of, temporary_beside, temporary_target, write_atomically,
                                   write_durably)


@pytest.mark.parametrize("durable", [False, True])
def test_a_file_is_replaced_whole_and_nothing_is_left_beside_it(tmp_path, durable):
    target = tmp_path / "record.json"
    target.write_text("old")
    write_atomically(target, "new ☃", durable=durable)
    assert target.read_text(encoding="utf-8") == "new ☃" and os.listdir(tmp_path) == ["record.json"]


def test_a_write_that_fails_keeps_the_old_file_and_no_temporary_one(tmp_path, monkeypatch):
    target = tmp_path / "record.json"
    target.write_text("old")

    def disk_full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", disk_full)
    with pytest.raises(OSError, match="No space"):
        write_atomically(target, b"new")
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["record.json"]


def test_a_temporary_name_is_found_again_and_names_what_it_stands_for(tmp_path):
    """One owner of the naming scheme: the writers (temporary_beside), the cleaners (temporaries_of: checkpoint
    debris, training state, ONNX exports) and the checks that tell debris from a stranger (temporary_target)."""
    target = tmp_path / "card[1].md"  # glob's brackets are a file name's characters here
    left = temporary_beside(target)
    left.write_text("half")
    (tmp_path / ".card[1].md.old").write_text("not a temporary")
    assert temporaries_of(target) == [left] and temporary_target(left.name) == "card[1].md"
    assert temporary_target("card.md") is None and temporary_target(".tmp-0badf00d") is None


def test_a_durable_write_the_disk_cannot_hold_leaves_no_torn_file_and_names_it(tmp_path, monkeypatch):
    """A full disk at a run's first state save left a torn tensor file, and the error named no file."""
    real_write = os.write

    def full(fd, data):
        real_write(fd, bytes(data[:10]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", full)
    target = tmp_path / "train_state.0123abcd.safetensors"
    with pytest.raises(OSError, match="No space left on device") as raised:
        write_durably(target, b"x" * 100)
    assert raised.value.filename == str(target) and raised.value.errno == errno.ENOSPC
    assert not list(tmp_path.iterdir())
