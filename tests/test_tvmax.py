"""TVmax (SparseCap, arXiv:2002.05556, Definition 1) and its 2D TV prox against generic convex solvers."""

import inspect
import math
import typing

import numpy as np
import pytest
import torch
from scipy.optimize import linprog, lsq_linear
from scipy.sparse import coo_matrix
from scipy.sparse.csgraph import connected_components as scipy_components

from captioner.models.attention import NORMALISERS, get_normaliser
from captioner.models.attention import tvmax as module
from captioner.models.attention.sparsemax import sparsemax
from captioner.models.attention.tvmax import _Grid, connected_components, grid_edges, tv2d_prox, tvmax

# tiny tensors gain nothing from a second thread, and on a busy machine waiting for it dominates
pytestmark = pytest.mark.usefixtures("one_thread")


def _difference_matrix(h: int, w: int) -> np.ndarray:
    first, second = (t.numpy() for t in grid_edges((h, w)))
    diff = np.zeros((first.size, h * w))
    diff[np.arange(first.size), first] = -1.0
    diff[np.arange(first.size), second] = 1.0
    return diff


def _reference_prox(z: np.ndarray, h: int, w: int, lam: float) -> tuple[np.ndarray, float]:
    """Generic solver: the dual box-constrained least squares ``min_{|u| ≤ λ} ½‖z − Dᵀu‖²`` by scipy's BVLS
    (an exact active-set method), ``w = z − Dᵀu``.  Returns w and the bound ``√(2·gap)`` on its error (the primal
    is 1-strongly convex), so the reference certifies its own accuracy."""
    diff = _difference_matrix(h, w)
    u = lsq_linear(diff.T, z, bounds=(-lam, lam), method="bvls", tol=1e-15, max_iter=10000).x
    prox = z - diff.T @ u
    jump = diff @ prox
    gap = float(np.sum(np.abs(jump) * (lam - u * np.sign(jump))))
    return prox, float(np.sqrt(2 * max(gap, 0.0)))


def _random_scores(n: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(n, 64, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale


# -- definition, convention, limits ------------------------------------------------------------------------------
def test_lambda_zero_is_exactly_sparsemax():
    for dtype in (torch.float32, torch.float64):
        z = _random_scores(8, 0).to(dtype)
        assert torch.equal(tvmax(z, (8, 8), lam=0.0), sparsemax(z))
    # and λ = 0 through the solver itself: the prox of 0·Ω is the identity
    z = _random_scores(4, 1)
    assert torch.equal(tv2d_prox(z, (8, 8), lam=0.0), z)


def test_lambda_zero_with_a_mask_is_the_masked_sparsemax():
    """λ = 0 takes sparsemax's shortcut rather than the solver: padded cells must still get exactly zero weight there,
    however large their scores, as they do at any λ > 0."""
    mask = torch.ones(4, 64, dtype=torch.bool)
    mask[:, 56:] = False
    z = _random_scores(4, 6).masked_fill(~mask, 50.0)
    p = tvmax(z, (8, 8), mask, lam=0.0)
    assert torch.equal(p, sparsemax(z, mask)) and torch.all(p[:, 56:] == 0)


def test_a_negative_lambda_is_refused():
    """Eq. 5 with λ < 0 rewards jumps: the box |u_e| ≤ λ of the solver's dual would be empty. A model configured with
    ``tvmax_lambda < 0`` must fail at its first attention, not train on what the solver returns."""
    with pytest.raises(ValueError, match="λ >= 0"):
        tvmax(_random_scores(2, 0), (8, 8), lam=-0.01)


def test_lambda_convention_is_eq5_with_the_half():
    # two cells, one edge: argmin ½‖w − z‖² + λ|w₁ − w₂| moves each end by exactly λ while |z₁ − z₂| > 2λ
    # (Eq. 6 without the ½ would move them by λ/2): docs/decisions.md#tvmax-lambda-convention
    z = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(tv2d_prox(z, (1, 2), lam=0.1), torch.tensor([[0.9, 0.1]], dtype=torch.float64))
    torch.testing.assert_close(tv2d_prox(z, (2, 1), lam=0.6), torch.tensor([[0.5, 0.5]], dtype=torch.float64))
    torch.testing.assert_close(tvmax(z, (1, 2), lam=0.1), torch.tensor([[0.9, 0.1]], dtype=torch.float64))


def test_output_lies_on_the_simplex():
    for lam in (0.01, 0.1, 1.0):
        for dtype in (torch.float32, torch.float64):
            p = tvmax(_random_scores(16, 2).to(dtype), (8, 8), lam=lam)
            assert p.dtype == dtype and (p >= 0).all()
            torch.testing.assert_close(p.sum(-1), torch.ones(16, dtype=dtype))


def test_constant_input_is_uniform():
    for value in (0.0, 0.3, -7.0):
        p = tvmax(torch.full((2, 64), value), (8, 8))
        torch.testing.assert_close(p, torch.full((2, 64), 1 / 64))


def test_huge_lambda_fuses_everything_to_uniform():
    z = _random_scores(4, 3, scale=3.0)
    torch.testing.assert_close(tvmax(z, (8, 8), lam=1e3), torch.full((4, 64), 1 / 64, dtype=torch.float64))
    w = tv2d_prox(z, (8, 8), lam=1e3)
    torch.testing.assert_close(w, z.mean(1, keepdim=True).expand(4, 64))


def test_tvmax_is_structured_and_sparse():
    # the point of TVmax: at a moderate λ the support is made of few flat patches
    z = _random_scores(1, 4, scale=0.1)
    p = tvmax(z, (8, 8), lam=0.01)
    assert (p == 0).any() and len(torch.unique(p[p > 0])) < (p > 0).sum()


# -- the prox against generic solvers ------------------------------------------------------------------------------
@pytest.mark.parametrize("lam,scale", [(0.01, 1.0), (0.01, 0.05), (0.1, 1.0), (0.5, 1.0), (3.0, 1.0)])
def test_prox_matches_generic_convex_solver(lam, scale):
    z = _random_scores(6, 5, scale)
    got = tv2d_prox(z, (8, 8), lam=lam).numpy()
    for row in range(6):
        expected, certified = _reference_prox(z[row].numpy(), 8, 8, lam)
        assert certified < 5e-6, "the reference solver did not converge"
        np.testing.assert_allclose(got[row], expected, atol=1e-5, rtol=0)
        # in practice the two agree far better than the brief's 1e-5
        assert np.abs(got[row] - expected).max() < max(certified, 1e-9)


@pytest.mark.parametrize("lam,scale", [(0.01, 1.0), (0.01, 0.05), (0.1, 0.3), (0.5, 1.0)])
def test_warm_started_solve_agrees_with_a_cold_one(lam, scale):
    """Where the solver starts and when it first checks is only speed (docs/tvmax.md): its default, 16 FISTA
    iterations in float32 from the λ·sign(Dz) warm start, then FISTA's dual as the certificate's flow, must give the
    certified answer of a cold solve that checks after 2 iterations (the active-set steps and explicit flows do the
    work from an almost untouched start) and of one that checks only after 400 (FISTA nearly converged)."""
    z = _random_scores(16, 15, scale)
    warm = tv2d_prox(z, (8, 8), lam=lam)
    for check_every in (1, 200):
        torch.testing.assert_close(tv2d_prox(z, (8, 8), lam=lam, check_every=check_every), warm, atol=1e-9, rtol=0)


@pytest.mark.parametrize("lam", [0.1, 0.3])
@pytest.mark.parametrize("masked", [False, True])
def test_out_of_iterations_returns_the_point_with_the_smaller_proven_bound(monkeypatch, lam, masked):
    """With ``max_iter`` spent before every grid is certified, each grid gets whichever of the active-set point
    (its certificate's bound) and FISTA's iterate ``z − Dᵀu`` (bound ``√(2·gap)``, the duality gap computed here
    from the primal and dual objectives) has the smaller proven bound, and lies within that bound of the exact
    prox. Two iterations leave some of these grids uncertified at either λ. Masked, the last row is no part of the
    grid: its cells meet each other with no jump and a dual pinned at 0 (a gap of 0·∞ if taken carelessly), and the
    real cells are a 7×8 grid."""
    z = _random_scores(16, 5)
    mask = torch.ones(64, dtype=torch.bool)
    if masked:
        mask[56:] = False
    seen = {}

    def recording(w, error, z_r, u, bound, grid):
        seen.update(w=w, error=error, u=u, z=z_r)
        return module._best_proven_point.__wrapped__(w, error, z_r, u, bound, grid)

    recording.__wrapped__ = module._best_proven_point
    monkeypatch.setattr(module, "_best_proven_point", recording)
    got = tv2d_prox(z, (8, 8), lam=lam, mask=mask if masked else None, max_iter=2, check_every=1).numpy()
    assert seen["z"].shape == z.shape, "the budget was not spent: the fallback was not reached"
    first, second = grid_edges((8, 8))
    kept = (mask[first] & mask[second]).numpy()  # the edges between real cells
    diff, scores, real = _difference_matrix(8, 8)[kept], z.numpy() * mask.numpy(), 56 if masked else 64
    u, error = seen["u"].numpy()[:, kept], seen["error"].numpy()
    iterate = scores - u @ diff
    primal = 0.5 * ((iterate - scores) ** 2).sum(1) + lam * np.abs(iterate @ diff.T).sum(1)
    dual = 0.5 * (scores ** 2).sum(1) - 0.5 * (iterate ** 2).sum(1)
    fista_bound = np.sqrt(2 * np.maximum(primal - dual, 0.0))
    assert np.isfinite(fista_bound).all() and (fista_bound > 0).all()
    picked = {"active set": 0, "iterate": 0}
    for row in range(16):
        expected = np.zeros(64)
        expected[:real], _ = _reference_prox(scores[row, :real], real // 8, 8, lam)
        assert np.linalg.norm(got[row] - expected) <= min(error[row], fista_bound[row]) + 1e-9
        # where one bound is clearly the smaller (not a rounding tie), its point is the one returned
        if error[row] > fista_bound[row] * (1 + 1e-6):
            np.testing.assert_allclose(got[row], iterate[row], atol=1e-12, rtol=0)
            picked["iterate"] += 1
        elif error[row] < fista_bound[row] * (1 - 1e-6):
            np.testing.assert_array_equal(got[row], seen["w"][row].numpy())
            picked["active set"] += 1
    assert all(picked.values()), f"both kinds of grid: {picked}"


def test_a_loose_tolerance_still_bounds_the_error():
    """``tol`` is a proven bound, not a stopping heuristic: with ``tol=1e-3`` and a check after every iteration the
    solver may return before the exact prox (one of these grids does), but each result lies within
    ``tol · max(1, max|z|)`` of it."""
    z = _random_scores(16, 9)
    got = tv2d_prox(z, (8, 8), lam=0.3, tol=1e-3, check_every=1).numpy()
    inexact = 0
    for row in range(16):
        expected, certified = _reference_prox(z[row].numpy(), 8, 8, 0.3)
        error = np.linalg.norm(got[row] - expected)
        assert error <= 1e-3 * max(1.0, z[row].abs().max().item()) + certified
        inexact += error > 1e-9
    assert inexact, "every grid came out exact: the tolerance was never used"


def test_tvmax_forwards_the_solver_options_to_the_prox():
    """tvmax's ``solver`` keywords (``tol``, ``max_iter``, ``check_every``) reach tv2d_prox: with a budget of two
    iterations and a check after each, some of these grids come back uncertified, so the weights are those of that
    budget's prox (0.2 away from the exact prox's), not those of the default solve."""
    z = _random_scores(16, 5)
    budget = {"max_iter": 2, "check_every": 1}
    got = tvmax(z, (8, 8), lam=0.3, **budget)
    assert torch.equal(got, sparsemax(tv2d_prox(z, (8, 8), lam=0.3, **budget)))
    assert not torch.allclose(got, tvmax(z, (8, 8), lam=0.3), atol=1e-2, rtol=0)


def test_the_solver_options_mean_the_same_under_autograd():
    """Scores that need a gradient (every training step) take the autograd path of tv2d_prox, which must hand the
    solver the same budget: ``max_iter`` and ``check_every`` swapped there would run 2·2000 float32 iterations
    before a first check of every default solve, and read a user's budget the other way round. Two iterations with
    a check after each leave some grids uncertified, so the weights show which budget ran."""
    z = _random_scores(16, 5)
    budget = {"max_iter": 2, "check_every": 1}
    plain = tv2d_prox(z, (8, 8), lam=0.3, **budget)
    assert not torch.allclose(plain, tv2d_prox(z, (8, 8), lam=0.3), atol=1e-2, rtol=0)  # the budget binds
    traced = tv2d_prox(z.clone().requires_grad_(), (8, 8), lam=0.3, **budget)
    assert traced.requires_grad
    assert torch.equal(traced.detach(), plain)


def test_the_solver_options_type_every_solver_keyword_of_the_prox():
    """``SolverOptions`` types tvmax's ``**solver``: a type checker refuses a keyword it does not list, or one of
    another type, in a library user's ``tvmax(scores, grid, tol=1e-6)``. It must list every solver keyword of
    tv2d_prox (``return_groups`` is not forwarded) with the prox's own type."""
    prox_types = typing.get_type_hints(tv2d_prox)
    parameters = inspect.signature(tv2d_prox).parameters
    keywords = [name for name in parameters if parameters[name].kind is inspect.Parameter.KEYWORD_ONLY]
    keywords.remove("return_groups")  # tvmax returns the weights, never the groups
    assert typing.get_type_hints(module.SolverOptions) == {name: prox_types[name] for name in keywords}
    assert sorted(keywords) == ["check_every", "max_iter", "tol"]


@pytest.mark.parametrize("solve, tol", [
    (lambda z: tv2d_prox(z, (8, 8), lam=0.1, tol=1e-4), 1e-4),
    (lambda z: tv2d_prox(z, (8, 8), lam=0.1, tol=0.0), 1e3 * torch.finfo(torch.float64).eps),
    (lambda z: tvmax(z, (8, 8), lam=0.1), 1e-9)], ids=["asked", "floor", "default"])
def test_the_certificate_asks_for_tol_times_the_scores_scale(monkeypatch, solve, tol):
    """The documented bound: ``tol`` in L2 times ``max(1, max|z|)`` per grid (absolute below |z| = 1, relative above),
    never below ``1e3·eps`` of the dtype, and ``tol=1e-9`` where the caller (tvmax, every model) passes none. What
    the active-set steps are asked to certify, per grid."""
    asked = []

    def recording(z, u, inner, bound, lam, grid, tol, groups):
        asked.append(tol.clone())
        return recording.__wrapped__(z, u, inner, bound, lam, grid, tol, groups)

    recording.__wrapped__ = module._active_set_steps
    monkeypatch.setattr(module, "_active_set_steps", recording)
    z = _random_scores(2, 17) * torch.tensor([[0.3], [5.0]], dtype=torch.float64)
    solve(z)
    assert torch.equal(asked[0], tol * torch.stack([torch.tensor(1.0, dtype=torch.float64), z[1].abs().max()]))


def test_an_active_set_step_that_corrects_the_first_guess_certifies_the_grid():
    """Two cells 1 apart at λ = 0.1, from a dual of 0 (every edge free: one group at 0.5): the first step's flow
    overloads the edge (error √2·0.4), the second pins it and is exact. The grid is certified with the second step's
    point and error 0; kept uncertified, the solver would run on for it, and with the budget spent hand back FISTA's
    iterate instead of this exact point."""
    grid = _Grid((1, 2), torch.device("cpu"), torch.float64)
    z, u = torch.tensor([[1.0, 0.0]], dtype=torch.float64), torch.zeros(1, 1, dtype=torch.float64)
    tol = torch.full((1,), 1e-9, dtype=torch.float64)
    w, labels, error, done, all_done = module._active_set_steps(z, u, 0.099, 0.1, 0.1, grid, tol, True)
    torch.testing.assert_close(w, torch.tensor([[0.9, 0.1]], dtype=torch.float64), atol=1e-15, rtol=0)
    assert labels.tolist() == [[0, 1]] and error.tolist() == [0.0] and done.tolist() == [True] and all_done


def test_prox_on_non_square_and_chain_grids():
    rng = np.random.default_rng(6)
    for h, w in ((1, 9), (5, 1), (3, 7)):
        z = rng.normal(size=(4, h * w))
        got = tv2d_prox(torch.tensor(z), (h, w), lam=0.2).numpy()
        for row in range(4):
            expected, _ = _reference_prox(z[row], h, w, 0.2)
            np.testing.assert_allclose(got[row], expected, atol=1e-6, rtol=0)


def test_prox_satisfies_kkt_conditions_by_linear_programming():
    """Independent optimality check of the returned w: a dual u with |u| ≤ λ, u_e = λ·sign((Dw)_e) where the jump
    is non-zero and Dᵀu = z − w must exist (SparseCap Eq. 16); scipy's LP finds one (or proves there is none)."""
    lam = 0.1
    diff = _difference_matrix(8, 8)
    z = _random_scores(3, 7)
    w = tv2d_prox(z, (8, 8), lam=lam).numpy()
    for row in range(3):
        jump = diff @ w[row]
        bounds = [(lam * np.sign(j), lam * np.sign(j)) if abs(j) > 1e-9 else (-lam, lam) for j in jump]
        result = linprog(np.zeros(len(jump)), A_eq=diff.T, b_eq=z[row].numpy() - w[row], bounds=bounds,
                         method="highs")
        assert result.status == 0, result.message


def test_fused_groups_are_exactly_flat_connected_components():
    z = _random_scores(8, 8, scale=0.3)
    w, labels = tv2d_prox(z, (8, 8), lam=0.1, return_groups=True)
    first, second = grid_edges((8, 8))
    for row in range(8):
        for label in labels[row].unique():
            cells = labels[row] == label
            assert len(torch.unique(w[row][cells])) == 1  # exactly flat, not just within a tolerance
        # labels are the connected components of "neighbours with equal value"
        equal = (w[row, first] == w[row, second]).numpy()
        graph = coo_matrix((np.ones(equal.sum()), (first.numpy()[equal], second.numpy()[equal])), shape=(64, 64))
        _, reference = scipy_components(graph, directed=False)
        ours = labels[row].numpy()
        assert all((ours == ours[i]).tolist() == (reference == reference[i]).tolist() for i in range(64))


def test_connected_components_on_a_snake():
    # a single path that winds through the whole 8×8 grid: the worst case for label propagation
    first, second = grid_edges((8, 8))
    fused = torch.zeros(1, first.numel(), dtype=torch.bool)
    for e, (i, j) in enumerate(zip(first.tolist(), second.tolist())):
        if i // 8 == j // 8 or (j == i + 8 and (i % 8 == 7 if (i // 8) % 2 == 0 else i % 8 == 0)):
            fused[0, e] = True
    labels = connected_components(fused, first, second, 64)
    assert torch.all(labels == 0)
    split = fused.clone()
    split[0, (first == 27) & (second == 28)] = False
    labels = connected_components(split, first, second, 64)
    assert len(labels.unique()) == 2


def test_explicit_flow_carries_a_demand_around_cycles_and_trees():
    """The certificate's explicit flow (``_flow``) on the free edges: leaf peeling settles the edges outside cycles,
    conjugate gradients those on them. Row 0: the whole 3×3 grid free (four 2×2 cycles); row 1: a comb with no
    cycle (the rows' edges and the first column's). Each row's demand sums to 0, so the flow carries all of it."""
    grid = _Grid((3, 3), torch.device("cpu"), torch.float64)
    first, second = grid_edges((3, 3))
    free = torch.stack([torch.ones_like(first, dtype=torch.bool), (second == first + 1) | (first % 3 == 0)])
    demand = torch.randn(2, 9, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    demand -= demand.mean(1, keepdim=True)
    flow, left = module._flow(demand, free, grid, torch.full((2,), 1e-12, dtype=torch.float64))
    assert torch.all(flow[~free] == 0), "a flow on a pinned edge"
    torch.testing.assert_close(grid.spread(flow), demand, atol=1e-12, rtol=0)
    torch.testing.assert_close(left, torch.zeros_like(left), atol=1e-12, rtol=0)


# -- batching, masks, determinism ----------------------------------------------------------------------------------
def test_batched_result_equals_per_grid_result():
    z = _random_scores(12, 9, scale=0.2).view(3, 4, 64)
    together = tvmax(z, (8, 8), lam=0.05)
    assert together.shape == (3, 4, 64)
    for a in range(3):
        for b in range(4):
            torch.testing.assert_close(together[a, b], tvmax(z[a, b], (8, 8), lam=0.05), atol=1e-12, rtol=0)
    assert torch.equal(together, tvmax(z, (8, 8), lam=0.05)), "not deterministic"


def test_masked_cells_are_removed_from_the_grid():
    z = _random_scores(3, 10, scale=0.3)
    mask = torch.ones(3, 64, dtype=torch.bool)
    mask[:, 56:] = False  # drop the last row: the rest is a 7×8 grid
    z = z.masked_fill(~mask, 50.0)  # masked scores must not matter, however large
    p = tvmax(z, (8, 8), mask, lam=0.05)
    assert torch.all(p[:, 56:] == 0)
    torch.testing.assert_close(p[:, :56], tvmax(z[:, :56], (7, 8), lam=0.05), atol=1e-12, rtol=0)
    none_real = tvmax(z[:1], (8, 8), torch.zeros(1, 64, dtype=torch.bool))
    assert torch.all(none_real == 0)


def test_masked_cells_leave_the_prox_at_zero_whatever_their_scores():
    """tv2d_prox's contract: a masked cell is no cell of the grid and its output is 0, however large its score
    (tvmax's sparsemax masks it again, but the prox is public), and the real 7×8 cells get the 7×8 grid's prox."""
    z = _random_scores(3, 10, scale=0.3)
    mask = torch.ones(3, 64, dtype=torch.bool)
    mask[:, 56:] = False
    w = tv2d_prox(z.masked_fill(~mask, 1e9), (8, 8), lam=0.05, mask=mask)
    assert torch.all(w[:, 56:] == 0)
    torch.testing.assert_close(w[:, :56], tv2d_prox(z[:, :56], (7, 8), lam=0.05), atol=1e-12, rtol=0)


def test_a_mask_of_zeros_and_ones_in_any_dtype_is_read_as_true_and_false():
    """Padding masks often come as integers (a tokenizer's attention mask) or floats (a collate's): tv2d_prox and tvmax
    read any 0/1 mask as the boolean one, rather than failing inside the solver."""
    z = _random_scores(3, 10, scale=0.3)
    mask = torch.ones(3, 64, dtype=torch.bool)
    mask[:, 56:] = False
    for function in (tv2d_prox, tvmax):
        expected = function(z, (8, 8), mask=mask, lam=0.05)
        for dtype in (torch.long, torch.int32, torch.float32):
            torch.testing.assert_close(function(z, (8, 8), mask=mask.to(dtype), lam=0.05), expected, atol=0, rtol=0)


def test_masked_cells_pass_back_no_gradient():
    """A masked cell's prox is 0 whatever its score, so its row and column of the prox's Jacobian are 0 (the
    public tv2d_prox's backward; tvmax's sparsemax gives masked cells no gradient anyway), and the real 2×3 cells
    get the 2×3 grid's group averages (SparseCap Eq. 9)."""
    z = _random_scores(1, 18, scale=0.3)[:, :9].requires_grad_()
    mask = torch.tensor([True] * 6 + [False] * 3)
    jacobian = torch.autograd.functional.jacobian(lambda x: tv2d_prox(x, (3, 3), lam=0.05, mask=mask), z)[0, :, 0]
    expected = torch.zeros(9, 9, dtype=torch.float64)
    expected[:6, :6] = torch.autograd.functional.jacobian(lambda x: tv2d_prox(x, (2, 3), lam=0.05), z[:, :6])[0, :, 0]
    assert expected[:6, :6].count_nonzero() > 6, "a point with a fused group"
    torch.testing.assert_close(jacobian, expected, atol=1e-15, rtol=0)


def test_float32_scores_are_solved_in_float64():
    """docs/decisions.md#tvmax-solver-precision: the prox runs in float64 by default whatever the scores' dtype, so
    float32 scores give the float64 solve's weights rounded once (fused groups exactly flat)."""
    z = _random_scores(8, 16, scale=0.3).float()
    expected = tvmax(z.double(), (8, 8), lam=0.05).float()
    assert torch.equal(tvmax(z, (8, 8), lam=0.05), expected)
    assert not torch.equal(tvmax(z, (8, 8), lam=0.05, dtype=None), expected)  # the float32 solve is not it


# -- backward ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("lam,scale", [(0.01, 0.05), (0.1, 1.0), (0.3, 1.0)])
def test_backward_matches_finite_differences(lam, scale):
    z = _random_scores(2, 11, scale).requires_grad_()
    p = tvmax(z, (8, 8), lam=lam)
    assert (p == 0).any() and (p > 0).sum() > 2  # a generic point with both zeros and fused groups
    # the solver is exact up to rounding, so central differences with the same solver are accurate
    assert torch.autograd.gradcheck(lambda x: tvmax(x, (8, 8), lam=lam), (z,), eps=1e-6, atol=1e-6)


def test_jacobians_are_symmetric_group_averages():
    z = _random_scores(1, 12, scale=0.3)[0]
    w, labels = tv2d_prox(z, (8, 8), lam=0.1, return_groups=True)
    same = (labels[:, None] == labels[None, :]).to(z.dtype)
    expected_tv = same / same.sum(1, keepdim=True)  # SparseCap Eq. 9
    jacobian_tv = torch.autograd.functional.jacobian(lambda x: tv2d_prox(x, (8, 8), lam=0.1), z)
    torch.testing.assert_close(jacobian_tv, expected_tv, atol=1e-14, rtol=0)
    jacobian = torch.autograd.functional.jacobian(lambda x: tvmax(x, (8, 8), lam=0.1), z)
    torch.testing.assert_close(jacobian, jacobian.T, atol=1e-14, rtol=0)
    s = (sparsemax(w) > 0).to(z.dtype)
    expected = (torch.diag(s) - torch.outer(s, s) / s.sum()) @ expected_tv  # J_sp(w*) J_TV (Prop. 1 chain rule)
    torch.testing.assert_close(jacobian, expected, atol=1e-14, rtol=0)


def _authors_backward(y: np.ndarray, dy: np.ndarray) -> np.ndarray:
    """The backward of the authors' layer (deep-spin/TVmax, ``core/model/tv2d_layer.py``: ``back``, called by
    ``TV2DFunction.backward`` on the output rounded to ``int(-log10(tol)) // 2`` digits), in plain Python: from each
    cell not yet grouped, in row-major order, a flood fill over the 4-neighbours (right, down, left, up) holding
    the seed's value; each cell's gradient is the mean of ``dy`` over its group."""
    rows, cols = y.shape
    dx, grouped = np.zeros_like(dy), np.zeros(y.shape, dtype=bool)
    for seed in np.ndindex(rows, cols):
        if grouped[seed]:
            continue
        group, queue = [], [seed]
        grouped[seed] = True
        while queue:
            a, b = queue.pop(0)
            group.append((a, b))
            for c, d in ((a, b + 1), (a + 1, b), (a, b - 1), (a - 1, b)):
                if 0 <= c < rows and 0 <= d < cols and not grouped[c, d] and y[c, d] == y[seed]:
                    grouped[c, d] = True
                    queue.append((c, d))
        for cell in group:
            dx[cell] = np.mean([dy[other] for other in group])
    return dx


@pytest.mark.parametrize("lam", [0.05, 0.2])
def test_backward_is_the_authors_group_average(lam):
    """The prox's vector-Jacobian product against the authors' layer's backward (SparseCap Eq. 9 as they coded it):
    the same groups, the same averages.  Their forward rounds its output to 6 digits (tol 1e-12) before grouping."""
    z = _random_scores(1, 14, scale=0.5)[0].view(8, 8).requires_grad_()
    w = tv2d_prox(z.flatten(), (8, 8), lam=lam).view(8, 8)
    dy = torch.randn(8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    (grad,) = torch.autograd.grad(w, z, dy)
    fused = len(np.unique(w.detach().numpy().round(6)))
    assert 1 < fused < 64, "a point with fused groups and more than one group"
    np.testing.assert_allclose(grad.numpy(), _authors_backward(w.detach().numpy().round(6), dy.numpy()),
                               rtol=0, atol=1e-12)


@pytest.mark.parametrize("z,grid_hw", [([0.0, 0.5], (1, 2)), ([0.0, 0.5, 0.5, 1.0], (2, 2))])
def test_neighbours_that_meet_exactly_at_the_box_face_are_one_group(z, grid_hw):
    # a jump of exactly 2λ (λ = 1/4, exact in binary) closes exactly: |u_e| = λ with no jump left, the degenerate
    # point where the dual sits on the box's face; Algorithm 1's groups are the connected components of equal
    # values, so the cells are one group and J_TV averages over it (SparseCap Eq. 9)
    z = torch.tensor([z], dtype=torch.float64, requires_grad=True)
    w, labels = tv2d_prox(z, grid_hw, lam=0.25, return_groups=True)
    assert torch.all(w == w[0, 0]) and torch.all(labels == 0)
    jacobian = torch.autograd.functional.jacobian(lambda x: tv2d_prox(x, grid_hw, lam=0.25), z)[0, :, 0]
    torch.testing.assert_close(jacobian, torch.full((z.shape[1], z.shape[1]), 1.0 / z.shape[1], dtype=torch.float64),
                               atol=1e-15, rtol=0)


def test_neighbours_that_almost_meet_at_the_box_face_stay_two_groups():
    # a jump of 2λ + 2⁻⁴⁰ leaves 2⁻⁴⁰ between the cells: two groups, each its own Jacobian block. The groups are
    # those of equal values, with no tolerance (a 1e-12 one would merge these and average across the jump)
    z = torch.tensor([[0.0, 0.5 + 2**-40]], dtype=torch.float64, requires_grad=True)
    w, labels = tv2d_prox(z, (1, 2), lam=0.25, return_groups=True)
    assert w[0, 1] - w[0, 0] == 2**-40 and labels.tolist() == [[0, 1]]
    jacobian = torch.autograd.functional.jacobian(lambda x: tv2d_prox(x, (1, 2), lam=0.25), z)[0, :, 0]
    assert torch.equal(jacobian, torch.eye(2, dtype=torch.float64))


def test_the_default_lambda_is_the_papers():
    """SparseCap §4: "For TVMAX, we set λ = 0.01", in Eq. 5 with the ½ (docs/decisions.md#tvmax-lambda-convention):
    what a call without λ and the registered normaliser use. Two cells 1 apart each move by exactly λ."""
    z = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    expected = torch.tensor([[0.99, 0.01]], dtype=torch.float64)
    torch.testing.assert_close(tv2d_prox(z, (1, 2)), expected, atol=1e-12, rtol=0)
    torch.testing.assert_close(tvmax(z, (1, 2)), expected, atol=1e-12, rtol=0)
    grid = torch.tensor([[1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)  # 2×2: the 1 loses λ to each of two neighbours
    torch.testing.assert_close(NORMALISERS["tvmax"](grid, None), tvmax(grid, (2, 2), lam=0.01), atol=1e-12, rtol=0)


def test_scores_that_do_not_fill_the_grid_are_refused_by_name():
    # two rows of 32 scores would reshape into one 8×8 grid and be solved as a single grid without the check
    with pytest.raises(ValueError, match="last dim 32 does not match the 8x8 grid"):
        tv2d_prox(torch.zeros(2, 32, dtype=torch.float64), (8, 8))
    with pytest.raises(ValueError, match="last dim 32 does not match the 8x8 grid"):
        tvmax(torch.zeros(2, 32, dtype=torch.float64), (8, 8), torch.ones(2, 32, dtype=torch.bool))


def test_a_mask_broadcasts_over_the_heads_in_front_of_the_scores():
    """Scores ``[B, heads, N]`` with a mask ``[B, 1, N]`` (one mask per image, as the region features give it): each
    head's grid is solved with its own image's mask, as if the mask had been expanded to the scores."""
    z = _random_scores(6, 18, scale=0.3).view(2, 3, 64)
    mask = torch.ones(2, 1, 64, dtype=torch.bool)
    mask[0, 0, 56:] = False  # image 0: the last row is padding; image 1: the last two
    mask[1, 0, 48:] = False
    for function in (tv2d_prox, tvmax):
        got = function(z, (8, 8), mask=mask, lam=0.05)
        torch.testing.assert_close(got, function(z, (8, 8), mask=mask.expand(2, 3, 64), lam=0.05), atol=1e-12, rtol=0)
        assert torch.all(got[0, :, 56:] == 0) and torch.all(got[1, :, 48:] == 0)


def test_masked_cells_join_no_group_even_at_the_real_cells_value():
    """A masked cell's prox is 0, and so is that of real cells whose scores are all 0 (all fused): equal neighbours,
    but no edge joins them (the masked cell's edges are dropped, their dual pinned at 0), so the masked cells stay
    groups of their own and the real cells' Jacobian averages over the six real cells only (SparseCap Eq. 9)."""
    mask = torch.tensor([True] * 6 + [False] * 3)
    z = torch.zeros(1, 9, dtype=torch.float64, requires_grad=True)
    w, labels = tv2d_prox(z, (3, 3), lam=0.05, mask=mask, return_groups=True)
    assert torch.all(w == 0) and labels.tolist() == [[0] * 6 + [6, 7, 8]]
    jacobian = torch.autograd.functional.jacobian(lambda x: tv2d_prox(x, (3, 3), lam=0.05, mask=mask), z)[0, :, 0]
    expected = torch.zeros(9, 9, dtype=torch.float64)
    expected[:6, :6] = 1.0 / 6
    torch.testing.assert_close(jacobian, expected, atol=1e-15, rtol=0)


def test_without_autograd_the_returned_groups_are_still_those_of_equal_values():
    """``return_groups`` outside autograd (the no-grad solve, as grounding and evaluation call it) gives Algorithm 1's
    groups too: two cells meeting exactly at the box's face are one group, as with a backward pass to prepare."""
    z = torch.tensor([[0.0, 0.5]], dtype=torch.float64)
    with torch.no_grad():
        w, labels = tv2d_prox(z, (1, 2), lam=0.25, return_groups=True)
    assert torch.all(w == 0.25) and labels.tolist() == [[0, 0]]


def test_the_tree_certificate_bounds_the_error_by_what_its_flow_leaves():
    """_tree_certificate's proven bound is ‖ρ‖₂ with ρ the group means of the remainder ``r`` (the part of the demand
    no flow inside a group can carry): a demand of 1.5 and 0.5 on one fused pair (which a flow could carry only if it
    summed to 0; here rounding is played by a whole 2) leaves ρ = (1, 1), a bound of √2, not the 1 of a size
    counted twice. Both the cells of the group and the pair's edge inside the box: ``carried``."""
    grid = _Grid((1, 2), torch.device("cpu"), torch.float64)
    demand = torch.tensor([[1.5, 0.5]], dtype=torch.float64)
    carried, error = module._tree_certificate(demand, torch.tensor([[True]]), torch.zeros(1, 1, dtype=torch.float64),
                                              torch.tensor([[0, 0]]), torch.tensor([[2.0, 1.0]], dtype=torch.float64),
                                              10.0, grid)
    assert carried.tolist() == [True]
    torch.testing.assert_close(error, torch.tensor([math.sqrt(2.0)], dtype=torch.float64), atol=1e-15, rtol=0)


# -- registry -----------------------------------------------------------------------------------------------------
def test_normaliser_entry_infers_a_square_grid():
    z = _random_scores(2, 13).float()
    mask = torch.ones(2, 64, dtype=torch.bool)
    torch.testing.assert_close(NORMALISERS["tvmax"](z, mask), tvmax(z, (8, 8), mask, lam=0.01))
    torch.testing.assert_close(get_normaliser("tvmax", lam=0.3)(z, None), tvmax(z, (8, 8), lam=0.3))
    # scores [..., N], as every normaliser takes them (heads or beams in front): the grid is read off the last dim
    torch.testing.assert_close(NORMALISERS["tvmax"](z.view(1, 2, 64), None), tvmax(z, (8, 8), lam=0.01).view(1, 2, 64))
    with pytest.raises(ValueError, match="square"):
        NORMALISERS["tvmax"](torch.randn(2, 10), None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_matches_cpu_and_is_deterministic():
    z = _random_scores(64, 14, scale=0.3)
    on_gpu = tvmax(z.cuda(), (8, 8), lam=0.05)
    torch.testing.assert_close(on_gpu.cpu(), tvmax(z, (8, 8), lam=0.05), atol=1e-12, rtol=0)
    assert torch.equal(on_gpu, tvmax(z.cuda(), (8, 8), lam=0.05))


@pytest.mark.parametrize("grid_hw", [(1, 1), (1, 5), (4, 1), (3, 4), (16, 16)])
def test_grid_operators_as_shifted_differences_equal_the_difference_matrix(grid_hw):
    """On a CPU the solver applies D, Dᵀ, |D|ᵀ and the FISTA matrix K = I − DDᵀ/L as shifted differences of the
    grid; on accelerators as products with the dense matrices. Both against the matrix built from the edge list."""
    h, w = grid_hw
    diff = torch.from_numpy(_difference_matrix(h, w))
    stencil = _Grid(grid_hw, torch.device("cpu"), torch.float64, dense=False)
    dense = _Grid(grid_hw, torch.device("cpu"), torch.float64, dense=True)
    assert stencil.dense_rows == 0 and dense.dense_rows == math.inf
    # by default on a CPU: products for small grids, and for a 16×16 grid at one row (beam 1) but not at three
    assert _Grid((8, 8), torch.device("cpu"), torch.float64).dense_rows == math.inf
    assert 1 < _Grid((16, 16), torch.device("cpu"), torch.float64).dense_rows <= 3
    generator = torch.Generator().manual_seed(h * 31 + w)
    cells = torch.randn(5, h * w, generator=generator, dtype=torch.float64)
    edges = torch.randn(5, diff.shape[0], generator=generator, dtype=torch.float64)
    offset = torch.randn_like(edges)
    kernel = torch.eye(diff.shape[0], dtype=torch.float64) - diff @ diff.T / max(stencil.lipschitz, 1e-12)
    for ops in (stencil, dense):
        torch.testing.assert_close(ops.jump(cells), cells @ diff.T, rtol=0, atol=1e-12)
        torch.testing.assert_close(ops.spread(edges), edges @ diff, rtol=0, atol=1e-12)
        torch.testing.assert_close(ops.spread(edges, signed=False), edges @ diff.abs(), rtol=0, atol=1e-12)
        torch.testing.assert_close(ops.iterate(offset, edges), offset + edges @ kernel, rtol=0, atol=1e-12)


def test_the_dense_operators_of_accelerators_give_the_same_prox(monkeypatch):
    """The accelerator path (dense products), run on the CPU, certifies the same prox as the CPU path."""
    scores = torch.randn(24, 256, generator=torch.Generator().manual_seed(4), dtype=torch.float64) * 0.05
    mask = torch.rand(24, 256, generator=torch.Generator().manual_seed(5)) > 0.1
    shifted = [module.tv2d_prox(scores, (16, 16), 0.01, m, return_groups=True) for m in (None, mask)]
    monkeypatch.setattr(module, "_operators", lambda hw, device, dtype: module._Grid(hw, device, dtype, dense=True))
    for m, (want, groups) in zip((None, mask), shifted):
        got, got_groups = module.tv2d_prox(scores, (16, 16), 0.01, m, return_groups=True)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-9)
        assert torch.equal(got_groups, groups)


def test_accelerators_always_take_the_dense_products():
    """docs/tvmax.md: on an accelerator every launch costs more than the arithmetic, so a grid of any size takes the
    dense products there (a 16×16 grid at three rows does not on a CPU); an explicit choice holds on any device.
    The meta device stands in for an accelerator: only the device type decides."""
    meta = torch.device("meta")
    assert _Grid((16, 16), meta, torch.float64).dense_rows == math.inf
    assert _Grid((16, 16), meta, torch.float64, dense=False).dense_rows == 0
