"""Graceful shutdown: on SIGTERM stop admitting, let admitted requests finish, then exit 0.

Uvicorn's own SIGTERM handling closes the listening socket first, so a load balancer that still routes to the
process sees refused connections rather than a 503 it can retry elsewhere, and the process then dies by the
re-raised signal (exit code 143).  Here the order is:

0. A signal while the models load (before the server listens) exits at once, status 0: nothing is served yet.
1. SIGTERM (or SIGINT): :class:`ShutdownGate` starts draining at once.  ``/readyz`` and every new request answer
   503 with ``Retry-After`` (an RFC 9457 problem document); ``/healthz`` and ``/metrics`` keep answering, so the
   orchestrator does not mistake a draining process for a dead one.
2. Requests admitted before the signal run to the end, for at most ``CAPTIONER_DRAIN_TIMEOUT_S`` in total.
3. Then uvicorn's shutdown runs (close the socket and idle connections, the app's lifespan shutdown stops the
   batchers) and the process exits 0.  A second signal skips the wait: what still runs is cancelled at once (and
   answered with the 503 below), and the process exits by the signal (uvicorn's behaviour).
   A request still running when the drain time is up is cancelled by uvicorn; it is answered with the same 503
   problem (uvicorn's own answer would be a plain-text 500).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import multiprocessing
import os
import time
from types import FrameType
from typing import Any, Awaitable, Callable, NoReturn

import uvicorn
from starlette.requests import Request

from .errors import NOT_READY_RETRY_AFTER_S
from .inputs import DISCARD_BYTES, drain_body
from .paths import app_path
from .problems import StartNotingSend, send_problem

log = logging.getLogger("captioner.lifecycle")

#: paths that keep answering while draining: liveness and monitoring, never work
ALWAYS_OPEN = frozenset({"/healthz", "/metrics"})


class ShutdownGate:
    """Admission state shared by :class:`DrainMiddleware` (which counts and rejects requests) and
    :class:`DrainingServer` (which starts the drain on SIGTERM and waits for it)."""

    def __init__(self, retry_after_s: int = NOT_READY_RETRY_AFTER_S, on_drain: Callable[[], None] | None = None,
                 on_reject: Callable[[], None] | None = None):
        self.retry_after_s = retry_after_s
        self.on_drain = on_drain
        self.on_reject = on_reject
        # a plain flag: set from a signal handler, where neither locks nor the event loop may be touched
        self.draining = False
        self.drain_began: float | None = None  # time.monotonic() of the first begin_drain
        self.in_flight = 0

    def begin_drain(self) -> None:
        if self.drain_began is None:
            self.drain_began = time.monotonic()
        self.draining = True

    def time_left(self, budget_s: float) -> float:
        """What is left of a drain budget of ``budget_s`` seconds since the drain began (the whole budget when none
        has; at least 1 s): the shutdown that follows a drain must not wait the budget a second time."""
        if self.drain_began is None:
            return budget_s
        return max(1.0, budget_s - (time.monotonic() - self.drain_began))

    async def drain(self, timeout_s: float) -> bool:
        """Stop admitting (if not yet) and wait until no admitted request is running or ``timeout_s`` passed.
        Returns whether every admitted request finished."""
        self.begin_drain()
        if self.on_drain is not None:
            self.on_drain()
        deadline = time.monotonic() + timeout_s
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return self.in_flight == 0


class DrainMiddleware:
    """Pure ASGI: counts admitted HTTP requests and, once the gate drains, answers new ones with 503."""

    def __init__(self, app: Any, gate: ShutdownGate):
        self.app = app
        self.gate = gate

    async def __call__(self, scope: dict, receive: Callable[[], Awaitable[dict]],
                       send: Callable[[dict], Awaitable[None]]) -> None:
        if scope["type"] != "http" or app_path(scope) in ALWAYS_OPEN:
            await self.app(scope, receive, send)
            return
        if self.gate.draining:
            await self._reject(scope, receive, send)
            return
        self.gate.in_flight += 1
        noted = StartNotingSend(send)
        try:
            await self.app(scope, receive, noted)
        except asyncio.CancelledError:
            if not self.gate.draining or noted.started:
                raise
            # the drain time is up and uvicorn cancels what still runs: the client gets the drain's 503 problem
            # rather than uvicorn's plain-text 500, and the task ends here as cancelled work should
            await self._answer_503(scope, send, "the service shut down before the request finished; retry on "
                                                "another replica")
        finally:
            self.gate.in_flight -= 1

    async def _reject(self, scope: dict, receive: Callable[[], Awaitable[dict]],
                      send: Callable[[dict], Awaitable[None]]) -> None:
        if self.gate.on_reject is not None:
            self.gate.on_reject()
        await drain_body(Request(scope, receive), DISCARD_BYTES)
        await self._answer_503(scope, send, "the service is shutting down; retry on another replica")

    async def _answer_503(self, scope: dict, send: Callable[[dict], Awaitable[None]], detail: str) -> None:
        await send_problem(scope, send, 503, detail, kind="not-ready",
                           headers=[(b"retry-after", str(self.gate.retry_after_s).encode()), (b"connection", b"close")])


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first SIGTERM/SIGINT drains through the :class:`ShutdownGate` before uvicorn's
    shutdown starts, and which then exits normally (status 0) instead of re-raising the signal."""

    def __init__(self, config: uvicorn.Config, gate: ShutdownGate, drain_timeout_s: float):
        super().__init__(config)
        self.gate = gate
        self.drain_timeout_s = drain_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None
        self.skip_wait = False  # a second signal came

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.started:  # the models still load (a drain starts only once the server listens)
            self._exit_before_serving(sig)
        if self.gate.draining:
            # a second signal skips the rest of the wait: what still runs is cancelled at once (and answered with
            # the drain's 503) where uvicorn would first wait its graceful-shutdown timeout, longer than the drain;
            # then uvicorn's own handling (exit by the signal)
            self.skip_wait = True
            self.config.timeout_graceful_shutdown = 0
            if self.should_exit:  # uvicorn's shutdown is already waiting: stop that wait too
                self.force_exit = True
            super().handle_exit(sig, frame)
            return
        self.gate.begin_drain()
        # a fresh context: the signal may interrupt a request, whose context variables (request id) must not leak
        self._loop.call_soon_threadsafe(self._start_drain, sig, context=contextvars.Context())

    @staticmethod
    def _exit_before_serving(sig: int) -> NoReturn:
        """Exit at once, status 0, on a signal that comes while the models load: uvicorn only looks at it after
        start-up (minutes of ONNX exports, loading and warm-up), so ``docker stop`` and a pod's deletion ended in
        SIGKILL.  Nothing is served yet, so nothing is lost; an export being made in a child process is stopped
        (exports are written to a temporary folder and swapped in whole, so none is left half-written)."""
        log.info("signal %d during start-up: exiting before serving", sig)
        for child in multiprocessing.active_children():
            child.terminate()
        logging.shutdown()  # the log lines written so far reach their destination
        os._exit(0)

    def _start_drain(self, sig: int) -> None:
        self._drain_task = asyncio.get_running_loop().create_task(self._drain_then_exit(sig))

    async def _drain_then_exit(self, sig: int) -> None:
        started = time.monotonic()
        log.info("signal %d: draining (%d request(s) in flight, at most %g s)", sig, self.gate.in_flight,
                 self.drain_timeout_s)
        if not await self.gate.drain(self.drain_timeout_s):
            log.warning("drain timeout of %g s passed with %d request(s) still running; they are cancelled",
                        self.drain_timeout_s, self.gate.in_flight)
        # what is left of the drain budget bounds uvicorn's wait for connections (at least 1 s to close them), unless
        # a second signal asked for no wait at all
        if not self.skip_wait:
            self.config.timeout_graceful_shutdown = max(1.0, self.drain_timeout_s - (time.monotonic() - started))
        log.info("drained in %.2f s; shutting down", time.monotonic() - started)
        self.should_exit = True
