"""The built-in captioners by name: importing this module imports (and so registers) every model file.

``create(name, **config)`` is the one way the rest of the project builds a model; add a new model file to the
imports below.
"""

from __future__ import annotations

from . import aoanet, area_transformer, ensemble, sat, sat_hard, sparsecap, xlan, xtransformer  # noqa: F401 (registers)
from .registry import UnknownModel, available, create

__all__ = ["UnknownModel", "available", "create"]
