"""The installed project lives under the ``captioner`` namespace and leaves the names ``models``/``service`` free."""

from __future__ import annotations

import ast
import base64
import hashlib
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
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


def fake_wheel_index(root: Path, pins: list[str]) -> str:
    """A PEP 503 index (a folder, as ``file://``) holding an empty pure-Python wheel for each ``name==version`` pin:
    what the PyTorch CPU index serves, as far as pip's choice goes.  Each names a dependency the index lacks, as
    torch's own (filelock, sympy, …) are left to the default index, with the project's."""
    for pin in pins:
        name, version = pin.split("==")
        dist, folder = f"{name}-{version}", root / name
        files = {f"{name}_stand_in/__init__.py": b"",
                 f"{dist}.dist-info/METADATA": (f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                                f"Requires-Dist: {name}-dependency-on-the-default-index\n").encode(),
                 f"{dist}.dist-info/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
        record = [f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
                  f"{len(data)}" for path, data in files.items()]
        files[f"{dist}.dist-info/RECORD"] = "\n".join([*record, f"{dist}.dist-info/RECORD,,", ""]).encode()
        folder.mkdir(parents=True)
        wheel = f"{dist}-py3-none-any.whl"
        with zipfile.ZipFile(folder / wheel, "w") as archive:
            for path, data in files.items():
                archive.writestr(path, data)
        (folder / "index.html").write_text(f'<a href="{wheel}">{wheel}</a>')
    return root.as_uri()


def test_setup_takes_cpu_only_torch_where_there_is_no_nvidia_driver(tmp_path):
    """``make cpu-torch`` (the first step of every set-up): without an NVIDIA driver, torch and torchvision come
    from the CPU wheel index as pyproject's pins spelt ``+cpu``; with a driver, with no index, or where the index
    cannot be reached, nothing is installed and the set-up goes on to the default index's torch.  One venv (with
    its own pip: the host's would see the host's torch) for the four cases, those that install nothing first."""
    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    site = next((venv / "lib").glob("python3*/site-packages"))
    # pyproject's pins as the CPU index spells them (docker/requirements.py makes the same of them)
    pins = [f"{r.strip()}+cpu" for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
            if r.split("==")[0].strip() in ("torch", "torchvision")]
    index = fake_wheel_index(tmp_path / "index", pins)

    def cpu_torch(index: str, driver: str = "") -> str:
        done = subprocess.run(["make", "--no-print-directory", "cpu-torch", f"VENV={venv}",
                               f"TORCH_CPU_INDEX={index}", f"NVIDIA_DRIVER={driver}"],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    def installed() -> list[str]:
        return sorted(p.name for p in site.glob("torch*.dist-info"))

    assert cpu_torch(index, driver="yes").startswith("NVIDIA driver found") and installed() == []
    assert cpu_torch("").startswith("TORCH_CPU_INDEX is empty") and installed() == []
    nowhere = (tmp_path / "nowhere").as_uri()
    assert cpu_torch(nowhere).startswith(f"note: no CPU-only {' '.join(pins)} from {nowhere} (unreachable, or no "
                                         f"such wheel? {venv}/requirements/pip.log says)")
    assert installed() == []
    said = cpu_torch(index)
    assert said.startswith(f"CPU-only {' '.join(pins)} from {index}"), said
    assert (venv / "requirements" / "torch-cpu.txt").read_text().split() == pins
    assert installed() == sorted(f"{pin.replace('==', '-')}.dist-info" for pin in pins)


def make(*args: str, path: str | None = None) -> str:
    """``make ARGS`` in the project, with the environment's own NVIDIA_DRIVER left out (and ``path`` as PATH)."""
    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    env = {k: v for k, v in os.environ.items() if k != "NVIDIA_DRIVER"} | ({"PATH": path} if path else {})
    done = subprocess.run([shutil.which("make"), "--no-print-directory", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_every_set_up_takes_cpu_only_torch_before_the_project(tmp_path):
    """``make setup`` (and ``make serve``, which installs the runtime alone) runs ``cpu-torch`` before pip installs
    the project: afterwards the project's torch pin is already met, so pip keeps the CPU-only wheels.  Printed, not
    run (``make -n``)."""
    venv = tmp_path / "venv"
    lines = make("-n", "setup", f"VENV={venv}", "NVIDIA_DRIVER=", "TORCH_CPU_INDEX=file:///cpu-index").splitlines()
    cpu_only = next(i for i, line in enumerate(lines)
                    if "docker/cpu_torch.sh " in line and '"file:///cpu-index"' in line)
    project = next(i for i, line in enumerate(lines) if "-e '.'" in line)
    assert cpu_only < project, lines


def test_every_set_up_installs_the_releases_the_constraints_pin():
    """``make setup`` and ``make serve`` install within docker/constraints.txt (``make lock``), and ``CONSTRAINTS=``
    installs without it."""
    def project_installs(*settings: str) -> list[str]:
        printed = make("-n", "setup", "VENV=/nowhere", "TORCH_CPU_INDEX=", *settings).splitlines()
        return [line for line in printed if "pip install" in line and " -e '" in line]

    installs = project_installs()
    assert installs and all("-c docker/constraints.txt -e '" in line for line in installs), installs
    unpinned = project_installs("CONSTRAINTS=")
    assert unpinned and not any(" -c " in line for line in unpinned), unpinned


def test_an_nvidia_driver_is_found_by_its_nvidia_smi(tmp_path):
    """Unless NVIDIA_DRIVER is given, ``cpu-torch`` looks for the driver itself: ``nvidia-smi`` on the PATH (or the
    kernel module's /proc file) keeps PyPI's CUDA build; without either, the CPU-only wheels are wanted (here with no
    index named, which installs nothing)."""
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
    (tools / "nvidia-smi").chmod(0o755)
    # this interpreter by name (the PATH holds the tools alone), and a venv of the test's own
    settings = ("TORCH_CPU_INDEX=", f"PYTHON={sys.executable}", f"VENV={tmp_path / 'venv'}")
    assert make("cpu-torch", *settings, path=str(tools)).startswith("NVIDIA driver found")
    if not Path("/proc/driver/nvidia/version").exists():
        (tools / "nvidia-smi").unlink()
        assert make("cpu-torch", *settings, path=str(tools)).startswith("TORCH_CPU_INDEX is empty")
