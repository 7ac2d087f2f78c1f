"""The code's conventions (pyproject.toml, ``[tool.ruff]``; `make lint`): a change that breaks them fails here, with
ruff's own report of where, rather than in a reviewer's comment."""

import subprocess
import sys

from .conftest import ROOT


def test_the_code_passes_its_linter():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", "."], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-2000:]
