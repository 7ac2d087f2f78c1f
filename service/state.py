"""The state of one app instance (settings, loaded runtimes, their batchers, metrics, readiness), handed to the
routes with FastAPI ``Depends``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request

from captioner.models.inference import Runtime

from .batcher import Batcher
from .metrics import Metrics
from .result_cache import ResultCache
from .settings import Settings
from .work_slots import UNLIMITED, UploadBudget, WorkSlots


@dataclass
class ServiceState:
    settings: Settings
    runtimes: dict[str, Runtime] = field(default_factory=dict)
    batchers: dict[str, Batcher] = field(default_factory=dict)
    metrics: Metrics = field(default_factory=Metrics)
    ready: bool = False
    #: the model of requests that name none: ``settings.default_model``, or the first loaded model when that one
    #: is missing (resolved at start-up; the settings themselves are never changed)
    default_model: str = ""
    result_cache: ResultCache | None = None
    #: why loading the models in the background failed (``load_in_background``); None while it has not
    load_failure: str | None = None
    #: bounded thread-pool work (work_slots.py): decoding uploads, rendering overlays; made at start-up
    decode_slots: WorkSlots = field(default_factory=lambda: WorkSlots(1))
    render_slots: WorkSlots = field(default_factory=lambda: WorkSlots(1))
    #: the bytes of the uploads being received at once (inputs.py); made at start-up
    upload_budget: UploadBudget = field(default_factory=lambda: UNLIMITED)
    #: returns freed memory to the system when work runs out (memory.py's IdleTrimmer; None: never)
    on_idle: Callable[[], None] | None = None

    def __post_init__(self) -> None:
        self.default_model = self.default_model or self.settings.default_model
        if self.result_cache is None:
            self.result_cache = ResultCache(self.settings.result_cache_entries)

    def at_work(self) -> bool:
        """Whether a batcher or a thread-pool slot is at work: the idle trimmer's release waits for none (memory.py).
        Read from the trimmer's thread, so the batchers are copied first (one C call: a model starting adds one)."""
        return (self.decode_slots.running > 0 or self.render_slots.running > 0
                or any(not batcher.idle for batcher in tuple(self.batchers.values())))


def get_state(request: Request) -> ServiceState:
    return request.app.state.service


State = Annotated[ServiceState, Depends(get_state)]
