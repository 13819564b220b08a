"""`--input_exprs` of `keras-ipu run`: NumPy constructors only, never arbitrary code.

An expression is parsed, not evaluated by Python: numbers, strings, tuples
and lists, `+ - * /` between them, attributes that are NumPy dtypes
(`np.float32`), and calls of the NumPy constructors in `CONSTRUCTORS` with
such arguments. Anything else is refused with what was found.
"""

from __future__ import annotations

import ast
import operator
from typing import Any

import numpy as np

CONSTRUCTORS = ("array", "asarray", "ones", "zeros", "full", "empty", "arange", "linspace",
                "eye", "identity", "ones_like", "zeros_like", "full_like")
_MODULES = ("np", "numpy")
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
              ast.Div: operator.truediv}


def evaluate(expression: str) -> np.ndarray:
    """The array an expression such as `np.ones((1, 4), dtype=np.float32) * 2` makes.

    Args:
        expression: The expression.

    Returns:
        A NumPy array.

    Raises:
        ValueError: For syntax errors, anything but the allowed forms, and
            allowed forms that fail (`np.ones("abc")`, `1/0`): one line.

    Example:

    >>> evaluate("np.full((2, 2), 3.0)")
    array([[3., 3.],
           [3., 3.]])
    """
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as error:
        raise ValueError(f"Cannot parse {expression!r}: {error.msg}.") from None
    try:
        return np.asarray(_value(tree.body, expression))
    except _Refused:
        raise
    # What the allowed calls and operators raise for bad arguments: ValueError
    # (np.ones(-1)), TypeError (np.ones("abc"), an array + "x"), ArithmeticError
    # (1/0, overflows), MemoryError (an array too large), RecursionError.
    except (ValueError, TypeError, ArithmeticError, MemoryError, RecursionError) as error:
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ValueError(f"Cannot evaluate {expression!r}: {message}.") from None


class _Refused(ValueError):
    """An expression of a form that is not allowed (its message names the expression)."""


def _value(node: ast.AST, expression: str) -> Any:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, complex, str, bool)):
        return node.value
    if isinstance(node, (ast.Tuple, ast.List)):
        items = [_value(item, expression) for item in node.elts]
        return tuple(items) if isinstance(node, ast.Tuple) else items
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _value(node.operand, expression)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_value(node.left, expression),
                                         _value(node.right, expression))
    if isinstance(node, ast.Attribute) and _is_numpy(node.value):
        return _dtype(node.attr, expression)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _is_numpy(
            node.func.value):
        if node.func.attr not in CONSTRUCTORS:
            raise _Refused(
                f"`np.{node.func.attr}` is not allowed in {expression!r}; allowed: "
                f"np.{', np.'.join(CONSTRUCTORS)}.")
        args = [_value(arg, expression) for arg in node.args]
        kwargs = {k.arg: _value(k.value, expression) for k in node.keywords if k.arg}
        if len(kwargs) != len(node.keywords):
            raise _Refused(f"`**` arguments are not allowed in {expression!r}.")
        return getattr(np, node.func.attr)(*args, **kwargs)
    raise _Refused(
        f"Only NumPy constructors, numbers, tuples and lists are allowed in {expression!r}; "
        f"found `{ast.unparse(node)}`.")


def _is_numpy(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id in _MODULES


def _dtype(name: str, expression: str) -> Any:
    try:
        return np.dtype(name).type
    except TypeError:
        raise _Refused(f"`np.{name}` in {expression!r} is not a NumPy dtype.") from None


__all__ = ["CONSTRUCTORS", "evaluate"]
