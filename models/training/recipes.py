"""Paper training recipes: ``models/recipes/NAME.toml``, read with the standard library's ``tomllib``.

A recipe has top-level keys shared by its phases and one table per phase (``[xe]``, ``[scst]``); each key is a
:class:`~captioner.models.training.config.TrainConfig` field (``model_args`` is a table of model hyper-parameters,
merged with ``--set``).  ``captioner train --recipe NAME [--phase scst]`` starts from the config defaults, applies the
recipe's shared keys and its phase table, then the flags given on the command line.
"""

from __future__ import annotations

import json
import shlex

import tomllib
from dataclasses import fields
from pathlib import Path
from typing import Any

from ..files import read_text_file

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
    from .config import TrainConfig

    path = recipe_path(name)
    try:
        data = tomllib.loads(read_text_file(path))
    except tomllib.TOMLDecodeError as exc:  # its message names a line, not the file
        raise ValueError(f"{path} is not a recipe (not TOML: {exc})") from None
    phase = phase or data.get("phase", "xe")
    if not isinstance(phase, str):
        raise ValueError(f"{path}: phase is {phase!r}, not a stage's name ({', '.join(PHASE_TABLES)})")
    if phase not in data and phase in PHASE_TABLES and any(t in data for t in PHASE_TABLES):
        raise ValueError(f"recipe {name!r} has no [{phase}] stage (it has: "
                         f"{', '.join(t for t in PHASE_TABLES if t in data)})")
    values = {k: v for k, v in data.items() if k not in PHASE_TABLES}
    stage = _table(path, data, phase)
    model_args = {**_table(path, values, "model_args"), **_table(path, stage, "model_args", f"{phase}.")}
    values.pop("model_args", None)
    values.update({k: v for k, v in stage.items() if k != "model_args"})
    if model_args:
        values["model_args"] = model_args
    known = {f.name for f in fields(TrainConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"recipe {name!r}: unknown setting(s) {', '.join(unknown)}")
    return {**values, "recipe": name, "phase": phase}


def _table(path: Path, within: dict[str, Any], key: str, prefix: str = "") -> dict[str, Any]:
    """The table ``key`` of a recipe (empty when absent): a value where a table belongs is a ValueError naming the
    file, where merging it would be a TypeError naming none."""
    value = within.get(key, {})
    if not isinstance(value, dict):
        raise ValueError(f"{path}: {prefix}{key} is {value!r}, not a table ([{prefix}{key}] or {key} = {{...}})")
    return value


#: fields that only say how a run is watched, not what it trains
_NOT_IN_COMMAND = ("out", "dataset", "recipe", "phase", "progress", "log_every", "checkpoint_every")


def command_line(config: dict[str, Any]) -> str:
    """The ``captioner train`` command that gives the saved ``train_config`` ``config``: its recipe (and phase), then
    a flag for every value that differs from what the recipe (or, without one, the config defaults) sets.  Model
    cards print it, so a card names every override a run used; a value a shell would split or expand (a folder with
    a space, a JSON list) is quoted, so the command can be pasted as it is."""
    from dataclasses import replace

    from .config import TrainConfig

    cfg = TrainConfig.from_json(config)
    base = TrainConfig(out=cfg.out)
    argv = ["captioner", "train"]
    if cfg.recipe:
        try:
            base = replace(base, **load_recipe(cfg.recipe, cfg.phase))
            argv += ["--recipe", cfg.recipe]
        except (ValueError, OSError):  # a recipe file of one's own that is gone: list every non-default value
            pass
    if cfg.phase != "xe":
        argv += ["--phase", cfg.phase]
    argv += ["--dataset", str(cfg.dataset), "--out", str(cfg.out)]
    for f in fields(TrainConfig):
        if f.name in _NOT_IN_COMMAND or not f.metadata.get("cli", True):
            continue
        value, default = getattr(cfg, f.name), getattr(base, f.name)
        if value == default:
            continue
        flag, kind = f.metadata.get("flag") or "--" + f.name.replace("_", "-"), f.metadata.get("kind")
        if kind == "keyvalue":
            # values as --set reads them back (JSON: false, not Python's False, which would be the string "False")
            for key, item in value.items():
                if default.get(key) != item:
                    argv += [flag, f"{key}={item if isinstance(item, str) else json.dumps(item)}"]
        elif kind == "append":
            for item in value:
                argv += [flag, str(item)]
        elif kind == "pair":
            argv += [flag, str(value[0]), str(value[1])]
        elif kind in ("true", "false"):
            argv.append(flag)
        else:
            argv += [flag, str(value)]
    return shlex.join(argv)
