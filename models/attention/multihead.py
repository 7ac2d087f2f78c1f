"""Multi-head scaled dot-product attention *without* an output projection (AoANet's ``f_mh-att``).

``f_mh-att(Q, K, V) = Concat(head_1, …, head_H)`` with ``head_h = softmax(Q_h K_hᵀ / √d) V_h``, where ``Q_h`` is
the ``h``-th channel slice of width ``d = D/H`` (Vaswani et al.).  The inputs are already projected and nothing is
applied to the concatenation, because in AoANet the AoA module takes the place of the output projection
(AoANet = Huang et al., "Attention on Attention for Image Captioning", arXiv:1908.06954, §3.2.1, Eq. 7–10).
"""

from __future__ import annotations

import math
from typing import Callable

from torch import Tensor

from .softmax import masked_softmax


def multi_head_attention(query: Tensor, key: Tensor, value: Tensor, heads: int, key_mask: Tensor | None = None,
                         weight_dropout: Callable[[Tensor], Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """``query [B, T, D]`` over ``key``/``value [B, N, D]`` → attended ``[B, T, D]`` and weights ``[B, H, T, N]``.

    ``key_mask [B, N]`` is True for real items; padded items get exactly zero weight.  ``weight_dropout`` acts on
    the weights used for the weighted sum only, so the returned weights are the softmax itself (what is exported).
    """
    if query.shape[-1] % heads:
        raise ValueError(f"width {query.shape[-1]} is not divisible by {heads} heads")
    head_dim = query.shape[-1] // heads

    def split(x: Tensor) -> Tensor:  # [B, L, D] → [B, H, L, d]: head h owns channels h·d … (h+1)·d − 1
        return x.unflatten(-1, (heads, head_dim)).transpose(1, 2)

    scores = split(query) @ split(key).transpose(-1, -2) / math.sqrt(head_dim)
    weights = masked_softmax(scores, None if key_mask is None else key_mask[:, None, None, :])
    mixing = weight_dropout(weights) if weight_dropout is not None else weights
    return (mixing @ split(value)).transpose(1, 2).flatten(2), weights
