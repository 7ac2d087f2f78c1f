"""Runtime: loaded checkpoints on a device, behind one small interface the batcher drives.

A :class:`ModelRuntime` turns preprocessed images into rows of encoder and decoder state (:meth:`begin`) and
advances rows by one decoding step (:meth:`step`), with either backend:

* ``torch``: the model's own protocol methods (``encode`` / ``init_state`` / ``step``) and the frozen
  :class:`~models.encoder.GridEncoder`, shared by every model with the same :class:`~models.encoder.EncoderSpec`;
* ``onnx``: the graphs of :mod:`models.onnx_export` on ONNX Runtime (CUDA execution provider when the device is
  CUDA, CPU otherwise), exported at start-up when no current export exists.

This is the only service layer that touches torch; it uses the same preprocessing function as training.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from captioner.models.checkpoint import Checkpoint, CheckpointError, find_checkpoints, load_checkpoint
from captioner.models.decoding import Hypothesis, beam_search, expand_rows, never_emitted
from captioner.models.device import resolve_device
from captioner.models.encoder import EncoderSpec, GridEncoder, preprocess
from captioner.models.pipeline import area_boxes_of
from captioner.models.protocol import AttnRecord, DecState, EncState, Geometry, VisualBatch
from captioner.models.vocab import EOS

log = logging.getLogger("captioner.runtime")
BACKENDS = ("torch", "onnx")


@dataclass
class Prepared:
    """An uploaded image after decoding and preprocessing (CPU tensors, ready to batch)."""

    pixels: torch.Tensor
    geometry: Geometry


@dataclass
class CaptionResult:
    model: str
    checkpoint: str
    attention_kind: str
    beam_size: int
    words: list[str]
    hypothesis: Hypothesis
    geometry: Geometry
    #: cell boxes (r1, c1, r2, c2) of the ``areas`` extra, for area-attention models (SPEC §6; decision #39)
    area_boxes: np.ndarray | None = None

    def to_json(self) -> dict[str, Any]:
        hyp = self.hypothesis
        tokens = self.words + ([EOS] if hyp.ended_with_eos else [])
        return {
            "model": self.model,
            "checkpoint": self.checkpoint,
            "beam_size": self.beam_size,
            "caption": " ".join(self.words),
            "tokens": tokens,
            "is_eos": hyp.is_eos,
            "token_logprobs": [round(v, 5) for v in hyp.token_logprobs],
            "score": round(hyp.score, 5),
            "geometry": self.geometry.to_json(),
            "attention": _rows(hyp.attention),
            "attention_kind": self.attention_kind,
            "extras": {name: _rows(value) for name, value in hyp.extras.items()},
            **({"area_boxes": self.area_boxes.tolist()} if self.area_boxes is not None else {}),
        }


def _rows(values: torch.Tensor) -> list:
    # 6 decimals keep rows summing to 1 within 1e-5 while exact zeros (sparsemax, TVmax) stay exactly 0.0
    return torch.round(values.float(), decimals=6).tolist()


class ModelRuntime:
    """One checkpoint on one device with the PyTorch backend (the ONNX backend subclasses it)."""

    backend = "torch"

    def __init__(self, name: str, ckpt: Checkpoint, encoder: GridEncoder, device: torch.device):
        self.name, self.ckpt, self.encoder, self.device = name, ckpt, encoder, device
        model = ckpt.model
        self.bos_id, self.eos_id = model.bos_id, model.eos_id
        self.never_emitted = never_emitted(model)

    @property
    def spec(self) -> EncoderSpec:
        return self.ckpt.encoder

    def describe(self) -> dict[str, Any]:
        model = self.ckpt.model
        return {"name": self.name, "architecture": model.arch, "attention_kind": model.attention_kind,
                "attention": getattr(model, "attention_name", model.config().get("attention", "softmax")),
                "vocab_size": len(self.ckpt.vocab), "checksum": f"sha256:{self.ckpt.checksum}",
                "encoder": self.spec.to_json(), "parameters": sum(p.numel() for p in model.parameters()),
                "device": str(self.device), "backend": self.backend}

    def prepare(self, image: Image.Image) -> Prepared:
        pixels, geometry = preprocess(image, self.spec)
        return Prepared(pixels, geometry)

    def _pixels(self, batch: list[Prepared]) -> torch.Tensor:
        pixels = torch.stack([p.pixels for p in batch])
        if self.device.type == "cuda":
            # page-locked host memory lets the copy run asynchronously with the work already queued on the GPU
            return pixels.pin_memory().to(self.device, non_blocking=True)
        return pixels

    # -- what the batcher calls ---------------------------------------------------------------------------
    @torch.inference_mode()
    def begin(self, batch: list[Prepared], widths: list[int]) -> tuple[EncState, DecState]:
        """Encode a batch of images; image ``i`` gets ``widths[i]`` rows of encoder and decoder state.

        Same order of operations as :func:`models.decoding.beam_search`: encode, expand, then init_state.
        """
        feats = self.encoder(self._pixels(batch).contiguous(memory_format=torch.channels_last))
        model = self.ckpt.model
        enc = expand_rows(model.encode(VisualBatch.from_features(feats, [p.geometry for p in batch])), widths)
        return enc, model.init_state(enc)

    @torch.inference_mode()
    def step(self, prev: torch.Tensor, state: DecState, enc: EncState) -> tuple[torch.Tensor, DecState, AttnRecord]:
        return self.ckpt.model.step(prev, state, enc)

    def result(self, hyp: Hypothesis, geometry: Geometry, beam_size: int) -> CaptionResult:
        return CaptionResult(self.name, str(self.ckpt.path), self.ckpt.model.attention_kind, beam_size,
                             self.ckpt.vocab.decode(hyp.token_ids), hyp, geometry,
                             area_boxes_of(self.ckpt.model, hyp, geometry))

    # -- reference path -------------------------------------------------------------------------------------
    @torch.inference_mode()
    def caption(self, batch: list[Prepared], beam_size: int, max_len: int) -> list[CaptionResult]:
        """Caption a fixed batch with :func:`models.decoding.beam_search` (no continuous batching)."""
        feats = self.encoder(self._pixels(batch).contiguous(memory_format=torch.channels_last))
        vis = VisualBatch.from_features(feats, [p.geometry for p in batch])
        return [self.result(hyps[0], prepared.geometry, beam_size)
                for prepared, hyps in zip(batch, beam_search(self.ckpt.model, vis, k=beam_size, max_len=max_len))]


class OnnxModelRuntime(ModelRuntime):
    """The same interface on ONNX Runtime sessions of the exported encoder and step graphs."""

    backend = "onnx"

    def __init__(self, name: str, ckpt: Checkpoint, folder: Path, device: torch.device, threads: int | None = None):
        import onnxruntime as ort

        from captioner.models.export.onnx import ENCODER_FILE, STEP_FILE, GraphSpec

        super().__init__(name, ckpt, encoder=None, device=device)  # type: ignore[arg-type]
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

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "providers": self.providers}

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
        values = self._run(self.encoder_session, {"pixels": self._pixels(batch)}, names)
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

    def caption(self, batch: list[Prepared], beam_size: int, max_len: int) -> list[CaptionResult]:
        raise NotImplementedError("the ONNX backend decodes only through the batcher")


_NUMPY_DTYPES = {torch.float32: np.float32, torch.float16: np.float16, torch.int64: np.int64, torch.int32: np.int32,
                 torch.bool: np.bool_}


def discover_checkpoints(weights_dir: Path, extra: list[Path]) -> dict[str, Path]:
    """Checkpoint folders by name: every child of ``weights_dir`` that holds a checkpoint, plus ``extra``."""
    return find_checkpoints(weights_dir, extra)


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
                  threads: int | None = None) -> dict[str, ModelRuntime]:
    """Every checkpoint as a runtime; ``backends`` picks ``torch`` or ``onnx`` per model name (default for the
    rest).  A model that cannot be exported falls back to the PyTorch backend with an error in the log."""
    from captioner.models.export.onnx import ExportUnsupported

    device = resolve_device(device_name)
    backends = backends or {}
    encoders: dict[str, GridEncoder] = {}
    runtimes: dict[str, ModelRuntime] = {}
    for name, path in discover_checkpoints(weights_dir, extra).items():
        try:
            ckpt = load_checkpoint(path, device)
        except (CheckpointError, KeyError, RuntimeError, OSError, TypeError, ValueError) as exc:
            log.error("skipping checkpoint %s: %s", path, exc)
            continue
        backend = backends.get(name, default_backend)
        if backend == "onnx":
            try:
                runtimes[name] = OnnxModelRuntime(name, ckpt, onnx_folder(onnx_dir, name, ckpt), device, threads)
                log.info("loaded %s (%s) from %s on ONNX Runtime %s", name, ckpt.model.arch, path,
                         runtimes[name].providers[0])
                continue
            except ExportUnsupported as exc:
                log.error("%s cannot run on ONNX Runtime (%s); serving it with PyTorch", name, exc)
        key = repr(ckpt.encoder)
        if key not in encoders:
            # channels-last convolutions are markedly faster on CPU (oneDNN) and on tensor cores
            encoders[key] = GridEncoder(ckpt.encoder).to(device).to(memory_format=torch.channels_last)
        runtimes[name] = ModelRuntime(name, ckpt, encoders[key], device)
        log.info("loaded %s (%s) from %s on %s", name, ckpt.model.arch, path, device)
    return runtimes
