"""What the benchmarks share: which checkpoints they run (names of folders under weights/, or checkpoint folders,
given on each benchmark's command line with defaults here, so that no benchmark depends on which folders weights/
holds today), and how a report is written.

The default SAT model is the service's default (``CAPTIONER_DEFAULT_MODEL``'s default in service/settings.py), so
a renamed default checkpoint is followed without editing the benchmarks.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WEIGHTS = ROOT / "weights"


def default_model() -> str:
    from captioner.service.settings import Settings

    return Settings.model_fields["default_model"].default


def decoder_models() -> list[str]:
    """The issue's three decoder architectures (SAT, AoANet, SparseCap-TVmax), and SparseCap with softmax output
    attention to read TVmax's share against."""
    return [default_model(), "aoanet", "sparsecap-tvmax", "sparsecap-softmax"]


def checkpoint(name: str) -> Path:
    """The checkpoint folder ``name``: a folder path, or the name of one under weights/."""
    path = Path(name)
    folder = path if path.is_dir() else WEIGHTS / name
    if not (folder / "model.safetensors").is_file():
        shipped = sorted(p.name for p in WEIGHTS.iterdir() if (p / "model.safetensors").is_file())
        raise SystemExit(f"no checkpoint {name!r} (looked in {folder}); weights/ holds {', '.join(shipped)}")
    return folder


def publish(out: Path, lines: list[str], started: float) -> None:
    """Write the Markdown ``lines`` to ``out`` with the run's total time (``started``: a perf_counter reading)
    last, and print them."""
    import time

    text = "\n".join([*lines, f"Total benchmark time: {time.perf_counter() - started:.0f} s.", ""])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
