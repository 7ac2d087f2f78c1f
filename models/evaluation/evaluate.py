"""Caption a split with the shared beam search and score it (the code behind ``captioner eval``)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from ..checkpoint import Checkpoint
from ..data.stores import VisualStore
from ..data.karpathy import CaptionedImage
from ..decoding import NO_RULES, DecodingRules, beam_search
from ..progress import progress_bar
from .diversity import diversity_scores
from .metrics import ALL_METRICS, ptb_captions, reference_texts, score_captions
from ..protocol import Captioner, VisualBatch
from ..vocab import Vocabulary


def visual_batches(model: Captioner, images: Sequence[CaptionedImage], store: VisualStore, batch_size: int,
                   device: str, desc: str, progress: bool) -> Iterator[tuple[Sequence[CaptionedImage], VisualBatch]]:
    """``(images, their visual items)`` batch by batch, with a progress bar, the model in eval mode meanwhile (its
    mode is restored afterwards, also when the loop stops early)."""
    was_training = model.training
    model.eval()
    try:
        for start in progress_bar(range(0, len(images), batch_size), desc=desc, disable=not progress):
            chunk = images[start:start + batch_size]
            with torch.no_grad():  # a store with fine-tuned encoder stages would otherwise record their graph
                yield chunk, store.batch([im.key for im in chunk]).to(device)
    finally:
        model.train(was_training)


def caption_dataset(model: Captioner, vocab: Vocabulary, images: Sequence[CaptionedImage], store: VisualStore,
                    beam_size: int = 3, max_len: int = 20, batch_size: int = 50, device: str = "cpu",
                    progress: bool = False, rules: DecodingRules = NO_RULES) -> dict[int, list[str]]:
    """Beam-search captions (as token lists) for every image, keyed by image id."""
    captions = {}
    for chunk, vis in visual_batches(model, images, store, batch_size, device, "captioning", progress):
        hyps = beam_search(model, vis, k=beam_size, max_len=max_len, rules=rules, extras=())
        for im, best in zip(chunk, hyps):
            captions[im.image_id] = vocab.decode(best[0].token_ids)
    return captions


def score_dataset(captions: dict[int, list[str]], images: Sequence[CaptionedImage],
                  metrics: Sequence[str] = ALL_METRICS,
                  training_captions: Sequence[list[str]] | None = None, ptb: bool = False) -> dict[str, float]:
    """The caption metrics, REP, distinct words and mean length (and, given ``training_captions``, the share of novel
    captions: models/evaluation/diversity.py), plus ``objects_named`` when the images are generated scenes (they list
    their objects).  ``ptb``: the caption metrics on coco-caption's PTB tokenization of the raw references and the
    captions (metrics.py); the other measures count the project's own tokens either way."""
    refs = dict(zip((im.image_id for im in images), reference_texts(images, ptb)))
    candidates = {i: " ".join(c) for i, c in captions.items()}
    scores = score_captions(ptb_captions(candidates) if ptb else candidates, refs, metrics)
    scores.update(diversity_scores(captions, {im.image_id: im.references for im in images}, training_captions))
    if images and images[0].info.get("objects") is not None:
        from ..data.scenes import object_naming_accuracy

        scores["objects_named"] = object_naming_accuracy([(captions[im.image_id], im.info["objects"]) for im in images])
    return scores


@torch.no_grad()
def evaluate_checkpoint(ckpt: Checkpoint, images: Sequence[CaptionedImage], store: VisualStore,
                        beam_size: int = 3, max_len: int = 20, metrics: Sequence[str] = ALL_METRICS,
                        device: str = "cpu", progress: bool = True, rules: DecodingRules = NO_RULES,
                        training_captions: Sequence[list[str]] | None = None, ptb: bool = False,
                        ) -> tuple[dict[str, float], dict[int, list[str]]]:
    captions = caption_dataset(ckpt.model, ckpt.vocab, images, store, beam_size, max_len, device=device,
                               progress=progress, rules=rules)
    return score_dataset(captions, images, metrics, training_captions, ptb), captions
