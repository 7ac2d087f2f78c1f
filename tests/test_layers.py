"""The small shared layers against their papers' formulas: Vaswani et al.'s sinusoidal positions (§3.5) and the
mean over the real regions that several models start from."""

import math

import torch

from captioner.models.layers import FeedForward, masked_mean, sinusoid_positions


def test_sinusoid_positions_are_sin_on_even_and_cos_on_odd_dimensions_with_base_10000():
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d)); the models' tests build their
    references with this function, so only a check against the formula itself holds the order and the base."""
    dim, positions = 10, [0, 1, 3, 17, 250]
    want = torch.zeros(len(positions), dim)
    for row, pos in enumerate(positions):
        for i in range(dim // 2):
            angle = pos / 10000 ** (2 * i / dim)
            want[row, 2 * i], want[row, 2 * i + 1] = math.sin(angle), math.cos(angle)
    torch.testing.assert_close(sinusoid_positions(torch.tensor(positions), dim), want, atol=1e-5, rtol=1e-5)


def test_sinusoid_positions_of_an_odd_width_end_on_the_last_sine():
    got = sinusoid_positions(torch.tensor([2]), 5)
    torch.testing.assert_close(got[0, 4], torch.tensor(math.sin(2 / 10000 ** (4 / 5))))
    assert got.shape == (1, 5)


def test_masked_mean_is_the_mean_of_the_real_items_and_zero_for_a_row_with_none():
    """A fully masked row (an image with no real region) is a zero vector, not NaN: the divisor is the count of real
    items, kept at least 1 only for that row (a row of one real item is that item)."""
    torch.manual_seed(0)
    feats = torch.randn(4, 4, 6)
    mask = torch.tensor([[True, True, False, False], [True] * 4, [False] * 4, [False, True, False, False]])
    got = masked_mean(feats, mask)
    torch.testing.assert_close(got[0], feats[0, :2].mean(0))
    torch.testing.assert_close(got[1], feats[1].mean(0))
    assert torch.equal(got[2], torch.zeros(6))
    torch.testing.assert_close(got[3], feats[3, 1])


def test_feed_forward_is_linear_relu_dropout_linear():
    """Vaswani et al.'s FFN(x) = max(0, xW₁ + b₁)W₂ + b₂ (Eq. 2), with its dropout on the hidden layer in training:
    the models' tests build it with dropout 0 and compare the models with themselves, so neither the ReLU nor the
    dropout was held."""
    torch.manual_seed(0)
    ffn = FeedForward(d_model=6, ffn_dim=32, dropout=0.5)
    first, second = ffn[0], ffn[3]
    x = torch.randn(5, 6) * 3
    ffn.eval()
    torch.testing.assert_close(ffn(x), second(torch.clamp_min(first(x), 0.0)))
    ffn.train()
    torch.manual_seed(1)
    got = ffn(x)
    torch.manual_seed(1)  # the same draw: each hidden unit kept and scaled by 1 / (1 - p), or zeroed
    kept = torch.nn.functional.dropout(torch.ones(5, 32), 0.5, training=True)
    torch.testing.assert_close(got, second(torch.clamp_min(first(x), 0.0) * kept))
    assert (kept == 0).any()
