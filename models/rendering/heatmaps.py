"""Attention heatmaps on the original image, in every mode of docs/decisions.md#heatmap-modes (CLI and service).

All modes start from a :class:`~captioner.models.protocol.Geometry`, whose boxes are already in original-image pixels
(after EXIF orientation, through the resize/crop of preprocessing), so the same code serves grids and regions,
square and non-square images.  ``scale`` renders onto a resized copy of the image (e.g. a thumbnail) by scaling
the boxes.

| mode          | input          | rendering                                                             |
|---------------|----------------|-----------------------------------------------------------------------|
| grid_smooth   | grid weights   | bilinear upsampling + Gaussian blur (σ = half a cell), as in SAT      |
| grid_blocks   | grid weights   | nearest upsampling, exact zeros transparent, as in SparseCap figures |
| region_sum    | region weights | heat(x, y) = Σ_i w_i 1[(x, y) ∈ box_i], normalised to [0, 1]          |
| top1_box      | region weights | outline of the single highest-weight item                             |
| area_topk     | area weights   | the top-k area rectangles, labelled with their weights                |

The heat modes scale each map to its peak (:func:`heatmap`, what the grounding measures read); what is drawn is
that map times :func:`heat_strength` (:func:`drawn_heat`): a row that is (nearly) uniform over the items, a model
attending to nothing in particular, is drawn with (nearly) no heat instead of full heat everywhere.
"""

from __future__ import annotations

import functools
import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from ..files import write_atomically
from ..protocol import Geometry

MODES = ("grid_smooth", "grid_blocks", "region_sum", "top1_box", "area_topk")
#: the modes that make a heat map (the others draw boxes)
HEAT_MODES = ("grid_smooth", "grid_blocks", "region_sum")
#: grid_smooth heat is computed with the longer side at most this many pixels, then resized up: a blur of half a
#: cell over a grid of a few cells holds nothing finer than that, while the blur's cost grows with the cube of
#: the side (a 6000-px photo took 12 s and 2.3 GB for one word, a 10000×3 strip 1.1 GB)
SMOOTH_WORK_SIDE = 512
#: a row whose largest weight is at least this many times the uniform share 1/n is drawn at full heat; a flatter
#: one fades linearly to no heat at uniform (docs/decisions.md#heatmap-modes)
FULL_HEAT_PEAK_RATIO = 2.0


class RenderError(ValueError):
    """The request cannot be rendered (unknown mode, mode not valid for this geometry, bad token index)."""


def default_mode(geometry: Geometry, attention_kind: str = "") -> str:
    """The mode a model's attention is drawn in unless one is asked for: region features' boxes summed; SparseCap's
    output attention (``attention_kind`` ``output_attention``) in blocks, whose exact zeros a blur would spread;
    every other grid map smoothed, as Xu et al. draw theirs."""
    if geometry.kind == "regions":
        return "region_sum"
    return "grid_blocks" if "output_attention" in attention_kind else "grid_smooth"


def _scaled_boxes(geometry: Geometry, scale: float) -> np.ndarray:
    return np.asarray(geometry.boxes, dtype=np.float64) * scale


@functools.lru_cache(maxsize=8)
def _blur_matrix(length: int, sigma: float, radius: int) -> np.ndarray:
    """``[length, length]``: row ``i`` holds the Gaussian kernel of ``sigma`` and ``radius`` centred on ``i``, with the
    taps that fall off either end added to the edge sample (edges extended).  Kept (read-only) for the next call: a
    figure blurs every word's map at the same size, and making the matrix cost more than the products that use it."""
    kernel = np.exp(-0.5 * (np.arange(-radius, radius + 1) / sigma) ** 2)
    kernel /= kernel.sum()
    positions = np.arange(length)
    matrix = np.zeros((length, length), dtype=np.float64)
    for tap, weight in enumerate(kernel):
        np.add.at(matrix, (positions, np.clip(positions + tap - radius, 0, length - 1)), weight)
    matrix = matrix.astype(np.float32)
    matrix.flags.writeable = False
    return matrix


def gaussian_blur(image: np.ndarray, sigma: float, truncate: float = 4.0) -> np.ndarray:
    """A 2-D Gaussian blur with edges extended: scipy.ndimage's ``gaussian_filter(image, sigma, mode="nearest")``
    (the same sampled, normalised kernel of radius ``int(truncate * sigma + 0.5)``, tested equal), as one matrix
    product per axis, so that the service does not need SciPy (111 MB of the container image) for its one blur."""
    radius = int(truncate * sigma + 0.5)
    image = image.astype(np.float32)
    if radius < 1:
        return image
    rows, cols = image.shape
    return _blur_matrix(rows, sigma, radius) @ image @ _blur_matrix(cols, sigma, radius).T


def _bilinear_blurred(grid: np.ndarray, xs: np.ndarray, ys: np.ndarray, sigma: float) -> np.ndarray:
    """``grid`` interpolated bilinearly at the cell coordinates ``xs`` (columns) and ``ys`` (rows) between cell
    centres (cell c has its centre at c + 0.5, edges clamped), then blurred by ``sigma`` pixels."""
    rows, cols = grid.shape
    fx, fy = np.clip(xs - 0.5, 0, cols - 1), np.clip(ys - 0.5, 0, rows - 1)
    x0, y0 = np.floor(fx).astype(int), np.floor(fy).astype(int)
    x1, y1 = np.minimum(x0 + 1, cols - 1), np.minimum(y0 + 1, rows - 1)
    wx, wy = (fx - x0)[None, :], (fy - y0)[:, None]
    top = grid[y0][:, x0] * (1 - wx) + grid[y0][:, x1] * wx
    bottom = grid[y1][:, x0] * (1 - wx) + grid[y1][:, x1] * wx
    return gaussian_blur((top * (1 - wy) + bottom * wy).astype(np.float32), sigma)


def _smooth_window(grid: np.ndarray, xs: np.ndarray, ys: np.ndarray, cell_w: float, cell_h: float) -> np.ndarray:
    """grid_smooth heat at the pixel centres ``xs`` × ``ys`` (cell units, evenly spaced) of the crop the network
    saw: bilinear between cell centres, blurred by half a cell (docs/decisions.md#heatmap-modes).

    Only the crop is computed: outside it the heat is zero, and inside it the blur's extended edges equal the
    clamped interpolation beyond them, so this is the whole image's computation cut to the crop.  A crop wider
    than :data:`SMOOTH_WORK_SIDE` is computed at that size and resized up."""
    sigma = 0.5 * min(cell_w, cell_h)
    width, height = len(xs), len(ys)
    shrink = SMOOTH_WORK_SIDE / max(width, height)
    if shrink >= 1.0:
        return _bilinear_blurred(grid, xs, ys, sigma)
    small_w, small_h = max(1, round(width * shrink)), max(1, round(height * shrink))
    # the smaller window's pixel centres, in the full window's pixels, then in cell units (a pixel is 1 / cell_w)
    small_xs = xs[0] + ((np.arange(small_w) + 0.5) * (width / small_w) - 0.5) / cell_w
    small_ys = ys[0] + ((np.arange(small_h) + 0.5) * (height / small_h) - 0.5) / cell_h
    small = _bilinear_blurred(grid, small_xs, small_ys, sigma * small_w / width)
    return np.asarray(Image.fromarray(small, mode="F").resize((width, height), Image.Resampling.BILINEAR))


def _grid_heat(weights: np.ndarray, geometry: Geometry, size: tuple[int, int], scale: float,
               smooth: bool) -> np.ndarray:
    rows, cols = geometry.grid_hw
    grid = weights.reshape(rows, cols).astype(np.float32)
    boxes = _scaled_boxes(geometry, scale)
    x1, y1, x2, y2 = boxes[0, 0], boxes[0, 1], boxes[-1, 2], boxes[-1, 3]  # the crop the network saw
    width, height = size
    heat = np.zeros((height, width), dtype=np.float32)
    # pixel centres of the output image, expressed in cell units of the grid; the crop is the pixels inside
    xs = (np.arange(width) + 0.5 - x1) / ((x2 - x1) / cols)
    ys = (np.arange(height) + 0.5 - y1) / ((y2 - y1) / rows)
    inside_x, inside_y = np.flatnonzero((xs >= 0) & (xs < cols)), np.flatnonzero((ys >= 0) & (ys < rows))
    if not len(inside_x) or not len(inside_y):
        return heat
    xs, ys = xs[inside_x], ys[inside_y]
    if smooth:
        window = _smooth_window(grid, xs, ys, (x2 - x1) / cols, (y2 - y1) / rows)
    else:
        window = grid[np.floor(ys).astype(int)][:, np.floor(xs).astype(int)]
    heat[inside_y[0]:inside_y[-1] + 1, inside_x[0]:inside_x[-1] + 1] = window
    return heat


def _region_heat(weights: np.ndarray, geometry: Geometry, size: tuple[int, int], scale: float) -> np.ndarray:
    width, height = size
    heat = np.zeros((height, width), dtype=np.float32)
    for w, (x1, y1, x2, y2) in zip(weights, _scaled_boxes(geometry, scale)):
        if w > 0:
            heat[max(int(round(y1)), 0):int(round(y2)), max(int(round(x1)), 0):int(round(x2))] += w
    return heat


def heat_strength(weights: Sequence[float] | np.ndarray) -> float:
    """How strongly a row's heat is drawn, in [0, 1], from how far its peak stands above the uniform share:
    ``clip((n · max_i w_i / Σ_i w_i − 1) / (FULL_HEAT_PEAK_RATIO − 1), 0, 1)`` over its ``n`` items.  A uniform row
    (every item ``1/n``, what a model that attends to nothing returns) gives 0, one whose peak holds at least
    :data:`FULL_HEAT_PEAK_RATIO` times the uniform share gives 1; an all-zero row gives 0."""
    weights = np.asarray(weights, dtype=np.float64)
    total = float(weights.sum())
    if total <= 0:
        return 0.0
    peak_over_uniform = weights.size * float(weights.max()) / total
    return float(np.clip((peak_over_uniform - 1) / (FULL_HEAT_PEAK_RATIO - 1), 0.0, 1.0))


def heatmap(weights: Sequence[float] | np.ndarray, geometry: Geometry, mode: str, size: tuple[int, int] | None = None,
            scale: float | None = None) -> np.ndarray:
    """Heat ``[H, W]`` in [0, 1] over the image at ``size`` (width, height), a resized copy of the original or the
    original itself: the row's mass over the pixels divided by its peak.  ``scale`` is its size over the original's:
    by default what ``size`` says (:func:`picture_scale`), else 1 (and ``size`` then the original × ``scale``).
    ``mode`` is one of :data:`HEAT_MODES`; the box modes draw no heat.  This is the map the grounding measures read
    (models/evaluation/grounding.py); what is drawn is :func:`drawn_heat`."""
    if mode not in HEAT_MODES:
        boxes = " (it draws boxes: see overlay)" if mode in MODES else ""
        raise RenderError(f"heat mode {mode!r}{boxes}; choose from {', '.join(HEAT_MODES)}")
    weights = np.asarray(weights, dtype=np.float32)
    if scale is None:
        scale = picture_scale(size, geometry.image_size) if size else 1.0
    size = size or (round(geometry.image_size[0] * scale), round(geometry.image_size[1] * scale))
    if mode in ("grid_smooth", "grid_blocks"):
        if geometry.kind != "grid" or geometry.grid_hw is None:
            raise RenderError(f"mode {mode} needs grid features; this model attends over {geometry.kind}")
        heat = _grid_heat(weights, geometry, size, scale, smooth=(mode == "grid_smooth"))
    else:
        heat = _region_heat(weights, geometry, size, scale)
    peak = float(heat.max())
    return heat / peak if peak > 0 else heat


def drawn_heat(weights: Sequence[float] | np.ndarray, geometry: Geometry, mode: str,
               size: tuple[int, int] | None = None, scale: float | None = None) -> np.ndarray:
    """The heat a word is drawn with (the overlays, the figures, the service's JSON heatmaps): :func:`heatmap` times
    the row's :func:`heat_strength`, so a peaked row's maximum is 1 and a uniform row's heat is 0 everywhere.  The
    peak alone would draw a uniform row, whose every pixel is its peak, as full heat over the whole image.  The
    grounding measures read :func:`heatmap` itself: they score where the mass lies, however flat."""
    return heatmap(weights, geometry, mode, size, scale) * heat_strength(weights)


def check_mode(mode: str) -> str:
    """``mode`` when it is one of :data:`MODES` (:class:`RenderError` naming them otherwise)."""
    if mode not in MODES:
        raise RenderError(f"unknown heat mode {mode!r}; choose from {', '.join(MODES)}")
    return mode


def colormap(name: str):
    """The matplotlib colormap called ``name`` (:class:`RenderError` naming it when there is none)."""
    import matplotlib  # only rendering needs it, not every import of this module

    try:
        return matplotlib.colormaps[name]
    except KeyError:
        raise RenderError(f"unknown matplotlib colormap {name!r}") from None


def picture_scale(size: tuple[int, int], original: tuple[int, int]) -> float:
    """How much smaller (or larger) a copy of ``size`` is than the ``original`` it was resized from: the ratio of the
    longer sides, which rounding moves least (a 1-pixel-wide strip's width says nothing of its scale)."""
    return size[0] / original[0] if original[0] >= original[1] else size[1] / original[1]


def _check_same_shape(size: tuple[int, int], original: tuple[int, int], scale: float) -> None:
    """Refuse a picture of another shape than the one captioned: its heat was laid out for the original's shape
    and fell on the wrong part, in silence (the top half of a picture twice as tall).  A resized copy passes: each
    side within a pixel and a half or 1 % of the original's × ``scale``, as a thumbnail or a JPEG's reduced decode
    round them."""
    for side, whole in zip(size, original):
        expected = whole * scale
        if abs(side - expected) > max(1.5, 0.01 * expected):
            raise RenderError(f"the picture is {size[0]}x{size[1]}, but the caption was made of a {original[0]}x"
                              f"{original[1]} one: draw on that picture, or on a copy resized to its shape")


def overlay(image: Image.Image, weights: Sequence[float] | np.ndarray, geometry: Geometry, mode: str | None = None,
            cmap: str = "jet", alpha: float = 0.5, area_boxes: np.ndarray | None = None, top_k: int = 3) -> Image.Image:
    """The image with one word's attention drawn on it (RGB, same size as ``image``).

    ``image`` may be a resized copy of the original (:func:`picture_scale`); a picture of another shape is refused.
    ``area_boxes`` (cell coordinates r1, c1, r2, c2, inclusive) are needed for ``area_topk``, whose ``weights`` are the
    areas' (:meth:`~captioner.models.inference.CaptionResult.drawn_rows`).  Without a ``mode``, the geometry's
    default; a caption's own (its model's, :attr:`~captioner.models.inference.CaptionResult.default_mode`) is what
    :meth:`CaptionResult.overlay <captioner.models.inference.CaptionResult.overlay>` draws.
    """
    mode = check_mode(mode or default_mode(geometry))
    if not 0.0 <= alpha <= 1.0:
        raise RenderError(f"alpha must be in [0, 1], got {alpha}")
    colours_of = colormap(cmap)
    base = image.convert("RGB")
    scale = picture_scale(base.size, geometry.image_size)
    _check_same_shape(base.size, geometry.image_size, scale)
    if mode in ("top1_box", "area_topk"):
        return _draw_boxes(base, weights, geometry, mode, colours_of, scale, area_boxes, top_k)
    heat = drawn_heat(weights, geometry, mode, base.size, scale)
    colours = colours_of(heat, bytes=True)[..., :3].astype(np.float32)
    # smooth maps cover the whole image (SAT's look); blocks and regions leave zero weight fully transparent
    opacity = np.full(heat.shape, alpha, np.float32) if mode == "grid_smooth" else alpha * (heat > 0)
    pixels = np.asarray(base, dtype=np.float32)
    blended = pixels * (1 - opacity[..., None]) + colours * opacity[..., None]
    return Image.fromarray(np.clip(blended, 0, 255).astype(np.uint8))


def _draw_boxes(image: Image.Image, weights: Sequence[float] | np.ndarray, geometry: Geometry, mode: str, colours_of,
                scale: float, area_boxes: np.ndarray | None, top_k: int) -> Image.Image:
    weights = np.asarray(weights, dtype=np.float32)
    out = image.copy()
    draw = ImageDraw.Draw(out)
    if mode == "top1_box":
        boxes, order = _scaled_boxes(geometry, scale), [int(weights.argmax())]
    else:
        if area_boxes is None or geometry.grid_hw is None:
            raise RenderError("area_topk needs area attention over a grid (a model with decoder area attention)")
        cells = _scaled_boxes(geometry, scale)
        cols = geometry.grid_hw[1]
        area_boxes = np.asarray(area_boxes, dtype=int)
        # an area spans cells (r1, c1)..(r2, c2): its rectangle runs from the first cell's corner to the last's
        boxes = np.array([[cells[r1 * cols + c1, 0], cells[r1 * cols + c1, 1], cells[r2 * cols + c2, 2],
                           cells[r2 * cols + c2, 3]] for r1, c1, r2, c2 in area_boxes])
        order = [int(i) for i in np.argsort(-weights)[:top_k]]
    width = max(2, round(min(image.size) / 100))
    top = float(weights[order[0]]) or 1.0
    # the weights in white with a black outline, large enough to read on any photo (Pillow's bitmap default font,
    # about 7 px tall and in the box's own colour, vanished on dark or busy regions); the colour stays the box's
    font = ImageFont.load_default(size=max(12, round(min(image.size) / 24)))
    for i in order:
        colour = tuple(int(255 * c) for c in colours_of(float(weights[i]) / top)[:3])
        draw.rectangle([float(v) for v in boxes[i]], outline=colour, width=width)
        if mode == "area_topk":
            draw.text((float(boxes[i][0]) + width + 1, float(boxes[i][1]) + width), f"{weights[i]:.2f}",
                      fill=(255, 255, 255), font=font, stroke_width=max(1, width // 2), stroke_fill=(0, 0, 0))
    return out


def caption_figure(image: Image.Image, words: Sequence[str], attention: Sequence[Sequence[float]] | np.ndarray,
                   geometry: Geometry, mode: str | None = None, cmap: str = "jet", alpha: float = 0.5, columns: int = 5,
                   area_boxes: np.ndarray | None = None, panel_size: int = 224) -> Image.Image:
    """The papers' figure: the image, then one panel per word with that word's heatmap (PNG-ready RGB).  From a
    caption, in its model's own mode: :meth:`CaptionResult.figure <captioner.models.inference.CaptionResult.figure>`."""
    thumb = _thumbnail(image, panel_size)
    panels = [("(image)", thumb)] + [
        (word, overlay(thumb, attention[i], geometry, mode, cmap, alpha, area_boxes)) for i, word in enumerate(words)]
    return _figure([panels[i:i + columns] for i in range(0, len(panels), columns)], columns)


@dataclass
class FigureRow:
    """One captioner's result on the image, for :func:`comparison_figure`."""

    label: str
    words: Sequence[str]
    attention: Sequence[Sequence[float]] | np.ndarray
    geometry: Geometry
    area_boxes: np.ndarray | None = None
    mode: str | None = None


def comparison_figure(image: Image.Image, rows: Sequence[FigureRow], cmap: str = "jet", alpha: float = 0.5,
                      panel_size: int = 224) -> Image.Image:
    """One row per captioner: the image with its caption, then every word's heatmap (SparseCap's Figure 1 layout, e.g.
    softmax / sparsemax / TVmax on the same picture)."""
    thumb = _thumbnail(image, panel_size)
    grid = [[(f"{row.label}:", thumb)] + [
        (word, overlay(thumb, row.attention[i], row.geometry, row.mode, cmap, alpha, row.area_boxes))
        for i, word in enumerate(row.words)] for row in rows]
    return _figure(grid, max(len(panels) for panels in grid))


def _thumbnail(image: Image.Image, panel_size: int) -> Image.Image:
    thumb = image.convert("RGB").copy()
    thumb.thumbnail((panel_size * 2, panel_size * 2))
    return thumb


def _figure(grid: Sequence[Sequence[tuple[str, Image.Image]]], columns: int) -> Image.Image:
    """Render rows of titled panels with matplotlib (headless) into an RGB image."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(grid), columns, figsize=(columns * 2.2, len(grid) * 2.4), squeeze=False)
    for axis in axes.flat:
        axis.axis("off")
    for axes_row, panels in zip(axes, grid):
        for axis, (word, picture) in zip(axes_row, panels):
            axis.imshow(picture)
            axis.set_title(word, fontsize=11)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    plt.close(figure)
    return Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")


def png_bytes(image: Image.Image) -> bytes:
    return _encoded(image, "PNG")


def save_picture(image: Image.Image, path: str | Path) -> Path:
    """Write ``image`` to ``path`` in the format its extension names (``.png``, ``.jpg``, ...), whole or not at all:
    a full disk or a killed process leaves the figure that was there before, never half of the new one."""
    path = Path(path)
    image_format = Image.registered_extensions().get(path.suffix.lower())
    if image_format is None:
        raise ValueError(f"{path}: the extension names no picture format (give figure.png, figure.jpg, ...)")
    write_atomically(path, _encoded(image, image_format))
    return path


def _encoded(image: Image.Image, image_format: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=image_format)
    return buffer.getvalue()
