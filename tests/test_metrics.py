import shutil

import pytest

from captioner.models.evaluation.metrics import score_captions

REFS = {1: ["a red circle and a blue square", "a red circle next to a blue square", "two shapes a red circle"],
        2: ["a green star on a striped background", "a green star", "one green star in the centre"]}


def test_perfect_and_wrong_captions():
    good = score_captions({1: "a red circle and a blue square", 2: "a green star"}, REFS, ("BLEU", "ROUGE-L", "CIDEr-D"))
    bad = score_captions({1: "an orange triangle", 2: "purple diamonds everywhere"}, REFS, ("BLEU", "ROUGE-L", "CIDEr-D"))
    assert good["CIDEr-D"] > 1.0 and bad["CIDEr-D"] < 0.05
    assert good["BLEU-1"] > 0.9 and bad["BLEU-1"] < 0.2
    assert good["ROUGE-L"] > bad["ROUGE-L"]


@pytest.mark.skipif(shutil.which("java") is None, reason="METEOR needs Java")
def test_meteor_runs_offline():
    scores = score_captions({1: "a red circle and a blue square", 2: "a green star"}, REFS, ("METEOR",))
    assert 0.3 < scores["METEOR"] <= 1.0
