"""A restricted unpickler for the authors' ``infos_*.pkl`` files: only allow-listed, data-only globals.

``pickle.load`` runs whatever callables a file names, so a downloaded pickle is code.  The AoANet ``infos`` file
only needs plain containers, ``argparse.Namespace`` (the training options) and NumPy scalars/arrays (scores,
split indices); anything else is refused with :class:`UnsafePickleError` before it is called.
"""

from __future__ import annotations

import argparse
import codecs
import collections
import copyreg
import functools
import io
import pickle
import types
from pathlib import Path
from typing import Any

import numpy as np

_NUMPY = np._core if hasattr(np, "_core") else np.core  # type: ignore[attr-defined]  # NumPy 2 renamed numpy.core
_NUMPY_CORE, _NUMPY_NUMERIC = _NUMPY.multiarray, _NUMPY.numeric

#: (module, name) → the object; Python 2 spellings (``__builtin__``, ``copy_reg``) and NumPy 1/2 module paths
ALLOWED: dict[tuple[str, str], Any] = {
    ("argparse", "Namespace"): argparse.Namespace,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("builtins", "set"): set, ("__builtin__", "set"): set,
    ("builtins", "frozenset"): frozenset, ("__builtin__", "frozenset"): frozenset,
    ("builtins", "object"): object, ("__builtin__", "object"): object,
    ("copyreg", "_reconstructor"): copyreg._reconstructor, ("copy_reg", "_reconstructor"): copyreg._reconstructor,
    # protocol-2 pickles spell bytes (e.g. a NumPy scalar's buffer) as _codecs.encode(text, "latin1"): data only
    ("_codecs", "encode"): codecs.encode,
    ("numpy", "dtype"): np.dtype, ("numpy", "ndarray"): np.ndarray,
    ("numpy.core.multiarray", "scalar"): _NUMPY_CORE.scalar, ("numpy._core.multiarray", "scalar"): _NUMPY_CORE.scalar,
    ("numpy.core.multiarray", "_reconstruct"): _NUMPY_CORE._reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): _NUMPY_CORE._reconstruct,
    # protocol 5 spells a contiguous array as numeric._frombuffer(its bytes, dtype, shape, order): data only
    ("numpy.core.numeric", "_frombuffer"): _NUMPY_NUMERIC._frombuffer,
    ("numpy._core.numeric", "_frombuffer"): _NUMPY_NUMERIC._frombuffer,
}


#: CPython's Py_TPFLAGS_IMMUTABLETYPE: a type whose attributes cannot be set (built-in and C extension types)
_IMMUTABLE_TYPE = 1 << 8


class UnsafePickleError(pickle.UnpicklingError):
    """The pickle names a global that is not on the allow-list."""


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the globals of :attr:`allowed`; any other is refused with its name."""

    allowed: dict[tuple[str, str], Any] = ALLOWED
    what_is_allowed = "plain data, argparse.Namespace and NumPy values"

    def find_class(self, module: str, name: str) -> Any:
        try:
            allowed = self.allowed[(module, name)]
        except KeyError:
            raise UnsafePickleError(f"refusing to load {module}.{name} from a pickle: only {self.what_is_allowed} "
                                    f"are allowed") from None
        return self._own_copy(allowed)

    def _own_copy(self, allowed: Any) -> Any:
        """This load's own subclass of an allowed Python class, or wrapper of an allowed Python function: the
        BUILD opcode sets attributes on whatever object it is given, the class a pickle names included, so a file
        could change ``argparse.Namespace`` (or ``torch._utils``' rebuilders) for the rest of the process.  Types
        and functions written in C cannot be changed and are given as they are."""
        copies = self.__dict__.setdefault("_copies", {})
        if id(allowed) not in copies:
            if isinstance(allowed, type) and not allowed.__flags__ & _IMMUTABLE_TYPE:
                copy: Any = type(allowed.__name__, (allowed,), {"__module__": allowed.__module__})
            elif isinstance(allowed, types.FunctionType):
                copy = functools.wraps(allowed)(lambda *args, **kwargs: allowed(*args, **kwargs))
            else:
                copy = allowed
            copies[id(allowed)] = copy
        return copies[id(allowed)]


def restricted_load(path: str | Path) -> Any:
    """Load a pickle with the allow-list; ``latin1`` decodes Python 2 ``str`` objects as NumPy's pickles need."""
    data = Path(path).read_bytes()
    try:
        return RestrictedUnpickler(io.BytesIO(data), encoding="latin1").load()
    except UnsafePickleError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, AttributeError, KeyError,
            MemoryError) as error:  # MemoryError: an array whose pickled shape asks for terabytes
        # an empty, truncated or foreign file (a JSON, a zip-format .pth) fails somewhere in the pickle machine;
        # each means "not a pickle this can read", with the reason kept
        raise pickle.UnpicklingError(f"{path} is not a readable pickle ({type(error).__name__}: {error})") from None
