"""Shared fixtures: a small generated-scene dataset, tiny models, and the repository paths."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from models.data.scenes import generate
from models.protocol import VisualBatch
from models.registry import create

ROOT = Path(__file__).resolve().parents[1]
WEIGHTS = ROOT / "weights"
DEFAULT_CHECKPOINT = WEIGHTS / "sat-scenes"

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def scenes(tmp_path_factory) -> Path:
    """A small scene dataset (images, masks, Karpathy JSON), generated once per test session."""
    out = tmp_path_factory.mktemp("scenes")
    return generate(out, {"train": 48, "val": 12, "test": 12, "heldout": 12}, seed=7, progress=False)


@pytest.fixture
def tiny_sat():
    torch.manual_seed(0)
    return create("sat", vocab_size=23, feat_dim=16, embed_dim=24, hidden_dim=32, attn_dim=20, dropout=0.0).eval()


@pytest.fixture
def random_visuals():
    torch.manual_seed(1)
    return VisualBatch.from_features(torch.randn(3, 9, 16))
