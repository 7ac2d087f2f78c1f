"""Runtimes of the served checkpoints: loading them (:func:`load_runtimes`) and the ONNX Runtime backend.

Every model is served through the :class:`~captioner.models.inference.Runtime` interface the batcher drives, with
either backend, chosen per model name:

* ``torch``: :class:`~captioner.models.inference.TorchRuntime`, the model's own protocol methods and the frozen
  :class:`~captioner.models.encoder.GridEncoder`;
* ``onnx``: :class:`OnnxRuntime`, the graphs of :mod:`captioner.models.export.onnx` on ONNX Runtime (CUDA execution
  provider when the device is CUDA, CPU otherwise), exported at start-up when no current, intact export exists;
* ``hybrid``: :class:`HybridRuntime`, the frozen CNN alone on ONNX Runtime and the model on PyTorch, for models
  whose decoder step cannot be exported (TVmax's data-dependent solver) — on a CPU the CNN is most of the cost;
* ``auto`` (the default): the fastest of these whose captions equal the PyTorch ones on a check set of a few
  generated images (:func:`check_images`): on a CPU ``onnx``, else ``hybrid``, else ``torch`` (measured once, in
  the benchmarks); on a GPU, timed on the check set at start-up (:func:`fastest_verified`).

The frozen CNN exists once per :class:`~captioner.models.encoder.EncoderSpec`, whatever the number of models
(:class:`SharedEncoders`): one ONNX Runtime session of its ``visual.onnx`` for the ``onnx`` and ``hybrid``
backends, one PyTorch module for the ``torch`` backend, each made only when some model needs it.  A model served
wholly by ONNX Runtime keeps no PyTorch weights (:func:`drop_torch_weights`).  Memory by number of models:
docs/decisions.md#one-cnn-per-encoder-spec-and-no-pytorch-weights-behind-onnx-models.

It runs models, and uses the same preprocessing function as training (the batcher moves their tensors).
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import time
from collections.abc import Collection
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw

from captioner.models.checkpoint import (Checkpoint, CheckpointError, find_checkpoints, load_checkpoint,
                                         read_config, recorded_checksum, resolve_encoder_weights)
from captioner.models.decoding import expand_rows
from captioner.models.device import resolve_device
from captioner.models.encoder import EncoderSpec, GridEncoder, preprocess
from captioner.models.files import write_atomically
from captioner.models.inference import Prepared, Runtime, TorchRuntime, grid_encoder
from captioner.models.protocol import AttnRecord, DecState, EncState, index_rows

log = logging.getLogger("captioner.runtime")
#: the check set of ``auto``: this many generated images, captioned with this beam and length by each backend
CHECK_IMAGES, CHECK_BEAM, CHECK_MAX_LEN = 3, 3, 20


def _session_options(threads: int | None):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    if threads:
        options.intra_op_num_threads = threads
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # Without its arena, ONNX Runtime returns each run's buffers to the allocator instead of keeping the largest
    # warm-up batch's worth per session (two per model): docs/decisions.md#onnx-runtime-without-its-memory-arena
    options.enable_cpu_mem_arena = False
    return options


class NoCudaProvider(RuntimeError):
    """The device is CUDA but ONNX Runtime cannot run there (the ``onnxruntime`` package without CUDA, or its CUDA
    provider failed to load): a whole-model ONNX runtime would hand GPU tensors to a CPU session."""


def _providers(device: torch.device) -> list:
    import onnxruntime as ort

    if device.type == "cuda" and "CUDAExecutionProvider" in ort.get_available_providers():
        return [("CUDAExecutionProvider", {"device_id": device.index or 0}), "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


class VisualSession:
    """The frozen CNN of one encoder spec on ONNX Runtime (``visual.onnx``: pixels → grid features), shared by
    every model with that spec."""

    def __init__(self, path: Path, device: torch.device, threads: int | None = None):
        import onnxruntime as ort

        self.device, self.path = device, Path(path)
        self.session = ort.InferenceSession(str(path), _session_options(threads), providers=_providers(device))
        self.providers = self.session.get_providers()
        self.on_gpu = self.providers[0] == "CUDAExecutionProvider" and device.type == "cuda"

    def features(self, pixels: torch.Tensor) -> torch.Tensor:
        (feats,) = run_session(self.session, {"pixels": pixels}, ["features"], self.device, self.on_gpu)
        return feats


class OnnxRuntime(Runtime):
    """The :class:`~captioner.models.inference.Runtime` interface on ONNX Runtime sessions of the exported graphs
    (the PyTorch model is used only for its vocabulary ids and :meth:`info`).  With a shared ``visual`` session the
    images go through it and then this model's ``head.onnx``; without one, through the self-contained
    ``encoder.onnx``."""

    backend = "onnx"

    def __init__(self, name: str, ckpt: Checkpoint, folder: Path, device: torch.device, threads: int | None = None,
                 visual: VisualSession | None = None):
        import onnxruntime as ort

        from captioner.models.export.onnx import ENCODER_FILE, HEAD_FILE, STEP_FILE, GraphSpec

        super().__init__(name, ckpt, device)
        self.graphs = GraphSpec.load(folder)
        self.folder = folder
        self.visual = visual
        options, providers = _session_options(threads), _providers(device)
        self.encoder_session = ort.InferenceSession(str(folder / (ENCODER_FILE if visual is None else HEAD_FILE)),
                                                    options, providers=providers)
        self.step_session = ort.InferenceSession(str(folder / STEP_FILE), options, providers=providers)
        self.providers = self.step_session.get_providers()
        # the tracer drops inputs a graph never reads (e.g. an encoder summary used only by init_state)
        self.step_inputs = [i.name for i in self.step_session.get_inputs()]
        self.on_gpu = self.providers[0] == "CUDAExecutionProvider" and device.type == "cuda"
        if device.type == "cuda" and not self.on_gpu:
            raise NoCudaProvider(f"ONNX Runtime has no working CUDA execution provider here (providers: "
                                 f"{', '.join(self.providers)}); install onnxruntime-gpu with its CUDA libraries")

    def _run(self, session, inputs: dict[str, torch.Tensor], outputs: list[str]) -> list[torch.Tensor]:
        return run_session(session, inputs, outputs, self.device, self.on_gpu)

    def begin(self, batch: list[Prepared], widths: list[int]) -> tuple[EncState, DecState]:
        names = self.graphs.encoder_outputs

        def encode(pixels: torch.Tensor) -> list[torch.Tensor]:
            inputs = {"pixels": pixels} if self.visual is None else {"features": self.visual.features(pixels)}
            return self._run(self.encoder_session, inputs, names)

        values = self.run_cnn(batch, encode)
        enc = {n[4:]: v for n, v in zip(names, values) if n.startswith("enc.")}
        state = {n[6:]: v for n, v in zip(names, values) if n.startswith("state.")}
        return expand_rows(enc, widths), expand_rows(state, widths)

    def step(self, prev: torch.Tensor, state: DecState, enc: EncState) -> tuple[torch.Tensor, DecState, AttnRecord]:
        available = {"prev_tokens": prev, **{f"state.{k}": v for k, v in state.items()},
                     **{f"enc.{k}": v for k, v in enc.items()}}
        names = self.graphs.step_outputs
        values = dict(zip(names, self._run(self.step_session, {n: available[n] for n in self.step_inputs}, names)))
        new_state = {k: values[f"next.{k}"] for k in self.graphs.state_keys}
        extras = {k: values[f"extra.{k}"] for k in self.graphs.extra_keys}
        return values["logprobs"], new_state, AttnRecord(values["attention"], extras)

    def reorder(self, state: DecState, index: torch.Tensor) -> DecState:
        # the step graph's state is exactly the model's state dict, whose rows the exporter verified to follow
        # beams by row selection (models/export/onnx.py checks the graphs on index_rows-reordered states)
        return index_rows(state, index)


def run_session(session, inputs: dict[str, torch.Tensor], outputs: list[str], device: torch.device,
                on_gpu: bool) -> list[torch.Tensor]:
    """Run an ONNX Runtime session on torch tensors, returning torch tensors on the same device."""
    if not on_gpu:
        # CPU: numpy views of torch tensors and back, no copies
        feed = {name: inputs[name].detach().contiguous().numpy() for name in inputs}
        return [torch.from_numpy(np.ascontiguousarray(v)) for v in session.run(outputs, feed)]
    # CUDA: bind device buffers directly (I/O binding), so nothing goes through host memory.  The contiguous
    # copies are held until the run ends (a copy dropped after binding could be reused by PyTorch's allocator
    # while ONNX Runtime reads it), and PyTorch's stream is drained first: ONNX Runtime reads the buffers on a
    # stream of its own, whose order after the kernels that wrote them would otherwise rest on how each library
    # happens to create its streams
    bound = {name: tensor.contiguous() for name, tensor in inputs.items()}
    torch.cuda.current_stream(device).synchronize()
    binding = session.io_binding()
    for name, tensor in bound.items():
        binding.bind_input(name, "cuda", device.index or 0, _NUMPY_DTYPES[tensor.dtype], tuple(tensor.shape),
                           tensor.data_ptr())
    for name in outputs:
        binding.bind_output(name, "cuda", device.index or 0)
    session.run_with_iobinding(binding)
    return [torch.from_dlpack(value) for value in binding.get_outputs()]


class HybridRuntime(TorchRuntime):
    """The frozen CNN on ONNX Runtime (a shared :class:`VisualSession`), the model's ``encode``, ``init_state``,
    ``step`` and ``reorder`` on PyTorch."""

    backend = "hybrid"

    def __init__(self, name: str, ckpt: Checkpoint, visual: VisualSession, device: torch.device):
        # no PyTorch CNN: holding one would keep it alive for nothing
        super().__init__(name, ckpt, None, device)
        self.visual = visual
        self.providers = visual.providers

    @property
    def on_gpu(self) -> bool:
        """Whether the CNN runs on ONNX Runtime's CUDA provider (the decoder follows ``device``)."""
        return self.visual.on_gpu

    def grid_features(self, batch: list[Prepared]) -> torch.Tensor:
        # on the CUDA provider: pinned and copied asynchronously to the GPU, then bound; otherwise host memory
        return self.run_cnn(batch, self.visual.features, on_device=self.visual.on_gpu).to(self.device)


def check_images(count: int = CHECK_IMAGES) -> list[Image.Image]:
    """Generated check images for ``auto``: coloured shapes on textured backgrounds, the same on every start."""
    rng = np.random.default_rng(20240)
    images = []
    for _ in range(count):
        width, height = (int(v) for v in rng.integers(200, 400, 2))
        base = rng.integers(0, 256, 3)
        noise = rng.normal(0, 20, (height, width, 3))
        image = Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8))
        draw = ImageDraw.Draw(image)
        for _ in range(int(rng.integers(1, 4))):
            x1, y1 = int(rng.integers(0, width // 2)), int(rng.integers(0, height // 2))
            x2, y2 = x1 + int(rng.integers(30, width // 2)), y1 + int(rng.integers(30, height // 2))
            shape = draw.ellipse if rng.random() < 0.5 else draw.rectangle
            shape((x1, y1, x2, y2), fill=tuple(int(c) for c in rng.integers(0, 256, 3)))
        images.append(image)
    return images


def check_captions(runtime: Runtime, prepared: list[Prepared]) -> list[list[int]]:
    """The token ids ``runtime`` gives the check set (beam ``CHECK_BEAM``, ``CHECK_MAX_LEN`` tokens)."""
    return [result.hypothesis.token_ids for result in runtime.caption(prepared, CHECK_BEAM, CHECK_MAX_LEN)]


class SharedEncoders:
    """The frozen encoder of each :class:`~captioner.models.encoder.EncoderSpec`, made on first use and shared by
    every model with that spec: the PyTorch module (``torch`` backend, exports, the check set's reference) and the
    ONNX Runtime session of its ``visual.onnx`` (``onnx`` and ``hybrid`` backends).  A server whose models all run
    their CNN on ONNX Runtime, with current exports, never builds the PyTorch one — nor imports timm, which brings
    torchvision and ``torch._dynamo`` (about 190 MB resident)."""

    def __init__(self, device: torch.device, onnx_dir: Path, threads: int | None, precision: str = "float32"):
        self.device, self.onnx_dir, self.threads = device, Path(onnx_dir), threads
        self.precision = precision  # of the ONNX CNN: float32, or int8 (models/export/quantize.py)
        self._torch: dict[str, GridEncoder] = {}
        self._onnx: dict[str, VisualSession] = {}

    def pytorch(self, spec: EncoderSpec) -> GridEncoder:
        key = repr(spec)
        if key not in self._torch:
            self._torch[key] = grid_encoder(spec, self.device)
        return self._torch[key]

    def for_export(self, spec: EncoderSpec) -> GridEncoder | None:
        """The PyTorch encoder for the exporter, which traces on the CPU (None on a GPU: it builds its own)."""
        return self.pytorch(spec) if self.device.type == "cpu" else None

    def onnx(self, spec: EncoderSpec) -> VisualSession:
        from captioner.models.export.quantize import visual_encoder_file

        key = repr(spec)
        if key not in self._onnx:
            path = visual_encoder_file(spec, self.onnx_dir, self.precision, lambda: self.for_export(spec))
            self._onnx[key] = VisualSession(path, self.device, self.threads)
        return self._onnx[key]


def drop_torch_weights(runtime: Runtime) -> None:
    """Free the PyTorch weights of a model that ONNX Runtime serves wholly: its parameters and buffers become
    shape-only (meta) tensors, which still answer what :meth:`~captioner.models.inference.Runtime.info` and
    :meth:`~captioner.models.inference.Runtime.result` ask of the model (its configuration and sizes)."""
    runtime.ckpt.model.to("meta")


def reference_record(onnx_dir: Path, checksum: str) -> Path:
    """Where :func:`reference_captions` records PyTorch's captions of the check set for the weights ``checksum``."""
    return Path(onnx_dir) / "reference" / f"{checksum}.json"


def reference_captions(name: str, ckpt: Checkpoint, encoders: SharedEncoders,
                       prepared: list[Prepared]) -> list[list[int]]:
    """PyTorch's token ids on the check set, as recorded in ``onnx_dir/reference/<weights checksum>.json`` when the
    record matches this torch version, device type and check set; otherwise computed (which needs the PyTorch
    encoder) and recorded.  The record is what lets a server with current exports start without the PyTorch CNN."""
    digest = hashlib.sha256()
    for item in prepared:
        digest.update(item.pixels.numpy().tobytes())
    key = {"torch": torch.__version__, "device": encoders.device.type, "beam": CHECK_BEAM, "max_len": CHECK_MAX_LEN,
           "images": digest.hexdigest()}
    record = reference_record(encoders.onnx_dir, ckpt.checksum)
    try:
        data = json.loads(record.read_text())
        if data.get("key") == key:
            return data["token_ids"]
    except (OSError, ValueError, AttributeError, KeyError):
        pass
    want = check_captions(TorchRuntime(name, ckpt, encoders.pytorch(ckpt.encoder), encoders.device), prepared)
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(record, json.dumps({"key": key, "token_ids": want}))  # readers never see half a record
    except OSError as exc:  # a read-only cache: computed again at the next start
        log.info("%s: cannot record the check set's reference captions (%s)", name, exc)
    return want


def check_seconds(runtime: Runtime, prepared: list[Prepared], repeats: int = 2) -> float:
    """Seconds ``runtime`` takes to caption the check set, best of ``repeats`` after its first (verifying) run,
    between device synchronisations."""
    timings = []
    for _ in range(repeats):
        runtime.synchronize()
        started = time.perf_counter()
        check_captions(runtime, prepared)
        runtime.synchronize()
        timings.append(time.perf_counter() - started)
    return min(timings)


def fastest_verified(name: str, ckpt: Checkpoint, encoders: SharedEncoders, threads: int | None,
                     measure: bool | None = None) -> Runtime:
    """``auto``: among the backends whose captions equal PyTorch's on the check set (an export that cannot be made
    or disagrees is logged and skipped), the fastest.  On a CPU that is ONNX Runtime for the whole model, else the
    hybrid, else PyTorch, in that order (measured once: docs/benchmarks/serving.md, ONNX Runtime's CNN is markedly
    faster); on a GPU (``measure``, default: the device is CUDA) nothing is known in advance, so every verified
    backend and PyTorch caption the check set again, timed (:func:`check_seconds`), and the fastest serves.  A
    model served by ONNX Runtime alone has its PyTorch weights dropped."""
    from captioner.models.export.onnx import ExportUnsupported

    device = encoders.device
    measure = device.type == "cuda" if measure is None else measure
    if device.type == "cuda" and _providers(device)[0] != "CUDAExecutionProvider":
        # ONNX Runtime without its CUDA provider would run the CNN on the CPU beside an idle GPU
        log.info("%s: ONNX Runtime has no CUDA execution provider here; PyTorch on %s", name, device)
        return TorchRuntime(name, ckpt, encoders.pytorch(ckpt.encoder), device)
    prepared = [Prepared(*preprocess(image, ckpt.encoder)) for image in check_images()]
    if encoders.precision == "int8":
        # an int8 CNN changes features, so PyTorch's float captions are no reference for the decoder graphs: they
        # must equal the PyTorch decoder's on the same int8 features (what int8 costs in accuracy is measured by
        # `captioner eval --encoder-precision int8`, docs/benchmarks/int8.md)
        want = check_captions(HybridRuntime(name, ckpt, encoders.onnx(ckpt.encoder), device), prepared)
    else:
        want = reference_captions(name, ckpt, encoders, prepared)
    candidates = (("onnx", lambda: OnnxRuntime(name, ckpt, onnx_folder(encoders, name, ckpt), device, threads,
                                               encoders.onnx(ckpt.encoder))),
                  ("hybrid", lambda: HybridRuntime(name, ckpt, encoders.onnx(ckpt.encoder), device)))
    verified: list[Runtime] = []
    for backend, make in candidates:
        try:
            runtime = make()
            if device.type == "cuda" and not runtime.on_gpu:  # the CUDA provider failed to load (cuDNN missing)
                raise NoCudaProvider(backend)
            same = check_captions(runtime, prepared) == want
        except NoCudaProvider:
            log.warning("%s: ONNX Runtime fell back to its CPU provider; no %s backend", name, backend)
            continue
        except ExportUnsupported as exc:
            log.info("%s: no %s backend (%s)", name, backend, str(exc).splitlines()[0] if str(exc) else exc)
            continue
        except Exception:  # noqa: BLE001 — ONNX Runtime's own errors (a corrupt export, a graph it cannot load,
            # memory) derive from Exception alone; `auto` serves what verifies, so a backend that fails is skipped
            log.warning("%s: the %s backend failed to load or run; not used", name, backend, exc_info=True)
            continue
        if not same:
            log.warning("%s: the %s backend's captions differ from PyTorch's on the check set; not used", name,
                        backend)
        elif not measure:
            return _serving(runtime)
        else:
            verified.append(runtime)
    pytorch = TorchRuntime(name, ckpt, encoders.pytorch(ckpt.encoder), device)
    if not verified:
        return pytorch
    check_captions(pytorch, prepared)  # its first run (kernel selection, allocator growth) is not timed
    seconds = {runtime: check_seconds(runtime, prepared) for runtime in (*verified, pytorch)}
    fastest = min(seconds, key=seconds.get)
    log.info("%s: %s backend, the fastest on the check set (%s)", name, fastest.backend,
             ", ".join(f"{runtime.backend} {1000 * t:.0f} ms" for runtime, t in seconds.items()))
    return _serving(fastest)


def _serving(runtime: Runtime) -> Runtime:
    """``runtime``, which will serve its model: ONNX Runtime alone needs no PyTorch weights."""
    if runtime.backend == "onnx":
        drop_torch_weights(runtime)
    return runtime


_NUMPY_DTYPES = {torch.float32: np.float32, torch.float16: np.float16, torch.int64: np.int64, torch.int32: np.int32,
                 torch.bool: np.bool_}


def onnx_folder(encoders: SharedEncoders, name: str, ckpt: Checkpoint) -> Path:
    """Where the ONNX export of checkpoint ``name`` lives (exported now when missing or made from other weights)."""
    from captioner.models.export.onnx import check_exportable, export_graphs, export_is_current

    folder = encoders.onnx_dir / name
    if not export_is_current(folder, ckpt.checksum):
        check_exportable(ckpt.model)  # before the PyTorch encoder is built for nothing
        log.info("exporting %s to ONNX in %s", name, folder)
        cpu = load_checkpoint(ckpt.path, "cpu") if next(ckpt.model.parameters()).device.type != "cpu" else ckpt
        export_graphs(cpu, folder, encoders.for_export(ckpt.encoder))
    return folder


def load_runtimes(weights_dir: Path | None, extra: list[Path], *, device_name: str = "auto",
                  backends: dict[str, str] | None = None, default_backend: str = "torch",
                  onnx_dir: Path = Path(".cache/onnx"), threads: int | None = None, precision: str = "float32",
                  encoder_precision: str = "float32", prefixed: dict[str, Path] | None = None,
                  only: Collection[str] | None = None) -> dict[str, Runtime]:
    """Every checkpoint as a runtime, named as :func:`find_checkpoints` names them (``prefixed``: name prefix → folder
    of checkpoints; ``only``: just these names); ``backends`` picks ``torch``, ``onnx``, ``hybrid`` or ``auto`` per
    model name (``default_backend`` for the rest).  A model that cannot be exported falls back to the PyTorch backend
    with an error in the log (``auto`` picks quietly: see :func:`fastest_verified`).  A ``precision`` other than float32
    is a PyTorch autocast option: those models run on PyTorch whatever their backend setting.  ``encoder_precision``
    ``int8`` runs the ONNX CNN quantized (``onnx``, ``hybrid`` and ``auto``; PyTorch models keep their float CNN).
    The settings are keywords: several are strings, which a call by position could swap in silence."""
    device = resolve_device(device_name)
    encoders = SharedEncoders(device, onnx_dir, threads, encoder_precision)
    runtimes: dict[str, Runtime] = {}

    def replaced(name: str, winner: Path, loser: Path) -> None:
        log.warning("model %r is %s; %s, named the same, is not served", name, winner, loser)

    for name, path in find_checkpoints(weights_dir, extra, prefixed, on_replaced=replaced).items():
        if only is not None and name not in only:
            continue
        try:
            ckpt = load_checkpoint(path, device)
            ckpt.check_reads_images()
        except (CheckpointError, KeyError, RuntimeError, OSError, TypeError, ValueError) as exc:
            # a damaged folder is named in one line; anything else may be a bug, so its traceback comes along
            log.error("skipping checkpoint %s: %s", path, exc, exc_info=not isinstance(exc, CheckpointError))
            continue
        backend = _chosen_backend(name, (backends or {}).get(name, default_backend), precision, encoder_precision)
        if backend == "auto":
            runtime = fastest_verified(name, ckpt, encoders, threads)
        else:
            runtime = _on_onnx_runtime(name, ckpt, backend, encoders, threads) if backend != "torch" else None
            runtime = runtime or TorchRuntime(name, ckpt, encoders.pytorch(ckpt.encoder), device, precision)
        runtimes[name] = runtime
        log.info("loaded %s (%s) from %s: %s backend on %s (%s)", name, ckpt.model.arch, path, runtime.backend, device,
                 ", ".join(runtime.providers or [precision]))
    return runtimes


def _chosen_backend(name: str, asked: str, precision: str, encoder_precision: str) -> str:
    """The backend ``name`` runs on: the one asked for, except that an autocast ``precision`` runs on PyTorch; a
    setting that cannot apply is said in the log."""
    if precision != "float32":
        if asked not in ("torch", "auto"):
            log.warning("%s: precision %s runs on PyTorch (the %s backend is float32 only)", name, precision, asked)
        asked = "torch"
    if encoder_precision != "float32" and asked == "torch":
        log.warning("%s: encoder precision %s applies to the ONNX Runtime CNN; the torch backend keeps float32",
                    name, encoder_precision)
    return asked


def _on_onnx_runtime(name: str, ckpt: Checkpoint, backend: str, encoders: SharedEncoders,
                     threads: int | None) -> Runtime | None:
    """``ckpt`` on ONNX Runtime (``hybrid``: its CNN only, the decoder on PyTorch), or None, with the reason in the
    log, where it cannot run there: the caller serves it with PyTorch."""
    from captioner.models.export.onnx import ExportUnsupported

    part = "its visual encoder" if backend == "hybrid" else "it"
    try:
        if backend == "hybrid":
            return HybridRuntime(name, ckpt, encoders.onnx(ckpt.encoder), encoders.device)
        runtime = OnnxRuntime(name, ckpt, onnx_folder(encoders, name, ckpt), encoders.device, threads,
                              encoders.onnx(ckpt.encoder))
        drop_torch_weights(runtime)
        return runtime
    except (ExportUnsupported, NoCudaProvider) as exc:
        log.error("%s: ONNX Runtime cannot run %s (%s); serving it with PyTorch", name, part, exc)
    except Exception:  # noqa: BLE001 — ONNX Runtime's errors derive from Exception alone (see above)
        log.error("%s: ONNX Runtime failed to load %s; serving it with PyTorch", name, part, exc_info=True)
    return None


def unprepared(weights_dir: Path | None, extra: list[Path], *, onnx_dir: Path,
               prefixed: dict[str, Path] | None = None, backends: dict[str, str] | None = None,
               default_backend: str = "auto", encoder_precision: str = "float32") -> list[str]:
    """The models whose start on ONNX Runtime still has something to make, read from disk without loading a
    checkpoint (the weights' sha256 from each manifest): the shared CNN's graph and the model's own export, each
    current and intact, and for ``auto`` PyTorch's reference captions of the check set as well
    (:func:`reference_captions`).  Their start exports graphs and runs the PyTorch CNN.  Models on the ``torch``
    backend have nothing to prepare; ``hybrid`` needs only the CNN's graph."""
    names = []
    for name, path in find_checkpoints(weights_dir, extra, prefixed).items():
        backend = (backends or {}).get(name, default_backend)
        if backend != "torch" and not _prepared(name, path, backend, Path(onnx_dir), encoder_precision):
            names.append(name)
    return names


def _prepared(name: str, path: Path, backend: str, onnx_dir: Path, encoder_precision: str) -> bool:
    from captioner.models.export.onnx import export_is_current, intact, visual_encoder_path
    from captioner.models.export.quantize import INT8_FILE

    checksum = recorded_checksum(path)
    if not checksum or (backend == "auto" and not reference_record(onnx_dir, checksum).is_file()):
        return False
    try:
        spec = resolve_encoder_weights(read_config(path)["encoder"], path)
    except (CheckpointError, KeyError, TypeError, ValueError):
        return True  # a damaged checkpoint: load_runtimes names it and skips it, a child would only do the same
    visual = visual_encoder_path(spec, onnx_dir)
    if encoder_precision == "int8":
        visual = visual.with_name(INT8_FILE)
    export = onnx_dir / name
    # ``auto`` has recorded its references, so what has no folder could not be exported (a TVmax decoder, a CNN
    # the tracer cannot record) and is served without it: only what exists must be intact
    optional = backend == "auto"
    if not (intact(visual) or optional and not visual.parent.exists()):
        return False
    return backend == "hybrid" or export_is_current(export, checksum) or optional and not export.exists()


def prepare_in_child(weights_dir: Path | None, extra: list[Path], *, only: Collection[str] | None = None,
                     **settings) -> None:
    """:func:`load_runtimes` with these arguments in a spawned child process, for the models ``only`` names (the
    :func:`unprepared` ones; all where None), which makes their ONNX exports and reference records and exits: the
    server's own process then starts as on any later start, without the PyTorch CNN, the exporter's tracing or the
    heap they leave fragmented (six Flickr8k models: 1,097 MiB resident after
    warm-up on a first start in the process, 847 MiB on later starts; docs/decisions.md, "First start in a child
    process").  A child that fails leaves the work to the server's own load, as before."""
    child = multiprocessing.get_context("spawn").Process(target=load_runtimes, args=(weights_dir, extra),
                                                         kwargs={**settings, "only": only}, name="captioner-prepare")
    child.start()
    child.join()
    if child.exitcode != 0:
        log.warning("preparing the ONNX exports in a child process failed (exit code %s); preparing them here",
                    child.exitcode)
