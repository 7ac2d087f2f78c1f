"""Defaults and helpers that several groups of model-side ``captioner`` subcommands share."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from ..data.datasets import DEFAULT_DATASET, resolve_dataset
from ..data.karpathy import DATASET_FORMATS
from ..files import unwritable
from ..placement import default_checkpoint

#: the checkpoint of the model `make serve` answers with by default, as a path string: below the working folder, or
#: else below this checkout (models/placement.py, default_checkpoint)
DEFAULT_CHECKPOINT = str(default_checkpoint())

DEFAULT_DATA = DEFAULT_DATASET


class CommandGroup:
    """The subcommands of one module, each added by its own function: ``add_commands`` (commands.py) adds them one
    at a time because the groups interleave in the order ``captioner --help`` lists the subcommands."""

    def __init__(self) -> None:
        self._adders: dict[str, Callable[[argparse._SubParsersAction], None]] = {}

    def command(self, name: str):
        """Decorator: the function that adds subcommand ``name`` (its options and its ``func``) to ``sub``."""
        def keep(add: Callable[[argparse._SubParsersAction], None]):
            self._adders[name] = add
            return add
        return keep

    def register(self, sub: argparse._SubParsersAction, name: str) -> None:
        """Add this group's subcommand ``name`` to ``sub``."""
        self._adders[name](sub)


def yes_or_no(text: str) -> bool:
    """argparse type of a grid of booleans (``--block-trigrams on off``): anything else is a usage error, not a
    silent no."""
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is neither on nor off (1/0, true/false, yes/no)")


def at_least(least: int, most: int | None = None) -> Callable[[str], int]:
    """argparse type of a whole number that must be at least ``least`` (and at most ``most``): anything else is a
    usage error naming the option, not a traceback deep in the work (``captioner train``'s counts take theirs from
    TrainConfig's ``least`` metadata)."""
    def whole_number(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
        if most is not None and value > most:
            raise argparse.ArgumentTypeError(f"must be at most {most}, got {value}")
        return value
    return whole_number


#: counts that must be at least 1 (beam width, caption length, threads, images...)
positive_int = at_least(1)
#: counts that may be 0 (the images of a split to generate, captions to show)
count = at_least(0)


def length_penalty(text: str) -> float:
    """argparse type of a GNMT length penalty α: the beam search's own range (models/decoding.py), checked before
    a grid of them is scored rather than in the middle of it."""
    from ..decoding import DecodingRules

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    try:
        return DecodingRules(length_penalty=value).length_penalty
    except ValueError as exc:  # outside the range the beam search accepts
        raise argparse.ArgumentTypeError(str(exc)) from None


def output_file(text: str) -> str:
    """argparse type of a file a command writes when its work is done (a report, captions): a folder, or a file in
    a folder that does not exist or cannot be written, is a usage error at once, not after the captioning it would
    have recorded."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder; give a file name")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"the folder of {text} does not exist")
    why = unwritable(path.parent)
    if why is not None:
        raise argparse.ArgumentTypeError(f"the folder of {text} cannot be written ({why})")
    return text


def refuse_overwrite(out: str | Path, force: bool, what: str = "--out") -> None:
    """Stop, before any work, a command that would write a checkpoint over whatever ``out`` already holds, unless
    ``--force`` says to: a checkpoint a command makes never silently replaces one a user trained or imported."""
    path = Path(out)
    if path.exists() and (not path.is_dir() or any(path.iterdir())) and not force:
        raise SystemExit(f"error: {out} already exists: choose another {what}, or pass --force to replace the "
                         "checkpoint there")


def refuse_input_as_output(outputs: Mapping[str, str | Path | None], files: Iterable[str | Path | None] = (),
                           folders: Iterable[str | Path | None] = ()) -> None:
    """Stop, before any work, a command whose output options (option → path; None: not given) name one of the
    files it reads (``files``), a file already in a folder it reads (``folders``: a checkpoint, a training run), or
    the same file twice: its result would replace what it was made from (``eval --results-json`` over the data
    set's JSON, ``tune-decoding --output`` over the checkpoint's ``config.json``), or one result the other."""
    named = {option: Path(path) for option, path in outputs.items() if path is not None}
    read = {Path(path).resolve() for path in files if path is not None}
    kept = [Path(folder) for folder in folders if folder is not None]
    written: dict[Path, str] = {}
    for option, path in named.items():
        target = path.resolve()
        holder = next((folder for folder in kept if target.exists() and target.is_relative_to(folder.resolve())),
                      None)
        if target in read or holder is not None:
            what = f"a file of {holder}" if holder is not None else "one of the command's inputs"
            raise SystemExit(f"error: {option} {path} is {what}: write it somewhere else")
        if target in written:
            raise SystemExit(f"error: {written[target]} and {option} both name {path}: give each its own file")
        written[target] = option


def dataset_file(dataset: str | Path | None) -> Path | None:
    """The file a ``--dataset`` is read from (None: not given, or not there: the command says so itself)."""
    try:
        return None if dataset is None else resolve_dataset(dataset)
    except FileNotFoundError:
        return None


def figure_file(text: str) -> str:
    """argparse type of a picture a command draws: an :func:`output_file` whose extension names a format Pillow
    writes (``.png``, ``.jpg``, ...), checked before any model runs."""
    from PIL import Image

    output_file(text)
    if Path(text).suffix.lower() not in Image.registered_extensions():
        raise argparse.ArgumentTypeError(f"{text}: give a picture's file name, such as figure.png (the extension "
                                         "chooses the format)")
    return text


#: Python's spellings of JSON's literals, as a Python user types them (``--set pre_norm=False``): read as the
#: string "False", they would count as true
_PYTHON_LITERALS = {"True": True, "False": False, "None": None}


def parse_value(text: str) -> Any:
    """A ``KEY=VALUE`` value: JSON (numbers, true/false, null, lists...), Python's True/False/None, else the text."""
    if text in _PYTHON_LITERALS:
        return _PYTHON_LITERALS[text]
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def key_values(pairs: list[str]) -> dict[str, Any]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"error: expected KEY=VALUE, got {pair!r}")
        out[key.replace("-", "_")] = parse_value(value)
    return out


IMAGE_ROOT_HELP = "folder the data set's image paths are relative to (default: where its layout puts them)"


def add_dataset_options(parser: argparse.ArgumentParser, *, dataset_help: str | None = None,
                        image_root_help: str | None = None) -> None:
    """``--dataset`` (default: the generated scenes) and ``--image-root``, as every command that reads a split has."""
    parser.add_argument("--dataset", default=DEFAULT_DATA,
                        help=dataset_help or f"{DATASET_FORMATS} (default: {DEFAULT_DATA})")
    parser.add_argument("--image-root", help=image_root_help or IMAGE_ROOT_HELP)


def add_cache_option(parser: argparse.ArgumentParser) -> None:
    """``--cache-dir``, where every command that reads photos keeps their encoded grid features."""
    parser.add_argument("--cache-dir", default=".cache/features", help="folder where the photos' grid features are "
                        "extracted once per encoder spec and reused (default .cache/features)")


def add_decoding_options(parser: argparse.ArgumentParser) -> None:
    """The beam search's rules against short and repetitive captions (models/decoding.py, DecodingRules)."""
    parser.add_argument("--length-penalty", type=length_penalty, metavar="ALPHA",
                        help="GNMT length penalty α, 0 to 5 (default: the checkpoint's, chosen on validation by "
                             "`captioner tune-decoding`; 0: none)")
    parser.add_argument("--block-trigrams", action=argparse.BooleanOptionalAction, default=None,
                        help="never repeat a word trigram within a caption (default: the checkpoint's)")
    parser.add_argument("--block-doubled-words", action=argparse.BooleanOptionalAction, default=None,
                        help="never follow a word with itself, as in 'green green' (default: the checkpoint's)")


def add_search_options(parser: argparse.ArgumentParser, rules: bool = True) -> None:
    """The beam search's width and length (and, with ``rules``, :func:`add_decoding_options`), as every command that
    captions has them."""
    parser.add_argument("--beam-size", type=positive_int, default=3, help="beam width (default 3)")
    parser.add_argument("--max-len", type=positive_int, default=20, help="most words per caption (default 20)")
    if rules:
        add_decoding_options(parser)


def add_device_options(parser: argparse.ArgumentParser) -> None:
    """Where a command runs its networks."""
    parser.add_argument("--device", default="auto", help="auto (a GPU when there is one), cpu, cuda or cuda:N")
    add_threads_option(parser)


def add_threads_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=positive_int, help="CPU threads of PyTorch (default: one per core)")


def decoding_rules(ckpt, args: argparse.Namespace):
    from ..decoding import DecodingRules

    return DecodingRules.of_checkpoint(ckpt.meta).overridden_by(args)


def load_split(dataset, image_root, split: str, **options) -> list:
    """One split's captioned images (``load_captioned``'s ``options``); a split with none, a name the data set does
    not use included, is a one-line error before any work that names the splits it has."""
    from ..data.datasets import EmptySplitError, load_split as split_images

    try:
        return split_images(dataset, image_root, split, **options)
    except EmptySplitError as exc:
        raise SystemExit(f"error: {exc}") from None


def split_with_features(ckpt, dataset, image_root, split: str, limit: int | None, cache_dir,
                        device: str = "cpu") -> tuple[list, Any]:
    """One split's captioned images (an empty split is a one-line error) and the store of the visual items ``ckpt``
    was trained on (its grid, or the region folder its run read), extracted once into ``cache_dir``."""
    from ..data.stores import open_feature_store

    images = load_split(dataset, image_root, split, limit=limit)
    return images, open_feature_store(ckpt.trained_features, images, ckpt.encoder, cache_dir, device=device)


def checkpoint_labels(checkpoints: Sequence[str | Path]) -> list[str]:
    """Their names (:func:`~captioner.models.checkpoint.checkpoint_name`, as the service names them), except that
    checkpoints whose names coincide (``weights/sat`` and ``weights/flickr8k/sat``) are named by their paths as
    given."""
    from ..checkpoint import checkpoint_name

    short = [checkpoint_name(c) for c in checkpoints]
    return [str(c) if short.count(label) > 1 else label for c, label in zip(checkpoints, short)]
