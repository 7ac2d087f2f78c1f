"""The grounding bar charts (models/evaluation/figures.py): what each panel draws, from the figure itself."""

import math
import os
from pathlib import Path

import matplotlib.figure
import matplotlib.pyplot as plt
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from PIL import Image

from captioner.models.evaluation.figures import control_bars

CONTROLS = ("model", "other", "uniform")
LABELS = {"model": "attention", "other": "chance: other"}  # "uniform" left to its own name


def _stat(mean, low, high):
    return {"mean": mean, "ci95": [low, high]}


def _panels():
    """Two statistics over two models; the second model has no "other" row."""
    first = [("a", {"model": _stat(0.5, 0.4, 0.7), "other": _stat(0.3, 0.25, 0.3), "uniform": _stat(0.2, 0.1, 0.2)}),
             ("b", {"model": _stat(0.6, 0.5, 0.65), "other": None, "uniform": _stat(0.1, 0.05, 0.2)})]
    second = [("a", {"model": _stat(0.9, 0.8, 1.0), "other": _stat(0.4, 0.3, 0.5), "uniform": _stat(0.3, 0.3, 0.3)}),
              ("b", {"model": _stat(0.7, 0.6, 0.8), "other": _stat(0.2, 0.1, 0.3), "uniform": _stat(0.1, 0.0, 0.2)})]
    return [("mass", first), ("pointing", second)]


def _drawn(monkeypatch, panels, out, controls=CONTROLS, **options):
    """The figure ``control_bars`` draws, kept from ``plt.close``."""
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    assert control_bars(panels, controls, LABELS, out, **options) == out
    (figure,) = figures
    monkeypatch.undo()
    plt.close(figure)  # its artists stay readable
    return figure


def _bars(axis):
    """Per control (in drawing order): [(x centre, width, height, error below, error above)] of its bars."""
    drawn = []
    for container in axis.containers:
        if not hasattr(container, "errorbar"):
            continue
        segments = container.errorbar.lines[2][0].get_segments()
        drawn.append([(bar.get_x() + bar.get_width() / 2, bar.get_width(), bar.get_height(),
                       *((bar.get_height() - segment[0][1], segment[1][1] - bar.get_height()) if len(segment)
                         else (math.nan, math.nan)))  # a missing value's error bar is not drawn
                      for bar, segment in zip(container.patches, segments)])
    return drawn


def test_each_control_is_a_bar_per_model_side_by_side_with_its_interval_as_error_bars(tmp_path, monkeypatch):
    figure = _drawn(monkeypatch, _panels(), tmp_path / "g.png")
    axes = figure.axes
    assert [axis.get_title() for axis in axes] == ["mass", "pointing"]
    width = 0.8 / 3  # three controls share 0.8 of each model's slot, centred on it
    mass = _bars(axes[0])
    assert len(mass) == 3
    for c, bars in enumerate(mass):
        assert [bar[0] for bar in bars] == pytest.approx([i + (c - 1) * width for i in range(2)])
        assert all(bar[1] == pytest.approx(width) for bar in bars)
    assert [bar[2] for bar in mass[0]] == pytest.approx([0.5, 0.6])
    # the interval below and above the mean, not the other way round
    assert [bar[3:] for bar in mass[0]] == [pytest.approx((0.1, 0.2)), pytest.approx((0.1, 0.05))]
    assert mass[2][1][3:] == pytest.approx((0.05, 0.1))
    # a missing value is an empty slot: no bar height, the others of its model in their places
    assert math.isnan(mass[1][1][2]) and mass[1][0][2] == pytest.approx(0.3)
    assert [bar[2] for bar in _bars(axes[1])[2]] == pytest.approx([0.3, 0.1])
    assert [tick.get_text() for tick in axes[0].get_xticklabels()] == ["a", "b"]
    assert list(axes[0].get_xticks()) == [0, 1]
    assert axes[0].get_ylim() == (0, 1) and axes[1].get_ylim() == (0, 1)
    # one legend, on the first panel, naming each control by its label or, without one, by itself
    assert [text.get_text() for text in axes[0].get_legend().get_texts()] == ["attention", "chance: other", "uniform"]
    assert axes[1].get_legend() is None
    # all panels in one row by default, each 2 inches plus 0.8 a model wide, 3.6 high
    assert tuple(figure.get_size_inches()) == pytest.approx(((2 + 0.8 * 2) * 2, 3.6))


def test_an_even_number_of_controls_sits_either_side_of_its_models_tick(tmp_path, monkeypatch):
    figure = _drawn(monkeypatch, [("mass", [("a", {"model": _stat(0.5, 0.4, 0.6), "other": _stat(0.2, 0.1, 0.3)})])],
                    tmp_path / "g.png", CONTROLS[:2])
    assert [bars[0][0] for bars in _bars(figure.axes[0])] == pytest.approx([-0.2, 0.2])  # width 0.4 each


def test_panels_fill_rows_of_the_given_columns_and_the_slots_left_over_are_blank(tmp_path, monkeypatch):
    panels = _panels() + [("third", _panels()[0][1][:1])]
    figure = _drawn(monkeypatch, panels, tmp_path / "g.png", columns=2, ylim=(0.0, 0.5))
    axes = figure.axes
    assert len(axes) == 4 and [axis.get_title() for axis in axes[:3]] == ["mass", "pointing", "third"]
    assert [axis.axison for axis in axes] == [True, True, True, False]
    assert axes[2].get_ylim() == (0.0, 0.5)
    assert list(axes[2].get_xticks()) == [0]  # a panel's ticks are its own models'
    # two rows of two columns, as wide as the panel with the most models needs
    assert tuple(figure.get_size_inches()) == pytest.approx(((2 + 0.8 * 2) * 2, 3.6 * 2))


def test_the_figure_is_as_wide_as_its_widest_panel_needs_wherever_that_panel_is(tmp_path, monkeypatch):
    """Panels may hold different models (each has its own ticks): a narrower one placed first must not squeeze the
    wider one after it."""
    panels = [("one model", _panels()[0][1][:1]), ("two models", _panels()[1][1])]
    figure = _drawn(monkeypatch, panels, tmp_path / "g.png")
    assert tuple(figure.get_size_inches()) == pytest.approx(((2 + 0.8 * 2) * 2, 3.6))


def test_every_title_and_label_lies_inside_the_figure(tmp_path, monkeypatch):
    """Laid out to fit (``tight_layout``): two rows of panels with slanted two-line labels lose none of their text
    to the figure's edges or under another panel."""
    long = [(f"a-long-model-name\n(normaliser {i})", stats) for i, (_, stats) in enumerate(_panels()[0][1])]
    figure = _drawn(monkeypatch, [("mass", long), ("pointing", long), ("third", long)], tmp_path / "g.png", columns=2)
    renderer = FigureCanvasAgg(figure).get_renderer()  # the figure as saved, closed since
    inside = figure.bbox
    # each panel with its title and labels: inside the figure, and clear of the other panels
    boxes = [axis.get_tightbbox(renderer) for axis in figure.axes[:3]]
    for i, box in enumerate(boxes):
        assert inside.x0 <= box.x0 and box.x1 <= inside.x1 and inside.y0 <= box.y0 and box.y1 <= inside.y1
        assert not any(box.overlaps(other) for other in boxes[i + 1:])


def test_labels_longer_than_twelve_letters_on_a_line_are_slanted(tmp_path, monkeypatch):
    def ticks(first_label):
        panels = [("mass", [(first_label, _panels()[0][1][0][1]), ("b", _panels()[0][1][1][1])])]
        figure = _drawn(monkeypatch, panels, tmp_path / "g.png")
        return [(tick.get_rotation(), tick.get_horizontalalignment()) for tick in figure.axes[0].get_xticklabels()]

    assert ticks("twelve-chars\n(lines)") == [(0, "center")] * 2  # each line at most 12: upright
    assert ticks("thirteen-char") == [(20, "right")] * 2


def test_the_figure_is_written_in_the_format_its_suffix_names_into_a_folder_made_for_it(tmp_path):
    png = control_bars(_panels(), CONTROLS, LABELS, tmp_path / "new" / "deeper" / "g.png")
    with Image.open(png) as image:  # 110 dpi: (2 + 0.8 × 2) × 2 inches wide, 3.6 high
        assert image.format == "PNG" and image.size == (round(7.2 * 110), round(3.6 * 110))
    svg = control_bars(_panels(), CONTROLS, LABELS, tmp_path / "g.svg")
    assert svg.read_text().lstrip().startswith("<?xml") and "<svg" in svg.read_text()
    bare = control_bars(_panels(), CONTROLS, LABELS, tmp_path / "g")
    with Image.open(bare) as image:
        assert image.format == "PNG"


def test_a_figure_that_fails_to_render_leaves_the_previous_one(tmp_path, monkeypatch):
    out = tmp_path / "g.png"
    out.write_bytes(b"the previous figure")

    def half_written(figure, target, **options):
        if hasattr(target, "write"):  # a file object, or the path to one
            target.write(b"half")
        else:
            Path(target).write_bytes(b"half")
        raise RuntimeError("rendering failed")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", half_written)
    with pytest.raises(RuntimeError, match="rendering failed"):
        control_bars(_panels(), CONTROLS, LABELS, out)
    plt.close("all")  # the failed figure's
    assert out.read_bytes() == b"the previous figure" and [p.name for p in tmp_path.iterdir()] == ["g.png"]


def test_a_figure_that_cannot_be_written_whole_leaves_the_previous_one(tmp_path, monkeypatch):
    """The figure goes to a temporary file first and replaces the old one whole: a full disk at the last step leaves
    the grounding page's previous chart, not a truncated PNG."""
    out = tmp_path / "g.png"
    out.write_bytes(b"the previous figure")

    def disk_full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", disk_full)
    with pytest.raises(OSError, match="No space"):
        control_bars(_panels(), CONTROLS, LABELS, out)
    assert out.read_bytes() == b"the previous figure" and [p.name for p in tmp_path.iterdir()] == ["g.png"]


def test_the_figure_is_drawn_off_screen_whatever_backend_the_process_chose(tmp_path):
    """Drawn with Agg, not a window's backend: ``captioner grounding-doc`` run on a desktop (or with a stale
    ``DISPLAY`` over ssh) would otherwise draw through a GUI toolkit."""
    before = matplotlib.get_backend()  # put back after, for the other tests
    plt.switch_backend("template")  # stands in for a GUI backend: it draws nothing
    try:
        control_bars(_panels(), CONTROLS, LABELS, tmp_path / "g.png")
        assert matplotlib.get_backend().lower() == "agg"
    finally:
        plt.switch_backend(before)
    with Image.open(tmp_path / "g.png") as image:
        assert image.format == "PNG"
