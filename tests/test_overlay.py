"""Overlay endpoints: valid PNGs of the right size, every mode, reuse without re-running the model."""

import base64
import dataclasses
import functools
import io
import threading
import time
import typing

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from PIL import Image
from skimage import data

from captioner.models.checkpoint import save_checkpoint
from captioner.models.encoder import grid_geometry
from captioner.models.images import load_image
from captioner.models.rendering.heatmaps import drawn_heat, overlay
from captioner.service import rendering
from captioner.service.app import create_app

from .serving_helpers import TINY_SPEC, VOCAB, count_encodes, serving_settings, tiny_model
from .test_service import _png, tiny_weights  # noqa: F401  (fixture)


@pytest.fixture(scope="module")
def client(tiny_weights):  # noqa: F811
    with TestClient(create_app(serving_settings(weights_dir=tiny_weights, default_model="tiny-a"))) as c:
        yield c


@pytest.fixture(scope="module")
def result(client):
    photo = _png(Image.fromarray(data.coffee()), "JPEG")
    body = client.post("/caption", params={"max_len": 4}, files={"file": ("coffee.jpg", photo, "image/jpeg")}).json()
    return body


def _image(response) -> Image.Image:
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "image/png"
    return Image.open(io.BytesIO(response.content))


@pytest.mark.parametrize("mode", ["grid_smooth", "grid_blocks", None])
def test_word_overlay_png_has_the_image_size(client, result, mode):
    params = {"token": 0, **({"mode": mode} if mode else {})}
    response = client.get(f"/captions/{result['id']}/overlay", params=params)
    assert _image(response).size == (600, 400)
    # the demo page names what it shows: the mode asked for, else the model's own (a softmax SAT's is grid_smooth)
    assert response.headers["x-heatmap-mode"] == (mode or "grid_smooth")
    small = _image(client.get(f"/captions/{result['id']}/overlay", params={**params, "max_side": 150}))
    assert small.size == (150, 100)


def test_figure_and_json_formats(client, result):
    figure = _image(client.get(f"/captions/{result['id']}/overlay", params={"format": "figure"}))
    assert figure.width > 400
    # max_side bounds the figure too (its panels have a fixed size, so it was the same whatever max_side said)
    bounded = _image(client.get(f"/captions/{result['id']}/overlay", params={"format": "figure", "max_side": 200}))
    assert max(bounded.size) == 200 and abs(bounded.width / bounded.height - figure.width / figure.height) < 0.1
    body = client.get(f"/captions/{result['id']}/heatmaps", params={"max_side": 300}).json()
    assert [h["token"] for h in body["heatmaps"]] == result["tokens"]
    heat = Image.open(io.BytesIO(base64.b64decode(body["heatmaps"][0]["heat_png"])))
    assert heat.size == (300, 200) and heat.mode == "L"


def test_an_overlay_without_a_format_is_a_words_png_given_a_token_else_the_figure(client, result):
    """A bare overlay URL opened in a browser shows the whole caption's figure (it was a 422 asking for a token);
    with a token it is that word's overlay, on both endpoints."""
    overlay = f"/captions/{result['id']}/overlay"
    assert _image(client.get(overlay)).tobytes() == _image(client.get(overlay, params={"format": "figure"})).tobytes()
    word = client.get(overlay, params={"token": 0})
    assert _image(word).tobytes() == _image(client.get(overlay, params={"format": "png", "token": 0})).tobytes()
    upload = {"file": ("x.png", _png(Image.new("RGB", (90, 60), (9, 9, 9))), "image/png")}
    assert _image(client.post("/caption/overlay", params={"token": 0}, files=upload)).size == (90, 60)
    figure = client.post("/caption/overlay", files=upload)
    stored = f"/captions/{figure.headers['x-caption-id']}/overlay"
    assert _image(figure).tobytes() == _image(client.get(stored, params={"format": "figure"})).tobytes()


def test_each_words_overlay_is_its_own_attention_row_drawn(client, result):
    """Every token's overlay is the library's drawing of that token's row on the decoded photo (every test asked for
    token 0: one that drew row 0 for every word passed them all)."""
    photo = load_image(_png(Image.fromarray(data.coffee()), "JPEG"))
    geometry = grid_geometry(client.app.state.service.runtimes["tiny-a"].spec, photo.size)
    drawn = []
    for token, row in enumerate(result["attention"]):
        served = np.asarray(_image(client.get(f"/captions/{result['id']}/overlay",
                                              params={"token": token, "mode": "grid_blocks"})), np.int16)
        expected = np.asarray(overlay(photo, np.array(row, np.float32), geometry, "grid_blocks"), np.int16)
        assert np.abs(served - expected).max() <= 1, token
        drawn.append(served)
    rows = np.array(result["attention"])
    # the two most different rows (the tiny model's rows can be near uniform, and two of them drawn alike)
    pairs = [(i, j) for i in range(len(rows)) for j in range(i + 1, len(rows))]
    i, j = max(pairs, key=lambda pair: np.abs(rows[pair[0]] - rows[pair[1]]).max())
    assert not np.allclose(rows[i], rows[j]) and np.abs(drawn[i] - drawn[j]).max() > 10


def test_reusing_a_result_does_not_run_the_model(client, result):
    runtime = client.app.state.service.runtimes["tiny-a"]
    calls = count_encodes(runtime)
    try:
        for token in range(len(result["tokens"])):
            _image(client.get(f"/captions/{result['id']}/overlay", params={"token": token}))
        assert client.get(f"/captions/{result['id']}").json()["caption"] == result["caption"]
    finally:
        del runtime.begin
    assert calls == []


def test_post_overlay_captions_and_renders_in_one_call(client):
    response = client.post("/caption/overlay", params={"format": "png", "token": 0, "mode": "grid_blocks"},
                           files={"file": ("x.png", _png(Image.new("RGB", (90, 60), (9, 9, 9))), "image/png")})
    assert _image(response).size == (90, 60)
    assert client.get(f"/captions/{response.headers['x-caption-id']}").status_code == 200


def test_exif_rotated_upload_overlay_has_the_displayed_size(client):
    exif = Image.Exif()
    exif[0x0112] = 6
    buffer = io.BytesIO()
    Image.new("RGB", (120, 200)).save(buffer, format="JPEG", exif=exif)
    response = client.post("/caption/overlay", params={"format": "png", "token": 0},
                           files={"file": ("r.jpg", buffer.getvalue(), "image/jpeg")})
    assert _image(response).size == (200, 120)


@pytest.mark.parametrize("params,status", [({"token": 99}, 422), ({"format": "png"}, 422),
                                           ({"token": 0, "mode": "region_sum"}, 200),
                                           ({"token": 0, "mode": "area_topk"}, 422),
                                           ({"token": 0, "mode": "nope"}, 422),
                                           ({"token": 0, "cmap": "nope"}, 422), ({"token": 0, "alpha": 2}, 422)])
def test_bad_overlay_requests_are_problems(client, result, params, status):
    response = client.get(f"/captions/{result['id']}/overlay", params=params)
    assert response.status_code == status
    if status != 200:
        assert response.headers["content-type"].startswith("application/problem+json")


@pytest.mark.parametrize("alpha", ["-0.1", "1.5", "nan"])
def test_an_opacity_outside_0_to_1_is_refused_as_the_query_parameter_it_is(client, result, alpha):
    """``alpha`` is bounded where the query is read (the documented bounds of the OpenAPI schema), so its 422 names
    ``query.alpha`` rather than coming from the renderer."""
    response = client.get(f"/captions/{result['id']}/overlay", params={"token": 0, "alpha": alpha})
    assert response.status_code == 422 and response.json()["type"] == "/problems/invalid-request"
    assert [error["loc"] for error in response.json()["errors"]] == [["query", "alpha"]]


def test_a_negative_token_is_refused_as_the_query_parameter_it_is_on_both_overlay_routes(client, result):
    """``token`` is bounded at 0 where the query is read, as the document states: a bound moved to -1 let
    ``token=-1`` through to the renderer, whose 422 is another problem type and names no query parameter."""
    photo = {"file": ("x.png", _png(Image.new("RGB", (90, 60), (9, 9, 9))), "image/png")}
    for response in (client.get(f"/captions/{result['id']}/overlay", params={"token": -1}),
                     client.post("/caption/overlay", params={"token": -1}, files=photo)):
        assert response.status_code == 422 and response.json()["type"] == "/problems/invalid-request"
        assert [error["loc"] for error in response.json()["errors"]] == [["query", "token"]]
    parameters = client.get("/openapi.json").json()["paths"]["/captions/{result_id}/overlay"]["get"]["parameters"]
    token = next(parameter for parameter in parameters if parameter["name"] == "token")
    assert token["schema"]["anyOf"][0]["minimum"] == 0


def test_a_heat_map_side_past_1024_is_refused_as_the_query_parameter_it_is_on_both_heatmaps_routes(client, result):
    """``max_side`` of the JSON heat maps is bounded at 1024 where the query is read, as the document states: a
    bound of the overlay's 4096 there was still a 422 from the renderer, but another problem type naming no query
    parameter, and the document offered sides up to 4096."""
    photo = {"file": ("x.png", _png(Image.new("RGB", (90, 60), (9, 9, 9))), "image/png")}
    for response in (client.get(f"/captions/{result['id']}/heatmaps", params={"max_side": 1025}),
                     client.post("/caption/heatmaps", params={"max_side": 1025}, files=photo)):
        assert response.status_code == 422 and response.json()["type"] == "/problems/invalid-request"
        assert [error["loc"] for error in response.json()["errors"]] == [["query", "max_side"]]
    paths = client.get("/openapi.json").json()["paths"]
    for path, method in (("/captions/{result_id}/heatmaps", "get"), ("/caption/heatmaps", "post")):
        side = next(parameter for parameter in paths[path][method]["parameters"] if parameter["name"] == "max_side")
        assert side["schema"]["anyOf"][0]["maximum"] == 1024, path


def test_unknown_result_is_404(client):
    response = client.get("/captions/does-not-exist/overlay", params={"token": 0})
    assert response.status_code == 404 and response.json()["type"].endswith("unknown-result")
    # RFC 9457's members and nothing else: a failure without per-field errors has no ``errors`` (not a null one)
    assert set(response.json()) == {"type", "title", "status", "detail", "instance"}


def test_demo_page_is_served_without_external_resources(client):
    page = client.get("/")
    assert page.status_code == 200 and "<html" in page.text
    for asset in ("/static/app.js", "/static/style.css"):
        assert client.get(asset).status_code == 200
    assert "http://" not in page.text and "https://" not in page.text


def test_area_model_returns_area_boxes_and_renders_its_top_areas(tmp_path):
    save_checkpoint(tmp_path / "area", tiny_model("area-transformer"), VOCAB, TINY_SPEC)
    with TestClient(create_app(serving_settings(weights_dir=tmp_path, default_model="area"))) as client:
        photo = _png(Image.fromarray(data.coffee()), "JPEG")
        body = client.post("/caption", params={"max_len": 3},
                           files={"file": ("coffee.jpg", photo, "image/jpeg")}).json()
        grid = body["geometry"]["grid_hw"]
        boxes = body["area_boxes"]
        assert len(boxes) == len(body["extras"]["areas"][0]) and [0, 0, 0, 0] in boxes
        assert all(0 <= r1 <= r2 < grid[0] and 0 <= c1 <= c2 < grid[1] for r1, c1, r2, c2 in boxes)
        plain = _image(client.get(f"/captions/{body['id']}/overlay", params={"token": 0, "mode": "grid_blocks"}))
        top = _image(client.get(f"/captions/{body['id']}/overlay", params={"token": 0, "mode": "area_topk"}))
        assert top.size == plain.size == (600, 400)
        assert top.tobytes() != plain.tobytes()


def test_an_area_model_offers_area_topk_for_an_upload_and_a_model_without_areas_does_not(tmp_path):
    """``GET /models`` lists ``area_topk`` among the heatmap modes of a model whose decoder attends over areas
    (``Runtime.reports_areas``), and ``POST /caption/overlay`` draws it for an upload; a model without areas lists
    it nowhere and is refused it (every model refusing it, and listing it nowhere, agreed with itself too)."""
    for name, arch in (("area", "area-transformer"), ("sat", "sat")):
        save_checkpoint(tmp_path / name, tiny_model(arch), VOCAB, TINY_SPEC)
    with TestClient(create_app(serving_settings(weights_dir=tmp_path, default_model="sat"))) as client:
        modes = {m["name"]: m["heatmap_modes"] for m in client.get("/models").json()}
        assert "area_topk" in modes["area"] and "area_topk" not in modes["sat"]
        photo = _png(Image.new("RGB", (90, 60), (9, 9, 9)))
        for name, status in (("area", 200), ("sat", 422)):
            response = client.post("/caption/overlay", params={"model": name, "mode": "area_topk", "token": 0,
                                                               "max_len": 2},
                                   files={"file": ("x.png", photo, "image/png")})
            assert response.status_code == status, (name, response.text)


def test_json_heatmaps_refuse_box_modes_and_what_only_pictures_take_and_name_their_result(client, result):
    url = f"/captions/{result['id']}/heatmaps"
    for params in ({"mode": "top1_box"}, {"mode": "bogus"}):
        response = client.get(url, params=params)
        assert response.status_code == 422 and response.json()["type"] == "/problems/invalid-render-request", params
    for params in ({"cmap": "jet"}, {"token": 0}, {"format": "json"}):  # a picture's parameters: not taken here
        response = client.get(url, params=params)
        assert response.status_code == 422 and next(iter(params)) in response.json()["detail"], params
    # the JSON answer has its own routes: an overlay is a picture (one media type each in the document)
    moved = client.get(f"/captions/{result['id']}/overlay", params={"format": "json"})
    assert moved.status_code == 422 and "format" in moved.json()["detail"]
    blocks = client.get(url, params={"mode": "grid_blocks", "max_side": 300})
    assert blocks.json()["mode"] == "grid_blocks" and blocks.headers["x-caption-id"] == result["id"]
    heat = np.asarray(Image.open(io.BytesIO(base64.b64decode(blocks.json()["heatmaps"][0]["heat_png"]))))
    assert len(np.unique(heat)) <= 64  # blocks: one value per cell, not the smooth map's gradient


def test_post_overlay_refuses_what_it_cannot_draw_before_running_the_model(client):
    runtimes = [client.app.state.service.runtimes[name] for name in ("tiny-a", "tiny-b")]
    calls = [count_encodes(runtime) for runtime in runtimes]
    photo = _png(Image.new("RGB", (90, 60), (9, 9, 9)))
    try:
        for params in ({"format": "png"}, {"format": "png", "token": 0, "mode": "bogus"},
                       {"format": "figure", "cmap": "nope"}, {"format": "png", "token": 0, "mode": "area_topk"},
                       {"format": "figure", "token": 2},  # the figure draws every word: a token was dropped
                       {"token": 20}, {"token": 4, "max_len": 4},  # past any caption of that length limit
                       {"token": 0, "alpha": "nan"}):
            response = client.post("/caption/overlay", params=params, files={"file": ("x.png", photo, "image/png")})
            assert response.status_code == 422, params
        too_far = client.post("/caption/overlay", params={"token": 4}, data={"max_len": "4"},
                              files={"file": ("x.png", photo, "image/png")})  # the form's length, once it is read
        assert too_far.status_code == 422
        assert too_far.json()["detail"] == ("token 4 is out of range: a caption of at most max_len=4 tokens has "
                                            "tokens 0 to 3")
        nan = client.post("/caption/overlay", params={"token": 0, "alpha": "nan"},
                          files={"file": ("x.png", photo, "image/png")})
        assert "finite number" in nan.json()["detail"]
        # the model a form field names is known once the body is read, still before it runs
        named = client.post("/caption/overlay", params={"format": "figure", "mode": "area_topk"},
                            files={"file": ("x.png", photo, "image/png")}, data={"model": "tiny-b"})
        assert named.status_code == 422 and "'tiny-b'" in named.json()["detail"]
    finally:
        for runtime in runtimes:
            del runtime.begin
    assert calls == [[], []]


def test_overlays_of_a_large_photo_are_rendered_at_most_2048_pixels_wide_unless_asked(client):
    photo = _png(Image.new("RGB", (3000, 600), (90, 120, 30)))
    response = client.post("/caption/overlay", params={"format": "png", "token": 0, "max_len": 2},
                           files={"file": ("wide.png", photo, "image/png")})
    assert _image(response).size == (2048, 410)
    assert client.get(f"/captions/{response.headers['x-caption-id']}/overlay",
                      params={"token": 0, "max_side": 5000}).status_code == 422


def test_json_heat_maps_of_a_large_photo_are_at_most_1024_pixels(client):
    """The JSON heatmaps encode one map per token: at 4,096 px a 33-token caption cost 20 s of a render slot and
    12 MB, again on every GET of the same result; their default and largest side is 1,024 (format=png still draws
    4,096)."""
    photo = _png(Image.new("RGB", (3000, 600), (90, 120, 30)))
    result = client.post("/caption", params={"max_len": 2}, files={"file": ("wide.png", photo, "image/png")}).json()
    url = f"/captions/{result['id']}/overlay"
    assert client.get(f"/captions/{result['id']}/heatmaps").json()["size"] == [1024, 205]
    refused = client.get(f"/captions/{result['id']}/heatmaps", params={"max_side": 2048})
    assert refused.status_code == 422 and "1024" in refused.json()["detail"]
    assert _image(client.get(url, params={"token": 0, "max_side": 4096})).size == (3000, 600)


def test_a_uniform_attention_row_is_drawn_without_heat_in_every_format(client):
    """A word whose row is uniform (its model attended to nothing in particular) shows no heat: the JSON map is
    black and a block overlay is the photo itself, where peak normalisation drew full heat over the whole photo
    (the demo page shows the PNG overlay, so it agrees as well)."""
    photo = Image.new("RGB", (120, 80), (40, 90, 160))
    answer = client.post("/caption", params={"max_len": 3}, files={"file": ("p.png", _png(photo), "image/png")})
    stored = client.app.state.results.get(answer.json()["id"])
    attention = stored.result.hypothesis.attention
    flat = dataclasses.replace(stored.result.hypothesis, attention=torch.full_like(attention, 1 / attention.shape[1]))
    result_id = client.app.state.results.put(dataclasses.replace(stored.result, hypothesis=flat), stored.upload)
    overlay = f"/captions/{result_id}/overlay"
    body = client.get(f"/captions/{result_id}/heatmaps", params={"mode": "grid_blocks"}).json()
    for word in body["heatmaps"]:
        assert not np.asarray(Image.open(io.BytesIO(base64.b64decode(word["heat_png"])))).any(), word["token"]
    drawn = _image(client.get(overlay, params={"token": 0, "mode": "grid_blocks"})).convert("RGB")
    assert drawn.tobytes() == photo.tobytes()


def test_each_json_heatmap_draws_its_own_tokens_attention(client, result):
    """Heatmap i is token i's attention row drawn as heat (a map shifted by one token would show every word where
    its neighbour looked)."""
    body = client.get(f"/captions/{result['id']}/heatmaps", params={"max_side": 300}).json()
    geometry = client.app.state.results.get(result["id"]).result.geometry
    got = [np.asarray(Image.open(io.BytesIO(base64.b64decode(h["heat_png"]))), dtype=float) for h in body["heatmaps"]]
    expected = [drawn_heat(np.asarray(row, dtype=np.float32), geometry, body["mode"], tuple(body["size"])) * 255
                for row in result["attention"]]
    assert len(got) == len(expected) == len(result["tokens"])
    # each names its token and that token's place in the caption (from 0, as the answer's rows count)
    assert [(h["index"], h["token"]) for h in body["heatmaps"]] == list(enumerate(result["tokens"]))
    for heat, want in zip(got, expected):
        assert np.abs(heat - want).max() <= 1.5  # 8-bit levels; the answer's attention is rounded to 6 decimals
    # neighbours differ by more than twice the tolerance: a map shifted by one token would fail the check
    assert any(np.abs(a - b).max() > 4 for a, b in zip(got, got[1:]))


def test_an_overlay_is_drawn_in_the_colormap_and_opacity_it_asks_for(client, result):
    """``cmap`` and ``alpha`` reach the drawing on both overlay routes (every test drew the default jet at 0.5, or
    asked for a bad one: a route that dropped them passed)."""
    photo = load_image(_png(Image.fromarray(data.coffee()), "JPEG"))
    geometry = grid_geometry(client.app.state.service.runtimes["tiny-a"].spec, photo.size)
    row = np.array(result["attention"][0], np.float32)
    style = {"cmap": "viridis", "alpha": 0.8}
    params = {"token": 0, "mode": "grid_blocks", **style}
    served = np.asarray(_image(client.get(f"/captions/{result['id']}/overlay", params=params)), np.int16)
    expected = np.asarray(overlay(photo, row, geometry, "grid_blocks", **style), np.int16)
    assert np.abs(served - expected).max() <= 1
    assert np.abs(expected - np.asarray(overlay(photo, row, geometry, "grid_blocks"), np.int16)).max() > 10
    upload = {"file": ("x.png", _png(Image.new("RGB", (90, 60), (9, 9, 9))), "image/png")}
    posted = client.post("/caption/overlay", params=params, files=upload)
    stored = f"/captions/{posted.headers['x-caption-id']}/overlay"
    assert _image(posted).tobytes() == _image(client.get(stored, params=params)).tobytes()
    assert _image(posted).tobytes() != _image(client.get(stored, params={"token": 0, "mode": "grid_blocks"})).tobytes()


def test_post_heatmaps_captions_and_answers_the_stored_results_heatmaps(client):
    """``POST /caption/heatmaps`` keeps its result and answers what ``GET /captions/{id}/heatmaps`` answers for it,
    in the mode and at the side it names."""
    upload = {"file": ("x.png", _png(Image.new("RGB", (90, 60), (9, 9, 9))), "image/png")}
    params = {"mode": "grid_blocks", "max_side": 45}
    posted = client.post("/caption/heatmaps", params=params, files=upload)
    assert posted.status_code == 200 and posted.headers["content-type"] == "application/json", posted.text
    body = posted.json()
    assert body["mode"] == posted.headers["x-heatmap-mode"] == "grid_blocks" and body["size"] == [45, 30]
    assert body["id"] == posted.headers["x-caption-id"]
    stored = client.get(f"/captions/{posted.headers['x-caption-id']}/heatmaps", params=params)
    assert stored.json() == body and len(body["heatmaps"]) == len(client.get(
        f"/captions/{posted.headers['x-caption-id']}").json()["tokens"])
    runtime = client.app.state.service.runtimes["tiny-a"]
    calls = count_encodes(runtime)
    try:  # a box mode draws no heat: refused before the model runs, not after
        refused = client.post("/caption/heatmaps", params={"mode": "top1_box"}, files=upload)
    finally:
        del runtime.begin
    assert refused.status_code == 422 and calls == []


def test_post_overlay_refuses_an_option_no_result_could_draw_before_reading_the_upload(client):
    """What no caption could be drawn with is refused before the body is read: the answer names the option, not
    the upload (a body that is no image at all is never looked at, so it is not its 415 that comes back)."""
    response = client.post("/caption/overlay", params={"format": "png"}, content=b"x",
                           headers={"content-type": "text/plain"})
    assert response.status_code == 422 and response.json()["type"] == "/problems/invalid-render-request"
    assert "token" in response.json()["detail"]


def test_post_overlay_refuses_an_option_no_result_could_draw_even_while_the_service_is_not_ready(client):
    """The endpoint's own options are checked before the service's readiness: a request no result could be drawn
    for is its 422 while the service starts or drains too. Answered 503, a client would send it again after
    Retry-After, only to learn that the request itself was wrong once the service is ready."""
    state, text = client.app.state.service, {"content-type": "text/plain"}
    state.ready = False
    try:
        never_drawn = client.post("/caption/overlay", params={"format": "png"}, content=b"x", headers=text)
        drawable = client.post("/caption/overlay", params={"format": "figure"}, content=b"x", headers=text)
    finally:
        state.ready = True
    assert never_drawn.status_code == 422 and never_drawn.json()["type"] == "/problems/invalid-render-request"
    assert drawable.status_code == 503  # the service was not ready for any other request


@pytest.mark.parametrize("route,largest", [("overlay", 4096), ("heatmaps", 1024)])
def test_max_side_is_taken_from_16_pixels_to_the_documented_largest(client, result, route, largest):
    """The bounds the document states for ``max_side`` are the ones kept, at both ends (only far-off values were
    tried: a bound moved by one passed)."""
    url = f"/captions/{result['id']}/{route}"
    extra = {"token": 0} if route == "overlay" else {}
    for side, status in ((15, 422), (16, 200), (largest, 200), (largest + 1, 422)):
        assert client.get(url, params={**extra, "max_side": side}).status_code == status, side


def test_a_json_heatmap_is_255_where_a_peaked_row_looks_and_0_elsewhere(client):
    """The documented scale of the JSON maps (``Heatmaps``): full white at the attention's peak (every other check
    allowed a grey level or so, and a scale of 254 passed them)."""
    photo = Image.new("RGB", (120, 80), (40, 90, 160))
    answer = client.post("/caption", params={"max_len": 3}, files={"file": ("p.png", _png(photo), "image/png")})
    stored = client.app.state.results.get(answer.json()["id"])
    attention = torch.zeros_like(stored.result.hypothesis.attention)
    attention[:, 0] = 1.0  # every word looks at the first cell alone
    peaked = dataclasses.replace(stored.result.hypothesis, attention=attention)
    result_id = client.app.state.results.put(dataclasses.replace(stored.result, hypothesis=peaked), stored.upload)
    body = client.get(f"/captions/{result_id}/heatmaps", params={"mode": "grid_blocks"}).json()
    for word in body["heatmaps"]:
        heat = np.asarray(Image.open(io.BytesIO(base64.b64decode(word["heat_png"]))))
        assert heat.max() == 255 and heat[0, 0] == 255 and heat[-1, -1] == 0, word["token"]


def test_the_figure_is_drawn_in_the_mode_it_names(client, result):
    """``mode`` reaches the figure as it reaches one word's overlay (the header named the mode asked for while
    the figure was drawn in the model's own)."""
    url = f"/captions/{result['id']}/overlay"
    blocks = client.get(url, params={"format": "figure", "mode": "grid_blocks"})
    assert blocks.headers["x-heatmap-mode"] == "grid_blocks"
    assert _image(blocks).tobytes() != _image(client.get(url, params={"format": "figure"})).tobytes()


def test_an_overlay_asks_for_a_reduced_decode_of_the_upload(client, result, monkeypatch):
    """The render decodes the upload at the fraction of its size the picture needs (``reduce_to``: a 40-megapixel
    JPEG is decoded at 1/2 to 1/8 of its size for an overlay of at most 2,048 px); a full decode costs gigabytes."""
    asked = []

    def recording(data, *args, **kwargs):
        asked.append(kwargs.get("reduce_to"))
        return load_image(data, *args, **kwargs)

    monkeypatch.setattr(rendering, "load_image", recording)
    _image(client.get(f"/captions/{result['id']}/overlay", params={"token": 0, "max_side": 300}))
    _image(client.get(f"/captions/{result['id']}/overlay", params={"token": 0}))
    assert client.get(f"/captions/{result['id']}/heatmaps").status_code == 200
    assert asked == [300, 2048, 1024]


def test_the_heatmaps_routes_document_the_headers_of_their_answer(client):
    """Both ``/heatmaps`` routes document the result id and the drawn mode they send with their 200, as the overlay
    routes do (a generated client reads its headers off the document)."""
    paths = client.get("/openapi.json").json()["paths"]
    for path, method in (("/captions/{result_id}/heatmaps", "get"), ("/caption/heatmaps", "post")):
        assert {"X-Caption-Id", "X-Heatmap-Mode"} <= set(paths[path][method]["responses"]["200"]["headers"]), path


def test_the_picture_and_heatmaps_routes_document_what_their_answers_are(client):
    """/docs and a generated client describe each answer from its ``description``: the 200 says what the picture or
    the JSON holds and the 504 why it came (a misspelt key left FastAPI's "Successful Response" and "Gateway
    Timeout" in their place, beside a field the OpenAPI schema does not allow, which a strict validator refuses)."""
    paths = client.get("/openapi.json").json()["paths"]
    png = "PNG: one word's overlay (format=png) or every word's (format=figure)"
    maps = "every word's heatmap as a grayscale PNG in JSON"
    routes = [("/captions/{result_id}/overlay", "get", png), ("/caption/overlay", "post", png)]
    routes += [("/captions/{result_id}/heatmaps", "get", maps), ("/caption/heatmaps", "post", maps)]
    for path, method, ok in routes:
        answers = paths[path][method]["responses"]
        assert answers["200"]["description"] == ok, path
        assert answers["504"]["description"] == "deadline passed while waiting for a render slot", path
        for status in ("200", "504"):  # a Response Object's fields (OpenAPI 3.1, 4.8.17.1)
            assert set(answers[status]) <= {"description", "headers", "content", "links"}, (path, status)


def test_the_result_and_picture_routes_are_documented_with_their_summaries(client):
    """What /docs and a generated client show for each route of a stored result or a picture (the caption, model
    and health routes' summaries are held in test_service; these could be dropped in silence)."""
    paths = client.get("/openapi.json").json()["paths"]
    assert {(path, method): paths[path][method]["summary"] for path, method in (
        ("/captions/{result_id}", "get"), ("/captions/{result_id}/overlay", "get"), ("/caption/overlay", "post"),
        ("/captions/{result_id}/heatmaps", "get"), ("/caption/heatmaps", "post"))} == {
        ("/captions/{result_id}", "get"): "A previous caption result (JSON), by id",
        ("/captions/{result_id}/overlay", "get"): "Render a previous result's attention (no model run)",
        ("/caption/overlay", "post"): "Caption an image and render its attention in one call",
        ("/captions/{result_id}/heatmaps", "get"): "A previous result's per-word heatmaps as JSON (no model run)",
        ("/caption/heatmaps", "post"): "Caption an image and return its per-word heatmaps as JSON in one call"}


def test_an_overlay_waiting_past_the_request_deadline_for_a_render_slot_is_a_504(client, result, monkeypatch):
    """A render waits for its slot only as long as the request deadline leaves (docs: 504 when it passes); given no
    time limit, a request behind a stuck render waited for as long as that render ran."""
    state = client.app.state.service
    monkeypatch.setattr(state, "settings", state.settings.model_copy(update={"request_timeout_s": 0.5}))
    release = threading.Event()
    slots = state.render_slots
    busy = client.portal.start_task_soon(functools.partial(slots.run, release.wait, 30, cost=slots.capacity))
    timer = threading.Timer(10, release.set)  # what a request with no time limit would wait for
    timer.start()
    try:
        for _ in range(500):  # the slots are all taken before the request arrives: by one job, holding every unit
            if slots.running == 1:
                break
            time.sleep(0.01)
        response = client.get(f"/captions/{result['id']}/overlay", params={"token": 0})
    finally:
        release.set()
        timer.cancel()
        busy.result(timeout=30)
    assert response.status_code == 504, response.status_code
    assert "deadline passed while the overlay waited to be rendered" in response.json()["detail"]


def test_a_figure_is_drawn_in_the_colormap_and_opacity_it_asks_for(client, result):
    """``cmap`` and ``alpha`` reach the per-word figure as they reach one word's overlay (a figure drawn in the
    default jet at 0.5 whatever it asked for passed every test)."""
    url = f"/captions/{result['id']}/overlay"
    params = {"format": "figure", "mode": "grid_blocks", "max_side": 400}
    plain = _image(client.get(url, params=params)).tobytes()
    assert _image(client.get(url, params=params)).tobytes() == plain  # the figure is drawn the same each time
    assert _image(client.get(url, params={**params, "cmap": "viridis"})).tobytes() != plain
    assert _image(client.get(url, params={**params, "alpha": 0.9})).tobytes() != plain


def test_render_options_default_to_the_overlay_routes_style(client, result):
    """A library caller's ``RenderOptions`` draws what the routes draw when a request names no style (jet at half
    opacity): the routes pass their own defaults, so only a direct caller meets the dataclass's."""
    stored = client.app.state.results.get(result["id"])
    served = _image(client.get(f"/captions/{result['id']}/overlay", params={"token": 0, "mode": "grid_blocks"}))
    rendered = Image.open(io.BytesIO(rendering._render(stored, rendering.RenderOptions("png", 0, "grid_blocks"))))
    assert np.array_equal(np.asarray(rendered), np.asarray(served))


@pytest.mark.parametrize("side, refused", [(rendering.JSON_RENDER_SIDE, False), (rendering.JSON_RENDER_SIDE + 1, True),
                                           (rendering.MAX_RENDER_SIDE, True)])
def test_the_json_heatmaps_bound_on_max_side_is_the_use_cases_own(side, refused):
    """The render refuses JSON heatmaps past 1,024 px itself, not only the routes' query check: a library caller
    (or a route whose check moved) would otherwise encode a 4,096-px map per token."""
    options = rendering.RenderOptions("json", max_side=side)
    if refused:
        with pytest.raises(rendering.RenderError, match="1024"):
            rendering.check_render_options(options)
    else:
        rendering.check_render_options(options)


def test_each_json_heatmap_is_its_drawn_heat_rounded_to_8_bits(client, result):
    """Each map is its token's drawn heat × 255 rounded to the nearest level, exactly (the other checks read the
    answer's attention, rounded to 6 decimals, so they allow a level either way: truncating every level passed)."""
    body = client.get(f"/captions/{result['id']}/heatmaps", params={"max_side": 300}).json()
    stored = client.app.state.results.get(result["id"]).result
    rows = stored.drawn_rows(body["mode"])
    for i, word in enumerate(body["heatmaps"]):
        got = np.asarray(Image.open(io.BytesIO(base64.b64decode(word["heat_png"]))))
        heat = drawn_heat(rows[i], stored.geometry, body["mode"], tuple(body["size"]))
        assert np.array_equal(got, (heat * 255).round().astype(np.uint8)), word["token"]


def test_a_figure_without_max_side_is_bounded_by_the_overlays_2048_pixels_not_the_json_maps_1024(client, result):
    """A figure's panels have a fixed size (a caption of up to four words is one row of five 220-px panels, 1,100 px
    wide): a figure bounded by the JSON heatmaps' 1,024 px rather than the pictures' 2,048 was shrunk, every panel
    blurred, though the request asked for no smaller side."""
    figure = _image(client.get(f"/captions/{result['id']}/overlay", params={"format": "figure"}))
    assert len(result["tokens"]) <= 4 and figure.size == (1100, 240)


def test_the_render_formats_the_options_are_typed_with_are_the_ones_rendered(client, result):
    """``RenderOptions.format`` is typed ``Format``: the overlay routes' picture formats and ``json`` (the
    ``/heatmaps`` routes). A misspelt name in the type had a type checker refuse the heatmaps' own options while the
    render took them; each format the type names is rendered, into the answer of its kind."""
    named = {value for arg in typing.get_args(rendering.Format) for value in (typing.get_args(arg) or (arg,))}
    assert named == set(typing.get_args(rendering.PictureFormat)) | {"json"} == {"png", "figure", "json"}
    stored = client.app.state.results.get(result["id"])
    for name in sorted(named):
        options = rendering.RenderOptions(name, 0 if name == "png" else None, max_side=64)
        assert isinstance(rendering._render(stored, options), rendering.Heatmaps if name == "json" else bytes), name


@pytest.mark.parametrize("max_len", [1, 2])
def test_post_overlay_draws_the_last_token_a_captions_length_limit_allows(client, max_len):
    """Token ``max_len - 1`` is a caption's last when it runs to its limit (the limit's own refusal says so: "tokens 0
    to max_len - 1"): the check made before the model runs refused it one token early, so the last word of such a
    caption (the only one, at ``max_len=1``) could not be drawn in one call. Each caption here is that long."""
    photo = _png(Image.new("RGB", (90, 60), (9, 9, 9)))
    response = client.post("/caption/overlay", params={"token": max_len - 1, "max_len": max_len},
                           files={"file": ("x.png", photo, "image/png")})
    assert _image(response).size == (90, 60)
    drawn = client.get(f"/captions/{response.headers['x-caption-id']}").json()
    assert len(drawn["tokens"]) == max_len, drawn["tokens"]
