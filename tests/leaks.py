"""A check that code closes what it opens."""

from __future__ import annotations

import gc
import warnings
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def nothing_left_open() -> Iterator[None]:
    """Fail if the block leaves a file, pipe or socket for the garbage collector to close: Python says so only as a
    ResourceWarning, which it shows in development mode (``-X dev``) and otherwise drops."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        yield
        gc.collect()
    assert [str(warning.message) for warning in caught if warning.category is ResourceWarning] == []
