"""Recent caption results, kept with their uploads so that the overlay endpoints can re-render any word in any
mode without running the model again."""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request

from captioner.models.inference import CaptionResult

from .errors import UnknownResult

#: random bytes of a result id (URL-safe base64): 128 bits, so ids cannot be guessed or enumerated
RESULT_ID_BYTES = 16


@dataclass
class StoredResult:
    result: CaptionResult
    upload: bytes
    created: float = field(default_factory=time.monotonic)


class ResultStore:
    """Recent results by random id, bounded three ways: the oldest go first once their uploads exceed
    ``max_bytes`` or there are more than ``max_count`` of them, and none is kept longer than ``max_age_s``.

    Eviction is by creation order (not by last use): reading a result never extends its life, so the age bound
    holds for every result, and the oldest entry is always at the front."""

    def __init__(self, max_bytes: int = 256 * 1024 * 1024, max_count: int = 1000, max_age_s: float = 3600.0,
                 clock=time.monotonic):
        self.max_bytes, self.max_count, self.max_age_s = max_bytes, max_count, max_age_s
        self._clock = clock
        self._items: OrderedDict[str, StoredResult] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def _evict(self, now: float) -> None:
        """Drop expired entries, then the oldest while over a bound (the newest one always stays)."""
        while self._items:
            oldest = next(iter(self._items.values()))
            over = self._bytes > self.max_bytes or len(self._items) > self.max_count
            if not (now - oldest.created > self.max_age_s or (over and len(self._items) > 1)):
                break
            _, old = self._items.popitem(last=False)
            self._bytes -= len(old.upload)

    def put(self, result: CaptionResult, upload: bytes) -> str:
        key = secrets.token_urlsafe(RESULT_ID_BYTES)
        with self._lock:
            now = self._clock()
            self._items[key] = StoredResult(result, upload, now)
            self._bytes += len(upload)
            self._evict(now)
        return key

    def get(self, key: str) -> StoredResult:
        with self._lock:
            self._evict(self._clock())
            item = self._items.get(key)
        if item is None:
            raise UnknownResult(f"no caption result with id {key!r} (results are kept for a limited time)")
        return item


def get_results(request: Request) -> ResultStore:
    return request.app.state.results


Results = Annotated[ResultStore, Depends(get_results)]
