"""Readers for Flickr8k and Flickr30k as their publishers distribute them: one token file of
``<image>#<0-4>\\t<caption>`` lines (five captions per photo) and three split lists.

* **Flickr8k** (Hodosh, Young & Hockenmaier, "Framing Image Description as a Ranking Task", JAIR 47, 2013):
  ``Flickr8k.token.txt`` and the official split ``Flickr_8k.trainImages.txt`` / ``Flickr_8k.devImages.txt`` /
  ``Flickr_8k.testImages.txt`` (6,000 / 1,000 / 1,000 file names) in ``Flickr8k_text/``; the photos unpack to
  ``Flicker8k_Dataset/`` (sic) beside it.
* **Flickr30k** (Young, Lai, Hodosh & Hockenmaier, TACL 2, 2014): ``results_20130124.token`` and the photos in
  ``flickr30k-images/``.  The publishers give no split; the split lists are Flickr30k Entities' ``train.txt`` /
  ``val.txt`` / ``test.txt`` (Plummer et al., IJCV 2017, arXiv:1505.04870: 29,783 / 1,000 / 1,000 photo ids),
  found beside the token file or in a ``flickr30k_entities/`` folder beside it (docs/decisions.md, "Flickr30k and
  COCO in their publishers' formats").

Splits are named as in the Karpathy JSON (Flickr8k's ``dev`` is ``val``), captions are tokenised like the Karpathy
JSON's (lower-cased ``[a-z0-9]+`` words), and photos in no split list are left out, as are caption keys with no
photo (the published Flickr8k file has one, ``2258277193_586949ec62.jpg.1``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from ..vocab import tokenize
from .karpathy import CaptionedImage, kept_references, read_captions_file


@dataclass(frozen=True)
class FlickrLayout:
    """Where one Flickr data set's files are, relative to the folder of its token file."""

    name: str
    token_file: str
    #: split → the candidate places of its list, first found wins
    split_files: dict[str, tuple[str, ...]]
    #: where the photos are when no ``image_root`` is given: the one holding the most of the first listed photos
    image_folders: tuple[str, ...]


FLICKR8K = FlickrLayout(
    "flickr8k", "Flickr8k.token.txt",
    {"train": ("Flickr_8k.trainImages.txt",), "val": ("Flickr_8k.devImages.txt",),
     "test": ("Flickr_8k.testImages.txt",)},
    # the publishers' archive unpacks Flicker8k_Dataset/ (sic) beside Flickr8k_text/; images/ is a common copy's
    ("Flicker8k_Dataset", "Flickr8k_Dataset", "images", "../Flicker8k_Dataset", "../Flickr8k_Dataset", "."))
FLICKR30K = FlickrLayout(
    "flickr30k", "results_20130124.token",
    {split: (f"{split}.txt", f"flickr30k_entities/{split}.txt", f"flickr30k_entities-master/{split}.txt")
     for split in ("train", "val", "test")},
    ("flickr30k-images", "images", "../flickr30k-images", "."))
LAYOUTS = (FLICKR8K, FLICKR30K)
TOKEN_FILES = tuple(layout.token_file for layout in LAYOUTS)


def flickr_layout(path: str | Path) -> FlickrLayout | None:
    """The layout whose token file ``path`` is (or holds), else ``None``."""
    path = Path(path)
    for layout in LAYOUTS:
        if path.name == layout.token_file or (path.is_dir() and (path / layout.token_file).is_file()):
            return layout
    return None


def _read_lines(path: Path, layout: FlickrLayout) -> list[tuple[int, str]]:
    """The file's non-blank lines, stripped, with their line numbers (from 1) for the errors that point at one."""
    text = read_captions_file(path, f"{path} does not exist: {_needs(layout)}")
    return [(number, line.strip()) for number, line in enumerate(text.splitlines(), 1) if line.strip()]


def _needs(layout: FlickrLayout) -> str:
    lists = ", ".join(places[0] for places in layout.split_files.values())
    where = " (Flickr30k Entities' split lists)" if layout is FLICKR30K else ""
    return f"{layout.name} needs {layout.token_file} and {lists}{where} beside it"


def _split_list(text_dir: Path, split: str, layout: FlickrLayout) -> list[tuple[str, str]]:
    """The photo file names of one split, in the list's order (Flickr30k Entities lists ids without ``.jpg``), each
    with the ``file:line`` that lists it."""
    places = layout.split_files[split]
    found = next((text_dir / place for place in places if (text_dir / place).is_file()), None)
    if found is None:
        tried = ", ".join(str(text_dir / place) for place in places)
        raise FileNotFoundError(f"no {split} list for {layout.name} (looked for {tried}): {_needs(layout)}")
    names = [(name if Path(name).suffix else f"{name}.jpg", f"{found}:{number}")
             for number, name in _read_lines(found, layout)]
    if not names:
        raise ValueError(f"{found} is empty: the {split} list of {layout.name} names one photo a line")
    return names


#: how many of the first listed photos decide which folder holds them
PROBED_PHOTOS = 8


def find_image_root(text_dir: Path, some_images: list[str], layout: FlickrLayout = FLICKR8K) -> Path:
    """The one of the layout's image folders beside the text files that holds the most of ``some_images`` (a photo
    missing from the right folder is then named by the check for missing photos, not taken for a wrong folder)."""
    held = {folder: sum((text_dir / folder / name).is_file() for name in some_images)
            for folder in layout.image_folders}
    best = max(layout.image_folders, key=lambda folder: held[folder])  # the first of equals: the likeliest place
    if held[best]:
        return (text_dir / best).resolve()
    tried = ", ".join(str(text_dir / f) for f in layout.image_folders)
    raise FileNotFoundError(f"cannot find the {layout.name} photos (looked for {some_images[0]} and the next "
                            f"listed in {tried}): pass --image-root DIR")


def _read_captions(token_path: Path, layout: FlickrLayout) -> dict[str, list[tuple[int, str]]]:
    """Each photo's ``(n, caption)`` pairs from the token file's ``<image>#<n>\\t<caption>`` lines."""
    captions: dict[str, list[tuple[int, str]]] = defaultdict(list)
    line_of: dict[str, int] = {}  # "name#n" → the line that gave it
    for number, line in _read_lines(token_path, layout):
        key, _, caption = line.partition("\t")
        name, _, index = key.rpartition("#")
        if not name or not index.isdigit():
            raise ValueError(f"{token_path}:{number}: not a '<image>#<n>\\t<caption>' line: {line[:80]!r}")
        if key in line_of:  # a file concatenated twice would otherwise give each photo its first captions twice
            raise ValueError(f"{token_path}:{number}: {key} is already on line {line_of[key]}")
        line_of[key] = number
        captions[name].append((int(index), caption))
    return captions


def _refuse_shared_photos(lists: dict[str, list[tuple[str, str]]]) -> None:
    """Refuse a photo listed twice: in two splits it would be trained on and tested on, in one it would count twice."""
    listed_at: dict[str, str] = {}
    for entries in lists.values():
        for name, where in entries:
            if name in listed_at:
                raise ValueError(f"{where}: {name} is already listed at {listed_at[name]}")
            listed_at[name] = where


def load_flickr(path: str | Path, image_root: str | Path | None = None, splits: tuple[str, ...] | None = None,
                max_refs: int = 5, limit: int | None = None) -> list[CaptionedImage]:
    """The photos of the requested splits (all three by default) with at most ``max_refs`` references each, in the
    order of the split lists; ``path`` is a token file or its folder.  Image ids number the photos of all
    three lists (train, then val, then test) from 0, so an id means the same photo whichever splits are loaded, and
    for Flickr8k the same photo as in Karpathy's ``dataset_flickr8k.json`` (its ``imgid``): results files of
    either layout line up (``captioner compare``)."""
    path = Path(path)
    layout = flickr_layout(path)
    if layout is None:
        raise ValueError(f"{path} is neither {' nor '.join(TOKEN_FILES)} nor a folder holding one")
    text_dir = path if path.is_dir() else path.parent
    unknown = set(splits or ()) - set(layout.split_files)
    if unknown:
        raise ValueError(f"{layout.name} has the splits {', '.join(layout.split_files)}, "
                         f"not {', '.join(sorted(unknown))}")
    token_path = text_dir / layout.token_file
    captions = _read_captions(token_path, layout)
    lists = {split: _split_list(text_dir, split, layout) for split in layout.split_files}
    _refuse_shared_photos(lists)
    wanted = [name for split, entries in lists.items() if not splits or split in splits for name, _ in entries]
    root = Path(image_root) if image_root else find_image_root(text_dir, wanted[:PROBED_PHOTOS], layout)
    out = []
    for image_id, (split, name, where) in enumerate((split, name, where) for split, entries in lists.items()
                                                     for name, where in entries):
        if splits and split not in splits:
            continue
        refs, raw = kept_references([(tokenize(text), text) for _, text in sorted(captions.get(name, []))], max_refs)
        if not refs:
            raise ValueError(f"{where}: {name} is in the {split} list but has no caption in {token_path}")
        out.append(CaptionedImage(image_id, root / name, split, refs, {"filename": name}, raw))
        if limit and len(out) >= limit:
            return out
    return out
