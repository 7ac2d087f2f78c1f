"""Two checkpoints' captions of the same images, compared image by image (``captioner compare``).

A corpus score of 500 generated scenes moves by about a tenth of a CIDEr-D point with the choice of scenes
(docs/decisions.md, "Paper recipes"), so "A scores above B" needs an interval. Both models captioned the same
images, so the comparison is paired: resample images with replacement and recompute the *difference* (Koehn,
"Statistical Significance Tests for Machine Translation Evaluation", EMNLP 2004, paired bootstrap resampling).

CIDEr-D decomposes over images (the corpus score is the mean of the per-image scores, with document frequencies
from the references of the images scored, the same for both sides), and ``objects_named`` is a ratio of counts
pooled over images; both are resampled as a ratio of per-image sums. BLEU is not decomposable and is left out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from ..data.karpathy import CaptionedImage
from .bootstrap import percentile_interval, resampled_ratios
from .metrics import cider_d


def paired_difference(per_image_a: Sequence[float], per_image_b: Sequence[float], counts: Sequence[float],
                      resamples: int = 2000, seed: int = 0, level: float = 0.95) -> dict[str, float | list[float]]:
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


def compare_captions(captions_a: Mapping[int, str], captions_b: Mapping[int, str], images: Sequence[CaptionedImage],
                     resamples: int = 2000, seed: int = 0) -> dict[str, dict]:
    """CIDEr-D and (for generated scenes) ``objects_named`` of A and B on ``images``, and A − B with its interval.
    ``captions_*`` map an image's id (its COCO id where it has one, as ``captioner eval --results-json`` writes)
    to a caption; every image must have one on both sides."""
    keys = [int(im.info.get("cocoid", im.image_id)) for im in images]
    missing = [k for k in keys if k not in captions_a or k not in captions_b]
    if missing:
        raise ValueError(f"{len(missing)} of {len(keys)} images have no caption on one side (first: id {missing[0]})")
    refs = [[" ".join(r) for r in im.references] for im in images]
    out = {"images": {"count": len(images)}}
    ones = np.ones(len(images))
    out["CIDEr-D"] = paired_difference(cider_d([captions_a[k] for k in keys], refs),
                                       cider_d([captions_b[k] for k in keys], refs), ones, resamples, seed)
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
