"""Reader for Karpathy-split caption JSON (``dataset_coco.json``, ``dataset_flickr8k.json``, ...).

Layout: ``{"images": [{"filepath"?, "filename", "split", "sentences": [{"tokens": [...], "raw": ...}]}]}``.
COCO's ``restval`` split is folded into ``train`` (the standard 113,287-image Karpathy training set).
Extra per-image fields (the generated scenes' objects and masks) are kept in ``CaptionedImage.info``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from ..vocab import tokenize

SPLIT_ALIASES = {"restval": "train"}
GZIP_MAGIC = b"\x1f\x8b"
#: what ``--dataset`` takes, for the commands' help and the errors that refuse a file
DATASET_FORMATS = ("a Karpathy-split JSON (dataset_coco.json, …), Flickr8k's or Flickr30k's token file or its folder, "
                   "COCO's annotations folder (captions_train2014.json, …), or a folder holding dataset_scenes.json")


@dataclass
class CaptionedImage:
    image_id: int
    path: Path
    split: str
    references: list[list[str]]  # tokenised reference captions
    info: dict[str, Any] = field(default_factory=dict)
    #: the references as their data set writes them, one per tokenised reference (what coco-caption's PTB
    #: tokenizer reads: metrics.py, ``ptb_tokenize``); empty where a data set gives tokens alone
    raw_references: list[str] = field(default_factory=list)

    @cached_property
    def key(self) -> str:
        """The photo's name in feature stores and batches: its absolute path with links resolved, so that one
        photo has one key however a command spells its data set (a run resumed from another folder, a dataset
        given through a symbolic link or as ``../``) and its features are encoded once."""
        return str(self.path.resolve())


def read_captions_file(path: Path, missing: str) -> str:
    """A captions file's text, read as UTF-8 as its publishers write it (Karpathy's JSON, Flickr's token files, COCO's
    JSON), a byte-order mark dropped (Windows editors write one): a :class:`FileNotFoundError` saying ``missing``, and
    a :class:`ValueError` naming the file when it is a folder, gzip-compressed, or another encoding's bytes."""
    if path.is_dir():
        raise ValueError(f"{path} is a folder, not a captions file")
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(missing) from None
    if data[:2] == GZIP_MAGIC:
        raise ValueError(f"{path} is gzip-compressed: unpack it (gunzip) and give the file it holds")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ValueError(f"{path}:{line} is not UTF-8 text (byte {exc.start}: {exc.reason}): save it as UTF-8"
                         ) from None


def read_karpathy_json(json_path: str | Path) -> dict[str, Any]:
    """The parsed JSON of a Karpathy-split file, checked to be one (a dict with an ``images`` list, not COCO's own
    captions format): a :class:`FileNotFoundError` when it is missing, a :class:`ValueError` naming the file
    otherwise.  :func:`load_karpathy` and :func:`karpathy_dataset_name` read it through here."""
    json_path = Path(json_path)
    text = read_captions_file(json_path, f"dataset file {json_path} does not exist")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{json_path} is not a data set's JSON ({exc}): --dataset takes {DATASET_FORMATS}") from None
    if not isinstance(data, dict) or not isinstance(data.get("images"), list):
        raise ValueError(f"{json_path} is not a Karpathy-split JSON: no 'images' list")
    if "annotations" in data:
        notes = data["annotations"]
        if not (isinstance(notes, list) and notes and isinstance(notes[0], dict) and "caption" in notes[0]):
            raise ValueError(f"{json_path} is a COCO annotations file without captions (instances, keypoints, …): "
                             "give the captions file of the same archive (captions_train2014.json, …)")
        raise ValueError(f"{json_path} is in COCO's own captions format, not Karpathy's: give it its published name "
                         "(captions_train2014.json, captions_val2014.json, …) or pass the folder that holds them")
    return data


def karpathy_dataset_name(json_path: str | Path) -> str | None:
    """The data set a Karpathy-split file says it holds (its top-level ``dataset`` field: ``flickr8k``, ``coco``,
    ``scenes``, …), None when it says none; errors as :func:`read_karpathy_json`'s."""
    named = read_karpathy_json(json_path).get("dataset")
    return str(named) if named else None


def load_karpathy(json_path: str | Path, image_root: str | Path | None = None, splits: tuple[str, ...] | None = None,
                  max_refs: int = 5, limit: int | None = None) -> list[CaptionedImage]:
    """Images of the requested splits with at most ``max_refs`` references each, the first ones
    (docs/decisions.md#tokenizer-and-caption-length).

    ``image_root`` defaults to the JSON's folder; an image lives at ``image_root/filepath/filename``.
    """
    json_path = Path(json_path)
    root = Path(image_root) if image_root else json_path.parent
    data = read_karpathy_json(json_path)
    if splits:
        folded = [split for split in splits if split in SPLIT_ALIASES]
        if folded:
            raise ValueError(f"split {folded[0]!r} is read as part of {SPLIT_ALIASES[folded[0]]!r} (Karpathy's "
                             f"training set): ask for {SPLIT_ALIASES[folded[0]]!r}")
    out, first_of_id, first_of_photo = [], {}, {}
    for position, entry in enumerate(data["images"]):
        try:
            image = _entry(entry, position, root, max_refs)
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            # one line naming the entry, not a traceback from deep in a parser
            missing = f"no {exc}" if isinstance(exc, KeyError) else str(exc)
            raise ValueError(f"{json_path}: image {position} is not a Karpathy-split entry ({missing}): each needs "
                             "'filename', 'split' and 'sentences', a list of {'tokens': [...]} or {'raw': '...'}"
                             ) from None
        if image.image_id in first_of_id:  # results are keyed by id: two images would share one caption
            raise ValueError(f"{json_path}: images {first_of_id[image.image_id]} and {position} have the same id "
                             f"{image.image_id}: each image needs its own 'imgid' (or 'cocoid')")
        first_of_id[image.image_id] = position
        if image.path in first_of_photo:  # in two splits, a test photo is trained on; in one, it counts twice
            raise ValueError(f"{json_path}: images {first_of_photo[image.path]} and {position} are the same photo "
                             f"({image.path}): list each photo once, in one split")
        first_of_photo[image.path] = position
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
    pairs = [(tokenize(" ".join(_tokens(s["tokens"])) if s.get("tokens") else s.get("raw", "")),
              s.get("raw") or " ".join(s.get("tokens") or ())) for s in entry["sentences"]]
    refs, raw = kept_references(pairs, max_refs)
    path = root / entry.get("filepath", "") / entry["filename"]
    info = {k: v for k, v in entry.items() if k not in ("sentences", "filename", "filepath", "split")}
    info["sentences"] = entry["sentences"][:max_refs]
    return CaptionedImage(int(entry.get("imgid", entry.get("cocoid", position))), path, split, refs, info, raw)


def kept_references(pairs: list[tuple[list[str], str]], max_refs: int) -> tuple[list[list[str]], list[str]]:
    """The first ``max_refs`` (tokens, raw text) pairs that hold a word, as the tokenised references and their raw
    texts, aligned (docs/decisions.md#tokenizer-and-caption-length)."""
    kept = [(tokens, raw) for tokens, raw in pairs if tokens][:max_refs]
    return [tokens for tokens, _ in kept], [raw for _, raw in kept]


def _tokens(tokens: Any) -> list[str]:
    """A sentence's ``tokens``, which must be a list of words (a string would be read letter by letter); they are
    tokenised again by the one rule every format's captions follow (lower case, no punctuation)."""
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise ValueError(f"'tokens' must be a list of words, not {tokens!r:.60}")
    return tokens
