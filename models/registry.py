"""Name → class registry for captioners (a dict plus a decorator, as in JDAI X-LAN, minus global config).

A leaf module: model files import it to ``@register`` themselves, and :mod:`.zoo` imports every model file and
offers ``create(name)``. Nothing here imports a model, so there is no import loop.
"""

from __future__ import annotations

from typing import Callable, TypeVar

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
