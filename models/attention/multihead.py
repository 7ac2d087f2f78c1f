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
    """``Concat(head_1, …, head_H)`` with ``head_h = softmax(Q_h K_hᵀ / √d) V_h``: Vaswani et al., "Attention Is All
    You Need", arXiv:1706.03762, Eq. 1 per head and the multi-head definition of §3.2.2, *without* its output
    projection ``W^O`` (AoANet's ``f_mh-att``, arXiv:1908.06954, Eq. 8–10).  The inputs are already projected, so
    head ``h``'s ``Q W^Q_h`` is the ``h``-th channel slice of ``query``, ``d = D/H``.

    ``query [B, T, D]`` over ``key``/``value [B, N, D]`` → attended ``[B, T, D]`` and weights ``[B, H, T, N]``.

    ``key_mask [B, N]`` is True for real items; padded items get exactly zero weight.  ``weight_dropout`` acts on
    the weights used for the weighted sum only, so the returned weights are the softmax itself (what is exported).
    """
    if query.shape[-1] % heads:
        raise ValueError(f"width {query.shape[-1]} is not divisible by {heads} heads")
    return attend_split(split_heads(query, heads), split_heads(key, heads), split_heads(value, heads), key_mask,
                        weight_dropout)


def split_heads(x: Tensor, heads: int) -> Tensor:
    """``[B, L, D] → [B, heads, L, d]`` (a view): head ``h`` owns channels ``h·d … (h+1)·d − 1``."""
    return x.unflatten(-1, (heads, x.shape[-1] // heads)).transpose(1, 2)


def attend_split(query: Tensor, key: Tensor, value: Tensor, key_mask: Tensor | None = None,
                 weight_dropout: Callable[[Tensor], Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """The attention of :func:`multi_head_attention` on inputs already split into heads (:func:`split_heads`):
    ``query [B, H, T, d]`` over ``key``/``value [B, H, N, d]`` → attended ``[B, T, H·d]`` (heads concatenated)
    and weights ``[B, H, T, N]``.

    A decoding step has one query per row and reads the image's keys and values, split into heads once in
    ``encode``: splitting them at every step copied them each time, and the block-diagonal query used instead
    (every head's query against all channels) multiplied the step's attention arithmetic by the number of heads."""
    scores = query @ key.transpose(-1, -2) / math.sqrt(query.shape[-1])
    weights = masked_softmax(scores, None if key_mask is None else key_mask[:, None, None, :])
    mixing = weight_dropout(weights) if weight_dropout is not None else weights
    return (mixing @ value).transpose(1, 2).flatten(2), weights
