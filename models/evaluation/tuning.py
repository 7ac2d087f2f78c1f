"""Choosing a checkpoint's decoding rules on validation data: every (length penalty, trigram blocking, doubled-word
blocking) combination of a grid, scored with the same beam search and metrics as ``captioner eval`` (the code behind
``captioner tune-decoding``).

The combination with the best score on the chosen metric becomes the checkpoint's default (``meta["decoding"]``,
which the service and ``captioner eval`` use unless told otherwise); a tie goes to the simpler rules (smaller
penalty, no blocking), so rules are only switched on where they pay.  Doubled-word blocking is off in the default
grid: it changed no shipped checkpoint's validation CIDEr-D by more than the tolerance its rule sets
(docs/decisions.md, "Flickr8k: doubled words").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from itertools import product
from typing import Any

from ..decoding import RULE_NAMES, DecodingRules
from ..progress import progress_bar
from .evaluate import evaluate_checkpoint
from .metrics import reported

# the grid `captioner tune-decoding` tries by default: above 1 the penalty lengthens Flickr8k captions mostly with
# repeats (docs/decisions.md, "Flickr8k: BLEU-1 and the brevity penalty": α = 2 took REP from 1.5 to 11), not worth
# a validation pass each
DEFAULT_PENALTIES = (0.0, 0.5, 1.0)


def decoding_grid(ckpt, images: Sequence, store, penalties: Sequence[float] = DEFAULT_PENALTIES,
                  trigram_options: Sequence[bool] = (False, True), beam_size: int = 3, max_len: int = 20,
                  metrics: Sequence[str] = ("BLEU", "ROUGE-L", "CIDEr-D"), device: str = "cpu",
                  training_captions: Sequence[list[str]] | None = None,
                  doubled_options: Sequence[bool] = (False,)) -> list[dict[str, Any]]:
    """One row per combination: the rules and every score (caption metrics, REP, distinct words, mean length,
    …)."""
    rows = []
    combinations = list(product(penalties, trigram_options, doubled_options))
    for penalty, block, doubled in progress_bar(combinations, desc="decoding rules", unit="combination"):
        rules = DecodingRules(length_penalty=penalty, block_trigrams=block, block_doubled_words=doubled)
        scores, _ = evaluate_checkpoint(ckpt, images, store, beam_size, max_len, metrics, device=device,
                                        progress=False, rules=rules, training_captions=training_captions)
        rows.append({**asdict(rules), **reported(scores)})
    return rows


def best_row(rows: Sequence[dict[str, Any]], metric: str) -> dict[str, Any]:
    """The grid's row with the highest ``metric``; ties to the smaller penalty, then to no blocking."""
    def preference(row: dict[str, Any]) -> tuple:
        rules = rules_of(row)
        return row[metric], -rules.length_penalty, not rules.block_trigrams, not rules.block_doubled_words

    return max(rows, key=preference)


def rules_of(row: dict[str, Any]) -> DecodingRules:
    """The decoding rules a grid row was decoded with (a row written before a rule existed: that rule off)."""
    return DecodingRules(**{name: row[name] for name in RULE_NAMES if name in row})


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    head = ["length penalty α", "block trigrams", "block doubled words", *columns]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        rules = rules_of(row)
        values = [f"{rules.length_penalty:g}", "yes" if rules.block_trigrams else "no",
                  "yes" if rules.block_doubled_words else "no",
                  *(f"{row[c]:.4g}" if isinstance(row.get(c), float) else str(row.get(c, "")) for c in columns)]
        lines.append("| " + " | ".join(values) + " |")
    return "\n".join(lines)
