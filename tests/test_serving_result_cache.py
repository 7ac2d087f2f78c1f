"""The optional result cache over HTTP: a second identical upload (same bytes, model and options) is answered
without the model and with the same caption; other options or other bytes miss; hits and misses are counted."""

from __future__ import annotations

import hashlib
import io
import random
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from captioner.models.decoding import DecodingRules
from captioner.service import captioning
from captioner.service.app import create_app
from captioner.service.result_cache import CacheKey, ResultCache, content_digest

from .serving_helpers import count_encodes, random_images, record_event_loop_calls, serving_settings

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")


def jpeg(seed: int) -> bytes:
    buffer = io.BytesIO()
    random_images(1, seed)[0].save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def scrape(text: str, name: str, **labels: str) -> float:
    wanted = name + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"
    values = [float(line.rpartition(" ")[2]) for line in text.splitlines() if line.startswith(wanted)]
    assert len(values) == 1, f"{wanted} not in /metrics"
    return values[0]


@pytest.fixture(scope="module")
def cached_app(tmp_path_factory):
    weights = tmp_path_factory.mktemp("weights")
    (weights / "sat").symlink_to(ROOT / "weights" / "sat")
    (weights / "sat-twin").symlink_to(ROOT / "weights" / "sat")  # the same weights served under a second name
    settings = serving_settings(weights_dir=weights, default_model="sat", release_memory=False,
                                result_cache_entries=2)
    with TestClient(create_app(settings)) as client:
        runtime = client.app.state.service.runtimes["sat"]
        calls = count_encodes(runtime)
        twin_calls = count_encodes(client.app.state.service.runtimes["sat-twin"])
        client.app.state.twin_calls = twin_calls
        yield client, calls


def caption(client, data: bytes, **params):
    response = client.post("/caption", files={"file": ("scene.jpg", data, "image/jpeg")}, params=params)
    assert response.status_code == 200, response.text
    body = response.json()
    body.pop("id")  # a fresh overlay id for every answer
    return body


def test_identical_upload_is_answered_from_the_cache(cached_app):
    client, calls = cached_app
    first_image, other_image = jpeg(1), jpeg(2)
    first = caption(client, first_image, beam_size=3, max_len=12)
    assert calls == [1]
    again = caption(client, first_image, beam_size=3, max_len=12)
    assert calls == [1]  # the model was not called
    assert again == first
    caption(client, first_image, beam_size=2, max_len=12)  # other options: a miss
    caption(client, other_image, beam_size=3, max_len=12)  # other bytes: a miss (and evicts the oldest of 2)
    assert len(calls) == 3
    caption(client, first_image, beam_size=3, max_len=12)  # least recently used, evicted: a miss again
    assert len(calls) == 4
    metrics = client.get("/metrics").text
    assert scrape(metrics, "captioner_result_cache_lookups_total", model="sat", outcome="hit") == 1
    assert scrape(metrics, "captioner_result_cache_lookups_total", model="sat", outcome="miss") == 4


def test_another_model_or_other_decoding_rules_are_a_miss(cached_app):
    """The cache key holds the model and the decoding rules: an answer made by one model or with one length penalty
    is never handed to a request asking for another."""
    client, calls = cached_app
    image = jpeg(3)
    caption(client, image, beam_size=2, max_len=8)
    before = len(calls)
    twin = client.app.state.twin_calls
    answer = caption(client, image, model="sat-twin", beam_size=2, max_len=8)
    assert answer["model"] == "sat-twin" and len(twin) == 1  # its own model ran
    caption(client, image, beam_size=2, max_len=8, length_penalty=1.5)
    caption(client, image, beam_size=2, max_len=8, block_trigrams="true")
    assert len(calls) == before + 2  # each set of rules ran the model


def test_a_caption_made_under_one_length_limit_is_a_miss_under_another(cached_app):
    """The key holds ``max_len``: a caption cut at 4 tokens is never the answer to a request allowing 12 (nor the
    other way round), whatever else the two requests share."""
    client, calls = cached_app
    image = jpeg(5)
    short = caption(client, image, beam_size=2, max_len=4)
    before = len(calls)
    longer = caption(client, image, beam_size=2, max_len=12)
    assert len(calls) == before + 1  # the model ran again
    assert len(short["tokens"]) <= 4 and longer["tokens"] != short["tokens"]


def test_the_upload_is_hashed_for_its_key_off_the_event_loop(cached_app, monkeypatch):
    """The key's digest reads every byte of the upload (a SHA-256 of up to 10 MiB, tens of milliseconds): taken on
    the event loop, every other request and the liveness probe would wait for each upload's hash."""
    client, _ = cached_app
    on_loop = record_event_loop_calls(monkeypatch, captioning, "content_digest")
    caption(client, jpeg(6), beam_size=2, max_len=4)
    assert on_loop == [False]


def test_the_cache_evicts_the_least_recently_used_entry():
    cache = ResultCache(2)
    a, b, c = (CacheKey(digest, "sat", 3, 20, DecodingRules()) for digest in "abc")
    cache.put(a, "A")  # type: ignore[arg-type]
    cache.put(b, "B")  # type: ignore[arg-type]
    assert cache.get(a) == "A"  # a is now the most recently used
    cache.put(c, "C")  # type: ignore[arg-type]
    assert cache.get(b) is None and cache.get(a) == "A" and cache.get(c) == "C"


def test_the_key_digest_is_the_sha256_of_every_byte_of_the_upload():
    """The key's digest is the upload's SHA-256 (module docstring, ``CAPTIONER_RESULT_CACHE_ENTRIES``' description),
    taken over all of its bytes: two photos that differ only far into the file (the bottom rows of a large JPEG)
    must never share an answer."""
    upload = bytes(range(256)) * 4096  # 1 MiB
    assert content_digest(upload) == hashlib.sha256(upload).hexdigest()
    assert content_digest(upload[:-1] + b"\x00") != content_digest(upload)


@pytest.mark.parametrize("entries", [0, 1, 3])
def test_the_cache_holds_the_most_recently_used_entries_up_to_its_size_and_none_when_off(entries):
    """Against a plain list of the most recently used keys: random puts and gets, with repeated keys, keep exactly
    the ``entries`` most recently used ones (a cache of one entry keeps the last); ``0`` is the off switch
    (``CAPTIONER_RESULT_CACHE_ENTRIES=0``): the use case never consults it, and it keeps nothing."""
    cache, recent = ResultCache(entries), []  # recent: the reference, most recently used last
    assert cache.enabled == (entries > 0)
    keys = [CacheKey(digest, "sat", 3, 20, DecodingRules()) for digest in "abcde"]
    rng = random.Random(entries)
    for _ in range(200):
        key = rng.choice(keys)
        if rng.random() < 0.5:
            cache.put(key, key.digest.upper())  # type: ignore[arg-type]
            recent = [k for k in recent if k != key] + [key]
            recent = recent[-entries:] if entries else []
        else:
            expected = key.digest.upper() if key in recent else None
            assert cache.get(key) == expected
            if expected is not None:
                recent = [k for k in recent if k != key] + [key]
        assert len(cache) == len(recent)


def test_with_the_cache_off_identical_uploads_run_the_model_and_no_lookup_is_counted(tmp_path_factory):
    """The default (``result_cache_entries=0``): every upload runs the model, and /metrics counts no cache lookups
    (the upload is not even hashed)."""
    weights = tmp_path_factory.mktemp("weights")
    (weights / "sat").symlink_to(ROOT / "weights" / "sat")
    settings = serving_settings(weights_dir=weights, default_model="sat", release_memory=False)
    with TestClient(create_app(settings)) as client:
        calls = count_encodes(client.app.state.service.runtimes["sat"])
        image = jpeg(4)
        first = caption(client, image, beam_size=2, max_len=8)
        assert caption(client, image, beam_size=2, max_len=8) == first
        assert len(calls) == 2
        assert "captioner_result_cache_lookups_total{" not in client.get("/metrics").text
