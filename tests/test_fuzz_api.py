"""API fuzzing with schemathesis over the app's own OpenAPI document (in-process, ASGI): generated requests to
every operation — valid and invalid parameters, bodies of every documented media type — never get a 5xx, and
every answer conforms to the document (status code, content type, body schema, problem documents included).
Bounded: a fixed number of examples per operation, derandomised, so the test takes well under a minute."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

import hypothesis
import pytest
import schemathesis
import torch
from fastapi.testclient import TestClient
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from captioner.models.checkpoint import save_checkpoint
from captioner.models.encoder import EncoderSpec
from captioner.models.vocab import Vocabulary
from captioner.models.zoo import create
from captioner.service.app import create_app

from .serving_helpers import serving_settings

EXAMPLES_PER_OPERATION = 40
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


def _app():
    root = Path(tempfile.mkdtemp(prefix="fuzz-weights-"))
    # made at collection, which every xdist worker does and one runs the tests of: each process removes its own
    # when it ends (the fixture's removal left one folder in /tmp a run)
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    torch.manual_seed(0)
    vocab = Vocabulary(["a", "red", "circle"])
    save_checkpoint(root / "tiny", create("sat", vocab_size=len(vocab), feat_dim=320, embed_dim=8, hidden_dim=8,
                                          attn_dim=4), vocab, EncoderSpec(image_size=64))
    return create_app(serving_settings(weights_dir=root, default_model="tiny", max_upload_bytes=200_000,
                                       max_pixels=1_000_000, max_beam_size=3, max_max_len=8, default_max_len=4,
                                       default_beam_size=1, max_rows=8))


# the document needs no loaded model, so the schema is read at collection time; the tests run against the same
# app with its lifespan (model loading) started by the fixture
APP = _app()
schema = schemathesis.openapi.from_asgi("/openapi.json", APP)


@pytest.fixture(scope="module")
def client():
    with TestClient(APP, raise_server_exceptions=False) as running:
        yield running


@schema.parametrize()
@hypothesis.settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, derandomize=True, database=None,
                     suppress_health_check=list(hypothesis.HealthCheck))
def test_no_server_errors_and_every_answer_matches_the_schema(case, client):
    response = case.call()  # through the app's ASGI interface, while the fixture keeps its models loaded
    case.validate_response(response, checks=CHECKS)
