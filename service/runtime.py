"""Runtime: loaded checkpoints on a device, turning preprocessed images into captions with attention.

This is the only service layer that touches torch.  It shares one frozen visual encoder between all models
that use the same :class:`~models.encoder.EncoderSpec`, and uses the same preprocessing function as training.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from models.checkpoint import Checkpoint, CheckpointError, is_checkpoint, load_checkpoint
from models.decoding import Hypothesis, beam_search
from models.device import resolve_device
from models.encoder import EncoderSpec, GridEncoder, preprocess
from models.protocol import Geometry, VisualBatch
from models.vocab import EOS

log = logging.getLogger("captioner.runtime")


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
        }


def _rows(values: torch.Tensor) -> list:
    # 6 decimals keep rows summing to 1 within 1e-5 while exact zeros (sparsemax, TVmax) stay exactly 0.0
    return torch.round(values.float(), decimals=6).tolist()


class ModelRuntime:
    def __init__(self, name: str, ckpt: Checkpoint, encoder: GridEncoder, device: torch.device):
        self.name, self.ckpt, self.encoder, self.device = name, ckpt, encoder, device

    @property
    def spec(self) -> EncoderSpec:
        return self.ckpt.encoder

    def describe(self) -> dict[str, Any]:
        model = self.ckpt.model
        return {"name": self.name, "architecture": model.arch, "attention_kind": model.attention_kind,
                "attention": getattr(model, "attention_name", "softmax"), "vocab_size": len(self.ckpt.vocab),
                "checksum": f"sha256:{self.ckpt.checksum}", "encoder": self.spec.to_json(),
                "parameters": sum(p.numel() for p in model.parameters()), "device": str(self.device)}

    def prepare(self, image: Image.Image) -> Prepared:
        pixels, geometry = preprocess(image, self.spec)
        return Prepared(pixels, geometry)

    @torch.inference_mode()
    def encode(self, batch: list[Prepared]) -> torch.Tensor:
        pixels = torch.stack([p.pixels for p in batch]).to(self.device, non_blocking=True)
        return self.encoder(pixels)

    @torch.inference_mode()
    def caption(self, batch: list[Prepared], beam_size: int, max_len: int) -> list[CaptionResult]:
        feats = self.encode(batch)
        vis = VisualBatch.from_features(feats, [p.geometry for p in batch])
        results = []
        for prepared, hyps in zip(batch, beam_search(self.ckpt.model, vis, k=beam_size, max_len=max_len)):
            best = hyps[0]
            results.append(CaptionResult(self.name, str(self.ckpt.path), self.ckpt.model.attention_kind, beam_size,
                                         self.ckpt.vocab.decode(best.token_ids), best, prepared.geometry))
        return results


def discover_checkpoints(weights_dir: Path, extra: list[Path]) -> dict[str, Path]:
    """Checkpoint folders by name: every child of ``weights_dir`` that holds a checkpoint, plus ``extra``."""
    found: dict[str, Path] = {}
    candidates = sorted(p for p in weights_dir.iterdir() if p.is_dir()) if weights_dir.is_dir() else []
    for path in [*candidates, *extra]:
        if is_checkpoint(path):
            found[path.name] = path
    return found


def load_runtimes(weights_dir: Path, extra: list[Path], device_name: str = "auto") -> dict[str, ModelRuntime]:
    device = resolve_device(device_name)
    encoders: dict[str, GridEncoder] = {}
    runtimes = {}
    for name, path in discover_checkpoints(weights_dir, extra).items():
        try:
            ckpt = load_checkpoint(path, device)
        except (CheckpointError, KeyError, RuntimeError, OSError) as exc:
            log.error("skipping checkpoint %s: %s", path, exc)
            continue
        key = repr(ckpt.encoder)
        if key not in encoders:
            encoders[key] = GridEncoder(ckpt.encoder).to(device)
        runtimes[name] = ModelRuntime(name, ckpt, encoders[key], device)
        log.info("loaded %s (%s) from %s on %s", name, ckpt.model.arch, path, device)
    return runtimes
