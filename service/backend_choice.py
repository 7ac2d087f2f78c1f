"""Which backend serves each model: the one its settings ask for (:func:`chosen_backend`), and for ``auto``
(the default) the fastest of ``onnx``, ``hybrid`` and ``torch`` whose captions equal the PyTorch ones on a check set
of a few generated images (:func:`check_images`): on a CPU ``onnx``, else ``hybrid``, else ``torch`` (measured once,
in the benchmarks); on a GPU, timed on the check set at start-up (:func:`fastest_verified`).  PyTorch's captions of
the check set are recorded once per weights (:func:`reference_captions`), so that a later start verifies without
the PyTorch CNN.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from typing import Callable

import numpy as np
import torch
from PIL import Image, ImageDraw

from captioner.models.checkpoint import Checkpoint
from captioner.models.export.sessions import cuda_provider_available
from captioner.models.files import write_atomically
from captioner.models.inference import Prepared, Runtime, TorchRuntime

from .onnx_backends import HybridRuntime, NoCudaProvider, OnnxRuntime, drop_torch_weights
from .onnx_exports import onnx_folder, reference_record
from .shared_encoders import SharedEncoders

log = logging.getLogger("captioner.runtime")  # the loader's logger, whose records these are
#: the check set of ``auto``: this many generated images, captioned with this beam and length by each backend
CHECK_IMAGES, CHECK_BEAM, CHECK_MAX_LEN = 3, 3, 20


def check_images(count: int = CHECK_IMAGES) -> list[Image.Image]:
    """Generated check images for ``auto``: coloured shapes on textured backgrounds, the same on every start."""
    rng = np.random.default_rng(20240)
    images = []
    for _ in range(count):
        width, height = (int(v) for v in rng.integers(200, 400, 2))
        base = rng.integers(0, 256, 3)
        noise = rng.normal(0, 20, (height, width, 3))
        image = Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8))
        draw = ImageDraw.Draw(image)
        for _ in range(int(rng.integers(1, 4))):
            x1, y1 = int(rng.integers(0, width // 2)), int(rng.integers(0, height // 2))
            x2, y2 = x1 + int(rng.integers(30, width // 2)), y1 + int(rng.integers(30, height // 2))
            shape = draw.ellipse if rng.random() < 0.5 else draw.rectangle
            shape((x1, y1, x2, y2), fill=tuple(int(c) for c in rng.integers(0, 256, 3)))
        images.append(image)
    return images


def check_captions(runtime: Runtime, prepared: list[Prepared]) -> list[list[int]]:
    """The token ids ``runtime`` gives the check set (beam ``CHECK_BEAM``, ``CHECK_MAX_LEN`` tokens)."""
    return [result.hypothesis.token_ids for result in runtime.caption(prepared, CHECK_BEAM, CHECK_MAX_LEN)]


def reference_captions(name: str, ckpt: Checkpoint, encoders: SharedEncoders,
                       prepared: list[Prepared]) -> list[list[int]]:
    """PyTorch's token ids on the check set, as recorded in ``onnx_dir/.reference/<weights identity>.json`` when the
    record matches this torch version, device type and check set; otherwise computed (which needs the PyTorch
    encoder) and recorded.  The record is what lets a server with current exports start without the PyTorch CNN."""
    from captioner.models.export.onnx import export_identity

    digest = hashlib.sha256()
    for item in prepared:
        digest.update(item.pixels.numpy().tobytes())
    key = {"torch": torch.__version__, "device": encoders.device.type, "beam": CHECK_BEAM, "max_len": CHECK_MAX_LEN,
           "images": digest.hexdigest()}
    record = reference_record(encoders.onnx_dir, export_identity(ckpt.checksum, ckpt.encoder))
    try:
        data = json.loads(record.read_text())
        if data.get("key") == key:
            return data["token_ids"]
    except (OSError, ValueError, AttributeError, KeyError):
        pass
    want = check_captions(TorchRuntime(name, ckpt, encoders.pytorch(ckpt.encoder), encoders.device), prepared)
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(record, json.dumps({"key": key, "token_ids": want}))  # readers never see half a record
    except OSError as exc:  # a read-only cache: computed again at the next start
        log.info("%s: cannot record the check set's reference captions (%s)", name, exc)
    return want


def check_seconds(runtime: Runtime, prepared: list[Prepared], repeats: int = 2) -> float:
    """Seconds ``runtime`` takes to caption the check set, best of ``repeats`` after its first (verifying) run,
    between device synchronisations."""
    timings = []
    for _ in range(repeats):
        runtime.synchronize()
        started = time.perf_counter()
        check_captions(runtime, prepared)
        runtime.synchronize()
        timings.append(time.perf_counter() - started)
    return min(timings)


def fastest_verified(name: str, ckpt: Checkpoint, encoders: SharedEncoders, threads: int | None,
                     measure: bool | None = None) -> Runtime:
    """``auto``: among the backends whose captions equal PyTorch's on the check set (an export that cannot be made
    or disagrees is logged and skipped), the fastest.  On a CPU that is ONNX Runtime for the whole model, else the
    hybrid, else PyTorch, in that order (measured once: docs/benchmarks/serving.md, ONNX Runtime's CNN is markedly
    faster); on a GPU (``measure``, default: the device is CUDA) nothing is known in advance, so every verified
    backend and PyTorch caption the check set again, timed (:func:`check_seconds`), and the fastest serves.  A
    model served by ONNX Runtime alone has its PyTorch weights dropped."""
    device = encoders.device
    measure = device.type == "cuda" if measure is None else measure
    if device.type == "cuda" and not cuda_provider_available(device):
        # ONNX Runtime without its CUDA provider would run the CNN on the CPU beside an idle GPU
        log.info("%s: ONNX Runtime has no CUDA execution provider here; PyTorch on %s", name, device)
        return TorchRuntime(name, ckpt, encoders.pytorch(ckpt.encoder), device)
    prepared = [Prepared.of(image, ckpt.encoder) for image in check_images()]
    want = _wanted_captions(name, ckpt, encoders, prepared)
    candidates = (("onnx", lambda: OnnxRuntime(name, ckpt, onnx_folder(encoders, name, ckpt), device, threads,
                                               encoders.onnx(ckpt.encoder))),
                  ("hybrid", lambda: HybridRuntime(name, ckpt, encoders.onnx(ckpt.encoder), device)))
    verified: list[Runtime] = []
    for backend, make in candidates:
        runtime = _verified(name, backend, make, device, prepared, want)
        if runtime is None:
            continue
        if not measure:
            return _serving(runtime)
        verified.append(runtime)
    pytorch = TorchRuntime(name, ckpt, encoders.pytorch(ckpt.encoder), device)
    if not verified:
        return pytorch
    return _serving(_fastest(name, verified, pytorch, prepared))


def _wanted_captions(name: str, ckpt: Checkpoint, encoders: SharedEncoders,
                     prepared: list[Prepared]) -> list[list[int]]:
    """The token ids a backend must give the check set ``prepared`` to be verified: PyTorch's
    (:func:`reference_captions`), or with an int8 CNN the PyTorch decoder's on the int8 features."""
    if encoders.precision == "int8":
        # an int8 CNN changes features, so PyTorch's float captions are no reference for the decoder graphs: they
        # must equal the PyTorch decoder's on the same int8 features (what int8 costs in accuracy is measured by
        # `captioner eval --encoder-precision int8`, docs/benchmarks/int8.md)
        return check_captions(HybridRuntime(name, ckpt, encoders.onnx(ckpt.encoder), encoders.device), prepared)
    return reference_captions(name, ckpt, encoders, prepared)


def _verified(name: str, backend: str, make: Callable[[], Runtime], device: torch.device, prepared: list[Prepared],
              want: list[list[int]]) -> Runtime | None:
    """The runtime ``make`` gives for ``backend`` if its captions of the check set are ``want``; else None, and the
    log says why: it could not be made or run, ONNX Runtime fell back to the CPU beside a GPU, or it disagrees."""
    from captioner.models.export.onnx import ExportUnsupported

    try:
        runtime = make()
        if device.type == "cuda" and not runtime.on_gpu:  # the CUDA provider failed to load (cuDNN missing)
            raise NoCudaProvider(backend)
        same = check_captions(runtime, prepared) == want
    except NoCudaProvider:
        log.warning("%s: ONNX Runtime fell back to its CPU provider; no %s backend", name, backend)
        return None
    except ExportUnsupported as exc:
        log.info("%s: no %s backend (%s)", name, backend, str(exc).splitlines()[0] if str(exc) else exc)
        return None
    except OSError as exc:  # an ONNX folder it cannot write (read-only, full): the file and why, in one line
        log.warning("%s: no %s backend (%s)", name, backend, exc)
        return None
    except Exception:  # noqa: BLE001 — ONNX Runtime's own errors (a corrupt export, a graph it cannot load,
        # memory) derive from Exception alone; `auto` serves what verifies, so a backend that fails is skipped
        log.warning("%s: the %s backend failed to load or run; not used", name, backend, exc_info=True)
        return None
    if not same:
        log.warning("%s: the %s backend's captions differ from PyTorch's on the check set; not used", name, backend)
        return None
    return runtime


def _fastest(name: str, verified: list[Runtime], pytorch: Runtime, prepared: list[Prepared]) -> Runtime:
    """Whichever of the ``verified`` backends and ``pytorch`` captions the check set ``prepared`` fastest
    (:func:`check_seconds`), logged with every backend's time."""
    check_captions(pytorch, prepared)  # its first run (kernel selection, allocator growth) is not timed
    seconds = {runtime: check_seconds(runtime, prepared) for runtime in (*verified, pytorch)}
    fastest = min(seconds, key=seconds.get)
    log.info("%s: %s backend, the fastest on the check set (%s)", name, fastest.backend,
             ", ".join(f"{runtime.backend} {1000 * t:.0f} ms" for runtime, t in seconds.items()))
    return fastest


def _serving(runtime: Runtime) -> Runtime:
    """``runtime``, which will serve its model: ONNX Runtime alone needs no PyTorch weights."""
    if runtime.backend == "onnx":
        drop_torch_weights(runtime)
    return runtime


def chosen_backend(name: str, asked: str, precision: str, encoder_precision: str) -> str:
    """The backend ``name`` runs on: the one asked for, except that an autocast ``precision`` runs on PyTorch; a
    setting that cannot apply is said in the log."""
    if precision != "float32":
        if asked not in ("torch", "auto"):
            log.warning("%s: precision %s runs on PyTorch (the %s backend is float32 only)", name, precision, asked)
        asked = "torch"
    if encoder_precision != "float32" and asked == "torch":
        log.warning("%s: encoder precision %s applies to the ONNX Runtime CNN; the torch backend keeps float32",
                    name, encoder_precision)
    return asked
