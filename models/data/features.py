"""On-disk cache of frozen-encoder grid features for training and evaluation.

Features are stored as one float16 ``.npy`` per (encoder spec, image list), memory-mapped at read time.  The
file is filled in chunks next to a ``.progress`` counter, so an interrupted extraction resumes where it stopped,
and it only gets its final name once complete.

Training and evaluation reach this cache, or precomputed region features, through
:func:`captioner.models.data.stores.open_feature_store`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from ..encoder import EncoderSpec, GridEncoder, load_image, preprocess
from ..protocol import VisualBatch
from .karpathy import CaptionedImage


class FeatureStore:
    def __init__(self, array: np.ndarray, keys: Sequence[str]):
        self.array = array
        self.row_of = {key: row for row, key in enumerate(keys)}

    @property
    def feat_dim(self) -> int:
        return int(self.array.shape[-1])

    def get(self, keys: Sequence[str]) -> torch.Tensor:
        rows = [self.row_of[k] for k in keys]
        return torch.from_numpy(np.asarray(self.array[rows], dtype=np.float32))

    def batch(self, keys: Sequence[str]) -> VisualBatch:
        """Every image has the same grid, so nothing is padded and the mask is all True."""
        return VisualBatch.from_features(self.get(keys))


#: EncoderSpec fields added after feature caches were first written, with the value all earlier caches were made
#: with: at that value a field stays out of the cache key, so existing caches stay valid
_LATER_FIELDS = {"grid_stride": 32}


def _cache_name(spec: EncoderSpec, keys: Sequence[str]) -> str:
    fields = {k: v for k, v in spec.to_json().items() if _LATER_FIELDS.get(k, object()) != v}
    digest = hashlib.sha256(json.dumps([fields, list(keys)]).encode()).hexdigest()[:16]
    return f"{spec.backbone}-{spec.layer}-{spec.image_size}-{digest}"


def extract_features(images: Sequence[CaptionedImage], spec: EncoderSpec, cache_dir: str | Path,
                     batch_size: int = 32, device: str = "cpu", encoder: GridEncoder | None = None,
                     progress: bool = True) -> FeatureStore:
    keys = [im.key for im in images]
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    final = cache_dir / f"{_cache_name(spec, keys)}.npy"
    if final.exists():
        return FeatureStore(np.load(final, mmap_mode="r"), keys)

    encoder = (encoder or GridEncoder(spec)).to(device)
    rows, cols = spec.grid_hw
    shape = (len(images), rows * cols, encoder.feat_dim)
    partial, counter = final.with_suffix(".partial.npy"), final.with_suffix(".progress")
    done = int(counter.read_text()) if partial.exists() and counter.exists() else 0
    mode = "r+" if done else "w+"
    array = np.lib.format.open_memmap(partial, mode=mode, dtype=np.float16, shape=shape)
    with tqdm(total=len(images), initial=done, desc="encoding images", unit="img", disable=not progress) as bar:
        for start in range(done, len(images), batch_size):
            chunk = images[start:start + batch_size]
            pixels = torch.stack([preprocess(load_image(im.path), spec)[0] for im in chunk]).to(device)
            array[start:start + len(chunk)] = encoder(pixels).cpu().numpy().astype(np.float16)
            array.flush()
            counter.write_text(str(start + len(chunk)))
            bar.update(len(chunk))
    del array
    partial.replace(final)
    counter.unlink(missing_ok=True)
    return FeatureStore(np.load(final, mmap_mode="r"), keys)
