"""HTTP routes of captioning, models and health: they only translate HTTP ↔ the use case.

Reading the body is ``inputs.py``, captioning is ``captioning.py``, the JSON shapes are ``schemas.py``, and every
failure is a typed exception that ``problems.py`` answers as an RFC 9457 problem.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from captioner.models.inference import CaptionResult

from .captioning import caption_image, refuse_early
from .errors import NotReady, Overloaded
from .inputs import MULTIPART_SLACK, QueryOptions, arrival, drain_body, options_before_body, read_caption_request
from .results import Results
from .schemas import CAPTION_BODY, CAPTION_PROBLEMS, AttentionFormat, CaptionOptions, CaptionOut, Health, ModelOut, \
    caption_json
from .state import ServiceState, State

router = APIRouter()

AttentionFormatQuery = Annotated[AttentionFormat, Query(
    description="how the answer writes its attention maps (`attention` and `extras`): `json`, rows of numbers, or "
                "`float16-base64`, each map packed as PackedRows (little-endian float16 in base64: a fifth of the "
                "bytes, decoded in one call)")]


def caption_answer(state: ServiceState, result: CaptionResult, result_id: str | None,
                   attention_format: AttentionFormat) -> Response | CaptionOut:
    """A caption result as its JSON answer, written by the settings' ``json_encoder``: orjson's bytes are sent as
    they are (FastAPI validates nothing again); a :class:`CaptionOut` goes through FastAPI's response model."""
    if state.settings.json_encoder == "orjson":
        return Response(caption_json(result, result_id, attention_format), media_type="application/json")
    return CaptionOut.of(result, result_id, attention_format)


async def caption_upload(request: Request, state: ServiceState,
                         query: CaptionOptions) -> tuple[bytes, CaptionResult]:
    """Read and caption the upload of either caption endpoint: the deadline counts from the request's arrival, and
    a request is refused before its body is parsed when the service is not ready, or when the model its query
    names would refuse it anyway."""
    arrived = arrival(request)
    try:
        refuse_early(state, options_before_body(request, query), arrived)
    except Overloaded:
        await drain_body(request, state.settings.max_upload_bytes + MULTIPART_SLACK)
        raise
    given = await read_caption_request(request, query, state.settings.max_upload_bytes)
    return given.data, await caption_image(state, given, arrived)


@router.post("/caption", response_model=CaptionOut, openapi_extra=CAPTION_BODY,
             summary="Caption an uploaded image, with per-word attention", responses=CAPTION_PROBLEMS)
async def caption(request: Request, state: State, results: Results, options: QueryOptions,
                  attention_format: AttentionFormatQuery = "json") -> Response | CaptionOut:
    data, result = await caption_upload(request, state, options)
    return caption_answer(state, result, results.put(result, data), attention_format)


@router.get("/models", response_model=list[ModelOut], summary="Models this service can caption with")
async def list_models(state: State) -> list[ModelOut]:
    return [ModelOut.of(runtime.info(), default=name == state.default_model) for name, runtime in state.runtimes.items()]


@router.get("/healthz", response_model=Health, summary="Liveness: the process answers")
async def healthz() -> Health:
    return Health(status="ok")


@router.get("/readyz", response_model=Health, summary="Readiness: models are loaded and warm")
async def readyz(state: State) -> Health:
    if not state.ready:
        raise NotReady("models are still loading (or the service is shutting down)")
    return Health(status="ready", models=sorted(state.runtimes))


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
async def metrics(state: State) -> Response:
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
