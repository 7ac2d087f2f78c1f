"""The benchmarks still run against the current code (``make bench`` is outside the suite, and a script that no
longer imports, or breaks on a smaller size, would only be found by the next person to regenerate a table): every
script answers ``--help``, and the cheap ones run at a small size into a temporary file."""

from __future__ import annotations

import subprocess
import sys

import pytest

from .conftest import ROOT

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
