"""Property tests (hypothesis) of the decoding options over HTTP: every ``beam_size`` and ``max_len`` inside the
service's bounds, sent in any of the ways the API accepts them (query, multipart form field, JSON field), gives a
200 whose caption and attention are well formed; every value outside them, or not an integer, gives a 422
problem document (RFC 9457) naming the option — never another status, never a 5xx.

The app is in-process (ASGI) with a tiny model, so each example costs a few milliseconds."""

from __future__ import annotations

import base64
import io

import pytest
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from captioner.models.checkpoint import save_checkpoint
from captioner.service.app import create_app

from .serving_helpers import serving_settings, tiny_checkpoint

MAX_BEAM, MAX_LEN = 4, 9
OPTIONS = ("beam_size", "max_len")
WAYS = ("query", "form", "json")
PROPERTY = settings(max_examples=40, deadline=None, derandomize=True, database=None)


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    root = tmp_path_factory.mktemp("bounds-weights")
    tiny = tiny_checkpoint("sat")
    save_checkpoint(root / "tiny", tiny.model, tiny.vocab, tiny.encoder)
    settings_ = serving_settings(weights_dir=root, default_model="tiny", release_memory=False,
                                 max_beam_size=MAX_BEAM, max_max_len=MAX_LEN, default_beam_size=2, default_max_len=5)
    with TestClient(create_app(settings_)) as running:
        yield running


@pytest.fixture(scope="module")
def image() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (40, 30), (200, 40, 40)).save(buffer, format="PNG")
    return buffer.getvalue()


def send(client: TestClient, image: bytes, options: dict, way: str):
    """POST /caption with ``options`` as query parameters, multipart form fields or JSON fields."""
    if way == "query":
        return client.post("/caption", params=options, files={"file": ("x.png", image, "image/png")})
    if way == "form":
        return client.post("/caption", data={k: str(v) for k, v in options.items()},
                           files={"file": ("x.png", image, "image/png")})
    return client.post("/caption", json={"image": base64.b64encode(image).decode(), **options})


def assert_well_formed(body: dict, beam: int | None, max_len: int | None) -> None:
    tokens = body["tokens"]
    assert body["beam_size"] == (beam or 2)
    assert 1 <= len(tokens) <= (max_len or 5)
    words = [t for t, eos in zip(tokens, body["is_eos"]) if not eos]
    assert body["caption"] == " ".join(words)
    assert (body["is_eos"] == [False] * len(words) + [True] * (len(tokens) - len(words))
            and len(tokens) - len(words) <= 1)
    assert len(body["token_logprobs"]) == len(body["attention"]) == len(tokens)
    assert all(lp <= 0 for lp in body["token_logprobs"]) and body["score"] <= 0
    rows, cols = body["geometry"]["grid_hw"]
    assert len(body["geometry"]["boxes"]) == rows * cols
    for row in body["attention"]:  # softmax attention: a distribution over the grid cells
        assert len(row) == rows * cols and min(row) >= 0 and abs(sum(row) - 1) < 1e-4


inside = st.fixed_dictionaries({}, optional={"beam_size": st.integers(1, MAX_BEAM), "max_len": st.integers(1, MAX_LEN)})
too_small = st.integers(max_value=0)
too_large = {"beam_size": st.integers(min_value=MAX_BEAM + 1, max_value=10**12),
             "max_len": st.integers(min_value=MAX_LEN + 1, max_value=10**12)}
not_an_integer = st.sampled_from(["abc", "1.5", "2e3", "0x3", "-"])


@pytest.mark.parametrize("way", WAYS)
def test_an_empty_option_names_none_in_a_query_or_a_form_and_is_no_integer_in_json(client, image, way):
    # `?beam_size=` and `curl -F beam_size=` say nothing, as a form field always did; JSON's "" is a typed value
    response = send(client, image, {"beam_size": ""}, way)
    if way == "json":
        assert response.status_code == 422 and "beam_size" in response.json()["detail"]
    else:
        assert response.status_code == 200 and response.json()["beam_size"] == 2, response.text


@PROPERTY
@given(options=inside, way=st.sampled_from(WAYS))
def test_options_inside_the_bounds_give_a_well_formed_caption(client, image, options, way):
    response = send(client, image, options, way)
    assert response.status_code == 200, response.text
    assert_well_formed(response.json(), options.get("beam_size"), options.get("max_len"))


@st.composite
def outside(draw) -> tuple[str, object, dict]:
    """One option out of bounds (or not an integer); the other, when present, inside."""
    name = draw(st.sampled_from(OPTIONS))
    bad = draw(st.one_of(too_small, too_large[name], not_an_integer))
    others = draw(st.fixed_dictionaries({}, optional={k: v for k, v in
                                                      (("beam_size", st.integers(1, MAX_BEAM)),
                                                       ("max_len", st.integers(1, MAX_LEN))) if k != name}))
    return name, bad, {**others, name: bad}


@PROPERTY
@given(case=outside(), way=st.sampled_from(WAYS))
def test_options_outside_the_bounds_get_a_422_problem_naming_them(client, image, case, way):
    name, bad, options = case
    response = send(client, image, options, way)
    assert response.status_code == 422, (options, way, response.text)
    assert response.headers["content-type"].startswith("application/problem+json")
    body = response.json()
    assert body["type"] == "/problems/invalid-request" and body["status"] == 422 and body["title"]
    assert name in body["detail"], body
