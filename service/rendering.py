"""The overlay use case: render a stored caption result's attention (a word's overlay PNG, the papers' per-word
figure, or per-word heatmaps as JSON: format ``json``, the ``/heatmaps`` routes) without running the model again.

Rendering is CPU work on numpy/PIL: :func:`render_result` runs it in the thread pool, off the event loop, a
bounded number at once (work_slots.py).  Bad
parameters raise :class:`~captioner.models.rendering.heatmaps.RenderError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
from PIL import Image

from captioner.models.images import load_image
from captioner.models.inference import CaptionResult, Runtime
from captioner.models.rendering.heatmaps import (HEAT_MODES, RenderError, check_mode, colormap,
                                                 drawn_heat, png_bytes)

from .results import StoredResult
from .work_slots import WorkSlots

#: what the overlay routes draw (a picture), and every render format (``json``: the ``/heatmaps`` routes)
PictureFormat = Literal["png", "figure"]
Format = Literal[PictureFormat, "json"]
#: the longer side of what is rendered when the request names no ``max_side``, and the most it may name: an
#: overlay costs memory in proportion to its pixels (a 40-megapixel upload would need gigabytes)
DEFAULT_RENDER_SIDE, MAX_RENDER_SIDE = 2048, 4096
#: the JSON heatmaps' default and largest side: it encodes one map per token (33 maps at 4,096 px took 20 s of a render
#: slot and 12 MB, again on every GET of the same result); heat maps are smooth, a client scales them up
JSON_RENDER_SIDE = 1024


@dataclass
class Heatmaps:
    """Every word's heat map (format ``json``): ``maps[i]`` is token ``tokens[i]``'s, a grayscale PNG of ``size``
    (width, height), 255 where its attention peaks."""

    mode: str
    size: tuple[int, int]
    tokens: list[str]
    maps: list[bytes]


@dataclass
class RenderOptions:
    format: Format = "png"
    token: int | None = None
    mode: str | None = None
    cmap: str = "jet"
    alpha: float = 0.5
    max_side: int | None = None


def check_render_options(options: RenderOptions, runtime: Runtime | None = None, max_len: int | None = None) -> None:
    """Refuse what no result could render or, given the ``runtime`` that will caption the upload and the caption's
    length limit ``max_len``, what no result of its model could (both before a caption is run for it); a token
    within the limit but past the caption's end is refused on the result."""
    if options.format == "png" and options.token is None:
        raise RenderError("format=png needs ?token=i (or use format=figure for the whole caption)")
    if options.format == "figure" and options.token is not None:
        raise RenderError("format=figure draws every word: leave out token (or use format=png for one word)")
    if max_len is not None and options.token is not None and options.token >= max_len:
        raise RenderError(f"token {options.token} is out of range: a caption of at most max_len={max_len} tokens "
                          f"has tokens 0 to {max_len - 1}")
    if options.mode is not None:
        check_mode(options.mode)
    if options.format == "json" and options.mode is not None and options.mode not in HEAT_MODES:
        raise RenderError(f"the heatmaps as JSON are heat maps: mode must be one of {', '.join(HEAT_MODES)} "
                          f"({options.mode} draws boxes: use the overlay, format=png or figure)")
    if options.format == "json" and (options.max_side or 0) > JSON_RENDER_SIDE:
        raise RenderError(f"the heatmaps as JSON are one map per token: max_side is at most {JSON_RENDER_SIDE} "
                          "for them (scale the maps up, or draw one token with the overlay, format=png)")
    colormap(options.cmap)
    if runtime is not None and options.mode == "area_topk" and not runtime.reports_areas:
        raise RenderError(f"area_topk draws area attention, which model {runtime.name!r} does not have (a model "
                          "with decoder area attention has)")


def drawn_mode(result: CaptionResult, options: RenderOptions) -> str:
    """The mode a render draws: the one asked for, else the model's default (:attr:`CaptionResult.default_mode`)."""
    return options.mode or result.default_mode


def _at_most(picture: Image.Image, side: int) -> Image.Image:
    """``picture``, shrunk in place to a longer side of at most ``side`` pixels."""
    picture.thumbnail((side, side))  # (never enlarges)
    return picture


def _render(stored: StoredResult, options: RenderOptions) -> bytes | Heatmaps:
    check_render_options(options)
    result = stored.result
    side = options.max_side or (JSON_RENDER_SIDE if options.format == "json" else DEFAULT_RENDER_SIDE)
    # a large JPEG is decoded at 1/2, 1/4 or 1/8 of its size
    image = _at_most(load_image(stored.upload, reduce_to=side), side)
    mode, style = drawn_mode(result, options), {"cmap": options.cmap, "alpha": options.alpha}
    if options.format == "figure":  # panels of a fixed size, whatever the photo's: the whole figure is bounded too
        return png_bytes(_at_most(result.figure(image, mode, **style), side))
    if options.format == "png":
        return png_bytes(result.overlay(image, options.token, mode, **style))
    rows = result.drawn_rows(mode)
    maps = []  # box modes were refused above, and every default mode draws heat
    for i in range(len(result.tokens)):
        heat = drawn_heat(rows[i], result.geometry, mode, image.size)
        maps.append(png_bytes(Image.fromarray((heat * 255).round().astype(np.uint8), mode="L")))
    return Heatmaps(mode, image.size, list(result.tokens), maps)


async def render_result(stored: StoredResult, options: RenderOptions, slots: WorkSlots,
                        timeout: float | None = None) -> bytes | Heatmaps:
    """PNG bytes (``png``, ``figure``) or the heatmaps (``json``, the ``/heatmaps`` routes) of a stored result,
    rendered in one of ``slots`` (:class:`TimeoutError` when none frees within ``timeout`` seconds)."""
    return await slots.run(_render, stored, options, timeout=timeout)
