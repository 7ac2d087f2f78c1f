"""Convert the AoANet authors' released checkpoint (github.com/husthuaan/AoANet: ``model-best.pth`` +
``infos_*-best.pkl``) into this project's checkpoint.

Their model is this project's :class:`~captioner.models.aoanet.AoANet` with the authors' code's choices switched on
(docs/decisions.md#aoanet-reference-compatibility-flags): pre-norm refiner with a final LayerNorm
(``pre_norm``), the Annotated-Transformer LayerNorm (``layer_norm="std"``), biases on every projection and on the
output layer (``projection_bias``), AoA fed the attention module's input rather than the projected query
(``aoa_query="input"``), a LayerNorm on the decoder query (``query_norm``) and Embedding → ReLU → Dropout
(``word_embedding="relu_dropout"``).  The weights map one to one, except:

* ``ctx2att`` (one ``Linear(D, 2D)``) splits into the decoder's key and value projections;
* the vocabulary: their index 0 is both the start token and the end token (and ``ix_to_word`` numbers the words
  from 1).  Their row 0 becomes ``<bos>``'s embedding and ``<eos>``'s output row; a word ``UNK`` becomes
  ``<unk>``; ``<pad>`` and ``<bos>`` (and ``<unk>`` if they have none) get output rows that can never win
  (weight 0, bias −1e9), so the log-probabilities of their tokens are unchanged.

The weights are read with ``torch.load(weights_only=True)`` and the infos file with a restricted unpickler
(:mod:`.safe_pickle`).  The model reads bottom-up region features (``--features regions:DIR``); the checkpoint's
encoder spec is the project default and unused with region features.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..aoanet import AoANet
from ..vocab import SPECIALS, Vocabulary
from .safe_pickle import restricted_load

NEVER = -1e9  # output bias of tokens the authors' model cannot emit


class ConversionError(ValueError):
    """The files are not an AoANet checkpoint this converter understands."""


def load_torch_weights(path: str | Path) -> dict[str, Tensor]:
    """A state dict from a ``.pth`` (``weights_only``: tensors and containers only), unwrapped from a training
    snapshot (``{"state_dict": ...}`` / ``{"model": ...}``) and without DataParallel's ``module.`` prefix."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    for wrapper in ("state_dict", "model"):
        if isinstance(state, dict) and isinstance(state.get(wrapper), dict):
            state = state[wrapper]
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise ConversionError(f"{path} does not hold a state dict of tensors")
    return {k.removeprefix("module."): v for k, v in state.items()}


def _options(infos: Any) -> dict[str, Any]:
    opt = infos.get("opt", {}) if isinstance(infos, dict) else {}
    return vars(opt) if isinstance(opt, argparse.Namespace) else dict(opt)


def _vocabulary(ix_to_word: dict) -> tuple[Vocabulary, dict[int, int]]:
    """Project vocabulary and project id → authors' index for every row that has one."""
    authors = sorted((int(ix), word) for ix, word in ix_to_word.items())
    words = [word for _, word in authors if word != "UNK" and word not in SPECIALS]
    vocab = Vocabulary(words)
    source = {vocab.bos_id: 0, vocab.eos_id: 0}
    for ix, word in authors:
        source[vocab.unk_id if word == "UNK" else vocab.stoi[word]] = ix
    return vocab, source


def convert_aoanet(weights: str | Path, infos_path: str | Path) -> tuple[AoANet, Vocabulary, dict[str, Any]]:
    state = load_torch_weights(weights)
    infos = restricted_load(infos_path)
    if not isinstance(infos, dict) or "vocab" not in infos:
        raise ConversionError(f"{infos_path} has no 'vocab' (ix_to_word): not an AoANet infos file")
    opt = _options(infos)
    vocab, source = _vocabulary(infos["vocab"])
    try:
        d_model, feat_dim = state["att_embed.0.weight"].shape
        embed_rows, embed_dim = state["embed.0.weight"].shape
    except KeyError as missing:
        raise ConversionError(f"{weights} lacks {missing}: not an AoANet model-*.pth") from None
    if any(k.startswith("att_embed.") and ("running_mean" in k) for k in state):
        raise ConversionError("checkpoints trained with --use_bn are not supported")
    if any(".feed_forward." in k for k in state):
        raise ConversionError("checkpoints trained with --use_ff (refiner FFN) are not supported")
    if "core.attention.linears.0.weight" not in state or state["ctx2att.weight"].shape[0] != 2 * d_model:
        raise ConversionError("only --use_multi_head 2 with --multi_head_scale 1 (the released AoANet) is supported")
    if state["core.att2ctx.0.weight"].shape != (2 * d_model, 2 * d_model):
        raise ConversionError("only --decoder_type AoA (the released AoANet) is supported")
    if embed_rows != len(infos["vocab"]) + 1:
        raise ConversionError(f"the embedding has {embed_rows} rows but the vocabulary {len(infos['vocab'])} words + 1")
    layers = sorted({int(m.group(1)) for k in state if (m := re.match(r"refiner\.layers\.(\d+)\.", k))})
    model = AoANet(len(vocab), int(feat_dim), d_model=int(d_model), embed_dim=int(embed_dim),
                   heads=int(opt.get("num_heads", 8)), refine_layers=len(layers),
                   refiner="aoa" if layers else "none", pre_norm=True, dropout=float(opt.get("drop_prob_lm", 0.5)),
                   query_norm=True, word_embedding="relu_dropout", projection_bias=True, aoa_query="input",
                   layer_norm="std", pad_id=vocab.pad_id, bos_id=vocab.bos_id, eos_id=vocab.eos_id)

    ours: dict[str, Tensor] = {}
    used: set[str] = set()

    def take(key: str) -> Tensor:
        used.add(key)
        return state[key].float()

    for kind in ("weight", "bias"):
        ours[f"embed_items.{kind}"] = take(f"att_embed.0.{kind}")
        for i in layers:
            theirs = f"refiner.layers.{i}"
            for j, name in enumerate(("query", "key", "value")):
                ours[f"refine.{i}.{name}.{kind}"] = take(f"{theirs}.self_attn.linears.{j}.{kind}")
            ours[f"refine.{i}.aoa.linear.{kind}"] = take(f"{theirs}.self_attn.aoa_layer.0.{kind}")
        ours[f"query.{kind}"] = take(f"core.attention.linears.0.{kind}")
        ours[f"key.{kind}"], ours[f"value.{kind}"] = take(f"ctx2att.{kind}").split(int(d_model))
        ours[f"aoa.linear.{kind}"] = take(f"core.att2ctx.0.{kind}")
    for kind in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
        ours[f"lstm.{kind}"] = take(f"core.att_lstm.{kind}")
    for mine, theirs in ([(f"refine.{i}.norm", f"refiner.layers.{i}.sublayer.0.norm") for i in layers]
                         + ([("refine_norm", "refiner.norm")] if layers else []) + [("query_norm", "core.attention.norm")]):
        ours[f"{mine}.weight"], ours[f"{mine}.bias"] = take(f"{theirs}.a_2"), take(f"{theirs}.b_2")

    their_embed, their_logit_w, their_logit_b = take("embed.0.weight"), take("logit.weight"), take("logit.bias")
    embed = torch.zeros(len(vocab), int(embed_dim))
    logit_w = torch.zeros(len(vocab), int(d_model))
    logit_b = torch.full((len(vocab),), NEVER)
    for mine, theirs in source.items():
        if mine != vocab.eos_id:  # <eos> is never an input; row 0 is their start token's embedding
            embed[mine] = their_embed[theirs]
        if mine != vocab.bos_id:  # row 0 of their output layer is the end token
            logit_w[mine], logit_b[mine] = their_logit_w[theirs], their_logit_b[theirs]
    ours.update({"embed_words.weight": embed, "logit.weight": logit_w, "logit.bias": logit_b})

    left = sorted(set(state) - used - {"fc_embed.0.weight", "fc_embed.0.bias"})
    if left:
        raise ConversionError(f"weights this converter does not understand: {', '.join(left[:5])}")
    model.load_state_dict(ours, strict=True)
    model.eval()
    meta = {"imported_from": {"code": "github.com/husthuaan/AoANet", "weights": Path(weights).name,
                              "infos": Path(infos_path).name},
            "visual_input": f"bottom-up region features ({int(feat_dim)}-d): use --features regions:DIR",
            "source_options": {k: v for k, v in opt.items() if isinstance(v, (int, float, str, bool))}}
    return model, vocab, meta
