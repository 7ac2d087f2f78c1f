"""Masked softmax: the ordinary attention normaliser."""

from __future__ import annotations

import torch
from torch import Tensor


def masked_softmax(scores: Tensor, mask: Tensor | None = None) -> Tensor:
    """softmax over the last dim with masked (False) items at exactly zero weight.

    Rows whose items are all masked return zeros instead of NaN.
    """
    if mask is None:
        return scores.softmax(-1)
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = scores.softmax(-1)
    return torch.nan_to_num(weights, nan=0.0)
