"""The captioning use case: one uploaded image and its options → a :class:`~captioner.models.inference.CaptionResult`.

Model choice (the request's, else the service default), option limits, decoding and preprocessing the image in the
thread pool (never on the event loop), the model's batcher under the request deadline, and the request latency metric
(:func:`observed_request`, around the whole request).  Every failure the client caused or can retry leaves as a
typed exception of ``errors.py`` (or the image decoder's :class:`~captioner.models.images.ImageDecodeError`); an
error raised by the model itself is a bug and leaves as it is (the app answers it 500 ``internal``).  Nothing here
knows about HTTP beyond the status label of the metric.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

from PIL import Image
from starlette.concurrency import run_in_threadpool

from captioner.models.decoding import DecodingRules
from captioner.models.images import decode_cost, load_image, open_image
from captioner.models.inference import CaptionResult, ModelInfo, Prepared, Runtime

from .batcher import BeamTooWide, DeadlineExceeded, NotAccepting, QueueFull
from .result_cache import CacheKey, content_digest
from .errors import (CLIENT_GONE, DeadlinePassed, InvalidRequest, NotReady, Overloaded, UnknownModel,
                     problem_type)
from .settings import Settings
from .state import ServiceState

#: the model label of a request naming no loaded model: a label per name a client makes up would grow the
#: metrics without bound
UNKNOWN_MODEL_LABEL = "unknown"


@dataclass(frozen=True)
class CaptionParameters:
    """How a request asks to be captioned, each None for the default: the model (the service's default), the beam
    width and caption length (the settings' defaults) and the decoding rules (the model's own
    :class:`~captioner.models.decoding.DecodingRules`).  The HTTP layer translates its wire options into these
    (``inputs.py``), so this use case knows nothing of how a request spelled them."""

    model: str | None = None
    beam_size: int | None = None
    max_len: int | None = None
    length_penalty: float | None = None
    block_trigrams: bool | None = None
    block_doubled_words: bool | None = None


@dataclass
class CaptionRequest:
    """An uploaded image (encoded bytes, not yet decoded) and the parameters it came with (``inputs.py`` reads them
    from any body format)."""

    data: bytes
    options: CaptionParameters


def remaining_s(settings: Settings, started: float) -> float:
    """Seconds left of the request deadline counted from ``started``."""
    return settings.request_timeout_s - (time.monotonic() - started)


def model_label(state: ServiceState, name: str | None) -> str:
    """The ``model`` label of a request's metrics: the model it named (or the default), if loaded."""
    name = name or state.default_model
    return name if name in state.runtimes else UNKNOWN_MODEL_LABEL


@contextmanager
def observed_request(state: ServiceState, arrived: float, model: Callable[[], str | None]) -> Iterator[None]:
    """The latency metric of one caption request, whatever ends it: an answer, a refusal before or after its body
    was read, or its client leaving; ``model`` names the model it asked for once it ends."""
    status = 200
    try:
        yield
    except asyncio.CancelledError:
        status = CLIENT_GONE
        state.metrics.rejected("client-gone")
        raise
    except Exception as exc:
        # typed failures are counted by reason where they are answered (install_problem_handlers)
        status = problem_type(exc)[0]
        raise
    finally:
        state.metrics.observe_request(model_label(state, model()), status, time.monotonic() - arrived)


def observe_invalid(state: ServiceState, arrived: float, model: str | None) -> None:
    """The latency metric of a caption request that FastAPI refused before the use case saw it (a query option that
    does not validate: 422), which :func:`observed_request` therefore never observed."""
    state.metrics.observe_request(model_label(state, model), 422, time.monotonic() - arrived)


def ensure_ready(state: ServiceState) -> None:
    if not state.ready:
        raise NotReady("the service is starting or shutting down")


def search_size(settings: Settings, options: CaptionParameters) -> tuple[int, int]:
    """The beam width and caption length a request asks for, the service's defaults where it names none; one above
    the service's limit is refused with a 422 naming it."""
    beam, length = options.beam_size or settings.default_beam_size, options.max_len or settings.default_max_len
    for option, value, limit in (("beam_size", beam, settings.max_beam_size),
                                 ("max_len", length, settings.max_max_len)):
        if value > limit:
            raise InvalidRequest(f"{option} {value} is above the limit of {limit}",
                                 [{"loc": [option], "msg": f"above the limit of {limit}"}])
    return beam, length


def refuse_early(state: ServiceState, options: CaptionParameters | None, arrived: float) -> None:
    """Before a request's body is read: 503 while not ready and, when its options name its model and the body
    cannot change them, 422 for a beam or length above the limits and 429 if that model's batcher would refuse it
    now — under overload, reading and parsing the body of a request that is then refused takes event-loop time
    from the admitted ones.  (Every request is checked again once its body is read.)"""
    ensure_ready(state)
    batcher = state.batchers.get(options.model) if options is not None and options.model else None
    if batcher is not None:
        settings = state.settings
        beam, length = search_size(settings, options)
        with batcher_errors(settings):
            batcher.check_admission(remaining_s(settings, arrived), beam, length)


def pick_model(state: ServiceState, name: str | None) -> str:
    name = name or state.default_model
    if name not in state.batchers:
        if not state.batchers:
            raise NotReady("no model is loaded")
        raise UnknownModel(f"unknown model {name!r}; available: {', '.join(sorted(state.batchers))}")
    return name


def loaded_models(state: ServiceState) -> list[tuple[ModelInfo, bool]]:
    """Every loaded model's description (:meth:`~captioner.models.inference.Runtime.info`) and whether it is the
    default."""
    return [(runtime.info(), name == state.default_model) for name, runtime in state.runtimes.items()]


def decoding_rules(runtime: Runtime, options: CaptionParameters) -> DecodingRules:
    """The request's length penalty, trigram and doubled-word blocking, each defaulting to the model's own
    (:attr:`~captioner.models.inference.Runtime.default_rules`)."""
    return runtime.default_rules.overridden_by(options)


def decode_and_prepare(runtime: Runtime, opened: Image.Image) -> Prepared:
    """Runs in the thread pool: decoding the pixels of an upload :func:`~captioner.models.images.open_image`
    opened, and preprocessing them, never block the event loop."""
    return runtime.prepare(load_image(opened))


@contextmanager
def batcher_errors(settings: Settings) -> Iterator[None]:
    """The batcher's refusals and failures as the service's typed errors."""
    try:
        yield
    except QueueFull as exc:  # also WouldMissDeadline: refused now rather than a 504 later
        retry_after = settings.retry_after_s if exc.retry_after_s is None else int(exc.retry_after_s)
        raise Overloaded(str(exc), max(retry_after, settings.retry_after_s)) from None
    except NotAccepting:
        raise NotReady("the service is starting or shutting down") from None
    except DeadlineExceeded:
        raise DeadlinePassed(f"captioning took longer than {settings.request_timeout_s:g} s") from None
    except BeamTooWide as exc:  # only this ValueError: one raised while decoding is a bug, a 500, not the client's
        raise InvalidRequest(str(exc)) from None


@contextmanager
def slot_deadline(settings: Settings, waiting: str) -> Iterator[None]:
    """A wait for a work slot (:class:`~captioner.service.work_slots.WorkSlots` raises :class:`TimeoutError`) that
    outlasts the request deadline, as the service's 504; ``waiting`` says for what ("the upload waited to be
    decoded")."""
    try:
        yield
    except TimeoutError:
        raise DeadlinePassed(f"the {settings.request_timeout_s:g} s request deadline passed while {waiting}") from None


async def caption_image(state: ServiceState, request: CaptionRequest, arrived: float | None = None,
                        check: Callable[[Runtime, int], None] = lambda runtime, max_len: None) -> CaptionResult:
    """Caption one uploaded image with its model's batcher, within the request deadline counted from ``arrived``
    (the request's arrival, ``time.monotonic()``; default: now).  ``check`` may refuse the request, given the
    runtime of the model it names and its caption length limit, before that model runs."""
    started = time.monotonic() if arrived is None else arrived
    settings, options = state.settings, request.options
    ensure_ready(state)
    name = pick_model(state, options.model)
    beam, length = search_size(settings, options)
    check(state.runtimes[name], length)
    rules = decoding_rules(state.runtimes[name], options)
    cache, key = state.result_cache, None
    if cache is not None and cache.enabled:
        key = CacheKey(await run_in_threadpool(content_digest, request.data), name, beam, length, rules)
        cached = cache.get(key)
        state.metrics.result_cache_lookup(name, cached is not None)
        if cached is not None:  # decoding is deterministic: the same bytes and options give this result
            return cached
    result = await _run_model(state, name, request.data, beam, length, rules, started)
    if key is not None:
        cache.put(key, result)
    return result


async def _run_model(state: ServiceState, name: str, data: bytes, beam: int, length: int, rules: DecodingRules,
                     started: float) -> CaptionResult:
    """The upload through model ``name``: admission, the image decoded in a work slot, then its rows in the batcher,
    all within the deadline counted from ``started``."""
    settings, batcher = state.settings, state.batchers[name]
    with batcher_errors(settings):
        # a request the batcher would refuse is refused before its image is decoded (under overload that
        # decoding is CPU time taken from the admitted requests)
        batcher.check_admission(remaining_s(settings, started), beam, length)
    # the header is parsed once, in a worker thread too: a JPEG of millions of empty markers takes Pillow seconds to
    # scan, which on the event loop stalled every other request (and the liveness probe) meanwhile; the decode goes
    # on from the opened image (opening the bytes again there scanned the header twice). An upload that is no
    # image, or is above the pixel limit, is refused here, before it waits for a decode slot
    opened = await run_in_threadpool(open_image, data, settings.max_pixels)
    with slot_deadline(settings, "the upload waited to be decoded"):
        prepared = await state.decode_slots.run(decode_and_prepare, state.runtimes[name], opened,
                                                cost=decode_cost(opened),
                                                timeout=remaining_s(settings, started))
    remaining = remaining_s(settings, started)
    if remaining <= 0:  # spent reading and decoding the upload: the rows are not given to it
        raise DeadlinePassed(f"the {settings.request_timeout_s:g} s request deadline passed before captioning "
                             "began (reading and decoding the upload took it)")
    with batcher_errors(settings):
        return await batcher.caption(prepared, beam, length, remaining, rules)
