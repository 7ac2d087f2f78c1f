"""The built-in captioners by name: importing this module imports (and so registers) every model file.

``create(name, **config)`` is the one way the rest of the project builds a model; add a new model file to the
imports below.
"""

from __future__ import annotations

from typing import Any

from . import aoanet, area_transformer, sat, sat_hard, sparsecap, xlan, xtransformer  # noqa: F401 (registers)
from .protocol import Captioner
from .registry import MODELS


def available() -> list[str]:
    """Registered model names, sorted."""
    return sorted(MODELS)


def create(name: str, **config: Any) -> Captioner:
    """Build a registered captioner from its config dict."""
    try:
        cls = MODELS[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; registered: {', '.join(available())}") from None
    return cls(**config)
