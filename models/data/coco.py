"""Reader for MS COCO's captions as cocodataset.org distributes them (Lin et al., "Microsoft COCO: Common Objects in
Context", ECCV 2014; Chen et al., "Microsoft COCO Captions", arXiv:1504.00325): ``annotations/captions_train2014.json``
and ``annotations/captions_val2014.json`` (or their 2017 versions), each ``{"images": [{"id", "file_name", ...}],
"annotations": [{"image_id", "id", "caption"}]}``, with the photos in ``train2014/`` and ``val2014/`` beside
``annotations/``.

The publishers' splits are ``train`` and ``val``; the test photos' captions are withheld for the evaluation
server, so there is no ``test`` split here (Karpathy's ``dataset_coco.json`` has one, carved out of val2014:
docs/decisions.md, "Flickr30k and COCO in their publishers' formats").  Image ids are COCO's own, which the
results format of its evaluation server uses; captions are tokenised like the Karpathy JSON's, the first
``max_refs`` by annotation id (a few photos have six or seven).
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

from ..vocab import tokenize
from .karpathy import CaptionedImage, kept_references, read_captions_file

CAPTIONS_FILE = re.compile(r"captions_(train|val)(\d{4})\.json")
YEARS = ("2014", "2017")
SPLITS = ("train", "val")


def coco_captions_file(path: str | Path) -> Path | None:
    """The COCO captions file that stands for the data set at ``path``: ``path`` itself when it is one, else the
    first ``captions_{train,val}{2014,2017}.json`` in the folder ``path`` or its ``annotations/``; ``None`` when
    ``path`` is not COCO in its publishers' layout."""
    path = Path(path)
    if CAPTIONS_FILE.fullmatch(path.name):
        return path
    if not path.is_dir():
        return None
    for folder in (path, path / "annotations"):
        for year in YEARS:
            for split in SPLITS:
                if (folder / f"captions_{split}{year}.json").is_file():
                    return folder / f"captions_{split}{year}.json"
    return None


def _read(path: Path) -> dict:
    text = read_captions_file(path, f"{path} does not exist: COCO's captions files come from cocodataset.org's "
                                    "annotations_trainval archive of the same year")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not COCO's captions JSON ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("images"), list) \
            or not isinstance(data.get("annotations"), list):
        raise ValueError(f"{path} is not COCO's captions JSON: it needs 'images' and 'annotations' lists")
    return data


def load_coco(path: str | Path, image_root: str | Path | None = None, splits: tuple[str, ...] | None = None,
              max_refs: int = 5, limit: int | None = None) -> list[CaptionedImage]:
    """The photos of the requested splits (``train`` and ``val`` by default), in the order of the captions files,
    with at most ``max_refs`` references each; ``path`` is one of the captions files or a folder holding them (see
    :func:`coco_captions_file`).  ``image_root`` is the folder holding ``train2014/`` and ``val2014/``; by default
    the parent of ``annotations/`` (or the captions files' own folder when they are not in one)."""
    captions_file = coco_captions_file(path)
    if captions_file is None:
        raise ValueError(f"{path} is not COCO's captions_train2014.json / captions_val2014.json nor a folder "
                         "holding them")
    year = CAPTIONS_FILE.fullmatch(captions_file.name).group(2)
    folder = captions_file.parent
    if "test" in (splits or ()):
        raise ValueError("COCO's published captions have no test split (the test photos' captions are withheld for "
                         "the evaluation server): evaluate on val, or use Karpathy's dataset_coco.json, whose test "
                         "split is 5,000 val2014 photos")
    unknown = set(splits or ()) - set(SPLITS)
    if unknown:
        raise ValueError(f"COCO has the splits {', '.join(SPLITS)}, not {', '.join(sorted(unknown))}")
    root = Path(image_root) if image_root else (folder.parent if folder.name == "annotations" else folder)
    out = []
    for split in splits or SPLITS:
        captions_path = folder / f"captions_{split}{year}.json"
        data = _read(captions_path)
        texts: dict[int, list[tuple[int, str]]] = defaultdict(list)
        for position, note in enumerate(data["annotations"]):
            image_id, note_id, caption = _fields(captions_path, "annotation", position, note,
                                                 ("image_id", int), ("id", int), ("caption", str))
            texts[image_id].append((note_id, caption))
        seen: set[int] = set()
        for position, entry in enumerate(data["images"]):
            image_id, file_name = _fields(captions_path, "image", position, entry, ("id", int), ("file_name", str))
            if image_id in seen:  # results are keyed by id: the photo would be trained on or scored twice
                raise ValueError(f"{captions_path}: image {position} repeats the id {image_id} of an earlier image")
            seen.add(image_id)
            refs, raw = kept_references([(tokenize(text), text) for _, text in sorted(texts.get(image_id, []))],
                                        max_refs)
            if not refs:
                raise ValueError(f"image {image_id} ({file_name}) of {captions_path} has no caption")
            out.append(CaptionedImage(image_id, root / f"{split}{year}" / file_name, split, refs,
                                      {"filename": file_name, "cocoid": image_id}, raw))
            if limit and len(out) >= limit:
                return out
    return out


def _fields(path: Path, kind: str, position: int, entry: object, *wanted: tuple[str, type]) -> list:
    """The ``wanted`` (key, type) fields of one entry of a captions file, or a one-line :class:`ValueError` naming the
    entry (a missing key or a caption of ``null`` was a traceback, or the reference "none")."""
    values = []
    for key, kind_of in wanted:
        value = entry.get(key) if isinstance(entry, dict) else None
        if isinstance(value, kind_of) and not isinstance(value, bool):
            values.append(value)
        else:
            raise ValueError(f"{path}: {kind} {position} has no {kind_of.__name__} {key!r} (COCO's {kind}s each have "
                             f"{', '.join(repr(k) for k, _ in wanted)})")
    return values
