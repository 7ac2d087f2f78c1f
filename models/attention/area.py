"""Area attention (Li et al. 2019, "Area Attention", arXiv:1810.10126): attend to groups of adjacent items.

An *area* is a span of 1..S adjacent items of a 1D memory or an axis-aligned rectangle of 1..H × 1..W cells of a
2D grid (Area attention §2, Fig. 1–2).  Attention runs over all areas up to the maximum size:

* area key  ``μ_r = (1/|r|) Σ_{j∈r} k_j``                                   (Eq. 3, the parameter-free form)
* area value ``v_r = Σ_{j∈r} v_j``                                          (Eq. 4)
* or the combined-feature key ``k_r = ReLU(μ_r W_μ + σ_r W_σ + e_r W_e) W_d`` with the per-dimension standard
  deviation ``σ_r`` (Eq. 5) and learned height/width embeddings ``e_r = [1(h_r)E^h; 1(w_r)E^w]`` (Eq. 6–9),
* then ordinary attention over areas, ``a_r = softmax_r(q·k_r/√d)`` and ``o = Σ_r a_r v_r`` (Eq. 1–2).

Every area feature is built from area sums.  The paper takes them from summed-area tables (integral images, §2.2,
Eq. 10–11, Algorithm 1); :func:`area_sums` adds shifted slices instead (an area is a smaller one plus one row or
column), which gives the same sums with one addition per area and none of the table's cancellation.

Areas are listed in the order of Algorithm 1: height ``h = 1..H`` outer, width ``w = 1..W`` inner, then
top-left corners in row-major order.  A 1D memory of length ``L`` is the grid ``1 × L`` with areas ``1 × S``.
Masking (docs/decisions.md#area-masking): an area is masked as soon as it holds one masked item, so with the causal
mask of decoder self-attention a query only sees spans that end at or before its own position.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .softmax import masked_softmax

Grid = tuple[int, int]


# -- counting and enumerating areas ------------------------------------------------------------------------------
def area_count_1d(length: int, max_size: int) -> int:
    """``|R| = (L − S)S + S(S+1)/2`` (Area attention §2), with ``S`` clamped to ``L``."""
    s = min(max_size, length)
    return (length - s) * s + s * (s + 1) // 2


def area_count_2d(rows: int, cols: int, max_h: int, max_w: int) -> int:
    """``|R| = |R_v| · |R_h|`` with each factor the 1D count (§2 of the paper): 225 for 8×8 up to 2×2, 441 up to 3×3."""
    return area_count_1d(rows, max_h) * area_count_1d(cols, max_w)


def _check(rows, cols, max_h: int, max_w: int) -> None:
    # under an ONNX trace the grid sizes are traced values: comparing them would freeze them (and they are the
    # shapes of real tensors there, so positive)
    if not torch.jit.is_tracing() and min(rows, cols, max_h, max_w) < 1:
        raise ValueError(f"grid {rows}×{cols} and maximum area {max_h}×{max_w} must all be positive")


def _clamp(rows: int, cols: int, max_h: int, max_w: int) -> tuple[int, int]:
    # larger maxima would give empty ranges of corners (so both are clamped to the grid)
    _check(rows, cols, max_h, max_w)
    return min(max_h, rows), min(max_w, cols)


@lru_cache(maxsize=256)
def _boxes(rows: int, cols: int, max_h: int, max_w: int) -> Tensor:
    max_h, max_w = _clamp(rows, cols, max_h, max_w)
    out = []
    for h in range(1, max_h + 1):
        for w in range(1, max_w + 1):
            r0, c0 = torch.meshgrid(torch.arange(rows - h + 1), torch.arange(cols - w + 1), indexing="ij")
            r0, c0 = r0.reshape(-1), c0.reshape(-1)
            out.append(torch.stack([r0, c0, r0 + h - 1, c0 + w - 1], 1))
    return torch.cat(out)


def enumerate_areas_2d(rows: int, cols: int, max_h: int, max_w: int) -> Tensor:
    """All areas of a ``rows × cols`` grid up to ``max_h × max_w``, as ``[|R|, 4]`` long boxes
    ``(r1, c1, r2, c2)`` with inclusive cell coordinates, in the order of Area attention Algorithm 1."""
    return _boxes(rows, cols, max_h, max_w).clone()


def enumerate_areas_1d(length: int, max_size: int) -> Tensor:
    """All spans of 1..``max_size`` items of a length-``length`` sequence as ``[|R|, 2]`` (start, end), inclusive."""
    return _boxes(1, length, 1, max_size)[:, [1, 3]].clone()


@lru_cache(maxsize=256)
def _shapes(rows: int, cols: int, max_h: int, max_w: int, device: torch.device) -> Tensor:
    """Height and width of every area, ``[|R|, 2]`` long (the ``S_h``, ``S_w`` of Algorithm 1), made once per grid
    and device and shared (read-only): a decoding step needs them in every area layer."""
    boxes = _boxes(rows, cols, max_h, max_w)
    return torch.stack([boxes[:, 2] - boxes[:, 0] + 1, boxes[:, 3] - boxes[:, 1] + 1], 1).to(device)


# -- area sums ---------------------------------------------------------------------------------------------------
def _accumulator(x: Tensor) -> torch.dtype:
    # E[x²] − μ² cancels when an area's spread is small next to its offset (in float32, σ of a low-spread area comes
    # out visibly wrong), so the second moments are taken in float64
    return torch.float32 if x.device.type == "mps" else torch.float64


def _area_pieces(grid: Tensor, max_h: int, max_w: int):
    """``(h, w, part)`` for every area shape in the order of Algorithm 1 (height outer, width inner), where
    ``part [..., rows − h + 1, cols − w + 1, D]`` holds the sums of ``grid [..., rows, cols, D]`` over the
    ``h × w`` areas by their top-left corners.

    The sums of ``w`` adjacent columns are those of ``w − 1`` columns plus the next column, and an area of height
    ``h`` is one of height ``h − 1`` plus the next row.  Shapes larger than the grid come out empty, so the grid
    size is never compared with the maxima: slicing by constant offsets keeps it symbolic in an ONNX trace, where a
    growing caption's length is an input (models/area_transformer.py, decoder self-attention over caption spans).
    """
    across = [grid]  # across[w − 1][..., r, c, :] = Σ_{b<w} x[r, c + b]
    for width in range(2, max_w + 1):
        across.append(across[-1][..., :-1, :] + grid[..., width - 1:, :])
    down = across  # down[w − 1][..., r, c, :] = Σ_{a<h, b<w} x[r + a, c + b]
    for height in range(1, max_h + 1):
        if height > 1:
            down = [prev[..., :-1, :, :] + run[..., height - 1:, :, :] for prev, run in zip(down, across)]
        yield from ((height, width, part) for width, part in enumerate(down, 1))


def area_sums(x: Tensor, rows: int, cols: int, max_h: int, max_w: int) -> Tensor:
    """Sum of the item vectors of every area: ``x [..., rows*cols, D]`` → ``[..., |R|, D]`` (Area attention Eq. 4).

    The paper gets these from a summed-area table (Eq. 10–11, Algorithm 1): ``Ĩ[r2+1, c2+1] − Ĩ[r1, c2+1] −
    Ĩ[r2+1, c1] + Ĩ[r1, c1]``.  We build them by adding shifted slices instead (:func:`_area_pieces`), which
    costs one addition per area (the table costs a four-corner gather and three subtractions per area, and its
    backward a scatter).  The sums are the same, and exact to the rounding of at most ``max_h · max_w``
    additions: unlike the table's differences of large entries they do not lose digits, so no wider float is
    needed.
    """
    _check(rows, cols, max_h, max_w)
    if not torch.jit.is_tracing() and x.shape[-2] != rows * cols:
        raise ValueError(f"memory has {x.shape[-2]} items, not a {rows}×{cols} grid")
    # unflatten, not reshape(*lead, …), and -1 for the columns: the leading sizes and the length of a 1D memory
    # stay symbolic in an ONNX trace (any row count, any caption length)
    pieces = _area_pieces(x.unflatten(-2, (rows, -1)), max_h, max_w)
    return torch.cat([part.flatten(-3, -2) for _, _, part in pieces], -2)


def _ones_like_traced(x: Tensor) -> Tensor:
    """True of ``x``'s shape, made from its values element by element.  The ONNX exporter turns ``ones_like``
    or ``arange`` of a computed tensor's size into a constant of the example's shape (it keeps only the sizes of
    graph inputs symbolic); an elementwise test of the values keeps every size symbolic."""
    nan = x.isnan()
    return nan | ~nan


def _traced_area_shapes(like: Tensor, rows: int, max_h: int, max_w: int) -> Tensor:
    """:func:`_shapes` computed from the shape of ``like [..., rows*cols, D]`` by tensor operations, so that
    it follows a symbolic grid size in an ONNX trace (:func:`_shapes` enumerates boxes in Python, once per
    grid)."""
    ones = _ones_like_traced(like[(0,) * (like.dim() - 2)][:, :1]).long().view(rows, -1, 1)
    shape_of = {(h, w): torch.tensor([h, w], device=like.device) for h in range(1, max_h + 1)
                for w in range(1, max_w + 1)}
    # a part holds the sums h·w of ones: [corners, 1] → the shape of every corner's area, [corners, 2]
    return torch.cat([part.flatten(0, 1) // (h * w) * shape_of[h, w]
                      for h, w, part in _area_pieces(ones, max_h, max_w)])


def area_features_2d(x: Tensor, rows: int, cols: int, max_h: int, max_w: int,
                     eps: float = 1e-6) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Mean, standard deviation and sum of every area, plus the area shapes (Area attention Algorithm 2).

    ``x [..., rows*cols, D]`` → ``mean, std, sum [..., |R|, D]`` and ``sizes [|R|, 2]`` (height, width; shared
    between calls, not to be modified).
    ``σ = sqrt(|E[x²] − μ²| + eps)`` (Eq. 12 with the guard of tensor2tensor's code; ``eps=0`` gives the plain
    formula).  The variance is taken of ``x`` minus its first item: σ does not change under a shift, and
    centring keeps ``E[x²] − μ²`` from cancelling when the items share a large offset; the first item (not the
    mean) is used so a causal memory and its prefix are centred identically.  The moments of σ are computed in
    float64; the sums (:func:`area_sums`) need no wider float.
    """
    # eager: the cached enumeration (a decoding step calls this per layer); traced: the tensor form, whose count
    # follows a caption length that is a graph input
    sizes = (_traced_area_shapes(x, rows, max_h, max_w) if torch.jit.is_tracing()
             else _shapes(rows, cols, max_h, max_w, x.device))
    total = area_sums(x, rows, cols, max_h, max_w)
    count = (sizes[:, 0] * sizes[:, 1]).unsqueeze(-1)
    wide = x.to(_accumulator(x))
    centred = wide - wide[..., :1, :]
    # both moments in one pass over the areas
    shifted_sum, second_sum = area_sums(torch.cat([centred, centred * centred], -1), rows, cols, max_h,
                                        max_w).chunk(2, -1)
    wide_count = count.to(wide.dtype)
    shifted_mean = shifted_sum / wide_count
    # a single item has no spread; rounding could leave noise there that the square root magnifies (and that
    # differs between a causal memory and its prefix), so use the exact zero
    # (a number, not zeros_like: an ONNX trace folds zeros_like into a constant of the example's batch size)
    variance = torch.where(wide_count > 1, (second_sum / wide_count - shifted_mean ** 2).abs(), 0.0)
    std = torch.sqrt(variance + eps)
    return total / count.to(total.dtype), std.to(x.dtype), total, sizes


def area_features_1d(x: Tensor, max_size: int, eps: float = 1e-6) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`area_features_2d` of a sequence ``x [..., L, D]`` seen as a ``1 × L`` grid with ``1 × S`` areas."""
    return area_features_2d(x, 1, x.shape[-2], 1, max_size, eps)


def area_mask(item_mask: Tensor, rows: int, cols: int, max_h: int, max_w: int) -> Tensor:
    """``item_mask [..., N]`` (True = usable) → ``[..., |R|]``, False for every area that holds at least one
    masked item (area sums of the masked-item indicator, as tensor2tensor does; docs/decisions.md#area-masking)."""
    masked = (~item_mask).to(torch.float32).unsqueeze(-1)
    return area_sums(masked, rows, cols, max_h, max_w).squeeze(-1) < 0.5


def causal_area_mask(length: int, max_size: int, device: torch.device | str | None = None) -> Tensor:
    """``[L, |R|]``: query ``t`` may use a 1D area only if the area holds no position after ``t``."""
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    return area_mask(causal, 1, length, 1, max_size)


# -- from areas back to cells (docs/decisions.md#area-to-cell-attribution) -----------------------------------------
def membership(areas: Tensor, rows: int, cols: int) -> Tensor:
    """``[|R|, rows*cols]`` 0/1 matrix: entry ``(r, j)`` is 1 when cell ``j`` (row-major) lies inside area ``r``."""
    r = torch.arange(rows, device=areas.device).repeat_interleave(cols)
    c = torch.arange(cols, device=areas.device).repeat(rows)
    inside = ((areas[:, 0:1] <= r) & (r <= areas[:, 2:3]) & (areas[:, 1:2] <= c) & (c <= areas[:, 3:4]))
    return inside.to(torch.float32)


def areas_to_cells(area_weights: Tensor, areas: Tensor, n_cells: int | Grid, value_mode: str = "sum") -> Tensor:
    """Per-cell coefficients ``c_j = Σ_{r∋j} a_r`` of area weights ``[..., |R|]`` → ``[..., N]``
    (docs/decisions.md#area-to-cell-attribution).

    With sum values (Eq. 4) the attention output is ``Σ_r a_r Σ_{j∈r} v_j = Σ_j c_j v_j``, so ``c_j`` is exactly
    how much cell ``j`` contributes; ``Σ_j c_j = Σ_r a_r |r|``.  With ``value_mode="mean"`` it is
    ``Σ_{r∋j} a_r/|r|``.  ``areas`` are ``(r1, c1, r2, c2)`` boxes; ``n_cells`` is the grid ``(rows, cols)`` or the
    number of cells ``N`` (the grid width is then read off the boxes: the 1×1 areas cover every column).
    """
    if isinstance(n_cells, int):
        cols = int(areas[:, 3].max()) + 1
        rows = n_cells // cols
        if rows * cols != n_cells:
            raise ValueError(f"{n_cells} cells do not form a grid {cols} wide")
    else:
        rows, cols = n_cells
    member = membership(areas, rows, cols).to(area_weights.dtype)
    if value_mode == "mean":
        member = member / member.sum(1, keepdim=True)
    elif value_mode != "sum":
        raise ValueError(f"unknown value mode {value_mode!r}")
    return area_weights @ member


# -- the attention module ------------------------------------------------------------------------------------------
class AreaKeyCombiner(nn.Module):
    """Combined-feature area key ``k_r = ReLU(μ_r W_μ + σ_r W_σ + e_r W_e) W_d`` (Area attention Eq. 5–9).

    ``W_μ, W_σ, W_e`` are one ``Linear`` over ``[μ; σ; e]``.  Applied per head with weights shared across heads,
    embedding depth ``S_e = d/2`` for per-head key size ``d``, as tensor2tensor's ``compute_area_key(mode="concat")``
    does (docs/decisions.md#area-key-network; checked against a transcription in tests/test_faithfulness_audit.py).
    """

    def __init__(self, depth: int, max_h: int, max_w: int):
        super().__init__()
        embed = max(depth // 2, 1)
        self.height = nn.Embedding(max_h, embed)  # E^h, row h−1 for height h (Eq. 6)
        self.width = nn.Embedding(max_w, embed)  # E^w (Eq. 7)
        self.hidden = nn.Linear(2 * depth + 2 * embed, depth)
        self.split = [depth, depth, 2 * embed]  # the columns of W_μ, W_σ and W_e in ``hidden``
        self.out = nn.Linear(depth, depth)  # W_d

    def forward(self, mean: Tensor, std: Tensor, sizes: Tensor) -> Tensor:
        shape = torch.cat([self.height(sizes[:, 0] - 1), self.width(sizes[:, 1] - 1)], -1)  # e_r (Eq. 8)
        # e_r W_e is the same for every image and head: added by broadcasting rather than expanding e_r to the
        # batch, which an ONNX trace would freeze at the example's batch size (and which copied e_r per head)
        # and μ_r W_μ + σ_r W_σ as two products rather than one over a concatenated [μ; σ] the size of both
        mean_weight, std_weight, embedding = self.hidden.weight.split(self.split, 1)
        hidden = mean @ mean_weight.T + std @ std_weight.T + F.linear(shape, embedding, self.hidden.bias)
        return self.out(torch.relu(hidden))


class AreaMultiHeadAttention(nn.Module):
    """Multi-head scaled dot-product attention over areas of the memory (within each head, Area attention §1).

    ``max_area=(1, 1)`` with mean keys is ordinary multi-head attention (taken by a direct path, so it matches
    exactly).  The memory is a ``rows × cols`` grid, or a sequence as the grid ``1 × L`` with
    ``max_area=(1, S)``.  ``forward`` does everything; a decoder splits it into :meth:`memory_areas` (area keys
    and values, once per image or per step) and :meth:`attend` (per query).
    """

    def __init__(self, d_model: int, n_heads: int, max_area: Grid = (1, 1), key_mode: str = "mean"):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model {d_model} is not divisible by {n_heads} heads")
        if key_mode not in ("mean", "combined"):
            raise ValueError(f"unknown area key mode {key_mode!r}; choose mean or combined")
        self.n_heads, self.head_dim = n_heads, d_model // n_heads
        self.max_area = (int(max_area[0]), int(max_area[1]))
        self.key_mode = key_mode
        self.q, self.k, self.v, self.o = (nn.Linear(d_model, d_model) for _ in range(4))
        self.combiner = AreaKeyCombiner(self.head_dim, *self.max_area) if key_mode == "combined" else None

    @property
    def uses_areas(self) -> bool:
        return self.max_area != (1, 1) or self.combiner is not None

    def boxes(self, grid: Grid) -> Tensor:
        return enumerate_areas_2d(*grid, *self.max_area)

    def _heads(self, x: Tensor) -> Tensor:  # [B, L, D] → [B, heads, L, d]
        return x.unflatten(-1, (self.n_heads, self.head_dim)).transpose(1, 2)

    def memory_areas(self, keys: Tensor, values: Tensor, grid: Grid,
                     key_mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
        """Area keys and values ``[B, heads, |R|, d]`` from projected item keys/values ``[B, N, D]``, and the
        usable areas ``[B, 1, |R|]`` (None when nothing is masked)."""
        if key_mask is not None:
            # zero padded items so that they add nothing to the area sums of the real ones
            keys = keys.masked_fill(~key_mask.unsqueeze(-1), 0.0)
            values = values.masked_fill(~key_mask.unsqueeze(-1), 0.0)
        k, v = self._heads(keys), self._heads(values)
        allowed = None
        if not self.uses_areas:
            if key_mask is not None:
                allowed = key_mask.unsqueeze(1)
            return k, v, allowed
        mean, std, _, sizes = area_features_2d(k, *grid, *self.max_area)
        area_k = mean if self.combiner is None else self.combiner(mean, std, sizes)
        area_v = area_sums(v, *grid, *self.max_area)
        if key_mask is not None:
            allowed = area_mask(key_mask, *grid, *self.max_area).unsqueeze(1)
        return area_k, area_v, allowed

    def prefix_areas(self, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """:meth:`memory_areas` of a sequence ``[B, L, D]`` for a query at its newest position (every span is in
        that query's past): a decoder's cached self-attention.

        The sequence is padded on the left with ``S − 1`` masked items, so it is never shorter than the longest
        span: the areas then follow ``L`` through tensor shapes alone, and one ONNX trace serves every step
        (masked areas get no weight, so the attention is the same as over the unpadded spans)."""
        span = self.max_area[1]
        if not self.uses_areas:
            return self.memory_areas(keys, values, (1, keys.shape[1]))
        keys, values = F.pad(keys, (0, 0, span - 1, 0)), F.pad(values, (0, 0, span - 1, 0))
        real = _ones_like_traced(keys[:1, :, 0]).long().cumsum(1) > span - 1  # [1, L + S − 1], False on the padding
        return self.memory_areas(keys, values, (1, keys.shape[1]), real)

    def attend(self, query: Tensor, area_k: Tensor, area_v: Tensor,
               allowed: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``query [B, T, D]`` (not yet projected) → output ``[B, T, D]`` and area weights ``[B, heads, T, |R|]``;
        ``allowed`` broadcasts to ``[B, T, |R|]`` (Eq. 1–2 over areas)."""
        # 1/√d on the queries, not on the larger score tensor
        q = self._heads(self.q(query) / math.sqrt(self.head_dim))
        scores = q @ area_k.transpose(-1, -2)
        if allowed is not None and not torch.jit.is_tracing() and bool(allowed.all()):
            allowed = None  # nothing to mask (a whole grid): spare the masked softmax its passes over the scores
        weights = masked_softmax(scores, None if allowed is None else allowed.unsqueeze(1))
        out = (weights @ area_v).transpose(1, 2).flatten(2)
        return self.o(out), weights

    def attend_rows(self, query: Tensor, area_k: Tensor, area_v: Tensor, allowed: Tensor | None,
                    rows: Tensor) -> Tensor:
        """:meth:`attend`'s output for ``query [B, T, D]`` where row ``b`` attends over the areas of image
        ``rows[b]`` of ``area_k``/``area_v [I, heads, |R|, d]`` (``allowed [I, 1, |R|]`` or None).

        The captions of an image become one longer query sequence, so the area keys and values are read per image
        instead of being copied to every caption (and their gradient summed back); each query attends on its own,
        so the result is the same."""
        images, (batch, length, width) = area_k.shape[0], query.shape
        counts = torch.bincount(rows, minlength=images)
        order = rows.argsort(stable=True)
        slot = torch.empty_like(rows)
        slot[order] = torch.arange(batch, device=rows.device) - (counts.cumsum(0) - counts)[rows[order]]
        per_image = int(counts.max())  # captions of the most captioned image: the others are padded to it
        place = rows * per_image + slot
        grouped = query.new_zeros(images * per_image, length, width).index_copy(0, place, query)
        out, _ = self.attend(grouped.view(images, per_image * length, width), area_k, area_v, allowed)
        return out.view(images * per_image, length, width).index_select(0, place)

    def forward(self, query: Tensor, memory: Tensor, grid: Grid | None = None, key_mask: Tensor | None = None,
                causal: bool = False) -> tuple[Tensor, Tensor]:
        """Attend from ``query [B, T, D]`` over the areas of ``memory [B, N, D]``.

        ``grid`` defaults to the sequence ``(1, N)``.  ``causal`` (1D only, ``T == N``) lets query ``t`` use only
        areas that end at or before ``t``.
        """
        grid = grid or (1, memory.shape[1])
        area_k, area_v, allowed = self.memory_areas(self.k(memory), self.v(memory), grid, key_mask)
        if causal:
            if grid[0] != 1 or query.shape[1] != memory.shape[1]:
                raise ValueError("causal area attention needs a 1D memory aligned with the queries")
            if self.uses_areas:
                future = causal_area_mask(memory.shape[1], self.max_area[1], memory.device)
            else:
                future = torch.ones(query.shape[1], query.shape[1], dtype=torch.bool, device=memory.device).tril()
            allowed = future.unsqueeze(0) if allowed is None else allowed & future
        return self.attend(query, area_k, area_v, allowed)
