"""Where training and evaluation get visual items from: one ``--features`` value → one store.

A *store* answers ``store.feat_dim`` and ``store.batch(keys)`` → :class:`~captioner.models.protocol.VisualBatch`.
This module sits above both kinds (the grid-feature cache of :mod:`.features` and the region files of
:mod:`.regions`), so neither imports the other's reader.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from ..encoder import EncoderSpec, EncoderTail
from ..protocol import VisualBatch
from .features import extract_features
from .karpathy import CaptionedImage
from .regions import RegionStore


class VisualStore(Protocol):
    """Where training and evaluation get visual items from, by image key (``CaptionedImage.key``)."""

    @property
    def feat_dim(self) -> int: ...

    def batch(self, keys: Sequence[str]) -> VisualBatch: ...


def open_feature_store(features: str | None, images: Sequence[CaptionedImage], spec: EncoderSpec,
                       cache_dir: str | Path, device: str = "cpu", progress: bool = True) -> VisualStore:
    """The store behind ``--features``: ``None`` or ``"grid"`` → frozen-encoder grid features of ``spec``
    (extracted once into ``cache_dir``); ``"regions:DIR"`` → precomputed region features in ``DIR``."""
    kind, _, where = (features or "grid").partition(":")
    if kind == "grid" and not where:
        return extract_features(images, spec, cache_dir, device=device, progress=progress)
    if kind == "regions" and where:
        return RegionStore(where, images)
    raise ValueError(f"--features must be 'grid' or 'regions:DIR', got {features!r}")


class TunedStore:
    """Features cached before the encoder's fine-tuned stages (``EncoderSpec.stop_stages``), passed through those
    stages on the way out, with gradients while training: the model sees what :class:`~captioner.models.encoder.
    GridEncoder` computes from the photo with the tuned weights (``captioner train --finetune-stages``)."""

    def __init__(self, inner: VisualStore, tail: EncoderTail):
        self.inner, self.tail = inner, tail

    @property
    def feat_dim(self) -> int:
        return self.tail.out_dim

    def batch(self, keys: Sequence[str]) -> VisualBatch:
        vis = self.inner.batch(keys).to(next(self.tail.parameters()).device)
        return VisualBatch(self.tail(vis.feats), vis.mask, vis.geometry)
