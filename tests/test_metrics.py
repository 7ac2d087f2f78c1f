import shutil

import pytest

from captioner.models.evaluation.metrics import score_captions

REFS = {1: ["a red circle and a blue square", "a red circle next to a blue square", "two shapes a red circle"],
        2: ["a green star on a striped background", "a green star", "one green star in the centre"]}


def test_perfect_and_wrong_captions():
    good = score_captions({1: "a red circle and a blue square", 2: "a green star"}, REFS,
                          ("BLEU", "ROUGE-L", "CIDEr-D"))
    bad = score_captions({1: "an orange triangle", 2: "purple diamonds everywhere"}, REFS,
                         ("BLEU", "ROUGE-L", "CIDEr-D"))
    assert good["CIDEr-D"] > 1.0 and bad["CIDEr-D"] < 0.05
    assert good["BLEU-1"] > 0.9 and bad["BLEU-1"] < 0.2
    assert good["ROUGE-L"] > bad["ROUGE-L"]


@pytest.mark.skipif(shutil.which("java") is None, reason="METEOR needs Java")
def test_meteor_runs_offline():
    scores = score_captions({1: "a red circle and a blue square", 2: "a green star"}, REFS, ("METEOR",))
    assert 0.3 < scores["METEOR"] <= 1.0


def test_unigram_misses_are_what_bleu1_does_not_credit():
    """Clipped counts: a word beyond the most times one reference holds it is a miss; with captions no shorter than
    their closest references (no brevity penalty), 1 − misses / words is coco-caption's BLEU-1."""
    from captioner.models.evaluation.metrics import unigram_misses

    captions = {1: "a dog a dog a dog runs fast".split(), 2: "the man in a red shirt is sitting on grass".split()}
    references = {1: ["a dog runs".split(), "a dog a dog".split()],
                  2: ["a man in a blue coat sits on the grass".split(), "a person sits outside".split()]}
    misses, words = unigram_misses(captions, references)
    assert words == 18
    # image 1: "a" ×3 and "dog" ×3 against at most 2 in one reference, "fast" in none;
    # image 2: "the" appears once in a reference, "red", "shirt", "is", "sitting" in none
    assert misses == {"a": 1, "dog": 1, "fast": 1, "red": 1, "shirt": 1, "is": 1, "sitting": 1}
    bleu1 = score_captions({i: " ".join(c) for i, c in captions.items()},
                           {i: [" ".join(r) for r in refs] for i, refs in references.items()}, ["BLEU"])["BLEU-1"]
    assert bleu1 == pytest.approx(1 - sum(misses.values()) / words, abs=1e-6)
