"""The phase registry: a training phase (``xe``, ``scst``) says what an epoch visits and what the loss of a batch is;
:func:`register_phase` names it for ``--phase``, and :class:`PhaseModule` puts its loss where
DistributedDataParallel looks for a forward pass.  Everything else a run does is the loop's
(:mod:`captioner.models.training.loop`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar, Sequence, TypeVar

import numpy as np
import torch
from torch import nn

from ..data.karpathy import CaptionedImage
from ..data.stores import VisualStore
from ..encoder import EncoderTail
from ..protocol import Captioner
from ..vocab import Vocabulary
from .config import TrainConfig


@dataclass
class BatchLoss:
    loss: torch.Tensor
    logs: dict[str, float]
    tokens: int  # target (XE) or sampled (SCST) tokens of this rank's share, for tokens/s


class Phase:
    """One training objective.  An epoch visits ``size`` examples in a seeded random order, ``batch_size`` at a
    time; :meth:`loss` turns this rank's indices of one batch into the loss to minimise.  ``global_batch`` is the
    whole batch over all ranks: the loss is normalised by it (times the number of ranks, since DDP averages the
    ranks' gradients), so N processes compute the gradient of one process with the same global batch."""

    name: ClassVar[str] = ""

    def __init__(self, cfg: TrainConfig, model: Captioner, vocab: Vocabulary, store: VisualStore,
                 images: Sequence[CaptionedImage], device: torch.device):
        self.cfg, self.model, self.vocab, self.store = cfg, model, vocab, store
        self.images, self.device = images, device
        self.ss_prob = 0.0  # scheduled-sampling probability of the current epoch (set by the loop)
        self.world = 1

    @property
    def size(self) -> int:
        raise NotImplementedError

    def loss(self, batch: Sequence[int], global_batch: Sequence[int] | None = None) -> BatchLoss:
        raise NotImplementedError

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The examples of 0-based ``epoch`` in visiting order: a permutation seeded by (seed, epoch), so a resumed
        run sees the same order."""
        return np.random.default_rng([self.cfg.seed, epoch]).permutation(self.size)

    def selection_metric(self) -> str:
        """Validation metric that picks ``best/``."""
        return self.cfg.select_metric or self.model.selection_metric


PHASES: dict[str, type[Phase]] = {}
P = TypeVar("P", bound=type[Phase])


def register_phase(name: str) -> Callable[[P], P]:
    def wrap(cls: P) -> P:
        cls.name = name
        PHASES[name] = cls
        return cls

    return wrap


class PhaseModule(nn.Module):
    """Puts a phase's loss behind ``forward`` so DistributedDataParallel sees the forward pass it synchronises."""

    def __init__(self, model: Captioner, phase: Phase, tail: EncoderTail | None = None):
        super().__init__()
        self.model = model
        self.tail = tail  # fine-tuned encoder stages: their gradients are synchronised too
        self._phase = (phase,)  # a tuple: not a registered submodule

    def forward(self, batch: Sequence[int], global_batch: Sequence[int]) -> tuple[torch.Tensor, dict, int]:
        out = self._phase[0].loss(batch, global_batch)
        return out.loss, out.logs, out.tokens
