"""The ONNX Runtime backends of the served models, behind the :class:`~captioner.models.inference.Runtime`
interface the batcher drives:

* :class:`OnnxRuntime` (backend ``onnx``): the graphs of :mod:`captioner.models.export.onnx` on ONNX Runtime (CUDA
  execution provider when the device is CUDA, CPU otherwise);
* :class:`HybridRuntime` (backend ``hybrid``): the frozen CNN alone on ONNX Runtime and the model on PyTorch, for
  models whose decoder step cannot be exported (TVmax's data-dependent solver) — on a CPU the CNN is most of the cost;
both run their images through a shared :class:`~captioner.models.export.sessions.VisualSession`, the frozen CNN's
``visual.onnx``, one per encoder spec (:class:`~captioner.service.shared_encoders.SharedEncoders` makes and shares
it). Their sessions are opened and run as every ONNX Runtime session of the project is
(:mod:`captioner.models.export.sessions`). Also :func:`drop_torch_weights`, for a model ONNX Runtime serves
wholly.  Which backend serves a model is :mod:`captioner.service.backend_choice`'s business; where the graphs come from,
:mod:`captioner.service.onnx_exports`'s.
"""

from __future__ import annotations

from pathlib import Path

import torch

from captioner.models.checkpoint import Checkpoint
from captioner.models.decoding import expand_rows
from captioner.models.export.sessions import VisualSession, open_session, run_session, runs_on_gpu
from captioner.models.inference import Prepared, Runtime, TorchRuntime
from captioner.models.protocol import AttnRecord, DecState, EncState, index_rows


class NoCudaProvider(RuntimeError):
    """The device is CUDA but ONNX Runtime cannot run there (the ``onnxruntime`` package without CUDA, or its CUDA
    provider failed to load): a whole-model ONNX runtime would hand GPU tensors to a CPU session."""


class OnnxRuntime(Runtime):
    """The :class:`~captioner.models.inference.Runtime` interface on ONNX Runtime sessions of the exported graphs
    (the PyTorch model is used only for its vocabulary ids and :meth:`info`).  With a shared ``visual`` session the
    images go through it and then this model's ``head.onnx``; without one, through the self-contained
    ``encoder.onnx``, which a server's own exports leave out (:func:`~captioner.service.onnx_exports.onnx_folder`)."""

    backend = "onnx"

    def __init__(self, name: str, ckpt: Checkpoint, folder: str | Path, device: torch.device | str,
                 threads: int | None = None, visual: VisualSession | None = None):
        from captioner.models.export.folder import ENCODER_FILE, SERVED_GRAPHS, STEP_FILE, intact
        from captioner.models.export.onnx import GraphSpec, export_identity

        folder, device = Path(folder), torch.device(device)
        super().__init__(name, ckpt, device)
        self.graphs = GraphSpec.load(folder)
        identity = export_identity(ckpt.checksum, ckpt.encoder)
        if self.graphs.checksum != identity:  # the graphs would caption, under this checkpoint's name
            raise ValueError(f"{folder} was exported from other weights ({self.graphs.checksum}) than {ckpt.path} "
                             f"({identity}): export this checkpoint (captioner export)")
        graphs = (ENCODER_FILE, STEP_FILE) if visual is None else SERVED_GRAPHS
        if visual is None and not (folder / ENCODER_FILE).exists():
            raise ValueError(f"{folder} holds no {ENCODER_FILE} (the service's exports leave it out: they run the "
                             "CNN's shared graph): export this checkpoint with captioner export for a self-contained "
                             "one")
        damaged = [graph for graph in graphs if not intact(folder / graph)]
        if damaged:  # another model's graph copied in, or one cut short, captioned (or failed) under this name
            raise ValueError(f"{folder}: {' and '.join(damaged)} not as its export wrote it (its seal does not "
                             "match: damaged or replaced since): export this checkpoint again (captioner export)")
        self.folder = folder
        self.visual = visual
        self.encoder_session = open_session(folder / graphs[0], device, threads)
        self.step_session = open_session(folder / STEP_FILE, device, threads)
        self.providers = self.step_session.get_providers()
        # the tracer drops inputs a graph never reads (e.g. an encoder summary used only by init_state)
        self.step_inputs = [i.name for i in self.step_session.get_inputs()]
        self.on_gpu = runs_on_gpu(self.step_session, device)
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
