"""Show, Attend and Tell with stochastic "hard" attention (SAT: Xu et al., 2015, arXiv:1502.03044, §4.1).

The decoder is :class:`~captioner.models.sat.ShowAttendTell` (initial state, additive ``α_t``, LSTM, deep output);
only the context vector and the training objective differ, and the β gate is left out
(docs/decisions.md#sat-hard-decoding):

* training: ``s̃_t ~ Multinoulli(α_t)`` (Eq. 8) and ``ẑ_t = Σ_i s̃_{t,i} a_i = a_{s̃_t}`` (Eq. 9).  With
  probability 0.5 per caption the indicator ``s̃_t`` is set to its expected value ``α_t`` for every step,
  i.e. ``ẑ_t = Σ_i α_{t,i} a_i`` (the paper's variance-reduction trick, §4.1);
* evaluation and decoding (``decode_location``): the expected context ``ẑ_t = Σ_i α_{t,i} a_i``, as the authors'
  caption generator does (arctic-captions ``generate_caps.py``: ``build_sampler(..., sampling=False)`` with
  ``argmax=False`` makes ``alpha_sample = alpha``), or the arg-max location ``ẑ_t = a_{argmax α_t}``
  (docs/decisions.md#sat-hard-decoding).

Every step exports ``α_t`` as the primary attention and the indicator actually used (one-hot, or ``α_t`` for a
caption that took the expectation) as ``extras["location"]`` ``[B', N]`` (to mark the chosen cell).

Training runs in the ordinary XE loop (docs/decisions.md#training-phases): :meth:`forward_xe` returns the
teacher-forced log-probs, whose mean-token NLL is the first term of the paper's learning rule, and the other two
terms as auxiliary losses, so ``captioner train --model sat-hard`` minimises (per caption, SAT's learning rule
after Eq. 12)::

    -( log p(y|s̃,a) + λ_r (log p(y|s̃,a) - b) log p(s̃|a) + λ_e H[s̃] )

with ``log p(s̃|a) = Σ_t log α_{t,s̃_t}``, ``H[s̃] = Σ_t H(α_t)`` and the moving-average baseline
``b_k = 0.9 b_{k-1} + 0.1 log p(y|s̃_k,a)``.  All three terms are divided by the number of target tokens, the
normalisation of the XE loss, so their ratio is the paper's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .protocol import DecState, EncState, VisualBatch
from .registry import register
from .sat import ShowAttendTell


#: the context outside training: the expected one (the authors' caption generator) or the arg-max location
DECODE_LOCATIONS = ("expectation", "argmax")


@register("sat-hard")
class ShowAttendTellHard(ShowAttendTell):
    """SAT with stochastic hard attention (Xu et al., "Show, Attend and Tell", arXiv:1502.03044, §4.1).

    Decoding runs the inherited :meth:`ShowAttendTell.step` (Eq. 1–5 and 7; no β gate and no Eq. 14 penalty, the
    soft model's of §4.2.1: docs/decisions.md#sat-hard-decoding); only :meth:`context`, the ``φ`` of Eq. 6,
    differs: Eq. 8–9 in training, the expected context of Eq. 13 (or the arg-max location) outside it.
    :meth:`forward_xe` adds the REINFORCE and entropy terms of §4.1's final learning rule (unnumbered, after
    Eq. 12: the Monte Carlo estimate of Eq. 11 with the baseline ``b_k`` and the entropy ``H[s̃]``).

    Deviations from §4.1: the 0.5 expectation coin ("for a given image") is drawn per caption, and a caption that
    took the expectation gets no REINFORCE term; every term is divided by the number of target tokens (the paper
    sums over the caption), which keeps their ratio; the first mini-batch's baseline is its own mean (§4.1 gives no
    ``b_0``); λ_r, λ_e and N_s are ours (docs/decisions.md#sat-hard-training-weights).
    """

    attention_kind = "hard_attention"
    gated = False

    def __init__(self, vocab_size: int, feat_dim: int, embed_dim: int = 512, hidden_dim: int = 1024,
                 attn_dim: int = 512, dropout: float = 0.5, reinforce_weight: float = 1.0,
                 entropy_weight: float = 0.002, location_samples: int = 1, expectation_prob: float = 0.5,
                 baseline_decay: float = 0.9, decode_location: str = "expectation", **ids: int):
        """``reinforce_weight`` λ_r, ``entropy_weight`` λ_e and ``location_samples`` N_s are not given by the paper
        (1.0, 0.002, 1: docs/decisions.md#sat-hard-training-weights); ``expectation_prob`` (0.5) and
        ``baseline_decay`` (0.9) are §4.1's; ``decode_location`` ("expectation" or "argmax") is the context used
        outside training."""
        # the doubly stochastic penalty is the soft model's regulariser (§4.2.1); hard attention has the entropy
        super().__init__(vocab_size, feat_dim, embed_dim, hidden_dim, attn_dim, dropout, doubly_stochastic=0.0,
                         **ids)
        if location_samples < 1 or not 0.0 <= expectation_prob <= 1.0 or not 0.0 <= baseline_decay < 1.0:
            raise ValueError("need location_samples >= 1, 0 <= expectation_prob <= 1 and 0 <= baseline_decay < 1")
        if decode_location not in DECODE_LOCATIONS:
            raise ValueError(f"decode_location must be one of {DECODE_LOCATIONS}, got {decode_location!r}")
        del self.hparams["doubly_stochastic"]
        self.hparams.update(reinforce_weight=reinforce_weight, entropy_weight=entropy_weight,
                            location_samples=location_samples, expectation_prob=expectation_prob,
                            baseline_decay=baseline_decay, decode_location=decode_location)
        self.reinforce_weight, self.entropy_weight = reinforce_weight, entropy_weight
        self.location_samples, self.expectation_prob = location_samples, expectation_prob
        self.baseline_decay, self.decode_location = baseline_decay, decode_location
        # b_k and k: buffers, so the baseline travels with checkpoints and a resumed run continues it exactly
        self.register_buffer("baseline", torch.zeros(()))
        self.register_buffer("baseline_batches", torch.zeros((), dtype=torch.long))

    # -- context -------------------------------------------------------------------------------------------
    def encode_rows(self, vis: VisualBatch, rows: Tensor | None = None) -> EncState:
        enc = super().encode_rows(vis, rows)
        if self.training:
            # §4.1: "with probability 0.5 for a given image, we set the sampled attention location s̃ to its
            # expected value α" — drawn once per caption row (after rows are expanded), so it holds for all of
            # its steps
            count = next(iter(enc.values())).shape[0]
            enc["expected"] = torch.rand(count, device=vis.feats.device) < self.expectation_prob
        return enc

    def draw_location(self, alpha: Tensor) -> Tensor:
        """``s̃_t ~ Multinoulli_L(α_t)`` (Eq. 8), one location index per row."""
        return torch.multinomial(alpha.detach(), 1).squeeze(1)

    def context(self, alpha: Tensor, state: DecState, enc: EncState) -> tuple[Tensor, dict[str, Tensor]]:
        """The hard ``φ`` of Eq. 6: ``ẑ_t = Σ_i s̃_{t,i} a_i`` (Eq. 9) with the one-hot ``s̃_t`` drawn by Eq. 8 in
        training (``α_t`` itself for a caption that drew §4.1's expectation coin); outside training the expected
        context ``Σ_i α_{t,i} a_i`` (Eq. 13) or the arg-max location, by ``decode_location``
        (docs/decisions.md#sat-hard-decoding)."""
        if not self.training and self.decode_location == "expectation":
            return torch.bmm(alpha.unsqueeze(1), enc["feats"]).squeeze(1), {"location": alpha}
        location = self.draw_location(alpha) if self.training else alpha.argmax(-1)
        indicator = F.one_hot(location, alpha.shape[-1]).to(alpha.dtype)
        if "expected" in enc:
            indicator = torch.where(enc["expected"].unsqueeze(1), alpha, indicator)
        # a one-hot indicator is a constant: the sampled path gets its gradient from REINFORCE, not from here
        z = torch.bmm(indicator.unsqueeze(1), enc["feats"]).squeeze(1)
        return z, {"location": indicator}

    # -- training objective ------------------------------------------------------------------------------
    def forward_xe(self, vis: VisualBatch, captions: Tensor, ss_prob: float = 0.0,
                   rows: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        """Teacher-forced log-probs ``[B, T, V]`` plus the REINFORCE and entropy terms of the learning rule.

        In training mode each caption is decoded along ``N_s`` sampled location paths; the returned log-probs
        are their mean, so the caller's token-mean NLL is ``1/N_s Σ_n -log p(y|s̃^n,a)`` (the NLL is linear in
        the log-probs).  In evaluation mode the path is the ``decode_location`` one and there is nothing to add.
        """
        if not self.training:
            return super().forward_xe(vis, captions, ss_prob, rows)
        n = self.location_samples
        if rows is None:
            rows = torch.arange(captions.shape[0], device=captions.device)
        targets = captions.repeat_interleave(n, 0)
        logprobs, records, enc = self.teacher_force(vis, targets, ss_prob, rows.repeat_interleave(n, 0))
        tokens = (targets != self.pad_id).to(logprobs.dtype)  # real steps, EOS included
        alpha = torch.stack([r.primary for r in records], dim=1)  # [R, T, N]
        indicator = torch.stack([r.extras["location"] for r in records], dim=1)
        tiny = torch.finfo(alpha.dtype).tiny  # log 0 guard; masked items have α = 0 and zero gradient anyway

        logp_y = (logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1) * tokens).sum(1)  # log p(y|s̃,a)
        logp_s = ((alpha * indicator).sum(-1).clamp_min(tiny).log() * tokens).sum(1)  # Σ_t log α_{t,s̃_t}
        entropy = (-(alpha * alpha.clamp_min(tiny).log()).sum(-1) * tokens).sum(1)  # H[s̃] = Σ_t H(α_t)

        # captions that took the expectation get no REINFORCE term (our choice: docs/decisions.md#sat-hard-decoding)
        sampled = ~enc["expected"]
        reward = logp_y.detach()
        advantage = (reward - self._baseline_for(reward[sampled])) * sampled.to(reward.dtype)
        self._update_baseline(reward[sampled])
        n_tokens = tokens.sum().clamp_min(1.0)
        aux = {"reinforce": -self.reinforce_weight * (advantage * logp_s).sum() / n_tokens,
               "entropy": -self.entropy_weight * entropy.sum() / n_tokens}
        return logprobs.unflatten(0, (captions.shape[0], n)).mean(1), aux

    @torch.no_grad()
    def _baseline_for(self, rewards: Tensor) -> Tensor:
        """``b_{k-1}``: the baseline before this mini-batch, so it does not depend on the sampled paths (and
        the estimator stays unbiased).  The first mini-batch has none yet and uses its own mean."""
        if int(self.baseline_batches) == 0 and rewards.numel():
            return rewards.mean()
        return self.baseline.clone()

    @torch.no_grad()
    def _update_baseline(self, rewards: Tensor) -> None:
        """``b_k = 0.9 b_{k-1} + 0.1 log p(y|s̃_k,a)`` with the mini-batch mean of the sampled captions."""
        if not rewards.numel():
            return  # every caption took the expectation: nothing was sampled, b stays
        mean = rewards.mean().to(self.baseline.dtype)
        first = int(self.baseline_batches) == 0
        self.baseline.copy_(mean if first else self.baseline_decay * self.baseline + (1 - self.baseline_decay) * mean)
        self.baseline_batches += 1
