"""AoANet (Huang et al., "Attention on Attention for Image Captioning", ICCV 2019 — P2 §3.2; SPEC §3).

Encoder.  Visual items ``r_i`` (bottom-up regions or grid cells; a mask marks padding) are embedded,
``a_i = ReLU(W_r r_i + b_r)`` (SPEC §3.3), then refined by ``refine_layers`` layers of P2 Eq. 7:
``A' = LN(A + AoA^E(f_mh-att, W^{Q_e}A, W^{K_e}A, W^{V_e}A))`` — multi-head self-attention (Eq. 8–10) with AoA
in place of the output projection and no feed-forward sub-layer.  ``pre_norm=True`` gives the authors' code's
``A + AoA(LN(A))`` with a final LN (decision #16).

Decoder, per step ``t`` (input word ``w_t``, BOS first; ``c_{-1} = 0``):

* ``x_t = [W_e Π_t ; ā + c_{t−1}]`` with ``ā`` the masked mean of the refined items   (Eq. 12)
* ``h_t, m_t = LSTM(x_t, (h_{t−1}, m_{t−1}))``                                        (Eq. 13)
* ``c_t = AoA^D(f_mh-att, W^{Q_d} h_t, W^{K_d} A, W^{V_d} A)``                          (Eq. 14)
* ``p(y_{t+1} | y_{≤t}, I) = softmax(W_p c_t)``                                        (Eq. 11)

Projections that the paper writes as bare matrices (``W^{Q,K,V}`` of Eq. 7/14, ``W_p`` of Eq. 11) have no bias;
the AoA linear has the biases of Eq. 3–4.  The paper's decoder has no residual around AoA^D, so neither do we.

Ablations of P2 Table 4 (SPEC §3.6) are config flags: ``refiner`` = ``aoa`` (Eq. 7) | ``transformer`` (standard
encoder layer with output projection and FFN, Fig. 6a) | ``none``; ``decoder_attention`` = ``multihead`` (Eq.
8–10 queried by ``W^{Q_d} h_t``) | ``additive`` (single-head ``wᵀ tanh(U a_i + W h_t)``, [REC] for the ablations'
single attention); ``context`` = ``aoa`` (Fig. 7c) | ``lstm`` (second LSTM on ``[â_t; h_t]``, Fig. 7b) |
``linear`` (``W [â_t; h_t] + b``, Fig. 7a).  "Base" is ``refiner=none, decoder_attention=additive,
context=linear``.  "LSTM + AoA" is left out: the paper could not train it and reports no numbers.

Attention export (SPEC §8.2, decision #40): ``primary`` is the decoder's attention over the visual items at step
``t`` — the one that fed ``c_t`` and hence the word predicted from it — **averaged over the heads**; padded items
are exactly zero and each row sums to 1.  The per-head maps ``[B', H, N]`` are the ``heads`` extra.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import get_normaliser
from .attention.aoa import AttentionOnAttention
from .attention.multihead import multi_head_attention
from .layers import AdditiveAttention, masked_mean
from .protocol import AttnRecord, Captioner, DecState, EncState, VisualBatch
from .registry import register

REFINERS = ("aoa", "transformer", "none")
DECODER_ATTENTIONS = ("multihead", "additive")
CONTEXTS = ("aoa", "lstm", "linear")


class AoARefinerLayer(nn.Module):
    """One refining layer (P2 Eq. 7): self-attention over the items, AoA with the projected query, residual + LN."""

    def __init__(self, d_model: int, heads: int, attention_dropout: float, aoa_dropout: float, pre_norm: bool):
        super().__init__()
        self.heads, self.pre_norm = heads, pre_norm
        self.query, self.key, self.value = (nn.Linear(d_model, d_model, bias=False) for _ in range(3))
        self.aoa = AttentionOnAttention(d_model, input_dropout=aoa_dropout)
        self.norm = nn.LayerNorm(d_model)
        # the authors' code drops attention weights and the residual branch with the same 0.1 (decision #17)
        self.drop = nn.Dropout(attention_dropout)

    def forward(self, items: Tensor, mask: Tensor) -> Tensor:
        x = self.norm(items) if self.pre_norm else items
        query = self.query(x)  # AoA^E's query argument is Q = W^{Q_e} A itself (Eq. 6–7)
        attended, _ = multi_head_attention(query, self.key(x), self.value(x), self.heads, mask, self.drop)
        out = items + self.drop(self.aoa(attended, query))
        return out if self.pre_norm else self.norm(out)


@register("aoanet")
class AoANet(Captioner):
    attention_kind = "multihead_attention"

    def __init__(self, vocab_size: int, feat_dim: int, d_model: int = 1024, embed_dim: int = 1024, heads: int = 8,
                 refine_layers: int = 6, refiner: str = "aoa", decoder_attention: str = "multihead",
                 context: str = "aoa", pre_norm: bool = False, ffn_dim: int = 2048, dropout: float = 0.5,
                 attention_dropout: float = 0.1, aoa_dropout: float = 0.3, **ids: int):
        super().__init__(vocab_size, feat_dim, **ids)
        for name, value, choices in (("refiner", refiner, REFINERS), ("context", context, CONTEXTS),
                                     ("decoder_attention", decoder_attention, DECODER_ATTENTIONS)):
            if value not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {value!r}")
        self.hparams = dict(d_model=d_model, embed_dim=embed_dim, heads=heads, refine_layers=refine_layers,
                            refiner=refiner, decoder_attention=decoder_attention, context=context, pre_norm=pre_norm,
                            ffn_dim=ffn_dim, dropout=dropout, attention_dropout=attention_dropout,
                            aoa_dropout=aoa_dropout)
        self.heads = heads
        self.refiner_kind, self.decoder_attention, self.context_kind = refiner, decoder_attention, context
        # -- encoder --------------------------------------------------------------------------------------------
        self.embed_items = nn.Linear(feat_dim, d_model)  # W_r, b_r (SPEC §3.3; φ = ReLU from the authors' code)
        if refiner == "aoa":
            self.refine = nn.ModuleList(AoARefinerLayer(d_model, heads, attention_dropout, aoa_dropout, pre_norm)
                                        for _ in range(refine_layers))
        elif refiner == "transformer":  # "Refine w/o AoA": attention + output projection, then FFN (Fig. 6a)
            self.refine = nn.ModuleList(
                nn.TransformerEncoderLayer(d_model, heads, ffn_dim, attention_dropout, batch_first=True,
                                           norm_first=pre_norm) for _ in range(refine_layers))
        else:
            self.refine = nn.ModuleList()
        # pre-norm leaves the residual stream un-normalised, so the authors' code ends the stack with a LayerNorm
        self.refine_norm = nn.LayerNorm(d_model) if pre_norm and len(self.refine) else nn.Identity()
        # -- decoder --------------------------------------------------------------------------------------------
        self.embed_words = nn.Embedding(vocab_size, embed_dim, padding_idx=self.pad_id)  # W_e of Eq. 12
        self.lstm = nn.LSTMCell(embed_dim + d_model, d_model)  # input [W_e Π_t; ā + c_{t−1}], hidden size D
        if decoder_attention == "multihead":
            self.query, self.key, self.value = (nn.Linear(d_model, d_model, bias=False) for _ in range(3))
        else:
            self.additive = AdditiveAttention(d_model, d_model, d_model, get_normaliser("softmax"))
        if context == "aoa":
            self.aoa = AttentionOnAttention(d_model)  # AoA^D of Eq. 14
        elif context == "lstm":
            self.context_lstm = nn.LSTMCell(2 * d_model, d_model)
        else:
            self.context_linear = nn.Linear(2 * d_model, d_model)
        self.logit = nn.Linear(d_model, vocab_size, bias=False)  # W_p of Eq. 11
        self.drop = nn.Dropout(dropout)  # items after embedding, c_{t−1} fed back, c_t before W_p (decision #17)
        self.attention_drop = nn.Dropout(attention_dropout)

    def config(self) -> dict[str, Any]:
        return dict(vocab_size=self.vocab_size, feat_dim=self.feat_dim, **self.hparams)

    # -- encoder ------------------------------------------------------------------------------------------------
    def encode(self, vis: VisualBatch) -> EncState:
        mask = vis.mask
        items = self.drop(F.relu(self.embed_items(vis.feats.to(self.embed_items.weight.dtype))))
        for layer in self.refine:
            items = layer(items, mask) if self.refiner_kind == "aoa" else layer(items, src_key_padding_mask=~mask)
        items = self.refine_norm(items)
        # keys and values of the decoder attention depend only on the image: computed once, beam-expanded later
        if self.decoder_attention == "multihead":
            keys, values = self.key(items), self.value(items)
        else:
            keys, values = self.additive.project_keys(items), items
        return {"mask": mask, "mean": masked_mean(items, mask), "keys": keys, "values": values}

    # -- decoder ------------------------------------------------------------------------------------------------
    def init_state(self, enc: EncState) -> DecState:
        zeros = enc["mean"].new_zeros(enc["mean"].shape)  # h_{-1} = m_{-1} = 0 [NS]; c_{-1} = 0 (P2 §3.2.2)
        state = {"h": zeros, "m": zeros, "context": zeros}
        return {**state, "h_ctx": zeros, "m_ctx": zeros} if self.context_kind == "lstm" else state

    def attend(self, h: Tensor, enc: EncState) -> tuple[Tensor, Tensor, Tensor]:
        """``â_t`` from the query ``h_t``; also the query as the context layer sees it and the weights
        ``[B', H, N]`` (``H = 1`` for additive attention)."""
        if self.decoder_attention == "additive":
            alpha = self.additive(enc["keys"], h, enc["mask"])
            return torch.bmm(alpha.unsqueeze(1), enc["values"]).squeeze(1), h, alpha.unsqueeze(1)
        query = self.query(h)  # W^{Q_d} h_t
        attended, weights = multi_head_attention(query.unsqueeze(1), enc["keys"], enc["values"], self.heads,
                                                 enc["mask"], self.attention_drop)
        return attended.squeeze(1), query, weights.squeeze(2)

    def step(self, prev_tokens: Tensor, state: DecState, enc: EncState) -> tuple[Tensor, DecState, AttnRecord]:
        visual = enc["mean"] + self.drop(state["context"])  # ā + c_{t−1}: added, not concatenated (Eq. 12)
        h, m = self.lstm(torch.cat([self.embed_words(prev_tokens), visual], 1), (state["h"], state["m"]))
        attended, query, weights = self.attend(h, enc)
        new_state = {"h": h, "m": m}
        if self.context_kind == "aoa":
            context = self.aoa(attended, query)  # Eq. 14: AoA's query is the projected W^{Q_d} h_t (Eq. 6)
        elif self.context_kind == "lstm":
            context, memory = self.context_lstm(torch.cat([attended, h], 1), (state["h_ctx"], state["m_ctx"]))
            new_state.update(h_ctx=context, m_ctx=memory)
        else:
            context = self.context_linear(torch.cat([attended, h], 1))
        new_state["context"] = context
        logprobs = F.log_softmax(self.logit(self.drop(context)), dim=-1)  # Eq. 11
        extras = {"heads": weights} if weights.shape[1] > 1 else {}
        return logprobs, new_state, AttnRecord(weights.mean(1), extras)
