"""Property tests (hypothesis) of the heatmap renderer: for any attention row on any image shape the heat is
finite, of the image's size, in [0, 1] with its maximum at 1 when the row's peak holds at least twice the uniform
share and at 0 when the row is uniform (docs/decisions.md#heatmap-modes), and the overlay keeps the image's size;
bad modes and alphas are a RenderError (a 422 in the service), never another exception."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from PIL import Image

from captioner.models.encoder import EncoderSpec, grid_geometry
from captioner.models.rendering.heatmaps import (HEAT_MODES, MODES, RenderError, default_mode, drawn_heat, heatmap,
                                                 overlay)

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


@settings(max_examples=40, deadline=None, derandomize=True)
@given(size=sizes, row=weights, alpha=st.floats(0, 1) | st.floats(-2, 3, allow_nan=False),
       mode=st.sampled_from(HEAT_MODES) | st.none() | st.text(max_size=12))
def test_overlay_draws_its_heat_at_the_image_size_or_refuses_cleanly(size, row, alpha, mode):
    image = Image.new("RGB", size, (30, 60, 90))
    geometry = grid_geometry(SPEC, size)
    mode = mode or None  # no mode, or an empty one: the geometry's default
    assume(mode is None or mode in HEAT_MODES or mode not in MODES)  # the box modes draw no heat
    if not (mode is None or mode in HEAT_MODES) or not 0 <= alpha <= 1:
        with pytest.raises(RenderError):
            overlay(image, row, geometry, mode, "jet", alpha)
        return
    out = overlay(image, row, geometry, mode, "jet", alpha)
    assert out.size == size
    # where the heat is drawn, and only there: a smooth map tints the whole picture, the others only where the heat
    # is above zero (no jet colour is this background's, so a visible alpha changes every tinted pixel)
    changed = np.any(np.asarray(out) != np.asarray(image), axis=-1)
    mode = mode or default_mode(geometry)
    heat = drawn_heat(row, geometry, mode)
    if alpha == 0:
        assert not changed.any()
    elif alpha >= 0.1:
        np.testing.assert_array_equal(changed, np.ones_like(changed) if mode == "grid_smooth" else heat > 0)
