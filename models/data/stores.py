"""Where training and evaluation get visual items from: one ``--features`` value → one store.

A *store* answers ``store.feat_dim`` and ``store.batch(keys)`` → :class:`~captioner.models.protocol.VisualBatch`.
This module sits above both kinds (the grid-feature cache of :mod:`.features` and the region files of
:mod:`.regions`), so neither imports the other's reader.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import torch

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
                       cache_dir: str | Path, device: str = "cpu", progress: bool = True,
                       mirrored: Sequence[CaptionedImage] = ()) -> VisualStore:
    """The store behind ``--features``: ``None`` or ``"grid"`` → frozen-encoder grid features of ``spec``
    (extracted once into ``cache_dir``); ``"regions:DIR"`` → precomputed region features in ``DIR``.  With
    ``mirrored`` images (grid only), a :class:`MirroredStore` that also holds their mirror images."""
    kind, _, where = (features or "grid").partition(":")
    if kind == "grid" and not where:
        store = extract_features(images, spec, cache_dir, device=device, progress=progress)
        if not mirrored:
            return store
        return MirroredStore(store, extract_features(mirrored, spec, cache_dir, device=device, progress=progress,
                                                     view="hflip"))
    if kind == "regions" and where:
        if mirrored:
            raise ValueError(f"region features ({features}) have no mirror images: --augment hflip needs the grid "
                             "encoder's features")
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


#: marks a key as the mirror image of its photo; a NUL cannot occur in the paths image keys come from
_MIRRORED = "\x00hflip"


def mirrored_key(key: str) -> str:
    """The key :class:`MirroredStore` answers with the mirror image's features of photo ``key``."""
    return key + _MIRRORED


class MirroredStore:
    """Photos and their mirror images in one store (``captioner train --augment hflip``): a key made by
    :func:`mirrored_key` is read from ``mirrored`` (features of the horizontally flipped photos, the ``"hflip"``
    view of :func:`~captioner.models.data.features.extract_features`), every other key from ``plain``."""

    def __init__(self, plain: VisualStore, mirrored: VisualStore):
        if plain.feat_dim != mirrored.feat_dim:
            raise ValueError(f"the mirrored store's features are {mirrored.feat_dim}-d, the photos' {plain.feat_dim}-d")
        self.plain, self.mirrored = plain, mirrored

    @property
    def feat_dim(self) -> int:
        return self.plain.feat_dim

    def batch(self, keys: Sequence[str]) -> VisualBatch:
        flipped = [key.endswith(_MIRRORED) for key in keys]
        if not any(flipped):
            return self.plain.batch(keys)
        rows = [[i for i, f in enumerate(flipped) if f == view] for view in (False, True)]
        parts = [self.plain.batch([keys[i] for i in rows[0]]),
                 self.mirrored.batch([keys[i].removesuffix(_MIRRORED) for i in rows[1]])]
        feats = torch.empty(len(keys), *parts[1].feats.shape[1:], dtype=parts[1].feats.dtype)
        mask = torch.empty(len(keys), *parts[1].mask.shape[1:], dtype=torch.bool)
        geometry = [None] * len(keys)
        for part, where in zip(parts, rows):  # each view's rows back to where their keys were asked
            if where:
                feats[where], mask[where] = part.feats, part.mask
                for i, g in zip(where, part.geometry):
                    geometry[i] = g
        return VisualBatch(feats, mask, geometry if all(g is not None for g in geometry) else [])
