"""Response models (they document the API in /docs; SPEC §8.5 export format)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class GeometryOut(BaseModel):
    kind: str = Field(description="grid or regions")
    image_size: list[int] = Field(description="(width, height) of the uploaded image after EXIF orientation")
    grid_hw: list[int] | None = Field(description="(rows, cols) of the grid; item i is row-major cell i")
    boxes: list[list[float]] = Field(description="x1, y1, x2, y2 of each visual item in original-image pixels")


class CaptionOut(BaseModel):
    id: str | None = Field(None, description="result id, reusable with the overlay endpoints")
    model: str
    checkpoint: str
    beam_size: int
    caption: str
    tokens: list[str] = Field(description="emitted words; the last is <eos> when the caption ended normally")
    is_eos: list[bool] = Field(description="flags the <eos> row of the attention")
    token_logprobs: list[float]
    score: float = Field(description="summed log-probability of the caption (the beam score)")
    geometry: GeometryOut
    attention: list[list[float]] = Field(description="one row per token: weights over the visual items")
    attention_kind: str
    extras: dict[str, Any] = Field(default_factory=dict, description="model-specific maps, one row per token")
    area_boxes: list[list[int]] | None = Field(
        None, description="area-attention models: the grid-cell box (r1, c1, r2, c2, inclusive) of every column of "
                          "extras.areas, for drawing the top-k areas")


class ModelOut(BaseModel):
    name: str
    architecture: str
    attention_kind: str
    attention: str
    vocab_size: int
    checksum: str
    encoder: dict[str, Any]
    parameters: int
    device: str
    backend: str = Field("torch", description="torch or onnx")
    providers: list[str] | None = Field(None, description="ONNX Runtime execution providers, in priority order")
    default: bool = False


class Health(BaseModel):
    status: str
    models: list[str] = []
