"""Attention grounding (models/evaluation/grounding.py) on hand-built maps whose answers are known."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from captioner.models.checkpoint import load_checkpoint, save_checkpoint
from captioner.models.data.karpathy import load_karpathy
from captioner.models.encoder import EncoderSpec, grid_geometry
from captioner.models.evaluation import figures
from captioner.models.evaluation.bootstrap import resampled_ratios
from captioner.models.evaluation.grounding import CaptionAttention, WordScore, bootstrap_mean, grounded_words, \
    grounding_report, markdown_table, normaliser_of, pixel_distribution, score_images, score_map, score_rows, summarise
from captioner.models.evaluation.params import count_parameters
from captioner.models.evaluation.zoo_table import END, START, grounding_figure, markdown, merged_reports, \
    normaliser_label, parameter_count, write_between_markers, write_zoo
from captioner.models.protocol import Geometry

from .conftest import ROOT
from .model_checks import two_by_two
from .serving_helpers import TINY_SPEC, VOCAB, tiny_model


def naive_distribution(weights, geometry: Geometry) -> np.ndarray:
    """Reference: each pixel centre takes weight / area of the item box containing it (boxes do not overlap)."""
    width, height = geometry.image_size
    out = np.zeros((height, width))
    for y in range(height):
        for x in range(width):
            for w, (x1, y1, x2, y2) in zip(weights, geometry.boxes):
                if x1 <= x + 0.5 < x2 and y1 <= y + 0.5 < y2:
                    out[y, x] += w / ((x2 - x1) * (y2 - y1))
    return out / out.sum()


def test_one_hot_cell_on_its_quadrant():
    dist = pixel_distribution([1, 0, 0, 0], two_by_two())
    quadrant = np.zeros((8, 8), bool)
    quadrant[:4, :4] = True
    assert dist.sum() == pytest.approx(1.0)
    assert score_map(dist, quadrant) == pytest.approx({"mass": 1.0, "pointing": 1.0, "ratio": 4.0})
    # a 2×2 corner of that cell: a quarter of the mass; the maximum is the whole cell, a quarter of it inside
    corner = np.zeros((8, 8), bool)
    corner[:2, :2] = True
    assert score_map(dist, corner) == pytest.approx({"mass": 0.25, "pointing": 0.25, "ratio": 4.0})
    # the opposite quadrant: nothing
    assert score_map(dist, quadrant[::-1, ::-1]) == pytest.approx({"mass": 0.0, "pointing": 0.0, "ratio": 0.0})


def test_uniform_map_scores_the_area_share():
    mask = np.zeros((8, 8), bool)
    mask[1:4, 2:7] = True  # 15 of 64 pixels, across cells
    scores = score_map(pixel_distribution(np.ones(4), two_by_two()), mask)
    assert scores == pytest.approx({"mass": 15 / 64, "pointing": 15 / 64, "ratio": 1.0})


@pytest.mark.parametrize("size", [(12, 8), (6, 10)])
def test_grid_follows_the_heatmap_geometry_on_non_square_images(size):
    geometry = two_by_two(size)
    weights = np.array([0.1, 0.2, 0.3, 0.4])
    assert np.allclose(pixel_distribution(weights, geometry), naive_distribution(weights, geometry))


def test_centre_crop_puts_no_attention_outside_the_crop():
    geometry = two_by_two((16, 8), resize="center_crop")  # the network sees the middle 8×8 square
    dist = pixel_distribution(np.ones(4), geometry)
    assert dist[:, :4].sum() == 0 and dist[:, 12:].sum() == 0
    assert dist[:, 4:12].sum() == pytest.approx(1.0)


def test_regions_spread_each_weight_over_its_own_box():
    geometry = Geometry(kind="regions", image_size=(10, 10), grid_hw=None,
                        boxes=np.array([[0, 0, 10, 10], [0, 0, 2, 2]], np.float32))
    dist = pixel_distribution([0.5, 0.5], geometry)
    small = np.zeros((10, 10), bool)
    small[:2, :2] = True
    # the small box holds its own 0.5 plus 4/100 of the whole-image region's 0.5
    scores = score_map(dist, small)
    assert scores["mass"] == pytest.approx(0.5 + 0.5 * 4 / 100)
    assert scores["pointing"] == 1.0
    assert scores["ratio"] == pytest.approx((0.5 + 0.02) / 0.04)


def test_region_boxes_are_placed_axis_by_axis_on_a_wide_image_drawn_at_another_size():
    """x runs along the width and y down the height, each scaled on its own: a transposed box, axis or scale moves
    the mass (the square image above cannot tell)."""
    geometry = Geometry(kind="regions", image_size=(40, 20), grid_hw=None,
                        boxes=np.array([[0, 0, 10, 20], [20, 4, 40, 12]], np.float32))
    left = pixel_distribution([1.0, 0.0], geometry, size=(20, 5))  # half the width, a quarter of the height
    assert left.shape == (5, 20) and left[:, :5] == pytest.approx(np.full((5, 5), 1 / 25)) and left[:, 5:].sum() == 0
    top_right = pixel_distribution([0.0, 1.0], geometry, size=(20, 5))  # rows 1 and 2 of 5
    assert top_right[1:3, 10:] == pytest.approx(np.full((2, 10), 1 / 20)) and top_right.sum() == pytest.approx(1.0)


def test_a_region_box_holds_the_pixels_whose_centres_fall_inside_it():
    """Box edges between pixel boundaries (a detector's boxes, or boxes scaled onto the image) take the pixels
    whose centres they hold, as :func:`naive_distribution` does: an edge at 0.7 leaves out pixel 0 (centre 0.5)
    and one at 3.6 takes in pixel 3 (centre 3.5).  Each box's weight is spread evenly over those pixels."""
    geometry = Geometry(kind="regions", image_size=(8, 8), grid_hw=None,
                        boxes=np.array([[0.7, 1.6, 3.6, 5.4], [4.4, 0.2, 7.7, 2.4]], np.float32))
    dist = pixel_distribution([0.75, 0.25], geometry)
    assert np.array_equal(dist > 0, naive_distribution([0.75, 0.25], geometry) > 0)
    assert dist[2:5, 1:4] == pytest.approx(np.full((3, 3), 0.75 / 9))  # rows 2–4, columns 1–3
    assert dist[0:2, 4:8] == pytest.approx(np.full((2, 4), 0.25 / 8))  # rows 0–1, columns 4–7


def test_region_rows_are_scored_per_pixel_as_score_map_scores_them():
    """score_rows counts grid cells; overlapping region boxes have no cells and take the pixel path."""
    geometry = Geometry(kind="regions", image_size=(10, 10), grid_hw=None,
                        boxes=np.array([[0, 0, 10, 10], [0, 0, 2, 2], [1, 1, 6, 4]], np.float32))
    rows = np.array([[0.5, 0.5, 0.0], [0.0, 0.2, 0.8], [1.0, 1.0, 1.0]])
    mask = np.zeros((10, 10), bool)
    mask[:3, :3] = True
    for row, scores in zip(rows, score_rows(rows, geometry, mask)):
        assert scores == pytest.approx(score_map(pixel_distribution(row, geometry), mask))


@pytest.mark.parametrize("size, resize, grid", [((37, 23), "stretch", 64), ((23, 37), "center_crop", 64),
                                                ((50, 50), "stretch", 96),
                                                ((60, 45), "stretch", 224),  # 7×7 cells: float32 k/49·49 falls below k
                                                ((2, 2), "stretch", 96)])  # cells that hold no pixel centre
def test_cell_scores_equal_the_pixel_scores(size, resize, grid):
    """score_rows counts pixels per cell; score_map of pixel_distribution counts them one by one."""
    geometry = grid_geometry(EncoderSpec(image_size=grid, resize=resize, resize_to=grid), size)
    rng = np.random.default_rng(1)
    cells = geometry.boxes.shape[0]
    rows = np.vstack([rng.random((4, cells)), np.zeros(cells), np.eye(cells)[:2], np.ones(cells),
                      np.where(rng.random(cells) < 0.5, 0.0, 0.3)])  # random, empty, one-hot, uniform, plateaus
    mask = np.zeros(size[::-1], bool)
    mask[3:17, 5:20] = True
    mask[size[1] - 4:, size[0] - 6:] = True
    for row, fast in zip(rows, score_rows(rows, geometry, mask)):
        # (the pixel path renders the weights in float32)
        assert fast == pytest.approx(score_map(pixel_distribution(row, geometry, size), mask), rel=1e-6, abs=1e-9)


def test_single_peak_outside_the_object_misses():
    dist = np.full((4, 4), 0.5 / 15)
    dist[3, 3] = 0.5
    mask = np.zeros((4, 4), bool)
    mask[:2, :2] = True
    assert score_map(dist, mask)["pointing"] == 0.0
    assert score_map(dist, mask)["mass"] == pytest.approx(4 * 0.5 / 15)


def test_bad_inputs_are_rejected():
    with pytest.raises(ValueError):
        pixel_distribution([-1, 1, 1, 1], two_by_two())
    with pytest.raises(ValueError):
        score_map(np.ones((4, 4)) / 16, np.zeros((4, 4), bool))
    with pytest.raises(ValueError, match="differ in shape"):  # a mask of width × height rather than height × width
        score_map(np.ones((4, 8)) / 32, np.ones((8, 4), bool))
    # the per-cell path of Entities phrases refuses an empty box mask in score_map's words (not a ZeroDivisionError)
    with pytest.raises(ValueError, match="^the object mask is empty$"):
        score_rows(np.ones((1, 4)), two_by_two(), np.zeros((8, 8), bool))


def test_grounded_words_only_for_correct_colour_shape_pairs():
    objects = [{"colour": "red", "shape": "circle"}, {"colour": "blue", "shape": "square"},
               {"colour": "blue", "shape": "square"}]
    tokens = "a red circle and two blue squares and a green star".split()
    assert grounded_words(tokens, objects) == [(1, "colour", [0]), (2, "shape", [0]), (5, "colour", [1, 2]),
                                               (6, "shape", [1, 2])]
    assert grounded_words("a red square".split(), objects) == []  # wrong pairing names nothing


def test_a_shape_ending_in_s_is_named_in_the_plural_with_es():
    """No generated shape ends in "s" yet, but grounded_words takes any scene's objects: "crosses", not "crosss"."""
    crosses = [{"colour": "green", "shape": "cross"}] * 2
    assert grounded_words("two green crosses".split(), crosses) == [(1, "colour", [0, 1]), (2, "shape", [0, 1])]


def test_bootstrap_interval():
    mean, low, high = bootstrap_mean([[1.0, 1.0], [1.0]])
    assert (mean, low, high) == (1.0, 1.0, 1.0)
    # pooled over words: image A has 3 words at 1, image B one word at 0 → 0.75
    mean, low, high = bootstrap_mean([[1, 1, 1], [0]], resamples=4000)
    assert mean == pytest.approx(0.75)
    assert low == 0.0 and high == 1.0  # some resamples hold B twice, some A twice
    values = [[v] for v in np.random.default_rng(0).normal(0.5, 0.1, 400)]
    mean, low, high = bootstrap_mean(values)
    assert low < mean < high and high - low == pytest.approx(2 * 1.96 * 0.1 / 20, rel=0.2)


def test_bootstrap_resamples_only_the_images_that_have_words_of_the_class():
    """summarise hands bootstrap_mean one list per evaluated image, empty for an image with no word of the class (a
    rare class such as a held-out colour has many): those images are left out of the resampling, so the interval is
    the same however many wordless images the split holds, and a resample of wordless images only cannot make it
    0/0."""
    values = [[v] for v in np.random.default_rng(0).random(5)]
    assert bootstrap_mean(values + [[]] * 15, resamples=200) == bootstrap_mean(values, resamples=200)


def test_summary_intervals_take_the_resamples_asked_for_and_repeat_run_after_run():
    """--grounding-resamples reaches every interval of the table (7 resamples give another interval than the default
    2000), and the bootstrap's seed is fixed, so the same scores give the same interval on every run."""
    values = np.random.default_rng(0).random(6)
    scores = [WordScore(i, "colour", "model", {"mass": v, "pointing": v, "ratio": v}) for i, v in enumerate(values)]
    mean, low, high = bootstrap_mean([[v] for v in values], resamples=7)
    assert summarise(scores, 6, resamples=7)[0]["mass"] == {"mean": round(mean, 4),
                                                           "ci95": [round(low, 4), round(high, 4)]}
    assert bootstrap_mean([[v] for v in values], resamples=7) == (mean, low, high)
    assert bootstrap_mean([[v] for v in values])[1:] != (low, high)


def test_summary_statistics_are_reported_to_four_decimals():
    scores = [WordScore(0, "colour", "model", {"mass": m, "pointing": m, "ratio": 4 * m}) for m in (1.0, 0.0, 0.0)]
    row = summarise(scores, 1, resamples=10)[0]
    assert row["mass"] == {"mean": 0.3333, "ci95": [0.3333, 0.3333]} and row["ratio"]["mean"] == 1.3333


TWO_SCENES = (("red", "circle", slice(0, 4), slice(0, 4)), ("blue", "square", slice(4, 8), slice(4, 8)))


def _scene(tmp_path: Path, scenes=TWO_SCENES) -> list:
    """8×8 scenes with one object each, ``(colour, shape, rows, columns)``; by default two: a red circle in the
    top-left quadrant, a blue square bottom-right."""
    (tmp_path / "masks").mkdir()
    entries = []
    for index, (colour, shape, rows, cols) in enumerate(scenes):
        label = np.zeros((8, 8), np.uint8)
        label[rows, cols] = 1
        Image.fromarray(label).save(tmp_path / "masks" / f"{index}.png")
        entries.append({"filename": f"{index}.jpg", "imgid": index, "split": "test", "mask": f"masks/{index}.png",
                        "objects": [{"colour": colour, "shape": shape}],
                        "sentences": [{"tokens": ["a", colour, shape]}]})
    (tmp_path / "d.json").write_text(json.dumps({"images": entries}))
    return load_karpathy(tmp_path / "d.json")


def test_a_grounding_table_row_holds_its_counts_and_statistics_in_the_headers_order():
    """Each column under its own header: words before images, then mass, pointing and ratio (the scenes' test has
    one mean for all three)."""
    def stat(mean):
        return {"mean": mean, "ci95": [mean - 0.25, mean + 0.25]}

    row = {"control": "uniform", "word_class": "colour", "words": 7, "images": 3, "mass": stat(0.5),
           "pointing": stat(0.625), "ratio": stat(1.5)}
    assert markdown_table([("toy", {"normaliser": "softmax", "rows": [row]})]).splitlines()[2] == (
        "| toy | softmax | chance: uniform, colour | 7 | 3 | 0.500 [0.250, 0.750] | 0.625 [0.375, 0.875] | "
        "1.500 [1.250, 1.750] |")


def _scene_captions(red_circle_rows, blue_square_rows):
    """The two scenes' captions ("a red circle", "a blue square") with the given attention rows over a 2×2 grid."""
    geometry = two_by_two()
    return [CaptionAttention(["a", "red", "circle"], np.array(red_circle_rows, float), geometry),
            CaptionAttention(["a", "blue", "square"], np.array(blue_square_rows, float), geometry)]


def test_score_images_with_chance_controls(tmp_path):
    images = _scene(tmp_path)
    # each caption's colour and shape words attend to their own object's cell; the article attends elsewhere
    results = _scene_captions([[0, 0, 0, 1], [1, 0, 0, 0], [1, 0, 0, 0]], [[1, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 1]])
    scores = score_images(images, results, tmp_path)
    by = {(w.control, w.image, w.word_class): w.scores for w in scores}
    assert by[("model", 0, "colour")] == pytest.approx({"mass": 1.0, "pointing": 1.0, "ratio": 4.0})
    assert by[("uniform", 1, "shape")] == pytest.approx({"mass": 0.25, "pointing": 0.25, "ratio": 1.0})
    # the other image's shape word looks at the opposite corner: a miss
    assert by[("other image", 0, "shape")] == pytest.approx({"mass": 0.0, "pointing": 0.0, "ratio": 0.0})
    rows = summarise(scores, len(images), resamples=200)
    model_all = next(r for r in rows if r["control"] == "model" and r["word_class"] == "all")
    assert model_all["words"] == 4 and model_all["images"] == 2 and model_all["mass"]["mean"] == 1.0
    table = markdown_table([("toy", {"normaliser": "softmax", "rows": rows})])
    assert "chance: uniform" in table and "chance: other image" in table and "1.000 [1.000, 1.000]" in table


def test_each_named_word_is_scored_on_its_own_attention_row(tmp_path):
    """The row aligned with a word is the one that fed its prediction: each scene's colour word looks at its
    object and its shape word (the next row) away from it, so the colour words hit and the shape words miss, and the
    other-image control reads the other scene's colour row, not its shape row."""
    images = _scene(tmp_path)
    results = _scene_captions([[0, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 1]], [[0, 1, 0, 0], [0, 0, 0, 1], [1, 0, 0, 0]])
    by = {(w.control, w.image, w.word_class): w.scores["mass"] for w in score_images(images, results, tmp_path)}
    assert [by[("model", image, word)] for image in (0, 1) for word in ("colour", "shape")] == [1.0, 0.0, 1.0, 0.0]
    assert [by[("other image", image, word)] for image in (0, 1) for word in ("colour", "shape")] == [0.0, 1.0,
                                                                                                     0.0, 1.0]


def test_another_scenes_region_row_is_placed_by_that_scenes_own_boxes(tmp_path):
    """Region boxes belong to their image: the other-image control reads the other scene's row through that
    scene's boxes, scaled onto this one (here drawn at twice the size, item 0 in the other corner), not through
    this scene's box of the same index."""
    images = _scene(tmp_path)
    quadrants = np.array([[0, 0, 4, 4], [4, 4, 8, 8]], np.float32)
    first = Geometry(kind="regions", image_size=(8, 8), grid_hw=None, boxes=quadrants)
    second = Geometry(kind="regions", image_size=(16, 16), grid_hw=None, boxes=quadrants[::-1] * 2)
    rows = np.array([[0, 1], [1, 0], [1, 0]], float)  # each scene's words look at item 0, its own object's box
    results = [CaptionAttention(["a", "red", "circle"], rows, first),
               CaptionAttention(["a", "blue", "square"], rows, second)]
    by = {(w.control, w.image, w.word_class): w.scores["mass"] for w in score_images(images, results, tmp_path)}
    assert by[("model", 0, "shape")] == by[("model", 1, "shape")] == 1.0
    assert by[("other image", 0, "shape")] == by[("other image", 1, "colour")] == 0.0


def test_the_uniform_control_spreads_over_the_items_the_encoder_saw(tmp_path):
    """Chance is attention spread evenly over the visual items, so on a centre-cropped 16×8 scene nothing falls
    outside the middle 8×8 the encoder saw: an object on columns 0–5 holds 2 of the crop's 8 columns (0.25),
    not 6 of the image's 16 (0.375)."""
    (tmp_path / "masks").mkdir()
    label = np.zeros((8, 16), np.uint8)
    label[:, :6] = 1
    Image.fromarray(label).save(tmp_path / "masks" / "0.png")
    (tmp_path / "d.json").write_text(json.dumps({"images": [
        {"filename": "0.jpg", "imgid": 0, "split": "test", "mask": "masks/0.png",
         "objects": [{"colour": "red", "shape": "circle"}], "sentences": [{"tokens": ["a", "red", "circle"]}]}]}))
    results = [CaptionAttention(["a", "red", "circle"], np.eye(4)[:3], two_by_two((16, 8), "center_crop"))]
    by = {(w.control, w.word_class): w.scores for w in score_images(load_karpathy(tmp_path / "d.json"), results,
                                                                      tmp_path)}
    assert by[("uniform", "shape")] == pytest.approx({"mass": 0.25, "pointing": 0.25, "ratio": 0.25 / 0.375})


def test_a_data_set_without_object_masks_is_refused_naming_the_image(tmp_path):
    """Scenes grounding needs the generated scenes' label masks: an image without one is a ValueError naming it
    (``captioner eval`` prints it in one line), not a KeyError."""
    images = _scene(tmp_path)
    del images[1].info["mask"]
    results = [CaptionAttention(["a", "red", "circle"], np.eye(4)[:3], two_by_two()) for _ in images]
    with pytest.raises(ValueError, match=r"^1\.jpg has no object mask: grounding needs generated scenes$"):
        score_images(images, results, tmp_path)


def test_an_ensembles_normaliser_names_each_members_map_as_the_table_does():
    """The grounding report names an ensemble's map as the mean of its members' maps, each named as a model of its
    kind is: the area Transformer's as its softmax over areas spread onto cells, not its own attention name."""
    ensemble = SimpleNamespace(model=tiny_model("ensemble"))  # SAT and the area Transformer
    assert normaliser_of(ensemble) == "mean of softmax and softmax over areas → cells"


def test_score_images_draws_the_maps_at_each_scenes_own_width_and_height(tmp_path):
    """Generated scenes vary in aspect ratio (portrait included), so a map is drawn at its label mask's width ×
    height, through the centre crop of that scene: a wide 16×8 scene with its circle on the left half, a tall 8×16
    one with its square on the top half; the tall scene's shape word, read over the wide scene (the other-image
    control), is placed by the wide scene's cells (the top row of its crop: half of the circle's mass)."""
    (tmp_path / "masks").mkdir()
    entries = []
    for index, (colour, shape, size) in enumerate([("red", "circle", (16, 8)), ("blue", "square", (8, 16))]):
        label = np.zeros(size[::-1], np.uint8)
        label[:size[1] // 2 if index else size[1], :size[0] // 2 if not index else size[0]] = 1
        Image.fromarray(label).save(tmp_path / "masks" / f"{index}.png")
        entries.append({"filename": f"{index}.jpg", "imgid": index, "split": "test", "mask": f"masks/{index}.png",
                        "objects": [{"colour": colour, "shape": shape}],
                        "sentences": [{"tokens": ["a", colour, shape]}]})
    (tmp_path / "d.json").write_text(json.dumps({"images": entries}))
    left, top = [0.5, 0, 0.5, 0], [0.5, 0.5, 0, 0]
    results = [CaptionAttention(["a", "red", "circle"], np.array([[0, 0, 0, 1], left, left], float),
                                two_by_two((16, 8), "center_crop")),
               CaptionAttention(["a", "blue", "square"], np.array([[0, 0, 0, 1], top, top], float),
                                two_by_two((8, 16), "center_crop"))]
    by = {(w.control, w.image, w.word_class): w.scores
          for w in score_images(load_karpathy(tmp_path / "d.json"), results, tmp_path)}
    assert by[("model", 0, "shape")] == pytest.approx({"mass": 1.0, "pointing": 1.0, "ratio": 2.0})
    assert by[("model", 1, "shape")] == pytest.approx({"mass": 1.0, "pointing": 1.0, "ratio": 2.0})
    assert by[("other image", 0, "shape")] == pytest.approx({"mass": 0.5, "pointing": 0.5, "ratio": 1.0})


@pytest.mark.parametrize("row", [[-0.5, 1.0, 0.25, 0.25], [np.inf, 0.0, 0.0, 0.0], [np.nan, 1.0, 0.0, 0.0]])
def test_the_per_cell_path_refuses_weights_the_pixel_path_refuses(row):
    """score_rows (the Entities phrases' path) checks the weights itself, as pixel_distribution does: a negative
    weight would otherwise score a mass outside [0, 1]."""
    mask = np.ones((8, 8), bool)
    with pytest.raises(ValueError, match="finite and non-negative"):
        score_rows(np.array([row]), two_by_two(), mask)


def test_bootstrap_interval_is_the_95_percent_percentile_interval():
    """The tables' ci95: the 2.5th and 97.5th percentiles of the resampled pooled means (seed 0), not another
    level's."""
    values = [[v] for v in np.random.default_rng(3).random(30)]
    sums, counts = np.array([v[0] for v in values]), np.ones(30)
    ratios = resampled_ratios(sums, counts, 2000, 0)
    _, low, high = bootstrap_mean(values)
    assert (low, high) == pytest.approx(tuple(np.percentile(ratios, [2.5, 97.5])))


def test_the_other_image_control_takes_the_next_image_with_a_word_of_the_class_and_its_first_such_row(tmp_path):
    """With three scenes the "next image" is not the previous one (two scenes cannot tell them apart): each scene's
    words look at the previous scene's object, so every other-image row lands on this scene's object.  Scene 1
    names its square twice, the second time looking elsewhere: the control reads its first row of each class."""
    images = _scene(tmp_path, (*TWO_SCENES, ("green", "star", slice(0, 4), slice(4, 8))))  # the star top right
    top_left, top_right, bottom_left, bottom_right = np.eye(4)
    results = [CaptionAttention(["a", "red", "circle"], np.array([top_left, top_right, top_right]), two_by_two()),
               CaptionAttention("a blue square by a blue square".split(),
                                np.array([top_left, top_left, top_left, top_left, top_left, bottom_left,
                                          bottom_left]), two_by_two()),
               CaptionAttention(["a", "green", "star"], np.array([top_left, bottom_right, bottom_right]),
                                two_by_two())]
    by = {(w.control, w.image, w.word_class): w.scores["mass"] for w in score_images(images, results, tmp_path)}
    assert [by[("other image", image, word)] for image in range(3) for word in ("colour", "shape")] == [1.0] * 6


def test_zoo_table_from_records_and_reports(tmp_path):
    meta = {"train_seconds": 240, "hardware": "a test CPU", "train_config": {"threads": 2},
            "started_from": {"train_seconds": 360}}
    checkpoint = save_checkpoint(tmp_path / "weights" / "toy", tiny_model("sparsecap", attention="tvmax"), VOCAB,
                                 TINY_SPEC, meta=meta)
    hard = save_checkpoint(tmp_path / "weights" / "hard", tiny_model("sat-hard"), VOCAB, TINY_SPEC)  # no report
    # the parameters the card and GET /models count, without loading the weights: SAT-hard's buffers are none
    assert parameter_count(hard) == count_parameters(load_checkpoint(hard).model)
    assert parameter_count(checkpoint) == count_parameters(load_checkpoint(checkpoint).model)
    results = tmp_path / "results"
    results.mkdir()
    stat = {"mean": 0.5, "ci95": [0.4, 0.6]}
    rows = [{"control": c, "word_class": "all", "words": 4, "images": 2, "mass": stat, "pointing": stat, "ratio": stat}
            for c in ("model", "uniform", "other image")]
    (results / "toy.json").write_text(json.dumps({"test": {"images": 2, "objects_named": 0.9, "CIDEr-D": 3.0,
                                                           "BLEU-4": 0.6, "grounding": {"normaliser": "tvmax",
                                                                                       "rows": rows}}}))
    (results / "toy.ood.json").write_text(json.dumps({"ood": {"images": 3, "objects_named": 0.7}}))
    document = tmp_path / "zoo.md"
    document.write_text("# Zoo\n\nprose stays\n")
    first = write_zoo(tmp_path / "weights", results, document, tmp_path / "figures" / "grounding.png")
    size = f"{parameter_count(checkpoint) / 1e6:.1f} M"
    # the training time counts the run it started from
    assert f"| toy | sparsecap | tvmax | {size} | 10 min on a test CPU, 2 thread(s) | 0.900 (n=2) | — | 0.700 (n=3) " \
           "| 3.000 | 0.600 | 0.500 [0.400, 0.600] | 0.500 [0.400, 0.600] |" in first
    heading = "## All shipped checkpoints (generated by `captioner zoo-table`)"
    assert first.startswith(f"{START}\n\n{heading}\n\n| checkpoint |")
    assert f"| hard | sat-hard | hard | {parameter_count(hard) / 1e6:.1f} M | not recorded on 2-core CPU (not " \
           "recorded) | — | — | — | — | — | — | — |" in first
    assert "chance: uniform" in first and (tmp_path / "figures" / "grounding.png").stat().st_size > 1000
    assert "\n### Attention grounding (test split)\n\n| " in first
    assert first.endswith(f"\n\n![grounding](figures/grounding.png)\n\n{END}")  # beside the document's figures/
    again = write_zoo(tmp_path / "weights", results, document, tmp_path / "grounding.png")
    assert again.endswith(f"\n\n![grounding]({tmp_path / 'grounding.png'})\n\n{END}")  # elsewhere: as given
    text = document.read_text()
    assert text.startswith("# Zoo\n\nprose stays\n") and text.count("zoo-table:start") == 1
    assert text.endswith(f"{again}\n")


def test_zoo_table_labels_the_ensembles_and_sat_hards_normalisers():
    assert normaliser_label({"arch": "ensemble", "model": {"attention": "tvmax"}}) == "ensemble"
    assert normaliser_label({"arch": "sat-hard", "model": {}}) == "hard"
    assert normaliser_label({"arch": "sparsecap", "model": {"attention": "sparsemax"}}) == "sparsemax"


def test_zoo_table_cells_say_what_no_record_holds():
    """Hand-built rows: a checkpoint without a training record or scores says so; the grounding cells are the
    model's own row over all words, not a chance control's or one word class's."""
    def stat(mean):
        return {"mean": mean, "ci95": [mean - 0.1, mean + 0.1]}

    grounding = {"rows": [{"control": "uniform", "word_class": "all", "mass": stat(0.2), "pointing": stat(0.2)},
                          {"control": "model", "word_class": "colour", "mass": stat(0.3), "pointing": stat(0.3)},
                          {"control": "model", "word_class": "all", "mass": stat(0.5), "pointing": stat(0.7)}]}
    old = {"name": "old", "arch": "sat", "normaliser": "softmax", "parameters": 12_345_678, "train_seconds": None,
           "hardware": None, "threads": None,
           "splits": {"test": {"images": 4, "BLEU-4": 0.25}, "heldout": {"images": 5, "objects_named": 0.5}}}
    new = {**old, "name": "new", "parameters": 2_000_000, "train_seconds": 5400, "hardware": "a GPU", "threads": 2,
           "splits": {"test": {"images": 4, "CIDEr-D": 1.5, "grounding": grounding}}}
    lines = markdown([old, new]).splitlines()
    assert lines[0].strip("| ").split(" | ") == [
        "checkpoint", "architecture", "normaliser", "parameters", "training", "test objects_named",
        "held-out objects_named", "OOD objects_named", "CIDEr-D (test)", "BLEU-4 (test)", "grounding mass (test)",
        "pointing hit (test)"]
    assert lines[1] == "|---" * 12 + "|"
    assert lines[2] == ("| old | sat | softmax | 12.3 M | not recorded on 2-core CPU (not recorded) | — | 0.500 (n=5) "
                        "| — | — | 0.250 | — | — |")
    assert lines[3] == ("| new | sat | softmax | 2.0 M | 90 min on a GPU, 2 thread(s) | — | — | — | 1.500 | — "
                        "| 0.500 [0.400, 0.600] | 0.700 [0.600, 0.800] |")
    assert lines[5].startswith("Grounding: attention of every word") and len(lines) == 6


def test_zoo_table_rounds_a_training_time_to_the_nearest_minute():
    """The table compares what each checkpoint cost to train: a run of 9 min 50 s is "10 min", not the 9 that
    dropping the seconds would print (which understates every run that is not a whole number of minutes)."""
    record = {"train_seconds": 590, "hardware": "a test CPU", "threads": None, "splits": {}}
    row = {"name": "r", "arch": "sat", "normaliser": "softmax", "parameters": 1_000_000, **record}
    assert markdown([row]).splitlines()[2].startswith("| r | sat | softmax | 1.0 M | 10 min on a test CPU | — |")


def test_zoo_table_merges_a_checkpoints_own_reports_later_files_winning(tmp_path):
    reports = {"toy.json": {"beam_size": 3, "decoding": {"length_penalty": 0.0}, "test": {"images": 2, "BLEU-4": 0.1}},
               "toy.ood.json": {"ood": {"images": 3}, "test": {"images": 2, "BLEU-4": 0.2}},
               "toy2.json": {"heldout": {"images": 9}}}  # another checkpoint's
    for name, report in reports.items():
        (tmp_path / name).write_text(json.dumps(report))
    assert merged_reports(tmp_path, "toy") == {"test": {"images": 2, "BLEU-4": 0.2}, "ood": {"images": 3}}


def test_zoo_table_figure_draws_each_models_controls_over_all_words(tmp_path, monkeypatch):
    drawn = []
    monkeypatch.setattr(figures, "control_bars", lambda *args: drawn.append(args) or args[-1])

    def stat(mean):
        return {"mean": mean, "ci95": [mean, mean]}

    def row(control, word_class, mean):
        return {"control": control, "word_class": word_class, "mass": stat(mean), "pointing": stat(mean + 0.1)}

    rows = [{"name": "a", "splits": {"test": {"grounding": {"normaliser": "tvmax", "rows": [
        row("model", "colour", 0.9), row("model", "all", 0.5), row("uniform", "all", 0.2),
        row("other image", "all", 0.3)]}}}},
        {"name": "b", "splits": {"test": {"images": 2}}}]  # no grounding: no bars
    assert grounding_figure(rows, tmp_path / "g.png") == tmp_path / "g.png"
    [(panels, controls, labels, out)] = drawn
    assert controls == ("model", "other image", "uniform") and out == tmp_path / "g.png"
    assert labels == {"model": "attention", "other image": "chance: other image", "uniform": "chance: uniform"}
    assert panels == [
        ("mass in object", [("a\n(tvmax)", {"model": stat(0.5), "other image": stat(0.3), "uniform": stat(0.2)})]),
        ("pointing-game hit", [("a\n(tvmax)", {"model": stat(0.5 + 0.1), "other image": stat(0.3 + 0.1),
                                               "uniform": stat(0.2 + 0.1)})])]
    assert grounding_figure(rows[1:], tmp_path / "none.png") is None and not drawn[1:]


def test_zoo_table_markers_are_the_ones_docs_model_zoo_holds(tmp_path):
    """`make zoo-table` replaces the text between these markers; with other ones it would append a second table."""
    text = (ROOT / "docs" / "model_zoo.md").read_text()
    assert text.count(START) == text.count(END) == 1 and text.index(START) < text.index(END)
    # and a document in a folder not made yet is written, with both markers
    document = tmp_path / "new" / "docs" / "zoo.md"
    write_between_markers(document, [START, "table", END])
    assert document.read_text() == f"\n\n{START}\ntable\n{END}\n"


def test_zoo_table_keeps_the_prose_after_its_block_that_quotes_the_end_marker(tmp_path):
    """The block ends at the first end marker after its start: prose further down that quotes the end marker (a
    note on how the page is generated) stays, word for word, rather than being cut at the quote or swallowed up to
    it."""
    document = tmp_path / "zoo.md"
    after = f"\n\n## How this page is made\n\nThe table ends at `{END}`; below it is written by hand.\n"
    document.write_text(f"# Zoo\n\n{START}\nold table\n{END}{after}")
    write_between_markers(document, [START, "new table", END])
    assert document.read_text() == f"# Zoo\n\n{START}\nnew table\n{END}{after}"


def test_a_zero_one_mask_of_another_dtype_scores_as_the_boolean_mask():
    # a label mask compared with an id, or read from a PNG, is 0/1 of an integer dtype: used as an index it would
    # pick rows 0 and 1 rather than the masked pixels
    distribution = pixel_distribution(np.arange(1.0, 5.0), two_by_two())
    mask = np.zeros((8, 8), bool)
    mask[:4, 4:] = True
    expected = score_map(distribution, mask)
    assert expected["mass"] == pytest.approx(0.2)
    for dtype in (np.uint8, np.int64, np.float32):
        assert score_map(distribution, mask.astype(dtype)) == pytest.approx(expected)


def test_a_mean_over_no_values_is_nan_with_a_nan_interval():
    assert all(np.isnan(v) for v in bootstrap_mean([[], []], resamples=10))


def test_the_grounding_report_names_its_map_and_holds_the_summary_of_every_word(tmp_path):
    """The section `captioner eval --grounding` writes (test_cli replaces it with a stub)."""
    images = _scene(tmp_path)
    results = _scene_captions([[0, 0, 0, 1], [1, 0, 0, 0], [1, 0, 0, 0]], [[1, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 1]])
    ckpt = SimpleNamespace(model=tiny_model("sat"))
    report = grounding_report(ckpt, images, results, tmp_path, resamples=50)
    assert (report["normaliser"], report["attention_kind"]) == ("softmax", ckpt.model.attention_kind)
    assert report["rows"] == summarise(score_images(images, results, tmp_path), len(images), 50)
    assert "grid cells / region boxes" in report["map"]


def test_a_near_tie_within_a_millionth_is_one_plateau_on_both_paths():
    """Two cells a millionth apart (float noise of a softmax) share the maximum: the per-pixel path counts the
    plateau as the per-cell path does, so pointing is half a hit for a mask on one of them."""
    row = np.array([1.0, 1.0 - 5e-7, 0.0, 0.0])  # apart in float32 too, which the pixel path renders in
    mask = np.zeros((8, 8), bool)
    mask[:4, :4] = True
    assert score_map(pixel_distribution(row, two_by_two()), mask)["pointing"] == pytest.approx(0.5)
    assert score_rows(row[None], two_by_two(), mask)[0]["pointing"] == pytest.approx(0.5)


def test_a_map_whose_weight_partly_falls_on_no_pixel_is_renormalised_over_the_pixels_it_reaches():
    """Attention on a region box too small to hold a pixel centre (a detector's sliver, or a box scaled onto a
    small image) reaches no pixel: the rest of the map still sums to 1, so a mask over the whole image holds all the
    mass (ratio 1) rather than the half the other box got."""
    geometry = Geometry(kind="regions", image_size=(8, 8), grid_hw=None,
                        boxes=np.array([[0, 0, 8, 8], [3.1, 3.1, 3.3, 3.3]], np.float32))
    dist = pixel_distribution([0.5, 0.5], geometry)
    assert dist.sum() == pytest.approx(1.0) and dist == pytest.approx(np.full((8, 8), 1 / 64))
    everything = np.ones((8, 8), bool)
    assert score_rows(np.array([[0.5, 0.5]]), geometry, everything)[0] == pytest.approx(
        {"mass": 1.0, "pointing": 1.0, "ratio": 1.0})


def test_a_word_whose_object_left_no_pixel_in_the_mask_is_skipped_and_the_others_are_scored(tmp_path):
    """An object named by the caption but absent from its scene's label mask (a scene set drawn by other means than
    the generator: an object too small to hold a pixel, or hidden) has nothing to score against: its words are left
    out rather than ending ``eval --grounding`` with "the object mask is empty", and the other scene's are scored."""
    nothing, corner = slice(0, 0), slice(4, 8)
    images = _scene(tmp_path, (("red", "circle", nothing, nothing), ("blue", "square", corner, corner)))
    results = _scene_captions([[0, 0, 0, 1], [1, 0, 0, 0], [1, 0, 0, 0]], [[1, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 1]])
    scores = score_images(images, results, tmp_path)
    assert {w.image for w in scores} == {1}
    by = {(w.control, w.word_class): w.scores for w in scores}
    assert by[("model", "shape")] == pytest.approx({"mass": 1.0, "pointing": 1.0, "ratio": 4.0})


def test_sat_hards_grounding_report_names_its_map_as_the_sampling_distribution():
    """SAT-hard's row is α, the distribution its attended location is drawn from, not a soft map: its grounding
    report names it so (docs/grounding.md and docs/model_zoo.md quote the name), and a soft SAT's is its softmax."""
    assert normaliser_of(SimpleNamespace(model=tiny_model("sat-hard"))) == "hard (α, the sampling distribution)"
    assert normaliser_of(SimpleNamespace(model=tiny_model("sat"))) == "softmax"


def test_a_grounding_tables_delimiter_row_has_a_cell_under_each_header():
    """The table is pasted into docs/model_zoo.md: its second line must be GitHub's delimiter row, one ``---`` per
    header cell and nothing after the last pipe, or the page shows the rows as plain text."""
    header, delimiter = markdown_table([]).splitlines()
    assert delimiter == "|" + "---|" * (header.count("|") - 1)


def test_grid_cells_are_drawn_at_the_size_asked_for():
    """A grid map drawn on a copy of the image at twice its size covers the copy as the cells cover the image: a
    one-hot top-left cell fills the copy's top-left quadrant (8×8 of 16×16), not the original's 4×4 corner."""
    dist = pixel_distribution([1.0, 0.0, 0.0, 0.0], two_by_two(), size=(16, 16))
    quadrant = np.zeros((16, 16), bool)
    quadrant[:8, :8] = True
    assert dist.shape == (16, 16) and dist[quadrant] == pytest.approx(np.full(64, 1 / 64))
    assert score_rows(np.array([[1.0, 0.0, 0.0, 0.0]]), two_by_two(), quadrant)[0] == pytest.approx(
        {"mass": 1.0, "pointing": 1.0, "ratio": 4.0})


def test_a_region_box_past_the_left_and_top_edges_keeps_its_visible_part():
    """A region file's box may start before the image (a detector's box around an object cut by the edge, or one
    scaled onto the image): its weight spreads over the pixels still inside, columns 0–3 and rows 0–1 here, rather
    than a negative edge wrapping round to the far side of the image and the weight being lost."""
    boxes = np.array([[-4, -2, 4, 2], [0, 0, 8, 8]], np.float32)
    geometry = Geometry(kind="regions", image_size=(8, 8), grid_hw=None, boxes=boxes)
    dist = pixel_distribution([0.5, 0.5], geometry)
    assert dist[0:2, 0:4] == pytest.approx(np.full((2, 4), 0.5 / 8 + 0.5 / 64))
    assert dist[2:] == pytest.approx(np.full((6, 8), 0.5 / 64)) and dist[0:2, 4:] == pytest.approx(0.5 / 64)


def test_region_boxes_on_a_tall_image_keep_their_rows_and_a_box_past_the_bottom_keeps_its_visible_part():
    """Rows are clipped at the image's height and columns at its width: on a portrait image (4 wide, 8 tall) a
    full-height box spreads over all 8 rows, and a box hanging past the bottom spreads its weight over the rows
    still inside, so the bottom half holds half of the first box's weight and all of the second's."""
    geometry = Geometry(kind="regions", image_size=(4, 8), grid_hw=None,
                        boxes=np.array([[0, 0, 4, 8], [0, 4, 4, 12]], np.float32))
    dist = pixel_distribution([0.5, 0.5], geometry)
    assert dist[:4] == pytest.approx(np.full((4, 4), 0.5 / 32))
    assert dist[4:] == pytest.approx(np.full((4, 4), 0.5 / 32 + 0.5 / 16))
