"""Evaluation: caption metrics (BLEU, METEOR, ROUGE-L, CIDEr-D, objects_named), dataset evaluation, model cards and
parameter counts."""
