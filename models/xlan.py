"""X-LAN (Pan et al., "X-Linear Attention Networks for Image Captioning", CVPR 2020, arXiv:2003.14080 — §3.3).

Encoder (§3.3.2).  Visual items ``r_i`` (bottom-up regions, or grid cells with an all-True mask) are embedded,
``v_i = Dropout(CELU(W_r r_i + b_r))`` (the authors' code), and refined by ``1 + M`` stacked X-Linear layers
(:class:`~captioner.models.attention.xlinear.XLinearLayer`, Eq. 7–8; paper: 4 "+ELU" layers) starting from the
masked mean ``v̂^(0) = v̄`` with ``K^(0) = V^(0) = V``.  Outputs: the attended image-level vectors
``v̂^(1) … v̂^(1+M)`` and the enhanced regions ``V^(1+M)``.

Decoder, per step ``t`` (input word ``w_t``, BOS first; ``c_{−1} = 0``, ``h_{−1} = m_{−1} = 0``:
docs/decisions.md#initial-decoder-states):

* ``ṽ = LN(W_G [v̂^(0); v̂^(1); …; v̂^(1+M)])``   global image feature, computed once     (Eq. 10; LN: authors' code)
* ``h_t, m_t = LSTM([E w_t; ṽ; c_{t−1}], (h_{t−1}, m_{t−1}))``  (§3.3.3; docs/decisions.md#x-lan-lstm-input)
* ``v̂_d = F_X-Linear(V^(1+M), V^(1+M), h_t)``                       one "+ELU" block      (Eq. 2–6)
* ``c_t = GLU(W_c [v̂_d; h_t] + b_c)``                                                       (§3.3.3)
* ``p(w_{t+1} | ·) = softmax(W_p c_t)``

``lstm_input="sum"`` feeds ``[E w_t; ṽ + c_{t−1}]`` as the authors' code does (needs ``dim == hidden_dim``).  The
code's extra ``LN(Linear[h_t; v̂_d])`` between the block and the GLU is not in the paper and is left out unless
``block_projection`` (docs/decisions.md#x-lan-and-x-transformer-reference-compatibility).  The word
embedding is ``Dropout(CELU(E w_t))`` as in the authors' code.

Attention export (docs/decisions.md#exported-attention-of-multi-head-models): ``primary`` is the decoder block's
spatial attention ``β^s`` at step ``t`` — the one that fed ``c_t`` and hence the word predicted from it — **averaged
over the heads**; padded items are exactly zero and every row sums to 1.  Extras: ``heads`` (the per-head
``β^s``, ``[B', H, N]``) and ``channel_attn`` (``β^c``, ``[B', D_B]``; channel attention, not drawable as a heatmap).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention.xlinear import XLinearAttention, XLinearLayer, embedding_activation
from .layers import masked_mean
from .protocol import AttnRecord, Captioner, DecState, EncState, VisualBatch
from .registry import register

LSTM_INPUTS = ("concat", "sum")


@register("xlan")
class XLAN(Captioner):
    """Defaults are the paper's sizes (X-LAN §4.1): ``D_v = D_B = 1024``, ``D_c = 512``, LSTM 1024, 4 encoder layers,
    8 heads (docs/decisions.md#x-lan-heads) and the authors' code's word embedding of 1024."""

    attention_kind = "xlinear_spatial_attention"

    def __init__(self, vocab_size: int, feat_dim: int, dim: int = 1024, hidden_dim: int = 1024,
                 embed_dim: int = 1024, channel_dim: int = 512, heads: int = 8, encoder_layers: int = 4,
                 activation: str = "celu", celu_alpha: float = 1.3, group_norm: bool = False,
                 shared_kv_update: bool = True, lstm_input: str = "concat", dropout: float = 0.5,
                 attention_dropout: float = 0.1, update_dropout: float = 0.3, block_projection: bool = False,
                 **ids: int):
        super().__init__(vocab_size, feat_dim, **ids)
        if lstm_input not in LSTM_INPUTS:
            raise ValueError(f"lstm_input must be one of {LSTM_INPUTS}, got {lstm_input!r}")
        if lstm_input == "sum" and dim != hidden_dim:
            raise ValueError(f"lstm_input='sum' adds c_{{t-1}} to ṽ: hidden_dim ({hidden_dim}) must equal dim ({dim})")
        self.hparams = dict(dim=dim, hidden_dim=hidden_dim, embed_dim=embed_dim, channel_dim=channel_dim,
                            heads=heads, encoder_layers=encoder_layers, activation=activation,
                            celu_alpha=celu_alpha, group_norm=group_norm, shared_kv_update=shared_kv_update,
                            lstm_input=lstm_input, dropout=dropout, attention_dropout=attention_dropout,
                            update_dropout=update_dropout)
        if block_projection:  # recorded only when set, so that earlier checkpoints' configs stay unchanged
            self.hparams["block_projection"] = True
        self.lstm_input = lstm_input
        xlinear = dict(activation=activation, celu_alpha=celu_alpha, group_norm=group_norm)
        # -- encoder (X-LAN §3.3.2) ----------------------------------------------------------------------------
        self.embed_items = nn.Sequential(nn.Linear(feat_dim, dim), embedding_activation(activation, celu_alpha),
                                         nn.Dropout(dropout))
        # K^(1+M) would feed nothing (the decoder attends over V^(1+M)), so the last layer has no key update W^k
        self.encoder = nn.ModuleList(
            XLinearLayer(dim, channel_dim, heads, shared_kv_update=shared_kv_update or i == encoder_layers - 1,
                         attention_dropout=attention_dropout, output_dropout=dropout, update_dropout=update_dropout,
                         **xlinear)
            for i in range(encoder_layers))
        self.global_embed = nn.Sequential(nn.Linear((encoder_layers + 1) * dim, dim), nn.LayerNorm(dim))  # W_G
        # -- decoder (X-LAN §3.3.3) ----------------------------------------------------------------------------
        self.embed_words = nn.Sequential(nn.Embedding(vocab_size, embed_dim, padding_idx=self.pad_id),
                                         embedding_activation(activation, celu_alpha), nn.Dropout(dropout))
        visual_input = dim + hidden_dim if lstm_input == "concat" else dim  # [ṽ; c_{t−1}] or ṽ + c_{t−1}
        self.lstm = nn.LSTMCell(embed_dim + visual_input, hidden_dim)
        self.attention = XLinearAttention(hidden_dim, dim, dim, bilinear_dim=dim, channel_dim=channel_dim,
                                          heads=heads, dropout=attention_dropout, **xlinear)  # queried by h_t
        # block_projection: the authors' code's v̂_d ← LN(W [h_t; v̂_d]) between the block and the GLU (not in the
        # paper; docs/decisions.md#x-lan-and-x-transformer-reference-compatibility)
        self.block_projection = (nn.Sequential(nn.Linear(hidden_dim + dim, dim), nn.LayerNorm(dim))
                                 if block_projection else None)
        self.context_gate = nn.Linear(dim + hidden_dim, 2 * hidden_dim)  # W_c, b_c; GLU halves it to c_t
        self.logit = nn.Linear(hidden_dim, vocab_size)  # W_p
        self.drop = nn.Dropout(dropout)  # c_{t−1} fed back, the block output v̂_d, c_t before W_p (authors' code)

    def config(self) -> dict[str, Any]:
        return dict(vocab_size=self.vocab_size, feat_dim=self.feat_dim, **self.hparams)

    # -- encoder ------------------------------------------------------------------------------------------------
    def encode(self, vis: VisualBatch) -> EncState:
        """X-LAN's encoder (§3.3.2): regions ``V`` embedded by ``Dropout(CELU(W_r r_i + b_r))`` (the authors' code),
        then ``1 + M`` X-Linear layers (paper: four) from ``v̂^(0) = v̄`` (a masked mean) and ``K^(0) = V^(0) = V``,
        each Eq. 7 then Eq. 8 (keys and values updated together by default:
        docs/decisions.md#x-lan-key-and-value-update), and ``ṽ = W_G[v̂^(0); …; v̂^(1+M)]`` (Eq. 10, with the
        authors' LN after ``W_G``).  The decoder block's ``ρ(W_k k_i)`` and ``ρ(W_v v_i)`` (Eq. 2, 6) over
        ``V^(1+M)`` are embedded here, once per image."""
        mask = vis.mask
        regions = self.embed_items(vis.feats.to(self.context_gate.weight.dtype))
        attended = masked_mean(regions, mask)  # v̂^(0) = v̄, the first query
        image_vectors, keys, values = [attended], regions, regions  # K^(0) = V^(0) = V
        for layer in self.encoder:
            attended, keys, values, _ = layer(attended, keys, values, mask)  # Eq. 7–8
            image_vectors.append(attended)
        # the decoder block's keys and values are the fixed V^(1+M): embed them once per image, not once per step
        key_embedding, value_embedding = self.attention.embed_memory(values, values)
        return {"mask": mask, "global": self.global_embed(torch.cat(image_vectors, -1)),  # ṽ (Eq. 10)
                "keys": key_embedding, "values": value_embedding}

    # -- decoder ------------------------------------------------------------------------------------------------
    def init_state(self, enc: EncState) -> DecState:
        zeros = enc["global"].new_zeros(enc["global"].shape[0], self.lstm.hidden_size)
        return {"h": zeros, "m": zeros, "context": zeros}

    def step(self, prev_tokens: Tensor, state: DecState, enc: EncState) -> tuple[Tensor, DecState, AttnRecord]:
        """One decoder step (X-LAN §3.3.3, whose only numbered equation is Eq. 10) for the input word ``w_t``: the
        LSTM on ``[E w_t; ṽ; c_{t−1}]`` with state ``(h_{t−1}, m_{t−1})`` (docs/decisions.md#x-lan-lstm-input), the
        block ``v̂_d = F_X-Linear(V^(1+M), V^(1+M), h_t)`` (Eq. 2–6), ``c_t = GLU(W_c[v̂_d; h_t] + b_c)`` ("an
        embedding layer and a Gated Linear Unit") and the log of ``softmax(W_p c_t)`` for ``w_{t+1}``.  Dropout on
        ``c_{t−1}``, ``v̂_d`` and ``c_t`` and the optional ``block_projection`` are the authors' code's, not the
        paper's (docs/decisions.md#x-lan--x-transformer).  Exports ``β^s`` averaged over the heads."""
        previous_context = self.drop(state["context"])
        visual = (torch.cat([enc["global"], previous_context], 1) if self.lstm_input == "concat"
                  else enc["global"] + previous_context)
        h, m = self.lstm(torch.cat([self.embed_words(prev_tokens), visual], 1), (state["h"], state["m"]))
        block = self.attention.attend(h, enc["keys"], enc["values"], enc["mask"])  # v̂_d, queried by h_t
        attended = self.drop(block.attended)
        if self.block_projection is not None:
            attended = self.block_projection(torch.cat([h, attended], 1))
        context = F.glu(self.context_gate(torch.cat([attended, h], 1)), dim=-1)  # c_t
        logprobs = F.log_softmax(self.logit(self.drop(context)), dim=-1)
        record = AttnRecord(block.spatial.mean(1), {"heads": block.spatial, "channel_attn": block.channel})
        return logprobs, {"h": h, "m": m, "context": context}, record
