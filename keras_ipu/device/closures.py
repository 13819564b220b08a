"""What a traced function reads from its closures and globals.

A program `call_compiled` keeps (`compiled_calls.py`) runs again only while the
host values its function reads are unchanged: numbers, strings, 0-d NumPy
arrays (JAX writes them into the program as literals), the queues it
takes from and fills, and the functions of its own it calls (with the methods of
its own classes whose objects it reads).
"""

from __future__ import annotations

import enum
import functools
import os
import site
import sys
import sysconfig
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from keras_ipu.device import queues

# Host values a traced function may read and fix in its program: a kept program is run
# again only while those it reads from its closure and globals are unchanged.
_HOST_SCALARS = (bool, int, float, complex, str, bytes, type(None), np.generic, enum.Enum)
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
        if depth < 0 or id(function) in seen:
            return
        seen.add(id(function))
        try:  # an object's `__getattr__` may raise anything for these names
            wrapped = getattr(function, "__wrapped__", None)  # a wrapper's (jit, grad) function
            owner = getattr(function, "__self__", None)
            inner = getattr(function, "__func__", function)  # a bound method's function
        except Exception:  # noqa: BLE001 - an object that answers no question: opaque
            return
        if isinstance(function, functools.partial):  # its bound arguments, then its function
            yield from read((*function.args, *function.keywords.values()), depth)
            yield from visit(function.func, depth - 1)
            return
        if wrapped is not None:
            yield from visit(wrapped, depth - 1)
        if not isinstance(inner, types.FunctionType):  # an object or a class: its own
            # methods read globals as functions do
            for method in _own_methods(function):
                yield from visit(method, depth - 1)
            return
        if _of_library(inner):
            return
        if owner is not None:
            yield from read((owner,), depth)
        cells = []
        for cell in inner.__closure__ or ():
            try:
                cells.append(cell.cell_contents)
            except ValueError:  # a cell not filled yet
                continue
        found = inner.__globals__
        names = _global_names(inner.__code__)
        yield from read(cells + [found[name] for name in names if name in found], depth)

    def read(values: Any, depth: int) -> Iterator[Any]:
        for value in values:
            yield value
            if not isinstance(value, _HOST_SCALARS):
                yield from visit(value, depth - 1)

    return visit(fn, depth)


def host_values(fn: Callable, depth: int = 8) -> tuple:
    """The numbers, strings, enum members, queues, callables and the user's objects `fn`
    (and what it calls) reads from closures and globals: part of a kept program's key.

    Values read from objects' attributes are not seen: a kept program keeps
    those of its trace, as `tf.function` does. Queues, callables, classes and
    the user's objects count by identity: a queue made again (a notebook cell
    run again) is another program's, as the kept one would take from, and
    fill, the old queue; a helper function defined again, or a global bound to
    another function or object, is traced again (its code may differ).

    Args:
        fn: The traced function.
        depth: How many calls deep to follow the functions it reads.

    Returns:
        `host_key(value)` per host value, in the order read.

    Example:

    >>> scale = 2.0
    >>> host_values(lambda x: x * scale)
    ((<class 'float'>, '0x1.0000000000000p+1'),)
    """
    return tuple(host_key(value) for value in referenced_values(fn, depth)
                 if isinstance(value, (*_HOST_SCALARS, *_QUEUES)) or _is_host_0d(value)
                 or callable(value) or _own_methods(value))


def host_key(value: Any) -> Any:
    """A host value as a kept program's key tells it apart: numbers by their exact value
    (`-0.0` is not `0.0`; a NaN equals itself), 0-d arrays by dtype and bytes, callables,
    classes and the user's objects by identity.

    Args:
        value: A value the traced function reads, or a fixed argument.

    Returns:
        A hashable key (unhashable only for an unhashable value of another kind).

    Example:

    >>> host_key(-0.0) == host_key(0.0)
    False
    """
    if _is_host_0d(value) or isinstance(value, np.generic):
        return (type(value), value.dtype.str, value.tobytes())
    if isinstance(value, float):
        return (float, value.hex())
    if isinstance(value, complex):
        return (complex, value.real.hex(), value.imag.hex())
    if isinstance(value, (*_HOST_SCALARS, *_QUEUES)):
        return (type(value), value)
    if callable(value) or _own_methods(value):
        return _Same(value)
    return (type(value), value)


class _Same:
    """An object in a key, equal only to itself while it lives: held weakly where it can be
    (a key kept for a function must not keep the models its closure read alive), so a new
    object that takes a dead one's `id` is not it."""

    __slots__ = ("_held", "_id")

    def __init__(self, value: Any):
        self._id = id(value)
        try:
            self._held = weakref.ref(value)
        except TypeError:  # not weakly referable: held
            self._held = lambda: value

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Same) or other._id != self._id:
            return False
        value = self._held()
        return value is not None and other._held() is value

    def __hash__(self) -> int:
        return self._id


def _own_methods(value: Any) -> tuple:
    """The functions the user's classes define for `value` (an object, or a class read as a
    global), properties' too: not those of installed packages' or the standard library's."""
    return _methods_of_class(value if isinstance(value, type) else type(value))


@functools.lru_cache(maxsize=512)  # a kept program's key is made at every call
def _methods_of_class(cls: type) -> tuple:
    methods = []
    for klass in cls.__mro__:
        if not _users_module(klass.__module__):
            continue
        for attribute in vars(klass).values():
            parts = ((attribute.fget, attribute.fset, attribute.fdel)
                     if isinstance(attribute, property)
                     else (getattr(attribute, "__func__", attribute),))  # static, class methods
            methods.extend(part for part in parts if isinstance(part, types.FunctionType))
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


def _of_library(function: Any) -> bool:
    return (getattr(function, "__module__", None) or "").partition(".")[0] in _LIBRARIES


def _is_host_0d(value: Any) -> bool:
    # JAX writes a 0-d NumPy array into the program as a literal, not as a constant.
    return isinstance(value, np.ndarray) and value.ndim == 0


@functools.lru_cache(maxsize=4096)
def _global_names(code: Any) -> frozenset:
    """The global names a code object and the functions defined in it use."""
    names = set(code.co_names)
    for constant in code.co_consts:
        if hasattr(constant, "co_names"):
            names |= _global_names(constant)
    return frozenset(names)


__all__ = ["host_key", "host_values", "referenced_values"]
