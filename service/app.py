"""App factory: ``create_app(settings)`` loads checkpoints in the lifespan handler and wires the layers
routes → use case (captioning) → batcher → runtime → model.

Start-up: set thread counts, then for each checkpoint in turn load it (PyTorch or ONNX Runtime per model; on a first
start, once the preparing child has made its ONNX exports, while the child goes on to the next), start its batcher
and warm it up over the encoder batch sizes it will use; then report ready.  With
``load_in_background`` this happens after the server starts listening, so ``/healthz`` answers at once while
``/readyz`` and caption requests answer 503 until the models are warm.  Shutdown: stop reporting ready, let
every batcher drain its queued and running requests (up to ``drain_timeout_s``), then stop.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import importlib.metadata
import logging
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import torch
from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool

from captioner.models.device import set_threads
from captioner.models.inference import Runtime

from .batcher import Batcher
from .captioning import observe_invalid
from .inputs import UnreadBodyMiddleware, arrival, known_query_only
from .lifecycle import DrainMiddleware, ShutdownGate
from .memory import IdleTrimmer, configure_allocator, freeze_startup_objects, page_out_gpu_libraries, release_memory
from .middleware import HeadAsGetMiddleware, RequestContextMiddleware, configure_logging
from .overlay import router as overlay_router
from .paths import AppRootMiddleware, app_path
from .problem_pages import install_problem_pages
from .problems import install_problem_handlers
from .results import ResultStore
from .routes import router
from .runtime import PreparingChild, iter_runtimes
from .onnx_exports import unprepared
from .openapi import install_docs, install_openapi
from .security import install_security
from .settings import Settings
from .state import ServiceState
from .work_slots import UploadBudget, WorkSlots
from .warmup import warm_up

log = logging.getLogger("captioner.app")
#: the caption endpoints (routes.py, overlay.py), whose every request the latency metric counts
CAPTION_PATHS = frozenset({"/caption", "/caption/overlay", "/caption/heatmaps"})
STATIC = Path(__file__).parent / "static"


def _observe_if_caption(app: FastAPI, request: Request) -> None:
    if app_path(request.scope) in CAPTION_PATHS:
        observe_invalid(app.state.service, arrival(request), request.query_params.get("model"))


async def start_models(app: FastAPI, settings: Settings) -> None:
    state: ServiceState = app.state.service
    found = (settings.weights_dir, settings.checkpoints)
    placed, run = settings.model_placement(), settings.model_loading()
    runtimes: dict[str, Runtime] = {}
    async with _prepared_first(settings, unprepared(*found, **placed), run) as wait_for:
        # each model is loaded and warmed up as soon as the child is done with it, while it prepares the next
        loading = iter_runtimes(*found, before_each=wait_for, **run)
        while (loaded := await run_in_threadpool(next, loading, None)) is not None:
            name, runtime = loaded
            runtimes[name] = runtime
            await _start_batcher(state, settings, name, runtime)
    if not runtimes:
        log.error("no checkpoint found in %s: every caption request will get 503",
                  ", ".join(settings.checkpoint_folders()))
    elif settings.default_model not in runtimes:
        fallback = sorted(runtimes)[0]
        log.warning("default model %r not found; using %r", settings.default_model, fallback)
        state.default_model = fallback
    state.runtimes = runtimes
    # frozen first, so that release_memory's own collection walks only what is left (next to nothing)
    log.info("%d start-up objects frozen out of the garbage collector", freeze_startup_objects())
    if settings.release_memory:  # hand warm-up's freed activations back to the system (memory.py)
        if settings.page_out_gpu_libraries and not torch.cuda.is_available():  # and the CUDA libraries' pages,
            # which nothing can run on this machine
            await run_in_threadpool(page_out_gpu_libraries)
        log.info("resident set after warm-up: %.0f MiB", await run_in_threadpool(release_memory) / 2**20)
    state.ready = True
    state.metrics.ready.set(1)
    log.info("ready: %s", ", ".join(f"{n} ({r.backend})" for n, r in runtimes.items()) or "no models")


@asynccontextmanager
async def _prepared_first(settings: Settings, missing: list[str],
                          loading: dict[str, Any]) -> AsyncIterator[Callable[[str], None]]:
    """The wait for a model's first-start preparation: the models ``missing`` names are prepared by a
    :class:`~.runtime.PreparingChild` (its ``wait_for``) with the ``loading`` options the server loads them with,
    the others need no wait.  When the block fails (a warm-up, a shutdown during start-up) the child is ended, not
    waited for."""
    if not missing:
        yield lambda name: None
        return
    log.info("first start of %s: their ONNX exports are made in a child process", ", ".join(missing))
    child = await run_in_threadpool(functools.partial(
        PreparingChild, settings.weights_dir, settings.checkpoints, only=missing,
        set_up_logging=functools.partial(configure_logging, settings.log_format, settings.log_level),
        **loading))
    try:
        yield child.wait_for
    except BaseException:
        child.stop()
        raise
    await run_in_threadpool(child.join)


async def _start_batcher(state: ServiceState, settings: Settings, name: str, runtime: Runtime) -> None:
    """Start the batcher of model ``name`` and warm it up (when the settings say so)."""
    batcher = Batcher(runtime, settings.max_batch_images, settings.queue_size, settings.max_rows, state.metrics,
                      on_idle=state.on_idle, overlap_encoding=settings.overlap_encoding)
    batcher.start()
    state.batchers[name] = batcher  # before warm-up, so that shutdown stops it even when warm-up fails
    if settings.warmup:
        await warm_up(batcher, settings)


def _note_load_failure(state: ServiceState, loading: asyncio.Task) -> None:
    """A model load in the background that failed is logged at once, and ``/healthz`` turns 503 from then on so
    that an orchestrator restarts the process (otherwise it would stay live and never ready, silently)."""
    if loading.cancelled() or loading.exception() is None:
        return
    exc = loading.exception()
    state.load_failure = f"loading the models failed: {type(exc).__name__}: {exc}"
    log.error("%s; /healthz now answers 503", state.load_failure, exc_info=exc)


@asynccontextmanager
async def _lifespan(app: FastAPI, settings: Settings) -> AsyncIterator[None]:
    """The app's lifespan (module docstring): the work limits, thread counts and models on start-up, in the
    background with ``load_in_background``; on shutdown, not ready, and every batcher drained and stopped."""
    state: ServiceState = app.state.service
    # made here, in the loop that serves: what a burst of captions, decodes or renders leaves in the allocator
    # goes back to the system once that work runs out (memory.py)
    state.on_idle = IdleTrimmer(busy=state.at_work) if settings.release_memory else None
    state.decode_slots = WorkSlots(settings.decode_pixels, state.on_idle)
    state.render_slots = WorkSlots(settings.render_concurrency, state.on_idle)
    state.upload_budget = UploadBudget(settings.upload_budget_bytes, settings.retry_after_s)
    state.metrics.watch_pressure(lambda: app.state.shutdown_gate.in_flight, lambda: state.upload_budget.held,
                                 {"decode": state.decode_slots, "render": state.render_slots})
    set_threads(settings.threads, settings.interop_threads)
    loading = None
    try:  # the batchers started are stopped however the app ends: a failed start in the foreground too
        if settings.load_in_background:
            loading = asyncio.create_task(start_models(app, settings))
            loading.add_done_callback(functools.partial(_note_load_failure, state))
        else:
            await start_models(app, settings)
        yield
    finally:
        state.ready = False
        state.metrics.ready.set(0)
        if loading is not None and not loading.done():
            loading.cancel()
            await asyncio.gather(loading, return_exceptions=True)
        # after a SIGTERM drain, only what is left of its budget: the pod's grace period counts both
        budget = app.state.shutdown_gate.time_left(settings.drain_timeout_s)
        await asyncio.gather(*(b.stop(budget) for b in state.batchers.values()))
        gc.unfreeze()  # what start-up froze is collectable again (an app made and closed in a longer process)


def create_app(settings: Settings | None = None) -> FastAPI:
    """The service for ``settings`` (default: ``Settings()``): its state, error handlers, middleware, routes and
    demo page; the models are loaded by its lifespan (:func:`_lifespan`)."""
    settings = settings or Settings()
    if settings.release_memory:
        configure_allocator()  # before the batchers' threads exist: arenas are created per thread
    # the installed distribution's version (pyproject.toml), so /openapi.json moves with each release
    app = FastAPI(title="Attention captioner", version=importlib.metadata.version("attention-captioner"),
                  docs_url=None, redoc_url=None,
                  lifespan=functools.partial(_lifespan, settings=settings),
                  description="Captions with per-word attention heatmaps from published attention captioners.",
                  license_info={"name": "MIT", "identifier": "MIT"},
                  # operation ids are the route functions' names (caption, get_overlay, ...): what a generated
                  # client names its methods, kept when a path changes (FastAPI's own join name, path and method)
                  generate_unique_id_function=lambda route: route.name,
                  # /models/ is a 404 problem like any path the API does not have: Starlette's 307 to /models named
                  # the host the client sent (an internal name behind a proxy) and made a POST send its upload again
                  redirect_slashes=False)
    app.state.service = ServiceState(settings=settings)
    app.state.results = ResultStore(settings.results_cache_bytes, settings.results_max_count,
                                    settings.results_max_age_s)
    install_problem_handlers(app, on_problem=lambda request, status, kind: app.state.service.metrics.rejected(kind),
                             on_invalid=functools.partial(_observe_if_caption, app))
    # graceful shutdown (lifecycle.py): SIGTERM flips /readyz and new requests to 503 before anything else stops;
    # added before RequestContextMiddleware so that the access log still records the 503s
    app.state.shutdown_gate = ShutdownGate(on_drain=lambda: app.state.service.metrics.ready.set(0),
                                           on_reject=lambda: app.state.service.metrics.rejected("not-ready"))
    app.add_middleware(DrainMiddleware, gate=app.state.shutdown_gate)
    # API keys, CORS and security headers (security.py), inside the request-id middleware so 401s are logged
    install_security(app, settings.api_keys, settings.cors_origins)
    # a body the answer did not need is read before the answer starts (behind nginx, a reset was its 502)
    app.add_middleware(UnreadBodyMiddleware)
    app.add_middleware(HeadAsGetMiddleware)  # inside the access log, which writes the method the client sent
    app.add_middleware(RequestContextMiddleware)
    app.add_middleware(AppRootMiddleware)  # outermost: the app's own prefix, before any mount adds to root_path
    for routes in (router, overlay_router):
        app.include_router(routes, dependencies=[Depends(known_query_only)])
    # every error documented as a problem document, and this server's limits of the options (openapi.py)
    install_openapi(app, {"beam_size": (settings.default_beam_size, settings.max_beam_size),
                          "max_len": (settings.default_max_len, settings.max_max_len)}, settings.root_path)
    install_docs(app)
    install_problem_pages(app)
    static = StaticFiles(directory=STATIC)
    app.mount("/static", static, name="static")

    @app.get("/", include_in_schema=False)
    async def demo_page(request: Request) -> Response:
        # as the mount answers its files: a browser's If-None-Match or If-Modified-Since gets a 304
        return await static.get_response("index.html", request.scope)

    return app
