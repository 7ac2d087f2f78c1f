"""Reading a caption request: the image bytes and the options, from any of the three body formats.

* ``multipart/form-data``: the image as the ``file`` part; options as form fields, honoured exactly like the
  query parameters (given both ways with different values: 422 naming both); any other part: 422 naming it.
* ``application/json``: ``{"image": base64 or data: URL, "model", "beam_size", "max_len", "length_penalty",
  "block_trigrams", "block_doubled_words"}``; its options override the query parameters.
* ``image/*`` or ``application/octet-stream``: the raw image; options from the query only.

Size limits are enforced while reading (before reading, when the client announced the length), so an oversized
body is never held in memory.  Every failure is a typed exception of ``errors.py``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import time
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import Query, Request
from fastapi.dependencies.models import Dependant
from fastapi.dependencies.utils import get_cached_model_fields, is_scalar_field, lenient_issubclass
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError, model_validator
from starlette.datastructures import FormData, UploadFile
from starlette.concurrency import run_in_threadpool
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import ClientDisconnect

from .captioning import CaptionParameters, CaptionRequest
from .errors import ClientGone, InvalidImage, InvalidRequest, UnsupportedBody, UploadTooLarge
from .middleware import ARRIVED
from .schemas import CAPTION_OPTIONS, CaptionJSON, CaptionOptions
from .settings import json_body_bytes
from .work_slots import UNLIMITED, UploadBudget, UploadHold

#: room for the multipart envelope around the file (boundaries, part headers, the option fields)
MULTIPART_SLACK = 64 * 1024
#: parts parsed before refusing: enough to name a client's stray parts in the 422, few enough to bound the work
MAX_FORM_FILES, MAX_FORM_FIELDS = 8, 16
FORM_PARTS = ("file", *CAPTION_OPTIONS)


class CaptionFields(CaptionOptions):
    """:class:`CaptionOptions` given as text: query parameters (FastAPI's query parameter model: each field a
    parameter of its own, with the field's description and bounds) and multipart form fields.  An empty value
    names no option."""

    @model_validator(mode="before")
    @classmethod
    def _empty_is_none(cls, data: Any) -> Any:
        # ?beam_size= and an empty form field (curl -F beam_size=) name no beam size: not a 422
        return {name: None if value == "" else value for name, value in data.items()} \
            if isinstance(data, dict) else data


#: the caption options given as query parameters, for the endpoints that caption an upload
QueryOptions = Annotated[CaptionFields, Query()]


def _query_params(dependant: Dependant) -> dict[str, bool]:
    """The query parameters a route (or a dependency) reads, its dependencies' and its query models' fields
    included: name → whether it takes one value."""
    params: dict[str, bool] = {}
    for param in dependant.query_params:
        model = param.field_info.annotation
        fields = get_cached_model_fields(model) if lenient_issubclass(model, BaseModel) else [param]
        params.update({field.alias: is_scalar_field(field) for field in fields})
    for dependency in dependant.dependencies:
        params.update(_query_params(dependency))
    return params


async def known_query_only(request: Request) -> None:
    """Refuse the query parameters the route does not take, by name, as FastAPI refuses a bad value: a misspelt
    ``beam_sise=5`` would otherwise be ignored, and the caption made with the default beam while the client
    believes it chose one (a stray multipart part is refused the same way).  A parameter of one value given more
    than once is refused too, as a repeated form field is: FastAPI read the last and dropped the others
    (``beam_size=1&beam_size=5`` captioned with 5)."""
    route = request.scope.get("route")
    if not isinstance(route, APIRoute):
        return
    accepted = _query_params(route.dependant)  # a few fields: cheaper than a thread hop, no cache needed
    unknown = sorted({name for name in request.query_params if name not in accepted})
    if unknown:
        takes = f"it takes {', '.join(sorted(accepted))}" if accepted else "it takes none"
        raise RequestValidationError([{"type": "extra_forbidden", "loc": ("query", name),
                                       "msg": f"unknown query parameter ({takes})"} for name in unknown])
    counts = Counter(name for name, _ in request.query_params.multi_items())
    repeated = sorted(name for name, scalar in accepted.items() if scalar and counts[name] > 1)
    if repeated:
        raise RequestValidationError([{"type": "repeated", "loc": ("query", name),
                                       "msg": f"given {counts[name]} times (it takes one value)"}
                                      for name in repeated])


def missing_file() -> InvalidRequest:
    return InvalidRequest("body.file: Field required (send multipart/form-data with a `file` part, JSON with a "
                          "base64 `image`, or the raw image bytes)",
                          errors=[{"loc": ["body", "file"], "msg": "Field required"}])


def _validation_failure(exc: ValidationError) -> InvalidRequest:
    errors = [{"loc": ["body", *map(str, e["loc"])], "msg": e["msg"]} for e in exc.errors()]
    return InvalidRequest("; ".join(f"{'.'.join(e['loc'])}: {e['msg']}" for e in errors), errors)


def checked_image(data: bytes, limit: int) -> bytes:
    """The uploaded image bytes, refused when above ``limit`` or empty (the same rule for every body format)."""
    if len(data) > limit:
        raise UploadTooLarge(limit)
    if not data:
        raise InvalidImage("the uploaded image is empty")
    return data


async def read_upload(upload: UploadFile, limit: int) -> bytes:
    return checked_image(await upload.read(limit + 1), limit)


async def limited_stream(request: Request, limit: int, refused_at: int | None = None,
                         budget: UploadBudget | UploadHold = UNLIMITED) -> AsyncGenerator[bytes, None]:
    """The body's chunks, refused (:class:`UploadTooLarge` naming ``limit``) as soon as more than ``refused_at``
    bytes (default ``limit``) have come, and before any is read when the client announced more: a body sent
    without a length (chunked) meets the same limit as one that declares it.  Its chunks are taken from ``budget``
    as they arrive (a request's :class:`UploadHold` gives them back when the request ends)."""
    refused_at = limit if refused_at is None else refused_at
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > refused_at:
        raise UploadTooLarge(limit)
    size = 0
    try:
        async for chunk in request.stream():
            budget.take(len(chunk))
            size += len(chunk)
            if size > refused_at:
                raise UploadTooLarge(limit)
            yield chunk
    except ClientDisconnect:  # a client leaving mid-upload is not a failure of the service
        raise ClientGone("the client closed the connection while sending the upload") from None


async def read_body(request: Request, limit: int, refused_at: int | None = None,
                    budget: UploadBudget | UploadHold = UNLIMITED) -> bytes:
    """The raw body, refusing as soon as it passes ``refused_at`` bytes (default ``limit``) — before reading it
    when the client announced its length."""
    return b"".join([chunk async for chunk in limited_stream(request, limit, refused_at, budget)])


class WholeMultiPartParser(MultiPartParser):
    """Starlette's parser, which drops a part the body ends in without a word: a cut-off upload came out as a form
    without its ``file`` ("Field required", though the client sent one).  This one notes the closing boundary
    (``--BOUNDARY--``), the only proof that the body arrived whole."""

    closed = False

    def on_end(self) -> None:  # called by python-multipart on the closing boundary only
        self.closed = True


@asynccontextmanager
async def multipart_form(request: Request, limit: int,
                         budget: UploadBudget | UploadHold = UNLIMITED) -> AsyncIterator[FormData]:
    """The multipart form of a request whose file may hold ``limit`` bytes, its parts' temporary files closed on
    leaving.  Starlette's ``request.form()`` spools a chunked body's file parts to disk whatever their size, so the
    parser reads the counted stream instead: past the file limit plus the envelope, the upload is refused while
    it arrives."""
    parser = WholeMultiPartParser(request.headers, limited_stream(request, limit, limit + MULTIPART_SLACK, budget),
                                  max_files=MAX_FORM_FILES, max_fields=MAX_FORM_FIELDS)

    def malformed(message: str) -> InvalidRequest:
        return InvalidRequest(f"malformed multipart/form-data body: {message}", [{"loc": ["body"], "msg": message}])

    try:
        form = await parser.parse()
    except MultiPartException as exc:
        raise malformed(exc.message) from None
    if not parser.closed:
        await form.close()
        # the part the body ended in is not in the form (Starlette drops it), but its spooled file is open; Starlette
        # lists every part's file here (it closes them on its own errors, not on this one)
        for file in getattr(parser, "_files_to_close_on_error", ()):
            file.close()
        raise malformed("the body ended before its closing boundary (--BOUNDARY--): the upload was cut off")
    try:
        yield form
    finally:
        await form.close()


def merge_form_options(query: CaptionOptions, form: CaptionOptions) -> CaptionOptions:
    """The options given either way; the same option given both ways must have the same value."""
    conflicts = [name for name in CAPTION_OPTIONS
                 if getattr(query, name) is not None and getattr(form, name) is not None
                 and getattr(query, name) != getattr(form, name)]
    if conflicts:
        described = "; ".join(f"query parameter {n}={getattr(query, n)!r} and form field {n}={getattr(form, n)!r}"
                              for n in conflicts)
        errors = [error for n in conflicts for error in (
            {"loc": ["query", n], "msg": f"conflicts with form field {n}={getattr(form, n)!r}"},
            {"loc": ["body", n], "msg": f"conflicts with query parameter {n}={getattr(query, n)!r}"})]
        raise InvalidRequest(f"conflicting values: {described} (give each option once, or the same value)", errors)
    return overlaid(query, form)


def overlaid(base: CaptionOptions, over: CaptionOptions) -> CaptionOptions:
    """``over``'s options where it gives them, ``base``'s where it does not."""
    return CaptionOptions(**{name: getattr(over, name) if getattr(over, name) is not None else getattr(base, name)
                             for name in CAPTION_OPTIONS})


def form_options(form: FormData) -> tuple[UploadFile, CaptionOptions]:
    """The ``file`` part and the option fields of a multipart form; anything else is refused by name."""
    counts = Counter(name for name, _ in form.multi_items())
    unknown = sorted(name for name in counts if name not in FORM_PARTS)
    if unknown:
        raise InvalidRequest(
            f"unknown multipart part(s) {', '.join(map(repr, unknown))}: send the image as `file` and only the "
            f"options {', '.join(CAPTION_OPTIONS)} as form fields",
            [{"loc": ["body", name], "msg": "unknown part"} for name in unknown])
    repeated = sorted(name for name, count in counts.items() if count > 1)
    if repeated:
        raise InvalidRequest(f"multipart part(s) {', '.join(map(repr, repeated))} given more than once",
                             [{"loc": ["body", name], "msg": "given more than once"} for name in repeated])
    upload = form.get("file")
    if isinstance(upload, str):  # curl -F file=abc: a text field, where -F file=@photo.jpg sends the photo
        raise InvalidRequest("`file` came as a text field, not a file part: send the image with a filename "
                             "(curl -F file=@photo.jpg)", [{"loc": ["body", "file"], "msg": "a text field, expected "
                                                            "a file part"}])
    if not isinstance(upload, UploadFile):
        raise missing_file()
    fields = {name: form[name] for name in CAPTION_OPTIONS if name in form}
    for name, value in fields.items():
        if isinstance(value, UploadFile):
            raise InvalidRequest(f"{name} must be a form field, not a file",
                                 [{"loc": ["body", name], "msg": "a file part, expected a form field"}])
    try:
        return upload, CaptionFields.model_validate(fields)
    except ValidationError as exc:
        raise _validation_failure(exc) from None


#: what a refused request's body may be read to, and dropped (for at most DISCARD_SECONDS): a connection closed with
#: unread data in it is reset, and the client sees the reset instead of the answer
DISCARD_BYTES = 64 * 1024 * 1024
#: how long a refused request's body may take to be read and dropped: a body sent a byte at a time must not hold
#: the connection (and the request, which counts as in flight for a drain) open
DISCARD_SECONDS = 2.0


async def drain_body(request: Request, limit: int, seconds: float = DISCARD_SECONDS) -> None:
    """Read and drop the body of a request answered without it (up to ``limit`` bytes, for at most ``seconds``): a
    connection closed with unread data in it is reset, and the client would see the reset instead of the answer;
    one that sends slower than that gets its answer and the reset."""
    size = 0
    try:
        async with asyncio.timeout(seconds):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    return
    except (ClientDisconnect, TimeoutError):  # the client left while sending, or sends too slowly to wait for
        return


class UnreadBodyMiddleware:
    """Reads and drops what is left of a request's body before its answer starts (up to ``limit`` bytes, for at
    most ``DISCARD_SECONDS``).  uvicorn closes the connection after the answer when the client asked it to
    (HTTP/1.0, ``Connection: close``), and a connection closed with unread data in it is reset: the client sees the
    reset, not the answer.  nginx speaks HTTP/1.0 to the server it proxies to, so every answer given before the
    body was read (401 without a key, 413 from the ``Content-Length``, 404 or 405 of a path, 422 of an unknown query
    parameter) reached nginx's client as its 502 about half the time.  A body declared larger than ``limit`` is
    left unread (its reset cannot be avoided by reading a part of it), and so is one whose client waits for
    ``100 Continue`` and was never asked for it (it sends nothing once it has the answer), and the rest of an
    upload answered 408 (its client is too slow to wait for: it would hold the connection 2 s longer)."""

    def __init__(self, app: Any, limit: int = DISCARD_BYTES):
        self.app = app
        self.limit = limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        headers = dict(scope.get("headers") or []) if scope["type"] == "http" else {}
        declared = headers.get(b"content-length", b"").strip()
        if scope["type"] != "http" or not declares_body(headers) or (declared.isdigit() and int(declared) > self.limit):
            await self.app(scope, receive, send)
            return
        waits_for_continue = headers.get(b"expect", b"").lower() == b"100-continue"
        body = {"asked": False, "read": False}

        async def noting_receive() -> dict:
            body["asked"] = True
            message = await receive()
            if message["type"] == "http.disconnect" or not message.get("more_body", False):
                body["read"] = True
            return message

        async def send_after_the_body(message: dict) -> None:
            if message["type"] == "http.response.start" and not body["read"] and message["status"] != 408 \
                    and (body["asked"] or not waits_for_continue):
                body["read"] = True
                await drain_body(Request(scope, receive), self.limit)
            await send(message)

        await self.app(scope, noting_receive, send_after_the_body)


def _content_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


def declares_body(headers: Mapping[bytes, bytes]) -> bool:
    """Whether a request's raw headers (ASGI's, lower-case names) announce a body: a length above 0, or chunks."""
    return b"transfer-encoding" in headers or headers.get(b"content-length", b"").strip() not in (b"", b"0")


def _is_json(content_type: str) -> bool:
    return content_type == "application/json" or content_type.endswith("+json")


def arrival(request: Request) -> float:
    """When the request arrived (``time.monotonic()``, noted by the request-context middleware; now without it)."""
    return request.scope.get("state", {}).get(ARRIVED) or time.monotonic()


def caption_parameters(options: CaptionOptions) -> CaptionParameters:
    """The wire options as the captioning use case's parameters: the one place HTTP's model of them is translated."""
    return CaptionParameters(**{name: getattr(options, name) for name in CAPTION_OPTIONS})


def option_sources(query: CaptionOptions, body: CaptionOptions | None) -> dict[str, str]:
    """Where each option a request gives came from, by name: ``body`` where its body gave it (a form field, which
    must agree with the query; a JSON member, which overrides it), else ``query``; a refusal by the use case is
    placed there (InvalidRequest.place)."""
    in_body = {name for name in CAPTION_OPTIONS if body is not None and getattr(body, name) is not None}
    return {name: "body" if name in in_body else "query"
            for name in CAPTION_OPTIONS if name in in_body or getattr(query, name) is not None}


def options_before_body(request: Request, query: CaptionOptions) -> CaptionParameters | None:
    """The options the query gives, when the body cannot change them: None for a JSON body (whose fields override
    the query); a form field must agree with the query, and a raw image body has no options."""
    return None if _is_json(_content_type(request)) else caption_parameters(query)


#: the whitespace base64 may be wrapped with (RFC 2045's line breaks, a pretty-printer's indentation): dropped by one
#: ``str.translate``, where ``"".join(encoded.split())`` made a string of every piece between two of them
BASE64_WHITESPACE = dict.fromkeys(map(ord, " \t\r\n\f\v"))


def _json_image(body: bytes) -> tuple[bytes, CaptionJSON]:
    """The image bytes and the options of a JSON caption body."""
    try:
        parsed = CaptionJSON.model_validate_json(body)
    except ValidationError as exc:
        raise _validation_failure(exc) from None
    encoded = parsed.image
    if encoded.startswith("data:"):
        encoded = encoded.partition(",")[2]
    try:
        return base64.b64decode(encoded.translate(BASE64_WHITESPACE), validate=True), parsed
    except (binascii.Error, ValueError):
        raise InvalidImage("`image` is not valid base64") from None


async def read_caption_request(request: Request, query: CaptionOptions, limit: int,
                               budget: UploadBudget | UploadHold = UNLIMITED
                               ) -> tuple[CaptionRequest, CaptionOptions | None]:
    """The image (at most ``limit`` bytes) and options of a caption request, from whichever body format it uses,
    its chunks taken from ``budget`` as they arrive; and the options its body gave (a form's fields, JSON's
    members; None for raw image bytes), for :func:`option_sources`."""
    coding = request.headers.get("content-encoding", "").strip().lower()
    if coding not in ("", "identity"):  # read as it is, a gzipped image was "not an image" and gzipped JSON "invalid"
        raise UnsupportedBody(f"a caption request's body cannot be compressed (Content-Encoding: {coding}): send "
                              "it uncompressed (images are compressed already)")
    content_type = _content_type(request)
    if content_type == "multipart/form-data":
        async with multipart_form(request, limit, budget) as form:
            upload, options = form_options(form)
            merged = caption_parameters(merge_form_options(query, options))
            return CaptionRequest(await read_upload(upload, limit), merged), options
    if _is_json(content_type):
        body = await read_body(request, limit, json_body_bytes(limit), budget)
        # parsing megabytes and decoding their base64 take a worker thread, as decoding an image does: on the event
        # loop, a stream of such bodies stalled every other request and the health probes for seconds
        data, parsed = await run_in_threadpool(_json_image, body)
        checked_image(data, limit)
        # JSON's members override the query's
        return CaptionRequest(data, caption_parameters(overlaid(query, parsed))), parsed
    if content_type.startswith("image/") or content_type == "application/octet-stream":
        return CaptionRequest(checked_image(await read_body(request, limit, budget=budget), limit),
                              caption_parameters(query)), None
    if not content_type and not declares_body(dict(request.scope["headers"])):
        raise missing_file()
    if not content_type:  # bytes without a (readable) type: what they are is the client's to say
        raise UnsupportedBody("a caption request's body needs a Content-Type: multipart/form-data with a `file` "
                              "part, application/json with a base64 `image`, or the image's own (image/jpeg, ...)")
    raise UnsupportedBody(f"a caption request's body cannot be {content_type}: send multipart/form-data with a "
                          "`file` part, JSON with a base64 `image`, or the raw image bytes (image/*)")
