"""Writing files so that a crash never leaves half of one: the one place that knows how.

A file is written whole or not at all by writing a temporary file beside it and renaming that over it (a rename
within a folder is atomic on POSIX file systems).  ``durable`` writes also survive a machine crash: the data is
flushed to disk before the rename, and the folder's entry after it.
"""

from __future__ import annotations

import glob
import hashlib
import os
import secrets
from pathlib import Path


def write_durably(path: Path, data: bytes) -> None:
    """Create ``path`` with ``data``, flushed to disk.  Mode 0666 minus the umask, like ``open(path, "w")``
    (``safetensors.save_file`` makes its files 0600, unreadable to a service running as another user)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


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


def write_atomically(path: Path, data: bytes | str, durable: bool = False) -> None:
    """Replace ``path`` with ``data`` (text as UTF-8) whole or not at all; ``durable``: flushed to disk, so that a
    machine crash too leaves either the old file or the new one.  A failed write leaves no temporary file."""
    tmp = temporary_beside(path)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    try:
        if durable:
            write_durably(tmp, payload)
        else:
            tmp.write_bytes(payload)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
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
