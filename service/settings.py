"""Service settings, read from ``CAPTIONER_*`` environment variables (pydantic-settings).

Every field is documented in the README's settings table; keep the two in step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, EnvSettingsSource, PydanticBaseSettingsSource, SettingsConfigDict

from captioner.models.placement import DEFAULT_MODEL, DEFAULT_ONNX_DIR, DEFAULT_WEIGHTS_DIR, check_name_prefixes

Backend = Literal["torch", "onnx", "hybrid", "auto"]
#: the levels CAPTIONER_LOG_LEVEL may name: those Python's logging and uvicorn both know (any case)
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def json_body_bytes(image_bytes: int) -> int:
    """The largest JSON caption request for an image of ``image_bytes``: base64 takes 4 bytes for 3, plus the
    options."""
    return (image_bytes * 4 + 2) // 3 + 4096


#: the settings the model-side commands read too (models/placement.py, for ``captioner export``, ``eval``,
#: ``caption``), which take an empty variable for an unset one
PLACEMENT_FIELDS = frozenset({"weights_dir", "prefixed_weights_dirs", "checkpoints", "onnx_dir"})


class _EmptyPlacementIsUnset(EnvSettingsSource):
    """The environment, with an empty placement variable read as unset, as models/placement.py reads it: with
    ``CAPTIONER_ONNX_DIR=`` (a compose file's ``${ONNX_DIR}`` left unset) ``captioner export`` wrote to the default
    folder and the service looked in the working folder, and ``CAPTIONER_CHECKPOINTS=`` stopped the service but not
    the export.  The other settings keep pydantic-settings' reading (an empty ``CAPTIONER_API_KEYS`` is refused, never
    an open service)."""

    def get_field_value(self, field, field_name: str) -> tuple[Any, str, bool]:
        value, key, is_complex = super().get_field_value(field, field_name)
        return (None if field_name in PLACEMENT_FIELDS and value == "" else value), key, is_complex


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CAPTIONER_", env_file=None)

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings],
                                   init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource,
                                   dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource,
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        # pydantic-settings' own order, with the environment read as above
        return init_settings, _EmptyPlacementIsUnset(settings_cls), dotenv_settings, file_secret_settings

    # -- models -------------------------------------------------------------------------------------------------
    weights_dir: Path = Field(DEFAULT_WEIGHTS_DIR, description="every checkpoint folder below it is served "
                              "under its folder name, a training run's best/last under the run's (the real-photo "
                              "checkpoints by default)")
    prefixed_weights_dirs: dict[str, Path] = Field(
        default_factory=dict, description='name prefix → folder, JSON: {"scenes-": "weights"} serves every '
        "checkpoint folder below weights/ as scenes-NAME (the generated-scene checkpoints beside the real-photo ones)")
    checkpoints: list[Path] = Field(
        default_factory=list, description="extra checkpoint folders (JSON list), each served under its folder name; "
        "a training run's RUN/best as RUN, its RUN/last as RUN-last")
    default_model: str = Field(DEFAULT_MODEL, description="model used when a request names none")
    backend: Backend = Field("auto", description="inference backend of every model not named in `backends`: auto "
                             "(ONNX Runtime where its captions equal PyTorch's on a check set, else the hybrid, "
                             "else torch), torch, onnx or hybrid (ONNX Runtime CNN, PyTorch decoder)")
    backends: dict[str, Backend] = Field(default_factory=dict,
                                         description='per-model backend, JSON: {"sat": "onnx"}')
    onnx_dir: Path = Field(DEFAULT_ONNX_DIR, description="ONNX exports, one folder per model; made when missing")

    # -- device -------------------------------------------------------------------------------------------------
    device: str = Field("auto", description="auto, cpu, cuda or cuda:N (the N-th GPU)")
    threads: int | None = Field(None, ge=1, description="intra-op threads of torch and ONNX Runtime (unset: their "
                                "defaults, one per core)")
    precision: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="PyTorch autocast precision of the encoder and decoder (not float32: PyTorch backend)")
    encoder_precision: Literal["float32", "int8"] = Field(
        "float32", description="the CNN on ONNX Runtime (onnx, hybrid and auto backends): float32, or int8 (static "
        "quantization, calibrated on generated scenes; accuracy: docs/benchmarks/int8.md)")
    interop_threads: int | None = Field(None, ge=1, description="torch inter-op threads")
    warmup: bool = Field(True, description="run the batcher over its batch shapes before reporting ready")
    release_memory: bool = Field(True, description="pin glibc's mmap threshold, cap its arenas and return freed "
                                 "memory after warm-up (service/memory.py)")
    page_out_gpu_libraries: bool = Field(True, description="on a machine without a CUDA device, hand back the pages "
                                         "of the CUDA libraries torch loads (about 250 MB) after warm-up")
    load_in_background: bool = Field(False, description="answer /healthz while models load; /readyz says when ready")

    # -- requests -----------------------------------------------------------------------------------------------
    max_upload_bytes: int = Field(10 * 1024 * 1024, ge=1, description="larger uploads get 413")
    upload_budget_bytes: int = Field(256 * 1024 * 1024, ge=1, description="bytes of the uploads being received at "
                                     "once, across requests: past it a request's next chunk is refused with 429 and "
                                     "Retry-After (clients trickling many large bodies cannot hold the memory)")
    max_pixels: int = Field(40_000_000, ge=1, description="larger images (decompression bombs) get 413")
    default_beam_size: int = Field(3, ge=1, description="beam width of requests that name none")
    max_beam_size: int = Field(10, ge=1, description="wider beams get 422")
    default_max_len: int = Field(20, ge=1, description="caption length limit (tokens) of requests that name none")
    max_max_len: int = Field(50, ge=1, description="larger max_len gets 422")
    request_timeout_s: float = Field(60.0, gt=0, description="per-request deadline before 504")
    json_encoder: Literal["orjson", "pydantic"] = Field(
        "orjson", description="writer of the caption answers: orjson (attention as shortest float32 numbers) or "
        "pydantic (the answer model validated and written by FastAPI, as before issue 30)")

    # -- batching and back-pressure -----------------------------------------------------------------------------
    max_batch_images: int = Field(16, ge=1, description="images encoded together at most (per step boundary)")
    max_rows: int = Field(256, ge=1, description="(request, beam) rows decoded together at most, per model")
    overlap_encoding: bool = Field(True, description="encode admitted images in a thread of their own while the "
                                   "batcher decodes (false: the batcher's thread encodes between decoding steps)")
    queue_size: int = Field(64, ge=1, description="waiting requests per model before 429")
    decode_pixels: int = Field(80_000_000, ge=1, description="pixels of the uploads decoded at once, at most (a "
                               "decode holds about 7 bytes per pixel; a 16-bit picture counts twice, every row "
                               "three pixels more; an image above it is decoded alone); the "
                               "others wait, within their deadline")
    render_concurrency: int = Field(2, ge=1, description="overlays rendered at once at most (a 4,096-px render "
                                    "holds about 1 GB; the others wait, within their deadline)")
    retry_after_s: int = Field(1, ge=0, description="Retry-After of 429 answers (503 answers use 5)")
    drain_timeout_s: float = Field(30.0, ge=0, description="graceful shutdown: how long in-flight requests may finish")
    keep_alive_s: float = Field(75.0, gt=0, description="idle HTTP keep-alive connections are closed after this "
                                "long: longer than clients' and proxies' own idle limits (httpx 5 s, nginx 60 s), "
                                "so that a client never sends a request on a connection the server is closing")

    # -- results, logs, binding ---------------------------------------------------------------------------------
    results_cache_bytes: int = Field(256 * 1024 * 1024, ge=0, description="uploads kept for re-rendering overlays")
    results_max_count: int = Field(1000, ge=1, description="caption results kept for the overlay endpoints, at most")
    results_max_age_s: float = Field(3600.0, gt=0, description="seconds a caption result is kept, at most")
    result_cache_entries: int = Field(0, ge=0, description="captions cached by (image SHA-256, model, beam_size, "
                                      "max_len, decoding rules) so duplicate uploads skip the model; 0: off")
    log_format: Literal["json", "text"] = Field("json", description="access and service log lines")
    log_level: str = Field("info", description="log level of the service loggers: critical, error, warning, info "
                           "or debug")
    host: str = Field("127.0.0.1", description="bind address of `captioner serve`")
    port: int = Field(8000, ge=1, le=65535, description="port of `captioner serve`")
    root_path: str = Field("", description="the path prefix a reverse proxy serves the app under when it strips it "
                           "before forwarding (for example /captioner); the docs page, the OpenAPI servers and the "
                           "demo page's requests carry it; empty: served at /")

    # -- access and hardening (service/security.py) ---------------------------------------------------------
    api_keys: list[str] = Field(default_factory=list, repr=False,
                                description='bearer keys for /caption* (JSON list, several for rotation); empty: open')
    cors_origins: list[str] = Field(default_factory=list,
                                    description='origins allowed to call the API from a browser (JSON list); '
                                    'empty: none')

    def model_placement(self) -> dict[str, Any]:
        """Where the models' files are and which backend runs them: the keywords of ``onnx_exports.unprepared``."""
        return dict(onnx_dir=self.onnx_dir, prefixed=self.prefixed_weights_dirs, backends=self.backends,
                    default_backend=self.backend, encoder_precision=self.encoder_precision, precision=self.precision)

    def checkpoint_folders(self) -> list[str]:
        """Every folder checkpoints are looked for in, for the messages that say none was found."""
        return [str(self.weights_dir), *map(str, self.prefixed_weights_dirs.values()), *map(str, self.checkpoints)]

    def model_loading(self) -> dict[str, Any]:
        """:meth:`model_placement` and how the models run: the keywords of ``runtime.load_runtimes``, for the server
        and for ``captioner caption --output``, which loads its checkpoint as the server does."""
        return dict(self.model_placement(), device_name=self.device, threads=self.threads)

    @field_validator("api_keys")
    @classmethod
    def _keys_are_not_blank(cls, value: list[str]) -> list[str]:
        # '["${KEY}"]' with KEY unset gave [""], which was dropped: the service served everyone, in silence
        if any(not key.strip() for key in value):
            raise ValueError("an API key is empty or blank (a template whose variable was unset?); give real keys, "
                             "or no CAPTIONER_API_KEYS for an open service")
        return value

    @field_validator("log_level")
    @classmethod
    def _log_level_is_one_both_loggers_know(cls, value: str) -> str:
        # Python's logging and uvicorn each know names the other does not: "warn" passed the first and stopped
        # uvicorn with a KeyError traceback, "trace" passed uvicorn and stopped logging with "Unknown level"
        level = value.strip().lower()
        if level not in LOG_LEVELS:
            raise ValueError(f"give one of {', '.join(LOG_LEVELS)}")
        return level

    @field_validator("root_path")
    @classmethod
    def _root_path_is_a_prefix(cls, value: str) -> str:
        # "captioner" or "/captioner/" would make every address the docs page builds wrong ("captioner/openapi.json",
        # "/captioner//docs/assets/…"): both are read as the prefix they name
        prefix = value.strip().strip("/")
        if not prefix:
            return ""
        if any(c in prefix for c in "?#\\ ") or "//" in prefix or not prefix.isascii():
            raise ValueError(f"{value!r} is not a URL path prefix; give one like /captioner")
        return "/" + prefix

    @field_validator("prefixed_weights_dirs")
    @classmethod
    def _prefixes_are_plain_names(cls, value: dict[str, Path]) -> dict[str, Path]:
        check_name_prefixes(value)
        return value

    @model_validator(mode="after")
    def _the_largest_upload_fits_the_budget(self) -> "Settings":
        # an upload the budget can never hold would be told "429, retry" for ever
        largest = json_body_bytes(self.max_upload_bytes)
        if self.upload_budget_bytes < largest:
            raise ValueError(f"upload_budget_bytes ({self.upload_budget_bytes}) must hold at least one largest upload "
                             f"(max_upload_bytes as base64 JSON: {largest} bytes)")
        return self

    @model_validator(mode="after")
    def _rows_fit_the_widest_beam(self) -> "Settings":
        if self.max_rows < self.max_beam_size:
            raise ValueError(f"max_rows ({self.max_rows}) must be at least max_beam_size ({self.max_beam_size})")
        if self.default_beam_size > self.max_beam_size or self.default_max_len > self.max_max_len:
            raise ValueError("default_beam_size and default_max_len must not exceed max_beam_size and max_max_len")
        return self
