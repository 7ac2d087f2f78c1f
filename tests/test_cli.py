"""The ``captioner`` console script, run as a user would."""

import json
import subprocess
import sys

from PIL import Image
from skimage import data

from .conftest import DEFAULT_CHECKPOINT, ROOT


def captioner(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "service.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    if check:
        assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_caption_with_overlay_figure_and_single_token(tmp_path):
    photo = tmp_path / "cat.jpg"
    Image.fromarray(data.chelsea()).save(photo)
    done = captioner("caption", str(photo), "--checkpoint", str(DEFAULT_CHECKPOINT), "--overlay", str(tmp_path / "fig.png"),
                     "--json")
    result = json.loads(done.stdout.splitlines()[0])
    assert result["caption"] and len(result["attention"]) == len(result["tokens"])
    assert Image.open(tmp_path / "fig.png").width > 500
    captioner("caption", str(photo), "--checkpoint", str(DEFAULT_CHECKPOINT), "--overlay", str(tmp_path / "w.png"),
              "--token", "0", "--mode", "grid_blocks")
    assert Image.open(tmp_path / "w.png").size == (451, 300)


def test_caption_errors_are_clear(tmp_path):
    (tmp_path / "bad.jpg").write_bytes(b"nope")
    done = captioner("caption", str(tmp_path / "bad.jpg"), "--checkpoint", str(DEFAULT_CHECKPOINT), check=False)
    assert done.returncode != 0 and "cannot identify" in done.stderr and "Traceback" not in done.stderr


def test_models_and_data_generate(tmp_path):
    assert "sat" in captioner("models").stdout.split()
    captioner("data", "generate", "--out", str(tmp_path), "--train", "3", "--val", "1", "--test", "1", "--heldout", "1")
    assert len(json.loads((tmp_path / "dataset_scenes.json").read_text())["images"]) == 6


def test_eval_reports_all_metrics(tmp_path, scenes):
    out = tmp_path / "report.json"
    captioner("eval", str(DEFAULT_CHECKPOINT), "--dataset", str(scenes), "--split", "test", "--cache-dir",
              str(tmp_path / "cache"), "--output", str(out))
    report = json.loads(out.read_text())["test"]
    for metric in ("BLEU-1", "BLEU-4", "METEOR", "ROUGE-L", "CIDEr-D", "objects_named"):
        assert metric in report
    assert report["SPICE"].startswith("unavailable")
