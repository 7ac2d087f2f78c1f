"""The container image's size, split into torch with its CUDA wheels and everything else (`make container`).

    python3 image_size.py ROOTFS TOTAL_BYTES

ROOTFS is the image's root filesystem (``buildah mount``), TOTAL_BYTES the sum of its layers. The torch part is
every installed distribution named ``torch``, ``triton``, ``nvidia-*`` or ``cuda-*`` in the image's
site-packages, measured by the files each one's ``RECORD`` lists (apparent sizes: what the layers hold, give or
take the tar headers); "own layers" is the rest: the base, python3, the other dependencies, the project and the
weights. Standard library only: it runs on the build machine's python3.
"""

from __future__ import annotations

import csv
import re
import sys
from pathlib import Path

#: the distributions PyPI's torch brings for CUDA (``nvidia-*`` libraries, ``cuda-bindings``, triton) and torch
#: itself; a CPU-only torch from the PyTorch CPU wheel index brings none of the others
TORCH_AND_CUDA = re.compile(r"(torch|triton|nvidia[-_].*|cuda[-_].*)")


def distribution_bytes(dist_info: Path) -> int:
    """The apparent size of the files an installed distribution's RECORD lists (paths relative to site-packages)."""
    site_packages = dist_info.parent
    total = 0
    with (dist_info / "RECORD").open(newline="") as record:
        for row in csv.reader(record):
            if not row:
                continue
            path = site_packages / row[0]
            if path.is_file() and not path.is_symlink():  # files removed after installing (tests) count nothing
                total += path.stat().st_size
    return total


def torch_and_cuda(rootfs: Path) -> dict[str, int]:
    """{"name version": bytes} of torch and its CUDA wheels installed anywhere under rootfs's /opt and /usr."""
    found = {}
    for top in ("opt", "usr"):
        for dist_info in sorted((rootfs / top).glob("**/site-packages/*.dist-info")):
            name, _, version = dist_info.name.removesuffix(".dist-info").partition("-")
            if TORCH_AND_CUDA.fullmatch(name.lower()) and (dist_info / "RECORD").is_file():
                found[f"{name} {version}"] = distribution_bytes(dist_info)
    return found


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


def human(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


def report(rootfs: Path, total_bytes: int) -> list[str]:
    torch_parts = torch_and_cuda(rootfs)
    torch_bytes = sum(torch_parts.values())
    torch_version = next((k.split()[1] for k in torch_parts if k.split()[0].lower() == "torch"), None)
    cuda_wheels = [k for k in torch_parts if k.split()[0].lower() != "torch"]
    if torch_version is None:
        kind = "no torch installed"
    elif "+cpu" in torch_version:
        kind = f"torch {torch_version}: the CPU-only wheel"
    else:
        kind = f"torch {torch_version} and {len(cuda_wheels)} CUDA wheels (triton, nvidia-*, cuda-*): PyPI's build"
    weights = rootfs / "app" / "weights"
    weights_bytes = folder_bytes(weights) if weights.is_dir() else 0
    return [
        f"image size:    {human(total_bytes)} ({total_bytes:,} bytes, the layers uncompressed)",
        f"  torch part:  {human(torch_bytes)} ({torch_bytes:,} bytes; {kind})",
        f"  own layers:  {human(total_bytes - torch_bytes)} ({total_bytes - torch_bytes:,} bytes: everything else,"
        f" weights {human(weights_bytes)} included)",
    ]


def main(argv: list[str]) -> int:
    if len(argv) != 2 or not argv[1].isdigit() or not Path(argv[0]).is_dir():
        print("usage: image_size.py ROOTFS TOTAL_BYTES", file=sys.stderr)
        return 2
    print("\n".join(report(Path(argv[0]), int(argv[1]))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
