"""RFC 9457 problem details: every error leaves the service as ``application/problem+json``.

Routes and use cases raise typed failures and never build problems themselves: :func:`problem_of` turns one into
its problem (status and type from :data:`~captioner.service.errors.PROBLEM_TYPES`, ``Retry-After`` and per-field
``errors`` from the exception), and :func:`install_problem_handlers` answers every error that way.
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .errors import PROBLEM_TYPES, problem_type

PROBLEM_JSON = "application/problem+json"


class Problem(Exception):
    """Raise anywhere in a route to answer with a problem document."""

    def __init__(self, status: int, detail: str, *, title: str | None = None, kind: str | None = None,
                 headers: dict[str, str] | None = None, **extra: Any):
        super().__init__(detail)
        self.status, self.detail = status, detail
        self.title = title or HTTPStatus(status).phrase
        self.kind = kind or HTTPStatus(status).phrase.lower().replace(" ", "-")
        self.headers = headers or {}
        self.extra = extra


def problem_of(exc: Exception) -> Problem:
    """The problem a typed failure answers with (see :data:`PROBLEM_TYPES`)."""
    status, kind = problem_type(exc)
    retry_after = getattr(exc, "retry_after_s", None)
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    errors = getattr(exc, "errors", None)
    return Problem(status, str(exc), title=getattr(exc, "title", None), kind=kind, headers=headers,
                   **({"errors": errors} if errors else {}))


def problem_response(request: Request, status: int, detail: str, title: str | None = None, kind: str | None = None,
                     headers: dict[str, str] | None = None, **extra: Any) -> JSONResponse:
    body = {"type": f"/problems/{kind or HTTPStatus(status).phrase.lower().replace(' ', '-')}",
            "title": title or HTTPStatus(status).phrase, "status": status, "detail": detail,
            "instance": request.url.path, **extra}
    return JSONResponse(body, status_code=status, media_type=PROBLEM_JSON, headers=headers)


def install_problem_handlers(app: FastAPI, on_problem: Callable[[Request, int, str], None] | None = None) -> None:
    """Answer every error as a problem document; ``on_problem(request, status, kind)`` sees each one (metrics)."""

    def answer(request: Request, status: int, detail: str, title: str | None = None, kind: str | None = None,
               headers: dict[str, str] | None = None, **extra: Any) -> JSONResponse:
        if on_problem is not None:
            on_problem(request, status, kind or HTTPStatus(status).phrase.lower().replace(" ", "-"))
        return problem_response(request, status, detail, title, kind, headers, **extra)

    @app.exception_handler(Problem)
    async def _problem(request: Request, exc: Problem) -> JSONResponse:
        return answer(request, exc.status, exc.detail, exc.title, exc.kind, exc.headers, **exc.extra)

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
        return answer(request, 422, detail, kind="invalid-request", errors=errors)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return answer(request, exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logging.getLogger("captioner.app").error("unhandled error", exc_info=exc)
        return answer(request, 500, "internal error; the request was not processed", kind="internal")
