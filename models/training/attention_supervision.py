"""Supervised attention from phrase boxes (``captioner train --attention-supervision entities:DIR``).

Liu, Mao, Sha & Yuille, "Attention Correctness in Neural Image Captioning" (AAAI 2017, arXiv:1605.09553), train
the attention of the words that name a boxed region towards that region ("strong supervision"): to the caption's
cross-entropy they add, for every such word, a cross-entropy between a ground-truth attention map ``β_t`` (the
region's mask on the attention grid, normalised to sum to 1) and the model's map ``α_t``.  Here ``β_t`` is the
union of the phrase chain's Flickr30k Entities boxes (Plummer et al., arXiv:1505.04870) laid on the photo through
the heatmaps' own cell geometry, each cell weighted by the share of the boxes' pixels it holds, and every word of a
boxed phrase is supervised ("a pink dress": all three), on the row that fed its prediction (the decoder's alignment
rule, the row the grounding measure of :mod:`..evaluation.phrase_grounding` scores).  The term is written as the
Kullback-Leibler divergence ``Σ_i β_i log(β_i / α_i)``: the same gradient as the cross-entropy, and 0 when the map
matches.  Choices: docs/decisions.md, "Flickr8k: supervised attention from the Entities boxes".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from ..data.entities import EntitiesDataset
from ..data.karpathy import CaptionedImage
from ..encoder import EncoderSpec, grid_geometry
from ..evaluation.grounding import cell_labels, cell_pixels
from ..evaluation.phrase_grounding import phrase_mask
from ..images import picture_size
from ..progress import progress_bar
from ..protocol import Captioner
from ..registry import MODELS

#: a weight this small stands for 0 inside the logarithm of α (sparse normalisers put exact zeros there)
_FLOOR = 1e-8


def attention_supervision_loss(attention: Tensor, target: Tensor, supervised: Tensor) -> Tensor:
    """Mean over the supervised words of ``KL(β_t ‖ α_t) = Σ_i β_{t,i} (log β_{t,i} − log α_{t,i})``.

    ``attention`` ``[B, T, N]`` the model's rows α_t, ``target`` ``[B, T, N]`` the ground-truth rows β_t,
    ``supervised`` ``[B, T]`` bool: which words have one.  0 when no word of the batch has a target."""
    if not bool(supervised.any()):
        return attention.sum() * 0.0  # keeps the graph (and DDP's view of the parameters) the same every step
    dtype = torch.promote_types(attention.dtype, torch.float32)  # float32 at least: bf16 logarithms lose the terms
    alpha, beta = attention[supervised].to(dtype), target[supervised].to(dtype)
    inside = beta > 0
    kl = torch.where(inside, beta * (beta.clamp_min(_FLOOR).log() - alpha.clamp_min(_FLOOR).log()),
                     torch.zeros_like(beta))
    return kl.sum(-1).mean()


def checked_entities_folder(cfg) -> str:
    """The Entities folder of ``cfg.attention_supervision`` (``entities:DIR``), once the rest of the run can use
    it: the xe phase, the grid's cells (the boxes are laid on them), the photos as they are (no mirror images) and a
    model whose training runs its decoding step, which hands over each word's attention.  ``cfg`` is resolved as
    :func:`~captioner.models.training.loop.prepare_run` hands it over (its model and features named)."""
    kind, _, where = cfg.attention_supervision.partition(":")
    if kind != "entities" or not where:
        raise ValueError(f"--attention-supervision takes entities:DIR (a Flickr30k Entities folder), got "
                         f"{cfg.attention_supervision!r}")
    try:
        EntitiesDataset(where)  # a folder without Sentences/ and Annotations/ is named here, before any work
    except FileNotFoundError as exc:
        raise ValueError(f"--attention-supervision: {exc}") from None
    if not cfg.attention_supervision_weight > 0:
        raise ValueError(f"--attention-supervision-weight must be positive, got {cfg.attention_supervision_weight}")
    if cfg.phase != "xe":
        raise ValueError(f"--attention-supervision adds a term to the xe phase's loss, not to --phase {cfg.phase}'s")
    if cfg.features != "grid":
        raise ValueError(f"--attention-supervision lays the boxes on the grid's cells; --features {cfg.features} "
                         "has none")
    if cfg.augment != "none":
        raise ValueError("--attention-supervision has boxes for the photos as they are, not their mirror images: "
                         "leave out --augment")
    model = MODELS.get(cfg.model)
    if model is not None and model.forward_xe is not Captioner.forward_xe:
        raise ValueError(f"--attention-supervision trains the attention each decoding step returns; {cfg.model} "
                         "trains through a forward pass of its own (choose sat, aoanet, xlan or sparsecap)")
    return where


@dataclass
class AttentionTargets:
    """The ground-truth rows of every training caption that has some: ``(image key, reference index)`` →
    ``{token position: β [N] float32}``, and counts for the run's log."""

    rows: dict[tuple[str, int], dict[int, np.ndarray]] = field(default_factory=dict)
    items: int = 0
    captions: int = 0  # training captions looked at
    aligned: int = 0  # of them, found word for word among their photo's Entities captions
    words: int = 0  # supervised words

    def batch(self, references: Sequence[tuple[str, int]], steps: int, device: torch.device
              ) -> tuple[Tensor, Tensor]:
        """``target`` ``[B, steps, N]`` and ``supervised`` ``[B, steps]`` for captions given by (key, index)."""
        target = torch.zeros(len(references), steps, self.items)
        supervised = torch.zeros(len(references), steps, dtype=torch.bool)
        for row, reference in enumerate(references):
            for position, beta in self.rows.get(reference, {}).items():
                if position < steps:
                    target[row, position] = torch.from_numpy(beta)
                    supervised[row, position] = True
        return target.to(device), supervised.to(device)

    def summary(self) -> str:
        return (f"attention supervision: {self.aligned} of {self.captions} training captions found in the Entities "
                f"captions, {self.words} words with a box")


def entities_attention_targets(images: Sequence[CaptionedImage], entities_dir: str, spec: EncoderSpec,
                               max_len: int, progress: bool = False) -> AttentionTargets:
    """The ground-truth rows of ``images``' reference captions on the grid of ``spec``.

    A reference is matched to the photo's Entities caption with the same tokens (Entities' captions are Flickr8k's
    up to small spelling fixes; one that differs is left unsupervised, not guessed at); its boxed phrases give the
    rows of their words, the first ``max_len`` positions (training captions are cut there)."""
    entities = EntitiesDataset(entities_dir)
    out = AttentionTargets(items=spec.grid_hw[0] * spec.grid_hw[1])
    labels_of: dict[tuple[int, int], np.ndarray] = {}  # every photo of one size has the same cells
    for image in progress_bar(images, desc="attention targets", disable=not progress):
        out.captions += len(image.references)
        entity = entities.load(image.path)
        if entity is None:
            continue
        size = picture_size(image.path)  # as the model sees the photo: after its EXIF orientation
        if size not in labels_of:
            labels_of[size] = cell_labels(grid_geometry(spec, size), size)
        by_tokens = {}
        for sentence in entity.sentences:
            tokens, spans = sentence.tokenized()
            by_tokens.setdefault(tuple(tokens), (sentence, spans))
        betas: dict[str, np.ndarray | None] = {}  # chain → its row (None: no box on the photo)
        for index, reference in enumerate(image.references):
            match = by_tokens.get(tuple(reference))
            if match is None:
                continue
            out.aligned += 1
            rows: dict[int, np.ndarray] = {}
            sentence, spans = match
            for phrase, (start, end) in zip(sentence.phrases, spans):
                if phrase.chain not in betas:
                    betas[phrase.chain] = _chain_row(entity.annotation, phrase.chain, size, labels_of[size],
                                                     out.items)
                beta = betas[phrase.chain]
                if beta is not None:
                    rows.update({position: beta for position in range(start, min(end, max_len))})
            if rows:
                out.rows[(image.key, index)] = rows
                out.words += len(rows)
    return out


def _chain_row(annotation, chain: str, size: tuple[int, int], labels: np.ndarray, items: int) -> np.ndarray | None:
    """β of one chain: each cell's share of the pixels inside the union of the chain's boxes."""
    if not annotation.boxes.get(chain):
        return None
    _, inside = cell_pixels(labels, phrase_mask(annotation, (chain,), size), items)
    return (inside / inside.sum()).astype(np.float32) if inside.sum() > 0 else None
