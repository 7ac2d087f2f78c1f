"""Multi-head scaled dot-product attention *without* an output projection (AoANet's ``f_mh-att``).

``f_mh-att(Q, K, V) = Concat(head_1, …, head_H)`` with ``head_h = softmax(Q_h K_hᵀ / √d) V_h``, where ``Q_h`` is
the ``h``-th channel slice of width ``d = D/H`` (Vaswani et al.).  The inputs are already projected and nothing is
applied to the concatenation, because in AoANet the AoA module takes the place of the output projection
(AoANet = Huang et al., "Attention on Attention for Image Captioning", arXiv:1908.06954, §3.2.1, Eq. 7–10).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
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
    if query.shape[1] == 1:
        return _one_query(query, key, value, heads, head_dim, key_mask, weight_dropout)

    def split(x: Tensor) -> Tensor:  # [B, L, D] → [B, H, L, d]: head h owns channels h·d … (h+1)·d − 1
        return x.unflatten(-1, (heads, head_dim)).transpose(1, 2)

    scores = split(query) @ split(key).transpose(-1, -2) / math.sqrt(head_dim)
    weights = masked_softmax(scores, None if key_mask is None else key_mask[:, None, None, :])
    mixing = weight_dropout(weights) if weight_dropout is not None else weights
    return (mixing @ split(value)).transpose(1, 2).flatten(2), weights


def _one_query(query: Tensor, key: Tensor, value: Tensor, heads: int, head_dim: int, key_mask: Tensor | None,
               weight_dropout: Callable[[Tensor], Tensor] | None) -> tuple[Tensor, Tensor]:
    """The same attention for one query per row (a decoding step), without per-head copies of the keys and values.

    Splitting ``[B, N, D]`` keys into heads makes every batched matmul copy them into ``[B, H, N, d]`` first — at a
    decoding step that copy of the image's keys and values, repeated every step, was most of AoANet's step time.
    Instead the query is laid out block-diagonally, ``Q̃[b, h] = (0, …, q_h, …, 0) ∈ R^D``, so ``Q̃ Kᵀ`` gives every
    head's scores ``q_h · k_{n,h}`` from the keys as they are stored; the weights times all of ``V`` give
    ``[B, H, D]``, of which head ``h`` keeps its own block ``h``.  Exact: the extra terms are products with zeros."""
    eye = torch.eye(heads, dtype=query.dtype, device=query.device)  # [H, H]
    q = query.squeeze(1).unflatten(-1, (heads, head_dim))  # [B, H, d]
    q_blocks = (eye[None, :, :, None] * q[:, None, :, :]).flatten(2)  # [B, H, D]: row h holds only q_h
    scores = torch.bmm(q_blocks, key.transpose(1, 2)) / math.sqrt(head_dim)  # [B, H, N]
    weights = masked_softmax(scores.unsqueeze(2), None if key_mask is None else key_mask[:, None, None, :])
    mixing = weight_dropout(weights) if weight_dropout is not None else weights
    every_block = torch.bmm(mixing.squeeze(2), value).unflatten(-1, (heads, head_dim))  # [B, H, H, d]
    own_block = (every_block * eye[None, :, :, None]).sum(1)  # [B, H, d]: block h of head h's mixture
    return own_block.flatten(1).unsqueeze(1), weights
