"""``captioner params``: the table equals the hand count of docs/parameters.md for SAT, AoANet, X-LAN and
X-Transformer."""

from pathlib import Path

import pytest
import torch

from captioner.models.evaluation import params
from captioner.models.evaluation.params import PAPER_SIZES, count_parameters, parameter_table
from captioner.models.zoo import available, options

DOC = Path(__file__).resolve().parents[1] / "docs" / "parameters.md"


def linear(n_in: int, n_out: int, bias: bool = True) -> int:
    return n_in * n_out + (n_out if bias else 0)


def lstm_cell(n_in: int, hidden: int) -> int:
    return 4 * hidden * n_in + 4 * hidden * hidden + 2 * 4 * hidden  # W_ih, W_hh and PyTorch's two bias vectors


def sat_by_hand(vocab: int, feat: int = 512, m: int = 512, n: int = 1024, attn: int = 512) -> int:
    """SAT Eq. 1–7 at the sizes of docs/decisions.md#sat-sizes, layer by layer."""
    return (vocab * m  # E
            + 2 * linear(feat, n)  # f_init,h and f_init,c
            + linear(feat, attn, bias=False) + linear(n, attn) + linear(attn, 1)  # U_a, U_h + b_e, w_e
            + linear(n, 1)  # β gate
            + lstm_cell(m + feat, n)
            + linear(n, m) + linear(feat, m) + linear(m, vocab))  # L_h, L_z, L_o


def aoanet_by_hand(vocab: int, feat: int = 2048, d: int = 1024, e: int = 1024, layers: int = 6) -> int:
    """AoANet §3.2 at D = E = 1024, layer by layer."""
    aoa = linear(2 * d, 2 * d)  # [v̂; q] → [i; g_pre] (Eq. 3–4)
    refiner_layer = 3 * linear(d, d, bias=False) + aoa + 2 * d  # W^{Q,K,V}_e, AoA^E, LayerNorm γ and β (Eq. 7)
    return (linear(feat, d)  # W_r, b_r
            + layers * refiner_layer
            + vocab * e  # W_e
            + lstm_cell(e + d, d)  # Eq. 12–13
            + 3 * linear(d, d, bias=False) + aoa  # W^{Q,K,V}_d and AoA^D (Eq. 14)
            + linear(d, vocab, bias=False))  # W_p (Eq. 11)


def xlinear_block(query: int, memory: int, bilinear: int, channel: int, heads: int) -> int:
    """X-LAN Eq. 2–6: the embeddings W_k, W^k_q, W_v, W^v_q and the per-head W^k_B, W_b, W_e shared by the heads."""
    d, c = bilinear // heads, channel // heads
    return 2 * linear(query, bilinear) + 2 * linear(memory, bilinear) + linear(d, c) + linear(c, 1) + linear(c, d)


def xlan_by_hand(vocab: int, feat: int = 2048, d: int = 1024, n: int = 1024, e: int = 1024, channel: int = 512,
                 heads: int = 8, layers: int = 4) -> int:
    """X-LAN §3.3 at the paper's sizes, keys and values updated together
    (docs/decisions.md#x-lan-key-and-value-update)."""
    update = linear(2 * d, d) + 2 * d  # W_m and LayerNorm (Eq. 8)
    return (linear(feat, d)  # W_r, b_r
            + layers * (xlinear_block(d, d, d, channel, heads) + update)  # Eq. 7–8
            + linear((layers + 1) * d, d) + 2 * d  # W_G and LayerNorm (Eq. 10)
            + vocab * e  # E
            + lstm_cell(e + d + n, n)  # input [E w_t; ṽ; c_{t−1}] (docs/decisions.md#x-lan-lstm-input)
            + xlinear_block(n, d, d, channel, heads)  # decoder block queried by h_t
            + linear(d + n, 2 * n)  # W_c, b_c before the GLU
            + linear(n, vocab))  # W_p


def xtransformer_by_hand(vocab: int, feat: int = 2048, d: int = 768, channel: int = 384, heads: int = 8,
                         encoder: int = 6, decoder: int = 6, ffn: int = 3072) -> int:
    """The authors' X-Transformer (docs/decisions.md#x-transformer-architecture) at its reference sizes."""
    norm, block = 2 * d, xlinear_block(d, d, d, channel, heads)
    update, feed_forward = linear(2 * d, d) + norm, linear(d, ffn) + linear(ffn, d) + norm
    return (linear(feat, d) + norm  # region embedding with LayerNorm
            + encoder * (block + update + feed_forward)
            + linear((encoder + 1) * d, d) + norm  # W_G and LayerNorm
            + vocab * d + norm  # word embedding and its LayerNorm
            + 2 * (linear(d, d) + norm)  # W_1, W_2 of the first query
            + decoder * (2 * block + 2 * norm)  # word and cross attention, their LayerNorms
            + (decoder - 1) * (update + feed_forward)  # the last layer's word states feed nothing
            + linear((decoder + 1) * d, 2 * d) + norm  # W_o before the GLU, LayerNorm
            + linear(d, vocab))  # W_p


@pytest.mark.parametrize("vocab", [10369, 57])
def test_table_equals_hand_count(vocab):
    table = parameter_table(vocab)
    assert table["sat"] == sat_by_hand(vocab)
    assert table["aoanet"] == aoanet_by_hand(vocab)
    assert table["xlan"] == xlan_by_hand(vocab)
    assert table["xtransformer"] == xtransformer_by_hand(vocab)


@pytest.mark.parametrize("name", ["sat", "sat-hard", "aoanet", "sparsecap", "xlan", "xtransformer"])
def test_a_model_built_with_no_options_has_the_sizes_the_table_counts(name):
    """``captioner train --model NAME`` (or ``--recipe NAME``, whose recipes name no sizes) with no model options
    builds the sizes the table counts, head counts included though they add no parameters; the table passes every
    size, so only this holds the defaults (the area Transformer's are a smaller model, docs/decisions.md)."""
    sizes = {key: size for key, size in PAPER_SIZES[name].items() if key != "feat_dim"}
    defaults = options(name)
    assert {key: defaults[key] for key in sizes} == sizes


def test_table_lists_registered_models_with_paper_sizes_only():
    table = parameter_table(100)
    assert set(table) == {name for name, sizes in PAPER_SIZES.items() if sizes is not None} & set(available())
    assert all(count > 0 for count in table.values())


def test_document_shows_the_command_output():
    text = DOC.read_text()
    for name, count in parameter_table(10369).items():
        if name in ("sat", "aoanet", "xlan", "xtransformer"):
            assert f"{name:16s} {count:>14,d}" in text  # the exact line `captioner params` prints


def test_document_lists_every_model_in_table_order_as_the_command_prints_it():
    """The hand counts cover four models; the document's block is the command's whole output, the other three
    models' rows (SAT-hard, SparseCap, the area Transformer) and the order included."""
    text = DOC.read_text()
    block = text[text.index("$ captioner params\n") + len("$ captioner params\n"):]
    block = block[:block.index("```")]
    assert block == "".join(f"{name:16s} {count:>14,d}\n" for name, count in parameter_table(10369).items())


def test_a_shared_tensor_and_a_frozen_one_are_each_counted_once():
    shared = torch.nn.Linear(3, 4)  # 16 parameters
    frozen = torch.nn.Linear(2, 1)  # 3
    frozen.requires_grad_(False)
    assert count_parameters(torch.nn.Sequential(shared, shared, frozen)) == 16 + 3


def test_models_are_built_on_the_meta_device_allocating_no_weights(monkeypatch):
    devices = []
    create = params.create

    def create_and_look(*args, **kwargs):
        model = create(*args, **kwargs)
        devices.extend({p.device.type for p in model.parameters()})
        return model

    monkeypatch.setattr(params, "create", create_and_look)
    assert parameter_table(57) and set(devices) == {"meta"}


def test_an_entry_left_as_none_or_naming_no_registered_model_is_skipped(monkeypatch):
    """Every shipped entry has sizes and a registered model, so the skip was never taken."""
    monkeypatch.setattr(params, "PAPER_SIZES", {"sparsecap": None, "not-a-model": {}, "sat": PAPER_SIZES["sat"]})
    assert list(parameter_table(57)) == ["sat"]
