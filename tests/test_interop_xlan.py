"""``captioner import xlan|xtransformer``: checkpoints in the X-LAN authors' format (JDAI-CV/image-captioning;
random weights, small widths) convert into models whose log-probabilities equal reference forward passes rebuilt
here from the authors' code as published, argument order included (their ``LowRank`` + ``SCAtt`` block,
``LowRankBilinearEnc/DecBlock``, ``XLAN.Forward`` and ``XTransformer``); foreign or damaged files and bad
vocabulary files are refused."""

import math
import os
import pickle
import re

import pytest
import torch
import torch.nn.functional as F

from captioner.models.checkpoint import load_checkpoint
from captioner.models.interop import xlan as xlan_module
from captioner.models.interop.common import ConversionError
from captioner.models.interop.xlan import MAX_VOCABULARY_BYTES, convert_xlan, convert_xtransformer, read_vocabulary
from captioner.service.cli import main as captioner

from .test_interop import WORDS, assert_same_distribution, linear, our_logprobs
from .test_interop import authors_state as aoanet_state

pytestmark = pytest.mark.usefixtures("one_thread")

D, HEADS, MID, FEAT, FFN = 16, 2, 4, 10, 64  # block width, heads, D_c per head (ATT_MID_DIM = [8, 4, 8])
XLAN_LAYERS, ENC_LAYERS, DEC_LAYERS = 2, 2, 2
ALPHA = 1.3  # MODEL.BILINEAR.ELU_ALPHA of the released configs
PE_MAX_LEN = 5000


# -- files in the authors' format --------------------------------------------------------------------------------
class Weights:
    """Random tensors under the authors' key names."""

    def __init__(self, seed):
        self.g = torch.Generator().manual_seed(seed)
        self.state = {}

    def r(self, *shape, scale=0.3):
        return torch.randn(*shape, generator=self.g) * scale

    def linear(self, name, out_dim, in_dim):
        self.state[f"{name}.weight"], self.state[f"{name}.bias"] = self.r(out_dim, in_dim), self.r(out_dim)

    def norm(self, name):
        self.state[f"{name}.weight"], self.state[f"{name}.bias"] = 1 + self.r(D), self.r(D)

    def lowrank(self, prefix):
        """``LowRank``: four Linear → CELU → GroupNorm embeddings and an ``SCAtt``."""
        for name in ("in_proj_q", "in_proj_k", "in_proj_v1", "in_proj_v2"):
            self.linear(f"{prefix}.{name}.0", D, D)
            self.norm(f"{prefix}.{name}.2")
        self.linear(f"{prefix}.attn_net.attention_basic.0", MID, D // HEADS)
        self.linear(f"{prefix}.attn_net.attention_last", 1, MID)
        self.linear(f"{prefix}.attn_net.attention_last2", D // HEADS, MID)

    def feed_forward(self, prefix, ffn=FFN):
        self.linear(f"{prefix}.fc1", ffn, D)
        self.linear(f"{prefix}.fc2", D, ffn)
        self.norm(f"{prefix}.layer_norms")


def xlan_state(seed=0, encoder_layers=XLAN_LAYERS):
    """``XLAN`` of experiments/xlan at small widths (WORD_EMBED_DIM = RNN_SIZE = BILINEAR.DIM, as their LSTM
    input needs)."""
    w = Weights(seed)
    w.state["word_embed.0.weight"] = w.r(len(WORDS) + 1, D)
    w.linear("att_embed.0", D, FEAT)
    for i in range(encoder_layers):
        w.lowrank(f"encoder_layers.layers.{i}.encoder_attn")
        w.linear(f"encoder_layers.bifeat_emb.{i}.0", D, 2 * D)
        w.norm(f"encoder_layers.layer_norms.{i}")
    w.linear("encoder_layers.proj", D, (encoder_layers + 1) * D)
    w.norm("encoder_layers.layer_norm")
    w.linear("att_lstm", 4 * D, 2 * D)
    w.state["att_lstm.weight_ih"] = w.state.pop("att_lstm.weight")
    w.state["att_lstm.bias_ih"] = w.state.pop("att_lstm.bias")
    w.state["att_lstm.weight_hh"], w.state["att_lstm.bias_hh"] = w.r(4 * D, D), w.r(4 * D)
    w.lowrank("attention.layers.0.encoder_attn")
    w.linear("attention.proj", D, 2 * D)
    w.norm("attention.layer_norm")
    w.linear("att2ctx.0", 2 * D, 2 * D)
    w.linear("logit", len(WORDS) + 1, D)
    return w.state


def their_positions(max_len=PE_MAX_LEN):
    """Their ``PositionalEncoding`` buffer: sin on even channels, cos on odd, base ``2 · max_len``."""
    dim = D
    position = torch.arange(max_len, dtype=torch.float32)[:, None]
    rate = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * -(math.log(max_len * 2.0) / dim))
    pe = torch.zeros(max_len, dim)
    pe[:, 0::2], pe[:, 1::2] = torch.sin(position * rate), torch.cos(position * rate)
    return pe[None]


def xtransformer_state(seed=1, encoder_layers=ENC_LAYERS, decoder_layers=DEC_LAYERS, ffn=FFN):
    """``XTransformer`` of experiments/xtransformer at small widths (ATT_FEATS_NORM on)."""
    w = Weights(seed)
    w.linear("att_embed.0", D, FEAT)
    w.norm("att_embed.2")
    for i in range(encoder_layers):
        p = f"encoder.layers.{i}"
        w.lowrank(f"{p}.encoder_attn")
        w.linear(f"{p}.bifeat_emb.0", D, 2 * D)
        w.norm(f"{p}.layer_norm")
        w.feed_forward(f"{p}.ff_layer", ffn)
    w.linear("encoder.proj_norm.0", D, (encoder_layers + 1) * D)
    w.norm("encoder.proj_norm.1")
    for i in range(decoder_layers):
        p = f"decoder.layers.{i}"
        w.lowrank(f"{p}.word_attn")
        w.lowrank(f"{p}.cross_att")
        w.norm(f"{p}.layer_norm_cross")
        w.norm(f"{p}.layer_norm_gx")
        if i < decoder_layers - 1:
            w.linear(f"{p}.bifeat_emb.0", D, 2 * D)
            w.norm(f"{p}.layer_norm_x")
            w.feed_forward(f"{p}.ff_layer", ffn)
    w.state["decoder.embed_tokens.weight"] = w.r(len(WORDS) + 1, D)
    w.state["decoder.embed_positions.pe"] = their_positions()
    w.norm("decoder.layer_norm_word")
    w.linear("decoder.generator", len(WORDS) + 1, D)
    for name in ("wbil1", "wbil2"):
        w.linear(f"decoder.{name}.0", D, D)
        w.norm(f"decoder.{name}.2")
    w.linear("decoder.proj_norm.0", 2 * D, (decoder_layers + 1) * D)
    w.norm("decoder.proj_norm.2")
    return w.state


# -- the reference: the authors' forward passes, rebuilt from JDAI-CV/image-captioning as published --------------
# (layers/low_rank.py, layers/sc_att.py, blocks/lowrank_bilinear_block.py, models/xlan.py, models/xtransformer.py)
def layer_norm(state, name, x):
    return F.layer_norm(x, (D,), state[f"{name}.weight"], state[f"{name}.bias"])


def lowrank(state, p, query, key, mask, value1, value2):
    """Their ``LowRank.forward2(query, key, mask, value1, value2)`` + ``SCAtt.forward(att_map, att_mask, value1,
    value2)`` (layers/low_rank.py, layers/sc_att.py; argument order as published): ``query``/``value1 [B, L, D]``
    over ``key``/``value2 [B, N, D]``, ``mask [B or 1, L or 1, N]`` (1 = visible)."""
    def embed(name, x):  # Linear → CELU → GroupNorm(heads) on rows, then split into heads: [B, H, rows, D/H]
        y = F.celu(linear(state, f"{p}.{name}.0", x), ALPHA)
        y = F.group_norm(y.reshape(-1, D), HEADS, state[f"{p}.{name}.2.weight"], state[f"{p}.{name}.2.bias"])
        return y.view(x.shape[0], -1, HEADS, D // HEADS).transpose(1, 2)

    q, v1, k, v2 = embed("in_proj_q", query), embed("in_proj_v1", value1), embed("in_proj_k", key), \
        embed("in_proj_v2", value2)
    att_map = F.relu(linear(state, f"{p}.attn_net.attention_basic.0", q.unsqueeze(-2) * k.unsqueeze(-3)))
    visible = mask.unsqueeze(1).float()  # [B, 1, L, N]
    pooled = (att_map * visible.unsqueeze(-1)).sum(-2) / visible.unsqueeze(-1).sum(-2)
    spatial = linear(state, f"{p}.attn_net.attention_last", att_map).squeeze(-1)
    spatial = spatial.masked_fill(visible == 0, -1e9).softmax(-1)
    channel = torch.sigmoid(linear(state, f"{p}.attn_net.attention_last2", pooled))
    out = v1 * (spatial @ v2) * channel  # [B, H, L, D/H]
    return out.transpose(1, 2).reshape(query.shape[0], -1, D)


def masked_mean(x, mask):
    weights = mask.float().unsqueeze(-1)
    return (x * weights).sum(1) / weights.sum(1)


def xlan_logprobs(state, feats, mask, tokens, encoder_layers=XLAN_LAYERS):
    """``XLAN`` (``AttBasicModel.preprocess`` + ``XLAN.Forward``) after feeding ``tokens[:, t]`` (0 = start)."""
    att = F.celu(linear(state, "att_embed.0", feats), ALPHA)
    gv = masked_mean(att, mask)
    image_vectors = [gv]
    for i in range(encoder_layers):  # LowRankBilinearEncBlock
        gv = lowrank(state, f"encoder_layers.layers.{i}.encoder_attn", gv[:, None], att, mask[:, None], gv[:, None],
                     att)[:, 0]  # layer(gv_feat, att_feats, att_mask, gv_feat, att_feats)
        both = torch.cat([gv[:, None].expand_as(att), att], -1)
        att = layer_norm(state, f"encoder_layers.layer_norms.{i}",
                         F.relu(linear(state, f"encoder_layers.bifeat_emb.{i}.0", both)) + att)
        image_vectors.append(gv)
    gv = linear(state, "encoder_layers.proj", torch.cat(image_vectors, -1))
    gv = layer_norm(state, "encoder_layers.layer_norm", gv)
    h = c = context = torch.zeros(feats.shape[0], D)
    out = []
    for t in range(tokens.shape[1]):
        word = F.celu(state["word_embed.0.weight"][tokens[:, t]], ALPHA)
        gates = (torch.cat([word, gv + context], 1) @ state["att_lstm.weight_ih"].T + state["att_lstm.bias_ih"]
                 + h @ state["att_lstm.weight_hh"].T + state["att_lstm.bias_hh"])  # their LSTMCell: i, f, g, o
        i, f, g, o = gates.chunk(4, -1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        block = lowrank(state, "attention.layers.0.encoder_attn", h[:, None], att, mask[:, None], h[:, None], att)[:, 0]
        block = layer_norm(state, "attention.layer_norm", linear(state, "attention.proj", torch.cat([h, block], 1)))
        context = F.glu(linear(state, "att2ctx.0", torch.cat([block, h], 1)), -1)
        out.append(F.log_softmax(linear(state, "logit", context), -1))
    return torch.stack(out, 1)


def feed_forward(state, p, x):
    return layer_norm(state, f"{p}.layer_norms", x + linear(state, f"{p}.fc2", F.relu(linear(state, f"{p}.fc1", x))))


def xtransformer_logprobs(state, feats, mask, tokens, encoder_layers=ENC_LAYERS, decoder_layers=DEC_LAYERS):
    """``XTransformer.forward`` (teacher forcing, causal ``seq_mask``) for ``tokens`` that hold no 0 after
    the start (their training mask also hides later 0s, the padding)."""
    x = layer_norm(state, "att_embed.2", F.celu(linear(state, "att_embed.0", feats), ALPHA))
    gx = masked_mean(x, mask)
    image_vectors = [gx]
    for i in range(encoder_layers):  # EncoderLayer: X-LAN's layer, then an FFN on the items
        p = f"encoder.layers.{i}"
        gx = lowrank(state, f"{p}.encoder_attn", gx[:, None], x, mask[:, None], gx[:, None], x)[:, 0]
        x = layer_norm(state, f"{p}.layer_norm",
                       F.relu(linear(state, f"{p}.bifeat_emb.0", torch.cat([gx[:, None].expand_as(x), x], -1))) + x)
        x = feed_forward(state, f"{p}.ff_layer", x)
        image_vectors.append(gx)
    gx = layer_norm(state, "encoder.proj_norm.1", linear(state, "encoder.proj_norm.0", torch.cat(image_vectors, -1)))

    steps = tokens.shape[1]
    words = math.sqrt(D) * state["decoder.embed_tokens.weight"][tokens] + state["decoder.embed_positions.pe"][:, :steps]
    words = layer_norm(state, "decoder.layer_norm_word", words)
    seq_mask = torch.ones(steps, steps).tril()[None]  # [1, T, T]
    words_so_far = (words.unsqueeze(1) * seq_mask.unsqueeze(-1)).sum(-2) / seq_mask.sum(-1).unsqueeze(-1)

    def bilinear(name, v):
        return layer_norm(state, f"decoder.{name}.2", F.celu(linear(state, f"decoder.{name}.0", v), ALPHA))

    query = bilinear("wbil1", gx)[:, None] * bilinear("wbil2", words_so_far)
    queries = [query]
    for i in range(decoder_layers):  # DecoderLayer
        p = f"decoder.layers.{i}"
        mixed = words + lowrank(state, f"{p}.word_attn", query, words, seq_mask, query, words)
        normed = layer_norm(state, f"{p}.layer_norm_cross", mixed)
        cross = lowrank(state, f"{p}.cross_att", normed, x, mask[:, None], normed, x)
        query = layer_norm(state, f"{p}.layer_norm_gx", mixed + cross)
        if i < decoder_layers - 1:
            update = F.relu(linear(state, f"{p}.bifeat_emb.0", torch.cat([query, words], -1))) + words
            words = feed_forward(state, f"{p}.ff_layer", layer_norm(state, f"{p}.layer_norm_x", update))
        queries.append(query)
    hidden = F.glu(linear(state, "decoder.proj_norm.0", torch.cat(queries, -1)), -1)
    hidden = layer_norm(state, "decoder.proj_norm.2", hidden)
    return F.log_softmax(linear(state, "decoder.generator", hidden), -1)


KINDS = {"xlan": (xlan_state, xlan_logprobs, convert_xlan),
         "xtransformer": (xtransformer_state, xtransformer_logprobs, convert_xtransformer)}


def write_vocabulary(path, words=WORDS, end="\n"):
    path.write_text(end.join(words) + end)
    return path


@pytest.fixture
def inputs():
    """Three images of five regions (the last with two padded ones, random features behind the padding) and
    six steps of the authors' token ids, 0 (start) first."""
    g = torch.Generator().manual_seed(5)
    feats = torch.randn(3, 5, FEAT, generator=g)
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[2, 3:] = False
    tokens = torch.tensor([[0, 1, 2, 4, 5, 3], [0, 6, 6, 1, 2, 4], [0, 3, 1, 1, 5, 2]])
    return feats, mask, tokens


@pytest.mark.parametrize("kind", KINDS)
def test_converted_model_equals_the_authors_forward(kind, inputs, tmp_path):
    make_state, reference, convert = KINDS[kind]
    # DataParallel's prefix and a training snapshot's wrapper, as their main.py saves it
    torch.save({"model": {f"module.{k}": v for k, v in make_state().items()}, "epoch": 3},
               tmp_path / "caption_model_3.pth")
    model, vocab, meta = convert(tmp_path / "caption_model_3.pth", write_vocabulary(tmp_path / "vocabulary.txt"))
    feats, mask, tokens = inputs
    with torch.no_grad():
        theirs = reference(make_state(), feats, mask, tokens)
    assert_same_distribution(our_logprobs(model, vocab, feats, tokens, mask), theirs, vocab)
    assert model.config()["group_norm"]
    # the checkpoint's card and GET /models say which of the authors' files it was made from, by name only (the
    # importer's own folders are nobody else's business)
    model_type, files = {"xlan": "XLAN", "xtransformer": "XTransformer"}[kind], {"vocab": "vocabulary.txt"}
    files["weights"] = "caption_model_3.pth"
    assert meta["imported_from"] == {"code": "github.com/JDAI-CV/image-captioning", "model": model_type, **files}
    assert "<unk>" in vocab.stoi and "UNK" not in vocab.stoi


@pytest.mark.parametrize("kind", KINDS)
def test_import_command_writes_a_loadable_checkpoint(kind, inputs, tmp_path, capsys):
    make_state, reference, _ = KINDS[kind]
    torch.save(make_state(), tmp_path / "caption_model_1.pth")
    vocabulary = write_vocabulary(tmp_path / "coco_vocabulary.txt", end="\r\n")
    captioner(["import", kind, "--checkpoint", str(tmp_path / "caption_model_1.pth"), "--vocab", str(vocabulary),
               "--out", str(tmp_path / kind)])
    # a region-feature model: the closing line's next step is evaluating it on features, not captioning images
    said = capsys.readouterr().out
    assert f"evaluate it with captioner eval {tmp_path / kind} --features regions:DIR" in said
    assert "captioner caption" not in said
    ckpt = load_checkpoint(tmp_path / kind)
    assert ckpt.model.arch == kind and ckpt.meta["imported_from"]["code"] == "github.com/JDAI-CV/image-captioning"
    # their models/__init__.py registers XLAN and XTransformer (XLANTransformer was the first day's name only)
    assert ckpt.meta["imported_from"]["model"] == {"xlan": "XLAN", "xtransformer": "XTransformer"}[kind]
    feats, mask, tokens = inputs
    with torch.no_grad():
        theirs = reference(make_state(), feats, mask, tokens)
    assert_same_distribution(our_logprobs(ckpt.model, ckpt.vocab, feats, tokens, mask), theirs, ckpt.vocab)


def test_xlan_compatibility_flags_are_recorded(tmp_path):
    torch.save(xlan_state(), tmp_path / "x.pth")
    model, _, meta = convert_xlan(tmp_path / "x.pth", write_vocabulary(tmp_path / "v.txt"))
    config = model.config()
    assert config["lstm_input"] == "sum" and config["block_projection"] and config["celu_alpha"] == ALPHA
    # the activations are not in the weights: the checkpoint's meta says they were taken from the released configs
    assert meta["assumed"].startswith(f"CELU(α={ALPHA}) embeddings and ReLU key/value updates")
    assert (config["heads"], config["channel_dim"], config["encoder_layers"]) == (HEADS, HEADS * MID, XLAN_LAYERS)


def test_xtransformer_layer_counts_and_ffn_width_are_each_read_from_the_weights(inputs, tmp_path):
    """The states above have as many encoder as decoder layers and an FFN of 4 · D, which a converter that read
    one layer count for both, or assumed the FFN's width, converted as well; here each differs."""
    state = xtransformer_state(encoder_layers=1, decoder_layers=3, ffn=24)
    torch.save(state, tmp_path / "x.pth")
    model, vocab, _ = convert_xtransformer(tmp_path / "x.pth", write_vocabulary(tmp_path / "v.txt"))
    config = model.config()
    assert (config["encoder_layers"], config["decoder_layers"], config["ffn_dim"]) == (1, 3, 24)
    feats, mask, tokens = inputs
    with torch.no_grad():
        theirs = xtransformer_logprobs(state, feats, mask, tokens, encoder_layers=1, decoder_layers=3)
    assert_same_distribution(our_logprobs(model, vocab, feats, tokens, mask), theirs, vocab)


def test_an_xlan_without_encoder_layers_converts(inputs, tmp_path):
    """``ENCODE_LAYERS 0`` (the refining block left out) stores no ``encoder_layers.layers.*`` key at all: a layer
    count of none, not one, and the model still equals theirs."""
    state = xlan_state(encoder_layers=0)
    torch.save(state, tmp_path / "x.pth")
    model, vocab, _ = convert_xlan(tmp_path / "x.pth", write_vocabulary(tmp_path / "v.txt"))
    assert model.config()["encoder_layers"] == 0
    feats, mask, tokens = inputs
    with torch.no_grad():
        theirs = xlan_logprobs(state, feats, mask, tokens, encoder_layers=0)
    assert_same_distribution(our_logprobs(model, vocab, feats, tokens, mask), theirs, vocab)


def test_layer_counts_of_two_digits_are_read_whole(tmp_path):
    """Layer indices past 9 (``encoder.layers.10.``) count as 10, not as an unknown key beside nine layers."""
    torch.save(xtransformer_state(encoder_layers=11, decoder_layers=1), tmp_path / "x.pth")
    model, _, _ = convert_xtransformer(tmp_path / "x.pth", write_vocabulary(tmp_path / "v.txt"))
    assert (model.config()["encoder_layers"], model.config()["decoder_layers"]) == (11, 1)


def save(tmp_path, state, name="bad.pth"):
    torch.save(state, tmp_path / name)
    return tmp_path / name


def test_foreign_truncated_or_unsupported_weights_are_refused(tmp_path):
    """The two importers share one reader: a checkpoint of the other model, or of neither, is refused spelling each
    model as its authors do (X-LAN, X-Transformer), so a user told which file they have, or which file was expected,
    can look it up."""
    vocabulary = write_vocabulary(tmp_path / "v.txt")
    with pytest.raises(ConversionError, match=r"^not an X-LAN caption_model_\*\.pth \(bad\.pth\): it lacks "
                                              r".*word_embed.0.weight"):
        convert_xlan(save(tmp_path, aoanet_state()), vocabulary)
    with pytest.raises(ConversionError, match=r"^not an X-Transformer caption_model_\*\.pth \(bad\.pth\): it lacks "):
        convert_xtransformer(save(tmp_path, aoanet_state()), vocabulary)
    with pytest.raises(ConversionError, match=r"is an X-Transformer checkpoint: use `captioner import xtransformer`$"):
        convert_xlan(save(tmp_path, xtransformer_state()), vocabulary)
    with pytest.raises(ConversionError, match=r"is an X-LAN checkpoint: use `captioner import xlan`$"):
        convert_xtransformer(save(tmp_path, xlan_state()), vocabulary)

    path = save(tmp_path, xlan_state(), "caption_model_9.pth")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ConversionError, match="cannot be read as a PyTorch state dict"):
        convert_xlan(path, vocabulary)

    state = xlan_state()
    del state["attention.proj.bias"]
    state["encoder_layers.extra.weight"] = torch.zeros(2)
    with pytest.raises(ConversionError, match=r"lacks 1 expected weight\(s\): attention.proj.bias"):
        convert_xlan(save(tmp_path, state), vocabulary)
    del state["encoder_layers.extra.weight"]
    state["attention.proj.bias"] = torch.zeros(D)
    state["encoder_layers.extra.weight"] = torch.zeros(2)
    with pytest.raises(ConversionError, match="does not understand .*encoder_layers.extra.weight"):
        convert_xlan(save(tmp_path, state), vocabulary)

    state = xlan_state()  # their LSTM adds c_(t-1) to the image vector: RNN_SIZE must be the block's width
    state["att_lstm.weight_hh"] = torch.zeros(4 * (D + 8), D + 8)
    with pytest.raises(ConversionError, match=f"LSTM width {D + 8} differs from the block width {D}"):
        convert_xlan(save(tmp_path, state), vocabulary)
    state = xlan_state()
    state.update({k.replace("layers.0", "layers.1"): v for k, v in state.items() if k.startswith("attention.layers.0")})
    with pytest.raises(ConversionError, match="one-layer decoder block"):
        convert_xlan(save(tmp_path, state), vocabulary)
    state = xtransformer_state()
    for max_len in (100, 4990):  # base 200, and base 9980: within 0.005 of base 10000's over 64 positions
        state["decoder.embed_positions.pe"] = their_positions(max_len=max_len)
        with pytest.raises(ConversionError, match="positional encoding"):
            convert_xtransformer(save(tmp_path, state), vocabulary)
    with pytest.raises(ConversionError, match="7 rows but .*v5.txt holds 5 words"):
        convert_xtransformer(save(tmp_path, xtransformer_state()), write_vocabulary(tmp_path / "v5.txt", WORDS[:5]))


def test_scatt_blocks_of_another_depth_are_refused_by_name(tmp_path):
    """``ATT_MID_DIM`` of two sizes (SCAtt with no hidden layer ``W^k_B``, Eq. 3) or of four (two hidden layers) is
    a layout the model cannot express: refused naming it, not a KeyError on the missing layer or a list of keys
    the converter does not understand."""
    vocabulary = write_vocabulary(tmp_path / "v.txt")
    shallow = {k: v for k, v in xlan_state().items() if ".attn_net.attention_basic." not in k}
    with pytest.raises(ConversionError, match="SCAtt without a hidden layer"):
        convert_xlan(save(tmp_path, shallow), vocabulary)
    block = "attention.layers.0.encoder_attn.attn_net.attention_basic"
    deeper = {**xlan_state(), f"{block}.3.weight": torch.zeros(MID, MID), f"{block}.3.bias": torch.zeros(MID)}
    with pytest.raises(ConversionError, match=f"more than one hidden layer is not supported \\({block}.3.bias\\)"):
        convert_xlan(save(tmp_path, deeper), vocabulary)


def test_positional_encoding_is_checked_over_every_position_a_caption_uses(tmp_path):
    """Our decoder computes its own sinusoid and drops theirs, so the check is all that stands between another
    encoding and wrong captions: a buffer that is right for the first positions and wrong at the caption's last
    (SEQ_LEN 17: position 16) is refused."""
    vocabulary = write_vocabulary(tmp_path / "v.txt")
    state = xtransformer_state()
    state["decoder.embed_positions.pe"] = their_positions()
    state["decoder.embed_positions.pe"][0, 16] += 0.01
    with pytest.raises(ConversionError, match="positional encoding is not the base-10000 sinusoid"):
        convert_xtransformer(save(tmp_path, state), vocabulary)


def test_a_positional_buffer_of_another_shape_is_refused_naming_it(tmp_path):
    """Not ``[1, max_len, D]`` (no batch axis, two of them, or another width): refused naming the shape, not a
    RuntimeError from comparing it with the sinusoid, nor a wrong diagnosis of its base."""
    vocabulary = write_vocabulary(tmp_path / "v.txt")
    pe = their_positions(max_len=100)
    wider = torch.cat([pe, pe[..., :2]], -1)
    for buffer in (pe[0], pe.expand(2, -1, -1).clone(), wider):
        state = {**xtransformer_state(), "decoder.embed_positions.pe": buffer}
        with pytest.raises(ConversionError, match=re.escape(f"has shape {tuple(buffer.shape)}, not [1, max_len, {D}]")):
            convert_xtransformer(save(tmp_path, state), vocabulary)


def test_a_block_width_the_head_width_does_not_divide_is_refused_naming_both(tmp_path):
    """The heads are the block width over SCAtt's hidden-layer input width: a width of 5 for D = 16 leaves no whole
    number of heads, which is named rather than left to the model's constructor."""
    state = xlan_state()
    block = "attention.layers.0.encoder_attn.attn_net.attention_basic.0"
    state[f"{block}.weight"] = torch.zeros(MID, 5)
    with pytest.raises(ConversionError, match=f"block width {D} is not a multiple of the head width 5"):
        convert_xlan(save(tmp_path, state), write_vocabulary(tmp_path / "v.txt"))


class Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_vocabulary_file_is_read_as_checked_text(tmp_path):
    assert read_vocabulary(write_vocabulary(tmp_path / "crlf.txt", end="\r\n")) == WORDS
    assert read_vocabulary(write_vocabulary(tmp_path / "cr.txt", end="\r")) == WORDS  # as Python's text mode reads
    (tmp_path / "spaced.txt").write_text("  a \n\tdog\nUNK\non\ngrass\nred")  # no final newline
    assert read_vocabulary(tmp_path / "spaced.txt") == WORDS
    refused = {"blank.txt": (b"a\ndog\n\non\n", "line 3 is blank"),
               "twice.txt": (b"a\ndog\na\n", "line 3 repeats the word 'a' of line 1"),
               "latin1.txt": ("caf\xe9\n".encode("latin-1"), "not UTF-8"),
               "nul.txt": (b"a\x00b\n", "binary"),
               "control.txt": (b"a\ndo\x07g\n", "non-printable")}
    for name, (data, message) in refused.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ConversionError, match=message):
            read_vocabulary(tmp_path / name)
    # a file past the limit is refused by its size before any of it is read (a sparse file: no disk is used)
    with open(tmp_path / "huge.txt", "wb") as huge:
        huge.truncate(MAX_VOCABULARY_BYTES + 1)
    with pytest.raises(ConversionError, match=f"{MAX_VOCABULARY_BYTES + 1:,} bytes: not a vocabulary file"):
        read_vocabulary(tmp_path / "huge.txt")
    # a well-formed file whose word is one of our special tokens: refused by the remapping, not silently merged
    special = write_vocabulary(tmp_path / "special.txt", ["a", "dog", "<pad>", "on", "grass", "red"])
    with pytest.raises(ConversionError, match="special tokens"):
        convert_xlan(save(tmp_path, xlan_state()), special)
    # a pickle passed as the vocabulary is text at best and is never unpickled: nothing it names runs
    marker = tmp_path / "pwned"
    for protocol in (0, 2):
        (tmp_path / "evil.txt").write_bytes(pickle.dumps(Exploit(str(marker)), protocol=protocol))
        with pytest.raises(ConversionError):
            convert_xlan(save(tmp_path, xlan_state()), tmp_path / "evil.txt")
    assert not marker.exists()


def test_a_vocabulary_of_cocos_size_reads_and_the_size_limit_binds_only_past_it(tmp_path, monkeypatch):
    """COCO's vocabulary file is about 70 kB (10,000 words): read in full. The limit itself refuses a file one byte
    past it and reads one of exactly its size (set small here, so no 16 MiB file is written)."""
    coco = [f"word{index}" for index in range(10_000)]
    assert read_vocabulary(write_vocabulary(tmp_path / "coco.txt", coco)) == coco
    monkeypatch.setattr(xlan_module, "MAX_VOCABULARY_BYTES", 12)
    (tmp_path / "at.txt").write_bytes(b"a\ndog\nred\nx\n")  # 12 bytes
    assert read_vocabulary(tmp_path / "at.txt") == ["a", "dog", "red", "x"]
    (tmp_path / "past.txt").write_bytes(b"a\ndog\nred\nxy\n")  # 13 bytes
    with pytest.raises(ConversionError, match="is 13 bytes: not a vocabulary file"):
        read_vocabulary(tmp_path / "past.txt")


def test_a_vocabulary_line_refused_for_a_control_character_is_quoted_only_by_its_start(tmp_path):
    """A user who passes another text file as the vocabulary (a tab-separated export on one line, minified JSON with
    tabs) is told which line is wrong and shown its start, not handed a message as large as the file."""
    (tmp_path / "one_line.tsv").write_text("a\tdog\t" + "grass " * 20_000 + "\n", encoding="utf-8")
    quoted = re.escape(repr("a\tdog\tgrass"))[:-1]  # the line's start, as the message quotes it
    with pytest.raises(ConversionError, match=f"line 1 holds a non-printable character: {quoted}") as refused:
        read_vocabulary(tmp_path / "one_line.tsv")
    assert len(str(refused.value)) < 200 + len(str(tmp_path))
