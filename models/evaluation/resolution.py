"""Do captions depend on the resolution of the photo a user sends?  The same photos captioned from their full-size
originals and from the small copies a data set ships (Flickr8k's public copies are 224×224, squashed), with the
service's own preprocessing, and both caption sets scored against the same references (``captioner
resolution-check``).  A model trained on small copies that loses more than a BLEU-4 point on the originals has a
preprocessing problem (docs/decisions.md, "Flickr8k: full-size photos").
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..data.karpathy import CaptionedImage
from ..decoding import DecodingRules
from ..pipeline import Pipeline
from ..progress import progress_bar
from .compare import compare_captions, result_id
from .metrics import reference_texts, reported, score_captions


def _caption(pipeline: Pipeline, paths: Sequence[Path], beam_size: int, max_len: int, rules: DecodingRules,
             batch: int, label: str) -> list[str]:
    captions = []
    for start in progress_bar(range(0, len(paths), batch), desc=label, unit="batch"):
        results = pipeline(list(paths[start:start + batch]), beam_size, max_len, rules)
        captions += [r.caption for r in results]
    return captions


def resolution_check(pipeline: Pipeline, images: Sequence[CaptionedImage], full_root: Path, beam_size: int = 3,
                     max_len: int = 20, rules: DecodingRules | None = None, batch: int = 16) -> dict[str, Any]:
    """Scores of the captions of ``images`` (the data set's copies) and of the originals of the same photos in
    ``full_root`` (matched by file name; photos without an original are left out), and originals − copies with a
    paired-bootstrap interval for CIDEr-D."""
    rules = pipeline.runtime.default_rules if rules is None else rules
    matched = [im for im in images if (full_root / im.path.name).is_file()]
    if not matched:
        raise FileNotFoundError(f"none of the {len(images)} photos has an original in {full_root}")
    copies = _caption(pipeline, [im.path for im in matched], beam_size, max_len, rules, batch, "copies")
    originals = _caption(pipeline, [full_root / im.path.name for im in matched], beam_size, max_len, rules, batch,
                         "originals")
    # keyed as compare_captions looks captions up: by COCO id where the data set has one
    ids = [result_id(im) for im in matched]
    refs = dict(zip(ids, reference_texts(matched)))
    report: dict[str, Any] = {"images": len(matched), "same_caption": sum(a == b for a, b in zip(copies, originals))}
    for name, captions in (("copies", copies), ("originals", originals)):
        report[name] = reported(score_captions(dict(zip(ids, captions)), refs, ("BLEU", "CIDEr-D")))
    # CIDEr-D and BLEU-4 differences with their paired-bootstrap intervals
    report["originals_minus_copies"] = compare_captions(dict(zip(ids, originals)), dict(zip(ids, copies)), matched)
    report["examples"] = [{"image": im.path.name, "copy": a, "original": b}
                          for im, a, b in zip(matched, copies, originals) if a != b][:10]
    return report
