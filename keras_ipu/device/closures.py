"""What a traced function reads from its closures and globals.

A program `call_compiled` keeps (`compiled_calls.py`) runs again only while the
host values its function reads are unchanged: numbers, strings, 0-d NumPy
arrays (JAX writes them into the program as literals), the queues it
takes from and fills, and the functions of its own it calls (with the methods of
its own classes whose objects it reads).
"""

from __future__ import annotations

import functools
import os
import site
import sys
import sysconfig
import types
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from keras_ipu.device import queues

# Host values a traced function may read and fix in its program: a kept program is run
# again only while those it reads from its closure and globals are unchanged.
_HOST_SCALARS = (bool, int, float, complex, str, bytes, type(None), np.generic)
# The queues a traced function may read: its program takes from and fills those of its trace.
_QUEUES = (queues.IPUInfeedQueue, queues.IPUOutfeedQueue)
# Whose functions' globals are their own constants: not walked.
_LIBRARIES = frozenset({"jax", "jaxlib", "keras", "keras_ipu", "numpy", "ml_dtypes", "optree"})


def referenced_values(fn: Callable, depth: int = 8) -> Iterator[Any]:
    """What `fn` (and the functions it calls) reads from closures and globals.

    Bound methods give their object too, and an object read there has the
    methods of its own class walked (a custom layer's `call`, which reads
    globals as a function does); functions and classes of the libraries in
    `_LIBRARIES` are not walked (their globals are their own constants), nor
    are values read from objects' attributes.

    Args:
        fn: A function.
        depth: How many calls deep to follow the functions it reads.

    Returns:
        An iterator over the values, each function's once.

    Example:

    >>> scale = 2.0
    >>> list(referenced_values(lambda x: x * scale))
    [2.0]
    """
    seen: set = set()

    def visit(function: Any, depth: int) -> Iterator[Any]:
        if isinstance(function, functools.partial):
            function = function.func
        if not hasattr(function, "__code__") and hasattr(function, "__wrapped__"):
            function = function.__wrapped__  # a callable wrapper's function
        owner = getattr(function, "__self__", None)
        function = getattr(function, "__func__", function)  # a bound method's function
        code = getattr(function, "__code__", None)
        if depth < 0 or id(function) in seen or _of_library(function):
            return
        seen.add(id(function))
        if code is None:  # an object: its class's methods read globals as its functions do
            for method in _own_methods(function):
                yield from visit(method, depth - 1)
            return
        if owner is not None:
            yield owner
        cells = []
        for cell in function.__closure__ or ():
            try:
                cells.append(cell.cell_contents)
            except ValueError:  # a cell not filled yet
                continue
        found = function.__globals__
        for value in cells + [found[name] for name in _global_names(code) if name in found]:
            yield value
            if (callable(value) and not isinstance(value, type)) or _own_methods(value):
                yield from visit(value, depth - 1)

    return visit(fn, depth)


def host_values(fn: Callable, depth: int = 8) -> tuple:
    """The numbers, strings, queues and functions `fn` (and what it calls) reads from
    closures and globals: part of a kept program's key.

    Values read from objects' attributes are not seen: a kept program keeps
    those of its trace, as `tf.function` does. Queues and functions count by
    identity: a queue made again (a notebook cell run again) is another
    program's, as the kept one would take from, and fill, the old queue; a
    helper function defined again is traced again (its code may differ).

    Args:
        fn: The traced function.
        depth: How many calls deep to follow the functions it reads.

    Returns:
        `(type, value)` per host value (a queue or function by identity, a
        0-d array by its dtype and bytes), in the order read.

    Example:

    >>> scale = 2.0
    >>> host_values(lambda x: x * scale)
    ((<class 'float'>, 2.0),)
    """
    return tuple(_host_key(value) for value in referenced_values(fn, depth)
                 if isinstance(value, (*_HOST_SCALARS, *_QUEUES))
                 or _is_host_0d(value) or _is_own_function(value))


def _own_methods(value: Any) -> tuple:
    """The functions the user's classes define for `value` (a custom layer's `call`): not
    those of installed packages' or the standard library's classes."""
    return _methods_of_class(type(value))


@functools.lru_cache(maxsize=512)  # a kept program's key is made at every call
def _methods_of_class(cls: type) -> tuple:
    methods = []
    for klass in cls.__mro__:
        if not _users_module(klass.__module__):
            continue
        for attribute in vars(klass).values():
            attribute = getattr(attribute, "__func__", attribute)  # static and class methods
            if isinstance(attribute, types.FunctionType):
                methods.append(attribute)
    return tuple(methods)


@functools.lru_cache(maxsize=1024)
def _users_module(name: str) -> bool:
    """Whether the module is the user's: a notebook's or script's (`__main__`), or a source
    file outside the interpreter's library and its installed packages."""
    if name == "__main__":
        return True
    path = getattr(sys.modules.get(name), "__file__", None)
    if path is None or name.partition(".")[0] in _LIBRARIES:
        return False
    path = os.path.realpath(path)
    return not any(path.startswith(prefix + os.sep) for prefix in _INSTALLED)


# Where the interpreter's own library and installed packages live: their classes' methods
# are not walked (a library object's whole class would be, for every call).
_INSTALLED = tuple(sorted({os.path.realpath(path) for path in (
    *(path for key, path in sysconfig.get_paths().items()
      if key in ("stdlib", "platstdlib", "purelib", "platlib")),
    *site.getsitepackages(), site.getusersitepackages())}))


def _is_own_function(value: Any) -> bool:
    # The user's functions the traced one calls: the libraries' are the same objects for ever.
    return isinstance(value, types.FunctionType) and not _of_library(value)


def _of_library(function: Any) -> bool:
    return (getattr(function, "__module__", None) or "").partition(".")[0] in _LIBRARIES


def _is_host_0d(value: Any) -> bool:
    # JAX writes a 0-d NumPy array into the program as a literal, not as a constant.
    return isinstance(value, np.ndarray) and value.ndim == 0


def _host_key(value: Any) -> tuple:
    if _is_host_0d(value):
        return (np.ndarray, value.dtype.str, value.tobytes())
    return (type(value), value)


@functools.lru_cache(maxsize=4096)
def _global_names(code: Any) -> frozenset:
    """The global names a code object and the functions defined in it use."""
    names = set(code.co_names)
    for constant in code.co_consts:
        if hasattr(constant, "co_names"):
            names |= _global_names(constant)
    return frozenset(names)


__all__ = ["host_values", "referenced_values"]
