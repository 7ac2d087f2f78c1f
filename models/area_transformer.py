"""AreaTransformer: a Transformer captioner over the grid cells with area attention (Li et al. 2019, "Area
Attention", arXiv:1810.10126, §3.2).

The encoder runs over the cells (learned row + column embeddings: docs/decisions.md#areatransformer-cell-positions);
the decoder is a Transformer decoder over the caption.  Area attention (:mod:`captioner.models.attention.area`)
replaces ordinary attention in the first ``area_layers`` layers (paper: 2): 2D areas up to ``encoder_area`` in encoder
self-attention, up to ``decoder_area`` in decoder cross-attention, and 1D areas up to ``caption_area`` in decoder
self-attention; ``area_key`` picks the basic mean key (Eq. 3) or the combined-feature key (Eq. 9, the paper's
"*").  Defaults are a small CPU model with the paper's best image setting, 3×3*;
``d_model=512, n_heads=8, enc_layers=dec_layers=6, ffn_dim=2048`` is the paper's T2T8x8.

The attention exported for a word (docs/decisions.md#exported-attention-of-multi-head-models) is the last decoder
layer's cross-attention, averaged over heads and, when that layer attends over areas, spread back onto cells with
``c_j = Σ_{r∋j} a_r`` (docs/decisions.md#area-to-cell-attribution) and renormalised.  Extras: ``areas`` (head-averaged
area weights of the last decoder layer whose cross-attention uses areas; boxes from
:meth:`AreaTransformer.area_boxes`), ``cell_mass`` (``Σ_j c_j`` before renormalising, when the last layer uses areas)
and ``layer{i}`` (every layer's cell map).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention.area import AreaMultiHeadAttention, Grid, areas_to_cells, enumerate_areas_2d
from .layers import FeedForward, sinusoid_positions
from .protocol import AttnRecord, Captioner, DecState, EncState, VisualBatch
from .registry import register


def _area(value: Any, rows: int = 1) -> tuple[int, int] | None:
    """Config value → maximum area: None/0 (off), an int (square, or a length when ``rows`` is 1), or [h, w]."""
    if not value:
        return None
    if isinstance(value, int):
        return (1, value) if rows == 1 else (value, value)
    return int(value[0]), int(value[1])


class _Sublayer(nn.Module):
    """Residual + dropout + LayerNorm around one sublayer, post-norm (Vaswani et al.) or pre-norm."""

    def __init__(self, d_model: int, dropout: float, pre_norm: bool):
        super().__init__()
        self.norm, self.drop, self.pre_norm = nn.LayerNorm(d_model), nn.Dropout(dropout), pre_norm

    def forward(self, x: Tensor, fn) -> tuple[Tensor, Any]:
        out, extra = fn(self.norm(x) if self.pre_norm else x)
        x = x + self.drop(out)
        return (x if self.pre_norm else self.norm(x)), extra


class _EncoderLayer(nn.Module):
    def __init__(self, d_model, n_heads, ffn_dim, dropout, pre_norm, area, area_key):
        super().__init__()
        self.attn = AreaMultiHeadAttention(d_model, n_heads, area or (1, 1), area_key if area else "mean")
        self.ffn = FeedForward(d_model, ffn_dim, dropout)
        self.sub1, self.sub2 = _Sublayer(d_model, dropout, pre_norm), _Sublayer(d_model, dropout, pre_norm)

    def forward(self, x: Tensor, grid: Grid, mask: Tensor) -> Tensor:
        x, _ = self.sub1(x, lambda y: self.attn(y, y, grid, mask))
        return self.sub2(x, lambda y: (self.ffn(y), None))[0]


class _DecoderLayer(nn.Module):
    def __init__(self, d_model, n_heads, ffn_dim, dropout, pre_norm, caption_area, image_area, area_key):
        super().__init__()
        self.self_attn = AreaMultiHeadAttention(d_model, n_heads, caption_area or (1, 1),
                                                area_key if caption_area else "mean")
        self.cross = AreaMultiHeadAttention(d_model, n_heads, image_area or (1, 1), area_key if image_area else "mean")
        self.ffn = FeedForward(d_model, ffn_dim, dropout)
        self.subs = nn.ModuleList(_Sublayer(d_model, dropout, pre_norm) for _ in range(3))

    def forward(self, x: Tensor, self_attend, cross_attend) -> tuple[Tensor, Tensor | None]:
        """``self_attend(y)`` is the (cached or causal) self-attention, ``cross_attend(y)`` the attention over the
        image's areas; each returns its output and weights (or None)."""
        x, _ = self.subs[0](x, self_attend)
        x, weights = self.subs[1](x, cross_attend)
        return self.subs[2](x, lambda y: (self.ffn(y), None))[0], weights


@register("area-transformer")
class AreaTransformer(Captioner):
    """A Transformer captioner with area attention in its first ``area_layers`` layers (Li et al., "Area
    Attention", arXiv:1810.10126, §3.2 and Table 4): 2D areas of the grid in the encoder's self-attention and the
    decoder's cross-attention, 1D spans of the caption in the decoder's self-attention.  Area keys are the mean of
    Eq. 3 or the combined key of Eq. 9 (from the features of Eq. 5–8), area values the sums of Eq. 4, and the
    attention Eq. 1–2 over the areas with a scaled dot product as ``f_att``
    (:class:`~captioner.models.attention.area.AreaMultiHeadAttention`).  The rest is the Transformer of Vaswani
    et al. (arXiv:1706.03762), with learned cell positions (docs/decisions.md#areatransformer-cell-positions).
    """

    attention_kind = "area_attention"

    def __init__(self, vocab_size: int, feat_dim: int, d_model: int = 256, n_heads: int = 4, enc_layers: int = 2,
                 dec_layers: int = 2, ffn_dim: int = 1024, dropout: float = 0.1, encoder_area: Any = 3,
                 decoder_area: Any = 3, caption_area: Any = None, area_key: str = "combined", area_layers: int = 2,
                 pre_norm: bool = False, grid_hw: Any = None, max_grid: int = 32, **ids: int):
        super().__init__(vocab_size, feat_dim, **ids)
        self.hparams = dict(d_model=d_model, n_heads=n_heads, enc_layers=enc_layers, dec_layers=dec_layers,
                            ffn_dim=ffn_dim, dropout=dropout, encoder_area=encoder_area, decoder_area=decoder_area,
                            caption_area=caption_area, area_key=area_key, area_layers=area_layers,
                            pre_norm=pre_norm, grid_hw=list(grid_hw) if grid_hw else None, max_grid=max_grid)
        self.grid_hw = tuple(grid_hw) if grid_hw else None
        self.d_model = d_model
        enc_area, dec_area, cap_area = _area(encoder_area, 2), _area(decoder_area, 2), _area(caption_area, 1)
        self.proj = nn.Linear(feat_dim, d_model)
        self.row_embed, self.col_embed = nn.Embedding(max_grid, d_model), nn.Embedding(max_grid, d_model)
        self.embed = nn.Embedding(vocab_size, d_model, padding_idx=self.pad_id)
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.ModuleList(
            _EncoderLayer(d_model, n_heads, ffn_dim, dropout, pre_norm, enc_area if i < area_layers else None, area_key)
            for i in range(enc_layers))
        self.decoder = nn.ModuleList(
            _DecoderLayer(d_model, n_heads, ffn_dim, dropout, pre_norm, cap_area if i < area_layers else None,
                          dec_area if i < area_layers else None, area_key) for i in range(dec_layers))
        # pre-norm leaves the residual stream un-normalised, so it needs a final LayerNorm on each side
        self.enc_norm = nn.LayerNorm(d_model) if pre_norm else nn.Identity()
        self.dec_norm = nn.LayerNorm(d_model) if pre_norm else nn.Identity()
        self.out = nn.Linear(d_model, vocab_size)

    def config(self) -> dict[str, Any]:
        return dict(vocab_size=self.vocab_size, feat_dim=self.feat_dim, **self.hparams)

    # -- encoder ------------------------------------------------------------------------------------------------
    def _grid(self, vis: VisualBatch) -> Grid:
        n = vis.feats.shape[1]
        candidates = [g.grid_hw for g in vis.geometry[:1] if g.grid_hw] + [self.grid_hw]
        for grid in candidates:
            if grid and grid[0] * grid[1] == n:
                return int(grid[0]), int(grid[1])
        side = math.isqrt(n)
        if side * side != n:
            raise ValueError(f"AreaTransformer needs grid features; cannot lay {n} items out as a grid "
                             "(pass geometry with grid_hw or set grid_hw)")
        return side, side

    def encode(self, vis: VisualBatch) -> EncState:
        """The encoder over the ``rows × cols`` grid: projected cells plus learned row + column embeddings
        (docs/decisions.md#areatransformer-cell-positions), then ``enc_layers`` layers whose first ``area_layers``
        self-attend over 2D areas up to ``encoder_area`` (Area attention §3.2; keys Eq. 3 or 9, values Eq. 4).
        Every decoder layer's cross-attention area keys and values, and which areas hold no padding
        (docs/decisions.md#area-masking), are built here once per image."""
        rows, cols = self._grid(vis)
        if max(rows, cols) > self.row_embed.num_embeddings:
            raise ValueError(f"grid {rows}×{cols} exceeds max_grid={self.row_embed.num_embeddings}")
        feats, mask = vis.feats.to(self.proj.weight.dtype), vis.mask
        device = feats.device
        pos = (self.row_embed(torch.arange(rows, device=device)).unsqueeze(1)
               + self.col_embed(torch.arange(cols, device=device)).unsqueeze(0)).flatten(0, 1)
        x = self.drop(self.proj(feats) + pos)
        for layer in self.encoder:
            x = layer(x, (rows, cols), mask)
        memory = self.enc_norm(x)
        batch = feats.shape[0]
        enc = {"memory": memory, "mask": mask,
               "grid_hw": torch.tensor([rows, cols], device=device).expand(batch, 2).contiguous()}
        for i, layer in enumerate(self.decoder):
            # the memory is fixed while decoding: area keys/values of every cross-attention are built once here
            key, value, allowed = layer.cross.memory_areas(layer.cross.k(memory), layer.cross.v(memory),
                                                           (rows, cols), mask)
            enc[f"cross_k{i}"], enc[f"cross_v{i}"] = key, value
            enc[f"cross_mask{i}"] = allowed if allowed is not None else torch.ones(
                batch, 1, key.shape[2], dtype=torch.bool, device=device)
        return enc

    # -- decoder ------------------------------------------------------------------------------------------------
    def _embed_tokens(self, tokens: Tensor, start: int) -> Tensor:
        positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)
        return self.drop(self.embed(tokens) * math.sqrt(self.d_model) + sinusoid_positions(positions, self.d_model))

    def _cross(self, enc: EncState, i: int) -> tuple[Tensor, Tensor, Tensor]:
        return enc[f"cross_k{i}"], enc[f"cross_v{i}"], enc[f"cross_mask{i}"]

    def init_state(self, enc: EncState) -> DecState:
        empty = enc["memory"].new_zeros(enc["memory"].shape[0], 0, self.d_model)
        return {f"{kind}{i}": empty for i in range(len(self.decoder)) for kind in ("k", "v")}

    def step(self, prev_tokens: Tensor, state: DecState, enc: EncState) -> tuple[Tensor, DecState, AttnRecord]:
        """Caption position ``t`` alone, equal to position ``t`` of :meth:`forward_xe`'s causal pass: embedding × √d
        plus the sinusoidal position, then per decoder layer the self-attention over the cached positions ``≤ t``
        (1D spans up to ``caption_area`` in the first ``area_layers`` layers), the cross-attention over the image's
        areas (Area attention Eq. 1–2 over the keys of Eq. 3 or 9 and the values of Eq. 4) and the FFN.  Exports the
        last layer's cross-attention averaged over the heads and, over areas, spread back onto the cells
        (docs/decisions.md#area-to-cell-attribution)."""
        t = state["k0"].shape[1]
        x = self._embed_tokens(prev_tokens[:, None], t)
        new_state, cross_weights = {}, []
        for i, layer in enumerate(self.decoder):
            def self_attend(y: Tensor, i: int = i, layer: _DecoderLayer = layer) -> tuple[Tensor, Tensor]:
                # the cache holds projected keys/values of every earlier position; the new query is the latest
                # position, so every span of the cached sequence is in its past
                keys = torch.cat([state[f"k{i}"], layer.self_attn.k(y)], 1)
                values = torch.cat([state[f"v{i}"], layer.self_attn.v(y)], 1)
                new_state[f"k{i}"], new_state[f"v{i}"] = keys, values
                return layer.self_attn.attend(y, *layer.self_attn.prefix_areas(keys, values))

            x, weights = layer(x, self_attend, lambda y, i=i, layer=layer: layer.cross.attend(y, *self._cross(enc, i)))
            cross_weights.append(weights[:, :, 0])
        logprobs = F.log_softmax(self.out(self.dec_norm(x[:, 0])), -1)
        return logprobs, new_state, self._record(cross_weights, enc)

    def forward_xe(self, vis: VisualBatch, captions: Tensor, ss_prob: float = 0.0,
                   rows: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        """One masked parallel pass (teacher forcing).  Scheduled sampling needs sequential decoding, so a
        Transformer does not support it."""
        if ss_prob > 0.0:
            raise ValueError("AreaTransformer trains with full teacher forcing; scheduled sampling is not supported")
        # the images are encoded once and their area keys/values read per image, never copied to each caption
        enc = self.encode(vis)
        if rows is None:
            rows = torch.arange(captions.shape[0], device=captions.device)
        bos = torch.full_like(captions[:, :1], self.bos_id)
        x = self._embed_tokens(torch.cat([bos, captions[:, :-1]], 1), 0)
        for i, layer in enumerate(self.decoder):
            x, _ = layer(x, lambda y, layer=layer: layer.self_attn(y, y, causal=True),
                         lambda y, i=i, layer=layer: (layer.cross.attend_rows(y, *self._cross(enc, i), rows), None))
        return F.log_softmax(self.out(self.dec_norm(x)), -1), {}

    # -- attention export -----------------------------------------------------------------------------------------
    def _record(self, cross_weights: list[Tensor], enc: EncState) -> AttnRecord:
        grid = tuple(enc["grid_hw"][0].tolist())
        cells, extras = [], {}
        for i, (layer, weights) in enumerate(zip(self.decoder, cross_weights)):
            mean = weights.mean(1)  # over heads: [B', |R|] or [B', N]
            if layer.cross.uses_areas:
                extras["areas"] = mean
                mean = areas_to_cells(mean, layer.cross.boxes(grid).to(mean.device), grid)
                # c_j sums to Σ_r a_r |r|, not 1: renormalise for display, keep the raw mass
                # (docs/decisions.md#area-to-cell-attribution)
                mass = mean.sum(-1, keepdim=True)
                if i == len(self.decoder) - 1:
                    extras["cell_mass"] = mass
                mean = mean / mass.clamp_min(1e-12)
            extras[f"layer{i + 1}"] = mean
            cells.append(mean)
        return AttnRecord(cells[-1], extras)

    def area_boxes(self, grid_hw: Grid | None = None) -> Tensor | None:
        """``[|R|, 4]`` cell boxes ``(r1, c1, r2, c2)`` (inclusive) of the ``areas`` extra, in its order; None when
        no decoder cross-attention uses areas.  ``grid_hw`` defaults to the configured grid, else 8×8."""
        area_layers = [layer for layer in self.decoder if layer.cross.uses_areas]
        if not area_layers:
            return None
        grid = grid_hw or self.grid_hw or (8, 8)
        return enumerate_areas_2d(*grid, *area_layers[-1].cross.max_area)
