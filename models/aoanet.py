"""AoANet (Huang et al., "Attention on Attention for Image Captioning", ICCV 2019, arXiv:1908.06954 — §3.2).

Encoder.  Visual items ``r_i`` (bottom-up regions or grid cells; a mask marks padding) are embedded,
``a_i = ReLU(W_r r_i + b_r)`` (§3.4; ReLU from the authors' code), then refined by ``refine_layers`` layers of Eq. 7:
``A' = LN(A + AoA^E(f_mh-att, W^{Q_e}A, W^{K_e}A, W^{V_e}A))`` — multi-head self-attention (Eq. 8–10) with AoA
in place of the output projection and no feed-forward sub-layer.  ``pre_norm=True`` gives the authors' code's
``A + AoA(LN(A))`` with a final LN (docs/decisions.md#aoanet-residual-style).

Decoder, per step ``t`` (input word ``w_t``, BOS first; ``c_{-1} = 0``):

* ``x_t = [W_e Π_t ; ā + c_{t−1}]`` with ``ā`` the masked mean of the refined items   (Eq. 12)
* ``h_t, m_t = LSTM(x_t, (h_{t−1}, m_{t−1}))``                                        (Eq. 13)
* ``c_t = AoA^D(f_mh-att, W^{Qa} h_t, W^{Ka} A, W^{Va} A)``                          (Eq. 14)
* ``p(y_{t+1} | y_{≤t}, I) = softmax(W_p c_t)``                                        (Eq. 11)

Projections that the paper writes as bare matrices (``W^{Q,K,V}`` of Eq. 7/14, ``W_p`` of Eq. 11) have no bias;
the AoA linear has the biases of Eq. 3–4.  The paper's decoder has no residual around AoA^D, so neither do we.

Ablations of Table 4 (§4.4) are config flags: ``refiner`` = ``aoa`` (Eq. 7) | ``transformer`` (standard encoder layer
with output projection and FFN, Fig. 6a) | ``none``; ``decoder_attention`` = ``multihead`` (Eq. 8–10 queried by
``W^{Qa} h_t``) | ``additive`` (single-head ``wᵀ tanh(U a_i + W h_t)``, our choice for the ablations' single
attention: docs/decisions.md#aoanet-ablation-attention); ``context`` = ``aoa`` (Fig. 7c) | ``lstm`` (second LSTM on
``[â_t; h_t]``, Fig. 7b) | ``linear`` (``W [â_t; h_t] + b``, Fig. 7a).  "Base" is
``refiner=none, decoder_attention=additive, context=linear``.  "LSTM + AoA" is left out: the paper could not train it
and reports no numbers.

Reference compatibility (docs/decisions.md#aoanet-reference-compatibility-flags): ``query_norm`` (LN on ``h_t``
before ``W^{Qa}``), ``word_embedding="relu_dropout"`` (Embedding → ReLU → Dropout), ``aoa_query="input"`` (AoA
fed the attention's input instead of the projected query), ``projection_bias`` and ``layer_norm="std"`` reproduce
the authors' code, so that ``captioner import aoanet`` converts their checkpoints exactly.  All default to the paper.

Attention export (docs/decisions.md#exported-attention-of-multi-head-models): ``primary`` is the decoder's
attention over the visual items at step ``t`` — the one that fed ``c_t`` and hence the word predicted from it —
**averaged over the heads**; padded items are exactly zero and each row sums to 1.  The per-head maps
``[B', H, N]`` are the ``heads`` extra.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import get_normaliser
from .attention.aoa import AttentionOnAttention
from .attention.multihead import attend_split, multi_head_attention, split_heads
from .layers import AdditiveAttention, masked_mean
from .protocol import AttnRecord, Captioner, DecState, EncState, VisualBatch
from .registry import register

REFINERS = ("aoa", "transformer", "none")
DECODER_ATTENTIONS = ("multihead", "additive")
CONTEXTS = ("aoa", "lstm", "linear")
WORD_EMBEDDINGS = ("plain", "relu_dropout")
AOA_QUERIES = ("projected", "input")
LAYER_NORMS = ("torch", "std")


class StdLayerNorm(nn.Module):
    """``γ ⊙ (x − mean) / (std + ε) + β`` with the *unbiased* standard deviation and ε outside the root: the
    LayerNorm of the authors' AoANet code (taken from the Annotated Transformer).  ``layer_norm="std"`` selects it
    so that their checkpoints convert exactly (``captioner import``); ``nn.LayerNorm`` differs by a factor
    ``√(D/(D−1))`` and in where ε enters."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight, self.bias, self.eps = nn.Parameter(torch.ones(dim)), nn.Parameter(torch.zeros(dim)), eps

    def forward(self, x: Tensor) -> Tensor:
        return self.weight * (x - x.mean(-1, keepdim=True)) / (x.std(-1, keepdim=True) + self.eps) + self.bias


def make_layer_norm(kind: str, dim: int) -> nn.Module:
    return nn.LayerNorm(dim) if kind == "torch" else StdLayerNorm(dim)


class AoARefinerLayer(nn.Module):
    """One refining layer (AoANet Eq. 7): self-attention over the items, AoA with the projected query, residual + LN."""

    def __init__(self, d_model: int, heads: int, attention_dropout: float, aoa_dropout: float, pre_norm: bool,
                 projection_bias: bool = False, aoa_query: str = "projected", layer_norm: str = "torch"):
        super().__init__()
        self.heads, self.pre_norm, self.aoa_query = heads, pre_norm, aoa_query
        self.query, self.key, self.value = (nn.Linear(d_model, d_model, bias=projection_bias) for _ in range(3))
        self.aoa = AttentionOnAttention(d_model, input_dropout=aoa_dropout)
        self.norm = make_layer_norm(layer_norm, d_model)
        # the authors' code drops attention weights and the residual branch with the same 0.1
        # (docs/decisions.md#aoanet-dropout)
        self.drop = nn.Dropout(attention_dropout)

    def forward(self, items: Tensor, mask: Tensor) -> Tensor:
        x = self.norm(items) if self.pre_norm else items
        query = self.query(x)  # AoA^E's query argument is Q = W^{Q_e} A itself (Eq. 6–7)
        attended, _ = multi_head_attention(query, self.key(x), self.value(x), self.heads, mask, self.drop)
        # aoa_query="input": the authors' code gives AoA the layer's (normalised) input instead of W^{Q_e} A
        out = items + self.drop(self.aoa(attended, query if self.aoa_query == "projected" else x))
        return out if self.pre_norm else self.norm(out)


@register("aoanet")
class AoANet(Captioner):
    """AoANet (Huang et al., "Attention on Attention for Image Captioning", arXiv:1908.06954, §3.2).

    :meth:`encode` is the refining encoder (§3.2.1: Eq. 7, with the multi-head attention of Eq. 8–10) and
    :meth:`step` the decoder (§3.2.2: Eq. 12–14, then Eq. 11), both built on AoA (§3.1, Eq. 3–6).  The defaults
    follow the paper's equations; ``pre_norm`` and the reference-compatibility flags give the authors' code instead
    (docs/decisions.md#aoanet-residual-style, docs/decisions.md#aoanet-reference-compatibility-flags), and
    ``refiner``, ``decoder_attention`` and ``context`` the ablations of Table 4 (see the module docstring).
    """

    attention_kind = "multihead_attention"

    def __init__(self, vocab_size: int, feat_dim: int, d_model: int = 1024, embed_dim: int = 1024, heads: int = 8,
                 refine_layers: int = 6, refiner: str = "aoa", decoder_attention: str = "multihead",
                 context: str = "aoa", pre_norm: bool = False, ffn_dim: int = 2048, dropout: float = 0.5,
                 attention_dropout: float = 0.1, aoa_dropout: float = 0.3, query_norm: bool = False,
                 word_embedding: str = "plain", projection_bias: bool = False, aoa_query: str = "projected",
                 layer_norm: str = "torch", **ids: int):
        super().__init__(vocab_size, feat_dim, **ids)
        for name, value, choices in (("refiner", refiner, REFINERS), ("context", context, CONTEXTS),
                                     ("decoder_attention", decoder_attention, DECODER_ATTENTIONS),
                                     ("word_embedding", word_embedding, WORD_EMBEDDINGS),
                                     ("aoa_query", aoa_query, AOA_QUERIES), ("layer_norm", layer_norm, LAYER_NORMS)):
            if value not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {value!r}")
        self.hparams = dict(d_model=d_model, embed_dim=embed_dim, heads=heads, refine_layers=refine_layers,
                            refiner=refiner, decoder_attention=decoder_attention, context=context, pre_norm=pre_norm,
                            ffn_dim=ffn_dim, dropout=dropout, attention_dropout=attention_dropout,
                            aoa_dropout=aoa_dropout)
        # the authors' code's choices (docs/decisions.md#aoanet-reference-compatibility-flags), off by default;
        # recorded only when set, so that earlier checkpoints' configs stay unchanged
        compatibility = dict(query_norm=query_norm, word_embedding=word_embedding, projection_bias=projection_bias,
                             aoa_query=aoa_query, layer_norm=layer_norm)
        defaults = dict(query_norm=False, word_embedding="plain", projection_bias=False, aoa_query="projected",
                        layer_norm="torch")
        self.hparams.update({k: v for k, v in compatibility.items() if v != defaults[k]})
        self.word_embedding, self.aoa_query = word_embedding, aoa_query
        self.heads = heads
        self.refiner_kind, self.decoder_attention, self.context_kind = refiner, decoder_attention, context
        # -- encoder --------------------------------------------------------------------------------------------
        self.embed_items = nn.Linear(feat_dim, d_model)  # W_r, b_r (§3.4; ReLU from the authors' code)
        if refiner == "aoa":
            self.refine = nn.ModuleList(AoARefinerLayer(d_model, heads, attention_dropout, aoa_dropout, pre_norm,
                                                        projection_bias, aoa_query, layer_norm)
                                        for _ in range(refine_layers))
        elif refiner == "transformer":  # "Refine w/o AoA": attention + output projection, then FFN (Fig. 6a)
            self.refine = nn.ModuleList(
                nn.TransformerEncoderLayer(d_model, heads, ffn_dim, attention_dropout, batch_first=True,
                                           norm_first=pre_norm) for _ in range(refine_layers))
        else:
            self.refine = nn.ModuleList()
        # pre-norm leaves the residual stream un-normalised, so the authors' code ends the stack with a LayerNorm
        self.refine_norm = make_layer_norm(layer_norm, d_model) if pre_norm and len(self.refine) else nn.Identity()
        # -- decoder --------------------------------------------------------------------------------------------
        self.embed_words = nn.Embedding(vocab_size, embed_dim, padding_idx=self.pad_id)  # W_e of Eq. 12
        self.lstm = nn.LSTMCell(embed_dim + d_model, d_model)  # input [W_e Π_t; ā + c_{t−1}], hidden size D
        if decoder_attention == "multihead":
            self.query, self.key, self.value = (nn.Linear(d_model, d_model, bias=projection_bias) for _ in range(3))
            # query_norm: the authors' code normalises h_t before W^{Qa} (not in the paper's Eq. 14)
            self.query_norm = make_layer_norm(layer_norm, d_model) if query_norm else nn.Identity()
        else:
            self.additive = AdditiveAttention(d_model, d_model, d_model, get_normaliser("softmax"))
        if context == "aoa":
            self.aoa = AttentionOnAttention(d_model)  # AoA^D of Eq. 14
        elif context == "lstm":
            self.context_lstm = nn.LSTMCell(2 * d_model, d_model)
        else:
            self.context_linear = nn.Linear(2 * d_model, d_model)
        self.logit = nn.Linear(d_model, vocab_size, bias=projection_bias)  # W_p of Eq. 11
        self.drop = nn.Dropout(dropout)  # items, c_{t−1} fed back, c_t before W_p (docs/decisions.md#aoanet-dropout)
        self.attention_drop = nn.Dropout(attention_dropout)

    def config(self) -> dict[str, Any]:
        return dict(vocab_size=self.vocab_size, feat_dim=self.feat_dim, **self.hparams)

    # -- encoder ------------------------------------------------------------------------------------------------
    def encode(self, vis: VisualBatch) -> EncState:
        """The refined items ``A`` (AoANet §3.2.1): ``a_i = ReLU(W_r r_i + b_r)`` (§3.4 states only the projection
        to ``D``; ReLU and dropout are the authors' code's: docs/decisions.md#aoanet-dropout), then
        ``refine_layers`` (paper: N = 6) layers of Eq. 7, ``A ← LN(A + AoA^E(f_mh-att, W^{Q_e}A, W^{K_e}A,
        W^{V_e}A))`` with ``f_mh-att`` of Eq. 8–10 (or a Table 4 ablation refiner).  Also what every step reuses:
        the mean ``ā`` of Eq. 12 (masked: docs/decisions.md#masked-items) and Eq. 14's ``W^{Ka}A``, ``W^{Va}A``,
        split into heads."""
        mask = vis.mask
        items = self.drop(F.relu(self.embed_items(vis.feats.to(self.embed_items.weight.dtype))))
        for layer in self.refine:
            items = layer(items, mask) if self.refiner_kind == "aoa" else layer(items, src_key_padding_mask=~mask)
        items = self.refine_norm(items)
        # keys and values of the decoder attention depend only on the image: computed once, beam-expanded later,
        # and for multi-head attention stored split into heads [B, H, N, d], as every step reads them
        if self.decoder_attention == "multihead":
            keys, values = (split_heads(x, self.heads).contiguous() for x in (self.key(items), self.value(items)))
        else:
            keys, values = self.additive.project_keys(items), items
        return {"mask": mask, "mean": masked_mean(items, mask), "keys": keys, "values": values}

    # -- decoder ------------------------------------------------------------------------------------------------
    def init_state(self, enc: EncState) -> DecState:
        # h_{-1} = m_{-1} = 0 (the paper does not state them; docs/decisions.md#initial-decoder-states);
        # c_{-1} = 0 (AoANet, arXiv:1908.06954, §3.2.2)
        zeros = enc["mean"].new_zeros(enc["mean"].shape)
        if self.context_kind == "lstm":  # c_t is the context LSTM's hidden state: kept once, as h_ctx
            return {"h": zeros, "m": zeros, "h_ctx": zeros, "m_ctx": zeros}
        return {"h": zeros, "m": zeros, "context": zeros}

    def previous_context(self, state: DecState) -> Tensor:
        """``c_{t−1}``: its own state entry, or the context LSTM's hidden state for ``context="lstm"`` (storing it
        twice would make every beam reorder copy it twice)."""
        return state["h_ctx"] if self.context_kind == "lstm" else state["context"]

    def attend(self, h: Tensor, enc: EncState) -> tuple[Tensor, Tensor, Tensor]:
        """``â_t`` from the query ``h_t``; also the query as the context layer sees it and the weights
        ``[B', H, N]`` (``H = 1`` for additive attention)."""
        if self.decoder_attention == "additive":
            alpha = self.additive(enc["keys"], h, enc["mask"])
            return torch.bmm(alpha.unsqueeze(1), enc["values"]).squeeze(1), h, alpha.unsqueeze(1)
        query = self.query(self.query_norm(h))  # W^{Qa} h_t (W^{Qa} LN(h_t) with query_norm)
        attended, weights = attend_split(split_heads(query.unsqueeze(1), self.heads), enc["keys"], enc["values"],
                                         enc["mask"], self.attention_drop)
        # aoa_query="input": the authors' code gives AoA^D the raw h_t instead of W^{Qa} h_t
        return attended.squeeze(1), query if self.aoa_query == "projected" else h, weights.squeeze(2)

    def step(self, prev_tokens: Tensor, state: DecState, enc: EncState) -> tuple[Tensor, DecState, AttnRecord]:
        """One decoder step (AoANet §3.2.2) for the input word ``w_t`` (``prev_tokens``):
        ``x_t = [W_e Π_t; ā + c_{t−1}]`` (Eq. 12), ``h_t, m_t = LSTM(x_t, h_{t−1}, m_{t−1})`` (Eq. 13),
        ``c_t = AoA^D(f_mh-att, W^{Qa} h_t, W^{Ka}A, W^{Va}A)`` (Eq. 14, with Eq. 6's AoA taking the projected
        ``W^{Qa} h_t`` as its query) and the log of ``softmax(W_p c_t)`` (Eq. 11) for the next word.  Dropout on
        ``c_{t−1}`` and ``c_t`` is the authors' code's (docs/decisions.md#aoanet-dropout); the ``context`` ablations
        (Fig. 7a, 7b) replace Eq. 14's AoA.  Exports the decoder attention averaged over the heads."""
        # ā + c_{t−1}: added, not concatenated (Eq. 12)
        visual = enc["mean"] + self.drop(self.previous_context(state))
        words = self.embed_words(prev_tokens)  # W_e Π_t
        if self.word_embedding == "relu_dropout":  # the authors' code: Embedding → ReLU → Dropout
            words = self.drop(F.relu(words))
        h, m = self.lstm(torch.cat([words, visual], 1), (state["h"], state["m"]))
        attended, query, weights = self.attend(h, enc)
        new_state = {"h": h, "m": m}
        if self.context_kind == "aoa":
            context = self.aoa(attended, query)  # Eq. 14: AoA's query is the projected W^{Qa} h_t (Eq. 6)
        elif self.context_kind == "lstm":
            context, memory = self.context_lstm(torch.cat([attended, h], 1), (state["h_ctx"], state["m_ctx"]))
            new_state.update(h_ctx=context, m_ctx=memory)  # h_ctx is c_t: no separate "context" entry
        else:
            context = self.context_linear(torch.cat([attended, h], 1))
        if self.context_kind != "lstm":
            new_state["context"] = context
        logprobs = F.log_softmax(self.logit(self.drop(context)), dim=-1)  # Eq. 11
        extras = {"heads": weights} if weights.shape[1] > 1 else {}
        return logprobs, new_state, AttnRecord(weights.mean(1), extras)
