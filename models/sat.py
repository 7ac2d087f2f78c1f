"""Show, Attend and Tell (SAT: Xu et al., 2015, arXiv:1502.03044), soft attention — §3.1 and §4.2.

Equations (SAT Eq. 1–7, §4.2.1): initial state from the mean annotation, additive attention ``α_t`` from ``h_{t-1}``
(Eq. 4–5; the score's form is ours: docs/decisions.md#sat-attention-score-and-initial-state), gated context
``ẑ_t = β_t Σ_i α_{t,i} a_i``, an LSTM on ``[E y_{t-1}; ẑ_t]`` and the deep output layer
``p(y_t) = softmax(L_o(E y_{t-1} + L_h h_t + L_z ẑ_t))``.  Training adds the doubly stochastic penalty
``λ Σ_i (1 − Σ_t α_{t,i})²`` (Eq. 14).  The attention exported for word ``y_t`` is ``α_t`` of the same step.

Four options express sgrvinod's "a-PyTorch-Tutorial-to-Image-Captioning" decoder (``DecoderWithAttention``), the
most used SAT reimplementation, so that its checkpoints convert exactly (``captioner import sgrvinod``,
docs/decisions.md#sgrvinod-tutorial-checkpoints); the defaults are the paper's reading above, and an option is
written into a checkpoint's config only when it differs from its default:

* ``init_activation="none"``: ``h_0 = init_h(mean)``, no tanh (its ``init_hidden_state``);
* ``attention_score="relu"``: ``e_i = w^T relu(U_a a_i + U_h h + b)`` (its ``Attention``);
* ``gate="channel"``: ``β_t = σ(f_beta(h_{t−1}))`` with one gate per feature channel (its ``f_beta``), not a scalar;
* ``output="hidden"``: ``p(y_t) = softmax(fc(dropout(h_t)))``, no deep output layer (its ``fc``).
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import get_normaliser
from .layers import AdditiveAttention, masked_mean
from .protocol import AttnRecord, Captioner, DecState, EncState, VisualBatch
from .registry import register


#: option → its values, the default (the paper's reading) first
SAT_OPTIONS = {"init_activation": ("tanh", "none"), "attention_score": ("tanh", "relu"),
               "gate": ("scalar", "channel"), "output": ("deep", "hidden")}


@register("sat")
class ShowAttendTell(Captioner):
    """The soft-attention decoder of Xu et al., "Show, Attend and Tell", arXiv:1502.03044 (§3.1, §4.2).

    ``init_state`` is ``h_0 = f_init,h(ā)``, ``c_0 = f_init,c(ā)`` (§3.1.2, the unnumbered equations after Eq. 6),
    each one affine layer + tanh of the masked mean annotation ``ā`` (the paper says "MLP":
    docs/decisions.md#sat-attention-score-and-initial-state); :meth:`step` is Eq. 1–7 with the soft ``φ`` of Eq. 13
    and the gate ``β_t`` of §4.2.1; :meth:`auxiliary_losses` is Eq. 14's doubly stochastic penalty, divided by the
    caption's length (a deviation, explained there).  Options other than the defaults are not the paper's but
    sgrvinod's tutorial's forms (docs/decisions.md#sgrvinod-tutorial-checkpoints).
    """

    attention_kind = "soft_attention"
    # SAT §4.3 early-stops on validation BLEU (docs/decisions.md#checkpoint-selection-metric)
    selection_metric = "BLEU-4"
    #: the β_t gate belongs to the soft model (SAT §4.2.1); SAT-hard leaves it out (docs/decisions.md#sat-hard-decoding)
    gated: ClassVar[bool] = True

    def __init__(self, vocab_size: int, feat_dim: int, embed_dim: int = 512, hidden_dim: int = 1024,
                 attn_dim: int = 512, dropout: float = 0.5, doubly_stochastic: float = 1.0,
                 init_activation: str = "tanh", attention_score: str = "tanh", gate: str = "scalar",
                 output: str = "deep", **ids: int):
        super().__init__(vocab_size, feat_dim, **ids)
        options = dict(init_activation=init_activation, attention_score=attention_score, gate=gate, output=output)
        for name, value in options.items():
            if value not in SAT_OPTIONS[name]:
                raise ValueError(f"{name} must be one of {SAT_OPTIONS[name]}, got {value!r}")
        self.hparams = dict(embed_dim=embed_dim, hidden_dim=hidden_dim, attn_dim=attn_dim, dropout=dropout,
                            doubly_stochastic=doubly_stochastic)
        self.hparams.update({k: v for k, v in options.items() if v != SAT_OPTIONS[k][0]})
        self.init_activation, self.output = init_activation, output
        self.embed = nn.Embedding(vocab_size, embed_dim, padding_idx=self.pad_id)
        self.init_h = nn.Linear(feat_dim, hidden_dim)  # f_init,h: one affine layer + tanh (our choice)
        self.init_c = nn.Linear(feat_dim, hidden_dim)
        self.attend = AdditiveAttention(feat_dim, hidden_dim, attn_dim, get_normaliser("softmax"), attention_score)
        # β_t = σ(w_β^T h_{t-1} + b_β): one scalar (ours), or one per channel of ẑ_t (gate="channel")
        self.gate = nn.Linear(hidden_dim, 1 if gate == "scalar" else feat_dim) if self.gated else None
        self.lstm = nn.LSTMCell(embed_dim + feat_dim, hidden_dim)
        if output == "deep":
            self.out_h = nn.Linear(hidden_dim, embed_dim)  # L_h
            self.out_z = nn.Linear(feat_dim, embed_dim)  # L_z
            self.out_word = nn.Linear(embed_dim, vocab_size)  # L_o
        else:
            self.out_word = nn.Linear(hidden_dim, vocab_size)  # fc(dropout(h_t))
        self.drop = nn.Dropout(dropout)
        self.doubly_stochastic = doubly_stochastic

    def config(self) -> dict:
        return dict(vocab_size=self.vocab_size, feat_dim=self.feat_dim, **self.hparams)

    def encode(self, vis: VisualBatch) -> EncState:
        feats, mask = vis.feats.to(self.embed.weight.dtype), vis.mask
        return {"feats": feats, "mask": mask, "keys": self.attend.project_keys(feats),
                "mean": masked_mean(feats, mask)}

    def init_state(self, enc: EncState) -> DecState:
        h, c = self.init_h(enc["mean"]), self.init_c(enc["mean"])
        return {"h": torch.tanh(h), "c": torch.tanh(c)} if self.init_activation == "tanh" else {"h": h, "c": c}

    def attention(self, state: DecState, enc: EncState) -> Tensor:
        """α_t from h_{t-1} (SAT Eq. 4–5)."""
        return self.attend(enc["keys"], state["h"], enc["mask"])

    def context(self, alpha: Tensor, state: DecState, enc: EncState) -> tuple[Tensor, dict[str, Tensor]]:
        """Soft context ẑ_t = β_t Σ_i α_{t,i} a_i (SAT Eq. 13 with the gate of §4.2.1)."""
        beta = torch.sigmoid(self.gate(state["h"]))
        # a channel gate is reported by its mean over the channels: one number per word, as for the scalar gate
        reported = beta if self.gate.out_features == 1 else beta.mean(1, keepdim=True)
        return beta * torch.bmm(alpha.unsqueeze(1), enc["feats"]).squeeze(1), {"beta_gate": reported}

    def step(self, prev_tokens: Tensor, state: DecState, enc: EncState) -> tuple[Tensor, DecState, AttnRecord]:
        """One SAT step (default options) for the previous word ``y_{t−1}`` (``prev_tokens``): ``α_t`` from
        ``h_{t−1}`` (Eq. 4–5, additive score: docs/decisions.md#sat-attention-score-and-initial-state);
        ``ẑ_t = β_t Σ_i α_{t,i} a_i`` (Eq. 6 with the soft ``φ`` of Eq. 13 and §4.2.1's ``β_t = σ(f_β(h_{t−1}))``;
        SAT-hard overrides ``context`` with Eq. 8–9); the LSTM of Eq. 1–3 on ``[E y_{t−1}; ẑ_t]`` with state
        ``(h_{t−1}, c_{t−1})``; ``log p(y_t) = log softmax(L_o(E y_{t−1} + L_h h_t + L_z ẑ_t))``, the deep output
        layer of Eq. 7 with no non-linearity inside (docs/decisions.md#sat-deep-output-layer).  Dropout on ``h_t``
        and on the sum is placed by us (§4.3 names dropout, not where).  Exports ``α_t``, the attention of the word
        predicted here."""
        alpha = self.attention(state, enc)
        z, extras = self.context(alpha, state, enc)
        emb = self.embed(prev_tokens)
        h, c = self.lstm(torch.cat([emb, z], dim=1), (state["h"], state["c"]))
        if self.output == "deep":
            # deep output layer (SAT Eq. 7), no non-linearity; the authors' arctic-captions capgen.py applies
            # tanh to this sum before L_o (tests/test_faithfulness_audit.py records the difference)
            deep = emb + self.out_h(self.drop(h)) + self.out_z(z)
            logprobs = F.log_softmax(self.out_word(self.drop(deep)), dim=-1)
        else:
            logprobs = F.log_softmax(self.out_word(self.drop(h)), dim=-1)
        return logprobs, {"h": h, "c": c}, AttnRecord(alpha, extras)

    def auxiliary_losses(self, attention: Tensor, token_mask: Tensor) -> dict[str, Tensor]:
        """Doubly stochastic penalty λ Σ_i (1 − Σ_t α_{t,i})², summing t over real steps (SAT Eq. 14), divided by
        the caption's length.

        Eq. 14 adds the penalty to −log P(y|x), a *sum* over the caption's words; our XE is a mean over words, so
        the penalty is divided by the number of words to keep the paper's ratio between the two terms.  Undivided,
        it outweighed the XE about tenfold on 8×8 grids and spread every word's attention over the whole image."""
        if not self.doubly_stochastic:
            return {}
        mask = token_mask.to(attention.dtype)
        per_location = (attention * mask.unsqueeze(-1)).sum(1)
        per_caption = ((1.0 - per_location) ** 2).sum(1) / mask.sum(1).clamp_min(1.0)
        return {"doubly_stochastic": self.doubly_stochastic * per_caption.mean()}
