"""``--resume``: what a resumed run takes from its saved state and what from the command.  The saved config is read
from the folder the run was started in (:func:`read_from`), merged with what may change on resume — the run's
length, how it runs, a learning-rate drop for epochs still to come (:func:`merge_resume`) — and the weights,
optimiser, random streams and grad scaler are put back (:func:`restore`).  The state's file format is
:mod:`captioner.models.training.state`'s."""

from __future__ import annotations

import contextlib
import os
from dataclasses import fields, replace
from pathlib import Path
from typing import Any, Collection

import torch

from ..data.datasets import resolve_dataset
from ..encoder import EncoderTail
from ..protocol import Captioner
from .config import Progress, TrainConfig
from .distributed import DistContext
from .schedules import learning_rate
from .state import restore_optimizer_state, set_rng_state


def _check_schedule_change(before: TrainConfig, after: TrainConfig, epochs_done: int) -> None:
    """A schedule changed on --resume must agree with the old one on the epochs already trained, or begun
    (``epochs_done`` counts an epoch a state saved inside of), so the resumed run equals one trained with the new
    schedule from the start."""
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


def read_from(saved: dict[str, Any], announce: bool) -> dict[str, Any]:
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


#: the options a resumed run takes from the command when the run's own no longer exist (a data set moved to another
#: disk): the same photos and captions somewhere else, not another recipe
MOVABLE_DATA = ("dataset", "image_root")


def _moved_data(before: TrainConfig, given: dict[str, Any]) -> dict[str, str]:
    """The ``given`` data locations that replace the run's: each where the run's is gone and the command's exists
    (a resume could not go on: it named the new place as ignored, then failed on the old one). Made absolute: a
    later resume reads the run's relative paths from the folder the run was started in."""
    return {name: str(Path(given[name]).resolve()) for name in MOVABLE_DATA
            if name in given and getattr(before, name)
            and not Path(getattr(before, name)).exists() and Path(given[name]).exists()}


def merge_resume(cfg: TrainConfig, saved_config: dict[str, Any], epochs_done: int,
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
    moved = _moved_data(before, given)
    if moved:
        merged = replace(merged, **moved)
        given = {name: value for name, value in given.items() if name not in moved}
        print("the run's data has moved; read from where the command says (its photos are encoded again): "
              + ", ".join(f"{name}={value!r} (the run's, gone: {getattr(before, name)!r})"
                          for name, value in moved.items()))
    if given:
        print("resuming keeps the run's recipe; ignored: " + ", ".join(
            f"{name}={value!r} (the run's: {getattr(before, name)!r})" for name, value in given.items()))
    _check_schedule_change(before, merged, epochs_done)
    return merged


def restore(saved: dict[str, Any], cfg: TrainConfig, run_dir: Path, ctx: DistContext, model: Captioner,
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
        set_rng_state(rngs[ctx.rank])
    else:  # resumed on another number of processes: a fresh, still rank-distinct stream
        torch.manual_seed(hash((cfg.seed, ctx.rank, progress.global_step)) & 0x7FFFFFFF)
    if scaler is not None and saved.get("scaler"):
        scaler.load_state_dict(saved["scaler"])
    if ctx.is_main:
        if progress.stopped_early:  # final: no --epochs trains a run that stopped early on
            print(f"{run_dir} has finished (stopped early): nothing to train")
        elif progress.epoch >= cfg.epochs:
            print(f"{run_dir} has finished ({progress.epoch} epochs): nothing to train; --epochs N with "
                  f"N > {progress.epoch} continues it")
        else:
            print(f"resuming {run_dir} at epoch {progress.epoch + 1}, step {progress.step_in_epoch}")
    return progress
