"""Trusted weights, the service's side: a checkpoint whose files fail their manifest is refused with one clear
log line while the other models keep serving; pickle files beside a checkpoint are never loaded; and serving
never writes into the weights folder (checksummed before and after a served run)."""

from __future__ import annotations

import hashlib
import io
import logging
import pickle
from pathlib import Path

import torch
from fastapi.testclient import TestClient
from PIL import Image

from captioner.models.checkpoint import save_checkpoint
from captioner.models.encoder import EncoderSpec
from captioner.models.vocab import Vocabulary
from captioner.models.zoo import create
from captioner.service.app import create_app
from captioner.service.settings import Settings


class _Trap:
    """Unpickling this creates a marker file: proof that a pickle was loaded."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_tampered_checkpoint_is_refused_the_others_serve_and_nothing_is_written(tmp_path, caplog):
    weights = tmp_path / "weights"
    torch.manual_seed(0)
    vocab = Vocabulary(["a", "red", "circle"])
    for name in ("good", "tampered"):
        save_checkpoint(weights / name, create("sat", vocab_size=len(vocab), feat_dim=320, embed_dim=8,
                                               hidden_dim=8, attn_dim=4), vocab, EncoderSpec(image_size=64))
    blob = bytearray((weights / "tampered" / "model.safetensors").read_bytes())
    blob[-5] ^= 0x01  # one bit of one weight: the file still parses, only its checksum tells
    (weights / "tampered" / "model.safetensors").write_bytes(bytes(blob))
    marker = tmp_path / "pickle-was-loaded"
    for name in ("model.pt", "pytorch_model.bin", "model.pkl"):
        (weights / "good" / name).write_bytes(pickle.dumps(_Trap(str(marker))))
    before = tree_digest(weights)
    image = io.BytesIO()
    Image.new("RGB", (48, 40), (9, 99, 199)).save(image, format="PNG")

    with caplog.at_level(logging.INFO, logger="captioner"):
        app = create_app(Settings(weights_dir=weights, default_model="good", warmup=True, default_beam_size=1,
                                  default_max_len=4, max_batch_images=2, max_rows=16, queue_size=4))
        with TestClient(app) as client:
            assert [m["name"] for m in client.get("/models").json()] == ["good"]
            answer = client.post("/caption", files={"file": ("x.png", image.getvalue(), "image/png")})
            assert answer.status_code == 200, answer.text
            overlay = client.post("/caption/overlay", params={"format": "png", "token": 0},
                                  files={"file": ("x.png", image.getvalue(), "image/png")})
            assert overlay.status_code == 200
            refused = client.post("/caption", params={"model": "tampered"},
                                  files={"file": ("x.png", image.getvalue(), "image/png")})
            assert refused.status_code == 404 and "good" in refused.json()["detail"]
    refusals = [r for r in caplog.records if "tampered" in r.getMessage() and r.levelno >= logging.ERROR]
    assert len(refusals) == 1, [r.getMessage() for r in caplog.records]
    assert "sha256" in refusals[0].getMessage() or "manifest" in refusals[0].getMessage()
    assert not marker.exists(), "a pickle file was loaded"
    assert tree_digest(weights) == before, "the service wrote into the weights folder"
