"""Cross-entropy training (SPEC §1.5, §8.6): teacher forcing plus the auxiliary losses the model returns (SAT's
doubly stochastic penalty; SAT-hard's REINFORCE and entropy terms, which makes this phase also SPEC §8.6's
``hard_reinforce``).  The loop, validation, checkpoints and resume are :mod:`models.training.loop`'s.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .loop import Phase, TrainConfig, TrainingInterrupted, register_phase, train

__all__ = ["TrainConfig", "TrainingInterrupted", "XEPhase", "train", "xe_loss"]


def _pad(captions: list[list[int]], pad_id: int) -> torch.Tensor:
    out = torch.full((len(captions), max(map(len, captions))), pad_id, dtype=torch.long)
    for i, ids in enumerate(captions):
        out[i, : len(ids)] = torch.tensor(ids)
    return out


def xe_loss(logprobs: torch.Tensor, targets: torch.Tensor, pad_id: int, label_smoothing: float = 0.0) -> torch.Tensor:
    """Mean token negative log-likelihood over non-pad targets (EOS included), optional label smoothing."""
    return F.nll_loss(logprobs.flatten(0, 1), targets.flatten(), ignore_index=pad_id) if not label_smoothing else \
        _smoothed(logprobs, targets, pad_id, label_smoothing)


def _smoothed(logprobs: torch.Tensor, targets: torch.Tensor, pad_id: int, eps: float) -> torch.Tensor:
    mask = targets != pad_id
    nll = -logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    uniform = -logprobs.mean(-1)
    return (((1 - eps) * nll + eps * uniform) * mask).sum() / mask.sum()


@register_phase("xe")
class XEPhase(Phase):
    """An epoch visits every (image, reference caption) pair once; captions are truncated to
    ``max_train_len`` words and end in EOS."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pairs = [(im.key, self.vocab.encode(ref, self.cfg.max_train_len))
                      for im in self.images for ref in im.references]

    @property
    def size(self) -> int:
        return len(self.pairs)

    def loss(self, batch: Sequence[int]) -> tuple[torch.Tensor, dict[str, float]]:
        pairs = [self.pairs[i] for i in batch]
        vis = self.store.batch([key for key, _ in pairs]).to(self.device)
        targets = _pad([ids for _, ids in pairs], self.vocab.pad_id).to(self.device)
        logprobs, aux = self.model.forward_xe(vis, targets)
        loss = xe_loss(logprobs, targets, self.vocab.pad_id, self.cfg.label_smoothing)
        total = loss + sum(aux.values()) if aux else loss
        return total, {"xe": loss.item(), **{name: value.item() for name, value in aux.items()}}
