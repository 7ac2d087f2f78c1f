"""Runtimes of the served checkpoints: :func:`load_runtimes` loads every checkpoint and serves it with the backend
chosen for it; :class:`PreparingChild` runs that load in a child process on a first start.

Every model is served through the :class:`~captioner.models.inference.Runtime` interface the batcher drives, with
either backend, chosen per model name:

* ``torch``: :class:`~captioner.models.inference.TorchRuntime`, the model's own protocol methods and the frozen
  :class:`~captioner.models.encoder.GridEncoder`;
* ``onnx``: :class:`~captioner.service.onnx_backends.OnnxRuntime`, the graphs of :mod:`captioner.models.export.onnx`
  on ONNX Runtime (CUDA execution provider when the device is CUDA, CPU otherwise), exported at start-up when no
  current, intact export exists (:mod:`captioner.service.onnx_exports`);
* ``hybrid``: :class:`~captioner.service.onnx_backends.HybridRuntime`, the frozen CNN alone on ONNX Runtime and the
  model on PyTorch, for models whose decoder step cannot be exported (TVmax's data-dependent solver) — on a CPU the
  CNN is most of the cost;
* ``auto`` (the service's default, ``CAPTIONER_BACKEND``): the fastest of these whose captions equal the PyTorch ones on
  a check set of a few generated images: on a CPU ``onnx``, else ``hybrid``, else ``torch`` (measured once, in the
  benchmarks); on a GPU, timed on the check set at start-up (:mod:`captioner.service.backend_choice`).

The frozen CNN exists once per :class:`~captioner.models.encoder.EncoderSpec`, whatever the number of models
(:class:`~captioner.service.shared_encoders.SharedEncoders`): one ONNX Runtime session of its ``visual.onnx`` for
the ``onnx`` and ``hybrid`` backends, one PyTorch module for the ``torch`` backend, each made only when some model
needs it.  A model served wholly by ONNX Runtime keeps no PyTorch weights
(:func:`~captioner.service.onnx_backends.drop_torch_weights`).  Memory by number of models:
docs/decisions.md#one-cnn-per-encoder-spec-and-no-pytorch-weights-behind-onnx-models.

It runs models, and uses the same preprocessing function as training (the batcher moves their tensors).
"""

from __future__ import annotations

import logging
import multiprocessing
from collections.abc import Callable, Collection, Iterator
from multiprocessing.connection import Connection
from pathlib import Path

from captioner.models.checkpoint import Checkpoint, CheckpointError, find_checkpoints, load_checkpoint
from captioner.models.device import resolve_device, set_threads
from captioner.models.export.quantize import int8_kernels
from captioner.models.files import describe_os_error
from captioner.models.inference import Runtime, TorchRuntime
from captioner.models.placement import DEFAULT_ONNX_DIR

from .backend_choice import chosen_backend, fastest_verified
from .onnx_backends import HybridRuntime, NoCudaProvider, OnnxRuntime, drop_torch_weights
from .onnx_exports import onnx_folder
from .shared_encoders import SharedEncoders

log = logging.getLogger("captioner.runtime")


def load_runtimes(weights_dir: Path | None, extra: list[Path], **settings) -> dict[str, Runtime]:
    """Every checkpoint as a runtime, by name (:func:`iter_runtimes`, whose keywords it takes)."""
    return dict(iter_runtimes(weights_dir, extra, **settings))


def iter_runtimes(weights_dir: Path | None, extra: list[Path], *, device_name: str = "auto",
                  backends: dict[str, str] | None = None, default_backend: str = "torch",
                  onnx_dir: Path = DEFAULT_ONNX_DIR, threads: int | None = None, precision: str = "float32",
                  encoder_precision: str = "float32", prefixed: dict[str, Path] | None = None,
                  only: Collection[str] | None = None, before_each: Callable[[str], None] = lambda name: None,
                  after_each: Callable[[str], None] = lambda name: None) -> Iterator[tuple[str, Runtime]]:
    """Every checkpoint as a runtime, one at a time, named as :func:`find_checkpoints` names them (``prefixed``: name
    prefix → folder of checkpoints; ``only``: just these names); ``backends`` picks ``torch``, ``onnx``, ``hybrid``
    or ``auto`` per model name (``default_backend`` for the rest).  A model that cannot be exported falls back to the
    PyTorch backend with an error in the log (``auto`` picks quietly: see
    :func:`~captioner.service.backend_choice.fastest_verified`).  A ``precision`` other than float32 is a PyTorch
    autocast option: those models run on PyTorch whatever their backend setting.  ``encoder_precision`` ``int8``
    runs the ONNX CNN quantized (``onnx``, ``hybrid`` and ``auto``; PyTorch models keep their float CNN).  The
    settings are keywords: several are strings, which a call by position could swap in silence.

    ``before_each(name)`` runs before a model loads (the server waits there for the preparing child's work on it:
    :class:`PreparingChild`), ``after_each(name)`` once it has loaded or been skipped (the child reports it there).
    One at a time, so that the server warms up each model while the child still prepares the next."""
    device = resolve_device(device_name)
    if encoder_precision == "int8" and device.type == "cpu" and int8_kernels() == "u8u8":
        # an operator opts into int8 for speed; on such a CPU it was measured no faster than float32
        log.warning("CAPTIONER_ENCODER_PRECISION=int8 on an x86 CPU without VNNI: the CNN's weights are uint8 (int8 "
                    "weights saturate here) and int8 may be no faster than float32 (docs/decisions.md, \"int8 on "
                    "CPUs without VNNI\"; benchmarks/bench_encoder.py measures it)")
    encoders = SharedEncoders(device, onnx_dir, threads, encoder_precision)

    def replaced(name: str, winner: Path, loser: Path) -> None:
        log.warning("model %r is %s; %s, named the same, is not served", name, winner, loser)

    def skipped(path: Path, why: CheckpointError) -> None:  # a run's folder instead of RUN/best, a typo: named, as
        # a damaged checkpoint is below
        log.error("skipping checkpoint %s: %s", path, why)

    found = find_checkpoints(weights_dir, extra, prefixed, replaced, skipped)
    # a model named in CAPTIONER_BACKENDS that no checkpoint is called (a typo) stayed on the default in silence
    unknown = sorted(set(backends or {}) - set(found))
    if unknown:
        log.warning("CAPTIONER_BACKENDS names %s, which no checkpoint is called (they are: %s)",
                    ", ".join(map(repr, unknown)), ", ".join(sorted(found)) or "none")
    for name, path in found.items():
        if only is not None and name not in only:
            continue
        before_each(name)
        try:
            ckpt = load_checkpoint(path, device)
            ckpt.check_reads_images()
        except (CheckpointError, KeyError, RuntimeError, OSError, TypeError, ValueError) as exc:
            # a damaged folder is named in one line; anything else may be a bug, so its traceback comes along
            log.error("skipping checkpoint %s: %s", path, exc, exc_info=not isinstance(exc, CheckpointError))
            after_each(name)
            continue
        backend = chosen_backend(name, (backends or {}).get(name, default_backend), precision, encoder_precision)
        if backend == "auto":
            runtime = fastest_verified(name, ckpt, encoders, threads)
        else:
            runtime = _on_onnx_runtime(name, ckpt, backend, encoders, threads) if backend != "torch" else None
            runtime = runtime or TorchRuntime(name, ckpt, encoders.pytorch(ckpt.encoder), device, precision)
        log.info("loaded %s (%s) from %s: %s backend on %s (%s)", name, ckpt.model.arch, path, runtime.backend, device,
                 ", ".join(runtime.providers or [precision]))
        after_each(name)
        yield name, runtime


def _on_onnx_runtime(name: str, ckpt: Checkpoint, backend: str, encoders: SharedEncoders,
                     threads: int | None) -> Runtime | None:
    """``ckpt`` on ONNX Runtime (``hybrid``: its CNN only, the decoder on PyTorch), or None, with the reason in the
    log, where it cannot run there: the caller serves it with PyTorch."""
    from captioner.models.export.onnx import ExportUnsupported

    part = "its visual encoder" if backend == "hybrid" else "it"
    try:
        if backend == "hybrid":
            return HybridRuntime(name, ckpt, encoders.onnx(ckpt.encoder), encoders.device)
        runtime = OnnxRuntime(name, ckpt, onnx_folder(encoders, name, ckpt), encoders.device, threads,
                              encoders.onnx(ckpt.encoder))
        drop_torch_weights(runtime)
        return runtime
    except (ExportUnsupported, NoCudaProvider, OSError) as exc:  # OSError: an ONNX folder it cannot write
        # an OS error as the CLI says it: the file it was to become, not an export's temporary folder
        reason = describe_os_error(exc) if isinstance(exc, OSError) else exc
        log.error("%s: ONNX Runtime cannot run %s (%s); serving it with PyTorch", name, part, reason)
    except Exception:  # noqa: BLE001 — ONNX Runtime's errors derive from Exception alone (see fastest_verified)
        log.error("%s: ONNX Runtime failed to load %s; serving it with PyTorch", name, part, exc_info=True)
    return None


class PreparingChild:
    """:func:`iter_runtimes` with these arguments in a spawned child process, for the models ``only`` names (the
    :func:`~captioner.service.onnx_exports.unprepared` ones; all where None), which makes their ONNX exports and
    reference records and exits: the server's own process then loads them as on any later start, without the
    PyTorch CNN, the exporter's tracing or the heap they leave fragmented (six Flickr8k models: 1,097 MiB resident
    after warm-up on a first start in the process, 847 MiB on later starts; docs/decisions.md, "First start in a
    child process").

    The child reports each model as it is done with it, and :meth:`wait_for` returns once it has: the server loads
    and warms up a model while the child prepares the next, in the order both take them (the checkpoints' order),
    instead of after the last (docs/decisions.md, "The first start's exports and warm-up side by side").  A child
    that fails leaves what it had not done to the server's own load, as before.

    ``set_up_logging`` (a picklable callable: the server's own logging set-up with its format and level) runs first
    in the child, so that it logs as the server does: a spawned process starts with Python's default logging, which
    dropped the child's progress ("exporting …", minutes on a first start) and wrote its warnings with their
    tracebacks as plain lines into the server's JSON log.  Taken as a callable, not as the format and level:
    logging's set-up is the HTTP layer's (middleware.py), which this layer does not import."""

    #: how often a wait looks whether the child has died without a word (seconds)
    POLL_S = 0.2
    #: the child's threads (PyTorch's and ONNX Runtime's): its work is mostly tracing, in one thread, and its kernels
    #: run on a few check images, where more threads cost more than they give, while the server warms up the models
    #: already prepared beside it (11 Flickr8k models on 2 cores: a first start of 47 s, against 65 s with the
    #: child on every core; docs/decisions.md, "The first start's exports and warm-up side by side")
    THREADS = 1

    def __init__(self, weights_dir: Path | None, extra: list[Path], *, only: Collection[str] | None = None,
                 set_up_logging: Callable[[], None] | None = None, **settings) -> None:
        context = multiprocessing.get_context("spawn")
        self._reports, sender = context.Pipe(duplex=False)
        self._only = None if only is None else frozenset(only)
        self._done: set[str] = set()
        self._failure_told = False
        self._process = context.Process(target=_prepare, args=(weights_dir, extra, set_up_logging, sender),
                                        kwargs={**settings, "only": only, "threads": self.THREADS},
                                        name="captioner-prepare")
        self._process.start()
        sender.close()  # the child's copy is the only one left: its exit ends the pipe

    def wait_for(self, name: str) -> None:
        """Return once the child is done with model ``name`` (loaded or skipped), or has exited without it (the
        server's own load then makes what it left); at once for a model it was not given."""
        if self._only is not None and name not in self._only:
            return
        while name not in self._done:
            if self._reports.poll(self.POLL_S):
                try:
                    self._done.add(self._reports.recv())
                    continue
                except EOFError:  # the child has exited, and every report is read: this one will not come
                    pass
            elif self._process.is_alive() or self._reports.poll():
                continue
            self._tell_failure()
            return

    def join(self) -> None:
        """Wait for the child to exit (once :meth:`wait_for` has had its last model, it is exiting)."""
        self._tell_failure()
        self._reports.close()

    def stop(self) -> None:
        """End the child now (the server stops before its start-up is done): what it was exporting is left in a
        temporary folder that the next export removes."""
        self._process.terminate()
        self._process.join()
        self._reports.close()

    def _tell_failure(self) -> None:
        """Wait for the child to exit; an exit that failed is logged, once."""
        self._process.join()
        if self._process.exitcode != 0 and not self._failure_told:
            self._failure_told = True
            log.warning("preparing the ONNX exports in a child process failed (exit code %s); preparing the rest "
                        "here", self._process.exitcode)


def _prepare(weights_dir: Path | None, extra: list[Path], set_up_logging: Callable[[], None] | None,
             reports: Connection, **settings) -> None:
    """The preparing child's work (:class:`PreparingChild`): its logging set up as the server's, then the load,
    each model reported as it is done."""
    if set_up_logging is not None:
        set_up_logging()
    set_threads(settings["threads"])
    for _ in iter_runtimes(weights_dir, extra, after_each=reports.send, **settings):
        pass  # each runtime goes as soon as it is made: the child keeps only what it has made on disk
