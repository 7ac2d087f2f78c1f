"""ONNX export of a captioner: an encoder graph and a decoder-step graph, both with dynamic row axes.

* ``encoder.onnx``: ``pixels [B, 3, S, S]`` → the model's encoder state followed by its initial decoder state
  (the frozen CNN, ``Captioner.encode`` and ``Captioner.init_state`` in one graph; left out of a server's exports,
  :data:`SERVED_GRAPHS`).
* ``head.onnx``: the same without the CNN, ``features [B, N, F]`` → encoder state and initial decoder state.  A
  server runs the CNN once per :class:`~captioner.models.encoder.EncoderSpec` (``visual.onnx`` of
  :func:`export_visual_encoder`, shared by every model with that spec) and then each model's head, instead of
  holding one copy of the CNN's weights per model.
* ``step.onnx``: ``prev_tokens [R]``, decoder state, encoder state → ``logprobs [R, V]``, the new decoder state,
  the primary attention ``[R, N]`` and every extra map of :class:`~captioner.models.protocol.AttnRecord`.
* ``onnx.json``: the tensor names (sorted; a session's ``get_inputs()`` gives a graph's own, the tracer dropping
  those it never reads), which state dimensions grow while decoding, and the identity of the weights the graphs
  were made from (:func:`export_identity`, so a runtime can tell that an export is stale).
* ``<graph>.sha256`` beside every graph: its own checksum when it was written, so a graph damaged on disk since
  is made again instead of failing every start (:func:`~.folder.intact`; the folder's files, seals and atomic
  replacement are :mod:`.folder`'s).

What an export folder holds stays bounded over months of use: a model's folder is replaced in place; a CNN's folder
(``visual-<key>``) is named by its spec, weights and format, so a new one appears whenever those change (an upgrade,
a re-downloaded or fine-tuned CNN), and writing it removes the folders of the same spec it replaces
(:func:`remove_replaced_encoders`); and the temporary folder of an export killed mid-way (SIGKILL, the OOM killer)
is removed by the next export into that folder (:func:`~.folder.remove_abandoned`).

State dicts are flattened into tuples sorted by key (``enc.<key>``, ``state.<key>``, ``extra.<key>``); dim 0 of
every tensor is the row axis, as the protocol guarantees, so a runtime can expand, reorder and concatenate ONNX
state exactly like PyTorch state.  Graphs come from the TorchScript tracer, which records the operations run
on example inputs; anything decided in Python from tensor *values* (data-dependent loops, ``.tolist()``) is
frozen into the graph.  Every export is therefore verified against PyTorch on inputs of another row count and
another decoding step, and a model whose graphs disagree is reported as :class:`ExportUnsupported` instead of
being written.
"""

from __future__ import annotations

import json
import re
import shutil
import warnings
from contextlib import suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from ..checkpoint import Checkpoint
from ..files import is_newer_format, naming, read_json_file, write_atomically
from ..encoder import EncoderSpec, GridEncoder, grid_geometry, weights_sha256
from ..protocol import Captioner, VisualBatch, index_rows
from .folder import (ALL_GRAPHS, ENCODER_FILE, HEAD_FILE, SERVED_GRAPHS, SPEC_FILE, STEP_FILE, VISUAL_FILE,
                     VISUAL_SPEC_FILE, alone_in, check_replaceable, folder_swapped_in, holds_only_export_files, intact,
                     seal)
from .sessions import open_session

# /2: exports gained head.onnx; older folders are not current and are re-made
FORMAT = "attention-captioner-onnx/2"
OPSET = 17
# verification tolerance: float32 graphs that differ only in kernel choice agree far better than this. ATOL is
# relative to the output's largest magnitude: deep encoders (X-Transformer's, values in the tens) differ by more
# than 1e-4 in absolute terms between thread counts, while a size frozen by the trace is wrong by the order of the
# values themselves
ATOL, RTOL = 1e-4, 1e-3


class ExportUnsupported(RuntimeError):
    """The model cannot be expressed as the two graphs (the message says why, naming the code responsible)."""


FROZEN_HINT = ("values computed in Python from tensors are constants of a traced graph, so data-dependent control "
               "flow or shape arithmetic there cannot follow other inputs")


def _frozen_sites(caught: list[warnings.WarningMessage]) -> list[str]:
    """``file:line (what)`` of every TracerWarning: the places where the trace froze a Python value."""
    root = Path(__file__).resolve().parents[1]
    sites = []
    for w in caught:
        if "Tracer" not in type(w.message).__name__:
            continue
        path = Path(w.filename)
        try:
            path = path.resolve().relative_to(root)
        except ValueError:
            pass
        what = str(w.message).split(".")[0].split(" might")[0]
        site = f"{path}:{w.lineno} ({what})"
        if site not in sites:
            sites.append(site)
    return sites


SHAPE_HINT = ("the graph only runs at the example's shapes: a size was recorded as a constant (Python ints taken "
              "from tensor.shape and unpacked into expand/reshape/view are not traced)")


def _ort_failure(exc: Exception, frozen: list[str]) -> str:
    """ONNX Runtime's complaint, the node (and so the module) where it happened, and the likely cause."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else exc.__class__.__name__
    node = re.search(r"Name:'([^']+)'", text)
    # drop ONNX Runtime's source location and C++ signature in front of the actual complaint
    status = re.search(r"Status Message: (?:\S+\.(?:h|cc):\d+ )?(?:[\w:]+\([^)]*\) )?(.*)$", text)
    where = f" at node {node.group(1)} (module {node.group(1).strip('/').rsplit('/', 1)[0].replace('/', '.')})" \
        if node else ""
    detail = status.group(1).strip() if status else text[:300]
    return f"{detail}{where}{_why(frozen) or ' — ' + SHAPE_HINT}"


def _why(frozen: list[str]) -> str:
    if not frozen:
        return ""
    shown = "; ".join(frozen[:4]) + (f"; and {len(frozen) - 4} more" if len(frozen) > 4 else "")
    return f" — the tracer froze Python values at {shown}: {FROZEN_HINT}"


@dataclass
class GraphSpec:
    """Names and shapes that tie the ONNX graphs to the protocol's state dicts (stored as ``onnx.json``)."""

    arch: str
    checksum: str  # the weights the graphs were made from, as :func:`export_identity` names them
    encoder: dict[str, Any]
    enc_keys: list[str]
    state_keys: list[str]
    extra_keys: list[str]
    # state key → dimensions (other than rows) whose size changes from step to step (e.g. a Transformer cache)
    growing_dims: dict[str, list[int]] = field(default_factory=dict)
    dtypes: dict[str, str] = field(default_factory=dict)
    # largest |ONNX Runtime − PyTorch| seen by the export's own verification, per output kind
    max_abs_diff: dict[str, float] = field(default_factory=dict)
    format: str = FORMAT

    @property
    def encoder_outputs(self) -> list[str]:
        return [f"enc.{k}" for k in self.enc_keys] + [f"state.{k}" for k in self.state_keys]

    @property
    def step_inputs(self) -> list[str]:
        return ["prev_tokens"] + [f"state.{k}" for k in self.state_keys] + [f"enc.{k}" for k in self.enc_keys]

    @property
    def step_outputs(self) -> list[str]:
        return (["logprobs"] + [f"next.{k}" for k in self.state_keys] + ["attention"]
                + [f"extra.{k}" for k in self.extra_keys])

    def save(self, folder: Path) -> None:
        (folder / SPEC_FILE).write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, folder: Path) -> "GraphSpec":
        path = Path(folder) / SPEC_FILE
        data = read_json_file(path, "an ONNX export's record")
        if data.get("format") != FORMAT:
            raise ValueError(f"{folder}: unknown ONNX export format {data.get('format')!r}")
        try:
            return cls(**data)
        except TypeError as exc:  # a field missing or unknown
            raise ValueError(f"{path} is not an ONNX export's record ({exc})") from None


class EncoderGraph(nn.Module):
    """pixels → (encoder state..., initial decoder state...) in :class:`GraphSpec` order; with ``nn.Identity()`` as
    ``visual``, the head graph: CNN features → the same outputs."""

    def __init__(self, visual: GridEncoder | nn.Identity, model: Captioner, spec: EncoderSpec, enc_keys: list[str],
                 state_keys: list[str]):
        super().__init__()
        self.visual, self.model = visual, model
        # geometry only tells grid models their layout; the boxes are not part of the graph
        self.geometry = grid_geometry(spec, (spec.image_size, spec.image_size))
        self.enc_keys, self.state_keys = enc_keys, state_keys

    def forward(self, pixels: Tensor) -> tuple[Tensor, ...]:
        feats = self.visual(pixels)
        enc = self.model.encode(VisualBatch.from_features(feats, [self.geometry] * feats.shape[0]))
        state = self.model.init_state(enc)
        return tuple(enc[k] for k in self.enc_keys) + tuple(state[k] for k in self.state_keys)


class StepGraph(nn.Module):
    """(prev_tokens, decoder state..., encoder state...) → (logprobs, new state..., attention, extras...)."""

    def __init__(self, model: Captioner, enc_keys: list[str], state_keys: list[str], extra_keys: list[str]):
        super().__init__()
        self.model = model
        self.enc_keys, self.state_keys, self.extra_keys = enc_keys, state_keys, extra_keys

    def forward(self, prev_tokens: Tensor, *tensors: Tensor) -> tuple[Tensor, ...]:
        n_state = len(self.state_keys)
        state = dict(zip(self.state_keys, tensors[:n_state]))
        enc = dict(zip(self.enc_keys, tensors[n_state:]))
        logprobs, new_state, attn = self.model.step(prev_tokens, state, enc)
        return (logprobs, *(new_state[k] for k in self.state_keys), attn.primary,
                *(attn.extras[k] for k in self.extra_keys))


def _example_pixels(spec: EncoderSpec, batch: int, seed: int) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(batch, 3, spec.image_size, spec.image_size, generator=generator) * 2 - 1


def _rows(batch: int, k: int) -> Tensor:
    return torch.arange(batch).repeat_interleave(k)


@torch.inference_mode(False)
@torch.no_grad()
def _probe(visual: GridEncoder, model: Captioner, spec: EncoderSpec, batch: int, k: int, steps: int, seed: int):
    """Run the protocol in PyTorch: the example pixels, their CNN features, the encoder outputs, and (inputs,
    outputs) of every step."""
    pixels = _example_pixels(spec, batch, seed)
    feats = visual(pixels)
    geometry = grid_geometry(spec, (spec.image_size, spec.image_size))
    enc = model.encode(VisualBatch.from_features(feats, [geometry] * batch))
    state0 = model.init_state(enc)
    enc_rows, state = index_rows(enc, _rows(batch, k)), index_rows(state0, _rows(batch, k))
    generator = torch.Generator().manual_seed(seed + 1)
    prev = torch.full((batch * k,), model.bos_id, dtype=torch.long)
    trace = []
    for _ in range(steps):
        logprobs, new_state, attn = model.step(prev, state, enc_rows)
        trace.append(((prev, state), (logprobs, new_state, attn)))
        # follow random but valid back-pointers and tokens, as a beam search would
        state = index_rows(new_state, torch.randint(0, batch * k, (batch * k,), generator=generator))
        prev = torch.randint(3, logprobs.shape[1], (batch * k,), generator=generator)
    return pixels, feats, enc, state0, enc_rows, trace


def _growing_dims(trace) -> dict[str, list[int]]:
    shapes = [{k: tuple(v.shape) for k, v in inputs[1].items()} for inputs, _ in trace]
    return {key: [d for d in range(1, len(shapes[0][key])) if len({s[key][d] for s in shapes}) > 1]
            for key in shapes[0]}


def check_exportable(model: Captioner) -> None:
    """Raise :class:`ExportUnsupported` when the model declares that it cannot be exported (before anything is
    built for an export that cannot succeed)."""
    blocker = model.export_blocker()
    if blocker:
        raise ExportUnsupported(f"{model.arch}: {blocker}")


def export_graphs(ckpt: Checkpoint, out: str | Path, visual: GridEncoder | None = None, *,
                  self_contained: bool = True) -> GraphSpec:
    """Write ``encoder.onnx``, ``head.onnx``, ``step.onnx``, their ``.sha256`` seals and ``onnx.json`` for ``ckpt``
    into ``out`` (atomically). ``visual`` is the frozen CNN the encoder graph is traced with (the checkpoint's
    encoder spec's, built here when not given).  Without ``self_contained``, ``encoder.onnx`` is left out
    (:data:`SERVED_GRAPHS`): a server never loads it, and tracing, checking and verifying the CNN inside it again
    is most of a small model's export (docs/onnx.md, "What the service exports").

    Raises :class:`ExportUnsupported`, saying why, when the model declares that it cannot be exported, when
    tracing fails, or when the graphs disagree with PyTorch on shapes the trace never saw.
    """
    import onnx

    model = ckpt.model.eval()
    check_exportable(model)
    check_replaceable(Path(out))
    spec_enc = ckpt.encoder
    visual = visual or GridEncoder(spec_enc)
    if next(model.parameters()).device.type != "cpu":
        raise ValueError("export from a CPU checkpoint (load_checkpoint(path, 'cpu'))")
    k = 2
    pixels, features, enc, state0, _, trace = _probe(visual, model, spec_enc, batch=2, k=k, steps=3, seed=0)
    spec = GraphSpec(arch=model.arch, checksum=export_identity(ckpt.checksum, spec_enc), encoder=spec_enc.to_json(),
                     enc_keys=sorted(enc), state_keys=sorted(state0), extra_keys=sorted(trace[0][1][2].extras),
                     growing_dims=_growing_dims(trace))
    spec.dtypes = {**{f"enc.{key}": str(v.dtype) for key, v in enc.items()},
                   **{f"state.{key}": str(v.dtype) for key, v in state0.items()}}
    # the step is traced at step 1 (not 0) so that growing dimensions are non-empty in the example
    (prev, state), _ = trace[1]
    enc_rows = index_rows(enc, _rows(2, k))
    step_inputs = (prev, *(state[key] for key in spec.state_keys), *(enc_rows[key] for key in spec.enc_keys))
    by_batch = {name: {0: "batch"} for name in spec.encoder_outputs}
    graphs = [  # (what, module, example inputs, file, input names, output names, dynamic axes)
        ("encoder", EncoderGraph(visual, model, spec_enc, spec.enc_keys, spec.state_keys), (pixels,), ENCODER_FILE,
         ["pixels"], spec.encoder_outputs, {"pixels": {0: "batch"}, **by_batch}),
        ("encoder head", EncoderGraph(nn.Identity(), model, spec_enc, spec.enc_keys, spec.state_keys),
         (features,), HEAD_FILE, ["features"], spec.encoder_outputs, {"features": {0: "batch"}, **by_batch}),
        ("decoder step", StepGraph(model, spec.enc_keys, spec.state_keys, spec.extra_keys), step_inputs, STEP_FILE,
         spec.step_inputs, spec.step_outputs, _step_axes(spec)),
    ]
    files = ALL_GRAPHS if self_contained else SERVED_GRAPHS
    with folder_swapped_in(Path(out)) as tmp:
        frozen = _trace_graphs(model.arch, [graph for graph in graphs if graph[3] in files], tmp)
        for name in files:
            onnx.checker.check_model(str(tmp / name))
        spec.max_abs_diff = _verify(tmp, files, spec, visual, model, spec_enc, frozen)
        for name in files:
            seal(tmp / name)
        spec.save(tmp)
    return spec


def _step_axes(spec: GraphSpec) -> dict[str, dict[int, str]]:
    """The step graph's dynamic axes: rows everywhere, plus each state's growing dimensions (a Transformer's
    cached keys grow by one position a step), named apart for the input and the output."""
    axes = {name: {0: "rows"} for name in spec.step_inputs + spec.step_outputs}
    for key, dims in spec.growing_dims.items():
        for d in dims:
            axes[f"state.{key}"][d] = f"{key}_dim{d}"
            axes[f"next.{key}"][d] = f"next_{key}_dim{d}"
    return axes


def _is_system_error(exc: BaseException) -> bool:
    """Whether ``exc`` is the operating system's (it carries an errno: ENOSPC, EROFS, …), not an OSError a tracer
    raises without one (``inspect``'s "could not get source code")."""
    return isinstance(exc, OSError) and exc.errno is not None


def _trace_graphs(arch: str, graphs: list[tuple], folder: Path) -> list[str]:
    """Trace each ``(what, module, inputs, file, input names, output names, axes)`` into ``folder``; returns the
    code sites whose tracer warnings say a Python value was frozen into a graph (for :func:`_verify` to name).
    A graph the tracer cannot record raises :class:`ExportUnsupported`, naming the graph and those sites."""
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        for what, graph, args, file, names_in, names_out, axes in graphs:
            try:
                torch.onnx.export(graph.eval(), args, str(folder / file), input_names=names_in,
                                  output_names=names_out, dynamic_axes=axes, opset_version=OPSET, dynamo=False)
            except Exception as exc:  # the tracer's errors have many types; all mean "cannot be expressed"
                if _is_system_error(exc):  # ... but a full disk's or a read-only folder's: expressed, not written
                    raise naming(exc, folder / file) from None
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                raise ExportUnsupported(
                    f"{arch}: the TorchScript tracer cannot record the {what} "
                    f"({exc.__class__.__name__}: {first}){_why(_frozen_sites(caught))}") from exc
    return _frozen_sites(caught)


def export_checkpoints(checkpoints: dict[str, Path], out_dir: str | Path,
                       log=None) -> dict[str, GraphSpec | ExportUnsupported]:
    """Export every named checkpoint into ``out_dir/<name>``, and the CNN of each encoder spec into
    ``out_dir/<visual_encoder_key>`` (what the service's ONNX backend loads); a model that cannot be expressed gets
    its :class:`ExportUnsupported` instead of a :class:`GraphSpec` (so does each model of a CNN that cannot be)."""
    from ..checkpoint import load_checkpoint

    results: dict[str, GraphSpec | ExportUnsupported] = {}
    visuals: dict[str, GridEncoder | ExportUnsupported] = {}
    for name in checkpoints:  # every target before the first export: a refusal leaves nothing half done
        check_replaceable(Path(out_dir) / name)
    for name, path in checkpoints.items():
        ckpt = load_checkpoint(path, "cpu")
        if ckpt.reads_regions:  # its graphs would take the CNN's grid, which it was never trained on (it crashed)
            results[name] = ExportUnsupported(f"{name} was trained on region features: it captions no photo, so "
                                              "there is no graph of photos to export (evaluate it with captioner "
                                              "eval --features regions:DIR)")
        else:
            key = repr(ckpt.encoder)
            if key not in visuals:
                visual = GridEncoder(ckpt.encoder)
                try:
                    export_visual_encoder(ckpt.encoder, out_dir, visual)
                    visuals[key] = visual
                except ExportUnsupported as exc:  # no graph of this CNN: each model on it is refused with why
                    visuals[key] = exc
            visual = visuals[key]
            try:
                results[name] = visual if isinstance(visual, ExportUnsupported) else \
                    export_graphs(ckpt, Path(out_dir) / name, visual)
            except ExportUnsupported as exc:
                results[name] = exc
        if log:
            log(name, results[name])
    return results


def _session(path: Path):
    # quiet: a failure is reported as ExportUnsupported, not also logged
    return open_session(path, torch.device("cpu"), quiet=True)


def _close(name: str, output: str, got: np.ndarray, want: Tensor, frozen: list[str], diffs: dict[str, float]) -> None:
    """Fail unless ``got`` matches ``want``; ``name`` is for messages, ``output`` the graph output's name."""
    want_np = want.detach().cpu().numpy()
    if got.shape != want_np.shape:
        raise ExportUnsupported(f"{name}: shape {got.shape} from ONNX Runtime, {want_np.shape} from PyTorch"
                                f"{_why(frozen)}")
    if want_np.dtype == np.bool_ or np.issubdtype(want_np.dtype, np.integer):
        ok = np.array_equal(got, want_np)
    else:
        finite = np.isfinite(want_np)
        got_f, want_f = got[finite], want_np[finite]
        scale = max(1.0, float(np.abs(want_f).max())) if want_f.size else 1.0
        ok = np.array_equal(finite, np.isfinite(got)) and np.allclose(got_f, want_f, atol=ATOL * scale, rtol=RTOL)
        if ok and want_f.size:
            kind = output.split(".")[0]
            diffs[kind] = max(diffs.get(kind, 0.0), float(np.abs(got_f - want_f).max()))
    if not ok:
        # a wrong number (not a failure to run) has a second common cause: the graph froze a Python value the step
        # keeps on the model between calls, where the protocol's step depends on its arguments alone
        raise ExportUnsupported(f"{name}: ONNX Runtime disagrees with PyTorch on new shapes"
                                f"{_why(frozen) or ' — ' + SHAPE_HINT.replace('only runs', 'is only right')}; or "
                                "step keeps something on the model between calls, which the graph froze (a step "
                                "depends on its arguments alone: models/protocol.py)")


def _verify(folder: Path, files: tuple[str, ...], spec: GraphSpec, visual: GridEncoder, model: Captioner,
            spec_enc: EncoderSpec, frozen: list[str]) -> dict[str, float]:
    """Run the graphs ``files`` names in ``folder`` (the encoder, head and step graphs, or the last two) on a batch
    size, beam width and step count the trace never saw; compare with PyTorch.
    Returns the largest absolute difference per output kind."""
    batch, k = 3, 3
    pixels, features, enc, state0, enc_rows, trace = _probe(visual, model, spec_enc, batch=batch, k=k, steps=4,
                                                           seed=5)
    diffs: dict[str, float] = {}
    prefix = f"{model.arch}: "
    for graph, file, feed in (("encoder", ENCODER_FILE, {"pixels": pixels.numpy()}),
                              ("encoder head", HEAD_FILE, {"features": features.numpy()})):
        if file not in files:
            continue
        try:
            outputs = _session(folder / file).run(spec.encoder_outputs, feed)
        except Exception as exc:
            raise ExportUnsupported(f"{prefix}ONNX Runtime cannot run the {graph} graph on a new batch size: "
                                    f"{_ort_failure(exc, frozen)}") from exc
        for name, got in zip(spec.encoder_outputs, outputs):
            kind, key = name.split(".", 1)
            _close(f"{prefix}{name} ({graph})", name, got, (enc if kind == "enc" else state0)[key], frozen, diffs)
    try:
        step = _session(folder / STEP_FILE)
    except Exception as exc:
        raise ExportUnsupported(f"{prefix}ONNX Runtime cannot load the step graph: {_ort_failure(exc, frozen)}") \
            from exc
    for t, ((prev, state), (logprobs, new_state, attn)) in enumerate(trace):
        feed = {"prev_tokens": prev.numpy(), **{f"state.{key}": state[key].numpy() for key in spec.state_keys},
                **{f"enc.{key}": enc_rows[key].numpy() for key in spec.enc_keys}}
        try:
            outputs = step.run(spec.step_outputs, {i.name: feed[i.name] for i in step.get_inputs()})
        except Exception as exc:
            raise ExportUnsupported(f"{prefix}ONNX Runtime cannot run the step graph on new row counts (step "
                                    f"{t}): {_ort_failure(exc, frozen)}") from exc
        want = {"logprobs": logprobs, "attention": attn.primary,
                **{f"next.{key}": new_state[key] for key in spec.state_keys},
                **{f"extra.{key}": attn.extras[key] for key in spec.extra_keys}}
        for name, got in zip(spec.step_outputs, outputs):
            _close(f"{prefix}{name} at step {t}", name, got, want[name], frozen, diffs)
    return diffs


def export_identity(checksum: str, encoder: EncoderSpec) -> str:
    """The identity of all the weights a checkpoint's export is made from: its own weights' sha256 (``checksum``)
    and, when its encoder names weight files (the CNN stages a fine-tuning run trained, an imported CNN), their
    content too, since ``encoder.onnx`` holds that CNN and the check set's reference captions come from it.  Without
    them, a checkpoint whose fine-tuned CNN changed while its decoder did not kept its stale export.  A checkpoint
    whose encoder names no file keeps ``checksum`` itself, so its exports made before stay current."""
    import hashlib

    files = weights_sha256(encoder, missing_ok=True)
    if not files:
        return checksum
    text = json.dumps({"weights": checksum, **files}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def export_is_current(folder: str | Path, identity: str, graphs: tuple[str, ...] = ALL_GRAPHS) -> bool:
    """True when ``folder`` holds an export made from the weights ``identity`` names (:func:`export_identity`) with
    each of ``graphs`` as it was written (:func:`intact`): all three by default, :data:`SERVED_GRAPHS` for a server,
    which never loads ``encoder.onnx``."""
    folder = Path(folder)
    try:
        spec = GraphSpec.load(folder)
    except (OSError, ValueError, TypeError):
        return False
    return spec.checksum == identity and all(intact(folder / name) for name in graphs)


def visual_encoder_key(spec: EncoderSpec) -> str:
    """Folder name of the encoder-only export of ``spec`` (same spec, same packaged or local weights → same key).
    Every weights file the spec names, a local ImageNet file and fine-tuned stages alike, is named by its content
    (:func:`~captioner.models.encoder.weights_sha256`, as the feature cache names them): an export made from other
    weights is never taken for this one."""
    import hashlib

    # a file that is not there keys as "", as it always did (exporting from it fails on the missing file)
    files = weights_sha256(spec, missing_ok=True)
    # fine-tuned stages add a field, so the key of a spec without them (and its earlier exports) does not change;
    # "weights" is "" for the packaged weights, as it always was
    tuned = {"tuned": files["tuned_weights"]} if "tuned_weights" in files else {}
    # a file the spec names is in the key by its content (above), not by the path it had where it was exported: a
    # checkpoint moved (or mounted elsewhere) had its CNN exported again beside the first, which stayed for good
    described = {field: value for field, value in spec.to_json().items() if field not in files}
    text = json.dumps({"spec": described, "weights": files.get("weights", ""), **tuned, "format": FORMAT},
                      sort_keys=True)
    return "visual-" + hashlib.sha256(text.encode()).hexdigest()[:16]


def visual_encoder_path(spec: EncoderSpec, out_dir: str | Path) -> Path:
    """Where :func:`export_visual_encoder` puts the CNN of ``spec`` (whether or not it is there yet)."""
    return Path(out_dir) / visual_encoder_key(spec) / VISUAL_FILE


def _spec_record(spec: EncoderSpec) -> dict:
    """What ``visual.json`` records: the spec (as read back: lists, not tuples) and the export format."""
    return {"spec": json.loads(json.dumps(spec.to_json())), "format": FORMAT}


def _record_spec(folder: Path, spec: EncoderSpec) -> None:
    """Record in a CNN's export folder the spec it was made from (:data:`VISUAL_SPEC_FILE`), atomically."""
    write_atomically(folder / VISUAL_SPEC_FILE, json.dumps(_spec_record(spec)))


def remove_replaced_encoders(out_dir: str | Path, spec: EncoderSpec, current: Path) -> list[str]:
    """Remove the CNN exports in ``out_dir`` that ``current`` replaces: those recorded as made from the same spec,
    whose other key means other weights (a re-downloaded ImageNet file, a fine-tuned stage trained again) or an
    older export format, so nothing will ask for them again.  Kept: folders of other specs, folders of a newer
    export format (a newer version sharing the folder still uses them), and folders made before specs were recorded
    (they cannot tell; docs/onnx.md says how to clear them).  Only while no other export writes in ``out_dir``
    (:func:`alone_in`): one may be quantizing into a folder this would remove.  Returns the names removed."""
    removed: list[str] = []
    with alone_in(Path(out_dir)) as alone:
        if not alone:
            return removed
        for record in Path(out_dir).glob(f"visual-*/{VISUAL_SPEC_FILE}"):
            folder = record.parent
            if folder.name == current.name:
                continue
            try:  # a record that is not an object this exporter wrote: its folder is not removed
                recorded = read_json_file(record)
            except (OSError, ValueError):
                continue
            same_spec = recorded.get("spec") == _spec_record(spec)["spec"]
            if same_spec and not is_newer_format(recorded.get("format"), FORMAT) and holds_only_export_files(folder):
                shutil.rmtree(folder, ignore_errors=True)
                removed.append(folder.name)
    return removed


def export_visual_encoder(spec: EncoderSpec, out_dir: str | Path, visual: GridEncoder | None = None) -> Path:
    """The frozen CNN alone as ``visual.onnx`` (``pixels [B, 3, S, S]`` → ``features [B, N, F]``), run once per
    spec by a server and followed by each model's ``head.onnx`` (or, for a decoder that cannot be exported, by the
    PyTorch model: the hybrid).  Cached in ``out_dir/<visual_encoder_key>`` with the spec it was made from; writing
    it removes the exports of the same spec it replaces (:func:`remove_replaced_encoders`).  Verified against
    PyTorch on a batch size the trace never saw."""
    import onnx

    path = visual_encoder_path(spec, out_dir)
    folder = path.parent
    if intact(path):
        if not (folder / VISUAL_SPEC_FILE).exists():
            with suppress(OSError):  # an export of an earlier version, made identifiable; a read-only one stays so
                _record_spec(folder, spec)
        return path
    check_replaceable(folder)
    visual = visual or GridEncoder(spec)
    with folder_swapped_in(folder) as tmp:
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            try:
                torch.onnx.export(visual, (_example_pixels(spec, 2, 0),), str(tmp / VISUAL_FILE),
                                  input_names=["pixels"], output_names=["features"],
                                  dynamic_axes={"pixels": {0: "batch"}, "features": {0: "batch"}},
                                  opset_version=OPSET, dynamo=False)
            except Exception as exc:
                if _is_system_error(exc):  # a full disk, a read-only folder: not a CNN the tracer cannot record
                    raise naming(exc, tmp / VISUAL_FILE) from None
                raise ExportUnsupported(f"visual encoder {spec.backbone}: the tracer cannot record it "
                                        f"({exc.__class__.__name__})") from exc
        onnx.checker.check_model(str(tmp / VISUAL_FILE))
        pixels = _example_pixels(spec, 3, 7)
        with torch.no_grad():
            want = visual(pixels)
        frozen = _frozen_sites(caught)
        try:
            got = _session(tmp / VISUAL_FILE).run(["features"], {"pixels": pixels.numpy()})[0]
        except Exception as exc:  # said as a model graph's is (`captioner export` prints one line), not ORT's own
            raise ExportUnsupported(f"visual encoder {spec.backbone}: ONNX Runtime cannot run it on a new batch "
                                    f"size: {_ort_failure(exc, frozen)}") from exc
        _close(f"visual encoder {spec.backbone}", "features", got, want, frozen, {})
        seal(tmp / VISUAL_FILE)
        _record_spec(tmp, spec)
    remove_replaced_encoders(out_dir, spec, folder)
    return path
