"""The built-in captioners by name: importing this module imports (and so registers) every model file.

``create(name, **config)`` is the one way the rest of the project builds a model; add a new model file to the
imports below.
"""

from __future__ import annotations

import inspect
from typing import Any

from . import aoanet, area_transformer, ensemble, sat, sat_hard, sparsecap, xlan, xtransformer  # noqa: F401 (registers)
from .protocol import Captioner
from .registry import MODELS


def available() -> list[str]:
    """Registered model names, sorted."""
    return sorted(MODELS)


class UnknownModel(KeyError, ValueError):
    """No model is registered under this name (a KeyError, as a registry lookup; a ValueError, as a mistake in a
    command, which the CLI answers in one line)."""

    def __str__(self) -> str:
        return str(self.args[0])


def create(name: str, **config: Any) -> Captioner:
    """Build a registered captioner from its config dict; a name or an option it does not have is a ValueError
    naming what it does have."""
    try:
        cls = MODELS[name]
    except KeyError:
        raise UnknownModel(f"unknown model {name!r}; registered: {', '.join(available())}") from None
    named = [n for n, p in inspect.signature(cls).parameters.items() if p.kind is not p.VAR_KEYWORD]
    # a model passes what it does not name itself (the special token ids) on to the protocol's constructor
    named += [n for n in inspect.signature(Captioner.__init__).parameters if n != "self" and n not in named]
    unknown = sorted(set(config) - set(named))
    if unknown:
        raise ValueError(f"model {name!r} has no option {', '.join(map(repr, unknown))}; its options: "
                         f"{', '.join(named)}")
    required = [n for n, p in inspect.signature(cls).parameters.items()
                if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n not in config]
    if required:  # vocab_size and feat_dim: the sizes every model is built for
        raise ValueError(f"model {name!r} needs {', '.join(map(repr, required))}")
    return cls(**config)
