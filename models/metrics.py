"""Caption metrics through ``pycocoevalcap``: BLEU-1..4, METEOR, ROUGE-L, CIDEr-D (raw scores, SPEC §0.3).

Captions are already tokenised by :func:`models.vocab.tokenize` (lower-case, no punctuation), so the PTB
tokenizer step is skipped.  SPICE needs models that are downloaded at first use; it is reported as unavailable
rather than faked.  METEOR runs a Java subprocess and is only computed when asked for.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping, Sequence

ALL_METRICS = ("BLEU", "METEOR", "ROUGE-L", "CIDEr-D")
UNAVAILABLE = {"SPICE": "needs Stanford CoreNLP models that are downloaded at first use; no download is possible here"}


def score_captions(candidates: Mapping[int, str], references: Mapping[int, Sequence[str]],
                   metrics: Sequence[str] = ALL_METRICS) -> dict[str, float]:
    """Corpus-level scores of ``candidates[id]`` (one caption) against ``references[id]`` (several)."""
    ids = sorted(candidates)
    res = {i: [candidates[i] or "<empty>"] for i in ids}
    gts = {i: list(references[i]) for i in ids}
    scores: dict[str, float] = {}
    if "BLEU" in metrics:
        from pycocoevalcap.bleu.bleu import Bleu

        bleu, _ = Bleu(4).compute_score(gts, res, verbose=0)
        scores.update({f"BLEU-{n + 1}": float(b) for n, b in enumerate(bleu)})
    if "METEOR" in metrics:
        if shutil.which("java") is None:
            raise RuntimeError("METEOR needs Java on PATH")
        from pycocoevalcap.meteor.meteor import Meteor

        scorer = Meteor()  # its __del__ stops the Java process
        scores["METEOR"] = float(scorer.compute_score(gts, res)[0])
        del scorer
    if "ROUGE-L" in metrics:
        from pycocoevalcap.rouge.rouge import Rouge

        scores["ROUGE-L"] = float(Rouge().compute_score(gts, res)[0])
    if "CIDEr-D" in metrics:
        from pycocoevalcap.cider.cider import Cider  # coco-caption's "CIDEr" is CIDEr-D

        scores["CIDEr-D"] = float(Cider().compute_score(gts, res)[0])
    return scores
