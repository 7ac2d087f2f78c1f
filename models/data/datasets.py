"""Every captioned-image data set the project reads, behind one call: the generated scenes (a folder holding
``dataset_scenes.json``), Karpathy-split JSON (COCO, Flickr8k, Flickr30k), Flickr8k's and Flickr30k's token files
with their split lists, and COCO's captions files.

``load_captioned`` is what training, evaluation and feature extraction call; it refuses a data set whose photos
are not where it expects them before anything slow starts.  ``trained_on`` names the data set a checkpoint was
trained on, with its citation, for ``GET /models`` and the model cards.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

from .coco import CAPTIONS_FILE, coco_captions_file, load_coco
from .flickr import TOKEN_FILES, flickr_layout, load_flickr
from .karpathy import CaptionedImage, karpathy_dataset_name, load_karpathy

SCENES_FILE = "dataset_scenes.json"
#: the data set commands read when they are given none: the generated scenes (``captioner data generate``)
DEFAULT_DATASET = ".cache/scenes"
#: the data sets' own names (Karpathy JSON's "dataset" field) → how a model card cites them
CITATIONS = {
    "flickr8k": "Flickr8k (Hodosh, Young & Hockenmaier, JAIR 2013)",
    "flickr30k": "Flickr30k (Young, Lai, Hodosh & Hockenmaier, TACL 2014)",
    "coco": "MS COCO (Lin et al., ECCV 2014)",
    "scenes": "generated scenes (this project's generator)",
}
#: the boxes ``--attention-supervision entities:DIR`` trains the attention on
ENTITIES_CITATION = "Flickr30k Entities (Plummer et al., IJCV 2017, arXiv:1505.04870)"


def resolve_dataset(dataset: str | Path) -> Path:
    """The file a data set is read from: a scene folder's ``dataset_scenes.json``, Flickr8k's or Flickr30k's token
    file, COCO's first captions file, or the path itself (a Karpathy JSON, or one of those files)."""
    path = Path(dataset)
    if path.is_dir() and (path.suffix in (".json", ".txt", ".token") or path.name in TOKEN_FILES):
        raise FileNotFoundError(f"{path} is a folder, not the data set's file")
    if path.is_dir():
        # Flickr8k_text/: where the publishers' text archive is commonly unpacked, beside Flicker8k_Dataset/
        for name in (SCENES_FILE, *TOKEN_FILES, f"Flickr8k_text/{TOKEN_FILES[0]}"):
            if (path / name).is_file():
                return path / name
        coco = coco_captions_file(path)
        if coco is not None:
            return coco
        raise FileNotFoundError(f"{path} holds neither {SCENES_FILE} (generated scenes), {' nor '.join(TOKEN_FILES)} "
                                "(Flickr8k, Flickr30k) nor COCO's captions_train2014.json: pass the data set's file "
                                "(a Karpathy-split JSON such as dataset_coco.json) instead")
    if not path.is_file():
        raise FileNotFoundError(f"dataset {path} does not exist")
    return path


def dataset_name(dataset: str | Path) -> str:
    """``flickr8k``, ``coco``, ``scenes``, …: the Karpathy JSON's own ``dataset`` field, else the file's kind."""
    path = resolve_dataset(dataset)
    named = _named_by_file(path)
    if named:
        return named
    match = re.fullmatch(r"dataset_(\w+)\.json", path.name)
    try:
        named = karpathy_dataset_name(path)
    except (OSError, ValueError):  # not a Karpathy JSON after all: what its file name says
        named = None
    return named or (match.group(1) if match else path.stem)


def load_captioned(dataset: str | Path, image_root: str | Path | None = None, splits: tuple[str, ...] | None = None,
                   limit: int | None = None, check_images: bool = True) -> list[CaptionedImage]:
    """The images of ``splits`` of any data set the project reads (see the module docstring); with
    ``check_images`` every image file must exist, or a ``FileNotFoundError`` names the first missing one."""
    path = resolve_dataset(dataset)
    reader, photos_folder = READERS.get(_named_by_file(path), READERS[None])
    if image_root is not None and not Path(image_root).is_dir():
        raise FileNotFoundError(f"--image-root {image_root} is not a folder: it should be {photos_folder}")
    images = reader(path, image_root, splits, limit=limit)
    if check_images:
        missing = next((im.path for im in images if not im.path.is_file()), None)
        if missing is not None:
            where = (f"the photos' folder is --image-root {image_root}: {photos_folder}" if image_root else
                     f"no --image-root was given, so the photos were looked for from {path.parent}; give the folder "
                     f"that holds them as --image-root: {photos_folder}")
            raise FileNotFoundError(f"image {missing} of {path} does not exist ({where})")
    return images


class EmptySplitError(ValueError):
    """A split that holds no image (a split name the data set does not use included)."""


def load_split(dataset: str | Path, image_root: str | Path | None, split: str, **options) -> list[CaptionedImage]:
    """One split's captioned images (:func:`load_captioned`'s ``options``); a split with none, a name the data set
    does not use included, is an :class:`EmptySplitError` naming the splits it has."""
    images = load_captioned(dataset, image_root, (split,), **options)
    if not images:
        try:
            present = sorted({im.split for im in load_captioned(dataset, image_root, check_images=False)})
        except (OSError, ValueError):  # a split's file missing: the empty split is the news
            present = []
        has = f"; its splits are {', '.join(present)}" if present else ""
        raise EmptySplitError(f"split {split!r} of {dataset} is empty{has}")
    return images


def train_split_captions(dataset: str | Path, image_root: str | Path | None) -> list[list[str]] | None:
    """The captions a model was trained on (its data set's train split), for the share of its captions that are new;
    None, with a note on stderr, when the data set's train captions are not here (COCO's val file without its train
    file)."""
    try:
        images = load_captioned(dataset, image_root, ("train",), check_images=False)
    except FileNotFoundError as exc:
        print(f"note: no share of novel captions: {exc}", file=sys.stderr)
        return None
    return [r for im in images for r in im.references]


def trained_on(meta: dict[str, Any]) -> str:
    """The data set a checkpoint was trained on, as ``GET /models`` names it: the training run's record
    (``meta["trained_on"]``), else what its dataset path says, else where an imported checkpoint came from."""
    if meta.get("trained_on"):
        return str(meta["trained_on"])
    imported = meta.get("imported_from")
    if isinstance(imported, dict):
        return f"the authors' released weights ({imported.get('code', 'see its model card')})"
    dataset = str(meta.get("dataset") or "")
    if not dataset:
        return "not recorded"
    name = named_by_path(dataset)
    if name == "scenes":
        return CITATIONS["scenes"]
    return f"{CITATIONS.get(name, name or Path(dataset).name)}, train split"


def named_by_path(dataset: str | Path) -> str | None:
    """``flickr8k``, ``coco``, ``scenes``, …: the data set a recorded path names by its file name alone (a publisher's
    file, or Karpathy's ``dataset_NAME.json``), without reading it: the path may be another machine's."""
    path = Path(dataset)
    match = re.fullmatch(r"dataset_(\w+)\.json", path.name)
    return _named_by_file(path) or (match.group(1) if match else None)


#: the reader of each kind of data set file (:func:`_named_by_file`; None: a Karpathy JSON, the generated scenes'
#: included), and what its ``--image-root`` is
READERS = {"flickr8k": (load_flickr, "the folder of the photos themselves; by default found beside the token file"),
           "flickr30k": (load_flickr, "the folder of the photos themselves; by default found beside the token file"),
           "coco": (load_coco, "the folder holding train2014/ and val2014/; by default the one holding annotations/"),
           None: (load_karpathy, "the folder the JSON's filepath/filename paths start from; by default the JSON's "
                                 "own")}


def _named_by_file(path: Path) -> str | None:
    """The data set whose own file name ``path`` has (scenes, a Flickr token file, a COCO captions file)."""
    if path.name == SCENES_FILE:
        return "scenes"
    layout = flickr_layout(path) if not path.is_dir() else None
    if layout is not None:
        return layout.name
    return "coco" if CAPTIONS_FILE.fullmatch(path.name) else None
