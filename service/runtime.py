"""Runtimes of the served checkpoints: loading them (:func:`load_runtimes`) and the ONNX Runtime backend.

Every model is served through the :class:`~captioner.models.inference.Runtime` interface the batcher drives, with
either backend, chosen per model name:

* ``torch``: :class:`~captioner.models.inference.TorchRuntime`, the model's own protocol methods and the frozen
  :class:`~captioner.models.encoder.GridEncoder`, shared by every model with the same
  :class:`~captioner.models.encoder.EncoderSpec`;
* ``onnx``: :class:`OnnxRuntime`, the graphs of :mod:`captioner.models.export.onnx` on ONNX Runtime (CUDA execution
  provider when the device is CUDA, CPU otherwise), exported at start-up when no current export exists.

This is the only service layer that touches torch; it uses the same preprocessing function as training.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np
import torch

from captioner.models.checkpoint import Checkpoint, CheckpointError, find_checkpoints, load_checkpoint
from captioner.models.decoding import expand_rows
from captioner.models.device import resolve_device
from captioner.models.encoder import GridEncoder
from captioner.models.inference import ModelInfo, Prepared, Runtime, TorchRuntime, grid_encoder
from captioner.models.protocol import AttnRecord, DecState, EncState, index_rows

log = logging.getLogger("captioner.runtime")
BACKENDS = ("torch", "onnx")


class OnnxRuntime(Runtime):
    """The :class:`~captioner.models.inference.Runtime` interface on ONNX Runtime sessions of the exported encoder
    and step graphs (the PyTorch model is used only for its vocabulary ids and :meth:`info`)."""

    backend = "onnx"

    def __init__(self, name: str, ckpt: Checkpoint, folder: Path, device: torch.device, threads: int | None = None):
        import onnxruntime as ort

        from captioner.models.export.onnx import ENCODER_FILE, STEP_FILE, GraphSpec

        super().__init__(name, ckpt, device)
        self.graphs = GraphSpec.load(folder)
        self.folder = folder
        options = ort.SessionOptions()
        options.log_severity_level = 3
        if threads:
            options.intra_op_num_threads = threads
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if device.type == "cuda" and "CUDAExecutionProvider" in ort.get_available_providers():
            providers: list = [("CUDAExecutionProvider", {"device_id": device.index or 0}), "CPUExecutionProvider"]
        else:
            providers = ["CPUExecutionProvider"]
        self.encoder_session = ort.InferenceSession(str(folder / ENCODER_FILE), options, providers=providers)
        self.step_session = ort.InferenceSession(str(folder / STEP_FILE), options, providers=providers)
        self.providers = self.step_session.get_providers()
        # the tracer drops inputs a graph never reads (e.g. an encoder summary used only by init_state)
        self.step_inputs = [i.name for i in self.step_session.get_inputs()]
        self.on_gpu = self.providers[0] == "CUDAExecutionProvider" and device.type == "cuda"

    def info(self) -> ModelInfo:
        return dataclasses.replace(super().info(), providers=list(self.providers))

    def _run(self, session, inputs: dict[str, torch.Tensor], outputs: list[str]) -> list[torch.Tensor]:
        if not self.on_gpu:
            # CPU: numpy views of torch tensors and back, no copies
            feed = {name: inputs[name].detach().contiguous().numpy() for name in inputs}
            return [torch.from_numpy(np.ascontiguousarray(v)) for v in session.run(outputs, feed)]
        # CUDA: bind device buffers directly, so state never leaves the GPU between steps
        binding = session.io_binding()
        for name, tensor in inputs.items():
            tensor = tensor.contiguous()
            binding.bind_input(name, "cuda", self.device.index or 0, _NUMPY_DTYPES[tensor.dtype], tuple(tensor.shape),
                               tensor.data_ptr())
        for name in outputs:
            binding.bind_output(name, "cuda", self.device.index or 0)
        session.run_with_iobinding(binding)
        return [torch.from_dlpack(value) for value in binding.get_outputs()]

    def begin(self, batch: list[Prepared], widths: list[int]) -> tuple[EncState, DecState]:
        names = self.graphs.encoder_outputs
        values = self._run(self.encoder_session, {"pixels": self.pixels(batch)}, names)
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


_NUMPY_DTYPES = {torch.float32: np.float32, torch.float16: np.float16, torch.int64: np.int64, torch.int32: np.int32,
                 torch.bool: np.bool_}


def onnx_folder(onnx_dir: Path, name: str, ckpt: Checkpoint) -> Path:
    """Where the ONNX export of checkpoint ``name`` lives (exported now when missing or made from other weights)."""
    from captioner.models.export.onnx import export_graphs, export_is_current

    folder = onnx_dir / name
    if not export_is_current(folder, ckpt.checksum):
        log.info("exporting %s to ONNX in %s", name, folder)
        cpu = load_checkpoint(ckpt.path, "cpu") if next(ckpt.model.parameters()).device.type != "cpu" else ckpt
        export_graphs(cpu, folder)
    return folder


def load_runtimes(weights_dir: Path, extra: list[Path], device_name: str = "auto", backends: dict[str, str] | None = None,
                  default_backend: str = "torch", onnx_dir: Path = Path(".cache/onnx"),
                  threads: int | None = None) -> dict[str, Runtime]:
    """Every checkpoint as a runtime; ``backends`` picks ``torch`` or ``onnx`` per model name (default for the
    rest).  A model that cannot be exported falls back to the PyTorch backend with an error in the log."""
    from captioner.models.export.onnx import ExportUnsupported

    device = resolve_device(device_name)
    backends = backends or {}
    encoders: dict[str, GridEncoder] = {}
    runtimes: dict[str, Runtime] = {}
    for name, path in find_checkpoints(weights_dir, extra).items():
        try:
            ckpt = load_checkpoint(path, device)
        except (CheckpointError, KeyError, RuntimeError, OSError, TypeError, ValueError) as exc:
            log.error("skipping checkpoint %s: %s", path, exc)
            continue
        backend = backends.get(name, default_backend)
        if backend == "onnx":
            try:
                runtimes[name] = OnnxRuntime(name, ckpt, onnx_folder(onnx_dir, name, ckpt), device, threads)
                log.info("loaded %s (%s) from %s on ONNX Runtime %s", name, ckpt.model.arch, path,
                         runtimes[name].providers[0])
                continue
            except ExportUnsupported as exc:
                log.error("%s cannot run on ONNX Runtime (%s); serving it with PyTorch", name, exc)
        key = repr(ckpt.encoder)
        if key not in encoders:
            encoders[key] = grid_encoder(ckpt.encoder, device)
        runtimes[name] = TorchRuntime(name, ckpt, encoders[key], device)
        log.info("loaded %s (%s) from %s on %s", name, ckpt.model.arch, path, device)
    return runtimes
