"""Heatmap endpoints: overlay PNGs, the papers' per-word figure, and per-word heatmaps as JSON.

Every caption result is kept (with its upload) in a bounded LRU :class:`ResultStore`, so
``GET /captions/{id}/overlay`` re-renders any word in any mode without running the model again.
Rendering is CPU work on numpy/PIL, so it runs in the thread pool, off the event loop.
"""

from __future__ import annotations

import base64
import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Annotated, Literal

import numpy as np
from fastapi import APIRouter, Depends, File, Query, Request, UploadFile
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response
from PIL import Image

from captioner.models.encoder import load_image
from captioner.models.rendering.heatmaps import MODES, RenderError, caption_figure, default_mode, heatmap, overlay, png_bytes

from .problems import Problem
from .routes import State, read_upload, run_caption
from .runtime import CaptionResult

router = APIRouter()
Format = Literal["png", "figure", "json"]


@dataclass
class StoredResult:
    result: CaptionResult
    upload: bytes


class ResultStore:
    """Recent results by id, evicting the oldest once their uploads exceed ``max_bytes``."""

    def __init__(self, max_bytes: int = 256 * 1024 * 1024):
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, StoredResult] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, result: CaptionResult, upload: bytes) -> str:
        key = uuid.uuid4().hex
        with self._lock:
            self._items[key] = StoredResult(result, upload)
            self._bytes += len(upload)
            while self._bytes > self.max_bytes and len(self._items) > 1:
                _, old = self._items.popitem(last=False)
                self._bytes -= len(old.upload)
        return key

    def get(self, key: str) -> StoredResult:
        with self._lock:
            item = self._items.get(key)
            if item is not None:
                self._items.move_to_end(key)
        if item is None:
            raise Problem(404, f"no caption result with id {key!r} (results are kept for a limited time)",
                          kind="unknown-result")
        return item


def get_results(request: Request) -> ResultStore:
    return request.app.state.results


Results = Annotated[ResultStore, Depends(get_results)]


def _render(stored: StoredResult, fmt: Format, token: int | None, mode: str | None, cmap: str, alpha: float,
            max_side: int | None) -> tuple[bytes | dict, str]:
    result = stored.result
    hyp = result.hypothesis
    image = load_image(stored.upload)
    if max_side and max(image.size) > max_side:
        image.thumbnail((max_side, max_side))
    words = result.to_json()["tokens"]
    attention = hyp.attention.numpy()
    area_boxes = result.area_boxes
    weights_of = (lambda i: hyp.extras["areas"][i].numpy()) if mode == "area_topk" and "areas" in hyp.extras else \
        (lambda i: attention[i])
    mode = mode or default_mode(result.geometry, result.attention_kind)
    if fmt == "figure":
        rows = [weights_of(i) for i in range(len(words))]
        return png_bytes(caption_figure(image, words, rows, result.geometry, mode, cmap, alpha,
                                        area_boxes=area_boxes)), "image/png"
    if fmt == "png":
        if token is None:
            raise RenderError("format=png needs ?token=i (or use format=figure for the whole caption)")
        if not 0 <= token < len(words):
            raise RenderError(f"token {token} is out of range: the caption has {len(words)} tokens")
        return png_bytes(overlay(image, weights_of(token), result.geometry, mode, cmap, alpha, area_boxes)), "image/png"
    scale = image.width / result.geometry.image_size[0]
    heatmaps = []
    for i, word in enumerate(words):
        heat = heatmap(attention[i], result.geometry, mode if mode in ("grid_smooth", "grid_blocks", "region_sum")
                       else default_mode(result.geometry), image.size, scale)
        gray = Image.fromarray((heat * 255).round().astype(np.uint8), mode="L")
        heatmaps.append({"token": word, "index": i, "heat_png": base64.b64encode(png_bytes(gray)).decode()})
    return {"mode": mode, "size": list(image.size), "heatmaps": heatmaps}, "application/json"


async def _respond(stored: StoredResult, fmt: Format, token: int | None, mode: str | None, cmap: str, alpha: float,
                   max_side: int | None, result_id: str | None = None):
    try:
        body, media = await run_in_threadpool(_render, stored, fmt, token, mode, cmap, alpha, max_side)
    except RenderError as exc:
        raise Problem(422, str(exc), kind="invalid-render-request") from None
    if isinstance(body, dict):
        return {"id": result_id, **body}
    headers = {"X-Caption-Id": result_id} if result_id else None
    return Response(body, media_type=media, headers=headers)


ModeQuery = Annotated[str | None, Query(description=f"one of {', '.join(MODES)}; default by geometry and model")]
TokenQuery = Annotated[int | None, Query(ge=0, description="token index for format=png")]
CmapQuery = Annotated[str, Query(description="matplotlib colormap name")]
AlphaQuery = Annotated[float, Query(ge=0.0, le=1.0, description="heatmap opacity")]
SideQuery = Annotated[int | None, Query(ge=16, le=8192, description="downscale so the longer side is at most this")]


@router.get("/captions/{result_id}", summary="A previous caption result (JSON), by id")
async def get_caption(result_id: str, results: Results) -> dict:
    return {"id": result_id, **results.get(result_id).result.to_json()}


@router.get("/captions/{result_id}/overlay", summary="Render a previous result's attention (no model run)",
            responses={200: {"content": {"image/png": {}, "application/json": {}}}})
async def get_overlay(result_id: str, results: Results, format: Format = "png", token: TokenQuery = None,
                      mode: ModeQuery = None, cmap: CmapQuery = "jet", alpha: AlphaQuery = 0.5,
                      max_side: SideQuery = None):
    return await _respond(results.get(result_id), format, token, mode, cmap, alpha, max_side, result_id)


@router.post("/caption/overlay", summary="Caption an image and render its attention in one call",
             responses={200: {"content": {"image/png": {}, "application/json": {}}}})
async def post_overlay(state: State, results: Results,
                       file: Annotated[UploadFile, File(description="image file")],
                       model: str | None = None, beam_size: Annotated[int | None, Query(ge=1)] = None,
                       max_len: Annotated[int | None, Query(ge=1)] = None, format: Format = "figure",
                       token: TokenQuery = None, mode: ModeQuery = None, cmap: CmapQuery = "jet",
                       alpha: AlphaQuery = 0.5, max_side: SideQuery = None):
    data = await read_upload(file, state.settings.max_upload_bytes)
    result = await run_caption(state, data, model, beam_size, max_len)
    result_id = results.put(result, data)
    return await _respond(results.get(result_id), format, token, mode, cmap, alpha, max_side, result_id)
