"""Self-critical sequence training with the CIDEr-D reward (Rennie et al. 2017, arXiv:1612.00563), the second training
stage of AoANet (arXiv:1908.06954 §3.3) and X-LAN (arXiv:2003.14080 §3.3.1).  Generic over every registered captioner,
since it only uses the protocol's ``encode`` / ``step`` through :func:`captioner.models.decoding.greedy` and
:func:`captioner.models.decoding.sample`.

Per mini-batch of images:

1. the greedy caption ``ŷ`` of each image, decoded with the model in eval mode and without gradient;
2. ``n`` captions ``y^s`` per image sampled from the full softmax with the model in train mode;
3. CIDEr-D of every caption against the image's references, with document frequencies from the training
   references (as the authors' code does); with ``scst_reward_eos`` a caption that ended holds its end token, and
   every reference one (self-critical.pytorch's ``array_to_str`` keeps the trailing 0; its document frequencies
   count it too), so a caption cut short of its last words earns less than the same words ending it;
4. ``L = -Σ (r(y^s) - r(ŷ)) Σ_t log p(y^s_t | y^s_<t) / #tokens``, summing up to and including EOS.

The images are encoded once per decode rather than once per batch (Rennie et al. encode once): the greedy baseline
runs in eval mode, and for models with dropout in the encoder (AoANet's refiner) that needs an eval-mode
encoding of its own.  ``scst_baseline="mean"`` replaces ``r(ŷ)`` by the mean reward of the image's other samples
(no greedy decode; not in the papers, off by default).

Usage: ``captioner train --phase scst --init runs/xe/best --out runs/scst --lr 2e-5``: the model, vocabulary
and encoder come from the XE checkpoint, batches hold ``--batch-size`` images, and ``best/`` is chosen by
validation CIDEr-D.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ..decoding import greedy, sample
from ..evaluation.metrics import CiderD
from ..protocol import Captioner, VisualBatch
from .phase import BatchLoss, Phase, register_phase

BASELINES = ("greedy", "mean")


def scst_advantages(sample_rewards: Tensor, greedy_rewards: Tensor | None) -> Tensor:
    """``r(y^s) - b`` for rewards ``[B, n]``: ``b = r(ŷ)`` of the image's greedy caption ``[B]``, or, without
    one, the mean reward of the image's other ``n - 1`` samples."""
    if greedy_rewards is not None:
        return sample_rewards - greedy_rewards[:, None]
    n = sample_rewards.shape[1]
    if n < 2:
        raise ValueError("the mean-of-samples baseline needs at least 2 samples per image")
    return sample_rewards - (sample_rewards.sum(1, keepdim=True) - sample_rewards) / (n - 1)


def scst_loss(logprobs: Tensor, mask: Tensor, advantages: Tensor) -> Tensor:
    """Rennie et al. Eq. 9 with the greedy baseline: ``-Σ_r A_r Σ_t log p(y_{r,t}) / #tokens`` over sampled rows
    ``[R, T]``, where ``mask`` marks the tokens up to and including EOS (divided by the unmasked token count, as the
    authors' code does)."""
    mask = mask.to(logprobs.dtype)
    return -(advantages.detach()[:, None] * logprobs * mask).sum() / mask.sum().clamp_min(1.0)


def scst_batch_loss(model: Captioner, vis: VisualBatch, references: Sequence[Sequence[str]], cider: CiderD,
                    to_text: Callable[[list[int]], str], samples: int = 5, max_len: int = 20,
                    baseline: str = "greedy") -> tuple[Tensor, dict[str, float]]:
    """The SCST loss of one batch of images (``references[b]``: image ``b``'s reference captions as strings),
    and the mean rewards for logging.  ``model`` is left in train mode."""
    if baseline not in BASELINES:
        raise ValueError(f"unknown SCST baseline {baseline!r}; choose from {BASELINES}")
    logs: dict[str, float] = {}
    greedy_rewards = None
    if baseline == "greedy":
        model.eval()
        hyps = greedy(model, vis, max_len=max_len)
        greedy_rewards = torch.from_numpy(cider.score([to_text(h.token_ids) for h in hyps], references))
        logs["greedy_reward"] = float(greedy_rewards.mean())
    model.train()
    drawn = sample(model, vis, n=samples, max_len=max_len)  # rows b*n .. b*n+n-1 belong to image b
    rewards = cider.score([to_text(ids) for ids in drawn.tokens.tolist()],
                          [references[row // samples] for row in range(drawn.tokens.shape[0])])
    rewards = torch.from_numpy(rewards).view(-1, samples)
    advantages = scst_advantages(rewards, greedy_rewards).flatten().to(drawn.logprobs.device, drawn.logprobs.dtype)
    loss = scst_loss(drawn.logprobs.float(), drawn.mask, advantages)
    return loss, {"scst": loss.item(), "reward": float(rewards.mean()), **logs, "tokens": float(drawn.mask.sum())}


@register_phase("scst")
class SCSTPhase(Phase):
    """An epoch visits every training image once; a batch is ``batch_size`` images."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        end = f" {self.vocab.itos[self.vocab.eos_id]}" if self.cfg.scst_reward_eos else ""
        self.references = [[" ".join(ref) + end for ref in im.references] for im in self.images]
        # document frequencies: the training references (as the authors' code does)
        self.cider = CiderD(self.references)

    @property
    def size(self) -> int:
        return len(self.images)

    def reward_text(self, ids: list[int]) -> str:
        """What CIDEr-D scores of a caption's ids: its words, and its end token where it has one and the reward
        counts it (``scst_reward_eos``); a caption that ran to the length limit has none."""
        words = self.vocab.decode(ids)
        if self.cfg.scst_reward_eos and self.vocab.eos_id in ids:
            words.append(self.vocab.itos[self.vocab.eos_id])
        return " ".join(words)

    def selection_metric(self) -> str:
        return self.cfg.select_metric or "CIDEr-D"

    def loss(self, batch: Sequence[int], global_batch: Sequence[int] | None = None) -> BatchLoss:
        """The SCST loss of this rank's images, weighted by their share of the global batch times the number of
        ranks (the token normaliser stays per rank: exact on one process, an approximation under DDP)."""
        vis = self.store.batch([self.images[i].key for i in batch]).to(self.device)
        loss, logs = scst_batch_loss(self.model, vis, [self.references[i] for i in batch], self.cider,
                                     self.reward_text, self.cfg.scst_samples, self.cfg.max_decode_len,
                                     self.cfg.scst_baseline)
        share = len(batch) * self.world / len(global_batch) if global_batch is not None and self.world > 1 else 1.0
        return BatchLoss(loss * share, logs, int(logs.pop("tokens")))
