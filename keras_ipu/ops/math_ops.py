"""Maths operators of `tensorflow.python.ipu.math_ops`, on JAX arrays.

Example:

```python
from keras_ipu.ops import math_ops

c = math_ops.serialized_matmul(a, b, 4, "a_columns")
```
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from keras_ipu.device import integers

# Where a serialized multiply splits `a [..., m, k] @ b [..., k, n]`:
# (axis of a, axis of b) split, or None; and how the parts combine.
_SPLITS = {
    "a_columns": ((-2, None), "concat_m"),
    "a_rows_b_columns": ((-1, -2), "sum"),
    "b_rows": ((None, -1), "concat_n"),
}


def serialized_matmul(a: Any, b: Any, serialization_factor: int, serialization_dimension: str,
                      transpose_a: bool = False, transpose_b: bool = False,
                      name: str | None = None) -> jax.Array:
    """`a @ b`, computed as `serialization_factor` smaller multiplies one after the other.

    Args:
        a: `[..., m, k]` (after `transpose_a`), rank 2 or more.
        b: `[..., k, n]` (after `transpose_b`), with `a`'s batch dimensions.
        serialization_factor: The number of smaller multiplies; it must
            divide the dimension split.
        serialization_dimension: `"a_columns"` (split `m`), `"a_rows_b_columns"`
            (split `k`, the parts' products added) or `"b_rows"` (split `n`).
        transpose_a: Transpose `a`'s inner two dimensions first.
        transpose_b: Transpose `b`'s inner two dimensions first.
        name: Accepted for compatibility.

    Returns:
        `a @ b`, of their type.

    Raises:
        ValueError: For an unknown `serialization_dimension`, a vector, shapes
            that do not multiply, or a factor that does not divide the
            dimension split.

    Example:

    >>> serialized_matmul(jnp.ones((4, 6)), jnp.ones((6, 2)), 3, "a_rows_b_columns")
    Array([[6., 6.], ...], dtype=float32)
    """
    if serialization_dimension not in _SPLITS:
        raise ValueError(f"Unknown serialization_dimension {serialization_dimension!r}; "
                         f"valid: {', '.join(_SPLITS)}.")
    a, b = jnp.asarray(a), jnp.asarray(b)
    if a.ndim < 2 or b.ndim < 2:  # IPU TensorFlow's op takes matrices, not vectors
        raise ValueError(f"serialized_matmul takes a and b of rank 2 or more (matrices), got "
                         f"shapes {a.shape} and {b.shape}.")
    a = jnp.swapaxes(a, -1, -2) if transpose_a else a
    b = jnp.swapaxes(b, -1, -2) if transpose_b else b
    _check_shapes(a.shape, b.shape)
    (axis_a, axis_b), combine = _SPLITS[serialization_dimension]
    size = a.shape[axis_a] if axis_a is not None else b.shape[axis_b]
    serialization_factor = checked_factor(serialization_factor, size,
                                          f"the {serialization_dimension} dimension")
    parts_a = jnp.split(a, serialization_factor, axis_a) if axis_a is not None else None
    parts_b = jnp.split(b, serialization_factor, axis_b) if axis_b is not None else None
    products = [jnp.matmul(parts_a[i] if parts_a else a, parts_b[i] if parts_b else b)
                for i in range(serialization_factor)]
    if combine == "sum":
        return sum(products[1:], products[0])
    return jnp.concatenate(products, axis=-2 if combine == "concat_m" else -1)


__all__ = ["serialized_matmul"]


def _check_shapes(a: tuple, b: tuple) -> None:
    """Refuses shapes `a @ b` cannot take, named as given (the parts would name others)."""
    try:
        batch = jnp.broadcast_shapes(a[:-2], b[:-2])
    except ValueError:
        batch = None
    if a[-1] != b[-2] or batch is None:
        raise ValueError(f"serialized_matmul multiplies a [..., m, k] by b [..., k, n] with "
                         f"broadcastable batch dimensions; got a {a} and b {b} (after "
                         f"transpose_a/transpose_b).")


def checked_factor(serialization_factor: Any, size: int, what: str) -> int:
    """`serialization_factor` as an int, checked to be positive and to divide `size`.

    Args:
        serialization_factor: The factor given: an int, or a NumPy or 0-d
            integer array (not a bool, nor a float such as `2.0`).
        size: The size it splits.
        what: What is split, for the message (`"the a_columns dimension"`).

    Returns:
        The factor as a Python int.

    Raises:
        ValueError: For anything else, naming the value and `size`.

    Example:

    >>> checked_factor(2, 6, "the a_columns dimension")
    2
    """
    factor = integers.integer_of(serialization_factor)
    if factor is None or factor < 1 or size % factor:
        raise ValueError(f"serialization_factor must be a positive integer dividing {what} "
                         f"({size}), got {serialization_factor!r}.")
    return factor
