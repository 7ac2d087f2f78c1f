"""Convert a checkpoint of sgrvinod's "a-PyTorch-Tutorial-to-Image-Captioning"
(github.com/sgrvinod/a-PyTorch-Tutorial-to-Image-Captioning: ``BEST_checkpoint_*.pth.tar`` + ``WORDMAP_*.json``)
into this project's checkpoint: its ``DecoderWithAttention`` into :class:`~captioner.models.sat.ShowAttendTell`
(Show, Attend and Tell, Xu et al. 2015, arXiv:1502.03044) with the four options that express the tutorial's
decoder, its ``Encoder`` (a torchvision ResNet's children but the last two, then ``AdaptiveAvgPool2d((14, 14))``)
into the service's grid encoder with the checkpoint's own trunk weights.

The tutorial's ``utils.save_checkpoint`` pickles whole modules (``torch.save`` of ``{'epoch', 'bleu-4',
'encoder', 'decoder', 'encoder_optimizer', 'decoder_optimizer', ...}``), so the file is code to a plain
``torch.load``.  It is read with :class:`TutorialUnpickler`: every class the file may name (the tutorial's
``Encoder``, ``Attention`` and ``DecoderWithAttention`` of its module ``models``, the ``torch.nn`` layers and
torchvision's ResNet blocks they hold, the Adam optimizers, ``nn.DataParallel``) becomes a :class:`PickledModule`
stand-in that only keeps its pickled attributes; tensors are rebuilt by PyTorch's own tensor rebuilders, plain
containers and ``torch.device`` are allowed; any other global is refused with its name.  No code of a class the
file names ever runs.

The decoder maps one to one (``decoder.<their name>`` → ours):

* ``init_h``/``init_c`` → ``init_h``/``init_c`` with ``init_activation="none"`` (``init_hidden_state``: no tanh);
* ``attention.encoder_att``/``decoder_att``/``full_att`` → ``attend.key``/``query``/``score`` with
  ``attention_score="relu"``; ``encoder_att``'s bias is added to the query's (the two are summed before the ReLU);
* ``f_beta`` → ``gate`` with ``gate="channel"`` (a sigmoid gate per feature channel);
* ``decode_step`` (``LSTMCell`` on ``[embedding; gated context]``) → ``lstm``;
* ``embedding`` and ``fc`` → ``embed`` and ``out_word`` with ``output="hidden"`` (``fc(dropout(h))``), their rows
  permuted into our vocabulary: ``<start>`` → ``<bos>``, ``<end>`` → ``<eos>``; ``<pad>`` and ``<unk>`` keep theirs.
  Every row has exactly one source, so the log-probabilities are the tutorial's, word for word.

The visual input is ``caption.py``'s: the image resized to 256×256 (stretched), ``/255``, ImageNet normalisation,
the trunk's last stage adaptive-average-pooled onto the checkpoint's grid (14×14).  Any torchvision ResNet
(18/34/50/101/152) is recognised from its blocks; the trunk's weights are written beside the model
(``encoder.safetensors``) and checked against torchvision's shapes.
"""

from __future__ import annotations

import contextlib
import json
import warnings
import zipfile
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor

from ..encoder import EncoderSpec
from ..sat import ShowAttendTell
from ..vocab import SPECIALS, Vocabulary
from .common import ConversionError, copy_weights, load_converted
from .safe_pickle import RestrictedUnpickler, UnsafePickleError

__all__ = ["ConversionError", "ENCODER_FILE", "UnsafePickleError", "convert_sgrvinod", "load_tutorial_checkpoint"]

CODE = "github.com/sgrvinod/a-PyTorch-Tutorial-to-Image-Captioning"
ENCODER_FILE = "encoder.safetensors"
IMAGE_SIZE = 256  # caption.py: imresize(img, (256, 256))
#: torchvision ResNet → (block class, blocks per stage)
RESNETS = {("BasicBlock", (2, 2, 2, 2)): "resnet18", ("BasicBlock", (3, 4, 6, 3)): "resnet34",
           ("Bottleneck", (3, 4, 6, 3)): "resnet50", ("Bottleneck", (3, 4, 23, 3)): "resnet101",
           ("Bottleneck", (3, 8, 36, 3)): "resnet152"}
#: index in ``Encoder.resnet`` (``list(resnet.children())[:-2]``) → torchvision's attribute name
TRUNK = {0: "conv1", 1: "bn1", 4: "layer1", 5: "layer2", 6: "layer3", 7: "layer4"}
#: the tutorial's word map specials → ours
SPECIAL_WORDS = {"<pad>": "<pad>", "<start>": "<bos>", "<end>": "<eos>", "<unk>": "<unk>"}


class PickledModule:
    """Stand-in for a class named by the tutorial's pickle: it keeps the pickled attributes (``state``) and runs
    nothing; ``source`` is the class the file named."""

    source: ClassVar[str] = ""

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (__dict__, slots)
            state = {**(state[0] or {}), **(state[1] or {})}
        self.state = state if isinstance(state, dict) else {}

    @property
    def kind(self) -> str:
        return self.source.rsplit(".", 1)[-1]

    def children(self) -> dict[str, Any]:
        modules = self.state.get("_modules")
        return dict(modules) if isinstance(modules, dict) else {}


def _stand_in(source: str) -> type[PickledModule]:
    return type(source.rsplit(".", 1)[-1], (PickledModule,), {"source": source})


def _legacy_backend() -> None:
    """Files of PyTorch 0.4 name ``torch.nn.backends.thnn._get_thnn_function_backend`` as every module's
    ``_backend``; it is data-free, so it becomes None."""


_STAND_INS = ([("models", name) for name in ("Encoder", "Attention", "DecoderWithAttention")]
              + [(f"torch.nn.modules.{module}", name) for module, name in (
                  ("container", "Sequential"), ("conv", "Conv2d"), ("batchnorm", "BatchNorm2d"),
                  ("activation", "ReLU"), ("activation", "Sigmoid"), ("activation", "Softmax"),
                  ("pooling", "MaxPool2d"), ("pooling", "AdaptiveAvgPool2d"), ("linear", "Linear"),
                  ("sparse", "Embedding"), ("dropout", "Dropout"), ("rnn", "LSTMCell"))]
              + [("torchvision.models.resnet", "BasicBlock"), ("torchvision.models.resnet", "Bottleneck"),
                 ("torch.optim.adam", "Adam"), ("torch.nn.parallel.data_parallel", "DataParallel")])


class TutorialUnpickler(RestrictedUnpickler):
    """The allow-list of a tutorial checkpoint: stand-ins for its classes, PyTorch's tensor rebuilders, and the
    containers the modules and optimizers hold (``__builtin__`` is protocol 2's spelling of ``builtins``)."""

    allowed = {**{key: _stand_in(".".join(key)) for key in _STAND_INS},
               ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
               ("torch._utils", "_rebuild_tensor"): torch._utils._rebuild_tensor,
               ("torch._utils", "_rebuild_parameter"): torch._utils._rebuild_parameter,
               # PyTorch 0.4 pickled a parameter as Parameter(tensor, requires_grad), the tutorial's released file
               # among them: the class only wraps a tensor it is given
               ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
               ("torch.nn.backends.thnn", "_get_thnn_function_backend"): _legacy_backend,
               ("torch", "device"): torch.device,  # DataParallel's src_device_obj
               **{(module, name): value for module in ("builtins", "__builtin__")
                  for name, value in (("dict", dict), ("set", set), ("list", list), ("tuple", tuple))},
               ("collections", "OrderedDict"): __import__("collections").OrderedDict,
               ("collections", "defaultdict"): __import__("collections").defaultdict}
    what_is_allowed = ("the tutorial's Encoder/Attention/DecoderWithAttention, the torch.nn layers and torchvision "
                       "ResNet blocks they hold, Adam, and tensors")


class _PickleModule:
    """What ``torch.load(pickle_module=...)`` needs: an ``Unpickler`` class and ``load``."""

    Unpickler = TutorialUnpickler
    __name__ = "captioner_tutorial_pickle"

    @staticmethod
    def load(file: Any, **kwargs: Any) -> Any:
        return TutorialUnpickler(file, **kwargs).load()


def _refuse_torchscript(path: str | Path) -> None:
    """A TorchScript archive (a zip holding ``constants.pkl`` and ``code/``) is handed by ``torch.load`` to
    ``torch.jit.load``, past the pickle module it was given: its ``__setstate__`` code runs (an import could write
    files). The tutorial saves pickles, never TorchScript: such a file is refused before it is opened as one."""
    with contextlib.suppress(OSError, zipfile.BadZipFile):
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as archive:
                if any(name.endswith("constants.pkl") or "/code/" in name for name in archive.namelist()):
                    raise UnsafePickleError(f"refusing to load {path}: it is a TorchScript archive, whose code "
                                            "torch.load would run; the tutorial's checkpoints are pickles "
                                            "(BEST_checkpoint_*.pth.tar)")


def load_tutorial_checkpoint(path: str | Path) -> dict[str, Any]:
    """The checkpoint dict, its modules as :class:`PickledModule` stand-ins (zip and pre-1.6 legacy files)."""
    _refuse_torchscript(path)
    try:
        with warnings.catch_warnings():  # legacy files compare the pickled classes' source with ours: noise here
            warnings.simplefilter("ignore")
            checkpoint = torch.load(path, map_location="cpu", weights_only=False, pickle_module=_PickleModule)
    except (FileNotFoundError, IsADirectoryError, PermissionError, UnsafePickleError):
        raise
    except Exception as error:  # a truncated or foreign file fails anywhere in torch's reader: say which file
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConversionError(f"{path} cannot be read as a tutorial checkpoint: {reason}") from None
    if isinstance(checkpoint, dict):
        for key in ("encoder", "decoder"):  # trained with nn.DataParallel (several GPUs): the wrapped module
            module = checkpoint.get(key)
            if isinstance(module, PickledModule) and module.kind == "DataParallel":
                checkpoint[key] = module.children().get("module")
    if not isinstance(checkpoint, dict) or not all(isinstance(checkpoint.get(k), PickledModule)
                                                   for k in ("encoder", "decoder")):
        raise ConversionError(f"{path} is not a tutorial checkpoint: it needs 'encoder' and 'decoder' modules "
                              f"(BEST_checkpoint_*.pth.tar as utils.save_checkpoint writes it)")
    for key, expected in (("encoder", "models.Encoder"), ("decoder", "models.DecoderWithAttention")):
        if checkpoint[key].source != expected:
            raise ConversionError(f"{path}: '{key}' is a {checkpoint[key].source}, not the tutorial's {expected}")
    return checkpoint


def module_tensors(module: PickledModule, prefix: str = "") -> dict[str, Tensor]:
    """The tensors of a stand-in and its children under their state-dict names (``_parameters``, ``_buffers``,
    ``_modules`` read as data, no hook run)."""
    found: dict[str, Tensor] = {}
    for group in ("_parameters", "_buffers"):
        values = module.state.get(group)
        for name, value in (values.items() if isinstance(values, dict) else ()):
            if value is None:
                continue
            if not isinstance(value, Tensor):
                raise ConversionError(f"{prefix}{name} of the pickled {module.source} is not a tensor")
            found[f"{prefix}{name}"] = value.detach().float() if value.is_floating_point() else value.detach()
    for name, child in module.children().items():
        if child is None:
            continue
        if not isinstance(child, PickledModule):
            raise ConversionError(f"{prefix}{name} of the pickled {module.source} is not a module")
        found.update(module_tensors(child, f"{prefix}{name}."))
    return found


def _trunk(encoder: PickledModule) -> tuple[str, int, dict[str, Tensor]]:
    """torchvision's name of the ResNet, the pooled grid's side and the trunk's weights under torchvision's keys."""
    children = encoder.children()
    resnet, pool = children.get("resnet"), children.get("adaptive_pool")
    if not (isinstance(resnet, PickledModule) and isinstance(pool, PickledModule)
            and pool.kind == "AdaptiveAvgPool2d"):
        raise ConversionError("the encoder is not the tutorial's (resnet trunk + AdaptiveAvgPool2d)")
    size = pool.state.get("output_size")
    sides = tuple(size) if isinstance(size, (tuple, list)) else (size, size)
    if len(sides) != 2 or sides[0] != sides[1] or not isinstance(sides[0], int) or sides[0] < 1:
        raise ConversionError(f"the encoder pools onto {size!r}: only a square grid is supported")
    stages = [resnet.children().get(str(index)) for index in range(4, 8)]
    blocks = {getattr(block, "kind", type(block).__name__) for stage in stages if isinstance(stage, PickledModule)
              for block in stage.children().values()}
    shape = (next(iter(blocks)) if len(blocks) == 1 else "",
             tuple(len(stage.children()) if isinstance(stage, PickledModule) else 0 for stage in stages))
    if len(resnet.children()) != 8 or shape not in RESNETS:
        raise ConversionError(f"the encoder's trunk is not a torchvision ResNet-18/34/50/101/152 "
                              f"({len(resnet.children())} children, blocks {shape})")
    name = RESNETS[shape]
    weights = {}
    for key, tensor in module_tensors(resnet).items():
        index, rest = key.split(".", 1)
        if int(index) not in TRUNK:
            raise ConversionError(f"the encoder's trunk holds weights in child {index}, which a ResNet has not")
        weights[f"{TRUNK[int(index)]}.{rest}"] = tensor.contiguous()
    _check_trunk(name, weights)
    return name, sides[0], weights


def _check_trunk(name: str, weights: dict[str, Tensor]) -> None:
    """The trunk's weights must be torchvision's ``name`` without its classifier: every key, every shape."""
    import torchvision

    expected = {k: v.shape for k, v in getattr(torchvision.models, name)(weights=None).state_dict().items()
                if not k.startswith("fc.")}
    missing, unknown = sorted(expected.keys() - weights.keys()), sorted(weights.keys() - expected.keys())
    wrong = sorted(k for k in expected.keys() & weights.keys() if weights[k].shape != expected[k])
    if missing or unknown or wrong:
        raise ConversionError(f"the encoder's trunk does not fit torchvision's {name} (a widened or modified "
                              f"ResNet?): missing {missing[:3]}, unknown {unknown[:3]}, misshapen {wrong[:3]}")


def read_word_map(path: str | Path, rows: int) -> tuple[Vocabulary, list[int]]:
    """Our vocabulary for the tutorial's ``WORDMAP_*.json`` (word → index) and, for each of our ids, the
    tutorial's index: a permutation of ``range(rows)``."""
    try:
        word_map = json.loads(Path(path).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConversionError(f"{path} is not a JSON word map ({error})") from None
    if not isinstance(word_map, dict) or not all(isinstance(i, int) and not isinstance(i, bool)
                                                 for i in word_map.values()):
        raise ConversionError(f"{path} is not a word map (a JSON object of word → index)")
    missing = [word for word in SPECIAL_WORDS if word not in word_map]
    if missing:
        raise ConversionError(f"{path} lacks the tutorial's special token(s) {missing}: not a WORDMAP_*.json")
    if sorted(word_map.values()) != list(range(rows)):
        raise ConversionError(f"{path} numbers {len(word_map)} words, but the decoder has {rows} output rows: the "
                              f"word map does not belong to this checkpoint (or repeats or skips an index)")
    clashes = [word for word in word_map if word in SPECIALS and word not in SPECIAL_WORDS]
    if clashes:
        raise ConversionError(f"{path} holds {clashes}, which are this project's special tokens")
    words = sorted((i, w) for w, i in word_map.items() if w not in SPECIAL_WORDS)
    vocab = Vocabulary([w for _, w in words])
    source = {vocab.stoi[ours]: word_map[theirs] for theirs, ours in SPECIAL_WORDS.items()}
    source.update({vocab.stoi[w]: i for i, w in words})
    return vocab, [source[i] for i in range(len(vocab))]


def convert_sgrvinod(checkpoint_path: str | Path, word_map_path: str | Path) -> tuple[
        ShowAttendTell, Vocabulary, EncoderSpec, dict[str, Tensor], dict[str, Any]]:
    """The model, its vocabulary, the encoder spec (its ``weights`` is :data:`ENCODER_FILE`, relative to the
    checkpoint folder), the trunk's weights to write there, and the metadata."""
    checkpoint = load_tutorial_checkpoint(checkpoint_path)
    decoder = checkpoint["decoder"]
    state = module_tensors(decoder)
    try:
        rows, embed_dim = state["embedding.weight"].shape
        attn_dim, feat_dim = state["attention.encoder_att.weight"].shape
        hidden_dim = state["decode_step.weight_hh"].shape[1]
    except KeyError as missing:
        raise ConversionError(f"the decoder lacks {missing}: not the tutorial's DecoderWithAttention") from None
    dropout = decoder.children().get("dropout")
    backbone, grid, trunk = _trunk(checkpoint["encoder"])
    vocab, source = read_word_map(word_map_path, int(rows))
    model = ShowAttendTell(len(vocab), int(feat_dim), embed_dim=int(embed_dim), hidden_dim=int(hidden_dim),
                           attn_dim=int(attn_dim), dropout=float(getattr(dropout, "state", {}).get("p", 0.5)),
                           init_activation="none", attention_score="relu", gate="channel", output="hidden",
                           pad_id=vocab.pad_id, bos_id=vocab.bos_id, eos_id=vocab.eos_id)
    names = {f"{mine}.{kind}": f"{theirs}.{kind}" for kind in ("weight", "bias") for mine, theirs in (
        ("init_h", "init_h"), ("init_c", "init_c"), ("attend.score", "attention.full_att"), ("gate", "f_beta"))}
    names.update({f"lstm.{kind}": f"decode_step.{kind}" for kind in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")})
    names.update({"attend.key.weight": "attention.encoder_att.weight", "attend.query.weight":
                  "attention.decoder_att.weight"})
    handled = ("attention.encoder_att.bias", "attention.decoder_att.bias", "embedding.weight", "fc.weight", "fc.bias")
    ours = copy_weights(state, names, what=f"the tutorial's DecoderWithAttention ({Path(checkpoint_path).name})",
                        handled=handled)
    # relu(W_e a + b_e + W_d h + b_d): b_e joins the query's bias, our keys have none
    ours["attend.query.bias"] = state["attention.decoder_att.bias"] + state["attention.encoder_att.bias"]
    rows_of = torch.tensor(source)
    ours["embed.weight"] = state["embedding.weight"][rows_of]
    ours["out_word.weight"], ours["out_word.bias"] = state["fc.weight"][rows_of], state["fc.bias"][rows_of]
    load_converted(model, ours)
    spec = EncoderSpec(backbone=backbone, image_size=IMAGE_SIZE, resize="stretch", layer="layer4",
                       weights=ENCODER_FILE, pooled_grid=grid)
    scalars = {k: v for k, v in checkpoint.items() if isinstance(v, (int, float, str)) and not isinstance(v, bool)}
    meta = {"imported_from": {"code": CODE, "checkpoint": Path(checkpoint_path).name,
                              "word_map": Path(word_map_path).name, **scalars},
            "visual_input": f"images: the checkpoint's {backbone} trunk, {IMAGE_SIZE}x{IMAGE_SIZE} stretched, "
                            f"ImageNet normalisation, pooled onto {grid}x{grid} (caption.py's preprocessing)"}
    return model, vocab, spec, trunk, meta


def encoder_file(weights: dict[str, Tensor]) -> bytes:
    """The trunk's weights as safetensors bytes (no pickle in a checkpoint folder)."""
    from safetensors.torch import save

    return save({k: v.contiguous() for k, v in weights.items()}, metadata={"source": CODE})
