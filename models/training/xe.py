"""Cross-entropy training (SPEC §1.5, §8.6): teacher forcing, auxiliary losses from the model, validation
CIDEr-D / BLEU-4 each epoch, best-checkpoint selection, and exact resume after an interruption.

A run directory holds ``best/`` and ``last/`` checkpoints plus ``train_state.*`` (weights, optimiser, RNG,
position inside the epoch).  Ctrl-C or SIGTERM finishes the current step, saves the state and exits; running
the same command with ``--resume`` continues from that step with the same data order.
"""

from __future__ import annotations

import json
import math
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..checkpoint import save_checkpoint
from ..data.features import extract_features
from ..data.karpathy import load_karpathy
from ..device import resolve_device, set_threads
from ..encoder import EncoderSpec
from ..protocol import VisualBatch
from ..registry import create
from ..vocab import Vocabulary
from .evaluate import caption_dataset, score_dataset
from .state import load_state, restore_optimizer_state, save_state


@dataclass
class TrainConfig:
    dataset: str
    out: str
    model: str = "sat"
    model_args: dict[str, Any] = field(default_factory=dict)
    image_root: str | None = None
    encoder: dict[str, Any] = field(default_factory=dict)  # EncoderSpec fields; empty = defaults
    cache_dir: str = ".cache/features"
    epochs: int = 20
    batch_size: int = 64
    lr: float = 4e-4
    grad_clip: float = 5.0
    label_smoothing: float = 0.0
    min_count: int = 1  # a word is kept if it occurs at least this often in training captions
    max_train_len: int = 16
    max_decode_len: int = 20
    val_beam: int = 1
    val_limit: int | None = None
    train_limit: int | None = None
    select_metric: str | None = None  # default: the model's own (SAT: BLEU-4, others: CIDEr-D)
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


def _pad(captions: list[list[int]], pad_id: int) -> torch.Tensor:
    out = torch.full((len(captions), max(map(len, captions))), pad_id, dtype=torch.long)
    for i, ids in enumerate(captions):
        out[i, : len(ids)] = torch.tensor(ids)
    return out


def xe_loss(logprobs: torch.Tensor, targets: torch.Tensor, pad_id: int, label_smoothing: float = 0.0) -> torch.Tensor:
    """Mean token negative log-likelihood over non-pad targets (EOS included), optional label smoothing."""
    return F.nll_loss(logprobs.flatten(0, 1), targets.flatten(), ignore_index=pad_id) if not label_smoothing else \
        _smoothed(logprobs, targets, pad_id, label_smoothing)


def _smoothed(logprobs: torch.Tensor, targets: torch.Tensor, pad_id: int, eps: float) -> torch.Tensor:
    mask = targets != pad_id
    nll = -logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    uniform = -logprobs.mean(-1)
    return (((1 - eps) * nll + eps * uniform) * mask).sum() / mask.sum()


def train(cfg: TrainConfig, resume: bool = False) -> Path:
    """Run XE training; returns the path of the best checkpoint."""
    set_threads(cfg.threads)
    device = resolve_device(cfg.device)
    run_dir = Path(cfg.out)
    run_dir.mkdir(parents=True, exist_ok=True)
    saved = load_state(run_dir) if resume else None
    if saved is None and (run_dir / "train_state.json").exists() and not resume:
        raise FileExistsError(f"{run_dir} already holds a training run: pass --resume to continue it, "
                              "or choose another --out (nothing is overwritten)")
    if saved is not None:
        cfg = TrainConfig(**{**saved["config"], "epochs": cfg.epochs, "max_steps": cfg.max_steps,
                             "progress": cfg.progress, "threads": cfg.threads, "device": cfg.device})
    torch.manual_seed(cfg.seed)

    spec = EncoderSpec(**cfg.encoder)
    train_images = load_karpathy(cfg.dataset, cfg.image_root, ("train",), limit=cfg.train_limit)
    val_images = load_karpathy(cfg.dataset, cfg.image_root, ("val",), limit=cfg.val_limit)
    if not train_images or not val_images:
        raise ValueError(f"{cfg.dataset} needs non-empty 'train' and 'val' splits "
                         f"(found {len(train_images)} train, {len(val_images)} val)")
    store = extract_features(train_images + val_images, spec, cfg.cache_dir, device=str(device),
                             progress=cfg.progress)

    if saved is not None:
        vocab = Vocabulary.from_json(saved["vocab"])
    else:
        vocab = Vocabulary.build((r for im in train_images for r in im.references), min_count=cfg.min_count)
    feat_dim = store.array.shape[-1]
    model = create(cfg.model, vocab_size=len(vocab), feat_dim=feat_dim, **cfg.model_args).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    select = cfg.select_metric or model.selection_metric

    pairs = [(im.key, vocab.encode(ref, cfg.max_train_len)) for im in train_images for ref in im.references]
    steps_per_epoch = math.ceil(len(pairs) / cfg.batch_size)
    progress = {"epoch": 0, "step_in_epoch": 0, "global_step": 0, "best_score": -1.0, "best_epoch": -1,
                "history": []}
    if saved is not None:
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(restore_optimizer_state(saved["optimizer"]))
        torch.set_rng_state(saved["rng"]["torch"])
        progress = saved["progress"]
        print(f"resuming {run_dir} at epoch {progress['epoch'] + 1}, step {progress['step_in_epoch']}")

    def snapshot() -> None:
        save_state(run_dir, {"config": cfg.to_json(), "vocab": vocab.to_json(), "progress": progress,
                             "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                             "rng": {"torch": torch.get_rng_state()}})

    meta = {"dataset": str(cfg.dataset), "train_config": cfg.to_json()}
    started = time.time()
    with _StopFlag() as stop:
        while progress["epoch"] < cfg.epochs:
            epoch = progress["epoch"]
            order = np.random.default_rng([cfg.seed, epoch]).permutation(len(pairs))
            model.train()
            bar = tqdm(total=steps_per_epoch, initial=progress["step_in_epoch"], desc=f"epoch {epoch + 1}/{cfg.epochs}",
                       unit="batch", disable=not cfg.progress, dynamic_ncols=True)
            for step in range(progress["step_in_epoch"], steps_per_epoch):
                batch = [pairs[i] for i in order[step * cfg.batch_size:(step + 1) * cfg.batch_size]]
                feats = store.get([key for key, _ in batch]).to(device)
                targets = _pad([ids for _, ids in batch], vocab.pad_id).to(device)
                logprobs, aux = model.forward_xe(VisualBatch.from_features(feats), targets)
                loss = xe_loss(logprobs, targets, vocab.pad_id, cfg.label_smoothing)
                total = loss + sum(aux.values()) if aux else loss
                optimizer.zero_grad(set_to_none=True)
                total.backward()
                if cfg.grad_clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
                optimizer.step()
                progress["step_in_epoch"] = step + 1
                progress["global_step"] += 1
                bar.update(1)
                bar.set_postfix(xe=f"{loss.item():.3f}", **{k: f"{v.item():.3f}" for k, v in aux.items()})
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
            scores = {"epoch": epoch + 1, "xe": float(loss.item()), **{k: round(v, 4) for k, v in scores.items()}}
            progress["history"].append(scores)
            print(json.dumps(scores))
            meta.update(history=progress["history"], train_seconds=round(time.time() - started, 1))
            save_checkpoint(run_dir / "last", model, vocab, spec, meta)
            if scores[select] > progress["best_score"]:
                progress["best_score"], progress["best_epoch"] = scores[select], epoch + 1
                save_checkpoint(run_dir / "best", model, vocab, spec,
                                {**meta, "selected_by": select, "best_epoch": epoch + 1, "val_scores": scores})
            progress["epoch"] += 1
            progress["step_in_epoch"] = 0
            snapshot()
    return run_dir / "best"
