"""Image files → captions with attention, in one call: the CLI's path (``captioner caption``).

A thin wrapper over :class:`~captioner.models.inference.TorchRuntime`: the same ``prepare`` / ``begin`` / ``step`` /
``reorder`` / ``result`` steps the service's batcher drives, here over one fixed batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from .checkpoint import Checkpoint
from .decoding import DecodingRules
from .images import load_image
from .inference import CaptionResult, torch_runtime


class Pipeline:
    """Caption image files with one checkpoint, in-process: what ``captioner caption`` and the commands that caption
    photos (``resolution-check``, the grounding example figure) use, and the Python entry point.

    It holds one :class:`~captioner.models.inference.TorchRuntime` (the checkpoint's model and frozen encoder on
    ``device``) and runs the runtime's own preprocessing and beam search over a whole list at once: the steps the
    service's batcher drives over requests as they come.  It implements no paper equation (the models do).
    """

    def __init__(self, checkpoint: str | Path | Checkpoint, device: str | torch.device = "cpu"):
        self.runtime = torch_runtime(checkpoint, device)
        self.ckpt = self.runtime.ckpt

    def __call__(self, sources: Sequence[str | Path | bytes | Image.Image | np.ndarray], beam_size: int = 3,
                 max_len: int = 20, rules: DecodingRules | None = None) -> list[CaptionResult]:
        """Caption ``sources``, a list of images (files, their bytes, PIL images or HxWx3 uint8 arrays: pass a decoded
        image to draw on it afterwards); ``rules`` default to the checkpoint's own (``Runtime.default_rules``)."""
        if isinstance(sources, (str, Path, bytes, Image.Image, np.ndarray)):  # a path was captioned letter by letter
            raise TypeError("Pipeline captions a list of images: pipeline([image])")
        if not sources:
            return []
        return self.runtime.caption([self.runtime.prepare(load_image(source)) for source in sources], beam_size,
                                    max_len, self.runtime.default_rules if rules is None else rules)
