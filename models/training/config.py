"""The training run's configuration: :class:`TrainConfig` (every field is a ``captioner train`` option, with its
help, choices and least value: :mod:`captioner.models.cli.training` builds the command line from these fields)
and :class:`Progress` (where a run is), both saved as JSON in every snapshot."""

from __future__ import annotations

import functools
import json
import math
import os
import typing
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, Mapping

from ..data.karpathy import DATASET_FORMATS
from ..value_kinds import SCALAR_KINDS
from .precision import PRECISION_CHOICES, canonical_precision


def option(default: Any = None, help: str = "", *, factory: Callable[[], Any] | None = None, **cli: Any) -> Any:
    """A config field with its command-line help (``captioner train`` is generated from these fields).  ``cli``
    may hold ``flag`` (another option name), ``kind`` (``append``, ``keyvalue``, ``pair``), ``choices``,
    ``parse`` (what turns the text into the value, before ``choices`` are checked), ``metavar``, ``least`` (the
    smallest value a count may take), ``within`` (the :class:`Interval` a number must lie in; both are checked by
    argparse and by :func:`check_values`, for each item of a list) and ``cli=False`` (not on the command line)."""
    meta = {"help": help, **cli}
    return field(default_factory=factory, metadata=meta) if factory else field(default=default, metadata=meta)


@dataclass(frozen=True)
class Interval:
    """The values a number option may take, printed as mathematics writes it: ``(0, 1]``, ``[0, inf)``."""

    low: float
    high: float = math.inf
    low_open: bool = False
    high_open: bool = True

    def holds(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below  # NaN holds nowhere

    def __str__(self) -> str:
        return f"{'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"


#: a rate, ε or factor: any positive number
POSITIVE = Interval(0.0, low_open=True)
#: a threshold or weight where 0 turns it off
NOT_NEGATIVE = Interval(0.0)
#: a probability
PROBABILITY = Interval(0.0, 1.0, high_open=False)
#: a share of the target distribution given away (label smoothing), or a decay that must shrink the rate
BELOW_ONE = Interval(0.0, 1.0)


class _SavedRecord:
    """A dataclass saved as JSON: fields added since a file was written take their defaults when it is read."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]):
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass(kw_only=True)
class TrainConfig(_SavedRecord):
    """Everything a training run depends on, with the defaults ``captioner train`` uses.  A recipe
    (``models/recipes/NAME.toml``) replaces some of these; command-line flags replace single values again."""

    out: str = option(help="run directory (best/, last/, train_state.*, metrics.jsonl)", required=True)
    dataset: str = option(".cache/scenes", DATASET_FORMATS)
    recipe: str | None = option(help="paper recipe from models/recipes (sat, sat-hard, aoanet, xlan, xtransformer, "
                                     "sparsecap, area-transformer); flags override its single values")
    model: str | None = option(help="registered model name (see `captioner models`; default: sat, or --init's)")
    model_args: dict[str, Any] = option(factory=dict, help="model hyper-parameter", flag="--set", kind="keyvalue")
    phase: str = option("xe", "xe: cross-entropy (SAT-hard: its REINFORCE objective); scst: self-critical CIDEr-D",
                        choices=("xe", "scst"))
    init: str | None = option(help="start from this checkpoint's model, vocabulary and encoder "
                                   "(e.g. --phase scst --init runs/xe/best)", metavar="CHECKPOINT")
    extend_vocab: bool = option(False, "with --init: append the training captions' words that the checkpoint's "
                                       "vocabulary lacks (their embedding and output rows start fresh)", kind="true")
    features: str | None = option(help="visual items: frozen-encoder grid (default) or precomputed region .npz "
                                       "files in DIR", metavar="grid|regions:DIR")
    image_root: str | None = option(help="folder of the photos (default: where the data set's layout puts them: "
                                              "the Karpathy JSON's folder, beside a Flickr token file, COCO's "
                                              "train2014/ and val2014/)")
    encoder: dict[str, Any] = option(factory=dict, help="EncoderSpec field", kind="keyvalue")
    cache_dir: str = option(".cache/features", "feature cache folder")
    finetune_stages: int = option(0, "fine-tune the encoder's last N stages (EfficientNet-Lite0, layer blocks) on "
                                     "features cached before them; 0: the encoder stays frozen", metavar="N", least=0)
    augment: str = option("none", "xe: hflip shows each training photo as its mirror image in half of the epochs "
                                  "(seeded), with left and right swapped in its captions; the mirror images' "
                                  "features are cached beside the photos'", choices=("none", "hflip"))
    encoder_lr_factor: float = option(0.25, "learning rate of the fine-tuned stages as a share of the decoder's "
                                            "(0.25: 1e-4 against 4e-4, as sgrvinod's SAT code fine-tunes its CNN)",
                                      within=NOT_NEGATIVE)
    epochs: int = option(20, "epochs to train (in total, counting those already trained on --resume)", least=1)
    batch_size: int = option(64, "captions (xe) or images (scst) per optimiser step, over all processes", least=1)
    optimizer: str = option("adam", "optimiser", choices=("adam", "radam"))
    lr: float = option(4e-4, "learning rate (base of the epoch schedule; ignored when --warmup-steps sets Noam)",
                       within=NOT_NEGATIVE)
    adam_betas: list[float] = option(factory=lambda: [0.9, 0.999], help="Adam β1 β2", kind="pair", within=BELOW_ONE)
    adam_eps: float = option(1e-8, "Adam ε", within=POSITIVE)
    lr_drops: list[int] = option(factory=list, help="after this many epochs multiply the learning rate by "
                                 "--lr-drop-factor (repeatable; with --resume, drops may be added ahead of the run)",
                                 flag="--lr-drop", kind="append", metavar="EPOCH", least=1)
    lr_drop_factor: float = option(0.1, "factor of each --lr-drop", within=POSITIVE)
    lr_decay_every: int = option(0, "multiply the learning rate by --lr-decay-factor every this many epochs (0: off)",
                                 least=0)
    lr_decay_factor: float = option(0.8, "factor of the periodic decay", within=POSITIVE)
    lr_decay_start: int = option(0, "first epoch (0-based) the periodic decay counts from", least=0)
    warmup_steps: int = option(0, "Noam schedule with this many warm-up steps (0: off, use the epoch schedule)",
                               least=0)
    noam_dim: int = option(1024, "model width d of the Noam schedule", least=1)
    noam_factor: float = option(1.0, "factor f of the Noam schedule", within=POSITIVE)
    plateau_factor: float = option(0.0, "multiply the learning rate by this when the validation score stops "
                                        "improving (0: off)", within=BELOW_ONE)
    plateau_patience: int = option(3, "validations without improvement before a plateau decay", least=1)
    ss_increase: float = option(0.0, "scheduled sampling: probability added every --ss-every epochs (0: off)",
                                within=PROBABILITY)
    ss_every: int = option(5, "scheduled sampling: epochs between increases", least=1)
    ss_start: int = option(0, "scheduled sampling: first epoch (0-based)", least=0)
    ss_max: float = option(0.5, "scheduled sampling: cap on the probability", within=PROBABILITY)
    grad_clip: float = option(5.0, "gradient clipping threshold (0: off)", within=NOT_NEGATIVE)
    grad_clip_mode: str = option("norm", "clip the global gradient norm or each value", choices=("norm", "value"))
    label_smoothing: float = option(0.0, "XE label smoothing ε", within=BELOW_ONE)
    attention_supervision: str | None = option(
        help="xe: train the attention of every word of a boxed phrase towards its boxes (Liu et al. 2017, "
             "arXiv:1605.09553, strong supervision) from a Flickr30k Entities folder; grid features, models that "
             "train through their decoding step", metavar="entities:DIR")
    attention_supervision_weight: float = option(1.0, "weight λ of --attention-supervision's term",
                                                 within=NOT_NEGATIVE)
    min_count: int = option(1, "keep words seen at least this often", least=1)
    group_by_image: bool = option(False, "xe: put all reference captions of an image in the same batch (the AoANet "
                                         "and X-LAN codes' seq_per_img), so each image is encoded once per batch",
                                  kind="true")
    max_train_len: int = option(16, "training captions are cut to this many words", least=1)
    max_decode_len: int = option(20, "decoding steps in validation and SCST", least=1)
    scst_samples: int = option(5, "captions sampled per image in SCST", least=1)
    scst_reward_eos: bool = option(False, "scst: score the reward with the end token in the sampled captions and the "
                                          "references, as self-critical.pytorch does (docs/decisions.md, \"Flickr8k: "
                                          "SCST with the end token in the reward\")", kind="true")
    scst_baseline: str = option("greedy", "SCST baseline: the greedy caption's reward or the mean of the other "
                                          "samples'", choices=("greedy", "mean"))
    val_beam: int = option(1, "beam size of the validation captions", least=1)
    val_limit: int | None = option(help="validate on the first N validation images", least=1)
    train_limit: int | None = option(help="train on the first N training images", least=1)
    select_metric: str | None = option(help="validation metric that picks best/: BLEU-1..4, CIDEr-D, or "
                                            "objects_named on generated scenes (default: the model's)")
    early_stop: int = option(0, "stop after this many epochs without a better validation score (0: off)", least=0)
    precision: str = option("auto", "auto: bfloat16 on a GPU that has it, else float16 with a grad scaler on a GPU, "
                                    "float32 on CPU (fp32, bf16, fp16: the same)", choices=PRECISION_CHOICES,
                            parse=canonical_precision)
    seed: int = option(0, "random seed")
    device: str = option("auto", "auto, cpu, cuda or cuda:N")
    threads: int | None = option(help="intra-op CPU threads", least=1)
    max_steps: int | None = option(help="stop after this many optimiser steps in total (smoke tests)", least=1)
    checkpoint_every: int = option(200, "save the resumable state every this many steps (and at every epoch's end; "
                                        "0: only there)", least=0)
    log_every: int = option(10, "write a metrics.jsonl record every this many steps (0: only the epochs')", least=0)
    progress: bool = option(True, "no progress bars (for logs and CI)", flag="--no-progress", kind="false")

    def __post_init__(self) -> None:
        # a run saved with fp32/bf16/fp16 (or a caller in code using them) reads as today's names, so its resume,
        # its record and its card's command line say float32/bfloat16/float16
        self.precision = canonical_precision(self.precision)


@dataclass
class Progress(_SavedRecord):
    """Where a run is: saved with every snapshot, so ``--resume`` continues from here."""

    epoch: int = 0  # epochs completed
    step_in_epoch: int = 0
    global_step: int = 0
    best_score: float = -1.0
    best_epoch: int = -1
    history: list[dict[str, Any]] = field(default_factory=list)  # one EpochLog.to_json() per epoch
    #: the last step's training losses, which its epoch's record reports: saved, so that an epoch whose last step
    #: was trained before an interruption still reports them when the resumed run validates it
    losses: dict[str, float] = field(default_factory=dict)
    train_seconds: float = 0.0
    plateau: dict[str, Any] | None = None
    stopped_early: bool = False


def check_values(cfg: TrainConfig) -> None:
    """Every field of ``cfg`` of its declared type, every count at least its field's ``least`` and every number
    within its field's ``within`` (argparse checks the flags; this covers recipes, whose TOML values nothing else
    checks, and configs built in code), so that a batch size of 0, a negative epoch count or gradient clip, label
    smoothing of 2, ``epochs = "10"`` or ``epochs = false`` (False counts as 0) is named before any work, not met as
    a traceback, a division by zero, a run that trains nothing (or backwards) and reports success, or the
    optimiser's refusal once every photo has been encoded."""
    types = declared_types()
    for f in fields(TrainConfig):
        value = getattr(cfg, f.name)
        problem = type_problem(types[f.name], value)
        if problem is None:
            items = value if isinstance(value, (list, tuple)) else [value]
            problem = next(filter(None, (bound_problem(f.metadata, item) for item in items)), None)
        if problem:
            flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
            raise ValueError(f"{flag} {problem}")


@functools.cache
def declared_types() -> dict[str, Any]:
    """Each :class:`TrainConfig` field's declared type (``int``, ``str | None``, ``list[float]``, ...), resolved
    once (the annotations are strings under ``from __future__ import annotations``)."""
    return typing.get_type_hints(TrainConfig)


#: what a value of each declared type is called, and which values are of it (a path given in code is text)
_KINDS: dict[type, tuple[str, Callable[[Any], bool]]] = {
    **SCALAR_KINDS,
    str: ("text", lambda v: isinstance(v, (str, os.PathLike))),
    dict: ("a table", lambda v: isinstance(v, Mapping)),
}


def declared_item(declared: Any) -> tuple[Any, bool]:
    """A field's declared type as the type of one value and whether a list holds such values: ``int | None`` →
    ``(int, False)``, ``list[float]`` → ``(float, True)``, ``dict[str, Any]`` → ``(dict, False)``."""
    if type(None) in typing.get_args(declared):
        (declared,) = [a for a in typing.get_args(declared) if a is not type(None)]
    if typing.get_origin(declared) is list:
        return typing.get_args(declared)[0], True
    return typing.get_origin(declared) or declared, False


def type_problem(declared: Any, value: Any) -> str | None:
    """What is wrong with ``value`` for a field declared ``declared`` (``int``, ``str | None``, ``list[float]``,
    ``dict[str, Any]``), or None; the value is shown as a recipe writes it."""
    if value is None and type(None) in typing.get_args(declared):
        return None
    item, listed = declared_item(declared)
    name, holds = _KINDS[item]
    if listed:
        fits, wanted = isinstance(value, (list, tuple)) and all(map(holds, value)), f"a list, each item {name}"
    else:
        fits, wanted = holds(value), name
    return None if fits else f"must be {wanted}, got {json.dumps(value, default=str)}"


def bound_problem(metadata: Mapping[str, Any], value: Any) -> str | None:
    """What is wrong with ``value`` for a field with this metadata (``least``, ``within``), or None."""
    least, within = metadata.get("least"), metadata.get("within")
    if value is None:
        return None
    if least is not None and value < least:
        return f"must be at least {least}, got {value}"
    if within is not None and not within.holds(value):
        return f"must lie in {within}, got {value}"
    return None
