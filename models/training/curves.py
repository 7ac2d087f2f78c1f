"""Training curves from runs' ``metrics.jsonl`` (the code behind ``captioner plot``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from .run_log import METRICS_LOG, is_number, iter_records

#: training losses drawn when a run logs them (XE, SCST), and the validation metrics drawn per epoch
LOSS_KEYS = ("xe", "scst", "reward")
SCORE_KEYS = ("CIDEr-D", "BLEU-4", "BLEU-1", "objects_named")


def read_metrics(run: str | Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The step records and the epoch records of a run (its folder or its metrics.jsonl); a torn last line (a
    run killed while writing) is skipped."""
    path = Path(run)
    path = path / METRICS_LOG if path.is_dir() else path
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: is {run} a training run folder?")
    steps, epochs = [], []
    for _, record in iter_records(path, strict=False):
        # only the numbers a curve can draw: a field of another kind (a log edited by hand) is left out, not a
        # matplotlib traceback
        record = {key: value for key, value in record.items() if is_number(value) or key == "kind"}
        (epochs if record.get("kind") == "epoch" else steps).append(record)
    return steps, epochs


def plot_runs(runs: Sequence[str | Path], out: str | Path, labels: Sequence[str] | None = None) -> Path:
    """One figure: training loss and learning rate against the step, validation metrics against the epoch; every
    run overlaid in its own colour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if labels and len(labels) != len(runs):
        raise ValueError(f"{len(labels)} --label for {len(runs)} runs: give one per run, in their order")
    data = [read_metrics(run) for run in runs]
    labels = list(labels) if labels else [Path(run).name if Path(run).is_dir() else Path(run).parent.name
                                          for run in runs]
    scores = [k for k in SCORE_KEYS if any(k in e for _, epochs in data for e in epochs)]
    losses = [k for k in LOSS_KEYS if any(k in s for steps, _ in data for s in steps)]
    panels = [("loss", losses), ("lr", ["lr"]), *(("score", [k]) for k in scores)]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    for ax, (kind, keys) in zip(axes[0], panels):
        for color, label, (steps, epochs) in zip(plt.rcParams["axes.prop_cycle"].by_key()["color"] * 10, labels, data):
            if kind == "score":
                points = [(e["epoch"], e[keys[0]]) for e in epochs if keys[0] in e and "epoch" in e]
                if points:
                    ax.plot(*zip(*points), marker="o", color=color, label=label)
                ax.set_xlabel("epoch")
                ax.set_title(f"validation {keys[0]}")
                continue
            for style, key in zip(("-", "--", ":"), keys):
                points = [(s["step"], s[key]) for s in steps if key in s and "step" in s]
                if points:
                    ax.plot(*zip(*points), style, color=color, label=f"{label} {key}" if len(keys) > 1 else label)
            ax.set_xlabel("step")
            ax.set_title("training loss" if kind == "loss" else "learning rate")
            if kind == "lr":
                ax.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    out = Path(out)
    if not out.suffix:  # matplotlib adds ".png" to a name without one: say the name it writes
        out = out.with_name(out.name + ".png")
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
