"""Name → class registry for captioners (a dict plus a decorator, as in JDAI X-LAN, minus global config).

A leaf module: model files import it to ``@register`` themselves (and an ensemble to ``create`` its members), and
:mod:`.zoo` imports every model file, so that ``zoo.create(name)`` knows them all.  Nothing here imports a model, so
there is no import loop.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, TypeVar

from .protocol import Captioner

MODELS: dict[str, type[Captioner]] = {}
T = TypeVar("T", bound=type[Captioner])


def register(name: str) -> Callable[[T], T]:
    """Class decorator: make a captioner constructible as ``zoo.create(name, ...)``."""

    def wrap(cls: T) -> T:
        if name in MODELS:
            raise ValueError(f"model {name!r} is already registered by {MODELS[name].__name__}")
        cls.arch = name
        MODELS[name] = cls
        return cls

    return wrap


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
        raise UnknownModel(f"unknown model {name!r}; registered: {', '.join(available())} (a new model file is "
                           "imported in models/zoo.py, which registers it)") from None
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
