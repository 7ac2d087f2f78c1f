"""Imports every built-in captioner so that its ``@register`` runs; add new model modules here."""

from . import sat  # noqa: F401
from . import sparsecap  # noqa: F401
from . import area_transformer  # noqa: F401
from . import aoanet  # noqa: F401
from . import sat_hard  # noqa: F401
from . import xlan  # noqa: F401
from . import xtransformer  # noqa: F401
