"""An ONNX export folder on disk, without an export (models/export/folder.py): a folder is swapped in whole or not
at all, the temporary folder of a failed export goes with it, a folder holding anything an export does not write is
refused and kept, two exports into one folder leave each other's temporary folders alone, and a graph's seal is
read again once either file changes.  test_serving_onnx.py holds the same through real exports, seconds each."""

from __future__ import annotations

import fcntl
import os
import threading
from pathlib import Path

import pytest

from captioner.models.export.folder import (SEAL_SUFFIX, SPEC_FILE, STEP_FILE, alone_in, check_replaceable,
                                            folder_swapped_in, intact, remove_abandoned, seal)

from .serving_helpers import call_bounded


def _export(final, graph: bytes):
    """An export's own files swapped in at ``final``: a sealed ``step.onnx`` holding ``graph``, and its record."""
    with folder_swapped_in(final) as tmp:
        (tmp / STEP_FILE).write_bytes(graph)
        seal(tmp / STEP_FILE)
        (tmp / SPEC_FILE).write_text("{}")
    return final


def _later(path) -> None:
    """Move ``path``'s modification time a second on, as a write some time after the last one would: two writes
    within one clock tick of the file system may keep the same time."""
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))


def test_an_export_replaces_the_old_one_whole_and_leaves_nothing_beside_it(tmp_path):
    final = _export(tmp_path / "sat", b"old graph")
    with folder_swapped_in(final) as tmp:
        (tmp / STEP_FILE).write_bytes(b"new graph")
        seal(tmp / STEP_FILE)
        assert sorted(p.name for p in final.iterdir()) == [SPEC_FILE, STEP_FILE, STEP_FILE + SEAL_SUFFIX]
    assert sorted(p.name for p in final.iterdir()) == [STEP_FILE, STEP_FILE + SEAL_SUFFIX]
    assert (final / STEP_FILE).read_bytes() == b"new graph" and intact(final / STEP_FILE)
    assert [p.name for p in tmp_path.iterdir()] == ["sat"]


def test_an_export_that_fails_midway_leaves_the_old_one_and_no_partial_folder(tmp_path):
    """A verification that fails, a full disk, Ctrl-C: the partial folder goes at once (a model's worth of graphs
    would otherwise stay until the next export into that folder) and the old export is still the one there."""
    final = _export(tmp_path / "sat", b"old graph")
    with pytest.raises(RuntimeError, match="does not match PyTorch"):
        with folder_swapped_in(final) as tmp:
            (tmp / STEP_FILE).write_bytes(b"half a graph")
            raise RuntimeError("step: does not match PyTorch")
    assert [p.name for p in tmp_path.iterdir()] == ["sat"]
    assert (final / STEP_FILE).read_bytes() == b"old graph" and intact(final / STEP_FILE)


def test_a_file_saved_into_the_folder_while_it_was_exported_is_kept_and_the_export_refused(tmp_path):
    """The folder is checked again before the swap (an export may take minutes): a file someone saved there
    meanwhile is not swapped away with the old export."""
    final = _export(tmp_path / "sat", b"old graph")
    with pytest.raises(FileExistsError, match="holds notes.txt, which no ONNX export writes"):
        with folder_swapped_in(final) as tmp:
            (tmp / STEP_FILE).write_bytes(b"new graph")
            (final / "notes.txt").write_text("mine")
    assert (final / "notes.txt").read_text() == "mine" and (final / STEP_FILE).read_bytes() == b"old graph"
    assert [p.name for p in tmp_path.iterdir()] == ["sat"]


def test_a_hidden_file_no_export_writes_is_as_foreign_as_any_other(tmp_path):
    """Only hidden names an export writes (a seal or a graph not yet renamed into place) are its own: a folder
    holding ``.gitignore`` or ``.notes`` is refused, not deleted by the swap."""
    final = _export(tmp_path / "sat", b"graph")
    (final / ".encoder.onnx.tmp-0123abcd").write_bytes(b"half a graph")
    (final / f".{STEP_FILE}{SEAL_SUFFIX}.tmp-0123abcd").write_text("0" * 64)
    check_replaceable(final)
    for name in (".gitignore", ".notes"):
        (final / name).write_text("mine")
        with pytest.raises(FileExistsError, match=f"holds {name}, which no ONNX export writes"):
            check_replaceable(final)
        (final / name).unlink()


def test_a_refusal_names_three_of_the_foreign_files_and_says_there_are_more(tmp_path):
    """A folder of thousands of photos given as ``--out``: three names, not all of them, in sorted order."""
    folder = tmp_path / "photos"
    folder.mkdir()
    for name in ("d.jpg", "b.jpg", "a.jpg", "c.jpg"):
        (folder / name).write_bytes(b"")
    with pytest.raises(FileExistsError, match=r"holds a\.jpg, b\.jpg, c\.jpg, …, which no ONNX export writes"):
        check_replaceable(folder)
    (folder / "d.jpg").unlink()
    with pytest.raises(FileExistsError, match=r"holds a\.jpg, b\.jpg, c\.jpg, which no ONNX export writes"):
        check_replaceable(folder)


def test_two_exports_into_one_folder_leave_each_others_temporary_folders_alone(tmp_path):
    """Two models exported into one folder at once (a server's start and ``captioner export``; here within one
    process, where ``flock`` works the same between two opened descriptors): the second cleans away only what
    killed exports left, and the first's temporary folder, holding nothing but an export's files, is not that."""
    with folder_swapped_in(tmp_path / "a") as first:
        (first / STEP_FILE).write_bytes(b"graph a")
        seal(first / STEP_FILE)
        call_bounded(60, _export, tmp_path / "b", b"graph b")
        assert (first / STEP_FILE).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]
    assert intact(tmp_path / "a" / STEP_FILE) and intact(tmp_path / "b" / STEP_FILE)


def test_an_export_waits_for_another_processs_cleaning_of_its_folder_before_it_writes_there(tmp_path, monkeypatch):
    """An export starting while another process cleans the folder (what killed exports left, or the CNN exports a
    newer one replaced: both under the folder's exclusive lock) waits for the cleaning to end and then writes under
    its shared lock.  Gone on unlocked, it would leave the next export's cleaning finding the folder to itself and
    removing this export's temporary folder, an export's files and nothing else, while it is written."""
    real_flock, seen, noticed = fcntl.flock, [], threading.Event()

    def noting_a_wait(fd, operation):
        if not operation & fcntl.LOCK_NB:
            try:
                return real_flock(fd, operation | fcntl.LOCK_NB)
            except BlockingIOError:
                seen.append("waiting")
                noticed.set()
        return real_flock(fd, operation)

    def export():
        with folder_swapped_in(tmp_path / "b") as tmp:
            seen.append("writing")
            noticed.set()
            (tmp / STEP_FILE).write_bytes(b"graph b")
            seal(tmp / STEP_FILE)

    with alone_in(tmp_path) as cleaning:  # the other process's cleaning, here within this one
        assert cleaning
        monkeypatch.setattr(fcntl, "flock", noting_a_wait)
        exporting = threading.Thread(target=export, daemon=True)
        exporting.start()
        assert noticed.wait(60)
        assert seen == ["waiting"]
    exporting.join(60)
    assert seen == ["waiting", "writing"] and intact(tmp_path / "b" / STEP_FILE)


def test_a_graph_renamed_over_a_sealed_one_of_the_same_size_and_time_is_checked_again(tmp_path):
    """A start keeps ``intact``'s answer while neither file changes, but a graph renamed into place is another file
    even with the old one's size and modification time: every graph of one architecture has the same size, and two
    writes within one clock tick of the file system, or a copy keeping its source's time (``cp -p``, ``rsync -a``),
    share a time.  Its seal is the old graph's, so it is not intact."""
    graph = tmp_path / STEP_FILE
    graph.write_bytes(b"graph a")
    seal(graph)
    assert intact(graph)
    other = tmp_path / "other.onnx"
    other.write_bytes(b"graph b")
    stat = graph.stat()
    os.utime(other, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    os.replace(other, graph)
    assert not intact(graph)


@pytest.mark.parametrize("damaged", ["graph", "seal"])
def test_a_graph_or_seal_changed_on_disk_since_it_was_found_intact_is_not_intact(tmp_path, damaged):
    """A start asks ``intact`` of each graph more than once and the answer is kept, but only while neither file
    changes: a byte of the graph overwritten in place (same size, same inode), or a seal rewritten, is seen."""
    graph = tmp_path / STEP_FILE
    graph.write_bytes(b"graph")
    seal(graph)
    assert intact(graph)
    path = graph if damaged == "graph" else graph.with_name(graph.name + SEAL_SUFFIX)
    with open(path, "r+b") as file:
        file.write(b"x")
    _later(path)
    assert not intact(graph)


@pytest.mark.parametrize("missing", ["graph", "seal"])
def test_a_graph_or_seal_that_is_not_there_is_not_intact_rather_than_an_error(tmp_path, missing):
    """A start asks ``intact`` of graphs not exported yet, and of an older version's graphs written without a seal:
    each is simply to be made (again), never an exception that stops the server or the export."""
    graph = tmp_path / STEP_FILE
    graph.write_bytes(b"graph")
    seal(graph)
    (graph if missing == "graph" else graph.with_name(graph.name + SEAL_SUFFIX)).unlink()
    assert intact(graph) is False


def test_a_graph_written_under_another_name_is_sealed_as_written_before_it_is_renamed_into_place(tmp_path):
    """The int8 CNN is quantized into a temporary file, sealed, then renamed over the graph it replaces (a damaged
    one, or none): the seal is the new graph's, so it is intact once in place and not quantized again."""
    graph = tmp_path / "visual-int8-u8s8.onnx"
    for old in (None, b"a damaged graph"):
        if old is not None:
            graph.write_bytes(old)
        written = tmp_path / ".visual-int8-u8s8.onnx.123"
        written.write_bytes(b"the new graph")
        seal(graph, written=written)
        os.replace(written, graph)
        assert intact(graph)


def test_only_what_killed_exports_left_is_cleaned_away_and_named(tmp_path):
    """A temporary folder's name (``.NAME.tmp-XXXXXXXX``, or ``.NAME.XXXXXXXX`` of ``tempfile.mkdtemp``) holding
    only an export's files: anything else, a hidden copy of an export someone keeps included, stays."""
    for name in (".sat.tmp-0123abcd", ".sat.k9x_2abc", ".sat-backup", ".sat.previous_export", "sat.tmp-0123abcd"):
        (tmp_path / name).mkdir()
        (tmp_path / name / STEP_FILE).write_bytes(b"graph")
    assert sorted(remove_abandoned(tmp_path)) == [".sat.k9x_2abc", ".sat.tmp-0123abcd"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".sat-backup", ".sat.previous_export", "sat.tmp-0123abcd"]


def test_what_only_looks_like_a_killed_exports_folder_is_left_alone(tmp_path):
    """Removed are folders of a temporary name holding an export's files: an empty one may be anyone's, a file of
    such a name (another writer's temporary file) is no folder to look into, and ``tempfile.mkdtemp``'s names have
    eight characters after the dot, not fewer."""
    (tmp_path / ".sat.tmp-0123abcd").mkdir()
    (tmp_path / ".notes.txt.tmp-0123abcd").write_text("being written")
    (tmp_path / ".sat.k9x_2ab").mkdir()
    (tmp_path / ".sat.k9x_2ab" / STEP_FILE).write_bytes(b"graph")
    assert remove_abandoned(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == [".notes.txt.tmp-0123abcd", ".sat.k9x_2ab",
                                                          ".sat.tmp-0123abcd"]


def test_a_temporary_folder_this_process_cannot_list_is_left_alone_and_the_cleaning_goes_on(tmp_path, monkeypatch):
    """Another user's folder of a temporary name, unreadable here, is not ours to remove, and must not stop the
    export about to run (a PermissionError out of the cleaning did); the killed export's folder beside it still
    goes.  Tests run as root, who can list any folder, so the refusal is stood in for."""
    for name in (".theirs.tmp-0123abcd", ".sat.tmp-89abcdef"):
        (tmp_path / name).mkdir()
        (tmp_path / name / STEP_FILE).write_bytes(b"graph")
    listing = Path.iterdir

    def unreadable_theirs(folder):
        if folder.name == ".theirs.tmp-0123abcd":
            raise PermissionError(13, "Permission denied", str(folder))
        return listing(folder)

    monkeypatch.setattr(Path, "iterdir", unreadable_theirs)
    assert remove_abandoned(tmp_path) == [".sat.tmp-89abcdef"]
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == [".theirs.tmp-0123abcd"]


def test_only_onnx_files_of_the_int8_cnns_name_are_an_exports_own(tmp_path):
    """The int8 CNN's name carries its recipe, so any ``visual-int8-*.onnx`` is an export's; a note of that prefix is
    not, and a folder holding one is refused like any other."""
    final = _export(tmp_path / "visual-0123", b"graph")
    (final / "visual-int8-qdq-minmax-1.onnx").write_bytes(b"an earlier recipe's graph")
    check_replaceable(final)
    (final / "visual-int8-notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="holds visual-int8-notes.txt, which no ONNX export writes"):
        check_replaceable(final)


def test_a_seal_ending_in_a_newline_still_seals(tmp_path):
    """A seal saved with a line end (``sha256sum``'s way, an editor's) holds the same checksum."""
    graph = tmp_path / STEP_FILE
    graph.write_bytes(b"graph")
    seal(graph)
    seal_path = graph.with_name(graph.name + SEAL_SUFFIX)
    seal_path.write_text(seal_path.read_text() + "\n")
    assert intact(graph)
