"""Writing files so that a crash never leaves half of one: the one place that knows how.

A file is written whole or not at all by writing a temporary file beside it and renaming that over it (a rename
within a folder is atomic on POSIX file systems).  ``durable`` writes also survive a machine crash: the data is
flushed to disk before the rename, and the folder's entry after it.
"""

from __future__ import annotations

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


def temporary_beside(path: Path) -> Path:
    """A name for ``path``'s temporary file, in its folder, hidden, and this writer's own (``.NAME.tmp-XXXXXXXX``):
    two writers of one file never write into each other's, and a reader looking for ``path`` never sees it."""
    return path.with_name(f".{path.name}.tmp-{secrets.token_hex(4)}")


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


def format_version(name: object, current: str) -> int:
    """The version ``N`` of a format name ``FAMILY/N`` of the same family as ``current`` (a feature store's, an ONNX
    export's); -1 for any other name, which no version of the project wrote."""
    family, _, version = str(name).rpartition("/")
    return int(version) if family == current.rpartition("/")[0] and version.isdigit() else -1
