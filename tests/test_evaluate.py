"""models/evaluation/evaluate.py, the code behind ``captioner eval`` and the training loop's validation: each image
captioned with the shared beam search's best hypothesis under the decoding rules given, in batches, the
model's mode given back as it was, and no autograd graph kept for the visual features."""

from pathlib import Path

import pytest
import torch

from captioner.models.checkpoint import Checkpoint
from captioner.models.data.karpathy import CaptionedImage
from captioner.models.decoding import DecodingRules, beam_search
from captioner.models.evaluation import evaluate as evaluate_module
from captioner.models.evaluation.evaluate import caption_dataset, evaluate_checkpoint, score_dataset, visual_batches
from captioner.models.protocol import VisualBatch

from .serving_helpers import FEAT_DIM, TINY_SPEC, VOCAB, tiny_model

IMAGES = [CaptionedImage(i, Path(f"/nowhere/{i}.png"), "test", [["w3", "w4", "w5"]]) for i in range(5)]
#: rules that change an untrained model's captions (it doubles words), so that dropping them shows
RULES = DecodingRules(length_penalty=0.5, block_doubled_words=True)


class Store:
    """A visual store of fixed random grid features, passed through a trainable scale as a store with fine-tuned
    encoder stages computes them."""

    def __init__(self):
        generator = torch.Generator().manual_seed(0)
        self.feats = {im.key: torch.randn(9, FEAT_DIM, generator=generator) for im in IMAGES}
        self.scale = torch.nn.Parameter(torch.ones(()))

    def batch(self, keys: list[str]) -> VisualBatch:
        return VisualBatch.from_features(torch.stack([self.feats[key] for key in keys]) * self.scale)


def best_captions(model, store: Store, rules: DecodingRules = DecodingRules()) -> dict[int, list[str]]:
    with torch.no_grad():
        hyps = beam_search(model.eval(), store.batch([im.key for im in IMAGES]), k=3, max_len=8, rules=rules,
                           extras=())
    return {im.image_id: VOCAB.decode(best[0].token_ids) for im, best in zip(IMAGES, hyps)}


@pytest.mark.parametrize("training", [True, False])
def test_each_image_gets_the_best_hypothesis_of_the_beam_under_the_rules_and_the_mode_is_given_back(training):
    model, store = tiny_model("sat"), Store()
    model.train(training)
    captions = caption_dataset(model, VOCAB, IMAGES, store, beam_size=3, max_len=8, batch_size=2, rules=RULES)
    assert model.training == training  # the training loop validates between its steps
    assert captions == best_captions(model, store, RULES) != best_captions(model, store)


def test_the_images_are_captioned_with_the_model_in_eval_mode():
    """A model validated between training steps has dropout on: each batch is captioned with it off (the tiny
    model has none, so the store records the mode the model is in when each batch is asked for)."""
    model, modes = tiny_model("sat"), []

    class Recording(Store):
        def batch(self, keys):
            modes.append(model.training)
            return super().batch(keys)

    model.train()
    caption_dataset(model, VOCAB, IMAGES, Recording(), beam_size=3, max_len=8, batch_size=2)
    assert modes == [False] * 3 and model.training


def test_by_default_three_beams_twenty_words_and_no_progress_bar(capsys):
    """The training loop's validation and ``captioner select`` rely on the defaults: a model that never ends its
    captions (its ``<eos>`` scored out) gets twenty words, and nothing is written to the training log."""
    model, store = tiny_model("sat"), Store()
    with torch.no_grad():
        model.out_word.bias[VOCAB.eos_id] = -1e4
    captions = caption_dataset(model, VOCAB, IMAGES, store)
    assert capsys.readouterr().err == ""
    assert {len(caption) for caption in captions.values()} == {20}
    with torch.no_grad():
        hyps = beam_search(model, store.batch([im.key for im in IMAGES]), k=3, max_len=20, extras=())
    assert captions == {im.image_id: VOCAB.decode(best[0].token_ids) for im, best in zip(IMAGES, hyps)}
    caption_dataset(model, VOCAB, IMAGES, store, progress=True)
    assert "captioning" in capsys.readouterr().err  # a bar only where asked


def test_by_default_images_are_captioned_fifty_at_a_time():
    """The batches ``captioner eval`` captions in are those the shipped reports were made in: tests/shipped_reports.py
    compares a checkpoint's first fifty captions with the committed ones exactly because they share one batch (a
    batch of another size rounds the beam's scores otherwise, and a near tie can change a caption)."""
    images = [CaptionedImage(i, Path(f"/nowhere/{i}.png"), "test", [["w3"]]) for i in range(51)]
    sizes = []

    class Recording:
        def batch(self, keys):
            sizes.append(len(keys))
            return VisualBatch.from_features(torch.zeros(len(keys), 9, FEAT_DIM))

    captions = caption_dataset(tiny_model("sat"), VOCAB, images, Recording(), beam_size=1, max_len=2)
    assert sizes == [50, 1] and len(captions) == 51


def test_a_checkpoint_is_evaluated_with_the_rules_given_and_scored_on_its_own_captions():
    model, store = tiny_model("sat"), Store()
    scores, captions = evaluate_checkpoint(Checkpoint(model, VOCAB, TINY_SPEC), IMAGES, store, beam_size=3,
                                           max_len=8, metrics=("BLEU",), progress=False, rules=RULES)
    assert captions == best_captions(model, store, RULES)
    assert scores["mean_length"] == pytest.approx(sum(map(len, captions.values())) / len(IMAGES))


def test_the_visual_features_are_computed_without_an_autograd_graph():
    """Validation during fine-tuning: a store with trainable encoder stages would otherwise record their graph
    for every batch (memory the training step then lacks)."""
    batches = list(visual_batches(tiny_model("sat"), IMAGES, Store(), 2, "cpu", "captioning", False))
    assert [len(chunk) for chunk, _ in batches] == [2, 2, 1]
    assert not any(vis.feats.requires_grad for _, vis in batches)


def test_each_batch_of_visual_features_is_moved_to_the_device_the_model_runs_on():
    """A feature store keeps its features on the CPU (a cache read from disk) while ``captioner eval --device cuda``
    runs the model on the GPU: each batch is moved there (``meta`` stands in for the GPU, which the tests lack)."""
    batches = list(visual_batches(tiny_model("sat"), IMAGES, Store(), 2, "meta", "captioning", False))
    assert {(vis.feats.device.type, vis.mask.device.type) for _, vis in batches} == {("meta", "meta")}


def test_scores_count_novel_captions_given_the_training_captions_and_name_a_scenes_objects():
    """``captioner eval`` on generated scenes reports ``objects_named`` from each image's own caption, and with the
    training split's captions the share of captions not copied from it; neither is there when its input is not."""
    scenes = [CaptionedImage(1, Path("/nowhere/1.png"), "test", [["a", "red", "circle"]],
                             info={"objects": [{"colour": "red", "shape": "circle"}]}),
              CaptionedImage(2, Path("/nowhere/2.png"), "test", [["two", "squares"]],
                             info={"objects": [{"colour": "blue", "shape": "square"},
                                               {"colour": "green", "shape": "square"}]})]
    # the first image's caption names its object, the second's one of its two (its reference names neither)
    captions = {1: ["a", "red", "circle"], 2: ["a", "green", "square"]}
    scores = score_dataset(captions, scenes, ("BLEU",), training_captions=[["a", "red", "circle"]])
    assert scores["objects_named"] == pytest.approx(2 / 3)
    assert scores["novel_captions"] == pytest.approx(0.5)
    assert "novel_captions" not in score_dataset(captions, scenes, ("BLEU",))
    assert "objects_named" not in score_dataset({0: ["w3"]}, IMAGES[:1], ("BLEU",))  # images without objects
    assert score_dataset({1: captions[1]}, scenes[:1], ("BLEU",))["objects_named"] == 1.0  # ``--limit 1``


def test_a_checkpoint_is_scored_with_the_metrics_training_captions_and_tokenization_given(monkeypatch):
    """``captioner eval``'s ``--max-len``, ``--ptb`` and the novel-caption share reach the captioning and the scoring
    (recorded here: the PTB tokenizer needs Java)."""
    calls = []
    monkeypatch.setattr(evaluate_module, "score_dataset", lambda *args: calls.append(args) or {})
    training, model = [["w3", "w4"]], tiny_model("sat")
    with torch.no_grad():
        model.out_word.bias[VOCAB.eos_id] = -1e4  # captions that never end: they stop at ``max_len``
    _, captions = evaluate_checkpoint(Checkpoint(model, VOCAB, TINY_SPEC), IMAGES, Store(), max_len=8,
                                      metrics=("BLEU",), progress=False, training_captions=training, ptb=True)
    assert calls == [(captions, IMAGES, ("BLEU",), training, True)]
    assert {len(caption) for caption in captions.values()} == {8}
    # without ``ptb`` (``captioner tune`` passes none): the project's own tokens, no Java
    evaluate_checkpoint(Checkpoint(tiny_model("sat"), VOCAB, TINY_SPEC), IMAGES, Store(), max_len=8, progress=False)
    assert calls[1][4] is False


def test_with_ptb_the_captions_too_are_ptb_tokenized(monkeypatch):
    """``--ptb`` scores coco-caption's tokenization of both sides, the captions as well as the references (both
    stood in for here: the tokenizer needs Java)."""
    monkeypatch.setattr(evaluate_module, "reference_texts", lambda images, ptb: [["w3 w4 w5"] for _ in images])
    monkeypatch.setattr(evaluate_module, "ptb_captions", lambda captions: {i: "w3 w4 w5" for i in captions})
    captions = {im.image_id: ["w9"] for im in IMAGES}
    assert score_dataset(captions, IMAGES, ("BLEU",), ptb=True)["BLEU-1"] == pytest.approx(1.0)
    assert score_dataset(captions, IMAGES, ("BLEU",))["BLEU-1"] == pytest.approx(0.0)


def test_with_ptb_the_references_are_ptb_tokenized_and_without_it_the_projects_own_tokens(monkeypatch):
    """``--ptb`` scores PTB-tokenized captions against PTB-tokenized references: references left in the project's
    tokens would score the two tokenizations' differences (punctuation, contractions) as the model's mistakes. Here
    the stand-in tokenizer turns every text into ``w3 w4 w5`` (it needs Java)."""
    def references(images, ptb):
        return [["w3 w4 w5"] if ptb else ["w9"] for _ in images]

    monkeypatch.setattr(evaluate_module, "reference_texts", references)
    monkeypatch.setattr(evaluate_module, "ptb_captions", lambda captions: {i: "w3 w4 w5" for i in captions})
    captions = {im.image_id: ["w9"] for im in IMAGES}
    assert score_dataset(captions, IMAGES, ("BLEU",), ptb=True)["BLEU-1"] == pytest.approx(1.0)
    assert score_dataset(captions, IMAGES, ("BLEU",))["BLEU-1"] == pytest.approx(1.0)


def test_the_model_is_given_back_its_mode_when_the_batches_stop_early():
    """A caller that stops after some batches (an error in one, a ``break``) leaves the model training as it was."""
    model = tiny_model("sat").train()
    batches = visual_batches(model, IMAGES, Store(), 2, "cpu", "captioning", False)
    next(batches)
    assert not model.training
    batches.close()
    assert model.training
