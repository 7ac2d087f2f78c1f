"""ONNX Runtime backend: every registered architecture either exports (and then captions exactly like PyTorch
through the same batcher) or says why it cannot; the shipped checkpoint agrees on both backends, through the
runtime and through the HTTP service; ``captioner export`` writes what the service loads."""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import fcntl
import functools
import io
import json
import logging
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from fastapi.testclient import TestClient
from PIL import Image
from skimage import data

from captioner.models.checkpoint import CheckpointError, load_checkpoint, save_checkpoint, write_manifest
from captioner.models.data.scenes import generate
from captioner.models.encoder import EncoderSpec, GridEncoder, preprocess
from captioner.models.export import onnx as exporter
from captioner.models.export import quantize, sessions
from captioner.models.export.folder import ENCODER_FILE, HEAD_FILE, SERVED_GRAPHS, STEP_FILE, intact, seal
from captioner.models.export.onnx import ExportUnsupported, GraphSpec, export_graphs, export_identity, \
    export_is_current, export_visual_encoder
from captioner.models.export.sessions import cuda_provider_available, session_options
from captioner.models.inference import Prepared, Runtime, TorchRuntime, padded_batch, torch_runtime
from captioner.service import backend_choice, onnx_backends, onnx_exports, shared_encoders
from captioner.service import app as app_module
from captioner.service import runtime as runtime_module
from captioner.service.app import create_app
from captioner.service.backend_choice import fastest_verified
from captioner.service.batcher import Batcher
from captioner.service.cli import main as captioner
from captioner.service.middleware import configure_logging
from captioner.service.onnx_backends import OnnxRuntime
from captioner.service.onnx_exports import unprepared
from captioner.service.settings import Settings
from captioner.service.shared_encoders import SharedEncoders

from .conftest import DEFAULT_CHECKPOINT, module_folder
from .serving_helpers import TINY_SPEC, VOCAB, all_architectures, assert_same_result, call_bounded, drive, \
    random_images, run_bounded, shared_encoder, tiny_checkpoint, tiny_model

# tiny tensors gain nothing from a second thread, and on a busy machine waiting for it dominates
pytestmark = pytest.mark.usefixtures("one_thread")

# ONNX Runtime vs PyTorch through the whole decode (measured ≤ 2e-6 on attention, ≤ 2e-5 on log-probs)
ATOL_ATTENTION, ATOL_LOGPROB = 1e-4, 1e-3
SCHEDULE = [(0, 0, 3, 6), (0, 1, 1, 4), (1, 2, 4, 9), (2, 3, 2, 3), (4, 4, 3, 7), (6, 5, 2, 5)]
CPU = torch.device("cpu")


def save_tiny_sats(weights: Path, names: list[str]) -> None:
    """A tiny SAT checkpoint in ``weights`` under each name, each with weights of its own (its position's seed)."""
    for seed, name in enumerate(names):
        ckpt = tiny_checkpoint("sat", seed=seed)
        save_checkpoint(weights / name, ckpt.model, ckpt.vocab, ckpt.encoder)


def load_on_cpu(tmp_path: Path, backend: str, **settings) -> dict[str, Runtime]:
    """``load_runtimes`` as the tests here start a server: the checkpoints in ``tmp_path/weights`` on the CPU with one
    thread, exports in ``tmp_path/onnx``; ``settings`` add to those or replace them."""
    return runtime_module.load_runtimes(tmp_path / "weights", [], **{
        "device_name": "cpu", "default_backend": backend, "onnx_dir": tmp_path / "onnx", "threads": 1, **settings})


def still_to_prepare(tmp_path: Path, **settings) -> list[str]:
    """``unprepared`` of the checkpoints in ``tmp_path/weights`` with exports in ``tmp_path/onnx``, as
    :func:`load_on_cpu` starts them; ``settings`` add to those."""
    return unprepared(tmp_path / "weights", [], onnx_dir=tmp_path / "onnx", **settings)


def file_stamps(folder: Path) -> dict[str, tuple[int, int]]:
    """Each file in ``folder`` by name: its inode and modification time, which a file made again changes."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in folder.iterdir()}


def preparing_child(folder: Path, set_up_logging=None, only: list[str] | None = None) -> runtime_module.PreparingChild:
    """The preparing child of a first start of the checkpoints in ``folder/weights`` (``only`` those where given),
    exporting into ``folder/onnx`` on the CPU; ``set_up_logging`` runs first in it."""
    return runtime_module.PreparingChild(folder / "weights", [], only=only, device_name="cpu", default_backend="auto",
                                         onnx_dir=folder / "onnx", threads=1, set_up_logging=set_up_logging)


@pytest.fixture(scope="module")
def encoder():
    return shared_encoder()


def run_schedule(runtime, images, schedule=SCHEDULE):
    batcher = Batcher(runtime, max_batch=3, queue_size=16, max_rows=64)
    batcher.start(worker=False)
    prepared = [runtime.prepare(image) for image in images]
    return run_bounded(drive(batcher, [(step, prepared[i], beam, n) for step, i, beam, n in schedule]))


def assert_backends_agree(torch_rt, onnx_rt, images, schedule=SCHEDULE):
    for got, want in zip(run_schedule(onnx_rt, images, schedule), run_schedule(torch_rt, images, schedule)):
        assert_same_result(got, want, atol_attention=ATOL_ATTENTION, atol_logprob=ATOL_LOGPROB)
    # the fixed-batch path (Runtime.caption: begin, then search_rows over step/reorder) agrees too
    prepared = [torch_rt.prepare(image) for image in images[:3]]
    for got, want in zip(onnx_rt.caption(prepared, 3, 8), torch_rt.caption(prepared, 3, 8)):
        assert_same_result(got, want, atol_attention=ATOL_ATTENTION, atol_logprob=ATOL_LOGPROB)


def export_or_skip(arch: str, ckpt, folder, encoder) -> GraphSpec:
    """The export, or a skip where the model declares it cannot be exported (``export_blocker``, e.g. TVmax's
    iterative solver): any other refusal, ONNX Runtime disagreeing with PyTorch among them, is a failure (it was a
    skip for every architecture but three, so a wrong number in aoanet's graph passed as "cannot be exported")."""
    try:
        return export_graphs(ckpt, folder, encoder)
    except ExportUnsupported as exc:
        message = str(exc)
        assert message.startswith(f"{ckpt.model.arch}:") and len(message) > 40, "the reason must be specific"
        assert not folder.exists(), "nothing is written for a model that cannot be exported"
        if not ckpt.model.export_blocker():
            raise
        pytest.skip(f"cannot be exported (reported as ExportUnsupported): {message[:400]}")


@pytest.mark.parametrize("arch", all_architectures())
def test_every_architecture_exports_and_matches_pytorch_or_says_why(arch, encoder, tmp_path):
    ckpt = tiny_checkpoint(arch)
    spec = export_or_skip(arch, ckpt, tmp_path / arch, encoder)
    # a str names the folder as well as a Path (what the signature says)
    assert export_is_current(str(tmp_path / arch), ckpt.checksum) and spec.arch == arch
    assert max(spec.max_abs_diff.values()) < 1e-3
    # the folder and the device as a library caller may name them, as str (what the signature says)
    onnx_rt = OnnxRuntime(arch, ckpt, str(tmp_path / arch), "cpu", threads=1)
    assert_backends_agree(TorchRuntime(arch, ckpt, encoder, CPU), onnx_rt, random_images(6, seed=2))
    # another checkpoint's export captioned under this one's name, in silence (a library user's audit)
    with pytest.raises(ValueError, match="was exported from other weights"):
        OnnxRuntime(arch, tiny_checkpoint(arch, seed=1), str(tmp_path / arch), "cpu", threads=1)
    # ...and a graph replaced or cut short since its export was loaded as it was (the ONNX audit)
    step = tmp_path / arch / "step.onnx"
    step.write_bytes(step.read_bytes()[:-100])
    with pytest.raises(ValueError, match="step.onnx not as its export wrote it"):
        OnnxRuntime(arch, ckpt, tmp_path / arch, CPU, threads=1)


def test_an_export_made_before_the_cnns_weights_changed_is_refused_at_load(encoder, tmp_path):
    """The export's identity holds the CNN's weight files as well as the checkpoint's own weights
    (``export_identity``): a checkpoint whose fine-tuned CNN changed while its decoder did not must not load the
    graphs of the old CNN (``encoder.onnx`` holds it) under its name; comparing the checkpoint's checksum alone let
    them through."""
    ckpt = tiny_checkpoint("sat")
    export_graphs(ckpt, tmp_path / "sat", encoder)
    tuned = tmp_path / "tuned.safetensors"
    tuned.write_bytes(b"the CNN's stages as a later fine-tuning run left them")
    ckpt.encoder = dataclasses.replace(ckpt.encoder, tuned_weights=str(tuned))
    with pytest.raises(ValueError, match="was exported from other weights"):
        OnnxRuntime("sat", ckpt, tmp_path / "sat", CPU, threads=1)


@pytest.mark.parametrize("graph", [ENCODER_FILE, HEAD_FILE])
def test_an_encoder_graph_damaged_since_its_export_is_refused_at_load(graph, encoder, tmp_path):
    """The seal is checked of the graph a runtime loads to encode, as of its step: ``encoder.onnx`` on its own,
    ``head.onnx`` behind a shared CNN (a graph cut short or copied in from another model captioned, or failed,
    under this model's name)."""
    ckpt = tiny_checkpoint("sat")
    export_graphs(ckpt, tmp_path / "sat", encoder)
    visual = sessions.VisualSession(export_visual_encoder(ckpt.encoder, tmp_path, encoder)) if graph == HEAD_FILE \
        else None
    damaged = tmp_path / "sat" / graph
    damaged.write_bytes(damaged.read_bytes()[:-100])
    with pytest.raises(ValueError, match=f"{graph} not as its export wrote it"):
        OnnxRuntime("sat", ckpt, tmp_path / "sat", CPU, threads=1, visual=visual)
    step = tmp_path / "sat" / STEP_FILE  # both graphs damaged: the message names each, not the first alone
    step.write_bytes(step.read_bytes()[:-100])
    with pytest.raises(ValueError, match=f"{graph} and step.onnx not as its export wrote it"):
        OnnxRuntime("sat", ckpt, tmp_path / "sat", CPU, threads=1, visual=visual)


def test_onnx_runtime_begins_each_image_with_its_own_rows_at_mixed_widths(encoder, tmp_path):
    """One batch of images with beams of different widths: each image's encoder and decoder rows repeated its own
    width, as on PyTorch (a caption with one width for every image cannot tell)."""
    ckpt = tiny_checkpoint("sat")
    export_graphs(ckpt, tmp_path / "sat", encoder)
    onnx_rt = OnnxRuntime("sat", ckpt, tmp_path / "sat", CPU, threads=1)
    torch_rt = TorchRuntime("sat", ckpt, encoder, CPU)
    prepared = [torch_rt.prepare(image) for image in random_images(2, seed=4)]
    for got, want in zip(onnx_rt.begin(prepared, [1, 3]), torch_rt.begin(prepared, [1, 3])):
        assert sorted(got) == sorted(want)
        for key, value in want.items():
            torch.testing.assert_close(got[key], value, atol=ATOL_ATTENTION, rtol=1e-3)


@pytest.mark.parametrize("arch,config", [
    ("area-transformer", dict(encoder_area=None, decoder_area=None, area_key="mean")),  # growing cache
    # spans of the growing caption (the shipped recipe's 3×3* + 2*): their number follows the caption's length
    ("area-transformer", dict(caption_area=3, area_key="combined")),
    ("sparsecap", dict(attention="sparsemax")),  # exact zeros must stay exact
])
def test_configuration_variants_export_and_match(arch, config, encoder, tmp_path):
    ckpt = tiny_checkpoint(arch, **config)
    if arch == "sparsecap":
        with torch.no_grad():  # spread the attention scores, so that sparsemax has zeros to keep
            for name, param in ckpt.model.named_parameters():
                if name.startswith("output_attention"):
                    param.mul_(10.0)
    spec = export_graphs(ckpt, tmp_path / "model", encoder)
    assert any(spec.growing_dims.values()) == (arch == "area-transformer")
    onnx_rt = OnnxRuntime(arch, ckpt, tmp_path / "model", CPU, threads=1)
    torch_rt = TorchRuntime(arch, ckpt, encoder, CPU)
    assert_backends_agree(torch_rt, onnx_rt, random_images(6, seed=4))
    if config.get("attention") == "sparsemax":
        result = run_schedule(onnx_rt, random_images(6, seed=4))[0]
        assert (result.hypothesis.attention == 0).any(), "sparsemax zeros survive the ONNX graph"


def test_unexportable_configuration_names_the_code_responsible(encoder, tmp_path):
    with pytest.raises(ExportUnsupported, match=r"sparsecap: .*models/attention/tvmax\.py:\d+"):
        export_graphs(tiny_checkpoint("sparsecap", attention="tvmax"), tmp_path / "tvmax", encoder)
    assert not (tmp_path / "tvmax").exists()


def test_a_step_that_reads_what_encode_kept_on_the_model_is_refused_naming_only_real_causes(encoder, tmp_path):
    """A model that keeps the batch's mean on ``self`` in ``encode`` and reads it in ``step`` (what README's
    protocol forbids) exports a graph with that mean frozen in: refused, and the message no longer lists the input
    checks of the project's own code, which the tracer had reported as frozen values ahead of the real cause."""
    ckpt = tiny_checkpoint("sat")
    model = ckpt.model
    plain_encode, plain_step = model.encode, model.step

    def encode(self, vis):
        self.kept = vis.feats.mean()
        return plain_encode(vis)

    def step(self, prev, state, enc):
        logprobs, state, attention = plain_step(prev, state, enc)
        tilt = 50 * self.kept * torch.linspace(0, 1, logprobs.shape[-1])  # changes which word is likelier
        return (logprobs + tilt).log_softmax(-1), state, attention

    model.encode, model.step = types.MethodType(encode, model), types.MethodType(step, model)
    with pytest.raises(ExportUnsupported, match="keeps something on the model between calls") as refused:
        export_graphs(ckpt, tmp_path / "kept", encoder)
    message = str(refused.value)
    assert not [name for name in ("encoder.py:", "protocol.py:", "layers.py:", "sat.py:") if name in message], message
    assert not (tmp_path / "kept").exists()


@pytest.mark.parametrize("method,refusal", [("init_state", "cannot run the encoder graph on a new batch size"),
                                            ("step", "cannot run the step graph on new row counts")])
def test_a_row_count_taken_as_a_python_int_is_refused_naming_the_line(method, refusal, encoder, tmp_path):
    """``int()`` of a tensor's size is a constant of the traced graph, which then runs only at the example's row
    count: the export runs its graphs on a batch size and beam width the trace never saw, refuses, and names the
    line (here, in the encoder graph's ``init_state`` and in the step graph)."""
    ckpt = tiny_checkpoint("sat")
    model = ckpt.model
    plain = getattr(model, method)

    def padded(first: torch.Tensor) -> torch.Tensor:
        return first + torch.zeros(int(first.shape[0]), 1)

    def init_state(self, enc):
        return {key: padded(value) for key, value in plain(enc).items()}

    def step(self, prev, state, enc):
        logprobs, state, attention = plain(prev, state, enc)
        return padded(logprobs), state, attention

    setattr(model, method, types.MethodType(init_state if method == "init_state" else step, model))
    with pytest.raises(ExportUnsupported, match=refusal) as refused:
        export_graphs(ckpt, tmp_path / "frozen", encoder)
    assert "the tracer froze Python values at" in str(refused.value) and "test_serving_onnx.py:" in str(refused.value)
    assert not (tmp_path / "frozen").exists()


def test_a_step_that_decides_on_the_previous_tokens_in_python_is_refused(encoder, tmp_path):
    """A value read from ``prev_tokens`` in Python is frozen at the traced step's tokens: the export checks its
    step graph on other tokens than the trace's (as a beam search feeds it), so such a graph is refused."""
    ckpt = tiny_checkpoint("sat")
    model = ckpt.model
    plain_step = model.step

    def step(self, prev, state, enc):
        logprobs, state, attention = plain_step(prev, state, enc)
        tilt = float(prev.max()) * torch.linspace(0, 1, logprobs.shape[-1])
        return (logprobs + tilt).log_softmax(-1), state, attention

    model.step = types.MethodType(step, model)
    with pytest.raises(ExportUnsupported, match="ONNX Runtime disagrees with PyTorch"):
        export_graphs(ckpt, tmp_path / "tokens", encoder)
    assert not (tmp_path / "tokens").exists()


def test_a_step_that_decides_on_the_decoding_step_in_python_is_refused_at_the_step_it_shows_at(encoder, tmp_path):
    """A Python value frozen from how far decoding has gone can agree with PyTorch on the first steps and not after
    (here a tilt that starts at the third word, read from a state that grows a column a step): the export checks its
    step graph at every step it runs, not the first alone, so such a graph is refused, naming the step it shows at,
    instead of being served to caption differently from its model after two words."""
    ckpt = tiny_checkpoint("sat")
    model = ckpt.model
    plain_init, plain_step = model.init_state, model.step

    def init_state(self, enc):
        state = plain_init(enc)
        return {**state, "words": state["h"][:, :0]}

    def step(self, prev, state, enc):
        words = state["words"]
        logprobs, new_state, attention = plain_step(prev, {k: v for k, v in state.items() if k != "words"}, enc)
        tilt = 50 * float(words.shape[1] >= 2) * torch.linspace(0, 1, logprobs.shape[-1])
        new_state = {**new_state, "words": torch.cat([words, torch.zeros_like(logprobs[:, :1])], 1)}
        return (logprobs + tilt).log_softmax(-1), new_state, attention

    model.init_state, model.step = types.MethodType(init_state, model), types.MethodType(step, model)
    with pytest.raises(ExportUnsupported, match="ONNX Runtime disagrees with PyTorch") as refused:
        export_graphs(ckpt, tmp_path / "late", encoder)
    assert "logprobs at step 2" in str(refused.value)
    assert not (tmp_path / "late").exists()


@pytest.mark.parametrize("complaint,shown", [
    ("Unsupported: prim::PythonOp", "(RuntimeError: Unsupported: prim::PythonOp)"),
    ("first line\nsecond line", "(RuntimeError: first line)"),
    ("", "(RuntimeError: )"),
])
def test_a_graph_the_tracer_cannot_record_is_refused_with_the_tracers_first_line(complaint, shown, encoder, tmp_path,
                                                                                 monkeypatch):
    """No model here makes the tracer fail, so it is made to, on the step graph alone: the refusal names the graph
    and the first line of the tracer's complaint, whether it has one line, several or none."""
    plain_export = torch.onnx.export

    def export(graph, args, file, **options):
        if file.endswith(STEP_FILE):
            raise RuntimeError(complaint)
        return plain_export(graph, args, file, **options)

    monkeypatch.setattr(torch.onnx, "export", export)
    with pytest.raises(ExportUnsupported, match="cannot record the decoder step") as refused:
        export_graphs(tiny_checkpoint("sat"), tmp_path / "sat", encoder)
    assert shown in str(refused.value) and "second line" not in str(refused.value)
    assert not (tmp_path / "sat").exists()


def test_a_tracers_os_error_without_an_errno_is_a_refusal_not_a_disk_failure(encoder, tmp_path, monkeypatch):
    """The tracer reads a model's source with ``inspect``, which raises an OSError of its own ("could not get source
    code": a model defined in a notebook, a package installed without its .py files). That is a model the tracer
    cannot record, refused as such (``captioner export`` reports it NOT EXPORTED, a server records it and serves
    PyTorch), not a full disk or a read-only folder, which stop the export and are tried again at the next start."""
    plain_export = torch.onnx.export

    def export(graph, args, file, **options):
        if file.endswith(STEP_FILE):
            raise OSError("could not get source code")
        return plain_export(graph, args, file, **options)

    monkeypatch.setattr(torch.onnx, "export", export)
    with pytest.raises(ExportUnsupported, match=r"cannot record the decoder step \(OSError: could not get source"):
        export_graphs(tiny_checkpoint("sat"), tmp_path / "sat", encoder)
    assert not (tmp_path / "sat").exists()


def test_a_step_graph_onnx_runtime_cannot_load_is_refused_naming_the_node(encoder, tmp_path, monkeypatch):
    """No graph here fails to load, so ONNX Runtime is made to refuse the step graph alone, with a complaint of its
    own form: the refusal says which graph, its first line's complaint and the node, and nothing is written."""
    plain_session = exporter._session

    def session(path):
        if path.name == STEP_FILE:
            raise RuntimeError("[ONNXRuntimeError] : 1 : FAIL : Node (/decoder/Reshape) Name:'/decoder/Reshape' "
                               "Status Message: the shape does not fit\n  the C++ stack it was raised from")
        return plain_session(path)

    monkeypatch.setattr(exporter, "_session", session)
    with pytest.raises(ExportUnsupported, match="sat: ONNX Runtime cannot load the step graph: the shape does not "
                                                r"fit at node /decoder/Reshape \(module decoder\)"):
        export_graphs(tiny_checkpoint("sat"), tmp_path / "sat", encoder)
    assert not (tmp_path / "sat").exists()


def test_onnx_runtimes_complaint_names_the_module_that_holds_a_deeply_nested_node():
    """A real graph's nodes sit several modules deep (``/decoder/attention/proj/Reshape``): the refusal names the
    whole module path the failing node belongs to, not just its outermost module, so a user is sent to the layer
    to change rather than left to search the whole decoder; ONNX Runtime's source location and C++ signature in
    front of the complaint are dropped."""
    where = "/onnxruntime_src/onnxruntime/core/providers/cpu/tensor/reshape_helper.h:39"
    signature = "onnxruntime::ReshapeHelper::ReshapeHelper(const onnxruntime::TensorShape&, bool)"
    problem = "The input tensor cannot be reshaped to the requested shape."
    node = "Name:'/decoder/attention/proj/Reshape'"
    head = "[ONNXRuntimeError] : 1 : FAIL : Non-zero status code returned while running Reshape node."
    complaint = f"{head} {node} Status Message: {where} {signature} {problem}"
    said = exporter._ort_failure(RuntimeError(complaint), [])
    assert said.startswith(f"{problem} at node /decoder/attention/proj/Reshape (module decoder.attention.proj) — ")


@pytest.mark.parametrize("graph,named", [(ENCODER_FILE, "(encoder)"), (HEAD_FILE, "(encoder head)"),
                                         (STEP_FILE, "at step 0")])
def test_a_graph_that_computes_another_models_weights_is_refused_whichever_it_is(graph, named, encoder, tmp_path,
                                                                                 monkeypatch):
    """Every graph written is checked against PyTorch, ``head.onnx`` too (the one the service runs after the
    shared CNN, which no caption test through ``encoder.onnx`` reaches): one swapped for another checkpoint's right
    after tracing is refused, and the message names it."""
    export_graphs(tiny_checkpoint("sat", seed=1), tmp_path / "other", encoder)
    trace = exporter._trace_graphs

    def swapped(arch, graphs, folder):
        frozen = trace(arch, graphs, folder)
        shutil.copyfile(tmp_path / "other" / graph, folder / graph)
        return frozen

    monkeypatch.setattr(exporter, "_trace_graphs", swapped)
    with pytest.raises(ExportUnsupported, match="ONNX Runtime disagrees with PyTorch") as refused:
        export_graphs(tiny_checkpoint("sat"), tmp_path / "model", encoder)
    assert named in str(refused.value)
    assert not (tmp_path / "model").exists()


def test_a_refusal_names_the_first_four_frozen_sites_and_counts_the_rest():
    """A deep model's trace can freeze values at many sites, the project's own input checks among them: the refusal
    names the first four and says how many more there are, so the line a user must change is not lost in the list
    (and the count it gives is the one left out)."""
    sites = [f"models/deep.py:{line} (Converting a tensor to a Python integer)" for line in range(1, 7)]
    why = exporter._why(sites)
    assert all(site in why for site in sites[:4]) and sites[4] not in why and sites[5] not in why
    assert why.count("models/deep.py:") == 4 and "; and 2 more" in why and exporter.FROZEN_HINT in why
    assert "more" not in exporter._why(sites[:4]) and exporter._why([]) == ""


# (PyTorch's output, ONNX Runtime's) where a graph computes something else than its model
OUTPUTS_THAT_DISAGREE = [
    ([[-1.5, -0.3, -2.0]], [[-1.5, -0.29, -2.0]]),  # a number a hundredth off: another model's, not kernel noise
    ([[-1.5, -float("inf"), -2.0]], [[-1.5, -30.0, -2.0]]),  # a word PyTorch rules out that the graph allows
    ([[-1.5, -0.3, -2.0]], [[-1.5, float("nan"), -2.0]]),  # a number the graph loses
    ([[3, 4, 5]], [[3, 4, 6]]),  # an integer state (a length, a position) one off
]


@pytest.mark.parametrize("want,got", OUTPUTS_THAT_DISAGREE)
def test_the_exports_check_refuses_a_graph_output_pytorch_does_not_give(want, got):
    """The export is only written after each graph output matched PyTorch's on new shapes (``_close``): within
    float noise (relative to the output's size), infinite and NaN exactly where PyTorch's are, integers equal. A
    check any looser passed a graph that captions differently from the model it was made from."""
    want_tensor = torch.tensor(want)
    got_array = np.array(got, dtype=want_tensor.numpy().dtype)
    with pytest.raises(ExportUnsupported, match="ONNX Runtime disagrees with PyTorch"):
        exporter._close("sat: logprobs at step 0", "logprobs", got_array, want_tensor, [], {})
    diffs: dict[str, float] = {}
    if want_tensor.is_floating_point():
        # float noise passes, and the largest difference over the steps is what the export records for the kind
        noisy = want_tensor.numpy() + np.float32(2e-5)
        exporter._close("sat: logprobs at step 0", "logprobs", noisy, want_tensor, [], diffs)
    exporter._close("sat: logprobs at step 1", "logprobs", want_tensor.numpy().copy(), want_tensor, [], diffs)
    assert diffs.get("logprobs", 0.0) == pytest.approx(2e-5 if want_tensor.is_floating_point() else 0.0, rel=0.1)


def test_the_exports_check_allows_float_noise_in_proportion_to_the_outputs_largest_value():
    """Float32 sums over large values carry noise of those values' size into the small entries they produce too: a
    state whose cells reach 200 has entries near zero off by a few thousandths in any runtime. The check's absolute
    tolerance grows with the output's largest value, so such a graph is written (not refused as another model's);
    a difference ten times that noise is still refused."""
    want = torch.tensor([[200.0, 0.0, -3.0]])
    noisy = np.array([[200.001, 0.005, -3.0]], dtype=np.float32)
    diffs: dict[str, float] = {}
    exporter._close("sat: next.c at step 0", "next.c", noisy, want, [], diffs)
    assert diffs["next"] == pytest.approx(0.005, rel=0.01)
    far = np.array([[200.0, 0.05, -3.0]], dtype=np.float32)
    with pytest.raises(ExportUnsupported, match="ONNX Runtime disagrees with PyTorch"):
        exporter._close("sat: next.c at step 0", "next.c", far, want, [], {})


# -- the shipped checkpoint -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def shipped(request, tmp_path_factory):
    """weights/sat, its ONNX export (made once for this module) and some images it knows how to caption."""
    ckpt = load_checkpoint(DEFAULT_CHECKPOINT, "cpu")
    onnx_dir = module_folder(request, tmp_path_factory, "onnx")
    visual = GridEncoder(ckpt.encoder).to(memory_format=torch.channels_last)
    spec = export_graphs(ckpt, onnx_dir / "sat", visual)
    scenes = tmp_path_factory.mktemp("scenes")
    dataset = json.loads(generate(scenes, {"test": 5}, seed=321, progress=False).read_text())
    images = [Image.open(scenes / "images" / entry["filename"]).convert("RGB") for entry in dataset["images"]]
    images.append(Image.fromarray(data.chelsea()))
    return ckpt, visual, onnx_dir, spec, images


def test_shipped_checkpoint_captions_identically_on_both_backends(shipped):
    ckpt, visual, onnx_dir, spec, images = shipped
    assert max(spec.max_abs_diff.values()) < 1e-3
    onnx_rt = OnnxRuntime("sat", ckpt, onnx_dir / "sat", CPU, threads=1)
    torch_rt = TorchRuntime("sat", ckpt, visual, CPU)
    assert_backends_agree(torch_rt, onnx_rt, images)
    assert onnx_rt.info().backend == "onnx" and onnx_rt.providers == ["CPUExecutionProvider"]


def torch_runtime_of(folder) -> TorchRuntime:
    return torch_runtime(load_checkpoint(folder, "cpu"))


def _jpeg(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=92)
    return buffer.getvalue()


def test_service_serves_a_model_on_onnx_runtime_by_config(shipped, tmp_path):
    """Two names for the shipped checkpoint, one per backend (CAPTIONER_BACKENDS); their HTTP answers agree."""
    _, _, onnx_dir, _, images = shipped
    weights = tmp_path / "weights"
    weights.mkdir()
    for name in ("sat-torch", "sat-onnx"):
        (weights / name).symlink_to(DEFAULT_CHECKPOINT.resolve(), target_is_directory=True)
        (onnx_dir / name).symlink_to((onnx_dir / "sat").resolve(), target_is_directory=True)
    settings = Settings(weights_dir=weights, default_model="sat-torch", backend="torch", backends={"sat-onnx": "onnx"},
                        onnx_dir=onnx_dir, device="cpu", threads=1, max_batch_images=2, queue_size=8, warmup=False)
    with TestClient(create_app(settings)) as client:
        models = {m["name"]: m for m in client.get("/models").json()}
        assert models["sat-onnx"]["backend"] == "onnx" and models["sat-torch"]["backend"] == "torch"
        assert models["sat-onnx"]["providers"] == ["CPUExecutionProvider"]
        assert models["sat-onnx"]["checksum"] == models["sat-torch"]["checksum"]
        for image in images[:3] + images[-1:]:
            answers = [client.post("/caption", params={"model": name, "beam_size": 3},
                                   files={"file": ("x.jpg", _jpeg(image), "image/jpeg")}).json()
                       for name in ("sat-torch", "sat-onnx")]
            assert answers[0]["caption"] == answers[1]["caption"] and answers[0]["caption"]
            np.testing.assert_allclose(answers[0]["attention"], answers[1]["attention"], atol=ATOL_ATTENTION)
            np.testing.assert_allclose(answers[0]["token_logprobs"], answers[1]["token_logprobs"], atol=ATOL_LOGPROB)


def test_captioner_export_writes_every_model_and_reports_the_ones_it_cannot(tmp_path, capsys):
    weights = tmp_path / "weights"
    for name, arch, config in (("tiny-sat", "sat", {}), ("tiny-tvmax", "sparsecap", {"attention": "tvmax"})):
        ckpt = tiny_checkpoint(arch, **config)
        save_checkpoint(weights / name, ckpt.model, ckpt.vocab, ckpt.encoder)
    captioner(["export", "--weights-dir", str(weights), "--out", str(tmp_path / "onnx"), "--threads", "1"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("tiny-sat: ") and "verified against PyTorch" in lines[0]
    assert lines[1].startswith("tiny-tvmax: NOT EXPORTED: sparsecap: ") and "tvmax.py" in lines[1]
    assert (tmp_path / "onnx" / "tiny-sat" / ENCODER_FILE).is_file()
    assert (tmp_path / "onnx" / "tiny-sat" / STEP_FILE).is_file()
    assert (tmp_path / "onnx" / "tiny-sat" / HEAD_FILE).is_file()
    # the CNN once per encoder spec, which the service shares between models
    assert len(list((tmp_path / "onnx").glob("visual-*/visual.onnx"))) == 1
    assert not (tmp_path / "onnx" / "tiny-tvmax").exists()
    with pytest.raises(SystemExit):
        captioner(["export", str(weights / "tiny-tvmax"), "--out", str(tmp_path / "onnx"), "--strict"])


def test_a_model_that_cannot_be_exported_is_served_with_pytorch(tmp_path, caplog):
    """... saying why, and its first start records that, so later starts spawn no child to try the export again."""
    ckpt = tiny_checkpoint("sparsecap", attention="tvmax")
    save_checkpoint(tmp_path / "weights" / "tvmax", ckpt.model, ckpt.vocab, ckpt.encoder)
    settings = Settings(weights_dir=tmp_path / "weights", default_model="tvmax", backend="onnx",
                        onnx_dir=tmp_path / "onnx", device="cpu", threads=1, warmup=False)
    assert unprepared(**settings.model_placement(), weights_dir=settings.weights_dir, extra=[]) == ["tvmax"]
    with caplog.at_level(logging.INFO, logger="captioner"), TestClient(create_app(settings)) as client:
        assert client.get("/models").json()[0]["backend"] == "torch"
        image = random_images(1)[0]
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        assert client.post("/caption", content=buffer.getvalue(),
                           headers={"content-type": "image/png"}).status_code == 200
    assert unprepared(**settings.model_placement(), weights_dir=settings.weights_dir, extra=[]) == []
    # where docs/onnx.md says the record is, named after the weights' identity
    identity = export_identity(load_checkpoint(tmp_path / "weights" / "tvmax").checksum, ckpt.encoder)
    assert [p.name for p in (tmp_path / "onnx" / ".unexportable").iterdir()] == [f"{identity}.json"]
    assert any("TVmax's 2D TV prox" in record.getMessage() for record in caplog.records
               if record.levelno >= logging.WARNING)  # the reason, not a folder the export never made
    # told before the CNN's graph is made: served on PyTorch, it would be traced and verified for nothing
    assert not list((tmp_path / "onnx").glob("visual-*"))


def test_a_record_that_a_model_cannot_be_exported_holds_for_its_export_format_only(tmp_path):
    """A model recorded as unexportable is not sent to the preparing child again on ``onnx``, but only while the
    record is of this export format: code writing another format may export what that code could not."""
    ckpt = tiny_checkpoint("sat")
    save_checkpoint(tmp_path / "weights" / "a", ckpt.model, ckpt.vocab, ckpt.encoder)
    identity = export_identity(load_checkpoint(tmp_path / "weights" / "a").checksum, ckpt.encoder)
    record = onnx_exports.unexportable_record(tmp_path / "onnx", identity)
    record.parent.mkdir(parents=True)
    for written_by, left in (("attention-captioner-onnx/1", ["a"]), (exporter.FORMAT, [])):
        record.write_text(json.dumps({"format": written_by, "why": "a step the tracer cannot record"}))
        assert still_to_prepare(tmp_path, default_backend="onnx") == left
    # hybrid runs the CNN's graph whatever the decoder: a record of this format does not excuse a CNN graph not made
    assert still_to_prepare(tmp_path, default_backend="hybrid") == ["a"]
    # a record torn, or JSON that is not an object: no record, so the child tries again
    for damaged in ('{"format": ', json.dumps([exporter.FORMAT])):
        record.write_text(damaged)
        assert still_to_prepare(tmp_path, default_backend="onnx") == ["a"]


def test_a_model_that_cannot_be_exported_is_recorded_under_the_identity_that_covers_its_cnns_file(tmp_path):
    """A TVmax decoder behind a fine-tuned CNN (its encoder names a weights file): the record that it cannot be
    exported is kept under the identity ``unprepared`` looks it up by, which covers the CNN's file, not under the
    decoder's checksum alone, where no start would find it and each would send the model to a child again."""
    ckpt = tiny_checkpoint("sparsecap", attention="tvmax")
    tuned = tmp_path / "tuned.safetensors"
    tuned.write_bytes(b"the CNN's stages as a fine-tuning run left them")
    ckpt.encoder = dataclasses.replace(ckpt.encoder, tuned_weights=str(tuned))
    identity = export_identity(ckpt.checksum, ckpt.encoder)
    assert identity != ckpt.checksum
    with pytest.raises(ExportUnsupported, match="TVmax"):
        onnx_exports.onnx_folder(SharedEncoders(CPU, tmp_path / "onnx", 1), "tvmax", ckpt)
    assert [p.name for p in (tmp_path / "onnx" / ".unexportable").iterdir()] == [f"{identity}.json"]


def test_a_record_that_a_model_cannot_be_exported_excuses_no_damaged_cnn_graph_once_it_has_been_exported(tmp_path):
    """A model recorded as impossible to export that has a current export since (``captioner export`` into the ONNX
    folder, or a later start whose export passed the check): the record excuses nothing any more, so its damaged
    CNN graph still sends it to the preparing child, rather than to the server's own load, which would build the
    PyTorch CNN in the serving process to make it."""
    save_tiny_sats(tmp_path / "weights", ["a"])
    assert load_on_cpu(tmp_path, "onnx")["a"].backend == "onnx"
    ckpt = load_checkpoint(tmp_path / "weights" / "a")
    record = onnx_exports.unexportable_record(tmp_path / "onnx", export_identity(ckpt.checksum, ckpt.encoder))
    record.parent.mkdir(parents=True)
    record.write_text(json.dumps({"format": exporter.FORMAT, "why": "graphs that disagreed with PyTorch once"}))
    assert still_to_prepare(tmp_path, default_backend="onnx") == []
    (visual,) = (tmp_path / "onnx").glob("visual-*/visual.onnx")
    visual.write_bytes(visual.read_bytes()[:1000])
    assert still_to_prepare(tmp_path, default_backend="onnx") == ["a"]


def test_an_export_stopped_by_a_full_disk_is_not_recorded_as_impossible_and_is_prepared_again(tmp_path, monkeypatch):
    """Only a model that cannot be exported (``ExportUnsupported``) is recorded so: an export a full disk stopped is
    served with PyTorch this time, and the next start still sends it to the preparing child, rather than counting a
    failure of the moment as the model's for good."""
    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "onnx" / "a" / STEP_FILE))

    monkeypatch.setattr(exporter, "export_graphs", full_disk)
    save_tiny_sats(tmp_path / "weights", ["a"])
    assert load_on_cpu(tmp_path, "onnx")["a"].backend == "torch"
    assert not (tmp_path / "onnx" / ".unexportable").exists()
    assert still_to_prepare(tmp_path, default_backend="onnx") == ["a"]


def test_every_model_that_cannot_be_exported_is_recorded_and_an_unwritable_record_keeps_the_reason(tmp_path, caplog):
    """Two models that cannot be exported: each is recorded (the second record goes into the folder the first made),
    so neither is sent to a child again.  An ONNX folder the record cannot be written to leaves the model to the next
    start, and the log still gives the real reason, not the folder's error."""
    for seed, name in enumerate(["t1", "t2"]):
        ckpt = tiny_checkpoint("sparsecap", seed=seed, attention="tvmax")
        save_checkpoint(tmp_path / "weights" / name, ckpt.model, ckpt.vocab, ckpt.encoder)
    assert still_to_prepare(tmp_path, default_backend="onnx") == ["t1", "t2"]
    assert {name: runtime.backend for name, runtime in load_on_cpu(tmp_path, "onnx").items()} == \
        {"t1": "torch", "t2": "torch"}
    assert len(list((tmp_path / "onnx" / ".unexportable").iterdir())) == 2
    assert still_to_prepare(tmp_path, default_backend="onnx") == []
    (tmp_path / "not-a-folder").write_text("")  # stands in for a read-only folder, as root may write anywhere
    caplog.clear()  # the first start's lines gave the reason too
    with caplog.at_level(logging.INFO, logger="captioner"):
        assert load_on_cpu(tmp_path, "onnx", onnx_dir=tmp_path / "not-a-folder" / "onnx")["t1"].backend == "torch"
    reasons = [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]
    assert any("t1" in reason and "TVmax's 2D TV prox" in reason for reason in reasons), reasons


def test_a_damaged_cnn_graph_of_a_model_auto_serves_as_the_hybrid_is_still_to_prepare(tmp_path):
    """``auto`` serves a model whose decoder cannot be exported as the hybrid, on the shared CNN's graph: the record
    that the decoder cannot be exported excuses its missing export, never a damaged CNN graph, which the preparing
    child makes again rather than the server's own load (which would build the PyTorch CNN in the serving process)."""
    ckpt = tiny_checkpoint("sparsecap", attention="tvmax")
    save_checkpoint(tmp_path / "weights" / "tvmax", ckpt.model, ckpt.vocab, ckpt.encoder)
    assert load_on_cpu(tmp_path, "auto")["tvmax"].backend == "hybrid"
    assert still_to_prepare(tmp_path) == []
    # PyTorch's captions of the check set and the record that the decoder cannot be exported, each where docs/onnx.md
    # says (one overwriting the other would caption the check set again at every start)
    identity = export_identity(load_checkpoint(tmp_path / "weights" / "tvmax").checksum, ckpt.encoder)
    for folder in (".reference", ".unexportable"):
        assert [p.name for p in (tmp_path / "onnx" / folder).iterdir()] == [f"{identity}.json"]
    assert "token_ids" in json.loads((tmp_path / "onnx" / ".reference" / f"{identity}.json").read_text())
    (visual,) = (tmp_path / "onnx").glob("visual-*/visual.onnx")
    visual.write_bytes(visual.read_bytes()[:1000])
    assert still_to_prepare(tmp_path) == ["tvmax"]


def test_a_checkpoint_whose_config_names_no_readable_encoder_is_left_to_the_loader_not_the_child(tmp_path):
    """A config.json whose encoder cannot be read (missing, not a mapping, a size that is no number): ``unprepared``
    does not name it on any ONNX backend, since the server's load skips it and a child would only do the same; the
    sound model beside it still is."""
    save_tiny_sats(tmp_path / "weights", ["a", "b"])
    folder = tmp_path / "weights" / "a"
    sound = json.loads((folder / "config.json").read_text())
    for edit in (lambda config: config.pop("encoder"), lambda config: config.update(encoder="efficientnet_lite0"),
                 lambda config: config["encoder"].update(image_size="big")):
        config = json.loads(json.dumps(sound))
        edit(config)
        (folder / "config.json").write_text(json.dumps(config))
        write_manifest(folder)
        for backend in ("auto", "onnx", "hybrid"):
            assert still_to_prepare(tmp_path, default_backend=backend) == ["b"]


def test_an_int8_cnn_not_yet_made_beside_the_float_one_is_still_to_prepare(tmp_path):
    """``CAPTIONER_ENCODER_PRECISION=int8`` after float32 starts: the float CNN graph is there, but the int8 one the
    server loads is not, so the model is still to prepare (the child quantizes it), not counted as prepared."""
    save_tiny_sats(tmp_path / "weights", ["a"])
    assert load_on_cpu(tmp_path, "hybrid")["a"].backend == "hybrid"
    for precision, left in (("float32", []), ("int8", ["a"])):
        assert still_to_prepare(tmp_path, default_backend="hybrid",
                          encoder_precision=precision) == left


def test_a_checkpoint_without_a_recorded_checksum_is_left_to_the_preparing_child(tmp_path):
    """No manifest, so no sha256 to name its export by without hashing the weights: ``unprepared`` cannot tell that
    its export is current, and names it on every ONNX backend (the child loads it and finds out)."""
    save_tiny_sats(tmp_path / "weights", ["a"])
    (tmp_path / "weights" / "a" / "manifest.json").unlink()
    for backend in ("auto", "onnx", "hybrid"):
        assert still_to_prepare(tmp_path, default_backend=backend) == ["a"]


def test_models_found_under_a_prefix_or_given_alone_are_still_to_prepare_by_their_served_names(tmp_path):
    """``unprepared`` names the models the server serves: a prefixed folder's under prefix + name, and a checkpoint
    given alone; each one's backend is the one the settings name for it under that name."""
    for folder, name in (("weights", "a"), ("other", "b"), ("alone", "c")):
        save_tiny_sats(tmp_path / folder, [name])

    def left(backends: dict[str, str]) -> list[str]:
        return unprepared(tmp_path / "weights", [tmp_path / "alone" / "c"], onnx_dir=tmp_path / "onnx",
                          prefixed={"p-": tmp_path / "other"}, backends=backends, default_backend="onnx")

    assert left({}) == ["a", "p-b", "c"]
    assert left({"p-b": "torch"}) == ["a", "c"]
    assert left({"a": "torch", "c": "torch"}) == ["p-b"]


@pytest.mark.parametrize("backend", ["auto", "onnx", "hybrid"])
def test_an_onnx_folder_that_cannot_be_written_is_named_in_one_line_and_pytorch_serves(tmp_path, caplog, backend):
    """A read-only (or full) ``CAPTIONER_ONNX_DIR`` with nothing current in it: each ONNX backend is given up with
    the file and the reason in one line, not a traceback that reads like a bug.  (A path under a regular file
    stands in for a read-only folder: the tests may run as root, whom permission bits do not stop.)"""
    save_tiny_sats(tmp_path / "weights", ["a"])
    (tmp_path / "not-a-folder").write_text("")
    with caplog.at_level(logging.INFO, logger="captioner"):
        loaded = load_on_cpu(tmp_path, backend, onnx_dir=tmp_path / "not-a-folder" / "onnx")
    assert loaded["a"].backend == "torch"
    assert not [record.getMessage() for record in caplog.records if record.exc_info]
    assert any("not-a-folder" in record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING)


@pytest.mark.parametrize("backend", ["onnx", "hybrid"])
def test_a_backend_named_in_the_settings_serves_its_models_with_the_cnn_their_spec_shares(tmp_path, backend):
    """``CAPTIONER_BACKEND=onnx`` or ``hybrid`` (not ``auto``): each model is served so, through one ONNX Runtime
    session of its spec's CNN, and captions like PyTorch; only ONNX Runtime alone drops the PyTorch weights.  A model
    ``CAPTIONER_BACKENDS`` names keeps the backend given there."""
    save_tiny_sats(tmp_path / "weights", ["a", "b", "c"])
    loaded = load_on_cpu(tmp_path, backend, backends={"c": "torch"})
    assert {name: r.backend for name, r in loaded.items()} == {"a": backend, "b": backend, "c": "torch"}
    assert loaded["a"].visual is loaded["b"].visual is not None
    for name in ("a", "b"):
        on_meta = all(p.is_meta for p in loaded[name].ckpt.model.parameters())
        assert on_meta == (backend == "onnx")
        # /models names ONNX Runtime's providers for either backend (the hybrid's: its CNN session's)
        assert loaded[name].info().providers == ["CPUExecutionProvider"]
    prepared = [loaded["c"].prepare(image) for image in random_images(2, seed=5)]
    want = torch_runtime_of(tmp_path / "weights" / "a").caption(prepared, 2, 6)
    for got, expected in zip(loaded["a"].caption(prepared, 2, 6), want):
        assert_same_result(got, expected, atol_attention=ATOL_ATTENTION, atol_logprob=ATOL_LOGPROB)


@pytest.mark.parametrize("backend", ["auto", "onnx", "hybrid"])
def test_an_autocast_precision_serves_every_model_on_pytorch_in_that_precision(tmp_path, backend):
    """``CAPTIONER_PRECISION=bfloat16`` is PyTorch's autocast: whatever backend is asked for, the model runs on
    PyTorch in that precision, and nothing is exported for it: so no preparing child is started for it either (it
    would export, at every start, graphs nothing loads)."""
    save_tiny_sats(tmp_path / "weights", ["a"])
    assert still_to_prepare(tmp_path, default_backend=backend, precision="bfloat16") == []
    loaded = load_on_cpu(tmp_path, backend, precision="bfloat16")
    assert (loaded["a"].backend, loaded["a"].precision) == ("torch", "bfloat16")
    assert not (tmp_path / "onnx").exists()


@pytest.mark.parametrize("asked, precision, encoder_precision, served, warned", [
    ("auto", "bfloat16", "float32", "torch", None),  # the default backend: nothing was asked that cannot apply
    ("torch", "float16", "float32", "torch", None),
    ("onnx", "bfloat16", "float32", "torch", "precision bfloat16 runs on PyTorch (the onnx backend is float32 only)"),
    ("torch", "float32", "int8", "torch",
     "encoder precision int8 applies to the ONNX Runtime CNN; the torch backend keeps float32"),
    ("onnx", "float32", "int8", "onnx", None),
    ("auto", "float32", "int8", "auto", None)])
def test_a_backend_setting_that_cannot_apply_is_said_and_only_then(caplog, asked, precision, encoder_precision,
                                                                   served, warned):
    """``chosen_backend``: an autocast precision serves PyTorch, and a setting that cannot apply (an ONNX backend
    asked with autocast, an int8 CNN on the torch backend, which has no ONNX CNN) is one warning naming the model;
    a default left alone or a setting that applies is not warned about."""
    with caplog.at_level(logging.INFO, logger="captioner.runtime"):
        assert backend_choice.chosen_backend("m", asked, precision, encoder_precision) == served
    assert caplog.messages == ([f"m: {warned}"] if warned else [])


def test_auto_backend_serves_onnx_where_verified_and_the_hybrid_where_the_decoder_cannot_be_exported(tmp_path):
    """The default backend: a tiny SAT runs wholly on ONNX Runtime, a tiny SparseCap-TVmax (no exportable step)
    gets the hybrid (ONNX Runtime CNN, PyTorch decoder), and both answer exactly like PyTorch over HTTP."""
    for name, arch, config in (("sat", "sat", {}), ("tvmax", "sparsecap", {"attention": "tvmax"})):
        ckpt = tiny_checkpoint(arch, **config)
        save_checkpoint(tmp_path / "weights" / name, ckpt.model, ckpt.vocab, ckpt.encoder)
    common = dict(weights_dir=tmp_path / "weights", default_model="sat", onnx_dir=tmp_path / "onnx", device="cpu",
                  threads=1, warmup=False)
    image = random_images(1, seed=9)[0]
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    answers = {}
    for backend in ("auto", "torch"):
        with TestClient(create_app(Settings(backend=backend, **common))) as client:
            models = {m["name"]: m["backend"] for m in client.get("/models").json()}
            assert models == ({"sat": "onnx", "tvmax": "hybrid"} if backend == "auto" else
                              {"sat": "torch", "tvmax": "torch"})
            for name in models:
                response = client.post("/caption", params={"model": name}, content=buffer.getvalue(),
                                       headers={"content-type": "image/png"})
                assert response.status_code == 200, response.text
                answers[backend, name] = response.json()
    # the next start has nothing to make: a decoder that cannot be exported has no folder, and needs none
    assert still_to_prepare(tmp_path) == []
    for name in ("sat", "tvmax"):
        assert answers["auto", name]["caption"] == answers["torch", name]["caption"]
        np.testing.assert_allclose(answers["auto", name]["attention"], answers["torch", name]["attention"],
                                   atol=ATOL_ATTENTION)


def test_auto_backend_refuses_a_backend_whose_captions_differ(tmp_path, monkeypatch):
    """A backend whose captions disagree with PyTorch's on the check set is not used (here ONNX Runtime's step is
    made to return wrong log-probs): the next candidate, the hybrid, is verified and chosen instead."""
    ckpt = tiny_checkpoint("sat")
    step = OnnxRuntime.step

    def wrong_step(self, prev, state, enc):
        logprobs, new_state, attn = step(self, prev, state, enc)
        return logprobs.flip(-1), new_state, attn

    monkeypatch.setattr(OnnxRuntime, "step", wrong_step)
    chosen = fastest_verified("sat", ckpt, SharedEncoders(CPU, tmp_path / "onnx", 1), 1)
    assert chosen.backend == "hybrid"


@pytest.mark.parametrize("fastest", ["onnx", "hybrid", "torch"])
def test_auto_on_a_gpu_serves_the_fastest_verified_backend(tmp_path, monkeypatch, caplog, fastest):
    """Where the order is not known in advance (a GPU: ``measure``), every backend whose captions equal PyTorch's
    is timed on the check set beside PyTorch, and the fastest serves, as the log says with every backend's time;
    only ONNX Runtime alone drops the PyTorch weights.  The timings are made up (a CPU here): what is tested is the
    choice made from them."""
    timed = []

    def made_up_seconds(runtime, prepared, repeats=2):
        timed.append(runtime.backend)
        return 0.1 if runtime.backend == fastest else 1.0

    monkeypatch.setattr(backend_choice, "check_seconds", made_up_seconds)
    encoders = SharedEncoders(CPU, tmp_path / "onnx", 1)
    with caplog.at_level(logging.INFO, logger="captioner.runtime"):
        chosen = backend_choice.fastest_verified("sat", tiny_checkpoint("sat"), encoders, 1, measure=True)
    assert chosen.backend == fastest and sorted(timed) == ["hybrid", "onnx", "torch"]
    times = ", ".join(f"{backend} {100 if backend == fastest else 1000} ms" for backend in ("onnx", "hybrid", "torch"))
    assert f"sat: {fastest} backend, the fastest on the check set ({times})" in caplog.messages
    on_meta = next(chosen.ckpt.model.parameters()).device.type == "meta"
    assert on_meta == (fastest == "onnx")
    assert chosen.caption([Prepared(*preprocess(image, chosen.spec)) for image in backend_choice.check_images(1)],
                          beam_size=2, max_len=5)[0].words


def test_a_backends_time_on_the_check_set_is_its_best_timed_run_between_device_synchronisations(monkeypatch):
    """What ``auto`` on a GPU compares: the seconds a runtime takes to caption the check set, the best of its timed
    runs, each timed between device synchronisations (a GPU runs its kernels after the call has returned).  A made-up
    clock: the runs take 2 s, then 1.5 s."""
    clock, events = [0.0], []

    class Timed:
        def synchronize(self):
            events.append("synchronize")

        def caption(self, prepared, beam_size, max_len):
            events.append("caption")
            clock[0] += 2.0 if events.count("caption") == 1 else 1.5
            return []

    monkeypatch.setattr(backend_choice, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    assert backend_choice.check_seconds(Timed(), [], repeats=2) == 1.5
    assert events == ["synchronize", "caption", "synchronize"] * 2


def test_onnx_runtime_picks_cuda_only_when_the_device_is_cuda(shipped):
    ckpt, _, onnx_dir, _, _ = shipped
    runtime = OnnxRuntime("sat", ckpt, onnx_dir / "sat", CPU, threads=1)
    assert runtime.providers == ["CPUExecutionProvider"] and not runtime.on_gpu
    if torch.cuda.is_available() and "CUDAExecutionProvider" in ort.get_available_providers():
        gpu = OnnxRuntime("sat", load_checkpoint(DEFAULT_CHECKPOINT, "cuda"), onnx_dir / "sat",
                               torch.device("cuda"))
        assert gpu.providers[0] == "CUDAExecutionProvider" and gpu.on_gpu


def test_onnx_runtime_sessions_neither_spin_nor_keep_an_arena(shipped):
    """Every session the project opens (the service's CNN, heads and steps, eval's CNN, the export's check) has
    idle intra-op threads sleep: spinning, ONNX Runtime's default, made a caption four times slower on two busy
    cores and halved the throughput at 8 clients (docs/decisions.md#onnx-runtime-threads-that-do-not-spin)."""
    ckpt, _, onnx_dir, _, _ = shipped
    runtime = OnnxRuntime("sat", ckpt, onnx_dir / "sat", CPU, threads=1)
    for options in (session_options(), session_options(2, quiet=True), runtime.step_session.get_session_options(),
                    runtime.encoder_session.get_session_options()):
        assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
        assert not options.enable_cpu_mem_arena
    # each of the runtime's sessions with the threads it was given (not one per core beside the others' pools)
    assert [session.get_session_options().intra_op_num_threads
            for session in (runtime.encoder_session, runtime.step_session)] == [1, 1]


def test_session_options_take_the_threads_every_optimisation_and_a_quieter_log_on_request(tmp_path):
    loud, quiet = session_options(), session_options(3, quiet=True)
    assert (loud.log_severity_level, quiet.log_severity_level) == (3, 4)
    assert (loud.intra_op_num_threads, quiet.intra_op_num_threads) == (0, 3)  # 0: ONNX Runtime's one per core
    assert loud.graph_optimization_level == quiet.graph_optimization_level == \
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opened = sessions.open_session(_two_outputs_graph(tmp_path), CPU, threads=2, quiet=True).get_session_options()
    assert (opened.log_severity_level, opened.intra_op_num_threads) == (4, 2)


def test_a_session_opened_without_quiet_logs_onnx_runtimes_errors(tmp_path):
    """The service's and eval's sessions (``VisualSession`` and the runtime's, opened without ``quiet``) log ONNX
    Runtime's errors (severity 3); only the export's own check, which reports a failure itself, asks for less."""
    opened = sessions.open_session(_two_outputs_graph(tmp_path), CPU, threads=1).get_session_options()
    assert opened.log_severity_level == 3


def _two_outputs_graph(tmp_path) -> Path:
    """An ONNX graph of ``x`` → ``same`` (x) and ``negated`` (−x)."""
    tensor = functools.partial(onnx.helper.make_tensor_value_info, elem_type=onnx.TensorProto.FLOAT, shape=[2])
    graph = onnx.helper.make_graph([onnx.helper.make_node("Identity", ["x"], ["same"]),
                                    onnx.helper.make_node("Neg", ["x"], ["negated"])], "two",
                                   [tensor("x")], [tensor("same"), tensor("negated")])
    path = tmp_path / "two.onnx"
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=9)
    onnx.save(model, str(path))  # IR 9: what ONNX Runtime reads, whichever onnx package wrote it
    return path


def test_a_session_on_the_cpu_answers_the_outputs_asked_for_in_their_order(tmp_path):
    session = sessions.open_session(_two_outputs_graph(tmp_path), CPU, threads=1)
    x = torch.tensor([1.0, -2.0])
    negated, same = sessions.run_session(session, {"x": x}, ["negated", "same"], CPU, on_gpu=False)
    assert negated.tolist() == [-1.0, 2.0] and same.tolist() == [1.0, -2.0]


@pytest.mark.parametrize("requires_grad", [False, True])
def test_a_session_on_the_cpu_reads_a_strided_view_or_a_tensor_that_needs_gradients_by_its_values(requires_grad,
                                                                                                   tmp_path):
    """Callers hand over what PyTorch gives them: a column of a batch is a strided view (its values are not the
    next ones in memory), and a tensor may carry gradients (``.numpy()`` refuses it)."""
    session = sessions.open_session(_two_outputs_graph(tmp_path), CPU, threads=1)
    batch = torch.tensor([[1.0, 5.0], [-2.0, 6.0]], requires_grad=requires_grad)
    column = batch[:, 0]  # [1, -2], every other float of the batch's memory
    (same,) = sessions.run_session(session, {"x": column}, ["same"], CPU, on_gpu=False)
    assert same.tolist() == [1.0, -2.0]


def test_a_cuda_device_asks_for_its_own_gpu_then_the_cpu_and_counts_as_on_it_only_where_cuda_loaded(monkeypatch):
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert sessions.execution_providers(torch.device("cuda:1")) == [
        ("CUDAExecutionProvider", {"device_id": 1}), "CPUExecutionProvider"]
    assert sessions.execution_providers(torch.device("cuda"))[0] == ("CUDAExecutionProvider", {"device_id": 0})
    assert sessions.execution_providers(CPU) == ["CPUExecutionProvider"]
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CPUExecutionProvider"])
    assert sessions.execution_providers(torch.device("cuda:1")) == ["CPUExecutionProvider"]
    # a session whose CUDA provider failed to load runs on the CPU: its tensors are not bound on the GPU
    loaded = types.SimpleNamespace(get_providers=lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    fell_back = types.SimpleNamespace(get_providers=lambda: ["CPUExecutionProvider"])
    assert sessions.runs_on_gpu(loaded, torch.device("cuda:1"))
    assert not sessions.runs_on_gpu(fell_back, torch.device("cuda:1")) and not sessions.runs_on_gpu(loaded, CPU)
    # and a session is opened asking for those providers, not for every one this ONNX Runtime has (TensorRT first)
    opened = {}
    monkeypatch.setattr(ort, "InferenceSession", lambda path, options, providers: opened.update(providers=providers))
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    sessions.open_session("graph.onnx", torch.device("cuda:1"))
    assert opened["providers"] == [("CUDAExecutionProvider", {"device_id": 1}), "CPUExecutionProvider"]


def test_a_hybrid_runtime_is_where_its_cnn_session_runs_and_names_that_sessions_providers():
    """``auto`` on a GPU refuses a backend that is not on it: the hybrid is on the GPU exactly when its CNN session
    is (its decoder follows the device), and ``/models`` names that session's providers."""
    visual = types.SimpleNamespace(providers=["CUDAExecutionProvider", "CPUExecutionProvider"], on_gpu=True)
    hybrid = onnx_backends.HybridRuntime("sat", tiny_checkpoint("sat"), visual, CPU)
    assert hybrid.on_gpu is True
    assert hybrid.providers == hybrid.info().providers == ["CUDAExecutionProvider", "CPUExecutionProvider"]
    visual.on_gpu = False
    assert hybrid.on_gpu is False


def test_a_hybrid_on_a_gpu_whose_cnn_runs_on_the_cpu_hands_it_host_pixels_and_its_decoder_device_features():
    """A GPU server whose ONNX Runtime has no CUDA provider (the meta device stands in for the GPU): the hybrid's CNN
    session runs on the CPU, so it is handed the batch as it is in host memory (GPU tensors would not run there, and
    a GPU runtime's padding rows would be convolved for nothing), and its features are moved to the decoder's device
    (host features would meet GPU weights in the first layer)."""
    handed = []

    def features(pixels):
        handed.append((pixels.device.type, len(pixels)))
        return torch.zeros(len(pixels), 8, 2, 2)

    visual = types.SimpleNamespace(providers=["CPUExecutionProvider"], on_gpu=False, features=features)
    hybrid = onnx_backends.HybridRuntime("sat", tiny_checkpoint("sat"), visual, torch.device("meta"))
    hybrid.pad_batches = True  # as on a GPU
    prepared = [Prepared(torch.zeros(3, 8, 8), (8, 8)) for _ in range(3)]
    grid = hybrid.grid_features(prepared)
    assert (grid.device.type, len(grid)) == ("meta", 3) and handed == [("cpu", 3)]


def test_a_hybrid_decodes_on_the_servers_device_whatever_its_cnn_session_runs_on(monkeypatch):
    """``CAPTIONER_BACKEND=hybrid`` on a GPU server: the hybrid's decoder runs on the device its checkpoint was loaded
    on, the server's (the meta device stands in for the GPU), not on the CPU its CNN session may run on: PyTorch
    weights on the GPU fed from a runtime placed on the CPU fail at the first caption, and a decoder moved to the CPU
    gives up the GPU the backend was chosen for."""
    made = []
    monkeypatch.setattr(runtime_module, "HybridRuntime", lambda name, ckpt, visual, device: made.append(device))
    encoders = types.SimpleNamespace(device=torch.device("meta"), onnx=lambda spec: "visual session")
    runtime_module._on_onnx_runtime("sat", types.SimpleNamespace(encoder=TINY_SPEC), "hybrid", encoders, 1)
    assert made == [torch.device("meta")]


def test_the_cuda_provider_is_seen_where_onnx_runtime_offers_it():
    """``auto`` asks whether ONNX Runtime offers CUDA before timing it on a GPU: the question compared the provider
    entry (name, options) with a name, so the answer was always no and every GPU served PyTorch."""
    assert cuda_provider_available(torch.device("cuda")) == ("CUDAExecutionProvider" in ort.get_available_providers())
    assert not cuda_provider_available(CPU)


def test_the_cuda_provider_is_seen_on_any_cuda_device_where_onnx_runtime_offers_it(monkeypatch):
    """The same question where ONNX Runtime offers CUDA (a CPU machine's package does not): the provider asked for
    first is CUDA's, named in its (name, options) entry, on an indexed device too."""
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert cuda_provider_available(torch.device("cuda")) and cuda_provider_available(torch.device("cuda:1"))
    assert not cuda_provider_available(CPU)


def test_a_visual_session_names_its_sessions_providers_and_is_on_the_gpu_only_where_cuda_loaded(monkeypatch):
    """A CNN session on a CUDA device whose CUDA provider failed to load (cuDNN missing) runs on the CPU: it says so
    (its providers, ``on_gpu``), so its pixels are not bound on the GPU, and it runs on the threads it was given."""
    opened = []

    def loading(providers_loaded):
        def open_session(path, options, providers):
            opened.append((path, options.intra_op_num_threads, providers))
            return types.SimpleNamespace(get_providers=lambda: providers_loaded)
        return open_session

    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    monkeypatch.setattr(ort, "InferenceSession", loading(["CUDAExecutionProvider", "CPUExecutionProvider"]))
    loaded = sessions.VisualSession(Path("visual.onnx"), "cuda:1", threads=2)
    assert loaded.device == torch.device("cuda:1") and loaded.on_gpu
    assert loaded.providers == ["CUDAExecutionProvider", "CPUExecutionProvider"]
    monkeypatch.setattr(ort, "InferenceSession", loading(["CPUExecutionProvider"]))
    fell_back = sessions.VisualSession(Path("visual.onnx"), "cuda:1", threads=2)
    assert not fell_back.on_gpu and fell_back.providers == ["CPUExecutionProvider"]
    assert opened == [("visual.onnx", 2, [("CUDAExecutionProvider", {"device_id": 1}), "CPUExecutionProvider"])] * 2


def recording_session(events: list, outputs: list | None = None, run=lambda binding: None) -> types.SimpleNamespace:
    """An ONNX Runtime session stood in for on a machine without a GPU: its I/O binding records each input bound
    (``("input", name, device type, device id, dtype, shape, address)``) and each output into ``events``, and gives
    back ``outputs``; ``run`` is called in place of the session's run."""

    class Binding:
        def bind_input(self, name, device_type, device_id, dtype, shape, pointer):
            events.append(("input", name, device_type, device_id, dtype, shape, pointer))

        def bind_output(self, name, device_type, device_id):
            events.append(("output", name, device_type, device_id))

        def get_outputs(self):
            return list(outputs or [])

    return types.SimpleNamespace(io_binding=Binding, run_with_iobinding=run)


@pytest.mark.parametrize("device, index", [("cuda:1", 1), ("cuda", 0)])
def test_a_session_on_the_gpu_binds_contiguous_copies_after_draining_pytorchs_stream(device, index, monkeypatch):
    """The I/O binding path, on a CPU machine with a session and a stream that record what they are asked: PyTorch's
    stream is drained before anything is bound, each input is bound on the device's GPU as a contiguous copy of its
    own dtype (a transposed one by its copy's address, which still holds the transposed values when the session
    runs), every output asked for is bound there, and the bound outputs come back as torch tensors."""
    events = []

    def run(binding):
        bound = [event[-1] for event in events if event[:2] == ("input", "pixels")]
        assert bound, "the session ran before its pixels were bound"  # no address to read the copy at
        copy = (ctypes.c_char * 12).from_address(bound[0])  # the bound copy of the 3 × 2 float16 pixels
        events.append(("run", np.frombuffer(bytes(copy), dtype=np.float16).tolist()))

    drained = types.SimpleNamespace(synchronize=lambda: events.append(("synchronize",)))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda on: drained if on == torch.device(device) else None)
    session = recording_session(events, [torch.tensor([0.5]), torch.tensor([2, 3])], run)
    pixels = torch.arange(6, dtype=torch.float16).reshape(2, 3).t()  # not contiguous
    ids = torch.tensor([4, 5])
    scores, words = sessions.run_session(session, {"pixels": pixels, "ids": ids}, ["scores", "words"],
                                         torch.device(device), on_gpu=True)
    assert scores.tolist() == [0.5] and words.tolist() == [2, 3]
    assert len(events) == 6 and events[1][-1] != pixels.data_ptr()
    assert events == [("synchronize",),
                      ("input", "pixels", "cuda", index, np.float16, (3, 2), events[1][-1]),
                      ("input", "ids", "cuda", index, np.int64, (2,), ids.data_ptr()),
                      ("output", "scores", "cuda", index), ("output", "words", "cuda", index),
                      ("run", pixels.flatten().tolist())]


def test_a_session_on_the_gpu_binds_a_step_graphs_float32_and_boolean_inputs_as_their_own_dtypes(monkeypatch):
    """Every step graph takes float32 states and the encoder's boolean mask (``enc.mask``) beside its int64 words:
    ONNX Runtime reads each bound buffer as the dtype it is bound as, so a float32 or boolean input bound as another
    (half floats, bytes) failed a GPU server's every caption on a type its graph does not take."""
    events = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda on: types.SimpleNamespace(synchronize=lambda: None))
    session = recording_session(events)
    feats, mask, words = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool), torch.tensor([1, 2])
    inputs = {"enc.feats": feats, "enc.mask": mask, "prev_tokens": words}
    sessions.run_session(session, inputs, [], torch.device("cuda"), on_gpu=True)
    bound = {event[1]: event[4] for event in events if event[0] == "input"}
    assert bound == {"enc.feats": np.float32, "enc.mask": np.bool_, "prev_tokens": np.int64}


def test_auto_on_a_gpu_without_onnx_runtimes_cuda_provider_serves_pytorch(monkeypatch, tmp_path):
    """On a CUDA device, ONNX Runtime without its CUDA provider would run the CNN on the CPU beside an idle GPU:
    ``auto`` serves PyTorch on the GPU instead, without exporting anything."""
    monkeypatch.setattr(sessions, "execution_providers", lambda device: ["CPUExecutionProvider"])
    encoders = SharedEncoders(torch.device("cuda"), tmp_path / "onnx", 1, "float32")
    gpu_encoder = object()  # stands for the PyTorch CNN on the GPU: nothing here may run on a device this CPU lacks
    monkeypatch.setattr(encoders, "pytorch", lambda spec: gpu_encoder)
    chosen = fastest_verified("sat", tiny_checkpoint("sat"), encoders, threads=1)
    assert chosen.backend == "torch" and chosen.encoder is gpu_encoder
    assert not (tmp_path / "onnx").exists()


@pytest.mark.parametrize("device, timed", [("cuda", ["onnx", "hybrid"]), ("cpu", None)])
def test_auto_times_the_verified_backends_by_default_on_a_gpu_only(monkeypatch, tmp_path, device, timed):
    """``measure`` defaults to the device: on a GPU every verified backend is timed against PyTorch (no order is
    known there in advance), on a CPU the first verified one serves untimed (the measured order).  The backends are
    stand-ins, verified by construction: what is tested is which choice the device leads to."""
    class Made:
        def __init__(self, backend):
            self.backend = backend

    compared = []

    def fastest(name, verified, pytorch, prepared):
        compared.append([runtime.backend for runtime in verified])
        return pytorch

    encoders = SharedEncoders(torch.device(device), tmp_path / "onnx", 1, "float32")
    monkeypatch.setattr(encoders, "pytorch", lambda spec: object())  # no CNN on a device this CPU may lack
    monkeypatch.setattr(backend_choice, "cuda_provider_available", lambda device: True)
    monkeypatch.setattr(backend_choice, "_wanted_captions", lambda *args: [])
    monkeypatch.setattr(backend_choice, "_verified", lambda name, backend, *args: Made(backend))
    monkeypatch.setattr(backend_choice, "TorchRuntime", lambda *args: Made("torch"))
    monkeypatch.setattr(backend_choice, "_fastest", fastest)
    monkeypatch.setattr(backend_choice, "drop_torch_weights", lambda runtime: None)
    chosen = fastest_verified("sat", tiny_checkpoint("sat"), encoders, threads=1)
    assert compared == ([timed] if timed else [])
    assert chosen.backend == ("torch" if timed else "onnx")


def test_a_backend_made_for_a_gpu_whose_sessions_fell_back_to_the_cpu_is_not_verified(caplog):
    """A CUDA device whose ONNX Runtime CUDA provider failed to load (cuDNN missing) leaves the sessions on the CPU:
    such a backend is given up with a warning that says so, even where its captions agree; on a CPU device the same
    runtime is what was asked for.  A stand-in runtime: no GPU is needed to hold the choice."""
    class Sessions:
        on_gpu = False

        def caption(self, prepared, beam_size, max_len):
            return []

    made = Sessions()
    with caplog.at_level(logging.INFO, logger="captioner.runtime"):
        assert backend_choice._verified("sat", "onnx", lambda: made, torch.device("cuda"), [], []) is None
    assert caplog.messages == ["sat: ONNX Runtime fell back to its CPU provider; no onnx backend"]
    assert backend_choice._verified("sat", "onnx", lambda: made, CPU, [], []) is made


def test_auto_with_no_backend_verified_serves_pytorch_without_timing_it(monkeypatch, tmp_path):
    """Nothing to compare PyTorch with: it serves at once, not after captioning the check set three more times to be
    logged as the fastest of one."""
    timed = []

    def seconds(runtime, prepared, repeats=2):
        timed.append(runtime.backend)
        return 1.0

    monkeypatch.setattr(backend_choice, "_wanted_captions", lambda *args: [])
    monkeypatch.setattr(backend_choice, "_verified", lambda *args: None)
    monkeypatch.setattr(backend_choice, "check_seconds", seconds)
    monkeypatch.setattr(backend_choice, "check_captions", lambda runtime, prepared: timed.append("untimed") or [])
    chosen = fastest_verified("sat", tiny_checkpoint("sat"), SharedEncoders(CPU, tmp_path / "onnx", 1), 1,
                              measure=True)
    assert chosen.backend == "torch" and timed == []


def test_onnx_backend_on_a_gpu_without_onnx_runtimes_cuda_provider_serves_pytorch(shipped, monkeypatch, tmp_path,
                                                                                   caplog):
    """``CAPTIONER_BACKEND=onnx`` on a CUDA device where ONNX Runtime has no CUDA provider: a whole-model ONNX
    runtime would be handed GPU tensors by the batcher, so it refuses to be made, and the loader serves the model
    with PyTorch on that device, saying why in the log."""
    ckpt, _, onnx_dir, _, _ = shipped
    monkeypatch.setattr(sessions, "execution_providers", lambda device: ["CPUExecutionProvider"])
    with pytest.raises(onnx_backends.NoCudaProvider, match="onnxruntime-gpu"):
        OnnxRuntime("sat", ckpt, onnx_dir / "sat", torch.device("cuda"), threads=1)
    # where the CUDA provider did load, the same runtime is made (its sessions here are the CPU's, never run)
    monkeypatch.setattr(onnx_backends, "runs_on_gpu", lambda session, device: True)
    assert OnnxRuntime("sat", ckpt, onnx_dir / "sat", torch.device("cuda"), threads=1).on_gpu

    made = []

    def no_cuda_provider(*args, **kwargs):
        made.append(args[0])
        raise onnx_backends.NoCudaProvider("ONNX Runtime has no working CUDA execution provider here")

    monkeypatch.setattr(runtime_module, "OnnxRuntime", no_cuda_provider)
    tiny = tiny_checkpoint("sat")
    save_checkpoint(tmp_path / "weights" / "tiny", tiny.model, tiny.vocab, tiny.encoder)
    with caplog.at_level("ERROR", logger="captioner.runtime"):
        runtimes = load_on_cpu(tmp_path, "onnx")
    assert made == ["tiny"] and runtimes["tiny"].backend == "torch"
    assert "no working CUDA execution provider" in caplog.text


def test_models_share_one_cnn_and_a_later_start_builds_no_pytorch_encoder(tmp_path, monkeypatch):
    """Two models of one encoder spec on ``auto``: one ONNX Runtime session of the CNN serves both, neither keeps
    PyTorch weights, and they caption exactly like PyTorch.  A second start, with the exports and the check set's
    reference captions recorded by the first, never builds a PyTorch encoder."""
    # "reference": the folder name the check set's records took beside the exports, where a checkpoint of that
    # name could then never be exported (the ONNX audit)
    for name, seed in (("a", 0), ("reference", 1)):
        ckpt = tiny_checkpoint("sat", seed=seed)
        save_checkpoint(tmp_path / "weights" / name, ckpt.model, ckpt.vocab, ckpt.encoder)

    def own_cnn(*args, **kwargs):
        raise AssertionError("an export built a PyTorch CNN of its own beside the shared one")

    monkeypatch.setattr(exporter, "GridEncoder", own_cnn)  # the first start's exports trace the shared CNN
    first = load_on_cpu(tmp_path, "auto")
    assert {r.backend for r in first.values()} == {"onnx"}
    assert first["a"].visual is first["reference"].visual
    assert all(p.is_meta for r in first.values() for p in r.ckpt.model.parameters())
    prepared = [first["a"].prepare(image) for image in random_images(3, seed=3)]
    for name, runtime in first.items():
        want = torch_runtime_of(tmp_path / "weights" / name).caption(prepared, 2, 6)
        for got, expected in zip(runtime.caption(prepared, 2, 6), want):
            assert_same_result(got, expected, atol_attention=ATOL_ATTENTION, atol_logprob=ATOL_LOGPROB)
    assert runtime.info().parameters == sum(p.numel() for p in tiny_checkpoint("sat").model.parameters())

    def no_pytorch_encoder(*args, **kwargs):
        raise AssertionError("a later start built a PyTorch encoder")

    monkeypatch.setattr(shared_encoders, "grid_encoder", no_pytorch_encoder)
    later = load_on_cpu(tmp_path, "auto")
    assert {r.backend for r in later.values()} == {"onnx"}


def test_a_model_shares_the_cnn_of_its_own_encoder_spec_never_another_specs(tmp_path):
    """Models of one encoder spec share one CNN, on ONNX Runtime and on PyTorch alike; a model of another spec (here
    a larger input) gets its own: a CNN shared across specs would encode its images at the other spec's size."""
    larger = dataclasses.replace(TINY_SPEC, image_size=128)
    for name, seed, spec in (("a", 0, TINY_SPEC), ("b", 1, TINY_SPEC), ("c", 2, larger)):
        ckpt = tiny_checkpoint("sat", seed=seed)
        save_checkpoint(tmp_path / "weights" / name, ckpt.model, ckpt.vocab, spec)
    on_onnx = load_on_cpu(tmp_path, "auto")
    assert {r.backend for r in on_onnx.values()} == {"onnx"}
    assert on_onnx["a"].visual is on_onnx["b"].visual and on_onnx["c"].visual is not on_onnx["a"].visual
    on_torch = load_on_cpu(tmp_path, "torch")
    assert on_torch["a"].encoder is on_torch["b"].encoder and on_torch["c"].encoder is not on_torch["a"].encoder
    assert on_torch["c"].encoder.spec == larger


def test_the_shared_onnx_cnn_is_made_in_its_precision_and_threads_and_the_exporter_gets_no_gpu_module(tmp_path,
                                                                                                     monkeypatch):
    """The ONNX CNN's file is the one of CAPTIONER_ENCODER_PRECISION (int8: the quantized graph) and its session
    takes CAPTIONER_THREADS; on a GPU the exporter, which traces on the CPU, is handed no PyTorch CNN (it builds its
    own), and none is built for it."""
    made, built = [], []
    monkeypatch.setattr(quantize, "visual_encoder_file", lambda spec, folder, precision, encoder: (
        made.append((folder, precision)) or tmp_path / "visual.onnx"))
    monkeypatch.setattr(shared_encoders, "VisualSession", lambda path, device, threads: ("session", path, threads))
    monkeypatch.setattr(shared_encoders, "grid_encoder", lambda spec, device: built.append(device))
    encoders = SharedEncoders(CPU, tmp_path / "onnx", 3, "int8")
    assert encoders.onnx(TINY_SPEC) == ("session", tmp_path / "visual.onnx", 3)
    assert made == [(tmp_path / "onnx", "int8")]
    assert SharedEncoders(torch.device("cuda"), tmp_path / "onnx", 1).for_export(TINY_SPEC) is None and built == []


@pytest.mark.parametrize("device", ["cuda", "mps"])
def test_on_an_accelerator_the_onnx_cnns_export_is_handed_no_pytorch_module_and_none_is_built(tmp_path, monkeypatch,
                                                                                                device):
    """The exporter traces on the CPU: on any device but the CPU (a GPU, Apple's MPS) the ``visual.onnx`` that is
    missing is exported from a CNN the exporter builds there itself, never from the server's own module on the
    device (which would also be built for nothing)."""
    handed, built = [], []
    monkeypatch.setattr(quantize, "visual_encoder_file", lambda spec, folder, precision, encoder: (
        handed.append(encoder()) or tmp_path / "visual.onnx"))
    monkeypatch.setattr(shared_encoders, "VisualSession", lambda path, device, threads: ("session", path, threads))
    monkeypatch.setattr(shared_encoders, "grid_encoder", lambda spec, device: built.append(device))
    SharedEncoders(torch.device(device), tmp_path / "onnx", 1).onnx(TINY_SPEC)
    assert handed == [None] and built == []


def test_a_reference_recorded_under_another_torch_device_or_check_set_is_computed_again(tmp_path, monkeypatch):
    """The check set's recorded PyTorch captions hold only for the torch version, device type and check images they
    were taken with: a stale record (here wrong captions under an older torch) is not what backends are verified
    against, a check set changed since (one image of it, here) is captioned again, and a record taken on the CPU is
    not reused on a GPU, whose PyTorch may caption otherwise."""
    save_tiny_sats(tmp_path / "weights", ["a"])
    assert load_on_cpu(tmp_path, "auto")["a"].backend == "onnx"
    (record,) = (tmp_path / "onnx" / ".reference").glob("*.json")
    current = json.loads(record.read_text())
    stale = {"key": {**current["key"], "torch": "1.0.0"}, "token_ids": [[1, 2]] * len(current["token_ids"])}
    record.write_text(json.dumps(stale))
    assert load_on_cpu(tmp_path, "auto")["a"].backend == "onnx"
    assert json.loads(record.read_text()) == current
    images = backend_choice.check_images()
    monkeypatch.setattr(backend_choice, "check_images",
                        lambda: [*images[:-1], images[-1].transpose(Image.Transpose.FLIP_LEFT_RIGHT)])
    load_on_cpu(tmp_path, "auto")
    assert json.loads(record.read_text())["key"]["images"] != current["key"]["images"]

    ckpt = load_checkpoint(tmp_path / "weights" / "a")
    on_gpu = SharedEncoders(torch.device("cuda"), tmp_path / "onnx", 1)

    def computed(spec):  # stands for the PyTorch CNN on the GPU, which this CPU may lack
        raise LookupError("computed again")

    monkeypatch.setattr(on_gpu, "pytorch", computed)
    prepared = [Prepared.of(image, ckpt.encoder) for image in backend_choice.check_images()]
    with pytest.raises(LookupError, match="computed again"):
        backend_choice.reference_captions("a", ckpt, on_gpu, prepared)


def test_a_backends_time_is_the_best_of_two_timed_runs_unless_asked_otherwise(monkeypatch):
    """``_fastest`` calls ``check_seconds`` without ``repeats``: its default is the "best of two" docs/decisions.md
    states, so that one slow run (a collection, a kernel chosen on first use) does not pick the backend."""
    clock, captions = [0.0], []

    class Timed:
        def synchronize(self):
            pass

        def caption(self, prepared, beam_size, max_len):
            captions.append(len(captions))
            clock[0] += 2.0 if len(captions) == 1 else 1.5
            return []

    monkeypatch.setattr(backend_choice, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    assert backend_choice.check_seconds(Timed(), []) == 1.5 and len(captions) == 2


def test_a_backends_time_is_its_faster_run_even_when_that_was_the_first(monkeypatch):
    """The best of two (docs/decisions.md) is the faster run wherever it fell: a second run slowed by a collection or
    another process on the machine must not stand for the backend, or a fast backend loses ``auto``'s choice on a GPU
    to one that merely had no hiccup.  A made-up clock: the runs take 1 s, then 3 s."""
    clock, durations = [0.0], iter([1.0, 3.0])

    class Timed:
        def synchronize(self):
            pass

        def caption(self, prepared, beam_size, max_len):
            clock[0] += next(durations)
            return []

    monkeypatch.setattr(backend_choice, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    assert backend_choice.check_seconds(Timed(), [], repeats=2) == 1.0


def test_pytorch_captions_the_check_set_once_untimed_before_the_backends_are_timed(monkeypatch):
    """The verified backends have run the check set once already (their verification), PyTorch not: its first run
    (kernel selection, allocator growth) is made untimed first, so each backend is timed warm."""
    class Made:
        def __init__(self, backend):
            self.backend = backend

    events = []
    seconds = {"onnx": 0.2, "hybrid": 0.3, "torch": 0.1}
    monkeypatch.setattr(backend_choice, "check_captions",
                        lambda runtime, prepared: events.append(("untimed", runtime.backend)) or [])
    monkeypatch.setattr(backend_choice, "check_seconds",
                        lambda runtime, prepared: events.append(("timed", runtime.backend)) or seconds[runtime.backend])
    chosen = backend_choice._fastest("sat", [Made("onnx"), Made("hybrid")], Made("torch"), [])
    assert chosen.backend == "torch"
    assert events == [("untimed", "torch"), ("timed", "onnx"), ("timed", "hybrid"), ("timed", "torch")]


def test_a_reference_recorded_under_another_torch_version_is_computed_again(tmp_path, monkeypatch):
    """The record's key holds the torch version (docs/decisions.md): after an upgrade, whose PyTorch may caption
    otherwise, the older version's captions are no reference.  The record made by a start is read back while the
    version is the same, and is computed again (the PyTorch CNN asked for) once it is another."""
    save_tiny_sats(tmp_path / "weights", ["a"])
    assert load_on_cpu(tmp_path, "auto")["a"].backend == "onnx"
    ckpt = load_checkpoint(tmp_path / "weights" / "a")
    encoders = SharedEncoders(CPU, tmp_path / "onnx", 1)

    def computed(spec):
        raise LookupError("computed again")

    monkeypatch.setattr(encoders, "pytorch", computed)
    prepared = [Prepared.of(image, ckpt.encoder) for image in backend_choice.check_images()]
    assert backend_choice.reference_captions("a", ckpt, encoders, prepared)  # the record, read back
    monkeypatch.setattr(backend_choice.torch, "__version__", "99.0.0")
    with pytest.raises(LookupError, match="computed again"):
        backend_choice.reference_captions("a", ckpt, encoders, prepared)


def test_a_torn_or_foreign_reference_record_is_captioned_again(tmp_path):
    """A record that is not the JSON the cache writes (torn by a disk filling up before writes were atomic, or
    another file under its name) is no reference and no reason to fail the start: the check set is captioned
    again and the record written whole."""
    save_tiny_sats(tmp_path / "weights", ["a"])
    assert load_on_cpu(tmp_path, "auto")["a"].backend == "onnx"
    (record,) = (tmp_path / "onnx" / ".reference").glob("*.json")
    current = json.loads(record.read_text())
    for foreign in (record.read_text()[:25], "[1, 2]", "{}"):
        record.write_text(foreign)
        assert load_on_cpu(tmp_path, "auto")["a"].backend == "onnx"
        assert json.loads(record.read_text()) == current


def test_a_first_start_prepares_in_a_child_process_and_the_server_builds_no_pytorch_encoder(tmp_path, monkeypatch):
    """The first start's exports and reference captions are made by a spawned child (``PreparingChild``), and the
    server loads each model once the child is done with it, while the child prepares the next: each of the server's
    loads is a later start, which builds no PyTorch encoder, and nothing is left unprepared."""
    save_tiny_sats(tmp_path / "weights", ["a", "b"])
    assert still_to_prepare(tmp_path) == ["a", "b"]
    # nothing to make for a model PyTorch serves: by its own backend, or under autocast, which serves every model so
    assert still_to_prepare(tmp_path, backends={"a": "torch"}) == ["b"]
    for autocast in ("bfloat16", "float16"):
        assert still_to_prepare(tmp_path, precision=autocast) == []

    def no_pytorch_encoder(*args, **kwargs):
        raise AssertionError("the server's own load built a PyTorch encoder")

    monkeypatch.setattr(shared_encoders, "grid_encoder", no_pytorch_encoder)  # in the server; the child is spawned
    settings = Settings(weights_dir=tmp_path / "weights", onnx_dir=tmp_path / "onnx", device="cpu", threads=1,
                        default_model="a", warmup=False)
    with TestClient(create_app(settings)) as client:
        assert client.get("/readyz").status_code == 200
        assert {model["name"]: model["backend"] for model in client.get("/models").json()} == \
            {"a": "onnx", "b": "onnx"}
    assert still_to_prepare(tmp_path) == []


def test_a_start_up_that_fails_ends_the_preparing_child_instead_of_waiting_for_it(tmp_path, monkeypatch):
    """The server warms up each model while the child prepares the next: a warm-up that fails ends the start-up at
    once, and the child with it (a server that will not serve has no use for its exports)."""
    # models left for the child to prepare when the first one's warm-up fails
    save_tiny_sats(tmp_path / "weights", ["a", "b", "c", "d"])

    async def failing_warm_up(batcher, settings):
        raise RuntimeError("warm-up failed")

    monkeypatch.setattr(app_module, "warm_up", failing_warm_up)
    settings = Settings(weights_dir=tmp_path / "weights", onnx_dir=tmp_path / "onnx", device="cpu", threads=1,
                        default_model="a")
    with pytest.raises(RuntimeError, match="warm-up failed"), TestClient(create_app(settings)):
        pass
    assert not [child for child in multiprocessing.active_children() if child.name == "captioner-prepare"]


def test_a_preparing_child_stopped_is_ended_not_waited_for(tmp_path):
    """A server stopped during its first start ends the child at once (SIGTERM) rather than waiting for the exports
    it would still make; here the child is still busy in its set-up, and nothing is made."""
    save_tiny_sats(tmp_path / "weights", ["a"])
    child = preparing_child(tmp_path, functools.partial(time.sleep, 30), only=["a"])
    (process,) = [c for c in multiprocessing.active_children() if c.name == "captioner-prepare"]
    child.stop()
    assert process.exitcode == -signal.SIGTERM
    assert still_to_prepare(tmp_path) == ["a"]


def test_every_model_is_reported_after_its_load_or_its_skip(tmp_path):
    """``iter_runtimes`` calls ``before_each`` before and ``after_each`` after every model it is given, a damaged
    one too: the preparing child reports through ``after_each``, and a model it skipped without a word would keep
    the server waiting for it until the child exits."""
    save_tiny_sats(tmp_path / "weights", ["a", "b"])
    (tmp_path / "weights" / "a" / "model.safetensors").write_bytes(b"damaged")
    calls = []
    loaded = dict(runtime_module.iter_runtimes(tmp_path / "weights", [], device_name="cpu", default_backend="torch",
                                               threads=1, before_each=lambda name: calls.append(("before", name)),
                                               after_each=lambda name: calls.append(("after", name))))
    assert set(loaded) == {"b"}
    assert calls == [("before", "a"), ("after", "a"), ("before", "b"), ("after", "b")]


@pytest.mark.parametrize("edit", [lambda config: config.pop("arch"),  # KeyError
                                  lambda config: config.update(encoder="efficientnet_lite0"),  # TypeError
                                  lambda config: config["encoder"].update(image_size="big")],  # ValueError
                         ids=["no-arch", "encoder-not-a-mapping", "image-size-not-a-number"])
def test_a_foreign_checkpoint_the_loader_fails_on_is_skipped_with_its_traceback_and_the_others_start(tmp_path, caplog,
                                                                                                    edit):
    """A config.json the loader was not written for (made by hand or by another tool, its manifest written after)
    fails inside the loader: that checkpoint is skipped, named in the log with the traceback (it may be a bug),
    and the other models start."""
    save_tiny_sats(tmp_path / "weights", ["a", "b"])
    folder = tmp_path / "weights" / "a"
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))
    write_manifest(folder)
    with caplog.at_level(logging.ERROR, logger="captioner.runtime"):
        loaded = load_on_cpu(tmp_path, "torch")
    assert set(loaded) == {"b"}
    (skipped,) = [r for r in caplog.records if r.getMessage().startswith(f"skipping checkpoint {folder}: ")]
    assert skipped.exc_info


@pytest.mark.parametrize(("failure", "traceback"), [
    (CheckpointError("model.safetensors is cut short"), False),  # a damaged folder: its one line says it all
    (OSError(errno.EIO, "Input/output error"), True),
    (RuntimeError("CUDA out of memory"), True),
])
def test_a_checkpoint_that_fails_to_load_is_skipped_and_the_others_start(tmp_path, monkeypatch, caplog, failure,
                                                                         traceback):
    """A disk that fails under one checkpoint, or a device without room for it, costs that model, not the start."""
    save_tiny_sats(tmp_path / "weights", ["a", "b"])
    load = runtime_module.load_checkpoint

    def failing_for_a(path, device):
        if path.name == "a":
            raise failure
        return load(path, device)

    monkeypatch.setattr(runtime_module, "load_checkpoint", failing_for_a)
    with caplog.at_level(logging.ERROR, logger="captioner.runtime"):
        loaded = load_on_cpu(tmp_path, "torch")
    assert set(loaded) == {"b"}
    (skipped,) = [r for r in caplog.records if r.getMessage().startswith("skipping checkpoint")]
    assert skipped.getMessage() == f"skipping checkpoint {tmp_path / 'weights' / 'a'}: {failure}"
    assert bool(skipped.exc_info) == traceback


def test_the_device_setting_places_every_model_even_where_auto_would_pick_the_gpu(tmp_path, monkeypatch):
    """``CAPTIONER_DEVICE=cpu`` on a machine with a GPU (an operator keeping the GPU for something else) serves on the
    CPU: the setting, not ``auto``'s choice, places the models. CUDA is made to look available here, so a model
    placed by ``auto`` would go to a GPU this machine does not have and fail to load."""
    save_tiny_sats(tmp_path / "weights", ["a"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    loaded = load_on_cpu(tmp_path, "torch")
    assert list(loaded) == ["a"] and loaded["a"].device == CPU


@pytest.mark.parametrize(
    "death,code",
    [(functools.partial(os._exit, 3), 3), (functools.partial(signal.raise_signal, signal.SIGKILL), -signal.SIGKILL)],
    ids=["exits-3", "killed"],
)
def test_a_preparing_child_that_dies_leaves_its_models_to_the_server(tmp_path, caplog, death, code):
    """A child that exits without reporting a model (killed, out of memory) does not leave the server waiting for
    it: the wait returns, the failure is logged once, and the server's own load prepares the model. The out-of-memory
    killer's SIGKILL, the likeliest death of a child tracing exports, is an exit code below zero: the warning is the
    operator's only word of why the first start took the server's own time."""
    save_tiny_sats(tmp_path / "weights", ["a"])
    with caplog.at_level("WARNING", logger="captioner.runtime"):
        child = preparing_child(tmp_path, death, only=["a"])
        child.wait_for("a")
        child.wait_for("not-given")  # a model the child was not given is never waited for
        child.join()
    assert [r.getMessage() for r in caplog.records] == [
        f"preparing the ONNX exports in a child process failed (exit code {code}); preparing the rest here"]
    assert still_to_prepare(tmp_path) == ["a"]


def gate_model_b(gate: Path) -> None:
    """A preparing child's ``set_up_logging`` (it runs in the child): the child's load of model ``b`` waits until
    ``gate`` exists (a minute at most), and writes beside it whether it was opened."""
    load = runtime_module.load_checkpoint

    def gated(path, device):
        if path.name == "b":
            for _ in range(600):
                if gate.exists():
                    break
                time.sleep(0.1)
            (gate.parent / "b-gate-opened").write_text(str(gate.exists()))
        return load(path, device)

    runtime_module.load_checkpoint = gated


def test_the_wait_for_a_model_returns_while_the_child_still_prepares_the_next(tmp_path):
    """The wait for a model returns once the child reports it, not once the child exits: here the child holds
    model b until the server, done waiting for a, opens its gate."""
    save_tiny_sats(tmp_path / "weights", ["a", "b"])
    gate = tmp_path / "gate"
    child = preparing_child(tmp_path, functools.partial(gate_model_b, gate), only=["a", "b"])
    child.wait_for("a")
    gate.touch()
    child.wait_for("b")
    child.join()
    assert (tmp_path / "b-gate-opened").read_text() == "True"
    assert still_to_prepare(tmp_path) == []


def hold_until(gate: Path) -> None:
    """A preparing child's ``set_up_logging`` (it runs in the child): the child waits until ``gate`` exists (a minute
    at most), writes beside it whether it was opened, and exits without preparing anything."""
    for _ in range(600):
        if gate.exists():
            break
        time.sleep(0.1)
    (gate.parent / "gate-opened").write_text(str(gate.exists()))
    os._exit(0)


def test_the_wait_for_a_model_the_child_was_not_given_returns_while_the_child_still_works(tmp_path):
    """The server waits for the child only on the models it gave it: a model already prepared loads at once, not
    once the child has done all the others (here the child holds on until the server, done waiting for a, opens
    its gate; a wait for a until the child exits would find the gate still closed a minute later)."""
    save_tiny_sats(tmp_path / "weights", ["a", "b"])
    gate = tmp_path / "gate"
    child = preparing_child(tmp_path, functools.partial(hold_until, gate), only=["b"])
    child.wait_for("a")
    gate.touch()
    child.join()
    assert (tmp_path / "gate-opened").read_text() == "True"


def test_the_preparing_child_logs_as_the_server_does(tmp_path, capfd):
    """The spawned child started with Python's default logging: its progress ("exporting …", minutes on a first
    start) was dropped and its warnings came with their tracebacks as plain lines in the server's JSON log (the
    operator audit). Given the service's format, each of its lines is one JSON record."""
    save_tiny_sats(tmp_path / "weights", ["a"])
    capfd.readouterr()
    preparing_child(tmp_path, functools.partial(configure_logging, "json", "info")).join()
    lines = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]  # a plain line fails here
    assert any(r["logger"] == "captioner.runtime" and r["msg"].startswith("exporting a to ONNX") for r in records)


def test_a_current_export_whose_cnn_graph_is_missing_is_prepared_in_the_child(tmp_path):
    """The model's own export is current but no CNN graph is under its spec's key (an upgrade that changed the key,
    or the folder removed): ``auto`` still has it to prepare, because a current export proves the CNN exports, so
    the missing graph is work for the preparing child, not a CNN the tracer cannot record (which the server's own
    load would then export, building the PyTorch CNN in the serving process)."""
    save_tiny_sats(tmp_path / "weights", ["a"])
    loaded = load_on_cpu(tmp_path, "auto")
    assert loaded["a"].backend == "onnx"
    assert still_to_prepare(tmp_path) == []
    (visual,) = (tmp_path / "onnx").glob("visual-*")
    shutil.rmtree(visual)
    assert export_is_current(tmp_path / "onnx" / "a", load_checkpoint(tmp_path / "weights" / "a").checksum,
                             SERVED_GRAPHS)
    assert still_to_prepare(tmp_path) == ["a"]
    # without a current export of its own either, no CNN graph is a CNN the tracer could not record: served without
    # it, and no child is sent to try again at every start
    shutil.rmtree(tmp_path / "onnx" / "a")
    assert still_to_prepare(tmp_path) == []


def test_the_preparing_child_loads_only_the_models_still_to_prepare(tmp_path, capfd):
    """A model added beside prepared ones: ``unprepared`` names only it, and the child given that name prepares it
    without loading the others (``only``): its log says which it loaded."""
    save_tiny_sats(tmp_path / "weights", ["a", "b"])
    assert set(load_on_cpu(tmp_path, "auto", only=["a"])) == {"a"}
    assert still_to_prepare(tmp_path) == ["b"]
    capfd.readouterr()
    preparing_child(tmp_path, functools.partial(configure_logging, "json", "info"), only=["b"]).join()
    records = [json.loads(line) for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert [r["msg"].split()[1] for r in records if r["msg"].startswith("loaded ")] == ["b"]
    assert still_to_prepare(tmp_path) == []


def test_padded_cnn_batches_caption_exactly_like_unpadded_ones(shipped):
    """On a GPU the CNN runs batches padded to a power of two (``padded_batch``: a new input shape costs cuDNN
    seconds there); the padding rows must not change any caption.  Forced on here, on the CPU."""
    assert [padded_batch(n) for n in (1, 2, 3, 4, 5, 8, 9, 16)] == [1, 2, 4, 4, 8, 8, 16, 16]
    ckpt, visual, onnx_dir, spec, images = shipped
    for runtime in (TorchRuntime("sat", ckpt, visual, CPU), OnnxRuntime("sat", ckpt, onnx_dir / "sat", CPU, threads=1)):
        prepared = [runtime.prepare(image) for image in images[:3]]
        plain = runtime.caption(prepared, 3, 8)
        runtime.pad_batches = True
        assert runtime.pixels(prepared).shape[0] == 4
        # a CNN with several outputs (the ONNX encoder graph's) is given the padded batch and loses its padding rows
        # from each of them
        given = []

        def two_outputs(pixels):
            given.append(len(pixels))
            return [pixels, pixels[:, :1]]

        outputs = runtime.run_cnn(prepared, two_outputs)
        assert given == [4] and [len(rows) for rows in outputs] == [3, 3]
        for got, want in zip(runtime.caption(prepared, 3, 8), plain, strict=True):
            assert_same_result(got, want, atol_attention=ATOL_ATTENTION, atol_logprob=ATOL_LOGPROB)


def test_a_runtime_on_the_cpu_runs_its_cnn_batches_unpadded():
    """Padding pays only on a GPU, where a new input shape costs cuDNN seconds; on the CPU each padding row would be
    one more image's convolutions for nothing, so the batch runs as it is."""
    runtime = TorchRuntime("sat", tiny_checkpoint("sat"), shared_encoder(), CPU)
    prepared = [runtime.prepare(image) for image in random_images(3)]
    assert not runtime.pad_batches
    assert runtime.pixels(prepared).shape[0] == 3
    given = []

    def cnn(pixels):
        given.append(len(pixels))
        return pixels

    runtime.run_cnn(prepared, cnn)
    assert given == [3]


@pytest.mark.parametrize("device,pads", [("cuda", True), ("cuda:1", True), ("cpu", False)])
def test_a_runtime_pads_its_cnn_batches_on_a_gpu_and_only_there(device, pads):
    """The runtime decides from its device alone (no GPU needed to check it). On a GPU a batch shape the CNN has not
    met costs about 2 s of cuDNN kernel choice: unpadded, a batch of 3, 5 or 6 images would stall a client's
    request, and the warm-up (service/warmup.py) would run every power of four rather than of two."""
    runtime = TorchRuntime("sat", tiny_checkpoint("sat"), None, torch.device(device))
    assert runtime.pad_batches is pads


def test_a_runtime_waits_for_its_gpu_to_finish_and_never_asks_the_cpu_to(monkeypatch):
    """``synchronize`` ends the batcher's timing of an encoding (admission control's cost per image, the warm-up's
    choice of encoder batch): on a GPU, whose kernels run asynchronously, without the wait the timing would count
    only the kernel launches; on the CPU there is nothing to wait for, and CUDA's call would fail without a GPU."""
    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", waited.append)
    TorchRuntime("sat", tiny_checkpoint("sat"), None, CPU).synchronize()
    assert waited == []
    gpu = torch.device("cuda:1")
    TorchRuntime("sat", tiny_checkpoint("sat"), None, gpu).synchronize()
    assert waited == [gpu]


def test_pixels_for_a_cnn_on_the_host_stay_there_unpadded_whatever_the_runtime_pads():
    """``pixels(on_device=False)`` is the input of a CNN on the CPU beside a GPU decoder (the hybrid runtime): the
    batch as it is, in host memory. A padded one (``pad_batches``, a GPU runtime's) would run blank images through
    the CPU's convolutions, and one moved to the GPU would not run on a CPU CNN at all."""
    runtime = TorchRuntime("sat", tiny_checkpoint("sat"), shared_encoder(), CPU)
    prepared = [runtime.prepare(image) for image in random_images(3)]
    runtime.pad_batches = True  # as on a GPU
    host = runtime.pixels(prepared, on_device=False)
    assert host.shape[0] == 3 and host.device.type == "cpu"
    assert torch.equal(host, torch.stack([p.pixels for p in prepared]))
    given = []

    def cnn(pixels):
        given.append(len(pixels))
        return pixels

    assert len(runtime.run_cnn(prepared, cnn, on_device=False)) == 3 and given == [3]


def test_a_runtimes_description_is_made_once_and_cannot_be_changed():
    """``GET /models`` answers every request with the one ``ModelInfo`` a runtime makes when first asked (a loaded
    runtime does not change): were it mutable, one caller assigning to it would change what every later request
    is told."""
    info = TorchRuntime("sat", tiny_checkpoint("sat"), shared_encoder(), CPU).info()
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.name = "renamed"
    assert info.name == "sat"


@pytest.mark.parametrize("asked,served,logged", [
    ("auto", "hybrid", "onnx backend failed"),
    ("onnx", "torch", "a: ONNX Runtime failed to load it; serving it with PyTorch"),
])
def test_an_export_onnx_runtime_cannot_load_is_logged_with_its_traceback_and_the_next_backend_serves(
        tmp_path, caplog, asked, served, logged):
    """ONNX Runtime's own errors (here InvalidProtobuf, from a step graph damaged on disk) derive from Exception
    alone: rather than failing the start, ``auto`` logs them with their traceback and serves the next verified
    backend, and ``CAPTIONER_BACKEND=onnx`` serves the model with PyTorch, saying why."""
    save_tiny_sats(tmp_path / "weights", ["a"])
    assert load_on_cpu(tmp_path, asked)["a"].backend == "onnx"
    # a graph ONNX Runtime refuses although it is the file the export wrote (sealed: not damaged since)
    (tmp_path / "onnx" / "a" / "step.onnx").write_bytes(b"not a graph")
    seal(tmp_path / "onnx" / "a" / "step.onnx")
    with caplog.at_level("WARNING", logger=runtime_module.log.name):
        assert load_on_cpu(tmp_path, asked)["a"].backend == served
    failure = next(r for r in caplog.records if logged in r.getMessage())
    assert failure.exc_info  # False, not None, where the traceback is left out


def test_graphs_damaged_on_disk_are_made_again_not_loaded(tmp_path):
    """A graph cut short after it was written (its seal no longer matches): the model's and the shared CNN's are
    made again at the next start, which then serves on ONNX Runtime as before; the ``onnx`` backend's start knows
    it has something to prepare."""
    ckpt = tiny_checkpoint("sat")
    save_checkpoint(tmp_path / "weights" / "a", ckpt.model, ckpt.vocab, ckpt.encoder)

    def unprepared(backend: str = "auto") -> list[str]:
        return still_to_prepare(tmp_path, default_backend=backend)

    assert unprepared("onnx") == ["a"]
    assert load_on_cpu(tmp_path, "onnx")["a"].backend == "onnx"
    assert unprepared("onnx") == []
    assert unprepared("torch") == []
    step, (visual,) = tmp_path / "onnx" / "a" / STEP_FILE, list((tmp_path / "onnx").glob("visual-*/visual.onnx"))
    for graph in (step, visual):
        graph.write_bytes(graph.read_bytes()[:1000])
    assert not export_is_current(tmp_path / "onnx" / "a", ckpt.checksum, SERVED_GRAPHS) and not intact(visual)
    assert unprepared("onnx") == ["a"]
    assert load_on_cpu(tmp_path, "onnx")["a"].backend == "onnx"
    assert intact(step) and intact(visual) and step.stat().st_size > 1000
    # auto, once its references are recorded, sends a damaged graph to the preparing child too
    assert load_on_cpu(tmp_path, "auto")["a"].backend == "onnx"
    assert unprepared() == []
    folder = tmp_path / "onnx" / "a"
    identity = GraphSpec.load(folder).checksum  # what the start asked the export to be made from
    for name in (None, *SERVED_GRAPHS):  # each of the graphs the service loads, damaged alone
        copy = tmp_path / f"copy-{name}"
        shutil.copytree(folder, copy)
        if name is not None:
            (copy / name).write_bytes((copy / name).read_bytes()[:1000])
        assert export_is_current(copy, identity, SERVED_GRAPHS) == (name is None), name
    step.write_bytes(step.read_bytes()[:1000])
    assert unprepared() == ["a"]


def test_a_damaged_head_graph_is_left_to_prepare_and_made_again(tmp_path):
    """``head.onnx`` cut short (the graph a server runs after the shared CNN, which the start checks as it checks
    ``step.onnx``): the model is still to prepare, and its start makes the export again."""
    save_tiny_sats(tmp_path / "weights", ["a"])
    assert load_on_cpu(tmp_path, "onnx")["a"].backend == "onnx"
    head = tmp_path / "onnx" / "a" / HEAD_FILE
    head.write_bytes(head.read_bytes()[:1000])
    left = still_to_prepare(tmp_path, default_backend="onnx")
    assert left == ["a"]
    assert load_on_cpu(tmp_path, "onnx")["a"].backend == "onnx"
    assert intact(head) and head.stat().st_size > 1000


def test_a_damaged_cnn_graph_alone_is_left_to_prepare_and_made_again(tmp_path):
    """The shared CNN's ``visual.onnx`` cut short beside an intact export of the model's own: the model is still to
    prepare on ``onnx`` and ``hybrid``, and its start makes the CNN's graph again."""
    save_tiny_sats(tmp_path / "weights", ["a"])
    assert load_on_cpu(tmp_path, "onnx")["a"].backend == "onnx"
    (visual,) = (tmp_path / "onnx").glob("visual-*/visual.onnx")
    visual.write_bytes(visual.read_bytes()[:1000])
    for backend in ("onnx", "hybrid"):
        assert still_to_prepare(tmp_path, default_backend=backend) == ["a"], backend
    assert load_on_cpu(tmp_path, "hybrid")["a"].backend == "hybrid"
    assert intact(visual) and still_to_prepare(tmp_path, default_backend="onnx") == []


def test_the_services_exports_leave_out_the_self_contained_encoder_graph(tmp_path):
    """A server runs every image through the CNN's shared ``visual.onnx``, then the model's ``head.onnx``: its exports
    leave out ``encoder.onnx`` (the CNN again, with the head), whose trace and verification were most of a small
    model's export.  The head is still verified against PyTorch, and a library user who opens such a folder for its
    self-contained graph is told how to make one."""
    save_tiny_sats(tmp_path / "weights", ["a"])
    assert load_on_cpu(tmp_path, "onnx")["a"].backend == "onnx"
    folder = tmp_path / "onnx" / "a"
    written = file_stamps(folder)
    assert sorted(written) == ["head.onnx", "head.onnx.sha256", "onnx.json", "step.onnx", "step.onnx.sha256"]
    assert load_on_cpu(tmp_path, "onnx")["a"].backend == "onnx"
    assert file_stamps(folder) == written  # current for the next start: nothing made again
    assert {"enc", "state", "logprobs", "attention"} <= set(GraphSpec.load(folder).max_abs_diff)
    ckpt = load_checkpoint(tmp_path / "weights" / "a")
    assert export_is_current(folder, ckpt.checksum, SERVED_GRAPHS) and not export_is_current(folder, ckpt.checksum)
    with pytest.raises(ValueError, match=r"holds no encoder\.onnx .* captioner export for a self-contained one"):
        OnnxRuntime("a", ckpt, folder, CPU, threads=1)


def test_a_model_on_an_accelerator_is_exported_from_its_weights_loaded_again_on_the_cpu(tmp_path, monkeypatch):
    """The exporter traces and verifies on the CPU: a server on a GPU (the meta device stands in for it) exports a
    model from its checkpoint loaded again on the CPU, never from the module on the device, which would fail the
    export and leave the model on PyTorch at every start; a model already on the CPU is exported as it is, with no
    second copy of its weights."""
    handed = []
    monkeypatch.setattr(exporter, "export_graphs", lambda ckpt, folder, encoder, self_contained: handed.append(ckpt))
    encoders = types.SimpleNamespace(onnx_dir=tmp_path / "onnx", onnx=lambda spec: None, for_export=lambda spec: None)
    save_tiny_sats(tmp_path / "weights", ["a"])
    on_cpu = load_checkpoint(tmp_path / "weights" / "a")
    on_device = load_checkpoint(tmp_path / "weights" / "a")
    on_device.model.to("meta")
    assert onnx_exports.onnx_folder(encoders, "a", on_device) == tmp_path / "onnx" / "a"
    (exported,) = handed
    assert {p.device.type for p in exported.model.parameters()} == {"cpu"}
    weights, loaded = exported.model.state_dict(), on_cpu.model.state_dict()
    assert all(torch.equal(weights[key], loaded[key]) for key in loaded)
    onnx_exports.onnx_folder(encoders, "a", on_cpu)
    assert handed[1] is on_cpu


def test_an_export_from_captioner_export_is_served_as_it_is(tmp_path):
    """``captioner export`` into the service's ONNX folder writes the self-contained graph as well: the service
    takes that export as current (its head and step are what a server loads) instead of making it again."""
    save_tiny_sats(tmp_path / "weights", ["a"])
    captioner(["export", "--weights-dir", str(tmp_path / "weights"), "--out", str(tmp_path / "onnx"),
               "--threads", "1"])
    before = file_stamps(tmp_path / "onnx" / "a")
    assert ENCODER_FILE in before
    assert still_to_prepare(tmp_path, default_backend="onnx") == []
    assert load_on_cpu(tmp_path, "onnx")["a"].backend == "onnx"
    assert file_stamps(tmp_path / "onnx" / "a") == before


def test_a_cnn_the_tracer_cannot_record_leaves_no_export_to_pass_for_proof_that_it_can(tmp_path, monkeypatch):
    """The service makes the CNN's graph before the model's own: where the tracer cannot record the CNN, no export of
    the model is left behind to pass for proof that the CNN exports, so ``auto`` serves the model on PyTorch and
    the next start has nothing to send to the preparing child (which would trace the CNN in vain at every start)."""
    def untraceable(spec, *args, **kwargs):
        raise ExportUnsupported(f"visual encoder {spec.backbone}: the tracer cannot record it (TracingCheckError)")

    monkeypatch.setattr(exporter, "export_visual_encoder", untraceable)
    save_tiny_sats(tmp_path / "weights", ["a"])
    assert load_on_cpu(tmp_path, "auto")["a"].backend == "torch"
    assert not (tmp_path / "onnx" / "a").exists()
    assert still_to_prepare(tmp_path) == []


@pytest.mark.parametrize("frozen_by, refusal", [("centring", "ONNX Runtime disagrees with PyTorch"),
                                                 ("reshaping", "ONNX Runtime cannot run it on a new batch size")])
def test_a_cnn_whose_graph_freezes_the_batch_size_is_refused_and_not_written(encoder, tmp_path, frozen_by, refusal):
    """The shared CNN's graph is checked on a batch size its trace never saw.  One that divides by the batch size
    taken as a Python int (a constant of the traced graph) computes other features for any other batch; one that
    reshapes to it cannot run at all, and is refused in the same words as a model's graph (`captioner export` prints
    one line, not ONNX Runtime's exception).  Either way no ``visual.onnx`` is left for every model of its spec."""

    class BatchFrozen(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = encoder

        def forward(self, pixels):
            feats = self.inner(pixels)
            batch = int(feats.shape[0])
            if frozen_by == "centring":
                return feats - feats.sum(0) / batch
            rows = feats.reshape(batch, int(feats[0].numel()))  # a shape of constants: no other batch fits it
            return torch.nn.functional.silu(rows).reshape(feats.shape)

    with pytest.raises(ExportUnsupported, match=f"visual encoder .*{refusal}"):
        export_visual_encoder(TINY_SPEC, tmp_path, BatchFrozen())
    assert not exporter.visual_encoder_path(TINY_SPEC, tmp_path).parent.exists()


def test_export_refuses_each_model_of_a_cnn_it_cannot_export_in_one_line_and_tries_that_cnn_once(tmp_path,
                                                                                                 monkeypatch):
    """A CNN that cannot be exported stopped `captioner export` with a traceback, the models before it reported and
    those after it never tried; each model on it is reported NOT EXPORTED with the CNN's reason now, and the CNN is
    not traced again for each."""
    tried = []

    def unexportable(spec, out_dir, visual=None):
        tried.append(spec)
        raise ExportUnsupported(f"visual encoder {spec.backbone}: ONNX Runtime cannot run it on a new batch size")

    monkeypatch.setattr(exporter, "export_visual_encoder", unexportable)
    for name in ("a", "b"):
        save_checkpoint(tmp_path / name, tiny_model("sat"), VOCAB, TINY_SPEC)
    results = exporter.export_checkpoints({"a": tmp_path / "a", "b": tmp_path / "b"}, tmp_path / "onnx")
    assert [str(results[name]) for name in "ab"] == [f"visual encoder {TINY_SPEC.backbone}: ONNX Runtime cannot run "
                                                     "it on a new batch size"] * 2
    assert tried == [TINY_SPEC] and not (tmp_path / "onnx" / "a").exists() and not (tmp_path / "onnx" / "b").exists()


def test_a_self_contained_export_is_current_only_with_each_of_its_graphs_intact(encoder, tmp_path, monkeypatch):
    """``export_is_current`` asks by default for every graph ``captioner export`` writes, and a server only for the
    two it loads: a damaged ``encoder.onnx`` is no reason for a server to make the export again.  Each of the three
    graphs passed ONNX's checker."""
    checked, check = [], onnx.checker.check_model

    def recorded(path, *args, **kwargs):
        checked.append(Path(path).name)
        return check(path, *args, **kwargs)

    monkeypatch.setattr(onnx.checker, "check_model", recorded)
    ckpt = tiny_checkpoint("sat")
    export_graphs(ckpt, tmp_path / "sat", encoder)
    assert sorted(checked) == sorted([ENCODER_FILE, HEAD_FILE, STEP_FILE])
    for name in (None, ENCODER_FILE, HEAD_FILE, STEP_FILE):
        copy = tmp_path / f"copy-{name}"
        shutil.copytree(tmp_path / "sat", copy)
        if name is not None:
            (copy / name).write_bytes((copy / name).read_bytes()[:1000])
        assert export_is_current(copy, ckpt.checksum) == (name is None), name
        assert export_is_current(copy, ckpt.checksum, SERVED_GRAPHS) == (name in (None, ENCODER_FILE)), name


def test_export_replaces_an_export_but_never_a_folder_of_anything_else(tmp_path, capsys):
    """``captioner export CKPT --out PARENT`` where PARENT/NAME is the checkpoint itself (or anything that is not
    an export): refused before any work, every file kept; an earlier export of the same name is replaced."""
    ckpt = tiny_checkpoint("sat")
    save_checkpoint(tmp_path / "runs" / "best", ckpt.model, ckpt.vocab, ckpt.encoder)
    before = sorted(p.name for p in (tmp_path / "runs" / "best").iterdir())
    checksum = load_checkpoint(tmp_path / "runs" / "best").checksum
    with pytest.raises(SystemExit) as exc:  # runs/best is exported as "runs": PARENT/runs is the training run
        captioner(["export", str(tmp_path / "runs" / "best"), "--out", str(tmp_path), "--threads", "1"])
    assert exc.value.code == 2 and "which no ONNX export writes" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "runs" / "best").iterdir()) == before
    assert load_checkpoint(tmp_path / "runs" / "best").checksum == checksum
    for _ in range(2):  # the second run replaces the first's export
        captioner(["export", str(tmp_path / "runs" / "best"), "--out", str(tmp_path / "onnx"), "--threads", "1"])
        assert export_is_current(tmp_path / "onnx" / "runs", checksum)


def test_an_export_given_no_cnn_builds_its_checkpoints_own(tmp_path):
    """``export_graphs(ckpt, out)``, as a library user calls it: the CNN of the checkpoint's encoder spec is built
    for the trace (every caller in the service hands it a shared one)."""
    ckpt = tiny_checkpoint("sat")
    spec = export_graphs(ckpt, tmp_path / "sat")
    assert export_is_current(tmp_path / "sat", ckpt.checksum) and spec.encoder == ckpt.encoder.to_json()


def test_an_export_into_a_path_that_is_a_file_is_refused_and_the_file_kept(encoder, tmp_path):
    """Where the export's folder would go there is a file: refused before any work, never swapped for the export."""
    target = tmp_path / "notes"
    target.write_text("not an export")
    with pytest.raises(FileExistsError, match="is a file, not an ONNX export folder"):
        export_graphs(tiny_checkpoint("sat"), target, encoder)
    assert target.read_text() == "not an export"
    assert [p.name for p in tmp_path.iterdir()] == ["notes"]


def test_what_a_killed_quantization_left_in_a_cnns_folder_does_not_stop_its_export_again(tmp_path):
    """An int8 CNN is written under a hidden temporary name before it is renamed into place; one left by a killed
    quantization is the export's own file, so the folder is still replaced, not refused as someone else's."""
    spec = EncoderSpec(image_size=64)
    path = export_visual_encoder(spec, tmp_path)
    (path.parent / ".visual-int8-u8s8.onnx.tmp-0123abcd").write_bytes(b"half a graph")
    path.write_bytes(path.read_bytes()[:1000])  # damaged: made again
    assert export_visual_encoder(spec, tmp_path) == path and intact(path)


def test_an_intact_cnn_export_is_kept_as_it_is_and_no_pytorch_cnn_is_built_for_it(tmp_path, monkeypatch):
    """``captioner export`` run again, and an int8 CNN quantized from the float one, find the float CNN's export
    intact: it is returned as it is, not traced again (minutes for a large CNN) from a PyTorch CNN built for that
    and swapped in over the folder the int8 graphs share with it."""
    spec = EncoderSpec(image_size=64)
    path = export_visual_encoder(spec, tmp_path)
    written = file_stamps(path.parent)
    monkeypatch.setattr(exporter, "GridEncoder", lambda spec: pytest.fail("a PyTorch CNN was built for it"))
    assert export_visual_encoder(spec, tmp_path) == path
    assert file_stamps(path.parent) == written


def test_a_cnn_exported_under_a_new_key_removes_the_export_of_its_spec_it_replaces(tmp_path, monkeypatch):
    """An upgrade that changes the export format (or new weights behind the same spec) gives the CNN a new key: the
    folder it replaces goes, instead of a CNN's worth of graphs left behind at every change; another spec's stays.
    A folder written before specs were recorded is made identifiable the next time it is used."""
    spec, other = EncoderSpec(image_size=64), EncoderSpec(image_size=96)
    old = exporter.export_visual_encoder(spec, tmp_path).parent
    kept = exporter.export_visual_encoder(other, tmp_path).parent
    (old / exporter.VISUAL_SPEC_FILE).unlink()  # as an earlier version wrote it
    assert exporter.export_visual_encoder(spec, tmp_path).parent == old  # current: used as it is, and recorded
    newer = tmp_path / "visual-of-a-newer-version"  # a newer version sharing the folder still uses it
    newer.mkdir()
    (newer / exporter.VISUAL_FILE).write_bytes(b"graph")
    (newer / exporter.VISUAL_SPEC_FILE).write_text(json.dumps({**exporter._spec_record(spec),
                                                               "format": "attention-captioner-onnx/99"}))
    family, _, version = exporter.FORMAT.rpartition("/")
    monkeypatch.setattr(exporter, "FORMAT", f"{family}/{int(version) + 1}")
    new = exporter.export_visual_encoder(spec, tmp_path).parent
    assert new != old and exporter.intact(new / exporter.VISUAL_FILE)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([new.name, kept.name, newer.name])


def test_a_replaced_cnn_export_holding_a_file_no_export_writes_is_kept_whole(tmp_path):
    """The pruning removes a replaced CNN's folder only when everything in it is an export's own: a folder of the
    same spec where the user also keeps a file of their own (notes, a copy of the graph they benchmark) is not
    deleted with that file in it; its twin holding only the export's files goes."""
    spec = EncoderSpec(image_size=64)
    record = json.dumps({**exporter._spec_record(spec), "format": "attention-captioner-onnx/1"})
    for name in ("visual-older", "visual-older-with-notes"):
        (tmp_path / name).mkdir()
        (tmp_path / name / exporter.VISUAL_FILE).write_bytes(b"graph")
        (tmp_path / name / exporter.VISUAL_SPEC_FILE).write_text(record)
    (tmp_path / "visual-older-with-notes" / "notes.txt").write_text("mine")
    assert exporter.remove_replaced_encoders(tmp_path, spec, tmp_path / "visual-current") == ["visual-older"]
    assert (tmp_path / "visual-older-with-notes" / "notes.txt").read_text() == "mine"


def test_replaced_cnn_exports_stay_while_another_export_writes_in_the_folder(tmp_path, monkeypatch):
    """Another process may be quantizing into the folder the pruning would remove: it waits for a start alone."""
    spec = EncoderSpec(image_size=64)
    old = exporter.export_visual_encoder(spec, tmp_path).parent
    family, _, version = exporter.FORMAT.rpartition("/")
    monkeypatch.setattr(exporter, "FORMAT", f"{family}/{int(version) + 1}")
    in_flight = os.open(tmp_path, os.O_RDONLY)
    try:
        fcntl.flock(in_flight, fcntl.LOCK_SH)
        new = call_bounded(120, exporter.export_visual_encoder, spec, tmp_path).parent
        assert old.is_dir() and new.is_dir()
    finally:
        os.close(in_flight)
    assert exporter.remove_replaced_encoders(tmp_path, spec, new) == [old.name]


def test_the_temporary_folder_of_a_killed_export_is_removed_by_the_next_export_but_never_one_in_flight(tmp_path):
    """SIGKILL (or the OOM killer) mid-export runs no ``finally``: its temporary folder, a model's worth of graphs,
    stays.  The next export into that folder removes it, unless another export holds the folder (it may be that
    export's own), and leaves anything that is not an export's alone."""
    # the child stops for good once its graph is written (at the check against PyTorch), so it is killed mid-export
    # however slowly this test polls
    child = subprocess.Popen([sys.executable, "-c", "import time, torch; torch.set_num_threads(1)\n"
                              "from captioner.models.encoder import EncoderSpec\n"
                              "from captioner.models.export import onnx\n"
                              "onnx._close = lambda *args, **kwargs: time.sleep(3600)\n"
                              f"onnx.export_visual_encoder(EncoderSpec(image_size=64), {str(tmp_path)!r})"])
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob(".visual-*/visual.onnx")) and child.poll() is None:
            assert time.monotonic() < deadline, "the export never started writing"
            time.sleep(0.02)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    (left,) = [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    (tmp_path / ".git.abcdefgh").mkdir()  # named like one, but not an export's
    (tmp_path / ".git.abcdefgh" / "HEAD").write_text("ref: refs/heads/main\n")
    (tmp_path / ".foo.settings").mkdir()  # named like one, and empty
    earlier = tmp_path / ".visual-0123.k9x_2abc"  # what tempfile.mkdtemp named them before this version
    earlier.mkdir()
    (earlier / "visual.onnx").write_bytes(b"half a graph")

    in_flight = os.open(tmp_path, os.O_RDONLY)
    try:
        fcntl.flock(in_flight, fcntl.LOCK_SH)  # another process's export, writing here
        call_bounded(120, export_visual_encoder, EncoderSpec(image_size=96), tmp_path)
        assert left.is_dir() and earlier.is_dir()
    finally:
        os.close(in_flight)
    # the next start exports what the killed one did not finish
    path = export_visual_encoder(EncoderSpec(image_size=64), tmp_path)
    assert path.is_file() and not left.exists() and not earlier.exists()
    assert (tmp_path / ".git.abcdefgh" / "HEAD").exists()
    assert (tmp_path / ".foo.settings").is_dir()


def test_an_export_folder_gets_the_usual_permissions_so_another_user_can_read_it(tmp_path):
    """The umask decides, as for checkpoints: ``tempfile.mkdtemp`` made every export folder 0700, so a service
    running as another user than the one who exported could not open the graphs."""
    old = os.umask(0o022)
    try:
        folder = export_visual_encoder(EncoderSpec(image_size=64), tmp_path).parent
    finally:
        os.umask(old)
    assert folder.stat().st_mode & 0o777 == 0o755
    for file in folder.iterdir():
        assert file.stat().st_mode & 0o777 == 0o644, file.name


@pytest.mark.parametrize("checkpoints, named, they_are", [(["grid"], "gird", "grid"), ([], "grid", "none")])
def test_a_backend_named_for_a_model_no_checkpoint_is_called_is_said(tmp_path, caplog, checkpoints, named, they_are):
    """CAPTIONER_BACKENDS='{"nosuch": "onnx"}' (a misspelt model) left the model meant on the default backend, in
    silence (the ONNX audit); with no checkpoint found at all (an empty or mistyped weights folder), the warning says
    that none are, rather than ending on an empty list the operator has to puzzle over."""
    (tmp_path / "weights").mkdir()
    for name in checkpoints:
        save_checkpoint(tmp_path / "weights" / name, tiny_model("sat"), VOCAB, TINY_SPEC)
    with caplog.at_level(logging.WARNING, logger="captioner"):
        served = load_on_cpu(tmp_path, "torch", backends={named: "torch", **dict.fromkeys(checkpoints, "torch")})
    assert sorted(served) == checkpoints
    assert f"CAPTIONER_BACKENDS names '{named}', which no checkpoint is called (they are: {they_are})" in caplog.text


def record_threads(record: Path) -> None:
    """A preparing child's ``set_up_logging`` (it runs in the child): each load of a checkpoint writes PyTorch's
    thread count at that moment into ``record``."""
    load = runtime_module.load_checkpoint

    def recording(path, device):
        record.write_text(str(torch.get_num_threads()))
        return load(path, device)

    runtime_module.load_checkpoint = recording


def test_the_preparing_child_runs_on_its_own_threads_not_the_servers(tmp_path):
    """The child prepares on ``PreparingChild.THREADS`` (one) threads whatever the server's setting: it traces in one
    thread, and the server warms up the models already prepared beside it (a child on every core made the first
    start of 11 models 65 s rather than 47 s). The server hands it its own loading options, threads among them."""
    save_tiny_sats(tmp_path / "weights", ["a"])
    record = tmp_path / "threads"
    runtime_module.PreparingChild(tmp_path / "weights", [], only=["a"], device_name="cpu", default_backend="torch",
                                  onnx_dir=tmp_path / "onnx", threads=2,
                                  set_up_logging=functools.partial(record_threads, record)).join()
    assert runtime_module.PreparingChild.THREADS == 1 and record.read_text() == "1"


def test_a_model_served_on_onnx_runtime_runs_its_sessions_on_the_threads_setting(tmp_path):
    """``CAPTIONER_THREADS`` reaches the decoder's own sessions, not only the shared CNN's (one left on ONNX Runtime's
    one thread per core would contend with the batchers of the other models)."""
    save_tiny_sats(tmp_path / "weights", ["a"])
    runtime = load_on_cpu(tmp_path, "onnx", threads=2)["a"]
    assert runtime.backend == "onnx"
    for session in (runtime.encoder_session, runtime.step_session):
        assert session.get_session_options().intra_op_num_threads == 2
