"""The overlay use case: render a stored caption result's attention (a word's overlay PNG, the papers' per-word
figure, or per-word heatmaps as JSON) without running the model again.

Rendering is CPU work on numpy/PIL: :func:`render_result` runs it in the thread pool, off the event loop.  Bad
parameters raise :class:`~captioner.models.rendering.heatmaps.RenderError`.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Literal

import numpy as np
from PIL import Image
from starlette.concurrency import run_in_threadpool

from captioner.models.encoder import load_image
from captioner.models.rendering.heatmaps import RenderError, caption_figure, default_mode, heatmap, overlay, png_bytes

from .results import StoredResult
from .schemas import HeatmapOut, HeatmapsOut

Format = Literal["png", "figure", "json"]


@dataclass
class RenderOptions:
    format: Format = "png"
    token: int | None = None
    mode: str | None = None
    cmap: str = "jet"
    alpha: float = 0.5
    max_side: int | None = None


def _render(stored: StoredResult, options: RenderOptions, result_id: str | None) -> bytes | HeatmapsOut:
    result = stored.result
    hyp = result.hypothesis
    image = load_image(stored.upload)
    if options.max_side and max(image.size) > options.max_side:
        image.thumbnail((options.max_side, options.max_side))
    words = result.tokens
    attention = hyp.attention.numpy()
    area_boxes = result.area_boxes
    token, cmap, alpha = options.token, options.cmap, options.alpha
    weights_of = (lambda i: hyp.extras["areas"][i].numpy()) if options.mode == "area_topk" and "areas" in hyp.extras \
        else (lambda i: attention[i])
    mode = options.mode or default_mode(result.geometry, result.attention_kind)
    if options.format == "figure":
        rows = [weights_of(i) for i in range(len(words))]
        return png_bytes(caption_figure(image, words, rows, result.geometry, mode, cmap, alpha, area_boxes=area_boxes))
    if options.format == "png":
        if token is None:
            raise RenderError("format=png needs ?token=i (or use format=figure for the whole caption)")
        if not 0 <= token < len(words):
            raise RenderError(f"token {token} is out of range: the caption has {len(words)} tokens")
        return png_bytes(overlay(image, weights_of(token), result.geometry, mode, cmap, alpha, area_boxes))
    scale = image.width / result.geometry.image_size[0]
    heatmaps = []
    for i, word in enumerate(words):
        heat = heatmap(attention[i], result.geometry, mode if mode in ("grid_smooth", "grid_blocks", "region_sum")
                       else default_mode(result.geometry), image.size, scale)
        gray = Image.fromarray((heat * 255).round().astype(np.uint8), mode="L")
        heatmaps.append(HeatmapOut(token=word, index=i, heat_png=base64.b64encode(png_bytes(gray)).decode()))
    return HeatmapsOut(id=result_id, mode=mode, size=list(image.size), heatmaps=heatmaps)


async def render_result(stored: StoredResult, options: RenderOptions, result_id: str | None) -> bytes | HeatmapsOut:
    """PNG bytes (``png``, ``figure``) or the heatmaps (``json``) of a stored result."""
    return await run_in_threadpool(_render, stored, options, result_id)
