"""Caption metrics through ``pycocoevalcap``: BLEU-1..4, METEOR, ROUGE-L, CIDEr-D (raw scores, SPEC §0.3).

Captions are already tokenised by :func:`models.vocab.tokenize` (lower-case, no punctuation), so the PTB
tokenizer step is skipped.  SPICE needs models that are downloaded at first use; it is reported as unavailable
rather than faked.  METEOR runs a Java subprocess and is only computed when asked for.
"""

from __future__ import annotations

import math
import shutil
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

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


class CiderD:
    """CIDEr-D of single captions with document frequencies fixed from a reference corpus: the SCST reward
    (SPEC §1.6 step 4, decision #4: document frequencies from the training-split references).

    ``pycocoevalcap``'s ``Cider`` (which is CIDEr-D: clipped n-gram counts and the Gaussian length penalty,
    σ = 6) recomputes the frequencies from whatever it is asked to score, which would make a sample's reward
    depend on the rest of its mini-batch.  This class keeps the same n-gram extraction (``precook``), tf-idf
    vectors and similarity, and takes the frequencies and ``log |corpus|`` from ``corpus`` once.
    """

    def __init__(self, corpus: Iterable[Sequence[str]], n: int = 4, sigma: float = 6.0):
        from pycocoevalcap.cider.cider_scorer import precook

        self._precook = precook
        self.n, self.sigma = n, sigma
        self.document_frequency: Counter = Counter()
        images = 0
        for references in corpus:  # one entry per image: its reference captions
            self.document_frequency.update({gram for ref in references for gram in precook(ref, n)})
            images += 1
        self.log_corpus = math.log(float(max(images, 1)))

    def _vector(self, caption: str) -> tuple[list[dict], np.ndarray, int]:
        """tf-idf vector per n-gram order, its norms, and the caption length for the penalty."""
        vec: list[dict] = [{} for _ in range(self.n)]
        norm = np.zeros(self.n)
        length = 0
        for gram, tf in self._precook(caption, self.n).items():
            order = len(gram) - 1
            weight = float(tf) * (self.log_corpus - math.log(max(1.0, self.document_frequency[gram])))
            vec[order][gram] = weight
            norm[order] += weight * weight
            if order == 1:  # coco-caption measures length in bigrams; only the difference matters
                length += tf
        return vec, np.sqrt(norm), length

    def _similarity(self, hyp: tuple[list[dict], np.ndarray, int],
                    ref: tuple[list[dict], np.ndarray, int]) -> np.ndarray:
        (vec_h, norm_h, len_h), (vec_r, norm_r, len_r) = hyp, ref
        val = np.zeros(self.n)
        for order in range(self.n):
            for gram, weight in vec_h[order].items():
                ref_weight = vec_r[order].get(gram, 0.0)
                val[order] += min(weight, ref_weight) * ref_weight  # clipped counts (the "-D")
            if norm_h[order] != 0 and norm_r[order] != 0:
                val[order] /= norm_h[order] * norm_r[order]
        return val * math.exp(-((len_h - len_r) ** 2) / (2 * self.sigma ** 2))  # length penalty (the "-D")

    def score(self, captions: Sequence[str], references: Sequence[Sequence[str]]) -> np.ndarray:
        """CIDEr-D of ``captions[i]`` against ``references[i]``; equal reference lists are vectorised once."""
        cache: dict[int, list] = {}
        out = np.zeros(len(captions))
        for i, (caption, refs) in enumerate(zip(captions, references)):
            ref_vecs = cache.setdefault(id(refs), [self._vector(r) for r in refs])
            hyp = self._vector(caption)
            out[i] = 10.0 * np.mean(sum(self._similarity(hyp, r) for r in ref_vecs)) / len(ref_vecs)
        return out
