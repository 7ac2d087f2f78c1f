"""Area attention (Li et al. 2019, arXiv:1810.10126): area enumeration, summed-area tables against naive loops,
masking, causal 1D areas, the area→cell attribution, and the module against the paper's equations."""

import math

import pytest
import torch
from torch import nn

from captioner.models.attention.area import (AreaMultiHeadAttention, area_count_1d, area_count_2d, area_features_1d,
                                   area_features_2d, area_mask, area_sums, areas_to_cells, causal_area_mask,
                                   enumerate_areas_1d, enumerate_areas_2d)

# tiny tensors gain nothing from a second thread, and on a busy machine waiting for it dominates
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _naive_features(x, boxes, cols):
    """Mean, std (no eps), sum of every area by an explicit loop over its cells."""
    means, stds, sums = [], [], []
    for r1, c1, r2, c2 in boxes.tolist():
        cells = [r * cols + c for r in range(r1, r2 + 1) for c in range(c1, c2 + 1)]
        items = x[..., cells, :]
        means.append(items.mean(-2))
        stds.append(items.std(-2, unbiased=False))
        sums.append(items.sum(-2))
    return torch.stack(means, -2), torch.stack(stds, -2), torch.stack(sums, -2)


def test_area_counts_follow_the_paper_formulas():
    assert area_count_1d(4, 3) == len(enumerate_areas_1d(4, 3)) == 9  # Area attention Fig. 1
    assert area_count_2d(3, 3, 2, 2) == len(enumerate_areas_2d(3, 3, 2, 2)) == 25  # Area attention Fig. 2
    # the captioner's 8×8 grid (§2 formula): 15·15 and 21·21
    assert [len(enumerate_areas_2d(8, 8, m, m)) for m in (1, 2, 3, 4)] == [64, 225, 441, 26 * 26]
    for rows, cols, h, w in [(8, 8, 3, 2), (5, 7, 2, 4), (1, 9, 1, 5), (3, 2, 5, 5), (6, 1, 3, 1)]:
        assert len(enumerate_areas_2d(rows, cols, h, w)) == area_count_2d(rows, cols, h, w)


def test_enumeration_is_canonical_and_complete():
    rows, cols = 4, 5
    boxes = enumerate_areas_2d(rows, cols, 2, 3)
    assert boxes.dtype == torch.long and boxes.shape[1] == 4
    heights, widths = boxes[:, 2] - boxes[:, 0] + 1, boxes[:, 3] - boxes[:, 1] + 1
    expected = [(r, c, r + h - 1, c + w - 1) for h in (1, 2) for w in (1, 2, 3)
                for r in range(rows - h + 1) for c in range(cols - w + 1)]
    assert [tuple(b) for b in boxes.tolist()] == expected  # height outer, width inner, corners row-major
    assert heights.max() == 2 and widths.max() == 3 and boxes.min() >= 0
    assert (boxes[:, 2] < rows).all() and (boxes[:, 3] < cols).all()
    assert enumerate_areas_1d(4, 2).tolist() == [[0, 0], [1, 1], [2, 2], [3, 3], [0, 1], [1, 2], [2, 3]]


@pytest.mark.parametrize("rows,cols,max_h,max_w", [(5, 6, 3, 2), (8, 8, 3, 3), (1, 9, 1, 4), (3, 4, 6, 6)])
def test_summed_area_tables_equal_naive_loop(rows, cols, max_h, max_w):
    x = torch.randn(2, 3, rows * cols, 5, dtype=torch.float64) + 4.0  # an offset makes E[x²] − μ² cancel
    mean, std, total, sizes = area_features_2d(x, rows, cols, max_h, max_w, eps=0.0)
    boxes = enumerate_areas_2d(rows, cols, max_h, max_w)
    naive_mean, naive_std, naive_sum = _naive_features(x, boxes, cols)
    torch.testing.assert_close(total, naive_sum)
    torch.testing.assert_close(mean, naive_mean)
    torch.testing.assert_close(std, naive_std)
    torch.testing.assert_close(area_sums(x, rows, cols, max_h, max_w), naive_sum)
    assert sizes.tolist() == (boxes[:, 2:] - boxes[:, :2] + 1).tolist()


def test_float32_std_is_accurate_and_single_items_have_none():
    x = torch.randn(2, 64, 8) * 3 + 10
    mean, std, total, sizes = area_features_2d(x, 8, 8, 3, 3)
    _, naive_std, naive_sum = _naive_features(x.double(), enumerate_areas_2d(8, 8, 3, 3), 8)
    torch.testing.assert_close(std.double(), torch.sqrt(naive_std ** 2 + 1e-6), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(total.double(), naive_sum, atol=1e-4, rtol=1e-5)
    single = (sizes[:, 0] * sizes[:, 1]) == 1
    assert torch.all(std[:, single] == math.sqrt(1e-6))
    seq_mean, seq_std, _, seq_sizes = area_features_1d(x, 3)
    assert seq_mean.shape == (2, area_count_1d(64, 3), 8) and seq_sizes[:, 0].eq(1).all()


def test_a_sequences_features_are_its_one_row_grids_with_the_same_default_guard():
    """area_features_1d is area_features_2d of the ``1 × L`` grid with ``1 × S`` areas, default ε = 1e-6
    (tensor2tensor's guard) included: a lone item's σ is √ε, as on a grid, whichever function a caller takes it from."""
    x = torch.randn(2, 10, 4)
    for got, expected in zip(area_features_1d(x, 3), area_features_2d(x, 1, 10, 1, 3)):
        assert torch.equal(got, expected)
    assert torch.all(area_features_1d(x, 3)[1][:, :10] == math.sqrt(1e-6))  # the first ten areas are single items


def test_equal_items_have_no_spread_and_no_nan_without_the_guard():
    """σ = sqrt(|E[x²] − μ²| + ε) (Eq. 12 with tensor2tensor's absolute value): over equal items E[x²] − μ² can
    round below zero (here, spans of 0.1 after a first item of 0), and with ``eps=0`` (the plain formula) its square
    root would be NaN."""
    x = torch.tensor([0.0] + [0.1] * 6, dtype=torch.float64).view(1, 7, 1)
    std = area_features_1d(x, 3, eps=0.0)[1][0, :, 0]
    equal = enumerate_areas_1d(7, 3)[:, 0] >= 1
    assert torch.isfinite(std).all() and torch.all(std[equal] < 1e-8)


def test_area_features_gradcheck():
    x = torch.randn(1, 12, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda v: area_features_2d(v, 3, 4, 2, 3)[:3], (x,))


def _copy_to_torch_mha(area_attn, d_model, heads):
    mha = nn.MultiheadAttention(d_model, heads, batch_first=True).double()
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.cat([area_attn.q.weight, area_attn.k.weight, area_attn.v.weight]))
        mha.in_proj_bias.copy_(torch.cat([area_attn.q.bias, area_attn.k.bias, area_attn.v.bias]))
        mha.out_proj.weight.copy_(area_attn.o.weight)
        mha.out_proj.bias.copy_(area_attn.o.bias)
    return mha


def test_max_area_1x1_is_ordinary_multi_head_attention():
    attn = AreaMultiHeadAttention(16, 4, (1, 1)).double()
    mha = _copy_to_torch_mha(attn, 16, 4)
    query, memory = torch.randn(2, 5, 16, dtype=torch.float64), torch.randn(2, 12, 16, dtype=torch.float64)
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, 7:] = False
    out, weights = attn(query, memory, (3, 4), mask)
    ref, ref_weights = mha(query, memory, memory, key_padding_mask=~mask, average_attn_weights=False)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(weights, ref_weights)
    causal_out, _ = attn(memory, memory, causal=True)
    ref_causal, _ = mha(memory, memory, memory, attn_mask=~torch.ones(12, 12, dtype=torch.bool).tril())
    torch.testing.assert_close(causal_out, ref_causal)
    # the summed-area path itself, at 1×1, also gives back the items
    mean, _, total, _ = area_features_2d(memory, 3, 4, 1, 1)
    torch.testing.assert_close(mean, memory)
    torch.testing.assert_close(total, memory)
    assert torch.equal(area_mask(mask, 3, 4, 1, 1), mask)


def test_the_default_module_is_ordinary_multi_head_attention():
    """``AreaMultiHeadAttention(d_model, heads)`` of a library user attends over single items with mean keys: every
    model of the zoo passes its own area and key mode, so only this test holds the defaults."""
    attn = AreaMultiHeadAttention(16, 4).double()
    assert attn.max_area == (1, 1) and attn.key_mode == "mean" and not attn.uses_areas
    query, memory = torch.randn(2, 5, 16, dtype=torch.float64), torch.randn(2, 12, 16, dtype=torch.float64)
    ref, _ = _copy_to_torch_mha(attn, 16, 4)(query, memory, memory)
    torch.testing.assert_close(attn(query, memory)[0], ref)


def test_mean_area_attention_matches_eq_1_to_4():
    rows, cols, heads, d_model = 3, 4, 2, 8
    attn = AreaMultiHeadAttention(d_model, heads, (2, 3)).double()
    query, memory = torch.randn(2, 3, d_model, dtype=torch.float64), torch.randn(2, 12, d_model, dtype=torch.float64)
    out, weights = attn(query, memory, (rows, cols))
    boxes = enumerate_areas_2d(rows, cols, 2, 3)
    d = d_model // heads
    q = attn.q(query).view(2, 3, heads, d)
    k, v = attn.k(memory).view(2, 12, heads, d), attn.v(memory).view(2, 12, heads, d)
    heads_out = []
    for h in range(heads):
        mu, _, _ = _naive_features(k[:, :, h], boxes, cols)  # Eq. 3
        _, _, v_area = _naive_features(v[:, :, h], boxes, cols)  # Eq. 4
        a = (q[:, :, h] @ mu.transpose(1, 2) / math.sqrt(d)).softmax(-1)  # Eq. 1
        torch.testing.assert_close(weights[:, h], a)
        heads_out.append(a @ v_area)  # Eq. 2
    torch.testing.assert_close(out, attn.o(torch.cat(heads_out, -1)))


def test_combined_key_is_eq_9():
    attn = AreaMultiHeadAttention(8, 2, (2, 2), key_mode="combined").double()
    memory = torch.randn(1, 9, 8, dtype=torch.float64)
    area_k, _, _ = attn.memory_areas(attn.k(memory), attn.v(memory), (3, 3))
    boxes = enumerate_areas_2d(3, 3, 2, 2)
    comb = attn.combiner
    # S_e = d/2 (docs/decisions.md#area-key-network)
    assert comb.height.weight.shape == (2, 2) and comb.width.weight.shape == (2, 2)
    k = attn.k(memory).view(1, 9, 2, 4)
    for h in range(2):  # one MLP shared by the heads
        mu, sigma, _ = _naive_features(k[:, :, h], boxes, 3)
        sigma = torch.sqrt(sigma ** 2 + 1e-6)
        e = torch.cat([comb.height.weight[boxes[:, 2] - boxes[:, 0]], comb.width.weight[boxes[:, 3] - boxes[:, 1]]], -1)
        w_mu, w_sigma, w_e = comb.hidden.weight.split([4, 4, 4], 1)
        hidden = torch.relu(mu @ w_mu.T + sigma @ w_sigma.T + e @ w_e.T + comb.hidden.bias)
        torch.testing.assert_close(area_k[:, h], hidden @ comb.out.weight.T + comb.out.bias, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("d_model,heads,depth", [(6, 2, 1), (4, 2, 1), (2, 2, 1), (16, 2, 4)])
def test_combined_key_size_embeddings_are_half_the_head_size_and_at_least_one(d_model, heads, depth):
    # tensor2tensor's S_e = d // 2 (docs/decisions.md#area-key-network), kept at 1 for a head of one dimension
    comb = AreaMultiHeadAttention(d_model, heads, (2, 3), key_mode="combined").combiner
    assert comb.height.weight.shape == (2, depth) and comb.width.weight.shape == (3, depth)


def test_area_to_cell_coefficients():
    rows, cols = 4, 5
    boxes = enumerate_areas_2d(rows, cols, 3, 2)
    a = torch.rand(3, len(boxes), dtype=torch.float64).softmax(-1)
    c = areas_to_cells(a, boxes, rows * cols)
    size = ((boxes[:, 2] - boxes[:, 0] + 1) * (boxes[:, 3] - boxes[:, 1] + 1)).double()
    torch.testing.assert_close(c.sum(-1), (a * size).sum(-1))  # Σ_j c_j = Σ_r a_r |r|
    naive = torch.zeros(3, rows * cols, dtype=torch.float64)
    for r, (r1, c1, r2, c2) in enumerate(boxes.tolist()):
        for i in range(r1, r2 + 1):
            for j in range(c1, c2 + 1):
                naive[:, i * cols + j] += a[:, r]
    torch.testing.assert_close(c, naive)
    torch.testing.assert_close(areas_to_cells(a, boxes, (rows, cols)), naive)
    # with sum values the attention output is exactly Σ_j c_j v_j
    values = torch.randn(3, rows * cols, 6, dtype=torch.float64)
    torch.testing.assert_close((a.unsqueeze(1) @ area_sums(values, rows, cols, 3, 2)).squeeze(1),
                               (c.unsqueeze(1) @ values).squeeze(1))
    torch.testing.assert_close(areas_to_cells(a, boxes, rows * cols, value_mode="mean").sum(-1), a.sum(-1))


def test_causal_1d_areas_never_include_future_positions():
    length, span = 7, 3
    allowed = causal_area_mask(length, span)
    spans = enumerate_areas_1d(length, span)
    for t in range(length):
        assert allowed[t].tolist() == (spans[:, 1] <= t).tolist()
    # and through the module: changing the future never changes the past, with mean or combined keys
    for mode in ("mean", "combined"):
        attn = AreaMultiHeadAttention(8, 2, (1, span), key_mode=mode).double()
        x = torch.randn(2, length, 8, dtype=torch.float64)
        out, weights = attn(x, x, causal=True)
        changed = x.clone()
        changed[:, 4:] = torch.randn(2, length - 4, 8, dtype=torch.float64)
        torch.testing.assert_close(attn(changed, changed, causal=True)[0][:, :4], out[:, :4])
        assert torch.all(weights[:, :, ~allowed] == 0)


def test_causal_areas_of_a_padded_memory_are_both_past_and_real():
    """With ``causal`` and a ``key_mask`` together, an area is used only if it holds no later position *and* no
    padded item: either mask alone would let a query see the future or the padding."""
    length, span = 6, 3
    attn = AreaMultiHeadAttention(8, 2, (1, span)).double()
    x = torch.randn(2, length, 8, dtype=torch.float64)
    mask = torch.ones(2, length, dtype=torch.bool)
    mask[1, 4:] = False
    _, weights = attn(x, x, key_mask=mask, causal=True)
    allowed = causal_area_mask(length, span) & area_mask(mask, 1, length, 1, span).unsqueeze(1)  # [B, T, |R|]
    assert torch.all(weights.masked_select(~allowed.unsqueeze(1)) == 0)
    assert torch.all(weights.masked_select(allowed.unsqueeze(1)) > 0)


def test_areas_holding_a_masked_item_get_zero_weight():
    rows, cols = 4, 4
    attn = AreaMultiHeadAttention(8, 2, (2, 3), key_mode="combined")
    memory, query = torch.randn(2, 16, 8), torch.randn(2, 3, 8)
    mask = torch.ones(2, 16, dtype=torch.bool)
    mask[0, [5, 15]] = False
    mask[1, 8:] = False
    out, weights = attn(query, memory, (rows, cols), mask)
    boxes = enumerate_areas_2d(rows, cols, 2, 3)
    for b in range(2):
        for r, (r1, c1, r2, c2) in enumerate(boxes.tolist()):
            cells = [i * cols + j for i in range(r1, r2 + 1) for j in range(c1, c2 + 1)]
            if not mask[b, cells].all():
                assert torch.all(weights[b, :, :, r] == 0)
            else:
                assert torch.all(weights[b, :, :, r] > 0)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 2, 3))
    noisy = memory.masked_fill(~mask.unsqueeze(-1), 1e3)  # what sits in padded items does not matter
    torch.testing.assert_close(attn(query, noisy, (rows, cols), mask)[0], out)
    # a query with nothing left to attend to gets zeros, not NaN
    nothing = torch.zeros(1, 16, dtype=torch.bool)
    empty_out, empty_w = attn(query[:1], memory[:1], (rows, cols), nothing)
    assert torch.all(empty_w == 0) and torch.isfinite(empty_out).all()


def test_attending_per_image_equals_copying_the_areas_to_every_caption():
    """attend_rows (the captions of an image as one query sequence) against the area keys/values indexed by row;
    uneven captions per image, one image without any, and a masked cell."""
    attn = AreaMultiHeadAttention(16, 4, (2, 2), "combined").double()
    memory = torch.randn(3, 12, 16, dtype=torch.float64)
    key_mask = torch.ones(3, 12, dtype=torch.bool)
    key_mask[2, 5] = False
    area_k, area_v, allowed = attn.memory_areas(attn.k(memory), attn.v(memory), (3, 4), key_mask)
    rows = torch.tensor([2, 0, 2, 2, 0])  # image 1 has no caption
    query = torch.randn(5, 4, 16, dtype=torch.float64)
    expected, _ = attn.attend(query, area_k[rows], area_v[rows], allowed[rows])
    torch.testing.assert_close(attn.attend_rows(query, area_k, area_v, allowed, rows), expected)


@pytest.mark.parametrize("rows,cols,max_h,max_w", [(0, 4, 1, 1), (3, 0, 1, 2), (3, 4, 0, 2), (3, 4, 2, 0)])
def test_an_empty_grid_or_maximum_area_is_refused_by_name(rows, cols, max_h, max_w):
    # a zero size enumerates no area at all: the caller hears which sizes are wrong, not that a list was empty
    with pytest.raises(ValueError, match="must all be positive"):
        enumerate_areas_2d(rows, cols, max_h, max_w)
    with pytest.raises(ValueError, match="must all be positive"):
        area_sums(torch.zeros(2, rows * cols, 3), rows, cols, max_h, max_w)


def test_a_memory_of_another_item_count_than_the_grid_is_refused_by_name():
    # 15 items unflatten into 3 rows as well as 12 do: without the check they would be summed as a 3×5 grid
    with pytest.raises(ValueError, match="memory has 15 items, not a 3×4 grid"):
        area_sums(torch.zeros(2, 15, 3), 3, 4, 2, 2)


def test_cells_that_do_not_fill_the_grid_the_boxes_span_are_refused_by_name():
    boxes = enumerate_areas_2d(4, 5, 2, 2)
    with pytest.raises(ValueError, match="21 cells do not form a grid 5 wide"):
        areas_to_cells(torch.rand(1, len(boxes)), boxes, 21)


def test_the_causal_mask_is_made_on_the_device_asked_for():
    # the meta device stands in for a GPU: a mask left on the CPU would meet cuda scores in the decoder
    assert causal_area_mask(5, 2, device="meta").device.type == "meta"


def test_a_prefix_of_a_memory_gets_the_same_spread_to_the_bit_as_its_spans_in_the_whole():
    """σ is taken of the memory minus its first item, which a prefix shares: a decoder's cached steps then see
    exactly what the whole caption's pass sees (centring on the mean would move with the length)."""
    x = torch.randn(2, 7, 16, dtype=torch.float64) * 0.01 + 50.0  # a large offset: centring shows in the last bits

    def spreads(memory, length):
        std = area_features_1d(memory, 3)[1]
        return {tuple(span): std[..., i, :] for i, span in enumerate(enumerate_areas_1d(length, 3).tolist())}

    whole, prefix = spreads(x, 7), spreads(x[:, :4], 4)
    assert all(torch.equal(whole[span], prefix[span]) for span in prefix)


def test_items_sharing_a_large_offset_keep_their_spread():
    """σ is taken of the items minus the first one (area_features_2d's docstring): with an offset of 10⁴ and a spread
    of 10⁻³, E[x²] − μ² of the raw items loses about a percent of the variance to float64 rounding; centred, the
    spread is exact to the last digits."""
    x = torch.randn(2, 12, 4, dtype=torch.float64) * 1e-3 + 1e4
    std = area_features_2d(x, 3, 4, 2, 2, eps=0.0)[1]
    _, naive_std, _ = _naive_features(x - 1e4, enumerate_areas_2d(3, 4, 2, 2), 4)
    torch.testing.assert_close(std, naive_std, rtol=1e-6, atol=0)


def test_an_unknown_value_mode_is_refused_by_name():
    # a typo such as "means" must not give the sum coefficients in silence
    boxes = enumerate_areas_2d(2, 2, 1, 2)
    with pytest.raises(ValueError, match="unknown value mode 'means'"):
        areas_to_cells(torch.rand(1, len(boxes)), boxes, (2, 2), value_mode="means")


def test_a_module_of_an_unknown_key_mode_or_an_uneven_head_width_is_refused_by_name():
    # an unknown key mode would otherwise build mean keys in silence (no combiner), and 10 dimensions over 3 heads
    # would fail only at the first forward, in a reshape
    with pytest.raises(ValueError, match="unknown area key mode 'concat'"):
        AreaMultiHeadAttention(8, 2, (2, 2), key_mode="concat")
    with pytest.raises(ValueError, match="d_model 10 is not divisible by 3 heads"):
        AreaMultiHeadAttention(10, 3)


def test_causal_attention_over_a_2d_memory_or_misaligned_queries_is_refused():
    """``causal`` is defined for a 1D memory whose positions are the queries': over a grid, or with fewer queries than
    items, the span mask would compare areas with the wrong positions."""
    attn = AreaMultiHeadAttention(8, 2, (1, 2)).double()
    memory = torch.randn(1, 6, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="causal area attention needs a 1D memory"):
        attn(memory, memory, (2, 3), causal=True)
    with pytest.raises(ValueError, match="causal area attention needs a 1D memory"):
        attn(memory[:, :4], memory, causal=True)


def test_padded_items_may_hold_anything_even_nan():
    """Padded items are zeroed before any area sum (memory_areas), so what they hold reaches no real area: not even
    a NaN (uninitialised padding), which a zero weight would not cancel (0·NaN = NaN), nor one in a padded first
    item, on which σ is centred."""
    attn = AreaMultiHeadAttention(8, 2, (2, 3), key_mode="combined")
    memory, query = torch.randn(2, 16, 8), torch.randn(2, 3, 8)
    mask = torch.ones(2, 16, dtype=torch.bool)
    mask[0, [0, 5]] = False
    mask[1, 8:] = False
    out, weights = attn(query, memory, (4, 4), mask)
    got, got_weights = attn(query, memory.masked_fill(~mask.unsqueeze(-1), float("nan")), (4, 4), mask)
    torch.testing.assert_close(got, out)
    torch.testing.assert_close(got_weights, weights)
