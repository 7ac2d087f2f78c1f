"""Access control and hardening (service/security.py, service/results.py): optional bearer API keys on the
captioning and result endpoints only, CORS closed unless configured, security headers, bounded and unguessable
stored results, request ids, and no stack traces or server paths in any answer."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import io
import json
import logging
import re
import socket
import sys
import time

import pytest
import torch
from fastapi.testclient import TestClient
from PIL import Image
from starlette.applications import Starlette
from starlette.routing import Mount

from captioner.models.checkpoint import save_checkpoint
from captioner.models.encoder import EncoderSpec
from captioner.models.vocab import Vocabulary
from captioner.models.zoo import create
from captioner.service.app import create_app
from captioner.service.cli import main, read_settings
from captioner.service.errors import UnknownResult
from captioner.service.inputs import DISCARD_SECONDS, UnreadBodyMiddleware
from captioner.service.middleware import JsonFormatter, TextFormatter, request_id_var
from captioner.service.paths import ROOT_KEY, AppRootMiddleware, app_path, app_root
from captioner.service.problems import UnexpectedErrorMiddleware
from captioner.service.results import ResultStore
from captioner.service.security import ApiKeyMiddleware, key_matches
from captioner.service.settings import Settings

from .conftest import tiny_demo_server
from .serving_helpers import ROOT, run_bounded, serving_settings

KEYS = ["first-key-0123456789", "second-key-abcdefghij"]


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    root = tmp_path_factory.mktemp("security-weights")
    torch.manual_seed(0)
    vocab = Vocabulary(["a", "red", "circle"])
    save_checkpoint(root / "tiny", create("sat", vocab_size=len(vocab), feat_dim=320, embed_dim=16, hidden_dim=16,
                                          attn_dim=8), vocab, EncoderSpec(image_size=64))
    return root


def make_client(weights, **settings) -> TestClient:
    return TestClient(create_app(serving_settings(weights_dir=weights, default_model="tiny",
                                                  default_beam_size=1, default_max_len=4, **settings)))


@pytest.fixture(scope="module")
def keyed(weights):
    with make_client(weights, api_keys=KEYS, cors_origins=["https://app.example"]) as client:
        yield client


@pytest.fixture(scope="module")
def open_client(weights):
    with make_client(weights) as client:
        yield client


@pytest.fixture(scope="module")
def jpeg() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (40, 30), (200, 30, 30)).save(buffer, format="JPEG")
    return buffer.getvalue()


@contextlib.contextmanager
def access_log(render):
    """``render(record)`` of every access log line the app writes meanwhile (``record.fields``: its structured
    fields; a formatter's ``format``: the line as the server writes it, formatted while the request is current)."""
    kept = []

    class Kept(logging.Handler):
        def emit(self, record):
            kept.append(render(record))

    access = logging.getLogger("captioner.access")
    handler, level = Kept(), access.level
    access.addHandler(handler)
    access.setLevel(logging.INFO)
    try:
        yield kept
    finally:
        access.removeHandler(handler)
        access.setLevel(level)


def caption(client, jpeg, **headers):
    return client.post("/caption", files={"file": ("x.jpg", jpeg, "image/jpeg")}, headers=headers)


def test_keys_guard_captioning_and_results_but_not_probes_or_the_page(keyed, jpeg):
    missing = caption(keyed, jpeg)
    assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
    assert missing.headers["content-type"].startswith("application/problem+json")
    assert {"type", "title", "status", "detail"} <= set(missing.json()) and missing.json()["status"] == 401
    assert missing.headers["x-request-id"]
    wrong = caption(keyed, jpeg, Authorization="Bearer first-key-0123456788")
    assert wrong.status_code == 401 and "invalid_token" in wrong.headers["www-authenticate"]
    assert caption(keyed, jpeg, Authorization="Basic Zmlyc3Q6a2V5").status_code == 401
    assert caption(keyed, jpeg, Authorization=f"Bearer {KEYS[0]}x").status_code == 401
    for key in KEYS:  # several keys, so one can be rotated while the other still works
        ok = caption(keyed, jpeg, Authorization=f"Bearer {key}")
        assert ok.status_code == 200, ok.text
    result_id = ok.json()["id"]
    # the scheme's name is case-insensitive (RFC 9110, 11.1), the key is not
    assert caption(keyed, jpeg, Authorization=f"bearer {KEYS[0]}").status_code == 200
    assert caption(keyed, jpeg, Authorization=f"Bearer {KEYS[0].upper()}").status_code == 401
    # the key is the token after the scheme and its spaces (RFC 9110, 11.4: 1*SP), not those spaces and the key
    assert caption(keyed, jpeg, Authorization=f"Bearer  {KEYS[0]}").status_code == 200
    assert keyed.get(f"/captions/{result_id}").status_code == 401
    assert keyed.get(f"/captions/{result_id}", headers={"Authorization": f"Bearer {KEYS[1]}"}).status_code == 200
    overlay = keyed.post("/caption/overlay", files={"file": ("x.jpg", jpeg, "image/jpeg")})
    assert overlay.status_code == 401
    for path in ("/healthz", "/readyz", "/metrics", "/", "/static/app.js", "/models"):
        assert keyed.get(path).status_code == 200, path


def test_behind_a_proxys_path_prefix_the_keys_draining_and_the_log_read_the_path_without_it(weights, jpeg):
    """uvicorn with ``root_path`` (``CAPTIONER_ROOT_PATH``) puts a stripping proxy's prefix back into the path:
    ``/vision/caption`` with ``root_path`` ``/vision``, as this client sends it. The API key check compared the
    whole path with its protected prefix (``/caption``) and let such requests through without a key; draining
    refused liveness; the access log wrote the prefix before some paths and not others."""
    with access_log(lambda record: record.fields) as entries:
        app = create_app(serving_settings(weights_dir=weights, default_model="tiny", default_beam_size=1,
                                          default_max_len=4, api_keys=KEYS, root_path="/vision"))
        with TestClient(app, root_path="/vision") as client:
            assert client.post("/vision/caption", files={"file": ("x.jpg", jpeg, "image/jpeg")}).status_code == 401
            ok = client.post("/vision/caption", files={"file": ("x.jpg", jpeg, "image/jpeg")},
                             headers={"Authorization": f"Bearer {KEYS[0]}"})
            assert ok.status_code == 200, ok.text
            assert client.get(f"/vision/captions/{ok.json()['id']}").status_code == 401
            page = client.get("/vision/")
            assert page.status_code == 200 and "default-src 'self'" in page.headers["content-security-policy"]
            # the page's own addresses are relative: under the prefix they name the prefix's files
            assert 'src="static/app.js"' in page.text and 'href="static/style.css"' in page.text
            assert client.get("/vision/static/app.js").status_code == 200
            docs = client.get("/vision/docs")
            assert "'/vision/openapi.json'" in docs.text
            for name in ("swagger-ui-bundle.js", "swagger-ui.css", "favicon-32x32.png"):  # without the script: blank
                assert f'"/vision/docs/assets/{name}"' in docs.text, name
                assert client.get(f"/vision/docs/assets/{name}").status_code == 200, name
            assert client.get("/vision/openapi.json").json()["servers"] == [{"url": "/vision"}]
            app.state.shutdown_gate.begin_drain()
            assert client.get("/vision/healthz").status_code == 200
            assert client.get("/vision/readyz").status_code == 503
    paths = [e["path"] for e in entries]
    assert paths[:3] == ["/caption", "/caption", "/captions/{result_id}"]
    # a mount's file keeps its mount's path: the mount's root_path was taken off too (``/app.js``)
    assert "/static/app.js" in paths and "/app.js" not in paths


def test_a_request_refused_while_draining_is_logged_and_answered_with_its_request_id_and_security_headers(
        weights, jpeg):
    """The drain gate sits inside the request-id, access-log and security layers (app.py): a 503 of a draining
    replica is a line in the access log, carries the id a client traces it by and the same hardening headers."""
    with access_log(lambda record: record.fields) as entries, make_client(weights) as client:
        client.app.state.shutdown_gate.begin_drain()
        refused = caption(client, jpeg, **{"X-Request-ID": "drain-trace-1"})
    assert refused.status_code == 503 and refused.json()["type"] == "/problems/not-ready"
    assert refused.headers["x-request-id"] == "drain-trace-1"
    assert refused.headers["x-content-type-options"] == "nosniff"
    assert [(entry["path"], entry["status"]) for entry in entries] == [("/caption", 503)]


def _answer_over_http_1_0(port: int, path: str, size: int, headers: str = "", body: bool = True) -> str:
    """The status line a POST of ``size`` bytes gets over HTTP/1.0, as nginx forwards requests: the body sent on
    while the answer may already be on its way, as a proxy sends it, and read after; a reset's error otherwise."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        try:
            s.sendall(f"POST {path} HTTP/1.0\r\nContent-Type: image/jpeg\r\nContent-Length: {size}\r\n"
                      f"{headers}\r\n".encode())
            for _ in range(size // 65536 if body else 0):
                s.sendall(bytes(65536))
            return s.makefile("rb").readline().decode().strip()
        except OSError as exc:
            return type(exc).__name__


def test_an_answer_given_before_the_body_is_read_reaches_a_proxy_speaking_http_1_0(tmp_path_factory):
    """nginx forwards a request over HTTP/1.0, so uvicorn closes the connection after the answer; closed with the
    rest of an unread body in it, the connection was reset, and nginx answered its own 502 instead (about half of
    the 401s without a key, the 413s refused from the Content-Length, the 404s of a path). The body is now read
    and dropped before the answer starts; a client that waits for ``100 Continue`` is answered without it."""
    key = f"Authorization: Bearer {KEYS[0]}\r\n"
    with tiny_demo_server(tmp_path_factory, CAPTIONER_ROOT_PATH="/vision", CAPTIONER_API_KEYS=json.dumps(KEYS),
                          CAPTIONER_MAX_UPLOAD_BYTES=str(2**20)) as server:
        port = int(server.rsplit(":", 1)[1])
        for path, headers, status in (("/caption", "", "401"), ("/caption", key, "413"), ("/nowhere", "", "404"),
                                      ("/models", "", "405")):
            for _ in range(3):
                answer = _answer_over_http_1_0(port, path, 8 << 20, headers)
                assert answer.startswith(f"HTTP/1.1 {status} "), (path, status, answer)
        started = time.monotonic()
        answer = _answer_over_http_1_0(port, "/caption", 8 << 20, "Expect: 100-continue\r\n", body=False)
        assert answer.startswith("HTTP/1.1 401 ") and time.monotonic() - started < 1.5, answer


def test_the_path_within_the_app_is_the_one_its_router_routes(weights):
    """``app_path`` is what the API key check, draining and the access log compare with a route's path, so it must
    name the route the router will run.  A root path spelt with its trailing slash (uvicorn's ``--root-path
    /vision/``, which ``Settings`` would have read as ``/vision``) makes uvicorn's path ``/vision//caption``: the
    router ran ``/caption``, while the key check read ``//caption``, no protected path, and captioned without a
    key.  The prefix itself is the app's ``/``, and a path that only begins with the prefix's letters is not under
    it."""
    for path, root, within in (("/vision/caption", "/vision", "/caption"), ("/vision//caption", "/vision/", "/caption"),
                               ("/vision/caption", "/vision/", "/caption"), ("/vision", "/vision", "/"),
                               ("/vision/", "/vision/", "/"), ("/visionary/caption", "/vision", "/visionary/caption"),
                               ("/caption", "", "/caption")):
        assert app_path({"path": path, "root_path": root}) == within, (path, root)
    # routed into a mount (/static), root_path ends with the mount's path: the app's own prefix is app_root_path
    assert app_path({"path": "/vision/static/app.js", "root_path": "/vision/static",
                     "app_root_path": "/vision"}) == "/static/app.js"
    app = create_app(serving_settings(weights_dir=weights, default_model="tiny", default_beam_size=1,
                                      default_max_len=4, api_keys=KEYS))
    with TestClient(app, root_path="/vision/") as client:  # the root_path uvicorn --root-path /vision/ sets
        refused = client.post("/vision//caption", content=b"x", headers={"content-type": "image/png"})
        assert refused.status_code == 401, refused.text


def test_the_app_records_its_own_prefix_even_inside_an_app_that_recorded_one():
    """An app mounted in another that records its prefix too (a second service under one process) is served under
    the mount's path, not the outer app's: the recorded prefix is this app's wherever the request entered before."""
    seen = []

    async def inner(scope, receive, send):
        seen.append(app_root(scope))

    entered = {"type": "http", "path": "/outer/vision/caption", "root_path": "/outer/vision", ROOT_KEY: "/outer"}
    run_bounded(AppRootMiddleware(inner)(entered, None, None), 5)
    assert seen == ["/outer/vision"]


def test_a_request_whose_server_gave_no_root_path_is_served_at_the_root():
    """The ASGI spec makes ``root_path`` optional, ``""`` when left out: a server that sends none serves the app at
    the root, so the recorded prefix is ``""`` and problem types are ``/problems/...``, not under a made-up one."""
    seen = []

    async def inner(scope, receive, send):
        seen.append((app_root(scope), app_path(scope)))

    run_bounded(AppRootMiddleware(inner)({"type": "http", "path": "/caption"}, None, None), 5)
    assert seen == [("", "/caption")]


def test_an_app_mounted_in_another_checks_keys_under_its_mount_and_names_its_pages_there(weights, jpeg):
    """Mounted in another app (``Mount("/vision", app=create_app(...))``), Starlette's ``app_root_path`` is the
    outer app's, ``""``: the key check read ``/vision/caption`` as an unprotected path and ran the route without a
    key, and problem types lost the prefix. The app records its own prefix as a request enters it."""
    inner = create_app(serving_settings(weights_dir=weights, default_model="tiny", default_beam_size=1,
                                        default_max_len=4, api_keys=KEYS))
    with TestClient(Starlette(routes=[Mount("/vision", app=inner)],
                              lifespan=lambda _: inner.router.lifespan_context(inner))) as client:
        refused = client.post("/vision/caption", files={"file": ("x.jpg", jpeg, "image/jpeg")})
        assert refused.status_code == 401 and refused.json()["type"] == "/vision/problems/unauthorized"
        assert client.get(refused.json()["type"]).status_code == 200
        ok = client.post("/vision/caption", files={"file": ("x.jpg", jpeg, "image/jpeg")},
                         headers={"Authorization": f"Bearer {KEYS[0]}"})
        assert ok.status_code == 200, ok.text
        assert "'/vision/openapi.json'" in client.get("/vision/docs").text
        assert "default-src 'self'" in client.get("/vision/").headers["content-security-policy"]


def test_an_app_mounted_in_another_writes_the_paths_within_it_in_its_access_log(weights):
    """The app's prefix is recorded outside the access log's middleware (app.py: the outermost layer): recorded
    inside it, the log of an app mounted at ``/vision`` read Starlette's outer ``app_root_path`` (``""``) and wrote
    every path with the mount's prefix, unlike the same app served under uvicorn's ``root_path``."""
    inner = create_app(serving_settings(weights_dir=weights, default_model="tiny", default_beam_size=1,
                                        default_max_len=4))
    with access_log(lambda record: record.fields) as entries, TestClient(Starlette(
            routes=[Mount("/vision", app=inner)], lifespan=lambda _: inner.router.lifespan_context(inner))) as client:
        assert client.get("/vision/healthz").status_code == 200
        assert client.get("/vision/static/app.js").status_code == 200
    assert [entry["path"] for entry in entries] == ["/healthz", "/static/app.js"]


def _unread_body(headers: dict[bytes, bytes], chunks: list[bytes], *, status: int = 401, reads: int = 0,
                 limit: int | None = 1 << 20, stalls: bool = False) -> list[bytes]:
    """The chunks of a body that :class:`UnreadBodyMiddleware` (at most ``limit`` bytes; None: its default) had read
    when an app that read ``reads`` of them answered ``status``; a client that ``stalls`` sends no last chunk."""
    messages = [{"type": "http.request", "body": chunk, "more_body": i < len(chunks) - 1}
                for i, chunk in enumerate(chunks)]
    read, read_when_answered = [], []

    async def receive():
        if not messages:
            await asyncio.Event().wait()  # still connected, sending nothing more
        read.append(messages.pop(0)["body"])
        return {"type": "http.request", "body": read[-1], "more_body": stalls or bool(messages)}

    async def app(scope, receive, send):
        for _ in range(reads):
            await receive()
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def send(message):
        if message["type"] == "http.response.start":
            read_when_answered.extend(read)

    scope = {"type": "http", "method": "POST", "path": "/caption", "headers": list(headers.items())}
    middleware = UnreadBodyMiddleware(app) if limit is None else UnreadBodyMiddleware(app, limit)
    run_bounded(middleware(scope, receive, send), 5)
    return read_when_answered


def test_the_unread_rest_of_a_body_is_read_before_the_answer_unless_reading_it_cannot_help():
    """What :class:`UnreadBodyMiddleware` reads before an answer starts (a connection closed with unread data in it
    is reset, and a proxy speaking HTTP/1.0 sees the reset instead of the answer): a chunked body, which declares no
    length, as much as one that does; the rest of a body whose client waited for ``100 Continue`` once the app
    asked for it (the client is sending); but nothing of a body declared larger than the limit (reading a part of
    it cannot avoid the reset) and no more than the limit of one that declares no length, nothing of one whose
    client waits for ``100 Continue`` that never came, nor after a 408; and a client that stops sending gets its
    answer after ``DISCARD_SECONDS`` (2 s), not whenever it sends again."""
    chunks = [b"a" * 1000, b"b" * 1000, b"c"]
    length = {b"content-length": b"2001"}
    assert _unread_body(length, chunks) == chunks
    assert _unread_body({b"transfer-encoding": b"chunked"}, chunks) == chunks
    assert _unread_body({**length, b"expect": b"100-continue"}, chunks, reads=1) == chunks
    assert _unread_body({**length, b"expect": b"100-continue"}, chunks) == []
    assert _unread_body(length, chunks, limit=2000) == []
    assert _unread_body({b"transfer-encoding": b"chunked"}, chunks * 2, limit=2000) == chunks  # read past the limit
    assert _unread_body(length, chunks, status=408, reads=1) == chunks[:1]
    started = time.monotonic()
    assert _unread_body(length, chunks[:2], stalls=True) == chunks[:2]
    assert DISCARD_SECONDS <= time.monotonic() - started < 3


def test_a_body_declared_at_exactly_the_limit_is_read_before_the_answer():
    """``limit`` is what may be read: a body declared at exactly that many bytes can be read to its end (and its
    connection closed without a reset), so it is read; only one declared larger is left alone."""
    chunks = [b"a" * 1000, b"b" * 1000, b"c"]
    length = {b"content-length": b"2001"}
    assert _unread_body(length, chunks, limit=2001) == chunks
    assert _unread_body(length, chunks, limit=2000) == []


def test_the_middleware_reads_a_body_of_up_to_64_mib_by_default():
    """docs/decisions.md promises the rest of a body is read "up to 64 MiB" before an answer: a body declared at
    exactly that is read (its connection then closes without a reset), one byte more is left alone."""
    chunks = [b"a" * 1000, b"b"]
    assert _unread_body({b"content-length": str(64 * 2**20).encode()}, chunks, limit=None) == chunks
    assert _unread_body({b"content-length": str(64 * 2**20 + 1).encode()}, chunks, limit=None) == []


def _answers_after_the_app_reads(messages: list[dict]) -> list[int]:
    """The statuses ``UnreadBodyMiddleware`` lets through when its app reads the body ``messages`` to its last one (a
    message without ``more_body`` is the last, as ASGI defines it) and then answers; asking for more than the whole
    body fails the test."""
    length = sum(len(message["body"]) for message in messages)
    statuses = []

    async def receive():
        assert messages, "asked for more than the whole body"
        return messages.pop(0)

    async def app(scope, receive, send):
        while (await receive()).get("more_body", False):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def send(message):
        if message["type"] == "http.response.start":
            statuses.append(message["status"])

    scope = {"type": "http", "method": "POST", "path": "/caption",
             "headers": [(b"content-length", str(length).encode())]}
    run_bounded(UnreadBodyMiddleware(app)(scope, receive, send), 5)
    assert not messages
    return statuses


def test_a_body_the_app_read_to_its_end_is_not_read_again_before_the_answer():
    """A body the app read to its last chunk has nothing left to drop: asking for more before the answer would wait
    for a message that never comes (the server has none until the answer is sent) for ``DISCARD_SECONDS`` on
    every request that read its body."""
    chunks = [b"a" * 1000, b"b" * 1000, b"c"]
    assert _answers_after_the_app_reads([{"type": "http.request", "body": chunk, "more_body": i < len(chunks) - 1}
                                         for i, chunk in enumerate(chunks)]) == [200]


def test_a_last_body_message_without_more_body_is_taken_for_the_last():
    """The ASGI spec lets a server leave ``more_body`` out of a body's last message (it defaults to False): such a
    body, read by the app, is whole, and asking for more before the answer would hold every answer for
    ``DISCARD_SECONDS`` waiting for a message that never comes."""
    assert _answers_after_the_app_reads([{"type": "http.request", "body": b"a" * 1000, "more_body": True},
                                         {"type": "http.request", "body": b"b"}]) == [200]


def test_a_root_path_is_read_as_the_prefix_it_names():
    for given, read in (("", ""), ("/", ""), ("captioner", "/captioner"), ("/captioner/", "/captioner"),
                        (" /a/b ", "/a/b")):
        assert Settings(root_path=given).root_path == read, given
    for bad in ("/a b", "/a?b", "/a#b", "/a//b", "/a\\b", "/ключ"):
        with pytest.raises(ValueError, match="not a URL path prefix"):
            Settings(root_path=bad)


def test_without_keys_everything_is_open(open_client, jpeg):
    answer = caption(open_client, jpeg)
    assert answer.status_code == 200
    result = answer.json()["id"]
    assert open_client.get(f"/captions/{result}").status_code == 200
    assert open_client.get(f"/captions/{result}/overlay", params={"token": 0}).status_code == 200
    overlay = open_client.post("/caption/overlay", params={"token": 0}, files={"file": ("x.jpg", jpeg, "image/jpeg")})
    assert overlay.status_code == 200 and overlay.headers["content-type"] == "image/png"


def test_key_comparison_is_exact():
    assert key_matches("abc", ["xyz", "abc"]) and not key_matches("abd", ["abc"])
    assert not key_matches("", ["abc"]) and not key_matches("ab", ["abc"]) and not key_matches("abcd", ["abc"])
    assert key_matches("ключ", ["ключ"])


def test_a_valid_key_sent_under_another_scheme_than_bearer_is_refused(keyed, jpeg):
    """Only ``Authorization: Bearer <key>`` carries a key: the same key as Basic credentials, or as the token of some
    other scheme, is refused as an invalid token."""
    for scheme in ("Basic", "Token", "Digest"):
        refused = caption(keyed, jpeg, Authorization=f"{scheme} {KEYS[0]}")
        assert refused.status_code == 401 and "invalid_token" in refused.headers["www-authenticate"], scheme


def test_a_wrong_key_is_told_apart_from_a_missing_one_in_the_challenge_and_the_detail(keyed, jpeg):
    """A client library reads the challenge by RFC 6750 (3.1): ``Bearer error="invalid_token"`` exactly, so it
    knows to stop retrying with that key, where a bare ``Bearer`` asks for one; the person reading the problem is told
    which of the two went wrong (a check for the word ``invalid_token`` anywhere passed a malformed challenge)."""
    wrong = caption(keyed, jpeg, Authorization=f"Bearer {KEYS[0][:-1]}x")
    assert wrong.status_code == 401 and wrong.headers["www-authenticate"] == 'Bearer error="invalid_token"'
    assert wrong.json()["detail"] == "the API key is not valid"
    # a header that names the scheme but no key (an empty variable in a client's configuration) was sent: invalid
    empty = caption(keyed, jpeg, Authorization="Bearer")
    assert empty.status_code == 401 and empty.headers["www-authenticate"] == 'Bearer error="invalid_token"'
    missing = caption(keyed, jpeg)
    assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
    assert missing.json()["detail"] == "this endpoint needs an API key: send `Authorization: Bearer <key>`"


def test_a_key_that_is_not_text_is_refused_401_not_answered_500():
    """A header value may hold any byte (RFC 9110, 5.5: obs-text); a hostile or broken client's key in another encoding
    than ASCII is an invalid key like any other, not an error of the server.  (The test client re-encodes header
    values as UTF-8, so the raw bytes go to the key check's layer directly.)"""
    async def app(scope, receive, send):
        raise AssertionError("a refused key reached the app")

    for value in (b"Bearer \xff\xfe", "Bearer ключ".encode("cp1251")):
        sent = []

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/caption", "headers": [(b"authorization", value)]}
        run_bounded(ApiKeyMiddleware(app, KEYS)(scope, None, send), 5)
        assert sent[0]["status"] == 401
        assert (b"www-authenticate", b'Bearer error="invalid_token"') in sent[0]["headers"]


def test_a_refused_key_is_repeated_neither_in_the_answer_nor_in_the_access_log(keyed, jpeg):
    """A refused key is often a real one a character off, or another service's: the 401 must not echo it back (a
    page or a proxy may show or keep the answer), nor the access log write it, in either format (logs are read by
    more people than hold keys)."""
    near = KEYS[0][:-1] + "x"
    text = TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    with access_log(lambda record: JsonFormatter().format(record) + "\n" + text.format(record)) as lines:
        refused = caption(keyed, jpeg, Authorization=f"Bearer {near}")
    assert refused.status_code == 401 and "invalid_token" in refused.headers["www-authenticate"]
    assert near not in refused.text and all(near not in value for value in refused.headers.values())
    assert len(lines) == 1 and near not in lines[0] and "401" in lines[0]


def test_every_configured_key_is_compared_in_constant_time_even_after_one_matched(monkeypatch):
    """The answer time must not tell whether, or how much of, a key was right: each configured key is compared with
    :func:`hmac.compare_digest`, and a match ends nothing (an early exit, or ``==``, which stops at the first byte
    that differs, passed every test of the result)."""
    compared, compare = [], hmac.compare_digest

    def recording(given, key):
        compared.append((given, key))
        return compare(given, key)

    monkeypatch.setattr(hmac, "compare_digest", recording)
    assert key_matches("abc", ["abc", "xyz", "abd"])
    assert not key_matches("abx", ["abc"])
    assert compared == [(b"abc", b"abc"), (b"abc", b"xyz"), (b"abc", b"abd"), (b"abx", b"abc")]


def test_refusals_and_errors_carry_the_security_headers_too(keyed, open_client):
    """The hardening headers go on every answer, not only the successful ones: a 401 of the key check (which answers
    before the routes, so the headers' layer must wrap it), a 404 and a 405."""
    api_headers = {"x-content-type-options": "nosniff", "referrer-policy": "no-referrer", "x-frame-options": "DENY",
                   "content-security-policy": "default-src 'none'; frame-ancestors 'none'"}
    answers = {401: keyed.post("/caption", content=b"x", headers={"content-type": "image/png"}),
               404: open_client.get("/no/such/path"), 405: open_client.get("/caption"),
               200: open_client.get("/healthz")}
    for status, answer in answers.items():
        assert answer.status_code == status, answer.text
        assert {name: answer.headers.get(name) for name in api_headers} == api_headers, status


def test_cors_is_closed_by_default_and_opens_only_to_configured_origins(open_client, keyed):
    preflight = {"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}
    for client in (open_client, keyed):
        answer = client.options("/caption", headers=preflight)
        assert "access-control-allow-origin" not in answer.headers
        assert "access-control-allow-origin" not in client.get("/healthz", headers={"Origin": "https://evil.example"}).headers
    # the headers a browser script sends: its key, its upload's type, and its own request id (echoed and logged)
    allowed = keyed.options("/caption", headers={**preflight, "Origin": "https://app.example",
                                                 "Access-Control-Request-Headers": "authorization, content-type, "
                                                                                   "x-request-id"})
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == "https://app.example"
    assert {"authorization", "content-type", "x-request-id"} <= \
        {name.strip().lower() for name in allowed.headers["access-control-allow-headers"].split(",")}
    assert allowed.headers["access-control-max-age"] == "600"
    # the API takes GET and POST only: a pre-flight for anything else is refused, from a listed origin too
    assert keyed.options("/caption", headers={**preflight, "Origin": "https://app.example",
                                              "Access-Control-Request-Method": "DELETE"}).status_code == 400
    # a browser script reads only the headers exposed to it: the request id, the result's and the wait's
    exposed = keyed.get("/healthz", headers={"Origin": "https://app.example"}).headers["access-control-expose-headers"]
    assert {"x-request-id", "x-caption-id", "x-heatmap-mode", "retry-after"} <= \
        {name.strip().lower() for name in exposed.split(",")}
    # a pre-flight from an origin not on the list was answered "Disallowed CORS origin" in plain text
    refused = keyed.options("/caption", headers=preflight)
    assert refused.status_code == 400 and refused.headers["content-type"] == "application/problem+json"
    assert refused.json()["type"] == "/problems/cors-refused" and "origin" in refused.json()["detail"]
    assert refused.json()["instance"] == "/caption" and "x-request-id" in refused.headers
    # the length of the problem document alone (the refusal's plain-text answer had a length of its own)
    assert refused.headers.get_list("content-length") == [str(len(refused.content))]


def test_a_browser_script_from_an_allowed_origin_can_read_the_401_of_a_missing_key(keyed):
    """The key check runs inside the CORS layer: its 401 carries ``Access-Control-Allow-Origin`` for a listed origin,
    so the page's script reads the refusal and tells its user to set a key (without the header the browser hands the
    script an opaque network error)."""
    headers = {"content-type": "image/png", "Origin": "https://app.example"}
    refused = keyed.post("/caption", content=b"x", headers=headers)
    assert refused.status_code == 401
    assert refused.headers["access-control-allow-origin"] == "https://app.example"


def test_a_refused_preflight_keeps_the_cors_headers_a_cache_and_a_browser_read():
    """The refused pre-flight, turned into a problem document, keeps Starlette's CORS headers: ``Vary: Origin`` above
    all, so that no cache hands one origin's refusal to another, and the methods the API takes."""
    client = TestClient(create_app(serving_settings(cors_origins=["https://app.example"])))  # no lifespan: no model
    refused = client.options("/caption", headers={"Origin": "https://evil.example",
                                                  "Access-Control-Request-Method": "POST"})
    assert refused.status_code == 400 and refused.headers["content-type"] == "application/problem+json"
    assert "Origin" in [name.strip() for name in refused.headers["vary"].split(",")]
    assert refused.headers["access-control-allow-methods"] == "GET, POST"


def test_only_the_page_and_its_static_folder_get_the_pages_policy_not_a_path_that_merely_starts_alike(open_client):
    """``/static/`` is the page's folder; an unknown ``/static-old`` or ``/staticx`` is an API 404 with the strictest
    policy, not the page's (which allows scripts and images from the origin)."""
    for path in ("/static-old", "/staticx/app.js"):
        answer = open_client.get(path)
        assert answer.status_code == 404, path
        assert answer.headers["content-security-policy"] == "default-src 'none'; frame-ancestors 'none'", path


def test_the_demo_page_has_a_strict_csp_and_no_inline_script(open_client):
    page = open_client.get("/")
    csp = page.headers["content-security-policy"]
    directives = dict(d.strip().split(" ", 1) for d in csp.split(";"))
    assert directives["default-src"] == "'self'" and directives["script-src"] == "'self'"
    assert directives["frame-ancestors"] == "'none'" and "'unsafe-inline'" not in csp
    assert page.headers["x-content-type-options"] == "nosniff" and page.headers["referrer-policy"]
    # the CSP forbids inline code: the page must not need any
    assert not re.search(r"<script(?![^>]*\bsrc=)[^>]*>", page.text), "inline <script> on the demo page"
    assert "<style" not in page.text and " style=" not in page.text and " onclick=" not in page.text
    for path in ("/static/app.js", "/static/style.css"):
        assert open_client.get(path).headers["content-security-policy"] == csp
    assert open_client.get("/healthz").headers["x-content-type-options"] == "nosniff"


def test_the_api_documentation_cannot_be_framed_and_serves_only_its_own_files(open_client):
    # the security audit: /docs had no framing policy, and the whole Swagger UI folder was served, its stock
    # index.html (a page that loads any spec a visitor types in) among it
    docs = open_client.get("/docs")
    assert docs.status_code == 200 and docs.headers["x-frame-options"] == "DENY"
    assert docs.headers["content-security-policy"] == "frame-ancestors 'none'"
    for name in ("swagger-ui-bundle.js", "swagger-ui.css", "favicon-32x32.png"):
        asset = open_client.get(f"/docs/assets/{name}")
        assert asset.status_code == 200 and asset.headers["x-frame-options"] == "DENY" and asset.content
    for name in ("index.html", "oauth2-redirect.html", "index.j2", "..%2F..%2Fsecurity.py"):
        refused = open_client.get(f"/docs/assets/{name}")
        assert refused.status_code == 404 and refused.headers["content-type"] == "application/problem+json"


def test_request_ids_are_echoed_and_logged(open_client, jpeg):
    with access_log(lambda record: json.loads(JsonFormatter().format(record))) as lines:
        answer = open_client.post("/caption", files={"file": ("x.jpg", jpeg, "image/jpeg")},
                                  headers={"X-Request-ID": "trace-abc-123"})
    assert answer.headers["x-request-id"] == "trace-abc-123"
    assert {(line.get("request_id"), line["path"], line["status"]) for line in lines} == {
        ("trace-abc-123", "/caption", 200)}
    generated = open_client.get("/healthz").headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", generated)
    too_long = open_client.get("/healthz", headers={"X-Request-ID": "a" * 65}).headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", too_long)  # a client cannot write lines of any length into the log
    assert open_client.get("/healthz", headers={"X-Request-ID": "a" * 64}).headers["x-request-id"] == "a" * 64
    # nor a space, which would end the id's field in a text log line and start a made-up one
    spaced = open_client.get("/healthz", headers={"X-Request-ID": "trace forged"}).headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", spaced)


def test_result_ids_are_random_and_the_store_is_bounded_in_count_and_age():
    now = [0.0]
    store = ResultStore(max_bytes=10_000, max_count=3, max_age_s=60, clock=lambda: now[0])
    ids = [store.put(object(), b"x" * 10) for _ in range(5)]  # type: ignore[arg-type]
    assert len(set(ids)) == 5 and all(len(i) >= 22 and re.fullmatch(r"[A-Za-z0-9_-]+", i) for i in ids)
    assert len(store) == 3
    with pytest.raises(UnknownResult, match="no caption result"):  # the 404, not any exception
        store.get(ids[0])  # evicted by count
    assert store.get(ids[4])
    now[0] = 61.0
    with pytest.raises(UnknownResult, match="no caption result"):
        store.get(ids[4])  # expired, even though it was just read
    assert len(store) == 0
    store.put(object(), b"y" * 6000)  # type: ignore[arg-type]
    store.put(object(), b"z" * 6000)  # type: ignore[arg-type]
    assert len(store) == 1  # bounded by bytes too


def test_the_result_store_counts_the_bytes_it_gives_back_and_always_keeps_the_newest():
    store = ResultStore(max_bytes=25, max_count=10, max_age_s=60)
    ids = [store.put(object(), b"x" * 10) for _ in range(4)]  # type: ignore[arg-type]
    assert len(store) == 2 and store.get(ids[2]) and store.get(ids[3])  # 20 bytes fit: only the oldest went
    larger = store.put(object(), b"y" * 100)  # type: ignore[arg-type]
    assert store.get(larger).upload == b"y" * 100 and len(store) == 1  # above the bound alone, and still kept


def test_reading_a_result_does_not_extend_its_life_in_the_store():
    """Eviction is by creation order, not by last use: a result read again still goes first when the store is full,
    and expires at its own age behind a younger one (kept as least recently used, a polled result lived for ever)."""
    now = [0.0]
    store = ResultStore(max_bytes=10_000, max_count=2, max_age_s=60, clock=lambda: now[0])
    first = store.put(object(), b"x")  # type: ignore[arg-type]
    now[0] = 30.0
    second = store.put(object(), b"y")  # type: ignore[arg-type]
    assert store.get(first)
    now[0] = 61.0
    with pytest.raises(UnknownResult):
        store.get(first)  # 61 s old, though it was read after the second was made
    assert store.get(second)
    full = ResultStore(max_bytes=10_000, max_count=2, max_age_s=60)
    ids = [full.put(object(), b"x") for _ in range(2)]  # type: ignore[arg-type]
    assert full.get(ids[0])
    ids.append(full.put(object(), b"z"))  # type: ignore[arg-type]
    with pytest.raises(UnknownResult):
        full.get(ids[0])  # the oldest made goes first by count, though it was read last
    assert full.get(ids[1]) and full.get(ids[2])


def test_the_result_store_keeps_uploads_that_fill_its_bytes_exactly():
    """``max_bytes`` is the most kept, not one byte less: the oldest go once the uploads exceed it."""
    store = ResultStore(max_bytes=20, max_count=10, max_age_s=60)
    ids = [store.put(object(), b"x" * 10) for _ in range(2)]  # type: ignore[arg-type]
    assert len(store) == 2 and all(store.get(i) for i in ids)
    store.put(object(), b"y")  # type: ignore[arg-type]
    assert len(store) == 2 and store.get(ids[1])


def test_an_upload_larger_than_the_results_cache_is_still_rendered_and_readable(weights, jpeg):
    """POST /caption/overlay stores the result, then renders it from the store: an upload above
    CAPTIONER_RESULTS_CACHE_BYTES must not be evicted by its own arrival (a 404 for a caption just made)."""
    with make_client(weights, results_cache_bytes=0) as client:
        overlay = client.post("/caption/overlay", params={"token": 0}, files={"file": ("x.jpg", jpeg, "image/jpeg")})
        assert overlay.status_code == 200 and overlay.headers["content-type"] == "image/png"
        assert client.get(f"/captions/{overlay.headers['x-caption-id']}").status_code == 200
        first = caption(client, jpeg).json()["id"]
        assert client.get(f"/captions/{first}/overlay", params={"token": 0}).status_code == 200
        caption(client, jpeg)
        gone = client.get(f"/captions/{first}")  # the bound still holds: the newer upload took its place
        assert gone.status_code == 404 and gone.json()["type"] == "/problems/unknown-result"


def test_no_answer_leaks_a_stack_trace_or_a_server_path(weights, jpeg):
    """An unexpected failure inside a route is a bare 500 problem: no traceback, no file name, no folder."""
    app = create_app(serving_settings(weights_dir=weights, default_model="tiny"))

    @app.get("/boom", include_in_schema=False)
    async def boom():
        raise RuntimeError(f"secret failure in {ROOT}/service/whatever.py")

    with TestClient(app, raise_server_exceptions=False) as client:
        answers = [client.get("/boom"), client.get("/captions/nope"), client.get("/no/such/path"),
                   client.post("/caption", content=b"garbage", headers={"content-type": "image/png"}),
                   client.post("/caption", files={"file": ("x.jpg", jpeg, "image/jpeg")})]
    assert answers[0].status_code == 500
    for answer in answers:
        text = answer.text
        assert "Traceback" not in text and "secret failure" not in text and ".py" not in text, text
        assert str(ROOT) not in text and str(weights) not in text and "/tmp" not in text, text


def test_an_unexpected_error_is_answered_inside_the_apps_layers_with_their_headers_and_its_log_line(weights):
    """Starlette answers the handler of ``Exception`` from its outermost layer, outside the app's middleware: the
    500 went out without the security headers and the request id, and the access log wrote a 499 whose client had
    left."""
    app = create_app(serving_settings(weights_dir=weights, default_model="tiny"))

    @app.get("/boom", include_in_schema=False)
    async def boom():
        raise RuntimeError("a bug")

    with access_log(lambda record: record.fields) as entries, TestClient(app, raise_server_exceptions=False) as client:
        answer = client.get("/boom", headers={"X-Request-ID": "trace-500"})
    assert answer.status_code == 500 and answer.json()["type"] == "/problems/internal"
    assert answer.headers["x-content-type-options"] == "nosniff"
    assert answer.headers["content-security-policy"] == "default-src 'none'; frame-ancestors 'none'"
    assert answer.headers["x-request-id"] == "trace-500"
    assert [(e["path"], e["status"], e["disconnected"]) for e in entries] == [("/boom", 500, False)]


def _run_behind_the_error_layer(handler, sent: list[str]) -> None:
    """Run ``handler`` behind :class:`UnexpectedErrorMiddleware` for one GET, the type of each message it sends
    appended to ``sent``: an error these tests raise must be passed on, so the layer's answer is never called."""

    async def answer(request, exc):
        raise AssertionError(f"the layer answered {exc!r}, an error it must pass on")

    async def send(message):
        sent.append(message["type"])

    layer = UnexpectedErrorMiddleware(handler, answer=answer)
    scope = {"type": "http", "method": "GET", "path": "/", "headers": [], "query_string": b""}
    asyncio.run(layer(scope, None, send))


@pytest.mark.parametrize("sent_before", [["http.response.start"], ["http.response.start", "http.response.body"]],
                         ids=["after-the-start", "after-a-first-chunk"])
def test_an_error_raised_once_the_answer_has_started_is_passed_on_not_answered_twice(sent_before):
    """Once the response's start has gone out nothing more can be answered: a second start (the 500's) is an ASGI
    protocol error, and the server's own handling (closing the connection) needs the original error. A first chunk
    of the body (a streamed answer) does not make the answer unstarted again."""
    async def streams_then_fails(scope, receive, send):
        for kind in sent_before:
            await send({"type": kind, "status": 200, "headers": []} if kind == "http.response.start"
                       else {"type": kind, "body": b"{", "more_body": True})
        raise RuntimeError("a bug mid-stream")

    sent = []
    with pytest.raises(RuntimeError, match="mid-stream"):
        _run_behind_the_error_layer(streams_then_fails, sent)
    assert sent == sent_before


def test_a_handler_cancelled_because_its_client_left_is_passed_on_not_answered_with_a_500():
    """The access log's layer cancels the handler when its client leaves before the answer (middleware.py): that
    cancellation is no bug of the app's. Answered as one, every client that left was logged as an unhandled error
    with a 500 sent to nobody, and the handler ended as if it had answered, so it was not logged as gone (499)."""

    async def cancelled_handler(scope, receive, send):
        raise asyncio.CancelledError

    sent = []
    with pytest.raises(asyncio.CancelledError):
        _run_behind_the_error_layer(cancelled_handler, sent)
    assert sent == []


def test_a_line_break_in_a_url_cannot_forge_a_text_log_line(open_client):
    """With CAPTIONER_LOG_FORMAT=text, the access log wrote the URL-decoded path as it came: ``%0A`` then a made-up
    timestamp and level started a second line that looked like the server's own."""
    with access_log(TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s").format) as lines:
        assert open_client.get("/caption%0A2026-11-30 16:00:00,000 INFO captioner.app: FORGED").status_code in (
            404, 405)
    assert lines and all("\n" not in line for line in lines)
    assert "/caption\\n2026-11-30" in lines[-1]


def test_a_line_break_in_a_logged_message_cannot_forge_a_text_log_line():
    """A message can hold what a request sent (a model's name): the text format escapes it too, and keeps the level
    and logger the line starts with."""
    record = logging.makeLogRecord({"name": "captioner.app", "levelno": logging.WARNING, "levelname": "WARNING",
                                    "msg": "unknown model %s", "args": ("x\n2026-11-30 16:00:00,000 INFO FORGED",)})
    line = TextFormatter("%(levelname)s %(name)s: %(message)s").format(record)
    assert line == "WARNING captioner.app: unknown model x\\n2026-11-30 16:00:00,000 INFO FORGED"


def test_every_control_character_in_a_logged_message_is_escaped_not_only_line_breaks():
    """An escape sequence (``ESC [2J`` clears the terminal of whoever tails the log) and DEL are control characters
    too: the text format writes them escaped, as it writes ``\\n``."""
    record = logging.makeLogRecord({"name": "captioner.app", "levelno": logging.WARNING, "levelname": "WARNING",
                                    "msg": "unknown model %s", "args": ("a\x1b[2Jb\x7fc\td",)})
    line = TextFormatter("%(message)s").format(record)
    assert line == "unknown model a\\x1b[2Jb\\x7fc\\td"


def test_a_json_log_line_of_an_error_carries_its_traceback():
    """``log.exception`` (an unhandled error's 500, a model skipped at start-up) is read from the JSON log: its
    traceback is the line's ``exc``, or the one thing an operator needs to find the cause is not written at all."""
    try:
        raise ValueError("the cause")
    except ValueError:
        record = logging.makeLogRecord({"name": "captioner.app", "levelno": logging.ERROR, "levelname": "ERROR",
                                        "msg": "unhandled error", "exc_info": sys.exc_info()})
    entry = json.loads(JsonFormatter().format(record))
    assert entry["msg"] == "unhandled error" and entry["level"] == "error"
    assert entry["exc"].startswith("Traceback (most recent call last):")
    assert entry["exc"].endswith("ValueError: the cause")


def test_a_json_log_lines_time_writes_its_milliseconds_in_three_digits():
    """5 ms past a second is ``.005``: unpadded it read ``.5``, half a second later than the event."""
    record = logging.makeLogRecord({"name": "captioner.app", "levelno": logging.INFO, "levelname": "INFO",
                                    "msg": "ready", "created": 1_700_000_000.005, "msecs": 5.0})
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.005", json.loads(JsonFormatter().format(record))["ts"])


def test_a_json_log_line_carries_the_request_id_its_record_was_given_before_the_current_one():
    """A line logged for a request outside its context (``extra={"request_id": ...}``, from a thread or task that
    does not carry the context variable) names that request, not the one whose context is current, if any."""
    record = logging.makeLogRecord({"name": "captioner.app", "levelno": logging.INFO, "levelname": "INFO",
                                    "msg": "done", "request_id": "given-id"})
    token = request_id_var.set("current-id")
    try:
        assert json.loads(JsonFormatter().format(record))["request_id"] == "given-id"
    finally:
        request_id_var.reset(token)
    plain = logging.makeLogRecord({"name": "captioner.app", "levelno": logging.INFO, "levelname": "INFO", "msg": "x"})
    assert "request_id" not in json.loads(JsonFormatter().format(plain))


def test_the_access_log_holds_no_result_id(open_client, keyed, jpeg):
    """A result's id is all it takes to read that result and its photo (from any client, with any key): the access
    log wrote it in every line of /captions/{id}, for whoever reads the logs (the security audit), and then still
    in the lines of the requests refused for their API key (a 401 comes before routing: the docs audit)."""
    with access_log(lambda record: record.fields) as entries:
        result = open_client.post("/caption", files={"file": ("x.jpg", jpeg, "image/jpeg")}).json()["id"]
        assert open_client.get(f"/captions/{result}").status_code == 200
        assert open_client.get(f"/captions/{result}/overlay", params={"token": 0}).status_code == 200
        assert keyed.get(f"/captions/{result}").status_code == 401  # no key
        assert keyed.get(f"/captions/{result}/overlay", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert [e["query"] for e in entries] == ["", "", "token=0", "", ""]
    assert [e["path"] for e in entries] == ["/caption", "/captions/{result_id}", "/captions/{result_id}/overlay",
                                            "/captions/{result_id}", "/captions/{result_id}/overlay"]
    assert [e["status"] for e in entries[3:]] == [401, 401]
    assert all(result not in str(e) for e in entries)


def test_the_access_log_writes_any_routed_paths_template_not_only_a_results(open_client):
    """A request a route answered is logged under that route's template wherever it has parameters, not only the
    result routes the ``/captions/`` pattern knows: ``/problems/{kind}`` (a problem type's page, and a 404 for a kind
    that does not exist) is one line shape, whatever kind or text a client put after ``/problems/``, so the lines of
    one route group together and a client's text is not written into the log."""
    with access_log(lambda record: record.fields) as entries:
        assert open_client.get("/problems/invalid-image").status_code == 200
        assert open_client.get("/problems/no-such-kind").status_code == 404
    assert [(e["path"], e["status"]) for e in entries] == [("/problems/{kind}", 200), ("/problems/{kind}", 404)]


def test_a_malformed_setting_is_named_without_its_value(monkeypatch, capsys):
    """pydantic's own error quoted the input: an API key mistyped as a JSON object was printed whole at start-up."""
    monkeypatch.setenv("CAPTIONER_API_KEYS", '{"client": "topsecret-key"}')
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--port", "8791"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "CAPTIONER_API_KEYS: Input should be a valid list" in err
    assert "topsecret" not in err
    # a rule between settings has no variable of its own: it is named as the settings together
    monkeypatch.delenv("CAPTIONER_API_KEYS")
    monkeypatch.setenv("CAPTIONER_MAX_ROWS", "2")
    with pytest.raises(SystemExit):
        main(["serve", "--port", "8791"])
    assert "error: settings: the settings together: Value error, max_rows (2)" in capsys.readouterr().err
    # a bad value inside a JSON setting is named by its variable, not by the key or index that holds it
    monkeypatch.delenv("CAPTIONER_MAX_ROWS")
    monkeypatch.setenv("CAPTIONER_BACKENDS", '{"sat": "tpu"}')
    with pytest.raises(SystemExit):
        main(["serve", "--port", "8791"])
    assert "error: settings: CAPTIONER_BACKENDS: Input should be 'torch'" in capsys.readouterr().err


def test_a_variable_that_is_no_setting_stops_the_server_and_a_plain_value_for_a_list_is_named(monkeypatch, capsys):
    """pydantic-settings ignores a CAPTIONER_* name it does not know: a misspelt CAPTIONER_API_KEY served without
    keys, in silence (the operator audit). And a key given bare where a JSON list is read was "error parsing value
    for field "api_keys" from source "EnvSettingsSource"", naming neither the variable nor what it takes."""
    def refused(*argv: str) -> str:
        with pytest.raises(SystemExit) as exc:
            main(["serve", "--port", "8791", *argv])
        assert exc.value.code == 2
        return capsys.readouterr().err

    monkeypatch.setenv("CAPTIONER_API_KEY", '["topsecret-key"]')
    err = refused()
    assert "unknown variable CAPTIONER_API_KEY (did you mean CAPTIONER_API_KEYS?)" in err and "topsecret" not in err
    monkeypatch.delenv("CAPTIONER_API_KEY")
    monkeypatch.setenv("CAPTIONER_API_KEYS", "topsecret-key")
    err = refused()
    assert "CAPTIONER_API_KEYS must be a JSON list" in err and "topsecret" not in err
    monkeypatch.delenv("CAPTIONER_API_KEYS")
    monkeypatch.setenv("CAPTIONER_BACKENDS", "onnx")
    assert "CAPTIONER_BACKENDS must be a JSON object" in refused()


def test_a_variable_in_lower_case_is_read_or_refused_as_in_upper_case_and_the_debug_switch_is_no_mistake(monkeypatch):
    """pydantic-settings reads the variables whatever their case, so a misspelling in lower case was as silent."""
    monkeypatch.setenv("CAPTIONER_DEBUG", "1")  # the command's own switch (service/cli.py), not a setting
    monkeypatch.setenv("captioner_default_model", "tiny")
    assert read_settings().default_model == "tiny"
    monkeypatch.setenv("captioner_api_key", '["topsecret-key"]')
    with pytest.raises(SystemExit, match="unknown variable captioner_api_key"):
        read_settings()


def test_a_variable_short_of_its_settings_last_word_is_told_the_setting_and_a_name_like_none_is_told_nothing(
        monkeypatch):
    """The suggestion reaches a name that dropped a setting's last word (CAPTIONER_MAX_BEAM for ..._MAX_BEAM_SIZE, as
    alike as most misspellings), not only one letter off; a name like no setting gets none rather than a guess."""
    monkeypatch.setenv("CAPTIONER_MAX_BEAM", "4")
    # one suggestion, the closest: CAPTIONER_MAX_PIXELS and CAPTIONER_MAX_ROWS are near enough to be guessed too
    with pytest.raises(SystemExit, match=r"CAPTIONER_MAX_BEAM \(did you mean CAPTIONER_MAX_BEAM_SIZE\?\): unset it"):
        read_settings()
    monkeypatch.delenv("CAPTIONER_MAX_BEAM")
    monkeypatch.setenv("CAPTIONER_XYZZY", "1")
    with pytest.raises(SystemExit, match=r"unknown variable CAPTIONER_XYZZY: unset it"):
        read_settings()


def test_a_blank_api_key_stops_the_server_rather_than_opening_it(monkeypatch, capsys):
    # '["${KEY}"]' with KEY unset: the empty key was dropped and the service served everyone (the security audit)
    for blank in ('[""]', '["  "]', '["real-key", ""]'):
        monkeypatch.setenv("CAPTIONER_API_KEYS", blank)
        with pytest.raises(SystemExit) as exc:
            main(["serve", "--port", "8791"])
        assert exc.value.code == 2 and "CAPTIONER_API_KEYS: Value error, an API key is empty or blank" in \
            capsys.readouterr().err


def test_the_settings_written_out_never_show_the_api_keys():
    # settings end up in logs and tracebacks (a debugger's locals, an operator's print): the keys stay out of them
    settings = Settings(api_keys=["topsecret-key"])
    assert settings.api_keys == ["topsecret-key"]
    assert "topsecret" not in repr(settings) and "topsecret" not in str(settings)


def test_options_is_never_asked_for_a_key_and_without_origins_no_cors_layer_answers(open_client, keyed):
    # with no origins configured there is no CORS layer: a pre-flight meets the routes, which take no OPTIONS (405),
    # rather than a CORS refusal (400) that would tell a browser the server speaks CORS
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
    answer = open_client.options("/caption", headers=preflight)
    assert answer.status_code == 405 and answer.headers["content-type"] == "application/problem+json"
    # OPTIONS carries no credentials (a browser's pre-flight never does), so the key check lets it through to the
    # routes: a plain OPTIONS to a protected path is the route's 405, not a 401
    plain = keyed.options("/caption")
    assert plain.status_code == 405 and "www-authenticate" not in plain.headers
