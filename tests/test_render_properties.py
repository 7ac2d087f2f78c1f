"""Property tests (hypothesis) of the heatmap renderer: for any attention row on any image shape the heat is
finite, of the image's size, in [0, 1] with its maximum at 1 when the row's peak holds at least twice the uniform
share and at 0 when the row is uniform (docs/decisions.md#heatmap-modes), and the overlay keeps the image's size;
bad modes and alphas are a RenderError (a 422 in the service), never another exception."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from captioner.models.encoder import EncoderSpec, grid_geometry
from captioner.models.rendering.heatmaps import HEAT_MODES, RenderError, drawn_heat, heatmap, overlay

SPEC = EncoderSpec(image_size=96)  # a 3×3 grid
CELLS = SPEC.grid_hw[0] * SPEC.grid_hw[1]
sizes = st.tuples(st.integers(1, 300), st.integers(1, 300))
weights = st.lists(st.floats(0, 1, allow_nan=False, width=32), min_size=CELLS, max_size=CELLS)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(size=sizes, row=weights, mode=st.sampled_from(HEAT_MODES))
def test_heat_is_bounded_and_image_sized(size, row, mode):
    heat = heatmap(row, grid_geometry(SPEC, size), mode)
    assert heat.shape == (size[1], size[0]) and np.isfinite(heat).all()
    assert heat.min() >= 0 and heat.max() <= 1 + 1e-6
    if max(row) > 0:
        assert abs(float(heat.max()) - 1) < 1e-5
    drawn = drawn_heat(row, grid_geometry(SPEC, size), mode)
    assert drawn.shape == heat.shape and (drawn <= heat + 1e-6).all()
    if sum(row) > 0 and len(row) * max(row) / sum(row) >= 2:
        np.testing.assert_allclose(drawn, heat, atol=1e-6)  # a peaked row is drawn as its map
    if len(set(row)) == 1:
        assert drawn.max() == 0


@settings(max_examples=30, deadline=None, derandomize=True)
@given(size=sizes, row=weights, alpha=st.floats(-2, 3, allow_nan=False), mode=st.text(max_size=12) | st.none())
def test_overlay_keeps_the_size_or_refuses_cleanly(size, row, alpha, mode):
    image = Image.new("RGB", size, (30, 60, 90))
    try:
        out = overlay(image, row, grid_geometry(SPEC, size), mode, "jet", alpha)
    except RenderError:
        return
    assert out.size == size and 0 <= alpha <= 1
