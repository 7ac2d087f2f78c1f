"""Name → class registry for captioners (a dict plus ``create(name)``, as in JDAI X-LAN, minus global config)."""

from __future__ import annotations

from typing import Any, Callable, TypeVar

from .protocol import Captioner

MODELS: dict[str, type[Captioner]] = {}
T = TypeVar("T", bound=type[Captioner])


def register(name: str) -> Callable[[T], T]:
    """Class decorator: make a captioner constructible as ``create(name, ...)``."""

    def wrap(cls: T) -> T:
        if name in MODELS:
            raise ValueError(f"model {name!r} is already registered by {MODELS[name].__name__}")
        cls.arch = name
        MODELS[name] = cls
        return cls

    return wrap


def available() -> list[str]:
    _import_builtin_models()
    return sorted(MODELS)


def create(name: str, **config: Any) -> Captioner:
    """Build a registered captioner from its config dict."""
    _import_builtin_models()
    try:
        cls = MODELS[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; registered: {', '.join(sorted(MODELS))}") from None
    return cls(**config)


def _import_builtin_models() -> None:
    # Importing the package registers every built-in model (each module calls @register at import time).
    from . import zoo  # noqa: F401
