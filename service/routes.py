"""HTTP routes: validate input, decode images off the event loop, hand work to a model's batcher."""

from __future__ import annotations

import asyncio
import base64
import binascii
import time
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request, UploadFile
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response
from PIL import Image
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, Field, ValidationError

from captioner.models.encoder import ImageDecodeError, load_image

from .batcher import Batcher, DeadlineExceeded, NotAccepting, QueueFull
from .metrics import Metrics
from .problems import Problem
from .runtime import CaptionResult, ModelRuntime, Prepared
from .schemas import CaptionOut, Health, ModelOut
from .settings import Settings

router = APIRouter()
NOT_READY_RETRY_AFTER = "5"
# room for the multipart envelope around the file (boundaries, part headers, other fields)
MULTIPART_SLACK = 64 * 1024


@dataclass
class ServiceState:
    settings: Settings
    runtimes: dict[str, ModelRuntime] = field(default_factory=dict)
    batchers: dict[str, Batcher] = field(default_factory=dict)
    metrics: Metrics = field(default_factory=Metrics)
    ready: bool = False


def get_state(request: Request) -> ServiceState:
    return request.app.state.service


State = Annotated[ServiceState, Depends(get_state)]


class CaptionJSON(BaseModel):
    """JSON alternative to the multipart upload, for clients that cannot send multipart."""

    image: str = Field(description="the image file, base64-encoded (a data: URL is accepted too)")
    model: str | None = Field(None, description="model name; overrides the query parameter")
    beam_size: int | None = Field(None, ge=1, description="beam width; overrides the query parameter")
    max_len: int | None = Field(None, ge=1, description="maximum caption length; overrides the query parameter")


async def read_upload(upload: UploadFile, limit: int) -> bytes:
    data = await upload.read(limit + 1)
    if len(data) > limit:
        raise Problem(413, f"upload is larger than the {limit}-byte limit", kind="upload-too-large")
    if not data:
        raise Problem(422, "the uploaded file is empty", kind="invalid-image")
    return data


def _too_large(limit: int) -> Problem:
    return Problem(413, f"upload is larger than the {limit}-byte limit", kind="upload-too-large")


async def _read_body(request: Request, limit: int) -> bytes:
    """The raw body, refusing (413) as soon as it passes ``limit`` bytes — before reading it when the client
    announced its length."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _missing_file() -> Problem:
    return Problem(422, "body.file: Field required (send multipart/form-data with a `file` part, JSON with a "
                   "base64 `image`, or the raw image bytes)", kind="invalid-request",
                   errors=[{"loc": ["body", "file"], "msg": "Field required"}])


@dataclass
class CaptionInput:
    data: bytes
    model: str | None = None
    beam_size: int | None = None
    max_len: int | None = None


async def read_caption_input(request: Request, limit: int) -> CaptionInput:
    """The image of a caption request: a multipart ``file`` part, JSON ``{"image": base64}``, or a raw image
    body (``image/*`` or ``application/octet-stream``)."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type == "multipart/form-data":
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit + MULTIPART_SLACK:
            raise _too_large(limit)
        form = await request.form(max_files=1, max_fields=16)
        upload = form.get("file")
        if not isinstance(upload, UploadFile) and not hasattr(upload, "read"):
            raise _missing_file()
        return CaptionInput(await read_upload(upload, limit))  # type: ignore[arg-type]
    if content_type == "application/json" or content_type.endswith("+json"):
        body = await _read_body(request, (limit * 4 + 2) // 3 + 4096)
        try:
            parsed = CaptionJSON.model_validate_json(body)
        except ValidationError as exc:
            errors = [{"loc": ["body", *map(str, e["loc"])], "msg": e["msg"]} for e in exc.errors()]
            detail = "; ".join(f"{'.'.join(e['loc'])}: {e['msg']}" for e in errors)
            raise Problem(422, detail, kind="invalid-request", errors=errors) from None
        encoded = parsed.image
        if encoded.startswith("data:"):
            encoded = encoded.partition(",")[2]
        try:
            data = base64.b64decode("".join(encoded.split()), validate=True)
        except (binascii.Error, ValueError):
            raise Problem(422, "`image` is not valid base64", kind="invalid-image") from None
        if len(data) > limit:
            raise _too_large(limit)
        if not data:
            raise Problem(422, "the image is empty", kind="invalid-image")
        return CaptionInput(data, parsed.model, parsed.beam_size, parsed.max_len)
    if content_type.startswith("image/") or content_type == "application/octet-stream":
        data = await _read_body(request, limit)
        if not data:
            raise Problem(422, "the uploaded file is empty", kind="invalid-image")
        return CaptionInput(data)
    raise _missing_file()


def _decode_and_prepare(runtime: ModelRuntime, data: bytes, max_pixels: int) -> Prepared:
    """Runs in the thread pool: image decoding and preprocessing never block the event loop."""
    try:
        image = load_image(data, max_pixels)
    except Image.DecompressionBombError as exc:  # PIL's own guard fires before ours for gigantic headers
        raise ImageDecodeError(f"image is above the limit of {max_pixels} pixels ({exc})") from exc
    return runtime.prepare(image)


def not_ready() -> Problem:
    return Problem(503, "the service is starting or shutting down", kind="not-ready",
                   headers={"Retry-After": NOT_READY_RETRY_AFTER})


def pick_model(state: ServiceState, name: str | None) -> str:
    name = name or state.settings.default_model
    if name not in state.batchers:
        if not state.batchers:
            raise Problem(503, "no model is loaded", kind="not-ready", headers={"Retry-After": NOT_READY_RETRY_AFTER})
        raise Problem(404, f"unknown model {name!r}; available: {', '.join(sorted(state.batchers))}",
                      kind="unknown-model")
    return name


async def run_caption(state: ServiceState, data: bytes, model: str | None, beam_size: int | None,
                      max_len: int | None) -> CaptionResult:
    """Caption one uploaded image with the model's batcher; every failure leaves as a :class:`Problem`."""
    started = time.monotonic()
    settings, metrics = state.settings, state.metrics
    name = model or settings.default_model
    status = 200
    try:
        if not state.ready:
            raise not_ready()
        name = pick_model(state, model)
        beam = beam_size or settings.default_beam_size
        length = max_len or settings.default_max_len
        if beam > settings.max_beam_size:
            raise Problem(422, f"beam_size {beam} is above the limit of {settings.max_beam_size}",
                          kind="invalid-request")
        if length > settings.max_max_len:
            raise Problem(422, f"max_len {length} is above the limit of {settings.max_max_len}",
                          kind="invalid-request")
        runtime = state.runtimes[name]
        try:
            prepared = await run_in_threadpool(_decode_and_prepare, runtime, data, settings.max_pixels)
        except ImageDecodeError as exc:
            too_big = "above the limit" in str(exc)
            raise Problem(413 if too_big else 422, str(exc),
                          kind="image-too-large" if too_big else "invalid-image") from None
        remaining = settings.request_timeout_s - (time.monotonic() - started)
        try:
            return await state.batchers[name].caption(prepared, beam, length, max(remaining, 0.001))
        except QueueFull as exc:
            raise Problem(429, str(exc), kind="overloaded",
                          headers={"Retry-After": str(settings.retry_after_s)}) from None
        except NotAccepting:
            raise not_ready() from None
        except DeadlineExceeded:
            raise Problem(504, f"captioning took longer than {settings.request_timeout_s:g} s",
                          kind="deadline") from None
        except ValueError as exc:
            raise Problem(422, str(exc), kind="invalid-request") from None
    except Problem as problem:
        status = problem.status  # counted by reason where it is answered (install_problem_handlers)
        raise
    except asyncio.CancelledError:
        status = 499  # cancelled: the client went away (nothing is answered)
        metrics.rejected("client-gone")
        raise
    except BaseException:
        status = 500
        raise
    finally:
        metrics.observe_request(name, status, time.monotonic() - started)


CAPTION_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {"schema": {
                "type": "object", "required": ["file"],
                "properties": {"file": {"type": "string", "format": "binary", "description":
                                        "image file: JPEG, PNG, WebP, GIF (first frame), BMP or TIFF"}}}},
            "application/json": {"schema": CaptionJSON.model_json_schema()},
            "image/*": {"schema": {"type": "string", "format": "binary"}},
        },
    }
}


@router.post("/caption", response_model=CaptionOut, openapi_extra=CAPTION_BODY,
             summary="Caption an uploaded image, with per-word attention",
             responses={413: {"description": "upload or image too large"}, 422: {"description": "bad input"},
                        429: {"description": "queue full (Retry-After)"}, 503: {"description": "not ready"},
                        504: {"description": "deadline passed"}})
async def caption(
    request: Request,
    state: State,
    model: Annotated[str | None, Query(description="model name (GET /models); default: the service default")] = None,
    beam_size: Annotated[int | None, Query(ge=1, description="beam width")] = None,
    max_len: Annotated[int | None, Query(ge=1, description="maximum caption length in tokens")] = None,
) -> dict:
    if not state.ready:
        raise not_ready()  # before reading the body: nothing to do with it
    given = await read_caption_input(request, state.settings.max_upload_bytes)
    result = await run_caption(state, given.data, given.model or model, given.beam_size or beam_size,
                               given.max_len or max_len)
    return {"id": request.app.state.results.put(result, given.data), **result.to_json()}


@router.get("/models", response_model=list[ModelOut], summary="Models this service can caption with")
async def list_models(state: State) -> list[dict]:
    return [{**rt.describe(), "default": name == state.settings.default_model} for name, rt in state.runtimes.items()]


@router.get("/healthz", response_model=Health, summary="Liveness: the process answers")
async def healthz() -> dict:
    return {"status": "ok"}


@router.get("/readyz", response_model=Health, summary="Readiness: models are loaded and warm")
async def readyz(state: State) -> dict:
    if not state.ready:
        raise Problem(503, "models are still loading (or the service is shutting down)", kind="not-ready",
                      headers={"Retry-After": NOT_READY_RETRY_AFTER})
    return {"status": "ready", "models": sorted(state.runtimes)}


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
async def metrics(state: State) -> Response:
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
