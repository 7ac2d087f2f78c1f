"""Attention on Attention (AoANet: Huang et al., ICCV 2019, arXiv:1908.06954 — §3.1, Eq. 3–6).

After any attention function has produced its result ``v̂ = f_att(q, K, V)``, AoA builds

* the information vector  ``i = W^i_q q + W^i_v v̂ + b^i``        (AoANet Eq. 3)
* the attention gate      ``g = σ(W^g_q q + W^g_v v̂ + b^g)``     (AoANet Eq. 4)

and returns the attended information ``î = g ⊙ i`` (Eq. 5–6).  The module has no state and acts on each query
independently, so it works for any leading shape.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class AttentionOnAttention(nn.Module):
    """``AoA(v̂, q) = σ(W^g [v̂; q] + b^g) ⊙ (W^i [v̂; q] + b^i)`` as one ``Linear(D_v + D_q, 2D_v)`` and a GLU.

    The two-matrix form of Eq. 3–4 is this map with ``linear.weight = [[W^i_v, W^i_q], [W^g_v, W^g_q]]`` and
    ``linear.bias = [b^i; b^g]``: GLU takes the first half of the output as the information vector and the sigmoid of
    the second half as the gate.  ``input_dropout`` drops entries of ``[v̂; q]`` (0.3 in the refiner, from
    the authors' code: docs/decisions.md#aoanet-dropout).
    """

    def __init__(self, dim: int, query_dim: int | None = None, input_dropout: float = 0.0):
        super().__init__()
        self.dim = dim
        self.linear = nn.Linear(dim + (query_dim or dim), 2 * dim)
        self.input_dropout = nn.Dropout(input_dropout)

    def forward(self, attended: Tensor, query: Tensor) -> Tensor:
        """``attended [..., D_v]`` (the attention result v̂) and ``query [..., D_q]`` → ``î [..., D_v]``."""
        return F.glu(self.linear(self.input_dropout(torch.cat([attended, query], -1))), dim=-1)
