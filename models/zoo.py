"""Imports every built-in captioner so that its ``@register`` runs; add new model modules here."""

from . import sat  # noqa: F401
from . import sparsecap  # noqa: F401
from . import area_transformer  # noqa: F401
