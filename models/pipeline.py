"""Image files → captions with attention, in one call: the CLI's path (``captioner caption``).

A thin wrapper over :class:`~captioner.models.inference.TorchRuntime`: the same ``prepare`` / ``begin`` / ``step`` /
``reorder`` / ``result`` steps the service's batcher drives, here over one fixed batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from .checkpoint import Checkpoint
from .decoding import DecodingRules, Hypothesis
from .encoder import load_image
from .inference import CaptionResult, torch_runtime
from .protocol import Geometry


@dataclass
class Captioned:
    """A caption together with the image it describes (the CLI draws overlays on it)."""

    image: Image.Image
    result: CaptionResult

    @property
    def words(self) -> list[str]:
        return self.result.words

    @property
    def tokens(self) -> list[str]:
        return self.result.tokens

    @property
    def hypothesis(self) -> Hypothesis:
        return self.result.hypothesis

    @property
    def geometry(self) -> Geometry:
        return self.result.geometry

    @property
    def area_boxes(self) -> np.ndarray | None:
        """Cell boxes of the ``areas`` extra (area-attention models only)."""
        return self.result.area_boxes

    @property
    def default_mode(self) -> str:
        return self.result.default_mode

    def drawn_rows(self, mode: str) -> np.ndarray:
        return self.result.drawn_rows(mode)


class Pipeline:
    def __init__(self, checkpoint: str | Path | Checkpoint, device: str | torch.device = "cpu"):
        self.runtime = torch_runtime(checkpoint, device)
        self.ckpt = self.runtime.ckpt

    def __call__(self, sources: list[str | Path | bytes | Image.Image], beam_size: int = 3,
                 max_len: int = 20, rules: DecodingRules | None = None) -> list[Captioned]:
        """Caption ``sources``; ``rules`` default to the checkpoint's own (``Runtime.default_rules``)."""
        images = [load_image(s) for s in sources]
        results = self.runtime.caption([self.runtime.prepare(image) for image in images], beam_size, max_len,
                                       self.runtime.default_rules if rules is None else rules)
        return [Captioned(image, result) for image, result in zip(images, results)]
