"""Progress bars for long work (training epochs, feature extraction, evaluation, scene generation, archives), alike on
a terminal and in a log.

On a terminal a bar is tqdm's, redrawn in place.  Written to a file or a pipe (``captioner train … > train.log 2>&1``,
a container's log), tqdm's redraws start with a carriage return, which a log keeps: hours of training became one
line of megabytes, shown by ``less`` as its last redraw only and by ``grep`` as one match.  There a bar is a plain
line at most every :data:`LOG_INTERVAL_S` seconds (and at its end) instead, each a line of its own.
"""

from __future__ import annotations

import sys
from typing import IO, Any

from tqdm import tqdm

#: seconds between two progress lines in a log (a terminal's bar is redrawn as tqdm redraws it)
LOG_INTERVAL_S = 60.0


class _Lines:
    """A stream that writes each of tqdm's redraws as a line of its own: the carriage return a redraw starts with
    becomes a line break (none before the first), and the spaces that wipe a longer previous redraw are dropped.
    One bar at a time: bars open together (none of the project's are) would add tqdm's cursor moves."""

    def __init__(self, stream: IO[str]):
        self.stream = stream
        self._inside_line = False

    def write(self, text: str) -> None:
        if text.startswith("\r"):  # a redraw, or a wipe before tqdm.write's line (a carriage return and spaces)
            text = ("\n" if self._inside_line else "") + text.replace("\r", "").rstrip(" ")
        if text:
            self.stream.write(text)
            self._inside_line = not text.endswith("\n")

    def flush(self) -> None:
        self.stream.flush()


def _is_terminal(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # not a file, or a closed one
        return False


def progress_bar(iterable: Any = None, *, file: IO[str] | None = None, **options: Any) -> tqdm:
    """``tqdm(iterable, **options)`` written to ``file`` (standard error by default) as the module says: redrawn in
    place on a terminal, a line every :data:`LOG_INTERVAL_S` seconds elsewhere.  ``disable=None`` keeps tqdm's own
    rule (no bar at all off a terminal)."""
    stream = sys.stderr if file is None else file
    if _is_terminal(stream) or ("disable" in options and options["disable"] is None):
        return tqdm(iterable, file=stream, **options)
    options.setdefault("mininterval", LOG_INTERVAL_S)
    # tqdm otherwise raises its redraw stride after each line, and its monitor thread then forces a redraw of a bar
    # silent for `maxinterval` (10 s): a second line within the minute
    options.setdefault("miniters", 1)
    options.pop("dynamic_ncols", None)  # a log has no width to follow
    return tqdm(iterable, file=_Lines(stream), **options)


def write_above(bar: tqdm, line: str) -> None:
    """Write ``line`` where ``bar`` is written: above the bar on a terminal, between its lines in a log, to standard
    error where the bar is off."""
    # tqdm wipes and redraws only the bars written to the file it is given: the bar's own (a disabled bar has none)
    bar.write(line, file=getattr(bar, "fp", sys.stderr))
