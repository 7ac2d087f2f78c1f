"""Typed failures of the service's use cases: input parsing, captioning and stored results raise these, and
:data:`PROBLEM_TYPES` gives each one its HTTP status and RFC 9457 problem type, in this one table (``problems.py``
builds the answer from it; the captioning use case labels its latency metric with the same status).

Failures raised below the service keep their own types and are listed too:
:class:`~captioner.models.images.ImageDecodeError` / :class:`~captioner.models.images.ImageTooLarge` (image decoding)
and :class:`~captioner.models.rendering.heatmaps.RenderError` (overlay parameters).
"""

from __future__ import annotations

from collections.abc import Mapping

from captioner.models.images import ImageDecodeError, ImageTooLarge
from captioner.models.rendering.heatmaps import RenderError

#: seconds a client should wait before retrying while the service starts or stops
NOT_READY_RETRY_AFTER_S = 5
#: the status of a request whose client went away (nginx's 499): logged and counted, never sent
CLIENT_GONE = 499


class ServiceError(Exception):
    """Base of the failures a client caused or can retry; ``str(exc)`` is the problem's ``detail``."""


class InvalidRequest(ServiceError):
    """The request's shape or options are wrong; ``errors`` lists each one as ``{"loc": [...], "msg": ...}``."""

    def __init__(self, detail: str, errors: list[dict] | None = None):
        super().__init__(detail)
        self.errors = errors

    def place(self, sources: Mapping[str, str]) -> None:
        """Put each error that names an option alone (``loc: [option]``: the use case's, which knows nothing of
        HTTP) where the request gave it, as FastAPI's own errors are (``sources``: option → ``query`` or ``body``)."""
        if self.errors:
            self.errors = [{**error, "loc": [sources[error["loc"][0]], *error["loc"]]}
                           if len(error.get("loc", ())) == 1 and error["loc"][0] in sources else error
                           for error in self.errors]


class InvalidImage(ServiceError):
    """The upload carries no usable image bytes (empty, or not valid base64)."""


class UploadTooLarge(ServiceError):
    """The upload is larger than ``max_upload_bytes``."""

    def __init__(self, limit: int):
        # in MiB for the person reading it, in bytes for a client that compares sizes
        super().__init__(f"upload is larger than the limit of {limit / 2**20:.3g} MiB ({limit} bytes)")
        self.limit = limit


class UnsupportedBody(ServiceError):
    """The body is none of the formats a caption request can take (multipart, JSON, raw image bytes)."""


class UploadTimeout(ServiceError):
    """The body did not arrive within the request deadline (a slow or stalled upload)."""


class ClientGone(ServiceError):
    """The client closed the connection before its request was read: nobody is there to answer (status 499, as
    nginx logs it)."""

    title = "Client Closed Request"


class UnknownModel(ServiceError):
    """The request names a model that is not loaded."""


class UnknownResult(ServiceError):
    """No stored caption result has this id (never made, or evicted)."""


class NotReady(ServiceError):
    """Models are loading, the service is shutting down, or no model is loaded: retry later."""

    retry_after_s = NOT_READY_RETRY_AFTER_S


class LoadFailed(ServiceError):
    """Loading the models failed (in the background): the process is not healthy and should be restarted."""


class Overloaded(ServiceError):
    """The model's queue is full: retry after ``retry_after_s`` seconds."""

    def __init__(self, detail: str, retry_after_s: int):
        super().__init__(detail)
        self.retry_after_s = retry_after_s


class UploadsBusy(Overloaded):
    """The uploads being received at once hold the service's byte budget (``upload_budget_bytes``): retry."""


class DeadlinePassed(ServiceError):
    """The caption was not finished within the request deadline."""


#: typed failure → (HTTP status, problem type); a subclass not listed takes its nearest listed base's entry
PROBLEM_TYPES: dict[type[Exception], tuple[int, str]] = {
    UploadTooLarge: (413, "upload-too-large"),
    ImageTooLarge: (413, "image-too-large"),
    ImageDecodeError: (422, "invalid-image"),
    InvalidImage: (422, "invalid-image"),
    InvalidRequest: (422, "invalid-request"),
    UnsupportedBody: (415, "unsupported-media-type"),
    UploadTimeout: (408, "upload-timeout"),
    ClientGone: (CLIENT_GONE, "client-gone"),
    RenderError: (422, "invalid-render-request"),
    UnknownModel: (404, "unknown-model"),
    UnknownResult: (404, "unknown-result"),
    Overloaded: (429, "overloaded"),
    NotReady: (503, "not-ready"),
    LoadFailed: (503, "load-failed"),
    DeadlinePassed: (504, "deadline"),
}


def problem_type(exc: BaseException) -> tuple[int, str]:
    """(HTTP status, problem type) of a typed failure; ``(500, "internal")`` for anything else."""
    for cls in type(exc).__mro__:
        if cls in PROBLEM_TYPES:
            return PROBLEM_TYPES[cls]
    return 500, "internal"
