"""Shared data structures and the model protocol (docs/decisions.md#model-protocol-and-alignment-rule).

Every captioner subclasses :class:`Captioner` and supplies ``encode`` / ``init_state`` / ``step`` /
``forward_xe``; decoding (greedy, sampling, beam search) lives once in :mod:`captioner.models.decoding` and only ever
talks to a model through this protocol.  Encoder and decoder states are plain ``dict[str, Tensor]`` whose
tensors all have the (batch × beam) rows on dim 0, so :func:`~captioner.models.decoding.expand_rows` and
:meth:`Captioner.reorder` are generic and no model needs to hand-write beam bookkeeping.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import numpy as np
import torch
from torch import Tensor, nn

EncState = dict[str, Tensor]
DecState = dict[str, Tensor]


@dataclass
class Geometry:
    """Where each visual item sits in the ORIGINAL image (docs/decisions.md#geometry-of-visual-items).

    ``boxes`` are ``x1, y1, x2, y2`` in original-image pixels; for a grid, item ``i`` is the row-major cell
    ``(i // W, i % W)`` mapped back through the resize/crop of preprocessing.
    """

    kind: Literal["grid", "regions"]
    image_size: tuple[int, int]  # (width, height) of the original image
    grid_hw: tuple[int, int] | None
    boxes: np.ndarray  # [N, 4] float32

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "image_size": list(self.image_size),
            "grid_hw": list(self.grid_hw) if self.grid_hw else None,
            # rounded in float64, as JSON writes it: float32 rounded to 2 places is 56.380001068115234 there
            "boxes": np.round(np.asarray(self.boxes, dtype=np.float64), 2).tolist(),
        }


@dataclass
class VisualBatch:
    """Padded visual items for a batch of images: features ``[B, N, F]``, mask ``[B, N]`` (True = real item)."""

    feats: Tensor
    mask: Tensor
    geometry: list[Geometry] = field(default_factory=list)

    def __post_init__(self) -> None:
        # not while tracing (an export): a check of the example's shapes is no part of the graph
        if not torch.jit.is_tracing() and (self.feats.dim() != 3 or self.mask.shape != self.feats.shape[:2]):
            raise ValueError(f"visual features are [batch, items, channels] with a [batch, items] mask, got "
                             f"{list(self.feats.shape)} and {list(self.mask.shape)}")

    @classmethod
    def from_features(cls, feats: Tensor, geometry: list[Geometry] | None = None) -> "VisualBatch":
        mask = torch.ones(feats.shape[:2], dtype=torch.bool, device=feats.device)
        return cls(feats=feats, mask=mask, geometry=geometry or [])

    def to(self, device: torch.device | str) -> "VisualBatch":
        return VisualBatch(self.feats.to(device), self.mask.to(device), self.geometry)


@dataclass
class AttnRecord:
    """The attention that fed the word predicted at this step (docs/decisions.md#model-protocol-and-alignment-rule).

    ``primary`` is ``[B', N]`` non-negative weights over the ``N`` visual items of the batch, each row summing to 1
    and zero on masked (padding) items (heatmaps, grounding and the ensemble's mean read it as a distribution); a
    model that attends to nothing returns rows uniform over its image's unmasked items.  ``extras`` carries
    model-specific maps (e.g. ``beta_gate`` [B', 1] for SAT, ``input_attention`` [B', N] for SparseCap).
    """

    primary: Tensor
    extras: dict[str, Tensor] = field(default_factory=dict)


def index_rows(state: dict[str, Tensor], index: Tensor) -> dict[str, Tensor]:
    """Select rows (dim 0) of every tensor in a state dict — the one primitive behind expand and reorder."""
    return {key: value.index_select(0, index) for key, value in state.items()}


def configured_normaliser(model_config: Mapping[str, Any]) -> str:
    """The attention normaliser a model's constructor arguments name (SparseCap's ``attention``: softmax, sparsemax
    or TVmax), softmax for models that take none; read from a checkpoint's ``config.json`` without building it."""
    configured = model_config.get("attention")
    return configured if isinstance(configured, str) else "softmax"


class Captioner(nn.Module):
    """Base class of every captioner (docs/decisions.md#model-protocol-and-alignment-rule).

    ``arch`` is the registry name (``@register(name)`` sets it); subclasses set ``attention_kind`` (how the primary
    map should be read) and implement the abstract methods and :meth:`config`, whose dict rebuilds the model
    (``create(arch, **config)``: a checkpoint stores it). ``vocab_size``, ``bos_id``, ``eos_id`` and ``pad_id`` come
    from the vocabulary the model was built with: a constructor takes the ids as ``**ids`` and passes them on to
    this one's (loading passes them). A constructor must run on PyTorch's meta device (it must not read
    a tensor's values: ``.item()``, ``.tolist()``): loading builds the model there first to check a checkpoint's
    shapes before allocating anything. A new model file is imported in :mod:`.zoo`, which registers it."""

    arch: ClassVar[str] = ""
    attention_kind: ClassVar[str] = "attention"
    #: metric used to pick the best checkpoint during XE training (docs/decisions.md#checkpoint-selection-metric)
    selection_metric: ClassVar[str] = "CIDEr-D"

    def __init__(self, vocab_size: int, feat_dim: int, *, pad_id: int = 0, bos_id: int = 1, eos_id: int = 2):
        super().__init__()
        self.vocab_size = vocab_size
        self.feat_dim = feat_dim
        self.pad_id, self.bos_id, self.eos_id = pad_id, bos_id, eos_id

    # -- protocol -----------------------------------------------------------------------------------------
    def encode(self, vis: VisualBatch) -> EncState:
        raise NotImplementedError

    def init_state(self, enc: EncState) -> DecState:
        raise NotImplementedError

    def step(self, prev_tokens: Tensor, state: DecState, enc: EncState) -> tuple[Tensor, DecState, AttnRecord]:
        """One decoding step: log-probs ``[B', V]`` for the next word, the new state, and its attention."""
        raise NotImplementedError

    def forward_xe(
        self, vis: VisualBatch, captions: Tensor, ss_prob: float = 0.0, rows: Tensor | None = None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Teacher-forced log-probs ``[B, T, V]`` for ``captions`` ``[B, T]`` (BOS-less targets ending in EOS)
        plus auxiliary losses.  The default runs ``step`` in a loop, which is what LSTM models want.

        ``rows`` (``[B]``) says which image of ``vis`` each caption belongs to, when a batch holds several captions
        of one image: the image is then encoded once (see :meth:`encode_rows`)."""
        logprobs, aux, _ = self.forward_xe_attended(vis, captions, ss_prob, rows)
        return logprobs, aux

    def forward_xe_attended(
        self, vis: VisualBatch, captions: Tensor, ss_prob: float = 0.0, rows: Tensor | None = None
    ) -> tuple[Tensor, dict[str, Tensor], Tensor]:
        """:meth:`forward_xe` of the ``step`` loop, plus the primary attention ``[B, T, N]`` of every step (the row
        that fed each word: what ``captioner train --attention-supervision`` trains)."""
        logprobs, records, _ = self.teacher_force(vis, captions, ss_prob, rows)
        attention = torch.stack([r.primary for r in records], dim=1)
        return logprobs, self.auxiliary_losses(attention, captions != self.pad_id), attention

    def teacher_force(self, vis: VisualBatch, captions: Tensor, ss_prob: float = 0.0,
                      rows: Tensor | None = None) -> tuple[Tensor, list[AttnRecord], EncState]:
        """The ``step`` loop behind :meth:`forward_xe`: log-probs ``[B, T, V]``, the attention record of every
        step and the encoder state, for models whose training objective needs more than the primary attention
        (SAT-hard's REINFORCE terms)."""
        enc = self.encode_rows(vis, rows)
        state = self.init_state(enc)
        batch, steps = captions.shape
        prev = torch.full((batch,), self.bos_id, dtype=torch.long, device=captions.device)
        outputs, records = [], []
        for t in range(steps):
            logprobs, state, attn = self.step(prev, state, enc)
            outputs.append(logprobs)
            records.append(attn)
            prev = captions[:, t]
            if ss_prob > 0.0 and t + 1 < steps:
                # scheduled sampling (Bengio et al.): feed the model's own sample with probability ss_prob
                use_sample = torch.rand(batch, device=captions.device) < ss_prob
                sampled = torch.multinomial(logprobs.detach().exp(), 1).squeeze(1)
                prev = torch.where(use_sample, sampled, prev)
        return torch.stack(outputs, dim=1), records, enc

    def encode_rows(self, vis: VisualBatch, rows: Tensor | None = None) -> EncState:
        """:meth:`encode` each image of ``vis`` once, then give caption ``i`` the encoding of image ``rows[i]``.

        Captions grouped by image (``captioner train --group-by-image``, as the AoANet and X-LAN codes batch
        ``seq_per_img`` captions of each image) then pay for a refining encoder once per image, not per caption."""
        self.check_visual(vis)
        enc = self.encode(vis)
        return enc if rows is None else index_rows(enc, rows)

    def check_visual(self, vis: VisualBatch) -> None:
        """Refuse features of another width than the model's (another encoder's): the first linear layer's
        "mat1 and mat2 shapes cannot be multiplied" named neither."""
        if vis.feats.shape[-1] != self.feat_dim:
            raise ValueError(f"{self.arch or type(self).__name__} takes {self.feat_dim}-channel features, got "
                             f"{vis.feats.shape[-1]} (features of another encoder?)")

    def auxiliary_losses(self, attention: Tensor, token_mask: Tensor) -> dict[str, Tensor]:
        """Extra training losses from the per-step attention ``[B, T, N]``; none by default."""
        return {}

    # -- generic beam bookkeeping (expanding an image to its rows is decoding.expand_rows, for every model) -----
    def reorder(self, state: DecState, index: Tensor) -> DecState:
        """Follow beam back-pointers: row ``i`` of the new state is row ``index[i]`` of the old one."""
        return index_rows(state, index)

    def config(self) -> dict[str, Any]:
        """Constructor keyword arguments, stored in the checkpoint's config.json."""
        raise NotImplementedError

    @property
    def attention_name(self) -> str:
        """The normaliser of the exported attention, as ``GET /models`` names it: the configured one of models that
        take one (SparseCap's ``attention``), else softmax."""
        return configured_normaliser(self.config())

    def area_boxes(self, grid_hw: tuple[int, int] | None = None) -> Tensor | None:
        """``[|R|, 4]`` inclusive cell boxes ``(r1, c1, r2, c2)`` that index the ``areas`` extra of :meth:`step`, for
        models that attend over areas (Area attention, arXiv:1810.10126); None for everyone else."""
        return None

    def export_blocker(self) -> str | None:
        """Why this model (with this configuration) cannot be exported to ONNX, or None to let the exporter try.

        The exporter verifies every graph against PyTorch anyway; override this to give a clearer reason up front
        (e.g. decoding that samples, or an iterative solver whose number of iterations depends on the data)."""
        return None


def check_step_contract(model: Captioner, grid_hw: tuple[int, int] = (3, 3)) -> None:
    """Run the protocol once (``encode``, ``init_state``, ``step``, ``reorder``) on random features of two images on a
    tiny square grid (TVmax infers its shape from the count), the second with its last two items padding (masked,
    as a batch of images with fewer regions has), and refuse (``ValueError``) the first rule ``model`` breaks, in
    words that name it: the states' (batch × beam) rows on dim 0, ``step``'s three results, log-probs ``[B', V]``,
    and an :class:`AttnRecord` whose ``primary`` is a distribution over the unmasked items. ``captioner train``
    calls it before reading any data, where a broken model otherwise failed after an epoch, in ``reorder`` or in the
    service."""
    rows, cols = grid_hw
    items, batch = rows * cols, 2
    cell = np.arange(items)
    boxes = np.stack([cell % cols, cell // cols, cell % cols + 1, cell // cols + 1], 1).astype(np.float32) * 8
    vis = VisualBatch.from_features(torch.randn(batch, items, model.feat_dim),
                                    [Geometry("grid", (8 * cols, 8 * rows), grid_hw, boxes)] * batch)
    vis.mask[1, -2:] = False
    with torch.no_grad():
        enc = model.encode(vis)
        _check_rows(enc, batch, "encode's state")
        state = model.init_state(enc)
        _check_rows(state, batch, "init_state's state")
        answer = model.step(torch.full((batch,), model.bos_id, dtype=torch.long), state, enc)
        if not (isinstance(answer, tuple) and len(answer) == 3):
            raise ValueError("step must return (log-probs, new state, AttnRecord)")
        logprobs, state, attention = answer
        if not isinstance(logprobs, Tensor) or tuple(logprobs.shape) != (batch, model.vocab_size):
            raise ValueError(f"step's log-probs must be [rows, vocab_size] = {[batch, model.vocab_size]}, got "
                             f"{list(getattr(logprobs, 'shape', [])) or type(logprobs).__name__}")
        if not isinstance(attention, AttnRecord):
            raise ValueError(f"step's attention must be an AttnRecord (its primary row and extras), got "
                             f"{type(attention).__name__}")
        primary = attention.primary
        if tuple(primary.shape) != (batch, items):
            raise ValueError(f"the attention row must hold one weight per visual item, [rows, items] = "
                             f"{[batch, items]}, got {list(primary.shape)}")
        if bool((primary < 0).any()) or not torch.allclose(primary.float().sum(-1), torch.ones(batch), atol=1e-3):
            raise ValueError("each attention row must be a distribution over the items (non-negative, summing to "
                             "1; uniform over the unmasked items for a model that attends to nothing)")
        if bool((primary[~vis.mask] != 0).any()):
            raise ValueError("the attention row must put no weight on masked items (VisualBatch.mask False: "
                             "padding, not the image); a model that attends to nothing is uniform over the others")
        _check_rows(state, batch, "step's state")
        _check_rows(model.reorder(state, torch.tensor([1, 0])), batch, "reorder's state")


def _check_rows(state: Any, batch: int, where: str) -> None:
    if not isinstance(state, dict):
        raise ValueError(f"{where} must be a dict of tensors, got {type(state).__name__}")
    for key, value in state.items():
        if not isinstance(value, Tensor) or value.dim() == 0 or value.shape[0] != batch:
            shape = list(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise ValueError(f"{where} {key!r} must be a tensor with the (batch × beam) rows on dim 0, here "
                             f"{batch}; got {shape} (beam search expands and reorders every state by its rows)")
