"""Image → caption with attention, in one call (the CLI's path; the service batches the same steps)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from .checkpoint import Checkpoint, load_checkpoint
from .decoding import Hypothesis, beam_search
from .encoder import GridEncoder, load_image, preprocess
from .protocol import Captioner, Geometry, VisualBatch


def area_boxes_of(model: Captioner, hyp: Hypothesis, geometry: Geometry) -> np.ndarray | None:
    """The cell boxes that index ``hyp``'s ``areas`` extra (what ``area_topk`` rendering needs), or None."""
    boxes = model.area_boxes(geometry.grid_hw) if "areas" in hyp.extras else None
    return None if boxes is None else boxes.cpu().numpy()


@dataclass
class Captioned:
    image: Image.Image
    words: list[str]
    hypothesis: Hypothesis
    geometry: Geometry
    area_boxes: np.ndarray | None = None  # cell boxes of the ``areas`` extra (area-attention models only)

    @property
    def tokens(self) -> list[str]:
        return self.words + (["<eos>"] if self.hypothesis.ended_with_eos else [])


class Pipeline:
    def __init__(self, checkpoint: str | Path | Checkpoint, device: str | torch.device = "cpu"):
        self.ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else load_checkpoint(checkpoint, device)
        self.device = torch.device(device)
        self.encoder = GridEncoder(self.ckpt.encoder).to(self.device)

    @torch.inference_mode()
    def __call__(self, sources: list[str | Path | bytes | Image.Image], beam_size: int = 3,
                 max_len: int = 20) -> list[Captioned]:
        images = [load_image(s) for s in sources]
        prepared = [preprocess(image, self.ckpt.encoder) for image in images]
        feats = self.encoder(torch.stack([p for p, _ in prepared]).to(self.device))
        vis = VisualBatch.from_features(feats, [g for _, g in prepared])
        hyps = beam_search(self.ckpt.model, vis, k=beam_size, max_len=max_len)
        return [Captioned(image, self.ckpt.vocab.decode(h[0].token_ids), h[0], geometry, area_boxes_of(self.ckpt.model, h[0], geometry))
                for image, h, (_, geometry) in zip(images, hyps, prepared)]
