"""Attention grounding on real photos: Flickr30k Entities (Plummer et al., IJCV 2017, arXiv:1505.04870) phrases
against their boxes, the code behind ``captioner eval --grounding entities:DIR``.

Every noun phrase of a photo's captions that Entities links to boxes is scored on the attention rows of its words
(the row that fed each word's prediction: the decoders' alignment rule), spread over the pixels of the image the
model saw through the heatmap geometry (:func:`.grounding.pixel_distribution`), against the union ``M`` of the
boxes of the phrase's chain, mapped onto that image axis by axis (:meth:`..data.entities.EntityAnnotation.boxes_on`):

* **attention correctness** (Liu et al., "Attention Correctness in Neural Image Captioning", AAAI 2017,
  arXiv:1605.09553, §3.1): the mass ``Σ_{p∈M} P(p)`` inside the boxes.  A phrase of several words is scored by
  its **best word**, the word with the highest mass, as Liu et al. score a noun phrase; its pointing hit and
  ratio are that word's too;
* **pointing-game hit**: the maximum of that word's map inside ``M`` (a plateau counts its fraction inside), with
  no 15-pixel tolerance (Zhang et al.'s protocol has one): stricter than published pointing-game numbers;
* **area-normalised ratio**: mass ÷ ``|M| / |image|``.

Two modes (both reported):

* **references, teacher-forced**: each reference caption is fed word by word (the Entities text in the project's
  tokens; words outside the vocabulary are ``<unk>``), and each annotated word is scored on the row that predicted
  it.  This measures the attention alone, whatever the model would have said.
* **generated**: phrases of the model's own beam-search caption that name something Entities boxed in that
  photo (:func:`generated_targets`: a head-noun match against every boxed reference phrase of the photo).

Chance rows go through the same code: a **uniform** map (equal weight on every visual item: its mass is the
boxes' share of the image) and **another photo's** attention: the same caption fed over the next photo of the list
(in the generated mode, the model's caption of this photo), its rows scored against this photo's boxes.  The
words, their number and their context are the model's own, only the photo differs, so this row also carries the
best-word selection (a best of several rows scores above the uniform share whenever the rows vary, as sparse maps
do, even without any grounding).  Means pool phrases over
photos with 95 % percentile-bootstrap intervals that resample photos (:func:`.grounding.bootstrap_mean`), overall
and per Entities phrase type (a phrase of two types counts under both, once under "all").
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..data.entities import PHRASE_TYPES, EntitiesDataset, EntityAnnotation, EntityImage
from ..progress import progress_bar
from ..protocol import Geometry
from .evaluate import visual_batches
from .grounding import CaptionAttention, interval, item_geometry, normaliser_of, score_rows, summarise

#: whose captions the attention is read along: the references, teacher-forced, or the model's own
CAPTION_SOURCES = ("references", "generated")
CONTROLS = ("model", "uniform", "other photo")
PHRASE_SCORE = "best word (highest mass) of the phrase, as Liu et al. (arXiv:1605.09553) score a noun phrase"
#: irregular plurals of Flickr8k's frequent head nouns (regular ones lose their final "s")
_IRREGULAR = {"men": "man", "women": "woman", "children": "child", "people": "person", "feet": "foot",
              "teeth": "tooth", "geese": "goose", "mice": "mouse"}


@dataclass
class PhraseTarget:
    """A phrase to score: the caption it is in, its words' token positions (= attention rows), its Entities types
    and the chains whose boxes it names."""

    caption: int
    positions: list[int]
    types: tuple[str, ...]
    chains: tuple[str, ...]


@dataclass
class PhraseScore:
    image: int  # index of the photo in the evaluated list
    classes: tuple[str, ...]  # the phrase's Entities types
    control: str
    scores: dict[str, float]


@dataclass
class PhotoAttention:
    """One photo in one mode: the attention rows ``[T, N]`` of each caption, their geometry, the phrases; and the
    rows of the same captions fed over another photo, with that photo's geometry (the other-photo chance row)."""

    rows: list[np.ndarray]
    geometry: Geometry
    targets: list[PhraseTarget]
    other_rows: list[np.ndarray] | None = None
    other_geometry: Geometry | None = None


# ---------------------------------------------------------------------------------------------------------------
# Which words name which boxes
# ---------------------------------------------------------------------------------------------------------------
def _visual_types(types: Collection[str]) -> tuple[str, ...]:
    return tuple(t for t in PHRASE_TYPES if t in types)


def reference_targets(entity: EntityImage) -> tuple[list[list[str]], list[PhraseTarget]]:
    """The photo's reference captions (tokens) and every phrase of them whose chain has boxes."""
    captions, targets = [], []
    for index, sentence in enumerate(entity.sentences):
        tokens, spans = sentence.tokenized()
        captions.append(tokens)
        for phrase, (start, end) in zip(sentence.phrases, spans):
            if end > start and entity.annotation.boxes.get(phrase.chain):
                targets.append(PhraseTarget(index, list(range(start, end)), _visual_types(phrase.types),
                                            (phrase.chain,)))
    return captions, targets


def head_form(token: str) -> str:
    """The form head nouns are matched by: singular for regular (final "s", not "ss") and a few irregular plurals."""
    if token in _IRREGULAR:
        return _IRREGULAR[token]
    return token[:-1] if len(token) > 3 and token.endswith("s") and not token.endswith("ss") else token


def generated_targets(tokens: Sequence[str], entity: EntityImage) -> list[PhraseTarget]:
    """Phrases of a generated caption that name something boxed in the photo.

    The head of a reference phrase is its last token (Entities phrases are noun phrases: "a little girl", "a set
    of stairs").  A generated token whose :func:`head_form` is the head of some boxed reference phrase of the
    photo heads a phrase; the phrase extends left over the tokens that also occur in those reference phrases
    ("a pink dress" against "a pink dress" / "a dress"), never over another phrase.  It names the union of the
    boxes of every chain with that head (two men in the references: either may be meant) and carries their types.
    """
    heads: dict[str, dict[str, set[str]]] = {}
    for sentence in entity.sentences:
        words, spans = sentence.tokenized()
        for phrase, (start, end) in zip(sentence.phrases, spans):
            head = head_form(words[end - 1]) if end > start else ""
            if len(head) < 2 or not entity.annotation.boxes.get(phrase.chain):
                continue
            entry = heads.setdefault(head, {"chains": set(), "types": set(), "words": set()})
            entry["chains"].add(phrase.chain)
            entry["types"].update(phrase.types)
            entry["words"].update(head_form(w) for w in words[start:end])
    targets: list[PhraseTarget] = []
    used: set[int] = set()
    for position, token in enumerate(tokens):
        entry = heads.get(head_form(token))
        if entry is None:
            continue
        start = position
        while start > 0 and start - 1 not in used and head_form(tokens[start - 1]) in entry["words"]:
            start -= 1
        used.update(range(start, position + 1))
        targets.append(PhraseTarget(0, list(range(start, position + 1)), _visual_types(entry["types"]),
                                    tuple(sorted(entry["chains"]))))
    return targets


# ---------------------------------------------------------------------------------------------------------------
# Maps against boxes
# ---------------------------------------------------------------------------------------------------------------
def box_mask(boxes: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """The union of boxes (``x0, y0, x1, y1`` pixel edges) on an image of ``size`` (width, height) as a boolean
    ``[H, W]`` mask: a pixel is inside when its centre is (the rule the grid heatmaps use); a box too thin to hold
    a pixel centre keeps the pixel under its own centre, so no annotated object vanishes."""
    width, height = size
    mask = np.zeros((height, width), bool)
    for x0, y0, x1, y1 in np.asarray(boxes, np.float64).reshape(-1, 4):
        c0, c1 = int(np.ceil(x0 - 0.5)), int(np.ceil(x1 - 0.5))  # columns whose centre j + 0.5 lies in [x0, x1)
        r0, r1 = int(np.ceil(y0 - 0.5)), int(np.ceil(y1 - 0.5))
        if c1 <= c0:
            c0 = int(np.clip(np.floor((x0 + x1) / 2), 0, width - 1))
            c1 = c0 + 1
        if r1 <= r0:
            r0 = int(np.clip(np.floor((y0 + y1) / 2), 0, height - 1))
            r1 = r0 + 1
        mask[max(r0, 0):min(r1, height), max(c0, 0):min(c1, width)] = True
    return mask


def best_word(rows: np.ndarray, geometry: Geometry, mask: np.ndarray) -> dict[str, float]:
    """The scores of the phrase word whose map puts the most mass inside ``mask`` (first one on a tie)."""
    return max(score_rows(rows, geometry, mask), key=lambda s: s["mass"])


def phrase_mask(annotation: EntityAnnotation, chains: Sequence[str], size: tuple[int, int]) -> np.ndarray:
    return box_mask(np.concatenate([annotation.boxes_on(c, size) for c in chains]), size)


def score_photos(photos: Sequence[PhotoAttention], annotations: Sequence[EntityAnnotation],
                 progress: bool = False, desc: str = "scoring phrases") -> list[PhraseScore]:
    """Per phrase: the model's map, the uniform map and another photo's map, each scored on the phrase's boxes."""
    out: list[PhraseScore] = []
    pairs = list(zip(photos, annotations))
    for index, (photo, annotation) in enumerate(progress_bar(pairs, desc=desc, disable=not progress)):
        if not photo.targets:
            continue
        size = photo.geometry.image_size
        uniform = np.ones((1, photo.geometry.boxes.shape[0]))
        for target in photo.targets:
            mask = phrase_mask(annotation, target.chains, size)
            rows = photo.rows[target.caption][target.positions]
            out.append(PhraseScore(index, target.types, "model", best_word(rows, photo.geometry, mask)))
            out.append(PhraseScore(index, target.types, "uniform", best_word(uniform, photo.geometry, mask)))
            if photo.other_rows is not None and photo.other_geometry is not None:
                # grid models see every photo through the same cells; region boxes are scaled onto this photo
                geometry = photo.geometry if photo.other_geometry.kind == "grid" else photo.other_geometry
                other = photo.other_rows[target.caption][target.positions]
                out.append(PhraseScore(index, target.types, "other photo", best_word(other, geometry, mask)))
    return out


# ---------------------------------------------------------------------------------------------------------------
# A checkpoint on a split
# ---------------------------------------------------------------------------------------------------------------
@torch.no_grad()
def teacher_forced_rows(model, vocab, vis, captions: Sequence[Sequence[list[str]]]) -> list[list[np.ndarray]]:
    """The attention rows ``[T, N]`` of every caption of every image of ``vis``, each caption fed word by word
    (``Captioner.teacher_force``: the model's own ``step``, the one the beam search runs, so row ``t`` is the
    attention that fed the prediction of token ``t``, as in a beam-search hypothesis)."""
    ids = [vocab.encode(tokens) for per_image in captions for tokens in per_image]
    if not ids:
        return [[] for _ in captions]
    image_of = [image for image, per_image in enumerate(captions) for _ in per_image]
    device = vis.feats.device
    padded = torch.full((len(ids), max(map(len, ids))), vocab.pad_id, dtype=torch.long)
    for row, caption in enumerate(ids):
        padded[row, :len(caption)] = torch.tensor(caption)
    _, records, _ = model.teacher_force(vis, padded.to(device), rows=torch.tensor(image_of, device=device))
    attention = torch.stack([r.primary.float() for r in records], dim=1).cpu().numpy()
    out: list[list[np.ndarray]] = [[] for _ in captions]
    for row, (image, caption) in enumerate(zip(image_of, ids)):
        out[image].append(attention[row, :len(caption) - 1])  # the words' rows, <eos>'s left out
    return out


def other_photo_rows(ckpt, store, donors: Sequence, captions: Sequence[Sequence[list[str]]],
                     device: str) -> list[tuple[list[np.ndarray], Geometry]]:
    """The other-photo chance row's attention: the captions of photo ``i`` fed over photo ``donors[i]``, with that
    photo's geometry.  The words, their number and their context stay; only the photo differs (so a phrase's best
    word is picked among as many rows as the model's own)."""
    vis = store.batch([donor.key for donor in donors]).to(device)
    rows = teacher_forced_rows(ckpt.model, ckpt.vocab, vis, captions)
    return [(per_photo, item_geometry(ckpt, vis, j, donor.path)) for j, (per_photo, donor)
            in enumerate(zip(rows, donors))]


def entities_grounding(ckpt, images: Sequence, store, entities_dir: str | Path,
                       generated: Sequence[CaptionAttention], batch_size: int = 20, resamples: int = 2000,
                       device: str = "cpu", progress: bool = True) -> dict:
    """The JSON section ``captioner eval --grounding entities:DIR`` adds to a split's report: both modes, every
    control, overall and per phrase type.  ``generated`` holds the beam-search captions of ``images`` with their
    attention (:func:`.grounding.caption_with_attention`, the same search ``captioner eval`` scores)."""
    dataset = EntitiesDataset(entities_dir)
    annotated = [(index, entity) for index, im in enumerate(images) if (entity := dataset.load(im.path)) is not None]
    if not annotated:
        raise ValueError(f"none of the {len(images)} photos has a Flickr30k Entities annotation in {entities_dir}")
    photos = [images[index] for index, _ in annotated]
    prepared = [reference_targets(entity) for _, entity in annotated]
    captions = [generated[index] for index, _ in annotated]
    references: list[PhotoAttention] = []
    own: list[PhotoAttention] = []
    for chunk, vis in visual_batches(ckpt.model, photos, store, batch_size, device, "teacher forcing", progress):
        first = len(references)
        batch, beams = prepared[first:first + len(chunk)], captions[first:first + len(chunk)]
        rows = teacher_forced_rows(ckpt.model, ckpt.vocab, vis, [refs for refs, _ in batch])
        others: list[tuple[list[np.ndarray] | None, Geometry | None]] = [(None, None)] * len(chunk)
        if len(photos) > 1:  # each photo's captions (references, then the generated one) over the next photo
            donors = [photos[(first + j + 1) % len(photos)] for j in range(len(chunk))]
            others = other_photo_rows(ckpt, store, donors, [refs + [beam.tokens] for (refs, _), beam
                                                            in zip(batch, beams)], device)
        for j, (photo, (_, targets), beam, (other, geometry)) in enumerate(zip(chunk, batch, beams, others)):
            references.append(PhotoAttention(rows[j], item_geometry(ckpt, vis, j, photo.path), targets,
                                             other and other[:-1], geometry))
            own.append(PhotoAttention([beam.attention], beam.geometry,
                                      generated_targets(beam.tokens, annotated[first + j][1]),
                                      other and other[-1:], geometry))
    annotations = [entity.annotation for _, entity in annotated]
    section = {"benchmark": "Flickr30k Entities (Plummer et al., arXiv:1505.04870)",
               "normaliser": normaliser_of(ckpt), "attention_kind": ckpt.model.attention_kind,
               "phrase_score": PHRASE_SCORE, "photos": len(annotated),
               "photos_without_annotation": len(images) - len(annotated)}
    for mode, attended in zip(CAPTION_SOURCES, (references, own)):
        scores = score_photos(attended, annotations, progress, desc=f"scoring {mode}")
        section[mode] = {"captions": sum(len(p.rows) for p in attended if p.targets),
                         "rows": summarise(scores, len(attended), resamples, PHRASE_TYPES, CONTROLS, "phrase_type",
                                           "phrases")}
    return section


# ---------------------------------------------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------------------------------------------
def _label(control: str) -> str:
    return "attention" if control == "model" else f"chance: {control}"


def summary_table(reports: Sequence[tuple[str, dict]]) -> str:
    """Every model × mode × control, all phrase types: ``(model name, grounding section)`` pairs → Markdown."""
    lines = ["| model | normaliser | mode | map | phrases | photos | attention correctness | pointing hit | "
             "area-normalised ratio |", "|---|---|---|---|---|---|---|---|---|"]
    for name, section in reports:
        for mode in CAPTION_SOURCES:
            for row in section[mode]["rows"]:
                if row["phrase_type"] == "all":
                    lines.append(f"| {name} | {section['normaliser']} | {mode} | {_label(row['control'])} | "
                                 f"{row['phrases']} | {row['images']} | {interval(row['mass'])} | "
                                 f"{interval(row['pointing'])} | {interval(row['ratio'])} |")
    return "\n".join(lines)


def type_table(reports: Sequence[tuple[str, dict]], mode: str = "references") -> str:
    """Attention correctness per phrase type (one mode), the model's and the two chance maps' side by side."""
    lines = ["| model | phrase type | phrases | attention | chance: uniform (boxes' share) | chance: other photo | "
             "pointing hit | area-normalised ratio |", "|---|---|---|---|---|---|---|---|"]
    for name, section in reports:
        rows = {(r["control"], r["phrase_type"]): r for r in section[mode]["rows"]}
        for phrase_type in (*PHRASE_TYPES, "all"):
            model = rows.get(("model", phrase_type))
            if model is None:
                continue
            chance = [interval(rows[(c, phrase_type)]["mass"]) if (c, phrase_type) in rows else "—"
                      for c in ("uniform", "other photo")]
            lines.append(f"| {name} | {phrase_type} | {model['phrases']} | {interval(model['mass'])} | {chance[0]} | "
                         f"{chance[1]} | {interval(model['pointing'])} | {interval(model['ratio'])} |")
    return "\n".join(lines)
