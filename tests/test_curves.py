"""``captioner plot``: training curves of several runs from their metrics.jsonl, overlaid in one PNG."""

import json

import matplotlib.pyplot as plt
import pytest
from PIL import Image

from captioner.models.training.curves import plot_runs, read_metrics


def _write_run(folder, scale):
    folder.mkdir()
    lines = [{"kind": "step", "epoch": 1 + s // 10, "step": s, "lr": 2e-4 * 0.8 ** (s // 30), "xe": scale * 3 / s,
              "tokens_per_s": 900.0, "ss_prob": 0.0, "seconds": s * 0.5} for s in range(1, 61)]
    lines += [{"kind": "epoch", "epoch": e, "step": 10 * e, "lr": 2e-4, "xe": 1.0, "CIDEr-D": 0.2 * e / scale,
               "BLEU-4": 0.05 * e, "seconds": 5.0 * e} for e in range(1, 7)]
    text = "".join(json.dumps(line) + "\n" for line in lines)
    (folder / "metrics.jsonl").write_text(text + '{"kind": "step", "ep')  # a run killed while writing a line
    return folder


def test_runs_are_read_torn_line_skipped_and_overlaid_in_one_png(tmp_path):
    a, b = _write_run(tmp_path / "a", 1.0), _write_run(tmp_path / "b", 2.0)
    steps, epochs = read_metrics(a)
    assert len(steps) == 60 and [e["epoch"] for e in epochs] == list(range(1, 7))
    out = plot_runs([a, b], tmp_path / "curves.png")
    image = Image.open(out)
    # panels: training loss, learning rate, validation CIDEr-D, validation BLEU-4 (4.2 inches × 100 dpi each)
    assert image.size == (1680, 340)
    counts = {colour: n for n, colour in image.convert("RGB").getcolors(1 << 20)}
    # each run drawn in its own colour of matplotlib's cycle (C0, C1): plotting the first run alone passed
    # a check that only counted colours
    for colour in ((0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E)):
        assert counts.get(colour, 0) > 400, (colour, counts.get(colour))


def test_a_name_without_an_extension_is_written_and_reported_as_png(tmp_path):
    out = plot_runs([_write_run(tmp_path / "a", 1.0)], tmp_path / "curves")
    assert out == tmp_path / "curves.png" and out.is_file()


def _figure(monkeypatch, runs, out, labels=None):
    """The figure ``plot_runs`` draws (and saves), kept from ``plt.close``."""
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    assert plot_runs(runs, out, labels) == out  # a name with its suffix is written as given
    (figure,) = figures
    return figure


def _drawn(monkeypatch, runs, out, labels=None):
    """The figure ``plot_runs`` draws: {title: (x label, [(legend label, xs, ys, style)])}."""
    axes = {ax.get_title(): ax for ax in _figure(monkeypatch, runs, out, labels).axes}
    # learning rates of 1e-4 read as 2 ×1e−4 on the axis, not 0.00020 (the figure is drawn: saved)
    assert axes["learning rate"].yaxis.get_offset_text().get_text() != ""
    assert axes["learning rate"].xaxis.get_offset_text().get_text() == ""  # the steps are not
    return {title: (ax.get_xlabel(), [(line.get_label(), list(line.get_xdata()), list(line.get_ydata()),
                                       line.get_linestyle()) for line in ax.get_lines()])
            for title, ax in axes.items()}


def test_each_panel_draws_its_key_against_step_or_epoch_labelled_by_run_folder(tmp_path, monkeypatch):
    a, b = _write_run(tmp_path / "a", 1.0), _write_run(tmp_path / "b", 2.0)
    panels = _drawn(monkeypatch, [a, b / "metrics.jsonl"], tmp_path / "curves.png")  # b named by its folder
    assert list(panels) == ["training loss", "learning rate", "validation CIDEr-D", "validation BLEU-4"]
    steps = list(range(1, 61))
    label, xs, ys, style = panels["training loss"][1][1]
    assert panels["training loss"][0] == "step" and (label, xs, style) == ("b", steps, "-")
    assert ys == pytest.approx([6 / s for s in steps])
    assert [line[0] for line in panels["learning rate"][1]] == ["a", "b"] and panels["learning rate"][0] == "step"
    assert panels["validation CIDEr-D"] == ("epoch", [("a", [1, 2, 3, 4, 5, 6], pytest.approx([0.2 * e for e in
                                                                                                 range(1, 7)]), "-"),
                                                      ("b", [1, 2, 3, 4, 5, 6], pytest.approx([0.1 * e for e in
                                                                                                 range(1, 7)]), "-")])


def test_scsts_losses_share_a_panel_in_their_own_styles_and_labels_are_given_per_run(tmp_path, monkeypatch):
    run = tmp_path / "scst"
    run.mkdir()
    records = [{"kind": "step", "step": s, "lr": 1e-5, "xe": 2.0, "scst": -0.5} for s in (1, 2)]
    records.append({"kind": "epoch", "epoch": 1, "step": 2, "BLEU-1": 0.5, "objects_named": 0.25})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    panels = _drawn(monkeypatch, [run], tmp_path / "curves.png", ["mine"])
    # a panel per score logged, and only those: no CIDEr-D or BLEU-4 here
    assert list(panels) == ["training loss", "learning rate", "validation BLEU-1", "validation objects_named"]
    assert [(label, style) for label, _, _, style in panels["training loss"][1]] == [("mine xe", "-"),
                                                                                       ("mine scst", "--")]
    assert panels["validation objects_named"] == ("epoch", [("mine", [1], [0.25], "-")])
    (run / "metrics.jsonl").write_text(json.dumps({"kind": "step", "step": 1, "lr": 1e-5, "reward": 0.4}) + "\n")
    assert _drawn(monkeypatch, [run], tmp_path / "curves.png", ["mine"])["training loss"][1] == [("mine", [1], [0.4],
                                                                                                   "-")]
    with pytest.raises(ValueError, match="1 --label for 2 runs"):
        plot_runs([run, run], tmp_path / "two.png", ["mine"])
    # a label too many is refused as well: the runs were not the ones meant (one left off the command line), and
    # the legend would name them wrongly
    with pytest.raises(ValueError, match="2 --label for 1 runs"):
        plot_runs([run], tmp_path / "one.png", ["mine", "yours"])


def _log(folder, records):
    folder.mkdir()
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


def test_runs_of_every_kind_are_labelled_as_given_in_their_order_in_each_panels_legend(tmp_path, monkeypatch):
    """An XE run, one killed before its first validation and an SCST run that validates CIDEr-D alone, overlaid:
    a loss or score is drawn when any run logs it, the others are passed over, not a KeyError."""
    xe = _write_run(tmp_path / "xe", 1.0)
    early = _log(tmp_path / "early", [{"kind": "step", "step": s, "lr": 1e-4, "xe": 4.0} for s in (1, 2)])
    scst = _log(tmp_path / "scst", [{"kind": "step", "step": 3, "lr": 1e-5, "scst": -0.5, "reward": 0.4},
                                     {"kind": "epoch", "epoch": 1, "step": 3, "CIDEr-D": 0.9}])
    figure = _figure(monkeypatch, [xe, early, scst], tmp_path / "curves.png", ["XE", "early", "SCST"])
    axes = {ax.get_title(): ax for ax in figure.axes}
    assert list(axes) == ["training loss", "learning rate", "validation CIDEr-D", "validation BLEU-4"]
    drawn = {title: [(line.get_label(), line.get_linestyle(), line.get_marker()) for line in ax.get_lines()]
             for title, ax in axes.items()}
    scsts = [("SCST scst", "--", "None"), ("SCST reward", ":", "None")]  # one colour: told apart by their styles
    assert drawn["training loss"] == [("XE xe", "-", "None"), ("early xe", "-", "None"), *scsts]
    assert drawn["learning rate"] == [("XE", "-", "None"), ("early", "-", "None"), ("SCST", "-", "None")]
    # a validation score is a point per epoch: marked, since a run validated once draws no line at all
    assert drawn["validation CIDEr-D"] == [("XE", "-", "o"), ("SCST", "-", "o")]
    assert drawn["validation BLEU-4"] == [("XE", "-", "o")]
    for title, ax in axes.items():  # the legend names every line of its panel, which is the only key to the colours
        assert [text.get_text() for text in ax.get_legend().get_texts()] == [label for label, *_ in drawn[title]]
    # a run alone that never validated: its two step panels, not an empty score panel
    assert [ax.get_title() for ax in _figure(monkeypatch, [early], tmp_path / "early.png").axes] == [
        "training loss", "learning rate"]


def test_every_panels_titles_and_axis_labels_lie_inside_the_picture(tmp_path, monkeypatch):
    """The layout pass keeps the x axis' "step" and "epoch" in the picture: without it they are cut off at its
    bottom edge."""
    figure = _figure(monkeypatch, [_write_run(tmp_path / "a", 1.0)], tmp_path / "curves.png")
    renderer = figure.canvas.get_renderer()
    width, height = figure.bbox.width, figure.bbox.height
    for ax in figure.axes:
        box = ax.get_tightbbox(renderer)
        assert 0 <= box.x0 and box.x1 <= width and 0 <= box.y0 and box.y1 <= height, (ax.get_title(), box)


def test_more_runs_than_the_colour_cycle_holds_are_each_drawn(tmp_path, monkeypatch):
    """A sweep's runs overlaid (``captioner plot runs/*``): an eleventh run is drawn in a colour used again, not
    left out."""
    runs = [_log(tmp_path / f"run{i:02d}", [{"kind": "step", "step": 1, "lr": 1e-4, "xe": float(i)}])
            for i in range(11)]
    lines = _drawn(monkeypatch, runs, tmp_path / "curves.png")["training loss"][1]
    assert [(label, ys) for label, _, ys, _ in lines] == [(f"run{i:02d}", [float(i)]) for i in range(11)]


def test_every_panel_is_gridded_so_values_can_be_read_off_its_curves(tmp_path, monkeypatch):
    """A loss or score is read off the figure against its axes (where CIDEr-D levelled out, at which step the loss
    fell below 2): each panel's grid carries the ticks across to the curves, which are far from the axes in a
    panel 4.2 inches wide."""
    figure = _figure(monkeypatch, [_write_run(tmp_path / "a", 1.0)], tmp_path / "curves.png")
    for ax in figure.axes:
        lines = ax.get_xgridlines() + ax.get_ygridlines()
        assert lines and all(line.get_visible() for line in lines), ax.get_title()


def test_each_panel_keeps_its_width_however_many_panels_the_runs_fill(tmp_path, monkeypatch):
    """The figure grows by 4.2 inches a panel: a run that logs every score (six panels) is not squeezed into the
    width of four, its tick labels run together, nor a run of two panels stretched."""
    records = [
        {"kind": "step", "step": 1, "lr": 1e-4, "xe": 2.0},
        {"kind": "epoch", "epoch": 1, "step": 1, "CIDEr-D": 0.5, "BLEU-4": 0.1, "BLEU-1": 0.4, "objects_named": 0.3},
    ]
    for run, panels in ((_log(tmp_path / "every", records), 6), (_log(tmp_path / "early", records[:1]), 2)):
        figure = _figure(monkeypatch, [run], tmp_path / f"{run.name}.png")
        assert len(figure.axes) == panels
        assert tuple(figure.get_size_inches()) == pytest.approx((4.2 * panels, 3.4))
