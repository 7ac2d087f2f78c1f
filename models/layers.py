"""Small building blocks shared by several models."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn import functional as F

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

    It is computed as ``e_i = 2 w^T σ(2 U_a a_i + 2 (U_h h + b)) − Σ_j w_j``, the same function (``tanh x =
    2σ(2x) − 1``), because ATen's CPU tanh costs about six times its sigmoid per element and this elementwise map
    over rows × items × ``attn_dim`` is the largest operation of a SAT or SparseCap decoding step
    (docs/decisions.md#serving-performance-issue-15). ``project_keys`` is computed once per image and cached in the
    encoder state; it returns the doubled keys ``2 U_a a_i``, so the factor costs nothing per step.

    ``activation="relu"`` scores ``e_i = w^T relu(U_a a_i + U_h h + b)`` instead: the form of sgrvinod's
    "a-PyTorch-Tutorial-to-Image-Captioning" (``Attention.full_att(relu(encoder_att(a) + decoder_att(h)))``), which
    ``captioner import sgrvinod`` converts (docs/decisions.md#sgrvinod-tutorial-checkpoints).
    """

    def __init__(self, feat_dim: int, query_dim: int, attn_dim: int, normalise: Normaliser,
                 activation: str = "tanh"):
        super().__init__()
        if activation not in ("tanh", "relu"):
            raise ValueError(f"activation must be 'tanh' or 'relu', got {activation!r}")
        self.key = nn.Linear(feat_dim, attn_dim, bias=False)
        self.query = nn.Linear(query_dim, attn_dim)
        self.score = nn.Linear(attn_dim, 1)
        self.normalise = normalise
        self.activation = activation

    def project_keys(self, feats: Tensor) -> Tensor:
        """``2 U_a a_i`` for every item ``[B, N, attn_dim]``: the keys in the scale the sigmoid form reads
        (``U_a a_i`` with ``activation="relu"``)."""
        keys = self.key(feats)
        return 2.0 * keys if self.activation == "tanh" else keys

    def forward(self, keys: Tensor, query: Tensor, mask: Tensor) -> Tensor:
        if self.activation == "relu":
            hidden = F.relu(keys + self.query(query).unsqueeze(1))
            return self.normalise(self.score(hidden).squeeze(-1), mask)
        projected = 2.0 * self.query(query).unsqueeze(1)
        # w^T tanh(x) + b = (2w)^T σ(2x) + (b − Σw): the score layer's weights in the sigmoid form
        weight, bias = 2.0 * self.score.weight, self.score.bias - self.score.weight.sum()
        # tracing first: the row count read off a traced shape would be reported as a value the graph froze
        rows = 0 if torch.jit.is_tracing() else max(1, CACHE_BLOCK_FLOATS // max(1, keys.shape[1] * keys.shape[2]))
        if rows and keys.shape[0] > rows and not torch.is_grad_enabled():
            # inference over many rows (a batched decoding step): the [rows, N, attn_dim] sum is the largest
            # tensor of the step and, whole, far larger than the CPU cache, so it is made and reduced block by
            # block of rows that fit (about 1.8× faster at 256 rows on a 16×16 grid); not while tracing, where a
            # Python loop over rows would freeze the row count into the graph
            scores = torch.cat([_additive_scores(keys[i:i + rows], projected[i:i + rows], weight, bias)
                                for i in range(0, keys.shape[0], rows)])
        else:
            scores = _additive_scores(keys, projected, weight, bias)
        return self.normalise(scores, mask)


def _additive_scores(doubled_keys: Tensor, doubled_query: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    # sigmoid in place on the sum's fresh buffer saves a second tensor of that size (autograd keeps sigmoid's
    # output, and the sum's backward needs no saved tensor, so this is safe in training too)
    return F.linear((doubled_keys + doubled_query).sigmoid_(), weight, bias).squeeze(-1)


def sinusoid_positions(positions: Tensor, dim: int) -> Tensor:
    """Vaswani et al.'s sinusoidal encoding of caption positions (no length limit, nothing to learn)."""
    freqs = torch.exp(torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32) * (-math.log(1e4) / dim))
    angles = positions.to(torch.float32)[:, None] * freqs
    return torch.stack([angles.sin(), angles.cos()], -1).flatten(1)[:, :dim]


class FeedForward(nn.Sequential):
    """The position-wise feed-forward sublayer of Vaswani et al.: Linear → ReLU → dropout → Linear."""

    def __init__(self, d_model: int, ffn_dim: int, dropout: float):
        super().__init__(nn.Linear(d_model, ffn_dim), nn.ReLU(), nn.Dropout(dropout), nn.Linear(ffn_dim, d_model))
