"""``captioner plot``: training curves of several runs from their metrics.jsonl, overlaid in one PNG."""

import json

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
