"""X-Linear attention (X-LAN: Pan et al., "X-Linear Attention Networks for Image Captioning", CVPR 2020,
arXiv:2003.14080, §3.2): bilinear query×key and query×value pooling with spatial *and* channel attention, and the
stacked "higher-order" layer that refines its keys and values with each new attended vector.

Single-head block, X-LAN Eq. 2–6 with biases (the paper leaves them out), ``ρ`` the embedding activation:

* ``B^k_i  = ρ(W_k k_i) ⊙ ρ(W^k_q Q)``                                      query–key bilinear pooling  (Eq. 2)
* ``B'^k_i = ReLU(W^k_B B^k_i)``, ``b^s_i = W_b B'^k_i``, ``β^s = softmax(b^s)``  spatial attention     (Eq. 3)
* ``B̄ = (1/N) Σ_i B'^k_i``                                                  squeeze                     (Eq. 4)
* ``β^c = sigmoid(W_e B̄)``                                                  excitation: channel attn.   (Eq. 5)
* ``v̂ = β^c ⊙ Σ_i β^s_i B^v_i`` with ``B^v_i = ρ(W_v v_i) ⊙ ρ(W^v_q Q)``                               (Eq. 6)

``ρ``: the paper's final "+ELU" block (X-LAN §3.2 "infinity order", Fig. 2; Table 3) encodes query, keys and values
with an exponential unit instead of ReLU.  The paper says "ELU" but cites Barron's *continuously differentiable*
ELU, so ``ρ`` is CELU with α = 1.3 (docs/decisions.md#x-lan-activation); ``activation="relu"`` is the base
block.  The ReLU inside Eq. 3 is not an embedding of Q, K or V and stays a ReLU.

**Efficient batched form.**  ``ρ(W^v_q Q)`` does not depend on ``i``, so Eq. 6 is computed as
``v̂ = β^c ⊙ ρ(W^v_q Q) ⊙ Σ_i β^s_i ρ(W_v v_i)``: one weighted sum of value embeddings per query instead of ``N``
bilinear vectors.  The per-item embeddings ``ρ(W_k k_i)`` and ``ρ(W_v v_i)`` depend only on the image, so a
decoder computes them once (:meth:`XLinearAttention.embed_memory`) and reuses them at every step; all queries
(``[B, L, D_q]``, e.g. every caption position of a Transformer) and all heads run in one pass.  Outside an ONNX
trace, Eq. 2–4 run as matmuls over a few (row, head) pairs at a time without materialising ``B^k`` or ``B'^k``
(:class:`_SpatialSqueeze`): for X-Transformer's cross-attention those are the largest tensors of a training step.

**Multi-head form** (our choice: docs/decisions.md#x-lan-heads).  ``D_B`` is split into ``H`` heads of ``D_B/H``
channels and ``D_c`` into ``H`` slices of ``D_c/H``; every head runs Eq. 2–6 on its own channel slice and gets its
own ``β^s`` and ``β^c``.  As in the authors' code the per-head layers ``W^k_B`` (``D_B/H → D_c/H``), ``W_b`` and
``W_e`` are one set of weights applied to every head.  ``heads=1`` is exactly the paper's single-head block.  The
authors' code also GroupNorms the four embeddings (``group_norm=True``); the paper does not, so it is off.

**Masking.**  ``mask`` is True for real items, ``[B, N]`` (the same items for every query) or ``[B, L, N]`` (per
query, e.g. causal).  Masked items get exactly zero spatial weight and are left out of the squeeze mean (Eq. 4 is
a mean over the real items: docs/decisions.md#masked-items).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .softmax import masked_softmax

ACTIVATIONS = ("celu", "relu")


def embedding_activation(name: str, celu_alpha: float = 1.3) -> nn.Module:
    """``ρ``: CELU(α) for the "+ELU" block (docs/decisions.md#x-lan-activation) or ReLU for the base block
    (X-LAN Eq. 2)."""
    if name == "celu":
        return nn.CELU(celu_alpha)
    if name == "relu":
        return nn.ReLU()
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {name!r}")


class _ChannelGroupNorm(nn.GroupNorm):
    """GroupNorm over the last dimension of a tensor with any leading shape (``nn.GroupNorm`` wants channels on
    dim 1); with ``heads`` groups each head's channels are normalised together, as in the authors' code."""

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x.reshape(-1, x.shape[-1])).view(x.shape)


#: floats of ``B'^k`` that :class:`_SpatialSqueeze` makes at a time (2 MiB: it stays in a core's cache between the
#: several passes made over it)
SLAB_FLOATS = 1 << 19


def dropout_keep_mask(shape: tuple[int, ...], drop: float, device: torch.device | str | None = None) -> Tensor:
    """Dropout's Bernoulli(1 − ``drop``) keep mask, bool ``shape``: element ``i`` is kept when a uniform 32-bit
    integer falls below ``round((1 − drop) · 2^32)``, i.e. with probability ``1 − drop`` to within ``2^−32``.

    The integers come as halves of full-range 64-bit words: half the generator calls of ``bernoulli_`` and no
    float conversion, which on a CPU makes the mask of X-Transformer's ``B'^k`` (tens of millions of entries a
    layer) about 2.5× cheaper to draw."""
    numel = math.prod(shape)
    if drop <= 0.0:  # the threshold would be 2^31, past every signed 32-bit integer
        return torch.ones(shape, dtype=torch.bool, device=device)
    words = torch.empty((numel + 1) // 2, dtype=torch.int64, device=device).random_(-2 ** 63, None)
    threshold = round((1.0 - drop) * 2 ** 32) - 2 ** 31  # as a signed 32-bit integer
    # bool, not float: converting the whole mask costs more than converting each slab while it is in the cache
    return (words.view(torch.int32)[:numel] < threshold).view(shape)


class _SpatialSqueeze(torch.autograd.Function):
    """``b^s`` without ``W_b``'s bias ``[G, N, L]`` and ``B̄`` ``[G, L, c]`` (X-LAN Eq. 2–4) for ``G`` (row, head)
    pairs, a slab of pairs at a time, never holding ``B^k`` or ``B'^k`` whole.

    ``W^k_B (q_l ⊙ k_i) + b = (W^k_B diag(q_l)) k_i + b``, so the pre-activation of ``B'^k`` for every item and query
    of a pair is one matmul with the bias added: ``K`` (``[N, d]``) by a mixer ``[d, L·c]`` with ``M[j, (l, m)] =
    W^k_B[m, j] q_l[j]``, plus ``b`` for every query (``baddbmm``) — instead of the ``[L, N, d]`` product ``B^k`` and
    a linear layer over it.  ``b^s = B'^k W_b`` and ``B̄`` (each query's weighted sum over the items, ``item_weights
    [G, 1 or L, N]``) are matmuls too.  The backward pass makes ``B'^k`` again from ``K`` and the mixer instead of
    keeping it: with one slab (:data:`SLAB_FLOATS`) in the cache, the passes over it run far faster than over the
    whole tensor (hundreds of MB in a training step of X-Transformer's cross-attention).  ``keep`` is the dropout
    mask of ``B'^k`` (bool ``[G, N, L·c]`` or None) and ``scale`` its ``1/(1 − p)``, applied to the small
    ``W_b`` and item weights rather than to ``B'^k``.
    """

    @staticmethod
    def forward(ctx, keys: Tensor, queries: Tensor, weight: Tensor, bias: Tensor, score_weight: Tensor,
                item_weights: Tensor, keep: Tensor | None, scale: float) -> tuple[Tensor, Tensor]:
        """X-LAN Eq. 2–4 for a slab of (row, head) pairs at a time: ``B^k_i = keys_i ⊙ queries_l`` (Eq. 2, both
        already ``ρ``-embedded), ``B'^k = ReLU(W^k_B B^k + b)`` (Eq. 3, made by one baddbmm with the mixer, then the
        dropout ``keep``), and from it ``b^s = B'^k W_b`` without ``W_b``'s bias (Eq. 3; the caller adds it) and
        ``B̄ = Σ_i item_weights_{l,i} B'^k_i`` (Eq. 4 with ``item_weights`` the mean over the real items)."""
        # autocast would pick a dtype op by op; the arithmetic follows the keys instead
        with torch.autocast(keys.device.type, enabled=False):
            ctx.dtypes, dtype = (queries.dtype, weight.dtype, bias.dtype, score_weight.dtype), keys.dtype
            weight, bias, queries = weight.to(dtype), bias.to(dtype), queries.to(dtype)
            score_weight, item_weights = score_weight.to(dtype) * scale, item_weights.to(dtype) * scale
            pairs, items, length, channels = keys.shape[0], keys.shape[1], queries.shape[1], weight.shape[0]
            # the bias by the baddbmm, not as a column of ones beside the keys: that column made a copy of the keys
            # at every call, a tenth of an X-LAN decoding step (docs/decisions.md#x-linear-memory-by-head)
            mixer = (queries.unsqueeze(2) * weight).flatten(1, 2).transpose(1, 2)  # [G, d, L·c]
            biases = bias.repeat(length)  # b for every query [L·c]
            ctx.save_for_backward(keys, mixer, biases, queries, weight, score_weight, item_weights, keep)
            ctx.scale, ctx.step = scale, max(1, SLAB_FLOATS // (items * length * channels))
            scores = keys.new_empty(pairs, items, length)
            squeezed = keys.new_empty(pairs, length, channels)
            for start in range(0, pairs, ctx.step):
                part = slice(start, start + ctx.step)
                transformed = _transformed(keys[part], mixer[part], biases, keep, part)
                torch.matmul(transformed.view(-1, channels), score_weight, out=scores[part].view(-1))
                squeezed[part] = _weighted_items(transformed.view(-1, items, length, channels), item_weights[part])
            return scores, squeezed

    @staticmethod
    def backward(ctx, grad_scores: Tensor, grad_squeezed: Tensor):
        """The chain rule through Eq. 2–4 (no equation of the paper): ``B'^k`` is made again slab by slab as in
        :meth:`forward`, ``∂B'^k_{i,l} = w_{l,i} ∂B̄_l + ∂b^s_{i,l} W_b`` goes back through the dropout mask and
        Eq. 3's ReLU, and from there to the keys, the queries, ``W^k_B``, its bias and ``W_b``."""
        keys, mixer, biases, queries, weight, score_weight, item_weights, keep = ctx.saved_tensors
        with torch.autocast(keys.device.type, enabled=False):
            dtype = keys.dtype
            grad_scores, grad_squeezed = grad_scores.to(dtype).contiguous(), grad_squeezed.to(dtype).contiguous()
            pairs, length, channels = keys.shape[0], queries.shape[1], weight.shape[0]
            grad_keys, grad_mixer = torch.empty_like(keys), torch.empty_like(mixer)
            grad_score, grad_biases = torch.zeros_like(score_weight), torch.zeros_like(biases)
            # ∂(b^s, B̄)/∂B'^k at item i, query l, channel m is w_{l,i} ∂B̄_{l,m} + ∂b^s_{i,l} W_b[m] (both scaled):
            # one matmul of [w_{·,i}, ∂b^s_{i,·}] ([N, L_w + L]) by [∂B̄ rows; W_b on a block diagonal]
            eye = torch.eye(length, dtype=dtype, device=keys.device)
            score_rows = (eye.unsqueeze(-1) * score_weight).flatten(1)  # [L, L·c]
            if item_weights.shape[1] == 1:
                squeeze_rows = grad_squeezed.view(pairs, 1, -1)
            else:
                squeeze_rows = (eye.unsqueeze(-1) * grad_squeezed.unsqueeze(1)).flatten(2)  # [G, L, L·c]
            right = torch.cat([squeeze_rows, score_rows.expand(pairs, -1, -1)], 1)
            left = torch.cat([item_weights.transpose(1, 2), grad_scores], -1)
            for start in range(0, pairs, ctx.step):
                part = slice(start, start + ctx.step)
                transformed = _transformed(keys[part], mixer[part], biases, keep, part)
                grad_score += transformed.view(-1, channels).T @ grad_scores[part].view(-1)
                # through the dropout mask and the ReLU: zero wherever the kept output is zero (as relu's backward)
                grad_pre = torch.ops.aten.threshold_backward(torch.bmm(left[part], right[part]), transformed, 0)
                torch.bmm(grad_pre, mixer[part].transpose(1, 2), out=grad_keys[part])
                grad_biases += grad_pre.sum((0, 1))
                # ∂M = K^T ∂B'^k, written as (∂B'^k)^T K into ∂M's transpose: ∂M has the mixer's layout, a transposed
                # view, and a bmm whose out= is not contiguous runs one matmul per (row, head) pair (hundreds a call)
                torch.bmm(grad_pre.transpose(1, 2), keys[part], out=grad_mixer[part].transpose(1, 2))
        grad_bias = grad_biases.view(length, channels).sum(0)
        by_query = grad_mixer.unflatten(-1, (length, channels))  # ∂M [G, d, L, c]
        grad_queries = (by_query * weight.T.unsqueeze(1)).sum(-1).transpose(1, 2)
        # ∂W^k_B[m, j] = Σ_{g,l} ∂M[g, j, l, m] q_{g,l}[j], over ∂M in its memory order [G, L, c, d]: an einsum over
        # the [G, d, L, c] view ran a bmm batched over j whose items are neither contiguous nor transposed (one
        # matmul per j) and took 2–5 times longer
        grad_weight = (grad_mixer.transpose(1, 2).unflatten(1, (length, channels))
                       * queries.unsqueeze(2)).sum((0, 1))
        # b^s = B'^k (scale · W_b) with B'^k unscaled here, so ∂/∂W_b carries the scale once more
        grads = (grad_queries, grad_weight, grad_bias, grad_score * ctx.scale)
        return (grad_keys, *(grad.to(dtype) for grad, dtype in zip(grads, ctx.dtypes)), None, None, None)


def _transformed(keys: Tensor, mixer: Tensor, biases: Tensor, keep: Tensor | None, part: slice) -> Tensor:
    """``B'^k`` of a slab, ``[g, N, L·c]``, with the dropout mask applied (not yet rescaled)."""
    transformed = torch.baddbmm(biases, keys, mixer).relu_()  # (Eq. 2–3)
    return transformed if keep is None else transformed.mul_(keep[part])


def _weighted_items(transformed: Tensor, item_weights: Tensor) -> Tensor:
    """``Σ_i w_{l,i} B'^k_{i,l}``: ``transformed [g, N, L, c]``, ``item_weights [g, 1 or L, N]`` → ``[g, L, c]``."""
    if item_weights.shape[1] == 1:  # the same weights for every query: one matmul
        return (item_weights @ transformed.flatten(2)).view(transformed.shape[0], *transformed.shape[2:])
    return torch.einsum("gilm,gli->glm", transformed, item_weights)


class XLinearOutput(NamedTuple):
    """Result of :meth:`XLinearAttention.attend`; the ``L`` axis is absent when the query was ``[B, D_q]``."""

    attended: Tensor  # v̂    [B, (L,) D_B]
    spatial: Tensor  # β^s  [B, H, (L,) N] — rows sum to 1 over the real items
    channel: Tensor  # β^c  [B, (L,) D_B] — in (0, 1), head h owns channels h·D_B/H … (h+1)·D_B/H − 1


class XLinearAttention(nn.Module):
    """The X-Linear attention block ``F_X-Linear(K, V, Q)`` (X-LAN Eq. 2–6), multi-head, with masks.

    ``bilinear_dim`` is ``D_B`` (paper: 1024) and ``channel_dim`` the total ``D_c`` (paper: 512); both must be
    divisible by ``heads``.  ``dropout`` acts on ``B'^k`` (0.1 in the authors' code; the paper does not state it).
    """

    def __init__(self, query_dim: int, key_dim: int, value_dim: int, bilinear_dim: int = 1024,
                 channel_dim: int = 512, heads: int = 8, activation: str = "celu", celu_alpha: float = 1.3,
                 group_norm: bool = False, dropout: float = 0.1):
        super().__init__()
        if bilinear_dim % heads or channel_dim % heads:
            raise ValueError(f"D_B={bilinear_dim} and D_c={channel_dim} must both be divisible by heads={heads}")
        self.heads = heads

        def embedding(in_dim: int) -> nn.Sequential:  # ρ(W x + b), GroupNorm-ed per head if asked
            layers = [nn.Linear(in_dim, bilinear_dim), embedding_activation(activation, celu_alpha)]
            if group_norm:
                layers.append(_ChannelGroupNorm(heads, bilinear_dim))
            return nn.Sequential(*layers)

        self.key_embed = embedding(key_dim)  # ρ(W_k k_i)      (Eq. 2)
        self.query_key_embed = embedding(query_dim)  # ρ(W^k_q Q)      (Eq. 2)
        self.value_embed = embedding(value_dim)  # ρ(W_v v_i)      (Eq. 6)
        self.query_value_embed = embedding(query_dim)  # ρ(W^v_q Q)      (Eq. 6)
        head_bilinear, head_channel = bilinear_dim // heads, channel_dim // heads
        self.bilinear_embed = nn.Linear(head_bilinear, head_channel)  # W^k_B   (Eq. 3)
        self.spatial_score = nn.Linear(head_channel, 1)  # W_b     (Eq. 3)
        self.excitation = nn.Linear(head_channel, head_bilinear)  # W_e     (Eq. 5)
        self.dropout = nn.Dropout(dropout)

    def embed_memory(self, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """``ρ(W_k k_i)`` and ``ρ(W_v v_i)``, each ``[B, H, N, D_B/H]`` (head-major): they depend only on the items,
        so a decoder computes them once per image (or appends one position per step, along dim 2) and passes them
        to :meth:`attend`.  Laid out by head here, once, because every step's matmuls run per (row, head): in the
        ``[B, N, D_B]`` order each step of a decoder copied both into that layout again
        (docs/decisions.md#x-linear-memory-by-head)."""
        return self._by_head(self.key_embed(keys)), self._by_head(self.value_embed(values))

    def _by_head(self, embedded: Tensor) -> Tensor:  # [B, N, D_B] → [B, H, N, D_B/H]
        return embedded.unflatten(-1, (self.heads, -1)).transpose(1, 2).contiguous()

    def empty_memory(self, rows: int, like: Tensor) -> Tensor:
        """A memory of no items ``[rows, H, 0, D_B/H]`` (``like``'s dtype and device), for a decoder that appends
        one item per step (:meth:`embed_memory`)."""
        return like.new_zeros(rows, self.heads, 0, self.bilinear_embed.in_features)

    def forward(self, query: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None = None) -> XLinearOutput:
        """``v̂ = F_X-Linear(K, V, Q)`` (X-LAN Eq. 6) with the spatial attention ``β^s`` (Eq. 2–3) and the channel
        attention ``β^c`` (Eq. 4–5), per head (docs/decisions.md#x-lan-heads), for ``query [B, D_q]`` or
        ``[B, L, D_q]`` over ``keys [B, N, D_k]`` and ``values [B, N, D_v]``."""
        return self.attend(query, *self.embed_memory(keys, values), mask)

    def attend(self, query: Tensor, key_embedding: Tensor, value_embedding: Tensor,
               mask: Tensor | None = None) -> XLinearOutput:
        """The block from precomputed item embeddings ``[B, H, N, D_B/H]`` (see :meth:`embed_memory`)."""
        single_query = query.dim() == 2
        if single_query:
            query = query.unsqueeze(1)
        if mask is not None and mask.dim() == 2:
            mask = mask.unsqueeze(1)  # [B, 1, N]: every query sees the same items

        def split(x: Tensor) -> Tensor:  # [..., D_B] → [..., H, D_B/H]
            return x.unflatten(-1, (self.heads, -1))

        query_for_keys = split(self.query_key_embed(query))  # ρ(W^k_q Q)            [B, L, H, d]
        query_for_values = split(self.query_value_embed(query))  # ρ(W^v_q Q)            [B, L, H, d]
        # an exported graph keeps the broadcast form: a custom autograd function does not trace to ONNX
        pool = self._scores_and_squeeze if torch.jit.is_tracing() else self._scores_and_squeeze_in_slabs
        scores, squeezed = pool(query_for_keys, key_embedding, mask)  # b^s [B, H, L, N], B̄ [B, L, H, c]
        spatial = masked_softmax(scores, None if mask is None else mask.unsqueeze(1))  # β^s          (Eq. 3)
        channel = torch.sigmoid(self.excitation(squeezed))  # β^c  [B, L, H, d]  (Eq. 4–5)
        pooled_values = (spatial @ value_embedding).transpose(1, 2)  # Σ_i β^s_i ρ(W_v v_i)  [B, L, H, d]
        attended = (channel * query_for_values * pooled_values).flatten(-2)  # (Eq. 6), efficient form
        channel = channel.flatten(-2)
        if single_query:
            return XLinearOutput(attended.squeeze(1), spatial.squeeze(2), channel.squeeze(1))
        return XLinearOutput(attended, spatial, channel)

    def _scores_and_squeeze(self, query_for_keys: Tensor, key_embedding: Tensor,
                            mask: Tensor | None) -> tuple[Tensor, Tensor]:
        """``b^s [B, H, L, N]`` and ``B̄ [B, L, H, c]`` written as Eq. 2–4 read, materialising ``B^k`` and ``B'^k``
        (``[B, L, N, H, ·]``) from ``query_for_keys [B, L, H, d]`` and ``key_embedding [B, H, N, d]``."""
        bilinear = query_for_keys.unsqueeze(2) * key_embedding.transpose(1, 2).unsqueeze(1)  # B^k [B, L, N, H, d]
        transformed = self.dropout(F.relu(self.bilinear_embed(bilinear)))  # B'^k [B, L, N, H, c]  (Eq. 3)
        scores = self.spatial_score(transformed).squeeze(-1).permute(0, 3, 1, 2)  # b^s  [B, H, L, N]  (Eq. 3)
        return scores, self._squeeze(transformed, mask)  # B̄ (Eq. 4)

    def _scores_and_squeeze_in_slabs(self, query_for_keys: Tensor, key_embedding: Tensor,
                                     mask: Tensor | None) -> tuple[Tensor, Tensor]:
        """The same ``b^s`` and ``B̄`` as :meth:`_scores_and_squeeze` from :class:`_SpatialSqueeze`, which never
        holds ``B^k`` or ``B'^k`` whole (see there)."""
        batch, queries, heads, _ = query_for_keys.shape
        items = key_embedding.shape[2]
        # Eq. 4's mean over each query's real items, as weights [B, 1 or L, N] shared by the heads
        if mask is None:
            weights = key_embedding.new_full((batch, 1, items), 1.0 / items)
        else:
            real = mask.expand(batch, -1, -1).to(key_embedding.dtype)
            weights = real / real.sum(-1, keepdim=True).clamp_min(1.0)
        drop = self.dropout.p if self.training else 0.0
        channels = self.bilinear_embed.out_features
        keep = None if drop == 0.0 else dropout_keep_mask((batch * heads, items, queries * channels), drop,
                                                          key_embedding.device)
        scores, squeezed = _SpatialSqueeze.apply(
            key_embedding.flatten(0, 1), query_for_keys.transpose(1, 2).flatten(0, 1),
            self.bilinear_embed.weight, self.bilinear_embed.bias, self.spatial_score.weight[0],
            weights.unsqueeze(1).expand(-1, heads, -1, -1).flatten(0, 1), keep,
            0.0 if drop >= 1.0 else 1.0 / (1.0 - drop))
        scores = scores.unflatten(0, (batch, heads)).transpose(-1, -2) + self.spatial_score.bias
        return scores, squeezed.unflatten(0, (batch, heads)).transpose(1, 2)

    @staticmethod
    def _squeeze(transformed: Tensor, mask: Tensor | None) -> Tensor:
        """``B̄`` (Eq. 4): the mean of ``B'^k [B, L, N, H, c]`` over each query's real items → ``[B, L, H, c]``.

        :func:`~captioner.models.layers.masked_mean` for a per-query mask, written with broadcasting only (no sizes
        taken from the input), so that a traced graph works for any number of rows, queries and items."""
        if mask is None:
            return transformed.mean(2)
        weights = mask[..., None, None].to(transformed.dtype)  # [B, L or 1, N, 1, 1]
        return (transformed * weights).sum(2) / weights.sum(2).clamp_min(1.0)


class ItemUpdate(nn.Module):
    """Refine every item with an attended vector (X-LAN Eq. 8): ``x_i ← LN(ReLU(W [v̂; x_i] + b) + x_i)``.

    ``attended`` is ``[B, D]`` (one vector for all items, Eq. 8) or ``[B, L, D]`` (one per item, as X-Transformer's
    decoder updates each caption position with its own state).  ``dropout`` follows the ReLU (0.3 in the authors'
    code; the paper does not state it).
    """

    def __init__(self, dim: int, dropout: float = 0.0):
        super().__init__()
        self.embed = nn.Linear(2 * dim, dim)  # W^k_m or W^v_m of Eq. 8
        self.dropout = nn.Dropout(dropout)
        self.norm = nn.LayerNorm(dim)

    def forward(self, attended: Tensor, items: Tensor) -> Tensor:
        if attended.dim() < items.dim():
            attended = attended.unsqueeze(-2).expand_as(items)
        return self.norm(self.dropout(F.relu(self.embed(torch.cat([attended, items], -1)))) + items)


class XLinearLayer(nn.Module):
    """One layer of the higher-order stack (X-LAN Eq. 7–8): attend with the previous attended vector as
    query, then update the keys and values with the new one,

    ``v̂^(m) = F_X-Linear(K^(m−1), V^(m−1), v̂^(m−1))``                                   (Eq. 7)
    ``k_i^(m) = LN(ReLU(W^k_m [v̂^(m); k_i^(m−1)]) + k_i^(m−1))``, ``v_i^(m)`` likewise with ``W^v_m``   (Eq. 8)

    so ``M`` stacked layers model ``2M``-th order interactions.  The residual needs ``D_B = D_k = D_v = dim``.
    ``shared_kv_update`` (the authors' code; docs/decisions.md#x-lan-key-and-value-update): keys and values stay
    one tensor, updated by a single ``W_m`` — with ``K^(0) = V^(0)`` (X-LAN's encoder) the paper's separate
    ``W^k_m``/``W^v_m`` would make them diverge.  ``output_dropout`` acts on ``v̂^(m)`` (0.5 in the authors' code).
    """

    def __init__(self, dim: int, channel_dim: int, heads: int, *, shared_kv_update: bool = True,
                 activation: str = "celu", celu_alpha: float = 1.3, group_norm: bool = False,
                 attention_dropout: float = 0.1, output_dropout: float = 0.0, update_dropout: float = 0.0):
        super().__init__()
        self.attention = XLinearAttention(dim, dim, dim, bilinear_dim=dim, channel_dim=channel_dim, heads=heads,
                                          activation=activation, celu_alpha=celu_alpha, group_norm=group_norm,
                                          dropout=attention_dropout)
        self.output_dropout = nn.Dropout(output_dropout)
        self.value_update = ItemUpdate(dim, update_dropout)  # W^v_m (the shared W_m when shared_kv_update)
        self.key_update = None if shared_kv_update else ItemUpdate(dim, update_dropout)  # W^k_m

    def forward(self, query: Tensor, keys: Tensor, values: Tensor,
                mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, XLinearOutput]:
        """``query [B, D]`` = ``v̂^(m−1)``, ``keys``/``values [B, N, D]`` → ``v̂^(m)``, ``K^(m)``, ``V^(m)`` and
        the block's output (for its attention maps)."""
        block = self.attention(query, keys, values, mask)
        attended = self.output_dropout(block.attended)
        new_values = self.value_update(attended, values)
        new_keys = new_values if self.key_update is None else self.key_update(attended, keys)
        return attended, new_keys, new_values, block
