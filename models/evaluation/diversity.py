"""What a set of captions says beyond n-gram overlap: repetition (REP), the words it uses and how many of its captions
are new.

* **REP** is the repetition score SparseCap reports (Martins et al. 2021, arXiv:2002.05556, Table 1), taken from
  Malaviya et al. 2018 ("Sparse and Constrained Attention for Neural Machine Translation", arXiv:1805.08241, §4).
  The authors' script (Unbabel/sparse_constrained_attention, ``generate_results/rep_score.py``) sums, per caption,
  (1) for every bigram that occurs more than once, its count minus its count in the reference (all of it when the
  reference lacks it), weight 1, and (2) for every bigram of one repeated word ("the the"), likewise, weight 2;
  normalised, 100 × the total over the number of reference words.  Lower is better.  A caption here has several
  references: a bigram's reference count is its largest count in any one of them (BLEU's clipping), and the
  normaliser is the mean reference length summed over the captions (docs/decisions.md#rep-with-several-references).
  With one reference per caption this is exactly the script's ``--normalize`` value (tested against it).
* **distinct words**: how many different words the captions use (a model that says "a man in a shirt" of every
  photo uses few).
* **novel captions**: the share of captions that are not word for word a training caption.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

#: weights of the two parts of REP: repeated bigrams, and bigrams of one repeated word (the script's -w1, -w2)
REP_WEIGHTS = (1.0, 2.0)


def _bigrams(words: Sequence[str]) -> Counter:
    return Counter(zip(words, words[1:]))


def repetition_count(caption: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """REP's unnormalised score of one caption: w1 × repeated bigrams + w2 × bigrams of one repeated word, each
    minus what the references already repeat."""
    counts = _bigrams(caption)
    allowed: Counter = Counter()
    for reference in references:
        allowed |= _bigrams(reference)  # | keeps the larger count of each bigram
    repeated = sum(max(0, n - allowed[g]) for g, n in counts.items() if n > 1)
    same_word = sum(max(0, n - allowed[g]) for g, n in counts.items() if g[0] == g[1])
    return REP_WEIGHTS[0] * repeated + REP_WEIGHTS[1] * same_word


def rep_score(captions: Mapping[int, Sequence[str]], references: Mapping[int, Sequence[Sequence[str]]]) -> float:
    """REP over a set of captions (×100, lower is better); ``references[id]`` holds the tokenised references."""
    total = sum(repetition_count(captions[i], references[i]) for i in captions)
    reference_words = sum(sum(len(r) for r in references[i]) / max(1, len(references[i])) for i in captions)
    return 100.0 * total / reference_words if reference_words else 0.0


def distinct_words(captions: Iterable[Sequence[str]]) -> int:
    return len({word for caption in captions for word in caption})


def novel_share(captions: Iterable[Sequence[str]], training_captions: Iterable[Sequence[str]]) -> float:
    """The share of ``captions`` that are no training caption, word for word."""
    seen = {" ".join(c) for c in training_captions}
    captions = [" ".join(c) for c in captions]
    return sum(c not in seen for c in captions) / len(captions) if captions else 0.0


def diversity_scores(captions: Mapping[int, Sequence[str]], references: Mapping[int, Sequence[Sequence[str]]],
                     training_captions: Iterable[Sequence[str]] | None = None) -> dict[str, float]:
    """REP, distinct words, mean caption length and (given the training captions) the share of novel captions."""
    scores = {"REP": rep_score(captions, references), "distinct_words": float(distinct_words(captions.values())),
              "mean_length": sum(len(c) for c in captions.values()) / max(1, len(captions))}
    if training_captions is not None:
        scores["novel_captions"] = novel_share(captions.values(), training_captions)
    return scores
