import os
import shutil
import threading

import pytest
from pycocoevalcap.bleu.bleu import Bleu
from pycocoevalcap.cider.cider import Cider
from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

from captioner.models.data.karpathy import CaptionedImage
from captioner.models.evaluation.evaluate import score_dataset
from captioner.models.evaluation.metrics import (ptb_captions, ptb_tokenize, reference_texts, reported,
                                                score_captions, unigram_misses)
from captioner.models.vocab import tokenize

from .leaks import nothing_left_open

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


def test_scores_are_raw_fractions_not_percentages():
    """docs: raw scores, not ×100 (docs/model_zoo.md's tables multiply them): captions that are references score
    BLEU-1..4 and ROUGE-L of 1, not 100."""
    exact = score_captions({1: "a red circle and a blue square", 2: "a green star"}, REFS, ("BLEU", "ROUGE-L"))
    assert exact == pytest.approx({"BLEU-1": 1.0, "BLEU-2": 1.0, "BLEU-3": 1.0, "BLEU-4": 1.0, "ROUGE-L": 1.0},
                                  abs=1e-6)


def test_captions_are_scored_as_given_without_lower_casing():
    """``score_captions`` splits at spaces and nothing more (``captioner eval`` tokenises first): "A" is not "a",
    "circle." is not "circle", so of "A red circle." only "red" is a reference's word."""
    given = score_captions({1: "A red circle."}, {1: ["a red circle"]}, "BLEU")
    assert given["BLEU-1"] == pytest.approx(1 / 3, abs=1e-6)


def test_inputs_that_scored_wrongly_in_silence_are_refused_by_name():
    # a library user's audit: a reference given as a string was scored as its characters (BLEU-1 0.5 for an exact
    # match), "BLEU-4" returned {}, a missing reference was a bare KeyError
    with pytest.raises(TypeError, match=r"references\[0\] must be a list of captions"):
        score_captions({0: "a dog"}, {0: "a dog"}, ("BLEU",))
    with pytest.raises(ValueError, match="unknown metric.*'BLEU-4'.*BLEU gives BLEU-1 to BLEU-4"):
        score_captions({1: "a red circle"}, REFS, ("BLEU-4",))
    with pytest.raises(ValueError, match="candidate 3 has no references"):
        score_captions({3: "a red circle"}, REFS, ("BLEU",))
    with pytest.raises(TypeError, match="give each caption as a string"):
        score_captions({1: ["a", "red", "circle"]}, REFS, ("BLEU",))
    assert score_captions({1: "a red circle"}, REFS, "CIDEr-D").keys() == {"CIDEr-D"}  # one name alone is a name


def test_references_of_images_without_a_caption_are_left_out_of_the_scores():
    """A library user scores the captions of some images against a whole data set's references: the other images'
    references are not scored (coco-caption's BLEU and ROUGE-L stop with a bare AssertionError when the two sets of
    keys differ), and the scores are those of the captioned images' references alone."""
    metrics = ("BLEU", "ROUGE-L", "CIDEr-D")
    some = {2: "a green star in the centre", 3: "a dog"}
    references = {**REFS, 3: ["a dog runs", "a brown dog"]}
    assert score_captions(some, references, metrics) == score_captions(some, {i: references[i] for i in some}, metrics)


@pytest.mark.skipif(shutil.which("java") is None, reason="METEOR needs Java")
def test_meteor_runs_offline():
    # pycocoevalcap's scorer stops Java but leaves its output pipes open: every evaluation leaked two
    with nothing_left_open():
        scores = score_captions({1: "a red circle and a blue square", 2: "a green star"}, REFS, ("METEOR",))
    assert 0.3 < scores["METEOR"] <= 1.0


def test_unigram_misses_are_what_bleu1_does_not_credit():
    """Clipped counts: a word beyond the most times one reference holds it is a miss; with captions no shorter than
    their closest references (no brevity penalty), 1 − misses / words is coco-caption's BLEU-1."""
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


@pytest.mark.skipif(shutil.which("java") is None, reason="the PTB tokenizer needs Java")
def test_ptb_scoring_is_coco_captions_own_pipeline():
    """``--ptb``: the scores coco-caption's own pipeline gives (pycocoevalcap's PTBTokenizer over the raw references
    and the captions, then Bleu and Cider), not the project's tokenizer's, which differ on "T-shirt" and "cannot"."""
    raw = {1: ["A man in a T-shirt cannot sit.", "A man, in a red T-shirt, stands.", "Someone's standing."],
           2: ["Two dogs play in the snow.", "Dogs' game: in the snow!", "Two close-up dogs."],
           3: ["A café by the road.", "People outside a cafe .", "A little café."]}
    captions = {1: "a man in a t shirt can not sit", 2: "two dogs play in the snow", 3: "a cafe by the road"}
    images = [CaptionedImage(i, f"{i}.jpg", "test", [tokenize(r) for r in texts], raw_references=texts)
              for i, texts in raw.items()]
    ours = score_dataset({i: c.split() for i, c in captions.items()}, images, ("BLEU", "CIDEr-D"), ptb=True)
    tokenizer = PTBTokenizer()
    gts = tokenizer.tokenize({i: [{"caption": t} for t in texts] for i, texts in raw.items()})
    res = tokenizer.tokenize({i: [{"caption": c}] for i, c in captions.items()})
    assert ours["BLEU-4"] == pytest.approx(Bleu(4).compute_score(gts, res, verbose=0)[0][3], abs=1e-9)
    assert ours["CIDEr-D"] == pytest.approx(Cider().compute_score(gts, res)[0], abs=1e-6)
    words = score_dataset({i: c.split() for i, c in captions.items()}, images, ("BLEU", "CIDEr-D"))
    assert words["CIDEr-D"] != pytest.approx(ours["CIDEr-D"], abs=1e-3)  # the two tokenizers do differ here
    # one caption per line whatever it holds: a line break the wrapper leaves (\r, \u2028) must not shift the
    # captions after it
    assert ptb_tokenize({"x": ["A T-shirt\rhere.", "Can't\u2028stop."], "y": ["Last one."]}) == {
        "x": ["a t-shirt here", "ca n't stop"], "y": ["last one"]}


def test_a_failed_ptb_tokenizer_run_is_an_error_not_empty_references(tmp_path, monkeypatch):
    """pycocoevalcap's wrapper checks neither Java's exit status nor the lines it returns: a failed run scored the
    captions against empty references, or failed later with an IndexError."""
    fake = tmp_path / "java"
    fake.write_text("#!/bin/sh\necho 'Error: could not find or load main class' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    with pytest.raises(ChildProcessError, match="did not return one line per caption"):
        ptb_tokenize({1: ["A dog runs."], 2: ["Two cats.", "A cat."]})
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    with pytest.raises(ChildProcessError, match="needs Java on PATH"):
        ptb_tokenize({1: ["A dog runs."]})


def test_a_report_keeps_four_decimals_of_every_score():
    """``captioner eval``, ``tune-decoding`` and ``resolution-check`` write scores through ``reported``: four
    decimals, the precision docs/model_zoo.md's tables (scores × 100, two decimals) are made from."""
    assert reported({"BLEU-4": 0.123456, "CIDEr-D": 1.00004, "ROUGE-L": 0.5}) == {
        "BLEU-4": 0.1235, "CIDEr-D": 1.0, "ROUGE-L": 0.5}


def test_references_are_the_projects_tokens_unless_ptb_is_asked_for():
    """The default is the project's tokens joined by spaces, never the raw texts through Java's PTB tokenizer:
    ``resolution-check`` and the Flickr8k zoo score the project's tokenized captions against them, and a PTB
    reference keeps "t-shirt" one word where the caption has "t shirt"."""
    image = CaptionedImage(1, "1.jpg", "test", [tokenize("A T-shirt, red.")], raw_references=["A T-shirt, red."])
    assert reference_texts([image]) == [["a t shirt red"]]
    # every reference of an image, in order (tests/test_compare.py's images repeat one reference five times)
    two = CaptionedImage(2, "2.jpg", "test", [["a", "dog"], ["two", "dogs", "run"]])
    assert reference_texts([image, two]) == [["a t shirt red"], ["a dog", "two dogs run"]]


def test_an_empty_caption_is_scored_as_the_one_word_empty():
    """docs/decisions.md: an empty caption is scored as the word ``<empty>`` by every measure (METEOR's Java process
    is never given an empty line); coco-caption's no words would give BLEU one word less of caption length."""
    empty = score_captions({1: "", 2: "a green star"}, REFS, ("BLEU", "ROUGE-L", "CIDEr-D"))
    assert empty == score_captions({1: "<empty>", 2: "a green star"}, REFS, ("BLEU", "ROUGE-L", "CIDEr-D"))


@pytest.mark.skipif(shutil.which("java") is None, reason="the PTB tokenizer needs Java")
def test_ptb_references_fall_back_to_the_tokens_and_an_image_without_texts_keeps_none():
    """A data set that gives tokens alone (no ``raw_references``) is scored with ``--ptb`` on its joined tokens, not
    on no references at all; a key with no texts comes back with none, not with a made-up ``<empty>``."""
    tokens_only = CaptionedImage(2, "2.jpg", "test", [["a", "dog", "runs"], ["two", "dogs"]])
    raw = CaptionedImage(1, "1.jpg", "test", [tokenize("A T-shirt.")], raw_references=["A T-shirt."])
    assert reference_texts([raw, tokens_only], ptb=True) == [["a t-shirt"], ["a dog runs", "two dogs"]]
    assert ptb_tokenize({"none": [], "one": ["Two dogs."]}) == {"none": [], "one": ["two dogs"]}


@pytest.mark.skipif(shutil.which("java") is None, reason="the PTB tokenizer needs Java")
def test_a_blank_text_is_the_word_empty_after_ptb_as_score_captions_scores_it():
    """A blank reference (or caption) given to ``ptb_tokenize`` comes back as the one word ``<empty>``, as
    ``score_captions`` scores an empty caption, not as no words: an empty reference would score BLEU's brevity
    penalty and CIDEr-D against a length of 0 under ``--ptb`` and of 1 without it."""
    assert ptb_tokenize({1: ["", "  \t", "A dog."]}) == {1: ["<empty>", "<empty>", "a dog"]}


@pytest.mark.skipif(shutil.which("java") is None, reason="the PTB tokenizer needs Java")
def test_a_caption_of_punctuation_alone_is_the_word_empty_after_ptb():
    """``compare --ptb`` scores ``ptb_captions``' output directly (no ``or "<empty>"`` after it): a caption the PTB
    tokenizer empties must still be the one word ``<empty>``, as ``captioner eval`` scores it."""
    assert ptb_captions({1: ". , !", 2: "A dog."}) == {1: "<empty>", 2: "a dog"}


def test_meteor_without_java_is_refused_by_name(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    with pytest.raises(RuntimeError, match="METEOR needs Java on PATH"):
        score_captions({1: "a red circle"}, REFS, ("METEOR",))


def test_a_java_that_stops_makes_meteor_an_error_not_a_hang(tmp_path, monkeypatch):
    """A Java that stops at once (a 2 GB heap it cannot reserve, a crash) broke pycocoevalcap's METEOR wrapper while
    it held its lock: the caller got a bare BrokenPipeError or ValueError, and the scorer's ``__del__``, which takes
    the same lock, then waited forever wherever the scorer was collected (``captioner eval --meteor`` never ended)."""
    fake = tmp_path / "java"
    fake.write_text("#!/bin/sh\necho 'Error: Could not reserve enough space for object heap' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    raised = []

    def score():
        try:
            score_captions({1: "a red circle", 2: "a green star"}, REFS, ("METEOR",))
        except ChildProcessError as error:
            raised.append(str(error))
        # leaving the except block frees the traceback and with it the scorer: its __del__ runs in this thread

    worker = threading.Thread(target=score, daemon=True)
    worker.start()
    worker.join(timeout=60)  # a bound on a hang, not a timing: the run takes well under a second
    assert not worker.is_alive(), "the METEOR scorer's __del__ waits for the lock that compute_score kept"
    assert len(raised) == 1 and "METEOR (Java) stopped before scoring: Error: Could not reserve" in raised[0]
