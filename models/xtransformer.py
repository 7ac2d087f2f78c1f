"""X-Transformer (X-LAN paper: Pan et al., CVPR 2020, arXiv:2003.14080 — §4.2, "plugging X-Linear attention
blocks into Transformer").

The paper gives no architecture for X-Transformer, so this follows the authors' code
(docs/decisions.md#x-transformer-architecture), with every attention an X-Linear block
(:class:`~captioner.models.attention.xlinear.XLinearAttention`, X-LAN Eq. 2–6, CELU "+ELU" embeddings:
docs/decisions.md#x-lan-activation).  Defaults are the sizes of the authors' code: width 768, 8 heads,
``D_c = 384`` (48 per head), 6 + 6 layers, FFN 4 × 768.

Encoder.  ``x_i = Dropout(LN(CELU(W_r r_i + b_r)))``; ``g^(0)`` = masked mean of ``x``; layer ``l`` is X-LAN's encoder
layer (X-LAN Eq. 7–8, keys = values: docs/decisions.md#x-lan-key-and-value-update) followed by a position-wise FFN on
the regions: ``g^(l) = F_X-Linear(X, X, g^(l−1))``, ``x_i ← LN(ReLU(W [g^(l); x_i]) + x_i)``, ``x_i ← FFN(x_i)``.  The
image vector is ``g = LN(W_G [g^(0); …; g^(L)])``.

Decoder, for caption position ``t`` (input word ``w_t``, BOS first):

* word states ``x_t = Dropout(LN(√d E w_t + PE(t)))``;
* first query ``q^(0)_t = Dropout(LN(CELU(W_1 g)) ⊙ LN(CELU(W_2 x̄_t)))`` with ``x̄_t = mean_{j≤t} x_j`` — a
  bilinear mix of the image and the words so far;
* layer ``l``: masked word attention ``x'_t = x_t + F_X-Linear(X_{≤t}, X_{≤t}, q^(l−1)_t)``; cross attention
  ``q^(l)_t = LN(x'_t + F_X-Linear(R, R, LN(x'_t)))`` over the encoded regions ``R``; then (except in the last
  layer) the next word states ``x_t ← FFN(LN(ReLU(W [q^(l)_t; x_t]) + x_t))``;
* ``p(w_{t+1}) = softmax(W_p Dropout(LN(GLU(W_o [q^(0)_t; …; q^(L)_t]))))``.

Every quantity at position ``t`` depends only on positions ``≤ t``, so :meth:`XTransformer.forward_xe` is one
causally masked parallel pass and :meth:`XTransformer.step` is the same computation one position at a time: the
state holds, per decoder layer, the X-Linear key/value embeddings of the word states so far (``word_keys{i}``,
``word_values{i}`` ``[B', H, t, D/H]``, growing on dim 2) and the running sum of ``x_j`` (``word_sum``), so beam
reordering is the generic row selection of the protocol.

Attention export (docs/decisions.md#exported-attention-of-multi-head-models): ``primary`` is the **last** decoder
layer's cross-attention ``β^s`` over the visual items at step ``t``, **averaged over the heads**; padded items are
exactly zero and every row sums to 1.  Extras: ``heads`` (that layer's per-head ``β^s``, ``[B', H, N]``), ``layer{i}``
(layer ``i``'s head-averaged cross-attention, ``i = 1..L``) and ``channel_attn`` (the last layer's ``β^c``,
``[B', D]``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention.xlinear import ItemUpdate, XLinearAttention, XLinearLayer, XLinearOutput, embedding_activation
from .layers import FeedForward, masked_mean, sinusoid_positions
from .protocol import AttnRecord, Captioner, DecState, EncState, VisualBatch
from .registry import register


class FeedForwardBlock(nn.Module):
    """Position-wise FFN sub-layer with its residual, post-norm: ``x ← LN(x + Dropout(W_2 Dropout(ReLU(W_1 x))))``
    (the authors' ``FeedForwardBlock``; the inner FFN is AreaTransformer's)."""

    def __init__(self, dim: int, ffn_dim: int, dropout: float):
        super().__init__()
        self.ffn = FeedForward(dim, ffn_dim, dropout)
        self.drop = nn.Dropout(dropout)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(x + self.drop(self.ffn(x)))


class XTransformerDecoderLayer(nn.Module):
    """Masked word X-Linear attention, cross X-Linear attention over the regions and, unless ``last``, the update
    of the word states for the next layer (the authors' code).  The last layer's word states would feed nothing, so
    it has no update or FFN."""

    def __init__(self, dim: int, channel_dim: int, heads: int, ffn_dim: int, last: bool, *, dropout: float,
                 attention_dropout: float, update_dropout: float, **xlinear: Any):
        super().__init__()
        block = dict(bilinear_dim=dim, channel_dim=channel_dim, heads=heads, dropout=attention_dropout, **xlinear)
        self.word_attention = XLinearAttention(dim, dim, dim, **block)
        self.cross_attention = XLinearAttention(dim, dim, dim, **block)
        self.cross_query_norm = nn.LayerNorm(dim)
        self.output_norm = nn.LayerNorm(dim)
        self.drop = nn.Dropout(dropout)
        self.word_update = None if last else ItemUpdate(dim, update_dropout)
        self.feed_forward = None if last else FeedForwardBlock(dim, ffn_dim, dropout)

    def forward(self, query: Tensor, words: Tensor, word_memory: tuple[Tensor, Tensor], word_mask: Tensor | None,
                cross_memory: tuple[Tensor, Tensor], cross_mask: Tensor) -> tuple[Tensor, Tensor | None, XLinearOutput]:
        """``query``/``words [B, L, D]`` at the ``L`` positions being computed; ``word_memory`` the word
        attention's key/value embeddings of every word state they may see (``word_mask``: None or causal
        ``[1, L, T]``); ``cross_memory`` the cross attention's embeddings of the regions.  Returns ``q^(l)``, the
        next layer's word states and the cross attention."""
        words_seen = self.word_attention.attend(query, *word_memory, word_mask).attended
        mixed = words + self.drop(words_seen)
        cross = self.cross_attention.attend(self.cross_query_norm(mixed), *cross_memory, cross_mask)
        query = self.output_norm(mixed + self.drop(cross.attended))
        if self.word_update is None:
            return query, None, cross
        return query, self.feed_forward(self.word_update(query, words)), cross


@register("xtransformer")
class XTransformer(Captioner):
    """Defaults are the sizes of the authors' code: width 768, 8 heads, ``D_c = 384``, 6 + 6 layers,
    FFN 3072, dropout 0.5 (0.1 on the word embedding and inside the blocks, 0.3 in the item updates)."""

    attention_kind = "xlinear_spatial_attention"

    def __init__(self, vocab_size: int, feat_dim: int, dim: int = 768, channel_dim: int = 384, heads: int = 8,
                 encoder_layers: int = 6, decoder_layers: int = 6, ffn_dim: int = 3072, activation: str = "celu",
                 celu_alpha: float = 1.3, group_norm: bool = False, dropout: float = 0.5, word_dropout: float = 0.1,
                 attention_dropout: float = 0.1, update_dropout: float = 0.3, **ids: int):
        super().__init__(vocab_size, feat_dim, **ids)
        self.hparams = dict(dim=dim, channel_dim=channel_dim, heads=heads, encoder_layers=encoder_layers,
                            decoder_layers=decoder_layers, ffn_dim=ffn_dim, activation=activation,
                            celu_alpha=celu_alpha, group_norm=group_norm, dropout=dropout, word_dropout=word_dropout,
                            attention_dropout=attention_dropout, update_dropout=update_dropout)
        self.dim = dim
        xlinear = dict(activation=activation, celu_alpha=celu_alpha, group_norm=group_norm)
        # -- encoder --------------------------------------------------------------------------------------------
        self.embed_items = nn.Sequential(nn.Linear(feat_dim, dim), embedding_activation(activation, celu_alpha),
                                         nn.LayerNorm(dim), nn.Dropout(dropout))
        self.encoder = nn.ModuleList(
            XLinearLayer(dim, channel_dim, heads, shared_kv_update=True, attention_dropout=attention_dropout,
                         output_dropout=dropout, update_dropout=update_dropout, **xlinear)
            for _ in range(encoder_layers))
        self.encoder_ffn = nn.ModuleList(FeedForwardBlock(dim, ffn_dim, dropout) for _ in range(encoder_layers))
        self.global_embed = nn.Sequential(nn.Linear((encoder_layers + 1) * dim, dim), nn.LayerNorm(dim))  # W_G
        # -- decoder --------------------------------------------------------------------------------------------
        self.embed_words = nn.Embedding(vocab_size, dim, padding_idx=self.pad_id)
        self.word_norm = nn.LayerNorm(dim)
        self.word_drop = nn.Dropout(word_dropout)
        self.query_image = nn.Sequential(nn.Linear(dim, dim), embedding_activation(activation, celu_alpha),
                                         nn.LayerNorm(dim))  # W_1
        self.query_words = nn.Sequential(nn.Linear(dim, dim), embedding_activation(activation, celu_alpha),
                                         nn.LayerNorm(dim))  # W_2
        self.decoder = nn.ModuleList(
            XTransformerDecoderLayer(dim, channel_dim, heads, ffn_dim, last=i == decoder_layers - 1, dropout=dropout,
                                     attention_dropout=attention_dropout, update_dropout=update_dropout, **xlinear)
            for i in range(decoder_layers))
        self.output_embed = nn.Linear((decoder_layers + 1) * dim, 2 * dim)  # W_o, halved by the GLU
        self.output_norm = nn.LayerNorm(dim)
        self.logit = nn.Linear(dim, vocab_size)  # W_p
        self.drop = nn.Dropout(dropout)

    def config(self) -> dict[str, Any]:
        return dict(vocab_size=self.vocab_size, feat_dim=self.feat_dim, **self.hparams)

    # -- encoder ------------------------------------------------------------------------------------------------
    def encode(self, vis: VisualBatch) -> EncState:
        """The encoder (layout from the authors' code: docs/decisions.md#x-transformer-architecture) with X-LAN's
        equations (Pan et al., arXiv:2003.14080): from the masked mean ``g^(0)``, each layer is Eq. 7
        (``g^(l) = F_X-Linear(X, X, g^(l−1))``) and Eq. 8 with keys = values
        (docs/decisions.md#x-lan-key-and-value-update), then a post-norm FFN on the regions;
        ``g = LN(W_G[g^(0); …; g^(L)])`` as Eq. 10.  Each decoder layer's cross-attention embeds the final regions
        (``ρ(W_k k_i)``, ``ρ(W_v v_i)`` of Eq. 2, 6) here, once per image."""
        mask = vis.mask
        items = self.embed_items(vis.feats.to(self.logit.weight.dtype))
        image_vector = masked_mean(items, mask)  # g^(0)
        image_vectors = [image_vector]
        for layer, feed_forward in zip(self.encoder, self.encoder_ffn):
            image_vector, _, items, _ = layer(image_vector, items, items, mask)  # keys = values = X
            items = feed_forward(items)
            image_vectors.append(image_vector)
        enc = {"mask": mask, "global": self.global_embed(torch.cat(image_vectors, -1))}
        # the regions are fixed while decoding: each cross attention embeds them once per image
        for i, layer in enumerate(self.decoder):
            enc[f"cross_keys{i}"], enc[f"cross_values{i}"] = layer.cross_attention.embed_memory(items, items)
        return enc

    # -- decoder ------------------------------------------------------------------------------------------------
    def _embed_words(self, tokens: Tensor, start: int) -> Tensor:
        positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)
        return self.word_drop(self.word_norm(self.embed_words(tokens) * math.sqrt(self.dim)
                                             + sinusoid_positions(positions, self.dim)))

    def _first_query(self, image: Tensor, word_mean: Tensor) -> Tensor:
        """``q^(0) = Dropout(LN(CELU(W_1 g)) ⊙ LN(CELU(W_2 x̄)))`` for ``image [B, D]``, ``word_mean [B, L, D]``."""
        return self.drop(self.query_image(image).unsqueeze(1) * self.query_words(word_mean))

    def _logprobs(self, queries: list[Tensor]) -> Tensor:
        hidden = self.output_norm(F.glu(self.output_embed(torch.cat(queries, -1)), dim=-1))
        return F.log_softmax(self.logit(self.drop(hidden)), dim=-1)

    def _cross(self, enc: EncState, i: int) -> tuple[Tensor, Tensor]:
        return enc[f"cross_keys{i}"], enc[f"cross_values{i}"]

    def init_state(self, enc: EncState) -> DecState:
        rows = enc["global"].shape[0]
        state = {f"word_{kind}{i}": layer.word_attention.empty_memory(rows, enc["global"])
                 for i, layer in enumerate(self.decoder) for kind in ("keys", "values")}
        return {**state, "word_sum": enc["global"].new_zeros(rows, self.dim)}

    def step(self, prev_tokens: Tensor, state: DecState, enc: EncState) -> tuple[Tensor, DecState, AttnRecord]:
        """Caption position ``t`` alone, equal to position ``t`` of :meth:`forward_xe`'s causal pass: the word state
        ``x_t = Dropout(LN(√d E w_t + PE(t)))`` (the sinusoidal ``PE`` of Vaswani et al., arXiv:1706.03762, §3.5),
        the first query ``q^(0)_t`` from ``g`` and the running mean of ``x_{≤t}``, per layer the masked word
        attention over the cached ``x_{≤t}`` and the cross attention over the regions (each an X-Linear block, X-LAN
        Eq. 2–6), and ``softmax(W_p Dropout(LN(GLU(W_o[q^(0)_t; …; q^(L)_t]))))``.  Only the blocks are the paper's
        equations; the layout is the authors' code (docs/decisions.md#x-transformer-architecture).  Exports the last
        layer's cross ``β^s`` averaged over the heads."""
        position = state["word_keys0"].shape[2]
        words = self._embed_words(prev_tokens[:, None], position)  # x_t  [B', 1, D]
        word_sum = state["word_sum"] + words[:, 0]
        query = self._first_query(enc["global"], (word_sum / (position + 1)).unsqueeze(1))
        queries, crosses, new_state = [query], [], {"word_sum": word_sum}
        for i, layer in enumerate(self.decoder):
            # append this position's embeddings to the cache: every cached position is in the past, so no mask
            new_keys, new_values = layer.word_attention.embed_memory(words, words)
            keys = torch.cat([state[f"word_keys{i}"], new_keys], 2)  # [B', H, t + 1, d]: positions are dim 2
            values = torch.cat([state[f"word_values{i}"], new_values], 2)
            new_state[f"word_keys{i}"], new_state[f"word_values{i}"] = keys, values
            query, words, cross = layer(query, words, (keys, values), None, self._cross(enc, i), enc["mask"])
            queries.append(query)
            crosses.append(cross)
        return self._logprobs(queries)[:, 0], new_state, self._record(crosses)

    def forward_xe(self, vis: VisualBatch, captions: Tensor, ss_prob: float = 0.0,
                   rows: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        """One causally masked parallel pass (teacher forcing).  Scheduled sampling needs sequential decoding, so
        a Transformer does not support it."""
        if ss_prob > 0.0:
            raise ValueError("XTransformer trains with full teacher forcing; scheduled sampling is not supported")
        enc = self.encode_rows(vis, rows)
        steps = captions.shape[1]
        words = self._embed_words(torch.cat([torch.full_like(captions[:, :1], self.bos_id), captions[:, :-1]], 1), 0)
        counts = torch.arange(1, steps + 1, device=captions.device, dtype=words.dtype)
        query = self._first_query(enc["global"], words.cumsum(1) / counts[:, None])  # x̄_t = mean_{j≤t} x_j
        causal = torch.ones(steps, steps, dtype=torch.bool, device=captions.device).tril().unsqueeze(0)
        queries = [query]
        for i, layer in enumerate(self.decoder):
            word_memory = layer.word_attention.embed_memory(words, words)
            query, words, _ = layer(query, words, word_memory, causal, self._cross(enc, i), enc["mask"])
            queries.append(query)
        return self._logprobs(queries), {}

    # -- attention export ---------------------------------------------------------------------------------------
    @staticmethod
    def _record(crosses: list[XLinearOutput]) -> AttnRecord:
        per_head = [cross.spatial[:, :, 0] for cross in crosses]  # [B', H, N] for the single position
        extras = {f"layer{i + 1}": heads.mean(1) for i, heads in enumerate(per_head)}
        extras.update(heads=per_head[-1], channel_attn=crosses[-1].channel[:, 0])
        return AttnRecord(per_head[-1].mean(1), extras)
