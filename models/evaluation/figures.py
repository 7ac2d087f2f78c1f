"""Bar charts of grounding statistics with their bootstrap intervals, shared by the scene zoo table
(``captioner zoo-table``) and the Flickr30k Entities document (``captioner grounding-doc``)."""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path

from ..files import write_atomically

#: a panel: its title and, per group of bars (one model), the x label and ``{control: {"mean", "ci95"} or None}``
Panel = tuple[str, Sequence[tuple[str, dict[str, dict | None]]]]


def control_bars(panels: Sequence[Panel], controls: Sequence[str], labels: dict[str, str], out: Path,
                 ylim: tuple[float, float] = (0, 1), columns: int | None = None) -> Path:
    """One panel per statistic (``columns`` a row, default all in one): per model, one bar per control
    (``labels`` names them in the legend) with its 95 % interval as error bars; a missing value is an empty slot."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    groups = max(len(groups) for _, groups in panels)
    columns = columns or len(panels)
    rows = -(-len(panels) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=((2 + 0.8 * groups) * columns, 3.6 * rows), squeeze=False)
    width = 0.8 / len(controls)
    long_labels = any(len(line) > 12 for _, entries in panels for label, _ in entries for line in label.split("\n"))
    for axis in axes.flat[len(panels):]:
        axis.axis("off")
    for axis, (title, entries) in zip(axes.flat, panels):
        for c, control in enumerate(controls):
            means, errors = [], [[], []]
            for _, stats in entries:
                stat = stats.get(control)
                mean = stat["mean"] if stat else float("nan")
                low, high = stat["ci95"] if stat else (mean, mean)
                means.append(mean)
                errors[0].append(mean - low)
                errors[1].append(high - mean)
            positions = [i + (c - (len(controls) - 1) / 2) * width for i in range(len(entries))]
            axis.bar(positions, means, width, yerr=errors, capsize=3, label=labels.get(control, control))
        axis.set_xticks(range(len(entries)))
        axis.set_xticklabels([label for label, _ in entries], fontsize=8, rotation=20 if long_labels else 0,
                             ha="right" if long_labels else "center")
        axis.set_title(title, fontsize=10)
        axis.set_ylim(*ylim)
    axes.flat[0].legend(fontsize=8)
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()  # written whole: an interrupted run leaves the previous figure, never half of one
    figure.savefig(buffer, format=out.suffix.lstrip(".") or "png", dpi=110)
    plt.close(figure)
    write_atomically(out, buffer.getvalue())
    return out
