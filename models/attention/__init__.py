"""Attention normalisers: plain functions that map scores ``[..., N]`` (+ mask) to weights on the simplex.

Every normaliser has the signature ``normalise(scores, mask) -> weights`` where ``mask`` is True for real
items; masked items get exactly zero weight.  Models pick one by name from :data:`NORMALISERS`:

* ``softmax`` — dense (SparseCap Eq. 1);
* ``sparsemax`` — Euclidean projection onto the simplex, exact zeros (SparseCap Eq. 2);
* ``tvmax`` — sparsemax of the 2D total-variation prox (SparseCap Eq. 5, λ = 0.01).  The items must be the row-major
  cells of a **square** grid: the entry infers ``side = √N`` and raises for any other ``N``.  For another λ use
  ``get_normaliser("tvmax", lam=...)``; for a non-square grid call :func:`.tvmax.tvmax` with ``grid_hw``.

SparseCap = Martins et al., "Sparse and Structured Visual Attention", arXiv:2002.05556.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

from torch import Tensor

from .softmax import masked_softmax
from .sparsemax import sparsemax
from .tvmax import tvmax_square

Normaliser = Callable[[Tensor, Tensor | None], Tensor]
NORMALISERS: dict[str, Normaliser] = {"softmax": masked_softmax, "sparsemax": sparsemax, "tvmax": tvmax_square}


class UnknownNormaliser(KeyError, ValueError):
    """No normaliser has this name (a KeyError, as a table lookup; a ValueError, as a mistake in a model's
    configuration, which the CLI answers in one line)."""

    def __str__(self) -> str:
        return str(self.args[0])


def get_normaliser(name: str, **options: Any) -> Normaliser:
    """The normaliser called ``name``; keyword ``options`` are bound to it (e.g. ``lam`` for ``tvmax``).  A new
    normaliser is a function of the signature above, added to :data:`NORMALISERS`."""
    try:
        normalise = NORMALISERS[name]
    except KeyError:
        raise UnknownNormaliser(f"unknown attention normaliser {name!r}; choose from {sorted(NORMALISERS)} (a new "
                                "one is added to NORMALISERS in models/attention/__init__.py)") from None
    return partial(normalise, **options) if options else normalise
