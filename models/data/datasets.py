"""Every captioned-image data set the project reads, behind one call: the generated scenes (a folder holding
``dataset_scenes.json``), Karpathy-split JSON (COCO, Flickr8k, Flickr30k) and Flickr8k's official text files.

``load_captioned`` is what training, evaluation and feature extraction call; it refuses a data set whose photos
are not where it expects them before anything slow starts.  ``trained_on`` names the data set a checkpoint was
trained on, with its citation, for ``GET /models`` and the model cards.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from .flickr8k import TOKEN_FILE, is_flickr8k, load_flickr8k
from .karpathy import CaptionedImage, load_karpathy

SCENES_FILE = "dataset_scenes.json"
#: the data sets' own names (Karpathy JSON's "dataset" field) → how a model card cites them
CITATIONS = {
    "flickr8k": "Flickr8k (Hodosh, Young & Hockenmaier, JAIR 2013)",
    "flickr30k": "Flickr30k (Young, Lai, Hodosh & Hockenmaier, TACL 2014)",
    "coco": "MS COCO (Lin et al., ECCV 2014)",
    "scenes": "generated scenes (this project's generator)",
}


def resolve_dataset(dataset: str | Path) -> Path:
    """The file a data set is read from: a scene folder's ``dataset_scenes.json``, Flickr8k's token file, or the
    path itself (a Karpathy JSON)."""
    path = Path(dataset)
    if path.is_dir():
        for name in (SCENES_FILE, TOKEN_FILE):
            if (path / name).is_file():
                return path / name
        raise FileNotFoundError(f"{path} holds neither {SCENES_FILE} (generated scenes) nor {TOKEN_FILE} (Flickr8k): "
                                "pass the data set's file (a Karpathy-split JSON such as dataset_coco.json) instead")
    if not path.is_file():
        raise FileNotFoundError(f"dataset {path} does not exist")
    return path


def dataset_name(dataset: str | Path) -> str:
    """``flickr8k``, ``coco``, ``scenes``, …: the Karpathy JSON's own ``dataset`` field, else the file's kind."""
    path = resolve_dataset(dataset)
    if path.name == TOKEN_FILE:
        return "flickr8k"
    if path.name == SCENES_FILE:
        return "scenes"
    match = re.fullmatch(r"dataset_(\w+)\.json", path.name)
    try:
        return str(json.loads(path.read_text()).get("dataset") or (match and match.group(1)) or path.stem)
    except (OSError, ValueError):
        return match.group(1) if match else path.stem


def load_captioned(dataset: str | Path, image_root: str | Path | None = None, splits: tuple[str, ...] | None = None,
                   limit: int | None = None, check_images: bool = True) -> list[CaptionedImage]:
    """The images of ``splits`` of any data set the project reads (see the module docstring); with
    ``check_images`` every image file must exist, or a ``FileNotFoundError`` names the first missing one."""
    path = resolve_dataset(dataset)
    images = (load_flickr8k(path, image_root, splits, limit=limit) if is_flickr8k(path)
              else load_karpathy(path, image_root, splits, limit=limit))
    if check_images:
        missing = next((im.path for im in images if not im.path.is_file()), None)
        if missing is not None:
            hint = "" if image_root else " (the photos' folder is --image-root DIR; by default the JSON's own folder)"
            raise FileNotFoundError(f"image {missing} of {path} does not exist{hint}")
    return images


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
    if dataset.endswith(SCENES_FILE):
        return CITATIONS["scenes"]
    match = re.fullmatch(r"dataset_(\w+)\.json", Path(dataset).name)
    name = "flickr8k" if Path(dataset).name == TOKEN_FILE else match.group(1) if match else None
    return f"{CITATIONS.get(name, name or Path(dataset).name)}, train split"
