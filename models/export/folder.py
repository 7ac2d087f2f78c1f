"""An ONNX export folder on disk: the files it holds, each graph's seal, and how a folder is replaced.

* ``<graph>.sha256`` beside every graph: its own checksum when it was written, so a graph damaged on disk since
  is made again instead of failing every start (:func:`intact`).
* A folder is written beside its final name and swapped in whole (:func:`folder_swapped_in`), so a reader never
  sees half an export; a folder holding anything an export does not write is refused, never deleted
  (:func:`check_replaceable`).
* The temporary folder of an export killed mid-way (SIGKILL, the OOM killer) is removed by the next export into
  that folder (:func:`remove_abandoned`), under a ``flock`` that keeps it from removing one still being written.

What goes into the graphs, and how they are checked against PyTorch, is :mod:`.onnx`'s.
"""

from __future__ import annotations

import fcntl
import functools
import os
import re
import shutil
from contextlib import contextmanager, suppress
from pathlib import Path

from ..files import file_checksum, replace_directory, temporary_beside, temporary_target, write_atomically

ENCODER_FILE, STEP_FILE, SPEC_FILE = "encoder.onnx", "step.onnx", "onnx.json"
HEAD_FILE = "head.onnx"
#: every graph :func:`~.onnx.export_graphs` writes by default, and those a server loads: it runs each image through the
#: CNN's shared ``visual.onnx``, then the model's head, so its exports leave out the self-contained ``encoder.onnx``
ALL_GRAPHS, SERVED_GRAPHS = (ENCODER_FILE, HEAD_FILE, STEP_FILE), (HEAD_FILE, STEP_FILE)
VISUAL_FILE = "visual.onnx"
#: beside ``visual.onnx``: the spec the CNN was exported from, so that a later export of that spec from other weights
#: or in another format (another key) can tell which folder it replaces
VISUAL_SPEC_FILE = "visual.json"
#: what ``tempfile.mkdtemp(prefix=".NAME.")`` named an export's temporary folder before they were named by
#: :func:`temporary_beside`: a killed export of that version may have left one
MKDTEMP_FOLDER = re.compile(r"\..+\.[a-z0-9_]{8}")
SEAL_SUFFIX = ".sha256"


def seal(path: Path, written: Path | None = None) -> None:
    """Record the sha256 of the graph ``written`` (default: ``path`` itself) as ``path``'s seal, atomically; write
    it before a graph is renamed into place, so a crash between the two leaves a seal without its graph (not
    intact: made again), never a graph with a wrong seal."""
    write_atomically(path.with_name(path.name + SEAL_SUFFIX), file_checksum(written or path))


def intact(path: Path) -> bool:
    """``path`` exists and still has the sha256 :func:`seal` recorded when it was written: a graph cut short,
    overwritten or left without its seal by an older version is made again rather than loaded.  A start asks this
    of each graph more than once (what is still to prepare, then loading), so the answer is kept for as long as
    neither file changes on disk."""
    seal_path = path.with_name(path.name + SEAL_SUFFIX)
    try:
        stamps = tuple((s.st_ino, s.st_size, s.st_mtime_ns) for s in (path.stat(), seal_path.stat()))
    except OSError:
        return False
    return _matches_seal(str(path), stamps)


@functools.lru_cache(maxsize=256)
def _matches_seal(path: str, stamps: tuple) -> bool:  # ``stamps`` keys the cache: a rewritten file misses it
    try:
        return file_checksum(Path(path)) == Path(path + SEAL_SUFFIX).read_text().strip()
    except (OSError, ValueError):  # a seal that is not text (UnicodeDecodeError) seals nothing
        return False


def _is_export_file(name: str) -> bool:
    """A file the exporter writes into a model's or a CNN's folder (the int8 CNN's name carries its recipe)."""
    if name.startswith(".") and (".onnx" in name or SEAL_SUFFIX in name):
        return True  # a write this module had not renamed into place yet (seal, int8 CNN) when it was stopped
    name = name.removesuffix(SEAL_SUFFIX)
    return name in (ENCODER_FILE, HEAD_FILE, STEP_FILE, SPEC_FILE, VISUAL_FILE, VISUAL_SPEC_FILE) or (
        name.startswith("visual-int8") and name.endswith(".onnx"))


def check_replaceable(final: Path) -> None:
    """An existing ``final`` is replaced only when it holds an export's own files and nothing else: a folder of
    anything else under that name (a checkpoint exported into its own parent folder, say) is refused before any
    work, never deleted."""
    if final.exists() and not final.is_dir():
        raise FileExistsError(f"{final} is a file, not an ONNX export folder: nothing was exported there")
    foreign = sorted(p.name for p in final.iterdir() if not _is_export_file(p.name)) if final.is_dir() else []
    if foreign:
        raise FileExistsError(f"{final} holds {', '.join(foreign[:3])}{', …' if len(foreign) > 3 else ''}, which "
                              "no ONNX export writes: nothing was exported there; export into another folder (--out)")


def holds_only_export_files(folder: Path, *, empty: bool = True) -> bool:
    """Whether every entry of ``folder`` is an export's file (an empty folder counts unless ``empty=False``);
    False for a folder this process cannot list, such as another user's."""
    try:
        names = [entry.name for entry in folder.iterdir()]
    except OSError:
        return False
    return (empty or bool(names)) and all(_is_export_file(name) for name in names)


def remove_abandoned(parent: Path) -> list[str]:
    """Remove the temporary folders (``.NAME.tmp-XXXXXXXX``, or ``.NAME.XXXXXXXX`` of earlier versions; holding only
    an export's files) that exports killed mid-way left in ``parent``: SIGKILL or the OOM killer runs no ``finally``,
    and each such export would otherwise leave a model's worth of graphs there for good.  Call it only while no
    export writes in ``parent`` (:func:`_writing_in` makes sure).  Returns the names removed."""
    removed = []
    for entry in parent.iterdir():
        # an empty folder of a matching name may be anyone's (".foo.settings"): a killed export's holds its files;
        # one this process cannot list (another user's) is left alone rather than failing the export about to run
        temporary = temporary_target(entry.name) is not None or MKDTEMP_FOLDER.fullmatch(entry.name)
        if temporary and entry.is_dir() and holds_only_export_files(entry, empty=False):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry.name)
    return removed


@contextmanager
def alone_in(parent: Path):
    """Yield whether this process holds ``parent``'s ``flock`` exclusively (no export writes in it, in any process),
    keeping it so while the block runs; False where another holds it or the file system has no ``flock``."""
    fd = os.open(parent, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # another export is writing here, or no flock on this file system
            yield False
        else:
            yield True
    finally:
        os.close(fd)  # releases the lock


@contextmanager
def _writing_in(parent: Path):
    """Hold a shared ``flock`` on folder ``parent`` while an export writes a temporary folder in it.  Before that,
    when no other process holds one (no export is in flight there, in any process), clear what killed exports left
    (:func:`remove_abandoned`).  A lock dies with its process, so a killed export never blocks the cleaning; where
    the file system has no ``flock`` nothing is cleaned and the export goes on unlocked."""
    with alone_in(parent) as alone:
        if alone:
            remove_abandoned(parent)
    fd = os.open(parent, os.O_RDONLY)
    try:
        with suppress(OSError):  # lets other exports (and their checks) in, and keeps the cleaning out
            fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)  # releases the lock


@contextmanager
def folder_swapped_in(final: Path):
    """Yield an empty folder beside ``final``; when the block succeeds it takes ``final``'s place in one step
    (:func:`~..files.replace_directory`), so a reader never sees half an export, nor no export.  On failure the
    partial folder is removed and ``final`` is untouched; a process killed before that leaves it for the next export
    to remove (:func:`_writing_in`).  (Callers check :func:`check_replaceable` before their work; it is checked
    again here, before anything is replaced.)"""
    final.parent.mkdir(parents=True, exist_ok=True)
    with _writing_in(final.parent):
        # not tempfile.mkdtemp: its folder is 0700 whatever the umask says, unreadable to a service running as
        # another user
        tmp = temporary_beside(final)
        os.mkdir(tmp)
        try:
            yield tmp
            check_replaceable(final)  # again: the export may have taken minutes
            replace_directory(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
