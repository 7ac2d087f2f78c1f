"""The caption answer written by orjson (``CAPTIONER_JSON_ENCODER=orjson``, the default) against the pydantic
answer model it replaces on the hot path: the same fields in the same order with the same values, the attention
maps as the same float32 numbers, for every architecture (extras and area boxes included) and over HTTP; and the
packed attention maps (``attention_format=float16-base64``): the JSON numbers to float16 precision, the caption
unchanged."""

from __future__ import annotations

import base64
import dataclasses
import json
from pathlib import PurePath

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from PIL import Image
from skimage import data

from captioner.models.inference import TorchRuntime
from captioner.service.app import create_app
from captioner.service.schemas import CaptionOut, caption_json
from captioner.service.settings import Settings

from .conftest import DEFAULT_CHECKPOINT
from .serving_helpers import all_architectures, random_images, shared_encoder, tiny_checkpoint
from .test_serving_http import encode

pytestmark = pytest.mark.usefixtures("one_thread")
MAPS = ("attention", "extras")


def unpack(packed: dict) -> np.ndarray:
    """A PackedRows map as the OpenAPI description says a client reads it."""
    assert packed["encoding"] == "float16-base64"
    return np.frombuffer(base64.b64decode(packed["data"]), "<f2").reshape(packed["shape"])


def assert_packed_answer(packed: dict, reference: dict) -> None:
    """Every field of the JSON answer unchanged but the maps, which are its numbers rounded to float16."""
    assert {k: v for k, v in packed.items() if k not in MAPS} == {k: v for k, v in reference.items() if k not in MAPS}
    assert list(packed["extras"]) == list(reference["extras"])
    for got, want in [(packed["attention"], reference["attention"]),
                      *[(packed["extras"][k], reference["extras"][k]) for k in reference["extras"]]]:
        np.testing.assert_array_equal(unpack(got), np.asarray(want, dtype=np.float64).astype(np.float16))


def assert_same_answer(fast: dict, reference: dict) -> None:
    """Equal field by field; the attention maps equal as float32 (what the model computed), where the reference
    writes each float32 widened to a double."""
    assert list(fast) == list(reference)
    assert {k: v for k, v in fast.items() if k not in MAPS} == {k: v for k, v in reference.items() if k not in MAPS}
    assert list(fast["extras"]) == list(reference["extras"])
    for got, want in [(fast["attention"], reference["attention"]),
                      *[(fast["extras"][k], reference["extras"][k]) for k in reference["extras"]]]:
        got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
        assert got.shape == want.shape
        np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))
        # the shortest float32 form differs from the widened double by less than half a float32 step
        np.testing.assert_allclose(got, want, rtol=2.0**-24, atol=0)


@pytest.mark.parametrize("arch", all_architectures())
def test_orjson_answer_equals_the_pydantic_answer(arch):
    ckpt = tiny_checkpoint(arch)
    runtime = TorchRuntime(arch, ckpt, shared_encoder(), torch.device("cpu"))
    results = runtime.caption([runtime.prepare(image) for image in random_images(2)], beam_size=3, max_len=8)
    for result in results:
        reference = json.loads(CaptionOut.of(result, "some-id").model_dump_json())
        fast_bytes = caption_json(result, "some-id")
        assert_same_answer(json.loads(fast_bytes), reference)
        # never longer (shortest float32 numbers); equal where every weight is short, as a model's exact 0s and 1s
        assert len(fast_bytes) <= len(CaptionOut.of(result, "some-id").model_dump_json())
        packed = json.loads(caption_json(result, "some-id", "float16-base64"))
        assert_packed_answer(packed, reference)
        # the pydantic writer packs the same bytes
        assert json.loads(CaptionOut.of(result, "some-id", "float16-base64").model_dump_json()) == packed


def test_both_encoders_answer_the_same_over_http(tmp_path):
    """One in-process service per encoder on the shipped default weights: the same answers, and the same problem
    documents for bad input (the encoder changes nothing but the writing of successful answers)."""
    upload = encode(Image.fromarray(data.chelsea()))
    answers, problems = {}, {}
    for encoder in ("orjson", "pydantic"):
        settings = Settings(weights_dir=tmp_path, checkpoints=[DEFAULT_CHECKPOINT], warmup=False,
                            release_memory=False, backend="torch", device="cpu", threads=1, json_encoder=encoder)
        with TestClient(create_app(settings)) as client:
            response = client.post("/caption", params={"beam_size": 2, "max_len": 10},
                                   files={"file": ("cat.jpg", upload, "image/jpeg")})
            assert response.status_code == 200 and response.headers["content-type"] == "application/json"
            answers[encoder] = {k: v for k, v in response.json().items() if k != "id"}
            packed = client.post("/caption", params={"beam_size": 2, "max_len": 10,
                                                     "attention_format": "float16-base64"},
                                 files={"file": ("cat.jpg", upload, "image/jpeg")})
            assert packed.status_code == 200
            assert_packed_answer({k: v for k, v in packed.json().items() if k != "id"}, answers[encoder])
            again = client.get(f"/captions/{packed.json()['id']}", params={"attention_format": "float16-base64"})
            assert again.json() == packed.json()
            bad = client.post("/caption", files={"file": ("x.jpg", b"not an image", "image/jpeg")})
            unknown = client.post("/caption", params={"attention_format": "float64"},
                                  files={"file": ("cat.jpg", upload, "image/jpeg")})
            problems[encoder] = [(r.status_code, r.json()["type"]) for r in (bad, unknown)]
            assert unknown.status_code == 422 and "attention_format" in unknown.json()["detail"]
            schema = client.get("/openapi.json").json()
    assert_same_answer(answers["orjson"], answers["pydantic"])
    assert problems["orjson"] == problems["pydantic"]
    # what tells them apart: orjson writes each weight as the shortest text of its float32, pydantic as a float64
    orjson_row, pydantic_row = answers["orjson"]["attention"][0], answers["pydantic"]["attention"][0]
    assert [str(np.float32(v)) for v in orjson_row] == [str(v) for v in orjson_row]
    assert [str(np.float32(v)) for v in pydantic_row] != [str(v) for v in pydantic_row]
    parameter = next(p for p in schema["paths"]["/caption"]["post"]["parameters"] if p["name"] == "attention_format")
    # one shared enum (a generated client made one class per route)
    assert parameter["schema"]["allOf"] == [{"$ref": "#/components/schemas/AttentionFormat"}]
    assert schema["components"]["schemas"]["AttentionFormat"]["enum"] == ["json", "float16-base64"]
    assert "PackedRows" in parameter["description"]
    assert set(schema["components"]["schemas"]["PackedRows"]["properties"]) == {"encoding", "shape", "data"}


def test_the_answer_rounds_attention_to_6_decimals_and_log_probabilities_to_5():
    """The rounding the answer's field descriptions state: attention weights to 6 decimals (which keep a row's sum
    within 1e-5 of 1 and exact zeros at 0.0), token log-probabilities and the score to 5, in both writers; and
    ``area_boxes`` is null for a model without area attention."""
    ckpt = tiny_checkpoint("sat")
    runtime = TorchRuntime("sat", ckpt, shared_encoder(), torch.device("cpu"))
    result = runtime.caption([runtime.prepare(random_images(1, seed=7)[0])], beam_size=2, max_len=8)[0]
    hyp = result.hypothesis
    attention = hyp.attention.float()
    assert not torch.equal(torch.round(attention, decimals=6), torch.round(attention, decimals=5))
    for answer in (json.loads(CaptionOut.of(result).model_dump_json()), json.loads(caption_json(result))):
        np.testing.assert_array_equal(np.asarray(answer["attention"], dtype=np.float32),
                                      torch.round(attention, decimals=6).numpy())
        assert answer["token_logprobs"] == [round(v, 5) for v in hyp.token_logprobs]
        assert answer["score"] == round(hyp.score, 5)
        assert answer["area_boxes"] is None  # null for a model without area attention, not an empty list
    properties = CaptionOut.model_json_schema()["properties"]
    assert "(6 decimals)" in properties["attention"]["description"]
    assert "(5 decimals)" in properties["token_logprobs"]["description"]


def test_the_answer_names_the_checkpoint_folder_never_its_path_on_the_server():
    """``checkpoint`` is the folder's name (its description says so): the server's directories never reach a
    client, from either writer."""
    ckpt = tiny_checkpoint("sat")
    runtime = TorchRuntime("sat", ckpt, shared_encoder(), torch.device("cpu"))
    result = runtime.caption([runtime.prepare(random_images(1, seed=8)[0])], beam_size=1, max_len=4)[0]
    folder = PurePath("/srv/captioner/weights/sat")  # where a server loaded it from
    result = dataclasses.replace(result, checkpoint=str(folder))
    for text in (CaptionOut.of(result).model_dump_json(), caption_json(result).decode()):
        assert json.loads(text)["checkpoint"] == folder.name
        assert str(folder.parent) not in text
