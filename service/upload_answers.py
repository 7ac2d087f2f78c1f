"""The HTTP side of captioning an upload, shared by ``POST /caption`` (``routes.py``) and ``POST /caption/overlay``
(``overlay.py``): read the request within its deadline, caption it (``captioning.py``), and write the answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Annotated

from fastapi import Query, Request
from fastapi.responses import Response

from captioner.models.inference import CaptionResult, Runtime

from .captioning import CaptionRequest, caption_image, observed_request, refuse_early, remaining_s
from .errors import InvalidRequest, UploadTimeout
from .inputs import arrival, option_sources, options_before_body, read_caption_request
from .schemas import AttentionFormat, CaptionOptions, CaptionOut, caption_json
from .state import ServiceState
from .work_slots import UploadHold

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


async def caption_upload(request: Request, state: ServiceState, query: CaptionOptions,
                         check: Callable[[Runtime | None, int | None], None] = lambda runtime, max_len: None
                         ) -> tuple[bytes, CaptionResult]:
    """Read and caption the upload of either caption endpoint: the deadline counts from the request's arrival, and
    a request is refused before its body is parsed when ``check(None, None)`` (the endpoint's own options) raises,
    when the service is not ready, or when the model its query names would refuse it anyway; and before its model
    runs when ``check`` raises given that model's runtime and the caption's length limit (a form's fields may name
    the model and the length)."""
    arrived = arrival(request)
    options = query  # the query's, until the body (a form's fields) completes them
    body = None  # the options the body gave, once it is read
    # the upload's bytes count against the service's budget from their arrival until the request ends: they stay
    # in memory while it waits for a decode slot and decodes
    with observed_request(state, arrived, lambda: options.model), state.upload_budget.hold() as hold:
        try:
            given, body = await _read_upload(request, state, query, lambda: check(None, None), arrived, hold)
            options = given.options
            return given.data, await caption_image(state, given, arrived, check)
        except InvalidRequest as refusal:  # a beam above the limit: in the query or in the body, as HTTP says it
            refusal.place(option_sources(query, body))
            raise


async def _read_upload(request: Request, state: ServiceState, query: CaptionOptions, check: Callable[[], None],
                       arrived: float, hold: UploadHold) -> tuple[CaptionRequest, CaptionOptions | None]:
    settings = state.settings
    # a refusal made before the body is read (429, 503, 404 of a model, 422 of a parameter) leaves the body to
    # inputs.UnreadBodyMiddleware, which reads and drops it before the answer: else the client would see a reset
    check()
    refuse_early(state, options_before_body(request, query), arrived)
    try:  # a slow or stalled upload is cut off at the deadline, not read to its end
        async with asyncio.timeout(remaining_s(settings, arrived)):
            return await read_caption_request(request, query, settings.max_upload_bytes, hold)
    except TimeoutError:
        raise UploadTimeout(f"the upload did not arrive within the {settings.request_timeout_s:g} s request "
                            "deadline") from None
