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


#: floats in a block of the additive attention's hidden tensor (2 MiB: inside a core's share of the cache)
CACHE_BLOCK_FLOATS = 1 << 19


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
        projected = self.query(query).unsqueeze(1)
        rows = max(1, CACHE_BLOCK_FLOATS // max(1, keys.shape[1] * keys.shape[2]))
        if keys.shape[0] > rows and not torch.is_grad_enabled() and not torch.jit.is_tracing():
            # inference over many rows (a batched decoding step): the [rows, N, attn_dim] sum is the largest
            # tensor of the step and, whole, far larger than the CPU cache, so it is made and reduced block by
            # block of rows that fit (about 1.8× faster at 256 rows on a 16×16 grid); not while tracing, where a
            # Python loop over rows would freeze the row count into the graph
            scores = torch.cat([self._scores(keys[i:i + rows], projected[i:i + rows])
                                for i in range(0, keys.shape[0], rows)])
        else:
            scores = self._scores(keys, projected)
        return self.normalise(scores, mask)

    def _scores(self, keys: Tensor, projected_query: Tensor) -> Tensor:
        # tanh in place on the sum's fresh buffer saves a second tensor of that size (autograd keeps tanh's
        # output, and the sum's backward needs no saved tensor, so this is safe in training too)
        hidden = keys + projected_query
        return self.score(hidden.tanh_()).squeeze(-1)


def sinusoid_positions(positions: Tensor, dim: int) -> Tensor:
    """Vaswani et al.'s sinusoidal encoding of caption positions (no length limit, nothing to learn)."""
    freqs = torch.exp(torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32) * (-math.log(1e4) / dim))
    angles = positions.to(torch.float32)[:, None] * freqs
    return torch.stack([angles.sin(), angles.cos()], -1).flatten(1)[:, :dim]


class FeedForward(nn.Sequential):
    """The position-wise feed-forward sublayer of Vaswani et al.: Linear → ReLU → dropout → Linear."""

    def __init__(self, d_model: int, ffn_dim: int, dropout: float):
        super().__init__(nn.Linear(d_model, ffn_dim), nn.ReLU(), nn.Dropout(dropout), nn.Linear(ffn_dim, d_model))
