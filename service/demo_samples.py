"""Writes the demo page's "Try a sample" photos (``make samples``): scikit-image's bundled ``chelsea``, ``astronaut``
and ``coffee`` as small JPEGs in ``service/static/samples/``, so a newcomer can caption a real photo without one at
hand. The JPEGs are committed; this only makes them reproducible.

Licences (the docstrings of ``skimage.data.chelsea``, ``.astronaut`` and ``.coffee``): chelsea, CC0 by the
photographer, Stefan van der Walt; coffee, CC0 by the photographer, Rachel Michetti (courtesy of Pikolo Espresso
Bar); astronaut (Eileen Collins), NASA, public domain.

Usage: ``python -m captioner.service.demo_samples [--out DIR]``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from PIL import Image

SAMPLES_DIR = Path(__file__).parent / "static" / "samples"
SAMPLES = ("chelsea", "astronaut", "coffee")  # skimage.data function names, and the files' stems
LONGEST_SIDE = 512  # big enough for the encoder (it resizes to 224–256 px), small enough to commit (tens of KB)
JPEG_QUALITY = 85


def write_samples(out: Path = SAMPLES_DIR) -> list[Path]:
    # imported here, not at the top: the container image leaves scikit-image out, and every module of
    # captioner.service must import there (tests/test_container_config.py)
    import skimage.data

    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name in SAMPLES:
        image = Image.fromarray(getattr(skimage.data, name)())
        image.thumbnail((LONGEST_SIDE, LONGEST_SIDE), Image.Resampling.LANCZOS)  # shrinks only, keeps the aspect
        path = out / f"{name}.jpg"
        image.save(path, "JPEG", quality=JPEG_QUALITY, optimize=True)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=SAMPLES_DIR)
    for path in write_samples(parser.parse_args(argv).out):
        with Image.open(path) as image:
            print(f"{path}: {image.width}×{image.height}, {path.stat().st_size / 1024:.1f} KiB")


if __name__ == "__main__":
    main()
