"""Pixel-level checks of the heatmap renderer (docs/decisions.md#heatmap-modes)."""

import errno
import io
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw
from scipy.ndimage import gaussian_filter
from skimage import data

from captioner.models.checkpoint import Checkpoint
from captioner.models.decoding import Hypothesis
from captioner.models.encoder import EncoderSpec, grid_geometry, preprocess
from captioner.models.images import load_image
from captioner.models.inference import CaptionResult, torch_runtime
from captioner.models.protocol import Geometry
from captioner.models.rendering import heatmaps
from captioner.models.rendering.heatmaps import FigureRow, RenderError, _blur_matrix, _figure, caption_figure, \
    comparison_figure, default_mode, drawn_heat, gaussian_blur, heat_strength, heatmap, overlay, save_picture

from .serving_helpers import TINY_SPEC, VOCAB, tiny_model


def one_hot(index: int, n: int = 64) -> np.ndarray:
    weights = np.zeros(n, np.float32)
    weights[index] = 1.0
    return weights


@pytest.mark.parametrize("size", [(640, 480), (300, 700), (256, 256)])
def test_one_hot_cell_lights_exactly_its_rectangle(size):
    geometry = grid_geometry(EncoderSpec(), size)
    r, c = 2, 5
    heat = heatmap(one_hot(r * 8 + c), geometry, "grid_blocks")
    width, height = size
    assert heat.shape == (height, width)
    ys, xs = np.nonzero(heat)
    cell_w, cell_h = width / 8, height / 8
    assert xs.min() == int(np.ceil(c * cell_w - 0.5)) and xs.max() == int(np.ceil((c + 1) * cell_w - 0.5)) - 1
    assert ys.min() == int(np.ceil(r * cell_h - 0.5)) and ys.max() == int(np.ceil((r + 1) * cell_h - 0.5)) - 1
    assert np.all(heat[ys.min():ys.max() + 1, xs.min():xs.max() + 1] == 1.0)


def test_blocks_overlay_leaves_zero_cells_untouched():
    image = Image.new("RGB", (640, 480), (128, 128, 128))
    geometry = grid_geometry(EncoderSpec(), image.size)
    out = np.asarray(overlay(image, one_hot(9), geometry, "grid_blocks", alpha=0.6)).astype(int)
    changed = np.any(out != 128, axis=-1)
    ys, xs = np.nonzero(changed)
    assert (xs.min(), xs.max(), ys.min(), ys.max()) == (80, 159, 60, 119)


def test_smooth_heat_peaks_in_the_attended_cell():
    geometry = grid_geometry(EncoderSpec(), (800, 400))
    heat = heatmap(one_hot(3 * 8 + 6), geometry, "grid_smooth")
    y, x = np.unravel_index(heat.argmax(), heat.shape)
    assert 600 <= x < 700 and 150 <= y < 200
    assert heat.max() == pytest.approx(1.0) and heat.min() >= 0


def test_center_crop_geometry_is_respected():
    spec = EncoderSpec(image_size=224, resize="center_crop", resize_to=256)
    geometry = grid_geometry(spec, (512, 256))  # crop x ∈ [144, 368), cells of 32 px (7×7 grid)
    heat = heatmap(one_hot(0, 49), geometry, "grid_blocks")
    ys, xs = np.nonzero(heat)
    assert (xs.min(), xs.max(), ys.min(), ys.max()) == (144, 175, 16, 47)
    assert heat[:, :144].max() == 0, "outside the crop nothing is lit"


def test_exif_rotated_upload_maps_to_the_displayed_image():
    stored = Image.new("RGB", (480, 640))  # stored portrait, displayed landscape after orientation 6
    exif = Image.Exif()
    exif[0x0112] = 6
    buffer = io.BytesIO()
    stored.save(buffer, format="JPEG", exif=exif)
    image = load_image(buffer.getvalue())
    _, geometry = preprocess(image, EncoderSpec())
    assert image.size == (640, 480) and geometry.image_size == (640, 480)
    out = overlay(image, one_hot(7), geometry, "grid_blocks")  # top-right cell of the displayed image
    lit = np.nonzero(np.any(np.asarray(out).astype(int) > 40, axis=-1))
    assert lit[1].min() == 560 and lit[0].max() == 59


def test_region_modes():
    geometry = Geometry("regions", (200, 100), None, np.array([[0, 0, 100, 100], [50, 0, 200, 50]], np.float32))
    heat = heatmap(np.array([0.1, 0.9]), geometry, "region_sum")
    assert heat[10, 75] == pytest.approx(1.0) and heat[80, 20] == pytest.approx(0.1 / 1.0)  # the overlap adds up
    assert heat[80, 150] == 0
    # the row's peak is 1.8 times the uniform share, so it is drawn at 0.8 of full heat (heat_strength)
    np.testing.assert_allclose(drawn_heat(np.array([0.1, 0.9]), geometry, "region_sum"), 0.8 * heat, atol=1e-6)
    boxed = np.asarray(overlay(Image.new("RGB", (200, 100)), [0.1, 0.9], geometry, "top1_box")).astype(int)
    assert boxed[0:3, 60:190].any() and not boxed[60:100, 0:40].any()
    with pytest.raises(RenderError, match="grid"):
        heatmap([0.5, 0.5], geometry, "grid_blocks")


def test_area_topk_draws_rectangles_and_needs_areas():
    geometry = grid_geometry(EncoderSpec(), (256, 256))
    areas = np.array([[0, 0, 1, 1], [4, 4, 4, 4], [6, 0, 7, 2]])
    out = np.asarray(overlay(Image.new("RGB", (256, 256)), [0.2, 0.7, 0.1], geometry, "area_topk",
                             area_boxes=areas, top_k=2)).astype(int)
    assert out[128:160, 128].any() and out[0:64, 0].any()
    assert not out[192:256, 0:96][10:50, 10:50].any()
    with pytest.raises(RenderError, match="area"):
        overlay(Image.new("RGB", (64, 64)), [1.0], grid_geometry(EncoderSpec(), (64, 64)), "area_topk")


@pytest.fixture
def labels(monkeypatch):
    """The words and the outline's stroke width of every text the overlays write, drawn as usual."""
    written, text = [], ImageDraw.ImageDraw.text

    def recording(self, xy, words, *args, **kwargs):
        written.append((words, kwargs.get("stroke_width", 0)))
        return text(self, xy, words, *args, **kwargs)

    monkeypatch.setattr(ImageDraw.ImageDraw, "text", recording)
    return written


def test_area_topk_labels_the_three_heaviest_areas_with_their_weights_to_two_places(labels):
    """Without a ``top_k`` (the CLI, the service and the figures pass none) the three heaviest areas are drawn, each
    labelled with its weight to two places, heaviest first: weights of 0.34 and 0.32 written to one place would both
    read 0.3."""
    geometry = grid_geometry(EncoderSpec(), (256, 256))
    areas = np.array([[0, 0, 1, 1], [4, 4, 4, 4], [6, 0, 7, 2], [2, 5, 3, 7]])
    overlay(Image.new("RGB", (256, 256)), [0.25, 0.34, 0.09, 0.32], geometry, "area_topk", area_boxes=areas)
    assert [words for words, _ in labels] == ["0.34", "0.32", "0.25"]


def test_area_topk_weights_are_written_legibly_on_dark_and_on_light_photos():
    """The weights were 7 px tall in the box's own colour: dark red on a dark photo. Now white with a black
    outline, at least 12 px: both are in the label's corner whatever the photo."""
    geometry = grid_geometry(EncoderSpec(), (512, 512))
    areas = np.array([[0, 0, 3, 3], [6, 6, 7, 7]])
    for background in (0, 255):
        out = np.asarray(overlay(Image.new("RGB", (512, 512), (background,) * 3), [0.9, 0.1], geometry,
                                 "area_topk", area_boxes=areas, top_k=1)).astype(int)
        label = out[8:40, 8:80]  # inside the top box, by its top-left corner, where the weight is written
        white = (label.min(-1) >= 240).sum()
        black = (label.max(-1) <= 15).sum()
        assert white >= 40 and black >= 40, (background, white, black)
        rows = np.nonzero(((label.min(-1) >= 240) & (label.max(-1) >= 240)).any(1))[0]
        assert rows.max() - rows.min() >= 10, rows  # glyphs at least ~12 px tall, not Pillow's 7 px bitmap font


def test_bad_render_requests():
    geometry = grid_geometry(EncoderSpec(), (64, 64))
    with pytest.raises(RenderError, match="mode"):
        overlay(Image.new("RGB", (64, 64)), one_hot(0), geometry, "rainbow")
    with pytest.raises(RenderError, match="colormap"):
        overlay(Image.new("RGB", (64, 64)), one_hot(0), geometry, "grid_blocks", cmap="nope")


def test_a_picture_of_another_shape_is_refused_and_a_resized_copy_is_drawn_on():
    # heat fell on the top half of a picture twice as tall, in silence (a library user's audit)
    geometry = grid_geometry(EncoderSpec(), (451, 300))
    weights = np.full(len(geometry.boxes), 1.0 / len(geometry.boxes))
    with pytest.raises(RenderError, match="the picture is 451x600, but the caption was made of a 451x300 one"):
        overlay(Image.new("RGB", (451, 600)), weights, geometry)
    for copy in ((451, 300), (226, 150), (113, 75), (57, 38)):  # the copies a thumbnail or a reduced decode makes
        assert overlay(Image.new("RGB", copy), weights, geometry).size == copy


def test_caption_figure_has_one_panel_per_word():
    image = Image.new("RGB", (300, 200), (200, 200, 200))
    geometry = grid_geometry(EncoderSpec(), image.size)
    figure = caption_figure(image, ["a", "red", "circle", "<eos>"], [one_hot(i) for i in range(4)], geometry)
    assert figure.mode == "RGB" and figure.width > figure.height > 100


def test_each_panel_of_a_caption_figure_draws_its_own_words_row():
    """Panel i draws attention row i: a figure whose second word looks elsewhere differs from one whose two words
    look at the same cell, whichever of the two rows is repeated."""
    image = Image.new("RGB", (300, 200), (200, 200, 200))
    geometry = grid_geometry(EncoderSpec(), image.size)
    first, second = one_hot(0), one_hot(63)

    def figure(rows):
        return np.asarray(caption_figure(image, ["a", "b"], rows, geometry, "grid_blocks"))

    own = figure([first, second])
    assert not np.array_equal(own, figure([first, first]))
    assert not np.array_equal(own, figure([second, second]))


@pytest.fixture
def laid_out(monkeypatch):
    """The panels a figure lays out (rows of (title, picture)) and its column count, instead of the rendered
    figure: what the layout is, without reading it back from matplotlib's pixels."""
    figures = []
    monkeypatch.setattr(heatmaps, "_figure", lambda grid, columns: figures.append((grid, columns)))
    return figures


def test_a_caption_figure_lays_out_the_photo_then_each_words_overlay_in_rows_of_its_columns(laid_out):
    """Every panel in order, none dropped at a row's end, the photo first, each word drawn in the figure's style
    (an ``alpha`` or colormap given to the figure was lost to the overlays' defaults in silence)."""
    image = Image.new("RGB", (300, 200), (200, 200, 200))
    geometry = grid_geometry(EncoderSpec(), image.size)
    words = ["a", "red", "circle", "on", "the", "grass", "<eos>"]
    rows = [one_hot(9 * i) for i in range(len(words))]
    caption_figure(image, words, rows, geometry, "grid_blocks", cmap="viridis", alpha=0.8, columns=3)
    ((grid, columns),) = laid_out
    assert columns == 3
    assert [[title for title, _ in row] for row in grid] == [["(image)", "a", "red"], ["circle", "on", "the"],
                                                              ["grass", "<eos>"]]
    panels = [picture for row in grid for _, picture in row]
    assert panels[0].tobytes() == image.tobytes()  # a 300x200 photo is its own thumbnail
    for row, picture in zip(rows, panels[1:]):
        assert picture.tobytes() == overlay(image, row, geometry, "grid_blocks", "viridis", 0.8).tobytes()


def test_a_comparison_figure_has_a_labelled_row_per_captioner_each_drawn_in_its_own_mode(laid_out):
    """SparseCap's Figure 1 layout: one row per captioner, its label over the photo, then its words, each in that
    row's own mode (with its area boxes for area_topk) and the figure's style; as many columns as the longest row
    (a row longer than the first lost its last words)."""
    image = Image.new("RGB", (300, 200), (120, 160, 200))
    geometry = grid_geometry(EncoderSpec(), image.size)
    areas = np.array([[0, 0, 0, 0], [0, 0, 1, 1], [2, 2, 4, 5]])
    figure_rows = [FigureRow("sat", ["a", "dog"], [one_hot(0), one_hot(9)], geometry, mode="grid_blocks"),
                   FigureRow("area", ["a", "red", "dog"], np.eye(3, dtype=np.float32) * 0.6 + 0.1, geometry,
                             area_boxes=areas, mode="area_topk")]
    comparison_figure(image, figure_rows, cmap="viridis", alpha=0.7)
    ((grid, columns),) = laid_out
    assert columns == 4
    assert [[title for title, _ in row] for row in grid] == [["sat:", "a", "dog"], ["area:", "a", "red", "dog"]]
    for row, panels in zip(figure_rows, grid):
        assert panels[0][1].tobytes() == image.tobytes()
        for i, (_, picture) in enumerate(panels[1:]):
            expected = overlay(image, row.attention[i], geometry, row.mode, "viridis", 0.7, row.area_boxes)
            assert picture.tobytes() == expected.tobytes(), (row.label, i)


def test_a_comparison_row_without_a_mode_is_drawn_in_its_geometrys_default(laid_out):
    """A row that names no mode draws in its features' default (region features' boxes summed): a row of region
    features defaulting to a grid mode had every panel refused, and the other tests named each row's mode."""
    image = Image.new("RGB", (200, 100), (120, 160, 200))
    regions = Geometry("regions", (200, 100), None, np.array([[0, 0, 100, 100], [50, 0, 200, 50]], np.float32))
    comparison_figure(image, [FigureRow("up-down", ["a"], [[0.1, 0.9]], regions)])
    ((grid, _),) = laid_out
    assert np.array_equal(np.asarray(grid[0][1][1]), np.asarray(overlay(image, [0.1, 0.9], regions, "region_sum")))


def test_each_panel_of_a_figure_is_titled_with_its_word():
    picture = Image.new("RGB", (64, 48), (200, 200, 200))

    def drawn(*titles):
        return np.asarray(_figure([[(title, picture) for title in titles]], len(titles)))

    titled = drawn("cat", "dog")
    assert not np.array_equal(titled, drawn("", "")) and not np.array_equal(titled, drawn("red", "circle"))


@pytest.mark.parametrize("original, copy", [((100, 1000), (13, 128)), ((1000, 100), (128, 13))])
def test_a_thumbnail_is_scaled_by_its_longer_side_whichever_side_that_is(original, copy):
    """A 100x1000 portrait's 13x128 thumbnail is 0.128 of it (its width was rounded up from 12.8): scaled by the
    short side it would look 0.13 and its height 2 pixels off, and the copy would be refused as another shape."""
    geometry = grid_geometry(EncoderSpec(), original)
    weights = one_hot(9)
    assert overlay(Image.new("RGB", copy), weights, geometry, "grid_blocks").size == copy
    assert drawn_heat(weights, geometry, "grid_blocks", copy).shape == (copy[1], copy[0])


@pytest.mark.parametrize("shape, sigma", [((375, 500), 8.3), ((64, 40), 0.4), ((224, 224), 3.5), ((5, 7), 3.0),
                                          ((1, 9), 1.2), ((64, 40), 0.3), ((5, 7), 0.0)])
def test_the_numpy_blur_equals_scipys_gaussian_filter(shape, sigma):
    image = np.random.default_rng(0).random(shape).astype(np.float32)
    np.testing.assert_allclose(gaussian_blur(image, sigma), gaussian_filter(image, sigma=sigma, mode="nearest"),
                               atol=1e-6)


def test_the_blur_keeps_its_matrices_unchanged_between_maps():
    """A figure blurs every word's map with the same matrices, made once and kept: a later map is blurred exactly
    as it is alone, and no caller can write into a kept matrix."""
    first, second = np.random.default_rng(1).random((2, 96, 128)).astype(np.float32)
    alone = gaussian_blur(second, 5.5)
    _blur_matrix.cache_clear()
    gaussian_blur(first, 5.5)
    assert np.array_equal(gaussian_blur(second, 5.5), alone)
    kept = _blur_matrix(96, 5.5, 22)  # the matrix gaussian_blur kept: radius int(4.0 * 5.5 + 0.5)
    assert _blur_matrix.cache_info().hits >= 2 and not kept.flags.writeable
    with pytest.raises(ValueError):
        kept[0, 0] = 1.0


@pytest.mark.parametrize("size, resize", [((1600, 1200), "stretch"), ((2048, 121), "stretch"),
                                          ((2000, 1000), "center_crop")])
def test_smooth_heat_of_a_large_photo_is_computed_small_and_resized_up(monkeypatch, size, resize):
    """The blur costs the cube of the side, so large photos are rendered at SMOOTH_WORK_SIDE and resized up; a
    Gaussian of half a cell holds nothing finer, so the result matches the full-resolution computation.  2048x121:
    the cells are 15 px tall, half a cell 7.56 px, at the working size 1.89 px (not cut to 1); a centre crop 500 px
    from the left edge is cut in cells of the crop's width, not of its right edge's position."""
    geometry = grid_geometry(EncoderSpec(resize=resize), size)
    weights = np.random.default_rng(0).dirichlet(np.full(64, 0.3)).astype(np.float32)
    resized = heatmap(weights, geometry, "grid_smooth")
    monkeypatch.setattr(heatmaps, "SMOOTH_WORK_SIDE", 4096)
    full = heatmap(weights, geometry, "grid_smooth")
    assert resized.shape == full.shape == size[::-1]
    assert np.abs(resized - full).max() < 0.02


@pytest.mark.parametrize("size", [(20000, 3), (3, 20000)])
def test_a_long_thin_strip_renders_at_its_own_size(size):
    # its blur matrix alone used to be 20000² floats: 3.2 GB; lying or standing, its short side is computed at
    # one pixel of the working size, not none
    geometry = grid_geometry(EncoderSpec(), size)
    heat = heatmap(one_hot(27), geometry, "grid_smooth")
    assert heat.shape == size[::-1] and 0.0 <= heat.min() and heat.max() == pytest.approx(1.0)


@pytest.mark.parametrize("size", [(20000, 3), (3, 20000), (1800, 600)])
def test_smooth_heat_is_blurred_with_its_longer_side_at_most_the_working_side(monkeypatch, size):
    """The working size bounds the longer side (SMOOTH_WORK_SIDE): the blur's cost grows with the cube of the side.
    Bounding the shorter one instead draws the same heat, so only the size blurred tells them apart: a 20000x3 strip
    was blurred whole (a 20000² matrix, gigabytes) and a 1800x600 photo at 1536x512."""
    blurred = []

    def recording(image, sigma, truncate=4.0):  # the shape alone: a mutant's 20000² blur would cost gigabytes
        blurred.append(image.shape)
        return image

    monkeypatch.setattr(heatmaps, "gaussian_blur", recording)
    heatmap(one_hot(27), grid_geometry(EncoderSpec(), size), "grid_smooth")
    assert len(blurred) == 1 and max(blurred[0]) == heatmaps.SMOOTH_WORK_SIDE


@pytest.mark.parametrize("size, resize", [((640, 480), "center_crop"), ((300, 500), "center_crop"),
                                          ((480, 360), "stretch")])
def test_smooth_heat_of_the_crop_alone_equals_the_whole_image_blurred_then_cut(size, resize):
    """A reference written from the mode's definition: bilinear between cell centres over the whole image (edges
    clamped), scipy's Gaussian of half a cell with edges extended, zero outside the crop the network saw; the
    renderer computes the crop alone, which must give the same map.  A stretched 480x360 photo has cells of 60x45
    px: half a cell is half the shorter side, 22.5 px."""
    geometry = grid_geometry(EncoderSpec(resize=resize), size)
    weights = np.random.default_rng(1).dirichlet(np.full(64, 0.3))
    grid = weights.reshape(8, 8)
    x1, y1, x2, y2 = geometry.boxes[0][0], geometry.boxes[0][1], geometry.boxes[-1][2], geometry.boxes[-1][3]
    cell_w, cell_h = (x2 - x1) / 8, (y2 - y1) / 8
    xs = np.clip((np.arange(size[0]) + 0.5 - x1) / cell_w - 0.5, 0, 7)
    ys = np.clip((np.arange(size[1]) + 0.5 - y1) / cell_h - 0.5, 0, 7)
    rows = np.array([np.interp(xs, np.arange(8), grid[r]) for r in range(8)])  # along x, per grid row
    whole = np.stack([np.interp(ys, np.arange(8), rows[:, x]) for x in range(size[0])], axis=1)  # then along y
    blurred = gaussian_filter(whole, 0.5 * min(cell_w, cell_h), mode="nearest")
    inside_x = (np.arange(size[0]) + 0.5 >= x1) & (np.arange(size[0]) + 0.5 < x2)
    inside_y = (np.arange(size[1]) + 0.5 >= y1) & (np.arange(size[1]) + 0.5 < y2)
    blurred[~inside_y, :] = 0
    blurred[:, ~inside_x] = 0
    np.testing.assert_allclose(heatmap(weights, geometry, "grid_smooth"), blurred / blurred.max(), atol=1e-5)


@pytest.mark.parametrize("mode", ["grid_blocks", "grid_smooth"])
def test_a_heatmap_at_another_size_is_placed_by_that_size(mode):
    # without a scale the cells stayed at the original's pixels: the last cell fell outside a half-size map
    geometry = grid_geometry(EncoderSpec(), (451, 300))
    half = heatmap(one_hot(63), geometry, mode, size=(225, 150))
    np.testing.assert_array_equal(half, heatmap(one_hot(63), geometry, mode, size=(225, 150), scale=225 / 451))
    assert half.max() == pytest.approx(1.0) and np.unravel_index(half.argmax(), half.shape)[1] > 225 / 2


def test_a_heatmap_given_only_a_scale_is_the_originals_size_times_it_rounded():
    geometry = grid_geometry(EncoderSpec(), (451, 300))
    assert heatmap(one_hot(63), geometry, "grid_blocks", scale=0.5).shape == (150, 226)  # 225.5 rounded, not cut


@pytest.mark.parametrize("mode", ["top1_box", "area_topk", "nope"])
def test_a_heatmap_in_a_mode_without_heat_is_refused_by_the_modes_that_have_it(mode):
    geometry = Geometry("regions", (200, 100), None, np.array([[0, 0, 100, 100], [50, 0, 200, 50]], np.float32))
    with pytest.raises(RenderError, match="choose from grid_smooth, grid_blocks, region_sum$"):
        heatmap([0.5, 0.5], geometry, mode)


@pytest.mark.parametrize("mode", ["grid_smooth", "grid_blocks"])
@pytest.mark.parametrize("kind, grid_hw", [("grid", None), ("regions", (1, 2))])
def test_a_grid_mode_is_refused_without_both_a_grid_kind_and_its_shape(mode, kind, grid_hw):
    """A grid mode needs a grid and its rows × columns: a geometry built by hand (``Geometry`` is the models'
    protocol) that lacks either is refused by name, not met by a TypeError unpacking ``None`` deep in the renderer."""
    geometry = Geometry(kind, (200, 100), grid_hw, np.array([[0, 0, 100, 100], [100, 0, 200, 100]], np.float32))
    with pytest.raises(RenderError, match=f"mode {mode} needs grid features; this model attends over {kind}"):
        heatmap([0.7, 0.3], geometry, mode)


def test_a_caption_draws_itself_in_its_models_mode():
    """From Python, ``overlay()`` and ``caption_figure()`` without a mode know only the geometry (grid_smooth for a
    grid), which blurs a sparse model's exact zeros; a caption's own ``figure``/``overlay`` use its model's mode."""
    photo = Image.fromarray(data.chelsea())
    sparse = tiny_model("sparsecap", attention="sparsemax")
    runtime = torch_runtime(Checkpoint(sparse, VOCAB, TINY_SPEC, checksum="tiny"), "cpu")
    (result,) = runtime.caption([runtime.prepare(photo)], 2, 5, runtime.default_rules)
    assert result.default_mode == "grid_blocks"
    rows = result.hypothesis.attention.numpy()
    assert result.figure(photo).tobytes() == caption_figure(photo, result.tokens, rows, result.geometry,
                                                            "grid_blocks").tobytes()
    assert result.overlay(photo, 0).tobytes() == overlay(photo, rows[0], result.geometry, "grid_blocks").tobytes()
    assert result.overlay(photo, 0).tobytes() != overlay(photo, rows[0], result.geometry).tobytes()
    with pytest.raises(RenderError, match="out of range"):
        result.overlay(photo, len(result.tokens))


def test_a_uniform_row_is_drawn_with_no_heat():
    """A model that attends to nothing returns a uniform row: divided by its peak alone, every pixel of the crop
    was the peak, and the word was drawn looking at the whole image at full heat."""
    geometry = grid_geometry(EncoderSpec(), (300, 200))
    flat = np.full(64, 1 / 64, np.float32)
    for mode in ("grid_smooth", "grid_blocks"):
        assert drawn_heat(flat, geometry, mode).max() == 0, mode
    regions = Geometry("regions", (200, 100), None, np.array([[0, 0, 100, 100], [100, 0, 200, 100]], np.float32))
    assert drawn_heat([0.5, 0.5], regions, "region_sum").max() == 0
    photo = Image.new("RGB", (300, 200), (90, 120, 150))
    # blocks leave a heatless cell transparent; the smooth mode tints the crop with the colormap's coldest colour
    assert overlay(photo, flat, geometry, "grid_blocks").tobytes() == photo.tobytes()
    cold = np.asarray(overlay(photo, flat, geometry, "grid_smooth")).astype(int)
    hot = np.asarray(overlay(photo, one_hot(27), geometry, "grid_smooth")).astype(int)
    assert (cold == cold[0, 0]).all() and cold[0, 0, 2] > cold[0, 0, 0]  # one blue everywhere
    assert not (hot == cold[0, 0]).all()


def test_a_nearly_uniform_row_is_drawn_faintly():
    geometry = grid_geometry(EncoderSpec(), (300, 200))
    noisy = np.random.default_rng(0).uniform(0.99, 1.01, 64) / 64  # its peak about 1 % above the uniform share
    for mode in ("grid_smooth", "grid_blocks"):
        heat = drawn_heat(noisy, geometry, mode)
        assert 0 < heat.max() < 0.02, mode


@pytest.mark.parametrize("peak_over_uniform, strength", [(1.5, 0.5), (1.9, 0.9), (2.0, 1.0), (8.0, 1.0)])
def test_heat_fades_linearly_below_twice_the_uniform_share(peak_over_uniform, strength):
    geometry = grid_geometry(EncoderSpec(), (256, 256))
    rest = (1 - peak_over_uniform / 64) / 63
    row = np.full(64, rest)
    row[9] = peak_over_uniform / 64
    heat = drawn_heat(row, geometry, "grid_blocks")
    assert heat.max() == pytest.approx(strength, abs=1e-6)
    assert heat[0, 0] == pytest.approx(strength * rest / row[9], abs=1e-6)  # every cell scaled alike


def test_a_peaked_row_is_drawn_relative_to_its_peak_as_before():
    """A row whose peak holds twice the uniform share or more keeps the peak-normalised map: its largest cell is
    1 and every other cell its weight over the largest (the stretched 256-px image: 32-px cells)."""
    geometry = grid_geometry(EncoderSpec(), (256, 256))
    row = np.random.default_rng(1).dirichlet(np.full(64, 0.3))
    assert 64 * row.max() > 2
    heat = drawn_heat(row, geometry, "grid_blocks")
    centres = heat[16::32, 16::32]
    np.testing.assert_allclose(centres, row.reshape(8, 8) / row.max(), rtol=1e-5)


@pytest.mark.parametrize("original, copy, drawn", [((451, 300), (226, 151), True), ((451, 300), (226, 152), False),
                                                   ((2000, 1000), (2000, 1010), True),
                                                   ((2000, 1000), (2000, 1011), False)])
def test_a_copy_is_drawn_on_within_a_pixel_and_a_half_or_1_percent_of_the_originals_shape(original, copy, drawn):
    """226x151 is a 451x300 photo halved (150.4 px tall, rounded); 226x152 is 1.6 px off, another shape.  A large
    copy may be 1 % off (a JPEG's reduced decode rounds each side): 10 px of 1000, not 11."""
    geometry = grid_geometry(EncoderSpec(), original)
    weights = np.full(64, 1 / 64)
    if drawn:
        assert overlay(Image.new("RGB", copy), weights, geometry).size == copy
    else:
        with pytest.raises(RenderError, match="draw on that picture"):
            overlay(Image.new("RGB", copy), weights, geometry)


def test_top1_box_outlines_only_the_heaviest_item_in_the_colormaps_top_colour():
    """Its outline is the colormap at 1 (the item's weight over the top one's), a hundredth of the picture's
    shorter side wide (4 px on a 350-px picture, rounded from 3.5), and nothing else is drawn."""
    boxes = np.array([[0, 0, 100, 100], [50, 20, 180, 80], [200, 200, 300, 300]], np.float32)
    geometry = Geometry("regions", (350, 350), None, boxes)
    out = np.asarray(overlay(Image.new("RGB", (350, 350)), [0.3, 0.6, 0.1], geometry, "top1_box"))
    outline = np.zeros((350, 350), bool)
    outline[20:81, 50:181] = True
    outline[24:77, 54:177] = False
    np.testing.assert_array_equal(out.any(-1), outline)
    np.testing.assert_array_equal(out[outline], np.broadcast_to((127, 0, 0), (outline.sum(), 3)))  # jet at 1


def test_area_topk_finds_an_areas_cells_in_a_grid_that_is_not_square():
    """Area (r1, c1)..(r2, c2) runs from cell r1 · cols + c1 to cell r2 · cols + c2 of the row-major cells: on a
    2x4 grid of 100-px cells, area (1, 2)..(1, 3) is the bottom row's right half (counting rows of cols cells)."""
    boxes = np.array([[x, y, x + 100, y + 100] for y in (0, 100) for x in (0, 100, 200, 300)], np.float32)
    geometry = Geometry("grid", (400, 200), (2, 4), boxes)
    out = np.asarray(overlay(Image.new("RGB", (400, 200)), [1.0], geometry, "area_topk",
                             area_boxes=np.array([[1, 2, 1, 3]]), top_k=1))
    ys, xs = np.nonzero(out.any(-1))
    assert (xs.min(), xs.max(), ys.min(), ys.max()) == (200, 399, 100, 199)


def test_a_small_pictures_box_is_outlined_two_pixels_wide():
    """A hundredth of the shorter side is 1 px on a 100-px picture: the outline is kept 2 px wide, no wider."""
    geometry = Geometry("regions", (100, 100), None, np.array([[10, 10, 60, 60], [50, 50, 90, 90]], np.float32))
    out = np.asarray(overlay(Image.new("RGB", (100, 100)), [0.7, 0.3], geometry, "top1_box"))
    outline = np.zeros((100, 100), bool)
    outline[10:61, 10:61] = True
    outline[12:59, 12:59] = False
    np.testing.assert_array_equal(out.any(-1), outline)


def test_area_topk_draws_each_area_in_the_colour_of_its_weight_over_the_top_ones():
    geometry = grid_geometry(EncoderSpec(), (256, 256))
    areas = np.array([[0, 0, 1, 1], [4, 4, 4, 4], [6, 0, 7, 2]])
    out = np.asarray(overlay(Image.new("RGB", (256, 256)), [0.2, 0.7, 0.1], geometry, "area_topk", area_boxes=areas,
                             top_k=2)).astype(int)
    jet = matplotlib.colormaps["jet"]
    np.testing.assert_allclose(out[48, 0], jet(0.2 / 0.7, bytes=True)[:3], atol=1)  # the left side of area 0
    np.testing.assert_allclose(out[150, 128], jet(1.0, bytes=True)[:3], atol=1)  # the left side of area 1


def test_region_sum_adds_each_weight_over_the_pixels_whose_centres_its_box_holds():
    """A reference from the mode's definition, with boxes at fractions of a pixel, one reaching past the picture's
    top-left corner and one of no weight."""
    boxes = np.array([[-7.3, -2.8, 60.2, 40.7], [30.6, 20.2, 99.0, 80.0], [10.0, 55.4, 45.8, 70.1],
                      [0.0, 0.0, 100.0, 80.0]], np.float32)
    weights = np.array([0.5, 0.3, 0.2, 0.0])
    xs, ys = np.arange(100) + 0.5, np.arange(80) + 0.5
    expected = sum(w * np.outer((ys >= y1) & (ys < y2), (xs >= x1) & (xs < x2))
                   for w, (x1, y1, x2, y2) in zip(weights, boxes))
    heat = heatmap(weights, Geometry("regions", (100, 80), None, boxes), "region_sum")
    np.testing.assert_allclose(heat, expected / expected.max(), atol=1e-6)


@pytest.mark.parametrize("mode", ["grid_blocks", "grid_smooth"])
def test_an_overlay_blends_the_heats_colour_into_the_photo_by_alpha(mode):
    """Each pixel is the photo's × (1 − alpha) + the colormap's colour of its drawn heat × alpha: everywhere for
    grid_smooth, only where there is heat for grid_blocks (half the cells here have none)."""
    photo = Image.fromarray(np.random.default_rng(2).integers(0, 256, (200, 300, 3), dtype=np.uint8))
    geometry = grid_geometry(EncoderSpec(), photo.size)
    row = np.random.default_rng(3).dirichlet(np.full(64, 0.3)) * np.tile([0, 1], 32)
    heat = drawn_heat(row, geometry, mode)
    colour = matplotlib.colormaps["viridis"](heat, bytes=True)[..., :3].astype(float)
    alpha = np.where(heat > 0, 0.3, 0.3 if mode == "grid_smooth" else 0.0)[..., None]
    expected = np.asarray(photo) * (1 - alpha) + colour * alpha
    out = np.asarray(overlay(photo, row, geometry, mode, "viridis", 0.3)).astype(float)
    np.testing.assert_allclose(out, expected, atol=1)


@pytest.mark.parametrize("mode", ["grid_smooth", "grid_blocks", "region_sum"])
def test_an_overlay_of_no_opacity_is_the_photo_itself_black_and_white_pixels_included(mode):
    pixels = np.zeros((200, 300, 3), np.uint8)
    pixels[:, 1::2] = 255  # black and white columns: the blend's clip keeps both ends of the range
    photo = Image.fromarray(pixels)
    if mode == "region_sum":
        geometry = Geometry("regions", (300, 200), None, np.array([[0, 0, 150, 200], [100, 0, 300, 100]], np.float32))
        weights = [0.1, 0.9]
    else:
        geometry, weights = grid_geometry(EncoderSpec(), photo.size), one_hot(27)
    assert overlay(photo, weights, geometry, mode, alpha=0.0).tobytes() == photo.tobytes()


def test_a_figures_panels_are_thumbnails_of_at_most_twice_the_panel_size(laid_out):
    photo = Image.new("RGB", (1000, 600), (200, 200, 200))
    geometry = grid_geometry(EncoderSpec(), photo.size)
    caption_figure(photo, ["a"], [np.full(64, 1 / 64)], geometry, panel_size=100)
    caption_figure(photo, ["a"], [np.full(64, 1 / 64)], geometry)  # 224 px panels by default
    portrait = photo.transpose(Image.Transpose.TRANSPOSE)  # bounded by its height, which a landscape never tests
    caption_figure(portrait, ["a"], [np.full(64, 1 / 64)], grid_geometry(EncoderSpec(), portrait.size))
    assert [[picture.size for _, picture in grid[0]] for grid, _ in laid_out] == [[(200, 120)] * 2, [(448, 269)] * 2,
                                                                                  [(269, 448)] * 2]


def test_a_captions_overlay_draws_the_tokens_row_and_refuses_a_negative_token():
    """Token i is tokens[i], ``<eos>`` last when the caption ended with it; a negative index is out of range, not
    the caption's last token counted from the end."""
    geometry = grid_geometry(EncoderSpec(), (256, 256))
    rows = np.stack([one_hot(0), one_hot(27), one_hot(63)])
    result = CaptionResult("m", "m", "soft", 1, ["a", "dog"], Hypothesis([4, 5, 2], [-0.5] * 3, torch.from_numpy(rows),
                                                                          ended_with_eos=True), geometry)
    photo = Image.new("RGB", (256, 256), (90, 120, 150))
    assert result.tokens == ["a", "dog", "<eos>"]
    assert result.overlay(photo, 2).tobytes() == overlay(photo, rows[2], geometry, "grid_smooth").tobytes()
    with pytest.raises(RenderError, match="token -1 is out of range"):
        result.overlay(photo, -1)


def test_a_captions_figure_has_an_eos_panel_and_its_overlay_refuses_a_token_past_the_last():
    """The figure draws every token, ``<eos>`` among them (one panel per attention row, as the papers' figures do),
    not only the words; the overlay's last token is ``<eos>``'s, and the index after it is out of range, not an
    IndexError from the rows."""
    geometry = grid_geometry(EncoderSpec(), (256, 256))
    rows = np.stack([one_hot(0), one_hot(27), one_hot(63)])
    result = CaptionResult("m", "m", "soft", 1, ["a", "dog"], Hypothesis([4, 5, 2], [-0.5] * 3, torch.from_numpy(rows),
                                                                          ended_with_eos=True), geometry)
    photo = Image.new("RGB", (256, 256), (90, 120, 150))
    want = caption_figure(photo, ["a", "dog", "<eos>"], rows, geometry, "grid_smooth")
    assert np.array_equal(np.asarray(result.figure(photo)), np.asarray(want))
    with pytest.raises(RenderError, match="token 3 is out of range: the caption has 3 tokens"):
        result.overlay(photo, 3)


def test_a_caption_draws_its_areas_weights_in_area_topk_only_and_keeps_its_area_boxes_in_a_figure_row():
    """A caption cut at max_len has no ``<eos>`` token; an area model's ``area_topk`` draws the areas' weights (the
    ``areas`` extra) with its area boxes, every other mode the attention over the cells."""
    attention, areas = torch.arange(128.0).reshape(2, 64), torch.arange(10.0).reshape(2, 5)
    boxes = np.array([[0, 0, 0, 0], [0, 0, 1, 1], [2, 2, 4, 5], [7, 7, 7, 7], [0, 0, 7, 7]])
    hypothesis = Hypothesis([4, 5], [-0.5] * 2, attention, {"areas": areas})
    result = CaptionResult("m", "m", "area", 1, ["a", "dog"], hypothesis, grid_geometry(EncoderSpec(), (256, 256)),
                           boxes)
    assert result.tokens == ["a", "dog"]
    assert np.array_equal(result.drawn_rows("area_topk"), areas.numpy())
    assert np.array_equal(result.drawn_rows("grid_blocks"), attention.numpy())
    row = result.figure_row("area", "area_topk")
    assert row.area_boxes is boxes and np.array_equal(row.attention, areas.numpy()) and row.mode == "area_topk"


def test_an_area_models_caption_draws_its_figure_and_overlays_in_area_topk_with_its_area_boxes():
    """``result.figure(photo, "area_topk")`` and ``result.overlay(photo, i, "area_topk")`` of an area model draw its
    areas' weights on the rectangles its area boxes name: a render without the boxes cannot place an area, so a
    library user would meet a RenderError for the one mode that shows what such a model attends to."""
    photo = Image.new("RGB", (256, 256), (120, 160, 200))
    attention, areas = torch.full((2, 64), 1 / 64), torch.tensor([[0.1, 0.6, 0.1, 0.1, 0.1], [0.7, 0.1, 0.1, 0, 0.1]])
    boxes = np.array([[0, 0, 0, 0], [0, 0, 1, 1], [2, 2, 4, 5], [7, 7, 7, 7], [0, 0, 7, 7]])
    geometry = grid_geometry(EncoderSpec(), photo.size)
    hypothesis = Hypothesis([4, 5], [-0.5] * 2, attention, {"areas": areas})
    result = CaptionResult("m", "m", "area", 1, ["a", "dog"], hypothesis, geometry, boxes)
    want = caption_figure(photo, ["a", "dog"], areas.numpy(), geometry, "area_topk", area_boxes=boxes)
    assert np.array_equal(np.asarray(result.figure(photo, "area_topk")), np.asarray(want))
    want = overlay(photo, areas[1].numpy(), geometry, "area_topk", area_boxes=boxes)
    assert np.array_equal(np.asarray(result.overlay(photo, 1, "area_topk")), np.asarray(want))


def test_an_all_zero_row_has_no_heat_strength():
    assert heat_strength(np.zeros(64)) == 0.0
    assert heat_strength([0.0, 0.0]) == 0.0


def test_a_comparison_figure_draws_its_overlays_in_the_default_style_unless_told(laid_out):
    """Without a colormap, alpha or panel size the panels are the overlay's defaults (jet, half the photo) on
    thumbnails of at most 448 px, as a caption figure's are."""
    photo = Image.new("RGB", (1000, 600), (120, 160, 200))
    geometry = grid_geometry(EncoderSpec(), photo.size)
    comparison_figure(photo, [FigureRow("sat", ["a"], [one_hot(9)], geometry, mode="grid_blocks")])
    ((grid, _),) = laid_out
    (_, thumb), (_, panel) = grid[0]
    assert thumb.size == (448, 269)
    # pixels compared as arrays: a failing bytes comparison of a 448-px panel took pytest minutes to explain
    assert np.array_equal(np.asarray(panel), np.asarray(overlay(thumb, one_hot(9), geometry, "grid_blocks")))


def test_smooth_heat_of_a_large_photo_mirrors_with_its_row():
    """Computed small and resized up, the smooth heat of a row turned end over end is the map turned end over end:
    the small map's pixel centres sit where the full map's do, not a pixel aside."""
    geometry = grid_geometry(EncoderSpec(), (1600, 1200))
    row = np.random.default_rng(4).dirichlet(np.full(64, 0.3))
    heat = heatmap(row, geometry, "grid_smooth")
    np.testing.assert_allclose(heatmap(row[::-1], geometry, "grid_smooth"), heat[::-1, ::-1], atol=1e-4)


def test_a_copy_too_small_for_any_pixel_centre_in_the_crop_has_no_heat():
    # a 512x256 photo's centre crop is x ∈ [144, 368): on a 2x1 copy it misses both pixel centres, a column of none
    geometry = grid_geometry(EncoderSpec(image_size=224, resize="center_crop", resize_to=256), (512, 256))
    for mode in ("grid_blocks", "grid_smooth"):
        heat = heatmap(one_hot(0, 49), geometry, mode, size=(2, 1))
        assert heat.shape == (1, 2) and not heat.any(), mode


@pytest.mark.parametrize("mode", ["grid_blocks", "grid_smooth"])
def test_a_pixel_whose_centre_is_on_the_crops_edge_is_inside_it(mode):
    """The crop holds the pixel centres in [x1, x2) × [y1, y2), as a cell's rectangle does: a 512x256 photo's centre
    crop x ∈ [144, 368), y ∈ [16, 240) is x ∈ [4.5, 11.5), y ∈ [0.5, 7.5) on a 16x8 copy, whose first column and
    row of the crop have their centres on its left and top edges."""
    geometry = grid_geometry(EncoderSpec(image_size=224, resize="center_crop", resize_to=256), (512, 256))
    heat = heatmap(np.full(49, 1 / 49), geometry, mode, size=(16, 8))
    xs, ys = np.arange(16) + 0.5, np.arange(8) + 0.5
    expected = np.outer((ys >= 0.5) & (ys < 7.5), (xs >= 4.5) & (xs < 11.5))
    np.testing.assert_allclose(heat, expected, atol=1e-5)


def test_a_one_column_grid_lights_its_own_cell():
    geometry = Geometry("grid", (100, 200), (2, 1), np.array([[0, 0, 100, 100], [0, 100, 100, 200]], np.float32))
    heat = heatmap([0.0, 1.0], geometry, "grid_blocks")
    assert not heat[:100].any() and (heat[100:] == 1).all()


def test_region_features_are_drawn_summed_unless_a_mode_is_given():
    regions = Geometry("regions", (200, 100), None, np.array([[0, 0, 100, 100], [50, 0, 200, 50]], np.float32))
    assert default_mode(regions) == default_mode(regions, "output_attention") == "region_sum"
    photo = Image.new("RGB", (200, 100), (90, 120, 150))
    assert overlay(photo, [0.1, 0.9], regions).tobytes() == overlay(photo, [0.1, 0.9], regions, "region_sum").tobytes()


def test_a_thumbnails_overlay_lights_the_attended_cell_scaled_to_the_thumbnail():
    """A figure's panels and the service's reduced decodes are drawn on a smaller copy: the geometry's boxes are in
    the original's pixels and must be scaled by the copy's size, or a 640x480 photo's cell (1, 1) is drawn on its
    160x120 thumbnail four times too far from the corner."""
    image = Image.new("RGB", (640, 480), (128, 128, 128))
    geometry = grid_geometry(EncoderSpec(), image.size)
    thumbnail = image.resize((160, 120))
    out = np.asarray(overlay(thumbnail, one_hot(9), geometry, "grid_blocks", alpha=0.6)).astype(int)
    ys, xs = np.nonzero(np.any(out != 128, axis=-1))
    assert (xs.min(), xs.max(), ys.min(), ys.max()) == (20, 39, 15, 29)  # the original's (80, 159, 60, 119) / 4


def test_a_caption_figure_has_five_panels_a_row_unless_told(laid_out):
    """The default layout every figure of ``captioner caption --overlay``, an archive and the service is drawn in."""
    image = Image.new("RGB", (300, 200), (200, 200, 200))
    geometry = grid_geometry(EncoderSpec(), image.size)
    caption_figure(image, ["a", "red", "circle", "on", "the"], [one_hot(i) for i in range(5)], geometry)
    ((grid, columns),) = laid_out
    assert columns == 5 and [len(row) for row in grid] == [5, 1]


def test_a_drawn_figure_is_closed_in_pyplot():
    """pyplot keeps every figure it makes until it is closed: a service drawing a figure per request, or an archive
    one per photo, would hold each of them in memory for good."""
    image = Image.new("RGB", (300, 200), (200, 200, 200))
    geometry = grid_geometry(EncoderSpec(), image.size)
    open_before = plt.get_fignums()
    caption_figure(image, ["a"], [one_hot(0)], geometry)
    assert plt.get_fignums() == open_before


@pytest.mark.parametrize("name, signature", [("figure.png", b"\x89PNG\r\n\x1a\n"), ("figure.jpg", b"\xff\xd8\xff"),
                                             ("FIGURE.JPEG", b"\xff\xd8\xff"), ("figure.Png", b"\x89PNG\r\n\x1a\n")])
def test_a_picture_is_saved_in_the_format_its_extension_names_in_any_case(tmp_path, name, signature):
    """``--overlay figure.jpg`` writes a JPEG, not PNG bytes under a JPEG's name; a camera's ``.JPG`` is a JPEG too."""
    path = save_picture(Image.new("RGB", (8, 6), (200, 30, 30)), tmp_path / name)
    assert path == tmp_path / name and path.read_bytes().startswith(signature)
    with Image.open(path) as saved:
        assert saved.size == (8, 6)


def test_a_picture_path_whose_extension_names_no_format_is_refused_and_nothing_is_written(tmp_path):
    with pytest.raises(ValueError, match="the extension names no picture format"):
        save_picture(Image.new("RGB", (8, 6)), tmp_path / "figure.txt")
    assert not list(tmp_path.iterdir())


def test_a_figures_panels_fill_their_cells():
    """The panels are laid out tight: with matplotlib's default margins each photo was drawn about a fifth narrower,
    in a frame of white (a quarter of the figure's pixels for a square one in rows of two)."""
    red = Image.new("RGB", (100, 100), (255, 0, 0))
    out = np.asarray(_figure([[("a", red), ("b", red)], [("c", red)]], 2)).astype(int)
    red_pixels = (out[..., 0] > 200) & (out[..., 1] < 50) & (out[..., 2] < 50)
    assert red_pixels.sum() / 3 > (0.8 * out.shape[1] / 2) ** 2  # each panel over 80 % of its cell's width


def test_a_figure_is_220_by_240_pixels_a_panel():
    """Each panel's cell is 2.2 × 2.4 inches at 100 dpi: the figure of a 2x3 layout is 660x480 pixels (a lower dpi
    drew every panel smaller and blurrier, and the only size check was 'wider than 400')."""
    red = Image.new("RGB", (100, 100), (255, 0, 0))
    assert _figure([[("a", red), ("b", red), ("c", red)], [("d", red)]], 3).size == (660, 480)


def test_a_region_overlay_leaves_the_pixels_outside_every_box_untouched():
    """As grid_blocks, region_sum colours only where its heat is: grid_smooth alone covers the whole photo."""
    photo = Image.new("RGB", (200, 100), (90, 120, 150))
    geometry = Geometry("regions", (200, 100), None, np.array([[0, 0, 100, 100], [50, 0, 200, 50]], np.float32))
    out = np.asarray(overlay(photo, [0.1, 0.9], geometry, "region_sum"))
    assert (out[50:, 100:] == (90, 120, 150)).all() and (out[:50, 50:] != (90, 120, 150)).any(-1).all()


def test_an_all_zero_rows_box_is_outlined_in_the_colormaps_lowest_colour():
    """An all-zero row's top box has a weight of 0 over a top weight of 0: drawn at 0, not at NaN, which the colormap
    draws black (and which warns)."""
    boxes = np.array([[0, 0, 100, 100], [50, 20, 180, 80]], np.float32)
    geometry = Geometry("regions", (350, 350), None, boxes)
    out = np.asarray(overlay(Image.new("RGB", (350, 350)), [0.0, 0.0], geometry, "top1_box"))
    assert tuple(out[50, 0]) == (0, 0, 127)  # jet at 0, on the first box's left edge


def test_a_small_copy_is_drawn_on_within_a_pixel_and_a_half_where_1_percent_is_less():
    """Under 150 px a side's 1 % is under a pixel and a half: a 57-px-wide copy of a 451x300 photo (an eighth, as a
    JPEG's reduced decode makes it) is 37.9 px tall, so 39 px is 1.1 px off and still its shape, 40 px is not."""
    geometry = grid_geometry(EncoderSpec(), (451, 300))
    weights = np.full(64, 1 / 64)
    assert overlay(Image.new("RGB", (57, 39)), weights, geometry).size == (57, 39)
    with pytest.raises(RenderError, match="draw on that picture"):
        overlay(Image.new("RGB", (57, 40)), weights, geometry)


def test_a_wide_pictures_boxes_and_labels_are_sized_by_its_shorter_side(monkeypatch):
    """The outline is a hundredth of the shorter side wide and the label's font a 24th of it: a 1200x300 panorama's
    are 3 px and 12 px, as a 300-px square's, not 12 px and 50 px from its width."""
    sizes, load_default = [], heatmaps.ImageFont.load_default

    def recording(size=None):
        sizes.append(size)
        return load_default(size=size)

    monkeypatch.setattr(heatmaps.ImageFont, "load_default", recording)
    geometry = grid_geometry(EncoderSpec(), (1200, 300))  # 150x37.5-px cells
    out = np.asarray(overlay(Image.new("RGB", (1200, 300)), [1.0], geometry, "area_topk",
                             area_boxes=np.array([[0, 0, 1, 1]]), top_k=1))
    assert sizes == [12]
    lit = out[60].any(-1)  # a row of the box below its label: its left outline, then its dark inside
    assert lit[:3].all() and not lit[3:20].any()


def test_an_area_label_is_written_inside_its_box_right_of_its_outline():
    """The weight is written in the box's top-left corner inside the outline, not across it: on an area in the middle
    of a dark photo, every white pixel of the label lies inside the box's outline."""
    geometry = grid_geometry(EncoderSpec(), (512, 512))  # 64-px cells; the outline is 5 px wide
    out = np.asarray(overlay(Image.new("RGB", (512, 512)), [1.0], geometry, "area_topk",
                             area_boxes=np.array([[2, 2, 5, 5]]), top_k=1)).astype(int)
    ys, xs = np.nonzero(out.min(-1) >= 240)
    assert len(xs) >= 40
    assert xs.min() >= 128 + 5 and ys.min() >= 128 + 5 and xs.max() < 384 - 5 and ys.max() < 384 - 5


@pytest.mark.parametrize("side, stroke", [(512, 2), (100, 1)])
def test_an_area_labels_black_outline_is_half_its_boxs_outline_wide(labels, side, stroke):
    """The weight's black outline is half the box's outline wide, at least a pixel: enough to read the white digits
    on a light photo without hiding more of the photo around them (as wide as the box's 5 px on a 512-px picture,
    each label sat in a black blob more than twice as thick)."""
    geometry = grid_geometry(EncoderSpec(), (side, side))  # outlines of 5 px at 512, 2 px (the least) at 100
    photo = Image.new("RGB", (side, side), (255, 255, 255))
    overlay(photo, [1.0], geometry, "area_topk", area_boxes=np.array([[2, 2, 5, 5]]), top_k=1)
    assert [width for _, width in labels] == [stroke]


@pytest.mark.parametrize("picture_mode", ["L", "RGBA", "P"])
@pytest.mark.parametrize("mode", ["grid_smooth", "grid_blocks", "top1_box"])
def test_an_overlay_of_a_picture_in_another_colour_mode_is_rgb(picture_mode, mode):
    """A library caller may pass a greyscale, transparent or palette picture as Pillow opened it: the overlay is RGB,
    drawn on the picture's RGB conversion, in every mode."""
    photo = Image.fromarray(np.random.default_rng(5).integers(0, 256, (200, 300, 3), dtype=np.uint8))
    picture = photo.convert(picture_mode)
    geometry = grid_geometry(EncoderSpec(), photo.size)
    out = overlay(picture, one_hot(27), geometry, mode)
    assert out.mode == "RGB" and out.size == photo.size
    assert out.tobytes() == overlay(picture.convert("RGB"), one_hot(27), geometry, mode).tobytes()


def test_a_greyscale_photos_figure_shows_it_in_grey_first(laid_out):
    """The figure's first panel is the photo converted to RGB: a greyscale one given as it is would be drawn by
    matplotlib through a colormap (viridis), its greys turned green and purple."""
    grey = Image.fromarray(np.random.default_rng(6).integers(0, 256, (200, 300), dtype=np.uint8))
    caption_figure(grey, ["a"], [one_hot(9)], grid_geometry(EncoderSpec(), grey.size))
    ((grid, _),) = laid_out
    (_, thumb), (_, panel) = grid[0]
    assert thumb.mode == panel.mode == "RGB" and thumb.tobytes() == grey.convert("RGB").tobytes()


def test_a_caption_figure_in_area_topk_hands_its_area_boxes_to_every_panel(laid_out):
    """An area model's figure in area_topk (``result.figure(photo, "area_topk")``, the service's figure in that mode)
    draws each word's areas with the caption's area boxes: without them every panel was refused."""
    image = Image.new("RGB", (300, 200), (120, 160, 200))
    geometry = grid_geometry(EncoderSpec(), image.size)
    areas = np.array([[0, 0, 0, 0], [0, 0, 1, 1], [2, 2, 4, 5]])
    rows = np.eye(3, dtype=np.float32) * 0.6 + 0.1
    caption_figure(image, ["a", "red", "dog"], rows, geometry, "area_topk", area_boxes=areas)
    ((grid, _),) = laid_out
    panels = [picture for row in grid for _, picture in row][1:]
    assert len(panels) == 3
    for row, picture in zip(rows, panels):
        assert picture.tobytes() == overlay(image, row, geometry, "area_topk", area_boxes=areas).tobytes()


@pytest.mark.parametrize("mode", ["grid_smooth", "grid_blocks"])
def test_an_overlay_of_full_opacity_is_the_heats_colours_where_it_draws(mode):
    """``alpha`` runs over [0, 1], both ends included: at 1 the heat's colours replace the photo wherever heat is
    drawn (the whole photo for grid_smooth, the lit cell alone for grid_blocks)."""
    photo = Image.fromarray(np.random.default_rng(7).integers(0, 256, (200, 300, 3), dtype=np.uint8))
    geometry = grid_geometry(EncoderSpec(), photo.size)
    heat = drawn_heat(one_hot(27), geometry, mode)
    out = np.asarray(overlay(photo, one_hot(27), geometry, mode, alpha=1.0))
    colours = matplotlib.colormaps["jet"](heat, bytes=True)[..., :3]
    drawn = np.ones(heat.shape, bool) if mode == "grid_smooth" else heat > 0
    np.testing.assert_array_equal(out[drawn], colours[drawn])
    np.testing.assert_array_equal(out[~drawn], np.asarray(photo)[~drawn])


@pytest.mark.parametrize("mode, hint", [("top1_box", True), ("area_topk", True), ("nope", False)])
def test_a_heatmap_asked_of_a_box_mode_points_to_overlay(mode, hint):
    """A box mode draws no heat map, but it is a mode: its refusal says where it is drawn; an unknown name's does
    not."""
    geometry = Geometry("regions", (200, 100), None, np.array([[0, 0, 100, 100], [50, 0, 200, 50]], np.float32))
    with pytest.raises(RenderError) as refused:
        heatmap([0.5, 0.5], geometry, mode)
    assert ("(it draws boxes: see overlay)" in str(refused.value)) == hint


def test_a_picture_that_fails_to_save_leaves_the_one_there_before_whole(tmp_path, monkeypatch):
    """A full disk part-way through a figure leaves the figure that was there before, never half of the new one,
    and no temporary file beside it (``save_picture``'s promise)."""
    path = tmp_path / "figure.png"
    save_picture(Image.new("RGB", (8, 6), (10, 20, 30)), path)
    before = path.read_bytes()

    def half_then_full(self, data):
        with open(self, "wb") as handle:
            handle.write(data[:len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", half_then_full)
    with pytest.raises(OSError):
        save_picture(Image.new("RGB", (64, 48), (200, 30, 30)), path)
    assert path.read_bytes() == before and list(tmp_path.iterdir()) == [path]


def test_png_bytes_are_a_lossless_png_of_the_picture():
    """The service answers every overlay and every JSON heat map with these bytes (service/rendering.py)."""
    picture = Image.fromarray(np.arange(4 * 6 * 3, dtype=np.uint8).reshape(4, 6, 3))
    encoded = heatmaps.png_bytes(picture)
    assert encoded.startswith(b"\x89PNG\r\n\x1a\n")
    with Image.open(io.BytesIO(encoded)) as decoded:
        assert decoded.size == (6, 4) and np.array_equal(np.asarray(decoded), np.asarray(picture))
