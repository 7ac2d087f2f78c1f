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


def _drawn(monkeypatch, runs, out, labels=None):
    """The figure ``plot_runs`` draws, kept from ``plt.close``: {title: (x label, [(legend label, xs, ys, style)])}."""
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    assert plot_runs(runs, out, labels) == out  # a name with its suffix is written as given
    (figure,) = figures
    axes = {ax.get_title(): ax for ax in figure.axes}
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
