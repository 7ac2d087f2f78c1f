"""The ONNX Runtime backends of the served models, behind the :class:`~captioner.models.inference.Runtime`
interface the batcher drives:

* :class:`OnnxRuntime` (backend ``onnx``): the graphs of :mod:`captioner.models.export.onnx` on ONNX Runtime (CUDA
  execution provider when the device is CUDA, CPU otherwise);
* :class:`HybridRuntime` (backend ``hybrid``): the frozen CNN alone on ONNX Runtime and the model on PyTorch, for
  models whose decoder step cannot be exported (TVmax's data-dependent solver) — on a CPU the CNN is most of the cost;
* :class:`VisualSession`: the frozen CNN's ``visual.onnx`` session, one per encoder spec, through which both run
  their images (:class:`~captioner.service.shared_encoders.SharedEncoders` makes and shares it).

Also what their sessions share: the session options, the execution providers and :func:`run_session` (torch tensors
in and out, bound on the GPU); and :func:`drop_torch_weights`, for a model ONNX Runtime serves wholly.  Which backend
serves a model is :mod:`captioner.service.backend_choice`'s business; where the graphs come from,
:mod:`captioner.service.onnx_exports`'s.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from captioner.models.checkpoint import Checkpoint
from captioner.models.decoding import expand_rows
from captioner.models.export.sessions import session_options
from captioner.models.inference import Prepared, Runtime, TorchRuntime
from captioner.models.protocol import AttnRecord, DecState, EncState, index_rows


class NoCudaProvider(RuntimeError):
    """The device is CUDA but ONNX Runtime cannot run there (the ``onnxruntime`` package without CUDA, or its CUDA
    provider failed to load): a whole-model ONNX runtime would hand GPU tensors to a CPU session."""


def _providers(device: torch.device) -> list:
    import onnxruntime as ort

    if device.type == "cuda" and "CUDAExecutionProvider" in ort.get_available_providers():
        return [("CUDAExecutionProvider", {"device_id": device.index or 0}), "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def cuda_provider_available(device: torch.device) -> bool:
    """Whether ONNX Runtime offers its CUDA execution provider for ``device`` (a CUDA device, and an ``onnxruntime``
    package built with CUDA): the provider its sessions there are asked to run on first."""
    first = _providers(device)[0]  # a provider is a name, or (name, options)
    return (first[0] if isinstance(first, tuple) else first) == "CUDAExecutionProvider"


class VisualSession:
    """The frozen CNN of one encoder spec on ONNX Runtime (``visual.onnx``: pixels → grid features), shared by
    every model with that spec."""

    def __init__(self, path: Path, device: torch.device, threads: int | None = None):
        import onnxruntime as ort

        self.device, self.path = device, Path(path)
        self.session = ort.InferenceSession(str(path), session_options(threads), providers=_providers(device))
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

    def __init__(self, name: str, ckpt: Checkpoint, folder: str | Path, device: torch.device | str,
                 threads: int | None = None, visual: VisualSession | None = None):
        import onnxruntime as ort

        from captioner.models.export.onnx import ENCODER_FILE, HEAD_FILE, STEP_FILE, GraphSpec

        folder, device = Path(folder), torch.device(device)
        super().__init__(name, ckpt, device)
        self.graphs = GraphSpec.load(folder)
        if self.graphs.checksum != ckpt.checksum:  # the graphs would caption, under this checkpoint's name
            raise ValueError(f"{folder} was exported from other weights ({self.graphs.checksum}) than {ckpt.path} "
                             f"({ckpt.checksum}): export this checkpoint (captioner export)")
        self.folder = folder
        self.visual = visual
        options, providers = session_options(threads), _providers(device)
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


_NUMPY_DTYPES = {torch.float32: np.float32, torch.float16: np.float16, torch.int64: np.int64, torch.int32: np.int32,
                 torch.bool: np.bool_}


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


def drop_torch_weights(runtime: Runtime) -> None:
    """Free the PyTorch weights of a model that ONNX Runtime serves wholly: its parameters and buffers become
    shape-only (meta) tensors, which still answer what :meth:`~captioner.models.inference.Runtime.info` and
    :meth:`~captioner.models.inference.Runtime.result` ask of the model (its configuration and sizes)."""
    runtime.ckpt.model.to("meta")
