"""Mixed precision: which autocast dtype a run trains under (``--precision``) and whether fp16 needs a gradient
scaler."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Precision:
    """Autocast dtype (None: fp32) and whether a gradient scaler guards fp16 against underflow."""

    name: str
    dtype: torch.dtype | None
    scaled: bool

    def autocast(self, device: torch.device):
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.dtype)


def resolve_precision(name: str, device: torch.device) -> Precision:
    """``auto`` → bf16 on a GPU that supports it, fp16 (scaled) on older GPUs, fp32 on CPU; an explicit
    ``bf16`` also runs on CPU (autocast), ``fp16`` needs CUDA."""
    if name == "auto":
        if device.type != "cuda":
            name = "fp32"
        else:
            name = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    if name == "fp32":
        return Precision("fp32", None, False)
    if name == "bf16":
        return Precision("bf16", torch.bfloat16, False)
    if name == "fp16":
        if device.type != "cuda":
            raise ValueError("--precision fp16 needs a CUDA device (use bf16 or fp32 on CPU)")
        return Precision("fp16", torch.float16, True)
    raise ValueError(f"unknown precision {name!r}; choose auto, fp32, bf16 or fp16")
