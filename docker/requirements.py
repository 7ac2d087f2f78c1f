"""The container image's dependency lists, from pyproject.toml (run by the Dockerfile's `requirements` stage).

    python3 requirements.py PYPROJECT DEVICE OUT_DIR

writes three pip requirement files into OUT_DIR:

* ``serving.txt``: ``[project] dependencies`` less ``[tool.captioner.container] not-served`` (packages that
  `captioner serve` never imports), and for DEVICE ``cpu`` ``onnxruntime`` in place of ``onnxruntime-gpu`` (same
  version specifier; the two must never be installed side by side);
* ``torch-cpu.txt``: the ``torch`` / ``torchvision`` pins spelt as the PyTorch CPU wheel index spells them
  (``torch==2.14.1+cpu``), for the Dockerfile's first try; empty for DEVICE ``cuda``;
* ``floors.txt``: every ``[project] dependencies`` range pinned to its lowest release (``fastapi>=0.157`` →
  ``fastapi==0.157``), the constraints ``make check-floors`` installs and tests (docs/decisions.md, "The declared
  floors, audited").

Standard library only: it runs on the base image's python3 before any package is installed.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

DEVICES = ("cpu", "cuda")
CPU_WHEEL_PACKAGES = ("torch", "torchvision")
GPU_ONNXRUNTIME, CPU_ONNXRUNTIME = "onnxruntime-gpu", "onnxruntime"


def project_name(requirement: str) -> str:
    """The PEP 503 normalised distribution name at the start of a requirement string."""
    name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if name is None:
        raise ValueError(f"not a requirement: {requirement!r}")
    return re.sub(r"[-_.]+", "-", name.group(1)).lower()


def serving_requirements(pyproject: dict, device: str) -> list[str]:
    not_served = {project_name(n) for n in pyproject["tool"]["captioner"]["container"]["not-served"]}
    dependencies = pyproject["project"]["dependencies"]
    unknown = not_served - {project_name(r) for r in dependencies}
    if unknown:  # a stale name would silently leave nothing out
        raise ValueError(f"not-served names no dependency: {sorted(unknown)}")
    kept = [r for r in dependencies if project_name(r) not in not_served]
    if device == "cpu":
        kept = [CPU_ONNXRUNTIME + r.lstrip()[len(GPU_ONNXRUNTIME):] if project_name(r) == GPU_ONNXRUNTIME else r
                for r in kept]
    return kept


def cpu_wheel_pins(requirements: list[str]) -> list[str]:
    """``torch==2.14.1`` → ``torch==2.14.1+cpu``: the CPU index publishes the same versions with a local label."""
    pins = []
    for requirement in requirements:
        if project_name(requirement) in CPU_WHEEL_PACKAGES:
            pin = re.fullmatch(r"\s*([A-Za-z0-9._-]+)\s*==\s*([0-9][0-9.]*)\s*", requirement)
            if pin is None:
                raise ValueError(f"{requirement!r}: the CPU wheel index needs an exact pin (name==version)")
            pins.append(f"{pin.group(1)}=={pin.group(2)}+cpu")
    return pins


def floor_pins(requirements: list[str]) -> list[str]:
    """Each requirement at the lowest release its specifier allows: ``name>=V`` (or ``name==V``, an upper bound
    beside it or not) → ``name==V``; extras dropped, as a constraints file takes none."""
    pins = []
    for requirement in requirements:
        spec = re.fullmatch(r"\s*([A-Za-z0-9._-]+)(?:\[[^\]]*\])?\s*(?:>=|==)\s*([0-9][0-9.]*)\s*(?:,.*)?", requirement)
        if spec is None:
            raise ValueError(f"{requirement!r}: no lowest release to test (write name>=version or name==version)")
        pins.append(f"{spec.group(1)}=={spec.group(2)}")
    return pins


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[1] not in DEVICES:
        print(f"usage: requirements.py PYPROJECT {{{'|'.join(DEVICES)}}} OUT_DIR", file=sys.stderr)
        return 2
    pyproject_path, device, out = Path(argv[0]), argv[1], Path(argv[2])
    pyproject = tomllib.loads(pyproject_path.read_text())
    serving = serving_requirements(pyproject, device)
    out.mkdir(parents=True, exist_ok=True)
    (out / "floors.txt").write_text("".join(f"{r}\n" for r in floor_pins(pyproject["project"]["dependencies"])))
    (out / "serving.txt").write_text("".join(f"{r}\n" for r in serving))
    (out / "torch-cpu.txt").write_text("".join(f"{r}\n" for r in cpu_wheel_pins(serving)) if device == "cpu" else "")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
