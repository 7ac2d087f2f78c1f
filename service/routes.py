"""HTTP routes of captioning, models and health: they only translate HTTP ↔ the use case.

Reading the body is ``inputs.py`` (and ``upload_answers.py``, shared with the overlay routes), captioning is
``captioning.py``, the JSON shapes are ``schemas.py``, and every
failure is a typed exception that ``problems.py`` answers as an RFC 9457 problem.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from .captioning import loaded_models
from .errors import LoadFailed, NotReady
from .inputs import QueryOptions
from .results import Results
from .schemas import CAPTION_BODY, CaptionOut, Health, ModelOut
from .state import State
from .upload_answers import AttentionFormatQuery, caption_answer, caption_upload

router = APIRouter()


@router.post("/caption", response_model=CaptionOut, openapi_extra=CAPTION_BODY,
             summary="Caption an uploaded image, with per-word attention")
async def caption(request: Request, state: State, results: Results, options: QueryOptions,
                  attention_format: AttentionFormatQuery = "json") -> Response | CaptionOut:
    data, result = await caption_upload(request, state, options)
    return caption_answer(state, result, results.put(result, data), attention_format)


@router.get("/models", response_model=list[ModelOut], summary="Models this service can caption with")
async def list_models(state: State) -> list[ModelOut]:
    return [ModelOut.of(info, default=is_default) for info, is_default in loaded_models(state)]


@router.get("/healthz", response_model=Health, summary="Liveness: the process answers (503 once loading failed)")
async def healthz(state: State) -> Health:
    if state.load_failure is not None:
        raise LoadFailed(state.load_failure)
    return Health(status="ok")


@router.get("/readyz", response_model=Health, summary="Readiness: models are loaded and warm")
async def readyz(state: State) -> Health:
    if not state.ready:
        raise NotReady("models are still loading (or the service is shutting down)")
    if not state.runtimes:  # up, but every caption would be refused: no traffic should be sent here
        raise NotReady("no model is loaded: no checkpoint was found, or none could be loaded (see the log)")
    return Health(status="ready", models=sorted(state.runtimes))


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
async def metrics(state: State) -> Response:
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
