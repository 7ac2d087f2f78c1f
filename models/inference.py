"""Image → caption, one path for every caller: the CLI (:class:`~captioner.models.pipeline.Pipeline`), the service's
continuous batcher and the tests.

A :class:`Runtime` is one checkpoint on one device behind the small interface the batcher drives:

* :meth:`Runtime.prepare` — decoded image → network input and geometry (the preprocessing function training uses);
* :meth:`Runtime.begin` — encode a batch of prepared images into rows of encoder and decoder state, ``widths[i]``
  rows (beams) for image ``i``;
* :meth:`Runtime.step` / :meth:`Runtime.reorder` — one decoding step over any rows, and following beam
  back-pointers (the model's ``step`` and ``reorder`` hooks of :class:`~captioner.models.protocol.Captioner`);
* :meth:`Runtime.result` — a decoded hypothesis → :class:`CaptionResult` (a domain object; the service's schemas
  serialise it).

:meth:`Runtime.caption` runs ``prepare``-d images through ``begin`` and :func:`~captioner.models.decoding.search_rows`
(the loop of :func:`~captioner.models.decoding.beam_search`) with the same ``step`` and ``reorder`` the batcher calls,
so a fixed batch and the batcher's changing tables share every step.  :class:`TorchRuntime` is the PyTorch
implementation; the ONNX Runtime one lives with the service (``service/onnx_backends.py``).
"""

from __future__ import annotations

import dataclasses
import functools
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from .checkpoint import Checkpoint, folder_relative, load_checkpoint
from .data.datasets import trained_on
from .device import PRECISIONS, autocast, resolve_device
from .decoding import NO_RULES, DecodingRules, Hypothesis, check_search, expand_rows, never_emitted, search_rows
from .encoder import EncoderSpec, GridEncoder, preprocess
from .protocol import AttnRecord, Captioner, DecState, EncState, Geometry, VisualBatch
from .rendering.heatmaps import MODES, FigureRow, RenderError, caption_figure, default_mode, overlay
from .vocab import EOS


@dataclass
class Prepared:
    """An image after decoding and preprocessing (CPU tensors, ready to batch)."""

    pixels: Tensor
    geometry: Geometry

    @classmethod
    def of(cls, image: Image.Image, spec: EncoderSpec) -> "Prepared":
        """``image`` through the one preprocessing path (:func:`~captioner.models.encoder.preprocess`)."""
        return cls(*preprocess(image, spec))


@dataclass
class CaptionResult:
    """One image's caption: the best hypothesis with its attention, where its visual items sit, and which model
    (and beam width) produced it."""

    model: str
    checkpoint: str
    attention_kind: str
    beam_size: int
    words: list[str]
    hypothesis: Hypothesis
    geometry: Geometry
    #: cell boxes (r1, c1, r2, c2) of the ``areas`` extra, for area-attention models (see :func:`area_boxes_of`)
    area_boxes: np.ndarray | None = None
    rules: DecodingRules = NO_RULES  # the length penalty and trigram blocking it was decoded with

    @property
    def caption(self) -> str:
        """The caption as text: its words, joined by spaces."""
        return " ".join(self.words)

    @property
    def attention(self) -> np.ndarray:
        """``[tokens, items]``: row ``i`` is where the model looked as it chose ``tokens[i]`` (non-negative, each
        row summing to 1), over the visual items whose boxes are ``geometry.boxes``."""
        return self.hypothesis.attention.numpy()

    @property
    def tokens(self) -> list[str]:
        """The emitted words, plus ``<eos>`` when the caption ended normally: one per attention row."""
        return self.words + ([EOS] if self.hypothesis.ended_with_eos else [])

    @property
    def default_mode(self) -> str:
        """The heatmap mode its attention is drawn in unless one is asked for: the model's, not only the
        geometry's (a sparse model's is grid_blocks, whose exact zeros grid_smooth would blur away)."""
        return default_mode(self.geometry, self.attention_kind)

    def drawn_rows(self, mode: str) -> np.ndarray:
        """``[tokens, items]`` what a render in ``mode`` draws for each token: the areas' weights (the ``areas`` extra,
        indexed by :attr:`area_boxes`) for ``area_topk``, the attention over the visual items for every other mode."""
        if mode == "area_topk" and "areas" in self.hypothesis.extras:
            return self.hypothesis.extras["areas"].numpy()
        return self.hypothesis.attention.numpy()

    def figure(self, image: Image.Image, mode: str | None = None, **style) -> Image.Image:
        """The papers' figure of this caption on ``image``, the photo it describes: the photo, then each word's
        heatmap (:func:`~captioner.models.rendering.heatmaps.caption_figure`; ``style``: ``cmap``, ``alpha``,
        ``panel_size``, …), in ``mode`` or this model's own (:attr:`default_mode`)."""
        mode, rows = self._drawn(mode)
        return caption_figure(image, self.tokens, rows, self.geometry, mode, area_boxes=self.area_boxes, **style)

    def overlay(self, image: Image.Image, token: int, mode: str | None = None, **style) -> Image.Image:
        """``image`` with the heatmap of token ``token`` (an index into :attr:`tokens`) drawn on it
        (:func:`~captioner.models.rendering.heatmaps.overlay`; ``style``: ``cmap``, ``alpha``)."""
        if not 0 <= token < len(self.tokens):
            raise RenderError(f"token {token} is out of range: the caption has {len(self.tokens)} tokens")
        mode, rows = self._drawn(mode)
        return overlay(image, rows[token], self.geometry, mode, area_boxes=self.area_boxes, **style)

    def figure_row(self, label: str, mode: str | None = None) -> FigureRow:
        """This caption as one row of a :func:`~captioner.models.rendering.heatmaps.comparison_figure`."""
        mode, rows = self._drawn(mode)
        return FigureRow(label, self.tokens, rows, self.geometry, self.area_boxes, mode)

    def _drawn(self, mode: str | None) -> tuple[str, np.ndarray]:
        """The mode a render draws (``mode``, else :attr:`default_mode`) and its rows (:meth:`drawn_rows`)."""
        mode = mode or self.default_mode
        return mode, self.drawn_rows(mode)


@dataclass(frozen=True)
class ModelInfo:
    """What a loaded model is and where it runs (``GET /models``)."""

    name: str
    architecture: str
    attention_kind: str
    attention: str
    vocab_size: int
    checksum: str
    encoder: dict
    parameters: int
    device: str
    backend: str
    trained_on: str = ""  # the data set the checkpoint was trained on (its card cites it)
    decoding: dict = field(default_factory=dict)  # the request defaults of its decoding rules (DecodingRules' fields)
    providers: list[str] | None = None
    heatmap_modes: list[str] = field(default_factory=list)  # the modes its captions' attention can be drawn in


def padded_batch(size: int) -> int:
    """The CNN batch a GPU runtime runs ``size`` images in: the next power of two.  cuDNN picks (and, for some
    engines, compiles) its convolution kernels per input shape on first use, which took about 2 s per new batch
    size on an H200 (docs/decisions.md, "Serving performance"); the service's warm-up runs every power of two
    up to its largest batch, so padded batches never meet a shape first while serving."""
    return 1 << max(0, size - 1).bit_length()


def area_boxes_of(model: Captioner, hyp: Hypothesis, geometry: Geometry) -> np.ndarray | None:
    """The cell boxes that index ``hyp``'s ``areas`` extra (what ``area_topk`` rendering needs), or None."""
    boxes = model.area_boxes(geometry.grid_hw) if "areas" in hyp.extras else None
    return None if boxes is None else boxes.cpu().numpy()


def in_inference_mode(method: Callable) -> Callable:
    """``torch.inference_mode()`` around ``method`` for callers outside it, and nothing for callers inside (the
    batcher's worker runs every step inside one): a fresh context per decoding step cost about 5 % of the
    interpreter lock under load (docs/benchmarks/serving-overhead.md), the same for any size of step."""
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        if torch.is_inference_mode_enabled():
            return method(*args, **kwargs)
        with torch.inference_mode():
            return method(*args, **kwargs)

    return wrapper


class Runtime(ABC):
    """One checkpoint on one device; subclasses supply :meth:`begin`, :meth:`step` and :meth:`reorder`."""

    backend: str = ""
    providers: list[str] | None = None  # ONNX Runtime's execution providers, for the runtimes that run on it

    def __init__(self, name: str, ckpt: Checkpoint, device: torch.device):
        self.name, self.ckpt, self.device = name, ckpt, torch.device(device)
        model = ckpt.model
        self.bos_id, self.eos_id = model.bos_id, model.eos_id
        self.never_emitted = never_emitted(model)
        # CNN batches padded to a power of two (see padded_batch): on a GPU, where a new shape costs seconds
        self.pad_batches = self.device.type == "cuda"

    @property
    def spec(self) -> EncoderSpec:
        return self.ckpt.encoder

    def info(self) -> ModelInfo:
        """What it is and where it runs (``GET /models``), described once: a loaded runtime does not change."""
        return self._info

    @functools.cached_property
    def _info(self) -> ModelInfo:
        model = self.ckpt.model
        return ModelInfo(name=self.name, architecture=model.arch, attention_kind=model.attention_kind,
                         attention=model.attention_name,
                         vocab_size=len(self.ckpt.vocab), checksum=f"sha256:{self.ckpt.checksum}",
                         encoder=self._public_spec().to_json(), parameters=sum(p.numel() for p in model.parameters()),
                         device=str(self.device), backend=self.backend, trained_on=trained_on(self.ckpt.meta),
                         decoding=dataclasses.asdict(self.default_rules),
                         # a photo is captioned on the grid (a region model cannot caption one): every mode draws
                         # it, and area_topk the areas of a model that attends over them
                         heatmap_modes=[m for m in MODES if m != "area_topk" or self.reports_areas],
                         providers=list(self.providers) if self.providers is not None else None)

    def _public_spec(self) -> EncoderSpec:
        """The spec as its checkpoint records it: files inside the checkpoint folder by name, not by this server's
        path to them."""
        return folder_relative(self.spec, self.ckpt.path) if self.ckpt.path is not None else self.spec

    @functools.cached_property
    def reports_areas(self) -> bool:
        """Whether its captions carry the ``areas`` extra that ``area_topk`` draws (decoder area attention)."""
        return self.ckpt.model.area_boxes() is not None

    @property
    def default_rules(self) -> DecodingRules:
        """The decoding rules a request gets unless it names its own: those chosen for the checkpoint on its
        validation split (``captioner tune-decoding``), else none."""
        return DecodingRules.of_checkpoint(self.ckpt.meta)

    def prepare(self, image: Image.Image) -> Prepared:
        return Prepared.of(image, self.spec)

    def pixels(self, batch: list[Prepared], on_device: bool = True) -> Tensor:
        """The batch's network input: on the runtime's device and padded with blank images to
        :func:`padded_batch` rows when ``pad_batches``, or, with ``on_device=False`` (a CNN on the CPU beside a
        GPU decoder), in host memory as it is."""
        pixels = torch.stack([p.pixels for p in batch])
        if not on_device:
            return pixels
        missing = padded_batch(len(batch)) - len(batch) if self.pad_batches else 0
        if missing:
            pixels = torch.cat([pixels, pixels.new_zeros((missing, *pixels.shape[1:]))])
        if self.device.type == "cuda":
            # page-locked host memory lets the copy run asynchronously with the work already queued on the GPU
            return pixels.pin_memory().to(self.device, non_blocking=True)
        return pixels

    def run_cnn(self, batch: list[Prepared], cnn: Callable, on_device: bool = True):
        """``cnn`` over the batch's :meth:`pixels`, with the padding rows cut off what it returns (a batch-first
        tensor, or a list of them)."""
        out = cnn(self.pixels(batch, on_device))
        return [value[:len(batch)] for value in out] if isinstance(out, list) else out[:len(batch)]

    def synchronize(self) -> None:
        """Wait until the device has run everything queued so far (CUDA kernels run asynchronously: without this,
        a wall-clock timing of :meth:`begin` measures only the kernel launches)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- what the batcher calls -----------------------------------------------------------------------------
    @abstractmethod
    def begin(self, batch: list[Prepared], widths: list[int]) -> tuple[EncState, DecState]:
        """Encode a batch of images; image ``i`` gets ``widths[i]`` rows of encoder and decoder state."""

    @abstractmethod
    def step(self, prev: Tensor, state: DecState, enc: EncState) -> tuple[Tensor, DecState, AttnRecord]:
        """One decoding step over every row: log-probs ``[rows, V]``, the new state and its attention."""

    @abstractmethod
    def reorder(self, state: DecState, index: Tensor) -> DecState:
        """Row ``i`` of the returned state is row ``index[i]`` of ``state`` (beam back-pointers, rows leaving)."""

    def result(self, hyp: Hypothesis, geometry: Geometry, beam_size: int,
               rules: DecodingRules = NO_RULES) -> CaptionResult:
        return CaptionResult(self.name, str(self.ckpt.path), self.ckpt.model.attention_kind, beam_size,
                             self.ckpt.vocab.decode(hyp.token_ids), hyp, geometry,
                             area_boxes_of(self.ckpt.model, hyp, geometry), rules)

    # -- a fixed batch, start to finish ---------------------------------------------------------------------
    @torch.inference_mode()
    def caption(self, batch: list[Prepared], beam_size: int, max_len: int,
                rules: DecodingRules = NO_RULES) -> list[CaptionResult]:
        """Caption a fixed batch: :meth:`begin`, then :func:`~captioner.models.decoding.search_rows` over :meth:`step`
        and :meth:`reorder` (the batcher runs the same steps over tables whose requests come and go)."""
        check_search([beam_size], max_len, rules)  # before the encoder runs
        enc, state = self.begin(batch, [beam_size] * len(batch))
        hyps = search_rows(self.step, self.reorder, enc, state, [beam_size] * len(batch), self.bos_id, self.eos_id,
                           self.never_emitted, max_len, rules)
        return [self.result(best, prepared.geometry, beam_size, rules) for prepared, (best,) in zip(batch, hyps)]


def grid_encoder(spec: EncoderSpec, device: torch.device | str) -> GridEncoder:
    """The frozen visual encoder of ``spec`` on ``device``, channels-last (markedly faster convolutions on CPU
    with oneDNN and on tensor cores)."""
    return GridEncoder(spec).to(device).to(memory_format=torch.channels_last)


class TorchRuntime(Runtime):
    """The PyTorch backend: the frozen :class:`~captioner.models.encoder.GridEncoder` (shareable between models with the
    same :class:`~captioner.models.encoder.EncoderSpec`) and the model's own protocol methods.

    ``precision`` ``bfloat16``/``float16`` runs the encoder and every step under :func:`torch.autocast` (weights stay
    float32; matrix products and convolutions run in the lower precision, softmaxes in float32); the log-probs that
    beam search accumulates are returned in float32, so only the network's arithmetic changes, not the search.
    ``encoder`` is None only for a subclass that encodes images by other means (the service's hybrid backend)."""

    backend = "torch"

    def __init__(self, name: str, ckpt: Checkpoint, encoder: GridEncoder | None, device: torch.device,
                 precision: str = "float32"):
        super().__init__(name, ckpt, device)
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
        self.encoder, self.precision = encoder, precision

    def _autocast(self):
        return autocast(self.device, PRECISIONS[self.precision])

    @in_inference_mode
    def begin(self, batch: list[Prepared], widths: list[int]) -> tuple[EncState, DecState]:
        """The order of :func:`captioner.models.decoding.beam_search`: encode, expand, then init_state."""
        with self._autocast():
            feats = self.grid_features(batch)
            model = self.ckpt.model
            enc = expand_rows(model.encode(VisualBatch.from_features(feats, [p.geometry for p in batch])), widths)
            return enc, model.init_state(enc)

    def grid_features(self, batch: list[Prepared]) -> Tensor:
        """The frozen CNN's features of a prepared batch, on this runtime's device (PyTorch's CNN here; the
        service's hybrid runtime runs ONNX Runtime's)."""
        return self.run_cnn(batch, lambda pixels: self.encoder(pixels.contiguous(memory_format=torch.channels_last)))

    @in_inference_mode
    def step(self, prev: Tensor, state: DecState, enc: EncState) -> tuple[Tensor, DecState, AttnRecord]:
        if self.precision == "float32":
            return self.ckpt.model.step(prev, state, enc)
        with self._autocast():
            logprobs, new_state, attn = self.ckpt.model.step(prev, state, enc)
        return logprobs.float(), new_state, AttnRecord(attn.primary.float(),
                                                       {k: v.float() for k, v in attn.extras.items()})

    def reorder(self, state: DecState, index: Tensor) -> DecState:
        return self.ckpt.model.reorder(state, index)


def torch_runtime(checkpoint: str | Path | Checkpoint, device: torch.device | str = "cpu",
                  name: str | None = None, precision: str = "float32") -> TorchRuntime:
    """A :class:`TorchRuntime` of a checkpoint folder (or a loaded checkpoint) with its own encoder."""
    device = resolve_device(str(device))  # "auto", and a GPU this machine lacks said in one line
    ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else load_checkpoint(checkpoint, device)
    ckpt.check_reads_images()
    return TorchRuntime(name or ckpt.name, ckpt, grid_encoder(ckpt.encoder, device), device, precision)
