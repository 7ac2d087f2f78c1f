"""The captioners, their training, evaluation and export; no web code (``captioner.service`` builds on this).

Where to start from Python (each module's docstring says more):

* :class:`captioner.models.pipeline.Pipeline`: a checkpoint folder → ``pipeline([images])`` → results with
  ``.caption``, ``.tokens``, ``.attention`` (one row per token), ``.figure(photo)`` and ``.overlay(photo, i)``.
* :func:`captioner.models.checkpoint.load_checkpoint` / :func:`~captioner.models.checkpoint.save_checkpoint`: the one
  checkpoint format; :func:`captioner.models.registry.create` builds a model by its registered name.
* :func:`captioner.models.decoding.beam_search`: the one beam search, over a model and a
  :class:`~captioner.models.protocol.VisualBatch`; :class:`~captioner.models.encoder.GridEncoder` makes the features.
* :func:`captioner.models.training.train` with a :class:`~captioner.models.training.config.TrainConfig`: what
  ``captioner train`` runs.
* :func:`captioner.models.evaluation.report.evaluation_report` (``captioner eval``) and
  :func:`captioner.models.evaluation.metrics.score_captions` (BLEU, METEOR, ROUGE-L, CIDEr-D of your own captions).
* :func:`captioner.models.export.onnx.export_graphs` (``captioner export``) and the importers of the authors'
  released checkpoints in :mod:`captioner.models.interop`.
"""
