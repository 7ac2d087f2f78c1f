"""The masked softmax normaliser (models/attention/softmax.py): the softmax of the unmasked items, exact zeros on
masked ones, zeros (not NaN) for a row with nothing unmasked, and gradients that reach only the unmasked scores."""

import torch

from captioner.models.attention.softmax import masked_softmax


def naive(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Row by row: exp of the unmasked scores over their sum, 0 elsewhere."""
    out = torch.zeros_like(scores)
    for row in range(scores.shape[0]):
        kept = mask[row]
        if kept.any():
            e = torch.exp(scores[row, kept] - scores[row, kept].max())
            out[row, kept] = e / e.sum()
    return out


def test_equals_the_naive_softmax_over_unmasked_items_with_exact_zeros_elsewhere():
    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(6, 9, generator=generator, dtype=torch.float64) * 3
    mask = torch.rand(6, 9, generator=generator) > 0.4
    mask[0] = True
    mask[1] = False  # nothing to attend to: zeros, not NaN
    weights = masked_softmax(scores, mask)
    torch.testing.assert_close(weights, naive(scores, mask))
    assert (weights[~mask] == 0).all() and not weights.isnan().any()
    torch.testing.assert_close(weights[2:].sum(-1)[mask[2:].any(-1)], torch.ones(int(mask[2:].any(-1).sum()),
                                                                                  dtype=torch.float64))
    torch.testing.assert_close(masked_softmax(scores), scores.softmax(-1))


def test_gradcheck_and_no_gradient_through_masked_scores():
    scores = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 0, 1, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.autograd.gradcheck(lambda s: masked_softmax(s, mask), (scores,))
    (masked_softmax(scores, mask) * torch.randn(3, 5, dtype=torch.float64)).sum().backward()
    assert (scores.grad[~mask] == 0).all()
    empty = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)  # a padded row of a batch: no NaN leaks back
    (masked_softmax(empty, torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)) * 2.0).sum().backward()
    assert torch.isfinite(empty.grad).all() and (empty.grad[1] == 0).all()


def test_batched_scores_are_normalised_over_their_last_dim_masked_or_not():
    """Attention calls it on ``[B, heads, queries, items]`` scores with a mask broadcast over heads and queries:
    every row of the last dim is the naive softmax of its own unmasked items, whatever the leading dims."""
    generator = torch.Generator().manual_seed(1)
    scores = torch.randn(2, 3, 4, 5, generator=generator, dtype=torch.float64) * 2
    mask = torch.rand(2, 1, 1, 5, generator=generator) > 0.3
    mask[:, ..., 0] = True
    rows = scores.reshape(-1, 5)
    full = torch.ones_like(rows, dtype=torch.bool)
    torch.testing.assert_close(masked_softmax(scores), naive(rows, full).view_as(scores))
    torch.testing.assert_close(masked_softmax(scores, mask), naive(rows, mask.expand_as(scores).reshape(-1, 5))
                               .view_as(scores))
