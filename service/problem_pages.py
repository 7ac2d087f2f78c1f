"""The pages a problem's ``type`` leads to: ``GET /problems/{kind}`` says what the problem means and what to do.

RFC 9457 §3.1.1: a problem type's URI, "when dereferenced, SHOULD provide human-readable documentation for the
problem type".  Every ``type`` the service sends is ``{prefix}/problems/{kind}`` (``problems.py``), so following it
from an answer reaches this page on the same server, behind a proxy's path prefix too; ``GET /problems`` lists them
all.  The pages are plain HTML (no script, no style): they are served under the API's strict Content-Security-Policy.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .errors import CLIENT_GONE, ClientGone
from .paths import app_root_uri


@dataclass(frozen=True)
class ProblemPage:
    """One problem type: the status it is sent with, what happened, and what the client (or operator) can do."""

    status: int
    meaning: str
    remedy: str


#: every problem type the service sends (tests/test_problem_pages.py checks this against the code that sends them)
PROBLEM_PAGES: dict[str, ProblemPage] = {
    "invalid-image": ProblemPage(
        422, "The body carries no image the service can read: it is empty, not valid base64, cut short, or in a "
             "format the service does not decode.",
        "Send a JPEG, PNG, WebP, GIF (its first frame is captioned), BMP or TIFF file, whole."),
    "invalid-request": ProblemPage(
        422, "An option is out of range or of the wrong type, the request has a query parameter or JSON key the "
             "route does not take, or its multipart body is malformed. The problem's <code>errors</code> lists "
             "each fault with its location.",
        "Correct the fields that <code>errors</code> names. <code>/openapi.json</code> gives every option's "
        "range on this server."),
    "unsupported-media-type": ProblemPage(
        415, "The body is neither <code>multipart/form-data</code>, JSON nor image bytes, it has no "
             "<code>Content-Type</code>, or it is compressed (a <code>Content-Encoding</code> other than "
             "<code>identity</code>).",
        "Send the image as a <code>file</code> part of a form, as base64 in a JSON <code>image</code> field, or "
        "as the raw bytes with an <code>image/*</code> or <code>application/octet-stream</code> type, "
        "uncompressed."),
    "upload-too-large": ProblemPage(
        413, "The upload is larger than this server accepts (<code>CAPTIONER_MAX_UPLOAD_BYTES</code>; the "
             "<code>detail</code> gives the limit in bytes). Nothing of it was kept.",
        "Send a smaller file: a JPEG copy at most 2048 pixels on its longer side is what the demo page sends."),
    "image-too-large": ProblemPage(
        413, "The image has more pixels than this server decodes (<code>CAPTIONER_MAX_PIXELS</code>), read from "
             "its header before any pixel was decoded: this is how decompression bombs are refused.",
        "Scale the image down before sending it."),
    "upload-timeout": ProblemPage(
        408, "The upload was still arriving when the request's deadline passed (<code>CAPTIONER_REQUEST_TIMEOUT_S"
             "</code>).",
        "Retry over a faster connection, or send a smaller file."),
    "client-gone": ProblemPage(
        CLIENT_GONE, "The client closed the connection before its request was read. The service logs and counts "
                     "it under this status (nginx's 499) and sends nothing: nobody is there to read it.",
        "Nothing: no client ever receives this answer."),
    "invalid-render-request": ProblemPage(
        422, "The heatmap options cannot be drawn: <code>format=png</code> without a <code>token</code>, "
             "<code>format=figure</code> with one, a <code>token</code> past the caption's end (or at or past its "
             "<code>max_len</code>), an unknown mode or colormap, or a heat mode the model's attention does not "
             "have.",
        "<code>GET /models</code> lists each model's <code>heatmap_modes</code>."),
    "unknown-model": ProblemPage(
        404, "The request names a model this server has not loaded.",
        "<code>GET /models</code> lists the loaded models; leave <code>model</code> out for the default one."),
    "unknown-result": ProblemPage(
        404, "No caption result is stored under this id: it was never made, or it aged out of the results kept "
             "(<code>CAPTIONER_RESULTS_MAX_AGE_S</code>, <code>CAPTIONER_RESULTS_MAX_COUNT</code>, "
             "<code>CAPTIONER_RESULTS_CACHE_BYTES</code>).",
        "Caption the image again (<code>POST /caption</code>), or draw it in the same request "
        "(<code>POST /caption/overlay</code>)."),
    "overloaded": ProblemPage(
        429, "The model's queue is full, the request would not finish before its deadline at the speed the server "
             "measures, or the uploads being received at once hold the server's upload budget "
             "(<code>CAPTIONER_UPLOAD_BUDGET_BYTES</code>).",
        "Retry after the number of seconds in the <code>Retry-After</code> header."),
    "not-ready": ProblemPage(
        503, "The server is loading its models or shutting down.",
        "Retry after the number of seconds in the <code>Retry-After</code> header (behind a load balancer, "
        "another replica answers)."),
    "load-failed": ProblemPage(
        503, "Loading the models in the background failed: this process cannot caption, and "
             "<code>/healthz</code> says so that an orchestrator restarts it.",
        "Operators: the server's log names the failure; restart the process once it is fixed."),
    "deadline": ProblemPage(
        504, "The caption was not finished within the request's deadline (<code>CAPTIONER_REQUEST_TIMEOUT_S"
             "</code>): decoding, waiting for a slot, or the model took too long.",
        "Retry later, or with a smaller <code>beam_size</code> or <code>max_len</code>."),
    "unauthorized": ProblemPage(
        401, "This route needs an API key (<code>CAPTIONER_API_KEYS</code>), and the request carried none or one "
             "that is not valid.",
        "Send <code>Authorization: Bearer &lt;key&gt;</code> with a key the operator gave you."),
    "cors-refused": ProblemPage(
        400, "A browser's CORS pre-flight came from an origin, or asked for a method or header, that this server "
             "does not allow (<code>CAPTIONER_CORS_ORIGINS</code>).",
        "Operators: add the page's origin to <code>CAPTIONER_CORS_ORIGINS</code>."),
    "not-found": ProblemPage(
        404, "No route has this path.",
        "<code>/docs</code> lists every route."),
    "method-not-allowed": ProblemPage(
        405, "The path exists, but not with this method.",
        "The <code>Allow</code> header lists the methods the path takes."),
    "internal": ProblemPage(
        500, "An unexpected error: the request was not processed. The details are in the server's log only.",
        "Retry once; if it persists, report it with the response's <code>X-Request-ID</code>."),
}


def problem_title(kind: str) -> str:
    status = PROBLEM_PAGES[kind].status
    return ClientGone.title if status == CLIENT_GONE else HTTPStatus(status).phrase


def _status_line(kind: str) -> str:
    """``422 Unprocessable Entity``: the status a problem type is sent with, and its title."""
    return f"{PROBLEM_PAGES[kind].status} {problem_title(kind)}"


def _root_attribute(request: Request) -> str:
    """The app's prefix, to write into an ``href``: percent-encoded, so it holds no character HTML would read."""
    return app_root_uri(request.scope, in_markup=True)


def _page(title: str, body: str) -> HTMLResponse:
    return HTMLResponse(f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}'
                        f'</title></head>\n<body>\n{body}\n</body></html>\n')


def install_problem_pages(app: FastAPI) -> None:
    """``GET /problems`` (the list) and ``GET /problems/{kind}`` (one type); an unknown kind is a 404 problem."""

    @app.get("/problems", include_in_schema=False)
    async def problem_index(request: Request) -> HTMLResponse:
        root = _root_attribute(request)
        rows = "\n".join(f'<li><a href="{root}/problems/{kind}"><code>{kind}</code></a>: {_status_line(kind)}</li>'
                         for kind in PROBLEM_PAGES)
        return _page("Problem types", f"<h1>Problem types</h1>\n<p>Every error this service answers is an RFC 9457 "
                                      f"problem document whose <code>type</code> is one of these.</p>\n<ul>\n{rows}"
                                      f"\n</ul>")

    @app.get("/problems/{kind}", include_in_schema=False)
    async def problem_page(request: Request, kind: str) -> HTMLResponse:
        page = PROBLEM_PAGES.get(kind)
        if page is None:
            raise StarletteHTTPException(404, f"no problem type is called {kind!r}: /problems lists them")
        return _page(f"{kind}: {_status_line(kind)}",
                     f"<h1><code>{kind}</code>: {_status_line(kind)}</h1>\n"
                     f"<h2>What happened</h2>\n<p>{page.meaning}</p>\n<h2>What to do</h2>\n<p>{page.remedy}</p>\n"
                     f'<p><a href="{_root_attribute(request)}/problems">Every problem type</a></p>')
