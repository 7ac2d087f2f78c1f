"""The one training loop behind every phase: ``xe`` and ``scst`` (:mod:`.phase`, registered by :mod:`.xe` and
:mod:`.scst`).  SAT-hard's REINFORCE has no phase of its own: its ``forward_xe`` returns the REINFORCE term on the
sampled locations (with its moving-average baseline) and the entropy bonus as auxiliary losses, which the ``xe``
phase adds to the caption's cross-entropy (:mod:`captioner.models.sat_hard`).

A phase only says what an epoch iterates over and what the loss of a batch is (:class:`.phase.Phase`).  This module
owns the rest, in two parts:

* :func:`prepare_run` turns a :class:`TrainConfig` into a :class:`Run`: resume merging (:mod:`.resume`), data and
  features, vocabulary, model (from scratch or ``init``, :mod:`.warm_start`), optimiser, schedules
  (:mod:`.schedules`), precision (:mod:`.precision`) and the process group;
* :func:`fit` trains it: the epoch loop with progress bars, scheduled sampling, periodic crash-safe snapshots
  (:mod:`.state`), validation BLEU / CIDEr-D after every epoch, plateau decay, early stopping, ``best/`` and
  ``last/`` checkpoints and a ``metrics.jsonl`` log (:mod:`.run_log`).

A run directory holds ``best/`` and ``last/`` checkpoints, ``metrics.jsonl`` and ``train_state.*`` (weights,
optimiser, RNG, position inside the epoch), written every ``checkpoint_every`` steps and at each epoch's end.
Ctrl-C or SIGTERM finishes the current step, saves the state and exits; a SIGKILL loses at most the steps since
the last snapshot.  Running the same command with ``--resume`` continues from the saved step with the same data
order.  Under ``torchrun`` every rank trains its share of each batch and only rank 0 writes.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import signal
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Collection, Iterator

import torch
from safetensors.torch import load_file
from safetensors.torch import save as save_tensors
from torch import nn

from ..checkpoint import Checkpoint, load_checkpoint, on_meta, remove_debris, save_checkpoint, state_shapes
from ..data.datasets import CITATIONS, ENTITIES_CITATION, dataset_name, load_captioned, resolve_dataset
from ..data.features import distributed_rank
from ..data.karpathy import CaptionedImage
from ..data.scenes import read_dataset_header
from ..data.stores import TunedStore, VisualStore, open_feature_store
from ..device import describe_hardware, resolve_device, set_threads
from ..encoder import EncoderSpec, EncoderTail, GridEncoder
from ..evaluation.evaluate import caption_dataset, score_dataset
from ..files import FolderInUse, held_alone
from ..progress import progress_bar
from ..protocol import Captioner, check_step_contract
from ..vocab import Vocabulary
from ..registry import BadOption, UnknownModel
from ..zoo import create
from .attention_supervision import checked_entities_folder
from .attention_supervision import entities_attention_targets
from .config import Progress, TrainConfig, check_values
from .distributed import DistContext, init_distributed
from .phase import PHASES, Phase, PhaseModule
from .precision import Precision, resolve_precision
from .resume import merge_resume, read_from, restore
from .run_log import METRICS_LOG, EpochLog, StepLog, append_record, check_new_run_folder, trim_metrics_log
from .schedules import Schedules, build_schedules
from .state import STATE_JSON, load_state, rng_state, save_state
from .warm_start import adopt_init, choose_vocab, lineage, load_init_weights

__all__ = ["Run", "TrainingDiverged", "TrainingInterrupted", "fit", "prepare_run", "train"]

#: the fine-tuned encoder stages' weights in a checkpoint folder (EncoderSpec.tuned_weights)
TUNED_WEIGHTS = "encoder_tuned.safetensors"


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
        # said at once: the stop waits for the step (or a whole validation) to end, and a user who heard nothing
        # pressed again and lost the work since the last save. Written to the descriptor, not through sys.stderr,
        # whose buffered writer a progress bar may be inside of when the signal comes (a reentrant call raises);
        # by the main rank only (torchrun hands the signal to every rank)
        if distributed_rank() == 0:
            os.write(2, b"\nstopping after this step to save the run (Ctrl-C again to abort without saving)\n")

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class TrainingInterrupted(RuntimeError):
    pass


class TrainingDiverged(RuntimeError):
    """The loss or a gradient stopped being a number: the run stopped before that step's update, keeping the state
    it saved last."""


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
    trainer: nn.Module  # the DDP-wrapped phase under torchrun, else the plain PhaseModule
    progress: Progress
    select: str
    meta: dict[str, Any]
    scaler: torch.amp.GradScaler | None = None
    tail: EncoderTail | None = None  # the encoder's fine-tuned stages (--finetune-stages), else None
    started: float = field(default_factory=time.time)
    #: the folder the run was first started in, kept by every resume: its relative paths are read from there
    started_in: str = field(default_factory=os.getcwd)

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.phase.size / self.cfg.batch_size)

    def elapsed(self) -> float:
        """Wall clock of the whole run: it adds up across --resume, so a resumed run's card reports all of it."""
        return round(self.progress.train_seconds + time.time() - self.started, 1)


# -- prepare_run ------------------------------------------------------------------------------------------------
def _open_run_dir(run_dir: Path, cfg: TrainConfig, ctx: DistContext, resume: bool,
                  explicit: Collection[str] | None) -> tuple[TrainConfig, dict[str, Any] | None]:
    """Make the run's folder and read its saved state (None for a new run, whose folder is checked to hold nothing
    it would write over); a resumed run gets its own recipe back, with what the command may change
    (:func:`~.resume.merge_resume`)."""
    if run_dir.exists() and not run_dir.is_dir():
        raise FileExistsError(f"--out {run_dir} is a file; a run is a folder (best/, last/, {METRICS_LOG}, "
                              "train_state.*): choose another --out")
    saved = load_state(run_dir, objects=("config", "progress", "model", "optimizer")) if resume else None
    if resume and saved is None:  # a mistyped --out: it trained a new run from scratch (or stopped on a data set
        # error about the default --dataset, where the command named none)
        raise FileNotFoundError(f"nothing to resume in {run_dir} (no {STATE_JSON}): check --out, or drop --resume "
                                "to start a new run there")
    if ctx.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
    ctx.barrier()
    if saved is None and (run_dir / STATE_JSON).exists() and not resume:
        raise FileExistsError(f"{run_dir} already holds a training run: pass --resume to continue it, "
                              "or choose another --out (nothing is overwritten)")
    if saved is None:
        check_new_run_folder(run_dir, announce=ctx.is_main)
        return cfg, None
    # a resumed run keeps its recipe; only its length and how it runs may change, and the rate of the epochs it has
    # not begun (a state saved inside an epoch has trained some of that epoch's steps at its rate)
    progress = saved["progress"]
    begun = progress["epoch"] + (1 if progress.get("step_in_epoch") else 0)
    cfg = merge_resume(cfg, read_from(saved, announce=ctx.is_main), begun, explicit)
    if ctx.is_main:  # what a killed save left beside best/ and last/
        for name in ("best", "last"):
            remove_debris(run_dir / name)
    return cfg, saved


def _resolve_config(cfg: TrainConfig, saved: dict[str, Any] | None) -> tuple[TrainConfig, Checkpoint | None]:
    """The config the run trains with, and the ``--init`` checkpoint of a new warm-started run (else None): the data
    set resolved, the phase known, the model, sizes, encoder and features taken from ``--init``, else the
    defaults."""
    check_values(cfg)
    cfg = replace(cfg, dataset=str(resolve_dataset(cfg.dataset)))
    if cfg.phase not in PHASES:
        raise ValueError(f"unknown phase {cfg.phase!r}; choose from {', '.join(sorted(PHASES))}")
    init = load_checkpoint(cfg.init) if cfg.init and saved is None else None
    if init is not None:
        cfg = adopt_init(cfg, init)
    # the defaults a warm start would otherwise have supplied: SAT, on the encoder's grid
    return replace(cfg, model=cfg.model or "sat", features=cfg.features or "grid"), init


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


#: the special ids a checkpoint's config.json passes every model (checkpoint.py, ``special_ids``), passed to probes
PROBE_IDS = {"pad_id": 0, "bos_id": 1, "eos_id": 2}


def _check_model(cfg: TrainConfig) -> None:
    """The model and its options, built on the meta device before any data is read (an unknown name or option was
    found only after the features were extracted), and rebuilt from its :meth:`~Captioner.config`, as loading its
    checkpoints will (a model whose config() is missing or incomplete failed at the first save, after an epoch)."""
    if cfg.model == "ensemble":
        raise ValueError("an ensemble is not trained: `captioner ensemble` builds one from trained checkpoints")
    # with the vocabulary's special ids, as loading passes them: a constructor without **ids trained, and then no
    # command could load its checkpoint
    build = functools.partial(create, cfg.model, vocab_size=16, feat_dim=64, **PROBE_IDS, **cfg.model_args)
    try:
        described = on_meta(build)
    except (TypeError, ValueError) as exc:  # a --set value of the wrong kind or size (an unknown model or option
        # is named by the registry already); TypeError came out as a traceback
        if isinstance(exc, (UnknownModel, BadOption)):  # they name the model and the option already
            raise
        if any(f"'{name}'" in str(exc) for name in PROBE_IDS):
            raise ValueError(f"model {cfg.model!r} does not take the vocabulary's special ids ({exc}): its "
                             "constructor must accept **ids and pass them on to Captioner.__init__ "
                             "(models/protocol.py)") from None
        options = " ".join(f"--set {name}={value}" for name, value in cfg.model_args.items())
        raise ValueError(f"model {cfg.model!r} cannot be built{' with ' + options if options else ''}: {exc}") \
            from None
    try:
        config = described.config()
    except NotImplementedError:
        raise ValueError(f"model {cfg.model!r} does not implement config(): the constructor arguments its checkpoints "
                         "store, to rebuild it (models/protocol.py)") from None
    forgotten = sorted(set(cfg.model_args) - set(config))  # given, but not stored: it would reload as its default
    try:
        rebuilt = on_meta(lambda: create(cfg.model, **config))
    except (TypeError, ValueError) as exc:  # config() left out an argument without a default (vocab_size, ...)
        raise ValueError(f"model {cfg.model!r}: create({cfg.model!r}, **config()) fails ({exc}): config() must "
                         "return every constructor argument (models/protocol.py)") from None
    if forgotten or state_shapes(rebuilt) != state_shapes(described):
        raise ValueError(f"model {cfg.model!r}: create({cfg.model!r}, **config()) builds another model than the one "
                         f"it describes{' (config() leaves out ' + ', '.join(forgotten) + ')' if forgotten else ''}: "
                         "config() must return every constructor argument (models/protocol.py)")
    try:
        with torch.random.fork_rng(devices=[]):  # the probe's weights and features leave the run's randomness as it was
            check_step_contract(build().eval())
    except ValueError as exc:
        raise ValueError(f"model {cfg.model!r} does not follow the protocol: {exc} (models/protocol.py)") from None
    except Exception as exc:  # a broken model raises anything: named here, not a traceback after an epoch
        raise ValueError(f"model {cfg.model!r} fails one step of the protocol on random features: "
                         f"{type(exc).__name__}: {exc} (models/protocol.py)") from None


def _load_splits(cfg: TrainConfig) -> tuple[list[CaptionedImage], list[CaptionedImage]]:
    """The train and val splits, which must not be empty; ``--select-metric`` must be one validation measures."""
    train_images = load_captioned(cfg.dataset, cfg.image_root, ("train",), limit=cfg.train_limit)
    val_images = load_captioned(cfg.dataset, cfg.image_root, ("val",), limit=cfg.val_limit)
    if not train_images or not val_images:
        raise ValueError(f"{cfg.dataset} needs non-empty 'train' and 'val' splits "
                         f"(found {len(train_images)} train, {len(val_images)} val)")
    selectable = ["BLEU-1", "BLEU-2", "BLEU-3", "BLEU-4", "CIDEr-D"]
    if val_images[0].info.get("objects") is not None:
        selectable.append("objects_named")  # generated scenes: the share of objects named with colour and shape
    if cfg.select_metric and cfg.select_metric not in selectable:
        raise ValueError(f"--select-metric {cfg.select_metric!r} cannot select checkpoints: choose from "
                         f"{', '.join(selectable)} (what validation measures, the higher the better)")
    return train_images, val_images


def _open_store(cfg: TrainConfig, spec: EncoderSpec, train_images: list[CaptionedImage],
                val_images: list[CaptionedImage], ctx: DistContext,
                device: torch.device) -> tuple[VisualStore, EncoderTail | None]:
    """The features of both splits (extracted into the cache where missing) and the encoder's fine-tuned stages
    (``--finetune-stages``, which then run on the cached input of their first stage), else None."""
    cache_spec = replace(spec, stop_stages=cfg.finetune_stages)  # the tuned stages' input, when there are some
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
    return store, tail


def _build_model(cfg: TrainConfig, vocab: Vocabulary, feat_dim: int, tail: EncoderTail | None,
                 init: Checkpoint | None, device: torch.device) -> tuple[Captioner, torch.optim.Optimizer]:
    """The model (fresh weights, or ``--init``'s) and its optimiser, over the fine-tuned encoder stages too."""
    # seeded here, not earlier: building the encoder (only when the feature cache is cold) draws random numbers too,
    # and a run's initial weights must not depend on whether its features were cached
    torch.manual_seed(cfg.seed)
    model = create(cfg.model, vocab_size=len(vocab), feat_dim=feat_dim, **cfg.model_args).to(device)
    if init is not None:
        load_init_weights(model, init, cfg.init)
    optimizer_cls = {"adam": torch.optim.Adam, "radam": torch.optim.RAdam}[cfg.optimizer]
    groups = [{"params": list(model.parameters())}]
    if tail is not None:  # ImageNet features need smaller steps than a decoder trained from scratch
        groups.append({"params": list(tail.parameters()), "lr_factor": cfg.encoder_lr_factor})
    return model, optimizer_cls(groups, lr=cfg.lr, betas=tuple(cfg.adam_betas), eps=cfg.adam_eps)


def _run_meta(cfg: TrainConfig, train_count: int, device: torch.device, ctx: DistContext, precision: Precision,
              saved: dict[str, Any] | None, init: Checkpoint | None) -> dict[str, Any]:
    """The record every checkpoint of the run carries: its data (with citation, and generated scenes' header), phase,
    config, hardware, precision and, for a warm start, what it started from."""
    name = dataset_name(cfg.dataset)
    meta = {"dataset": str(cfg.dataset), "phase": cfg.phase, "train_config": cfg.to_json(),
            "trained_on": f"{CITATIONS.get(name, name)}, train split ({train_count:,} images)"
                          + (f", its attention supervised by the {ENTITIES_CITATION} boxes of those photos"
                             if cfg.attention_supervision else ""),
            "hardware": describe_hardware(device) + (f" ×{ctx.world} processes" if ctx.active else ""),
            "precision": precision.name}
    if name == "scenes":
        # the generator's version and settings, so the model card names the same scenes wherever it is written, with
        # the data set at hand or not (models/evaluation/card.py)
        meta["dataset_header"] = read_dataset_header(cfg.dataset)
    if cfg.init:  # read at the first start: by a resume, the --init folder may hold another checkpoint
        meta["started_from"] = saved.get("started_from") if saved is not None else lineage(cfg.init, init)
    return meta


def prepare_run(cfg: TrainConfig, resume: bool = False, explicit: Collection[str] | None = None) -> Run:
    """Everything before the first step: resume merging, data, features, vocabulary, model, optimiser, schedules,
    precision and (under torchrun) the process group."""
    set_threads(cfg.threads)
    ctx, device_name = init_distributed(cfg.device)
    device = resolve_device(device_name)
    run_dir = Path(cfg.out)
    cfg, saved = _open_run_dir(run_dir, cfg, ctx, resume, explicit)
    cfg, init = _resolve_config(cfg, saved)
    precision = resolve_precision(cfg.precision, device)
    spec = EncoderSpec.of(cfg.encoder)
    _check_combinations(cfg, resumed=saved is not None)
    _check_model(cfg)
    entities_dir = checked_entities_folder(cfg) if cfg.attention_supervision else None
    train_images, val_images = _load_splits(cfg)
    vocab = choose_vocab(cfg, saved, init, train_images)  # before the features: a --min-count that keeps no word
    if ctx.is_main:  # what the run is about to train on: nothing else was said before the first epoch's bar
        captions = sum(len(im.references) for im in train_images)
        print(f"training {cfg.model} on {len(train_images):,} photos ({captions:,} "
              f"captions) of {cfg.dataset}, validating on {len(val_images):,}; vocabulary of {len(vocab):,} words",
              flush=True)
    store, tail = _open_store(cfg, spec, train_images, val_images, ctx, device)
    model, optimizer = _build_model(cfg, vocab, store.feat_dim, tail, init, device)

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
        progress = restore(saved, cfg, run_dir, ctx, model, tail, optimizer, scaler)
    elif ctx.active:
        torch.manual_seed(cfg.seed * 1000 + ctx.rank)  # ranks draw different dropout masks and samples
    if schedules.plateau is not None and progress.plateau:
        schedules.plateau.load_state_dict(progress.plateau)

    trainer: nn.Module = PhaseModule(model, phase, tail)
    if ctx.active:
        trainer = nn.parallel.DistributedDataParallel(
            trainer, device_ids=[device.index] if device.type == "cuda" else None, forward_sync_buffers=False,
            # optional branches (flags, SAT-hard's soft/hard switch) leave some parameters without a gradient
            find_unused_parameters=True)
    meta = _run_meta(cfg, len(train_images), device, ctx, precision, saved, init)
    return Run(cfg=cfg, run_dir=run_dir, device=device, dist=ctx, spec=spec, vocab=vocab, model=model, store=store,
               phase=phase, val_images=val_images, optimizer=optimizer, schedules=schedules, precision=precision,
               progress=progress, select=phase.selection_metric(), meta=meta, scaler=scaler, tail=tail,
               trainer=trainer, started_in=(saved or {}).get("working_dir") or os.getcwd())


# -- fit --------------------------------------------------------------------------------------------------------
def _snapshot(run: Run) -> None:
    """Save the resumable state (every rank takes part: the RNG states of all ranks are gathered to rank 0)."""
    rngs = run.dist.gather(rng_state())
    if not run.dist.is_main:
        return
    run.progress.train_seconds = run.elapsed()
    run.started = time.time()
    run.progress.plateau = run.schedules.plateau.state_dict() if run.schedules.plateau else None
    state = {"config": run.cfg.to_json(), "vocab": run.vocab.to_json(), "progress": run.progress.to_json(),
             "model": run.model.state_dict(), "optimizer": run.optimizer.state_dict(),
             "rng_ranks": rngs, "started_from": run.meta.get("started_from"), "working_dir": run.started_in}
    if run.scaler is not None:
        state["scaler"] = run.scaler.state_dict()
    if run.tail is not None:
        state["encoder_tail"] = run.tail.tuned_state()
    save_state(run.run_dir, state)


def _optimizer_step(run: Run, loss: torch.Tensor) -> None:
    cfg, params = run.cfg, [p for group in run.optimizer.param_groups for p in group["params"] if p.requires_grad]
    run.optimizer.zero_grad(set_to_none=True)
    if run.scaler is not None:
        run.scaler.scale(loss).backward()
        run.scaler.unscale_(run.optimizer)  # clip the true gradients
    else:
        loss.backward()
    # one norm serves the divergence check and the clipping by norm (clip_grad_norm_ would compute it again); a
    # float16 run clipping by value, or not at all, needs neither
    clip_by_norm = bool(cfg.grad_clip) and cfg.grad_clip_mode != "value"
    norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None]) \
        if run.scaler is None or clip_by_norm else None
    if run.scaler is None:
        _stop_if_diverged(run, loss, norm)
    if clip_by_norm:
        torch.nn.utils.clip_grads_with_norm_(params, cfg.grad_clip, norm)
    elif cfg.grad_clip:
        torch.nn.utils.clip_grad_value_(params, cfg.grad_clip)
    if run.scaler is not None:
        run.scaler.step(run.optimizer)
        run.scaler.update()
    else:
        run.optimizer.step()


def _stop_if_diverged(run: Run, loss: torch.Tensor, norm: torch.Tensor) -> None:
    """Raise :class:`TrainingDiverged` where the loss or the gradients' ``norm`` is NaN or infinite (a rate too
    high, a log of zero), before the update: stepped on, it is NaN in every weight, and every later snapshot
    (``last/``, ``best/`` if validation happens to score it well) keeps it.  Under float16 the gradient scaler
    skips such a step and lowers its scale instead, so runs with a scaler do not come here."""
    finite = bool(torch.isfinite(loss.detach()) & torch.isfinite(norm))
    if run.dist.any(not finite):
        # a rank stopped by another's divergence must not present its own finite loss as the one that diverged
        what = ("another rank's loss or gradients stopped being a number" if finite
                else f"the loss became {loss.item()} (its gradients' norm {norm.item()})")
        raise TrainingDiverged(
            f"{what} at epoch {run.progress.epoch + 1}, step {run.progress.step_in_epoch + 1}, and the run stopped "
            f"before the update: {run.run_dir} keeps the state it saved last (--checkpoint-every, or the last "
            "epoch's end); rerun with --resume and a lower --lr (or --grad-clip) to go on from it")


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
        append_record(run.run_dir, record)
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


def _steps_reached(run: Run) -> bool:
    """Whether the run has taken its ``max_steps`` (none set: never)."""
    return bool(run.cfg.max_steps and run.progress.global_step >= run.cfg.max_steps)


def _train_epoch(run: Run, stop: _StopFlag) -> float:
    """Train epoch ``progress.epoch`` from step ``progress.step_in_epoch`` to its end, or until a stop is asked for
    or ``max_steps`` is reached, with a snapshot every ``checkpoint_every`` steps; returns the last step's rate."""
    cfg, progress, ctx = run.cfg, run.progress, run.dist
    steps_per_epoch = run.steps_per_epoch
    epoch = progress.epoch
    order = run.phase.epoch_order(epoch)
    run.phase.ss_prob = run.schedules.sampling(epoch)
    run.model.train()
    bar = progress_bar(total=steps_per_epoch, initial=progress.step_in_epoch, unit="batch", dynamic_ncols=True,
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
        # shown with the bar's next redraw: a redraw of its own at every step would be a line a step in a log
        bar.set_postfix_str(" ".join([*(f"{k}={v:.3f}" for k, v in logs.items()), f"lr={lr:.2e}",
                                      f"tok/s={rate:.0f}"]), refresh=False)
        if ctx.is_main and cfg.log_every and progress.global_step % cfg.log_every == 0:
            append_record(run.run_dir, StepLog(epoch + 1, progress.global_step, lr, logs, run.phase.ss_prob, rate,
                                               run.elapsed()))
        if ctx.any(stop.raised) or _steps_reached(run):
            break
        if cfg.checkpoint_every and progress.global_step % cfg.checkpoint_every == 0 \
                and progress.step_in_epoch < steps_per_epoch:
            _snapshot(run)
    bar.close()
    return lr


def fit(run: Run) -> Path:
    """Train ``run`` to ``cfg.epochs`` (or ``max_steps``, early stopping, Ctrl-C); returns the best checkpoint."""
    cfg, progress, ctx = run.cfg, run.progress, run.dist
    log = run.run_dir / METRICS_LOG
    if ctx.is_main and (progress.global_step or log.exists()):  # a fresh start's log holds no records
        trim_metrics_log(log, progress.global_step)
    with _StopFlag() as stop:
        # max_steps is checked before an epoch too: reached at an epoch's end (or given to a resume that had
        # already taken them), the next epoch took one step more
        while progress.epoch < cfg.epochs and not progress.stopped_early and not _steps_reached(run):
            epoch = progress.epoch
            lr = _train_epoch(run, stop)
            if ctx.any(stop.raised):
                _snapshot(run)
                raise TrainingInterrupted(f"interrupted at epoch {epoch + 1}, step {progress.step_in_epoch}; "
                                          f"state saved in {run.run_dir}: rerun with --resume to continue")
            if progress.step_in_epoch < run.steps_per_epoch:  # max_steps reached mid-epoch
                _snapshot(run)
                break
            _end_epoch(run, _validate(run, epoch, lr, progress.losses))
            _snapshot(run)
    return run.run_dir / "best"


class RunInUse(FolderInUse):
    """The run's folder is being trained by another process."""


@contextlib.contextmanager
def _sole_trainer(run_dir: Path) -> Iterator[None]:
    """Hold the run's folder for this process (its main rank) while it trains: a second ``train`` into the same
    ``--out`` (a ``--resume`` typed while the run still went on, say) interleaved its steps into the metrics log and
    its checkpoints into ``best/``."""
    if distributed_rank() != 0 or (run_dir.exists() and not run_dir.is_dir()):
        yield  # other ranks follow the main one; a file given as --out is refused by the run itself
        return
    with held_alone(run_dir, RunInUse(f"{run_dir} is being trained by another process: wait for it to end (or stop "
                                      "it) before --resume, or choose another --out")):
        yield


def train(cfg: TrainConfig, resume: bool = False, explicit: Collection[str] | None = None) -> Path:
    """Run the phase ``cfg.phase``; returns the path of the best checkpoint.  A run that fails before its first
    step (a bad option, a missing file, its folder in use) leaves no empty ``--out`` folder behind."""
    run_dir = Path(cfg.out)
    existed = run_dir.exists()
    with _sole_trainer(run_dir):
        try:
            run = prepare_run(cfg, resume, explicit)
        except BaseException:
            if not existed and run_dir.is_dir() and not any(run_dir.iterdir()):
                run_dir.rmdir()
            raise
        return fit(run)
