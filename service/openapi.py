"""The OpenAPI document, completed with what the routes cannot declare themselves: every error answer is an RFC 9457
problem document (``application/problem+json``), for the statuses each operation can produce, and the Prometheus text
of ``/metrics``; and the ``/docs`` page that shows it.  FastAPI's default 422 schema (``HTTPValidationError``) is
replaced, because the service never answers with it.  The fuzz test (tests/test_fuzz_api.py) checks answers against
this document.
"""

from __future__ import annotations

import copy
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from captioner.models.rendering.heatmaps import HEAT_MODES, MODES

from .paths import app_root_uri
from .problems import PROBLEM_JSON
from .schemas import CaptionJSON, form_schema

COMPONENTS = "#/components/schemas/"
#: the caption endpoints' request bodies (schemas.py's CAPTION_BODY refers to them), as components
REQUEST_BODIES = {"CaptionForm": form_schema(), "CaptionJSON": CaptionJSON.model_json_schema()}
#: the API keys (CAPTIONER_API_KEYS) as the document declares them: a bearer token on the caption and result
#: endpoints, optional (``{}``), since a service without keys takes none; a generated client then sends it
BEARER = {"bearerAuth": {"type": "http", "scheme": "bearer",
                         "description": "one of CAPTIONER_API_KEYS, when the service is configured with keys"}}
#: query parameters whose values are a closed set, as components of their own (a generated client made one enum class
#: per route of each): parameter → component; ``mode`` is checked by the renderer, so its sets are written here: the
#: overlays draw every mode, the JSON heatmaps (``/heatmaps``) the modes that draw heat
CHOICES = {"attention_format": "AttentionFormat", "format": "OverlayFormat", "mode": "HeatmapMode"}
HEAT_CHOICES = {**CHOICES, "mode": "HeatMode"}
EXTRA_ENUMS = {"HeatmapMode": list(MODES), "HeatMode": list(HEAT_MODES)}


def _shared_choices(path: str, parameter: dict[str, Any], components: dict[str, Any]) -> None:
    """Point a closed-set query parameter's schema (or its non-null branch) at a shared enum component."""
    component = (HEAT_CHOICES if path.endswith("/heatmaps") else CHOICES).get(parameter["name"])
    if component is None:
        return
    schema = parameter["schema"]
    branches = schema.get("anyOf", [schema])
    for i, branch in enumerate(branches):
        if branch.get("type") == "string":
            values = branch.get("enum") or EXTRA_ENUMS.get(component)
            if values:
                components[component] = {"type": "string", "enum": values, "title": component}
                branches[i] = {"$ref": COMPONENTS + component}
    if "anyOf" not in schema and branches[0] is not schema:
        parameter["schema"] = {**{k: v for k, v in schema.items() if k in ("description", "default", "title")},
                               "allOf": [branches[0]]}


#: where /docs finds Swagger UI's script and style
DOCS_ASSETS = "/docs/assets"
DOCS_FILES = frozenset({"swagger-ui-bundle.js", "swagger-ui.css", "favicon-32x32.png"})
PROBLEM_SCHEMA: dict[str, Any] = {
    "title": "Problem",
    "description": "RFC 9457 problem details",
    "type": "object",
    "required": ["type", "title", "status", "detail"],
    "properties": {
        "type": {"type": "string", "format": "uri-reference",
                 "description": "problem type: the path of its page on this server, e.g. /problems/invalid-image"},
        "title": {"type": "string"},
        "status": {"type": "integer", "minimum": 400, "maximum": 599},
        "detail": {"type": "string", "description": "what went wrong, for a person"},
        "instance": {"type": "string", "format": "uri-reference", "description": "the request path"},
        "errors": {"type": "array", "description": "invalid request: one per field", "items": {
            "type": "object", "required": ["loc", "msg"],
            "properties": {"loc": {"type": "array", "items": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
                                   "description": "where: body or query, then the field"},
                           "msg": {"type": "string", "description": "what is wrong with it"}}}},
    },
    "additionalProperties": True,
}
REASONS = {401: "API key missing or invalid (only when keys are configured)",
           404: "unknown model or result", 405: "method not allowed", 408: "upload not received within the deadline",
           413: "upload or image too large",
           415: "unsupported body type", 422: "invalid input",
           429: "queue full, or the uploads being handled at once hold their byte budget (Retry-After)",
           500: "internal error (no details are disclosed)", 503: "not ready or shutting down (Retry-After)",
           504: "deadline passed"}
EVERY_OPERATION = (404, 405, 422, 500, 503)
CAPTIONING = (401, 408, 413, 415, 429, 504)
RESULTS = (401,)
RENDERING = (504,)  # a render slot waited for past the deadline


def _statuses(path: str) -> tuple[int, ...]:
    if path.startswith("/caption/") or path == "/caption":
        return EVERY_OPERATION + CAPTIONING
    if path.startswith("/captions/"):
        return EVERY_OPERATION + RESULTS + (RENDERING if path.endswith(("/overlay", "/heatmaps")) else ())
    return EVERY_OPERATION


def header_doc(description: str) -> dict[str, Any]:
    """An answer's header as the document describes it (every header the service sends is a string)."""
    return {"description": description, "schema": {"type": "string"}}


#: the headers every answer carries (middleware.py), and those of some statuses (problems.py, security.py)
EVERY_ANSWER_HEADERS = {"X-Request-ID": header_doc("the request's id: the client's X-Request-ID when it is sane, "
                                                   "else a new one; the access log line carries it")}
RETRY_AFTER = {"Retry-After": header_doc("seconds to wait before retrying")}
STATUS_HEADERS = {"401": {"WWW-Authenticate": header_doc("Bearer")}, "429": RETRY_AFTER, "503": RETRY_AFTER}


#: a request option → (its default, its largest value): the server's settings, which the document states
Limits = dict[str, tuple[int, int]]


def _state_limit(schema: dict[str, Any], default: int, largest: int) -> None:
    """Give an integer option's schema (or its integer branch) this server's largest value and say its default."""
    for branch in schema.get("anyOf", [schema]):
        if branch.get("type") == "integer":
            branch["maximum"] = largest
    schema["description"] = f"{schema.get('description', '')}; default {default}, at most {largest} on this server"


def state_limits(schema: dict[str, Any], limits: Limits) -> None:
    """Write the server's limits (``CAPTIONER_MAX_BEAM_SIZE``, ``CAPTIONER_DEFAULT_BEAM_SIZE``, …) into every place
    a request names the option: the query parameters, the form and the JSON body. The document said only "at least
    1", so a generated client, or the docs page's form, learnt the largest beam from a 422."""
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            for parameter in operation.get("parameters", []):
                if parameter["name"] in limits:  # Swagger UI shows the parameter's description, not its schema's
                    _state_limit(parameter["schema"], *limits[parameter["name"]])
                    parameter["description"] = parameter["schema"]["description"]
    for body in REQUEST_BODIES:
        for name, option in schema["components"]["schemas"][body]["properties"].items():
            if name in limits:
                _state_limit(option, *limits[name])


def complete_openapi(schema: dict[str, Any], limits: Limits | None = None, root_path: str = "") -> dict[str, Any]:
    """Add the problem responses, the answers' headers (and the metrics media type) to a FastAPI OpenAPI document,
    the server's ``limits`` of the request options and its address (``root_path``, a proxy's prefix), in place."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components["Problem"] = PROBLEM_SCHEMA
    components.update(copy.deepcopy(REQUEST_BODIES))  # the limits are written into them: one app's, not every app's
    schema["components"]["securitySchemes"] = BEARER
    # one server: behind a proxy's prefix, "/" would name the proxy's root (FastAPI adds the prefix before it)
    schema["servers"] = [{"url": root_path or "/"}]
    problem = {"content": {PROBLEM_JSON: {"schema": {"$ref": COMPONENTS + "Problem"}}}}
    for path, operations in schema.get("paths", {}).items():
        for operation in operations.values():
            for parameter in operation.get("parameters", []):
                _shared_choices(path, parameter, components)
            responses = operation.setdefault("responses", {})
            for status in _statuses(path):
                entry = responses.setdefault(str(status), {})
                entry["description"] = entry.get("description") or REASONS[status]
                if entry["description"] == "Validation Error":
                    entry["description"] = REASONS[status]
                entry["content"] = problem["content"]
            for status, entry in responses.items():
                entry["headers"] = {**EVERY_ANSWER_HEADERS, **STATUS_HEADERS.get(str(status), {}),
                                    **(entry.get("headers") or {})}
            if 401 in _statuses(path):
                operation["security"] = [{name: []} for name in BEARER] + [{}]
    metrics = schema.get("paths", {}).get("/metrics", {}).get("get")
    if metrics:
        metrics["responses"]["200"]["content"] = {"text/plain": {"schema": {"type": "string"}}}
    for unused in ("HTTPValidationError", "ValidationError"):
        schema["components"]["schemas"].pop(unused, None)
    state_limits(schema, limits or {})
    return schema


def install_docs(app: FastAPI) -> None:
    """``/docs``: Swagger UI from the ``swagger-ui-bundle-v2`` package, served by the app (FastAPI's own page loads
    it from a CDN, which a machine without internet access cannot reach: the page stayed blank)."""
    from swagger_ui_bundle import swagger_ui_path

    # the three files the page loads, not the package's folder: that holds Swagger UI's stock index.html too, a
    # page that fetches any spec a visitor types in, served from this origin
    assets = StaticFiles(directory=swagger_ui_path)

    @app.get(f"{DOCS_ASSETS}/{{name}}", include_in_schema=False)
    async def docs_asset(name: str, request: Request) -> Response:
        if name not in DOCS_FILES:
            raise StarletteHTTPException(404, "Not Found")
        # as a static mount answers: a conditional request for the 1.5 MB bundle gets a 304, not the bundle again
        return await assets.get_response(name, request.scope)

    @app.get("/docs", include_in_schema=False)
    async def docs(request: Request) -> HTMLResponse:
        # the page's addresses are the browser's: behind a proxy's prefix (CAPTIONER_ROOT_PATH) they start with it,
        # percent-encoded (FastAPI writes them into an attribute and a quoted string as given)
        prefix = app_root_uri(request.scope, in_markup=True)
        return get_swagger_ui_html(openapi_url=prefix + app.openapi_url, title=f"{app.title} — API",
                                   swagger_js_url=f"{prefix}{DOCS_ASSETS}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{prefix}{DOCS_ASSETS}/swagger-ui.css",
                                   swagger_favicon_url=f"{prefix}{DOCS_ASSETS}/favicon-32x32.png")


def install_openapi(app: FastAPI, limits: Limits, root_path: str = "") -> None:
    """Serve the completed document at ``/openapi.json`` (built once, on first use, like FastAPI's own)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = complete_openapi(get_openapi(
                title=app.title, version=app.version, description=app.description, routes=app.routes,
                license_info=app.license_info), limits, root_path)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
