"""App factory: ``create_app(settings)`` loads checkpoints in the lifespan handler and wires the layers
routes → batcher → runtime → model."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from typing import AsyncIterator

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from models.device import set_threads

from .batcher import Batcher
from .overlay import ResultStore
from .overlay import router as overlay_router
from .problems import install_problem_handlers
from .routes import ServiceState, router
from .runtime import load_runtimes
from .settings import Settings

log = logging.getLogger("captioner.app")
STATIC = Path(__file__).parent / "static"


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state: ServiceState = app.state.service
        set_threads(settings.threads)
        state.runtimes = load_runtimes(settings.weights_dir, settings.checkpoints, settings.device)
        if not state.runtimes:
            log.error("no checkpoint found in %s: every caption request will get 503", settings.weights_dir)
        elif settings.default_model not in state.runtimes:
            fallback = sorted(state.runtimes)[0]
            log.warning("default model %r not found; using %r", settings.default_model, fallback)
            settings.default_model = fallback
        for name, runtime in state.runtimes.items():
            state.batchers[name] = Batcher(runtime, settings.max_batch_images, settings.queue_size)
            state.batchers[name].start()
        state.ready = True
        yield
        state.ready = False
        for batcher in state.batchers.values():
            await batcher.stop()

    app = FastAPI(title="Attention captioner", version="0.1.0", lifespan=lifespan,
                  description="Captions with per-word attention heatmaps from published attention captioners.")
    app.state.service = ServiceState(settings=settings)
    app.state.results = ResultStore(settings.results_cache_bytes)
    install_problem_handlers(app)
    app.include_router(router)
    app.include_router(overlay_router)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/", include_in_schema=False)
    async def demo_page() -> FileResponse:
        return FileResponse(STATIC / "index.html")

    return app
