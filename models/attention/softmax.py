"""Masked softmax: the ordinary attention normaliser."""

from __future__ import annotations

import torch
from torch import Tensor


def masked_softmax(scores: Tensor, mask: Tensor | None = None) -> Tensor:
    """``softmax(z)_i = exp(z_i) / Σ_j exp(z_j)`` over the last dim (Martins et al., "Sparse and Structured Visual
    Attention", arXiv:2002.05556, Eq. 1; the normaliser of Vaswani et al., arXiv:1706.03762, Eq. 1 and of SAT,
    arXiv:1502.03044, Eq. 5), with the sum over the real items only: masked (False) items get exactly zero weight
    (docs/decisions.md#masked-items).

    Rows whose items are all masked return zeros instead of NaN (no paper has such rows).
    """
    if mask is None:
        return scores.softmax(-1)
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = scores.softmax(-1)
    return torch.nan_to_num(weights, nan=0.0)
