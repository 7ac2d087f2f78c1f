"""The path a request names within the app, whatever prefix a reverse proxy serves the app under.

With ``CAPTIONER_ROOT_PATH=/captioner`` (uvicorn's ``root_path``) a proxy forwards ``/captioner/caption`` as
``/caption``, and uvicorn puts the prefix back: ``scope["path"]`` is ``/captioner/caption`` with ``root_path``
``/captioner`` (the ASGI spec's reading since 2024; Starlette's router strips it the same way). Every check that
compares a request's path with a route's (API keys, draining, the access log, the security headers) compares this
one: comparing ``scope["path"]`` let ``/vision/caption`` past the API key check as an unprotected path, and kept
``/vision/healthz`` from answering while the server drained."""

from typing import Any


def app_root(scope: dict[str, Any]) -> str:
    """The prefix the app is served under (``""`` without one).  Once routed into a mount (``/static``),
    ``root_path`` ends with the mount's path too; the app's own is Starlette's ``app_root_path`` (the access log
    wrote ``/static/app.js`` as ``/app.js``); without its trailing slash, as uvicorn's ``--root-path`` may be spelt."""
    return scope.get("app_root_path", scope.get("root_path", "")).rstrip("/")


def app_path(scope: dict[str, Any]) -> str:
    """``scope["path"]`` without the app's prefix (:func:`app_root`; ``/`` for the prefix itself)."""
    path, root = scope["path"], app_root(scope)
    if root and (path == root or path.startswith(root + "/")):
        return path[len(root):] or "/"
    return path
