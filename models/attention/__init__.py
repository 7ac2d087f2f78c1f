"""Attention normalisers: plain functions that map scores ``[..., N]`` (+ mask) to weights on the simplex.

Every normaliser has the signature ``normalise(scores, mask) -> weights`` where ``mask`` is True for real
items; masked items get exactly zero weight.  Models pick one by name from :data:`NORMALISERS`.
"""

from __future__ import annotations

from typing import Callable

from torch import Tensor

from .softmax import masked_softmax

Normaliser = Callable[[Tensor, Tensor | None], Tensor]
NORMALISERS: dict[str, Normaliser] = {"softmax": masked_softmax}


def get_normaliser(name: str) -> Normaliser:
    try:
        return NORMALISERS[name]
    except KeyError:
        raise KeyError(f"unknown attention normaliser {name!r}; choose from {sorted(NORMALISERS)}") from None
