"""Warm-up: the first requests a batcher serves are the service's own, so that clients never pay first-use costs.
Shared by the app's start-up (``app.py``) and the archive command (``archive.py``), so both engines start alike."""

from __future__ import annotations

from PIL import Image
from starlette.concurrency import run_in_threadpool

from .batcher import Batcher
from .settings import Settings

WARMUP_TIMEOUT_S = 600.0


def warmup_sizes(max_batch: int, factor: int = 2) -> list[int]:
    """Encoder batch sizes to run once before serving: the powers of ``factor`` below ``max_batch``, and
    ``max_batch``."""
    sizes, n = [], 1
    while n < max_batch:
        sizes.append(n)
        n *= factor
    return sizes + [max_batch]


async def warm_up(batcher: Batcher, settings: Settings) -> None:
    """Send the batcher requests shaped like real traffic under ``settings`` (each encoder batch size, the default
    beam) through the normal path, so that first-use costs (allocator growth, kernel selection, ONNX Runtime
    arenas) are paid before the first client arrives; :meth:`Batcher.calibrate <.batcher.Batcher.calibrate>` runs
    them and measures the batcher on them."""
    runtime = batcher.runtime
    prepared = await run_in_threadpool(runtime.prepare, Image.new("RGB", (runtime.spec.image_size,) * 2, (127,) * 3))
    beam = min(settings.default_beam_size, settings.max_rows)
    # the worker never encodes more images at once than fit the rows, the batch limit or the queue
    largest = min(settings.max_batch_images, max(1, settings.max_rows // beam), settings.queue_size)
    # A runtime that pads its CNN's batches to powers of two (a GPU's) meets each as a new shape, whose first run must
    # not be a client's (cuDNN's kernel choice, about 2 s each). One that does not pad (a CPU's) meets no such stall,
    # and its warm-up only chooses the encoder batch, for which every other power of two is enough: each size is run
    # twice, and the sizes are most of a start's time per model (docs/decisions.md, "A CPU's warm-up at powers of four")
    sizes = warmup_sizes(largest, 2 if runtime.pad_batches else 4)
    # the request deadline does not apply (a tiny CAPTIONER_REQUEST_TIMEOUT_S must not fail the start-up)
    await batcher.calibrate(prepared, beam, sizes, timeout_s=WARMUP_TIMEOUT_S, calibrate_len=settings.default_max_len)
