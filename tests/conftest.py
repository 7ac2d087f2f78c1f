"""Shared fixtures: a small generated-scene dataset, tiny models, and the repository paths."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from captioner.models.data.scenes import generate
from captioner.models.protocol import VisualBatch
from captioner.models.training.config import Progress
from captioner.models.training.state import rng_state
from captioner.models.zoo import create

from . import parallel

# the helpers' asserts (every registered model through HTTP, ONNX and batching) say what differed, as a test's do
pytest.register_assert_rewrite("tests.serving_helpers")

ROOT = Path(__file__).resolve().parents[1]
WEIGHTS = ROOT / "weights"
DEFAULT_CHECKPOINT = WEIGHTS / "sat"
#: the real photos the project may read but never commits (Flickr8k, official files and Karpathy JSON): beside the
#: checkout, as CI places it; tests that need them skip where it is absent
FLICKR8K_DIR = ROOT.parent / "shared" / "data" / "flickr8k"
#: the demo page's sample photos (scikit-image's chelsea, astronaut, coffee as JPEGs: service/demo_samples.py)
DEMO_SAMPLES = ROOT / "service" / "static" / "samples"


def script_module(path: Path):
    """A script that is no module of the package (docker/, benchmarks/) loaded as a module, to test its functions."""
    spec = importlib.util.spec_from_file_location(f"script_{path.parent.name}_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def before_each_step(run, note) -> None:
    """Make ``note(*args)`` run before each of ``run``'s training steps, with the step's arguments (its shard and
    global batch): what a test records of the steps (their batches, the optimiser's rates) or does in one (a signal
    sent in the middle of an epoch)."""
    step = run.trainer

    def noted(*args):
        note(*args)
        return step(*args)

    run.trainer = noted


def saved_linear_run(progress=None, rng=None) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict]:
    """A one-layer model, its optimiser and the state a snapshot of them holds (``progress`` a
    :class:`~captioner.models.training.config.Progress`, ``rng`` the saved random stream, this process's by
    default): what a test hands ``restore`` without training a run."""
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    saved = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
             "progress": (progress or Progress()).to_json(), "rng": rng_state() if rng is None else rng}
    return model, optimizer, saved


def cli_error(capsys: pytest.CaptureFixture, *argv: str) -> str:
    """What ``captioner ARGV`` prints when it refuses (exit status 2, asserted), stripped."""
    from captioner.service.cli import main

    with pytest.raises(SystemExit) as stop:
        main(list(argv))
    assert stop.value.code == 2
    return capsys.readouterr().err.strip()


# two intra-op threads on a 2-core machine, one each where `make test` runs two xdist workers there; the processes
# the tests start (`captioner train`, `captioner serve`, ...) get the same share through OMP_NUM_THREADS, which torch
# reads at start-up: with torch's default of one thread per core, a child of each worker kept two threads on two busy
# cores, and its OpenMP threads' spin-waits made a tiny model's training step five times slower
INTRA_OP_THREADS = max(1, min(2, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))
torch.set_num_threads(INTRA_OP_THREADS)
os.environ.setdefault("OMP_NUM_THREADS", str(INTRA_OP_THREADS))


def pytest_configure(config: pytest.Config) -> None:
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(parallel.Scheduling(), "captioner-module-scheduling")


@pytest.fixture(scope="session", autouse=True)
def onnx_exports_in_a_temporary_folder(tmp_path_factory):
    """Servers made by the tests (in-process or subprocess) export their ONNX graphs under pytest's temporary
    folder, not into the repository's ``.cache/onnx``, where tiny test models would pile up beside real ones."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CAPTIONER_ONNX_DIR", str(tmp_path_factory.mktemp("onnx-exports")))
        yield


@pytest.fixture(scope="module", autouse=True)
def one_browser_a_module():
    """The browser tests' pages share one Chromium per module (``demo_pages.shared_browser``): closed here, so that
    no Playwright driver outlives the module whose pages started it."""
    yield
    pages = sys.modules.get(f"{__package__}.demo_pages")  # imported only where there are pages (it loads playwright)
    if pages is not None:
        pages.close_shared_browser()


def module_folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """A temporary folder for a module-scoped fixture, removed when its module ends unless a test failed meanwhile
    (kept for the post-mortem, as a failing test's ``tmp_path`` is).  pytest keeps ``tmp_path_factory``'s folders
    to the end of the session; the largest module fixtures' (checkpoints, ONNX graphs: about 300 MB in all) would
    otherwise add up on a CI machine whose disk may hold little beside the virtual environment."""
    folder = tmp_path_factory.mktemp(name)
    failed_before = request.session.testsfailed

    def remove_when_passed() -> None:
        if request.session.testsfailed == failed_before:
            shutil.rmtree(folder, ignore_errors=True)

    request.addfinalizer(remove_when_passed)
    return folder


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny models (``pytestmark = pytest.mark.usefixtures("one_thread")``):
    their ops are too small to split, and on a busy 2-core machine waiting for a second thread dominates."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


#: the sizes and seed of the session's scene data set (:func:`scenes`), for tests that draw it again
SCENE_SIZES, SCENE_SEED = {"train": 48, "val": 12, "test": 12, "heldout": 12}, 7


@pytest.fixture(scope="session")
def scenes(tmp_path_factory) -> Path:
    """A small scene dataset (images, masks, Karpathy JSON), generated once per test session."""
    out = tmp_path_factory.mktemp("scenes")
    return generate(out, SCENE_SIZES, seed=SCENE_SEED, progress=False)


@pytest.fixture
def tiny_sat():
    torch.manual_seed(0)
    return create("sat", vocab_size=23, feat_dim=16, embed_dim=24, hidden_dim=32, attn_dim=20, dropout=0.0).eval()


@pytest.fixture
def random_visuals():
    torch.manual_seed(1)
    return VisualBatch.from_features(torch.randn(3, 9, 16))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def server_log(tmp_path_factory) -> Path:
    """Where the session server writes its output (structured access logs included)."""
    return tmp_path_factory.mktemp("server") / "server.log"


@pytest.fixture(scope="session")
def server(server_log):
    """``captioner serve`` in a real process on a free localhost port, with the shipped scene weights (``weights/``,
    the scene `sat` as the default model: the service's own default, `sat-supervised`, is a real-photo one).

    Its output goes to a file (``server_log``), never to an undrained pipe that would block a chatty server.  Its
    encoder takes at most 4 images at once (``CAPTIONER_MAX_BATCH_IMAGES``, 16 by default): the warm-up times every
    batch size up to it twice for each of the nine models, and sizes 8 and 16 took three quarters of that time."""
    assert (DEFAULT_CHECKPOINT / "model.safetensors").exists(), "the default checkpoint ships with the repo"
    port = free_port()
    log = open(server_log, "w")
    proc = subprocess.Popen([sys.executable, "-m", "captioner.service.cli", "serve", "--port", str(port),
                             "--weights-dir", str(WEIGHTS), "--model", DEFAULT_CHECKPOINT.name],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "CAPTIONER_MAX_BATCH_IMAGES": "4"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600  # every shipped checkpoint loads, is exported to ONNX (a fresh clone) and warms up
    while time.time() < deadline:
        try:
            if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.3)
        if proc.poll() is not None:
            break
    else:
        proc.kill()
        pytest.fail(f"server did not become ready: {server_log.read_text()[-3000:]}")
    if proc.poll() is not None:
        pytest.fail(f"server exited: {server_log.read_text()[-3000:]}")
    yield url
    proc.terminate()
    proc.wait(timeout=30)
    log.close()


@contextlib.contextmanager
def tiny_demo_server(tmp_path_factory, **env: str):
    """``captioner serve`` of one tiny SAT (3×3 grid), no warm-up, with ``CAPTIONER_*`` settings ``env`` besides:
    ready in seconds; its URL."""
    from captioner.models.checkpoint import save_checkpoint

    from .serving_helpers import TINY_SPEC, VOCAB, ServerProcess, tiny_model

    root = tmp_path_factory.mktemp("demo-weights")
    save_checkpoint(root / "tiny", tiny_model("sat"), VOCAB, TINY_SPEC)
    server = ServerProcess(root, {"CAPTIONER_DEFAULT_MODEL": "tiny", "CAPTIONER_DEVICE": "cpu",
                                  "CAPTIONER_WARMUP": "false", "CAPTIONER_BACKEND": "torch",
                                  "CAPTIONER_DEFAULT_BEAM_SIZE": "2", "CAPTIONER_MAX_BEAM_SIZE": "12", **env},
                           tmp_path_factory.mktemp("demo-log") / "server.log")
    try:
        yield server.wait_ready(timeout_s=120).url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def tiny_server(tmp_path_factory):
    """The demo page's browser tests' server (:func:`tiny_demo_server`)."""
    # 3 MP: a photo above it is refused (413), as a phone's 48 MP one is by default
    with tiny_demo_server(tmp_path_factory, CAPTIONER_MAX_PIXELS="3000000") as url:
        yield url


def captioned_page(url, before_load=None):
    """The demo page at ``url`` showing the caption of a 160×120 gradient (``before_load``: as :func:`page_of`)."""
    from .demo_pages import image_bytes, page_of, upload

    with page_of(url, before_load=before_load) as page:
        upload(page, "photo.png", image_bytes((160, 120), "PNG"), "image/png")
        yield page


@pytest.fixture
def captioned(tiny_server):
    """The demo page showing the caption of a 160×120 gradient."""
    yield from captioned_page(tiny_server)


@pytest.fixture
def captioned_without_openapi(tiny_server):
    """:func:`captioned`, on a page that cannot read the service's OpenAPI document (``without_openapi``): its beam
    box has no maximum, so the service refuses a beam above its limit."""
    from .demo_pages import without_openapi

    yield from captioned_page(tiny_server, before_load=without_openapi)
