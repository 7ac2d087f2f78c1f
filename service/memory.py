"""Keeping the server's resident set small: glibc allocator limits and returning freed memory after warm-up.

Where a server's memory goes (measured in docs/benchmarks/memory.md and docs/decisions.md): the libraries
(``import torch`` maps its CUDA libraries even on a CPU-only machine), the weights (one frozen CNN per distinct
:class:`~captioner.models.encoder.EncoderSpec`, shared, and a few MB to a few tens of MB per model:
``service/shared_encoders.py``), and — the part this module addresses — memory the allocator keeps after it was
freed.  Warm-up
runs the encoder at every batch size up to the largest, so its activations (tens of MB per layer at batch 16) are
allocated and freed; glibc raises its mmap threshold after such frees ("dynamic threshold") and from then on serves
large tensors from heap arenas it never returns to the system, one arena per thread that ever allocated.

* :func:`configure_allocator` pins the mmap threshold (large blocks are mapped and unmapped, never cached in an
  arena) and caps the number of arenas.  Call it before worker threads start.
* :func:`release_memory` runs the garbage collector and ``malloc_trim(0)``, which hands the free pages of every
  arena back to the kernel.  The app calls it once the models are warm, and :class:`IdleTrimmer` calls it when
  the batchers fall idle after work (at most once per interval): a burst of requests otherwise leaves hundreds of
  MB of freed blocks (decoded uploads, preprocessed pixels, ONNX Runtime's per-run buffers) in the arenas.

* :func:`page_out_gpu_libraries` hands back the pages of the CUDA libraries that ``import torch`` loads even on a
  machine without a GPU (PyPI's torch wheel links them: cuBLASLt, NVRTC, nvJitLink, ``libtorch_cuda``, …, about
  250 MB resident in a server, a quarter of its memory, that nothing on a CPU ever runs). The app calls it after
  warm-up where no CUDA device exists.

The allocator functions are no-ops where glibc is not the C library (musl, macOS).
"""

from __future__ import annotations

import ctypes
import gc
import logging
import threading
import time
from pathlib import Path
from typing import Callable

log = logging.getLogger("captioner.memory")
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8
#: blocks at least this large are mmapped (and returned on free): above every small tensor of a decoding step,
#: below the encoder's per-layer activations
MMAP_THRESHOLD_BYTES = 4 * 1024 * 1024
ARENA_MAX = 4


def _libc():
    # the symbols already loaded into this process, libc's among them (models/files.py reaches renameat2 so):
    # ctypes.util.find_library would run ldconfig in a child process at every release (about 10 ms)
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt, libc.malloc_trim  # noqa: B018 - glibc only: raise AttributeError elsewhere
        return libc
    except (OSError, AttributeError):
        return None


def configure_allocator(mmap_threshold: int = MMAP_THRESHOLD_BYTES, arena_max: int = ARENA_MAX) -> bool:
    """Pin glibc's mmap threshold (no dynamic growth) and cap its arenas; False where that is not possible."""
    libc = _libc()
    if libc is None:
        return False
    ok = bool(libc.mallopt(M_MMAP_THRESHOLD, int(mmap_threshold))) and bool(libc.mallopt(M_ARENA_MAX, int(arena_max)))
    # trim the heap top whenever this much is free at its end (the default, made explicit: setting the mmap
    # threshold switches off the dynamic adjustment of both)
    ok &= bool(libc.mallopt(M_TRIM_THRESHOLD, 2 * int(mmap_threshold)))
    return ok


def release_memory() -> int:
    """Collect garbage and return the allocator's free pages to the system; the resident set in bytes after."""
    gc.collect()
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
    return resident_bytes()


#: madvise(2) advice: reclaim these pages now (Linux 5.4+). Clean file-backed pages are dropped and read back
#: from the file if ever touched again; pages the process wrote (relocations) stay, as there is no swap to take
#: them: the advice never loses data, so it is safe on any mapping.
MADV_PAGEOUT = 21
#: the mappings :func:`page_out_gpu_libraries` pages out: NVIDIA's wheels (site-packages/nvidia/…, cuda-python's
#: bindings) and torch's own CUDA libraries
GPU_LIBRARY_PATTERNS = ("/nvidia/", "/cuda/bindings/", "libtorch_cuda", "libc10_cuda", "libcudnn", "libnccl",
                        "libcusparseLt", "libnvrtc", "libnvJitLink", "libcublas")


def gpu_library_ranges(maps_text: str, patterns: tuple[str, ...] = GPU_LIBRARY_PATTERNS) -> list[tuple[int, int]]:
    """The (start, end) address ranges of ``/proc/self/maps`` lines whose file matches one of ``patterns``."""
    ranges = []
    for line in maps_text.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and any(pattern in fields[5] for pattern in patterns):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


def page_out_gpu_libraries() -> int:
    """Advise the kernel to reclaim the resident pages of the CUDA libraries mapped into this process (call it only
    where no CUDA device exists: a page touched again is simply read back); the bytes of mappings advised, 0 where
    /proc or madvise is not available."""
    libc = _libc()
    if libc is None:
        return 0
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return 0
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    advised = 0
    for start, end in gpu_library_ranges(maps):
        if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_PAGEOUT) == 0:
            advised += end - start
    return advised


def freeze_startup_objects() -> int:
    """Move every object alive now (modules, weights, warm-up caches: hundreds of thousands of them) out of the
    cyclic garbage collector's reach, so that a full collection later (:class:`IdleTrimmer`'s, or one Python
    starts by itself) walks only what serving allocated since, instead of holding the GIL for a fifth of a second
    on a 2-core machine (400,000 objects) while every request waits; the number of objects frozen.
    :func:`gc.unfreeze` undoes it (the app does at shutdown)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class IdleTrimmer:
    """:func:`release_memory` on request, at most once per ``interval_s``: a request inside the interval is not
    dropped but deferred to its end, so the last one after a burst always runs.  Thread-safe (every batcher's
    worker calls it when it falls idle) and never raises; the release itself runs in a short-lived daemon thread.

    ``busy`` says whether work is running (the app's: a batcher or a thread-pool slot at work).  A deferred release
    that comes due while it is skips: ``malloc_trim`` holds each arena's lock while it returns that arena's pages,
    so a request allocating beside it would wait (docs/decisions.md, "Memory after a burst").  The work's own end
    asks again, so the last release after a burst still runs."""

    def __init__(self, interval_s: float = 5.0, busy: Callable[[], bool] = lambda: False):
        self.interval_s = interval_s
        self._busy = busy
        self._lock = threading.Lock()
        self._last = float("-inf")
        self._scheduled = False

    def __call__(self) -> None:
        with self._lock:
            if self._scheduled:
                return
            self._scheduled = True
            delay = max(0.0, self._last + self.interval_s - time.monotonic())
        timer = threading.Timer(delay, self._release)
        timer.daemon = True
        try:
            timer.start()
        except RuntimeError as exc:
            # no thread to be had now: the memory stays until the next call, which tries again (a caller is a
            # request finishing or a batcher's worker, neither of which this may fail)
            with self._lock:
                self._scheduled = False
            log.warning("could not start the memory release: %s", exc)

    def _release(self) -> None:
        with self._lock:
            self._scheduled = False
            if self._busy():
                return
            self._last = time.monotonic()
        release_memory()


def resident_bytes(pid: int | str = "self") -> int:
    """The resident set (VmRSS) of a process, in bytes (0 where /proc is not available)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
