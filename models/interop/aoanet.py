"""Convert the AoANet authors' released checkpoint (github.com/husthuaan/AoANet: ``model-best.pth`` +
``infos_*-best.pkl``) into this project's checkpoint.

Their model is this project's :class:`~captioner.models.aoanet.AoANet` with the authors' code's choices switched on
(docs/decisions.md#aoanet-reference-compatibility-flags): pre-norm refiner with a final LayerNorm
(``pre_norm``), the Annotated-Transformer LayerNorm (``layer_norm="std"``), biases on every projection and on the
output layer (``projection_bias``), AoA fed the attention module's input rather than the projected query
(``aoa_query="input"``), a LayerNorm on the decoder query (``query_norm``) and Embedding → ReLU → Dropout
(``word_embedding="relu_dropout"``).  The weights map one to one, except:

* ``ctx2att`` (one ``Linear(D, 2D)``) splits into the decoder's value projection (first half) and key
  projection (second half): ``AoA_Decoder_Core.forward`` calls ``self.attention(h_att, p_att_feats.narrow(2, 0, D),
  p_att_feats.narrow(2, D, D), att_masks)`` and ``MultiHeadedDotAttention.forward`` is declared ``(self, query,
  value, key, mask=None)`` (``models/AoAModel.py``);
* the vocabulary (``ix_to_word`` numbers the words from 1; index 0 is both the start and the end token): remapped
  by :func:`.common.vocabulary_from_indexed` and :func:`.common.token_rows`, so that the log-probabilities of
  their tokens are unchanged and ``<pad>``/``<bos>`` can never win.

Checkpoints the model cannot express are refused: ``--use_bn``, ``--use_ff``, another attention or decoder type,
and ``--mean_feats 0`` (the LSTM then reads ``fc_embed`` of a separate fc feature, which region features lack).
The weights are read with ``torch.load(weights_only=True)`` and the infos file with a restricted unpickler
(:mod:`.safe_pickle`).  The model reads bottom-up region features (``--features regions:DIR``); the checkpoint's
encoder spec is the project default and unused with region features.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import Tensor

from ..aoanet import AoANet
from ..vocab import Vocabulary
from .common import ConversionError, copy_weights, load_converted, load_torch_weights, token_rows, \
    vocabulary_from_indexed
from .safe_pickle import restricted_load

__all__ = ["ConversionError", "convert_aoanet", "load_torch_weights"]


def _options(infos: Any) -> dict[str, Any]:
    opt = infos.get("opt", {}) if isinstance(infos, dict) else {}
    return vars(opt) if isinstance(opt, argparse.Namespace) else dict(opt)


def convert_aoanet(weights: str | Path, infos_path: str | Path) -> tuple[AoANet, Vocabulary, dict[str, Any]]:
    """Their model (``model-*.pth``) and vocabulary (``infos_*.pkl``) → :class:`~captioner.models.aoanet.AoANet`
    with the authors' code's choices, and the checkpoint's meta; a checkpoint the model cannot express is refused
    (:class:`ConversionError`, module docstring)."""
    state = load_torch_weights(weights)
    infos = restricted_load(infos_path)
    if not isinstance(infos, dict) or not isinstance(infos.get("vocab"), dict):
        raise ConversionError(f"{infos_path} has no 'vocab' dict (ix_to_word): not an AoANet infos file")
    opt = _options(infos)
    vocab, source = vocabulary_from_indexed(infos["vocab"].items())
    d_model, feat_dim, embed_dim = _supported_sizes(state, opt, weights, len(infos["vocab"]))
    layers = sorted({int(m.group(1)) for k in state if (m := re.match(r"refiner\.layers\.(\d+)\.", k))})
    model = AoANet(len(vocab), int(feat_dim), d_model=int(d_model), embed_dim=int(embed_dim),
                   heads=int(opt.get("num_heads", 8)), refine_layers=len(layers),
                   refiner="aoa" if layers else "none", pre_norm=True, dropout=float(opt.get("drop_prob_lm", 0.5)),
                   query_norm=True, word_embedding="relu_dropout", projection_bias=True, aoa_query="input",
                   layer_norm="std", pad_id=vocab.pad_id, bos_id=vocab.bos_id, eos_id=vocab.eos_id)

    split = ("ctx2att.weight", "ctx2att.bias")  # one Linear(D, 2D): the decoder's value and key projections
    rows = ("embed.0.weight", "logit.weight", "logit.bias")  # remapped to our vocabulary
    ours = copy_weights(state, _weight_names(layers), what=f"an AoANet model-*.pth ({weights})", handled=split + rows)
    for kind in ("weight", "bias"):
        # the first half feeds the `value` parameter of their MultiHeadedDotAttention.forward(query, value, key)
        ours[f"value.{kind}"], ours[f"key.{kind}"] = state[f"ctx2att.{kind}"].float().split(int(d_model))
    ours["embed_words.weight"], ours["logit.weight"], ours["logit.bias"] = token_rows(
        vocab, source, *(state[key].float() for key in rows))
    load_converted(model, ours)
    meta = {"imported_from": {"code": "github.com/husthuaan/AoANet", "weights": Path(weights).name,
                              "infos": Path(infos_path).name},
            "visual_input": f"bottom-up region features ({int(feat_dim)}-d): use --features regions:DIR",
            "source_options": {k: v for k, v in opt.items() if isinstance(v, (int, float, str, bool))}}
    return model, vocab, meta


def _supported_sizes(state: Mapping[str, Tensor], opt: dict[str, Any], weights: str | Path,
                     words: int) -> tuple[int, int, int]:
    """``(d_model, feature size, word-embedding size)`` of their model, read from the weights' shapes, once the
    weights and options are known to be a configuration this model can express (else :class:`ConversionError`,
    naming the training flag that it cannot); ``words``: the size of their vocabulary."""
    # before the shapes: with --use_bn, att_embed.0 is the authors' BatchNorm1d, whose weight is 1-d
    if any(k.startswith("att_embed.") and ("running_mean" in k) for k in state):
        raise ConversionError("checkpoints trained with --use_bn are not supported")
    try:
        d_model, feat_dim = state["att_embed.0.weight"].shape
        embed_rows, embed_dim = state["embed.0.weight"].shape
    except KeyError as missing:
        raise ConversionError(f"{weights} lacks {missing}: not an AoANet model-*.pth") from None
    except ValueError:
        raise ConversionError(f"{weights}: att_embed.0 / embed.0 are not the linear layers of AoANet's model-*.pth") \
            from None
    if any(".feed_forward." in k for k in state):
        raise ConversionError("checkpoints trained with --use_ff (refiner FFN) are not supported")
    if "core.attention.linears.0.weight" not in state or ("ctx2att.weight" in state
                                                         and state["ctx2att.weight"].shape[0] != 2 * d_model):
        raise ConversionError("only --use_multi_head 2 with --multi_head_scale 1 (the released AoANet) is supported")
    if "fc_embed.0.weight" in state or not int(opt.get("mean_feats", 1)):
        raise ConversionError("checkpoints trained with --mean_feats 0 are not supported: their LSTM reads "
                              "fc_embed(fc_feats) of a separate fc feature instead of the mean of the refined "
                              "regions, and this model has no fc input")
    if "core.att2ctx.0.weight" in state and state["core.att2ctx.0.weight"].shape != (2 * d_model, 2 * d_model):
        raise ConversionError("only --decoder_type AoA (the released AoANet) is supported")
    if embed_rows != words + 1:
        raise ConversionError(f"the embedding has {embed_rows} rows but the vocabulary {words} words + 1")
    return d_model, feat_dim, embed_dim


def _weight_names(layers: list[int]) -> dict[str, str]:
    """Our parameter name → theirs for every weight that maps one to one (all but ``ctx2att`` and the vocabulary's
    rows), for a refiner of ``layers`` (their layer numbers)."""
    names: dict[str, str] = {}  # our key → theirs
    for kind in ("weight", "bias"):
        names[f"embed_items.{kind}"] = f"att_embed.0.{kind}"
        for i in layers:
            theirs = f"refiner.layers.{i}"
            for j, name in enumerate(("query", "key", "value")):
                names[f"refine.{i}.{name}.{kind}"] = f"{theirs}.self_attn.linears.{j}.{kind}"
            names[f"refine.{i}.aoa.linear.{kind}"] = f"{theirs}.self_attn.aoa_layer.0.{kind}"
        names[f"query.{kind}"] = f"core.attention.linears.0.{kind}"
        names[f"aoa.linear.{kind}"] = f"core.att2ctx.0.{kind}"
    for kind in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
        names[f"lstm.{kind}"] = f"core.att_lstm.{kind}"
    for mine, theirs in ([(f"refine.{i}.norm", f"refiner.layers.{i}.sublayer.0.norm") for i in layers]
                         + ([("refine_norm", "refiner.norm")] if layers else [])
                         + [("query_norm", "core.attention.norm")]):
        names[f"{mine}.weight"], names[f"{mine}.bias"] = f"{theirs}.a_2", f"{theirs}.b_2"
    return names
