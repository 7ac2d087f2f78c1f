"""Access control and browser hardening, as three small pure-ASGI layers installed by :func:`install_security`.

* **API keys** (optional): with ``CAPTIONER_API_KEYS`` set (a JSON list; several keys so they can be rotated one
  at a time), the captioning and result endpoints (``/caption``, ``/caption/overlay``, ``/captions/…``) need
  ``Authorization: Bearer <key>``.  Keys are compared with :func:`hmac.compare_digest` against every configured
  key (no early exit), so the answer time does not reveal how much of a key was right.  Health, readiness,
  metrics, the model list, the demo page and its static files stay open: probes and dashboards must not need a
  secret.  A refusal is a 401 RFC 9457 problem with ``WWW-Authenticate: Bearer``.
* **CORS**: closed by default (no ``Access-Control-Allow-Origin`` for anyone); ``CAPTIONER_CORS_ORIGINS`` lists
  the origins that may call the API from a browser.
* **Security headers** on every response: ``X-Content-Type-Options: nosniff``, ``Referrer-Policy: no-referrer``;
  the demo page and its files get a Content-Security-Policy that allows only the app's own origin (the page has
  no inline script or style, so none is allowed) plus ``blob:`` images (the page shows the chosen file and the
  overlays through object URLs), and may not be framed (``frame-ancestors 'none'``); API answers get the
  strictest policy (``default-src 'none'``).  The interactive ``/docs`` page (Swagger UI, served by the app) starts
  it with an inline script, so its policy only forbids framing (``frame-ancestors 'none'``, ``X-Frame-Options``).
"""

from __future__ import annotations

import hmac
from typing import Any, Iterable

from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response

from .paths import app_path
from .problems import send_problem

#: path prefixes that need a key when keys are configured (everything that runs a model or returns a result)
PROTECTED_PREFIXES = ("/caption",)  # /caption, /caption/overlay and /captions/{id}[/overlay]
PAGE_CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' blob: data:; "
            "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
API_CSP = "default-src 'none'; frame-ancestors 'none'"
#: Swagger UI's page is started by an inline script: it may not be framed (clickjacking), nothing more
DOCS_CSP = "frame-ancestors 'none'"
DOCS_PATHS = ("/docs",)  # the page and its Swagger UI files (/docs/assets/…)


def _is_protected(path: str) -> bool:
    return path.startswith(PROTECTED_PREFIXES)


def key_matches(given: str, keys: Iterable[str]) -> bool:
    """Constant-time check of ``given`` against every key (each comparison runs; none returns early)."""
    given_bytes = given.encode("utf-8", "surrogateescape")
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(given_bytes, key.encode("utf-8", "surrogateescape"))
    return matched


class ApiKeyMiddleware:
    """Refuse requests to protected paths without a valid ``Authorization: Bearer`` key (401 problem)."""

    def __init__(self, app: Any, keys: list[str]):
        self.app = app
        self.keys = list(keys)  # Settings refuses a blank key: one dropped here opened the service

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not self.keys or scope.get("method") == "OPTIONS" \
                or not _is_protected(app_path(scope)):
            await self.app(scope, receive, send)
            return
        header = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = header.partition(" ")
        if scheme.lower() == "bearer" and token.strip() and key_matches(token.strip(), self.keys):
            await self.app(scope, receive, send)
            return
        if header:
            detail, challenge = "the API key is not valid", 'Bearer error="invalid_token"'
        else:
            detail, challenge = "this endpoint needs an API key: send `Authorization: Bearer <key>`", "Bearer"
        await send_problem(scope, send, 401, detail, headers=[(b"www-authenticate", challenge.encode())])


class SecurityHeadersMiddleware:
    """Add the hardening headers of the module docstring to every response that does not set them itself."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = app_path(scope)
        if path.startswith(DOCS_PATHS):
            csp = DOCS_CSP
        elif path == "/" or path.startswith("/static/"):
            csp = PAGE_CSP
        else:
            csp = API_CSP

        async def send_with_headers(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                present = {name.lower() for name, _ in headers}
                wanted = [(b"x-content-type-options", b"nosniff"), (b"referrer-policy", b"no-referrer"),
                          (b"content-security-policy", csp.encode()), (b"x-frame-options", b"DENY")]
                headers += [(name, value) for name, value in wanted if name not in present]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)


class _RefusedPreflight(Response):
    """A refused CORS pre-flight as an RFC 9457 problem, rendered when it is sent (where the request's path, its
    ``instance``, is known), with the CORS headers Starlette gave its plain-text answer."""

    def __init__(self, detail: str, headers: list[tuple[bytes, bytes]]):
        super().__init__(status_code=400)
        self.detail, self.cors_headers = detail, headers

    async def __call__(self, scope, receive, send) -> None:
        await send_problem(scope, send, 400, self.detail, kind="cors-refused", headers=self.cors_headers)


class ProblemCORSMiddleware(CORSMiddleware):
    """Starlette's CORS middleware, whose refused pre-flight (an origin, method or header not allowed) is a problem
    document like every other refusal rather than the text "Disallowed CORS origin"."""

    def preflight_response(self, request_headers):
        response = super().preflight_response(request_headers)
        if response.status_code != 400:
            return response
        kept = [(name, value) for name, value in response.raw_headers
                if name not in (b"content-type", b"content-length")]
        return _RefusedPreflight(bytes(response.body).decode(), kept)


def install_security(app: Any, api_keys: list[str], cors_origins: list[str]) -> None:
    """Wire the layers into a FastAPI app.  Call it *before* adding the request-id middleware: Starlette runs the
    last added first, so the request-id middleware wraps these (401s carry a request id and are access-logged),
    and CORS answers pre-flights before the key check."""
    app.add_middleware(ApiKeyMiddleware, keys=list(api_keys))
    if cors_origins:
        app.add_middleware(ProblemCORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type", "X-Request-ID"],
                           expose_headers=["X-Request-ID", "X-Caption-Id", "X-Heatmap-Mode", "Retry-After"],
                           max_age=600)
    app.add_middleware(SecurityHeadersMiddleware)
