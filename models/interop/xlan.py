"""Convert the X-LAN authors' released checkpoints (github.com/JDAI-CV/image-captioning: a ``caption_model_*.pth``
state dict + the vocabulary text file ``coco_vocabulary.txt``) into this project's checkpoint: their ``XLAN``
into :class:`~captioner.models.xlan.XLAN` and their ``XTransformer`` (the paper's X-Transformer) into
:class:`~captioner.models.xtransformer.XTransformer` (Pan et al., "X-Linear Attention Networks for Image
Captioning", CVPR 2020, arXiv:2003.14080).

The authors' code differs from the paper in three ways that change outputs, each a flag of our models
(docs/decisions.md#x-lan-and-x-transformer-reference-compatibility): every X-Linear embedding (Eq. 2, 6) is
followed by a GroupNorm over the heads (``group_norm``); X-LAN's LSTM gets ``[E w_t; ṽ + c_{t−1}]`` rather than
§3.3.3's concatenation (``lstm_input="sum"``); X-LAN's decoder block output goes through ``LN(W [h_t; v̂_d])``
before the GLU (``block_projection``).  Everything else maps one to one:

* their ``LowRank`` block ``in_proj_q`` / ``in_proj_k`` / ``in_proj_v1`` / ``in_proj_v2`` are ``ρ(W^k_q Q)``,
  ``ρ(W_k k_i)``, ``ρ(W^v_q Q)``, ``ρ(W_v v_i)`` (Eq. 2, 6); ``SCAtt``'s hidden layer, ``attention_last`` and
  ``attention_last2`` are ``W^k_B`` (Eq. 3), ``W_b`` (Eq. 3) and ``W_e`` (Eq. 5).  The number of heads is not
  stored: it is ``D_B`` over the hidden layer's input width (their ``ATT_MID_DIM[0]`` is the head width);
* the vocabulary: their ``utils.load_vocab`` puts ``.`` at index 0 (start and end token) and then one word per
  line; remapped as for AoANet (:mod:`.common`).

What the state dict does not record is taken from the released configs (``experiments/xlan``,
``experiments/xtransformer``): CELU with α = 1.3 for every embedding, ReLU in the key/value update, and the
dropout rates (which are our models' defaults).  Variants the released models do not use are refused: a decoder
block of several layers (``DECODE_LAYERS > 1``), ``BasicAtt``, an ``ATT_MID_DIM`` with more than one hidden layer,
a positional encoding other than base 10000.  The weights are read with ``torch.load(weights_only=True)`` and the
vocabulary as UTF-8 text; the model reads bottom-up region features (``--features regions:DIR``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..layers import sinusoid_positions
from ..vocab import Vocabulary
from ..xlan import XLAN
from ..xtransformer import XTransformer
from .common import ConversionError, copy_weights, load_converted, load_torch_weights, token_rows, \
    vocabulary_from_indexed

CODE = "github.com/JDAI-CV/image-captioning"
MAX_VOCABULARY_BYTES = 16 << 20  # COCO's is ~70 kB: anything this large is not a vocabulary file
#: what the released configs set and the weights cannot tell (MODEL.BILINEAR.ACT / ELU_ALPHA, BIFEAT_EMB_ACT)
RELEASED = dict(activation="celu", celu_alpha=1.3, group_norm=True)
ASSUMED = ("CELU(α=1.3) embeddings and ReLU key/value updates, as in the released configs "
           "(activations are not stored in the weights)")
_EMBEDDINGS = (("query_key_embed", "in_proj_q"), ("key_embed", "in_proj_k"),
               ("query_value_embed", "in_proj_v1"), ("value_embed", "in_proj_v2"))
_SCATT = (("bilinear_embed", "attn_net.attention_basic.0"), ("spatial_score", "attn_net.attention_last"),
          ("excitation", "attn_net.attention_last2"))


def read_vocabulary(path: str | Path) -> list[str]:
    """Their words, index 1 onwards, as their ``utils.load_vocab`` reads the file: one word per line, stripped
    (lines end with ``\\n``, ``\\r\\n`` or ``\\r``); index 0 (``.``) is implicit.

    Read as text and checked, never evaluated: a file larger than :data:`MAX_VOCABULARY_BYTES`, not UTF-8, with
    NUL bytes, a blank line, a non-printable character or a repeated word is refused, naming the line."""
    path = Path(path)
    if path.stat().st_size > MAX_VOCABULARY_BYTES:
        raise ConversionError(f"{path} is {path.stat().st_size:,} bytes: not a vocabulary file (one word per line)")
    data = path.read_bytes()
    if b"\0" in data:
        raise ConversionError(f"{path} is binary, not a vocabulary text file (one word per line)")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConversionError(f"{path} is not UTF-8 text ({error.reason} at byte {error.start}): not a vocabulary "
                              f"file (one word per line)") from None
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the newline that ends the last line starts no line
    words = [line.strip() for line in lines]
    seen: dict[str, int] = {}
    for number, word in enumerate(words, 1):
        if not word:
            raise ConversionError(f"{path}, line {number} is blank: every line must hold one word")
        if not word.isprintable():
            raise ConversionError(f"{path}, line {number} holds a non-printable character: {word[:40]!r}")
        if word in seen:
            raise ConversionError(f"{path}, line {number} repeats the word {word!r} of line {seen[word]}")
        seen[word] = number
    if not words:
        raise ConversionError(f"{path} holds no words")
    return words


def _vocabulary(path: str | Path, rows: int) -> tuple[Vocabulary, dict[int, int]]:
    words = read_vocabulary(path)
    if rows != len(words) + 1:
        raise ConversionError(f"the checkpoint's word embedding has {rows} rows but {path} holds {len(words)} words "
                              f"(+ 1 for '.', index 0): the vocabulary file does not belong to these weights")
    return vocabulary_from_indexed(enumerate(words, 1))


def _layer_count(state: Mapping[str, Tensor], prefix: str) -> int:
    pattern = re.compile(re.escape(prefix) + r"\.(\d+)\.")
    found = {int(m.group(1)) for key in state if (m := pattern.match(key))}
    return max(found) + 1 if found else 0


#: import kind → (the model's name, a key only that model's checkpoints have)
_KINDS = {"xlan": ("X-LAN", "att_lstm.weight_hh"), "xtransformer": ("X-Transformer", "decoder.embed_tokens.weight")}


def _open(checkpoint: str | Path, kind: str, required: tuple[str, ...]) -> tuple[dict[str, Tensor], str, int, int]:
    """The state dict, its description for messages, and the block and region-feature widths; a checkpoint of the
    other model, or one without the keys the sizes are read from, is refused."""
    state = load_torch_weights(checkpoint)
    name = _KINDS[kind][0]
    what = f"an {name} caption_model_*.pth ({Path(checkpoint).name})"
    for other, (other_name, marker) in _KINDS.items():
        if other != kind and marker in state:
            raise ConversionError(f"{checkpoint} is an {other_name} checkpoint: use `captioner import {other}`")
    missing = [key for key in ("att_embed.0.weight", *required) if key not in state]
    if missing:
        raise ConversionError(f"not {what}: it lacks {', '.join(missing)}")
    dim, feat_dim = (int(n) for n in state["att_embed.0.weight"].shape)
    return state, what, dim, feat_dim


def _block_shape(state: Mapping[str, Tensor], prefix: str, dim: int) -> tuple[int, int]:
    """``(heads, D_c)`` of the X-Linear block under ``prefix``: ``SCAtt``'s hidden layer is
    ``Linear(D_B/H → D_c/H)`` (their ``ATT_MID_DIM = [D_B/H, D_c/H, D_B/H]``)."""
    hidden = f"{prefix}.attn_net.attention_basic.0.weight"
    if f"{prefix}.attn_net.attention_last2.weight" not in state:
        raise ConversionError(f"{prefix} is not an SCAtt X-Linear block (ATTTYPE BasicAtt is not supported)")
    if hidden not in state:
        raise ConversionError(f"{prefix}: SCAtt without a hidden layer (ATT_MID_DIM of two sizes) is not supported")
    deeper = sorted({key for key in state if key.startswith(f"{prefix}.attn_net.attention_basic.")
                     and not key.startswith(f"{prefix}.attn_net.attention_basic.0.")})
    if deeper:
        raise ConversionError(f"{prefix}: ATT_MID_DIM with more than one hidden layer is not supported ({deeper[0]})")
    channels, head_width = state[hidden].shape
    if dim % head_width:
        raise ConversionError(f"{prefix}: the block width {dim} is not a multiple of the head width {head_width}")
    heads = dim // head_width
    return heads, heads * int(channels)


def _block_names(ours: str, theirs: str) -> dict[str, str]:
    """Our X-Linear block's keys ← their ``LowRank`` + ``SCAtt`` keys (the embeddings are Linear → CELU →
    GroupNorm, indices 0 and 2, in both)."""
    names = {}
    for kind in ("weight", "bias"):
        for mine, their_name in _EMBEDDINGS:
            for index in (0, 2):
                names[f"{ours}.{mine}.{index}.{kind}"] = f"{theirs}.{their_name}.{index}.{kind}"
        for mine, their_name in _SCATT:
            names[f"{ours}.{mine}.{kind}"] = f"{theirs}.{their_name}.{kind}"
    return names


def _pairs(ours: str, theirs: str) -> dict[str, str]:
    """``weight`` and ``bias`` of one layer."""
    return {f"{ours}.{kind}": f"{theirs}.{kind}" for kind in ("weight", "bias")}


def _convert(model: XLAN | XTransformer, state: Mapping[str, Tensor], names: dict[str, str], rows: dict[str, str],
             vocab: Vocabulary, source: dict[int, int], what: str, handled: tuple[str, ...] = ()) -> None:
    """Copy the one-to-one weights, remap the word embedding and output rows (``rows``: our embedding, output
    weight and output bias ← theirs) and load them into ``model``."""
    ours = copy_weights(state, names, what=what, handled=tuple(rows.values()) + handled)
    embedding, weight, bias = (state[key].float() for key in rows.values())
    ours.update(zip(rows, token_rows(vocab, source, embedding, weight, bias)))
    load_converted(model, ours)


def _meta(model_type: str, checkpoint: str | Path, vocab_path: str | Path, feat_dim: int, **extra: str) -> dict:
    return {"imported_from": {"code": CODE, "model": model_type, "weights": Path(checkpoint).name,
                              "vocab": Path(vocab_path).name},
            "visual_input": f"bottom-up region features ({feat_dim}-d): use --features regions:DIR",
            "assumed": ASSUMED, **extra}


def convert_xlan(checkpoint: str | Path, vocab_path: str | Path) -> tuple[XLAN, Vocabulary, dict[str, Any]]:
    """Their ``XLAN`` (``experiments/xlan``) → :class:`~captioner.models.xlan.XLAN` with ``group_norm``,
    ``lstm_input="sum"`` and ``block_projection``."""
    state, what, dim, feat_dim = _open(checkpoint, "xlan", (
        "word_embed.0.weight", "att_lstm.weight_hh", "attention.layers.0.encoder_attn.attn_net.attention_last2.weight"))
    rows, embed_dim = (int(n) for n in state["word_embed.0.weight"].shape)
    hidden = int(state["att_lstm.weight_hh"].shape[1])
    if _layer_count(state, "attention.layers") != 1:
        raise ConversionError("only a one-layer decoder block (BILINEAR.DECODE_LAYERS 1, the released X-LAN) is "
                              f"supported; {checkpoint} has {_layer_count(state, 'attention.layers')}")
    if hidden != dim:
        raise ConversionError(f"the LSTM width {hidden} differs from the block width {dim}: their code adds "
                              f"c_(t-1) to the image vector, so RNN_SIZE must equal BILINEAR.DIM")
    heads, channel_dim = _block_shape(state, "attention.layers.0.encoder_attn", dim)
    layers = _layer_count(state, "encoder_layers.layers")
    vocab, source = _vocabulary(vocab_path, rows)
    model = XLAN(len(vocab), feat_dim, dim=dim, hidden_dim=hidden, embed_dim=embed_dim, channel_dim=channel_dim,
                 heads=heads, encoder_layers=layers, lstm_input="sum", block_projection=True, **RELEASED,
                 pad_id=vocab.pad_id, bos_id=vocab.bos_id, eos_id=vocab.eos_id)

    names = {**_pairs("embed_items.0", "att_embed.0"), **_pairs("global_embed.0", "encoder_layers.proj"),
             **_pairs("global_embed.1", "encoder_layers.layer_norm"), **_pairs("context_gate", "att2ctx.0"),
             **_block_names("attention", "attention.layers.0.encoder_attn"),
             **_pairs("block_projection.0", "attention.proj"), **_pairs("block_projection.1", "attention.layer_norm")}
    names.update({f"lstm.{kind}": f"att_lstm.{kind}" for kind in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")})
    for i in range(layers):  # their encoder block keeps the item updates in lists beside the layers
        names.update(_block_names(f"encoder.{i}.attention", f"encoder_layers.layers.{i}.encoder_attn"))
        names.update(_pairs(f"encoder.{i}.value_update.embed", f"encoder_layers.bifeat_emb.{i}.0"))
        names.update(_pairs(f"encoder.{i}.value_update.norm", f"encoder_layers.layer_norms.{i}"))
    rows_map = {"embed_words.0.weight": "word_embed.0.weight", "logit.weight": "logit.weight",
                "logit.bias": "logit.bias"}
    _convert(model, state, names, rows_map, vocab, source, what)
    return model, vocab, _meta("XLAN", checkpoint, vocab_path, feat_dim)


def _check_positions(pe: Tensor, dim: int) -> None:
    """Their ``PositionalEncoding`` buffer must be the sinusoid of base 10000 that our decoder computes (their
    base is ``2 · TRANSFORMER.PE_MAX_LEN``, 10000 with the default 5000)."""
    if pe.dim() != 3 or pe.shape[0] != 1 or pe.shape[2] != dim:
        raise ConversionError(f"decoder.embed_positions.pe has shape {tuple(pe.shape)}, not [1, max_len, {dim}]")
    positions = min(pe.shape[1], 64)  # captions are at most SEQ_LEN = 17 tokens long
    expected = sinusoid_positions(torch.arange(positions), dim)
    if not torch.allclose(pe[0, :positions].float(), expected, atol=1e-4):
        raise ConversionError("the decoder's positional encoding is not the base-10000 sinusoid "
                              "(TRANSFORMER.PE_MAX_LEN other than 5000?): not supported")


def convert_xtransformer(checkpoint: str | Path, vocab_path: str | Path) -> tuple[XTransformer, Vocabulary,
                                                                                    dict[str, Any]]:
    """Their ``XTransformer`` (``experiments/xtransformer``) →
    :class:`~captioner.models.xtransformer.XTransformer` with ``group_norm``."""
    state, what, dim, feat_dim = _open(checkpoint, "xtransformer", (
        "decoder.embed_tokens.weight", "decoder.embed_positions.pe",
        "decoder.layers.0.cross_att.attn_net.attention_last2.weight"))
    rows = int(state["decoder.embed_tokens.weight"].shape[0])
    heads, channel_dim = _block_shape(state, "decoder.layers.0.cross_att", dim)
    inner = [value.shape[0] for key, value in state.items() if key.endswith(".ff_layer.fc1.weight")]
    ffn_dim = int(inner[0]) if inner else 4 * dim  # their FFN is 4 × D; none at all with one decoder layer only
    encoder_layers = _layer_count(state, "encoder.layers")
    decoder_layers = _layer_count(state, "decoder.layers")
    _check_positions(state["decoder.embed_positions.pe"], dim)
    vocab, source = _vocabulary(vocab_path, rows)
    model = XTransformer(len(vocab), feat_dim, dim=dim, channel_dim=channel_dim, heads=heads,
                         encoder_layers=encoder_layers, decoder_layers=decoder_layers, ffn_dim=ffn_dim, **RELEASED,
                         pad_id=vocab.pad_id, bos_id=vocab.bos_id, eos_id=vocab.eos_id)

    def feed_forward(ours: str, theirs: str) -> dict[str, str]:
        return {**_pairs(f"{ours}.ffn.0", f"{theirs}.fc1"), **_pairs(f"{ours}.ffn.3", f"{theirs}.fc2"),
                **_pairs(f"{ours}.norm", f"{theirs}.layer_norms")}

    names = {**_pairs("embed_items.0", "att_embed.0"), **_pairs("embed_items.2", "att_embed.2"),
             **_pairs("global_embed.0", "encoder.proj_norm.0"), **_pairs("global_embed.1", "encoder.proj_norm.1"),
             **_pairs("word_norm", "decoder.layer_norm_word"),
             **_pairs("query_image.0", "decoder.wbil1.0"), **_pairs("query_image.2", "decoder.wbil1.2"),
             **_pairs("query_words.0", "decoder.wbil2.0"), **_pairs("query_words.2", "decoder.wbil2.2"),
             **_pairs("output_embed", "decoder.proj_norm.0"), **_pairs("output_norm", "decoder.proj_norm.2")}
    for i in range(encoder_layers):
        theirs = f"encoder.layers.{i}"
        names.update({**_block_names(f"encoder.{i}.attention", f"{theirs}.encoder_attn"),
                      **_pairs(f"encoder.{i}.value_update.embed", f"{theirs}.bifeat_emb.0"),
                      **_pairs(f"encoder.{i}.value_update.norm", f"{theirs}.layer_norm"),
                      **feed_forward(f"encoder_ffn.{i}", f"{theirs}.ff_layer")})
    for i in range(decoder_layers):
        theirs = f"decoder.layers.{i}"
        names.update({**_block_names(f"decoder.{i}.word_attention", f"{theirs}.word_attn"),
                      **_block_names(f"decoder.{i}.cross_attention", f"{theirs}.cross_att"),
                      **_pairs(f"decoder.{i}.cross_query_norm", f"{theirs}.layer_norm_cross"),
                      **_pairs(f"decoder.{i}.output_norm", f"{theirs}.layer_norm_gx")})
        if i < decoder_layers - 1:  # the last layer's word states feed nothing: no update, no FFN (both codes)
            names.update({**_pairs(f"decoder.{i}.word_update.embed", f"{theirs}.bifeat_emb.0"),
                          **_pairs(f"decoder.{i}.word_update.norm", f"{theirs}.layer_norm_x"),
                          **feed_forward(f"decoder.{i}.feed_forward", f"{theirs}.ff_layer")})
    rows_map = {"embed_words.weight": "decoder.embed_tokens.weight", "logit.weight": "decoder.generator.weight",
                "logit.bias": "decoder.generator.bias"}
    _convert(model, state, names, rows_map, vocab, source, what, handled=("decoder.embed_positions.pe",))
    return model, vocab, _meta("XTransformer", checkpoint, vocab_path, feat_dim,
                               regions="their config keeps the first 50 regions of each image "
                                       "(DATA_LOADER.MAX_FEAT 50): give the same features")


#: ``captioner import KIND`` → converter
CONVERTERS = {"xlan": convert_xlan, "xtransformer": convert_xtransformer}
