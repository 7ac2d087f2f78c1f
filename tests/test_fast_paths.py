"""Inference fast paths of the attention layers compute what their plain forms compute: SAT/SparseCap's additive
attention in cache-sized blocks of rows, and AoANet's one-query multi-head attention without per-head copies."""

from __future__ import annotations

import math

import pytest
import torch

from captioner.models.attention import get_normaliser
from captioner.models.attention.multihead import multi_head_attention
from captioner.models.layers import CACHE_BLOCK_FLOATS, AdditiveAttention


@pytest.mark.parametrize("last", [5, 1])
def test_additive_attention_in_blocks_of_rows_equals_the_whole_computation(last):
    torch.manual_seed(0)
    items, attn_dim = 64, 64
    rows = 3 * CACHE_BLOCK_FLOATS // (items * attn_dim) + last  # several blocks and a partial last one (of one row)
    layer = AdditiveAttention(feat_dim=32, query_dim=16, attn_dim=attn_dim, normalise=get_normaliser("softmax"))
    keys = layer.project_keys(torch.randn(rows, items, 32)).detach()
    query, mask = torch.randn(rows, 16), torch.rand(rows, items) > 0.2
    whole = layer(keys, query, mask)  # grad enabled: the plain path
    with torch.inference_mode():
        blocked = layer(keys, query, mask)
    torch.testing.assert_close(blocked, whole.detach(), atol=1e-6, rtol=1e-5)


@pytest.mark.filterwarnings("ignore:`torch.jit.trace:FutureWarning")  # the tracer the ONNX export runs
def test_additive_attention_traced_through_more_rows_than_a_block_runs_on_any_number_of_rows():
    """The ONNX export traces the step under ``no_grad`` on an example of 2 images × 2 beams, more rows than a block
    once items × ``attn_dim`` passes 2¹⁷ (a 20 × 20 grid, 640-pixel images, at ``attn_dim`` 512: blocks of 2 rows).
    Traced through the blocked path, the loop over blocks would freeze the example's block bounds into the graph:
    the export would be refused as unable to run on a new batch size, or serve a graph that fails on more rows."""
    torch.manual_seed(3)
    items, attn_dim = 64, 64
    block = CACHE_BLOCK_FLOATS // (items * attn_dim)
    layer = AdditiveAttention(feat_dim=8, query_dim=8, attn_dim=attn_dim, normalise=get_normaliser("softmax")).eval()

    def step_inputs(rows):
        keys = layer.project_keys(torch.randn(rows, items, 8))
        return keys, torch.randn(rows, 8), torch.ones(rows, items, dtype=torch.bool)

    with torch.no_grad():
        traced = torch.jit.trace(layer, step_inputs(block + 2))
        served = step_inputs(3 * block)
        torch.testing.assert_close(traced(*served), layer(*served))


def test_additive_attention_is_sat_eq_4_with_tanh():
    """The sigmoid form (2σ(2x) − 1 for tanh) computes softmax_i(wᵀ tanh(U_a a_i + U_h h + b) + b_w), item by item."""
    torch.manual_seed(2)
    layer = AdditiveAttention(feat_dim=12, query_dim=8, attn_dim=16, normalise=get_normaliser("softmax"))
    feats, query = torch.randn(3, 7, 12) * 3, torch.randn(3, 8) * 3
    mask = torch.ones(3, 7, dtype=torch.bool)
    got = layer(layer.project_keys(feats), query, mask)
    w, b = layer.score.weight[0], layer.score.bias[0]
    scores = torch.zeros(3, 7)
    for row in range(3):
        for item in range(7):
            hidden = layer.key.weight @ feats[row, item] + layer.query.weight @ query[row] + layer.query.bias
            scores[row, item] = w @ torch.tanh(hidden) + b
    torch.testing.assert_close(got, scores.softmax(-1), atol=1e-6, rtol=1e-5)
    assert torch.autograd.gradcheck(lambda f, q: layer.double()(layer.project_keys(f), q, mask),
                                    (feats.double().requires_grad_(), query.double().requires_grad_()))


def test_additive_attention_refuses_an_activation_it_does_not_compute():
    """Only tanh (SAT) and relu (sgrvinod's tutorial) are computed: any other name would be scored in the tanh form
    without a word."""
    with pytest.raises(ValueError, match="activation must be 'tanh' or 'relu', got 'sigmoid'"):
        AdditiveAttention(feat_dim=4, query_dim=4, attn_dim=4, normalise=get_normaliser("softmax"),
                          activation="sigmoid")


def naive_multi_head(query, key, value, heads, mask):
    """softmax(q_h k_hᵀ/√d) v_h per head, concatenated (Vaswani et al.), one row and one head at a time."""
    d = query.shape[-1] // heads
    out = torch.zeros_like(query)
    weights = torch.zeros(query.shape[0], heads, query.shape[1], key.shape[1])
    for b in range(query.shape[0]):
        for h in range(heads):
            part = slice(h * d, (h + 1) * d)
            scores = query[b, :, part] @ key[b, :, part].T / math.sqrt(d)
            scores = scores.masked_fill(~mask[b], float("-inf"))
            weights[b, h] = scores.softmax(-1)
            out[b, :, part] = weights[b, h] @ value[b, :, part]
    return out, weights


def test_one_query_multi_head_attention_equals_the_per_head_computation():
    torch.manual_seed(1)
    batch, items, width, heads = 5, 12, 32, 4
    query, key, value = torch.randn(batch, 1, width), torch.randn(batch, items, width), torch.randn(batch, items, width)
    mask = torch.rand(batch, items) > 0.3
    mask[:, 0] = True
    got, got_weights = multi_head_attention(query, key, value, heads, mask)
    want, want_weights = naive_multi_head(query, key, value, heads, mask)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_weights, want_weights, atol=1e-6, rtol=1e-5)
    assert float(got_weights.masked_select(~mask[:, None, None, :]).abs().max()) == 0.0


def test_weight_dropout_mixes_the_values_but_the_returned_weights_are_the_softmax():
    """What is exported (AoANet's heatmaps) is the attention itself; dropout acts on the weighted sum only."""
    torch.manual_seed(1)
    query, key = torch.randn(2, 1, 8), torch.randn(2, 5, 8)
    attended, weights = multi_head_attention(query, key, key, 2, weight_dropout=torch.zeros_like)
    assert float(attended.abs().max()) == 0.0
    torch.testing.assert_close(weights, multi_head_attention(query, key, key, 2)[1])


def test_a_width_the_heads_do_not_divide_is_a_value_error_naming_both():
    """AoANet's constructor does not check ``d_model % heads``: its refiner's first call is where such a model is
    refused, with a ValueError naming both (without the check, unflatten's RuntimeError named neither)."""
    query = torch.randn(2, 1, 16)
    with pytest.raises(ValueError, match="width 16 is not divisible by 3 heads"):
        multi_head_attention(query, query, query, 3)
