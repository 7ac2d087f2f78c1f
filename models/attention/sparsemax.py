"""Sparsemax (Martins & Astudillo, 2016, arXiv:1602.02068): Euclidean projection of the scores onto the simplex.

SparseCap (Martins et al., "Sparse and Structured Visual Attention", arXiv:2002.05556) Eq. 2 / Eq. 14:
``sparsemax(z) = argmin_{p ∈ Δ} ½‖p − z‖²``.  The forward pass is the exact sort-based algorithm of Martins &
Astudillo (2016, Algorithm 1), which SparseCap §2.1 cites, and the backward pass is the closed form of SparseCap Eq. 15,
``J = diag(s) − s sᵀ/‖s‖₁`` with ``s = [p > 0]``, applied as ``dz = s ⊙ (dp − mean_{s}(dp))``.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _fill_masked(scores: Tensor, mask: Tensor) -> Tensor:
    """Replace masked scores by a finite value that can never enter the support.

    Every simplex point has ``p_max ≤ 1``, so ``τ ≥ z_max − 1`` and any score ``≤ z_max − 2`` gets exactly zero
    weight.  A finite value (rather than −inf) keeps the sort/cumsum free of inf − inf = NaN.
    """
    lowest = torch.finfo(scores.dtype).min
    real_max = scores.masked_fill(~mask, lowest).amax(-1, keepdim=True)
    real_max = torch.where(real_max == lowest, torch.zeros_like(real_max), real_max)  # fully masked rows
    fill = real_max - 2.0 - real_max.abs()
    return torch.where(mask, scores, fill.expand_as(scores))


def sparsemax_threshold(scores: Tensor) -> Tensor:
    """The threshold τ(z) of sparsemax, ``[..., 1]``, by the sort-based algorithm of Martins & Astudillo (2016).

    With ``z_(1) ≥ … ≥ z_(k)``: ``k* = max{j : 1 + j z_(j) > Σ_{r≤j} z_(r)}`` and
    ``τ = (Σ_{r≤k*} z_(r) − 1) / k*`` (Martins & Astudillo 2016, Alg. 1).
    """
    ordered, _ = scores.sort(dim=-1, descending=True)
    cumulative = ordered.cumsum(-1)
    ranks = torch.arange(1, scores.shape[-1] + 1, device=scores.device, dtype=scores.dtype)
    # the condition holds on a prefix of the sorted order, so counting it gives k*; j = 1 always satisfies it
    support_size = (1.0 + ranks * ordered > cumulative).sum(-1, keepdim=True).clamp_min(1)
    return (cumulative.gather(-1, support_size - 1) - 1.0) / support_size.to(scores.dtype)


def _sparsemax_forward(scores: Tensor, mask: Tensor | None) -> Tensor:
    if mask is not None:
        scores = _fill_masked(scores, mask)
    probs = (scores - sparsemax_threshold(scores)).clamp_min(0.0)
    if mask is not None:
        # exact zeros for masked items, also in fully masked rows (which would otherwise be uniform)
        probs = probs.masked_fill(~mask, 0.0)
    return probs


class SparsemaxFunction(torch.autograd.Function):
    """Sparsemax with the closed-form Jacobian–vector product of SparseCap Eq. 15."""

    @staticmethod
    def forward(ctx, scores: Tensor, mask: Tensor | None) -> Tensor:
        probs = _sparsemax_forward(scores, mask)
        ctx.save_for_backward(probs)
        return probs

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        (probs,) = ctx.saved_tensors
        return sparsemax_backward(probs, grad_output), None


def sparsemax_backward(probs: Tensor, grad_output: Tensor) -> Tensor:
    """``J_spᵀ dp`` (SparseCap Eq. 15; J is symmetric): ``s ⊙ (dp − Σ_{s} dp / ‖s‖₁)``, ``s = [p > 0]``."""
    support = (probs > 0).to(grad_output.dtype)
    size = support.sum(-1, keepdim=True).clamp_min(1.0)  # rows with empty support (all masked) give zero
    mean = (grad_output * support).sum(-1, keepdim=True) / size
    return support * (grad_output - mean)


def sparsemax(scores: Tensor, mask: Tensor | None = None) -> Tensor:
    """``sparsemax(z) = argmin_{p ∈ Δ} ½‖p − z‖²`` over the last dim (SparseCap Eq. 2), batched over leading dims.

    ``mask`` (broadcastable to ``scores``, True = real item) gives exactly zero weight to False items; rows
    with no real item return all zeros.
    """
    if mask is not None:
        mask = mask.to(torch.bool).expand_as(scores)
    if torch.is_grad_enabled() and scores.requires_grad:
        return SparsemaxFunction.apply(scores, mask)
    return _sparsemax_forward(scores, mask)  # no backward to prepare (decoding): no autograd bookkeeping
