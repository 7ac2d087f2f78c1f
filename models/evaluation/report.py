"""``captioner eval``'s work as one call: a checkpoint's beam-search captions of a data set's splits, scored, in the
report the command prints and writes (``--output``), with the captions in COCO's results format (``--results-json``).

:func:`evaluation_report` chooses the data set (given none: for a Flickr30k Entities grounding the one the checkpoint
was trained on, else the generated scenes), loads the checkpoint, opens the features it was trained on (or the int8
CNN's), decodes with the checkpoint's decoding rules unless told otherwise, and scores; the command adds only its
flags, the tables it prints and the files it writes.  A mistake in the request is a :class:`ValueError` (or
:class:`FileNotFoundError`) saying what to change, raised before the captioning where it can be.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from ..data.datasets import DEFAULT_DATASET
from ..data.karpathy import CaptionedImage
from ..placement import onnx_dir_from_env

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


@dataclass
class ScoredSplit:
    """One split as :func:`evaluation_report` scored it: its ``section`` of the report, the ``images`` in the
    split's order and their ``captions`` (image id → words), handed to ``on_split`` as soon as the split is done."""

    name: str
    section: dict[str, Any]
    images: list[CaptionedImage]
    captions: dict[int, list[str]]


def evaluation_report(checkpoint: str | Path, dataset: str | Path | None = None, splits: Sequence[str] = ("test",),
                      *, image_root: str | Path | None = None, beam_size: int = 3, max_len: int = 20,
                      length_penalty: float | None = None, block_trigrams: bool | None = None,
                      block_doubled_words: bool | None = None,
                      limit: int | None = None, meteor: bool = True, ptb: bool = False, misses: int = 0,
                      features: str | None = None, cache_dir: str | Path = ".cache/features",
                      device: str = "auto", encoder_precision: str = "float32",
                      onnx_dir: str | Path | None = None, threads: int | None = None,
                      grounding: str | None = None, grounding_resamples: int = 2000,
                      progress: bool = True, on_split: Callable[[ScoredSplit], None] | None = None) -> Evaluation:
    """Caption ``splits`` of ``dataset`` with the checkpoint in folder ``checkpoint`` and score them: BLEU-1..4,
    METEOR (``meteor``; it needs Java), ROUGE-L, CIDEr-D, REP, distinct words, mean length, novel captions and, on
    the generated scenes, objects named (``score_dataset``), as ``captioner eval`` reports them.  The keywords are
    the command's flags, one for one.

    ``dataset`` None: :func:`evaluated_dataset`.  ``length_penalty``, ``block_trigrams`` and
    ``block_doubled_words`` override the checkpoint's decoding defaults (None keeps them).  ``limit``: the first N
    images of each split.  ``ptb``:
    score on coco-caption's PTB tokenization (needs Java; refused before the captioning without it).  ``misses``:
    add the N caption words BLEU-1 most often leaves uncredited.  ``features``: ``grid`` or ``regions:DIR``
    (default: what the checkpoint was trained on), cached in ``cache_dir``.  ``encoder_precision`` ``int8``: grid
    features of the CNN quantized for ONNX Runtime (made in ``onnx_dir``; default ``CAPTIONER_ONNX_DIR``, else
    ``.cache/onnx``, as the service's), as the service computes them with
    ``CAPTIONER_ENCODER_PRECISION=int8``.  ``grounding``: ``scenes`` or ``entities:DIR``
    (:func:`grounding_benchmark`), with ``grounding_resamples`` bootstrap resamples.  ``threads``: the ONNX
    Runtime CNN's (set PyTorch's with :func:`~captioner.models.device.set_threads`).  ``on_split``: called with
    each :class:`ScoredSplit` as soon as it is scored, before the next split starts (``captioner eval --show``
    prints its captions from it)."""
    from ..checkpoint import load_checkpoint
    from ..data.datasets import resolve_dataset, train_split_captions
    from ..decoding import DecodingRules
    from ..device import resolve_device
    from .metrics import ALL_METRICS, check_ptb_tokenizer

    if ptb:  # refused before the captioning, not after it
        check_ptb_tokenizer()
    kind, entities = grounding_benchmark(grounding)
    run_on = resolve_device(device)
    ckpt = load_checkpoint(checkpoint, run_on)
    chosen, image_root = evaluated_dataset(checkpoint, ckpt.meta.get("train_config", {}), dataset, image_root,
                                           for_entities=entities is not None)
    chosen = resolve_dataset(chosen)
    rules = DecodingRules.of_checkpoint(ckpt.meta).overridden(
        length_penalty=length_penalty, block_trigrams=block_trigrams, block_doubled_words=block_doubled_words)
    # the weights' sha256 says which checkpoint was scored wherever it is copied to (a card checks it)
    report: dict[str, Any] = {"checkpoint": str(checkpoint), "weights_sha256": ckpt.checksum,
                              "dataset": str(chosen), "beam_size": beam_size,
                              "tokenizer": PTB_TOKENIZER if ptb else WORDS_TOKENIZER,
                              "decoding": asdict(rules), "encoder_precision": encoder_precision}
    scorer = _SplitScorer(
        ckpt=ckpt, device=str(run_on), dataset=chosen, image_root=image_root, rules=rules,
        metrics=[m for m in ALL_METRICS if meteor or m != "METEOR"],
        training_captions=train_split_captions(chosen, image_root), beam_size=beam_size, max_len=max_len,
        limit=limit, ptb=ptb, misses=misses,
        # by default the features the model was trained on (grid, or regions:DIR)
        features=features or ckpt.trained_features, cache_dir=cache_dir, encoder_precision=encoder_precision,
        onnx_dir=onnx_dir, threads=threads, grounding=kind, entities=entities,
        grounding_resamples=grounding_resamples, progress=progress)
    evaluation = Evaluation(report, {}, {}, [])
    for split in splits:
        scored = scorer.score(split)
        _add_split(evaluation, scored)
        if on_split is not None:
            on_split(scored)
    return evaluation


@dataclass(frozen=True)
class _SplitScorer:
    """What :func:`evaluation_report` scores every split with, set up once: the checkpoint and where it runs, the data
    set, the decoding rules, the metrics, the grounding benchmark and the call's feature and output options."""

    ckpt: Any
    device: str
    dataset: Path
    image_root: str | Path | None
    rules: Any
    metrics: list[str]
    training_captions: Any
    beam_size: int
    max_len: int
    limit: int | None
    ptb: bool
    misses: int
    features: str
    cache_dir: str | Path
    encoder_precision: str
    onnx_dir: str | Path | None
    threads: int | None
    grounding: str | None  # None, "scenes" or "entities" (grounding_benchmark's kind)
    entities: Path | None
    grounding_resamples: int
    progress: bool

    def score(self, split: str) -> ScoredSplit:
        """One split captioned and scored: its report section (scores, the BLEU-1 misses and the grounding asked
        for), its images and their captions."""
        from ..data.datasets import load_split
        from .evaluate import evaluate_checkpoint, score_dataset
        from .metrics import UNAVAILABLE, reported

        images = load_split(self.dataset, self.image_root, split, limit=self.limit)
        store = self._feature_store(images)
        if self.grounding:
            # one beam search gives both the captions that are scored and the attention rows that are grounded
            from .grounding import caption_with_attention

            results = caption_with_attention(self.ckpt, images, store, self.beam_size, self.max_len,
                                             device=self.device, progress=self.progress, rules=self.rules)
            captions = {im.image_id: r.tokens for im, r in zip(images, results)}
            scores = score_dataset(captions, images, self.metrics, self.training_captions, self.ptb)
        else:
            scores, captions = evaluate_checkpoint(self.ckpt, images, store, self.beam_size, self.max_len,
                                                   self.metrics, device=self.device, progress=self.progress,
                                                   rules=self.rules, training_captions=self.training_captions,
                                                   ptb=self.ptb)
        section = {"images": len(images), **reported(scores)}
        section["SPICE"] = f"unavailable: {UNAVAILABLE['SPICE']}"
        if self.misses:
            from .metrics import unigram_misses

            missed, words = unigram_misses(captions, {im.image_id: im.references for im in images})
            section["BLEU-1 misses"] = {"caption_words": words, "uncredited": sum(missed.values()),
                                        "most_uncredited": dict(missed.most_common(self.misses))}
        if self.grounding == "scenes":
            from .grounding import grounding_report

            section["grounding"] = grounding_report(self.ckpt, images, results, self.dataset.parent,
                                                    self.grounding_resamples)
        elif self.grounding == "entities":
            from .phrase_grounding import entities_grounding

            section["grounding"] = entities_grounding(self.ckpt, images, store, self.entities, results,
                                                      resamples=self.grounding_resamples, device=self.device,
                                                      progress=self.progress)
        return ScoredSplit(split, section, images, captions)

    def _feature_store(self, images: Sequence[CaptionedImage]):
        """The split's visual features: the float PyTorch CNN's (or the regions'), else the quantized ONNX CNN's."""
        from ..data.stores import open_feature_store

        if self.encoder_precision == "float32":
            return open_feature_store(self.features, images, self.ckpt.encoder, self.cache_dir, device=self.device,
                                      progress=self.progress)
        return _onnx_feature_store(self.ckpt, images, self.features, self.encoder_precision, self.cache_dir,
                                   self.onnx_dir, self.threads)


def _add_split(evaluation: Evaluation, scored: ScoredSplit) -> None:
    """``scored`` into the report, the captions and the COCO results, after the splits before it."""
    from .compare import result_id

    evaluation.report[scored.name] = scored.section
    evaluation.captions[scored.name], evaluation.images[scored.name] = scored.captions, scored.images
    # COCO's evaluation server and coco-caption key results by the COCO id (Karpathy's "cocoid"), not "imgid": the
    # id `captioner compare` matches them by
    evaluation.coco_results += [{"image_id": result_id(im), "caption": " ".join(scored.captions[im.image_id])}
                                for im in scored.images]


def _onnx_feature_store(ckpt, images: Sequence[CaptionedImage], features: str, precision: str,
                        cache_dir: str | Path, onnx_dir: str | Path | None, threads: int | None):
    """Grid features of the CNN at ``precision`` on ONNX Runtime, as the service computes them with
    CAPTIONER_ENCODER_PRECISION; cached apart from the float features (the cache is keyed by spec, not by CNN)."""
    from ..data.features import extract_features
    from ..export.quantize import RECIPE, int8_recipe, visual_encoder_file
    from ..export.sessions import VisualSession

    if features != "grid":
        raise ValueError("--encoder-precision applies to grid features, not " + str(features))
    path = visual_encoder_file(ckpt.encoder, onnx_dir or onnx_dir_from_env(), precision)
    recipe = int8_recipe() if precision == "int8" else RECIPE
    return extract_features(images, ckpt.encoder, Path(cache_dir) / f"onnx-{precision}-{recipe}",
                            encoder=VisualSession(path, "cpu", threads))
