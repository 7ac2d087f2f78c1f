"""Small building blocks shared by several models."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .attention import Normaliser


def masked_mean(feats: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``feats [B, N, D]`` over the real items of ``mask [B, N]`` (docs/decisions.md#masked-items)."""
    weights = mask.to(feats.dtype).unsqueeze(-1)
    return (feats * weights).sum(1) / weights.sum(1).clamp_min(1.0)


class AdditiveAttention(nn.Module):
    """Bahdanau attention ``e_i = w^T tanh(U_a a_i + U_h h + b)`` (SAT Eq. 4 in our additive form,
    docs/decisions.md#sat-attention-score-and-initial-state; SparseCap's input/output attention has the same form).

    ``project_keys`` is computed once per image (``U_a a_i``) and cached in the encoder state.
    """

    def __init__(self, feat_dim: int, query_dim: int, attn_dim: int, normalise: Normaliser):
        super().__init__()
        self.key = nn.Linear(feat_dim, attn_dim, bias=False)
        self.query = nn.Linear(query_dim, attn_dim)
        self.score = nn.Linear(attn_dim, 1)
        self.normalise = normalise

    def project_keys(self, feats: Tensor) -> Tensor:
        return self.key(feats)

    def forward(self, keys: Tensor, query: Tensor, mask: Tensor) -> Tensor:
        scores = self.score(torch.tanh(keys + self.query(query).unsqueeze(1))).squeeze(-1)
        return self.normalise(scores, mask)


def sinusoid_positions(positions: Tensor, dim: int) -> Tensor:
    """Vaswani et al.'s sinusoidal encoding of caption positions (no length limit, nothing to learn)."""
    freqs = torch.exp(torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32) * (-math.log(1e4) / dim))
    angles = positions.to(torch.float32)[:, None] * freqs
    return torch.stack([angles.sin(), angles.cos()], -1).flatten(1)[:, :dim]


class FeedForward(nn.Sequential):
    """The position-wise feed-forward sublayer of Vaswani et al.: Linear → ReLU → dropout → Linear."""

    def __init__(self, d_model: int, ffn_dim: int, dropout: float):
        super().__init__(nn.Linear(d_model, ffn_dim), nn.ReLU(), nn.Dropout(dropout), nn.Linear(ffn_dim, d_model))
