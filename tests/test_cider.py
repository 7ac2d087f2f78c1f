"""The vectorised CIDEr-D against ``pycocoevalcap``'s ``Cider`` (coco-caption's CIDEr-D) on a fixed set."""

import math
from collections import defaultdict

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


def test_reward_with_the_scored_references_as_corpus_equals_pycocoevalcap():
    """The SCST reward's own document frequencies (one count per image, over all its references, and log of the
    number of images), built from a corpus that is the scored set itself, give pycocoevalcap's scores: the
    fixed-corpus path is checked against coco-caption, not only against itself."""
    captions, refs = _fixed_set(images=60, seed=4)
    _, theirs = Cider().compute_score({i: r for i, r in enumerate(refs)}, {i: [c] for i, c in enumerate(captions)})
    np.testing.assert_allclose(CiderD(refs).score(captions, refs), theirs, rtol=0, atol=1e-6)


def test_words_never_seen_in_the_corpus_still_match_their_reference():
    cider = CiderD([["a b c"]] * 2)
    assert cider.score(["x y z"], [["x y z"]])[0] > 0
    with pytest.raises(ValueError, match="reference"):
        cider.score(["a"], [[]])


# --------------------------------------------------------------------------------------------------------------
# The SCST reward's CIDEr-D (document frequencies from a training corpus, fixed) against the authors' scorer:
# vrama91/cider ``pyciderevalcap/ciderD/ciderD_scorer.py`` (``compute_doc_freq``, ``counts2vec``, ``sim``,
# ``compute_cider``; commit 3b388bd), which self-critical.pytorch vendors as its ``cider`` submodule and feeds with
# ``scripts/prepro_ngrams.py``'s ``get_doc_freq`` (document frequency per image over the training references,
# ``ref_len`` = their number of images).  Transcribed in its own dictionary shape, Python 3 spelling.
# --------------------------------------------------------------------------------------------------------------
def _precook(s, n=4):
    words = s.split()
    counts = {}
    for k in range(1, n + 1):
        for i in range(len(words) - k + 1):
            ngram = tuple(words[i:i + k])
            counts[ngram] = counts.get(ngram, 0) + 1
    return counts


def _authors_cider_d(captions, references, corpus, n=4, sigma=6.0):
    document_frequency = defaultdict(float)
    for refs in [[_precook(r, n) for r in refs] for refs in corpus]:  # get_doc_freq → compute_doc_freq
        for ngram in set([ngram for ref in refs for (ngram, count) in ref.items()]):
            document_frequency[ngram] += 1
    ref_len = np.log(float(len(corpus)))

    def counts2vec(cnts):
        vec = [defaultdict(float) for _ in range(n)]
        length = 0
        norm = [0.0 for _ in range(n)]
        for (ngram, term_freq) in cnts.items():
            df = np.log(max(1.0, document_frequency[ngram]))
            k = len(ngram) - 1
            vec[k][ngram] = float(term_freq) * (ref_len - df)
            norm[k] += pow(vec[k][ngram], 2)
            if k == 1:
                length += term_freq
        norm = [np.sqrt(x) for x in norm]
        return vec, norm, length

    def sim(vec_hyp, vec_ref, norm_hyp, norm_ref, length_hyp, length_ref):
        delta = float(length_hyp - length_ref)
        val = np.array([0.0 for _ in range(n)])
        for k in range(n):
            for (ngram, count) in vec_hyp[k].items():
                val[k] += min(vec_hyp[k][ngram], vec_ref[k][ngram]) * vec_ref[k][ngram]
            if (norm_hyp[k] != 0) and (norm_ref[k] != 0):
                val[k] /= (norm_hyp[k] * norm_ref[k])
            assert not math.isnan(val[k])
            val[k] *= np.e ** (-(delta ** 2) / (2 * sigma ** 2))
        return val

    scores = []
    for test, refs in zip(captions, references):
        vec, norm, length = counts2vec(_precook(test, n))
        score = np.array([0.0 for _ in range(n)])
        for ref in refs:
            vec_ref, norm_ref, length_ref = counts2vec(_precook(ref, n))
            score += sim(vec, vec_ref, norm, norm_ref, length, length_ref)
        score_avg = np.mean(score)
        score_avg /= len(refs)
        score_avg *= 10.0
        scores.append(score_avg)
    return np.array(scores)


@pytest.mark.parametrize("seed", range(4))
def test_reward_equals_the_authors_cider_d_with_training_document_frequencies(seed):
    """Adversarial inputs: a vocabulary of one or two words (long runs of one word: clipping), captions much longer
    than their references (the length penalty), empty captions and references, words and n-grams the training
    corpus never saw, non-ASCII words, and an end token on both sides (``--scst-reward-eos``)."""
    rng = np.random.default_rng(seed)
    words = ["a", "é", "dog", "<eos>", "straße"][:int(rng.integers(1, 6))]

    def sentence(low, high):
        return " ".join(rng.choice(words, size=int(rng.integers(low, high))))

    corpus = [[sentence(1, 10) for _ in range(int(rng.integers(1, 6)))] for _ in range(int(rng.integers(2, 30)))]
    references = [[sentence(0, 8) for _ in range(int(rng.integers(1, 6)))] for _ in range(25)]
    captions = [sentence(0, 30) for _ in range(25)]
    captions[0], references[1] = "", ["", "a a a a a a"]
    captions[2] = "never seen " + captions[2]
    ours = CiderD(corpus).score(captions, references)
    np.testing.assert_allclose(ours, _authors_cider_d(captions, references, corpus), rtol=0, atol=1e-9)


def test_a_vocabulary_past_eight_thousand_words_keeps_every_4_gram_apart():
    """Word ids run past 2^13 in a large corpus (Flickr8k's references hold about 8,900 words): 4-grams that differ
    only in a word of a high id stay different n-grams, as pycocoevalcap's string n-grams are; the caption's
    "a b c d" must not match the reference's "z b c d" (z's id 2^13 + 1, a's 1)."""
    fillers = " ".join(f"f{i}" for i in range(8184))  # ids 9 … 8192, after the captions' eight words
    captions = ["a b c d", "p q r s"]
    references = [[fillers, "z b c d"], ["p q r s", "p q"]]
    _, theirs = Cider().compute_score({i: r for i, r in enumerate(references)},
                                      {i: [c] for i, c in enumerate(captions)})
    np.testing.assert_allclose(cider_d(captions, references), theirs, rtol=0, atol=1e-6)


def test_document_frequencies_from_a_one_image_corpus_weigh_every_n_gram_zero():
    """log |corpus| − log df(ω) = log 1 − log 1 for a corpus of one image: every caption scores 0, as pycocoevalcap
    scores a one-image set, not the log 2 of a corpus counted as two."""
    references = [["a dog runs on the grass", "a brown dog"]]
    _, theirs = Cider().compute_score({0: references[0]}, {0: ["a dog runs"]})
    assert CiderD(references).score(["a dog runs"], references)[0] == pytest.approx(theirs[0], abs=1e-12) == 0.0


def test_a_corpus_without_4_grams_still_scores_captions_that_have_some():
    """References of two or three words hold no 4-gram (nor, here, any 3-gram): their document frequencies are
    empty tables, and a longer caption's 3- and 4-grams get df 0, as in pycocoevalcap, not an IndexError."""
    references = [["a dog", "a brown dog"], ["two cats", "cats"]]
    captions = ["a brown dog runs fast", "two cats"]
    _, theirs = Cider().compute_score({i: r for i, r in enumerate(references)},
                                      {i: [c] for i, c in enumerate(captions)})
    np.testing.assert_allclose(CiderD(references).score(captions, references), theirs, rtol=0, atol=1e-6)


def test_the_corpus_scorer_refuses_references_that_do_not_pair_with_the_captions():
    """``captioner eval``'s path (``cider_d``, frequencies from the scored references) refuses what the reward's
    ``CiderD.score`` refuses: fewer captions than reference lists (the last images' references would weigh the
    document frequencies and score nothing) and an empty reference list (a division by zero references)."""
    with pytest.raises(ValueError, match="1 captions but 2 reference lists"):
        cider_d(["a dog"], [["a dog"], ["a cat"]])
    with pytest.raises(ValueError, match="at least one reference"):
        cider_d(["a dog", "a cat"], [["a dog"], []])


def test_the_reward_refuses_captions_and_reference_lists_that_do_not_pair():
    """``CiderD.score`` pairs ``captions[i]`` with ``references[i]``: unchecked, one reference list too few leaves a
    caption's set an uninitialised index (an IndexError, or a score against whatever set it names) and one too many
    an IndexError, where the error should say why."""
    scorer = CiderD([["a dog runs"], ["a cat"]])
    with pytest.raises(ValueError, match="2 captions but 1 reference lists"):
        scorer.score(["a dog", "a cat"], [["a dog"]])
    with pytest.raises(ValueError, match="1 captions but 2 reference lists"):
        scorer.score(["a dog"], [["a dog"], ["a cat"]])


def test_every_16_bit_word_id_is_scored_and_a_larger_vocabulary_is_refused():
    """N-gram codes hold four 16-bit word ids (id 0 is the sentence separator): 65,535 distinct words score as
    pycocoevalcap scores them, the next word is refused instead of overflowing into another n-gram's code."""
    words = [f"w{i}" for i in range((1 << 16) - 1)]
    corpus = [[" ".join(words[:len(words) // 2])], [" ".join(words[len(words) // 2:])]]
    captions, references = [" ".join(words[-5:])], [[" ".join(words[-6:]), " ".join(words[:3])]]
    _, theirs = Cider().compute_score({0: corpus[1]}, {0: [captions[0]]})
    np.testing.assert_allclose(cider_d(captions, [corpus[1]]), theirs, rtol=0, atol=1e-6)
    assert CiderD(corpus).score(captions, references)[0] > 0
    with pytest.raises(ValueError, match="more than 65535 distinct words"):
        CiderD(corpus + [["one more word"]])


def test_the_reward_takes_its_corpus_as_any_iterable_of_reference_lists():
    """``CiderD(corpus)`` reads its corpus once: a generator of each image's references (a data set streamed by a
    library user) gives the document frequencies of the same corpus as a list."""
    captions, refs = _fixed_set(images=30, seed=5)
    np.testing.assert_array_equal(CiderD(iter(refs)).score(captions, refs), CiderD(refs).score(captions, refs))


def test_the_reward_of_no_captions_is_an_empty_array():
    """A batch with no captions (an empty last batch, a filter that kept none) scores as an empty array, which sums
    and concatenates like the others, not None."""
    scores = CiderD([["a dog runs"], ["a cat"]]).score([], [])
    assert isinstance(scores, np.ndarray) and scores.shape == (0,)


def test_the_corpus_score_of_no_captions_is_an_empty_array():
    """``cider_d([], [])`` (a split filtered to no images) is an empty array, as ``CiderD.score([], [])`` is, not the
    math domain error of the log of a corpus of no images."""
    scores = cider_d([], [])
    assert isinstance(scores, np.ndarray) and scores.shape == (0,)
