"""The one checkpoint format: a directory with ``model.safetensors`` + ``config.json`` + ``vocab.json``, and
``manifest.json`` (the sha256 of every file, verified when the checkpoint is loaded).

No pickle anywhere: weights are safetensors, everything else is JSON.  ``config.json`` records the
architecture name and its constructor arguments, the visual encoder spec (so serving preprocesses exactly as
training did) and free-form metadata (training command, metrics).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from safetensors import safe_open
from safetensors.torch import load_file
from safetensors.torch import save as save_tensors

from .device import resolve_device
from .encoder import WEIGHTS_FILE_FIELDS, EncoderSpec
from .files import (file_checksum, fsync_path, replace_directory, set_aside, temporaries_of, temporary_beside,
                    temporary_target, write_atomically, create_durably)
from .placement import check_name_prefixes
from .protocol import Captioner
from .zoo import create
from .vocab import Vocabulary

FORMAT = "attention-captioner/1"
WEIGHTS, CONFIG, VOCAB, MANIFEST = "model.safetensors", "config.json", "vocab.json", "manifest.json"
OWN_FILES = (WEIGHTS, CONFIG, VOCAB, MANIFEST)  # what save_checkpoint writes itself; anything else is an extra file
CARD = "MODEL_CARD.md"  # the model card (``captioner card``), which a checkpoint folder may hold besides
MANIFEST_FORMAT = "attention-captioner-manifest/1"


class CheckpointError(ValueError):
    """A checkpoint directory is missing, incomplete or of an unknown format."""


@dataclass
class Checkpoint:
    model: Captioner
    vocab: Vocabulary
    encoder: EncoderSpec
    path: Path | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    checksum: str = ""
    storage: str = "float32"  # the dtype its weights are stored in (STORAGE_DTYPES)

    @property
    def name(self) -> str:
        return self.meta.get("name") or (checkpoint_name(self.path) if self.path else self.model.arch)

    @property
    def trained_features(self) -> str:
        """The ``--features`` its training run read, which evaluation reads again by default: ``"grid"`` (the
        encoder's grid, also for a run that did not name it) or ``"regions:DIR"``."""
        return self.meta.get("train_config", {}).get("features") or "grid"

    @property
    def reads_regions(self) -> bool:
        """Trained on region features (``--features regions:DIR``, or an author's checkpoint of bottom-up
        features): it cannot caption a photo, whose features would be the grid."""
        authors_regions = "region features" in str(self.meta.get("visual_input", ""))
        return self.trained_features.startswith("regions:") or authors_regions

    def check_reads_images(self) -> None:
        """Refuse (:class:`CheckpointError`) to caption photos with a checkpoint that reads region features."""
        if self.reads_regions:
            raise CheckpointError(f"{self.path or self.name} was trained on region features, and a photo gives "
                                  "grid features: caption photos with a checkpoint trained on images; evaluate "
                                  "this one with captioner eval --features regions:DIR")


#: how a checkpoint's floating-point weights may be stored: float32, or float16 (half the bytes; loading casts them
#: back into the float32 model, so only the stored values are rounded; a card says what that changed)
STORAGE_DTYPES = {"float32": torch.float32, "float16": torch.float16}


def save_checkpoint(path: str | Path, model: Captioner, vocab: Vocabulary, encoder: EncoderSpec,
                    meta: dict[str, Any] | None = None, storage: str = "float32",
                    files: Mapping[str, bytes] | None = None) -> Path:
    """Write atomically: the files (each fsynced) and their sha256 manifest go to a temporary sibling directory
    that then takes ``path``'s place in one rename, so an interrupted save never leaves a torn checkpoint and
    never destroys the previous one.  Files and folder get the usual permissions (the umask decides), so a
    service running as another user can read them.

    ``files`` (name → bytes) are written beside the weights and listed in the manifest: an encoder weight file
    that ``encoder.weights`` names relative to the folder (:func:`load_checkpoint` resolves it there)."""
    path = Path(path)
    if storage not in STORAGE_DTYPES:
        raise ValueError(f"storage must be one of {', '.join(STORAGE_DTYPES)}, got {storage!r}")
    check_replaceable(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_debris(path)
    tmp = temporary_beside(path)
    os.mkdir(tmp)  # not tempfile.mkdtemp: that makes the folder 0700 whatever the umask says
    try:
        state = {k: (v.to(STORAGE_DTYPES[storage]) if v.is_floating_point() else v).detach().cpu().contiguous()
                 for k, v in model.state_dict().items()}
        create_durably(tmp / WEIGHTS, save_tensors(state, metadata={"format": FORMAT, "arch": model.arch}))
        for name, data in (files or {}).items():
            if Path(name).name != name or name in OWN_FILES:
                raise ValueError(f"{name!r} cannot be an extra file of a checkpoint folder")
            create_durably(tmp / name, data)
        config = {"format": FORMAT, "arch": model.arch, "model": model.config(), "encoder": encoder.to_json(),
                  "special_ids": {"pad_id": model.pad_id, "bos_id": model.bos_id, "eos_id": model.eos_id},
                  "meta": meta or {}}
        if storage != "float32":  # written only when it differs, so float32 checkpoints stay byte-identical
            config["storage"] = storage
        (tmp / CONFIG).write_text(json.dumps(config, indent=2))
        vocab.save(tmp / VOCAB)
        for name in (CONFIG, VOCAB):
            fsync_path(tmp / name)
        write_manifest(tmp)
        fsync_path(tmp)
        replace_directory(tmp, path)
    except BaseException:  # a full disk: the half-written folder gives back its space (replace_files does the same)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _link_or_copy(source: str | Path, target: str | Path) -> None:
    """``source`` hard-linked at ``target``, copied where links are refused (another file system); a symbolic link
    stays one.  A link is as good as a copy here: nothing writes a checkpoint's file in place (writers replace it)."""
    if os.path.islink(source):
        os.symlink(os.readlink(source), target)
        return
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def update_meta(path: str | Path, **fields: Any) -> Path:
    """Store ``fields`` in the checkpoint's record (``meta``), rewriting it atomically with its manifest (the
    weights are written again unchanged, in their storage dtype)."""
    return _rewrite(path, path, None, fields)


def replace_files(path: str | Path, files: Mapping[str, str | bytes]) -> Path:
    """Add or replace ``files`` (name → text or bytes; a model card, say) in checkpoint folder ``path`` and record
    them in its manifest, whole or not at all: a new folder beside it, holding everything else the folder holds
    hard-linked (copied where links are refused; subfolders and dot-files too) and these written, takes ``path``'s
    place as in :func:`save_checkpoint`.  Written in place, a crash or a full disk between a file and its manifest
    left a file the manifest no longer matched: a checkpoint :func:`load_checkpoint` refuses.

    A symbolic link to a checkpoint is followed: its target is replaced and the link stays.  Unlike a save, this
    clears no debris of earlier saves beside the folder: one of them may be a training run's save in flight."""
    path = Path(path).resolve()
    for name in files:
        if Path(name).name != name or name in OWN_FILES:
            raise ValueError(f"{name!r} cannot be replaced in a checkpoint folder this way")
    tmp = temporary_beside(path)
    os.mkdir(tmp)
    try:
        for entry in path.iterdir():
            if entry.name in files or temporary_target(entry.name) is not None:
                continue  # another writer's file in flight (`captioner manifest`'s): renamed or gone at any moment
            if entry.is_dir() and not entry.is_symlink():
                shutil.copytree(entry, tmp / entry.name, symlinks=True, copy_function=_link_or_copy)
            else:
                _link_or_copy(entry, tmp / entry.name)
        for name, data in files.items():
            create_durably(tmp / name, data.encode("utf-8") if isinstance(data, str) else data)
        write_manifest(tmp)
        fsync_path(tmp)
        replace_directory(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def convert_storage(path: str | Path, storage: str, out: str | Path | None = None) -> Path:
    """Write the checkpoint at ``path`` again with its weights stored as ``storage`` (in place, or to ``out``):
    float16 halves the weights' bytes; whether the rounding changed its captions is for ``captioner eval`` to say.
    Weights stored otherwise are other weights: the model card, which names their sha256 and what they measured,
    is left out (``captioner card`` writes one for them)."""
    return _rewrite(path, out or path, storage, {})


def _rewrite(path: str | Path, out: str | Path, storage: str | None, fields: dict[str, Any]) -> Path:
    """The checkpoint at ``path`` saved again at ``out``: ``fields`` added to its record, its weights in ``storage``
    (None: as they are), and its extra files (e.g. an imported CNN's weights) carried over."""
    ckpt = load_checkpoint(path)
    reweighted = storage is not None and storage != ckpt.storage
    extra = {f.name: f.read_bytes() for f in Path(path).iterdir()
             if f.is_file() and f.name not in OWN_FILES and not f.name.startswith(".")
             and not (reweighted and f.name == CARD)}
    return save_checkpoint(out, ckpt.model, ckpt.vocab, folder_relative(ckpt.encoder, Path(path)),
                           {**ckpt.meta, **fields}, storage or ckpt.storage, extra)


def remove_debris(path: str | Path) -> None:
    """Clear what a crash during :func:`save_checkpoint` of ``path`` left beside it: temporary folders are removed;
    a previous checkpoint renamed aside (``.NAME.old``, where the OS cannot swap folders atomically) is put back if
    ``path`` itself is missing, else removed."""
    path = Path(path)
    for stale in temporaries_of(path):
        shutil.rmtree(stale, ignore_errors=True)
    old = set_aside(path)
    if old.exists() and not path.exists():
        os.replace(old, path)
    shutil.rmtree(old, ignore_errors=True)


def check_replaceable(path: Path) -> None:
    """A checkpoint replaces only a checkpoint or an empty folder: a file, or a folder of anything else, at ``path``
    is named in an error and left as it is.  A checkpoint folder is one whose ``config.json`` is of this format and
    which holds nothing but a checkpoint's files (:func:`foreign_entries`): a project folder that happens to have a
    ``config.json`` is not one, and ``--force`` would have deleted it whole."""
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"{path} is a file, not a checkpoint folder: nothing was written there")
    if not path.is_dir() or not any(path.iterdir()):
        return
    if not _has_checkpoint_config(path):
        raise FileExistsError(f"{path} exists and is not a checkpoint folder (it has no {CONFIG} of this project's "
                              "format): nothing was written there; choose another folder")
    foreign = foreign_entries(path)
    if foreign:
        raise FileExistsError(f"{path} holds files no checkpoint has ({', '.join(foreign[:3])}"
                              f"{', …' if len(foreign) > 3 else ''}): nothing was written there; move them or choose "
                              "another folder")


def foreign_entries(path: Path) -> list[str]:
    """The entries of checkpoint folder ``path`` that are not a checkpoint's: anything but its own files, its card
    and the extra files its manifest lists (a sub-folder, say)."""
    allowed = {*OWN_FILES, CARD, *listed_files(path)}
    # a write_atomically killed inside the folder (a card, update_meta) leaves .NAME.tmp-XXXX: debris, not a stranger
    return sorted(entry.name for entry in path.iterdir()
                  if not (entry.is_file() and (entry.name in allowed or temporary_target(entry.name) in allowed)))


def _has_checkpoint_config(path: Path) -> bool:
    """Whether ``path`` has a ``config.json`` of this format (:func:`read_config` reads it)."""
    try:
        read_config(path)
    except (CheckpointError, OSError, AttributeError):  # AttributeError: JSON that is not an object
        return False
    return True


def file_records(path: str | Path) -> dict[str, dict[str, Any]]:
    """What ``manifest.json`` records of checkpoint folder ``path``: the sha256 and size of each of its files (the
    manifest itself and hidden files aside), by name."""
    return {f.name: {"sha256": file_checksum(f), "bytes": f.stat().st_size}
            for f in sorted(Path(path).iterdir()) if f.is_file() and f.name != MANIFEST and not f.name.startswith(".")}


def write_manifest(path: str | Path, records: dict[str, dict[str, Any]] | None = None) -> Path:
    """Record the sha256 and size of every file in checkpoint folder ``path`` in ``manifest.json`` (written
    atomically); :func:`load_checkpoint` verifies them.  ``records``: :func:`file_records` of the folder, where the
    caller has them already (the files are hashed once)."""
    path = Path(path)
    files = file_records(path) if records is None else records
    write_atomically(path / MANIFEST, json.dumps({"format": MANIFEST_FORMAT, "files": files}, indent=2), durable=True)
    return path / MANIFEST


def manifest_changes(path: str | Path, records: dict[str, dict[str, Any]] | None = None) -> list[str] | None:
    """The files of checkpoint folder ``path`` that differ from what its ``manifest.json`` records (changed, added
    or gone), by name; None when it has no manifest that can be read.  ``records``: as :func:`write_manifest`
    takes them."""
    path = Path(path)
    listed = _manifest_entries(path)
    if listed is None:
        return None
    present = file_records(path) if records is None else records
    return sorted(name for name in set(listed) | set(present)
                  if name not in present or name not in listed
                  or present[name]["sha256"] != listed[name].get("sha256"))


def verify_manifest(path: str | Path, recorded: bytes | None = None) -> dict[str, str]:
    """Check every file the manifest lists against its sha256 (and the files a checkpoint needs are listed);
    returns the digests.  A torn, foreign or altered file raises :class:`CheckpointError` naming it.
    ``recorded``: the manifest's bytes where the caller has read them already."""
    path = Path(path)
    try:
        manifest = json.loads(recorded if recorded is not None else (path / MANIFEST).read_bytes())
    except FileNotFoundError:
        raise CheckpointError(f"{path} has no {MANIFEST}: it was not written by save_checkpoint; if you trust its "
                              f"files, record them with `captioner manifest {path}`") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CheckpointError(f"{path / MANIFEST} is not valid JSON (torn or altered)") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise CheckpointError(f"{path / MANIFEST}: unknown manifest format {found!r}")
    listed = manifest.get("files", {})
    if not isinstance(listed, dict) or not all(isinstance(entry, dict) for entry in listed.values()):
        raise CheckpointError(f"{path / MANIFEST}: its files are not a manifest's records (altered)")
    for name in (WEIGHTS, CONFIG, VOCAB):
        if name not in listed:
            raise CheckpointError(f"{path / MANIFEST} does not list {name}")
    digests = {}
    for name, entry in listed.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file} is listed in {MANIFEST} but missing")
        digests[name] = file_checksum(file)
        if file.stat().st_size != entry.get("bytes") or digests[name] != entry.get("sha256"):
            raise CheckpointError(f"{file} does not match its sha256 in {MANIFEST}: the file is torn, from another "
                                  "checkpoint or altered; refusing to load it")
    return digests


def model_files(path: str | Path) -> frozenset[str]:
    """The files of checkpoint folder ``path`` its model is made from, by name: the weights, config and vocabulary,
    and each encoder weight file its config names inside the folder (an imported CNN, fine-tuned stages: a relative
    name, there or gone, a link or not).  ``captioner manifest`` reseals anything else (a card) but refuses these
    changed unless forced."""
    encoder = read_config(path).get("encoder", {})
    kept = {file for file in (encoder.get(name) for name in WEIGHTS_FILE_FIELDS)
            if isinstance(file, str) and file and not Path(file).is_absolute()}
    return frozenset({WEIGHTS, CONFIG, VOCAB} | kept)


def recorded_checksum(path: str | Path) -> str | None:
    """The weights' sha256 as the manifest records it (what :attr:`Checkpoint.checksum` holds once verified), read
    without hashing or verifying anything; None when there is no readable manifest entry."""
    entry = listed_files(Path(path)).get(WEIGHTS)
    return entry.get("sha256") if isinstance(entry, dict) else None


def listed_files(path: Path) -> dict[str, Any]:
    """The entries ``manifest.json`` lists, read leniently for questions that verify nothing (no manifest, or a torn
    one, lists none); :func:`verify_manifest` is the strict reader that loading goes through."""
    return _manifest_entries(path) or {}


def _manifest_entries(path: Path) -> dict[str, Any] | None:
    """The ``files`` entries of ``path``'s manifest, or None where there is no manifest or it cannot be read as one
    (torn, not JSON, not an object, its ``files`` not an object)."""
    try:
        files = json.loads((path / MANIFEST).read_text()).get("files", {})
    except (OSError, ValueError, AttributeError):  # AttributeError: JSON that is not an object
        return None
    return files if isinstance(files, dict) else None


def not_a_checkpoint(path: Path) -> CheckpointError:
    """The error for a folder without ``config.json``; a training run's folder is named as one, with the
    checkpoints it holds (``captioner eval runs/sat`` means ``runs/sat/best``)."""
    if not path.exists():
        return CheckpointError(f"{path} does not exist: give a checkpoint folder")
    held = [f"{path / name}" for name in ("best", "last") if (path / name / CONFIG).is_file()]
    if held:
        return CheckpointError(f"{path} is a training run, not a checkpoint: give {' or '.join(held)}")
    return CheckpointError(f"{path} is not a checkpoint: {CONFIG} is missing")


def read_config(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        config = json.loads((path / CONFIG).read_text())
    except FileNotFoundError:
        raise not_a_checkpoint(path) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path / CONFIG} is not valid JSON ({exc})") from None
    if not isinstance(config, dict) or config.get("format") != FORMAT:
        found = config.get("format") if isinstance(config, dict) else type(config).__name__
        raise CheckpointError(f"{path}: unknown checkpoint format {found!r} (expected {FORMAT})")
    return config


#: loads of a folder that was replaced while it was read, before giving up
LOAD_ATTEMPTS = 3


def folder_inode(path: Path) -> tuple[int, int] | None:
    """Which folder ``path`` names now (device and inode; None: none, between the two renames of a swap on a
    system that cannot exchange folders): a writer that replaces a checkpoint whole puts another one there."""
    try:
        status = os.stat(path)
    except FileNotFoundError:
        return None
    return status.st_dev, status.st_ino


def _folder_identity(path: Path) -> tuple[int, int, bytes] | None:
    """What tells one saved folder from the next at ``path``: its inode (a number the file system may give the
    next folder again) and its manifest, whose digests name the files' contents."""
    inode = folder_inode(path)
    try:
        manifest = (path / MANIFEST).read_bytes()
    except FileNotFoundError:  # between the two renames of a swap on a system that cannot exchange folders
        return None
    return None if inode is None else (*inode, manifest)


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu", verify: bool = True) -> Checkpoint:
    """Rebuild the model from ``config.json``, load its weights strictly, and put it in eval mode.  With ``verify``
    every file must first match the sha256 in ``manifest.json`` (see :func:`verify_manifest`).

    A training run replaces its ``best/`` and ``last/`` whole while it goes on (:func:`replace_directory`), and
    each file is opened by name: a load that a replacement came through could pair one checkpoint's manifest digest
    with the other's weights.  The folder is the same one before and after a load that is kept; otherwise the load
    is made again."""
    path, device = Path(path), resolve_device(str(device))
    for _ in range(LOAD_ATTEMPTS):
        before = _folder_identity(path)
        try:  # the manifest read for the folder's identity is the one verified
            checkpoint = _load_once(path, device, verify, before[2] if before else None)
        except (CheckpointError, OSError):
            if _folder_identity(path) == before:
                raise
            continue  # read across a replacement: what failed may be the mix of two checkpoints
        if _folder_identity(path) == before:
            return checkpoint
    raise CheckpointError(f"{path} was replaced {LOAD_ATTEMPTS} times while it was being loaded (a training run "
                          "or `captioner card` writing it?): load it again once the writer has moved on")


def _load_once(path: Path, device: torch.device, verify: bool, manifest: bytes | None) -> Checkpoint:
    if not (path / CONFIG).is_file():
        raise not_a_checkpoint(path)
    digests = verify_manifest(path, manifest) if verify else {}
    config = read_config(path)
    vocab = _read_vocabulary(path / VOCAB)
    build = _builder(config)
    _check_shapes(path, config["arch"], build)
    model = build()
    try:
        weights = load_file(path / WEIGHTS, device="cpu")
    except Exception as exc:  # noqa: BLE001 — safetensors' own error type for a truncated or foreign file
        raise CheckpointError(f"{path / WEIGHTS} cannot be read as safetensors ({exc})") from None
    model.load_state_dict(weights, strict=True)  # names and shapes were checked above
    model.to(device).eval()
    return Checkpoint(model=model, vocab=vocab, encoder=resolve_encoder_weights(config["encoder"], path), path=path,
                      meta=config.get("meta", {}), checksum=digests.get(WEIGHTS) or file_checksum(path / WEIGHTS),
                      storage=config.get("storage", "float32"))


def _read_vocabulary(file: Path) -> Vocabulary:
    """The vocabulary ``file`` holds; one that is not (torn, or another file's JSON) is a :class:`CheckpointError`
    naming it, where it was a parser's message, or a ``KeyError`` traceback, about no file in particular."""
    try:
        return Vocabulary.load(file)
    except (ValueError, KeyError, TypeError) as exc:  # ValueError: JSON's, UTF-8's and the specials' own check
        reason = f"no {exc} list" if isinstance(exc, KeyError) else str(exc)
        raise CheckpointError(f"{file} is not a vocabulary ({reason})") from None


class _NoFilling(TorchFunctionMode):
    """Skips the in-place initialisation of a model built on the meta device (``normal_``, ``uniform_``,
    ``kaiming_uniform_``, ``fill_``, …: it has no values to fill).  Run on meta tensors, those go through
    ``torch._refs``, whose first use imports ``torch._dynamo`` and sympy: 150 MB more resident in every server,
    for a check that reads shapes alone."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        target = args[0] if args else kwargs.get("tensor")
        if name.endswith("_") and not name.startswith("__") and isinstance(target, torch.Tensor):
            return target  # an in-place op returns its tensor
        return func(*args, **kwargs)


def on_meta(build: Callable[[], Captioner]) -> Captioner:
    """The model ``build`` makes, on PyTorch's meta device: its shapes and parameter count, without memory."""
    try:
        with torch.device("meta"), _NoFilling():
            return build()
    except (RuntimeError, NotImplementedError) as exc:  # a constructor that reads a tensor's value; a bad config
        # is a ValueError or TypeError, which passes as it is
        if "meta" not in str(exc):  # not the meta device's refusal: a size no tensor can have (a dimension of -5)
            raise CheckpointError(f"the model cannot be built ({exc})") from None
        raise CheckpointError(f"the model cannot be built on PyTorch's meta device ({exc}), where loading checks a "
                              "checkpoint's shapes before allocating anything: a model's constructor must not read "
                              "tensor values (.item(), .tolist()); compute such constants in Python") from None


def state_shapes(model: Captioner) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor of the model's state dict, by name."""
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


def described_model(path: str | Path) -> Captioner:
    """The model checkpoint ``path``'s ``config.json`` describes, on the meta device (:func:`on_meta`)."""
    config = read_config(path)
    return on_meta(_builder(config))


def _builder(config: dict[str, Any]) -> Callable[[], Captioner]:
    """What builds the model a ``config.json`` describes (on whatever device is current)."""
    return functools.partial(create, config["arch"], **config["model"], **config.get("special_ids", {}))


def _check_shapes(path: Path, arch: str, build: Callable[[], Captioner]) -> None:
    """The model ``config.json`` describes, built on PyTorch's meta device (no memory), against the tensors the
    safetensors header lists: a folder whose config asks for a model of gigabytes beside weights of megabytes (a
    mistake, or a hostile folder among the served ones) is refused before anything is allocated."""
    expected = state_shapes(on_meta(build))
    try:
        with safe_open(path / WEIGHTS, "pt") as stored_file:
            stored = {name: tuple(stored_file.get_slice(name).get_shape()) for name in stored_file.keys()}
    except FileNotFoundError:
        raise CheckpointError(f"{path} is not a checkpoint: {WEIGHTS} is missing") from None
    except Exception as exc:  # noqa: BLE001 — safetensors' own error type for a truncated or foreign file
        raise CheckpointError(f"{path / WEIGHTS} cannot be read as safetensors ({exc})") from None
    if expected == stored:
        return
    problems = [f"missing {name}" for name in expected.keys() - stored.keys()]
    problems += [f"unexpected {name}" for name in stored.keys() - expected.keys()]
    problems += [f"{name}: {list(stored[name])} stored, {list(expected[name])} described"
                 for name in expected.keys() & stored.keys() if expected[name] != stored[name]]
    shown = "; ".join(sorted(problems)[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
    raise CheckpointError(f"{path / WEIGHTS} does not hold the weights of the {arch} model its {CONFIG} describes: "
                          f"{shown}")


def resolve_encoder_weights(encoder: dict[str, Any], path: Path) -> EncoderSpec:
    """The encoder spec, with each relative weights file that the checkpoint folder holds (an imported CNN, e.g.
    ``captioner import sgrvinod``; the stages a fine-tuning run trained, ``--finetune-stages``) made absolute, so the
    checkpoint can be served from any working directory."""
    spec = EncoderSpec.from_json(encoder)
    for name in WEIGHTS_FILE_FIELDS:
        file = getattr(spec, name)
        if file and not Path(file).is_absolute() and (path / file).is_file():
            spec = replace(spec, **{name: str((path / file).resolve())})
    return spec


def folder_relative(spec: EncoderSpec, path: Path) -> EncoderSpec:
    """The inverse of :func:`resolve_encoder_weights`: files inside the checkpoint folder named by their name alone,
    so a rewritten or copied checkpoint does not point back into the folder it came from."""
    folder = path.resolve()
    for name in WEIGHTS_FILE_FIELDS:
        file = getattr(spec, name)
        if file and Path(file).is_absolute() and Path(file).parent == folder:
            spec = replace(spec, **{name: Path(file).name})
    return spec


#: a training run's checkpoints (``captioner train --out RUN``): RUN/best and RUN/last, named after their run
RUN_CHECKPOINT_SUFFIXES = {"best": "", "last": "-last"}


def checkpoint_name(path: str | Path) -> str:
    """The name a checkpoint folder is served, exported and reported under: its folder's name, except that a
    training run's ``best`` and ``last`` are named after their run (``runs/sat/best`` → ``sat``, ``runs/sat/last``
    → ``sat-last``): two runs' ``best`` would otherwise share one name."""
    path = Path(path)
    suffix = RUN_CHECKPOINT_SUFFIXES.get(path.name)
    run = Path(os.path.abspath(path)).parent.name  # abspath collapses "..": runs/sat/last/../best is sat's
    return run + suffix if suffix is not None and run else path.name


def is_checkpoint(path: Path) -> bool:
    return (path / CONFIG).is_file() and (path / WEIGHTS).is_file()


def checkpoint_children(folder: str | Path | None) -> list[Path]:
    """The children of ``folder`` that hold a checkpoint, by name (none when it is unset or missing); a child that
    is not itself a checkpoint, such as ``weights/flickr8k`` below ``weights``, is skipped."""
    root = Path(folder) if folder else None
    if not root or not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and is_checkpoint(p))


def find_checkpoints(weights_dir: str | Path | None, extra: Sequence[str | Path] = (),
                     prefixed: Mapping[str, str | Path] | None = None,
                     on_replaced: Callable[[str, Path, Path], None] | None = None,
                     on_skipped: Callable[[Path, CheckpointError], None] | None = None) -> dict[str, Path]:
    """Checkpoint folders by model name (:func:`checkpoint_name`: the folder's, a training run's ``best``/``last`` its
    run's): every checkpoint child of ``weights_dir``, then every checkpoint child of each ``prefixed`` folder under
    its prefix + that name (``{"scenes-": "weights"}`` serves ``weights/sat`` as ``scenes-sat``), then the ``extra``
    folders; a later one with the same name wins, and ``on_replaced(name, winner, loser)`` hears of it (the loser is
    neither served nor exported); an ``extra`` folder that holds no checkpoint is skipped, and ``on_skipped(folder,
    why)`` hears of it (a run given for ``RUN/best``, a typo). This is how the service and ``captioner export`` name
    models (and so the ONNX exports' folders); a prefix that is not a plain name is refused (``ValueError``:
    :func:`~.placement.check_name_prefixes`)."""
    check_name_prefixes(prefixed or {})
    named = [(checkpoint_name(path), path) for path in checkpoint_children(weights_dir)]
    for prefix, folder in (prefixed or {}).items():
        named += [(prefix + checkpoint_name(path), path) for path in checkpoint_children(folder)]
    for path in map(Path, extra):
        if is_checkpoint(path):
            named.append((checkpoint_name(path), path))
        elif on_skipped is not None:
            on_skipped(path, not_a_checkpoint(path))
    found: dict[str, Path] = {}
    for name, path in named:
        if on_replaced is not None and name in found and found[name].resolve() != path.resolve():
            on_replaced(name, path, found[name])
        found[name] = path
    return found
