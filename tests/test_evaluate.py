"""models/evaluation/evaluate.py, the code behind ``captioner eval`` and the training loop's validation: each image
captioned with the shared beam search's best hypothesis under the decoding rules given, in batches, the
model's mode given back as it was, and no autograd graph kept for the visual features."""

from pathlib import Path

import pytest
import torch

from captioner.models.checkpoint import Checkpoint
from captioner.models.data.karpathy import CaptionedImage
from captioner.models.decoding import DecodingRules, beam_search
from captioner.models.evaluation.evaluate import caption_dataset, evaluate_checkpoint, visual_batches
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
