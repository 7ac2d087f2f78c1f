"""The one training loop behind every phase of SPEC §8.6 (``xe``, ``scst``; SAT-hard's ``hard_reinforce`` is
the ``xe`` phase with the model's own REINFORCE terms, see :mod:`models.sat_hard`).

A phase only says what an epoch iterates over and what the loss of a batch is (:class:`Phase`); this module
owns everything around it: data and features, vocabulary, model creation or initialisation from a checkpoint
(``init``), Adam with gradient clipping, the progress bar, validation BLEU / CIDEr-D after every epoch,
``best/`` and ``last/`` checkpoints, and exact resume.

A run directory holds ``best/`` and ``last/`` checkpoints plus ``train_state.*`` (weights, optimiser, RNG,
position inside the epoch).  Ctrl-C or SIGTERM finishes the current step, saves the state and exits; running
the same command with ``--resume`` continues from that step with the same data order.
"""

from __future__ import annotations

import json
import math
import signal
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, ClassVar, Sequence, TypeVar

import numpy as np
import torch
from tqdm import tqdm

from ..checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from ..data.stores import VisualStore, open_feature_store
from ..data.karpathy import CaptionedImage, load_karpathy
from ..device import describe_hardware, resolve_device, set_threads
from ..encoder import EncoderSpec
from ..protocol import Captioner
from ..zoo import create
from ..vocab import Vocabulary
from ..evaluation.evaluate import caption_dataset, score_dataset
from .state import load_state, restore_optimizer_state, save_state


@dataclass
class TrainConfig:
    dataset: str
    out: str
    model: str | None = None  # registered name; default: "sat", or the architecture of ``init``
    model_args: dict[str, Any] = field(default_factory=dict)
    phase: str = "xe"  # "xe" (SPEC §1.5) or "scst" (SPEC §1.6)
    init: str | None = None  # start from this checkpoint (its model, vocabulary and encoder) instead of scratch
    features: str | None = None  # None/"grid": cached frozen-encoder grid; "regions:DIR": precomputed regions
    image_root: str | None = None
    encoder: dict[str, Any] = field(default_factory=dict)  # EncoderSpec fields; empty = defaults
    cache_dir: str = ".cache/features"
    epochs: int = 20
    batch_size: int = 64  # captions per batch for XE, images per batch for SCST
    lr: float = 4e-4
    # step schedule: after each of these many epochs the learning rate is multiplied by lr_drop_factor (the
    # field's usual "decay at epoch N"; empty keeps it constant)
    lr_drops: list[int] = field(default_factory=list)
    lr_drop_factor: float = 0.1
    grad_clip: float = 5.0
    label_smoothing: float = 0.0
    min_count: int = 1  # a word is kept if it occurs at least this often in training captions
    max_train_len: int = 16
    max_decode_len: int = 20
    scst_samples: int = 5  # captions sampled per image (SPEC decision #4)
    scst_baseline: str = "greedy"  # "greedy" (SPEC §1.6) or "mean" (mean reward of the image's other samples)
    val_beam: int = 1
    val_limit: int | None = None
    train_limit: int | None = None
    select_metric: str | None = None  # default: the phase's (XE: the model's own, SCST: CIDEr-D)
    seed: int = 0
    device: str = "auto"
    threads: int | None = None
    max_steps: int | None = None  # stop after this many optimiser steps in total (smoke tests)
    progress: bool = True

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


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
    time; :meth:`loss` turns the indices of one batch into the loss to minimise and the numbers to log."""

    name: ClassVar[str] = ""

    def __init__(self, cfg: TrainConfig, model: Captioner, vocab: Vocabulary, store: VisualStore,
                 images: Sequence[CaptionedImage], device: torch.device):
        self.cfg, self.model, self.vocab, self.store = cfg, model, vocab, store
        self.images, self.device = images, device

    @property
    def size(self) -> int:
        raise NotImplementedError

    def loss(self, batch: Sequence[int]) -> tuple[torch.Tensor, dict[str, float]]:
        raise NotImplementedError

    def selection_metric(self) -> str:
        """Validation metric that picks ``best/`` (SPEC §8.6)."""
        return self.cfg.select_metric or self.model.selection_metric


PHASES: dict[str, type[Phase]] = {}
P = TypeVar("P", bound=type[Phase])


def register_phase(name: str) -> Callable[[P], P]:
    def wrap(cls: P) -> P:
        cls.name = name
        PHASES[name] = cls
        return cls

    return wrap


def _adopt_init(cfg: TrainConfig, init: Checkpoint) -> TrainConfig:
    """Take architecture, hyper-parameters, encoder and feature source from the ``init`` checkpoint; ``--set``
    values still override hyper-parameters (a shape change then fails loudly when the weights are loaded)."""
    if cfg.model not in (None, init.model.arch):
        raise ValueError(f"--model {cfg.model} does not match the {init.model.arch} checkpoint {cfg.init}")
    if cfg.encoder and EncoderSpec(**cfg.encoder) != init.encoder:
        raise ValueError(f"--encoder differs from the encoder {cfg.init} was trained with")
    args = {k: v for k, v in init.model.config().items() if k not in ("vocab_size", "feat_dim")}
    trained_on = init.meta.get("train_config", {}).get("features")
    return replace(cfg, model=init.model.arch, model_args={**args, **cfg.model_args}, encoder=init.encoder.to_json(),
                   features=cfg.features or trained_on)


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


def learning_rate(cfg: TrainConfig, epoch: int) -> float:
    """The rate for 0-based ``epoch``: ``lr`` times ``lr_drop_factor`` per drop at or before it."""
    return cfg.lr * cfg.lr_drop_factor ** sum(epoch >= drop for drop in cfg.lr_drops)


def train(cfg: TrainConfig, resume: bool = False) -> Path:
    """Run the phase ``cfg.phase``; returns the path of the best checkpoint."""
    set_threads(cfg.threads)
    device = resolve_device(cfg.device)
    run_dir = Path(cfg.out)
    run_dir.mkdir(parents=True, exist_ok=True)
    saved = load_state(run_dir) if resume else None
    if saved is None and (run_dir / "train_state.json").exists() and not resume:
        raise FileExistsError(f"{run_dir} already holds a training run: pass --resume to continue it, "
                              "or choose another --out (nothing is overwritten)")
    if saved is not None:
        # a resumed run keeps its recipe; only the length, the schedule's later drops and how it runs may change
        schedule = {"lr_drops": cfg.lr_drops, "lr_drop_factor": cfg.lr_drop_factor} if cfg.lr_drops else {}
        cfg = TrainConfig(**{**saved["config"], "epochs": cfg.epochs, "max_steps": cfg.max_steps,
                             "progress": cfg.progress, "threads": cfg.threads, "device": cfg.device, **schedule})
        _check_schedule_change(TrainConfig(**saved["config"]), cfg, saved["progress"]["epoch"])
    if cfg.phase not in PHASES:
        raise ValueError(f"unknown phase {cfg.phase!r}; choose from {', '.join(sorted(PHASES))}")
    init = load_checkpoint(cfg.init) if cfg.init and saved is None else None
    if init is not None:
        cfg = _adopt_init(cfg, init)
    cfg = replace(cfg, model=cfg.model or "sat")

    spec = EncoderSpec(**cfg.encoder)
    train_images = load_karpathy(cfg.dataset, cfg.image_root, ("train",), limit=cfg.train_limit)
    val_images = load_karpathy(cfg.dataset, cfg.image_root, ("val",), limit=cfg.val_limit)
    if not train_images or not val_images:
        raise ValueError(f"{cfg.dataset} needs non-empty 'train' and 'val' splits "
                         f"(found {len(train_images)} train, {len(val_images)} val)")
    selectable = ["BLEU-1", "BLEU-2", "BLEU-3", "BLEU-4", "CIDEr-D"]
    if val_images[0].info.get("objects") is not None:
        selectable.append("objects_named")  # generated scenes: the share of objects named with colour and shape
    if cfg.select_metric and cfg.select_metric not in selectable:
        raise ValueError(f"--select-metric {cfg.select_metric!r} is not measured on validation; "
                         f"choose from {', '.join(selectable)}")
    store = open_feature_store(cfg.features, train_images + val_images, spec, cfg.cache_dir, device=str(device),
                               progress=cfg.progress)

    if saved is not None:
        vocab = Vocabulary.from_json(saved["vocab"])
    elif init is not None:
        vocab = init.vocab
    else:
        vocab = Vocabulary.build((r for im in train_images for r in im.references), min_count=cfg.min_count)
    # seeded here, not earlier: building the encoder (only when the feature cache is cold) draws random numbers too,
    # and a run's initial weights must not depend on whether its features were cached
    torch.manual_seed(cfg.seed)
    model = create(cfg.model, vocab_size=len(vocab), feat_dim=store.feat_dim, **cfg.model_args).to(device)
    if init is not None:
        model.load_state_dict(init.model.state_dict())
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    phase = PHASES[cfg.phase](cfg, model, vocab, store, train_images, device)
    select = phase.selection_metric()

    steps_per_epoch = math.ceil(phase.size / cfg.batch_size)
    progress = {"epoch": 0, "step_in_epoch": 0, "global_step": 0, "best_score": -1.0, "best_epoch": -1,
                "history": []}
    if saved is not None:
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(restore_optimizer_state(saved["optimizer"]))
        _set_rng_state(saved["rng"])
        progress = saved["progress"]
        print(f"resuming {run_dir} at epoch {progress['epoch'] + 1}, step {progress['step_in_epoch']}")

    started, seconds_before = time.time(), progress.get("train_seconds", 0.0)

    def elapsed() -> float:
        """Wall clock of the whole run: it adds up across --resume, so a resumed run's card reports all of it."""
        return round(seconds_before + time.time() - started, 1)

    def snapshot() -> None:
        progress["train_seconds"] = elapsed()
        save_state(run_dir, {"config": cfg.to_json(), "vocab": vocab.to_json(), "progress": progress,
                             "model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": _rng_state()})

    meta = {"dataset": str(cfg.dataset), "phase": cfg.phase, "train_config": cfg.to_json(),
            "hardware": describe_hardware(device)}
    logs: dict[str, float] = {}
    with _StopFlag() as stop:
        while progress["epoch"] < cfg.epochs:
            epoch = progress["epoch"]
            order = np.random.default_rng([cfg.seed, epoch]).permutation(phase.size)
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(cfg, epoch)
            model.train()
            bar = tqdm(total=steps_per_epoch, initial=progress["step_in_epoch"],
                       desc=f"{cfg.phase} epoch {epoch + 1}/{cfg.epochs}", unit="batch", disable=not cfg.progress,
                       dynamic_ncols=True)
            for step in range(progress["step_in_epoch"], steps_per_epoch):
                loss, logs = phase.loss(order[step * cfg.batch_size:(step + 1) * cfg.batch_size])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                if cfg.grad_clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
                optimizer.step()
                progress["step_in_epoch"] = step + 1
                progress["global_step"] += 1
                bar.update(1)
                bar.set_postfix({k: f"{v:.3f}" for k, v in logs.items()})
                if stop.raised or (cfg.max_steps and progress["global_step"] >= cfg.max_steps):
                    break
            bar.close()
            if stop.raised:
                snapshot()
                raise TrainingInterrupted(f"interrupted at epoch {epoch + 1}, step {progress['step_in_epoch']}; "
                                          f"state saved in {run_dir}: rerun with --resume to continue")
            if progress["step_in_epoch"] < steps_per_epoch:  # max_steps reached mid-epoch
                snapshot()
                break

            captions = caption_dataset(model, vocab, val_images, store, cfg.val_beam, cfg.max_decode_len,
                                       device=str(device))
            scores = score_dataset(captions, val_images, ("BLEU", "CIDEr-D"))
            # the logged training numbers are those of the epoch's last batch
            scores = {"epoch": epoch + 1, "lr": learning_rate(cfg, epoch), **{k: round(v, 4) for k, v in logs.items()},
                      **{k: round(v, 4) for k, v in scores.items()}}
            progress["history"].append(scores)
            print(json.dumps(scores))
            meta.update(history=progress["history"], train_seconds=elapsed())
            save_checkpoint(run_dir / "last", model, vocab, spec, meta)
            if scores[select] > progress["best_score"]:
                progress["best_score"], progress["best_epoch"] = scores[select], epoch + 1
                save_checkpoint(run_dir / "best", model, vocab, spec,
                                {**meta, "selected_by": select, "best_epoch": epoch + 1, "val_scores": scores})
            progress["epoch"] += 1
            progress["step_in_epoch"] = 0
            snapshot()
    return run_dir / "best"
