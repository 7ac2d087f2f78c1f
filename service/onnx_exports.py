"""The files a model's start on ONNX Runtime needs, under the ONNX folder (``CAPTIONER_ONNX_DIR``): the model's export
(:func:`onnx_folder` finds it, or exports it when missing, stale or damaged: its ``head.onnx`` and ``step.onnx``,
the graphs a server loads), the shared CNN's ``visual.onnx``
(:class:`~captioner.service.shared_encoders.SharedEncoders` makes it), and the ``auto`` check set's reference
captions (:func:`reference_record`), or the record that the model cannot be exported (:func:`unexportable_record`).
:func:`unprepared` tells from disk alone, without loading a checkpoint, which models still have something to make,
so that :class:`~captioner.service.runtime.PreparingChild` makes it in a child process before the server's own
load.
"""

from __future__ import annotations

import json
import logging
from contextlib import suppress
from pathlib import Path

from captioner.models.checkpoint import (Checkpoint, CheckpointError, find_checkpoints, load_checkpoint, read_config,
                                         recorded_checksum, resolve_encoder_weights)
from captioner.models.files import write_atomically

from .shared_encoders import SharedEncoders

log = logging.getLogger("captioner.runtime")  # the loader's logger, whose records these are


def reference_record(onnx_dir: Path, identity: str) -> Path:
    """Where :func:`~captioner.service.backend_choice.reference_captions` records PyTorch's captions of the check set
    for the weights ``identity`` names (:func:`~captioner.models.export.onnx.export_identity`). A hidden folder: the
    exports beside it are named after the checkpoints, and one called ``reference`` could never be exported there."""
    return Path(onnx_dir) / ".reference" / f"{identity}.json"


def unexportable_record(onnx_dir: Path, identity: str) -> Path:
    """Where :func:`onnx_folder` records that the weights ``identity`` names cannot be exported (a TVmax decoder,
    graphs that disagree with PyTorch), so that :func:`unprepared` stops sending them to a child at every start."""
    return Path(onnx_dir) / ".unexportable" / f"{identity}.json"


def onnx_folder(encoders: SharedEncoders, name: str, ckpt: Checkpoint) -> Path:
    """Where the ONNX export of checkpoint ``name`` lives (exported now when missing or made from other weights),
    without the self-contained ``encoder.onnx``: the server runs the CNN's shared graph, made first, then the
    model's head.  Raises :class:`~captioner.models.export.onnx.ExportUnsupported` where it cannot be, and records
    that."""
    from captioner.models.export.folder import SERVED_GRAPHS
    from captioner.models.export.onnx import (FORMAT, ExportUnsupported, check_exportable, export_graphs,
                                              export_identity, export_is_current)

    folder = encoders.onnx_dir / name
    identity = export_identity(ckpt.checksum, ckpt.encoder)
    if not export_is_current(folder, identity, SERVED_GRAPHS):
        try:
            check_exportable(ckpt.model)  # before the PyTorch encoder is built for nothing
            # the CNN's graph before the model's: a current export then means that its CNN exported too, as it
            # did when the export held the CNN itself (encoder.onnx), and unprepared() relies on that
            encoders.onnx(ckpt.encoder)
            log.info("exporting %s to ONNX in %s", name, folder)
            cpu = load_checkpoint(ckpt.path, "cpu") if next(ckpt.model.parameters()).device.type != "cpu" else ckpt
            export_graphs(cpu, folder, encoders.for_export(ckpt.encoder), self_contained=False)
        except ExportUnsupported as exc:
            record = unexportable_record(encoders.onnx_dir, identity)
            # under the export format: code that writes another format may export what this code could not
            with suppress(OSError):  # a read-only folder: the child is spawned again at the next start, as before
                record.parent.mkdir(parents=True, exist_ok=True)
                write_atomically(record, json.dumps({"format": FORMAT, "why": str(exc)}))
            raise
    return folder


def _known_unexportable(onnx_dir: Path, identity: str) -> bool:
    from captioner.models.export.onnx import FORMAT

    try:
        return json.loads(unexportable_record(onnx_dir, identity).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):  # AttributeError: JSON that is not an object
        return False


def unprepared(weights_dir: Path | None, extra: list[Path], *, onnx_dir: Path,
               prefixed: dict[str, Path] | None = None, backends: dict[str, str] | None = None,
               default_backend: str = "auto", encoder_precision: str = "float32",
               precision: str = "float32") -> list[str]:
    """The models whose start on ONNX Runtime still has something to make, read from disk without loading a
    checkpoint (the weights' sha256 from each manifest): the shared CNN's graph and the model's own export, each
    current and intact, and for ``auto`` PyTorch's reference captions of the check set as well
    (:func:`~captioner.service.backend_choice.reference_captions`).  Their start exports graphs and runs the PyTorch
    CNN.  Models on the ``torch`` backend have nothing to prepare, nor any model under an autocast ``precision``,
    which runs every model on PyTorch (:func:`~captioner.service.backend_choice.chosen_backend`); ``hybrid`` needs
    only the CNN's graph."""
    if precision != "float32":
        return []
    names = []
    for name, path in find_checkpoints(weights_dir, extra, prefixed).items():
        backend = (backends or {}).get(name, default_backend)
        if backend != "torch" and not _prepared(name, path, backend, Path(onnx_dir), encoder_precision):
            names.append(name)
    return names


def _prepared(name: str, path: Path, backend: str, onnx_dir: Path, encoder_precision: str) -> bool:
    from captioner.models.export.folder import SERVED_GRAPHS, intact
    from captioner.models.export.onnx import export_identity, export_is_current
    from captioner.models.export.quantize import visual_encoder_path_at

    checksum = recorded_checksum(path)
    if not checksum:
        return False
    try:
        spec = resolve_encoder_weights(read_config(path)["encoder"], path)
    except (CheckpointError, KeyError, TypeError, ValueError):
        return True  # a damaged checkpoint: load_runtimes names it and skips it, a child would only do the same
    identity = export_identity(checksum, spec)
    if backend == "auto" and not reference_record(onnx_dir, identity).is_file():
        return False
    visual = visual_encoder_path_at(spec, onnx_dir, encoder_precision)
    export = onnx_dir / name
    # ``auto`` has recorded its references, so what has no folder could not be exported (a TVmax decoder, a CNN
    # the tracer cannot record) and is served without it: only what exists must be intact. A current export of the
    # model's own is the exception: onnx_folder made the CNN's graph first, so the CNN exports, and a missing CNN
    # graph (its key changed with an upgrade, or the folder was removed) is still to make, in the child
    optional = backend == "auto"
    export_current = export_is_current(export, identity, SERVED_GRAPHS)
    if backend == "onnx" and not export_current and _known_unexportable(onnx_dir, identity):
        return True  # served on PyTorch instead (load_runtimes says why): nothing for a child to make
    cnn_left_unexported = optional and not export_current and not visual.parent.exists()
    if not (intact(visual) or cnn_left_unexported):
        return False
    decoder_left_unexported = optional and not export.exists()
    return backend == "hybrid" or export_current or decoder_left_unexported
