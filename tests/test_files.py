"""models/files.py: a file is replaced whole or not at all, and a failed write leaves nothing beside it."""

import ctypes
import errno
import fcntl
import gc
import hashlib
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from captioner.models.files import (FolderInUse, describe_os_error, file_checksum, held_alone, is_newer_format,
                                   naming_errors, read_json_file, read_text_file, replace_directory, temporaries_of,
                                   temporary_beside, temporary_target, unwritable, write_atomically, create_durably)


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
    assert temporary_target("..tmp-0badf00d") is None  # a mark with no name before it stands for nothing
    assert temporary_target(temporary_beside(tmp_path / "a").name) == "a"  # a name of one letter is a name


def test_two_writers_of_one_file_each_get_a_temporary_of_their_own():
    """Two processes writing one file at once (two runs' `eval --output` to one report) must not write into one
    temporary: a plain write would mix their bytes, and a durable one would refuse the second as an existing file."""
    names = {temporary_beside(Path("runs/x/report.json")) for _ in range(20)}
    assert len(names) == 20


def test_a_folder_that_cannot_take_a_file_is_said_so_in_the_oss_words_and_the_probe_leaves_nothing(tmp_path):
    """`serve` (CAPTIONER_ONNX_DIR) and the output flags check a folder with it before any work, and print its
    reason in their one line: the reason alone, not Python's ``[Errno 2] ...: 'PATH'``."""
    assert unwritable(tmp_path) is None and os.listdir(tmp_path) == []
    assert unwritable(tmp_path / "missing") == "No such file or directory"
    (tmp_path / "a-file").write_text("not a folder")
    assert unwritable(tmp_path / "a-file") == "Not a directory"


def test_a_json_file_holding_another_kind_of_value_is_refused_naming_the_file_and_what_it_should_be(tmp_path):
    """A training state, an export's record or a feature index whose JSON is a list (a file of another tool's) is
    refused in words, not read on into a TypeError or AttributeError far from the file."""
    path = tmp_path / "index.json"
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"index.json is not a feature store's index \(its JSON is list, not an "
                                         r"object\)"):
        read_json_file(path, "a feature store's index")
    assert read_json_file(path, "a list of ids", kind=list) == [1, 2]
    path.write_text('"report"')
    with pytest.raises(ValueError, match=r"index.json is not a list of ids \(its JSON is str, not a list\)"):
        read_json_file(path, "a list of ids", kind=list)


def test_an_os_error_reads_as_the_shells_tools_say_it_naming_what_the_user_asked_for(tmp_path):
    """``[Errno 2] No such file or directory: '/proc/.x.png.tmp-b8aee956'`` was what `caption --overlay` said: the
    number first, the path quoted, and a hidden name the user never gave."""
    def raised(action):
        with pytest.raises(OSError) as caught:
            action()
        return describe_os_error(caught.value)

    missing = tmp_path / "gone" / "x.png"
    assert raised(lambda: write_atomically(missing, b"png")) == f"{missing}: No such file or directory"
    (tmp_path / "taken").mkdir()
    assert raised(lambda: (tmp_path / "taken").mkdir()) == f"{tmp_path / 'taken'}: File exists"
    assert raised(lambda: os.rename(tmp_path / "a", tmp_path / "b")) == (
        f"{tmp_path / 'a'} → {tmp_path / 'b'}: No such file or directory")
    assert raised(lambda: os.fstat(987654)) == "Bad file descriptor"  # no file named: the reason alone
    assert raised(lambda: os.stat(987654)) == "987654: Bad file descriptor"  # a descriptor named: as its number
    checkpoint = temporary_beside(tmp_path / "best")  # a checkpoint's folder while it is written
    assert raised(lambda: (checkpoint / "model.safetensors").read_bytes()) == (
        f"{tmp_path / 'best' / 'model.safetensors'}: No such file or directory")
    assert describe_os_error(FileNotFoundError("no checkpoint in runs/x")) == "no checkpoint in runs/x"


def test_a_durable_write_the_disk_cannot_hold_leaves_no_torn_file_and_names_it(tmp_path, monkeypatch):
    """A full disk at a run's first state save left a torn tensor file, and the error named no file."""
    real_write = os.write

    def full(fd, data):
        real_write(fd, bytes(data[:10]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", full)
    target = tmp_path / "train_state.0123abcd.safetensors"
    with pytest.raises(OSError, match="No space left on device") as raised:
        create_durably(target, b"x" * 100)
    assert raised.value.filename == str(target) and raised.value.errno == errno.ENOSPC
    assert not list(tmp_path.iterdir())


def test_an_interrupt_during_a_write_stays_an_interrupt_and_leaves_no_torn_file(tmp_path, monkeypatch):
    """Ctrl-C mid-write: the partial file is removed, the old one kept, and the interrupt goes on as itself, not as
    an error about the file (only an OS error is given the file's name)."""
    def interrupted(*args):
        raise KeyboardInterrupt

    target = tmp_path / "record.json"
    target.write_text("old")
    monkeypatch.setattr(os, "write", interrupted)
    with pytest.raises(KeyboardInterrupt):
        create_durably(tmp_path / "train_state.0123abcd.safetensors", b"x" * 100)
    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_atomically(target, b"new")
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["record.json"]


def test_durable_writes_leave_no_file_open_whether_they_succeed_or_fail(tmp_path, monkeypatch):
    """Training and the service write files for as long as they run: a descriptor left open by each write (the
    file's, or its folder's, opened to flush them) ends in "Too many open files"."""
    gc.collect()  # files earlier tests left to the collector are closed now, not while this one looks
    before = set(os.listdir("/proc/self/fd"))
    write_atomically(tmp_path / "state.json", "{}", durable=True)  # the file, then its folder, flushed
    new = tmp_path / ".ckpt.tmp-0badf00d"
    new.mkdir()
    replace_directory(new, tmp_path / "ckpt")

    def disk_full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space left on device"):
        create_durably(tmp_path / "torn.json", b"{}")
    assert set(os.listdir("/proc/self/fd")) <= before


def test_a_durable_write_never_overwrites_a_file_that_is_there(tmp_path):
    """It creates its file: one already at that name (another writer's) is an error, not written over."""
    target = tmp_path / "train_state.0123abcd.safetensors"
    target.write_bytes(b"another writer's")
    with pytest.raises(FileExistsError):
        create_durably(target, b"mine")
    assert target.read_bytes() == b"another writer's"


def test_a_durable_write_flushes_the_file_before_the_rename_and_the_folder_after_it(tmp_path, monkeypatch):
    real_fsync, real_replace, events = os.fsync, os.replace, []

    def fsync(fd):
        events.append(("fsync", os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", os.path.basename(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    write_atomically(tmp_path / "state.json", "{}", durable=True)
    assert events[1:] == [("replace", "state.json"), ("fsync", tmp_path.name)]
    assert events[0][0] == "fsync" and temporary_target(events[0][1]) == "state.json"
    events.clear()
    write_atomically(tmp_path / "state.json", "{}")  # not durable: nothing flushed
    assert events == [("replace", "state.json")]


def test_a_replaced_folder_is_flushed_in_its_parent_after_the_swap(tmp_path, monkeypatch):
    """A checkpoint or an export folder put in place survives a machine crash: the parent's entry is flushed once
    the new folder is there."""
    (tmp_path / "ckpt").mkdir()
    new = tmp_path / ".ckpt.tmp-0badf00d"
    new.mkdir()
    (new / "config.json").write_text("{}")
    real_fsync, flushed = os.fsync, []

    def fsync(fd):
        flushed.append((os.readlink(f"/proc/self/fd/{fd}"), sorted(os.listdir(tmp_path))))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    replace_directory(new, tmp_path / "ckpt")
    assert flushed == [(str(tmp_path), ["ckpt"])] and (tmp_path / "ckpt" / "config.json").is_file()


def test_an_existing_folder_is_exchanged_for_the_new_one_in_one_step(tmp_path, monkeypatch):
    """Linux swaps the two names at once (renameat2): a crash while a checkpoint is replaced never finds its name
    missing, nor the old folder set aside, for neither is ever renamed on its own."""
    monkeypatch.chdir(tmp_path)  # names relative to the working folder, as `--out runs/x` gives them
    ckpt, new = Path("ckpt"), Path(".ckpt.tmp-0badf00d")
    ckpt.mkdir()
    (ckpt / "config.json").write_text("old")
    new.mkdir()
    (new / "config.json").write_text("new")

    def rename(src, dst):
        raise AssertionError(f"{src} renamed to {dst}: the folder's name was missing for a moment")

    monkeypatch.setattr(os, "replace", rename)
    replace_directory(new, ckpt)
    assert (ckpt / "config.json").read_text() == "new" and os.listdir(tmp_path) == ["ckpt"]


def test_where_folders_cannot_be_exchanged_the_old_one_is_set_aside_replaced_and_removed(tmp_path, monkeypatch):
    """A C library without renameat2 (macOS, an old glibc): the old folder is renamed aside (a crash between the two
    renames leaves it as ``.NAME.old``, which a resume puts back), the new one takes its name, and the old one goes."""
    monkeypatch.setattr(ctypes, "CDLL", lambda name, use_errno: SimpleNamespace())  # a libc with no renameat2
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("old")
    new = tmp_path / ".ckpt.tmp-0badf00d"
    new.mkdir()
    (new / "config.json").write_text("new")
    replace_directory(new, tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "config.json").read_text() == "new" and os.listdir(tmp_path) == ["ckpt"]


def test_a_file_that_is_not_utf8_is_named_with_the_line_of_its_first_bad_byte(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_bytes(b"first line\nsecond \xff line\nthird\nfourth\n")
    with pytest.raises(ValueError, match=r"notes.txt:2 is not UTF-8 text \(byte 18: invalid start byte\)"):
        read_text_file(notes)
    notes.write_bytes(b"\nsecond \xff line\n")  # an empty first line is a line too
    with pytest.raises(ValueError, match=r"notes.txt:2 is not UTF-8 text \(byte 8: invalid start byte\)"):
        read_text_file(notes)


def test_a_files_checksum_is_the_sha256_of_all_its_bytes(tmp_path):
    """Manifests, ONNX seals and weights identities written by earlier versions hold sha256 digests: any other
    digest, or one of part of a file read in blocks, refuses every checkpoint and export already on disk."""
    data = os.urandom(3 * 2**20 + 5)  # three whole blocks and part of a fourth
    (tmp_path / "model.safetensors").write_bytes(data)
    assert file_checksum(tmp_path / "model.safetensors") == hashlib.sha256(data).hexdigest()


def test_only_a_higher_version_of_the_same_family_is_a_newer_format():
    assert is_newer_format("store/3", "store/2") and not is_newer_format("store/2", "store/2")
    assert not is_newer_format("store/1", "store/2") and not is_newer_format("other/9", "store/2")
    assert not is_newer_format(None, "store/2") and not is_newer_format("store/x", "store/2")


def test_an_error_that_names_its_own_file_keeps_it_and_one_without_a_number_is_left_as_it_is(tmp_path):
    """``naming_errors(PATH)`` names PATH only in an error that names no file (a write to a full disk): an error about
    another file, or a message of the project's own, is not made to point at PATH."""
    with pytest.raises(FileNotFoundError) as raised:
        with naming_errors(tmp_path / "metrics.jsonl"):
            (tmp_path / "gone.json").read_text()
    assert raised.value.filename == str(tmp_path / "gone.json")
    assert describe_os_error(raised.value) == f"{tmp_path / 'gone.json'}: No such file or directory"
    own = OSError("the archive was closed")
    with pytest.raises(OSError) as raised:
        with naming_errors(tmp_path / "captions.jsonl"):
            raise own
    assert raised.value is own


def test_a_folder_held_alone_is_made_with_its_missing_parents(tmp_path):
    """``captioner data generate --out data/new/scenes`` and ``train --out runs/new/x`` name folders whose parents
    need not exist yet: the lock makes the folder before anything else does."""
    folder = tmp_path / "data" / "new" / "scenes"
    with held_alone(folder, FolderInUse("busy")):
        assert folder.is_dir()


def test_a_folder_on_a_file_system_without_flock_is_written_unlocked(tmp_path, monkeypatch):
    """Some network file systems answer ``flock`` with ENOLCK: a data set is then generated there as before the lock
    existed, not refused as if another writer held the folder (none can be seen to)."""
    def no_flock(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_flock)
    ran = []
    with held_alone(tmp_path / "scenes", FolderInUse("busy")):
        ran.append(True)
    assert ran == [True]
