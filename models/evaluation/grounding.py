"""Attention grounding on generated scenes: does the attention behind a word that names an object fall on it?

For every word of a generated caption that names objects of the scene correctly — the colour adjective and the
shape noun of a "colour shape" pair whose colour and shape some object has — the attention row aligned with that
word (the row that fed its prediction, the decoder's alignment rule) is spread over the image's pixels through the
item geometry the heatmaps use (:mod:`..rendering.heatmaps`: grid cells through the encoder's resize/crop, or
region boxes), giving a pixel distribution ``P`` (sums to 1 over the image).  Against the mask ``M`` of the objects
the word names (all of them: "two red circles" names both):

* **mass in object** ``Σ_{p∈M} P(p)`` — the fraction of attention inside the mask;
* **pointing-game hit** (Zhang et al., "Top-down Neural Attention by Excitation Backprop", arXiv:1608.00507):
  whether the maximum of ``P`` falls inside the object; when the maximum is a plateau (a whole grid cell, or a
  uniform map) the hit counts the plateau's fraction inside the mask, the expected hit of a random tie-break.
  Without the 15-pixel tolerance of their protocol (TorchRay's ``pointing_game.py``): stricter than published
  pointing-game numbers, for comparisons within this project;
* **area-normalised ratio** ``mass / (|M| / |image|)``: 1 is what attention spread evenly over the image scores.

Statistics are pooled over words and carry 95 % percentile-bootstrap intervals that resample *images* (the words
of one caption are not independent).  Two chance controls go through exactly the same code: a **uniform** map
(equal weight on every visual item) and attention **from a different image** (the same model's row for a word of
the same class in the next image of the list that has one), scored against this image's mask.

The words come from the model's own beam-search caption (what a user sees), so a model that names fewer objects
is scored on fewer words; ``words`` in each row says how many.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from ..ensemble import Ensemble, mean_of
from ..protocol import Geometry
from ..rendering.heatmaps import heatmap
from .bootstrap import percentile_interval, resampled_ratios
from .evaluate import visual_batches

WORD_CLASSES = ("colour", "shape")
CONTROLS = ("model", "uniform", "other image")
STATISTICS = ("mass", "pointing", "ratio")


# ---------------------------------------------------------------------------------------------------------------
# One map against one mask
# ---------------------------------------------------------------------------------------------------------------
def pixel_distribution(weights: Sequence[float] | np.ndarray, geometry: Geometry,
                       size: tuple[int, int] | None = None) -> np.ndarray:
    """Attention weights over visual items → a distribution over the pixels of an image of ``size`` (width,
    height; default the geometry's image size), ``[H, W]`` summing to 1 (all zeros if the weights are).

    Grid items go through :func:`..rendering.heatmaps.heatmap` in ``grid_blocks`` mode (each pixel takes its
    cell's weight; every cell covers the same area, so this is weight spread evenly over the cell).  Region items
    spread each weight evenly over its box, ``Σ_i w_i 1[p ∈ box_i] / |box_i|``, so a large box is not counted as
    more attention than a small one.
    """
    weights = np.asarray(weights, dtype=np.float64)
    if np.any(weights < 0) or not np.all(np.isfinite(weights)):
        raise ValueError("attention weights must be finite and non-negative")
    width, height = size or geometry.image_size
    if geometry.kind == "grid":
        scale = width / geometry.image_size[0]
        density = heatmap(weights, geometry, "grid_blocks", size=(width, height), scale=scale).astype(np.float64)
    else:
        sx, sy = width / geometry.image_size[0], height / geometry.image_size[1]
        density = np.zeros((height, width), np.float64)
        for w, (x1, y1, x2, y2) in zip(weights, np.asarray(geometry.boxes, np.float64)):
            c1, c2 = max(int(round(x1 * sx)), 0), min(int(round(x2 * sx)), width)
            r1, r2 = max(int(round(y1 * sy)), 0), min(int(round(y2 * sy)), height)
            if w > 0 and c2 > c1 and r2 > r1:
                density[r1:r2, c1:c2] += w / ((c2 - c1) * (r2 - r1))
    total = density.sum()
    return density / total if total > 0 else density


def score_map(distribution: np.ndarray, mask: np.ndarray) -> dict[str, float]:
    """Mass in object, pointing-game hit and area-normalised ratio of one pixel distribution against one boolean
    mask of the same shape (see the module docstring)."""
    if distribution.shape != mask.shape:
        raise ValueError(f"distribution {distribution.shape} and mask {mask.shape} differ in shape")
    mask = mask.astype(bool)
    share = mask.mean()
    if share == 0:
        raise ValueError("the object mask is empty")
    mass = float(distribution[mask].sum())
    peak = distribution.max()
    if peak <= 0:
        return {"mass": 0.0, "pointing": 0.0, "ratio": 0.0}
    top = distribution >= peak * (1 - 1e-6)  # the maximum, or its plateau
    pointing = float((top & mask).sum() / top.sum())
    return {"mass": mass, "pointing": pointing, "ratio": mass / float(share)}


def cell_labels(geometry: Geometry, size: tuple[int, int]) -> np.ndarray:
    """``[H, W]`` the grid cell (1..N) each pixel of an image of ``size`` (width, height) falls in, read off the
    heatmap itself (``grid_blocks`` of the weights 1..N), so the geometry is the heatmaps' by construction."""
    items = len(geometry.boxes)
    return np.rint(heatmap(np.arange(1, items + 1), geometry, "grid_blocks", size=size,
                           scale=size[0] / geometry.image_size[0]) * items).astype(np.int64)


def cell_pixels(labels: np.ndarray, mask: np.ndarray, items: int) -> tuple[np.ndarray, np.ndarray]:
    """Per grid cell of :func:`cell_labels` (``items`` of them), its pixels and those of them inside ``mask``:
    ``[N]`` each."""
    pixels = np.bincount(labels.ravel(), minlength=items + 1)[1:].astype(np.float64)
    inside = np.bincount(labels[mask.astype(bool)], minlength=items + 1)[1:].astype(np.float64)
    return pixels, inside


def score_rows(rows: np.ndarray, geometry: Geometry, mask: np.ndarray) -> list[dict[str, float]]:
    """:func:`score_map` of :func:`pixel_distribution` of every row of ``rows`` ``[K, N]`` against one mask (on an
    image of the mask's size), with the same results computed per grid cell rather than per pixel.

    Under ``pixel_distribution`` every pixel takes its cell's weight, so with ``n_c`` the pixels of cell ``c`` and
    ``m_c`` those inside the mask: mass ``= Σ w_c m_c / Σ w_c n_c``, and the maximum is the plateau of the cells of
    largest weight (pointing ``= Σ_top m_c / Σ_top n_c``), both counted by :func:`cell_pixels`.  Region items
    overlap and take the pixel path."""
    rows = np.atleast_2d(np.asarray(rows, np.float64))
    height, width = mask.shape
    if geometry.kind != "grid":
        return [score_map(pixel_distribution(row, geometry, (width, height)), mask) for row in rows]
    if np.any(rows < 0) or not np.all(np.isfinite(rows)):
        raise ValueError("attention weights must be finite and non-negative")
    share = float(mask.mean())
    if share == 0:
        raise ValueError("the object mask is empty")
    pixels, inside = cell_pixels(cell_labels(geometry, (width, height)), mask, rows.shape[1])
    out = []
    for row in rows:
        total = row @ pixels
        if total <= 0:
            out.append({"mass": 0.0, "pointing": 0.0, "ratio": 0.0})
            continue
        mass = float(row @ inside / total)
        seen = pixels > 0
        top = seen & (row >= row[seen].max() * (1 - 1e-6))
        out.append({"mass": mass, "pointing": float(inside[top].sum() / pixels[top].sum()), "ratio": mass / share})
    return out


# ---------------------------------------------------------------------------------------------------------------
# Which words name which objects
# ---------------------------------------------------------------------------------------------------------------
def _shape_forms(shape: str) -> set[str]:
    return {shape, shape + ("es" if shape.endswith("s") else "s")}


def grounded_words(tokens: Sequence[str], objects: Sequence[dict]) -> list[tuple[int, str, list[int]]]:
    """``(position, word class, object ids)`` for every word that names objects correctly: the colour and the
    shape word of each adjacent "colour shape" pair that some object of the scene matches (ids: all of them)."""
    out = []
    for position in range(len(tokens) - 1):
        colour, noun = tokens[position], tokens[position + 1]
        ids = [i for i, obj in enumerate(objects) if obj["colour"] == colour and noun in _shape_forms(obj["shape"])]
        if ids:
            out += [(position, "colour", ids), (position + 1, "shape", ids)]
    return out


# ---------------------------------------------------------------------------------------------------------------
# Pooling with bootstrap intervals over images
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class WordScore:
    image: int  # index of the image in the evaluated list
    word_class: str
    control: str
    scores: dict[str, float]

    @property
    def classes(self) -> tuple[str, ...]:
        return (self.word_class,)


def bootstrap_mean(values_per_image: Sequence[Sequence[float]], resamples: int = 2000, seed: int = 0,
                   level: float = 0.95) -> tuple[float, float, float]:
    """Mean over all values (pooled over images) and its percentile-bootstrap interval, resampling images with
    replacement (a cluster bootstrap: an image's words travel together)."""
    groups = [np.asarray(v, np.float64) for v in values_per_image if len(v)]
    if not groups:
        return float("nan"), float("nan"), float("nan")
    sums = np.array([g.sum() for g in groups])
    counts = np.array([len(g) for g in groups], np.float64)
    low, high = percentile_interval(resampled_ratios(sums, counts, resamples, seed), level)
    return float(sums.sum() / counts.sum()), low, high


def summarise(word_scores: Sequence, n_images: int, resamples: int = 2000, classes: Sequence[str] = WORD_CLASSES,
              controls: Sequence[str] = CONTROLS, class_key: str = "word_class", unit: str = "words") -> list[dict]:
    """One row per (control, class ∪ "all"): every statistic's mean and 95 % interval, the ``unit`` (scored items)
    and image counts.  Items are anything with ``image``, ``classes`` (an item counts under each of its classes,
    once under "all"), ``control`` and ``scores``: the scenes' words, or Flickr30k Entities phrases."""
    rows = []
    for control in controls:
        for word_class in (*classes, "all"):
            chosen = [w for w in word_scores
                      if w.control == control and (word_class == "all" or word_class in w.classes)]
            if not chosen:
                continue
            row = {"control": control, class_key: word_class, unit: len(chosen),
                   "images": len({w.image for w in chosen})}
            for stat in STATISTICS:
                per_image: list[list[float]] = [[] for _ in range(n_images)]
                for w in chosen:
                    per_image[w.image].append(w.scores[stat])
                mean, low, high = bootstrap_mean(per_image, resamples)
                row[stat] = {"mean": round(mean, 4), "ci95": [round(low, 4), round(high, 4)]}
            rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------------------------
# A checkpoint on a dataset
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class CaptionAttention:
    """One image's beam-search caption and its aligned attention rows ``[T, N]`` with their geometry."""

    tokens: list[str]
    attention: np.ndarray
    geometry: Geometry
    extras: dict[str, np.ndarray] = field(default_factory=dict)


def load_label_mask(image, dataset_root: Path) -> np.ndarray:
    """The scene's label mask (0 = background, ``i + 1`` = object ``i``)."""
    if "mask" not in image.info:
        raise ValueError(f"{image.path.name} has no object mask: grounding needs generated scenes")
    return np.asarray(Image.open(Path(dataset_root) / image.info["mask"]))


def score_images(images: Sequence, results: Sequence[CaptionAttention], dataset_root: Path) -> list[WordScore]:
    """Per grounded word: the model's map, the uniform map and another image's map, each scored on the mask."""
    labels = [load_label_mask(im, dataset_root) for im in images]
    grounded = [grounded_words(r.tokens, im.info["objects"]) for im, r in zip(images, results)]
    # for the "other image" control: per class, the first grounded row of each image
    first_row: dict[str, dict[int, tuple[np.ndarray, Geometry]]] = {c: {} for c in WORD_CLASSES}
    for index, (words, result) in enumerate(zip(grounded, results)):
        for position, word_class, _ in words:
            first_row[word_class].setdefault(index, (result.attention[position], result.geometry))
    out: list[WordScore] = []
    n = len(images)
    for index, (words, result, label) in enumerate(zip(grounded, results, labels)):
        size = (label.shape[1], label.shape[0])
        uniform = pixel_distribution(np.ones(result.attention.shape[1]), result.geometry, size)
        for position, word_class, ids in words:
            mask = np.isin(label, [i + 1 for i in ids])
            if not mask.any():
                continue  # the object lies outside the image the encoder saw (never for the generated scenes)
            own = pixel_distribution(result.attention[position], result.geometry, size)
            out.append(WordScore(index, word_class, "model", score_map(own, mask)))
            out.append(WordScore(index, word_class, "uniform", score_map(uniform, mask)))
            other = next((first_row[word_class][j] for j in ((index + k) % n for k in range(1, n))
                          if j in first_row[word_class]), None)
            if other is not None:
                weights, geometry = other
                # grid models see every image through the same cells: reuse this image's geometry; region boxes
                # belong to their own image and are scaled onto this one
                geometry = result.geometry if geometry.kind == "grid" else geometry
                out.append(WordScore(index, word_class, "other image",
                                     score_map(pixel_distribution(weights, geometry, size), mask)))
    return out


def item_geometry(ckpt, vis, row: int, image_path: Path) -> Geometry:
    """Where the visual items of row ``row`` of ``vis`` sit on the image file the model saw: the store's own
    geometry (regions), or the encoder grid's on the picture's size (read from its header only, after its EXIF
    orientation, as the model saw it)."""
    from ..encoder import grid_geometry
    from ..images import picture_size

    if vis.geometry:
        return vis.geometry[row]
    return grid_geometry(ckpt.encoder, picture_size(image_path))


@torch.no_grad()
def caption_with_attention(ckpt, images: Sequence, store, beam_size: int = 3, max_len: int = 20,
                           batch_size: int = 50, device: str = "cpu", progress: bool = False,
                           rules=None) -> list[CaptionAttention]:
    """Beam-search captions with the primary attention row of every word (the same search as ``captioner
    eval``'s captions, with its decoding ``rules``), and each image's geometry: the store's own (regions) or the
    encoder grid's."""
    from ..decoding import NO_RULES, beam_search

    model, vocab = ckpt.model, ckpt.vocab
    out: list[CaptionAttention] = []
    for chunk, vis in visual_batches(model, images, store, batch_size, device, "captioning", progress):
        hyps = beam_search(model, vis, k=beam_size, max_len=max_len, rules=rules or NO_RULES, extras=())
        for row, (im, best) in enumerate(zip(chunk, hyps)):
            ids = best[0].token_ids
            tokens = vocab.decode(ids)
            attention = best[0].attention.numpy()[vocab.kept_positions(ids)]  # one row per decoded word
            out.append(CaptionAttention(tokens, attention, item_geometry(ckpt, vis, row, im.path)))
    return out


def normaliser_of(ckpt) -> str:
    """The attention normaliser behind the scored map, for the table: SparseCap's configured one, the hard and
    area models by kind, an ensemble's members' in turn, softmax otherwise."""
    return _normaliser(ckpt.model)


def _normaliser(model) -> str:
    if isinstance(model, Ensemble):  # the mean of its members' maps, each labelled as the table labels it
        return mean_of(_normaliser(member) for member in model.members)
    kind = model.attention_kind
    if "hard" in kind:
        return "hard (α, the sampling distribution)"
    if "area" in kind:
        return "softmax over areas → cells"
    return model.attention_name


def grounding_report(ckpt, images: Sequence, results: Sequence[CaptionAttention], dataset_root: Path,
                     resamples: int = 2000) -> dict:
    """The JSON section ``captioner eval --grounding`` adds to a split's report."""
    word_scores = score_images(images, results, dataset_root)
    return {"normaliser": normaliser_of(ckpt), "attention_kind": ckpt.model.attention_kind,
            "map": "primary attention row aligned with the word; grid cells / region boxes → pixels",
            "rows": summarise(word_scores, len(images), resamples)}


def interval(stat: dict) -> str:
    """A statistic as the tables print it: ``mean [low, high]``."""
    return f"{stat['mean']:.3f} [{stat['ci95'][0]:.3f}, {stat['ci95'][1]:.3f}]"


def markdown_table(reports: Sequence[tuple[str, dict]]) -> str:
    """A grounding table from ``(model name, grounding section)`` pairs: one row per model × control × word class,
    mass / pointing / ratio as ``mean [low, high]``."""
    lines = ["| model | normaliser | map | words | images | mass in object | pointing hit | area-normalised ratio |",
             "|---|---|---|---|---|---|---|---|"]

    for name, section in reports:
        for row in section["rows"]:
            label = "attention" if row["control"] == "model" else f"chance: {row['control']}"
            lines.append(f"| {name} | {section['normaliser']} | {label}, {row['word_class']} | {row['words']} | "
                         f"{row['images']} | {interval(row['mass'])} | {interval(row['pointing'])} | "
                         f"{interval(row['ratio'])} |")
    return "\n".join(lines)
