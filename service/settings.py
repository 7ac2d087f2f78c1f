"""Service settings, read from ``CAPTIONER_*`` environment variables (pydantic-settings)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CAPTIONER_", env_file=None)

    weights_dir: Path = Field(Path("weights"), description="every checkpoint folder below it is served by name")
    checkpoints: list[Path] = Field(default_factory=list, description="extra checkpoint folders (JSON list)")
    default_model: str = Field("sat-scenes", description="model used when a request names none")
    device: str = Field("auto", description="auto, cpu or cuda")
    threads: int | None = Field(None, description="torch intra-op threads (default: torch's choice)")
    max_upload_bytes: int = Field(10 * 1024 * 1024, description="larger uploads get 413")
    max_pixels: int = Field(40_000_000, description="larger images (decompression bombs) get 413")
    default_beam_size: int = Field(3, ge=1)
    max_beam_size: int = Field(10, ge=1)
    default_max_len: int = Field(20, ge=1)
    max_max_len: int = Field(50, ge=1)
    max_batch_images: int = Field(16, ge=1, description="images encoded and decoded together at most")
    queue_size: int = Field(64, ge=1, description="waiting requests per model before 429")
    results_cache_bytes: int = Field(256 * 1024 * 1024, description="uploads kept for re-rendering overlays")
    request_timeout_s: float = Field(60.0, gt=0, description="per-request deadline before 504")
