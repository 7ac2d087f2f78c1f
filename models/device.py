"""Device selection shared by training, evaluation and serving."""

from __future__ import annotations

import torch


def resolve_device(name: str = "auto") -> torch.device:
    """``auto`` → CUDA when available, else CPU; an explicit ``cuda`` without a GPU is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' was requested but no CUDA GPU is available")
    return device


def set_threads(threads: int | None) -> None:
    if threads:
        torch.set_num_threads(threads)
