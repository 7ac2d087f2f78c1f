"""The request contract of the caption endpoints, over HTTP with real image bytes: options sent as multipart form
fields count exactly like query parameters, a conflict between the two is refused naming both, unknown parts are
refused by name, JSON options override the query as documented, and the OpenAPI schema describes the form."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import gzip
import io
import json
import logging
import time
import types
from typing import Annotated

import numpy as np
import pytest
from fastapi import Depends, FastAPI, Query
from fastapi.testclient import TestClient
from PIL import Image
from skimage import data
from starlette.requests import Request

from captioner.models.checkpoint import save_checkpoint
from captioner.models.decoding import DecodingRules
from captioner.models.images import decode_cost, open_image
from captioner.models.inference import ModelInfo
from captioner.models.rendering.heatmaps import MODES
from captioner.service import captioning, inputs, middleware, upload_answers
from captioner.service.admission import QueueFull
from captioner.service.app import CAPTION_PATHS, create_app
from captioner.service.captioning import CaptionParameters, CaptionRequest, caption_image, pick_model, refuse_early
from captioner.service.errors import DeadlinePassed, InvalidRequest, NotReady, UnknownModel, UploadTooLarge
from captioner.service.inputs import QueryOptions, arrival, known_query_only, option_sources
from captioner.service.middleware import HeadAsGetMiddleware
from captioner.service.schemas import CaptionOptions

from .leaks import nothing_left_open
from .serving_helpers import (TINY_SPEC, VOCAB, parse_metrics, record_event_loop_calls, run_bounded, serving_settings,
                              tiny_model)


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    root = tmp_path_factory.mktemp("contract-weights")
    for seed, name in enumerate(("tiny-a", "tiny-b")):  # different weights: different captions
        save_checkpoint(root / name, tiny_model("sat", seed=seed), VOCAB, TINY_SPEC)
    settings = serving_settings(weights_dir=root, default_model="tiny-a", max_beam_size=4, max_max_len=12,
                                default_max_len=6)
    with TestClient(create_app(settings)) as c:
        yield c


@pytest.fixture(scope="module")
def photo() -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(data.coffee()).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def post(client, photo, params=None, fields=None, extra_files=None, path="/caption"):
    files = [("file", ("coffee.jpg", photo, "image/jpeg")), *(extra_files or [])]
    return client.post(path, params=params or {}, data=fields or {}, files=files)


def problem(response, status=422, kind="invalid-request") -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    body = response.json()
    assert body["type"] == f"/problems/{kind}" and body["status"] == status
    return body


def same_caption(a: dict, b: dict) -> None:
    assert (a["model"], a["beam_size"], a["tokens"]) == (b["model"], b["beam_size"], b["tokens"])
    np.testing.assert_allclose(a["attention"], b["attention"], atol=1e-6)


def test_form_fields_choose_the_model_beam_and_length(client, photo):
    default = post(client, photo).json()
    chosen = post(client, photo, fields={"model": "tiny-b", "beam_size": "3", "max_len": "2"})
    assert chosen.status_code == 200, chosen.text
    body = chosen.json()
    assert default["model"] == "tiny-a" and default["beam_size"] == 3
    assert body["model"] == "tiny-b" and body["beam_size"] == 3 and len(body["tokens"]) <= 2
    # exactly what the same options as query parameters give
    same_caption(body, post(client, photo, params={"model": "tiny-b", "beam_size": 3, "max_len": 2}).json())
    assert post(client, photo, fields={"beam_size": "1"}).json()["beam_size"] == 1


def test_form_fields_have_the_query_parameters_bounds(client, photo):
    for fields, field in (({"beam_size": "0"}, "beam_size"), ({"beam_size": "three"}, "beam_size"),
                          ({"max_len": "-1"}, "max_len"), ({"max_len": "0"}, "max_len")):
        body = problem(post(client, photo, fields=fields))
        assert [e["loc"] for e in body["errors"]] == [["body", field]], body
    too_wide = problem(post(client, photo, fields={"beam_size": "9"}))
    assert "above the limit of 4" in too_wide["detail"] and too_wide["errors"][0]["loc"] == ["body", "beam_size"]
    assert "above the limit of 12" in problem(post(client, photo, fields={"max_len": "13"}))["detail"]
    assert "unknown model 'nope'" in problem(post(client, photo, fields={"model": "nope"}), 404, "unknown-model")[
        "detail"]


def test_a_limit_refusal_says_where_the_request_gave_the_option(client, photo):
    """The use case checks the limits on the options as merged, and said ``loc: ["beam_size"]`` wherever it came
    from; FastAPI's own errors say ``["query", …]`` or ``["body", …]``, and so do these now."""
    image = base64.b64encode(photo).decode()

    def where(response) -> list[str]:
        return problem(response)["errors"][0]["loc"]

    assert where(post(client, photo, params={"beam_size": 9})) == ["query", "beam_size"]  # checked after the body
    assert where(client.post("/caption", json={"image": image, "beam_size": 9})) == ["body", "beam_size"]
    # a JSON member overrides the query: the refused value is the body's, even where the query gave the same
    for given in (2, 9):
        assert where(client.post("/caption", params={"beam_size": given}, json={"image": image, "beam_size": 9})) == [
            "body", "beam_size"]
    assert where(client.post("/caption", params={"max_len": 13}, json={"image": image})) == ["query", "max_len"]


def test_a_refusal_is_placed_by_the_options_the_body_gave():
    query, body = CaptionOptions(beam_size=3, max_len=9), CaptionOptions(beam_size=3, model="tiny-a")
    assert option_sources(query, body) == {"beam_size": "body", "max_len": "query", "model": "body"}
    assert option_sources(query, None) == {"beam_size": "query", "max_len": "query"}  # raw image bytes
    refusal = InvalidRequest("three refusals", [{"loc": ["beam_size"], "msg": "above"}, {"loc": ["token"], "msg": "t"},
                                                {"loc": ["body", "max_len"], "msg": "placed already"}])
    refusal.place(option_sources(query, body))
    assert [error["loc"] for error in refusal.errors] == [["body", "beam_size"], ["token"], ["body", "max_len"]]


def test_placing_a_refusal_keeps_each_errors_message_and_moves_only_a_loc_naming_an_option_alone():
    """``place`` rewrites only ``loc``: the message (and any other member) a client shows beside the field is kept;
    and only an error naming an option alone (``[option]``, the use case's) is placed, never a longer ``loc``
    that happens to begin with an option's name."""
    refusal = InvalidRequest("two refusals", [{"loc": ["beam_size"], "msg": "above the limit of 4", "input": 9},
                                              {"loc": ["max_len", "extra"], "msg": "left alone"}])
    refusal.place({"beam_size": "body", "max_len": "query"})
    assert refusal.errors == [{"loc": ["body", "beam_size"], "msg": "above the limit of 4", "input": 9},
                              {"loc": ["max_len", "extra"], "msg": "left alone"}]


def test_query_options_above_the_limits_are_refused_before_the_body_is_read(client, photo):
    # a query naming its model is checked before the body is read (refuse_early clamped the values to the limits
    # and let the body be read first); over HTTP, the same 422 naming the option
    with pytest.raises(InvalidRequest, match="beam_size 9 is above the limit of 4"):
        refuse_early(client.app.state.service, CaptionParameters(model="tiny-b", beam_size=9), time.monotonic())
    refuse_early(client.app.state.service, CaptionParameters(model="tiny-b", beam_size=4), time.monotonic())
    too_wide = problem(post(client, photo, params={"model": "tiny-b", "beam_size": 9}))
    assert "above the limit of 4" in too_wide["detail"] and too_wide["errors"][0]["loc"] == ["query", "beam_size"]
    too_long = problem(post(client, photo, params={"model": "tiny-a", "max_len": 13}))
    assert "above the limit of 12" in too_long["detail"] and too_long["errors"][0]["loc"] == ["query", "max_len"]
    # each error is the documented {loc, msg} pair (the Problem schema requires both): a form that shows the message
    # beside the option it names reads ``msg``, under that name
    assert too_wide["errors"] == [{"loc": ["query", "beam_size"], "msg": "above the limit of 4"}]
    assert too_long["errors"] == [{"loc": ["query", "max_len"], "msg": "above the limit of 12"}]
    assert post(client, photo, params={"model": "tiny-b", "beam_size": 4}).status_code == 200


def test_the_same_value_both_ways_is_accepted(client, photo):
    response = post(client, photo, params={"model": "tiny-b", "beam_size": 2}, fields={"model": "tiny-b",
                                                                                      "beam_size": "2"})
    assert response.status_code == 200, response.text
    assert response.json()["model"] == "tiny-b" and response.json()["beam_size"] == 2


@pytest.mark.parametrize("name,query,form", [("model", "tiny-a", "tiny-b"), ("beam_size", 2, "3"),
                                             ("max_len", 4, "5")])
def test_a_conflict_between_form_and_query_names_both(client, photo, name, query, form):
    body = problem(post(client, photo, params={name: query}, fields={name: form}))
    shown = repr(form) if name == "model" else form
    assert f"query parameter {name}={query!r}" in body["detail"] and f"form field {name}={shown}" in body["detail"]
    assert [e["loc"] for e in body["errors"]] == [["query", name], ["body", name]]


def test_unknown_parts_and_fields_are_refused_by_name(client, photo):
    body = problem(post(client, photo, fields={"colour": "red", "beam_size": "2"}))
    assert "'colour'" in body["detail"] and [e["loc"] for e in body["errors"]] == [["body", "colour"]]
    extra_file = [("thumbnail", ("small.png", photo, "image/png"))]
    body = problem(post(client, photo, fields={"format": "png"}, extra_files=extra_file))
    assert "'format'" in body["detail"] and "'thumbnail'" in body["detail"]
    assert sorted(e["loc"][1] for e in body["errors"]) == ["format", "thumbnail"]
    # the image under another name is an unknown part too (it used to be a silent "file missing")
    renamed = client.post("/caption", files={"image": ("coffee.jpg", photo, "image/jpeg")})
    assert "'image'" in problem(renamed)["detail"]


def test_unknown_query_parameters_are_refused_by_name(client, photo):
    # a misspelt option was ignored: the caption came with the default beam while the client believed it chose 1
    body = problem(post(client, photo, params={"beam_sise": 1, "max_len": 4}))
    assert [e["loc"] for e in body["errors"]] == [["query", "beam_sise"]]
    assert "unknown query parameter" in body["detail"] and "beam_size" in body["detail"]
    # every route's own parameters only: the overlay's are not the caption's, and a GET that takes none takes none
    assert post(client, photo, params={"format": "png", "token": 0}, path="/caption/overlay").status_code == 200
    assert problem(post(client, photo, params={"format": "png"}))["errors"][0]["loc"] == ["query", "format"]
    assert "takes none" in problem(client.get("/models", params={"verbose": 1}))["detail"]
    assert client.get("/readyz").status_code == 200 and client.get("/", params={"utm_source": "x"}).status_code == 200


def test_a_query_parameter_given_twice_is_refused_as_a_repeated_form_field_is(client, photo):
    """``beam_size=1&beam_size=3`` was captioned with the last value and the first dropped without a word, where
    the same option repeated in the form is a 422: a client cannot tell which of its values was used."""
    for params, path in (([("beam_size", "1"), ("beam_size", "3")], "/caption"),
                         ([("token", "0"), ("token", "1")], "/caption/overlay"),
                         ([("max_len", "2"), ("max_len", "2")], "/caption/heatmaps")):
        body = problem(post(client, photo, params=params, path=path))
        assert body["errors"] == [{"loc": ["query", params[0][0]], "msg": "given 2 times (it takes one value)"}]
    result_id = post(client, photo).json()["id"]
    twice = client.get(f"/captions/{result_id}", params=[("attention_format", "json")] * 2)
    assert problem(twice)["errors"][0]["loc"] == ["query", "attention_format"]
    assert client.get(f"/captions/{result_id}", params={"attention_format": "json"}).status_code == 200


def test_head_of_every_get_route_answers_as_its_get_without_the_body(client, photo, caplog):
    """RFC 9110 §9.1: a general-purpose server MUST support HEAD. FastAPI's routes answered it 405 (an uptime
    monitor checking ``/healthz`` with HEAD saw the service down); Starlette's own routes and files took it."""
    result = post(client, photo).json()["id"]
    paths = ["/healthz", "/readyz", "/models", "/metrics", "/openapi.json", "/docs", "/problems",
             "/problems/not-ready", "/", "/static/app.js", f"/captions/{result}",
             f"/captions/{result}/overlay?token=0", f"/captions/{result}/heatmaps"]
    with caplog.at_level(logging.INFO, logger="captioner.access"):
        for path in paths:
            got, head = client.get(path), client.head(path)
            assert head.status_code == got.status_code == 200, (path, head.status_code)
            # no body check here: the test client drops a HEAD answer's body itself, as uvicorn does (what the app
            # sends is checked at the ASGI level below)
            assert got.content, path
            assert head.headers["content-type"] == got.headers["content-type"], path
            assert int(head.headers["content-length"]) == len(got.content) or path == "/metrics", path
    logged = [record.fields["method"] for record in caplog.records if record.name == "captioner.access"]
    assert logged.count("HEAD") == len(paths) and logged.count("GET") == len(paths)
    for path, status in (("/caption", 405), ("/nowhere", 404), (f"/captions/{result}x", 404)):
        head = client.head(path)
        assert head.status_code == status, path
    assert client.head("/caption").headers["allow"] == "POST"


def asgi_messages(app, method: str, path: str, headers: list[tuple[bytes, bytes]] = ()) -> list[dict]:
    """What ``app`` sends for a bodiless request, as the ASGI server receives it. uvicorn drops a HEAD answer's body
    itself, and so does the test client: what the app sends is only seen here (and in the access log's
    ``bytes_out``, and by any other server)."""
    sent, requests = [], [{"type": "http.request", "body": b"", "more_body": False}]

    async def receive():
        if requests:
            return requests.pop()
        await asyncio.Event().wait()  # the client stays connected

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"", "headers": list(headers),
             "client": ("127.0.0.1", 50000), "server": ("testserver", 80)}
    run_bounded(app(scope, receive, send), 10)
    return sent


def test_head_sends_no_part_of_a_streamed_body_and_still_ends_the_answer():
    """A streamed answer comes in several body messages (``more_body``): none of their bytes go out, and the last
    message still does, empty, or the server never sees the answer end (uvicorn logs "ASGI callable returned
    without completing response" and closes the connection)."""
    seen = []

    async def streaming(scope, receive, send):
        seen.append(scope["method"])
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"6")]})
        for chunk in (b"ab", b"cd"):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"ef"})  # the last: no more_body, as Response sends it

    sent = asgi_messages(HeadAsGetMiddleware(streaming), "HEAD", "/stream")
    assert seen == ["GET"] and sent[0] == {"type": "http.response.start", "status": 200,
                                           "headers": [(b"content-length", b"6")]}
    bodies = [message for message in sent if message["type"] == "http.response.body"]
    assert bodies and all(message["body"] == b"" for message in bodies)
    assert not bodies[-1].get("more_body", False)


def test_head_answered_before_routing_sends_the_get_answers_headers_without_its_body(tmp_path):
    """The API key check answers before any route: HEAD must be turned into GET outside it, or the 401's problem
    document goes out as HEAD's body. No lifespan: the refusal needs no model."""
    app = create_app(serving_settings(weights_dir=tmp_path, api_keys=["head-key-0123456789"]))
    got, head = (asgi_messages(app, method, "/captions/abc") for method in ("GET", "HEAD"))
    assert got[0]["status"] == head[0]["status"] == 401 and got[-1]["body"]
    assert [h for h in head[0]["headers"] if h[0] != b"x-request-id"] == \
        [h for h in got[0]["headers"] if h[0] != b"x-request-id"]
    assert [m["body"] for m in head if m["type"] == "http.response.body"] == [b""]


def test_every_unknown_query_parameter_is_named_and_names_are_case_sensitive(client):
    # FastAPI reads query names as spelt: Attention_Format is not attention_format and would be ignored in silence
    body = problem(client.get("/captions/some-id", params={"Attention_Format": "json", "colour": "red"}))
    assert [e["loc"] for e in body["errors"]] == [["query", "Attention_Format"], ["query", "colour"]]


def test_repeated_parts_and_files_in_option_fields_are_refused(client, photo):
    twice = post(client, photo, extra_files=[("file", ("other.jpg", photo, "image/jpeg"))])
    assert "'file' given more than once" in problem(twice)["detail"]
    as_file = post(client, photo, extra_files=[("model", ("model.txt", b"tiny-b", "text/plain"))])
    assert [e["loc"] for e in problem(as_file)["errors"]] == [["body", "model"]]
    no_file = client.post("/caption", data={"model": "tiny-b"}, files={"other": ("", b"", "text/plain")})
    assert problem(no_file)["detail"]
    only_fields = client.post("/caption", data={"model": "tiny-b"},
                              headers={"content-type": "multipart/form-data; boundary=x"},
                              content=b'--x\r\nContent-Disposition: form-data; name="model"\r\n\r\ntiny-b\r\n--x--\r\n')
    assert problem(only_fields)["errors"] == [{"loc": ["body", "file"], "msg": "Field required"}]
    as_text = client.post("/caption", data={"file": "abc"}, files={"model": (None, "tiny-b")})
    assert "not a file part" in problem(as_text)["detail"]
    # a client shows each error beside its field: the refusal names `file` and says what came instead
    assert problem(as_text)["errors"] == [{"loc": ["body", "file"], "msg": "a text field, expected a file part"}]
    no_boundary = client.post("/caption", headers={"content-type": "multipart/form-data"}, content=b"--x--\r\n")
    assert "malformed multipart" in problem(no_boundary)["detail"] and "boundary" in problem(no_boundary)["detail"]
    assert [(e["loc"], "boundary" in e["msg"]) for e in problem(no_boundary)["errors"]] == [(["body"], True)]
    too_many = post(client, photo, extra_files=[(f"extra{i}", ("x.txt", b"x", "text/plain")) for i in range(10)])
    assert "Too many files" in problem(too_many)["detail"]


def test_the_overlay_endpoint_follows_the_same_contract(client, photo):
    response = post(client, photo, params={"format": "png", "token": 0}, fields={"model": "tiny-b", "max_len": "3"},
                    path="/caption/overlay")
    assert response.status_code == 200 and response.headers["content-type"] == "image/png"
    stored = client.get(f"/captions/{response.headers['x-caption-id']}").json()
    assert stored["model"] == "tiny-b" and len(stored["tokens"]) <= 3
    conflict = post(client, photo, params={"model": "tiny-a"}, fields={"model": "tiny-b"}, path="/caption/overlay")
    assert "form field model='tiny-b'" in problem(conflict)["detail"]
    assert "'token'" in problem(post(client, photo, fields={"token": "0"}, path="/caption/overlay"))["detail"]


def test_json_options_override_the_query_as_documented(client, photo):
    encoded = base64.b64encode(photo).decode()
    response = client.post("/caption", params={"model": "tiny-a", "beam_size": 1},
                           json={"image": encoded, "model": "tiny-b"})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["model"] == "tiny-b" and body["beam_size"] == 1
    same_caption(body, post(client, photo, fields={"model": "tiny-b", "beam_size": "1"}).json())


def test_a_json_body_keeps_its_types_and_names_what_it_does_not_know(client, photo):
    # "beam_size": true was a beam of 1, "2" a beam of 2, and a misspelt key was ignored
    encoded = base64.b64encode(photo).decode()
    for extra, field in (({"beam_size": True}, "beam_size"), ({"beam_size": "2"}, "beam_size"),
                         ({"block_trigrams": 1}, "block_trigrams"), ({"beam_sise": 2}, "beam_sise")):
        body = problem(client.post("/caption", json={"image": encoded, **extra}))
        assert [e["loc"] for e in body["errors"]] == [["body", field]], body
    accepted = client.post("/caption", json={"image": encoded, "beam_size": 2, "length_penalty": 1, "model": None})
    assert accepted.status_code == 200 and accepted.json()["beam_size"] == 2, accepted.text


def test_json_base64_may_be_wrapped_with_whitespace_and_nothing_else(client, photo):
    encoded = base64.b64encode(photo).decode()
    wrapped = "\r\n".join("  " + encoded[i:i + 76] + "\t" for i in range(0, len(encoded), 76))  # RFC 2045, indented
    response = client.post("/caption", json={"image": "data:image/jpeg;base64," + wrapped})
    assert response.status_code == 200, response.text
    same_caption(response.json(), post(client, photo).json())
    bad = client.post("/caption", json={"image": encoded[:100] + "*" + encoded[100:]})
    assert "not valid base64" in problem(bad, 422, "invalid-image")["detail"]


def test_a_json_body_is_parsed_off_the_event_loop(client, photo, monkeypatch):
    """Parsing megabytes of JSON and base64 on the event loop stalled every other request (the concurrency
    audit): it runs in a worker thread, where no event loop runs."""
    parsed_on_loop = record_event_loop_calls(monkeypatch, inputs, "_json_image")
    response = client.post("/caption", json={"image": base64.b64encode(photo).decode()})
    assert response.status_code == 200, response.text
    assert parsed_on_loop == [False]


def test_openapi_documents_the_form_fields(client):
    document = client.get("/openapi.json").json()
    paths, components = document["paths"], document["components"]["schemas"]
    for path in ("/caption", "/caption/overlay"):
        # one component per body, shared by both routes: a generated client has one form class, not one per route
        # (passing the other route's class sent no body at all)
        content = paths[path]["post"]["requestBody"]["content"]
        assert content["multipart/form-data"]["schema"] == {"$ref": "#/components/schemas/CaptionForm"}, path
        assert content["application/json"]["schema"] == {"$ref": "#/components/schemas/CaptionJSON"}, path
        # a bare image body is a file to a generated client, as the form's file part is (without the type it is
        # any JSON value, and the client serialises the bytes rather than sending them)
        for media_type in ("image/*", "application/octet-stream"):
            assert content[media_type]["schema"] == {"type": "string", "format": "binary"}, (path, media_type)
    form = components["CaptionForm"]
    assert set(form["properties"]) == {"file", "model", "beam_size", "max_len", "length_penalty", "block_trigrams",
                                       "block_doubled_words"}
    assert form["required"] == ["file"] and form["additionalProperties"] is False
    # the file part is a file to a generated client, as the bare image body is: a string of binary format (the
    # format alone, without its type, leaves the part any JSON value, which a client serialises, not uploads)
    assert {k: form["properties"]["file"].get(k) for k in ("type", "format")} == {"type": "string", "format": "binary"}
    # a form field is text or absent, never null: a generated client sent None as the text "None" (a model named so)
    assert [name for name, field in form["properties"].items()
            if "anyOf" in field or field.get("type") == "null" or "default" in field] == [], form["properties"]
    assert form["properties"]["beam_size"]["type"] == "integer" and form["properties"]["beam_size"]["minimum"] == 1
    for path in ("/caption", "/caption/overlay"):
        query = {p["name"] for p in paths[path]["post"]["parameters"] if p["in"] == "query"}
        assert {"model", "beam_size", "max_len"} <= query
        assert paths[path]["post"]["requestBody"]["required"] is True  # an upload without a body is refused
    # the query parameters have the JSON and form fields' bounds, read off CaptionOptions (not typed twice), with
    # this server's largest values (the fixture's CAPTIONER_MAX_BEAM_SIZE=4, CAPTIONER_MAX_MAX_LEN=12) stated in each

    def bounds(schema: dict) -> list[dict]:
        return [{k: v for k, v in option.items() if k in ("minimum", "maximum")} for option in schema["anyOf"]]

    fields, largest = CaptionOptions.model_json_schema()["properties"], {"beam_size": 4, "max_len": 12}
    for parameter in paths["/caption"]["post"]["parameters"]:
        if parameter["name"] in fields:
            want = bounds(fields[parameter["name"]])
            if parameter["name"] in largest:
                want[0]["maximum"] = largest[parameter["name"]]
            assert bounds(parameter["schema"]) == want == bounds(components["CaptionJSON"]["properties"][
                parameter["name"]]), parameter["name"]
    for name, at_most in largest.items():
        assert form["properties"][name]["maximum"] == at_most
        default = {"beam_size": 3, "max_len": 6}[name]  # CAPTIONER_DEFAULT_MAX_LEN=6
        described = {p["name"]: p["description"] for p in paths["/caption"]["post"]["parameters"]}[name]
        assert described.endswith(f"; default {default}, at most {at_most} on this server"), described
    # a render that waits for a slot past the deadline is a 504, with or without a model run before it, and like
    # every error answer it is a problem document (the result route's had no content)
    for path, method in (("/captions/{result_id}/overlay", "get"), ("/caption/overlay", "post"), ("/caption", "post"),
                         ("/captions/{result_id}/heatmaps", "get"), ("/caption/heatmaps", "post")):
        assert "application/problem+json" in paths[path][method]["responses"]["504"]["content"], path
    # one wording of each status for every path (the caption routes had a second, drifted copy)
    reasons = {(status, answer["description"]) for operations in paths.values() for operation in operations.values()
               for status, answer in operation["responses"].items() if status in ("413", "422", "429", "503")}
    assert len(reasons) == 4, reasons


def test_openapi_serves_generated_clients(client):
    """What a client generated from the document needs (openapi-python-client, openapi-typescript, hey-api): the
    API keys as a bearer scheme, optional, on the routes that check them; stable operation ids; every field an
    answer always has marked required, the result id a string; the overlays' PNG as binary; a server and a
    licence."""
    document = client.get("/openapi.json").json()
    assert document["components"]["securitySchemes"]["bearerAuth"] == {
        "type": "http", "scheme": "bearer", "description": "one of CAPTIONER_API_KEYS, when the service is configured "
                                                             "with keys"}
    operations = {(path, method): operation for path, methods in document["paths"].items()
                  for method, operation in methods.items()}
    guarded = {key for key, operation in operations.items() if "security" in operation}
    assert guarded == {("/caption", "post"), ("/captions/{result_id}", "get"), ("/captions/{result_id}/overlay", "get"),
                       ("/caption/overlay", "post"), ("/captions/{result_id}/heatmaps", "get"),
                       ("/caption/heatmaps", "post")}
    assert all(operations[key]["security"] == [{"bearerAuth": []}, {}] for key in guarded)
    assert {key: operation["operationId"] for key, operation in operations.items()} == {
        ("/caption", "post"): "caption", ("/models", "get"): "list_models", ("/healthz", "get"): "healthz",
        ("/readyz", "get"): "readyz", ("/metrics", "get"): "metrics", ("/captions/{result_id}", "get"): "get_caption",
        ("/captions/{result_id}/overlay", "get"): "get_overlay", ("/caption/overlay", "post"): "post_overlay",
        ("/captions/{result_id}/heatmaps", "get"): "get_heatmaps", ("/caption/heatmaps", "post"): "post_heatmaps"}
    schemas = document["components"]["schemas"]
    for name in ("CaptionOut", "ModelOut", "Health", "HeatmapsOut", "GeometryOut", "PackedRows"):
        assert set(schemas[name]["required"]) == set(schemas[name]["properties"]), name
    assert schemas["CaptionOut"]["properties"]["id"]["type"] == "string"
    assert schemas["HeatmapsOut"]["properties"]["id"]["type"] == "string"
    # one media type per answer: a picture from /overlay, JSON from /heatmaps (a generated client decoded every
    # overlay PNG as JSON when one answer documented both)
    for path in ("/captions/{result_id}/overlay", "/caption/overlay"):
        method = "get" if path.startswith("/captions/") else "post"
        assert operations[(path, method)]["responses"]["200"]["content"] == {
            "image/png": {"schema": {"type": "string", "format": "binary"}}}, path
    for path in ("/captions/{result_id}/heatmaps", "/caption/heatmaps"):
        method = "get" if path.startswith("/captions/") else "post"
        assert operations[(path, method)]["responses"]["200"]["content"] == {
            "application/json": {"schema": {"$ref": "#/components/schemas/HeatmapsOut"}}}, path
    assert document["servers"] == [{"url": "/"}] and document["info"]["license"]["identifier"] == "MIT"
    # Prometheus text, not the JSON FastAPI declares by default
    metrics = operations[("/metrics", "get")]["responses"]["200"]["content"]
    assert metrics == {"text/plain": {"schema": {"type": "string"}}}
    # the modes each route draws: every mode for a picture, the heat modes for the JSON heatmaps
    modes = {path: next(p for p in operation["parameters"] if p["name"] == "mode")["schema"]["anyOf"][0]["$ref"]
             for (path, _), operation in operations.items() if path.endswith(("/overlay", "/heatmaps"))}
    assert {path: ref.rsplit("/", 1)[1] for path, ref in modes.items()} == {
        "/captions/{result_id}/overlay": "HeatmapMode", "/caption/overlay": "HeatmapMode",
        "/captions/{result_id}/heatmaps": "HeatMode", "/caption/heatmaps": "HeatMode"}
    assert schemas["HeatMode"]["enum"] == ["grid_smooth", "grid_blocks", "region_sum"]
    # maps of a fixed shape are typed: a model's decoding rules (as many fields as DecodingRules has, so that one
    # added there is not dropped from the answer) and a problem's per-field errors
    assert schemas["ModelOut"]["properties"]["decoding"]["$ref"] == "#/components/schemas/DecodingOut"
    assert set(schemas["DecodingOut"]["properties"]) == {f.name for f in dataclasses.fields(DecodingRules)}
    assert schemas["Problem"]["properties"]["errors"]["items"]["required"] == ["loc", "msg"]
    # every error answer is a problem with these members and an error status (what the fuzz test checks answers by)
    problem = schemas["Problem"]
    assert problem["required"] == ["type", "title", "status", "detail"]
    assert {k: problem["properties"]["status"][k] for k in ("minimum", "maximum")} == {"minimum": 400, "maximum": 599}
    models = client.get("/models").json()
    assert all(set(m["decoding"]) == {"length_penalty", "block_trigrams", "block_doubled_words"} for m in models)
    assert "area_topk" in schemas["HeatmapMode"]["enum"]


def test_the_model_list_gives_every_field_a_loaded_model_has(client):
    """GET /models is where a client reads what a model attends over, where it runs and on which backend: every
    field of its ModelInfo is in the answer (a field left out of the answer model was dropped in silence, since
    ModelOut ignores a keyword it does not declare, and the document then no longer listed it either)."""
    fields = {field.name for field in dataclasses.fields(ModelInfo)} | {"default"}
    models = client.get("/models").json()
    assert [set(model) for model in models] == [fields, fields], models
    described = [(m["attention_kind"], m["attention"], m["device"], m["backend"], m["default"]) for m in models]
    served = ("soft_attention", "softmax", "cpu", "torch")  # the tiny SAT models, on the CPU, with PyTorch
    assert described == [(*served, True), (*served, False)]  # the first by name is the default


def test_decoding_rules_arrive_the_same_way_from_query_form_and_json(client, photo):
    """length_penalty, block_trigrams and block_doubled_words are options like the others: the answer says what was
    used, the model's defaults when the request names none, and the three ways of giving them agree."""
    rules = ("length_penalty", "block_trigrams", "block_doubled_words")
    default = post(client, photo).json()
    assert tuple(default[r] for r in rules) == (0.0, False, False)  # no defaults stored: none
    options = {"length_penalty": "1.5", "block_trigrams": "true", "block_doubled_words": "true", "max_len": "12"}
    by_form = post(client, photo, fields=options)
    assert by_form.status_code == 200, by_form.text
    assert tuple(by_form.json()[r] for r in rules) == (1.5, True, True)
    same_caption(by_form.json(), post(client, photo, params=options).json())
    encoded = base64.b64encode(photo).decode()
    by_json = client.post("/caption", params={"block_trigrams": "false"},
                          json={"image": encoded, "length_penalty": 1.5, "block_trigrams": True,
                                "block_doubled_words": True, "max_len": 12})
    same_caption(by_form.json(), by_json.json())
    # a JSON false overrides the query's true (it is a value, not a missing field)
    off = client.post("/caption", params={"block_trigrams": "true"}, json={"image": encoded, "block_trigrams": False})
    assert off.json()["block_trigrams"] is False
    for fields, field in (({"length_penalty": "-1"}, "length_penalty"), ({"length_penalty": "6"}, "length_penalty"),
                          ({"length_penalty": "-0.01"}, "length_penalty"),
                          ({"length_penalty": "5.01"}, "length_penalty"),  # one step past each bound
                          ({"block_trigrams": "maybe"}, "block_trigrams"),
                          ({"block_doubled_words": "2"}, "block_doubled_words")):
        body = problem(post(client, photo, fields=fields))
        assert [e["loc"] for e in body["errors"]] == [["body", field]], body


def test_each_options_bound_itself_is_accepted_from_the_form_and_from_json(client, photo):
    """The bounds are inclusive, as the document says (minimum 1, length penalty 0 to 5): length_penalty 0 is how a
    client turns off a model's own penalty ("0: none"), 5 the strongest the service allows, and max_len 1 a one-word
    answer; a bound moved by one refused each with a 422 (only the values one step past were tried)."""
    encoded = base64.b64encode(photo).decode()
    for options in ({"length_penalty": 0.0, "max_len": 1}, {"length_penalty": 5.0, "max_len": 1}):
        by_form = post(client, photo, fields={name: str(value) for name, value in options.items()})
        by_json = client.post("/caption", json={"image": encoded, **options})
        for answer in (by_form, by_json):
            assert answer.status_code == 200, answer.text
            assert answer.json()["length_penalty"] == options["length_penalty"] and len(answer.json()["tokens"]) == 1


def test_a_body_of_another_media_type_is_415_and_an_unknown_model_gets_no_metric_series_of_its_own(client, photo):
    text = client.post("/caption", content=photo, headers={"content-type": "text/plain"})
    assert "text/plain" in problem(text, 415, "unsupported-media-type")["detail"]
    for name in ("made-up-1", "made-up-2"):
        assert client.post("/caption", params={"model": name}, files={"file": ("c.jpg", photo, "image/jpeg")}
                           ).status_code == 404
    metrics = client.get("/metrics").text
    assert "made-up" not in metrics
    assert 'captioner_request_latency_seconds_count{model="unknown",status="404"}' in metrics


def test_a_model_named_in_the_form_is_the_one_the_latency_metric_counts(client, photo):
    """A form field names the model as the query does: the request is counted under the model it used, which the
    query (naming none) did not say."""
    series = 'captioner_request_latency_seconds_count{model="tiny-b",status="200"}'

    def counted() -> float:
        return parse_metrics(client.get("/metrics").text).get(series, 0.0)

    before = counted()
    assert post(client, photo, fields={"model": "tiny-b", "max_len": "2"}).json()["model"] == "tiny-b"
    assert counted() == before + 1


def test_a_query_option_fastapi_refuses_is_counted_by_the_latency_metric_under_the_model_it_names(client, photo):
    """A query option that does not validate is FastAPI's own 422, before the use case (which observes every other
    answer) runs: the problem handler counts it, under the model the query names."""
    series = 'captioner_request_latency_seconds_count{model="tiny-b",status="422"}'

    def counted() -> float:
        return parse_metrics(client.get("/metrics").text).get(series, 0.0)

    before = counted()
    problem(post(client, photo, params={"model": "tiny-b", "beam_size": 0}))
    assert counted() == before + 1


def test_fastapis_own_refusal_of_two_options_sets_each_loc_and_msg_apart_in_the_detail(client, photo):
    """FastAPI's own 422 (options that do not validate, refused before the route runs) says in ``detail`` what each
    of its ``errors`` says, as ``loc: msg`` parts set apart by ``; ``: a message can hold a comma itself (pydantic's
    "Input should be a valid integer, unable to parse string as an integer"), so joined by commas a reader, or a
    client that shows the detail, could not tell where one option's message ends and the next one's begins."""
    body = problem(post(client, photo, params={"beam_size": 0, "max_len": "many"}))
    assert [e["loc"] for e in body["errors"]] == [["query", "beam_size"], ["query", "max_len"]]
    assert "," in body["errors"][1]["msg"]  # the message the separator must stay apart from
    assert body["detail"].split("; ") == [f"query.{e['loc'][1]}: {e['msg']}" for e in body["errors"]]


def test_a_query_option_refused_on_a_route_that_captions_nothing_is_not_counted_by_the_latency_metric(client):
    """Only the caption routes' refusals are caption requests (CAPTION_PATHS): a stored result's overlay asked with
    an alpha that does not validate is FastAPI's 422 too, but counted it would add a caption answer that never was
    under the default model."""
    def counted() -> float:
        return sum(value for series, value in parse_metrics(client.get("/metrics").text).items()
                   if series.startswith("captioner_request_latency_seconds_count"))

    before = counted()
    problem(client.get("/captions/no-such-result/overlay", params={"alpha": "opaque"}))
    assert counted() == before


def test_every_route_that_captions_an_upload_is_counted_by_the_latency_metric(client):
    """CAPTION_PATHS names the routes whose invalid requests the caption metrics count; a caption route added
    without it (POST /caption/heatmaps) would have its refusals go uncounted."""
    paths = client.get("/openapi.json").json()["paths"]
    captioning = {path for path, operations in paths.items() for operation in operations.values()
                  if "requestBody" in operation}  # the routes that take an upload
    assert captioning == CAPTION_PATHS == {"/caption", "/caption/overlay", "/caption/heatmaps"}


def test_the_upload_limit_admits_exactly_its_bytes_in_every_body_format(tmp_path, photo):
    """An image of exactly max_upload_bytes is captioned and one byte more is a 413, whichever way it comes: raw
    with its length, raw chunked (no length: counted while it arrives), a multipart file part and base64 JSON."""
    save_checkpoint(tmp_path / "tiny-a", tiny_model("sat"), VOCAB, TINY_SPEC)
    settings = serving_settings(weights_dir=tmp_path, default_model="tiny-a", default_max_len=4,
                                max_upload_bytes=len(photo))
    over = photo + b"\0"  # a JPEG with a stray byte after its end still decodes: only its size differs

    def answers(image: bytes) -> list[int]:
        chunks = (image[i:i + 4096] for i in range(0, len(image), 4096))
        return [c.post("/caption", content=image, headers={"content-type": "image/jpeg"}).status_code,
                c.post("/caption", content=chunks, headers={"content-type": "image/jpeg"}).status_code,
                c.post("/caption", files={"file": ("c.jpg", image, "image/jpeg")}).status_code,
                c.post("/caption", json={"image": base64.b64encode(image).decode()}).status_code]

    with TestClient(create_app(settings)) as c:
        assert answers(photo) == [200] * 4
        assert answers(over) == [413] * 4
        refused = problem(c.post("/caption", files={"file": ("c.jpg", over, "image/jpeg")}), 413, "upload-too-large")
        # the limit, in MiB for a person and in bytes for a client that compares sizes
        assert refused["detail"].endswith(f" MiB ({len(photo)} bytes)"), refused["detail"]


def test_an_uploads_limit_is_said_in_mebibytes_to_three_digits_beside_its_bytes():
    assert str(UploadTooLarge(10 * 2**20)) == "upload is larger than the limit of 10 MiB (10485760 bytes)"
    assert str(UploadTooLarge(1_500_000)).endswith(" 1.43 MiB (1500000 bytes)")  # 1,500,000 / 1,048,576


def test_a_json_body_of_any_json_media_type_is_read_as_json(client, photo):
    """``application/*+json`` (RFC 6839's structured suffix) is JSON: the same caption as application/json."""
    body = {"image": base64.b64encode(photo).decode(), "beam_size": 2}
    plain = client.post("/caption", json=body)
    suffixed = client.post("/caption", content=plain.request.content,
                           headers={"content-type": "application/vnd.example+json; charset=utf-8"})
    assert plain.status_code == suffixed.status_code == 200, suffixed.text
    same_caption(plain.json(), suffixed.json())


def test_routing_errors_are_problem_documents_with_their_own_status_type_title_and_headers(client):
    """Starlette's own 404 and 405 leave as RFC 9457 documents: the status they are, typed and titled by its
    reason phrase, the request path as ``instance``, and the 405's ``Allow`` header kept."""
    wrong_method = client.get("/caption")
    body = problem(wrong_method, 405, "method-not-allowed")
    assert body["title"] == "Method Not Allowed" and body["instance"] == "/caption" and body["detail"]
    assert wrong_method.headers["allow"] == "POST"
    body = problem(client.get("/no/such/page"), 404, "not-found")
    assert body["title"] == "Not Found" and body["instance"] == "/no/such/page"


def test_a_gets_405_lists_head_and_a_trailing_slash_is_a_404_not_a_redirect(client, photo):
    """Every GET route answers HEAD (HeadAsGetMiddleware), so a 405's ``Allow`` says so; and ``/models/`` was a 307
    to an absolute URL built from the client's ``Host`` (an internal name behind a proxy), which made a POST send
    its upload again."""
    assert problem(client.post("/models"), 405, "method-not-allowed") and \
        client.post("/models").headers["allow"] == "GET, HEAD"
    assert client.get("/caption").headers["allow"] == "POST"
    # Starlette's own routes (the OpenAPI document's) list HEAD already, in the order of a set: HEAD once
    assert sorted(client.post("/openapi.json").headers["allow"].split(", ")) == ["GET", "HEAD"]
    for response in (client.get("/models/", follow_redirects=False),
                     client.post("/caption/", files={"file": ("c.jpg", photo, "image/jpeg")},
                                 follow_redirects=False)):
        assert problem(response, 404, "not-found")["instance"].endswith("/")
        assert "location" not in response.headers


def test_the_page_and_the_docs_files_answer_conditional_requests_as_static_files_do(client):
    """``/`` and the docs' Swagger UI files carried an ETag but answered every If-None-Match with the whole file
    (1.5 MB for the bundle), where ``/static/`` answered 304."""
    for path in ("/", "/docs/assets/swagger-ui-bundle.js", "/static/app.js"):
        first = client.get(path)
        assert first.status_code == 200 and first.headers["etag"], path
        again = client.get(path, headers={"if-none-match": first.headers["etag"]})
        assert (again.status_code, again.content) == (304, b""), path
        since = client.get(path, headers={"if-modified-since": first.headers["last-modified"]})
        assert since.status_code == 304, path
        assert client.get(path, headers={"if-none-match": '"another"'}).content == first.content, path
    assert client.get("/").headers["content-type"].startswith("text/html")


def test_a_cut_off_multipart_upload_is_named_malformed_not_missing_its_file(client, photo):
    """Starlette's parser drops a part the body ends in: an upload cut off before its closing boundary was refused
    as a form without a ``file`` ("Field required"), though the client sent one."""
    head = (b'--XYZ\r\nContent-Disposition: form-data; name="file"; filename="c.jpg"\r\n'
            b"Content-Type: image/jpeg\r\n\r\n")
    headers = {"content-type": "multipart/form-data; boundary=XYZ"}
    # nothing left open: the cut-off part's spooled file, which Starlette leaves open when it drops the part
    with nothing_left_open():
        for body in (head + photo, head + photo + b"\r\n--XYZ"):
            detail = problem(client.post("/caption", content=body, headers=headers))["detail"]
            assert detail == ("malformed multipart/form-data body: the body ended before its closing boundary "
                              "(--BOUNDARY--): the upload was cut off")
    whole = client.post("/caption", content=head + photo + b"\r\n--XYZ--\r\n", headers=headers)
    assert whole.status_code == 200, whole.text


def test_a_forms_file_spooled_to_disk_is_closed_when_its_request_ends(client, photo):
    """A file part over Starlette's spooling threshold (1 MiB) is written to a temporary file on disk: the form
    closes it when the request ends, captioned or refused, rather than leaving it to the garbage collector (a file
    descriptor held until then)."""
    large = photo + b"\0" * (1536 * 1024)  # a JPEG with bytes after its end still decodes
    with nothing_left_open():
        captioned = post(client, large)
        assert captioned.status_code == 200, captioned.text
        problem(post(client, large, fields={"beam_sise": "2"}))  # refused after the form was parsed


def test_a_compressed_body_or_one_without_a_media_type_is_415(client, photo):
    """``Content-Encoding: gzip`` was ignored (a gzipped image was "not an image", gzipped JSON "invalid JSON", and
    an image labelled ``br`` was captioned); bytes without a Content-Type were refused as a form without a file."""
    body = json.dumps({"image": base64.b64encode(photo).decode()}).encode()
    zipped = client.post("/caption", content=gzip.compress(body),
                         headers={"content-type": "application/json", "content-encoding": "gzip"})
    assert "Content-Encoding: gzip" in problem(zipped, 415, "unsupported-media-type")["detail"]
    labelled = client.post("/caption", content=photo, headers={"content-type": "image/jpeg", "content-encoding": "br"})
    problem(labelled, 415, "unsupported-media-type")
    plain = client.post("/caption", content=photo, headers={"content-type": "image/jpeg",
                                                            "content-encoding": "identity"})
    assert plain.status_code == 200, plain.text
    for content_type in ("", ";;;"):
        untyped = client.post("/caption", content=photo, headers={"content-type": content_type})
        assert "needs a Content-Type" in problem(untyped, 415, "unsupported-media-type")["detail"]
    assert "Field required" in problem(client.post("/caption"))["detail"]  # no body at all: no file


def test_an_empty_form_field_is_no_option_as_an_empty_query_parameter_is(client, photo):
    """``curl -F beam_size=`` names no beam size, as ``?beam_size=`` does: the default's caption, not a 422."""
    plain = post(client, photo)
    assert plain.status_code == 200, plain.text
    for fields in ({"beam_size": ""}, {"model": "", "max_len": "", "length_penalty": "", "block_trigrams": ""}):
        empty = post(client, photo, fields=fields)
        assert empty.status_code == 200, empty.text
        same_caption(plain.json(), empty.json())
    same_caption(plain.json(), post(client, photo, params={"beam_size": ""}).json())


def test_every_option_given_empty_as_a_query_parameter_names_no_option(client, photo):
    """An empty query value names no option for every caption option, not only ``beam_size``: an empty-as-none
    reading that missed a field (``?model=``, ``?block_trigrams=``, as a form submitted with its controls left
    empty sends them) answered 422 for it where the same empty form field is the default's caption."""
    plain = post(client, photo)
    assert plain.status_code == 200, plain.text
    empty = post(client, photo, params={name: "" for name in CaptionOptions.model_fields})
    assert empty.status_code == 200, empty.text
    same_caption(plain.json(), empty.json())


def test_the_caption_routes_query_parameters_are_the_caption_options_fields(client, photo):
    """The query parameters are :class:`CaptionOptions`' own fields (FastAPI's query parameter model): an option
    added to the schema is a query parameter of every caption route at once, with its description, and taken."""
    document = client.get("/openapi.json").json()
    for path in ("/caption", "/caption/overlay", "/caption/heatmaps"):
        parameters = {p["name"]: p for p in document["paths"][path]["post"]["parameters"]}
        for name, field in CaptionOptions.model_fields.items():
            assert parameters[name]["description"].startswith(field.description), (path, name)
    answer = post(client, photo, params={"block_doubled_words": "true", "block_trigrams": "false"})
    assert answer.status_code == 200, answer.text
    assert (answer.json()["block_doubled_words"], answer.json()["block_trigrams"]) == (True, False)


def paging(size: Annotated[int, Query(alias="page-size")] = 10,
           tags: Annotated[list[str], Query()] = []) -> tuple[int, list[str]]:  # a dependency's own parameters
    return size, tags


def test_the_query_check_reads_a_dependencys_parameters_by_alias_and_a_list_may_repeat():
    """The unknown/repeated check reads every query parameter a route takes, not only its query model's fields:
    a dependency's parameters (the caption options were one until the query model), by the alias a client
    sends, and a list parameter may be given many times.  Reading only the route's own parameters, or the
    Python names, refused a parameter the route takes as unknown; a list read as one value refused its repeats."""
    app = FastAPI()

    @app.get("/page", dependencies=[Depends(known_query_only)])
    def page(options: QueryOptions, page: Annotated[tuple[int, list[str]], Depends(paging)]) -> dict:
        return {"size": page[0], "tags": page[1], "beam_size": options.beam_size}

    with TestClient(app) as client:
        taken = client.get("/page", params=[("page-size", "2"), ("tags", "a"), ("tags", "b"), ("beam_size", "3")])
        assert taken.status_code == 200, taken.text
        assert taken.json() == {"size": 2, "tags": ["a", "b"], "beam_size": 3}
        unknown = client.get("/page", params={"size": "2"})
        assert unknown.status_code == 422 and unknown.json()["detail"][0]["loc"] == ["query", "size"]
        # the type FastAPI gives a field it does not take, as a client of a plain FastAPI app reads it
        assert unknown.json()["detail"][0]["type"] == "extra_forbidden"
        twice = client.get("/page", params=[("page-size", "2"), ("page-size", "3")])
        assert twice.status_code == 422 and twice.json()["detail"][0]["type"] == "repeated"


def test_each_route_documents_the_error_statuses_it_can_answer_and_no_others(client):
    """A generated client (or a reader of /docs) learns from the document what to handle: an upload's statuses
    (408, 413, 415, 429) only on the routes that take an upload, not on ``/captions/{result_id}``, whose path also
    starts with ``/caption``; a render's 504 only where something is rendered."""
    paths = client.get("/openapi.json").json()["paths"]
    errors = {path: sorted(int(status) for status in operation["responses"] if status != "200")
              for path, operations in paths.items() for operation in operations.values()}
    every, result, render = [404, 405, 422, 500, 503], [401], [504]
    upload = [401, 408, 413, 415, 429, 504]
    assert errors == {
        **{path: every for path in ("/models", "/healthz", "/readyz", "/metrics")},
        "/captions/{result_id}": sorted(every + result),
        **{path: sorted(every + result + render)
           for path in ("/captions/{result_id}/overlay", "/captions/{result_id}/heatmaps")},
        **{path: sorted(every + upload) for path in ("/caption", "/caption/overlay", "/caption/heatmaps")}}


def test_the_document_keeps_no_schema_of_fastapis_own_422(client):
    """Every 422 is a problem document (``Problem``): FastAPI's ``HTTPValidationError`` and ``ValidationError``,
    referenced by no answer once replaced, would still be classes of a generated client, for answers that never come."""
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    assert "Problem" in schemas
    assert not {"HTTPValidationError", "ValidationError"} & set(schemas)


def test_every_documented_error_answer_is_a_problem_by_its_schema(client):
    """Each error status of each route names ``Problem`` as its body's schema: a generated client learns the fields
    it can read (``type``, ``detail``, ``errors``) from it, and the fuzz test (tests/test_fuzz_api.py) checks each
    answer against it; a media type with no ``schema`` under it types nothing and checks nothing."""
    paths = client.get("/openapi.json").json()["paths"]
    documented = {}
    for path, operations in paths.items():
        for operation in operations.values():
            for status, answer in operation["responses"].items():
                if int(status) >= 400:
                    documented[path, status] = answer.get("content")
    problem = {"application/problem+json": {"schema": {"$ref": "#/components/schemas/Problem"}}}
    assert documented and all(content == problem for content in documented.values()), documented


def test_every_closed_set_parameter_refers_to_its_shared_enum_on_every_route(client):
    """A generated client makes one enum class per inline enum: each closed-set query parameter (the attention
    format, the overlay format, the heatmap mode) refers to its one component on every route. A parameter that
    is never null (``attention_format``, default ``json``) wraps the reference in ``allOf``, keeping its default
    and description beside it, not an inline ``enum`` of its own."""
    document = client.get("/openapi.json").json()
    schemas, found = document["components"]["schemas"], {}
    for path, operations in document["paths"].items():
        for operation in operations.values():
            for parameter in operation.get("parameters", []):
                if parameter["name"] not in ("attention_format", "format", "mode"):
                    continue
                schema = parameter["schema"]
                assert "enum" not in schema and "type" not in schema, (path, schema)
                branches = schema.get("anyOf") or schema["allOf"]
                refs = [branch["$ref"].rsplit("/", 1)[1] for branch in branches if "$ref" in branch]
                found[(path, parameter["name"])] = refs
                assert [branch for branch in branches if "$ref" not in branch] in ([], [{"type": "null"}]), schema
    assert found[("/caption", "attention_format")] == found[("/captions/{result_id}", "attention_format")] == [
        "AttentionFormat"]
    assert {refs[0] for (_, name), refs in found.items() if name == "format"} == {"OverlayFormat"}
    attention = next(p for p in document["paths"]["/captions/{result_id}"]["get"]["parameters"]
                     if p["name"] == "attention_format")["schema"]
    assert attention["default"] == "json" and "PackedRows" in attention["description"]
    assert schemas["AttentionFormat"] == {"type": "string", "enum": ["json", "float16-base64"],
                                          "title": "AttentionFormat"}
    assert schemas["OverlayFormat"]["enum"] == ["png", "figure"]
    assert schemas["HeatmapMode"]["enum"] == list(MODES)


def test_behind_a_proxys_prefix_the_document_names_its_server_under_it(tmp_path):
    """``/`` would name the proxy's root, where no route of this API is."""
    document = create_app(serving_settings(weights_dir=tmp_path, root_path="/vision")).openapi()
    assert document["servers"] == [{"url": "/vision"}]


def test_each_apps_document_states_its_own_limits(client, tmp_path):
    """The request bodies' schemas are written into every app's document with that server's limits: written into
    the components the documents start from, the limits of the app made last reached every other app's document in
    the process (a library user's, the tests'), and each app added its sentence to the one before."""
    before = client.get("/openapi.json").json()["components"]["schemas"]
    other = create_app(serving_settings(weights_dir=tmp_path, default_beam_size=1, max_beam_size=2, default_max_len=4,
                                        max_max_len=5)).openapi()
    after = client.get("/openapi.json").json()["components"]["schemas"]
    for schemas, largest in ((before, 4), (after, 4), (other["components"]["schemas"], 2)):
        for body in ("CaptionForm", "CaptionJSON"):
            beam = schemas[body]["properties"]["beam_size"]
            integer = next(branch for branch in beam.get("anyOf", [beam]) if branch.get("type") == "integer")
            assert integer["maximum"] == largest and beam["description"].count("on this server") == 1, (body, beam)


def test_an_empty_image_is_refused_as_empty_in_every_body_format(client):
    """Zero bytes of image are named as such (422 invalid-image), whichever way they come, not handed to the
    decoder to fail as an unreadable image."""
    answers = [client.post("/caption", content=b"", headers={"content-type": "image/jpeg"}),
               client.post("/caption", files={"file": ("c.jpg", b"", "image/jpeg")}),
               client.post("/caption", json={"image": ""})]
    for answer in answers:
        assert problem(answer, 422, "invalid-image")["detail"] == "the uploaded image is empty"


def test_a_requests_arrival_is_the_time_the_middleware_noted_else_now():
    assert arrival(Request({"type": "http", "state": {middleware.ARRIVED: 12.5}})) == 12.5
    before = time.monotonic()
    for scope in ({"type": "http"}, {"type": "http", "state": {}}):  # no middleware: the deadline counts from now
        assert before <= arrival(Request(scope)) <= time.monotonic()


def test_the_deadline_counts_from_the_requests_arrival_not_from_when_the_route_asks(client, photo, monkeypatch):
    timeout = client.app.state.service.settings.request_timeout_s
    # the middleware notes an arrival a deadline and a minute ago; the route runs now, well within a deadline of its
    # own, so only the time noted at arrival can spend it (reading and waiting for the event loop count too)
    monkeypatch.setattr(middleware, "time", types.SimpleNamespace(
        perf_counter=time.perf_counter, monotonic=lambda: time.monotonic() - timeout - 60))
    late = problem(client.post("/caption", files={"file": ("coffee.jpg", photo, "image/jpeg")}), 504, "deadline")
    assert f"the {timeout:g} s request deadline passed" in late["detail"]


def test_an_upload_still_arriving_at_the_deadline_counted_from_arrival_is_cut_off_as_a_408(client, photo,
                                                                                           monkeypatch):
    """A slow or stalled upload is cut off when the request's deadline passes, counted from its arrival (not a
    whole deadline from when the route starts reading), and answered 408 ``upload-timeout``. The middleware notes an
    arrival a second short of the deadline ago; the body never arrives (its read would give up only after 20 s, far
    past the deadline, failing the request otherwise)."""
    timeout = client.app.state.service.settings.request_timeout_s
    monkeypatch.setattr(middleware, "time", types.SimpleNamespace(
        perf_counter=time.perf_counter, monotonic=lambda: time.monotonic() - timeout + 1))

    async def stalled_read(*args, **kwargs):
        await asyncio.sleep(20)
        raise AssertionError("the upload's read was not cut off at the deadline")

    monkeypatch.setattr(upload_answers, "read_caption_request", stalled_read)
    cut = problem(client.post("/caption", files={"file": ("coffee.jpg", photo, "image/jpeg")}), 408, "upload-timeout")
    assert f"within the {timeout:g} s request deadline" in cut["detail"]


def test_the_use_case_counts_the_deadline_from_the_arrival_it_is_given(client, photo):
    state = client.app.state.service
    arrived = time.monotonic() - state.settings.request_timeout_s - 60
    with pytest.raises(DeadlinePassed):
        client.portal.call(caption_image, state, CaptionRequest(photo, CaptionParameters()), arrived)
    assert client.portal.call(caption_image, state, CaptionRequest(photo, CaptionParameters())).tokens  # default: now


def test_the_use_case_refuses_a_request_read_after_the_service_stopped_being_ready(client, photo, monkeypatch):
    """The readiness checked before the body is read is checked again after it: a request whose upload arrived once
    the service stopped being ready (shutting down) gets the 503, although its model's batcher still accepts."""
    state = client.app.state.service
    monkeypatch.setattr(state, "ready", False)
    with pytest.raises(NotReady):
        client.portal.call(caption_image, state, CaptionRequest(photo, CaptionParameters()))


def test_admission_is_asked_with_the_requests_beam_length_and_what_is_left_of_its_deadline(client, photo,
                                                                                            monkeypatch):
    """Before the body is read and again before the image is decoded, the batcher is asked whether it would take
    this request: its own beam and length (not swapped), and what is left of its deadline, not a whole one."""
    state = client.app.state.service
    batcher = state.batchers["tiny-b"]
    asked, check_admission = [], batcher.check_admission

    def noting_check(timeout_s, beam_size, max_len):
        asked.append((timeout_s, beam_size, max_len))
        return check_admission(timeout_s, beam_size, max_len)

    monkeypatch.setattr(batcher, "check_admission", noting_check)
    arrived = time.monotonic() - 20
    options = CaptionParameters(model="tiny-b", beam_size=2, max_len=5)
    refuse_early(state, options, arrived)
    client.portal.call(caption_image, state, CaptionRequest(photo, options), arrived)
    assert [(beam, length) for _, beam, length in asked] == [(2, 5), (2, 5)]
    assert all(0 < left <= state.settings.request_timeout_s - 20 for left, _, _ in asked), asked


@pytest.fixture
def tiny_a_full(client, monkeypatch):
    """tiny-a's batcher refuses every request at admission, as with its queue full."""
    def full(timeout_s, beam_size, max_len):
        raise QueueFull("the queue of 'tiny-a' is full")

    monkeypatch.setattr(client.app.state.service.batchers["tiny-a"], "check_admission", full)


@pytest.mark.usefixtures("tiny_a_full")
def test_a_request_its_named_models_batcher_would_refuse_is_refused_before_its_body_is_read(client):
    # a body no caption request may have: read, it would have been refused 415
    answer = client.post("/caption", params={"model": "tiny-a"}, content=b"x", headers={"content-type": "text/plain"})
    assert problem(answer, 429, "overloaded")["detail"] == "the queue of 'tiny-a' is full"


@pytest.mark.usefixtures("tiny_a_full")
def test_an_upload_its_models_batcher_would_refuse_is_refused_before_its_image_is_decoded(client):
    # no image at all: opened, it would have been refused 422 invalid-image (JSON's options come with its body)
    answer = client.post("/caption", json={"image": base64.b64encode(b"not an image").decode(), "model": "tiny-a"})
    assert problem(answer, 429, "overloaded")["detail"] == "the queue of 'tiny-a' is full"


@pytest.mark.usefixtures("tiny_a_full")
def test_an_upload_whose_query_names_no_model_is_not_judged_early_by_the_default_models_batcher(client, photo):
    """The query names no model, so the early check has no batcher to ask: a form field may still name one (here
    tiny-b, while the default tiny-a would refuse), and the request is judged once its body has said which."""
    answer = post(client, photo, fields={"model": "tiny-b", "beam_size": "2"})
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == "tiny-b"
    refused = post(client, photo)  # the default model, judged after the body is read: its own refusal
    assert problem(refused, 429, "overloaded")["detail"] == "the queue of 'tiny-a' is full"


def test_the_decode_slot_and_the_batcher_are_given_what_is_left_of_the_deadline(client, photo, monkeypatch):
    state = client.app.state.service
    timeouts, slots, batcher = {}, state.decode_slots, state.batchers["tiny-a"]
    run, caption = slots.run, batcher.caption

    async def noting_run(*args, timeout, **kwargs):
        timeouts["slot"] = timeout
        return await run(*args, timeout=timeout, **kwargs)

    async def noting_caption(prepared, beam_size, max_len, timeout_s, rules):
        timeouts["batcher"] = timeout_s
        return await caption(prepared, beam_size, max_len, timeout_s, rules)

    monkeypatch.setattr(slots, "run", noting_run)
    monkeypatch.setattr(batcher, "caption", noting_caption)
    # arrived 20 s ago: each wait may take at most what is left, not a whole deadline
    arrived = time.monotonic() - 20
    client.portal.call(caption_image, state, CaptionRequest(photo, CaptionParameters(max_len=3)), arrived)
    assert set(timeouts) == {"slot", "batcher"}
    assert all(0 < left <= state.settings.request_timeout_s - 20 for left in timeouts.values()), timeouts


def test_an_option_sent_as_a_file_part_is_refused_naming_it(client, photo):
    # curl -F beam_size=@three.txt: said so, not left to the option's validation to call "3" an invalid integer
    refused = problem(post(client, photo, extra_files=[("beam_size", ("three.txt", b"3", "text/plain"))]))
    assert refused["detail"] == "beam_size must be a form field, not a file"
    # a client shows each error beside its field: the entry names the option and says what came instead
    assert refused["errors"] == [{"loc": ["body", "beam_size"], "msg": "a file part, expected a form field"}]


def test_a_query_option_a_json_body_overrides_is_not_refused_before_the_body_is_read(client, photo):
    # the query names its model and a beam above the limit; the JSON body's beam replaces it, so nothing is refused
    answer = client.post("/caption", params={"model": "tiny-a", "beam_size": 9},
                         json={"image": base64.b64encode(photo).decode(), "beam_size": 2})
    assert answer.status_code == 200, answer.text
    assert answer.json()["beam_size"] == 2


def test_media_types_and_content_codings_are_case_insensitive_and_raw_bytes_may_be_octet_stream(client, photo):
    # RFC 9110: a media type's type and subtype, and a content coding, are case-insensitive
    plain = post(client, photo).json()
    for headers in ({"content-type": "Image/JPEG"}, {"content-type": "application/octet-stream"},
                    {"content-type": "image/jpeg", "content-encoding": "Identity"}):
        answer = client.post("/caption", content=photo, headers=headers)
        assert answer.status_code == 200, (headers, answer.text)
        same_caption(plain, answer.json())


def test_a_json_lookalike_media_type_is_not_read_as_json(client, photo):
    # newline-delimited JSON ends in "json" but is no JSON document (not application/json, not a +json suffix)
    body = json.dumps({"image": base64.b64encode(photo).decode()})
    answer = client.post("/caption", content=body, headers={"content-type": "application/x-ndjson"})
    assert "application/x-ndjson" in problem(answer, 415, "unsupported-media-type")["detail"]


def test_base64_that_begins_with_data_is_not_taken_for_a_data_url(client):
    # "dataAAEC" is the base64 of six bytes (no image): decoded and refused as such, not cut to nothing at a comma
    answer = client.post("/caption", json={"image": base64.b64encode(b"u\xabZ\x00\x01\x02").decode()})
    assert problem(answer, 422, "invalid-image")["detail"] != "the uploaded image is empty"


def test_base64_with_a_non_ascii_character_is_refused_as_invalid_base64(client, photo):
    # a typographic quote or a non-breaking space pasted into the image (base64's decoder raises ValueError, not
    # binascii.Error, for a str that is not ASCII) is the client's mistake: a 422 naming it, not a 500
    encoded = base64.b64encode(photo).decode()
    for stray in ("\u201d", "\u00a0", "\u00e9"):
        answer = client.post("/caption", json={"image": encoded[:100] + stray + encoded[100:]})
        assert "not valid base64" in problem(answer, 422, "invalid-image")["detail"]


def test_the_use_cases_check_reads_the_requests_caption_length_and_the_decode_slot_weighs_its_pixels(
        client, photo, monkeypatch):
    """``check`` (the overlay's: a token past a caption's last is refused before the model runs) is given the
    request's length limit, not its beam; the decode slot is asked for the image's own decode cost, so that the
    decode budget lets small uploads decode together and a huge one alone, not a share of one per upload."""
    state = client.app.state.service
    checked, costs, run = [], [], state.decode_slots.run

    async def noting_run(*args, cost, **kwargs):
        costs.append(cost)
        return await run(*args, cost=cost, **kwargs)

    monkeypatch.setattr(state.decode_slots, "run", noting_run)
    client.portal.call(caption_image, state, CaptionRequest(photo, CaptionParameters(beam_size=2, max_len=5)), None,
                       lambda runtime, max_len: checked.append((runtime.name, max_len)))
    assert checked == [(state.default_model, 5)]
    assert costs == [decode_cost(open_image(photo, state.settings.max_pixels))] and costs[0] > 1


def test_an_upload_is_prepared_by_the_runtime_of_the_model_it_names(client, photo, monkeypatch):
    """Each model preprocesses for its own encoder (its input size and normalisation): an upload for tiny-b prepared
    by the default model's runtime would reach tiny-b's encoder as another model's pixels (wrong features, or a
    shape error, silently for models that happen to share a preprocessing)."""
    state = client.app.state.service
    prepared_by, run = [], state.decode_slots.run

    async def noting_run(work, runtime, *args, **kwargs):
        prepared_by.append(runtime)
        return await run(work, runtime, *args, **kwargs)

    monkeypatch.setattr(state.decode_slots, "run", noting_run)
    assert state.default_model != "tiny-b"
    client.portal.call(caption_image, state, CaptionRequest(photo, CaptionParameters(model="tiny-b", max_len=5)))
    assert prepared_by == [state.runtimes["tiny-b"]]


def test_a_decode_wait_past_the_deadline_is_a_504_saying_the_upload_waited_to_be_decoded(client, photo, monkeypatch):
    """The 504's detail names what waited: an operator reading "waited to be decoded" raises the decode budget,
    one reading "waited to be rendered" the render pool's."""
    state = client.app.state.service

    async def slots_full(*args, **kwargs):
        raise TimeoutError  # what WorkSlots raises when the wait outlasts its timeout

    monkeypatch.setattr(state.decode_slots, "run", slots_full)
    with pytest.raises(DeadlinePassed) as refused:
        client.portal.call(caption_image, state, CaptionRequest(photo, CaptionParameters(max_len=5)))
    limit = f"{state.settings.request_timeout_s:g}"
    assert str(refused.value) == f"the {limit} s request deadline passed while the upload waited to be decoded"


def test_a_service_ready_with_no_model_loaded_answers_a_caption_request_503_not_404():
    """A start that found no checkpoint still ends ready (``/readyz`` says why it takes no traffic); a caption
    request sent there anyway is the 503 "no model is loaded", retryable, not a 404 for a model it did not name."""
    empty = types.SimpleNamespace(batchers={}, default_model=None)
    for name in (None, "sat"):
        with pytest.raises(NotReady, match="no model is loaded"):
            pick_model(empty, name)
    with pytest.raises(UnknownModel, match="available: sat"):
        pick_model(types.SimpleNamespace(batchers={"sat": object()}, default_model="sat"), "other")


def test_a_request_is_refused_503_before_its_body_is_read_while_the_service_is_not_ready(client, monkeypatch):
    """While starting or shutting down, a caption request is refused before its body is read, whatever its options
    name (none here, so no batcher is asked): reading an upload only to refuse it takes event-loop time. Read, this
    body would have been refused 415."""
    state = client.app.state.service
    monkeypatch.setattr(state, "ready", False)
    with pytest.raises(NotReady):
        refuse_early(state, None, time.monotonic())
    answer = client.post("/caption", content=b"x", headers={"content-type": "text/plain"})
    problem(answer, 503, "not-ready")


def test_a_request_with_under_a_second_of_its_deadline_left_is_still_given_to_the_batcher(client, photo,
                                                                                          monkeypatch):
    """Only a deadline already spent reading and decoding the upload keeps the rows from a request: one with half a
    second left is captioned within it (the batcher gives up at the deadline itself). The use case's clock is
    frozen, so every reading of what is left says exactly half a second."""
    state = client.app.state.service
    batcher, now = state.batchers["tiny-a"], time.monotonic()
    given = []

    async def noting_caption(prepared, beam_size, max_len, timeout_s, rules):
        given.append(timeout_s)
        return "captioned"

    monkeypatch.setattr(state, "result_cache", None)  # a cached caption would never reach the batcher
    monkeypatch.setattr(captioning, "time", types.SimpleNamespace(monotonic=lambda: now))
    monkeypatch.setattr(batcher, "check_admission", lambda timeout_s, beam_size, max_len: None)
    monkeypatch.setattr(batcher, "caption", noting_caption)
    arrived = now - state.settings.request_timeout_s + 0.5
    assert client.portal.call(caption_image, state, CaptionRequest(photo, CaptionParameters()), arrived) == "captioned"
    assert given == [0.5]


def test_the_problem_members_and_every_answer_header_are_typed_in_the_document(tmp_path):
    """A generated client and a validator take the types from the document: a problem's ``type`` and ``instance``
    are URI references (its page, the request path), ``detail`` is text, members beyond these are allowed (RFC 9457's
    extension members: a client made to refuse them breaks on the first one added), and every header an answer is
    documented with is a string, as the service sends it. A member or header left untyped is any JSON value to a
    client."""
    document = create_app(serving_settings(weights_dir=tmp_path)).openapi()
    members = document["components"]["schemas"]["Problem"]["properties"]
    formats = {name: member["format"] for name, member in members.items() if "format" in member}
    assert formats == {"type": "uri-reference", "instance": "uri-reference"}
    types = [members[name].get("type") for name in ("type", "title", "status", "detail", "instance", "errors")]
    assert types == ["string", "string", "integer", "string", "string", "array"]
    assert document["components"]["schemas"]["Problem"]["additionalProperties"] is True
    documented, untyped, text = 0, [], {"type": "string"}
    for path, operations in document["paths"].items():
        for operation in operations.values():
            for status, answer in operation["responses"].items():
                headers = answer.get("headers", {})
                documented += len(headers)
                untyped += [(path, status, name) for name in headers if headers[name].get("schema") != text]
    assert documented and untyped == []
