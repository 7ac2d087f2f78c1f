"""The request middleware cancels a handler whose client has gone, for requests with and without a body: a GET
render (``/captions/{id}/overlay``) whose client had left kept its render slot, and a burst of them made every
overlay wait past its deadline (the concurrency audit)."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest

from captioner.service import middleware
from captioner.service.middleware import RequestContextMiddleware


def _scope(method: str) -> dict:
    return {"type": "http", "method": method, "path": "/slow", "query_string": b"", "headers": [],
            "client": ("127.0.0.1", 5000)}


class _Client:
    """An ASGI client: its one request message, then (once ``leave`` is set) the disconnect; what it was sent.
    ``says_last``: the message says ``more_body: False``; the ASGI spec lets a server leave it out (default False)."""

    def __init__(self, body: bytes = b"", says_last: bool = True):
        self.first = {"type": "http.request", "body": body, **({"more_body": False} if says_last else {})}
        self.leave = asyncio.Event()
        self.sent: list[dict] = []

    async def receive(self) -> dict:
        if self.first is not None:
            message, self.first = self.first, None
            return message
        await self.leave.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        self.sent.append(message)


def _access_log_fields(caplog) -> list[dict]:
    return [record.fields for record in caplog.records if record.name == "captioner.access"]


@pytest.mark.parametrize("says_last", [True, False])
@pytest.mark.parametrize("method", ["GET", "POST"])
def test_a_handler_is_cancelled_when_its_client_leaves(method, says_last, caplog):
    async def scenario() -> tuple[bool, list]:
        cancelled, started = asyncio.Event(), asyncio.Event()
        client = _Client(b"x" if method == "POST" else b"", says_last)

        async def slow_app(scope, receive, send):
            if method == "POST":
                await receive()  # the body
            started.set()
            try:
                await asyncio.sleep(30)  # a render waiting for its slot
            except asyncio.CancelledError:
                cancelled.set()
                raise
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"done"})

        call = asyncio.create_task(RequestContextMiddleware(slow_app)(_scope(method), client.receive, client.send))
        await asyncio.wait_for(started.wait(), 5)
        client.leave.set()
        await asyncio.wait_for(call, 5)
        return cancelled.is_set(), client.sent

    with caplog.at_level(logging.INFO, logger="captioner.access"):
        cancelled, sent = asyncio.run(scenario())
    assert cancelled and sent == []
    # never answered: logged as nginx's 499, marked as a disconnect
    assert [(f["status"], f["disconnected"], f["bytes_out"]) for f in _access_log_fields(caplog)] == [(499, True, 0)]


def test_a_handler_whose_answer_has_started_is_not_cancelled_when_its_client_leaves():
    """Once the answer has started the handler runs to its end (it is told of the disconnect if it asks): only work
    nobody has been answered for yet is cancelled."""
    async def scenario() -> list:
        started = asyncio.Event()
        client = _Client()

        async def streaming_app(scope, receive, send):
            await send({"type": "http.response.start", "status": 200, "headers": []})
            started.set()
            await receive()  # the (empty) body, then the disconnect, as a streaming response listens for it
            await receive()
            await send({"type": "http.response.body", "body": b"end"})

        call = asyncio.create_task(RequestContextMiddleware(streaming_app, log_requests=False)(
            _scope("GET"), client.receive, client.send))
        await asyncio.wait_for(started.wait(), 5)
        client.leave.set()
        await asyncio.wait_for(call, 5)
        return client.sent

    sent = asyncio.run(scenario())
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"] and sent[1]["body"] == b"end"


@pytest.mark.parametrize("cancelled_by", ["the handler's own work", "the server's shutdown"])
def test_a_cancellation_the_client_did_not_cause_is_passed_on_when_nothing_was_answered(cancelled_by):
    """Only a client's leaving ends a request quietly. A handler cancelled by anything else (its own work cancelled,
    or the server cancelling the request at its shutdown timeout) that has answered nothing passes the cancellation
    on to the server: swallowed, the request is logged as a disconnect that never happened and the server, seeing no
    answer, sends the client a plain-text 500."""
    async def scenario() -> tuple[bool, list]:
        started = asyncio.Event()
        client = _Client()

        async def app(scope, receive, send):
            started.set()
            if cancelled_by == "the handler's own work":
                raise asyncio.CancelledError
            await asyncio.sleep(30)  # cancelled below; it ends without answering

        call = asyncio.create_task(RequestContextMiddleware(app, log_requests=False)(
            _scope("GET"), client.receive, client.send))
        await asyncio.wait_for(started.wait(), 5)
        if cancelled_by == "the server's shutdown":
            call.cancel()
        await asyncio.wait([call], timeout=5)
        return call.cancelled(), client.sent

    passed_on, sent = asyncio.run(scenario())
    assert passed_on and sent == []


def test_a_get_that_stays_is_answered_and_may_read_its_empty_body(caplog):
    async def scenario() -> list:
        client = _Client()

        async def app(scope, receive, send):
            message = await receive()  # Starlette's Request.body() on a GET
            assert message == {"type": "http.request", "body": b"", "more_body": False}
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})

        await asyncio.wait_for(RequestContextMiddleware(app)(_scope("GET"), client.receive, client.send), 5)
        return client.sent

    with caplog.at_level(logging.INFO, logger="captioner.access"):
        sent = asyncio.run(scenario())
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"] and sent[1]["body"] == b"ok"
    assert [(f["status"], f["disconnected"], f["bytes_out"]) for f in _access_log_fields(caplog)] == [(200, False, 2)]


@pytest.mark.parametrize("method,announced", [("GET", [(b"content-length", b"5")]),
                                              ("POST", [(b"content-length", b"5")]),
                                              ("GET", [(b"transfer-encoding", b"chunked")]), ("PATCH", []),
                                              ("PUT", [])])
def test_a_request_announcing_a_body_that_never_comes_is_still_answered(method, announced):
    """Pre-reading the first message of a GET that announces a body waited for it without a deadline (review):
    ``GET /healthz`` with ``Content-Length: 5`` and no body went unanswered; so would any request with a body, left
    to an app that may answer without reading it (over HTTP/2 a body needs no length: a PATCH or a PUT may have one,
    and a PUT, which no route takes, must still get its 405)."""
    async def scenario() -> list:
        sent: list[dict] = []

        async def never_sends_the_body():
            await asyncio.Event().wait()

        async def send(message):
            sent.append(message)

        async def app(scope, receive, send):
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})

        scope = {**_scope(method), "headers": announced}
        await asyncio.wait_for(RequestContextMiddleware(app, log_requests=False)(scope, never_sends_the_body, send), 5)
        return sent

    assert [m.get("status") for m in asyncio.run(scenario())] == [200, None]


def test_an_access_log_line_holds_the_whole_answers_bytes_its_query_client_and_milliseconds(caplog, monkeypatch):
    """The access line of a streamed answer: its bytes are every chunk's, not the last one's; the query as sent; the
    client as ``host:port``; the duration in milliseconds (a clock read at the start and the end, here 0.25 s
    apart)."""
    clock = iter([10.0, 10.25])
    monkeypatch.setattr(middleware, "time", SimpleNamespace(perf_counter=lambda: next(clock), monotonic=lambda: 0.0))

    async def scenario() -> None:
        client = _Client()

        async def streaming(scope, receive, send):
            await send({"type": "http.response.start", "status": 200, "headers": []})
            for chunk in (b"ab", b"cde"):
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"f"})

        scope = {**_scope("GET"), "query_string": b"token=0&alpha=0.5"}
        await asyncio.wait_for(RequestContextMiddleware(streaming)(scope, client.receive, client.send), 5)

    with caplog.at_level(logging.INFO, logger="captioner.access"):
        asyncio.run(scenario())
    assert _access_log_fields(caplog) == [{
        "method": "GET", "path": "/slow", "query": "token=0&alpha=0.5", "status": 200, "duration_ms": 250.0,
        "bytes_out": 6, "client": "127.0.0.1:5000", "disconnected": False}]


def test_an_answer_cut_off_after_it_started_is_logged_with_its_status_not_as_a_disconnect(caplog):
    """``disconnected`` marks the requests never answered (the 499s): one whose answer started and then stopped
    before its last chunk was answered, and its line keeps its status and the bytes that went out."""
    async def scenario() -> None:
        client = _Client()

        async def cut_off(scope, receive, send):
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"abc", "more_body": True})

        await asyncio.wait_for(RequestContextMiddleware(cut_off)(_scope("GET"), client.receive, client.send), 5)

    with caplog.at_level(logging.INFO, logger="captioner.access"):
        asyncio.run(scenario())
    assert [(f["status"], f["disconnected"], f["bytes_out"]) for f in _access_log_fields(caplog)] == [(200, False, 3)]


@pytest.mark.parametrize("given, kept", [("trace-7", True), ("trace-7\n", False), ("a" * 64, True)])
def test_a_request_id_is_kept_only_when_the_whole_value_is_safe(given, kept):
    """``$`` also matches before a final newline: the id pattern must hold the whole value, or ``trace-7\\n`` would
    reach a text log line and end it there.  (Uvicorn refuses such a header; an ASGI server need not.)"""
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    client = _Client()
    scope = {**_scope("GET"), "headers": [(b"x-request-id", given.encode())]}
    asyncio.run(asyncio.wait_for(RequestContextMiddleware(app, log_requests=False)(scope, client.receive, client.send),
                                 5))
    echoed = dict(client.sent[0]["headers"])[b"x-request-id"].decode()
    assert (echoed == given) is kept and (kept or len(echoed) == 32)


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_no_task_of_a_request_outlives_its_answer(method):
    """The disconnect watcher ends with its request: a POST refused before its body is read (a 429 at the door, a
    503 while not ready) never lets the watcher start listening, and a watcher left waiting for that body would be
    a task per refused request, kept until the server stops (or destroyed while pending, with a log line each)."""
    async def scenario() -> set:
        client = _Client(body=b"unread")

        async def refuses_unread(scope, receive, send):
            await send({"type": "http.response.start", "status": 429, "headers": []})
            await send({"type": "http.response.body", "body": b""})

        middleware_call = RequestContextMiddleware(refuses_unread, log_requests=False)
        await asyncio.wait_for(middleware_call(_scope(method), client.receive, client.send), 5)
        await asyncio.sleep(0)  # a cancelled task ends at its next turn
        return {task for task in asyncio.all_tasks() if task is not asyncio.current_task()}

    assert asyncio.run(scenario()) == set()
