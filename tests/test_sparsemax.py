"""Sparsemax (SparseCap, arXiv:2002.05556, Eq. 2 / Eq. 15) against brute force, autograd and its closed-form
properties."""

import numpy as np
import pytest
import torch

from captioner.models.attention import NORMALISERS, get_normaliser
from captioner.models.attention.sparsemax import sparsemax, sparsemax_threshold


def _bisection_sparsemax(z: np.ndarray) -> np.ndarray:
    """Brute force: τ solves Σ_i max(z_i − τ, 0) = 1, found by bisection on [max z − 1, max z]."""
    lo, hi = z.max() - 1.0, z.max()
    for _ in range(200):
        mid = (lo + hi) / 2
        if np.maximum(z - mid, 0).sum() > 1.0:
            lo = mid
        else:
            hi = mid
    return np.maximum(z - (lo + hi) / 2, 0)


def test_output_lies_on_the_simplex():
    torch.manual_seed(0)
    scores = torch.randn(5, 7, 13) * 3
    probs = sparsemax(scores)
    assert probs.shape == scores.shape
    assert (probs >= 0).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(5, 7))
    assert (probs == 0).any(), "sparsemax of spread-out scores should have exact zeros"


def test_sort_based_equals_bisection_on_tau():
    rng = np.random.default_rng(0)
    for scale in (0.1, 1.0, 10.0):
        z = rng.normal(size=(20, 64)) * scale
        got = sparsemax(torch.tensor(z)).numpy()
        for row in range(20):
            np.testing.assert_allclose(got[row], _bisection_sparsemax(z[row]), atol=1e-12)


def test_threshold_definition():
    z = torch.tensor([[3.0, 1.0, 0.2, -1.0]], dtype=torch.float64)
    # k* = 1 since 1 + 2·1 = 3 is not > 3 + 1; τ = (3 − 1)/1 = 2
    assert sparsemax_threshold(z).item() == pytest.approx(2.0)
    z = torch.tensor([[0.5, 0.4, 0.3, -1.0]], dtype=torch.float64)
    # k* = 3: τ = (1.2 − 1)/3
    assert sparsemax_threshold(z).item() == pytest.approx(0.2 / 3)


def test_matches_entmax_package():
    entmax = pytest.importorskip("entmax")
    torch.manual_seed(1)
    z = torch.randn(30, 64, dtype=torch.float64)
    torch.testing.assert_close(sparsemax(z), entmax.sparsemax(z, dim=-1), atol=1e-12, rtol=0)


def test_gradcheck_without_ties():
    torch.manual_seed(2)
    z = torch.randn(4, 12, dtype=torch.float64)
    # keep every score well away from τ so a finite-difference step never changes the support
    tau = sparsemax_threshold(z)
    z = torch.where((z - tau).abs() < 1e-3, z + 1e-2, z).requires_grad_()
    assert torch.autograd.gradcheck(sparsemax, (z,), eps=1e-6, atol=1e-8)


def test_backward_is_the_closed_form_jacobian():
    torch.manual_seed(3)
    z = torch.randn(16, dtype=torch.float64)
    p = sparsemax(z)
    s = (p > 0).to(z.dtype)
    expected = torch.diag(s) - torch.outer(s, s) / s.sum()  # SparseCap Eq. 15
    jacobian = torch.autograd.functional.jacobian(sparsemax, z)
    torch.testing.assert_close(jacobian, expected, atol=1e-12, rtol=0)
    torch.testing.assert_close(jacobian, jacobian.T)


def test_one_dominant_score_gives_one_hot():
    z = torch.zeros(3, 10)
    z[0, 4], z[1, 0], z[2, 9] = 5.0, 1.0, 100.0  # a lead of ≥ 1 is enough for the whole mass
    expected = torch.zeros(3, 10)
    expected[0, 4] = expected[1, 0] = expected[2, 9] = 1.0
    assert torch.equal(sparsemax(z), expected)


def test_masked_items_get_exact_zeros():
    torch.manual_seed(4)
    z = torch.randn(6, 10, dtype=torch.float64) + 5.0  # large scores: masked ones would win without the mask
    mask = torch.rand(6, 10) > 0.4
    mask[:, 0] = True
    mask[5] = False  # a fully masked row
    p = sparsemax(z, mask)
    assert torch.all(p[~mask] == 0)
    torch.testing.assert_close(p[:5].sum(-1), torch.ones(5, dtype=torch.float64))
    assert torch.all(p[5] == 0)
    for row in range(5):
        torch.testing.assert_close(p[row, mask[row]], sparsemax(z[row, mask[row]]))
    # −inf on masked items (a common convention) must not produce NaN
    p_inf = sparsemax(z.masked_fill(~mask, float("-inf")), mask)
    torch.testing.assert_close(p_inf, p)
    z = z.requires_grad_()
    (sparsemax(z, mask) * torch.randn(6, 10, dtype=torch.float64)).sum().backward()
    assert torch.all(z.grad[~mask] == 0) and torch.isfinite(z.grad).all()


def test_batched_over_leading_dims_and_registered():
    torch.manual_seed(5)
    z = torch.randn(2, 3, 4, 9)
    together = sparsemax(z)
    for index in np.ndindex(2, 3, 4):
        torch.testing.assert_close(together[index], sparsemax(z[index][None])[0])
    assert NORMALISERS["sparsemax"] is sparsemax and get_normaliser("sparsemax") is sparsemax


def test_masked_items_never_enter_the_support_whatever_their_scores_and_the_rows_scales():
    """The masked scores are replaced by a value below every real item's reach, found from each row's own real
    scores: rows of very different scales (one far below zero), batched over leading dims, with masked scores far
    above the real ones, give each row the sparsemax of its real items alone (Martins & Astudillo's bisection)."""
    rng = np.random.default_rng(6)
    z = rng.normal(size=(2, 3, 8)) * np.array([0.3, 4.0, 1.0])[:, None] + np.array([-40.0, 0.0, 25.0])[:, None]
    mask = rng.random(size=(2, 3, 8)) > 0.5
    mask[..., 0] = True
    z = np.where(mask, z, 60.0)  # the masked scores would take all the weight were they ever compared
    p = sparsemax(torch.tensor(z), torch.tensor(mask)).numpy()
    for index in np.ndindex(2, 3):
        expected = np.zeros(8)
        expected[mask[index]] = _bisection_sparsemax(z[index][mask[index]])
        np.testing.assert_allclose(p[index], expected, atol=1e-12)


def test_a_row_with_one_item_in_its_support_passes_no_gradient():
    """A one-hot row (a lead of more than 1, or a single real item under the mask) has ``s`` with one non-zero, so
    SparseCap Eq. 15's ``J = diag(s) − s sᵀ/‖s‖₁`` is zero there: the weight stays 1 whatever the scores do nearby.
    A decoder's attention is often one-hot once trained; the other rows keep their usual Jacobian."""
    z = torch.tensor([[4.0, 0.5, 0.0, -1.0], [0.3, 0.2, 0.1, 0.0], [2.0, 7.0, 1.5, 1.0]], dtype=torch.float64,
                     requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)  # row 2: one real item
    p = sparsemax(z, mask)
    assert torch.equal(p[0], torch.tensor([1.0, 0, 0, 0], dtype=torch.float64)) and p[2, 0] == 1
    grad = torch.randn(3, 4, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    (z_grad,) = torch.autograd.grad(p, z, grad)
    assert torch.equal(z_grad[[0, 2]], torch.zeros(2, 4, dtype=torch.float64))
    s = (p[1] > 0).to(z.dtype)
    torch.testing.assert_close(z_grad[1], s * (grad[1] - (grad[1] * s).sum() / s.sum()), atol=1e-15, rtol=0)
    assert torch.autograd.gradcheck(lambda x: sparsemax(x, mask), (z,), eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("dtype", [torch.long, torch.uint8, torch.float32])
def test_a_zero_one_mask_of_another_dtype_masks_like_the_boolean_one(dtype):
    """``mask`` is read as True = real item whatever its dtype (a 0/1 padding mask is often long or float): taken
    as it comes, ``~mask`` of a long or a byte mask is a bitwise not (1 → -2 or 254, every item still "real") and
    ``masked_fill`` refuses it; the mask is made boolean first, as TVmax's prox does."""
    generator = torch.Generator().manual_seed(8)
    z = torch.randn(4, 7, generator=generator, dtype=torch.float64) + 3.0
    mask = torch.rand(4, 7, generator=generator) > 0.4
    mask[:, 0] = True
    expected = sparsemax(z, mask)
    assert torch.equal(sparsemax(z, mask.to(dtype)), expected)
    z = z.requires_grad_()
    weights = torch.randn(4, 7, generator=generator, dtype=torch.float64)
    (z_grad,) = torch.autograd.grad((sparsemax(z, mask.to(dtype)) * weights).sum(), z)  # the autograd Function's path
    (expected_grad,) = torch.autograd.grad((sparsemax(z, mask) * weights).sum(), z)
    assert torch.equal(z_grad, expected_grad) and torch.all(z_grad[~mask] == 0)


@pytest.mark.parametrize("name", sorted(NORMALISERS))
def test_every_normaliser_gives_the_same_weights_to_a_row_shifted_by_a_constant(name):
    """The additive attention's sigmoid form drops a score term that is the same for every item of a row (the
    ``− Σ_j w_j`` of ``2 w^T σ(…) − Σ_j w_j``, models/layers.py): exact only while every normaliser ignores a
    per-row shift, as softmax, sparsemax and TVmax do. A normaliser that did not would need that term back."""
    torch.manual_seed(0)
    scores = torch.randn(3, 16, dtype=torch.float64)
    mask = torch.ones(3, 16, dtype=torch.bool)
    mask[1, -3:] = False
    shift = torch.tensor([[5.0], [-2.5], [0.75]], dtype=torch.float64)
    normalise = get_normaliser(name)
    torch.testing.assert_close(normalise(scores + shift, mask), normalise(scores, mask))
