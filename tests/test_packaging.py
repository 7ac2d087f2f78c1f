"""The installed project lives under the ``captioner`` namespace and leaves the names ``models``/``service`` free."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("models", "service", "tests", "benchmarks")


def test_every_package_folder_is_listed_in_pyproject():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    on_disk = {"captioner." + ".".join(init.parent.relative_to(ROOT).parts)
               for top in ("models", "service") for init in (ROOT / top).rglob("__init__.py")}
    data_folders = set(setuptools["package-data"])
    assert listed == on_disk | data_folders
    # every file of a data folder is one its patterns ship (a new sample or recipe is not left out of the wheel)
    for package, patterns in setuptools["package-data"].items():
        folder = ROOT.joinpath(*package.split(".")[1:])
        for path in folder.iterdir():
            if path.is_file() and path.name != "__init__.py":
                assert any(path.match(pattern) for pattern in patterns), f"{path} is not in package-data"


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


#: what the project's top level holds (besides dotfiles): the product's folders and the files that build and run it
TOP_LEVEL = {"models", "service", "weights", "docker", "tests", "docs", "benchmarks", "Dockerfile", "Makefile",
             "README.md", "LICENSE", "pyproject.toml"}


def test_the_top_level_holds_the_project_layout_only():
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: what is tracked is unknown")
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    top = {line.split("/")[0] for line in tracked.splitlines() if line}
    assert {name for name in top if not name.startswith(".")} <= TOP_LEVEL
