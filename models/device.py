"""Device selection shared by training, evaluation and serving."""

from __future__ import annotations

import contextlib
import logging
import os
import platform

import torch

log = logging.getLogger("captioner.device")

#: the precisions the networks run in, by torch's dtype names → the autocast dtype (None: plain float32): the one
#: vocabulary of serving (``CAPTIONER_PRECISION``) and training (``captioner train --precision``, which adds
#: ``auto``: models/training/precision.py)
PRECISIONS: dict[str, torch.dtype | None] = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}


def autocast(device: torch.device, dtype: torch.dtype | None):
    """``torch.autocast`` to ``dtype`` on ``device``'s type; for ``None`` (float32), a context that does nothing."""
    return contextlib.nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


def resolve_device(name: str = "auto") -> torch.device:
    """``auto`` → CUDA when available, else CPU; an explicit ``cuda`` without a GPU, a ``cuda:N`` past the last GPU,
    or a name torch does not know, is a :class:`ValueError` (a mistake in the command, which the CLI answers in one
    line)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"unknown device {name!r}: use auto, cpu or cuda (cuda:N for the N-th GPU)") from None
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise ValueError(f"device {name!r} was requested but no CUDA GPU is available (use auto or cpu)")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        # torch accepts any index here and fails only at the first tensor moved, with "invalid device ordinal"
        names = "cuda:0" if count == 1 else f"cuda:0 to cuda:{count - 1}"
        raise ValueError(f"device {name!r} was requested but this machine has {count} CUDA GPU{'s' * (count != 1)} "
                         f"({names})")
    return device


def set_threads(threads: int | None, interop: int | None = None) -> None:
    """PyTorch's intra-op threads and, given ``interop``, its inter-op threads (None: their defaults).  The
    inter-op count can only be set before the process's first parallel work: later, a warning says so."""
    if threads:
        torch.set_num_threads(threads)
    if interop:
        try:
            torch.set_num_interop_threads(interop)
        except RuntimeError as exc:
            log.warning("cannot set inter-op threads to %d: %s", interop, exc)


def describe_hardware(device: torch.device) -> str:
    """What a run ran on, for model cards: the GPU's name, or the CPU's core count and architecture."""
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} GPU"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()  # a container's share
    return f"{cores}-core {platform.machine()} CPU, no GPU"
