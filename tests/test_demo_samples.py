"""``make samples`` (service/demo_samples.py): the demo page's sample JPEGs, written again into a temporary folder
(never over the committed ones in service/static/samples/)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
from PIL import Image
from skimage import data

from captioner.service import demo_samples

from .conftest import DEMO_SAMPLES, ROOT

COMMITTED = DEMO_SAMPLES


def test_the_samples_are_the_committed_jpegs_of_the_three_photos(tmp_path):
    """What the module promises: it reproduces the committed files byte for byte (same Pillow and libjpeg: a
    version that encodes otherwise fails here, and `make samples` is then run and its JPEGs committed)."""
    written = demo_samples.write_samples(tmp_path / "new")
    assert written == [tmp_path / "new" / f"{name}.jpg" for name in ("chelsea", "astronaut", "coffee")]
    for path in written:
        # compared outside the assert: pytest explaining two differing JPEGs byte by byte ran past two minutes
        same = path.read_bytes() == (COMMITTED / path.name).read_bytes()
        assert same, f"{path.name} differs from the committed file"


def test_each_sample_is_its_photo_shrunk_to_512_pixels_keeping_its_aspect(tmp_path):
    sizes = {"chelsea": (451, 300), "astronaut": (512, 512), "coffee": (512, 341)}  # coffee is 600×400
    for path in demo_samples.write_samples(tmp_path):
        with Image.open(path) as image:
            assert image.format == "JPEG" and image.mode == "RGB" and image.size == sizes[path.stem]
            decoded = np.asarray(image, dtype=np.float64)
        photo = Image.fromarray(getattr(data, path.stem)()).resize(sizes[path.stem], Image.Resampling.LANCZOS)
        # quality 85: a few levels off the photo on average; another photo, or no photo, is tens of levels off
        assert np.abs(decoded - np.asarray(photo, dtype=np.float64)).mean() < 4, path.stem


def test_make_samples_writes_to_out_and_says_each_file(tmp_path, capsys):
    demo_samples.main(["--out", str(tmp_path / "samples")])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == [str(tmp_path / "samples" / f"{name}.jpg")
                                                      for name in ("chelsea", "astronaut", "coffee")]
    size = (tmp_path / "samples" / "chelsea.jpg").stat().st_size / 1024
    assert lines[0].endswith(f": 451×300, {size:.1f} KiB")


def test_make_samples_makes_the_out_folder_and_its_missing_parents(tmp_path):
    """``--out`` may name a folder several levels below one that exists (``--out build/demo/samples``)."""
    out = tmp_path / "build" / "demo" / "samples"
    assert demo_samples.write_samples(out) == [out / f"{name}.jpg" for name in ("chelsea", "astronaut", "coffee")]
    assert all(path.is_file() for path in out.iterdir())


def test_make_samples_writes_over_the_committed_samples_by_default(monkeypatch, capsys):
    # recorded, not written: the checkout's JPEGs are left alone
    folders, write_samples = [], demo_samples.write_samples
    monkeypatch.setattr(demo_samples, "write_samples", lambda out: folders.append(out) or [])
    demo_samples.main([])
    # resolved: the package may be imported through a link to the checkout (as these audits do)
    assert [folder.resolve() for folder in folders + list(write_samples.__defaults__)] == [COMMITTED, COMMITTED]


def test_make_samples_writes_beside_the_module_from_any_working_folder(tmp_path, monkeypatch):
    """``make samples`` run from another folder (or the module run from wherever the package is installed) still
    writes the demo page's samples, not a ``service/static/samples`` under the working folder the page never serves."""
    monkeypatch.chdir(tmp_path)
    folders = []
    monkeypatch.setattr(demo_samples, "write_samples", lambda out: folders.append(out) or [])
    demo_samples.main([])
    assert [folder.resolve() for folder in folders] == [COMMITTED]


def test_make_samples_runs_the_module_which_describes_itself():
    """`make samples` is ``python -m captioner.service.demo_samples``: run so, the module runs ``main``."""
    done = subprocess.run([sys.executable, "-m", "captioner.service.demo_samples", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Writes the demo page's \"Try a sample\" photos (``make samples``)" in " ".join(done.stdout.split())
    assert "Licences" not in done.stdout  # the docstring's first paragraph only, not its licences and usage


def test_make_samples_says_each_files_size_in_kib_of_1024_bytes(tmp_path, monkeypatch, capsys):
    """100 KiB exactly (a JPEG with bytes after its end, which readers ignore): 1000- or 1025-byte units say
    otherwise at one decimal."""
    path = tmp_path / "padded.jpg"
    Image.new("RGB", (8, 4)).save(path, "JPEG")
    path.write_bytes(path.read_bytes().ljust(100 * 1024, b"\0"))
    monkeypatch.setattr(demo_samples, "write_samples", lambda out: [path])
    demo_samples.main(["--out", str(tmp_path)])
    assert capsys.readouterr().out == f"{path}: 8×4, 100.0 KiB\n"
