"""A bounded cache of finished captions, keyed by (SHA-256 of the uploaded bytes, model, beam size, max length,
decoding rules).

Decoding is deterministic for a given model, image and options, so a retry or a duplicate upload can be answered
from the cache without touching the batcher.  It is bounded by entry count (least recently used go first) and off
when ``CAPTIONER_RESULT_CACHE_ENTRIES`` is 0.  Each cached :class:`~captioner.models.inference.CaptionResult` holds
the caption's attention maps (steps × visual items floats), so its memory is roughly entries × a few tens of KiB.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from typing import NamedTuple

from captioner.models.decoding import DecodingRules
from captioner.models.inference import CaptionResult


class CacheKey(NamedTuple):
    digest: str
    model: str
    beam_size: int
    max_len: int
    rules: DecodingRules


def content_digest(data: bytes) -> str:
    """SHA-256 of the upload (hashlib releases the GIL on large buffers: fine in the thread pool)."""
    return hashlib.sha256(data).hexdigest()


class ResultCache:
    def __init__(self, max_entries: int):
        self.max_entries = max_entries
        self._items: OrderedDict[CacheKey, CaptionResult] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: CacheKey) -> CaptionResult | None:
        with self._lock:
            result = self._items.get(key)
            if result is not None:
                self._items.move_to_end(key)
            return result

    def put(self, key: CacheKey, result: CaptionResult) -> None:
        if not self.enabled:
            return
        with self._lock:
            self._items[key] = result
            self._items.move_to_end(key)
            while len(self._items) > self.max_entries:
                self._items.popitem(last=False)
