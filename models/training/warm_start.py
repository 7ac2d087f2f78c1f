"""Warm starts (``--init CHECKPOINT``): a new run takes its architecture, sizes, encoder and feature source from a
trained checkpoint (:func:`adopt_init`), its vocabulary, possibly extended by the new data's words
(:func:`choose_vocab`), and its weights, also into a related architecture (:func:`load_init_weights`); the model
card records what it began from (:func:`lineage`)."""

from __future__ import annotations

import inspect
from dataclasses import replace
from typing import Any, Sequence

import torch

from ..checkpoint import Checkpoint
from ..data.karpathy import CaptionedImage
from ..encoder import EncoderSpec
from ..protocol import Captioner
from ..registry import MODELS
from ..vocab import SPECIALS, Vocabulary
from .config import TrainConfig


def adopt_init(cfg: TrainConfig, init: Checkpoint) -> TrainConfig:
    """Take architecture, hyper-parameters, encoder and feature source from the ``init`` checkpoint; ``--set``
    values still override hyper-parameters (a shape change then fails loudly when the weights are loaded)."""
    if cfg.encoder and EncoderSpec.of(cfg.encoder) != init.encoder:
        raise ValueError(f"--encoder differs from the encoder {cfg.init} was trained with")
    args = {k: v for k, v in init.model.config().items() if k not in ("vocab_size", "feat_dim")}
    if cfg.model not in (None, init.model.arch):  # another architecture: only the sizes it has (SAT → SAT-hard)
        accepted = inspect.signature(MODELS[cfg.model]).parameters if cfg.model in MODELS else {}
        args = {k: v for k, v in args.items() if k in accepted}
    return replace(cfg, model=cfg.model or init.model.arch,
                   model_args={**args, **cfg.model_args}, encoder=init.encoder.to_json(),
                   features=cfg.features or init.trained_features)


def lineage(path: str, init: Checkpoint) -> dict[str, Any]:
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


def load_init_weights(model: Captioner, init: Checkpoint, source: str) -> None:
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


def choose_vocab(cfg: TrainConfig, saved: dict[str, Any] | None, init: Checkpoint | None,
                 train_images: Sequence[CaptionedImage]) -> Vocabulary:
    """The resumed run's vocabulary, else ``--init``'s (with ``--extend-vocab``, the training captions' new words
    appended), else the training captions' words at ``--min-count``."""
    def data_vocab() -> Vocabulary:
        vocab = Vocabulary.build((r for im in train_images for r in im.references), min_count=cfg.min_count)
        if len(vocab) == len(SPECIALS) and not (init is not None and cfg.extend_vocab):
            words = len({w for im in train_images for r in im.references for w in r})
            raise ValueError(f"--min-count {cfg.min_count} keeps none of the training captions' {words} distinct "
                             "words (a word is kept when it occurs at least that often): lower it")
        return vocab

    if saved is not None:
        return Vocabulary.from_json(saved["vocab"])
    if init is not None and cfg.extend_vocab:  # appended, so every word keeps its id and its trained rows
        return Vocabulary(init.vocab.itos + [w for w in data_vocab().itos if w not in init.vocab.stoi])
    if init is not None:
        return init.vocab
    return data_vocab()
