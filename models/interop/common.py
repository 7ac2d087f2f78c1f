"""What every converter of an authors' released checkpoint shares: reading their ``.pth`` without running code,
checking its keys against the expected ones, and remapping the vocabulary.

The vocabulary rule (docs/decisions.md#aoanet-reference-compatibility-flags): in the authors' codebases index 0 is
both the start token and the end token.  Their row 0 becomes ``<bos>``'s embedding and ``<eos>``'s output row; a
word ``UNK`` becomes ``<unk>``; ``<pad>`` and ``<bos>`` (and ``<unk>`` if they have none) get output rows that can
never win (weight 0, bias −1e9), so the log-probabilities of their tokens are unchanged.
"""

from __future__ import annotations

import pickle
import struct
import zipfile
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path

import torch
from torch import Tensor, nn

from ..vocab import SPECIALS, Vocabulary

NEVER = -1e9  # output bias of tokens the authors' model cannot emit
UNKNOWN_WORD = "UNK"  # the authors' unknown-word token, which becomes <unk>
_WRAPPERS = ("state_dict", "model", "model_state_dict")  # training snapshots keep the weights under one of these


class ConversionError(ValueError):
    """The files are not a checkpoint of the authors' code that this converter understands."""


def _is_tensor_dict(value: object) -> bool:
    return isinstance(value, dict) and bool(value) and all(isinstance(v, Tensor) for v in value.values())


#: How a file that is no pickle at all (a vocabulary's text given for the weights) fails: the unpickler reads its
#: bytes as opcodes and stops inside its own machinery (KeyError "101", IndexError "pop from empty list",
#: struct.error on a short operand, met by 3,500 fuzzed files; TypeError and AttributeError as restricted_load meets)
_UNPICKLER_FAILURES = (KeyError, IndexError, TypeError, AttributeError, struct.error)


def load_torch_weights(path: str | Path) -> dict[str, Tensor]:
    """A state dict from a ``.pth`` (``weights_only``: tensors and containers only, never code), held directly or
    under one key of a training snapshot, without DataParallel's ``module.`` prefix."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        raise
    except (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError, OSError,
            *_UNPICKLER_FAILURES) as error:
        # a truncated download fails in the zip reader or the unpickler; an object that needs code to load is
        # refused by weights_only: both are "not a checkpoint we can read", and the reason is kept
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        if isinstance(error, _UNPICKLER_FAILURES):  # messages such as "101" or "pop from empty list"
            reason = f"its bytes are not a pickle ({type(error).__name__}: {reason})"
        if "weights_only" in str(error):  # PyTorch's advice to load it unsafely is not what to tell a user
            reason = "it holds pickled Python objects, not only tensors, and is not loaded as code"
        raise ConversionError(f"{path} cannot be read as a PyTorch state dict (truncated, or not a .pth of "
                              f"tensors): {reason}") from None
    if isinstance(state, dict) and not _is_tensor_dict(state):
        inner = [state[k] for k in _WRAPPERS if _is_tensor_dict(state.get(k))]
        inner = inner or [v for v in state.values() if _is_tensor_dict(v)]
        if len(inner) == 1:
            state = inner[0]
    if not _is_tensor_dict(state):
        raise ConversionError(f"{path} does not hold a state dict of tensors")
    return {k.removeprefix("module."): v for k, v in state.items()}


def _listing(keys: list[str], limit: int = 6) -> str:
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def copy_weights(state: Mapping[str, Tensor], names: Mapping[str, str], *, what: str,
                 handled: Collection[str] = ()) -> dict[str, Tensor]:
    """``{ours: their tensor}`` for every ``ours → theirs`` pair of ``names``.  Every key of ``names`` and of
    ``handled`` (keys the converter maps itself) must be in ``state`` and ``state`` may hold nothing else: both
    kinds of mismatch are refused, naming the keys."""
    expected = set(names.values()) | set(handled)
    missing = sorted(expected - state.keys())
    if missing:
        raise ConversionError(f"not {what}: it lacks {len(missing)} expected weight(s): {_listing(missing)}")
    unknown = sorted(state.keys() - expected)
    if unknown:
        raise ConversionError(f"weights this converter does not understand ({what} expected): {_listing(unknown)}")
    return {ours: state[theirs].float() for ours, theirs in names.items()}


def load_converted(model: nn.Module, weights: dict[str, Tensor]) -> None:
    """Load the mapped weights (strict); a shape that does not fit the inferred sizes is a conversion error."""
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as error:
        problems = [line.strip() for line in str(error).splitlines()[1:] if line.strip()] or [str(error)]
        raise ConversionError(f"the weights do not fit the model their shapes describe ({len(problems)} "
                              f"problem(s)): {_listing(problems, 3)}") from None
    model.eval()


def vocabulary_from_indexed(words: Iterable[tuple[int, str]]) -> tuple[Vocabulary, dict[int, int]]:
    """The project vocabulary for the authors' words (their index ≥ 1 → word), and project id → authors' index
    for every row that has one (``<bos>`` and ``<eos>`` both come from their index 0)."""
    try:
        authors = sorted((int(ix), word) for ix, word in words)
    except (TypeError, ValueError):
        raise ConversionError("the vocabulary's indices are not all whole numbers") from None
    # the authors' words are numbered 1..N (0 is their start/end token), and their output layer has a row for each
    if [ix for ix, _ in authors] != list(range(1, len(authors) + 1)):
        raise ConversionError(f"the vocabulary is not numbered 1..{len(authors)} (0 is the authors' start and end "
                              "token): its indices skip or repeat a number")
    blank = next(((ix, word) for ix, word in authors if not isinstance(word, str) or not word or word != word.strip()
                  or any(c.isspace() for c in word)), None)
    if blank is not None:
        raise ConversionError(f"the vocabulary's word {blank[1]!r} (index {blank[0]}) is not a word: words are "
                              "non-empty strings without spaces")
    seen: set[str] = set()
    for ix, word in authors:
        if word in seen:
            raise ConversionError(f"the vocabulary holds {word!r} twice (index {ix}): one id per word is needed")
        if word in SPECIALS:
            raise ConversionError(f"the vocabulary's word {word!r} (index {ix}) is one of this project's special "
                                  f"tokens {SPECIALS}")
        seen.add(word)
    vocab = Vocabulary([word for _, word in authors if word != UNKNOWN_WORD])
    source = {vocab.bos_id: 0, vocab.eos_id: 0}
    for ix, word in authors:
        source[vocab.unk_id if word == UNKNOWN_WORD else vocab.stoi[word]] = ix
    return vocab, source


def token_rows(vocab: Vocabulary, source: Mapping[int, int], embedding: Tensor, logit_weight: Tensor,
               logit_bias: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """Our word embedding, output weight and output bias from the authors' rows (indexed by their token ids).

    ``<eos>`` is never an input, and their row 0 is the start token's embedding; row 0 of their output layer is
    the end token.  Rows without a source keep weight 0 and bias ``NEVER``."""
    embed = embedding.new_zeros(len(vocab), embedding.shape[1])
    weight = logit_weight.new_zeros(len(vocab), logit_weight.shape[1])
    bias = logit_weight.new_full((len(vocab),), NEVER)
    for mine, theirs in source.items():
        if mine != vocab.eos_id:
            embed[mine] = embedding[theirs]
        if mine != vocab.bos_id:
            weight[mine] = logit_weight[theirs]
            bias[mine] = 0.0 if logit_bias is None else logit_bias[theirs]
    return embed, weight, bias
