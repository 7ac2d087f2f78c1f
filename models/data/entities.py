"""Reader for Flickr30k Entities (Plummer et al., "Flickr30k Entities: Collecting Region-to-Phrase Correspondences
for Richer Image-to-Sentence Models", IJCV 2017, arXiv:1505.04870) in its official format.

A dataset folder holds, per Flickr photo id (the part of ``1000268201_693b08cb0e.jpg`` before ``_``):

* ``Sentences/<id>.txt``: the photo's five captions, one a line, noun phrases marked up as
  ``[/EN#<chain id>/<type 1>/.../<type n> <word 1> ... <word n>]``.  Phrases of one chain name the same thing;
  chain ``0`` (type ``notvisual``) is never a chain.  Parsed as the dataset's own ``get_sentence_data``
  (``flickr30k_entities_utils.py``): whitespace-split tokens, a phrase opens at a ``[`` token and closes at the
  first word that ends in ``]``.
* ``Annotations/<id>.xml``: PASCAL-VOC-like, the original photo's ``<size>`` and ``<object>``s, each with one or
  more ``<name>`` (chain ids) and either a ``<bndbox>`` (1-based inclusive pixel coordinates of the original
  photo) or ``<scene>`` / ``<nobndbox>`` flags.  A box belongs to **every** chain its object names, as the
  dataset's README says ("one or more name tags which contain the chain ids the object refers to") — the
  dataset's Python ``get_annotations`` reads only the first ``<name>``, which would drop about 8 % of the boxes.
* ``UNRELATED_CAPTIONS``: ``<id> <sentence number>`` (1-based) of captions that do not describe their photo;
  they are skipped.

Boxes are mapped to the image a model saw by scaling each axis on its own (the Flickr8k copies are squashed to
224×224): ``x0 = (xmin − 1)·w/width``, ``x1 = xmax·w/width``, likewise ``y`` (:meth:`EntityAnnotation.boxes_on`).
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..files import read_text_file
from ..vocab import tokenize

#: the coarse phrase types of Flickr30k Entities (arXiv:1505.04870, §3), "notvisual" aside
PHRASE_TYPES = ("people", "clothing", "bodyparts", "animals", "vehicles", "instruments", "scene", "other")
_OPENING = re.compile(r"^\[/EN#(\d+)((?:/[^/\s]+)+)$")


class EntitiesFormatError(ValueError):
    """A Flickr30k Entities file that does not follow the official format."""


@dataclass(frozen=True)
class Phrase:
    """One marked-up noun phrase: its chain id, types, and where its words sit in the sentence's ``words``."""

    chain: str
    types: tuple[str, ...]
    first_word: int
    words: tuple[str, ...]


@dataclass
class EntitySentence:
    """One caption: the words with the markup removed, and its phrases."""

    words: list[str]
    phrases: list[Phrase]

    def tokenized(self) -> tuple[list[str], list[tuple[int, int]]]:
        """The caption in the project's tokens (lower-cased ``[a-z0-9]+``, :func:`..vocab.tokenize`, word by word),
        and each phrase's ``[start, end)`` token span (empty when its words hold no token, e.g. only ``'``)."""
        tokens: list[str] = []
        starts = []
        for word in self.words:
            starts.append(len(tokens))
            tokens += tokenize(word)
        starts.append(len(tokens))
        return tokens, [(starts[p.first_word], starts[p.first_word + len(p.words)]) for p in self.phrases]


@dataclass
class EntityAnnotation:
    """One photo's boxes: ``size`` (width, height) of the original photo; ``boxes`` chain id → boxes in the file's
    1-based inclusive pixel coordinates; the chains flagged as the whole scene or as having no box."""

    size: tuple[int, int]
    boxes: dict[str, list[tuple[int, int, int, int]]] = field(default_factory=dict)
    scene: set[str] = field(default_factory=set)
    nobox: set[str] = field(default_factory=set)

    def boxes_on(self, chain: str, image_size: tuple[int, int]) -> np.ndarray:
        """``[K, 4]`` float edges ``x0, y0, x1, y1`` of the chain's boxes on an image of ``image_size`` (width,
        height) showing the whole photo, each axis scaled on its own; ``[0, 4]`` for a chain without boxes."""
        boxes = np.asarray(self.boxes.get(chain, []), np.float64).reshape(-1, 4)
        sx, sy = image_size[0] / self.size[0], image_size[1] / self.size[1]
        return np.stack([(boxes[:, 0] - 1) * sx, (boxes[:, 1] - 1) * sy, boxes[:, 2] * sx, boxes[:, 3] * sy], axis=1)


def parse_sentences(text: str, source: str = "sentences") -> list[EntitySentence]:
    """Every non-empty line of a ``Sentences/<id>.txt`` file, in order."""
    out = []
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        words: list[str] = []
        phrases: list[Phrase] = []
        opening: tuple[str, tuple[str, ...], int] | None = None
        for token in line.split():
            if opening is None and token.startswith("["):
                match = _OPENING.match(token)
                if match is None:
                    raise EntitiesFormatError(f"{source}, line {number}: bad phrase markup {token!r}")
                opening = (match.group(1), tuple(match.group(2).strip("/").split("/")), len(words))
                continue
            closes = opening is not None and token.endswith("]")
            words.append(token[:-1] if closes else token)
            if closes:
                chain, types, first = opening
                phrases.append(Phrase(chain, types, first, tuple(words[first:])))
                opening = None
        if opening is not None:
            raise EntitiesFormatError(f"{source}, line {number}: phrase [/EN#{opening[0]} is never closed")
        out.append(EntitySentence(words, phrases))
    return out


def _integer(element: ET.Element, tag: str, source: str) -> int:
    child = element.find(tag)
    try:
        return int(child.text)  # type: ignore[union-attr, arg-type]
    except (AttributeError, TypeError, ValueError):
        raise EntitiesFormatError(f"{source}: <{element.tag}> needs an integer <{tag}>") from None


def parse_annotation(text: str | bytes, source: str = "annotation") -> EntityAnnotation:
    """An ``Annotations/<id>.xml`` file."""
    try:
        root = ET.fromstring(text)
    except ET.ParseError as exc:
        raise EntitiesFormatError(f"{source}: not XML ({exc})") from None
    size = root.find("size")
    if size is None:
        raise EntitiesFormatError(f"{source}: no <size>")
    width, height = _integer(size, "width", source), _integer(size, "height", source)
    if width <= 0 or height <= 0:
        raise EntitiesFormatError(f"{source}: size {width}×{height}")
    annotation = EntityAnnotation((width, height))
    for obj in root.iter("object"):
        chains = [name.text.strip() for name in obj.findall("name") if name.text and name.text.strip()]
        if not chains:
            raise EntitiesFormatError(f"{source}: an <object> without a <name>")
        box = obj.find("bndbox")
        if box is not None:
            coords = tuple(_integer(box, tag, source) for tag in ("xmin", "ymin", "xmax", "ymax"))
            if not (1 <= coords[0] <= coords[2] and 1 <= coords[1] <= coords[3]):
                raise EntitiesFormatError(f"{source}: box {coords} is not 1-based with min ≤ max")
            for chain in chains:
                annotation.boxes.setdefault(chain, []).append(coords)  # type: ignore[arg-type]
            continue
        for flag, chosen in (("scene", annotation.scene), ("nobndbox", annotation.nobox)):
            if obj.find(flag) is not None and _integer(obj, flag, source) > 0:
                chosen.update(chains)
    return annotation


@dataclass
class EntityImage:
    """The Entities annotation of one photo: its captions (unrelated ones already dropped) and its boxes."""

    flickr_id: str
    sentences: list[EntitySentence]
    annotation: EntityAnnotation


class EntitiesDataset:
    """A Flickr30k Entities folder (``Sentences/``, ``Annotations/``, optional ``UNRELATED_CAPTIONS``)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        for part in ("Sentences", "Annotations"):
            if not (self.root / part).is_dir():
                raise FileNotFoundError(f"{self.root} is not a Flickr30k Entities folder: no {part}/ in it")
        self.unrelated: set[tuple[str, int]] = set()
        listing = self.root / "UNRELATED_CAPTIONS"
        if listing.exists():
            for line in read_text_file(listing).splitlines():
                parts = line.split()
                if len(parts) == 2 and parts[1].isdigit():  # the first line is a "# format:" comment
                    self.unrelated.add((parts[0], int(parts[1]) - 1))

    @staticmethod
    def flickr_id(image_path: str | Path) -> str:
        """``.../1000268201_693b08cb0e.jpg`` → ``1000268201`` (Flickr8k names photo files ``<id>_<secret>``)."""
        return Path(image_path).stem.split("_")[0]

    def load(self, image_path: str | Path) -> EntityImage | None:
        """The annotation of the photo at ``image_path``, or None when the folder has none for it."""
        flickr_id = self.flickr_id(image_path)
        sentences_file = self.root / "Sentences" / f"{flickr_id}.txt"
        annotation_file = self.root / "Annotations" / f"{flickr_id}.xml"
        if not (sentences_file.exists() and annotation_file.exists()):
            return None
        sentences = parse_sentences(read_text_file(sentences_file), str(sentences_file))
        kept = [s for index, s in enumerate(sentences) if (flickr_id, index) not in self.unrelated]
        return EntityImage(flickr_id, kept, parse_annotation(annotation_file.read_bytes(), str(annotation_file)))
