"""The one training loop behind every phase (``xe``, ``scst``; SAT-hard's ``hard_reinforce`` is the ``xe`` phase
with the model's own REINFORCE terms, see :mod:`captioner.models.sat_hard`).

A phase only says what an epoch iterates over and what the loss of a batch is (:class:`Phase`).  This module
owns the rest, in two parts:

* :func:`prepare_run` turns a :class:`TrainConfig` into a :class:`Run`: resume merging, data and features,
  vocabulary, model (from scratch or ``init``), optimiser, schedules, precision and the process group;
* :func:`fit` trains it: the epoch loop with progress bars, scheduled sampling, periodic crash-safe snapshots,
  validation BLEU / CIDEr-D after every epoch, plateau decay, early stopping, ``best/`` and ``last/`` checkpoints and
  a ``metrics.jsonl`` log.

A run directory holds ``best/`` and ``last/`` checkpoints, ``metrics.jsonl`` and ``train_state.*`` (weights,
optimiser, RNG, position inside the epoch), written every ``checkpoint_every`` steps and at each epoch's end.
Ctrl-C or SIGTERM finishes the current step, saves the state and exits; a SIGKILL loses at most the steps since
the last snapshot.  Running the same command with ``--resume`` continues from the saved step with the same data
order.  Under ``torchrun`` every rank trains its share of each batch and only rank 0 writes.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import os
import signal
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable, ClassVar, Collection, Sequence, TypeVar

import numpy as np
import torch
from safetensors.torch import load_file
from safetensors.torch import save as save_tensors
from torch import nn
from tqdm import tqdm

from ..checkpoint import (Checkpoint, check_replaceable, load_checkpoint, remove_debris, save_checkpoint,
                          write_durably)
from ..data.datasets import CITATIONS, ENTITIES_CITATION, dataset_name, load_captioned, resolve_dataset
from ..data.karpathy import CaptionedImage
from ..data.stores import TunedStore, VisualStore, open_feature_store
from ..device import describe_hardware, resolve_device, set_threads
from ..encoder import EncoderSpec, EncoderTail, GridEncoder
from ..evaluation.evaluate import caption_dataset, score_dataset
from ..protocol import Captioner
from ..registry import MODELS
from ..vocab import Vocabulary
from ..zoo import create
from .attention_supervision import check_setting as check_attention_supervision
from .attention_supervision import entities_attention_targets
from .config import Progress, TrainConfig, check_counts
from .distributed import DistContext, init_distributed
from .schedules import NoamWarmup, PlateauDecay, Schedules, ScheduledSampling, StepDecay
from .state import STATE_JSON, load_state, restore_optimizer_state, save_state

METRICS_LOG = "metrics.jsonl"
#: the fine-tuned encoder stages' weights in a checkpoint folder (EncoderSpec.tuned_weights)
TUNED_WEIGHTS = "encoder_tuned.safetensors"


@dataclass
class StepLog:
    """One logged training step (a ``metrics.jsonl`` line with ``"kind": "step"``)."""

    epoch: int  # 1-based
    step: int  # global optimiser step, 1-based
    lr: float
    losses: dict[str, float]
    ss_prob: float
    tokens_per_s: float
    seconds: float  # wall clock of the run so far

    def to_json(self) -> dict[str, Any]:
        return {"kind": "step", "epoch": self.epoch, "step": self.step, "lr": self.lr, "ss_prob": self.ss_prob,
                "tokens_per_s": round(self.tokens_per_s, 1), "seconds": self.seconds,
                **{k: round(v, 5) for k, v in self.losses.items()}}


@dataclass
class EpochLog:
    """One finished epoch: the last batch's losses and the validation scores (``"kind": "epoch"``)."""

    epoch: int
    step: int
    lr: float
    losses: dict[str, float]
    scores: dict[str, float]
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return {"kind": "epoch", "epoch": self.epoch, "step": self.step, "lr": self.lr, "seconds": self.seconds,
                **{k: round(v, 4) for k, v in self.losses.items()}, **{k: round(v, 4) for k, v in self.scores.items()}}


@dataclass
class BatchLoss:
    loss: torch.Tensor
    logs: dict[str, float]
    tokens: int  # target (XE) or sampled (SCST) tokens of this rank's share, for tokens/s


class _StopFlag:
    """Turns SIGINT/SIGTERM into a flag checked between steps, so the state is saved consistently."""

    def __init__(self) -> None:
        self.raised = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "_StopFlag":
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: keep the default behaviour
                pass
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.raised:  # a second Ctrl-C aborts at once
            raise KeyboardInterrupt
        self.raised = True

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class TrainingInterrupted(RuntimeError):
    pass


class Phase:
    """One training objective.  An epoch visits ``size`` examples in a seeded random order, ``batch_size`` at a
    time; :meth:`loss` turns this rank's indices of one batch into the loss to minimise.  ``global_batch`` is the
    whole batch over all ranks: the loss is normalised by it (times the number of ranks, since DDP averages the
    ranks' gradients), so N processes compute the gradient of one process with the same global batch."""

    name: ClassVar[str] = ""

    def __init__(self, cfg: TrainConfig, model: Captioner, vocab: Vocabulary, store: VisualStore,
                 images: Sequence[CaptionedImage], device: torch.device):
        self.cfg, self.model, self.vocab, self.store = cfg, model, vocab, store
        self.images, self.device = images, device
        self.ss_prob = 0.0  # scheduled-sampling probability of the current epoch (set by the loop)
        self.world = 1

    @property
    def size(self) -> int:
        raise NotImplementedError

    def loss(self, batch: Sequence[int], global_batch: Sequence[int] | None = None) -> BatchLoss:
        raise NotImplementedError

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The examples of 0-based ``epoch`` in visiting order: a permutation seeded by (seed, epoch), so a resumed
        run sees the same order."""
        return np.random.default_rng([self.cfg.seed, epoch]).permutation(self.size)

    def selection_metric(self) -> str:
        """Validation metric that picks ``best/``."""
        return self.cfg.select_metric or self.model.selection_metric


PHASES: dict[str, type[Phase]] = {}
P = TypeVar("P", bound=type[Phase])


def register_phase(name: str) -> Callable[[P], P]:
    def wrap(cls: P) -> P:
        cls.name = name
        PHASES[name] = cls
        return cls

    return wrap


class _PhaseModule(nn.Module):
    """Puts a phase's loss behind ``forward`` so DistributedDataParallel sees the forward pass it synchronises."""

    def __init__(self, model: Captioner, phase: Phase, tail: EncoderTail | None = None):
        super().__init__()
        self.model = model
        self.tail = tail  # fine-tuned encoder stages: their gradients are synchronised too
        self._phase = (phase,)  # a tuple: not a registered submodule

    def forward(self, batch: Sequence[int], global_batch: Sequence[int]) -> tuple[torch.Tensor, dict, int]:
        out = self._phase[0].loss(batch, global_batch)
        return out.loss, out.logs, out.tokens


@dataclass(frozen=True)
class Precision:
    """Autocast dtype (None: fp32) and whether a gradient scaler guards fp16 against underflow."""

    name: str
    dtype: torch.dtype | None
    scaled: bool

    def autocast(self, device: torch.device):
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.dtype)


def resolve_precision(name: str, device: torch.device) -> Precision:
    """``auto`` → bf16 on a GPU that supports it, fp16 (scaled) on older GPUs, fp32 on CPU; an explicit
    ``bf16`` also runs on CPU (autocast), ``fp16`` needs CUDA."""
    if name == "auto":
        if device.type != "cuda":
            name = "fp32"
        else:
            name = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    if name == "fp32":
        return Precision("fp32", None, False)
    if name == "bf16":
        return Precision("bf16", torch.bfloat16, False)
    if name == "fp16":
        if device.type != "cuda":
            raise ValueError("--precision fp16 needs a CUDA device (use bf16 or fp32 on CPU)")
        return Precision("fp16", torch.float16, True)
    raise ValueError(f"unknown precision {name!r}; choose auto, fp32, bf16 or fp16")


def build_schedules(cfg: TrainConfig) -> Schedules:
    epoch_rate = StepDecay(cfg.lr, cfg.lr_decay_factor, cfg.lr_decay_every, cfg.lr_decay_start,
                           tuple(cfg.lr_drops), cfg.lr_drop_factor)
    warmup = NoamWarmup(cfg.noam_dim, cfg.warmup_steps, cfg.noam_factor) if cfg.warmup_steps else None
    plateau = PlateauDecay(cfg.plateau_factor, cfg.plateau_patience) if cfg.plateau_factor else None
    sampling = ScheduledSampling(cfg.ss_increase, cfg.ss_every, cfg.ss_start, cfg.ss_max)
    return Schedules(epoch_rate, warmup, plateau, sampling)


def learning_rate(cfg: TrainConfig, epoch: int, global_step: int = 0) -> float:
    """The rate of 0-based ``epoch`` (and step, under Noam), before any plateau decay."""
    return replace(build_schedules(cfg), plateau=None).learning_rate(epoch, global_step)


def _adopt_init(cfg: TrainConfig, init: Checkpoint) -> TrainConfig:
    """Take architecture, hyper-parameters, encoder and feature source from the ``init`` checkpoint; ``--set``
    values still override hyper-parameters (a shape change then fails loudly when the weights are loaded)."""
    if cfg.encoder and EncoderSpec(**cfg.encoder) != init.encoder:
        raise ValueError(f"--encoder differs from the encoder {cfg.init} was trained with")
    args = {k: v for k, v in init.model.config().items() if k not in ("vocab_size", "feat_dim")}
    if cfg.model not in (None, init.model.arch):  # another architecture: only the sizes it has (SAT → SAT-hard)
        accepted = inspect.signature(MODELS[cfg.model]).parameters if cfg.model in MODELS else {}
        args = {k: v for k, v in args.items() if k in accepted}
    return replace(cfg, model=cfg.model or init.model.arch,
                   model_args={**args, **cfg.model_args}, encoder=init.encoder.to_json(),
                   features=cfg.features or init.trained_features)


def _lineage(path: str, init: Checkpoint) -> dict[str, Any]:
    """What a warm start began from, for the model card: the checkpoint's architecture, data, epochs, training time,
    its own command and, recursively, what it began from."""
    from .recipes import command_line

    meta = init.meta
    return {"checkpoint": str(path), "arch": init.model.arch, "dataset": meta.get("dataset"),
            "phase": meta.get("phase"), "epochs": len(meta.get("history", [])), "best_epoch": meta.get("best_epoch"),
            "train_seconds": meta.get("train_seconds"),
            "command": command_line(meta["train_config"]) if "train_config" in meta else None,
            "started_from": meta.get("started_from")}


def _grown_by_words(own: torch.Tensor, theirs: torch.Tensor, old_words: int, new_words: int) -> bool:
    """Whether ``own`` is ``theirs`` with more rows for an appended vocabulary (embedding, output layer)."""
    return (new_words > old_words and own.dim() >= 1 and own.shape[0] == new_words and theirs.shape[0] == old_words
            and own.shape[1:] == theirs.shape[1:])


def _load_init_weights(model: Captioner, init: Checkpoint, source: str) -> None:
    """Copy ``init``'s weights into ``model``. Another architecture is accepted when every parameter of ``model``
    is in the checkpoint with its shape (e.g. SAT-hard from a soft SAT: the same network without the β gate);
    the checkpoint's extra parameters are dropped and named (docs/decisions.md, "Warm starts")."""
    own, theirs = model.state_dict(), init.model.state_dict()
    fits = {k for k in own if k in theirs and theirs[k].shape == own[k].shape}
    # a vocabulary extended by --extend-vocab: rows of the checkpoint's words copied, the appended words' kept fresh
    grown = {k for k in own if k in theirs and k not in fits and _grown_by_words(own[k], theirs[k], len(init.vocab),
                                                                                  model.vocab_size)}
    weights = {k: theirs[k] if k in fits else own[k] for k in own}
    for key in grown:
        weights[key] = torch.cat([theirs[key], own[key][len(init.vocab):]])
    fits |= grown
    # a buffer the checkpoint lacks (SAT-hard's REINFORCE baseline) keeps its fresh value; a parameter may not
    missing = sorted(k for k, _ in model.named_parameters() if k not in fits)
    if missing:
        raise ValueError(f"{source} ({init.model.arch}) cannot initialise {type(model).__name__}: no weights of the "
                         f"right shape for {', '.join(missing[:8])}{' …' if len(missing) > 8 else ''}")
    dropped = sorted(set(theirs) - set(own))
    if dropped:
        print(f"--init {source}: {init.model.arch} weights {type(model).__name__} has no use for: {', '.join(dropped)}")
    model.load_state_dict(weights)


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():  # multinomial sampling (SCST, SAT-hard) on a GPU draws from the CUDA generator
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(state["cuda"]))


def _check_schedule_change(before: TrainConfig, after: TrainConfig, epochs_done: int) -> None:
    """A schedule changed on --resume must agree with the old one on the epochs already trained, so the resumed run
    equals one trained with the new schedule from the start."""
    for epoch in range(epochs_done):
        if learning_rate(before, epoch) != learning_rate(after, epoch):
            raise ValueError(f"the new --lr-drop schedule changes the learning rate of epoch {epoch + 1}, which this "
                             f"run has already trained; drops can only be added at epoch {epochs_done} or later")


#: what --resume may change: the length of the run and how it runs, never the recipe.  These stay the run's own
#: unless the command gives them...
RESUME_OVERRIDES = ("epochs", "checkpoint_every", "log_every", "precision", "early_stop")
#: ...and these belong to the process, whatever the run had (a --max-steps kept would stop every later resume
#: at once; a GPU run resumed on a CPU machine must not ask for its GPU)
PER_PROCESS = ("max_steps", "progress", "threads", "device")


#: the options that name files or folders, which a run reads relative to the folder it was started from...
PATH_OPTIONS = ("dataset", "image_root", "cache_dir", "init")
#: ...and those that name one after a kind (``regions:DIR``, ``entities:DIR``)
PREFIXED_PATH_OPTIONS = ("features", "attention_supervision")


def _read_from(saved: dict[str, Any], announce: bool) -> dict[str, Any]:
    """The saved run's config with its relative paths read from the folder the run was started in, when this
    process runs elsewhere (``--resume`` from another folder finds the data, cache and ``--init`` the run found)."""
    started_in, config = saved.get("working_dir"), saved["config"]
    if not started_in or Path(started_in).resolve() == Path.cwd().resolve():
        return config

    def rebased(path: str) -> str:
        return path if os.path.isabs(path) else os.path.join(started_in, path)

    changes = {name: rebased(config[name]) for name in PATH_OPTIONS if config.get(name)}
    for name in PREFIXED_PATH_OPTIONS:
        kind, colon, where = (config.get(name) or "").partition(":")
        if where:
            changes[name] = f"{kind}{colon}{rebased(where)}"
    if announce:
        print(f"the run was started in {started_in}: its relative paths are read from there")
    return {**config, **changes}


def _merge_resume(cfg: TrainConfig, saved_config: dict[str, Any], epochs_done: int,
                  explicit: Collection[str] | None = None) -> TrainConfig:
    """The saved run's config, with what may change on resume (its length, how it runs, a learning-rate drop)
    taken from ``cfg``: only the options the command gave (``explicit``, their names; None: all of them, as a
    caller building ``cfg`` in code means them), so a ``--resume`` without ``--epochs`` keeps the run's epochs."""
    before = TrainConfig.from_json(saved_config)
    stated = (lambda name: True) if explicit is None else (lambda name: name in explicit)
    schedule = {"lr_drops": cfg.lr_drops, "lr_drop_factor": cfg.lr_drop_factor} \
        if cfg.lr_drops and stated("lr_drops") else {}
    merged = replace(before, **{k: getattr(cfg, k) for k in RESUME_OVERRIDES if stated(k)},
                     **{k: getattr(cfg, k) for k in PER_PROCESS}, **schedule)
    # a value given now that the run's own recipe overrides is said, not dropped in silence (the data set is
    # compared as resolved: the run recorded its resolved path)
    defaults = TrainConfig(out=cfg.out)
    given = {f.name: getattr(cfg, f.name) for f in fields(TrainConfig)
             if f.name not in (*RESUME_OVERRIDES, *PER_PROCESS, "lr_drops", "lr_drop_factor", "out", "dataset")
             and (stated(f.name) if explicit is not None else getattr(cfg, f.name) != getattr(defaults, f.name))
             and getattr(cfg, f.name) != getattr(before, f.name)}
    if cfg.dataset != defaults.dataset and cfg.dataset != before.dataset:
        with contextlib.suppress(OSError, ValueError):
            if Path(resolve_dataset(cfg.dataset)).resolve() != Path(before.dataset).resolve():
                given["dataset"] = cfg.dataset
    if given:
        print("resuming keeps the run's recipe; ignored: " + ", ".join(
            f"{name}={value!r} (the run's: {getattr(before, name)!r})" for name, value in given.items()))
    _check_schedule_change(before, merged, epochs_done)
    return merged


@dataclass
class Run:
    """A prepared training run: everything :func:`fit` needs, built by :func:`prepare_run`."""

    cfg: TrainConfig
    run_dir: Path
    device: torch.device
    dist: DistContext
    spec: EncoderSpec
    vocab: Vocabulary
    model: Captioner
    store: VisualStore
    phase: Phase
    val_images: list[CaptionedImage]
    optimizer: torch.optim.Optimizer
    schedules: Schedules
    precision: Precision
    progress: Progress
    select: str
    meta: dict[str, Any]
    scaler: torch.amp.GradScaler | None = None
    tail: EncoderTail | None = None  # the encoder's fine-tuned stages (--finetune-stages), else None
    trainer: nn.Module | None = None  # the DDP-wrapped phase under torchrun, else the plain _PhaseModule
    started: float = field(default_factory=time.time)

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.phase.size / self.cfg.batch_size)

    def elapsed(self) -> float:
        """Wall clock of the whole run: it adds up across --resume, so a resumed run's card reports all of it."""
        return round(self.progress.train_seconds + time.time() - self.started, 1)


def _is_run_log(path: Path) -> bool:
    """Whether ``path`` holds nothing but this loop's records, and at most the start of one more (a write that was
    killed: no newline after it)."""
    text = path.read_text(errors="replace")
    lines = text.splitlines()
    if lines and not text.endswith("\n"):
        torn, start = lines.pop(), '{"kind": "'
        if not (torn.startswith(start) or start.startswith(torn)):
            return False
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            return False
        if not isinstance(record, dict) or record.get("kind") not in ("step", "epoch"):
            return False
    return True


def _check_new_run_folder(run_dir: Path, announce: bool) -> None:
    """A new run writes into ``run_dir`` only what is its own to write, checked before any work (an unusable
    ``best/`` was met only at the end of the first epoch): not into a checkpoint folder, not over a ``best/`` or
    ``last/`` that is no checkpoint, not on a ``metrics.jsonl`` that is not a run's log.  A log of this loop's
    records without a resumable state is an earlier start killed before its first snapshot: its steps are trained
    again, so :func:`fit` drops them rather than log them twice."""
    if (run_dir / "config.json").is_file():
        raise FileExistsError(f"--out {run_dir} is a checkpoint folder, not a run's: choose another --out (a run "
                              "writes its checkpoints into best/ and last/ below it)")
    for name in ("best", "last"):
        check_replaceable(run_dir / name)
    log = run_dir / METRICS_LOG
    if log.is_file() and not _is_run_log(log):
        raise FileExistsError(f"{log} is not a training log (its lines are not this loop's records): nothing was "
                              "written there; choose another --out")
    if log.is_file() and log.stat().st_size and announce:
        print(f"{run_dir} holds the log of a start that stopped before its first snapshot (--checkpoint-every): "
              "the run starts afresh and its log with it")


def _check_combinations(cfg: TrainConfig, resumed: bool) -> None:
    """Refuse options that cannot work together, before any data is read (``cfg`` resolved: its model and features
    named)."""
    if cfg.finetune_stages and cfg.features != "grid":
        raise ValueError("--finetune-stages fine-tunes the grid encoder; it cannot be combined with --features "
                         f"{cfg.features}")
    if cfg.features != "grid" and cfg.model_args.get("attention") == "tvmax":
        # TVmax's total variation runs over a grid's 4-neighbour pairs (SparseCap, Martins et al., arXiv:2002.05556,
        # Eq. 3 and Definition 1); regions have no grid, and a padded count read as one (9 regions as 3×3) means
        # nothing
        raise ValueError("--attention tvmax needs grid features (its total variation is over neighbouring cells); "
                         f"with --features {cfg.features} use softmax or sparsemax")
    if cfg.augment != "none" and cfg.phase != "xe":
        raise ValueError(f"--augment {cfg.augment} applies to the xe phase (its captions are the references); "
                         f"--phase {cfg.phase} samples its own")
    if cfg.phase == "scst" and cfg.scst_baseline == "mean" and cfg.scst_samples < 2:
        raise ValueError("--scst-baseline mean compares each sample with the image's other samples: give "
                         f"--scst-samples 2 or more (got {cfg.scst_samples})")
    if cfg.phase == "scst" and not cfg.init and not resumed:
        # self-critical training samples from the model it improves: from random weights every sample scores 0
        raise ValueError("--phase scst starts from a trained model: give --init RUN/best (its XE stage)")
    if cfg.extend_vocab and not cfg.init:
        raise ValueError("--extend-vocab adds the data's new words to the vocabulary of --init's checkpoint: "
                         "give --init")


def _choose_vocab(cfg: TrainConfig, saved: dict[str, Any] | None, init: Checkpoint | None,
                  train_images: Sequence[CaptionedImage]) -> Vocabulary:
    """The resumed run's vocabulary, else ``--init``'s (with ``--extend-vocab``, the training captions' new words
    appended), else the training captions' words at ``--min-count``."""
    def data_vocab() -> Vocabulary:
        return Vocabulary.build((r for im in train_images for r in im.references), min_count=cfg.min_count)

    if saved is not None:
        return Vocabulary.from_json(saved["vocab"])
    if init is not None and cfg.extend_vocab:  # appended, so every word keeps its id and its trained rows
        return Vocabulary(init.vocab.itos + [w for w in data_vocab().itos if w not in init.vocab.stoi])
    if init is not None:
        return init.vocab
    return data_vocab()


def _restore(saved: dict[str, Any], cfg: TrainConfig, run_dir: Path, ctx: DistContext, model: Captioner,
             tail: EncoderTail | None, optimizer: torch.optim.Optimizer,
             scaler: torch.amp.GradScaler | None) -> Progress:
    """Put a saved state back: the weights (the tuned encoder stages' too), the optimiser, the random streams and
    the grad scaler; returns where the run is, after saying so."""
    model.load_state_dict(saved["model"])
    if tail is not None:
        tail.load_tuned_state(saved["encoder_tail"])
    optimizer.load_state_dict(restore_optimizer_state(saved["optimizer"]))
    progress = Progress.from_json(saved["progress"])
    rngs = saved.get("rng_ranks") or [saved["rng"]]
    if len(rngs) == ctx.world:
        _set_rng_state(rngs[ctx.rank])
    else:  # resumed on another number of processes: a fresh, still rank-distinct stream
        torch.manual_seed(hash((cfg.seed, ctx.rank, progress.global_step)) & 0x7FFFFFFF)
    if scaler is not None and saved.get("scaler"):
        scaler.load_state_dict(saved["scaler"])
    if ctx.is_main:
        if progress.epoch >= cfg.epochs or progress.stopped_early:
            how = "stopped early" if progress.stopped_early else f"{progress.epoch} epochs"
            print(f"{run_dir} has finished ({how}): nothing to train; --epochs N with N > {progress.epoch} "
                  "continues it")
        else:
            print(f"resuming {run_dir} at epoch {progress.epoch + 1}, step {progress.step_in_epoch}")
    return progress


def _run_meta(cfg: TrainConfig, train_count: int, device: torch.device, ctx: DistContext, precision: Precision,
              saved: dict[str, Any] | None, init: Checkpoint | None) -> dict[str, Any]:
    """The record every checkpoint of the run carries: its data (with citation), phase, config, hardware,
    precision and, for a warm start, what it started from."""
    name = dataset_name(cfg.dataset)
    meta = {"dataset": str(cfg.dataset), "phase": cfg.phase, "train_config": cfg.to_json(),
            "trained_on": f"{CITATIONS.get(name, name)}, train split ({train_count:,} images)"
                          + (f", its attention supervised by the {ENTITIES_CITATION} boxes of those photos"
                             if cfg.attention_supervision else ""),
            "hardware": describe_hardware(device) + (f" ×{ctx.world} processes" if ctx.active else ""),
            "precision": precision.name}
    if cfg.init:  # read at the first start: by a resume, the --init folder may hold another checkpoint
        meta["started_from"] = saved.get("started_from") if saved is not None else _lineage(cfg.init, init)
    return meta


def prepare_run(cfg: TrainConfig, resume: bool = False, explicit: Collection[str] | None = None) -> Run:
    """Everything before the first step: resume merging, data, features, vocabulary, model, optimiser, schedules,
    precision and (under torchrun) the process group."""
    set_threads(cfg.threads)
    ctx, device_name = init_distributed(cfg.device)
    device = resolve_device(device_name)
    run_dir = Path(cfg.out)
    if run_dir.exists() and not run_dir.is_dir():
        raise FileExistsError(f"--out {run_dir} is a file; a run is a folder (best/, last/, {METRICS_LOG}, "
                              "train_state.*): choose another --out")
    if ctx.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
    ctx.barrier()
    saved = load_state(run_dir) if resume else None
    if resume and saved is None and ctx.is_main:  # a mistyped --out would otherwise go unnoticed
        print(f"nothing to resume in {run_dir}: a new run starts there")
    if saved is None and (run_dir / STATE_JSON).exists() and not resume:
        raise FileExistsError(f"{run_dir} already holds a training run: pass --resume to continue it, "
                              "or choose another --out (nothing is overwritten)")
    if saved is None:
        _check_new_run_folder(run_dir, announce=ctx.is_main)
    if saved is not None:  # a resumed run keeps its recipe; only its length and how it runs may change
        cfg = _merge_resume(cfg, _read_from(saved, announce=ctx.is_main), saved["progress"]["epoch"], explicit)
        if ctx.is_main:  # what a killed save left beside best/ and last/
            for name in ("best", "last"):
                remove_debris(run_dir / name)
    check_counts(cfg)
    cfg = replace(cfg, dataset=str(resolve_dataset(cfg.dataset)))
    if cfg.phase not in PHASES:
        raise ValueError(f"unknown phase {cfg.phase!r}; choose from {', '.join(sorted(PHASES))}")
    init = load_checkpoint(cfg.init) if cfg.init and saved is None else None
    if init is not None:
        cfg = _adopt_init(cfg, init)
    # the defaults a warm start would otherwise have supplied: SAT, on the encoder's grid
    cfg = replace(cfg, model=cfg.model or "sat", features=cfg.features or "grid")
    precision = resolve_precision(cfg.precision, device)

    spec = EncoderSpec(**cfg.encoder)
    _check_combinations(cfg, resumed=saved is not None)
    entities_dir = check_attention_supervision(cfg) if cfg.attention_supervision else None
    cache_spec = replace(spec, stop_stages=cfg.finetune_stages)  # the tuned stages' input, when there are some
    train_images = load_captioned(cfg.dataset, cfg.image_root, ("train",), limit=cfg.train_limit)
    val_images = load_captioned(cfg.dataset, cfg.image_root, ("val",), limit=cfg.val_limit)
    if not train_images or not val_images:
        raise ValueError(f"{cfg.dataset} needs non-empty 'train' and 'val' splits "
                         f"(found {len(train_images)} train, {len(val_images)} val)")
    selectable = ["BLEU-1", "BLEU-2", "BLEU-3", "BLEU-4", "CIDEr-D"]
    if val_images[0].info.get("objects") is not None:
        selectable.append("objects_named")  # generated scenes: the share of objects named with colour and shape
    if cfg.select_metric and cfg.select_metric not in selectable:
        raise ValueError(f"--select-metric {cfg.select_metric!r} is not measured on validation; "
                         f"choose from {', '.join(selectable)}")
    # rank 0 extracts missing features first; the others then open the finished store
    store = None
    for turn in (True, False):
        if ctx.is_main == turn:
            store = open_feature_store(cfg.features, train_images + val_images, cache_spec, cfg.cache_dir,
                                       device=str(device), progress=cfg.progress and ctx.is_main,
                                       mirrored=train_images if cfg.augment == "hflip" else ())
        ctx.barrier()
    tail = EncoderTail(GridEncoder(spec), cfg.finetune_stages).to(device) if cfg.finetune_stages else None
    if tail is not None:
        store = TunedStore(store, tail)

    vocab = _choose_vocab(cfg, saved, init, train_images)
    # seeded here, not earlier: building the encoder (only when the feature cache is cold) draws random numbers too,
    # and a run's initial weights must not depend on whether its features were cached
    torch.manual_seed(cfg.seed)
    model = create(cfg.model, vocab_size=len(vocab), feat_dim=store.feat_dim, **cfg.model_args).to(device)
    if init is not None:
        _load_init_weights(model, init, cfg.init)
    optimizer_cls = {"adam": torch.optim.Adam, "radam": torch.optim.RAdam}[cfg.optimizer]
    groups = [{"params": list(model.parameters())}]
    if tail is not None:  # ImageNet features need smaller steps than a decoder trained from scratch
        groups.append({"params": list(tail.parameters()), "lr_factor": cfg.encoder_lr_factor})
    optimizer = optimizer_cls(groups, lr=cfg.lr, betas=tuple(cfg.adam_betas), eps=cfg.adam_eps)
    phase = PHASES[cfg.phase](cfg, model, vocab, store, train_images, device)
    phase.world = ctx.world
    if entities_dir is not None:
        targets = entities_attention_targets(train_images, entities_dir, spec, cfg.max_train_len,
                                             progress=cfg.progress and ctx.is_main)
        if ctx.is_main:
            print(targets.summary())
        phase.supervise_attention(targets)
    schedules = build_schedules(cfg)
    scaler = torch.amp.GradScaler(device.type) if precision.scaled else None

    progress = Progress()
    if saved is not None:
        progress = _restore(saved, cfg, run_dir, ctx, model, tail, optimizer, scaler)
    elif ctx.active:
        torch.manual_seed(cfg.seed * 1000 + ctx.rank)  # ranks draw different dropout masks and samples
    if schedules.plateau is not None and progress.plateau:
        schedules.plateau.load_state_dict(progress.plateau)

    trainer: nn.Module = _PhaseModule(model, phase, tail)
    if ctx.active:
        trainer = nn.parallel.DistributedDataParallel(
            trainer, device_ids=[device.index] if device.type == "cuda" else None, forward_sync_buffers=False,
            # optional branches (flags, SAT-hard's soft/hard switch) leave some parameters without a gradient
            find_unused_parameters=True)
    meta = _run_meta(cfg, len(train_images), device, ctx, precision, saved, init)
    return Run(cfg=cfg, run_dir=run_dir, device=device, dist=ctx, spec=spec, vocab=vocab, model=model, store=store,
               phase=phase, val_images=val_images, optimizer=optimizer, schedules=schedules, precision=precision,
               progress=progress, select=phase.selection_metric(), meta=meta, scaler=scaler, tail=tail,
               trainer=trainer)


# -- fit --------------------------------------------------------------------------------------------------------
def _snapshot(run: Run) -> None:
    """Save the resumable state (every rank takes part: the RNG states of all ranks are gathered to rank 0)."""
    rngs = run.dist.gather(_rng_state())
    if not run.dist.is_main:
        return
    run.progress.train_seconds = run.elapsed()
    run.started = time.time()
    run.progress.plateau = run.schedules.plateau.state_dict() if run.schedules.plateau else None
    state = {"config": run.cfg.to_json(), "vocab": run.vocab.to_json(), "progress": run.progress.to_json(),
             "model": run.model.state_dict(), "optimizer": run.optimizer.state_dict(),
             "rng_ranks": rngs, "started_from": run.meta.get("started_from"), "working_dir": os.getcwd()}
    if run.scaler is not None:
        state["scaler"] = run.scaler.state_dict()
    if run.tail is not None:
        state["encoder_tail"] = run.tail.tuned_state()
    save_state(run.run_dir, state)


def _log(run: Run, record: StepLog | EpochLog) -> None:
    if run.dist.is_main:
        with open(run.run_dir / METRICS_LOG, "a") as handle:
            handle.write(json.dumps(record.to_json()) + "\n")


def _trim_metrics_log(run: Run) -> None:
    """On resume, drop records of steps after the snapshot (they will be trained again) and a torn last line."""
    path = run.run_dir / METRICS_LOG
    if not run.dist.is_main or not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("step", 0) <= run.progress.global_step:
            keep.append(line)
    # a new file renamed over the old one: a crash in the middle leaves the whole log, never half of it
    trimmed = path.with_name(f".{path.name}.trimmed")
    trimmed.unlink(missing_ok=True)
    write_durably(trimmed, "".join(f"{line}\n" for line in keep).encode())
    os.replace(trimmed, path)


def _optimizer_step(run: Run, loss: torch.Tensor) -> None:
    cfg, params = run.cfg, [p for group in run.optimizer.param_groups for p in group["params"] if p.requires_grad]
    run.optimizer.zero_grad(set_to_none=True)
    if run.scaler is not None:
        run.scaler.scale(loss).backward()
        run.scaler.unscale_(run.optimizer)  # clip the true gradients
    else:
        loss.backward()
    if cfg.grad_clip:
        if cfg.grad_clip_mode == "value":
            torch.nn.utils.clip_grad_value_(params, cfg.grad_clip)
        else:
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
    if run.scaler is not None:
        run.scaler.step(run.optimizer)
        run.scaler.update()
    else:
        run.optimizer.step()


def _validate(run: Run, epoch: int, lr: float, logs: dict[str, float]) -> EpochLog:
    """Rank 0 captions and scores the validation split; every rank gets the same record."""
    scores = None
    if run.dist.is_main:
        captions = caption_dataset(run.model, run.vocab, run.val_images, run.store, run.cfg.val_beam,
                                   run.cfg.max_decode_len, device=str(run.device))
        scores = score_dataset(captions, run.val_images, ("BLEU", "CIDEr-D"))
    scores = run.dist.from_main(scores)
    return EpochLog(epoch=epoch + 1, step=run.progress.global_step, lr=lr, losses=logs, scores=scores,
                       seconds=run.elapsed())


def _encoder_files(run: Run) -> tuple[EncoderSpec, dict[str, bytes]]:
    """The encoder spec a checkpoint of this run records, and the fine-tuned stages' weights it carries: those the
    run trained, over those its ``--init`` checkpoint brought (which a frozen run passes on unchanged)."""
    tuned = load_file(run.spec.tuned_weights) if run.spec.tuned_weights else {}
    if run.tail is not None:
        tuned.update(run.tail.tuned_state())
    if not tuned:
        return run.spec, {}
    return replace(run.spec, tuned_weights=TUNED_WEIGHTS), {TUNED_WEIGHTS: save_tensors(tuned)}


def _end_epoch(run: Run, record: EpochLog) -> None:
    progress, cfg = run.progress, run.cfg
    row = record.to_json()
    row.pop("kind")
    progress.history.append(row)
    score = record.scores[run.select]
    improved = score > progress.best_score
    if run.dist.is_main:
        print(json.dumps(row))
        _log(run, record)
        run.meta.update(history=progress.history, train_seconds=run.elapsed())
        spec, files = _encoder_files(run)
        save_checkpoint(run.run_dir / "last", run.model, run.vocab, spec, run.meta, files=files)
        if improved:
            save_checkpoint(run.run_dir / "best", run.model, run.vocab, spec,
                            {**run.meta, "selected_by": run.select, "best_epoch": record.epoch, "val_scores": row},
                            files=files)
    if improved:
        progress.best_score, progress.best_epoch = score, record.epoch
    if run.schedules.plateau is not None:
        run.schedules.plateau.update(score)
    if cfg.early_stop and record.epoch - progress.best_epoch >= cfg.early_stop:
        progress.stopped_early = True
    progress.epoch += 1
    progress.step_in_epoch = 0


def fit(run: Run) -> Path:
    """Train ``run`` to ``cfg.epochs`` (or ``max_steps``, early stopping, Ctrl-C); returns the best checkpoint."""
    cfg, progress, ctx = run.cfg, run.progress, run.dist
    if progress.global_step or (run.run_dir / METRICS_LOG).exists():  # a fresh start's log holds no records
        _trim_metrics_log(run)
    steps_per_epoch = run.steps_per_epoch
    with _StopFlag() as stop:
        while progress.epoch < cfg.epochs and not progress.stopped_early:
            epoch = progress.epoch
            order = run.phase.epoch_order(epoch)
            run.phase.ss_prob = run.schedules.sampling(epoch)
            run.model.train()
            bar = tqdm(total=steps_per_epoch, initial=progress.step_in_epoch, unit="batch", dynamic_ncols=True,
                       desc=f"{cfg.phase} epoch {epoch + 1}/{cfg.epochs}", disable=not (cfg.progress and ctx.is_main))
            tick, tokens = time.time(), 0
            lr = run.schedules.learning_rate(epoch, progress.global_step)
            for step in range(progress.step_in_epoch, steps_per_epoch):
                lr = run.schedules.learning_rate(epoch, progress.global_step)
                for group in run.optimizer.param_groups:
                    group["lr"] = lr * group.get("lr_factor", 1.0)
                global_batch = order[step * cfg.batch_size:(step + 1) * cfg.batch_size]
                with run.precision.autocast(run.device):
                    loss, logs, batch_tokens = run.trainer(ctx.shard(global_batch), global_batch)
                _optimizer_step(run, loss)
                progress.losses = logs
                progress.step_in_epoch, progress.global_step = step + 1, progress.global_step + 1
                tokens += batch_tokens * ctx.world
                rate = tokens / max(time.time() - tick, 1e-9)
                bar.update(1)
                bar.set_postfix_str(" ".join([*(f"{k}={v:.3f}" for k, v in logs.items()), f"lr={lr:.2e}",
                                              f"tok/s={rate:.0f}"]))
                if cfg.log_every and progress.global_step % cfg.log_every == 0:
                    _log(run, StepLog(epoch + 1, progress.global_step, lr, logs, run.phase.ss_prob, rate,
                                         run.elapsed()))
                stopping = ctx.any(stop.raised) or bool(cfg.max_steps and progress.global_step >= cfg.max_steps)
                if stopping:
                    break
                if cfg.checkpoint_every and progress.global_step % cfg.checkpoint_every == 0 \
                        and progress.step_in_epoch < steps_per_epoch:
                    _snapshot(run)
            bar.close()
            if ctx.any(stop.raised):
                _snapshot(run)
                raise TrainingInterrupted(f"interrupted at epoch {epoch + 1}, step {progress.step_in_epoch}; "
                                          f"state saved in {run.run_dir}: rerun with --resume to continue")
            if progress.step_in_epoch < steps_per_epoch:  # max_steps reached mid-epoch
                _snapshot(run)
                break
            _end_epoch(run, _validate(run, epoch, lr, progress.losses))
            _snapshot(run)
    return run.run_dir / "best"


def train(cfg: TrainConfig, resume: bool = False, explicit: Collection[str] | None = None) -> Path:
    """Run the phase ``cfg.phase``; returns the path of the best checkpoint.  A run that fails before its first
    step (a bad option, a missing file) leaves no empty ``--out`` folder behind."""
    run_dir = Path(cfg.out)
    existed = run_dir.exists()
    try:
        run = prepare_run(cfg, resume, explicit)
    except BaseException:
        if not existed and run_dir.is_dir() and not any(run_dir.iterdir()):
            run_dir.rmdir()
        raise
    return fit(run)
