"""Cross-entropy training: teacher forcing (optionally scheduled sampling, Bengio et al. 2015, arXiv:1506.03099, as
AoANet, arXiv:1908.06954 §3.4, uses it) plus the auxiliary losses the model returns (SAT's doubly stochastic penalty, Xu
et al. 2015, arXiv:1502.03044 §4.2.1; SAT-hard's REINFORCE and entropy terms, so that SAT-hard trains in this phase
too, with no phase of its own: :mod:`captioner.models.sat_hard`).  The loop, validation, checkpoints and resume are
:mod:`captioner.models.training.loop`'s.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..data.stores import mirrored_key
from .attention_supervision import AttentionTargets, attention_supervision_loss
from .phase import BatchLoss, Phase, register_phase

__all__ = ["XEPhase", "mirror_words", "xe_loss"]

#: the words a mirror image swaps (``--augment hflip``): 127 of Flickr8k's 30,000 training captions hold one
MIRRORED_WORDS = {"left": "right", "right": "left"}


def mirror_words(tokens: Sequence[str]) -> list[str]:
    """A caption of the photo → the caption of its mirror image."""
    return [MIRRORED_WORDS.get(word, word) for word in tokens]


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
    ``max_train_len`` words and end in EOS.  With ``--augment hflip`` it visits each pair once too, in one of its
    two views: index ``i < size`` is pair ``i``, ``size + i`` its mirror image with the mirrored caption."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pairs = [(im.key, self.vocab.encode(ref, self.cfg.max_train_len))
                      for im in self.images for ref in im.references]
        #: ground-truth attention rows by (image key, reference index) (``--attention-supervision``), or None
        self.attention_targets: AttentionTargets | None = None
        # pairs of image i are pairs[starts[i]:starts[i + 1]]
        self.starts = np.cumsum([0] + [len(im.references) for im in self.images])
        self.image_of_pair = np.repeat(np.arange(len(self.images)), np.diff(self.starts))
        if self.cfg.augment == "hflip":
            self.pairs += [(mirrored_key(im.key), self.vocab.encode(mirror_words(ref), self.cfg.max_train_len))
                           for im in self.images for ref in im.references]

    @property
    def size(self) -> int:
        return int(self.starts[-1])

    def epoch_order(self, epoch: int) -> np.ndarray:
        """With ``group_by_image``, images in a seeded random order, each followed by all its captions (the
        captions of an image are consecutive, so they share batches); otherwise all pairs shuffled.  With
        ``--augment hflip`` each image is its mirror image (all its captions with it) in this epoch with
        probability 1/2, drawn from (seed, epoch) so that a resumed run sees the same views."""
        if not self.cfg.group_by_image:
            order = super().epoch_order(epoch)
        else:
            images = np.random.default_rng([self.cfg.seed, epoch]).permutation(len(self.images))
            order = np.concatenate([np.arange(self.starts[i], self.starts[i + 1]) for i in images])
        if self.cfg.augment != "hflip":
            return order
        mirrored = np.random.default_rng([self.cfg.seed, epoch, 1]).random(len(self.images)) < 0.5
        return order + self.size * mirrored[self.image_of_pair[order]]

    def loss(self, batch: Sequence[int], global_batch: Sequence[int] | None = None) -> BatchLoss:
        """Token-mean XE (plus the model's auxiliary losses) of this rank's ``batch``, weighted by its share of
        the global batch's tokens (captions, for the auxiliary terms) times the number of ranks: averaged over the
        ranks, that is the token-mean over the global batch, as on one process."""
        pairs = [self.pairs[i] for i in batch]
        # each distinct image is read and encoded once; captions point at their image's row
        images = {key: row for row, key in enumerate(dict.fromkeys(key for key, _ in pairs))}
        vis = self.store.batch(list(images)).to(self.device)
        rows = torch.tensor([images[key] for key, _ in pairs], device=self.device)
        targets = _pad([ids for _, ids in pairs], self.vocab.pad_id).to(self.device)
        if self.attention_targets is None:
            logprobs, aux = self.model.forward_xe(vis, targets, self.ss_prob, rows)
        else:
            logprobs, aux = self._supervised_forward(vis, targets, rows, batch)
        # the loss in float32 even under autocast: a bf16 log-probability sum loses the small terms
        loss = xe_loss(logprobs.float(), targets, self.vocab.pad_id, self.cfg.label_smoothing)
        tokens = sum(len(ids) for _, ids in pairs)
        token_share, item_share = 1.0, 1.0
        if global_batch is not None and self.world > 1:
            token_share = tokens * self.world / sum(len(self.pairs[i][1]) for i in global_batch)
            item_share = len(batch) * self.world / len(global_batch)
        total = loss * token_share + sum(value.float() * item_share for value in aux.values())
        return BatchLoss(total, {"xe": loss.item(), **{name: value.item() for name, value in aux.items()}}, tokens)

    def supervise_attention(self, targets: AttentionTargets) -> None:
        """Add ``--attention-supervision``'s term to every batch
        (:func:`.attention_supervision.checked_entities_folder` has made sure this model trains through its ``step``
        loop, which hands over each step's attention)."""
        self.attention_targets = targets

    def reference_of(self, pair: int) -> tuple[str, int]:
        """(image key, index among its references) of pair ``pair`` (``pairs[starts[i] + j]`` is reference ``j`` of
        image ``i``)."""
        image = int(self.image_of_pair[pair])
        return self.images[image].key, pair - int(self.starts[image])

    def _supervised_forward(self, vis, targets: torch.Tensor, rows: torch.Tensor, batch: Sequence[int]):
        """:meth:`Captioner.forward_xe` plus the supervised-attention term, from the same teacher-forced steps."""
        logprobs, aux, attention = self.model.forward_xe_attended(vis, targets, self.ss_prob, rows)
        beta, supervised = self.attention_targets.batch([self.reference_of(i) for i in batch], targets.shape[1],
                                                        self.device)
        aux["attention_supervision"] = (self.cfg.attention_supervision_weight
                                        * attention_supervision_loss(attention, beta, supervised))
        return logprobs, aux
