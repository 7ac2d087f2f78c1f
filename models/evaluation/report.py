"""``captioner eval``'s work as one call: a checkpoint's beam-search captions of a data set's splits, scored, in the
report the command prints and writes (``--output``), with the captions in COCO's results format (``--results-json``).

:func:`evaluation_report` chooses the data set (given none: for a Flickr30k Entities grounding the one the checkpoint
was trained on, else the generated scenes), loads the checkpoint, opens the features it was trained on (or the int8
CNN's), decodes with the checkpoint's decoding rules unless told otherwise, and scores; the command adds only its
flags, the tables it prints and the files it writes.  A mistake in the request is a :class:`ValueError` (or
:class:`FileNotFoundError`) saying what to change, raised before the captioning where it can be.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

from ..data.datasets import DEFAULT_DATASET
from ..data.karpathy import CaptionedImage

#: how a report's captions and references were tokenised for scoring
WORDS_TOKENIZER, PTB_TOKENIZER = "the project's (models/vocab.py)", "coco-caption's PTB tokenizer on the raw texts"


@dataclass
class Evaluation:
    """What :func:`evaluation_report` made: ``report`` is the JSON ``captioner eval --output`` writes; ``captions``
    (split → image id → words) and ``images`` (split → its images) are what was scored, in the split's order;
    ``coco_results`` the captions as ``--results-json`` writes them (``[{"image_id", "caption"}]``, COCO ids)."""

    report: dict[str, Any]
    captions: dict[str, dict[int, list[str]]]
    images: dict[str, list[CaptionedImage]]
    coco_results: list[dict[str, Any]]


def grounding_benchmark(value: str | None) -> tuple[str | None, Path | None]:
    """``grounding``: None, ``"scenes"`` (the generated scenes' masks) or ``"entities:DIR"`` (Flickr30k Entities
    boxes) → its kind and, for Entities, the folder; anything else is a :class:`ValueError`, raised before any work
    is done."""
    if value is None or value == "scenes":
        return value, None
    kind, _, where = value.partition(":")
    if kind != "entities" or not where:
        raise ValueError(f"--grounding takes no value (the scenes' masks) or entities:DIR, got {value!r}")
    if not ((Path(where) / "Sentences").is_dir() and (Path(where) / "Annotations").is_dir()):
        raise ValueError(f"{where} is not a Flickr30k Entities folder (no Sentences/ and Annotations/)")
    return kind, Path(where)


def evaluated_dataset(checkpoint: str | Path, training: dict[str, Any], dataset: str | Path | None,
                      image_root: str | Path | None, for_entities: bool) -> tuple[str | Path, str | Path | None]:
    """The data set (and image root) a checkpoint is scored on: ``dataset`` where one is given; else, for a Flickr30k
    Entities grounding, the one it was trained on (``training``: its ``train_config``), since Entities annotate
    those photos; else :data:`DEFAULT_DATASET`.  A default that is not here is a :class:`FileNotFoundError` that
    says which data set to give."""
    if dataset is not None:
        return dataset, image_root
    if for_entities and training.get("dataset"):
        chosen, root = training["dataset"], image_root or training.get("image_root")
        if not Path(chosen).exists():  # recorded as training named it: relative to where it ran
            raise FileNotFoundError(f"the data set {checkpoint} was trained on, {chosen} (as its training named it, "
                                    "relative to the folder it ran in), is not here: give --dataset and --image-root")
        return chosen, root
    if not Path(DEFAULT_DATASET).exists() and training.get("dataset"):
        raise FileNotFoundError(f"no --dataset given and the default {DEFAULT_DATASET} does not exist ({checkpoint} "
                                f"was trained on {training['dataset']}): give --dataset (and --image-root)")
    return DEFAULT_DATASET, image_root


def evaluation_report(checkpoint: str | Path, dataset: str | Path | None = None, splits: Sequence[str] = ("test",),
                      *, image_root: str | Path | None = None, beam_size: int = 3, max_len: int = 20,
                      length_penalty: float | None = None, block_trigrams: bool | None = None,
                      limit: int | None = None, meteor: bool = True, ptb: bool = False, misses: int = 0,
                      features: str | None = None, cache_dir: str | Path = ".cache/features",
                      device: str = "auto", encoder_precision: str = "float32",
                      onnx_dir: str | Path | None = None, threads: int | None = None,
                      grounding: str | None = None, grounding_resamples: int = 2000,
                      progress: bool = True) -> Evaluation:
    """Caption ``splits`` of ``dataset`` with the checkpoint in folder ``checkpoint`` and score them: BLEU-1..4,
    METEOR (``meteor``; it needs Java), ROUGE-L, CIDEr-D, REP, distinct words, mean length, novel captions and, on
    the generated scenes, objects named (``score_dataset``), as ``captioner eval`` reports them.

    ``dataset`` None: :func:`evaluated_dataset`.  ``length_penalty`` and ``block_trigrams`` override the
    checkpoint's decoding defaults (None keeps them).  ``limit``: the first N images of each split.  ``ptb``:
    score on coco-caption's PTB tokenization (needs Java; refused before the captioning without it).  ``misses``:
    add the N caption words BLEU-1 most often leaves uncredited.  ``features``: ``grid`` or ``regions:DIR``
    (default: what the checkpoint was trained on), cached in ``cache_dir``.  ``encoder_precision`` ``int8``: grid
    features of the CNN quantized for ONNX Runtime (made in ``onnx_dir``; default ``CAPTIONER_ONNX_DIR``, else
    ``.cache/onnx``, as the service's), as the service computes them with
    ``CAPTIONER_ENCODER_PRECISION=int8``.  ``grounding``: ``scenes`` or ``entities:DIR``
    (:func:`grounding_benchmark`), with ``grounding_resamples`` bootstrap resamples.  ``threads``: the ONNX
    Runtime CNN's (set PyTorch's with :func:`~captioner.models.device.set_threads`)."""
    from ..checkpoint import load_checkpoint
    from ..data.datasets import load_split, resolve_dataset, train_split_captions
    from ..data.stores import open_feature_store
    from ..decoding import DecodingRules
    from ..device import resolve_device
    from .compare import result_id
    from .evaluate import evaluate_checkpoint, score_dataset
    from .metrics import ALL_METRICS, UNAVAILABLE, check_ptb_tokenizer

    if ptb:  # refused before the captioning, not after it
        check_ptb_tokenizer()
    kind, entities = grounding_benchmark(grounding)
    run_on = resolve_device(device)
    ckpt = load_checkpoint(checkpoint, run_on)
    chosen, image_root = evaluated_dataset(checkpoint, ckpt.meta.get("train_config", {}), dataset, image_root,
                                           for_entities=entities is not None)
    chosen = resolve_dataset(chosen)
    rules = DecodingRules.of_checkpoint(ckpt.meta).overridden(length_penalty, block_trigrams)
    report: dict[str, Any] = {"checkpoint": str(checkpoint), "dataset": str(chosen), "beam_size": beam_size,
                              "tokenizer": PTB_TOKENIZER if ptb else WORDS_TOKENIZER,
                              "decoding": asdict(rules), "encoder_precision": encoder_precision}
    training_captions = train_split_captions(chosen, image_root)
    metrics = [m for m in ALL_METRICS if meteor or m != "METEOR"]
    evaluation = Evaluation(report, {}, {}, [])
    for split in splits:
        images = load_split(chosen, image_root, split, limit=limit)
        # by default the features the model was trained on (grid, or regions:DIR)
        used = features or ckpt.trained_features
        if encoder_precision == "float32":
            store = open_feature_store(used, images, ckpt.encoder, cache_dir, device=str(run_on), progress=progress)
        else:
            store = _onnx_feature_store(ckpt, images, used, encoder_precision, cache_dir, onnx_dir, threads)
        if kind:
            # one beam search gives both the captions that are scored and the attention rows that are grounded
            from .grounding import caption_with_attention, grounding_report

            results = caption_with_attention(ckpt, images, store, beam_size, max_len, device=str(run_on),
                                             progress=progress, rules=rules)
            captions = {im.image_id: r.tokens for im, r in zip(images, results)}
            scores = score_dataset(captions, images, metrics, training_captions, ptb)
        else:
            scores, captions = evaluate_checkpoint(ckpt, images, store, beam_size, max_len, metrics,
                                                   device=str(run_on), progress=progress, rules=rules,
                                                   training_captions=training_captions, ptb=ptb)
        section = report[split] = {"images": len(images), **{k: round(v, 4) for k, v in scores.items()}}
        section["SPICE"] = f"unavailable: {UNAVAILABLE['SPICE']}"
        if misses:
            from .metrics import unigram_misses

            missed, words = unigram_misses(captions, {im.image_id: im.references for im in images})
            section["BLEU-1 misses"] = {"caption_words": words, "uncredited": sum(missed.values()),
                                        "most_uncredited": dict(missed.most_common(misses))}
        if kind == "scenes":
            section["grounding"] = grounding_report(ckpt, images, results, chosen.parent, grounding_resamples)
        elif kind == "entities":
            from .phrase_grounding import entities_grounding

            section["grounding"] = entities_grounding(ckpt, images, store, entities, results,
                                                      resamples=grounding_resamples, device=str(run_on),
                                                      progress=progress)
        evaluation.captions[split], evaluation.images[split] = captions, images
        # COCO's evaluation server and coco-caption key results by the COCO id (Karpathy's "cocoid"), not "imgid":
        # the id `captioner compare` matches them by
        evaluation.coco_results += [{"image_id": result_id(im), "caption": " ".join(captions[im.image_id])}
                                    for im in images]
    return evaluation


def _onnx_feature_store(ckpt, images: Sequence[CaptionedImage], features: str, precision: str,
                        cache_dir: str | Path, onnx_dir: str | Path | None, threads: int | None):
    """Grid features of the CNN at ``precision`` on ONNX Runtime, as the service computes them with
    CAPTIONER_ENCODER_PRECISION; cached apart from the float features (the cache is keyed by spec, not by CNN)."""
    from ..data.features import extract_features
    from ..export.quantize import RECIPE, OnnxGridEncoder, visual_encoder_file

    if features != "grid":
        raise ValueError("--encoder-precision applies to grid features, not " + str(features))
    path = visual_encoder_file(ckpt.encoder, onnx_dir or os.environ.get("CAPTIONER_ONNX_DIR", ".cache/onnx"), precision)
    return extract_features(images, ckpt.encoder, Path(cache_dir) / f"onnx-{precision}-{RECIPE}",
                            encoder=OnnxGridEncoder(path, ckpt.encoder, threads))
