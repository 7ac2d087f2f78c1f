"""Name → class registry for captioners (a dict plus a decorator, as in JDAI X-LAN, minus global config).

A leaf module: model files import it to ``@register`` themselves (and an ensemble to ``create`` its members), and
:mod:`.zoo` imports every model file, so that ``zoo.create(name)`` knows them all.  Nothing here imports a model, so
there is no import loop.
"""

from __future__ import annotations

import collections.abc
import inspect
import types
import typing
from typing import Any, Callable, TypeVar

from .protocol import Captioner
from .value_kinds import SCALAR_KINDS

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


class BadOption(ValueError):
    """An option the model does not have, or a value its annotation does not admit: the message names the model,
    the option and what it takes, so callers pass it on as it is."""


#: what :func:`options` reports for an argument without a default (``vocab_size``, ``feat_dim``)
REQUIRED = inspect.Parameter.empty
#: the arguments of every model that the data set and the encoder decide (sizes, special token ids), not a user
_PROTOCOL_DEFAULTS = {n: p.default for n, p in inspect.signature(Captioner.__init__).parameters.items() if n != "self"}
PROTOCOL_ARGUMENTS = tuple(_PROTOCOL_DEFAULTS)


def model_class(name: str) -> type[Captioner]:
    """The class registered under ``name``; an :class:`UnknownModel` naming the registered ones otherwise."""
    try:
        return MODELS[name]
    except KeyError:
        raise UnknownModel(f"unknown model {name!r}; registered: {', '.join(available())} (a model file is imported "
                           "in models/zoo.py, or another package names its module under the entry-point group "
                           "captioner.models: README, Adding a model)") from None


def options(name: str) -> dict[str, Any]:
    """A registered model's options, the arguments :func:`create` takes, with their defaults (:data:`REQUIRED`
    where there is none): the class's own named parameters, then those of ``Captioner.__init__`` (the special
    token ids) it passes on through ``**ids``."""
    return _options(model_class(name))


def _options(cls: type[Captioner]) -> dict[str, Any]:
    own = {n: p.default for n, p in inspect.signature(cls).parameters.items()
           if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return {**own, **{n: default for n, default in _PROTOCOL_DEFAULTS.items() if n not in own}}


#: what a value of each annotated scalar kind is called in an error
_SCALARS: dict[type, tuple[str, Callable[[Any], bool]]] = {
    **SCALAR_KINDS,
    str: ("a string", lambda v: isinstance(v, str)),
}


def _admitted(value: Any, hint: Any) -> list[str]:
    """What the annotation ``hint`` names that ``value`` is not ([] when it admits it, or says nothing checkable:
    ``Any``, a class of its own): scalars by kind, a union by any member, sequences as JSON lists or tuples."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        kinds = [_admitted(value, member) for member in typing.get_args(hint)]
        return [] if any(not kind for kind in kinds) else [k for kind in kinds for k in kind]
    if hint is type(None):
        return [] if value is None else ["null"]
    if hint in _SCALARS:
        said, accepts = _SCALARS[hint]
        return [] if accepts(value) else [said]
    origin = typing.get_origin(hint) or hint
    if origin in (list, tuple, collections.abc.Sequence):
        return [] if isinstance(value, (list, tuple)) else ["a list"]
    return []


def _annotations(cls: type) -> dict[str, Any]:
    """The constructor's resolved annotations; none (so nothing checked) where they cannot be resolved."""
    try:
        return typing.get_type_hints(cls.__init__)
    except Exception:  # a plugin's annotation naming what its module never imports: its options go unchecked
        return {}


def create(name: str, **config: Any) -> Captioner:
    """Build a registered captioner from its config dict; a name or an option it does not have, a missing size, or
    a value its annotation does not admit (a string for an ``int``, ...) is a ValueError naming what it takes."""
    cls = model_class(name)
    known = _options(cls)
    unknown = sorted(set(config) - set(known))
    if unknown:
        raise BadOption(f"model {name!r} has no option {', '.join(map(repr, unknown))}; its options: "
                         f"{', '.join(known)} (captioner models {name})")
    required = [n for n, default in known.items() if default is REQUIRED and n not in config]
    if required:  # vocab_size and feat_dim: the sizes every model is built for
        raise ValueError(f"model {name!r} needs {', '.join(map(repr, required))}")
    hints = _annotations(cls)
    for option, value in config.items():
        wanted = _admitted(value, hints.get(option, typing.Any))
        if wanted:
            default = "" if known[option] is REQUIRED else f" (default {known[option]!r})"
            raise BadOption(f"model {name!r}: option {option!r} takes {' or '.join(wanted)}{default}, got {value!r}")
    return cls(**config)
