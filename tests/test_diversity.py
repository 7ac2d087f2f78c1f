"""REP, distinct words and novel captions (models/evaluation/diversity.py).

The REP reference below follows the authors' script as published (Unbabel/sparse_constrained_attention,
``generate_results/rep_score.py``: ``create_ngram_sentence_list``, ``count_repetitions``, ``n_gram_score``,
``consecutive_words_score``, ``calculate_final_scores`` with -n 2 -w1 1 -w2 2 --normalize), kept in its own shape
(lists of (n-gram, count) pairs, linear searches) so that it does not share our implementation's reading of it.
"""

import random
from collections import Counter

import pytest

from captioner.models.evaluation.diversity import diversity_scores, novel_share, rep_score, repetition_count


def _script_rep(references, predictions):
    def ngrams(sentences, n):
        return [[tuple(s[i:i + n]) for i in range(len(s) - n + 1)] for s in sentences]

    def counts(ngram_lists, threshold):
        return [[(k, v) for k, v in Counter(line).items() if v > threshold] for line in ngram_lists]

    def ngram_score(ref_counts, out_counts):
        score = [0] * len(ref_counts)
        for index, (list1, list2) in enumerate(zip(out_counts, ref_counts)):
            for item1 in list1:
                if item1[1] > 1:
                    found = 0
                    for item2 in list2:
                        if item1[0] == item2[0]:
                            score[index] += max(0, item1[1] - item2[1])
                            found = 1
                            break
                    if not found:
                        score[index] += item1[1]
        return score

    def consecutive(ref_counts, out_counts):
        score = [0] * len(out_counts)
        for index, (list1, list2) in enumerate(zip(out_counts, ref_counts)):
            for item1 in list1:
                if len(set(item1[0])) == 1:
                    found = 0
                    for item2 in list2:
                        if len(set(item2[0])) == 1 and set(item1[0]) == set(item2[0]):
                            score[index] += max(0, item1[1] - item2[1])
                            found = 1
                            break
                    if not found:
                        score[index] += item1[1]
        return score

    ref_counts, out_counts = counts(ngrams(references, 2), 0), counts(ngrams(predictions, 2), 0)
    totals = [1.0 * a + 2.0 * b for a, b in zip(ngram_score(ref_counts, out_counts),
                                                consecutive(ref_counts, out_counts))]
    return 100 * float(sum(totals)) / sum(len(r) for r in references)


def test_rep_with_one_reference_equals_the_authors_script():
    rng = random.Random(0)
    words = ["a", "dog", "the", "runs", "on", "grass"]  # few words: many repeats, some of one word
    for _ in range(20):
        refs = [[rng.choice(words) for _ in range(rng.randint(3, 12))] for _ in range(30)]
        preds = [[rng.choice(words) for _ in range(rng.randint(2, 14))] for _ in range(30)]
        ours = rep_score(dict(enumerate(preds)), {i: [r] for i, r in enumerate(refs)})
        assert ours == pytest.approx(_script_rep(refs, preds), abs=1e-9)


def test_rep_counts_what_the_references_do_not_repeat():
    caption = "a dog and a dog and a ball".split()  # "a dog" ×2, "dog and" ×2, "and a" ×2
    assert repetition_count(caption, ["a cat".split()]) == 6
    # a reference that itself says "a dog" twice excuses those two; the larger count over references is used
    assert repetition_count(caption, ["a cat".split(), "a dog by a dog".split()]) == 4
    assert repetition_count("the the dog".split(), ["a dog".split()]) == 2  # one same-word bigram, weight 2
    assert repetition_count("a dog runs".split(), ["a cat".split()]) == 0
    # two references saying "a dog" once each excuse one repeat, not two: the largest count, not the sum
    assert repetition_count(caption, ["a dog".split(), "a dog sits".split()]) == 5


def test_rep_normalises_by_the_mean_reference_length_of_each_caption():
    captions = {1: "a dog a dog".split(), 2: "a cat".split()}
    references = {1: ["a b c d".split(), "a b c d e f".split()], 2: ["x y".split(), "x y z w".split(), "x".split()]}
    total = repetition_count(captions[1], references[1]) + repetition_count(captions[2], references[2])
    assert total == 2  # "a dog" twice, unexcused
    # mean reference lengths 5 and 7/3: neither their sums (10, 7) nor their largest (6, 4)
    assert rep_score(captions, references) == pytest.approx(100 * 2 / (5 + 7 / 3))


def test_novel_share_and_distinct_words():
    train = ["a dog runs".split(), "a cat sits".split()]
    captions = {1: "a dog runs".split(), 2: "a dog sits".split()}
    assert novel_share(captions.values(), train) == 0.5
    # every caption counts, repeated ones too: two of three captions are new
    repeated = ["a dog sits".split(), "a dog sits".split(), "a cat sits".split()]
    assert novel_share(repeated, train) == pytest.approx(2 / 3)
    scores = diversity_scores(captions, {1: ["a dog".split()], 2: ["a dog".split()]}, train)
    assert scores["distinct_words"] == 4 and scores["novel_captions"] == 0.5 and scores["mean_length"] == 3
    assert scores["REP"] == 0.0


def test_one_caption_and_no_caption_score_as_themselves():
    """A set of one caption: its own length is the mean length and its own REP the score; an empty set (no
    captions, so no reference words) repeats nothing and has no words, not a division by zero."""
    one = {7: "a dog a dog runs".split()}
    scores = diversity_scores(one, {7: ["a dog runs".split()]})
    assert scores["mean_length"] == 5 and scores["distinct_words"] == 3
    assert scores["REP"] == pytest.approx(100 * 1 / 3)  # "a dog" once beyond the reference's one, over 3 words
    assert diversity_scores({}, {}) == {"REP": 0.0, "distinct_words": 0.0, "mean_length": 0.0}
    assert rep_score({}, {}) == 0.0 and novel_share([], ["a dog".split()]) == 0.0


def test_a_caption_whose_image_has_no_references_adds_no_reference_words():
    """An image listed with an empty reference list (a split entry without sentences) counts its caption's repeats
    but adds nothing to the normaliser: no division by its zero references."""
    captions = {1: "a dog a dog".split(), 2: "a cat".split()}
    references = {1: ["a b c d".split()], 2: []}
    assert rep_score(captions, references) == pytest.approx(100 * 2 / 4)


def test_a_reference_repeating_a_bigram_more_often_than_the_caption_excuses_it_without_a_credit():
    """A bigram the caption repeats less often than a reference does counts 0, not a negative amount that would
    cancel another bigram's repeats (the script's ``max(0, …)``)."""
    caption = "a dog a dog and the ball and the ball".split()  # "a dog" ×2, "and the" ×2, "the ball" ×2
    assert repetition_count(caption, ["a dog a dog a dog".split()]) == 4


def test_scores_cover_the_captions_given_not_every_image_of_the_references():
    """References may hold a whole split while the captions are a subset: the mean length and REP's normaliser are
    over the captions' images only."""
    captions = {1: "a dog a dog".split()}
    references = {1: ["a b c d".split()], 2: ["x y z w v u".split()], 3: ["p q".split()]}
    scores = diversity_scores(captions, references)
    assert scores["mean_length"] == 4
    assert scores["REP"] == pytest.approx(100 * 2 / 4)


def test_a_novel_caption_differs_from_every_training_caption_word_for_word_in_order():
    """Novelty is word for word: the training caption's words in another order are a new caption; and against an
    empty training set (given, but empty) every caption is new, not the column left out."""
    train = ["a dog runs".split()]
    assert novel_share(["dog a runs".split(), "a dog runs".split()], train) == 0.5
    assert diversity_scores({1: "a dog".split()}, {1: ["a dog".split()]}, [])["novel_captions"] == 1.0


def test_the_mean_length_is_the_mean_of_unequal_lengths_not_rounded_down():
    """Captions of three and four words are 3.5 words long on average: the card's length column compares models
    whose captions differ by fractions of a word, which a whole-number mean would hide."""
    captions = {1: "a dog runs".split(), 2: "a cat sits down".split()}
    scores = diversity_scores(captions, {1: ["a dog".split()], 2: ["a cat".split()]})
    assert scores["mean_length"] == 3.5


def test_a_caption_is_not_a_training_caption_whose_words_split_it_elsewhere():
    """Word for word means the same words, not the same letters: "ab c" is not the training caption "a bc" (a key
    joining the words without a separator would make them one caption and count a new caption as seen)."""
    assert novel_share(["ab c".split()], ["a bc".split()]) == 1.0
    assert novel_share(["a bc".split()], ["a bc".split()]) == 0.0
