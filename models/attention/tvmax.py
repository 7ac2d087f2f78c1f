"""TVmax (Martins et al., P4 Definition 1): sparse attention whose non-zero weights form contiguous 2D patches.

``TVmax(z) = argmin_{p ∈ Δ} ½‖p − z‖² + λ Ω_2D(p)`` (P4 Eq. 5, with the ½ — SPEC decision #32), computed by
Proposition 1 (P4 Eq. 7) as ``sparsemax(prox_{λΩ_2D}(z))``, where ``Ω_2D`` is the anisotropic 2D total
variation of the row-major ``H × W`` grid (P4 Eq. 3 on the 4-neighbour grid graph, each pair counted once).

The 2D TV prox (P4 Eq. 4) has no direct algorithm.  We solve its dual

    min_{|u_e| ≤ λ}  ½‖z − Dᵀu‖²,      w = z − Dᵀu,

(``D`` is the ``E × N`` edge-difference matrix, ``(Dw)_e = w_j − w_i`` for edge ``e = (i, j)``) with FISTA and
gradient-based adaptive restart, batched over every grid of the call, then *polish* the iterate with the
group-wise characterisation of Proposition 2 (P4 Eq. 8): once the fused groups and the signs across their
boundaries are known, the solution is their closed form, and every group is then exactly flat.  Groups are read
off the iterate as connected components of edges whose jump is within tolerance (decision #33: 1e-6 relative to
the max) or whose dual is strictly inside the box (a boundary edge has ``|u*_e| = λ``, P4 Eq. 16).  The polished
point is accepted only with a KKT certificate: a dual ``u`` with ``|u| ≤ λ``, ``u_e = λ sign((Dw)_e)`` across
group boundaries and residual ``r = z − w − Dᵀu`` (the FISTA dual plus a least-norm flow correction inside the
groups).  Such a ``w`` is the *exact* prox of ``z − r``, and the prox is non-expansive, so
``‖w − prox(z)‖₂ ≤ ‖r‖₂``: the tolerance is a proven error bound, not a heuristic.  Why this algorithm rather
than the paper's proximal Dykstra, and measurements: ``docs/tvmax.md``.

The backward pass is P4 Algorithm 1: ``J_TVmax = J_sp(w*) J_TV`` (Prop. 1 chain rule), with the sparsemax
Jacobian of P4 Eq. 15 and ``(J_TV)_ij = 1/|G_i|`` for ``j`` in the fused group ``G_i`` (P4 Eq. 9), using the
certified groups of the forward pass (exactly flat, so "connected components of equal values" without any
tolerance left to choose).  Connected components are computed batched in torch by min-label propagation with
pointer jumping.

All grids of a call are solved together with pure tensor ops (no Python loop over grids, no per-iteration
host synchronisation); the host looks at the data once per ``check_every`` iterations, to stop early and to
drop finished grids from the batch.  Computation is in float64 by default (SPEC decision #31).
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
from torch import Tensor

from .sparsemax import sparsemax

#: SPEC decision #32: λ is the weight of Ω_2D in Eq. 5 *with* the ½ (the paper's value)
DEFAULT_LAMBDA = 0.01
#: SPEC decision #33: neighbours are fused when their values differ by less than this, relative to max |z|
GROUP_TOL = 1e-6


# ---------------------------------------------------------------------------------------------------------------
# grid operators
# ---------------------------------------------------------------------------------------------------------------
def grid_edges(grid_hw: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """Endpoints ``(i, j)`` of the ``E`` grid edges: all horizontal ``(r,c)→(r,c+1)``, then all vertical
    ``(r,c)→(r+1,c)`` (P4 §2.2.1: ``i ∼ j`` iff ``j`` is right of or immediately below ``i``)."""
    h, w = grid_hw
    index = torch.arange(h * w).view(h, w)
    first = torch.cat([index[:, :-1].reshape(-1), index[:-1, :].reshape(-1)])
    second = torch.cat([index[:, 1:].reshape(-1), index[1:, :].reshape(-1)])
    return first, second


@lru_cache(maxsize=32)
def _operators(grid_hw: tuple[int, int], device: torch.device, dtype: torch.dtype):
    """``D`` [E, N], the FISTA iteration matrix ``K = I − D Dᵀ / L`` [E, E], ``L`` and the edge endpoints."""
    h, w = grid_hw
    first, second = grid_edges(grid_hw)
    edges = first.numel()
    diff = torch.zeros(edges, h * w, dtype=torch.float64)
    diff[torch.arange(edges), first] = -1.0
    diff[torch.arange(edges), second] = 1.0

    # L = λ_max(D Dᵀ) = λ_max of the grid Laplacian = sum of the two path Laplacians' largest eigenvalues,
    # 2(1 + cos(π/n)) each; removing edges (masks) only lowers it, so 1/L is always a safe step
    def path_max(n: int) -> float:
        return 2.0 * (1.0 + math.cos(math.pi / n)) if n > 1 else 0.0

    lipschitz = path_max(h) + path_max(w)
    iteration = torch.eye(edges, dtype=torch.float64) - diff @ diff.T / max(lipschitz, 1e-12)
    return (diff.to(device, dtype), iteration.to(device, dtype), lipschitz,
            first.to(device), second.to(device))


def connected_components(fused: Tensor, first: Tensor, second: Tensor, cells: int, check_every: int = 4) -> Tensor:
    """Component label (smallest cell index) of every cell, ``[B, N]`` long, for the graph whose edges
    ``(first[e], second[e])`` are kept where ``fused[b, e]``.

    Min-label propagation across kept edges, followed by pointer jumping (``ℓ ← ℓ[ℓ]``, valid because a label is
    always the index of a cell of the same component and never exceeds the cell's own index), until nothing
    changes.  Pure tensor ops; the host checks for convergence once every ``check_every`` rounds.
    """
    batch = fused.shape[0]
    labels = torch.arange(cells, device=fused.device).expand(batch, cells).contiguous()
    if fused.shape[1] == 0:
        return labels
    sentinel = torch.full_like(fused, cells, dtype=torch.long)
    for round_ in range(cells):  # every round shrinks the diameter a label still has to travel; N is a hard bound
        previous = labels
        a, b = labels[:, first], labels[:, second]
        smaller = torch.where(fused, torch.minimum(a, b), sentinel)
        labels = labels.scatter_reduce(1, first.expand(batch, -1), smaller, reduce="amin")
        labels = labels.scatter_reduce(1, second.expand(batch, -1), smaller, reduce="amin")
        labels = labels.gather(1, labels)
        if round_ % check_every == check_every - 1 and torch.equal(labels, previous):
            break
    return labels


def group_means(values: Tensor, labels: Tensor) -> Tensor:
    """Replace every value by the mean over its group (the action of ``J_TV`` of P4 Eq. 9, which is symmetric).

    Deterministic on every device: the sums are a batched matrix product with the 0/1 membership matrix (no
    atomics), and every cell reads its group's value from the root row, so a group is exactly flat.
    """
    member = (labels.unsqueeze(2) == torch.arange(labels.shape[1], device=labels.device)).to(values.dtype)
    sums = torch.bmm(member.transpose(1, 2), values.unsqueeze(2)).squeeze(2)  # [B, N] indexed by root
    sizes = member.sum(1)
    return (sums / sizes.clamp_min(1.0)).gather(1, labels)


# ---------------------------------------------------------------------------------------------------------------
# the 2D TV prox
# ---------------------------------------------------------------------------------------------------------------
def _polish(z: Tensor, w: Tensor, u: Tensor, bound: Tensor, diff: Tensor, first: Tensor, second: Tensor,
            lam: float, lipschitz: float, fused: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Closed-form solution for the groups and boundary signs read off an approximate ``w`` (P4 Eq. 8), the
    labels of those groups, and a proven bound on the polished point's L2 distance to the exact prox.

    Eq. 8 with our edge orientation: ``w_G = mean_{j ∈ G}(z_j − (Dᵀ(λ s))_j)`` where ``s_e = sign((Dw)_e)`` on edges
    leaving the group and 0 inside it — every boundary edge pulls its cell by ``λ`` towards the neighbour.

    Certificate (KKT of P4 Eq. 16): boundary edges carry ``u_e = λ s_e``; inside the groups we take the FISTA
    dual and add the least-norm flow correction ``D_in ψ`` with ``L_in ψ = r`` (``L_in`` the Laplacian of the
    inside edges, ``r`` the residual, which sums to 0 over every group), so the residual vanishes up to rounding.
    A correction that leaves the box ``|u| ≤ λ`` is clipped back and its size (times ``‖D‖ = √L``) added to the
    bound.  Then ``w`` is the exact prox of a point within that bound of ``z`` and the prox is non-expansive.
    """
    batch, cells = z.shape
    jump = w @ diff.T
    labels = connected_components(fused, first, second, cells)
    # an edge whose two cells are in one group is interior even if its own jump was above the tolerance
    inside = labels[:, first] == labels[:, second]
    signs = torch.where(inside | (bound == 0), torch.zeros_like(jump), torch.sign(jump))
    polished = group_means(z - (lam * signs) @ diff, labels)

    dual = torch.where(inside, u, lam * signs)
    residual = z - polished - dual @ diff
    weight = inside.to(z.dtype)
    adjacency = z.new_zeros(batch, cells, cells)
    adjacency[:, first, second] = weight  # every (i, j) pair is one edge: plain writes, no accumulation
    adjacency[:, second, first] = weight
    member = (labels.unsqueeze(2) == labels.unsqueeze(1)).to(z.dtype)
    # L_in + (projector onto group-constant vectors) is positive definite; r ⊥ those vectors, so ψ solves L_in ψ = r
    system = torch.diag_embed(adjacency.sum(2)) - adjacency + member / member.sum(2, keepdim=True)
    factor, _ = torch.linalg.cholesky_ex(system)  # the _ex variant never synchronises to check for errors
    psi = torch.cholesky_solve(residual.unsqueeze(2), factor).squeeze(2)
    dual = dual + weight * (psi @ diff.T)
    feasible = torch.maximum(torch.minimum(dual, bound), -bound)
    error = (z - polished - dual @ diff).norm(dim=1) + math.sqrt(lipschitz) * (dual - feasible).norm(dim=1)
    consistent = ((polished @ diff.T) * signs >= 0).all(1)  # no boundary may have flipped its sign
    error = torch.where(consistent & torch.isfinite(error), error, torch.full_like(error, float("inf")))
    return polished, labels, error


def _tv2d_solve(z: Tensor, grid_hw: tuple[int, int], lam: float, mask: Tensor | None, tol: float,
                max_iter: int, check_every: int) -> tuple[Tensor, Tensor]:
    """Batched ``prox_{λΩ_2D}`` of ``z`` [B, N] (P4 Eq. 4) → ``(w, labels)``; see the module docstring."""
    batch, cells = z.shape
    diff, iteration, lipschitz, first, second = _operators(tuple(grid_hw), z.device, z.dtype)
    labels_all = torch.arange(cells, device=z.device).expand(batch, cells).clone()
    if lam == 0.0 or first.numel() == 0 or batch == 0:
        return z.clone(), labels_all
    if mask is None:
        bound = torch.full((batch, first.numel()), lam, dtype=z.dtype, device=z.device)
        scale = z.abs().amax(1, keepdim=True)
    else:
        # a masked cell does not exist: drop its edges (their dual is pinned to 0) and ignore its score
        bound = lam * (mask[:, first] & mask[:, second]).to(z.dtype)
        z = torch.where(mask, z, torch.zeros_like(z))
        scale = z.abs().amax(1, keepdim=True)
    # fusion tolerance: decision #33's 1e-6 relative to the max is the cap; below it the tolerance follows the
    # iterate's recent movement, so two truly distinct neighbours closer than the cap are split apart once the
    # iterate is accurate enough (otherwise their wrong merge would fail the certificate forever)
    tol_cap = GROUP_TOL * scale.clamp_min(1e-12)
    eps = torch.finfo(z.dtype).eps
    tol_floor = 500 * eps * scale.clamp_min(1e-12)
    # the certificate bound is absolute below |z| = 1 and relative above it (rounding of r grows with |z|); it
    # cannot be asked below what the dtype resolves (float32 runs get ~1e-4)
    cert_tol = (max(tol, 1e3 * eps) * scale.clamp_min(1.0)).squeeze(1)

    out_w, out_labels = z.clone(), labels_all
    rows = torch.arange(batch, device=z.device)  # grids still being solved
    offset = (z @ diff.T) / lipschitz  # the constant part of the gradient step: u + (D z − D Dᵀ u)/L
    u = torch.zeros_like(bound)
    y = torch.zeros_like(bound)
    since_restart = torch.zeros(batch, 1, dtype=z.dtype, device=z.device)
    previous = z.clone()  # the primal iterate at the previous check
    pattern = torch.full(bound.shape, 3, dtype=torch.int8, device=z.device)  # fused/sign pattern, ditto
    done_iters = 0
    while True:
        lower = -bound
        for _ in range(check_every):
            # projected gradient step on the dual at the extrapolated point (FISTA): a dozen small ops, no sync
            u_next = torch.addmm(offset, y, iteration).clamp_(lower, bound)
            step = u_next - u
            # O'Donoghue & Candès gradient restart: drop a grid's momentum when it points uphill
            restart = y.sub_(u_next).mul_(step).sum(1, keepdim=True) > 0
            since_restart.add_(1.0).masked_fill_(restart, 0.0)
            # momentum k/(k+3) after k steps without restart (Nesterov's t-sequence, asymptotically)
            y = torch.addcmul(u_next, since_restart / (since_restart + 3.0), step)
            u = u_next
        done_iters += check_every
        last = done_iters >= max_iter

        zr = z.index_select(0, rows)
        w = zr - u @ diff
        jump = w @ diff.T
        movement = (w - previous).abs().amax(1, keepdim=True)
        group_tol = torch.minimum(torch.maximum(10.0 * movement, tol_floor.index_select(0, rows)),
                                  tol_cap.index_select(0, rows))
        previous = w
        # an edge is taken as fused when its jump is within tolerance OR its dual is strictly inside the box (an
        # edge between two different groups has |u*_e| = λ, P4 Eq. 16): the dual test finds the groups after a
        # handful of iterations, long before the primal iterate is accurate to 1e-6
        fused = (bound > 0) & ((jump.abs() <= group_tol) | (u.abs() < bound * (1.0 - 4 * eps)))
        new_pattern = torch.where(fused, torch.full_like(pattern, 2), torch.sign(jump).to(torch.int8))
        # polishing costs as much as ~100 batched iterations, so only grids whose groups and boundary signs
        # have not moved since the last check try it
        ready = (new_pattern == pattern).all(1) | last
        pattern = new_pattern
        if not bool(ready.any()):
            continue
        trying = ready.nonzero().squeeze(1)
        polished, labels, error = _polish(zr[trying], w[trying], u[trying], bound[trying], diff, first, second,
                                          lam, lipschitz, fused[trying])
        certified = error <= cert_tol[rows[trying]]
        if last:
            # out of budget: keep whichever point has the smaller proven error bound (the plain FISTA iterate's
            # bound is the duality gap, ‖w − w*‖² ≤ 2·gap by 1-strong convexity of the primal)
            gap = (jump.abs() * (bound - u * torch.sign(jump))).sum(1).clamp_min(0.0)
            keep_polished = error <= (2.0 * gap).sqrt()
            polished = torch.where(keep_polished[:, None], polished, w)
            certified = torch.ones_like(certified)
        if not bool(certified.any()):
            continue
        finished = trying[certified]
        out_w.index_copy_(0, rows[finished], polished[certified])
        out_labels.index_copy_(0, rows[finished], labels[certified])
        if finished.numel() == rows.numel():
            break
        # drop finished grids so the remaining iterations only pay for the hard ones
        running = torch.ones_like(rows, dtype=torch.bool).index_fill_(0, finished, False).nonzero().squeeze(1)
        rows, u, y, since_restart = rows[running], u[running], y[running], since_restart[running]
        previous, pattern, offset, bound = previous[running], pattern[running], offset[running], bound[running]
    return out_w, out_labels


class TV2DProxFunction(torch.autograd.Function):
    """``w* = prox_{λΩ_2D}(z)`` (P4 Eq. 4) with the group-averaging Jacobian of P4 Eq. 9 as backward."""

    @staticmethod
    def forward(ctx, z: Tensor, grid_hw: tuple[int, int], lam: float, mask: Tensor | None, tol: float,
                max_iter: int, check_every: int) -> Tensor:  # type: ignore[override]
        w, labels = _tv2d_solve(z, grid_hw, lam, mask, tol, max_iter, check_every)
        ctx.save_for_backward(labels)
        ctx.mark_non_differentiable(labels)
        return w, labels

    @staticmethod
    def backward(ctx, grad_w: Tensor, _grad_labels: Tensor | None):  # type: ignore[override]
        (labels,) = ctx.saved_tensors
        # J_TV is symmetric (P4 Eq. 9), so J_TVᵀ dw is again "average dw over each fused group"
        return group_means(grad_w, labels), None, None, None, None, None, None


def tv2d_prox(z: Tensor, grid_hw: tuple[int, int], lam: float = DEFAULT_LAMBDA, mask: Tensor | None = None, *,
              tol: float = 1e-9, max_iter: int = 2000, check_every: int = 5,
              return_groups: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """``prox_{λΩ_2D}(z) = argmin_w ½‖w − z‖² + λ Ω_2D(w)`` (P4 Eq. 4) over ``[..., H*W]`` row-major grids.

    Differentiable (backward = group averaging, P4 Eq. 9).  The result is certified to lie within ``tol``
    (L2, times ``max(1, max|z|)``) of the exact prox; fused groups are exactly flat.  With ``return_groups``
    also returns the group label (smallest cell index of the group) of every cell.  Masked cells (False)
    are removed from the grid graph and returned unchanged.
    """
    h, w = grid_hw
    if z.shape[-1] != h * w:
        raise ValueError(f"last dim {z.shape[-1]} does not match the {h}x{w} grid")
    flat = z.reshape(-1, h * w)
    flat_mask = None if mask is None else mask.to(torch.bool).expand_as(z).reshape(-1, h * w)
    out, labels = TV2DProxFunction.apply(flat, (h, w), float(lam), flat_mask, tol, max_iter, check_every)
    out, labels = out.reshape(z.shape), labels.reshape(z.shape)
    return (out, labels) if return_groups else out


def tvmax(scores: Tensor, grid_hw: tuple[int, int], mask: Tensor | None = None, lam: float = DEFAULT_LAMBDA, *,
          dtype: torch.dtype | None = torch.float64, **solver: float) -> Tensor:
    """TVmax (P4 Definition 1, Eq. 5) over ``[..., H*W]`` row-major grid scores, via Proposition 1:
    ``TVmax(z) = sparsemax(prox_{λΩ_2D}(z))`` (P4 Eq. 7).

    Backward = P4 Algorithm 1 (sparsemax Jacobian Eq. 15, then group averaging Eq. 9).  ``mask`` False cells get
    exactly zero weight and are removed from the grid graph.  ``λ = 0`` is exactly sparsemax.  Internally in
    ``dtype`` (float64 by default, SPEC decision #31; ``None`` keeps the input dtype); the result has the
    input dtype.  ``solver`` forwards ``tol`` / ``max_iter`` / ``check_every`` to :func:`tv2d_prox`.
    """
    if lam < 0:
        raise ValueError(f"TVmax needs λ >= 0, got {lam}")
    if lam == 0:
        return sparsemax(scores, mask)  # the prox of 0·Ω is the identity (P4: "λ = 0 recovers sparsemax")
    work = scores if dtype is None else scores.to(dtype)
    fused = tv2d_prox(work, grid_hw, lam, mask, **solver)
    return sparsemax(fused, mask).to(scores.dtype)


def square_grid(cells: int) -> tuple[int, int]:
    side = math.isqrt(cells)
    if side * side != cells:
        raise ValueError(f"TVmax needs a square grid to infer its shape; got {cells} items")
    return side, side


def tvmax_square(scores: Tensor, mask: Tensor | None = None, lam: float = DEFAULT_LAMBDA) -> Tensor:
    """The ``NORMALISERS["tvmax"]`` entry: :func:`tvmax` on a square grid inferred from ``N = side²``."""
    return tvmax(scores, square_grid(scores.shape[-1]), mask, lam)
