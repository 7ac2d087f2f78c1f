"""On-disk store of frozen-encoder grid features: float16, sharded, memory-mapped, resumable, shared by DDP ranks.

Layout of one store (one folder per encoder spec + image list, named by :func:`_cache_name`)::

    <cache_dir>/<backbone>-<layer>-<size>-<digest>/
        shard-00000.npy    float16 [≤ shard_size, rows, feat_dim]   plain .npy (no pickle), memory-mapped to read
        shard-00001.npy
        ...
        index.json         format, encoder spec, item shape, shard files, key → [shard, row], each photo's size in
                           bytes; written last

* **Incremental, resumable.**  Shard ``j`` holds images ``j·S … (j+1)·S − 1`` of the list.  It is filled in a
  ``shard-0000j.partial.npy`` and renamed to its final name once complete (an atomic rename), so a finished
  shard file is always whole.  An interrupted extraction (crash, Ctrl-C, preemption) keeps its finished shards
  and the next run encodes only the missing ones; at most one shard of work is lost.
* **Completion marker.**  ``index.json`` is written (atomically) after the last shard: a store without it is
  unfinished and is never read.
* **Stale photos.**  A store is keyed by the photos' paths, so a data set regenerated or replaced in place (``captioner
  data generate`` with another seed, sizes or generator version into the same folder) would get the old photos'
  features.  The index records each photo's size in bytes, and a store whose photos no longer have those sizes is
  not used: extracted again (its own folder) or passed over (a covering store).  Stores written before sizes were
  recorded cannot tell and are used as before.
* **Read without loading.**  :class:`FeatureStore` maps each shard with ``np.load(mmap_mode="r")`` on first use
  and copies only the rows of a batch; memory stays at the page cache, which the OS shares between processes.
* **DDP.**  Only global rank 0 extracts (holding an ``fcntl`` lock on ``extract.lock``, which also keeps two
  unrelated processes from writing the same store); the other ranks poll for ``index.json`` and then map the same
  files.  If rank 0 fails it leaves ``failed.json`` and the waiting ranks stop with its message instead of
  waiting forever.  Ranks must see the same ``cache_dir`` (one machine, or a shared filesystem); on several
  machines without one, extract first with ``captioner data features``.

Bytes per image and read throughput are measured by ``benchmarks/bench_feature_store.py``
(docs/feature_store.md).  Training and evaluation reach this store, or precomputed region features, through
:func:`captioner.models.data.stores.open_feature_store`.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..encoder import EncoderSpec, GridEncoder, preprocess, weights_sha256
from ..files import is_newer_format, read_json_file, write_atomically
from ..images import ImageDecodeError, load_image
from ..progress import progress_bar
from ..protocol import VisualBatch
from .karpathy import CaptionedImage

if TYPE_CHECKING:  # the ONNX CNN `captioner eval --encoder-precision int8` extracts with, and a shard's bar
    from tqdm import tqdm

    from ..export.sessions import VisualSession

FORMAT = "attention-captioner-features/2"
INDEX, FAILED, LOCK = "index.json", "failed.json", "extract.lock"
#: the shard size an unfinished store was started with: its finished shards are kept only under the same size
LAYOUT = "layout.json"
#: images per shard: 1,024 COCO images at 16×16×472 float16 make a 247 MB file
DEFAULT_SHARD_SIZE = 1024
#: what a store's images are before the encoder sees them, applied to :func:`preprocess`'s output so that training
#: and serving keep one preprocessing path.  ``""``: the photo; ``"hflip"``: its mirror image (``captioner train
#: --augment hflip``; the network input mirrored is the mirrored photo preprocessed, up to the resize's rounding)
VIEWS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"": lambda pixels: pixels,
                                                              "hflip": lambda pixels: pixels.flip(-1)}


class FeatureStoreError(RuntimeError):
    """A feature store is unfinished, of an unknown format, or its extraction failed on another rank."""


class UnreadablePhotos(ImageDecodeError):
    """Photos of a data set that could not be decoded, all of them named (an extraction goes on past each)."""

    def __init__(self, failures: Sequence[str], encoded: int, total: int):
        shown = "\n  ".join(failures[:10]) + (f"\n  and {len(failures) - 10} more" if len(failures) > 10 else "")
        super().__init__(f"{len(failures)} photo(s) could not be read:\n  {shown}\nreplace them and run again, "
                         f"which encodes only the shards that held one (the {encoded} of {total} images encoded in "
                         "the others are kept), or remove them from the data set")
        self.failures = list(failures)


class NewerFeatureStore(FeatureStoreError):
    """A store a newer version of the project wrote: never extracted again in its place (that version, sharing the
    cache folder, would extract it back), but refused."""


def shard_name(shard: int) -> str:
    return f"shard-{shard:05d}.npy"


class FeatureStore:
    """A finished store, read through memory maps: ``store.batch(keys)`` copies only those images' rows."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        try:
            index = read_json_file(self.folder / INDEX, "a feature store's index")
        except FileNotFoundError:
            raise FeatureStoreError(f"{self.folder} is not a finished feature store: {INDEX} is missing") from None
        except ValueError as exc:  # torn or altered: extracted again in its place, as a store of another format
            raise FeatureStoreError(str(exc)) from None
        if index.get("format") != FORMAT:
            if is_newer_format(index.get("format"), FORMAT):
                raise NewerFeatureStore(f"{self.folder} was written by a newer version of the project (format "
                                        f"{index['format']!r}; this one reads {FORMAT!r}): give this version "
                                        "another cache folder, or upgrade it")
            raise FeatureStoreError(f"{self.folder}: unknown feature store format {index.get('format')!r}")
        try:
            self.item_shape = tuple(index["item_shape"])
            self.shard_files = [self.folder / name for name in index["shards"]]
            self.location: dict[str, tuple[int, int]] = {key: (s, r) for key, (s, r) in index["index"].items()}
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise FeatureStoreError(f"{self.folder / INDEX} is not a feature store's index ({exc!r})") from None
        self.encoder = index.get("encoder")
        # the sha256 of each weights file of the spec (:func:`weights_sha256`); a store written before local ImageNet
        # files were known by content recorded the fine-tuned stages' alone
        self.weights_sha256: dict[str, str] = index.get("weights_sha256") or (
            {"tuned_weights": index["tuned_sha256"]} if index.get("tuned_sha256") else {})
        self.view = index.get("view", "")  # a key of VIEWS
        self.file_bytes: dict[str, int] = index.get("bytes") or {}  # each photo's size when it was encoded
        self._shards: list[np.ndarray | None] = [None] * len(self.shard_files)

    @property
    def feat_dim(self) -> int:
        return int(self.item_shape[-1])

    def describes(self, sizes: Mapping[str, int]) -> bool:
        """Whether the photos of ``sizes`` (:func:`photo_file_bytes`) are still those whose features this store holds,
        by their sizes in bytes (a regenerated or replaced photo at the same path almost never keeps its size; a
        copy keeps it, where a modification time would not).  A photo whose size was not recorded (an older store)
        or that is not on this machine cannot tell, and counts as current."""
        return all(self.file_bytes.get(key, size) == size for key, size in sizes.items())

    def __len__(self) -> int:
        return len(self.location)

    def __contains__(self, key: str) -> bool:
        return key in self.location

    def shard(self, number: int) -> np.ndarray:
        if self._shards[number] is None:  # mapped on first use; nothing is read until rows are indexed
            try:
                self._shards[number] = np.load(self.shard_files[number], mmap_mode="r", allow_pickle=False)
            except ValueError as exc:  # cut short or overwritten since its index was written
                raise ValueError(f"{self.shard_files[number]} is not a whole feature shard ({exc}): remove "
                                 f"{self.folder} and run again to extract it anew") from None
        return self._shards[number]

    def get_numpy(self, keys: Sequence[str]) -> np.ndarray:
        """float16 ``[len(keys), rows, feat_dim]`` in the order of ``keys``; reads shard by shard in row order."""
        out = np.empty((len(keys), *self.item_shape), dtype=np.float16)
        where = np.array([self.location[k] for k in keys], dtype=np.int64).reshape(len(keys), 2)
        for number in np.unique(where[:, 0]):
            positions = np.nonzero(where[:, 0] == number)[0]
            rows = where[positions, 1]
            order = np.argsort(rows)  # ascending rows: the OS reads ahead instead of seeking back and forth
            out[positions[order]] = self.shard(int(number))[rows[order]]
        return out

    def get(self, keys: Sequence[str]) -> torch.Tensor:
        return torch.from_numpy(self.get_numpy(keys).astype(np.float32))

    def batch(self, keys: Sequence[str]) -> VisualBatch:
        """Every image has the same grid, so nothing is padded and the mask is all True."""
        return VisualBatch.from_features(self.get(keys))


#: EncoderSpec fields added after feature caches were first written, with the value all earlier caches were made
#: with: at that value a field stays out of the cache key, so existing caches stay valid
_LATER_FIELDS = {"grid_stride": 32}


def _cache_name(spec: EncoderSpec, keys: Sequence[str], files: Mapping[str, str] | None = None,
                view: str = "") -> str:
    """The store's folder name: the spec, each weights file it names by its content (``files``, its
    :func:`weights_sha256`) in place of its path, the view and the images."""
    fields = {k: v for k, v in spec.to_json().items() if _LATER_FIELDS.get(k, object()) != v}
    fields.update(weights_sha256(spec) if files is None else files)
    if view:  # the photos as they are keep the names caches had before views existed
        fields["view"] = view
    digest = hashlib.sha256(json.dumps([fields, list(keys)]).encode()).hexdigest()[:16]
    return f"{spec.backbone}-{spec.layer}-{spec.image_size}-{digest}"


def distributed_rank() -> int:
    """The global rank under ``torchrun`` (0 outside it): from the process group if it is up, else ``RANK``."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))


@contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # blocks while another process extracts into the same folder
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def photo_file_bytes(images: Sequence[CaptionedImage]) -> dict[str, int]:
    """Each photo's size in bytes by its key (photos not on this machine are left out), read once per extraction:
    what a store records and what :meth:`FeatureStore.describes` compares."""
    sizes = {}
    for im in images:
        with suppress(OSError):
            sizes[im.key] = im.path.stat().st_size
    return sizes


def _write_json_atomically(path: Path, data: dict) -> None:
    write_atomically(path, json.dumps(data))


def find_covering_store(cache_dir: str | Path, spec: EncoderSpec, keys: Sequence[str],
                        files: Mapping[str, str] | None = None, view: str = "",
                        sizes: Mapping[str, int] | None = None) -> FeatureStore | None:
    """A finished store in ``cache_dir`` of the same encoder spec (and weights files, by content: ``files``, the
    spec's :func:`weights_sha256`; and view)
    that holds every key (and, given their :func:`photo_file_bytes`, still describes their photos), if there is one: a
    store of all splits serves training (train + val) and evaluation (test) alike."""
    files = weights_sha256(spec) if files is None else files
    prefix = f"{spec.backbone}-{spec.layer}-{spec.image_size}-"
    for index in sorted(Path(cache_dir).glob(f"{prefix}*/{INDEX}")):
        try:
            store = FeatureStore(index.parent)
        except (FeatureStoreError, ValueError, KeyError):
            continue
        if store.encoder == spec.to_json() and store.weights_sha256 == files and store.view == view \
                and all(key in store.location for key in keys) and store.describes(sizes or {}):
            return store
    return None


def _finished(folder: Path, sizes: Mapping[str, int]) -> FeatureStore | None:
    """The finished store in ``folder`` if it still describes the photos of ``sizes`` and is of this version's
    :data:`FORMAT`, else None: a store an older version wrote (the folder's name does not hold the format) is
    extracted again in its place, as a store of changed photos is, not left on disk refusing every run.  One a newer
    version wrote is refused (:class:`NewerFeatureStore`): two versions sharing a cache would otherwise re-extract
    each other's stores for good, and pull shards from under each other's runs."""
    if not (folder / INDEX).exists():  # unfinished, or its index.json removed by a re-extraction meanwhile
        return None
    try:
        store = FeatureStore(folder)
    except NewerFeatureStore:
        raise
    except FeatureStoreError:  # of an older format
        return None
    return store if store.describes(sizes) else None


def wait_for_store(folder: Path, poll_s: float = 2.0, timeout_s: float | None = None,
                   sizes: Mapping[str, int] | None = None) -> FeatureStore:
    """What ranks other than 0 do: wait for rank 0's completion marker (``index.json``, of a store that describes
    the photos of ``sizes``) or failure marker."""
    start, started_at = time.monotonic(), time.time()
    while (store := _finished(folder, sizes or {})) is None:
        try:  # a failure marker from an earlier run (older than this wait by a minute) is rank 0's to clear
            failed = folder / FAILED
            if failed.stat().st_mtime > started_at - 60:
                raise FeatureStoreError(f"feature extraction into {folder} failed on rank 0: "
                                        f"{json.loads(failed.read_text()).get('error')}")
        except FileNotFoundError:  # no marker, or rank 0 removed it while this rank looked
            pass
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            raise FeatureStoreError(f"waited {timeout_s:.0f} s for rank 0 to finish {folder / INDEX}")
        time.sleep(poll_s)
    return store


def extract_features(images: Sequence[CaptionedImage], spec: EncoderSpec, cache_dir: str | Path,
                     batch_size: int = 32, device: str = "cpu", encoder: GridEncoder | VisualSession | None = None,
                     progress: bool = True, shard_size: int = DEFAULT_SHARD_SIZE, rank: int | None = None,
                     wait_timeout_s: float | None = None, view: str = "") -> FeatureStore:
    """The store of ``spec``'s grid features for ``images`` (seen as ``view``, a key of :data:`VIEWS`) in
    ``cache_dir``, extracted (or finished) first if needed.  ``rank`` defaults to the DDP rank: rank 0 extracts,
    the others wait for it."""
    if view not in VIEWS:
        raise ValueError(f"unknown view {view!r}; choose from {', '.join(map(repr, VIEWS))}")
    keys = [im.key for im in images]
    files = weights_sha256(spec)  # read once: the name, the covering store and the index all need it
    folder = Path(cache_dir) / _cache_name(spec, keys, files, view)
    sizes = photo_file_bytes(images)  # once: every store looked at below compares them, and the new index records them
    if (store := _finished(folder, sizes)) is not None:
        return store
    covering = find_covering_store(cache_dir, spec, keys, files, view, sizes)
    if covering is not None:  # e.g. all splits extracted once by `captioner data features`
        return covering
    folder.mkdir(parents=True, exist_ok=True)
    if (distributed_rank() if rank is None else rank) != 0:
        return wait_for_store(folder, timeout_s=wait_timeout_s, sizes=sizes)
    with _exclusive(folder / LOCK):
        if (store := _finished(folder, sizes)) is not None:  # another process finished it meanwhile
            return store
        if (folder / INDEX).exists():  # the photos changed since (a data set regenerated in place), or the store
            # is another version's: encode again, in its place
            (folder / INDEX).unlink()
            for stale in folder.glob("shard-*.npy"):
                stale.unlink()
        (folder / FAILED).unlink(missing_ok=True)
        try:
            _extract_shards(images, spec, folder, batch_size, device, encoder, progress, shard_size, sizes, files,
                            view)
        except BaseException as error:  # KeyboardInterrupt too: waiting ranks must not wait forever
            # the disk that is full, or read-only, for the shards is for this record too: the error that stopped
            # the extraction is the one to tell, not this one's
            with suppress(OSError):
                _write_json_atomically(folder / FAILED, {"error": f"{type(error).__name__}: {error}"})
            raise
    return FeatureStore(folder)


def _finished_shards(folder: Path, shards: Sequence[Sequence[int]], shard_size: int) -> list[bool]:
    """Which of ``shards`` an interrupted extraction already wrote.  A shard holds the images of its position
    under one shard size, so the shards of a run started with another size (``--shard-size``) are discarded, not
    read as if they held other images."""
    layout = folder / LAYOUT
    try:
        recorded = read_json_file(layout, "a shard layout").get("shard_size") if layout.exists() else shard_size
    except ValueError:  # torn: the shards' size cannot be told, so they are not kept
        recorded = None
    if recorded != shard_size:
        for stale in folder.glob("shard-*.npy"):
            stale.unlink()
    _write_json_atomically(layout, {"shard_size": shard_size})
    return [(folder / shard_name(j)).exists()
            and np.load(folder / shard_name(j), mmap_mode="r").shape[0] == len(members)
            for j, members in enumerate(shards)]


def _new_shard(path: Path, shape: tuple[int, ...]) -> np.memmap:
    """A float16 ``.npy`` file of ``shape`` mapped in memory, its bytes reserved on the disk first: the mapped file
    is otherwise sparse, and a write into it that the disk cannot hold is a SIGBUS (the process died with "Bus
    error" and no word of the full disk); a reservation that fails is an ``OSError`` naming the shard."""
    array, size = None, int(np.prod(shape)) * np.dtype(np.float16).itemsize
    try:  # the header open_memmap writes first can find the disk full too: the same error, naming the shard
        array = np.lib.format.open_memmap(path, mode="w+", dtype=np.float16, shape=shape)
        size = path.stat().st_size
        if hasattr(os, "posix_fallocate"):  # Linux; elsewhere the sparse file stays
            with open(path, "r+b") as handle:
                os.posix_fallocate(handle.fileno(), 0, size)
    except OSError as exc:
        del array
        path.unlink(missing_ok=True)
        raise OSError(exc.errno, f"no room for the feature shard {path} ({size / 2**20:.1f} MiB): {exc.strerror}; "
                                 "free space there or give another --cache-dir") from None
    return array


def _pixels_or_blank(image: CaptionedImage, spec: EncoderSpec, unreadable: list[str]) -> torch.Tensor:
    """The network's input for ``image``; for a photo that cannot be decoded, its error is added to ``unreadable``
    and a blank input keeps the batch's shape (its shard is not kept)."""
    try:
        return preprocess(load_image(image.path), spec)[0]
    except ImageDecodeError as exc:
        unreadable.append(str(exc))
        return torch.zeros(3, spec.image_size, spec.image_size)


def _extract_shards(images: Sequence[CaptionedImage], spec: EncoderSpec, folder: Path, batch_size: int,
                    device: str, encoder: GridEncoder | VisualSession | None, progress: bool, shard_size: int,
                    sizes: Mapping[str, int], files: Mapping[str, str] | None = None, view: str = "") -> None:
    """Encode ``images`` into the shards of ``folder`` (``shard_size`` images each; those an interrupted run
    finished are kept), then write its index; photos that cannot be decoded are named at the end
    (:class:`UnreadablePhotos`), their shards left to encode again."""
    if shard_size < 1:
        raise ValueError(f"shard_size must be ≥ 1, got {shard_size}")
    shards = [list(range(start, min(start + shard_size, len(images))))
              for start in range(0, len(images), shard_size)]
    done = _finished_shards(folder, shards, shard_size)
    model = None
    encoded = sum(len(s) for s, d in zip(shards, done) if d)
    unreadable: list[str] = []  # every torn photo is named at the end, not one per run of hours
    if not progress and encoded < len(images):  # without bars (logs, CI), a line per shard: minutes were silent
        print(f"encoding {len(images) - encoded} images{f' ({view})' if view else ''} into {folder}",
              file=sys.stderr, flush=True)
    with progress_bar(total=len(images), initial=encoded, desc=f"encoding images{f' ({view})' if view else ''}",
                      unit="img", disable=not progress) as bar:
        for number, members in enumerate(shards):
            if done[number]:
                continue
            if model is None:  # a finished store needs no encoder at all
                model = _ready_encoder(encoder, spec, device)
            partial = folder / f"shard-{number:05d}.partial.npy"
            failures_before = len(unreadable)
            _encode_shard(model, [images[i] for i in members], spec, device, view, batch_size, partial, unreadable,
                          bar)
            if len(unreadable) > failures_before:  # a blank stands for a photo: encoded again once it is mended
                partial.unlink()
                continue
            os.replace(partial, folder / shard_name(number))  # the shard is complete: it gets its final name
            encoded += len(members)  # counted here: a disabled bar counts nothing
            if not progress:
                print(f"  {encoded} of {len(images)} images encoded", file=sys.stderr, flush=True)
    if unreadable:
        raise UnreadablePhotos(unreadable, encoded, len(images))
    _write_index(folder, images, spec, len(shards), shard_size, sizes, files, view)


def _ready_encoder(encoder: GridEncoder | VisualSession | None, spec: EncoderSpec,
                   device: str) -> GridEncoder | VisualSession:
    """``encoder``, or else a new PyTorch encoder of ``spec``, ready to encode on ``device``."""
    model = encoder if encoder is not None else GridEncoder(spec)
    if isinstance(model, torch.nn.Module):  # an ONNX session runs where it was opened
        model = model.to(device).eval()
    return model


def _encode_shard(model: GridEncoder | VisualSession, images: Sequence[CaptionedImage], spec: EncoderSpec,
                  device: str, view: str, batch_size: int, partial: Path, unreadable: list[str],
                  bar: tqdm) -> None:
    """Encode the ``images`` of one shard, seen through ``view``, in batches of ``batch_size`` into the new shard
    file ``partial``; a photo that cannot be decoded is encoded as a blank and its error added to ``unreadable``."""
    rows, cols = spec.grid_hw
    array = None  # opened on the first batch's features, whose shape it takes
    for start in range(0, len(images), batch_size):
        chunk = images[start:start + batch_size]
        pixels = VIEWS[view](torch.stack([_pixels_or_blank(im, spec, unreadable) for im in chunk]))
        with torch.no_grad():
            features = model(pixels.to(device)).float().cpu().numpy().astype(np.float16)
        if features.shape[1] != rows * cols:
            raise ValueError(f"the encoder gave {features.shape[1]} grid cells per image, where {spec} has "
                             f"{rows}×{cols}")
        if array is None:
            array = _new_shard(partial, (len(images), *features.shape[1:]))
        array[start:start + len(chunk)] = features
        bar.update(len(chunk))
    array.flush()
    del array


def _write_index(folder: Path, images: Sequence[CaptionedImage], spec: EncoderSpec, shards: int, shard_size: int,
                 sizes: Mapping[str, int], files: Mapping[str, str] | None, view: str) -> None:
    """Write the index of the store in ``folder`` (``shards`` shards of ``shard_size`` images), last: a store is
    finished once it has one (:func:`_finished`)."""
    rows, cols = spec.grid_hw
    first = np.load(folder / shard_name(0), mmap_mode="r") if shards else np.zeros((0, rows * cols, 0), np.float16)
    index = {im.key: [j // shard_size, j % shard_size] for j, im in enumerate(images)}
    _write_json_atomically(folder / INDEX, {
        "format": FORMAT, "encoder": spec.to_json(), "dtype": "float16", "item_shape": list(first.shape[1:]),
        "shard_size": shard_size, "shards": [shard_name(j) for j in range(shards)], "images": len(images),
        "index": index, "bytes": dict(sizes),
        **({"weights_sha256": dict(files)} if files else {}), **({"view": view} if view else {})})
