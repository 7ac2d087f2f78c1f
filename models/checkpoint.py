"""The one checkpoint format: a directory with ``model.safetensors`` + ``config.json`` + ``vocab.json``.

No pickle anywhere: weights are safetensors, everything else is JSON.  ``config.json`` records the
architecture name and its constructor arguments, the visual encoder spec (so serving preprocesses exactly as
training did) and free-form metadata (training command, metrics).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from .encoder import EncoderSpec
from .protocol import Captioner
from .zoo import create
from .vocab import Vocabulary

FORMAT = "attention-captioner/1"
WEIGHTS, CONFIG, VOCAB = "model.safetensors", "config.json", "vocab.json"


class CheckpointError(ValueError):
    """A checkpoint directory is missing, incomplete or of an unknown format."""


@dataclass
class Checkpoint:
    model: Captioner
    vocab: Vocabulary
    encoder: EncoderSpec
    path: Path | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    checksum: str = ""

    @property
    def name(self) -> str:
        return self.meta.get("name") or (self.path.name if self.path else self.model.arch)


def save_checkpoint(path: str | Path, model: Captioner, vocab: Vocabulary, encoder: EncoderSpec,
                    meta: dict[str, Any] | None = None) -> Path:
    """Write atomically: files go to a temporary sibling directory that replaces ``path`` in one rename, so an
    interrupted save never destroys the previous checkpoint."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    save_file(state, tmp / WEIGHTS, metadata={"format": FORMAT, "arch": model.arch})
    config = {"format": FORMAT, "arch": model.arch, "model": model.config(), "encoder": encoder.to_json(),
              "special_ids": {"pad_id": model.pad_id, "bos_id": model.bos_id, "eos_id": model.eos_id},
              "meta": meta or {}}
    (tmp / CONFIG).write_text(json.dumps(config, indent=2))
    vocab.save(tmp / VOCAB)
    old = path.with_name(f".{path.name}.old")
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)
    return path


def read_config(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        config = json.loads((path / CONFIG).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is not a checkpoint: {CONFIG} is missing") from None
    if config.get("format") != FORMAT:
        raise CheckpointError(f"{path}: unknown checkpoint format {config.get('format')!r} (expected {FORMAT})")
    return config


def file_checksum(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu") -> Checkpoint:
    """Rebuild the model from ``config.json``, load its weights strictly, and put it in eval mode."""
    path = Path(path)
    config = read_config(path)
    vocab = Vocabulary.load(path / VOCAB)
    model = create(config["arch"], **config["model"], **config.get("special_ids", {}))
    model.load_state_dict(load_file(path / WEIGHTS, device="cpu"), strict=True)
    model.to(device).eval()
    return Checkpoint(model=model, vocab=vocab, encoder=EncoderSpec.from_json(config["encoder"]), path=path,
                      meta=config.get("meta", {}), checksum=file_checksum(path / WEIGHTS))


def is_checkpoint(path: Path) -> bool:
    return (path / CONFIG).is_file() and (path / WEIGHTS).is_file()


def find_checkpoints(weights_dir: str | Path | None, extra: list[str | Path] | tuple = ()) -> dict[str, Path]:
    """Checkpoint folders by name (the folder name): every child of ``weights_dir`` that holds a checkpoint, then
    ``extra`` folders (a later one with the same name wins).  This is how the service and ``captioner export``
    name models."""
    found: dict[str, Path] = {}
    root = Path(weights_dir) if weights_dir else None
    candidates = sorted(p for p in root.iterdir() if p.is_dir()) if root and root.is_dir() else []
    for path in [*candidates, *map(Path, extra)]:
        if is_checkpoint(path):
            found[path.name] = path
    return found
