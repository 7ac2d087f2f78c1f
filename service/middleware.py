"""ASGI middleware: request ids, structured access logs, and cancelling work whose client has gone.

Pure ASGI (no ``BaseHTTPMiddleware``), so it does not buffer bodies or change how the app reads them.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import re
import time
import uuid
from typing import Any

from .errors import CLIENT_GONE
from .paths import app_path

REQUEST_ID_HEADER = "x-request-id"
request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)
access_log = logging.getLogger("captioner.access")
_SAFE_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")
#: key of the request's arrival time (``time.monotonic()``) in ``request.state``
ARRIVED = "arrived"


class HeadAsGetMiddleware:
    """``HEAD`` of every ``GET`` route: the ``GET`` answer's status and headers, without its body (RFC 9110 §9.3.2;
    §9.1: a general-purpose server MUST support HEAD).  FastAPI's routes answered it 405, so an uptime monitor that
    checks a URL with ``HEAD`` (UptimeRobot's default) found ``/healthz`` down.  The route runs as for ``GET``; the
    access log still says ``HEAD``, since the app sees a copy of the request's scope."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return

        async def send_without_body(message: dict) -> None:
            if message["type"] == "http.response.body":
                if message.get("more_body", False):
                    return
                message = {**message, "body": b""}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, send_without_body)


class RequestContextMiddleware:
    """Gives every request an id (the client's ``X-Request-ID`` when it is sane), echoes it in the response,
    writes one access-log line per request, and cancels the app's handler when the client disconnects before the
    response starts (once a body is read), so the caption or render it waits for is cancelled too (the batcher
    frees its rows at the next step, a render its slot)."""

    def __init__(self, app: Any, log_requests: bool = True):
        self.app = app
        self.log_requests = log_requests

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        given = headers.get(REQUEST_ID_HEADER.encode(), b"").decode("latin-1")
        request_id = given if _SAFE_ID.fullmatch(given) else uuid.uuid4().hex
        token = request_id_var.set(request_id)
        started = time.perf_counter()
        # a request's deadline counts from here (captioning.py): reading its body, or waiting for a busy event loop,
        # is time its client waits too
        scope.setdefault("state", {})[ARRIVED] = time.monotonic()
        response: dict[str, Any] = {"status": None, "bytes": 0}

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                response["status"] = message["status"]
                message = {**message, "headers": [*message.get("headers", []),
                                                  (REQUEST_ID_HEADER.encode(), request_id.encode())]}
            elif message["type"] == "http.response.body":
                response["bytes"] += len(message.get("body", b""))
            await send(message)

        try:
            # a request without a body starts with one empty http.request message: read here, it lets the watcher
            # wait for the disconnect from the start (a GET render whose client had left kept its render slot, and
            # a burst of them made every overlay wait past its deadline)
            prefetched = await receive() if _announces_no_body(scope, headers) else None
            await self._call_watching_disconnect(scope, receive, send_with_id, response, prefetched)
        finally:
            if self.log_requests:
                status = response["status"] or CLIENT_GONE
                access_log.info("request", extra={"fields": {
                    "method": scope["method"], "path": _logged_path(scope),
                    "query": scope.get("query_string", b"").decode("latin-1"), "status": status,
                    "duration_ms": round((time.perf_counter() - started) * 1000, 2), "bytes_out": response["bytes"],
                    "client": f"{scope['client'][0]}:{scope['client'][1]}" if scope.get("client") else None,
                    "disconnected": response["status"] is None}})
            request_id_var.reset(token)

    async def _call_watching_disconnect(self, scope: dict, receive: Any, send: Any, response: dict,
                                        prefetched: dict | None = None) -> None:
        """Run the handler, cancelled when its client disconnects before the answer starts; the watcher listens
        once the body is read (``prefetched``: the first message, already read from ``receive``)."""
        client = _ClientMessages(receive, prefetched)
        handler = asyncio.create_task(self.app(scope, client.receive, send))
        watcher = asyncio.create_task(_cancel_on_disconnect(receive, client, handler, response))
        try:
            await asyncio.shield(handler)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                # the server itself is cancelling us (its shutdown timeout): pass it on, and let the handler end,
                # so that what it answers on its way out (the drain's 503, lifecycle.py) reaches the client
                # before uvicorn would answer a plain-text 500 for a request without a response
                handler.cancel()
                await asyncio.gather(handler, return_exceptions=True)
                if response["status"] is None:
                    raise
                return
            if not client.gone.is_set():
                raise
            # the client went away: nothing can be sent, and the handler's work has been cancelled
        finally:
            watcher.cancel()


class _ClientMessages:
    """The request's messages as the app receives them (:meth:`receive`), noting when the body has been read
    (``body_read``) and when the client has disconnected (``gone``)."""

    def __init__(self, receive: Any, prefetched: dict | None):
        """``prefetched``: the first message, already read from the server's ``receive`` (None: none was)."""
        self._server_receive = receive
        self._prefetched = prefetched
        self.body_read = asyncio.Event()
        self.gone = asyncio.Event()
        if prefetched is not None and not prefetched.get("more_body", False):
            self.body_read.set()

    async def receive(self) -> dict:
        """The next message for the app: the prefetched one, a part of the body, then only the disconnect."""
        if self._prefetched is not None:
            message, self._prefetched = self._prefetched, None
            if message["type"] == "http.disconnect":
                self.gone.set()
            return message
        if self.body_read.is_set():
            # the body is consumed: the only message left is the disconnect the watcher is waiting for
            await self.gone.wait()
            return {"type": "http.disconnect"}
        message = await self._server_receive()
        if message["type"] == "http.disconnect":
            self.gone.set()
        elif not message.get("more_body", False):
            self.body_read.set()
        return message


async def _cancel_on_disconnect(receive: Any, client: _ClientMessages, handler: asyncio.Task,
                                response: dict) -> None:
    """The watcher: once the app has read the body, read the server's ``receive`` until the client disconnects,
    then cancel ``handler`` unless its answer has started (``response["status"]``) or it has ended."""
    await client.body_read.wait()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            client.gone.set()
            if response["status"] is None and not handler.done():
                handler.cancel()
            return


def _announces_no_body(scope: dict, headers: dict[bytes, bytes]) -> bool:
    """A GET (HEAD, DELETE, …) without a length or a chunked body: its one http.request message is empty and
    there at once.  One that announces a body is left to the app, which may never read it (waiting for it here
    held the request without a deadline)."""
    if scope["method"] in ("POST", "PUT", "PATCH") or b"transfer-encoding" in headers:
        return False
    return headers.get(b"content-length", b"0").strip() in (b"", b"0")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, request id and any ``extra={"fields": {...}}``."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {"ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
                                 "level": record.levelname.lower(), "logger": record.name,
                                 "msg": record.getMessage()}
        request_id = getattr(record, "request_id", None) or request_id_var.get()
        if request_id:
            entry["request_id"] = request_id
        entry.update(getattr(record, "fields", {}) or {})
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


#: control characters (a line break above all) in what a request put into a log line
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def one_line(text: object) -> str:
    """``text`` with its control characters escaped (``\\n``, ``\\x1b``, …): a URL path or a model name holding a
    line break must not start a forged log line of its own."""
    return _CONTROL.sub(lambda match: repr(match.group())[1:-1], str(text))


#: the result routes' paths (``/captions/{result_id}...``, service/overlay.py) up to their id
_RESULT_ID_IN_PATH = re.compile(r"^/captions/[^/]+")


def _logged_path(scope: dict) -> str:
    """The path as the access log writes it: a route's template where it has parameters
    (``/captions/{result_id}``), since a result's id is all it takes to read that result and its photo, and logs
    are read by more people than the clients who hold the ids. A request answered before routing, or by no route
    (a missing or wrong API key: 401; an unknown path below a result's), has no route in its scope: its result id,
    the segment after ``/captions/``, is written as the template writes it."""
    route = scope.get("route")
    template = getattr(route, "path", None)
    if template and "{" in template:
        return template
    path = app_path(scope)
    return _RESULT_ID_IN_PATH.sub("/captions/{result_id}", path) if route is None else path


class TextFormatter(logging.Formatter):
    """``time level logger: message request_id=… key=value …`` on one line (a traceback follows on its own lines)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return one_line(super().formatMessage(record))

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        request_id = request_id_var.get()
        fields = getattr(record, "fields", None)
        extra = " ".join(f"{k}={one_line(v)}" for k, v in (fields or {}).items())
        return " ".join(part for part in (line, f"request_id={request_id}" if request_id else "", extra) if part)


#: the loggers the service writes: its own, and uvicorn's (start-up, shutdown, a malformed HTTP request), which
#: wrote plain-text lines into the JSON stream before
SERVICE_LOGGERS = ("captioner", "uvicorn")


def configure_logging(fmt: str = "json", level: str = "info") -> None:
    """Route the ``captioner.*`` and ``uvicorn.*`` loggers to stderr in the chosen format (idempotent; uvicorn is
    then started with ``log_config=None``, so that it keeps these handlers)."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else
                         TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in SERVICE_LOGGERS:
        logger = logging.getLogger(name)
        logger.handlers = [handler]
        logger.setLevel(level.upper())
        logger.propagate = False
