"""Reader for Karpathy-split caption JSON (``dataset_coco.json``, ``dataset_flickr8k.json``, ...).

Layout: ``{"images": [{"filepath"?, "filename", "split", "sentences": [{"tokens": [...], "raw": ...}]}]}``.
COCO's ``restval`` split is folded into ``train`` (the standard 113,287-image Karpathy training set).
Extra per-image fields (the generated scenes' objects and masks) are kept in ``CaptionedImage.info``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..vocab import tokenize

SPLIT_ALIASES = {"restval": "train"}


@dataclass
class CaptionedImage:
    image_id: int
    path: Path
    split: str
    references: list[list[str]]  # tokenised reference captions
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return str(self.path)


def read_captions_file(path: Path, missing: str) -> str:
    """A captions file's text, read as UTF-8 as its publishers write it (Karpathy's JSON, Flickr's token files, COCO's
    JSON): a :class:`FileNotFoundError` saying ``missing``, and a :class:`ValueError` naming the file when its bytes
    are another encoding's."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(missing) from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} is not UTF-8 text (byte {exc.start}: {exc.reason}): save it as UTF-8") from None


def load_karpathy(json_path: str | Path, image_root: str | Path | None = None, splits: tuple[str, ...] | None = None,
                  max_refs: int = 5, limit: int | None = None) -> list[CaptionedImage]:
    """Images of the requested splits with at most ``max_refs`` references each, the first ones
    (docs/decisions.md#tokenizer-and-caption-length).

    ``image_root`` defaults to the JSON's folder; an image lives at ``image_root/filepath/filename``.
    """
    json_path = Path(json_path)
    root = Path(image_root) if image_root else json_path.parent
    text = read_captions_file(json_path, f"dataset file {json_path} does not exist")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{json_path} is not a data set's JSON ({exc}): give a Karpathy-split JSON, "
                         "Flickr8k's Flickr8k.token.txt or its folder, or a generated-scene folder") from None
    if not isinstance(data, dict) or not isinstance(data.get("images"), list):
        raise ValueError(f"{json_path} is not a Karpathy-split JSON: no 'images' list")
    if "annotations" in data:
        raise ValueError(f"{json_path} is in COCO's own captions format, not Karpathy's: give it its published name "
                         "(captions_train2014.json, captions_val2014.json, …) or pass the folder that holds them")
    out = []
    for position, entry in enumerate(data["images"]):
        try:
            image = _entry(entry, position, root, max_refs)
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            # one line naming the entry, not a traceback from deep in a parser
            missing = f"no {exc}" if isinstance(exc, KeyError) else str(exc)
            raise ValueError(f"{json_path}: image {position} is not a Karpathy-split entry ({missing}): each needs "
                             "'filename', 'split' and 'sentences', a list of {'tokens': [...]} or {'raw': '...'}"
                             ) from None
        if splits and image.split not in splits:
            continue
        if not image.references:  # BLEU would stop at it after a whole epoch of training
            raise ValueError(f"{json_path}: image {position} ({entry['filename']}) has no caption: its 'sentences' are "
                             "empty or hold no words")
        out.append(image)
        if limit and len(out) >= limit:
            break
    return out


def _entry(entry: dict[str, Any], position: int, root: Path, max_refs: int) -> CaptionedImage:
    """One entry of the JSON's ``images`` list (KeyError, TypeError, … where it lacks what Karpathy's entries hold)."""
    split = SPLIT_ALIASES.get(entry["split"], entry["split"])
    refs = [s["tokens"] if s.get("tokens") else tokenize(s.get("raw", "")) for s in entry["sentences"]]
    refs = [[t.lower() for t in r] for r in refs if r][:max_refs]
    path = root / entry.get("filepath", "") / entry["filename"]
    info = {k: v for k, v in entry.items() if k not in ("sentences", "filename", "filepath", "split")}
    info["sentences"] = entry["sentences"][:max_refs]
    return CaptionedImage(int(entry.get("imgid", entry.get("cocoid", position))), path, split, refs, info)
