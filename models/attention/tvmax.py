"""TVmax (SparseCap Definition 1): sparse attention whose non-zero weights form contiguous 2D patches.

SparseCap = Martins et al., "Sparse and Structured Visual Attention", arXiv:2002.05556; equation numbers are its.
``TVmax(z) = argmin_{p ∈ Δ} ½‖p − z‖² + λ Ω_2D(p)`` (Eq. 5, with the ½: docs/decisions.md#tvmax-lambda-convention),
computed by Proposition 1 (Eq. 7) as ``sparsemax(prox_{λΩ_2D}(z))``, where ``Ω_2D`` is the anisotropic 2D total
variation of the row-major ``H × W`` grid (Eq. 3 on the 4-neighbour grid graph, each pair counted once).

The 2D TV prox (Eq. 4) has no direct algorithm.  We work on its dual

    min_{|u_e| ≤ λ}  ½‖z − Dᵀu‖²,      w = z − Dᵀu,

(``D`` is the ``E × N`` edge-difference matrix, ``(Dw)_e = w_j − w_i`` for edge ``e = (i, j)``), batched over every
grid of the call:

1. **FISTA** with step ``1/L`` (``L = λ_max(DDᵀ)``) and momentum ``(k − 1)/(k + 2)``, never restarted,
   warm-started at ``u = λ sign(Dz)`` (every cell its own group).  An iteration is a few tensor ops (``D`` and
   ``Dᵀ`` applied as shifted differences on a CPU, dense products on an accelerator: :class:`_Grid`) and no host
   synchronisation.  The iterations before the first check only have to point at the active set and run in
   float32, on the dual scaled by ``1/λ`` so that the box's faces are exact in both precisions.
2. After ``2·check_every`` iterations, then every ``check_every``, FISTA's dual names an *active set*: edges
   strictly inside the box are free (fused), the others pinned at ``u_e = λ sign(u_e)`` (Eq. 16).  Up to
   :data:`ACTIVE_SET_STEPS` primal–dual active-set steps (:func:`_active_set_step`) follow: the fused groups are
   the connected components of the free edges, the solution for the guess is their closed form, Eq. 8 (every
   group exactly flat), and a KKT certificate either accepts it or yields the next guess (free the pinned edges
   whose jump has the wrong sign, pin the free edges whose flow leaves the box).  FISTA then continues from its
   own iterate.
3. The certificate is a dual flow inside the box on the free edges that carries the rest of ``z − w``: FISTA's
   own dual there plus a spanning-tree bound on what it leaves, when that suffices, else an explicit flow
   (:func:`_flow`: leaf peeling, then conjugate gradients on the cycles).  With it, ``w`` is the *exact* prox of
   ``z − ρ`` (``ρ`` what the flow leaves: rounding), and the prox is non-expansive, so ``‖w − prox(z)‖₂ ≤ ‖ρ‖₂``
   (+ ``√L`` × any box clipping): the tolerance is a proven error bound, not a heuristic.  Certified grids leave
   the batch; after ``max_iter`` the point with the smaller proven bound (the active-set point or the FISTA
   iterate, bound ``√(2·gap)``) is returned.

Why this algorithm rather than the paper's proximal Dykstra, and details: ``docs/tvmax.md``.

The backward pass is Algorithm 1: ``J_TVmax = J_sp(w*) J_TV`` (Prop. 1 chain rule), with the sparsemax Jacobian
of Eq. 15 and ``(J_TV)_ij = 1/|G_i|`` for ``j`` in the fused group ``G_i`` (Eq. 9), using the certified groups
of the forward pass (exactly flat, and merged where neighbouring groups come out equal, so they
are the "connected components of equal values" without any tolerance to choose).  Connected components are
computed batched in torch by min-label propagation with pointer jumping.

No Python loop over grids.  The host synchronises only at checks (a few boolean reductions per active-set step,
one per label-propagation round, leaf-peeling round and conjugate-gradient iteration, and the index of the grids
still running), never inside the FISTA iterations.  Group sums use ``scatter_add`` on CPU and a ``bmm`` with the
0/1 membership matrix on accelerators, so results are deterministic everywhere.  Computation is in float64 by
default (docs/decisions.md#tvmax-solver-precision).
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import TypedDict, Unpack

import torch
from torch import Tensor

from .sparsemax import sparsemax

#: λ weighs Ω_2D in SparseCap Eq. 5 *with* the ½, the paper's value (docs/decisions.md#tvmax-lambda-convention).
#: The authors' layer (deep-spin/TVmax core/model/tv2d_layer.py, ``TV2DFunction``) passes ``step_size=alpha / 2`` to
#: a prox of ``½‖w − z‖² + step_size · Ω_2D``, i.e. its ``alpha`` is Eq. 6's λ (no ½): its ``alpha = 0.01`` is
#: ``lam = 0.005`` here.
DEFAULT_LAMBDA = 0.01
#: primal-dual active-set steps tried after every ``check_every`` FISTA iterations
ACTIVE_SET_STEPS = 3


class SolverOptions(TypedDict, total=False):
    """The :func:`tv2d_prox` options that :func:`tvmax` forwards: the iteration counts are ints (``range`` takes
    them), the tolerance a float."""

    tol: float
    max_iter: int
    check_every: int


# ---------------------------------------------------------------------------------------------------------------
# grid operators
# ---------------------------------------------------------------------------------------------------------------
def grid_edges(grid_hw: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """Endpoints ``(i, j)`` of the ``E`` grid edges: all horizontal ``(r,c)→(r,c+1)``, then all vertical
    ``(r,c)→(r+1,c)`` (SparseCap §2.2.1: ``i ∼ j`` iff ``j`` is right of or immediately below ``i``)."""
    h, w = grid_hw
    index = torch.arange(h * w).view(h, w)
    first = torch.cat([index[:, :-1].reshape(-1), index[:-1, :].reshape(-1)])
    second = torch.cat([index[:, 1:].reshape(-1), index[1:, :].reshape(-1)])
    return first, second


@lru_cache(maxsize=32)
def _operators(grid_hw: tuple[int, int], device: torch.device, dtype: torch.dtype) -> "_Grid":
    return _Grid(tuple(grid_hw), device, dtype)


#: on a CPU, grids of at most this many edges (8×8: 112, 10×10: 180) always take the dense products: their
#: matrices stay in a core's cache, and one product costs less than the dozen small ops of the shifted differences
DENSE_MAX_EDGES = 200
#: and larger grids take them while rows × edges² is below this (16×16 at one row; measured in docs/tvmax.md)
DENSE_MAX_WORK = 500_000


class _Grid:
    """The edge-difference operator ``D`` [E, N] of one grid shape, ``(Dw)_e = w_second[e] − w_first[e]``, and what
    the solver does with it, on one device in one dtype.

    Two ways to apply ``D``, ``Dᵀ`` and the FISTA matrix: products with the dense matrices (one kernel each), or
    differences of shifted slices of the ``[B, H, W]`` grid (a dozen small elementwise ops over ``B × N`` numbers,
    where the dense ``[E, E]`` product does ``E`` times more arithmetic: each row of ``D`` has two non-zeros).  On
    an accelerator, where every launch costs more than the arithmetic, always the products; on a CPU the products
    for small grids and few rows, the shifted differences otherwise (:data:`DENSE_MAX_EDGES`,
    :data:`DENSE_MAX_WORK`): on a 16×16 grid the products were most of a batched TVmax step.  Both compute the same
    sums of at most four terms, in a different order.
    """

    def __init__(self, grid_hw: tuple[int, int], device: torch.device, dtype: torch.dtype, dense: bool | None = None):
        """``dense``: always the dense products (True), always the shifted differences (False), or by device and
        size (None)."""
        h, w = self.height, self.width = grid_hw
        first, second = grid_edges(grid_hw)
        self.first, self.second = first.to(device), second.to(device)
        self.horizontal = h * (w - 1)  # edges 0 .. horizontal-1 join (r, c) and (r, c+1); the rest (r, c), (r+1, c)

        # L = λ_max(D Dᵀ) = λ_max of the grid Laplacian = sum of the two path Laplacians' largest eigenvalues,
        # 2(1 + cos(π/n)) each; removing edges (masks) only lowers it, so 1/L is always a safe step
        def path_max(n: int) -> float:
            return 2.0 * (1.0 + math.cos(math.pi / n)) if n > 1 else 0.0

        self.lipschitz = path_max(h) + path_max(w)
        edges = first.numel()
        if dense is None and torch.device(device).type != "cpu":
            dense = True
        # rows below which the dense products win (0: never; a number above any batch: always)
        self.dense_rows = {True: math.inf, False: 0}.get(
            dense, math.inf if edges <= DENSE_MAX_EDGES else DENSE_MAX_WORK / max(edges * edges, 1))
        if self.dense_rows:
            diff = torch.zeros(edges, h * w, dtype=torch.float64)
            diff[torch.arange(edges), first] = -1.0
            diff[torch.arange(edges), second] = 1.0
            iteration = torch.eye(edges, dtype=torch.float64) - diff @ diff.T / max(self.lipschitz, 1e-12)
            self.diff, self.diff_t = diff.to(device, dtype), diff.T.to(device, dtype).contiguous()
            self.incidence, self.iteration = diff.abs().to(device, dtype), iteration.to(device, dtype)

    def jump(self, w: Tensor) -> Tensor:
        """``D w``: the jump of ``w`` [B, N] across every edge, [B, E]."""
        if w.shape[0] < self.dense_rows:
            return w @ self.diff_t
        cells = w.view(w.shape[0], self.height, self.width)
        return torch.cat([(cells[:, :, 1:] - cells[:, :, :-1]).flatten(1),
                          (cells[:, 1:, :] - cells[:, :-1, :]).flatten(1)], 1)

    def spread(self, u: Tensor, signed: bool = True) -> Tensor:
        """``Dᵀ u``: what the edge values ``u`` [B, E] send to the cells, [B, N] (``−u_e`` to ``first[e]``,
        ``+u_e`` to ``second[e]``); with ``signed=False``, ``|D|ᵀ u`` (both ends get ``+u_e``)."""
        if u.shape[0] < self.dense_rows:
            return u @ (self.diff if signed else self.incidence)
        h, w = self.height, self.width
        batch = u.shape[0]
        across = u[:, :self.horizontal].view(batch, h, w - 1)
        down = u[:, self.horizontal:].view(batch, h - 1, w)
        cells = u.new_zeros(batch, h, w)
        cells[:, :, 1:] += across
        cells[:, 1:, :] += down
        if signed:
            cells[:, :, :-1] -= across
            cells[:, :-1, :] -= down
        else:
            cells[:, :, :-1] += across
            cells[:, :-1, :] += down
        return cells.view(batch, h * w)

    def iterate(self, offset: Tensor, y: Tensor) -> Tensor:
        """``offset + y K`` with the FISTA iteration matrix ``K = I − D Dᵀ / L`` [E, E] (``y`` [B, E])."""
        if y.shape[0] < self.dense_rows:
            return torch.addmm(offset, y, self.iteration)
        return (offset + y).sub_(self.jump(self.spread(y)), alpha=1.0 / max(self.lipschitz, 1e-12))


def connected_components(fused: Tensor, first: Tensor, second: Tensor, cells: int) -> Tensor:
    """Component label (smallest cell index) of every cell, ``[B, N]`` long, for the graph whose edges
    ``(first[e], second[e])`` are kept where ``fused[b, e]``.

    Min-label propagation across kept edges, followed by pointer jumping (``ℓ ← ℓ[ℓ]``, valid because a label is
    always the index of a cell of the same component and never exceeds the cell's own index).  It stops when every
    kept edge joins two equal labels: labels are cells of their own component, so each component then has exactly
    one.  Small groups need a single round; the host reads one boolean per round.
    """
    batch = fused.shape[0]
    # every cell its own label; expanded, not repeated (a copy per call costs more than a propagation round's op)
    labels = torch.arange(cells, device=fused.device).expand(batch, cells)
    if not bool(fused.any()):
        return labels.contiguous()
    for _ in range(cells):  # every round shrinks the diameter a label still has to travel; N is a hard bound
        a, b = labels.index_select(1, first), labels.index_select(1, second)
        smaller = torch.where(fused, torch.minimum(a, b), cells)
        labels = labels.scatter_reduce(1, first.expand(batch, -1), smaller, reduce="amin")
        labels = labels.scatter_reduce(1, second.expand(batch, -1), smaller, reduce="amin")
        labels = labels.gather(1, labels)
        if not bool((fused & (labels.index_select(1, first) != labels.index_select(1, second))).any()):
            break
    return labels


def _group_sums(values: Tensor, labels: Tensor) -> Tensor:
    """Sums of ``values`` ``[B, C, N]`` over the groups of ``labels`` ``[B, N]``, stored at each group's root
    (the cell its label names; 0 elsewhere).

    Deterministic on every device: on CPU ``scatter_add`` runs sequentially; on accelerators, where it would use
    floating-point atomics, the sums are a batched matrix product with the 0/1 membership matrix instead.
    """
    if values.device.type == "cpu":
        return torch.zeros_like(values).scatter_add_(2, labels.unsqueeze(1).expand_as(values), values)
    member = labels.unsqueeze(2) == torch.arange(labels.shape[1], device=labels.device)  # [B, cell, root]
    return torch.bmm(values, member.to(values.dtype))


def group_means(values: Tensor, labels: Tensor) -> Tensor:
    """Replace every value of ``[B, N]`` by the mean over its group (the action of ``J_TV`` of SparseCap Eq. 9, which is
    symmetric).  Every cell reads its group's value from the root, so a group is exactly flat."""
    sums, sizes = _group_sums(torch.stack([values, torch.ones_like(values)], 1), labels).unbind(1)
    return (sums / sizes.clamp_min(1.0)).gather(1, labels)


# ---------------------------------------------------------------------------------------------------------------
# the 2D TV prox
# ---------------------------------------------------------------------------------------------------------------
def _flow(demand: Tensor, free: Tensor, grid: _Grid, tol: Tensor) -> tuple[Tensor, Tensor]:
    """A flow ``c`` on the ``free`` edges with ``D_Fᵀ c = demand`` (``demand`` sums to 0 on every connected
    component of the free graph, up to rounding), and what is left of the demand, ``demand − Dᵀc``.

    1. **Leaf peeling** (exact, no linear solve): an edge that is the only free edge of one of its cells must carry
       that cell's whole remaining demand (``(Dᵀc)_i = −c_e`` at ``i = first[e]``, ``+c_e`` at ``second[e]``).  All
       such edges are settled at once and removed, as long as there are any.  This settles every edge outside the
       2-core of the free graph (all bridges, whose flow is the same in every solution), in as many rounds as the
       hanging trees are deep.
    2. What remains lies on cycles (fused 2×2 blocks and larger): the least-norm flow ``c = D_R ψ`` with
       ``L_R ψ = demand`` (``L_R`` the Laplacian of the remaining edges) by conjugate gradients, which are exact
       after as many steps as ``L_R`` has distinct eigenvalues; a row stops once its residual is below ``tol``.
    """
    first, second = grid.first, grid.second
    flow = torch.zeros(free.shape, dtype=demand.dtype, device=demand.device)
    remaining, left = free, demand
    while True:
        degree = grid.spread(remaining.to(demand.dtype), signed=False)
        leaf_first, leaf_second = degree.index_select(1, first) == 1, degree.index_select(1, second) == 1
        peel = remaining & (leaf_first | leaf_second)
        if not bool(peel.any()):
            break
        carried = torch.where(leaf_first, -left.index_select(1, first), left.index_select(1, second))
        step = torch.where(peel, carried, 0.0)
        flow = flow + step
        left = left - grid.spread(step)
        remaining = remaining ^ peel
    if not bool(remaining.any()):
        return flow, left
    weight = remaining.to(demand.dtype)
    psi = torch.zeros_like(left)
    residual, direction = left, left
    norm2 = (residual * residual).sum(1, keepdim=True)
    target = tol.unsqueeze(1) ** 2
    for _ in range(demand.shape[1]):  # L_R has at most N distinct eigenvalues
        image = grid.spread(grid.jump(direction) * weight)
        curvature = (direction * image).sum(1, keepdim=True)
        going = (norm2 > target) & (curvature > 0)  # converged rows stay put (no 0/0 on exact zeros)
        alpha = torch.where(going, norm2 / torch.where(going, curvature, 1.0), 0.0)
        psi = torch.addcmul(psi, alpha, direction)
        residual = torch.addcmul(residual, alpha, image, value=-1.0)
        new_norm2 = (residual * residual).sum(1, keepdim=True)
        beta = torch.where(going, new_norm2 / torch.where(going, norm2, 1.0), 0.0)
        direction = torch.addcmul(residual, beta, direction)
        norm2 = new_norm2
        if not bool(going.any()):
            break
    flow = torch.addcmul(flow, weight, grid.jump(psi))
    return flow, demand - grid.spread(flow)


def _active_set_step(z: Tensor, free: Tensor, signs: Tensor, bound: Tensor | float, lam: float, grid: _Grid,
                     tol: Tensor, flow_guess: Tensor,
                     groups: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The exact prox for one guess of the dual's active set if the guess is right, a proven bound on its error,
    and the next guess: one primal-dual active-set step on the dual box QP.

    The guess: ``free`` edges, whose dual may lie strictly inside the box, and the others, *pinned* at
    ``u_e = λ s_e`` (SparseCap Eq. 16; ``signs`` s, and 0 on masked edges).  The fused groups are the connected
    components of the free edges, and the solution is their closed form, SparseCap Eq. 8, which with our edge
    orientation reads ``w_G = mean_{j ∈ G}(z − Dᵀ u_pinned)_j``: every group is exactly flat.

    Certificate (KKT of SparseCap Eq. 16): no pinned edge may see a jump against its sign, and the free edges must carry
    the remaining *demand* ``d = z − Dᵀ u_pinned − w`` with a flow inside the box ``|c_e| ≤ λ``.  A cheap
    sufficient test comes first (:func:`_tree_certificate`: ``flow_guess``, FISTA's dual, plus a spanning-tree
    flow).  Only when that test fails is the flow computed (:func:`_flow`); an overloaded edge is then
    pinned at the flow's sign, and a pinned edge whose jump has the wrong sign is freed: the next guess.  With a
    flow inside the box, ``w`` is the *exact* prox of ``z − ρ``, where ``ρ`` is the part of the demand the flow
    does not carry (the group means of ``r`` for the cheap test, what :func:`_flow` leaves otherwise: rounding),
    and the prox is non-expansive; a flow clipped back into the box adds ``√L = ‖Dᵀ‖`` times the clipped amount.
    The returned error bounds ``‖w − prox(z)‖₂`` (``inf`` when a sign is violated).  Without ``groups`` the returned
    labels are those of the free edges only, not merged where neighbouring groups come out equal (the caller has no
    use for Algorithm 1's groups, e.g. no backward pass).
    """
    cells = z.shape[1]
    labels = connected_components(free, grid.first, grid.second, cells)
    pinned = (signs * bound).masked_fill_(free, 0.0)
    shifted = z - grid.spread(pinned)
    sums, sizes = _group_sums(torch.stack([shifted, torch.ones_like(shifted)], 1), labels).unbind(1)
    sizes = sizes.clamp_min(1.0)
    polished = (sums / sizes).gather(1, labels)  # SparseCap Eq. 8
    jump = grid.jump(polished)
    crossing = jump * pinned < 0
    demand = shifted.sub_(polished)
    carried, error = _tree_certificate(demand, free, flow_guess, labels, sizes, lam, grid)
    following = free | crossing
    if not bool(carried.all()):
        flow, left = _flow(demand, free & ~carried.unsqueeze(1), grid, tol / 4)
        overloaded = flow.abs() > bound
        clipped = flow - flow.clamp(-bound, bound)
        exact = left.norm(dim=1) + math.sqrt(grid.lipschitz) * clipped.norm(dim=1)
        error = torch.where(carried, error, exact)
        signs = torch.where(overloaded, torch.sign(flow), signs)
        following = following & ~overloaded
    error = error.masked_fill(crossing.any(1), float("inf"))
    # Algorithm 1's groups are the connected components of equal values: two neighbouring groups that come out
    # exactly equal (a degenerate point: |u_e| = λ with no jump) are one group
    if groups:
        touching = (jump == 0) & (pinned != 0)
        if bool(touching.any()):
            labels = connected_components(free | touching, grid.first, grid.second, cells)
    return polished, labels, error, following, signs


def _tree_certificate(demand: Tensor, free: Tensor, flow_guess: Tensor, labels: Tensor, sizes: Tensor, lam: float,
                      grid: _Grid) -> tuple[Tensor, Tensor]:
    """The cheap sufficient test of :func:`_active_set_step`'s certificate: whether FISTA's dual plus a
    spanning-tree flow on the ``free`` edges carries the ``demand`` ``d`` of every group (``labels``; ``sizes`` at
    the roots) inside the box, per grid, and the error bound ``‖ρ‖₂`` that this proves.

    ``flow_guess`` (FISTA's dual: any values in the box) on the free edges carries all of ``d`` but a remainder
    ``r = d − Dᵀ c̃``, which, like ``d``, sums to zero on each group (up to rounding); a spanning tree of the group
    carries ``r`` with at most half the group's ``ℓ1`` remainder on any edge (a partial sum of ``r``), so
    ``c̃ + that tree flow`` stays in the box when ``max_G |c̃| + ½(Σ_G |r| + |Σ_G r|) ≤ λ`` for every group; what
    is left, ``ρ``, is the group means of ``r``.
    """
    on_free = free.to(demand.dtype)
    guess = flow_guess * on_free
    # one gradient step of the guess towards carrying d (step 1/4 < 2/λ_max(D_F D_Fᵀ), as λ_max < 8 on any grid):
    # three ops that let the cheap test pass on ~97% of trained SparseCap grids instead of ~92% after 16 FISTA
    # iterations, where a failure costs an explicit flow
    left = demand - grid.spread(guess)
    guess = guess.add_(grid.jump(left).mul_(on_free), alpha=0.25)
    left = demand - grid.spread(guess)
    total, spread = _group_sums(torch.stack([left, left.abs()], 1), labels).unbind(1)
    # the largest |c̃| of each group, at its root (the label of an edge's endpoints); pinned edges contribute 0
    peak = torch.zeros_like(demand).scatter_reduce_(1, labels.index_select(1, grid.first), guess.abs_(), "amax")
    carried = (spread.add_(total.abs()).add_(peak, alpha=2.0) <= 2.0 * lam).all(1)
    error = (total.square() / sizes).sum(1).sqrt()  # ‖ρ‖₂, ρ = the group means of r
    return carried, error


def _tv2d_solve(z: Tensor, grid_hw: tuple[int, int], lam: float, mask: Tensor | None, tol: float,
                max_iter: int, check_every: int, groups: bool = True) -> tuple[Tensor, Tensor]:
    """Batched ``prox_{λΩ_2D}`` of ``z`` [B, N] (SparseCap Eq. 4) → ``(w, labels)``; see the module docstring.
    ``groups=False``: the labels are not needed (:func:`_active_set_step`)."""
    batch, cells = z.shape
    grid = _operators(tuple(grid_hw), z.device, z.dtype)
    if lam == 0.0 or grid.first.numel() == 0 or batch == 0:
        return z.clone(), torch.arange(cells, device=z.device).repeat(batch, 1)
    bound: Tensor | float = lam  # without a mask every edge has the same box: clamps and products take the number
    if mask is not None:
        # a masked cell does not exist: drop its edges (their dual is pinned to 0) and ignore its score
        bound = lam * (mask.index_select(1, grid.first) & mask.index_select(1, grid.second)).to(z.dtype)
        z = torch.where(mask, z, 0.0)
    # the certificate bound is absolute below |z| = 1 and relative above it (rounding grows with |z|); it cannot
    # be asked below what the dtype resolves (float32 runs get ~1e-4)
    eps = torch.finfo(z.dtype).eps
    cert_tol = max(tol, 1e3 * eps) * z.abs().amax(1).clamp_min(1.0)
    inner = bound * (1.0 - 4 * eps)  # |u_e| below this: strictly inside the box, so the edge is free (Eq. 16)

    out_w, out_labels = z, None
    rows = None  # the grids still being solved (None: all of them)
    # An active-set check costs as much as a dozen FISTA iterations, and on a trained SparseCap's scores 16
    # iterations name the exact active set of ~98% of the grids where 8 name ~75% (docs/tvmax.md): the first check
    # waits for twice the interval.
    u, y = _coarse_fista(z, grid_hw, grid, lam, bound, mask, 2 * check_every)
    u, offset = u.to(z.dtype).mul_(lam), None  # offset (unscaled, z's dtype): made only if FISTA has to go on
    iterations = 2 * check_every
    while True:
        last = iterations >= max_iter
        zr = z if rows is None else z.index_select(0, rows)
        tol_r = cert_tol if rows is None else cert_tol.index_select(0, rows)
        w_r, labels_r, error_r, done, all_done = _active_set_steps(zr, u, inner, bound, lam, grid, tol_r, groups)
        if last and not all_done:
            w_r = _best_proven_point(w_r, error_r, zr, u, bound, grid)
            done, all_done = torch.ones_like(done), True
        if rows is None:
            if all_done:
                return w_r, labels_r
            out_w, out_labels, rows = w_r.clone(), labels_r.clone(), torch.arange(batch, device=z.device)
        else:
            out_w.index_copy_(0, rows, w_r)
            out_labels.index_copy_(0, rows, labels_r)
            if all_done:
                return out_w, out_labels
        # drop finished grids so the remaining iterations only pay for the hard ones
        running = (~done).nonzero().squeeze(1)
        if offset is None:
            offset, y = grid.jump(z) / grid.lipschitz, y.to(z.dtype).mul_(lam)
        rows, u, y, offset = (t.index_select(0, running) for t in (rows, u, y, offset))
        if mask is not None:
            bound, inner = bound.index_select(0, running), inner.index_select(0, running)
        u, y = _fista(u, y, offset, grid, bound, iterations, check_every)
        iterations += check_every


def _coarse_fista(z: Tensor, grid_hw: tuple[int, int], grid: _Grid, lam: float, bound: Tensor | float,
                  mask: Tensor | None, count: int) -> tuple[Tensor, Tensor]:
    """The first ``count`` FISTA iterations of :func:`_tv2d_solve`, from the warm start ``u = λ sign(Dz)``, in
    float32 on the dual scaled by ``1/λ``: the scaled dual ``u / λ`` and the extrapolated point ``y / λ``."""
    # These iterations only have to point at the active set, so they run in float32 (half the cost of the float64
    # matrix product), on the dual scaled by 1/λ: the box [−1, 1] and its faces are exact in both precisions, so
    # pinned edges stay exactly pinned when the iterate returns to float64.
    unit = bound / lam if mask is None else (bound / lam).float()
    coarse = _operators(tuple(grid_hw), z.device, torch.float32)
    # the constant part of the gradient step u + (D z − D Dᵀ u)/L, for the scaled dual
    scaled = coarse.jump(z.to(torch.float32)).div_(grid.lipschitz * lam)
    # warm start: every cell its own group, u_e = λ sign((Dz)_e): the exact dual when λ is small enough that no
    # two neighbours fuse, and otherwise wrong only around the few pairs that do
    return _fista(torch.sign(scaled).mul_(unit), None, scaled, coarse, unit, 0, count)


def _active_set_steps(z: Tensor, u: Tensor, inner: Tensor | float, bound: Tensor | float, lam: float, grid: _Grid,
                      tol: Tensor, groups: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, bool]:
    """Up to :data:`ACTIVE_SET_STEPS` active-set steps (:func:`_active_set_step`) from the active set that FISTA's
    dual ``u`` points at, until every grid is certified (error bound within ``tol``): per grid the first certified
    ``(w, labels, error)`` (the first step's where none is), which grids are certified, and whether all are."""
    # the active set FISTA points at, then a few primal-dual active-set steps from it
    free, signs = u.abs() < inner, torch.sign(u)
    done = None
    for _ in range(ACTIVE_SET_STEPS):
        polished, labels, error, free, signs = _active_set_step(z, free, signs, bound, lam, grid, tol, u, groups)
        certified = error <= tol
        if done is None:
            w_r, labels_r, error_r, done = polished, labels, error, certified
        else:
            newly = (certified & ~done).unsqueeze(1)
            w_r, labels_r = torch.where(newly, polished, w_r), torch.where(newly, labels, labels_r)
            error_r, done = torch.where(certified & ~done, error, error_r), done | certified
        all_done = bool(done.all())
        if all_done:
            break
    return w_r, labels_r, error_r, done, all_done


def _best_proven_point(w: Tensor, error: Tensor, z: Tensor, u: Tensor, bound: Tensor | float,
                       grid: _Grid) -> Tensor:
    """Per grid, whichever of the active-set point ``w`` (proven bound ``error``) and the plain FISTA iterate
    ``z − Dᵀu`` has the smaller proven error bound: what :func:`_tv2d_solve` returns when out of iterations."""
    # out of budget: keep whichever point has the smaller proven error bound (the plain FISTA iterate's
    # bound is the duality gap, ‖w − w*‖² ≤ 2·gap by 1-strong convexity of the primal)
    iterate = z - grid.spread(u)
    jump = grid.jump(iterate)
    gap = (jump.abs() * (bound - u * torch.sign(jump))).sum(1).clamp_min(0.0)
    return torch.where((error <= (2.0 * gap).sqrt()).unsqueeze(1), w, iterate)


def _fista(u: Tensor, y: Tensor | None, offset: Tensor, grid: _Grid, bound: Tensor | float, done: int,
           count: int) -> tuple[Tensor, Tensor]:
    """``count`` FISTA steps on the dual after ``done`` earlier ones: a projected gradient step at the extrapolated
    point ``y`` (``u`` itself at the start, :meth:`_Grid.iterate`), then momentum ``(k − 1)/(k + 2)`` (Chambolle &
    Dossal); a few small ops per step and no host synchronisation."""
    y, lower = u if y is None else y, -bound
    for k in range(done + 1, done + count + 1):
        u_next = grid.iterate(offset, y).clamp_(lower, bound)
        y = torch.lerp(u, u_next, 1.0 + (k - 1) / (k + 2))
        u = u_next
    return u, y


class TV2DProxFunction(torch.autograd.Function):
    """``w* = prox_{λΩ_2D}(z)`` (SparseCap Eq. 4) with the group-averaging Jacobian of SparseCap Eq. 9 as backward."""

    @staticmethod
    def forward(ctx, z: Tensor, grid_hw: tuple[int, int], lam: float, mask: Tensor | None, tol: float,
                max_iter: int, check_every: int) -> tuple[Tensor, Tensor]:
        w, labels = _tv2d_solve(z, grid_hw, lam, mask, tol, max_iter, check_every)
        ctx.save_for_backward(labels, mask)
        ctx.mark_non_differentiable(labels)
        return w, labels

    @staticmethod
    def backward(ctx, grad_w: Tensor, _grad_labels: Tensor | None):
        labels, mask = ctx.saved_tensors
        # J_TV is symmetric (SparseCap Eq. 9), so J_TVᵀ dw is again "average dw over each fused group"; a masked
        # cell is a group of its own whose output is 0 whatever its score: no gradient
        grad_z = group_means(grad_w, labels)
        return (grad_z if mask is None else grad_z.masked_fill(~mask, 0.0)), None, None, None, None, None, None


def tv2d_prox(z: Tensor, grid_hw: tuple[int, int], lam: float = DEFAULT_LAMBDA, mask: Tensor | None = None, *,
              tol: float = 1e-9, max_iter: int = 2000, check_every: int = 8,
              return_groups: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """``prox_{λΩ_2D}(z) = argmin_w ½‖w − z‖² + λ Ω_2D(w)`` (SparseCap Eq. 4) over ``[..., H*W]`` row-major grids.

    Differentiable (backward = group averaging, SparseCap Eq. 9).  The result is certified to lie within ``tol``
    (L2, times ``max(1, max|z|)``; at least ``1e3·eps`` of the dtype) of the exact prox, unless ``max_iter`` FISTA
    iterations run out first (then the candidate with the smaller proven bound is returned); fused groups are
    exactly flat.  The solver looks for a certificate every ``check_every`` iterations.  With ``return_groups``
    also returns the group label (smallest cell index of the group) of every cell.  Masked cells (False) are
    removed from the grid graph; their output is 0, and so is the gradient they get back.
    """
    h, w = grid_hw
    if z.shape[-1] != h * w:
        raise ValueError(f"last dim {z.shape[-1]} does not match the {h}x{w} grid")
    flat = z.reshape(-1, h * w)
    flat_mask = None if mask is None else mask.to(torch.bool).expand_as(z).reshape(-1, h * w)
    if torch.is_grad_enabled() and z.requires_grad:
        out, labels = TV2DProxFunction.apply(flat, (h, w), float(lam), flat_mask, tol, max_iter, check_every)
    else:  # no backward to prepare: the autograd.Function's bookkeeping would cost a decoding step several ops
        out, labels = _tv2d_solve(flat, (h, w), float(lam), flat_mask, tol, max_iter, check_every, return_groups)
    out, labels = out.reshape(z.shape), labels.reshape(z.shape)
    return (out, labels) if return_groups else out


def tvmax(scores: Tensor, grid_hw: tuple[int, int], mask: Tensor | None = None, lam: float = DEFAULT_LAMBDA, *,
          dtype: torch.dtype | None = torch.float64, **solver: Unpack[SolverOptions]) -> Tensor:
    """TVmax (SparseCap Definition 1, Eq. 5) over ``[..., H*W]`` row-major grid scores, via Proposition 1:
    ``TVmax(z) = sparsemax(prox_{λΩ_2D}(z))`` (SparseCap Eq. 7).

    Backward = SparseCap Algorithm 1 (sparsemax Jacobian Eq. 15, then group averaging Eq. 9).  ``mask`` False cells get
    exactly zero weight and are removed from the grid graph.  ``λ = 0`` is exactly sparsemax.  Internally in
    ``dtype`` (float64 by default: docs/decisions.md#tvmax-solver-precision; ``None`` keeps the input dtype); the
    result has the input dtype.  ``solver`` forwards ``tol`` / ``max_iter`` / ``check_every`` to :func:`tv2d_prox`.
    """
    if lam < 0:
        raise ValueError(f"TVmax needs λ >= 0, got {lam}")
    if lam == 0:
        return sparsemax(scores, mask)  # the prox of 0·Ω is the identity (SparseCap §2.2.2: λ = 0 gives sparsemax)
    if mask is not None and bool(mask.all()):
        # one host read instead of the masked paths' dozen small ops (padding only ever comes with region features)
        mask = None
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
