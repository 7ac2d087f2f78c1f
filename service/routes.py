"""HTTP routes: validate input, decode images off the event loop, hand work to a model's batcher."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import APIRouter, Depends, File, Query, Request, UploadFile
from fastapi.concurrency import run_in_threadpool

from models.encoder import ImageDecodeError, load_image

from .batcher import Batcher, QueueFull
from .problems import Problem
from .runtime import CaptionResult, ModelRuntime
from .schemas import CaptionOut, Health, ModelOut
from .settings import Settings

router = APIRouter()


@dataclass
class ServiceState:
    settings: Settings
    runtimes: dict[str, ModelRuntime] = field(default_factory=dict)
    batchers: dict[str, Batcher] = field(default_factory=dict)
    ready: bool = False


def get_state(request: Request) -> ServiceState:
    return request.app.state.service


State = Annotated[ServiceState, Depends(get_state)]


async def read_upload(upload: UploadFile, limit: int) -> bytes:
    data = await upload.read(limit + 1)
    if len(data) > limit:
        raise Problem(413, f"upload is larger than the {limit}-byte limit", kind="upload-too-large")
    if not data:
        raise Problem(422, "the uploaded file is empty", kind="invalid-image")
    return data


async def decode_image(data: bytes, max_pixels: int):
    try:
        return await run_in_threadpool(load_image, data, max_pixels)
    except ImageDecodeError as exc:
        too_big = "above the limit" in str(exc)
        raise Problem(413 if too_big else 422, str(exc), kind="image-too-large" if too_big else "invalid-image")


def pick_model(state: ServiceState, name: str | None) -> str:
    name = name or state.settings.default_model
    if name not in state.batchers:
        if not state.batchers:
            raise Problem(503, "no model is loaded", kind="not-ready", headers={"Retry-After": "5"})
        raise Problem(404, f"unknown model {name!r}; available: {', '.join(sorted(state.batchers))}",
                      kind="unknown-model")
    return name


async def run_caption(state: ServiceState, data: bytes, model: str | None, beam_size: int | None,
                      max_len: int | None) -> CaptionResult:
    settings = state.settings
    name = pick_model(state, model)
    beam = beam_size or settings.default_beam_size
    length = max_len or settings.default_max_len
    if beam > settings.max_beam_size:
        raise Problem(422, f"beam_size {beam} is above the limit of {settings.max_beam_size}", kind="invalid-request")
    if length > settings.max_max_len:
        raise Problem(422, f"max_len {length} is above the limit of {settings.max_max_len}", kind="invalid-request")
    image = await decode_image(data, settings.max_pixels)
    runtime = state.runtimes[name]
    prepared = await run_in_threadpool(runtime.prepare, image)
    try:
        return await asyncio.wait_for(state.batchers[name].submit(prepared, beam, length), settings.request_timeout_s)
    except QueueFull as exc:
        raise Problem(429, str(exc), kind="overloaded", headers={"Retry-After": "1"}) from None
    except TimeoutError:
        raise Problem(504, f"captioning took longer than {settings.request_timeout_s} s", kind="deadline") from None


@router.post("/caption", response_model=CaptionOut, summary="Caption an uploaded image, with per-word attention")
async def caption(
    request: Request,
    state: State,
    file: Annotated[UploadFile, File(description="image file: JPEG, PNG, WebP, GIF (first frame), BMP or TIFF")],
    model: Annotated[str | None, Query(description="model name (GET /models); default: the service default")] = None,
    beam_size: Annotated[int | None, Query(ge=1, description="beam width")] = None,
    max_len: Annotated[int | None, Query(ge=1, description="maximum caption length in tokens")] = None,
) -> dict:
    data = await read_upload(file, state.settings.max_upload_bytes)
    result = await run_caption(state, data, model, beam_size, max_len)
    return {"id": request.app.state.results.put(result, data), **result.to_json()}


@router.get("/models", response_model=list[ModelOut], summary="Models this service can caption with")
async def list_models(state: State) -> list[dict]:
    return [{**rt.describe(), "default": name == state.settings.default_model} for name, rt in state.runtimes.items()]


@router.get("/healthz", response_model=Health, summary="Liveness: the process answers")
async def healthz() -> dict:
    return {"status": "ok"}


@router.get("/readyz", response_model=Health, summary="Readiness: models are loaded and warm")
async def readyz(state: State) -> dict:
    if not state.ready:
        raise Problem(503, "models are still loading", kind="not-ready", headers={"Retry-After": "5"})
    return {"status": "ready", "models": sorted(state.runtimes)}
