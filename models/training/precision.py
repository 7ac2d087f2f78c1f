"""Mixed precision: which autocast dtype a run trains under (``--precision``) and whether float16 needs a gradient
scaler.

The precisions are named as torch names the dtypes and as serving names them
(:data:`~captioner.models.device.PRECISIONS`: ``float32``, ``bfloat16``, ``float16``), plus ``auto``.  Runs started
before that wrote ``fp32``, ``bf16`` and ``fp16``: those are read as aliases, on the command line and in a saved
run's config (:func:`canonical_precision`), so such a run still resumes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..device import PRECISIONS, autocast

#: what ``--precision`` takes
PRECISION_CHOICES = ("auto", *PRECISIONS)
#: the names earlier runs recorded → today's
PRECISION_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def canonical_precision(name: str) -> str:
    """``name`` with an alias (``fp32``, ``bf16``, ``fp16``) replaced by its dtype name; any other name as given
    (argparse's choices, or :func:`resolve_precision`, refuses an unknown one)."""
    return PRECISION_ALIASES.get(name, name)


@dataclass(frozen=True)
class Precision:
    """Autocast dtype (None: float32) and whether a gradient scaler guards float16 against underflow."""

    name: str
    dtype: torch.dtype | None
    scaled: bool

    def autocast(self, device: torch.device):
        return autocast(device, self.dtype)


def runs_bfloat16_natively(device: torch.device) -> bool:
    """Whether the CUDA ``device`` has bfloat16 arithmetic: Ampere or newer (compute capability 8), or a ROCm GPU.
    ``torch.cuda.is_bf16_supported()`` also says yes to a V100 or T4, where torch emulates bfloat16 (its
    ``including_emulation=True`` default), and asks the current device rather than the run's."""
    return bool(torch.version.hip) or torch.cuda.get_device_capability(device)[0] >= 8


def resolve_precision(name: str, device: torch.device) -> Precision:
    """``auto`` → bfloat16 on a GPU that supports it, float16 (scaled) on older GPUs, float32 on CPU; an explicit
    ``bfloat16`` also runs on CPU (autocast), ``float16`` needs CUDA.  The aliases ``fp32``, ``bf16``, ``fp16`` are
    taken too."""
    name = canonical_precision(name)
    if name == "auto":
        if device.type != "cuda":
            name = "float32"
        else:
            name = "bfloat16" if runs_bfloat16_natively(device) else "float16"
    if name not in PRECISIONS:
        raise ValueError(f"unknown precision {name!r}; choose {', '.join(PRECISION_CHOICES)} "
                         f"(or {', '.join(PRECISION_ALIASES)})")
    if name == "float16" and device.type != "cuda":
        raise ValueError("--precision float16 needs a CUDA device (use bfloat16 or float32 on CPU)")
    return Precision(name, PRECISIONS[name], scaled=name == "float16")
