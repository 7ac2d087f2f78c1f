"""Paper training recipes: ``models/recipes/NAME.toml``, read with the standard library's ``tomllib``.

A recipe has top-level keys shared by its phases and one table per phase (``[xe]``, ``[scst]``); each key is a
:class:`~captioner.models.training.loop.TrainConfig` field (``model_args`` is a table of model hyper-parameters, merged
with ``--set``).  ``captioner train --recipe NAME [--phase scst]`` starts from the config defaults, applies the
recipe's shared keys and its phase table, then the flags given on the command line.
"""

from __future__ import annotations

import tomllib
from dataclasses import fields
from pathlib import Path
from typing import Any

RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"
PHASE_TABLES = ("xe", "scst")


def available_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.toml"))


def recipe_path(name: str) -> Path:
    path = Path(name)
    if path.suffix == ".toml" and path.is_file():  # a recipe file of one's own
        return path
    path = RECIPES_DIR / f"{name}.toml"
    if not path.is_file():
        raise ValueError(f"unknown recipe {name!r}; choose from {', '.join(available_recipes())} or give a .toml file")
    return path


def load_recipe(name: str, phase: str | None = None) -> dict[str, Any]:
    """The config values recipe ``name`` sets for ``phase`` (default: the recipe's own ``phase`` key, else
    ``xe``), with ``recipe`` and ``phase`` filled in.  Unknown keys are an error, so a typo cannot pass silently."""
    from .loop import TrainConfig

    with open(recipe_path(name), "rb") as handle:
        data = tomllib.load(handle)
    phase = phase or data.get("phase", "xe")
    if phase not in data and phase in PHASE_TABLES and any(t in data for t in PHASE_TABLES):
        raise ValueError(f"recipe {name!r} has no [{phase}] stage (it has: "
                         f"{', '.join(t for t in PHASE_TABLES if t in data)})")
    values = {k: v for k, v in data.items() if k not in PHASE_TABLES}
    stage = data.get(phase, {})
    model_args = {**values.pop("model_args", {}), **stage.get("model_args", {})}
    values.update({k: v for k, v in stage.items() if k != "model_args"})
    if model_args:
        values["model_args"] = model_args
    known = {f.name for f in fields(TrainConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"recipe {name!r}: unknown setting(s) {', '.join(unknown)}")
    return {**values, "recipe": name, "phase": phase}
