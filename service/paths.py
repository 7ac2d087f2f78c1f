"""The path a request names within the app, whatever prefix a reverse proxy serves the app under.

With ``CAPTIONER_ROOT_PATH=/captioner`` (uvicorn's ``root_path``) a proxy forwards ``/captioner/caption`` as
``/caption``, and uvicorn puts the prefix back: ``scope["path"]`` is ``/captioner/caption`` with ``root_path``
``/captioner`` (the ASGI spec's reading since 2024; Starlette's router strips it the same way). Every check that
compares a request's path with a route's (API keys, draining, the access log, the security headers) compares this
one: comparing ``scope["path"]`` let ``/vision/caption`` past the API key check as an unprotected path, and kept
``/vision/healthz`` from answering while the server drained."""

from typing import Any
from urllib.parse import quote

#: what a path written into an answer may hold unencoded besides letters and digits: RFC 3986's pchar and "/", less
#: "%" (a decoded "%" is encoded again)
PATH_CHARACTERS = "/-._~!$&'()*+,;=:@"
#: the same less "&" and "'", for a path written into HTML or a script's quoted string (the problem pages, the docs
#: page), where they would be read as markup; the server decodes either spelling alike
MARKUP_PATH_CHARACTERS = "/-._~!$()*+,;=:@"

#: where :class:`AppRootMiddleware` records the app's own prefix in a request's scope (an ASGI extension key)
ROOT_KEY = "captioner.root_path"


class AppRootMiddleware:
    """Record the prefix the app is served under as a request enters it, before any mount adds to ``root_path``.
    Starlette's ``app_root_path`` names the outermost app's: with this app mounted in another
    (``Mount("/vision", app=create_app())``) it was ``""``, so ``/vision/caption`` passed the API key check as an
    unprotected path.  The outermost middleware of the app (``app.py``)."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket"):
            scope = {**scope, ROOT_KEY: scope.get("root_path", "")}
        await self.app(scope, receive, send)


def _spelt_root(scope: dict[str, Any]) -> str:
    """The app's prefix as it was given: recorded where the request entered the app, else (a scope that did not pass
    :class:`AppRootMiddleware`) Starlette's ``app_root_path``, else ``root_path``.  Once routed into a mount
    (``/static``), ``root_path`` ends with the mount's path too (the access log wrote ``/static/app.js`` as
    ``/app.js``)."""
    return scope.get(ROOT_KEY, scope.get("app_root_path", scope.get("root_path", "")))


def app_root(scope: dict[str, Any]) -> str:
    """The prefix the app is served under (``""`` without one), without the trailing slash that uvicorn's
    ``--root-path`` may be spelt with."""
    return _spelt_root(scope).rstrip("/")


def uri_path(path: str, in_markup: bool = False) -> str:
    """A decoded path (``scope["path"]``, the app's prefix) percent-encoded again as a URI reference
    (``/captions/ûø£`` is none, nor is a prefix ``/r&d"x``, which the settings accept); ``in_markup``: to be written
    into HTML or a script's string as it is, so ``&`` and ``'`` are encoded too."""
    return quote(path, safe=MARKUP_PATH_CHARACTERS if in_markup else PATH_CHARACTERS)


def app_root_uri(scope: dict[str, Any], in_markup: bool = False) -> str:
    """:func:`app_root` as written into an answer (:func:`uri_path`): a problem's ``type``, the links of the problem
    pages, the addresses the docs page loads."""
    return uri_path(app_root(scope), in_markup)


def app_path(scope: dict[str, Any]) -> str:
    """``scope["path"]`` without the app's prefix (:func:`app_root`; ``/`` for the prefix itself).  A prefix spelt
    with its trailing slash is first taken off as spelt, as Starlette's router takes it off: uvicorn joins
    ``--root-path /vision/`` and ``/caption`` into ``/vision//caption``, which the router runs as ``/caption`` (read
    as ``//caption``, it was no protected path, and the API key check let it through)."""
    path, spelt = scope["path"], _spelt_root(scope)
    if spelt.endswith("/") and path.startswith(spelt + "/"):
        return path[len(spelt):]
    root = app_root(scope)
    if root and (path == root or path.startswith(root + "/")):
        return path[len(root):] or "/"
    return path
