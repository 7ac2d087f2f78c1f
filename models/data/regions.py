"""Region features read from precomputed files, bottom-up style (AoANet §3.4 and X-LAN §4.1 use a variable number of
Faster R-CNN regions per image, each with its box in original-image pixels).

On-disk format: one folder holding one ``.npz`` per image, named after the image file without its extension
(Karpathy JSON ``filename``: ``COCO_val2014_000000391895.npz``, ``scene_000042.npz``) or, failing that, after
the numeric image id, COCO's where the data set records it (``391895.npz``, the layout of the common bottom-up
conversions)::

    features    [N, D] float16 / float32   one feature vector per region
    boxes       [N, 4] float               x1, y1, x2, y2 of each region in original-image pixels
    image_size  [2]    int                 (width, height) of the original image

``N`` may differ from image to image; ``D`` may not.  An optional ``regions.json`` in the folder describes where
the features came from (``format``, ``feat_dim``, ``source``, ``encoder``).  A row of the bottom-up-attention
TSV (``image_w``, ``image_h``, ``boxes``, ``features``) maps one to one onto a file: see :func:`save_regions`.

:class:`RegionStore` pads a batch to its largest ``N`` with a mask (docs/decisions.md#masked-items) and gives every
image a ``Geometry(kind="regions")`` with its own boxes, so heatmaps follow the regions (``region_sum`` / ``top1_box``).

:func:`write_scene_regions` (``captioner data regions``) makes such a folder for the generated scenes without a
detector: each object's box from its mask, with the frozen encoder's grid features averaged over the object's
mask, plus background regions.  It is a stand-in for a detector that exercises the real loading path.
"""

from __future__ import annotations

import io
import json
import zipfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from ..encoder import EncoderSpec, crop_box
from ..files import read_json_file, write_atomically
from ..progress import progress_bar
from ..protocol import Geometry, VisualBatch
from .features import extract_features
from .karpathy import CaptionedImage, load_karpathy

FORMAT = "attention-captioner-regions/1"
MANIFEST = "regions.json"


def save_regions(path: str | Path, features: np.ndarray, boxes: np.ndarray, image_size: tuple[int, int]) -> None:
    """Write one image's regions (atomically: an interrupted writer never leaves half a file)."""
    features, boxes = np.asarray(features), np.asarray(boxes, dtype=np.float32)
    _check(Path(path), features, boxes, np.asarray(image_size))
    buffer = io.BytesIO()
    np.savez(buffer, features=features, boxes=boxes, image_size=np.asarray(image_size, dtype=np.int64))
    write_atomically(Path(path), buffer.getvalue())


def read_regions(path: str | Path) -> tuple[np.ndarray, Geometry]:
    """One image's features ``[N, D]`` and its ``Geometry(kind="regions")``."""
    path = Path(path)
    try:
        # the file opened here, not by np.load: numpy leaves its own open when the zip is torn (BadZipFile)
        with open(path, "rb") as file, np.load(file, allow_pickle=False) as data:
            features, boxes, size = data["features"], data["boxes"].astype(np.float32), data["image_size"]
    except (ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:  # not an .npz, cut short, an array missing
        raise ValueError(f"{path} is not a region file (an .npz of features, boxes and image_size: {exc})") from None
    _check(path, features, boxes, size)
    return features, Geometry(kind="regions", image_size=(int(size[0]), int(size[1])), grid_hw=None, boxes=boxes)


def _check(path: Path, features: np.ndarray, boxes: np.ndarray, image_size: np.ndarray) -> None:
    if features.ndim != 2 or features.shape[0] < 1:
        raise ValueError(f"{path}: features must be [N >= 1, D], got shape {features.shape}")
    if boxes.shape != (features.shape[0], 4):
        raise ValueError(f"{path}: boxes must be [N, 4] = [{features.shape[0]}, 4], got {boxes.shape}")
    if image_size.shape != (2,):
        raise ValueError(f"{path}: image_size must be (width, height), got shape {image_size.shape}")


class RegionStore:
    """Precomputed region features for a list of images, looked up by ``CaptionedImage.key``."""

    def __init__(self, folder: str | Path, images: Sequence[CaptionedImage]):
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise FileNotFoundError(f"region feature folder {self.folder} does not exist")
        manifest = self.folder / MANIFEST
        self.manifest = read_json_file(manifest, "a region folder's manifest") if manifest.exists() else {}
        self.file_of: dict[str, Path] = {}
        missing = []
        for im in images:
            # the image file's stem, or its id: COCO's where the data set records it, since the bottom-up TSVs key
            # their rows on COCO's id, and never then Karpathy's number (imgid 0..123286), which names another
            # photo's file in such a folder about one time in five
            number = im.info.get("cocoid", im.image_id)
            candidates = (self.folder / f"{Path(im.path).stem}.npz", self.folder / f"{number}.npz")
            found = next((c for c in candidates if c.exists()), None)
            if found is None:
                missing.append(candidates[0].name)
            else:
                self.file_of[im.key] = found
        if missing:
            raise FileNotFoundError(f"{len(missing)} image(s) have no region file in {self.folder}, e.g. "
                                    f"{', '.join(missing[:3])} (named after the image file, the image id or COCO's id)")
        if "feat_dim" in self.manifest:
            feat_dim = self.manifest["feat_dim"]
            if not isinstance(feat_dim, int) or isinstance(feat_dim, bool) or feat_dim < 1:
                raise ValueError(f"{manifest}: feat_dim is {feat_dim!r}, not a feature width")
            self.feat_dim = feat_dim
        else:
            first = next(iter(self.file_of.values()), None)
            self.feat_dim = int(read_regions(first)[0].shape[1]) if first is not None else 0

    def batch(self, keys: Sequence[str]) -> VisualBatch:
        """Features padded with zeros to the largest ``N`` of the batch, mask True on real regions."""
        loaded = [read_regions(self.file_of[key]) for key in keys]
        for key, (features, _) in zip(keys, loaded):
            if features.shape[1] != self.feat_dim:
                raise ValueError(f"{self.file_of[key]}: {features.shape[1]}-d features, the folder's are "
                                 f"{self.feat_dim}-d")
        most = max(features.shape[0] for features, _ in loaded)
        feats = torch.zeros(len(keys), most, self.feat_dim)
        mask = torch.zeros(len(keys), most, dtype=torch.bool)
        for row, (features, _) in enumerate(loaded):
            feats[row, :features.shape[0]] = torch.from_numpy(features.astype(np.float32))
            mask[row, :features.shape[0]] = True
        return VisualBatch(feats, mask, [geometry for _, geometry in loaded])


# --------------------------------------------------------------------------------------------------------------
# A detector stand-in for the generated scenes
# --------------------------------------------------------------------------------------------------------------
def _coverage(region: np.ndarray, spec: EncoderSpec, image_size: tuple[int, int]) -> np.ndarray:
    """Fraction of every grid cell ``[H, W]`` covered by the boolean pixel mask ``region`` (original pixels),
    through the same resize / crop as the encoder's input."""
    rows, cols = spec.grid_hw
    picture = Image.fromarray(region.astype(np.uint8) * 255)
    return np.asarray(picture.resize((cols, rows), Image.BOX, box=crop_box(spec, image_size)), np.float32) / 255.0


def scene_regions(labels: np.ndarray, grid: np.ndarray, spec: EncoderSpec) -> tuple[np.ndarray, np.ndarray]:
    """Regions of one scene from its label mask ``[height, width]`` (0 = background, ``i + 1`` = object ``i``)
    and its grid features ``[H*W, D]``: per object, its mask's bounding box and the features averaged over the
    cells it covers (weighted by coverage); then the whole image (mean of all cells) and the background of each
    image quadrant.  Regions the encoder does not see (outside a centre crop) are left out."""
    height, width = labels.shape
    grid = grid.astype(np.float32)
    regions: list[tuple[np.ndarray, tuple[float, float, float, float]]] = []
    for label in range(1, int(labels.max()) + 1):
        ys, xs = np.nonzero(labels == label)
        if len(xs):
            box = (float(xs.min()), float(ys.min()), float(xs.max() + 1), float(ys.max() + 1))
            regions.append((labels == label, box))
    regions.append((np.ones_like(labels, dtype=bool), (0.0, 0.0, float(width), float(height))))
    half_w, half_h = width // 2, height // 2
    for x1, y1, x2, y2 in ((0, 0, half_w, half_h), (half_w, 0, width, half_h), (0, half_h, half_w, height),
                           (half_w, half_h, width, height)):
        inside = np.zeros_like(labels, dtype=bool)
        inside[y1:y2, x1:x2] = True
        regions.append((inside & (labels == 0), (float(x1), float(y1), float(x2), float(y2))))
    features, boxes = [], []
    for pixels, box in regions:
        weights = _coverage(pixels, spec, (width, height)).reshape(-1)
        if weights.sum() > 0:
            features.append(weights @ grid / weights.sum())
            boxes.append(box)
    return np.stack(features), np.asarray(boxes, dtype=np.float32)


def write_scene_regions(dataset: str | Path, out: str | Path, spec: EncoderSpec | None = None,
                        cache_dir: str | Path = ".cache/features", device: str = "cpu",
                        progress: bool = True) -> Path:
    """Region files for every image of a generated-scene dataset (``dataset_scenes.json``, with masks), from
    the frozen encoder's grid features; returns the folder.  Existing files are kept, so a rerun resumes."""
    dataset = Path(dataset)
    if dataset.is_dir():
        dataset = dataset / "dataset_scenes.json"
    spec = spec or EncoderSpec()
    images = load_karpathy(dataset)
    if not images or "mask" not in images[0].info:
        raise ValueError(f"{dataset} has no object masks: region stand-ins need the generated scenes")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    store = extract_features(images, spec, cache_dir, device=device, progress=progress)
    for im in progress_bar(images, desc="writing regions", unit="img", disable=not progress):
        target = out / f"{im.path.stem}.npz"
        if target.exists():
            continue
        labels = np.asarray(Image.open(dataset.parent / im.info["mask"]))
        features, boxes = scene_regions(labels, store.get([im.key])[0].numpy(), spec)
        save_regions(target, features.astype(np.float16), boxes, (labels.shape[1], labels.shape[0]))
    write_atomically(out / MANIFEST, json.dumps({
        "format": FORMAT, "feat_dim": store.feat_dim, "encoder": spec.to_json(),
        "source": "generated scenes: object masks pooled over frozen-encoder grid features, plus the whole image "
                  "and the background of each quadrant (a detector stand-in)"}, indent=2))
    return out
