"""What a value of each scalar kind is called in an error, and which values are of it: the one table behind the
checks of a model's options (registry.py) and of a training run's settings (training/config.py).  JSON and TOML
bring whole numbers where a float is declared; True is no whole number, though Python counts it as 1."""

from __future__ import annotations

from typing import Any, Callable

SCALAR_KINDS: dict[type, tuple[str, Callable[[Any], bool]]] = {
    bool: ("true or false", lambda v: isinstance(v, bool)),
    int: ("a whole number", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    float: ("a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)),
}
