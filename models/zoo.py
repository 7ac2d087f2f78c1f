"""The captioners by name: importing this module imports (and so registers) every built-in model file, then the
model modules other installed packages name under the entry-point group ``captioner.models``.

``create(name, **config)`` is the one way the rest of the project builds a model.  A model of this project is a
file imported below; one of another package is a module it names in its own ``pyproject.toml``::

    [project.entry-points."captioner.models"]
    show-tell = "my_package.show_tell"    # a module whose class is decorated with @register("show-tell")

so that every command, the service and its ONNX export child know it without this package being edited.
"""

from __future__ import annotations

import importlib.metadata
import warnings

from . import aoanet, area_transformer, ensemble, sat, sat_hard, sparsecap, xlan, xtransformer  # noqa: F401 (registers)
from .registry import PROTOCOL_ARGUMENTS, REQUIRED, UnknownModel, available, create, options

__all__ = ["PLUGIN_GROUP", "PROTOCOL_ARGUMENTS", "REQUIRED", "UnknownModel", "available", "create", "options"]

PLUGIN_GROUP = "captioner.models"


def load_plugins() -> dict[str, str]:
    """Import every module named under :data:`PLUGIN_GROUP` (each registers its models); returns the ones that
    failed, ``{entry name: why}``, each also warned about. A broken plugin leaves the built-in models served:
    a checkpoint of one of its models is then an unknown model, named with the registered ones."""
    failed = {}
    for entry in importlib.metadata.entry_points(group=PLUGIN_GROUP):
        try:
            entry.load()
        except Exception as exc:  # whatever a third-party module raises on import
            failed[entry.name] = f"{exc.__class__.__name__}: {exc}"
            warnings.warn(f"the model plugin {entry.name!r} ({entry.value}, entry-point group {PLUGIN_GROUP}) "
                          f"failed to load: {failed[entry.name]}", RuntimeWarning, stacklevel=2)
    return failed


load_plugins()
