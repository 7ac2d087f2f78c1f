"""The vectorised CIDEr-D against ``pycocoevalcap``'s ``Cider`` (coco-caption's CIDEr-D) on a fixed set."""

import numpy as np
import pytest
from pycocoevalcap.cider.cider import Cider

from captioner.models.evaluation.metrics import CiderD, cider_d, score_captions


def _fixed_set(images: int = 300, seed: int = 0):
    """Captions and 1–5 references per image from a small Zipf-ish vocabulary, so n-grams repeat across images
    (non-trivial document frequencies), with repeated words (clipping matters), empty and one-word captions."""
    rng = np.random.default_rng(seed)
    words = [f"w{i}" for i in range(40)]
    p = 1.0 / np.arange(1, 41)
    p /= p.sum()

    def sentence(low=0, high=14):
        return " ".join(rng.choice(words, size=int(rng.integers(low, high)), p=p))

    refs = [[sentence(1) for _ in range(int(rng.integers(1, 6)))] for _ in range(images)]
    captions = [sentence() for _ in range(images)]
    captions[0], captions[1], captions[2] = "", "w0", refs[2][0]  # empty, one word, an exact reference
    return captions, refs


def test_equals_pycocoevalcap_within_1e6():
    captions, refs = _fixed_set()
    _, theirs = Cider().compute_score({i: r for i, r in enumerate(refs)}, {i: [c] for i, c in enumerate(captions)})
    ours = cider_d(captions, refs)
    assert np.abs(ours - theirs).max() < 1e-6
    assert ours[2] > 0 and ours[0] == 0.0 and np.std(ours) > 0.1, "the set exercises the score's range"


def test_eval_corpus_score_is_pycocoevalcaps_mean():
    captions, refs = _fixed_set(images=50, seed=3)
    theirs, _ = Cider().compute_score({i: r for i, r in enumerate(refs)},
                                      {i: [c or "<empty>"] for i, c in enumerate(captions)})
    ours = score_captions(dict(enumerate(captions)), dict(enumerate(refs)), metrics=("CIDEr-D",))["CIDEr-D"]
    assert ours == pytest.approx(theirs, abs=1e-6)


def test_reward_with_fixed_frequencies_ignores_the_rest_of_the_batch():
    captions, refs = _fixed_set(images=40, seed=1)
    cider = CiderD(refs)  # frequencies from a training corpus, fixed
    batch = cider.score(captions, refs)
    alone = [cider.score([c], [r])[0] for c, r in zip(captions, refs)]
    np.testing.assert_allclose(batch, alone, rtol=0, atol=1e-12)
    # the same reference list object repeated (as SCST does for an image's samples) scores like separate copies
    shared = refs[5]
    np.testing.assert_allclose(cider.score(captions[:4], [shared] * 4),
                               cider.score(captions[:4], [list(shared) for _ in range(4)]), atol=1e-12)


def test_words_never_seen_in_the_corpus_still_match_their_reference():
    cider = CiderD([["a b c"]] * 2)
    assert cider.score(["x y z"], [["x y z"]])[0] > 0
    with pytest.raises(ValueError, match="reference"):
        cider.score(["a"], [[]])
