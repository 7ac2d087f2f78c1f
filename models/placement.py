"""Where the served checkpoints and their ONNX exports are, by default and by the ``CAPTIONER_*`` variables.

The service reads these variables through its ``Settings`` (pydantic-settings) and the model-side ``captioner``
subcommands (``export``, ``eval``, ``caption``) read them here, because ``models/`` never imports ``service/``.
Both take their defaults and the rule for served names from this module, so that ``captioner export`` writes the
exports the service looks for, under the names it serves.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path

#: every checkpoint folder below it is served under its folder name (the Flickr8k checkpoints: docs/decisions.md,
#: "Flickr8k: where the checkpoints live and which are served")
DEFAULT_WEIGHTS_DIR = Path("weights/flickr8k")
#: the model a request that names none gets (docs/decisions.md, "Flickr8k: the default model")
DEFAULT_MODEL = "sat-supervised"
#: the checkpoint of the default model, which the model-side commands use when given none
DEFAULT_CHECKPOINT = DEFAULT_WEIGHTS_DIR / DEFAULT_MODEL
#: one folder of ONNX graphs per served model, made when missing
DEFAULT_ONNX_DIR = Path(".cache/onnx")
#: the checkout these files are in, where the shipped weights are whatever the working folder
PROJECT_ROOT = Path(__file__).resolve().parents[1]

# a served model's name is also its ONNX export's folder name and a URL parameter: no path separators in it
_NAME_PREFIX = re.compile(r"[A-Za-z0-9._-]*")


def check_name_prefixes(prefixed: Mapping[str, object]) -> None:
    """Refuse (``ValueError``) a name prefix of ``CAPTIONER_PREFIXED_WEIGHTS_DIRS`` that is not a plain name: with
    ``"../x-"`` an export would be written outside the exports' folder."""
    bad = [prefix for prefix in prefixed if not _NAME_PREFIX.fullmatch(prefix)]
    if bad:
        raise ValueError(f"name prefixes may hold only letters, digits, '.', '_' and '-': {bad}")


def default_checkpoint() -> Path:
    """The checkpoint the model-side commands use when given none: the default model's, below the working folder
    (a checkout, the container's) or else below this checkout, so that ``captioner caption photo.jpg`` works from
    any folder."""
    return DEFAULT_CHECKPOINT if DEFAULT_CHECKPOINT.is_dir() else PROJECT_ROOT / DEFAULT_CHECKPOINT


def weights_dir_from_env() -> Path:
    """``CAPTIONER_WEIGHTS_DIR``, or the default."""
    return Path(os.environ.get("CAPTIONER_WEIGHTS_DIR") or DEFAULT_WEIGHTS_DIR)


def onnx_dir_from_env() -> Path:
    """``CAPTIONER_ONNX_DIR``, or the default."""
    return Path(os.environ.get("CAPTIONER_ONNX_DIR") or DEFAULT_ONNX_DIR)


def prefixed_dirs_from_env() -> dict[str, Path]:
    """``CAPTIONER_PREFIXED_WEIGHTS_DIRS``: a JSON object of name prefix → folder (``{"scenes-": "weights"}``)."""
    value = _json_from_env("CAPTIONER_PREFIXED_WEIGHTS_DIRS", "{}")
    if not isinstance(value, dict) or not all(isinstance(folder, str) for folder in value.values()):
        raise ValueError('CAPTIONER_PREFIXED_WEIGHTS_DIRS must be a JSON object such as {"scenes-": "weights"}')
    check_name_prefixes(value)
    return {prefix: Path(folder) for prefix, folder in value.items()}


def checkpoints_from_env() -> list[Path]:
    """``CAPTIONER_CHECKPOINTS``: a JSON list of extra checkpoint folders, each served under its own name."""
    value = _json_from_env("CAPTIONER_CHECKPOINTS", "[]")
    if not isinstance(value, list) or not all(isinstance(folder, str) for folder in value):
        raise ValueError('CAPTIONER_CHECKPOINTS must be a JSON list of folders such as ["runs/mine/best"]')
    return [Path(folder) for folder in value]


def _json_from_env(name: str, empty: str) -> object:
    text = os.environ.get(name) or empty
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{name} is not JSON ({exc}): {text!r}") from None
