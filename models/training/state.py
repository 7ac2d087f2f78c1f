"""Resumable training state without pickle: tensors → safetensors, everything else → JSON."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

STATE_TENSORS, STATE_JSON = "train_state.safetensors", "train_state.json"


def _split(obj: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    """Replace every tensor in a nested dict/list by a ``{"__tensor__": key}`` marker."""
    if isinstance(obj, torch.Tensor):
        tensors[prefix] = obj.detach().cpu().contiguous()
        return {"__tensor__": prefix}
    if isinstance(obj, dict):
        return {str(k): _split(v, f"{prefix}.{k}", tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_split(v, f"{prefix}.{i}", tensors) for i, v in enumerate(obj)]
    return obj


def _join(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {"__tensor__"}:
            return tensors[obj["__tensor__"]]
        return {k: _join(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_join(v, tensors) for v in obj]
    return obj


def save_state(run_dir: Path, state: dict[str, Any]) -> None:
    """Atomically write ``state`` (nested dicts with tensors); a crash mid-write keeps the previous state."""
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _split(state, "s", tensors)
    tmp_t, tmp_j = run_dir / (STATE_TENSORS + ".tmp"), run_dir / (STATE_JSON + ".tmp")
    save_file(tensors, tmp_t)
    tmp_j.write_text(json.dumps(skeleton))
    os.replace(tmp_t, run_dir / STATE_TENSORS)
    os.replace(tmp_j, run_dir / STATE_JSON)


def load_state(run_dir: Path) -> dict[str, Any] | None:
    if not (run_dir / STATE_JSON).exists():
        return None
    skeleton = json.loads((run_dir / STATE_JSON).read_text())
    return _join(skeleton, load_file(run_dir / STATE_TENSORS))


def restore_optimizer_state(state: dict[str, Any]) -> dict[str, Any]:
    """JSON turned the integer parameter ids of ``optimizer.state`` into strings; turn them back."""
    return {"state": {int(k): v for k, v in state["state"].items()}, "param_groups": state["param_groups"]}
