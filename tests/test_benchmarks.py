"""The benchmarks still run against the current code (``make bench`` is outside the suite, and a script that no
longer imports, or breaks on a smaller size, would only be found by the next person to regenerate a table): every
script answers ``--help``, and the cheap ones run at a small size into a temporary file."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
from fastapi.testclient import TestClient

from captioner.service import app, cli
from captioner.service.settings import Settings

from .conftest import DEFAULT_CHECKPOINT, DEMO_SAMPLES, ROOT

BENCHMARKS = ROOT / "benchmarks"
SCRIPTS = sorted(p.name for p in BENCHMARKS.glob("bench_*.py"))


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=BENCHMARKS, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_benchmark_imports_and_answers_help(script):
    done = run(script, "--help")
    assert done.returncode == 0 and "usage:" in done.stdout, done.stderr[-2000:]


def test_the_cider_benchmark_runs_below_its_default_size(tmp_path):
    out = tmp_path / "cider.md"
    done = run("bench_cider.py", "--images", "200", "--repeats", "1", "--out", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "200 captions" in out.read_text()


def test_the_overhead_benchmarks_servers_answer_from_recorded_rows(monkeypatch, tmp_path):
    """bench_serving_overhead.py's servers run ``captioner serve`` with every loaded model's runtime swapped for
    recorded rows, through the app's model loader: once the loader was renamed, every one of them died at start-up
    (seen on a lent GPU). Here the swap runs in an app of this process instead of a server."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    overhead = importlib.import_module("bench_serving_overhead")
    monkeypatch.setattr(app, "iter_runtimes", app.iter_runtimes)  # the benchmark replaces it: put back afterwards
    weights = tmp_path / "weights"
    weights.mkdir()
    (weights / DEFAULT_CHECKPOINT.name).symlink_to(DEFAULT_CHECKPOINT)
    answers = []

    def serve(argv: list[str]) -> None:  # `captioner serve --weights-dir DIR`, answering one upload
        assert argv == ["serve", "--weights-dir", str(weights)]
        settings = Settings(weights_dir=weights, default_model=DEFAULT_CHECKPOINT.name, device="cpu", backend="torch",
                            onnx_dir=tmp_path / "onnx")  # as the benchmark's servers run
        with TestClient(app.create_app(settings)) as client:
            photo = (DEMO_SAMPLES / "chelsea.jpg").read_bytes()
            answers.append(client.post("/caption", files={"file": ("chelsea.jpg", photo, "image/jpeg")}))
            answers.append(client.app.state.service.runtimes)

    monkeypatch.setattr(cli, "main", serve)
    overhead.serve_recorded_rows(["--weights-dir", str(weights)])
    response, runtimes = answers
    assert response.status_code == 200, response.text
    assert [type(runtime).__name__ for runtime in runtimes.values()] == ["RecordedRows"]
    assert len(response.json()["attention"]) == len(response.json()["tokens"]) >= 1
