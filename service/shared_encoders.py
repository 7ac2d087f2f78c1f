"""The frozen CNN of each :class:`~captioner.models.encoder.EncoderSpec`, once whatever the number of models
(:class:`SharedEncoders`): one ONNX Runtime session of its ``visual.onnx`` for the ``onnx`` and ``hybrid`` backends,
one PyTorch module for the ``torch`` backend, the exporter and the ``auto`` check set's reference, each made only
when some model needs it.  Memory by number of models:
docs/decisions.md#one-cnn-per-encoder-spec-and-no-pytorch-weights-behind-onnx-models.
"""

from __future__ import annotations

from pathlib import Path

import torch

from captioner.models.encoder import EncoderSpec, GridEncoder
from captioner.models.export.sessions import VisualSession
from captioner.models.inference import grid_encoder


class SharedEncoders:
    """The frozen encoder of each :class:`~captioner.models.encoder.EncoderSpec`, made on first use and shared by
    every model with that spec: the PyTorch module (``torch`` backend, exports, the check set's reference) and the
    ONNX Runtime session of its ``visual.onnx`` (``onnx`` and ``hybrid`` backends).  A server whose models all run
    their CNN on ONNX Runtime, with current exports, never builds the PyTorch one."""

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
