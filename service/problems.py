"""RFC 9457 problem details: every error leaves the service as ``application/problem+json``.

Routes and use cases raise typed failures and never build problems themselves: :func:`problem_of` turns one into
its problem (status and type from :data:`~captioner.service.errors.PROBLEM_TYPES`, ``Retry-After`` and per-field
``errors`` from the exception), and :func:`install_problem_handlers` answers every error that way.  The middlewares
that answer before a route runs (API keys, the shutdown drain) send theirs with :func:`send_problem`; every body is
made by :func:`problem_body`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Awaitable, Callable, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .errors import PROBLEM_TYPES, problem_type
from .paths import app_root_uri, uri_path

PROBLEM_JSON = "application/problem+json"


def default_kind(status: int) -> str:
    """The problem type of a status no failure names: its reason phrase (``/problems/method-not-allowed``)."""
    return HTTPStatus(status).phrase.lower().replace(" ", "-")


def problem_body(scope: dict[str, Any], status: int, detail: str, title: str | None = None, kind: str | None = None,
                 **extra: Any) -> dict[str, Any]:
    """The RFC 9457 document of an answer to the request ``scope``: ``type``, ``title``, ``status``, ``detail``,
    ``instance`` (the request's path).  The ``type`` is the path of the problem type's page on this server
    (``problem_pages.py``), behind a proxy's prefix too: ``/captioner/problems/not-ready`` under ``/captioner``.
    Both are URI references, so the path, and the prefix in the type, are percent-encoded again (``scope["path"]``
    and ``root_path`` are decoded)."""
    return {"type": f"{app_root_uri(scope)}/problems/{kind or default_kind(status)}",
            "title": title or HTTPStatus(status).phrase, "status": status, "detail": detail,
            "instance": uri_path(scope["path"]), **extra}


@dataclass
class Problem:
    """What a failure is answered with (:func:`problem_of`)."""

    status: int
    detail: str
    title: str | None = None
    kind: str | None = None
    headers: dict[str, str] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def problem_of(exc: Exception) -> Problem:
    """The problem a typed failure answers with (see :data:`PROBLEM_TYPES`)."""
    status, kind = problem_type(exc)
    retry_after = getattr(exc, "retry_after_s", None)
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    errors = getattr(exc, "errors", None)
    return Problem(status, str(exc), getattr(exc, "title", None), kind, headers, {"errors": errors} if errors else {})


def problem_response(request: Request, status: int, detail: str, title: str | None = None, kind: str | None = None,
                     headers: dict[str, str] | None = None, **extra: Any) -> JSONResponse:
    return JSONResponse(problem_body(request.scope, status, detail, title, kind, **extra), status_code=status,
                        media_type=PROBLEM_JSON, headers=headers)


async def send_problem(scope: dict, send: Callable[[dict], Awaitable[None]], status: int, detail: str, *,
                       kind: str | None = None, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    """Answer with a problem document from an ASGI middleware, before (or instead of) the app."""
    body = json.dumps(problem_body(scope, status, detail, kind=kind)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", PROBLEM_JSON.encode()), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


class StartNotingSend:
    """An ASGI ``send`` that notes whether the response has started: once it has, a middleware can answer nothing
    more (a second start is a protocol error) and must pass an error on instead."""

    def __init__(self, send: Callable[[dict], Awaitable[None]]):
        self.send, self.started = send, False

    async def __call__(self, message: dict) -> None:
        self.started = self.started or message["type"] == "http.response.start"
        await self.send(message)


def with_head(allow: str) -> str:
    """A 405's ``Allow`` with ``HEAD`` wherever it has ``GET``: every GET route answers HEAD too
    (middleware.HeadAsGetMiddleware), and ``Allow`` lists the methods a resource supports (RFC 9110 §10.2.1)."""
    methods = [m.strip() for m in allow.split(",") if m.strip()]
    return ", ".join(methods + ["HEAD"] if "GET" in methods and "HEAD" not in methods else methods)


def install_problem_handlers(app: FastAPI, on_problem: Callable[[Request, int, str], None] | None = None,
                             on_invalid: Callable[[Request], None] | None = None) -> None:
    """Answer every error as a problem document; ``on_problem(request, status, kind)`` sees each one (metrics), and
    ``on_invalid(request)`` each request refused by FastAPI's own validation, before its endpoint ran.  Call it
    before adding the app's middleware: an unexpected error is answered inside them all."""

    def answer(request: Request, status: int, detail: str, title: str | None = None, kind: str | None = None,
               headers: dict[str, str] | None = None, **extra: Any) -> JSONResponse:
        if on_problem is not None:
            on_problem(request, status, kind or default_kind(status))
        return problem_response(request, status, detail, title, kind, headers, **extra)

    async def _typed(request: Request, exc: Exception) -> JSONResponse:
        problem = problem_of(exc)
        return answer(request, problem.status, problem.detail, problem.title, problem.kind, problem.headers,
                      **problem.extra)

    for failure in PROBLEM_TYPES:
        app.add_exception_handler(failure, _typed)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [{"loc": list(e.get("loc", ())), "msg": e.get("msg", "")} for e in exc.errors()]
        detail = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in errors)
        if on_invalid is not None:
            on_invalid(request)
        return answer(request, 422, detail, kind="invalid-request", errors=errors)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        headers = dict(getattr(exc, "headers", None) or {})
        if exc.status_code == 405 and "Allow" in headers:
            headers["Allow"] = with_head(headers["Allow"])
        return answer(request, exc.status_code, str(exc.detail), headers=headers or None)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logging.getLogger("captioner.app").error("unhandled error", exc_info=exc)
        return answer(request, 500, "internal error; the request was not processed", kind="internal")

    # Starlette answers the handler of Exception from its outermost layer, outside every middleware of the app: the
    # 500 went out without the security headers and the request id, and the access log wrote it as a client that
    # left (499). Answered from inside them, it is an answer like any other; the handler above still answers an
    # error raised outside this layer
    app.add_middleware(UnexpectedErrorMiddleware, answer=_unexpected)


class UnexpectedErrorMiddleware:
    """Answers an error no handler took (``answer``: the 500 problem) where it is raised, inside the app's other
    middleware; an error raised once the answer has started is passed on, since nothing more can be answered."""

    def __init__(self, app: Any, answer: Callable[[Request, Exception], Awaitable[JSONResponse]]):
        self.app, self.answer = app, answer

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        noted = StartNotingSend(send)
        try:
            await self.app(scope, receive, noted)
        except Exception as exc:
            if noted.started:
                raise
            await (await self.answer(Request(scope), exc))(scope, receive, send)
