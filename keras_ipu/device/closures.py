"""What a traced function reads from its closures and globals.

A program `call_compiled` keeps (`compiled_calls.py`) runs again only while the
host values its function reads are unchanged: numbers, strings, 0-d NumPy
arrays (JAX writes them into the program as literals), the queues it
takes from and fills, and the functions of its own it calls (with the methods of
its own classes whose objects it reads).
"""

from __future__ import annotations

import argparse
import dis
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
# Configuration objects: one bound again (a notebook cell parsing its arguments again) is
# another program's; their attributes, as any object's, stay those of the trace.
_NAMESPACES = (argparse.Namespace, types.SimpleNamespace)
# The queues a traced function may read: its program takes from and fills those of its trace.
_QUEUES = (queues.IPUInfeedQueue, queues.IPUOutfeedQueue)
# The methods a library calls on an object of the user's it is given: `obj(...)` runs
# `__call__`, and a layer's (library) `__call__` runs its `call`.
_ENTRY_METHODS = frozenset({"__call__", "call"})
# What reads the same whoever reads it: visited once (an object or module by the names read).
_NAMELESS = (types.FunctionType, types.MethodType, functools.partial)
# The most functions one key walks (a large helper library of the user's would cost
# milliseconds at every call): those further away are not compared.
_FUNCTIONS_WALKED = 64
# Whose functions' globals are their own constants: not walked.
_LIBRARIES = frozenset({"jax", "jaxlib", "keras", "keras_ipu", "numpy", "ml_dtypes", "optree"})


def referenced_values(fn: Callable, depth: int = 8) -> Iterator[Any]:
    """What `fn` (and the functions it calls) reads from closures and globals.

    Bound methods give their object too. An object (or class) of the user's
    own modules has the methods walked that the code reading it names (`H.scale`,
    `self.helper()`), and `__call__` and `call` (a custom layer's, which Keras'
    `__call__` runs): they read globals as functions do. Functions and classes
    of the libraries in `_LIBRARIES` and of installed packages are not walked
    (their globals are their own constants), nor are values read from
    objects' attributes.

    Args:
        fn: A function.
        depth: How many calls deep to follow the functions it reads (of
            `_FUNCTIONS_WALKED` functions at most, the nearest first in each
            branch).

    Returns:
        An iterator over the values, each function's once.

    Example:

    >>> scale = 2.0
    >>> list(referenced_values(lambda x: x * scale))
    [2.0]
    """
    # What was visited, with the depth left then: met again with more depth left (a
    # shorter path) or, for an object, with other names, it is visited again.
    seen: dict = {}
    walked = [0]  # functions walked: the key is made at every call

    def visit(value: Any, depth: int, names: frozenset = frozenset(),
              owner: Any = None) -> Iterator[Any]:
        # `names`: the names the code that read `value` uses, among them the methods it
        # calls on it; `owner`: the object whose method `value` is.
        mark = (id(value), None if isinstance(value, _NAMELESS) else names)
        if depth < 0 or seen.get(mark, -1) >= depth or walked[0] >= _FUNCTIONS_WALKED:
            return
        seen[mark] = depth
        try:  # an object's `__getattr__` may raise anything for these names
            wrapped = getattr(value, "__wrapped__", None)  # a wrapper's (jit, grad) function
            bound_to = getattr(value, "__self__", None)
            inner = getattr(value, "__func__", value)  # a bound method's function
        except Exception:  # noqa: BLE001 - an object that answers no question: opaque
            return
        if isinstance(value, functools.partial):  # its bound arguments, then its function
            yield from read((*value.args, *value.keywords.values()), depth, names)
            yield from visit(value.func, depth, names, owner)
            return
        if wrapped is not None:  # the same call, one wrapper further (a method's too); an
            # object that makes a new one for any name (a Mock) costs depth, to end
            further = depth if isinstance(wrapped, _NAMELESS) else depth - 1
            yield from visit(wrapped, further, names, owner if bound_to is None else bound_to)
        if isinstance(value, types.ModuleType):  # the functions and values of the user's
            # own module that the code names (`helpers.scale(x)`)
            if _users_module(value.__name__):
                members = vars(value)
                yield from read([members[n] for n in names if n in members], depth, names)
            return
        if not isinstance(inner, types.FunctionType):  # an object or a class
            yield from methods(value, names | _ENTRY_METHODS, depth)
            return
        if _of_library(inner):
            return
        walked[0] += 1
        if bound_to is not None:
            yield bound_to
            owner = bound_to
        cells = []
        for cell in inner.__closure__ or ():
            try:
                cells.append(cell.cell_contents)
            except ValueError:  # a cell not filled yet
                continue
        found = inner.__globals__
        global_names, code_names = _names(inner.__code__)
        defaults = (*(inner.__defaults__ or ()), *(inner.__kwdefaults__ or {}).values())
        yield from read([*cells, *defaults, *(found[n] for n in global_names if n in found)],
                        depth, code_names)
        if owner is not None:  # the methods it calls on its own object (`self.helper()`)
            yield from methods(owner, code_names, depth)

    def methods(owner: Any, names: frozenset, depth: int) -> Iterator[Any]:
        # Each method counts as the function it is now (one replaced on its class is
        # another), and what it reads.
        for method in _named_methods(owner, names):
            yield method
            yield from visit(method, depth - 1, frozenset(), owner)

    def read(values: Any, depth: int, names: frozenset) -> Iterator[Any]:
        for value in values:
            yield value
            if not isinstance(value, _HOST_SCALARS):
                yield from visit(value, depth - 1, names)

    return visit(fn, depth)


def host_values(fn: Callable, depth: int = 8) -> tuple:
    """The numbers, strings, enum members, queues, callables and the user's objects `fn`
    (and what it calls) reads from closures and globals: part of a kept program's key.

    Values read from objects' attributes are not seen: a kept program keeps
    those of its trace, as `tf.function` does. Queues, callables, classes and
    the user's objects count (see `host_key`): a queue made again (a notebook
    cell run again) is another program's, as the kept one would take from, and
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
                 if isinstance(value, (*_HOST_SCALARS, *_QUEUES, *_NAMESPACES))
                 or _is_host_0d(value) or callable(value) or _is_users_object(value))


def host_key(value: Any) -> Any:
    """A host value as a kept program's key tells it apart: numbers by their exact value
    (`-0.0` is not `0.0`; a NaN equals itself), 0-d arrays by dtype and bytes, objects of
    default equality (functions, classes, layers) by identity, held weakly, and others by
    value (equal dataclasses, the same bound method).

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
    if type(value).__eq__ is object.__eq__:  # compared by identity: held weakly
        return _Same(value)
    try:  # by value (a dataclass, a bound method): equal ones share a program
        hash(value)
    except TypeError:
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


def _named_methods(value: Any, names: frozenset) -> list:
    """The functions the user's own classes define for `value` (an object, or a class read
    as a global) under `names`, properties' too; not those of installed packages' or the
    standard library's classes. Looked up at every call: a method replaced on its class
    counts from then on."""
    mro = (value if isinstance(value, type) else type(value)).__mro__
    methods = []
    for name in names:
        # Every definition along the classes, an override's `super().name()` reaches them.
        for klass in mro:
            attribute = vars(klass).get(name)
            if attribute is None or not _users_module(klass.__module__):
                continue
            parts = ((attribute.fget, attribute.fset, attribute.fdel)
                     if isinstance(attribute, property)
                     else (getattr(attribute, "__func__", attribute),))  # static, class methods
            methods.extend(part for part in parts if isinstance(part, types.FunctionType))
    return methods


def _is_users_object(value: Any) -> bool:
    """Whether `value` is an object (or a class) of the user's own modules."""
    return _users_module((value if isinstance(value, type) else type(value)).__module__)


@functools.lru_cache(maxsize=1024)
def _users_module(name: str) -> bool:
    """Whether the module is the user's: a notebook's or script's (`__main__`), or a source
    file outside the interpreter's library and its installed packages."""
    if name == "__main__":
        return True
    path = getattr(sys.modules.get(name), "__file__", None)
    if path is None or name.partition(".")[0] in _LIBRARIES:
        return False
    return not _installed(path)


@functools.lru_cache(maxsize=4096)
def _installed(path: str) -> bool:
    """Whether a source file is the interpreter's library's or an installed package's."""
    path = os.path.realpath(path)
    return any(path.startswith(prefix + os.sep) for prefix in _INSTALLED)


# Where the interpreter's own library and installed packages live: their classes' methods
# are not walked (a library object's whole class would be, for every call).
_INSTALLED = tuple(sorted({os.path.realpath(path) for path in (
    *(path for key, path in sysconfig.get_paths().items()
      if key in ("stdlib", "platstdlib", "purelib", "platlib")),
    *site.getsitepackages(), site.getusersitepackages())}))


def _of_library(function: Any) -> bool:
    # By its code's file too: a wrapper (`jax.checkpoint`'s) takes the user's `__module__`.
    if (getattr(function, "__module__", None) or "").partition(".")[0] in _LIBRARIES:
        return True
    return _installed(function.__code__.co_filename)


def _is_host_0d(value: Any) -> bool:
    # JAX writes a 0-d NumPy array into the program as a literal, not as a constant.
    return isinstance(value, np.ndarray) and value.ndim == 0


@functools.lru_cache(maxsize=4096)
def _names(code: Any) -> tuple[frozenset, frozenset]:
    """`(globals, names)` of a code object and the functions defined in it: the global names
    it loads, and every name it uses (attributes too: the methods and module members it
    may call). An attribute named as a global (`self.loss` beside a global `loss`) is not
    that global."""
    loaded, names = set(), set(code.co_names)
    for instruction in dis.get_instructions(code):
        if instruction.opname in _GLOBAL_LOADS:
            loaded.add(instruction.argval)
    for constant in code.co_consts:
        if hasattr(constant, "co_names"):
            inner_loaded, inner_names = _names(constant)
            loaded |= inner_loaded
            names |= inner_names
    return frozenset(loaded), frozenset(names)


# The instructions that read a global (module-level code, a notebook cell's, loads names).
_GLOBAL_LOADS = frozenset({"LOAD_GLOBAL", "LOAD_NAME"})


__all__ = ["host_key", "host_values", "referenced_values"]
