"""Two checkpoints' captions of the same images, compared image by image (``captioner compare``).

A corpus score of 500 generated scenes moves by about a tenth of a CIDEr-D point with the choice of scenes
(docs/decisions.md, "Paper recipes"), so "A scores above B" needs an interval. Both models captioned the same
images, so the comparison is paired: resample images with replacement and recompute the *difference* (Koehn,
"Statistical Significance Tests for Machine Translation Evaluation", EMNLP 2004, paired bootstrap resampling).

CIDEr-D decomposes over images (the corpus score is the mean of the per-image scores, with document frequencies
from the references of the images scored, the same for both sides), and ``objects_named`` is a ratio of counts
pooled over images; both are resampled as a ratio of per-image sums.  Corpus BLEU (Papineni et al., "BLEU: a Method
for Automatic Evaluation of Machine Translation", ACL 2002) is not a mean of per-image scores: its clipped n-gram
precisions and brevity penalty are taken of counts summed over the corpus.  So each caption's counts are computed
once (:func:`bleu_statistics`), a resample sums them over the images it drew, and BLEU is recomputed from the sums
(:func:`corpus_bleu`); with every image drawn once this is ``pycocoevalcap``'s ``Bleu`` exactly.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache
from pathlib import Path

import numpy as np

from ..data.karpathy import CaptionedImage
from .bootstrap import percentile_interval, resample_counts, resampled_ratios
from .metrics import cider_d, ptb_captions, reference_texts

#: pycocoevalcap's ``BleuScorer.compute_score`` smoothing: ``tiny`` over ``small`` keeps a precision with no n-gram
#: matches at ~0 instead of 0/0, and a caption of length 0 from dividing by zero in the brevity ratio; kept so that
#: the scores equal the ones ``captioner eval`` reports
BLEU_TINY, BLEU_SMALL = 1e-15, 1e-9
BLEU_ORDER = 4


def paired_difference(per_image_a: Sequence[float] | np.ndarray, per_image_b: Sequence[float] | np.ndarray,
                      counts: Sequence[float] | np.ndarray, resamples: int = 2000, seed: int = 0,
                      level: float = 0.95) -> dict[str, float | list[float]]:
    """``Σa/Σc − Σb/Σc`` over the images, its paired-bootstrap interval, and the share of resamples in which A
    is not above B (a one-sided bootstrap p-value for "A > B")."""
    a, b = np.asarray(per_image_a, np.float64), np.asarray(per_image_b, np.float64)
    c = np.asarray(counts, np.float64)
    if not len(c) or c.sum() == 0:
        raise ValueError("no images (or no objects) to compare")
    ratios = resampled_ratios(np.stack([a, b], 1), c, resamples, seed)
    diffs = ratios[:, 0] - ratios[:, 1]
    low, high = percentile_interval(diffs, level)
    return {"a": float(a.sum() / c.sum()), "b": float(b.sum() / c.sum()),
            "difference": float((a.sum() - b.sum()) / c.sum()), f"ci{round(level * 100)}": [low, high],
            "share_not_above": float(np.mean(diffs <= 0))}


def paired_corpus_difference(stats_a: np.ndarray, stats_b: np.ndarray,
                             corpus_score: Callable[[np.ndarray], np.ndarray], resamples: int = 2000, seed: int = 0,
                             level: float = 0.95) -> dict[str, float | list[float]]:
    """As :func:`paired_difference`, for a score that is a function of statistics summed over the images
    (``corpus_score`` maps sums, last axis, to the score): each resample sums both sides' per-image rows
    (``stats_*``, one row per image) over the same drawn images and recomputes both scores from the sums."""
    stats_a, stats_b = np.asarray(stats_a, np.float64), np.asarray(stats_b, np.float64)
    if not len(stats_a):
        raise ValueError("no images to compare")
    counts = resample_counts(len(stats_a), resamples, seed)  # (resamples, images): one matrix product per side
    diffs = corpus_score(counts @ stats_a) - corpus_score(counts @ stats_b)
    a, b = float(corpus_score(stats_a.sum(0))), float(corpus_score(stats_b.sum(0)))
    low, high = percentile_interval(diffs, level)
    return {"a": a, "b": b, "difference": a - b, f"ci{round(level * 100)}": [low, high],
            "share_not_above": float(np.mean(diffs <= 0))}


def bleu_statistics(captions: Sequence[str], references: Sequence[Sequence[str]],
                    order: int = BLEU_ORDER) -> np.ndarray:
    """One row per caption: its clipped n-gram matches for n = 1..``order`` (each n-gram counted at most as often
    as in the one reference that has it most), its n-grams for n = 1..``order``, its length and the length of the
    reference closest to it (the shorter on a tie): pycocoevalcap's ``cook_test`` with ``eff="closest"``, what
    ``BleuScorer.compute_score(option="closest")`` (the option ``Bleu`` passes) sums over the corpus."""
    from pycocoevalcap.bleu.bleu_scorer import cook_test

    rows = np.zeros((len(captions), 2 * order + 2))
    for row, caption, refs in zip(rows, captions, references):
        cooked = cook_test(caption, _cooked_references(tuple(refs), order), eff="closest", n=order)
        row[:] = [*cooked["correct"], *cooked["guess"], cooked["testlen"], cooked["reflen"]]
    return rows


@lru_cache(maxsize=5000)
def _cooked_references(references: tuple[str, ...], order: int) -> tuple[list[int], dict[tuple[str, ...], int]]:
    """pycocoevalcap's ``cook_refs`` of one image's references (their lengths, and each n-gram's largest count),
    made once however many captions are scored against them: ``make zoo-f8k`` compares every model with the
    baseline on the same images, and cooking the same references again for each side of each comparison was most
    of its time.  Shared, so never modified (``cook_test`` only reads it).  The size holds a Karpathy COCO
    split (5,000 images; Flickr8k's 1,000 take about 17 MB)."""
    from pycocoevalcap.bleu.bleu_scorer import cook_refs

    return cook_refs(references, n=order)


def corpus_bleu(totals: np.ndarray, order: int = BLEU_ORDER) -> np.ndarray:
    """BLEU-1..``order`` (last axis) from :func:`bleu_statistics` summed over a corpus (any leading axes: one
    corpus per resample): the geometric mean of the clipped precisions times the brevity penalty
    ``exp(1 − r/c)`` when the captions are shorter than their closest references (Papineni et al. 2002, §2.3),
    with pycocoevalcap's smoothing constants."""
    totals = np.asarray(totals, np.float64)
    correct, guessed = totals[..., :order], totals[..., order:2 * order]
    length, reference_length = totals[..., 2 * order], totals[..., 2 * order + 1]
    # BLEU-n is the n-th root of the product of the first n precisions (pycocoevalcap multiplies in this order)
    bleu = np.cumprod((correct + BLEU_TINY) / (guessed + BLEU_SMALL), axis=-1) ** (1.0 / np.arange(1, order + 1))
    ratio = (length + BLEU_TINY) / (reference_length + BLEU_SMALL)
    brevity = np.where(ratio < 1, np.exp(1 - 1 / ratio), 1.0)
    return bleu * brevity[..., None]


def bleu_4(totals: np.ndarray) -> np.ndarray:
    return corpus_bleu(totals)[..., 3]


def result_id(image: CaptionedImage) -> int:
    """The id ``captioner eval --results-json`` writes for an image: its COCO id where it has one."""
    return int(image.info.get("cocoid", image.image_id))


def read_results(path: Path) -> dict[int, str]:
    """The captions of a COCO results file, as ``captioner eval --results-json`` writes them
    (``[{"image_id", "caption"}]``): image id → caption.  A missing or malformed file is a :class:`ValueError`
    naming it."""
    if not path.is_file():
        raise ValueError(f"{path} is missing: write the captions with captioner eval --results-json")
    try:
        return {int(r["image_id"]): str(r["caption"]) for r in json.loads(path.read_text())}
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f'{path} is not a COCO results file [{{"image_id", "caption"}}]: {exc!r}') from None


def scored_captions(captions: Mapping[int, str], keys: Sequence[int]) -> list[str]:
    # an empty caption is scored as "<empty>", as captioner eval's score_captions scores it
    return [captions[k] or "<empty>" for k in keys]


def compare_captions(captions_a: Mapping[int, str], captions_b: Mapping[int, str], images: Sequence[CaptionedImage],
                     resamples: int = 2000, seed: int = 0, ptb: bool = False) -> dict[str, dict]:
    """CIDEr-D, BLEU-4 and (for generated scenes) ``objects_named`` of A and B on ``images``, and A − B with its
    interval.  ``captions_*`` map an image's id (:func:`result_id`) to a caption; every image must have one on both
    sides.  ``ptb``: scored on coco-caption's PTB tokenization (metrics.py)."""
    keys = [result_id(im) for im in images]
    missing = [k for k in keys if k not in captions_a or k not in captions_b]
    if missing:
        raise ValueError(f"{len(missing)} of {len(keys)} images have no caption on one side (first: id {missing[0]})")
    refs = reference_texts(images, ptb)
    out = {"images": {"count": len(images)}}
    ones = np.ones(len(images))
    side_a, side_b = scored_captions(captions_a, keys), scored_captions(captions_b, keys)
    if ptb:
        tokenized = ptb_captions({(side, i): caption for side, captions in (("a", side_a), ("b", side_b))
                                  for i, caption in enumerate(captions)})
        side_a, side_b = ([tokenized[(side, i)] for i in range(len(keys))] for side in ("a", "b"))
    out["CIDEr-D"] = paired_difference(cider_d(side_a, refs), cider_d(side_b, refs), ones, resamples, seed)
    out["BLEU-4"] = paired_corpus_difference(bleu_statistics(side_a, refs), bleu_statistics(side_b, refs), bleu_4,
                                             resamples, seed)
    if images and images[0].info.get("objects") is not None:
        from ..data.scenes import named_objects

        def named(captions: Mapping[int, str]) -> list[int]:
            return [sum(named_objects(captions[k].split(), im.info["objects"])) for k, im in zip(keys, images)]

        out["objects_named"] = paired_difference(named(captions_a), named(captions_b),
                                                 [len(im.info["objects"]) for im in images], resamples, seed)
    return out


def markdown(result: dict[str, dict], name_a: str, name_b: str) -> str:
    """One row per measure: A, B, A − B [95 % interval], share of resamples with A not above B."""
    lines = [f"| measure ({result['images']['count']} images) | {name_a} | {name_b} | difference [95 % CI] | "
             f"resamples with {name_a} not above |", "|---|---:|---:|---|---:|"]
    for measure, stat in result.items():
        if measure == "images":
            continue
        low, high = stat["ci95"]
        lines.append(f"| {measure} | {stat['a']:.3f} | {stat['b']:.3f} | {stat['difference']:+.3f} "
                     f"[{low:+.3f}, {high:+.3f}] | {stat['share_not_above']:.1%} |")
    return "\n".join(lines)
