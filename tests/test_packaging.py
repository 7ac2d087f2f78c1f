"""The installed project lives under the ``captioner`` namespace and leaves the names ``models``/``service`` free."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("models", "service", "tests", "benchmarks")


def test_every_package_folder_is_listed_in_pyproject():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {"captioner." + ".".join(init.parent.relative_to(ROOT).parts)
               for top in ("models", "service") for init in (ROOT / top).rglob("__init__.py")}
    assert listed == on_disk


def test_a_users_own_models_and_service_modules_still_import(tmp_path):
    (tmp_path / "models.py").write_text("WHO = 'user models'\n")
    (tmp_path / "service.py").write_text("WHO = 'user service'\n")
    probe = ("import models, service\n"
             "from captioner.models.zoo import create\n"
             "from captioner.service.settings import Settings\n"
             "assert models.WHO == 'user models', models.__file__\n"
             "assert service.WHO == 'user service', service.__file__\n"
             "assert create('sat', vocab_size=12, feat_dim=8).arch == 'sat'\n"
             "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_no_source_file_imports_the_bare_folder_names():
    offenders = []
    for top in SOURCE_DIRS:
        for path in (ROOT / top).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                names = []
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                offenders += [f"{path.relative_to(ROOT)}:{node.lineno} {name}" for name in names
                              if name.split(".")[0] in ("models", "service")]
    assert not offenders, "import captioner.models / captioner.service instead:\n" + "\n".join(offenders)
