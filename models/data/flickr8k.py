"""Reader for Flickr8k as its publishers distribute it (Hodosh, Young & Hockenmaier, "Framing Image Description as a
Ranking Task", JAIR 47, 2013): ``Flickr8k.token.txt`` (``<image>#<0-4>\\t<caption>``, five per photo) and the official
split lists ``Flickr_8k.trainImages.txt`` / ``Flickr_8k.devImages.txt`` / ``Flickr_8k.testImages.txt`` (6,000 /
1,000 / 1,000 file names), in the folder of the text files (the publishers' ``Flickr8k_text/``).

Splits are named as in the Karpathy JSON (``dev`` is ``val``), captions are tokenised like the Karpathy JSON's
(lower-cased ``[a-z0-9]+`` words), and photos in no split list are left out, as are caption keys with no photo (the
published file has one, ``2258277193_586949ec62.jpg.1``).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from ..vocab import tokenize
from .karpathy import CaptionedImage

TOKEN_FILE = "Flickr8k.token.txt"
SPLIT_FILES = {"train": "Flickr_8k.trainImages.txt", "val": "Flickr_8k.devImages.txt",
               "test": "Flickr_8k.testImages.txt"}
#: where the photos are, relative to the text files' folder, when no ``image_root`` is given: the publishers'
#: archive unpacks ``Flicker8k_Dataset/`` (sic) beside ``Flickr8k_text/``; ``images/`` is a common copy's layout
IMAGE_FOLDERS = ("Flicker8k_Dataset", "Flickr8k_Dataset", "images", "../Flicker8k_Dataset", "../Flickr8k_Dataset", ".")


def is_flickr8k(path: str | Path) -> bool:
    """Whether ``path`` is the token file, or a folder holding it."""
    path = Path(path)
    return path.name == TOKEN_FILE or (path.is_dir() and (path / TOKEN_FILE).is_file())


def _read_lines(path: Path) -> list[str]:
    try:
        return [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} does not exist: Flickr8k needs {TOKEN_FILE} and the three "
                                f"{', '.join(SPLIT_FILES.values())} beside it") from None


def find_image_root(text_dir: Path, some_image: str) -> Path:
    """The first of :data:`IMAGE_FOLDERS` beside the text files that holds ``some_image``."""
    for folder in IMAGE_FOLDERS:
        if (text_dir / folder / some_image).is_file():
            return (text_dir / folder).resolve()
    tried = ", ".join(str(text_dir / f) for f in IMAGE_FOLDERS)
    raise FileNotFoundError(f"cannot find the Flickr8k photos (looked for {some_image} in {tried}): "
                            "pass --image-root DIR")


def load_flickr8k(path: str | Path, image_root: str | Path | None = None, splits: tuple[str, ...] | None = None,
                  max_refs: int = 5, limit: int | None = None) -> list[CaptionedImage]:
    """The photos of the requested splits (all three by default) with at most ``max_refs`` references each, in the
    order of the split lists; ``path`` is the token file or its folder.  Image ids number the photos of all
    three lists (train, then dev, then test) from 0, so an id means the same photo whichever splits are loaded, and
    the same photo as in Karpathy's ``dataset_flickr8k.json`` (its ``imgid``): results files of either layout
    line up (``captioner compare``)."""
    path = Path(path)
    text_dir = path.parent if path.name == TOKEN_FILE else path
    captions: dict[str, list[tuple[int, str]]] = defaultdict(list)
    for line in _read_lines(text_dir / TOKEN_FILE):
        key, _, caption = line.partition("\t")
        name, _, number = key.rpartition("#")
        if not name or not number.isdigit():
            raise ValueError(f"{text_dir / TOKEN_FILE}: not a '<image>#<n>\\t<caption>' line: {line[:80]!r}")
        captions[name].append((int(number), caption))
    lists = {split: _read_lines(text_dir / name) for split, name in SPLIT_FILES.items()}
    unknown = set(splits or ()) - set(SPLIT_FILES)
    if unknown:
        raise ValueError(f"Flickr8k has the splits {', '.join(SPLIT_FILES)}, not {', '.join(sorted(unknown))}")
    root = Path(image_root) if image_root else find_image_root(text_dir, lists["train"][0])
    out = []
    for image_id, (split, name) in enumerate((split, name) for split, names in lists.items() for name in names):
        if splits and split not in splits:
            continue
        refs = [tokenize(text) for _, text in sorted(captions.get(name, []))]
        refs = [r for r in refs if r][:max_refs]
        if not refs:
            raise ValueError(f"{name} is in {SPLIT_FILES[split]} but has no caption in {TOKEN_FILE}")
        out.append(CaptionedImage(image_id, root / name, split, refs, {"filename": name}))
        if limit and len(out) >= limit:
            return out
    return out
