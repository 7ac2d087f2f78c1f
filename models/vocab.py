"""Tokenizer and vocabulary (docs/decisions.md#tokenizer-and-caption-length).

One rule for every model: lower-case, strip punctuation, split on whitespace.  Special tokens come first so
their ids are stable: ``<pad>``=0, ``<bos>``=1, ``<eos>``=2, ``<unk>``=3.  A word is kept if it occurs at
least ``min_count`` times in the training captions ("kept if count ≥ k", the unambiguous form of the rule).
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIALS = (PAD, BOS, EOS, UNK)
_NON_WORD = re.compile(r"[^a-z0-9\s]")


def tokenize(text: str) -> list[str]:
    """Lower-case (case-folded: ß → ss), accents dropped (café → cafe, not "caf"), punctuation dropped, split on
    whitespace."""
    decomposed = unicodedata.normalize("NFKD", text.casefold())
    letters = "".join(c for c in decomposed if not unicodedata.combining(c))
    return _NON_WORD.sub(" ", letters).split()


class Vocabulary:
    def __init__(self, words: Iterable[str]):
        self.itos: list[str] = list(SPECIALS) + [w for w in words if w not in SPECIALS]
        self.stoi: dict[str, int] = {w: i for i, w in enumerate(self.itos)}

    pad_id, bos_id, eos_id, unk_id = 0, 1, 2, 3

    @classmethod
    def build(cls, captions: Iterable[list[str]], min_count: int = 1, max_size: int | None = None) -> "Vocabulary":
        counts = Counter(token for caption in captions for token in caption)
        # most frequent first, ties broken alphabetically so the vocabulary is deterministic
        kept = sorted((w for w, c in counts.items() if c >= min_count), key=lambda w: (-counts[w], w))
        if max_size is not None:
            if max_size < len(SPECIALS):  # a negative bound would cut from the end, keeping more words, not fewer
                raise ValueError(f"max_size counts the {len(SPECIALS)} special tokens: at least {len(SPECIALS)}, "
                                 f"got {max_size}")
            kept = kept[: max_size - len(SPECIALS)]
        return cls(kept)

    def __len__(self) -> int:
        return len(self.itos)

    def encode(self, tokens: list[str], max_len: int | None = None) -> list[int]:
        """Word ids of ``tokens`` (truncated to ``max_len`` words) followed by ``<eos>``."""
        ids = [self.stoi.get(t, self.unk_id) for t in tokens[:max_len]]
        return ids + [self.eos_id]

    def decode(self, ids: Iterable[int]) -> list[str]:
        """Words up to (not including) the first ``<eos>``; padding dropped."""
        ids = list(ids)
        return [self.itos[ids[t]] for t in self.kept_positions(ids)]

    def kept_positions(self, ids: Iterable[int]) -> list[int]:
        """The positions of ``ids`` whose words :meth:`decode` keeps (a caption's attention rows are picked by
        them): up to the first ``<eos>``, ``<pad>`` skipped."""
        kept = []
        for position, i in enumerate(ids):
            if i == self.eos_id:
                break
            if i != self.pad_id:
                kept.append(position)
        return kept

    def to_json(self) -> dict:
        return {"itos": self.itos}

    @classmethod
    def from_json(cls, data: dict) -> "Vocabulary":
        itos = data["itos"]
        if tuple(itos[: len(SPECIALS)]) != SPECIALS:
            raise ValueError(f"vocabulary must start with {SPECIALS}, got {itos[:4]}")
        return cls(itos[len(SPECIALS):])

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=0))

    @classmethod
    def load(cls, path: str | Path) -> "Vocabulary":
        return cls.from_json(json.loads(Path(path).read_text()))
