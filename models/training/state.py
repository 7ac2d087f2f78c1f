"""Resumable training state without pickle: tensors → safetensors, everything else → JSON, committed atomically;
and the random streams it holds (:func:`rng_state`, :func:`set_rng_state`), so a resumed run draws what the
uninterrupted one would have drawn."""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from safetensors.torch import save as save_tensors

from ..checkpoint import CheckpointError
from ..files import file_checksum, read_json_file, temporaries_of, write_atomically, create_durably

STATE_TENSORS, STATE_JSON = "train_state.safetensors", "train_state.json"
TENSORS_KEY = "__tensors__"


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


def _joined(skeleton: dict[str, Any], tensor_file: Path, path: Path) -> dict[str, Any]:
    """:func:`_join` of the state ``path`` holds with ``tensor_file``'s tensors; a tensor name the file does not hold
    (the JSON altered) is a :class:`CheckpointError` naming ``path``."""
    try:
        return _join(skeleton, load_file(tensor_file))
    except (KeyError, TypeError) as exc:  # TypeError: a name that is not one (a list, an object)
        raise CheckpointError(f"{path} names a tensor its tensor file does not hold ({exc}; altered): refusing to "
                              "resume from it") from None


def save_state(run_dir: Path, state: dict[str, Any]) -> None:
    """Write ``state`` (nested dicts with tensors) so that a crash at any moment leaves either the previous state
    or the new one, never a mix: the tensors go to a new uniquely named file (fsynced), then ``train_state.json``,
    which names that file and its sha256, replaces the old JSON in one atomic rename — the commit point — and only
    then is the previous tensor file removed."""
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _split(state, "s", tensors)
    name = f"train_state.{secrets.token_hex(4)}.safetensors"
    create_durably(run_dir / name, save_tensors(tensors))
    skeleton[TENSORS_KEY] = {"file": name, "sha256": file_checksum(run_dir / name)}
    try:
        write_atomically(run_dir / STATE_JSON, json.dumps(skeleton), durable=True)
    except BaseException:
        if _committed_tensor_file(run_dir) != name:  # the previous state stands: its tensors, not these
            (run_dir / name).unlink(missing_ok=True)
        raise
    for stale in [*run_dir.glob("train_state.*.safetensors"), *temporaries_of(run_dir / STATE_JSON)]:
        if stale.name != name:  # older states and what a killed writer left
            stale.unlink(missing_ok=True)
    (run_dir / STATE_TENSORS).unlink(missing_ok=True)  # the single-file layout of older runs


def _committed_tensor_file(run_dir: Path) -> str:
    """The tensor file the state's JSON names now ("" where it cannot be read): after a failed commit, whether the
    rename happened (a failure after it, flushing the folder, leaves the new state committed)."""
    try:
        return str(read_json_file(run_dir / STATE_JSON)[TENSORS_KEY]["file"])
    except (OSError, ValueError, KeyError, TypeError):
        return ""


def load_state(run_dir: Path, objects: Sequence[str] = ()) -> dict[str, Any] | None:
    """The saved state, or None; a state whose tensor file does not match the sha256 its JSON records (torn,
    foreign, altered), or that lacks one of the ``objects`` its reader takes from it (each a JSON object), is refused
    with :class:`~captioner.models.checkpoint.CheckpointError`."""
    path = run_dir / STATE_JSON
    if not path.exists():
        return None
    try:
        skeleton = read_json_file(path, "a training run's state")
    except ValueError as exc:
        raise CheckpointError(f"{exc} (torn or altered): refusing to resume from it") from None
    # what the reader takes from the JSON itself (the tensors are checked by their sha256 below)
    wrong = [key for key in objects if not isinstance(skeleton.get(key), dict)]
    ref = skeleton.pop(TENSORS_KEY, None)
    names_its_tensors = isinstance(ref, dict) and all(isinstance(ref.get(key), str) for key in ("file", "sha256"))
    if wrong or not (ref is None or names_its_tensors):  # None: a state written before it named its tensor file
        raise CheckpointError(f"{path} is not a training run's state (altered: "
                              f"{', '.join(wrong) or TENSORS_KEY} missing or of the wrong kind): refusing to resume "
                              "from it")
    if ref is None:
        return _joined(skeleton, run_dir / STATE_TENSORS, path)
    tensor_file = run_dir / ref["file"]
    if not tensor_file.is_file():
        raise CheckpointError(f"{tensor_file}, named by {STATE_JSON}, is missing")
    if file_checksum(tensor_file) != ref["sha256"]:
        raise CheckpointError(f"{tensor_file} does not match the sha256 in {STATE_JSON}: torn, foreign or altered; "
                              "refusing to resume from it")
    return _joined(skeleton, tensor_file, path)


def restore_optimizer_state(state: dict[str, Any]) -> dict[str, Any]:
    """JSON turned the integer parameter ids of ``optimizer.state`` into strings; turn them back."""
    return {"state": {int(k): v for k, v in state["state"].items()}, "param_groups": state["param_groups"]}


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():  # multinomial sampling (SCST, SAT-hard) on a GPU draws from the CUDA generator
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(state["cuda"]))
