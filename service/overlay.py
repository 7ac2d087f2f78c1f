"""Heatmap endpoints: overlay PNGs and the papers' per-word figure (``/overlay``), and the per-word heatmaps as
JSON (``/heatmaps``): a picture and JSON are separate routes, so that each has one media type in the document (a
generated client decoded every overlay PNG as JSON).

Every caption result is kept (with its upload) in the bounded :class:`~captioner.service.results.ResultStore`, so
``GET /captions/{id}/overlay`` re-renders any word in any mode without running the model again.  These routes
only translate HTTP ↔ the use cases (``captioning.py``, ``rendering.py``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from captioner.models.rendering.heatmaps import HEAT_MODES, MODES

from .captioning import remaining_s, slot_deadline
from .inputs import QueryOptions, arrival
from .openapi import header_doc
from .rendering import (DEFAULT_RENDER_SIDE, JSON_RENDER_SIDE, MAX_RENDER_SIDE, Heatmaps, PictureFormat,
                        RenderOptions, check_render_options, drawn_mode, render_result)
from .results import Results, StoredResult
from .schemas import CAPTION_BODY, CaptionOut, HeatmapsOut
from .state import ServiceState, State
from .upload_answers import AttentionFormatQuery, caption_answer, caption_upload

router = APIRouter()

ModeQuery = Annotated[str | None, Query(description=f"one of {', '.join(MODES)}; default by geometry and model")]
HeatModeQuery = Annotated[str | None, Query(description=f"one of {', '.join(HEAT_MODES)} (the modes that draw heat); "
                                                         "default by geometry and model")]
TokenQuery = Annotated[int | None, Query(ge=0, description="token index for format=png")]
FormatQuery = Annotated[PictureFormat | None, Query(description=(
    "png: one word's heatmap (needs token), figure: every word's; default png when a token is given, else figure "
    "(the heatmaps as numbers: the /heatmaps routes)"))]
CmapQuery = Annotated[str, Query(description="matplotlib colormap name")]
AlphaQuery = Annotated[float, Query(ge=0.0, le=1.0, allow_inf_nan=False, description="heatmap opacity")]
SideQuery = Annotated[int | None, Query(ge=16, le=MAX_RENDER_SIDE, description=(
    f"downscale so the longer side is at most this (default {DEFAULT_RENDER_SIDE})"))]
HeatSideQuery = Annotated[int | None, Query(ge=16, le=JSON_RENDER_SIDE, description=(
    f"downscale so the longer side is at most this (default and at most {JSON_RENDER_SIDE}: one map per token)"))]
RENDER_HEADERS = {"X-Caption-Id": header_doc("the stored result the picture was drawn from"),
                  "X-Heatmap-Mode": header_doc("the heatmap mode drawn (the model's own when the request named none)")}
RENDERED: dict[int | str, dict[str, Any]] = {
    200: {"content": {"image/png": {"schema": {"type": "string", "format": "binary"}}},
          "description": "PNG: one word's overlay (format=png) or every word's (format=figure)",
          "headers": RENDER_HEADERS},
    504: {"description": "deadline passed while waiting for a render slot"}}
HEATMAPS: dict[int | str, dict[str, Any]] = {
    200: {"description": "every word's heatmap as a grayscale PNG in JSON", "headers": RENDER_HEADERS},
    504: RENDERED[504]}


def _format(format: PictureFormat | None, token: int | None) -> PictureFormat:
    """The format a request names, else one word's PNG when it names a word and the whole caption's figure when it
    does not (so that a bare overlay URL opened in a browser shows a picture, not a 422)."""
    return format or ("png" if token is not None else "figure")


async def _respond(request: Request, state: ServiceState, stored: StoredResult, options: RenderOptions,
                   result_id: str) -> Response:
    settings = state.settings
    options = replace(options, mode=drawn_mode(stored.result, options))  # resolved once: the render and its header
    with slot_deadline(settings, "the overlay waited to be rendered"):
        body = await render_result(stored, options, state.render_slots, remaining_s(settings, arrival(request)))
    headers = {"X-Caption-Id": result_id, "X-Heatmap-Mode": options.mode}
    if isinstance(body, Heatmaps):
        return Response(HeatmapsOut.of(body, result_id).model_dump_json(), media_type="application/json",
                        headers=headers)
    return Response(body, media_type="image/png", headers=headers)


@router.get("/captions/{result_id}", response_model=CaptionOut, summary="A previous caption result (JSON), by id")
async def get_caption(result_id: str, state: State, results: Results,
                      attention_format: AttentionFormatQuery = "json") -> Response | CaptionOut:
    return caption_answer(state, results.get(result_id).result, result_id, attention_format)


# response_class: the answer is a picture, not FastAPI's default JSON (which the document listed beside the PNG)
@router.get("/captions/{result_id}/overlay", summary="Render a previous result's attention (no model run)",
            responses=RENDERED, response_class=Response)
async def get_overlay(request: Request, result_id: str, state: State, results: Results, format: FormatQuery = None,
                      token: TokenQuery = None, mode: ModeQuery = None, cmap: CmapQuery = "jet",
                      alpha: AlphaQuery = 0.5, max_side: SideQuery = None):
    return await _respond(request, state, results.get(result_id),
                          RenderOptions(_format(format, token), token, mode, cmap, alpha, max_side), result_id)


@router.post("/caption/overlay", summary="Caption an image and render its attention in one call",
             openapi_extra=CAPTION_BODY, responses=RENDERED, response_class=Response)
async def post_overlay(request: Request, state: State, results: Results, options: QueryOptions,
                       format: FormatQuery = None, token: TokenQuery = None, mode: ModeQuery = None,
                       cmap: CmapQuery = "jet", alpha: AlphaQuery = 0.5, max_side: SideQuery = None):
    return await _caption_and_render(request, state, results, options,
                                     RenderOptions(_format(format, token), token, mode, cmap, alpha, max_side))


async def _caption_and_render(request: Request, state: ServiceState, results: Results, options: QueryOptions,
                              render: RenderOptions) -> Response:
    """Caption the upload, keep the result, and render it; what ``render`` could not draw for the model is refused
    before the model runs."""
    data, result = await caption_upload(request, state, options,
                                        check=lambda runtime, max_len: check_render_options(render, runtime,
                                                                                            max_len))
    result_id = results.put(result, data)
    return await _respond(request, state, results.get(result_id), render, result_id)


@router.get("/captions/{result_id}/heatmaps", response_model=HeatmapsOut, responses=HEATMAPS,
            summary="A previous result's per-word heatmaps as JSON (no model run)")
async def get_heatmaps(request: Request, result_id: str, state: State, results: Results,
                       mode: HeatModeQuery = None, max_side: HeatSideQuery = None):
    return await _respond(request, state, results.get(result_id), RenderOptions("json", None, mode, max_side=max_side),
                          result_id)


@router.post("/caption/heatmaps", response_model=HeatmapsOut, responses=HEATMAPS, openapi_extra=CAPTION_BODY,
             summary="Caption an image and return its per-word heatmaps as JSON in one call")
async def post_heatmaps(request: Request, state: State, results: Results, options: QueryOptions,
                        mode: HeatModeQuery = None, max_side: HeatSideQuery = None):
    return await _caption_and_render(request, state, results, options, RenderOptions("json", None, mode,
                                                                                      max_side=max_side))
