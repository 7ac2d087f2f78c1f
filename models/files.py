"""Writing files so that a crash never leaves half of one: the one place that knows how.

A file is written whole or not at all by writing a temporary file beside it and renaming that over it (a rename
within a folder is atomic on POSIX file systems).  ``durable`` writes also survive a machine crash: the data is
flushed to disk before the rename, and the folder's entry after it.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import glob
import hashlib
import json
import os
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator


def create_durably(path: Path, data: bytes) -> None:
    """Create ``path`` with ``data``, flushed to disk.  Mode 0666 minus the umask, like ``open(path, "w")``
    (``safetensors.save_file`` makes its files 0600, unreadable to a service running as another user)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except BaseException as exc:  # a full disk, an interrupt: no torn file is left behind
        os.close(fd)
        path.unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.filename is None:  # os.write's error names no file: this one does
            raise naming(exc, path) from None
        raise
    os.close(fd)


def naming(exc: OSError, path: str | Path) -> OSError:
    """``exc`` naming ``path`` when it names no file (the error of a ``write`` or ``flush``: a full disk, a read-only
    file system), so that :func:`describe_os_error` says ``PATH: reason`` and not the OS's reason alone."""
    if exc.filename is not None or exc.errno is None:
        return exc
    return type(exc)(exc.errno, exc.strerror, str(path))


@contextlib.contextmanager
def naming_errors(path: str | Path) -> Iterator[None]:
    """Raise an OS error of the block as :func:`naming` ``path``: a ``write`` or ``flush`` to a full disk says the
    reason alone, and the CLI then named no file."""
    try:
        yield
    except OSError as exc:
        raise naming(exc, path) from None


def fsync_path(path: Path) -> None:
    """Flush a file's or a folder's (its entries') data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


#: what marks a temporary name: ``.NAME`` + this + 8 random hex digits
_TEMPORARY_MARK = ".tmp-"


def temporary_beside(path: Path) -> Path:
    """A name for ``path``'s temporary file, in its folder, hidden, and this writer's own (``.NAME.tmp-XXXXXXXX``):
    two writers of one file never write into each other's, and a reader looking for ``path`` never sees it."""
    return path.with_name(f".{path.name}{_TEMPORARY_MARK}{secrets.token_hex(4)}")


def temporaries_of(path: Path) -> list[Path]:
    """The temporary files or folders :func:`temporary_beside` named for ``path`` that are still there: what writers
    killed mid-way left (call it only when no writer of ``path`` can be running)."""
    return list(path.parent.glob(f".{glob.escape(path.name)}{_TEMPORARY_MARK}*"))


def temporary_target(name: str) -> str | None:
    """The name a :func:`temporary_beside` name stands for (``.NAME.tmp-XXXXXXXX`` → ``NAME``); None for any other."""
    stem, mark, token = name.rpartition(_TEMPORARY_MARK)
    return stem[1:] if mark and token and len(stem) > 1 and stem.startswith(".") else None


def unwritable(folder: Path) -> str | None:
    """Why no file can be made in ``folder`` (the OS's words), or None when one can.  A file is made and gone at
    once: permissions alone say nothing of a read-only file system, nor of a superuser's writes."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            return None
    except OSError as exc:
        return exc.strerror or str(exc)


def describe_os_error(exc: OSError) -> str:
    """An OS error as the shell's tools say it, ``PATH: reason`` (Python's ``[Errno 2] No such file or directory:
    'PATH'`` leads with the number and quotes the path); a temporary of :func:`temporary_beside` is named as the
    file or folder it was to become, the one the user asked for (a file in a temporary folder too)."""
    if not exc.strerror:
        return str(exc)
    names = [_shown(name) for name in (exc.filename, exc.filename2) if name is not None]
    return f"{' → '.join(names)}: {exc.strerror}" if names else exc.strerror


def _shown(name: object) -> str:
    if not isinstance(name, (str, bytes, os.PathLike)):  # a file descriptor
        return str(name)
    return str(Path(*(temporary_target(part) or part for part in Path(os.fsdecode(name)).parts)))


def set_aside(path: Path) -> Path:
    """Where :func:`replace_directory` renames an existing folder while it puts the new one in place, on systems
    that cannot swap two folders in one step (``.NAME.old``)."""
    return path.with_name(f".{path.name}.old")


def replace_directory(tmp: Path, path: Path) -> None:
    """Put the finished folder ``tmp`` (in ``path``'s folder) at ``path``.  An existing ``path`` is swapped out
    atomically where the OS can (so ``path`` always names a whole folder: a checkpoint, an ONNX export); elsewhere it
    is renamed aside first, and a crash between the two renames leaves it as :func:`set_aside`'s name."""
    if path.exists() and _exchange(tmp, path):
        shutil.rmtree(tmp)
    else:
        old = set_aside(path)
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    fsync_path(path.parent)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def write_atomically(path: Path, data: bytes | str, durable: bool = False) -> None:
    """Replace ``path`` with ``data`` (text as UTF-8) whole or not at all; ``durable``: flushed to disk, so that a
    machine crash too leaves either the old file or the new one.  A failed write leaves no temporary file."""
    tmp = temporary_beside(path)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    try:
        if durable:
            create_durably(tmp, payload)
        else:
            tmp.write_bytes(payload)
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError):  # a full disk: Path.write_bytes's error names no file (the CLI said the reason)
            raise naming(exc, path) from None
        raise
    if durable:
        fsync_path(path.parent)


def file_checksum(path: str | Path) -> str:
    """The sha256 of a file's bytes (hex), read in 1 MiB blocks: checkpoint manifests, ONNX seals and the identity
    of a weights file (:func:`~captioner.models.encoder.weights_sha256`)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def is_newer_format(name: object, current: str) -> bool:
    """Whether ``name`` is a format name ``FAMILY/N`` of ``current``'s family with a higher ``N`` (a feature store's,
    an ONNX export's): written by a newer version of the project.  Any other name is not (no version wrote it)."""
    return _format_version(name, current) > _format_version(current, current)


def _format_version(name: object, current: str) -> int:
    family, _, version = str(name).rpartition("/")
    return int(version) if family == current.rpartition("/")[0] and version.isdigit() else -1


def read_text_file(path: str | Path) -> str:
    """A text file the user gave (a report, notes, a document, a log), read as UTF-8: a file that is another
    encoding's bytes is a :class:`ValueError` naming the file and its line, not the codec's message alone (which
    names no file).  OS errors (missing, a folder, unreadable) are raised as they are: they name the file."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ValueError(f"{path}:{line} is not UTF-8 text (byte {exc.start}: {exc.reason})") from None


def read_json_file(path: str | Path, what: str = "JSON", kind: type = dict) -> Any:
    """The JSON value of ``path``, of Python type ``kind`` (an object, by default): a file that is not UTF-8, not
    JSON (empty, truncated) or holds another kind of value is a :class:`ValueError` naming the file and saying it
    is not ``what``."""
    text = read_text_file(path)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not {what} (not JSON: {exc})") from None
    if not isinstance(value, kind):
        expected = {dict: "an object", list: "a list"}.get(kind, kind.__name__)
        raise ValueError(f"{path} is not {what} (its JSON is {type(value).__name__}, not {expected})")
    return value


class FolderInUse(OSError):
    """Another process is writing the folder (:func:`held_alone`)."""


@contextlib.contextmanager
def held_alone(folder: Path, refusal: FolderInUse) -> Iterator[None]:
    """Hold ``folder`` (made if missing) for this process while the block runs; where another process holds it,
    raise ``refusal`` before anything is written.  The lock is the folder's own ``flock``: a killed holder leaves
    nothing behind, and no file is added to the folder.  (On a file system without ``flock`` the block runs
    unlocked, as it did before there was a lock.)"""
    folder.mkdir(parents=True, exist_ok=True)
    handle = os.open(folder, os.O_RDONLY)
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise refusal from None
        except OSError:  # no flock here (some network file systems)
            pass
        yield
    finally:
        os.close(handle)  # releases the lock


def being_written(folder: Path, command: str) -> FolderInUse:
    """The refusal of a second writer of a data set's ``folder`` (:func:`held_alone`)."""
    return FolderInUse(f"{folder} is being written by another `{command}`: wait for it to end, or give --out "
                       "another folder; nothing was written")
