"""Warnings for arguments IPU TensorFlow deprecated, given only when a caller passes them."""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any


def deprecated_arguments(**instructions: str) -> Callable:
    """Makes a function warn when a caller passes any of the named arguments.

    As TensorFlow's `deprecated_args`, the warning names the argument and
    says what to do instead; arguments left at their defaults stay silent.

    Args:
        **instructions: For each deprecated argument, by name, what to do
            instead.

    Returns:
        A decorator for the function that takes the arguments.

    Example:

    >>> @deprecated_arguments(feed_name="No change needed.")
    ... def make(dataset, feed_name=None): ...
    >>> make([1], feed_name="x")  # DeprecationWarning naming feed_name
    """

    def decorate(function: Callable) -> Callable:
        signature = inspect.signature(function)
        unknown = set(instructions) - set(signature.parameters)
        if unknown:
            raise TypeError(f"{function.__qualname__} takes no arguments {sorted(unknown)}.")

        @functools.wraps(function)
        def warn_then_call(*args: Any, **kwargs: Any) -> Any:
            try:
                passed = signature.bind(*args, **kwargs).arguments
            except TypeError:
                passed = {}  # the call itself raises the clear error
            for name in sorted(instructions.keys() & passed.keys()):
                warnings.warn(
                    f"The argument {name} of {function.__qualname__.split('.')[0]} is "
                    f"deprecated, as in IPU TensorFlow: {instructions[name]}",
                    DeprecationWarning, stacklevel=2)
            return function(*args, **kwargs)

        return warn_then_call

    return decorate
