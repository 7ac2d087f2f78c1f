"""Flickr30k Entities grounding (models/data/entities.py, models/evaluation/phrase_grounding.py) on hand-written
files, hand-built maps and boxes whose answers are known."""

from __future__ import annotations

import json
import re
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from captioner.models import attention, pipeline
from captioner.models.checkpoint import FORMAT, write_manifest
from captioner.models.data.entities import EntitiesDataset, EntitiesFormatError, EntityAnnotation, EntityImage, \
    parse_annotation, parse_sentences
from captioner.models.decoding import DecodingRules, beam_search
from captioner.models.evaluation import figures, phrase_grounding
from captioner.models.evaluation.grounding import CaptionAttention, caption_with_attention, pixel_distribution, \
    score_map, summarise
from captioner.models.evaluation.grounding_doc import closing_note, examples_figure, heatmap_checkpoints, \
    is_real_photo, normaliser, ordering_sentence, real_photo_checkpoints, results_figure, write_grounding_doc
from captioner.models.evaluation.phrase_grounding import PhotoAttention, PhraseTarget, best_word, box_mask, \
    entities_grounding, generated_targets, head_form, reference_targets, score_photos, summary_table, \
    teacher_forced_rows, type_table
from captioner.models.protocol import Geometry, VisualBatch
from captioner.models.rendering import heatmaps
from captioner.models.vocab import Vocabulary
from captioner.models.zoo import create

from .conftest import DEFAULT_CHECKPOINT
from .entities_photos import circle_photos
from .model_checks import two_by_two
from .test_cli import captioner

SENTENCES = """[/EN#31/people A little boy] in [/EN#32/clothing a green coat] climbs [/EN#33/other the ladder] .
[/EN#31/people/other The boy 's] [/EN#0/notvisual smile] is [/EN#34/scene outdoors] .
"""

ANNOTATION = """<annotation>
  <filename>1000.jpg</filename>
  <size><width>400</width><height>200</height><depth>3</depth></size>
  <object><name>31</name><bndbox><xmin>1</xmin><ymin>101</ymin><xmax>200</xmax><ymax>200</ymax></bndbox></object>
  <object><name>32</name><name>33</name>
    <bndbox><xmin>201</xmin><ymin>1</ymin><xmax>400</xmax><ymax>100</ymax></bndbox></object>
  <object><name>31</name><bndbox><xmin>301</xmin><ymin>151</ymin><xmax>400</xmax><ymax>200</ymax></bndbox></object>
  <object><name>34</name><scene>1</scene><nobndbox>0</nobndbox></object>
  <object><name>35</name><scene>0</scene><nobndbox>1</nobndbox></object>
</annotation>
"""


# ---------------------------------------------------------------------------------------------------------------
# Reader
# ---------------------------------------------------------------------------------------------------------------
def test_sentences_markup_chains_types_and_tokens():
    first, second = parse_sentences(SENTENCES)
    assert first.words == "A little boy in a green coat climbs the ladder .".split()
    assert [(p.chain, p.types, p.first_word, p.words) for p in first.phrases] == [
        ("31", ("people",), 0, ("A", "little", "boy")), ("32", ("clothing",), 4, ("a", "green", "coat")),
        ("33", ("other",), 8, ("the", "ladder"))]
    assert second.phrases[0].types == ("people", "other") and second.phrases[1].chain == "0"
    # project tokens: lower case, punctuation dropped ("'s" → "s"); spans follow
    tokens, spans = second.tokenized()
    assert tokens == ["the", "boy", "s", "smile", "is", "outdoors"]
    assert spans == [(0, 3), (3, 4), (5, 6)]


def test_a_phrase_that_ends_the_caption_spans_to_its_last_token():
    (sentence,) = parse_sentences("[/EN#1/people A man] rides [/EN#2/animals a horse]")
    assert sentence.tokenized() == (["a", "man", "rides", "a", "horse"], [(0, 2), (3, 5)])


def test_every_caption_line_is_read_past_blank_lines():
    text = "\n\n".join(f"[/EN#{n}/people A man] rides ." for n in range(1, 6)) + "\n"
    assert [sentence.phrases[0].chain for sentence in parse_sentences(text)] == ["1", "2", "3", "4", "5"]
    with pytest.raises(EntitiesFormatError, match="line 11: phrase \\[/EN#6 is never closed"):
        parse_sentences(text + "\n[/EN#6/people A man rides .\n")


def test_a_line_of_blanks_alone_is_no_caption():
    """The docstring's "every non-empty line": a line of spaces or a tab (a trailing one in an edited file) is skipped
    like an empty one, so it neither adds a caption without words nor moves the numbers ``UNRELATED_CAPTIONS`` gives
    the captions after it."""
    text = "[/EN#1/people A man] rides .\n   \n\t\n[/EN#2/people A woman] walks .\n"
    assert [sentence.phrases[0].chain for sentence in parse_sentences(text)] == ["1", "2"]


@pytest.mark.parametrize("line", ["[/EN#x/people a dog] runs", "a [/EN#3/people dog runs", "[EN#3/people a dog]",
                                  "[/EN#3/ a dog] runs", "[/EN#/people a dog] runs"])
def test_bad_markup_is_a_format_error(line):
    with pytest.raises(EntitiesFormatError):
        parse_sentences(line)


def test_annotation_boxes_every_name_and_flags():
    annotation = parse_annotation(ANNOTATION)
    assert annotation.size == (400, 200)
    assert annotation.boxes == {"31": [(1, 101, 200, 200), (301, 151, 400, 200)], "32": [(201, 1, 400, 100)],
                                "33": [(201, 1, 400, 100)]}
    assert annotation.scene == {"34"} and annotation.nobox == {"35"}
    for bad in ("<annotation/>", "<annotation><size><width>4</width></size></annotation>", "not xml",
                ANNOTATION.replace("<xmin>301</xmin>", "<xmin>0</xmin>")):
        with pytest.raises(EntitiesFormatError):
            parse_annotation(bad)


@pytest.mark.parametrize("width, height", [(0, 200), (400, 0)])
def test_an_annotation_of_no_width_or_height_is_a_format_error(width, height):
    # boxes_on divides by it
    size = f"<width>{width}</width><height>{height}</height>"
    bad = ANNOTATION.replace("<width>400</width><height>200</height>", size)
    with pytest.raises(EntitiesFormatError, match=f"size {width}×{height}"):
        parse_annotation(bad)


def test_an_empty_name_is_no_chain():
    annotation = parse_annotation(ANNOTATION.replace("<name>32</name><name>33</name>", "<name/><name>33</name>"))
    assert "32" not in annotation.boxes and annotation.boxes["33"] == [(201, 1, 400, 100)]
    with pytest.raises(EntitiesFormatError, match="an <object> without a <name>"):
        parse_annotation(ANNOTATION.replace("<name>32</name><name>33</name>", "<name/><name> </name>"))


def test_boxes_on_a_squashed_copy_scale_each_axis_on_its_own():
    annotation = parse_annotation(ANNOTATION)
    # the 400×200 photo squashed to 224×224: x by 0.56, y by 1.12
    assert np.allclose(annotation.boxes_on("31", (224, 224)), [[0, 112, 112, 224], [168, 168, 224, 224]])
    assert annotation.boxes_on("34", (224, 224)).shape == (0, 4)
    mask = box_mask(annotation.boxes_on("31", (224, 224)), (224, 224))
    assert mask.sum() == 112 * 112 + 56 * 56
    assert mask[112:, :112].all() and not mask[:112].any()
    # the same photo at its own size: the identity
    assert np.allclose(annotation.boxes_on("32", (400, 200)), [[200, 0, 400, 100]])


def test_box_mask_pixel_centres_and_thin_boxes():
    assert box_mask(np.array([[0.4, 0.0, 2.6, 1.0]]), (4, 2)).tolist() == [[True, True, True, False],
                                                                        [False, False, False, False]]
    thin = box_mask(np.array([[1.1, 1.1, 1.3, 1.3]]), (4, 4))  # holds no pixel centre: keeps the one under it
    assert thin.sum() == 1 and thin[1, 1]
    # a thin box in the last column of a wide image, and a flat one on the bottom edge: the pixel beside each stays
    last_column = box_mask(np.array([[3.6, 0.0, 3.9, 2.0]]), (4, 2))
    assert last_column.sum() == 2 and last_column[:, 3].all()
    bottom_edge = box_mask(np.array([[1.0, 4.0, 2.0, 4.0]]), (4, 4))
    assert bottom_edge.sum() == 1 and bottom_edge[3, 1]
    # a thin box keeps the pixel under its centre (2.1, 1.2), not the one its left or top edge starts in
    assert np.argwhere(box_mask(np.array([[1.9, 0.9, 2.3, 1.5]]), (4, 4))).tolist() == [[1, 2]]


def test_a_flat_box_on_the_right_edge_keeps_the_last_column():
    """The columns' twin of the bottom-edge case above: a box of no width on the image's right edge (x = width)
    keeps the last column's pixel rather than one past the image, so the object does not vanish."""
    right_edge = box_mask(np.array([[4.0, 1.0, 4.0, 2.0]]), (4, 4))
    assert np.argwhere(right_edge).tolist() == [[1, 3]]


def test_box_mask_edges_are_half_open_on_a_halved_photo():
    """Scaled by ½, an odd edge lands on a pixel centre (201 px → 100.5): a centre on the right or bottom edge is
    outside, on the left or top one inside, so boxes that meet share no pixel."""
    assert np.argwhere(box_mask(np.array([[0.5, 0.5, 2.5, 2.5]]), (4, 4))).tolist() == [[0, 0], [0, 1], [1, 0],
                                                                                         [1, 1]]
    halves = [box_mask(np.array([box]), (4, 4)) for box in ([0.0, 0.0, 1.5, 1.5], [1.5, 1.5, 4.0, 4.0])]
    assert halves[0].sum() == 1 and halves[1].sum() == 9 and not (halves[0] & halves[1]).any()


def _entities_folder(root, sentences=SENTENCES, annotation=ANNOTATION):
    for part in ("Sentences", "Annotations"):
        (root / part).mkdir(exist_ok=True)
    (root / "Sentences" / "1000.txt").write_text(sentences)
    (root / "Annotations" / "1000.xml").write_text(annotation)
    return root / "Sentences" / "1000.txt", root / "Annotations" / "1000.xml"


def test_dataset_folder_ids_and_unrelated_captions(tmp_path):
    _entities_folder(tmp_path)
    (tmp_path / "UNRELATED_CAPTIONS").write_text("# format: <imageID> <sentence number>\n1000 1\n")
    dataset = EntitiesDataset(tmp_path)
    entity = dataset.load("images/1000_abcdef.jpg")
    assert entity.flickr_id == "1000" and len(entity.sentences) == 1  # sentence 1 is unrelated
    assert entity.sentences[0].phrases[0].types == ("people", "other")
    assert dataset.load("images/999_x.jpg") is None
    (tmp_path / "Sentences" / "1001.txt").write_text(SENTENCES)  # its annotation not downloaded: no entities either
    assert dataset.load("images/1001_x.jpg") is None
    with pytest.raises(FileNotFoundError, match="not a Flickr30k Entities folder"):
        EntitiesDataset(tmp_path / "Sentences")


@pytest.mark.parametrize("present, missing", [("Sentences", "Annotations"), ("Annotations", "Sentences")])
def test_a_folder_with_half_of_the_download_is_not_an_entities_folder(tmp_path, present, missing):
    """Both halves are needed: a folder holding ``Sentences/`` alone (the annotations not yet unpacked) would answer
    None for every photo, read as photos without entities, rather than naming what is missing."""
    (tmp_path / present).mkdir()
    with pytest.raises(FileNotFoundError, match=f"not a Flickr30k Entities folder: no {missing}/ in it"):
        EntitiesDataset(tmp_path)


def _authors_sentence(line):
    """The rules of the dataset's own ``get_sentence_data`` (flickr30k_entities_utils.py), restated: outside a
    phrase a token starting with ``[`` opens one (its id after ``EN#``, its types after that); inside one every
    token is a word and the first ending in ``]`` closes it."""
    words, phrases, open_phrase = [], [], None
    for token in line.split():
        if open_phrase is None and token[0] == "[":
            parts = token.split("/")
            open_phrase = (parts[1][3:], tuple(parts[2:]), len(words))
            continue
        if open_phrase is not None and token[-1] == "]":
            token = token[:-1]
            words.append(token)
            chain, types, first = open_phrase
            phrases.append((chain, types, first, tuple(words[first:])))
            open_phrase = None
            continue
        words.append(token)
    return words, phrases


@pytest.mark.parametrize("line", [*SENTENCES.splitlines(),
                                  "[/EN#7/people/clothing A man 's] hat] and [/EN#8/other one] more ]",
                                  "[/EN#1/people a [/EN#2/other dog] runs] off",
                                  "[/EN#1/people A  man]\trides  off ."])  # runs of blanks, a tab: str.split()
def test_sentences_are_read_by_the_rules_of_the_datasets_own_parser(line):
    """A word ending in ``]`` outside a phrase stays a word; the published captions nest no phrases, and a bracket
    inside an open phrase is one of its words, as the authors' reader has it, not a phrase of its own."""
    (sentence,) = parse_sentences(line)
    words, phrases = _authors_sentence(line)
    assert sentence.words == words
    assert [(p.chain, p.types, p.first_word, p.words) for p in sentence.phrases] == phrases


@pytest.mark.parametrize("edges", [(0, 101, 200, 200), (1, 0, 200, 200), (201, 101, 200, 200), (1, 101, 200, 100)])
def test_a_box_off_the_one_based_grid_or_with_a_far_edge_before_its_near_one_is_a_format_error(edges):
    """Boxes are 1-based inclusive: an edge at 0 (a 0-based file) or a max below its min is refused on either axis."""
    tags = "".join(f"<{tag}>{value}</{tag}>" for tag, value in zip(("xmin", "ymin", "xmax", "ymax"), edges))
    bad = ANNOTATION.replace("<xmin>1</xmin><ymin>101</ymin><xmax>200</xmax><ymax>200</ymax>", tags)
    with pytest.raises(EntitiesFormatError, match="is not 1-based with min ≤ max"):
        parse_annotation(bad)
    one_pixel = ANNOTATION.replace("<xmax>200</xmax><ymax>200</ymax>", "<xmax>1</xmax><ymax>101</ymax>")
    assert parse_annotation(one_pixel).boxes["31"][0] == (1, 101, 1, 101)


@pytest.mark.parametrize("part, damage, message", [
    ("Sentences", lambda text: text + "[/EN#6/people A man rides .\n", "line 3: phrase \\[/EN#6 is never closed"),
    ("Sentences", lambda text: text.replace("[/EN#33/other", "[/EN#33"), "line 1: bad phrase markup"),
    ("Annotations", lambda text: text[:-20], "not XML"),
    ("Annotations", lambda text: text.replace("<xmin>301</xmin>", "<xmin>0</xmin>"), "box .* is not 1-based")],
    ids=["unclosed phrase", "bad markup", "torn XML", "0-based box"])
def test_a_format_error_in_a_photos_files_names_the_file(tmp_path, part, damage, message):
    """A damaged file is found by its name among the 31,783 photos': the dataset gives each file's path as the
    source of its errors."""
    files = dict(zip(("Sentences", "Annotations"), _entities_folder(tmp_path)))
    files[part].write_text(damage(files[part].read_text()))
    with pytest.raises(EntitiesFormatError, match=f"{re.escape(str(files[part]))}(, |: ){message}"):
        EntitiesDataset(tmp_path).load("images/1000_abcdef.jpg")


def test_a_photo_with_an_annotation_but_no_sentences_has_no_entities(tmp_path):
    sentences, _ = _entities_folder(tmp_path)
    sentences.unlink()
    assert EntitiesDataset(tmp_path).load("images/1000_abcdef.jpg") is None


def test_the_flags_of_an_object_with_a_box_are_not_read():
    """As in the dataset's ``get_annotations``: an object is boxed, or else flagged as the scene or as having no box."""
    flagged = ANNOTATION.replace("<ymax>100</ymax></bndbox>",
                                 "<ymax>100</ymax></bndbox><scene>1</scene><nobndbox>1</nobndbox>")
    annotation = parse_annotation(flagged)
    assert annotation.boxes["32"] == [(201, 1, 400, 100)] and annotation.scene == {"34"} and annotation.nobox == {"35"}


def test_an_unrelated_caption_is_dropped_from_its_own_photo_only(tmp_path):
    """``UNRELATED_CAPTIONS`` names a photo and a sentence number: another photo's caption of the same number stays."""
    _entities_folder(tmp_path)
    (tmp_path / "Sentences" / "1001.txt").write_text(SENTENCES)
    (tmp_path / "Annotations" / "1001.xml").write_text(ANNOTATION)
    (tmp_path / "UNRELATED_CAPTIONS").write_text("# format: <imageID> <sentence number>\n1000 1\n")
    dataset = EntitiesDataset(tmp_path)
    assert len(dataset.load("images/1000_abcdef.jpg").sentences) == 1
    assert len(dataset.load("images/1001_abcdef.jpg").sentences) == 2


def test_unrelated_captions_lines_other_than_an_id_and_a_number_are_skipped(tmp_path):
    """An edited ``UNRELATED_CAPTIONS`` (a blank line, a word alone, a two-word note) still loads: only lines of an
    id and a sentence number name a caption, so the others must neither stop the folder from opening (an
    ``IndexError`` or ``ValueError`` from a line that is not a pair) nor drop a caption."""
    _entities_folder(tmp_path)
    (tmp_path / "UNRELATED_CAPTIONS").write_text("# format: <imageID> <sentence number>\n\n1000 1\n\nnote\n# done\n")
    dataset = EntitiesDataset(tmp_path)
    assert dataset.unrelated == {("1000", 0)}
    assert len(dataset.load("images/1000_abcdef.jpg").sentences) == 1


def test_a_flickr30k_photo_named_by_its_id_alone_is_found():
    """Flickr30k names its photos ``<id>.jpg`` (Flickr8k ``<id>_<secret>.jpg``): both give the id, without suffix."""
    assert EntitiesDataset.flickr_id("flickr30k-images/1000.jpg") == "1000"
    assert EntitiesDataset.flickr_id("Flicker8k_Dataset/1000_abcdef.jpg") == "1000"


def test_an_objects_one_flag_is_read_without_the_other():
    """An object without a box may carry ``<scene>`` or ``<nobndbox>`` alone: the missing one is not set."""
    flags = "<name>34</name><scene>1</scene><nobndbox>0</nobndbox>"
    annotation = parse_annotation(ANNOTATION.replace(flags, "<name>34</name><scene>1</scene>")
                                  .replace("<scene>0</scene><nobndbox>1</nobndbox>", "<nobndbox>1</nobndbox>"))
    assert annotation.scene == {"34"} and annotation.nobox == {"35"}


def test_a_flag_of_an_object_naming_two_chains_is_every_chains():
    """As a box belongs to every chain its object names (the README's "one or more name tags"), so does a ``<scene>``
    or ``<nobndbox>`` flag: the second chain of a flagged object is the whole scene, or has no box, too."""
    flagged = ANNOTATION.replace("<name>34</name>", "<name>34</name><name>36</name>")
    annotation = parse_annotation(flagged.replace("<name>35</name>", "<name>35</name><name>37</name>"))
    assert annotation.scene == {"34", "36"} and annotation.nobox == {"35", "37"}


def test_a_chain_name_is_read_without_the_whitespace_around_it():
    """An indented file (``<name>\\n  32\\n</name>``) names chain ``32``, the id its sentences give."""
    annotation = parse_annotation(ANNOTATION.replace("<name>32</name>", "<name>\n  32\n</name>"))
    assert annotation.boxes["32"] == [(201, 1, 400, 100)]


def test_a_one_pixel_photo_is_a_size_not_a_format_error():
    """Only a width or height of 0 or less is refused (``boxes_on`` divides by it): 1×1 is the smallest photo."""
    size = "<width>400</width><height>200</height>"
    one = ANNOTATION.replace(size, "<width>1</width><height>1</height>").split("  <object>")[0] + "</annotation>"
    assert parse_annotation(one).size == (1, 1)


# ---------------------------------------------------------------------------------------------------------------
# Which words name which boxes
# ---------------------------------------------------------------------------------------------------------------
def _entity() -> EntityImage:
    return EntityImage("1000", parse_sentences(SENTENCES), parse_annotation(ANNOTATION))


def test_reference_targets_only_phrases_with_boxes():
    captions, targets = reference_targets(_entity())
    assert captions[0][:3] == ["a", "little", "boy"]
    # chain 34 is a scene without box and chain 0 is not visual: neither is a target
    assert [(t.caption, t.positions, t.types, t.chains) for t in targets] == [
        (0, [0, 1, 2], ("people",), ("31",)), (0, [4, 5, 6], ("clothing",), ("32",)),
        (0, [8, 9], ("other",), ("33",)), (1, [0, 1, 2], ("people", "other"), ("31",))]
    # a boxed phrase of punctuation alone has no word to score: no target (its best word would be a max of nothing)
    punctuation = EntityImage("1000", parse_sentences("[/EN#31/people A boy] climbs [/EN#33/other ...] .\n"),
                              parse_annotation(ANNOTATION))
    assert [t.positions for t in reference_targets(punctuation)[1]] == [[0, 1]]


def test_a_generated_irregular_plural_grounds_on_the_references_singular_phrase():
    """One caption says "children" where a reference says "a child": a generated irregular plural must find the
    boxes of a reference phrase headed by its singular, or some of Flickr's commonest phrases go unscored."""
    plurals = ("men", "women", "children", "people", "feet", "teeth", "geese", "mice")
    assert [head_form(w) for w in plurals] == ["man", "woman", "child", "person", "foot", "tooth", "goose", "mouse"]
    sentences = parse_sentences("[/EN#31/people A little child] climbs [/EN#33/other the ladder] .\n")
    entity = EntityImage("1000", sentences, parse_annotation(ANNOTATION))
    targets = generated_targets("two children climb a ladder".split(), entity)
    assert [(t.positions, t.chains) for t in targets] == [([1], ("31",)), ([4], ("33",))]


def test_generated_phrases_match_heads_and_extend_over_reference_words():
    tokens = "two boys in a green coat near a red ladder and a dog".split()
    targets = generated_targets(tokens, _entity())
    # "boys" → head "boy" ("a little boy": chain 31; "the boy s" is headed by "s"); "a green coat" extends over
    # words of the reference phrase; "red" is in no reference phrase of "ladder", so the phrase starts after it; no dog
    assert [(t.positions, t.types, t.chains) for t in targets] == [
        ([1], ("people",), ("31",)), ([3, 4, 5], ("clothing",), ("32",)), ([9], ("other",), ("33",))]
    assert [head_form(w) for w in ("men", "people", "boys", "glass", "bus")] == ["man", "person", "boy", "glass", "bus"]
    # "smile" (not visual) and "outdoors" (a scene) head reference phrases without boxes: nothing to score
    assert [t.positions for t in generated_targets("a boy with a smile outdoors".split(), _entity())] == [[0, 1]]
    # a doubled head (a decoding slip) is a phrase of its own: a phrase never extends over the one before it
    assert [t.positions for t in generated_targets("a green coat coat".split(), _entity())] == [[0, 1, 2], [3]]


def test_generated_phrases_extend_over_plural_words_and_up_to_the_phrase_before():
    """A phrase's words are matched in their head form, as its head is ("the kids toy" → "kid"); a phrase extends
    left up to the one before it, not one word short of it; and a one-letter head ("the boy 's" → "s") names
    nothing."""
    entity = EntityImage("1000", parse_sentences("[/EN#31/people A little boy] holds [/EN#33/other the kids toy] "
                                                 "and [/EN#32/clothing a green coat] .\n"
                                                 "[/EN#31/people/other The boy 's] [/EN#0/notvisual smile] .\n"),
                         parse_annotation(ANNOTATION))
    assert [t.positions for t in generated_targets("a boy holds kids toy".split(), entity)] == [[0, 1], [3, 4]]
    assert [t.positions for t in generated_targets("a boy a green coat".split(), entity)] == [[0, 1], [2, 3, 4]]
    assert [t.positions for t in generated_targets("a boy s smile".split(), entity)] == [[0, 1]]


def test_a_generated_phrase_extends_over_its_reference_phrases_words_only_not_the_rest_of_their_caption():
    """In "a little boy in a green coat climbs the ladder", "green" follows the phrase "a little boy" but is none of
    its words, so "a green boy" (a decoding slip) is scored on "boy" alone; a phrase reaching over the caption's
    later words too would pick its best word among ones that describe something else."""
    assert [(t.positions, t.chains) for t in generated_targets("a green boy".split(), _entity())] == [([2], ("31",))]


def test_a_phrases_types_are_its_visual_ones_in_entities_order_and_a_shared_head_carries_every_phrases():
    """A reference phrase's types are read through the eight coarse types, in their order (a file may list them
    otherwise); a generated head that several boxed phrases share names all their chains and carries all their types
    (generated_targets' docstring), not only the first phrase's."""
    entity = EntityImage("1000", parse_sentences("[/EN#31/people A boy] climbs [/EN#33/other/clothing a ladder]"
                                                 " .\n[/EN#33/other The boy] waves .\n"), parse_annotation(ANNOTATION))
    assert [(t.caption, t.types) for t in reference_targets(entity)[1]] == [
        (0, ("people",)), (0, ("clothing", "other")), (1, ("other",))]
    assert [(t.positions, t.types, t.chains) for t in generated_targets("a boy on a ladder".split(), entity)] == [
        ([0, 1], ("people", "other"), ("31", "33")), ([3, 4], ("clothing", "other"), ("33",))]


def test_each_of_the_eight_coarse_types_is_kept_in_the_papers_order_and_notvisual_is_not():
    """The type table has a row per coarse type (arXiv:1505.04870, §3): a phrase listing all eight, in reverse and
    with ``notvisual``, carries each of them under its dataset spelling ("bodyparts") and in the paper's order."""
    entity = EntityImage("1000", parse_sentences("[/EN#31/other/scene/instruments/vehicles/animals/bodyparts/clothing"
                                                 "/people/notvisual A boy] climbs .\n"), parse_annotation(ANNOTATION))
    assert [t.types for t in reference_targets(entity)[1]] == [
        ("people", "clothing", "bodyparts", "animals", "vehicles", "instruments", "scene", "other")]


# ---------------------------------------------------------------------------------------------------------------
# Measures
# ---------------------------------------------------------------------------------------------------------------
def test_best_word_of_a_phrase_and_its_pointing_and_ratio():
    geometry = two_by_two()
    mask = np.zeros((8, 8), bool)
    mask[:4, :4] = True  # the top-left cell
    rows = np.array([[0.25, 0.25, 0.25, 0.25],  # "a": uniform, 1/4 inside
                     [0.5, 0.5, 0.0, 0.0],  # "little": half inside, its plateau half inside
                     [0.8, 0.0, 0.0, 0.2]])  # "boy": the best word
    assert best_word(rows, geometry, mask) == pytest.approx({"mass": 0.8, "pointing": 1.0, "ratio": 3.2})
    assert best_word(rows[:2], geometry, mask) == pytest.approx({"mass": 0.5, "pointing": 0.5, "ratio": 2.0})
    # a tie on the mass: the first word's pointing hit, whichever order the rows come in
    assert best_word(np.array([rows[1], [0.5, 0.25, 0.25, 0.0]]), geometry, mask)["pointing"] == pytest.approx(0.5)
    assert best_word(np.array([[0.5, 0.25, 0.25, 0.0], rows[1]]), geometry, mask)["pointing"] == pytest.approx(1.0)


def test_uniform_map_scores_the_boxes_share_on_a_squashed_photo():
    annotation = parse_annotation(ANNOTATION)
    geometry = two_by_two((56, 56))  # a squashed 56×56 copy of the 400×200 photo
    mask = box_mask(annotation.boxes_on("31", (56, 56)), (56, 56))
    share = (28 * 28 + 14 * 14) / 56 ** 2
    assert score_map(pixel_distribution(np.ones(4), geometry), mask) == pytest.approx(
        {"mass": share, "pointing": share, "ratio": 1.0})


def _photo(rows_per_caption, targets, other=None, size=(8, 8)) -> PhotoAttention:
    geometry = two_by_two(size)
    return PhotoAttention([np.asarray(r, float) for r in rows_per_caption], geometry, targets,
                          None if other is None else [np.asarray(r, float) for r in other], geometry)


def test_score_photos_controls_and_summary():
    top_left = EntityAnnotation((8, 8), {"1": [(1, 1, 4, 4)]})
    bottom_right = EntityAnnotation((8, 8), {"1": [(5, 5, 8, 8)]})
    # photo 0: a two-word phrase, its first word on the box; the same words over another photo look bottom right
    # (a miss) and top right (a miss); photo 1: one word on its box, and over another photo on it too (a hit)
    photos = [_photo([[[1, 0, 0, 0], [0, 0, 0, 1]]], [PhraseTarget(0, [0, 1], ("people",), ("1",))],
                     other=[[[0, 0, 0, 1], [0, 1, 0, 0]]]),
              _photo([[[0, 0, 0, 1]]], [PhraseTarget(0, [0], ("people",), ("1",))], other=[[[0, 0, 0, 1]]]),
              _photo([[[0, 0, 0, 1]]], [PhraseTarget(0, [0], ("people",), ("1",))])]  # no other photo
    scores = score_photos(photos, [top_left, bottom_right, bottom_right])
    by = {(s.control, s.image): s.scores for s in scores}
    assert by[("model", 0)] == pytest.approx({"mass": 1.0, "pointing": 1.0, "ratio": 4.0})
    assert by[("model", 1)] == pytest.approx({"mass": 1.0, "pointing": 1.0, "ratio": 4.0})
    assert by[("uniform", 0)] == pytest.approx({"mass": 0.25, "pointing": 0.25, "ratio": 1.0})
    assert by[("other photo", 0)] == pytest.approx({"mass": 0.0, "pointing": 0.0, "ratio": 0.0})
    assert by[("other photo", 1)] == pytest.approx({"mass": 1.0, "pointing": 1.0, "ratio": 4.0})
    assert ("other photo", 2) not in by and ("model", 2) in by
    scores = [s for s in scores if s.image < 2]
    rows = summarise(scores, 2, 200, ("people", "other"), ("model", "uniform", "other photo"), "phrase_type", "phrases")
    uniform = next(r for r in rows if r["control"] == "uniform" and r["phrase_type"] == "all")
    assert uniform["phrases"] == 2 and uniform["mass"]["mean"] == pytest.approx(0.25)
    assert uniform["ratio"] == {"mean": 1.0, "ci95": [1.0, 1.0]}
    # the other photo misses on photo 0 and hits on photo 1: resampling photos spans both
    other = next(r for r in rows if r["control"] == "other photo" and r["phrase_type"] == "all")
    assert other["mass"] == {"mean": 0.5, "ci95": [0.0, 1.0]}
    section = {"normaliser": "softmax", "references": {"rows": rows}, "generated": {"rows": []}}
    assert "| toy | softmax | references | chance: uniform | 2 | 2 | 0.250 [0.250, 0.250]" in summary_table(
        [("toy", section)])
    assert "| toy | people | 2 | 1.000 [1.000, 1.000] | 0.250 [0.250, 0.250] | 0.500" in type_table([("toy", section)])


def test_the_summary_table_shows_each_controls_row_over_all_phrases_only():
    """The per-type rows are type_table's: the summary holds one row per mode and control, that over all phrases."""
    def stat(mean):
        return {"mean": mean, "ci95": [mean - 0.25, mean + 0.25]}

    rows = [{"control": "model", "phrase_type": phrase_type, "phrases": phrases, "images": images, "mass": stat(mass),
             "pointing": stat(0.625), "ratio": stat(1.5)}
            for phrase_type, phrases, images, mass in (("people", 1, 1, 0.75), ("all", 3, 2, 0.5))]
    section = {"normaliser": "softmax", "references": {"rows": rows}, "generated": {"rows": []}}
    assert summary_table([("toy", section)]).splitlines()[2:] == [
        "| toy | softmax | references | attention | 3 | 2 | 0.500 [0.250, 0.750] | 0.625 [0.375, 0.875] | "
        "1.500 [1.250, 1.750] |"]


def test_the_type_table_ends_each_model_with_its_row_over_all_phrases():
    """type_table's rows are the phrase types in Entities' order, then "all" (every phrase once); a chance map
    missing for a type shows as a dash."""
    def stat(mean):
        return {"mean": mean, "ci95": [mean, mean]}

    rows = [{"control": control, "phrase_type": phrase_type, "phrases": phrases, "images": 1, "mass": stat(mass),
             "pointing": stat(0.5), "ratio": stat(2.0)}
            for control, phrase_type, phrases, mass in (("model", "all", 3, 0.75), ("uniform", "all", 3, 0.25),
                                                         ("model", "people", 1, 1.0), ("model", "clothing", 2, 0.5))]
    section = {"normaliser": "softmax", "references": {"rows": rows}, "generated": {"rows": []}}
    assert type_table([("toy", section)]).splitlines()[2:] == [
        "| toy | people | 1 | 1.000 [1.000, 1.000] | — | — | 0.500 [0.500, 0.500] | 2.000 [2.000, 2.000] |",
        "| toy | clothing | 2 | 0.500 [0.500, 0.500] | — | — | 0.500 [0.500, 0.500] | 2.000 [2.000, 2.000] |",
        "| toy | all | 3 | 0.750 [0.750, 0.750] | 0.250 [0.250, 0.250] | — | 0.500 [0.500, 0.500] | "
        "2.000 [2.000, 2.000] |"]


def test_both_grounding_tables_have_a_delimiter_cell_under_each_header():
    """Both tables are written into the grounding page (docs/grounding.md): GitHub draws a table only when its second
    line is a delimiter row of one ``---`` cell per header, so a malformed one leaves the numbers as a run of text."""
    for table in (summary_table([]), type_table([])):
        header, delimiter = table.splitlines()
        assert delimiter == "|" + "---|" * (header.count("|") - 1)


def test_a_phrase_is_scored_on_each_of_its_words_and_on_none_outside_it():
    """The head noun ends a phrase and is often its best word: the phrase's last row counts, the next one does not."""
    top_left = EntityAnnotation((8, 8), {"1": [(1, 1, 4, 4)]})
    rows = [[0, 0, 0, 1], [1, 0, 0, 0], [0, 0, 0, 1]]  # "a" looks away, "boy" at the box, the word after away
    photo = _photo([rows], [PhraseTarget(0, [0, 1], ("people",), ("1",))])
    model = next(s for s in score_photos([photo], [top_left]) if s.control == "model")
    assert model.scores == pytest.approx({"mass": 1.0, "pointing": 1.0, "ratio": 4.0})


def test_another_photos_grid_attention_is_read_through_this_photos_cells():
    """A grid model sees every photo through the same cells: the other photo's row is placed by this photo's centre
    crop, not by the donor's (a tall donor's crop lies elsewhere on a wide photo)."""
    annotation = EntityAnnotation((16, 8), {"1": [(5, 1, 8, 4)]})  # the crop's top-left cell of the wide photo
    row = [np.array([[1.0, 0.0, 0.0, 0.0]])]
    photo = PhotoAttention(row, two_by_two((16, 8), "center_crop"), [PhraseTarget(0, [0], ("people",), ("1",))], row,
                          two_by_two((8, 16), "center_crop"))
    other = next(s for s in score_photos([photo], [annotation]) if s.control == "other photo")
    assert other.scores == pytest.approx({"mass": 1.0, "pointing": 1.0, "ratio": 8.0})


def test_a_phrase_naming_two_chains_is_scored_on_the_union_of_their_boxes():
    """A generated head that several reference chains share ("two men") names the boxes of all of them: a word
    looking at the second chain's box is inside."""
    annotation = EntityAnnotation((8, 8), {"1": [(1, 1, 4, 4)], "2": [(5, 5, 8, 8)]})
    photo = _photo([[[0, 0, 0, 1]]], [PhraseTarget(0, [0], ("people",), ("1", "2"))])
    by = {s.control: s.scores for s in score_photos([photo], [annotation])}
    assert by["model"] == pytest.approx({"mass": 1.0, "pointing": 1.0, "ratio": 2.0})
    assert by["uniform"]["mass"] == pytest.approx(0.5)


def test_another_photos_region_attention_is_placed_by_that_photos_own_boxes():
    """Region boxes belong to their photo: the other-photo row is read through the donor's boxes, scaled onto this
    photo (here a donor drawn at twice the size, its item 0 in the other corner), not this photo's box of the same
    index."""
    quadrants = np.array([[0, 0, 4, 4], [4, 4, 8, 8]], np.float32)
    own = Geometry(kind="regions", image_size=(8, 8), grid_hw=None, boxes=quadrants)
    donor = Geometry(kind="regions", image_size=(16, 16), grid_hw=None, boxes=quadrants[::-1] * 2)
    row = [np.array([[1.0, 0.0]])]  # item 0: this photo's top-left box, the donor's bottom-right one
    photo = PhotoAttention(row, own, [PhraseTarget(0, [0], ("people",), ("1",))], row, donor)
    by = {s.control: s.scores["mass"] for s in score_photos([photo], [EntityAnnotation((8, 8), {"1": [(1, 1, 4, 4)]})])}
    assert (by["model"], by["other photo"]) == (1.0, 0.0)


def test_scoring_phrases_shows_no_progress_unless_asked(capsys):
    """score_photos is a library function too: its bar is the command's (``progress=True``), off by default."""
    photo = _photo([[[1, 0, 0, 0]]], [PhraseTarget(0, [0], ("people",), ("1",))])
    score_photos([photo], [EntityAnnotation((8, 8), {"1": [(1, 1, 4, 4)]})])
    assert capsys.readouterr().err == ""


def test_teacher_forcing_gives_the_rows_beam_search_aligns_with_its_words():
    torch.manual_seed(0)
    vocab = Vocabulary([f"w{i}" for i in range(16)])
    model = create("sat", vocab_size=len(vocab), feat_dim=8, embed_dim=16, hidden_dim=16, attn_dim=8).eval()
    vis = VisualBatch.from_features(torch.randn(2, 4, 8))
    hyps = [h[0] for h in beam_search(model, vis, k=3, max_len=6)]
    captions = [[vocab.decode(h.token_ids)] for h in hyps]
    rows = teacher_forced_rows(model, vocab, vis, [c * 2 for c in captions])  # two copies each: batched rows
    for hyp, per_image, caption in zip(hyps, rows, captions):
        words = len(caption[0])
        assert len(per_image) == 2 and per_image[0].shape == (words, 4)
        np.testing.assert_allclose(per_image[0], hyp.attention[:words].numpy(), atol=1e-5)
        np.testing.assert_allclose(per_image[1], per_image[0], atol=1e-6)


def test_a_batch_of_photos_without_reference_captions_is_fed_nothing():
    """A photo keeps no caption when UNRELATED_CAPTIONS lists all of its own: a batch of only such photos (a split's
    last, say) gets no rows, not a maximum of no caption lengths."""
    vocab = Vocabulary([f"w{i}" for i in range(4)])
    model = create("sat", vocab_size=len(vocab), feat_dim=8, embed_dim=16, hidden_dim=16, attn_dim=8).eval()
    assert teacher_forced_rows(model, vocab, VisualBatch.from_features(torch.zeros(2, 4, 8)), [[], []]) == [[], []]


def _tiny_sat_on_two_images():
    """An untrained SAT of 16 words (seed 0) and a store of two images' 2×2 grid features: (checkpoint, store,
    images, geometry)."""
    torch.manual_seed(0)
    vocab = Vocabulary([f"w{i}" for i in range(16)])
    model = create("sat", vocab_size=len(vocab), feat_dim=8, embed_dim=16, hidden_dim=16, attn_dim=8).eval()
    feats, geometry = torch.randn(2, 4, 8), two_by_two()
    store = SimpleNamespace(batch=lambda keys: VisualBatch.from_features(feats[list(keys)], [geometry] * len(keys)))
    images = [SimpleNamespace(key=i, path=None) for i in range(2)]
    return SimpleNamespace(model=model, vocab=vocab), store, images, geometry


def test_beam_search_captions_keep_each_words_own_attention_row():
    """The generated mode's rows (caption_with_attention) pair each decoded word with the row that fed its
    prediction: the row teacher forcing gives that word of the same caption."""
    ckpt, store, images, geometry = _tiny_sat_on_two_images()
    captions = caption_with_attention(ckpt, images, store, max_len=6)
    rows = teacher_forced_rows(ckpt.model, ckpt.vocab, store.batch([0, 1]), [[c.tokens] for c in captions])
    for caption, per_image in zip(captions, rows):
        assert caption.tokens and caption.geometry is geometry
        np.testing.assert_allclose(caption.attention, per_image[0], atol=1e-5)


def test_captioning_with_attention_shows_no_progress_unless_asked(capsys):
    """caption_with_attention is a library function too: its "encoding images" bar is ``captioner eval``'s
    (``progress=True``), off by default, as score_photos' is."""
    ckpt, store, images, _ = _tiny_sat_on_two_images()
    assert len(caption_with_attention(ckpt, images, store, max_len=6)) == 2
    assert capsys.readouterr().err == ""


def test_beam_search_captions_follow_the_decoding_rules_given():
    """``captioner eval --grounding`` scores the captions its grounding search gives, so that search takes the
    decoding rules asked for (--block-doubled-words here, which changes both of these captions), as the same eval
    without --grounding would."""
    ckpt, store, images, _ = _tiny_sat_on_two_images()
    rules = DecodingRules(block_doubled_words=True)
    captions = [c.tokens for c in caption_with_attention(ckpt, images, store, max_len=6, rules=rules)]
    want = beam_search(ckpt.model, store.batch([0, 1]), k=3, max_len=6, rules=rules)
    assert captions == [ckpt.vocab.decode(hyps[0].token_ids) for hyps in want]
    unruled = [c.tokens for c in caption_with_attention(ckpt, images, store, max_len=6)]
    assert all(caption != other for caption, other in zip(captions, unruled))


# ---------------------------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------------------------
CIRCLES = [("111", (0, 0, 32, 24), "test"), ("222", (32, 24, 64, 48), "test"), ("333", (0, 24, 32, 48), "test")]


def _photos_and_entities(tmp_path, count=2):
    """``count`` (two or three) 64×48 copies of 128×96 photos, each a red circle in one quadrant, with their
    Entities files."""
    return circle_photos(tmp_path, CIRCLES[:count], [["a", "red", "circle"]])


def test_cli_eval_grounding_entities_both_modes(tmp_path):
    dataset, entities = _photos_and_entities(tmp_path)
    checkpoint = tmp_path / "sat"
    shutil.copytree(DEFAULT_CHECKPOINT, checkpoint)
    if not (checkpoint / "manifest.json").exists():
        write_manifest(checkpoint)
    done = captioner("eval", str(checkpoint), "--dataset", str(dataset), "--grounding", f"entities:{entities}",
                     "--no-meteor", "--grounding-resamples", "100", "--cache-dir", str(tmp_path / "cache"),
                     "--threads", "1", "--output", str(tmp_path / "report.json"))
    section = json.loads((tmp_path / "report.json").read_text())["test"]["grounding"]
    assert section["photos"] == 2 and section["normaliser"] == "softmax"
    rows = {(r["control"], r["phrase_type"]): r for r in section["references"]["rows"]}
    # four boxed phrases (two per photo; the scene chain has no box); the box is a quarter of each photo
    assert rows[("model", "all")]["phrases"] == 4 and rows[("model", "other")]["images"] == 2
    assert rows[("uniform", "all")]["mass"]["mean"] == pytest.approx(0.25, abs=0.01)
    assert ("model", "scene") not in rows and rows[("other photo", "all")]["phrases"] == 4
    # the other-photo chance row reads the same captions over the other photo, not over the photo itself
    assert rows[("other photo", "all")]["mass"] != rows[("model", "all")]["mass"]
    assert "| sat | softmax | references | attention | 4 | 2 |" in done.stderr
    # the scene model names the red circle: its phrase is matched by head noun against the references'
    generated = {(r["control"], r["phrase_type"]): r for r in section["generated"]["rows"]}
    assert 1 <= generated[("model", "all")]["phrases"] <= 2 and set(generated) <= {
        (c, t) for c in ("model", "uniform", "other photo") for t in ("other", "all")}


def _tiny_sat_over_circle_photos(tmp_path, count=2):
    """A tiny SAT over random features of ``count`` circle photos, with their Entities folder: ``(ckpt, images,
    store, entities, geometry)`` for :func:`entities_grounding`."""
    _, entities = _photos_and_entities(tmp_path, count)
    torch.manual_seed(0)
    vocab = Vocabulary("a red circle on plain background . one".split())
    model = create("sat", vocab_size=len(vocab), feat_dim=8, embed_dim=16, hidden_dim=16, attn_dim=8).eval()
    feats, geometry = torch.randn(count, 4, 8), two_by_two((64, 48))
    store = SimpleNamespace(batch=lambda keys: VisualBatch.from_features(feats[list(keys)], [geometry] * len(keys)))
    images = [SimpleNamespace(key=key, path=tmp_path / "images" / f"{flickr_id}_x.jpg")
              for key, (flickr_id, _, _) in enumerate(CIRCLES[:count])]
    return SimpleNamespace(model=model, vocab=vocab), images, store, entities, geometry


def test_the_generated_modes_other_photo_row_feeds_the_generated_caption(tmp_path, monkeypatch):
    """The generated mode's other-photo control is the photo's own generated caption fed over the next photo; a
    generated caption that shares a reference's first words would hide a reference read in its place."""
    ckpt, images, store, entities, geometry = _tiny_sat_over_circle_photos(tmp_path)
    model, vocab = ckpt.model, ckpt.vocab
    generated = [CaptionAttention(["one", "red", "circle"], np.full((3, 4), 0.25), geometry) for _ in images]
    attended = []
    scored = phrase_grounding.score_photos
    monkeypatch.setattr(phrase_grounding, "score_photos",
                        lambda photos, *args, **kwargs: attended.append(photos) or scored(photos, *args, **kwargs))
    entities_grounding(ckpt, images, store, entities, generated, resamples=10, progress=False)
    own = attended[1]
    expected = teacher_forced_rows(model, vocab, store.batch([1, 0]), [[caption.tokens] for caption in generated])
    for photo, donor in zip(own, expected):
        assert len(photo.other_rows) == 1
        np.testing.assert_allclose(photo.other_rows[0], donor[0], atol=1e-6)


def test_a_generated_caption_naming_nothing_boxed_leaves_its_photo_in_the_resampled_photos(tmp_path):
    """A caption often names nothing Entities boxed: its photo has no phrase to score, yet the phrases of the photos
    after it keep their places (the bootstrap is over every annotated photo, those without phrases included)."""
    ckpt, images, store, entities, geometry = _tiny_sat_over_circle_photos(tmp_path)
    generated = [CaptionAttention(tokens, np.full((len(tokens), 4), 0.25), geometry)
                 for tokens in (["plain", "background"], ["one", "red", "circle"])]
    section = entities_grounding(ckpt, images, store, entities, generated, resamples=10, progress=False)
    model = next(r for r in section["generated"]["rows"] if (r["control"], r["phrase_type"]) == ("model", "all"))
    assert (model["phrases"], model["images"], section["generated"]["captions"]) == (1, 1, 1)


def test_the_other_photo_is_the_next_one_and_photos_without_annotation_are_counted(tmp_path, monkeypatch):
    """Two photos cannot tell the next photo from the previous one: of three, photo i's reference captions are
    fed over photo i + 1 (the last over the first).  A fourth photo without an Entities annotation is left out and
    counted."""
    ckpt, images, store, entities, geometry = _tiny_sat_over_circle_photos(tmp_path, 3)
    images.append(SimpleNamespace(key=3, path=tmp_path / "images" / "999_x.jpg"))  # no Entities files
    generated = [CaptionAttention(["one", "red", "circle"], np.full((3, 4), 0.25), geometry) for _ in images]
    attended = []
    scored = phrase_grounding.score_photos
    monkeypatch.setattr(phrase_grounding, "score_photos",
                        lambda photos, *args, **kwargs: attended.append(photos) or scored(photos, *args, **kwargs))
    section = entities_grounding(ckpt, images, store, entities, generated, resamples=10, progress=False)
    assert (section["photos"], section["photos_without_annotation"]) == (3, 1)
    references = attended[0]  # every photo has the same reference captions: its donor's own rows are its other rows
    for index, photo in enumerate(references):
        donor = references[(index + 1) % 3]
        assert len(photo.other_rows) == len(donor.rows) == 2
        for other, rows in zip(photo.other_rows, donor.rows):
            np.testing.assert_allclose(other, rows, atol=1e-6)


def test_a_split_of_one_annotated_photo_has_no_other_photo_row(tmp_path):
    """With one annotated photo there is no other photo to feed its captions over: the report has no other-photo
    chance row rather than one read over the photo itself, which would show chance equal to the attention."""
    ckpt, images, store, entities, geometry = _tiny_sat_over_circle_photos(tmp_path, 1)
    generated = [CaptionAttention(["one", "red", "circle"], np.full((3, 4), 0.25), geometry)]
    section = entities_grounding(ckpt, images, store, entities, generated, resamples=10, progress=False)
    for mode in ("references", "generated"):
        controls = {row["control"] for row in section[mode]["rows"]}
        assert controls == {"model", "uniform"}, mode


def test_photos_past_the_first_batch_keep_their_own_caption_entities_and_donor(tmp_path, monkeypatch):
    """Photos are fed ``batch_size`` at a time, and the generated captions come for every photo of the split, those
    without an annotation too: a photo of a later batch is matched against its own Entities phrases, its
    other-photo row is read over the next photo of the whole list (the last over the first), and a photo without an
    annotation before the others shifts no one's caption onto its neighbour."""
    ckpt, images, store, entities, geometry = _tiny_sat_over_circle_photos(tmp_path, 3)
    (entities / "Sentences" / "333.txt").write_text("[/EN#1/other a red ball] .\n")  # the last photo's own words
    images.insert(0, SimpleNamespace(key=3, path=tmp_path / "images" / "999_x.jpg"))  # no Entities files
    tokens = (["plain", "background"], ["one", "red", "circle"], ["one", "red", "circle"], ["a", "red", "ball"])
    generated = [CaptionAttention(list(words), np.full((len(words), 4), 0.25), geometry) for words in tokens]
    attended = []
    scored = phrase_grounding.score_photos
    monkeypatch.setattr(phrase_grounding, "score_photos",
                        lambda photos, *args, **kwargs: attended.append(photos) or scored(photos, *args, **kwargs))
    section = entities_grounding(ckpt, images, store, entities, generated, batch_size=2, resamples=10,
                                 progress=False)
    model = next(r for r in section["generated"]["rows"] if (r["control"], r["phrase_type"]) == ("model", "all"))
    assert (model["phrases"], model["images"]) == (3, 3)  # each photo's caption names its own boxed object
    expected = teacher_forced_rows(ckpt.model, ckpt.vocab, store.batch([1, 2, 0]), [[list(t)] for t in tokens[1:]])
    for photo, donor in zip(attended[1], expected):
        np.testing.assert_allclose(photo.other_rows[0], donor[0], atol=1e-6)


def test_a_split_without_any_annotated_photo_is_refused_naming_the_folder(tmp_path):
    """An Entities folder that annotates none of the split's photos (another split's download, say) is a mistake to
    name, not a report of zero phrases."""
    ckpt, _, store, entities, geometry = _tiny_sat_over_circle_photos(tmp_path)
    photos = [SimpleNamespace(key=0, path=tmp_path / "images" / "999_x.jpg")]
    generated = [CaptionAttention(["one", "red", "circle"], np.full((3, 4), 0.25), geometry)]
    with pytest.raises(ValueError, match=f"^none of the 1 photos has a Flickr30k Entities annotation in "
                                         f"{re.escape(str(entities))}$"):
        entities_grounding(ckpt, photos, store, entities, generated, resamples=10, progress=False)


@pytest.mark.parametrize("value, extra, message", [
    ("boxes:DIR", (), "takes no value"), ("entities:/nonexistent", (), "not a Flickr30k Entities folder"),
    ("entities:{entities}", ("--dataset", "/nonexistent.json"), "does not exist")])
def test_cli_bad_grounding_is_one_line(tmp_path, value, extra, message):
    _, entities = _photos_and_entities(tmp_path)
    done = captioner("eval", str(DEFAULT_CHECKPOINT), "--grounding", value.format(entities=entities), *extra,
                     check=False)
    assert done.returncode != 0 and message in done.stderr and "Traceback" not in done.stderr


# ---------------------------------------------------------------------------------------------------------------
# docs/grounding.md
# ---------------------------------------------------------------------------------------------------------------
def test_ordering_sentence_reads_the_intervals():
    def stat(mean, half=0.01):
        return {"mean": mean, "ci95": [mean - half, mean + half]}

    held = ordering_sentence({"softmax": stat(0.3), "sparsemax": stat(0.4), "tvmax": stat(0.5)})
    assert held.startswith("softmax 0.300 [0.290, 0.310] < sparsemax") and held.endswith("TVmax, holds")
    tied = ordering_sentence({"softmax": stat(0.3), "sparsemax": stat(0.305), "tvmax": stat(0.5)})
    assert "softmax 0.300 [0.290, 0.310] ≈ sparsemax" in tied and tied.endswith("does not hold (as a strict, "
                                                                                 "interval-separated ordering)")
    # intervals that share an end overlap: not an interval-separated step
    touching = ordering_sentence({"softmax": {"mean": 0.3, "ci95": [0.25, 0.35]},
                                  "sparsemax": {"mean": 0.4, "ci95": [0.35, 0.45]}, "tvmax": stat(0.5)})
    assert "softmax 0.300 [0.250, 0.350] ≈ sparsemax" in touching and "does not hold" in touching
    reversed_ = ordering_sentence({"softmax": stat(0.5), "sparsemax": stat(0.4), "tvmax": stat(0.3)})
    assert reversed_.startswith("tvmax") and "does not hold" in reversed_
    assert ordering_sentence({"softmax": stat(0.5)}) == ("fewer than two of softmax, sparsemax and TVmax were "
                                                         "measured: no ordering to read")
    # a normaliser added to the table is no part of the study's ordering (the verdict compared against the whole
    # table, and turned to "does not hold" as soon as a fourth normaliser was registered: the extension audit)
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(attention.NORMALISERS, "entmax15", attention.NORMALISERS["sparsemax"])
        assert ordering_sentence({"softmax": stat(0.3), "sparsemax": stat(0.4), "tvmax": stat(0.5)}) == held


def test_grounding_doc_from_reports_of_real_photo_checkpoints(tmp_path):
    weights = tmp_path / "weights"
    real = weights / "f8k-sat"
    shutil.copytree(DEFAULT_CHECKPOINT, real)
    shutil.copytree(DEFAULT_CHECKPOINT, weights / "scenes-sat")  # trained on the scenes: not listed
    config = json.loads((real / "config.json").read_text())
    config["meta"]["train_config"]["dataset"] = "../data/flickr8k/dataset_flickr8k.json"
    (real / "config.json").write_text(json.dumps(config))
    write_manifest(real)
    assert real_photo_checkpoints(weights) == [real]
    stat = {"mean": 0.5, "ci95": [0.4, 0.6]}
    rows = [{"control": c, "phrase_type": t, "phrases": 3, "images": 2, "mass": stat, "pointing": stat, "ratio": stat}
            for c in ("model", "uniform", "other photo") for t in ("people", "all")]
    section = {"normaliser": "softmax", "photos": 2, "references": {"rows": rows}, "generated": {"rows": rows}}
    results = tmp_path / "results"
    results.mkdir()
    (results / "f8k-sat.json").write_text(json.dumps({"test": {"images": 2, "grounding": section}}))
    document = tmp_path / "docs" / "grounding.md"
    document.parent.mkdir()
    document.write_text("# Grounding\n\nprose stays\n")
    figures = tmp_path / "docs" / "figures"
    block = write_grounding_doc(weights, results, document, figures / "g.png", figures / "h.png", tmp_path,
                                photos=("chelsea",))
    assert "| f8k-sat | softmax | generated | chance: other photo | 3 | 2 | 0.500 [0.400, 0.600]" in block
    assert "| f8k-sat | people | 3 | 0.500 [0.400, 0.600]" in block and "![" in block
    assert "Flickr8k `test` split (2 photos with Flickr30k Entities annotations;" in block
    assert (figures / "g.png").stat().st_size > 1000 and Image.open(figures / "h.png").height > 200
    assert "\n### Heatmaps on scikit-image photos\n" in block and "one row per checkpoint (softmax: `f8k-sat`)" in block
    assert "![softmax, sparsemax and TVmax heatmaps](figures/h.png)" in block
    for mode in ("references", "generated"):  # one softmax model, no scene reports
        assert f"\n- real photos, {mode}: attention correctness fewer than two of softmax, sparsemax and TVmax" in block
    # one block per photo, stacked, in a folder made for it
    two = examples_figure([real], tmp_path / "new" / "deeper" / "two.png", photos=("chelsea", "chelsea"))
    assert Image.open(two).size == (Image.open(figures / "h.png").width, 2 * Image.open(figures / "h.png").height)
    write_grounding_doc(weights, results, document, figures / "g.png", figures / "h.png", tmp_path, photos=())
    text = document.read_text()
    assert text.startswith("# Grounding\n\nprose stays\n") and text.count("grounding:start") == 1
    assert "](figures/g.png)" in text


@pytest.mark.parametrize("dataset,real", [("../data/flickr8k/dataset_flickr8k.json", True),
                                          ("/data/f8k/Flickr8k_text/Flickr8k.token.txt", True),
                                          ("/data/flickr30k/results_20130124.token", True),
                                          ("/data/coco/annotations/captions_train2014.json", False),
                                          (".cache/scenes/dataset_scenes.json", False), ("", False)])
def test_real_photo_checkpoints_are_named_by_their_data_set_not_their_folder(tmp_path, dataset, real):
    """Flickr8k or Flickr30k in Karpathy's JSON or the publishers' token file (a path of another machine: never
    read) are the photos Flickr30k Entities annotate; COCO and the scenes are not."""
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(DEFAULT_CHECKPOINT, checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    config["meta"]["train_config"]["dataset"] = dataset
    config["meta"].pop("dataset", None)
    (checkpoint / "config.json").write_text(json.dumps(config))
    assert is_real_photo(checkpoint) is real


def _configured(folder, arch="sparsecap", attention="softmax", dataset="../data/flickr8k/dataset_flickr8k.json"):
    """A checkpoint folder as far as the grounding page reads it: its config (arch, normaliser, data set)."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"format": FORMAT, "arch": arch, "model": {"attention": attention},
                                                    "meta": {"train_config": {"dataset": dataset}}}))
    (folder / "model.safetensors").write_bytes(b"")
    return folder


def _interval(mean):
    return {"mean": mean, "ci95": [round(mean - 0.01, 3), round(mean + 0.01, 3)]}


def _entities_section(normaliser, mass, generated=None):
    """Every mode's rows in an order a reader by position would misread: the chance rows and a phrase type first; the
    generated mode's model and other-photo rows from ``generated`` where it is given, else the same as the
    references'."""
    def rows(mass):
        return [{"control": "uniform", "phrase_type": "all", "mass": _interval(0.05)},
                {"control": "model", "phrase_type": "people", "mass": _interval(0.95)},
                {"control": "other photo", "phrase_type": "all", "mass": _interval(mass - 0.2)},
                {"control": "model", "phrase_type": "all", "mass": _interval(mass)}]

    return {"normaliser": normaliser, "photos": 2, "references": {"rows": rows(mass)},
            "generated": {"rows": rows(mass if generated is None else generated)}}


def test_a_checkpoint_whose_training_config_names_no_data_set_is_named_by_its_meta(tmp_path):
    """An ensemble records its first member's training config, which may name no data set: the data set its meta
    records (the one ``GET /models`` names) says whether it was trained on Flickr photos."""
    checkpoint = _configured(tmp_path / "ckpt", dataset=None)
    config = json.loads((checkpoint / "config.json").read_text())
    config["meta"]["dataset"] = "../data/flickr8k/dataset_flickr8k.json"
    (checkpoint / "config.json").write_text(json.dumps(config))
    assert is_real_photo(checkpoint)


def test_closing_note_reads_sparsecaps_model_rows_against_other_photo_chance_and_the_scenes(tmp_path):
    weights, scenes = tmp_path / "weights", tmp_path / "scenes"
    masses = {"softmax": 0.3, "sparsemax": 0.5, "tvmax": 0.7}
    reports = [(f"sc-{norm}", _entities_section(norm, mass)) for norm, mass in masses.items()]
    for norm in masses:
        _configured(weights / f"sc-{norm}", attention=norm)
    _configured(weights / "sat", arch="sat")  # softmax too, not SparseCap: no part of the ordering
    reports.append(("sat", _entities_section("softmax", 0.9)))
    scenes.mkdir()
    for norm, mass in (("softmax", 0.6), ("tvmax", 0.4)):
        rows = [{"control": "model", "word_class": "noun", "mass": _interval(0.99)},
                {"control": "uniform", "word_class": "all", "mass": _interval(0.01)},
                {"control": "model", "word_class": "all", "mass": _interval(mass)}]
        (scenes / f"sparsecap-{norm}.json").write_text(json.dumps({"test": {"images": 2, "grounding": {"rows": rows}}}))
    lines = closing_note(reports, weights, scenes)
    held = ("softmax 0.300 [0.290, 0.310] < sparsemax 0.500 [0.490, 0.510] < tvmax 0.700 [0.690, 0.710]: the "
            "ordering of the human study of Martins et al. (arXiv:2002.05556), softmax < sparsemax < TVmax, holds.")
    chance = "  Above the other-photo chance row (which"
    assert lines[1:] == [
        f"- real photos, references: attention correctness {held}", lines[2],
        f"- real photos, generated: attention correctness {held}", lines[2],
        "- generated scenes (`docs/model_zoo.md`), mass in object: tvmax 0.400 [0.390, 0.410] < softmax 0.600 "
        "[0.590, 0.610]: the ordering of the human study of Martins et al. (arXiv:2002.05556), softmax < "
        "sparsemax < TVmax, does not hold (as a strict, interval-separated ordering)."]
    assert lines[2].startswith(chance) and lines[2].endswith(": softmax +0.200, sparsemax +0.200, tvmax +0.200.")


def test_closing_note_reads_each_mode_off_its_own_rows(tmp_path):
    """The generated captions' ordering and their gap above chance come from the generated mode's rows: with the
    same rows in both modes, as above, a note that read the references twice passed."""
    weights = tmp_path / "weights"
    masses = {"softmax": (0.3, 0.7), "sparsemax": (0.5, 0.5), "tvmax": (0.7, 0.3)}  # references, generated
    for norm in masses:
        _configured(weights / f"sc-{norm}", attention=norm)
    reports = [(f"sc-{norm}", _entities_section(norm, ref, gen)) for norm, (ref, gen) in masses.items()]
    lines = closing_note(reports, weights, tmp_path / "no scene reports")
    assert lines[1].startswith("- real photos, references: attention correctness softmax 0.300 [0.290, 0.310] < "
                               "sparsemax") and lines[1].endswith(", holds.")
    assert lines[3].startswith("- real photos, generated: attention correctness tvmax 0.300 [0.290, 0.310] < "
                               "sparsemax") and lines[3].endswith("does not hold (as a strict, interval-separated "
                                                                  "ordering).")
    # each model row against its own mode's chance row (0.2 below it in both modes)
    assert lines[2].endswith(": softmax +0.200, sparsemax +0.200, tvmax +0.200.") and lines[4] == lines[2]


def test_the_ordering_ranks_the_normalisers_by_their_means_whatever_their_intervals_widths():
    """A checkpoint scored on fewer photos has a wider interval: its low end below another's says nothing of which
    mean is higher."""
    wide, narrow = {"mean": 0.5, "ci95": [0.2, 0.8]}, {"mean": 0.45, "ci95": [0.44, 0.46]}
    assert ordering_sentence({"softmax": wide, "sparsemax": narrow}).startswith(
        "sparsemax 0.450 [0.440, 0.460] ≈ softmax 0.500 [0.200, 0.800]: ")


def test_two_normalisers_apart_in_the_studys_order_are_not_said_to_hold_its_ordering_of_three():
    """Without a TVmax checkpoint the study's softmax < sparsemax < TVmax is not measured: never said to hold."""
    two = ordering_sentence({"softmax": _interval(0.3), "sparsemax": _interval(0.5)})
    assert two.startswith("softmax 0.300 [0.290, 0.310] < sparsemax 0.500 [0.490, 0.510]: ")
    assert two.endswith("does not hold (as a strict, interval-separated ordering)")


def test_the_page_writes_each_modes_type_table_between_the_markers_and_links_a_figure_by_its_path(tmp_path,
                                                                                                 monkeypatch):
    """The generated mode's per-type table is read off its own rows; a figure saved outside the document's folder is
    linked by the path it was given (no relative one leads there); what lies between docs/grounding.md's own markers
    is replaced in place, the prose before and after them kept; a checkpoint not evaluated yet is left out."""
    monkeypatch.setattr(figures, "control_bars", lambda *args, **options: args[3])  # the figure: a test above
    weights, results, figure = tmp_path / "weights", tmp_path / "results", tmp_path / "elsewhere" / "g.png"
    _configured(weights / "sc")
    _configured(weights / "sc-unevaluated")  # trained on Flickr8k, no report yet
    section = _entities_section("softmax", 0.3, 0.6)
    for mode in ("references", "generated"):  # what the tables print besides the mass
        section[mode]["rows"] = [{**row, "phrases": 3, "images": 2, "pointing": row["mass"], "ratio": row["mass"]}
                                 for row in section[mode]["rows"]]
    results.mkdir()
    (results / "sc.json").write_text(json.dumps({"test": {"images": 2, "grounding": section}}))
    document = tmp_path / "docs" / "grounding.md"
    document.parent.mkdir()
    before, after = "# Grounding\n\nprose before\n\n", "\n\nprose after\n"
    document.write_text(f"{before}<!-- grounding:start -->\nlast run's results\n<!-- grounding:end -->{after}")
    block = write_grounding_doc(weights, results, document, figure, tmp_path / "h.png", tmp_path, photos=())
    assert document.read_text() == before + block + after
    references, generated = block.split("### Per phrase type, references")[1].split("### Per phrase type, generated")
    assert "| sc | all | 3 | 0.300 [0.290, 0.310] |" in references
    generated = generated.split("### Closing note")[0]
    assert "| sc | all | 3 | 0.600 [0.590, 0.610] |" in generated and "0.300 [0.290, 0.310]" not in generated
    assert f"![grounding on Flickr30k Entities]({figure})" in block and "sc-unevaluated" not in block


def test_the_pages_tables_list_the_checkpoints_by_name(tmp_path, monkeypatch):
    """Every table of the page lists the evaluated checkpoints in their folders' name order, whatever order the
    reports were written in."""
    monkeypatch.setattr(figures, "control_bars", lambda *args, **options: args[3])
    weights, results = tmp_path / "weights", tmp_path / "results"
    results.mkdir()
    for name, mass in (("b-sc", 0.6), ("a-sc", 0.3)):
        _configured(weights / name)
        section = _entities_section("softmax", mass)
        for mode in ("references", "generated"):
            section[mode]["rows"] = [{**row, "phrases": 3, "images": 2, "pointing": row["mass"], "ratio": row["mass"]}
                                     for row in section[mode]["rows"]]
        (results / f"{name}.json").write_text(json.dumps({"test": {"images": 2, "grounding": section}}))
    block = write_grounding_doc(weights, results, tmp_path / "grounding.md", tmp_path / "g.png", tmp_path / "h.png",
                                tmp_path, photos=())
    names = re.findall(r"^\| ([ab]-sc) \|", block, flags=re.MULTILINE)
    # the summary table: each checkpoint's two modes × three controls; each per-type table: its people and all rows
    assert names == ["a-sc"] * 6 + ["b-sc"] * 6 + (["a-sc"] * 2 + ["b-sc"] * 2) * 2


def test_the_closing_note_reads_the_studys_three_normalisers_in_its_order_whatever_the_checkpoints_names(tmp_path):
    """Checkpoints named out of the study's order are still listed softmax, sparsemax, TVmax in the gap above
    chance; a SparseCap checkpoint of a normaliser the study did not test (one added to models/attention later) is
    in neither the ordering nor the gaps."""
    weights = tmp_path / "weights"
    masses = {"a-tv": ("tvmax", 0.7), "b-soft": ("softmax", 0.3), "c-sparse": ("sparsemax", 0.5),
              "d-entmax": ("entmax15", 0.9)}
    reports = []
    for name, (norm, mass) in masses.items():
        _configured(weights / name, attention=norm)
        reports.append((name, _entities_section(norm, mass)))
    lines = closing_note(reports, weights, tmp_path / "no scene reports")
    assert lines[1].startswith("- real photos, references: attention correctness softmax 0.300 [0.290, 0.310] < "
                               "sparsemax 0.500 [0.490, 0.510] < tvmax 0.700 [0.690, 0.710]: ")
    assert lines[1].endswith(", holds.") and "entmax15" not in "".join(lines)
    assert lines[2].endswith(": softmax +0.200, sparsemax +0.200, tvmax +0.200.")


def test_normalisers_of_the_same_mean_are_said_in_the_studys_order():
    """A tie is an overlap, never the study's strict ordering; the tied normalisers keep the study's order, so the
    sentence does not read as if one ranked below the other."""
    sentence = ordering_sentence({"tvmax": _interval(0.5), "sparsemax": _interval(0.5), "softmax": _interval(0.3)})
    assert sentence.startswith("softmax 0.300 [0.290, 0.310] < sparsemax 0.500 [0.490, 0.510] ≈ tvmax 0.500 "
                               "[0.490, 0.510]: ")
    assert sentence.endswith("does not hold (as a strict, interval-separated ordering)")


def test_normalisers_tied_on_intervals_of_no_width_are_said_to_overlap():
    """A report of one annotated photo (or maps that all score the same) has an interval of no width; two
    normalisers with the same such interval are the same number, so the page must say "≈" and not claim the study's
    ordering: each interval's low end reaching the other's high end is an overlap, whichever of the two it is."""
    same = {"mean": 1.0, "ci95": [1.0, 1.0]}
    sentence = ordering_sentence({"softmax": _interval(0.3), "sparsemax": same, "tvmax": dict(same)})
    said = "softmax 0.300 [0.290, 0.310] < sparsemax 1.000 [1.000, 1.000] ≈ tvmax 1.000 [1.000, 1.000]: "
    assert sentence.startswith(said)
    assert sentence.endswith("does not hold (as a strict, interval-separated ordering)")


def test_the_closing_note_says_no_gap_above_chance_without_other_photo_rows(tmp_path):
    """A split with a single annotated photo has no other photo to feed the caption over, so no other-photo chance
    row: the note then says nothing of a gap above it (not an empty list after a colon)."""
    weights = tmp_path / "weights"
    reports = []
    for norm, mass in (("softmax", 0.3), ("sparsemax", 0.5)):
        _configured(weights / f"sc-{norm}", attention=norm)
        section = _entities_section(norm, mass)
        for mode in ("references", "generated"):
            section[mode]["rows"] = [row for row in section[mode]["rows"] if row["control"] != "other photo"]
        reports.append((f"sc-{norm}", section))
    lines = closing_note(reports, weights, tmp_path / "no scene reports")
    assert [line.split(":")[0] for line in lines[1:]] == ["- real photos, references", "- real photos, generated",
                                                          "- generated scenes (`docs/model_zoo.md`), mass in object"]


def test_a_page_without_entities_reports_says_which_checkpoints_lack_one(tmp_path):
    weights, results = tmp_path / "weights", tmp_path / "results"
    results.mkdir()
    document = tmp_path / "grounding.md"
    _configured(weights / "f8k-sat", arch="sat")
    _configured(weights / "scenes-sat", arch="sat", dataset=".cache/scenes/dataset_scenes.json")
    # a scene benchmark's grounding (no references mode), and Entities on another split: neither is this page's
    scene = {"rows": [{"control": "model", "word_class": "all", "mass": _interval(0.5)}]}
    (results / "f8k-sat.json").write_text(json.dumps({"test": {"images": 2, "grounding": scene},
                                                      "val": {"images": 2, "grounding": _entities_section("s", 0.5)}}))
    args = (results, document, tmp_path / "g.png", tmp_path / "h.png", tmp_path)
    assert "No real-photo checkpoint has an Entities report yet: f8k-sat.\n" in write_grounding_doc(weights, *args)
    assert not (tmp_path / "g.png").exists()
    shutil.rmtree(weights / "f8k-sat")
    assert f"yet: no checkpoint in {weights} was trained on Flickr photos.\n" in write_grounding_doc(weights, *args)


def test_the_heatmaps_show_sparsecaps_checkpoint_of_each_normaliser_in_the_tables_order(tmp_path):
    weights = tmp_path / "weights"
    chosen = [_configured(weights / "b-tvmax", attention="tvmax"), _configured(weights / "c-softmax")]
    _configured(weights / "a-sat", arch="sat")  # softmax, listed first by name: SparseCap's is shown
    _configured(weights / "d-scenes", attention="sparsemax", dataset=".cache/scenes/dataset_scenes.json")
    assert heatmap_checkpoints(weights) == chosen[::-1]


def test_the_results_figure_draws_both_modes_statistics_against_the_two_chance_rows(tmp_path, monkeypatch):
    drawn = []
    monkeypatch.setattr(figures, "control_bars", lambda *args, **options: drawn.append((args, options)) or args[3])
    section = _entities_section("sparsemax", 0.5)
    section["references"] = {"rows": [{**row, "pointing": row["mass"]} for row in section["references"]["rows"]]}
    section["generated"] = {"rows": section["references"]["rows"][:2]}  # no chance rows, no "all" model row
    assert results_figure([("sc", section)], tmp_path / "g.png") == tmp_path / "g.png"
    ((panels, controls, labels, out), options) = drawn[0]
    stats = {"model": _interval(0.5), "other photo": _interval(0.3), "uniform": _interval(0.05)}
    assert panels == [("attention correctness, references", [("sc\n(sparsemax)", stats)]),
                      ("pointing hit, references", [("sc\n(sparsemax)", stats)]),
                      ("attention correctness, generated", [("sc\n(sparsemax)", {"model": None, "other photo": None,
                                                                                  "uniform": _interval(0.05)})]),
                      ("pointing hit, generated", [("sc\n(sparsemax)", {"model": None, "other photo": None,
                                                                         "uniform": _interval(0.05)})])]
    assert controls == ("model", "other photo", "uniform") and options == {"columns": 2}
    assert labels == {"model": "attention", "other photo": "chance: other photo",
                      "uniform": "chance: uniform (boxes' share)"}


def test_the_heatmap_figure_stacks_a_block_per_photo_grid_maps_as_blocks(tmp_path, monkeypatch):
    """Each checkpoint's caption is one row of every photo's block; a grid's maps drawn as ``grid_blocks`` (a sparse
    map's exact zeros show), a region model's in its own way."""
    rows, kinds = [], {"softmax": "grid", "sparsemax": "regions"}

    class Captioned:
        def __init__(self, kind):
            self.geometry = SimpleNamespace(kind=kind)

        def figure_row(self, label, mode):
            rows.append((label, mode))
            return label

    monkeypatch.setattr(pipeline, "Pipeline", lambda checkpoint, device: lambda photos: [
        Captioned(kinds[normaliser(checkpoint)])])
    monkeypatch.setattr(heatmaps, "comparison_figure", lambda photo, labels: Image.new("RGB", (photo.width // 10, 7)))
    checkpoints = [_configured(tmp_path / "soft"), _configured(tmp_path / "sparse", attention="sparsemax")]
    out = examples_figure(checkpoints, tmp_path / "new" / "deeper" / "h.png", photos=("chelsea", "coffee"))
    assert rows == [("softmax", "grid_blocks"), ("sparsemax", None)] * 2
    assert Image.open(out).size == (60, 14)  # coffee is 600 px wide, chelsea 451
    # the blocks (black here) are pasted from the canvas's top-left corner, one under the other with no gap: the
    # first row of the first block and the last row of the last one are drawn, not left white
    picture = np.asarray(Image.open(out).convert("RGB"))
    assert (picture[:, :45] == 0).all() and (picture[7:] == 0).all() and (picture[:7, 45:] == 255).all()


def test_the_heatmap_figure_by_default_draws_the_three_scikit_image_photos(tmp_path, monkeypatch):
    """``captioner grounding-doc`` (and ``make grounding``) passes no photos: the default names must each be a
    photo scikit-image ships, or the page's regeneration stops at the heatmaps with an ``AttributeError``."""
    seen = []

    def captioned(photos):
        return [SimpleNamespace(geometry=SimpleNamespace(kind="grid"), figure_row=lambda label, mode: label)]

    def block(photo, rows):
        seen.append(photo.size)
        return Image.new("RGB", (photo.width // 10, 7))

    monkeypatch.setattr(pipeline, "Pipeline", lambda checkpoint, device: captioned)
    monkeypatch.setattr(heatmaps, "comparison_figure", block)
    out = examples_figure([_configured(tmp_path / "soft")], tmp_path / "h.png")
    assert seen == [(451, 300), (512, 512), (600, 400)]  # chelsea, astronaut, coffee
    assert Image.open(out).size == (60, 21)
