"""Histogram operators of `tensorflow.python.ipu.statistics_ops`, on JAX arrays.

A histogram over `levels` (ascending bin boundaries) has `len(levels) + 1`
float32 counts, as Poplar's: entry 0 counts the values below `levels[0]`,
entry `i` those in `[levels[i-1], levels[i])`, the last those at or above
`levels[-1]` (the rule of `numpy.digitize`). `fixed_width_bins(inputs,
n_bins)` gives `n_bins` evenly spaced levels from the smallest to the
largest input, as IPU TensorFlow does (so the last entry counts the values
equal to the largest).

Example:

```python
from keras_ipu.ops import statistics_ops

levels = statistics_ops.fixed_width_bins(activations, 10)
hist = statistics_ops.histogram(activations, levels)   # 11 counts
```
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_FLOATS = (jnp.float16, jnp.float32)


def _rank_one_floats(function: str, **arrays: Any) -> dict[str, jax.Array]:
    arrays = {name: jnp.asarray(value) for name, value in arrays.items()}
    for name, array in arrays.items():
        if array.dtype not in _FLOATS:
            raise ValueError(f"{function}: only float16 and float32 are supported, got {name} "
                             f"of {array.dtype}.")
        if array.ndim != 1:
            raise ValueError(f"{function} expects rank-1 arrays, got {name} of shape "
                             f"{array.shape}.")
    return arrays


def fixed_width_bins(inputs: Any, n_bins: int) -> jax.Array:
    """`n_bins` evenly spaced levels from the smallest to the largest of `inputs`.

    Args:
        inputs: The values, rank 1.
        n_bins: The number of levels, a Python int of at least 1.

    Returns:
        A rank-1 array: `linspace(min(inputs), max(inputs), n_bins)`.

    Raises:
        ValueError: For `n_bins` below 1, inputs not of rank 1, or no values.

    Example:

    >>> fixed_width_bins(jnp.array([0.0, 4.0, 1.0]), 5)
    Array([0., 1., 2., 3., 4.], dtype=float32)
    """
    if isinstance(n_bins, bool) or not isinstance(n_bins, (int, np.integer)) or n_bins < 1:
        raise ValueError(f"n_bins must be an int of at least 1, got {n_bins!r}.")
    values = jnp.asarray(inputs)
    if values.ndim != 1:  # as `histogram` takes them
        raise ValueError(f"fixed_width_bins expects a rank-1 array, got inputs of shape "
                         f"{values.shape}.")
    if values.size == 0:
        raise ValueError("fixed_width_bins needs at least one value.")
    return jnp.linspace(values.min(), values.max(), int(n_bins))


def histogram(inputs: Any, levels: Any, absolute_of_input: bool = False) -> jax.Array:
    """Counts `inputs` in the bins `levels` bounds.

    Args:
        inputs: Rank-1 float16 or float32 values.
        levels: Rank-1 float16 or float32 ascending bin boundaries.
        absolute_of_input: Bin the magnitudes `|inputs|`.

    Returns:
        A rank-1 float32 array of `len(levels) + 1` counts.

    Raises:
        ValueError: For arrays that are not rank-1 float16 or float32.

    Example:

    >>> histogram(jnp.array([0.5, 1.0, 2.5, 9.0]), jnp.array([1.0, 2.0, 3.0]))
    Array([1., 1., 1., 1.], dtype=float32)
    """
    arrays = _rank_one_floats("histogram", inputs=inputs, levels=levels)
    return _counts(arrays["inputs"], arrays["levels"], absolute_of_input)


def _counts(values: jax.Array, levels: jax.Array, absolute_of_input: bool) -> jax.Array:
    values = jnp.abs(values) if absolute_of_input else values
    dtype = jnp.promote_types(values.dtype, levels.dtype)
    bins = jnp.searchsorted(levels.astype(dtype), values.astype(dtype), side="right")
    return jnp.zeros(levels.shape[0] + 1, jnp.float32).at[bins].add(1)


def histogram_update(hist: Any, inputs: Any, levels: Any,
                     absolute_of_input: bool = False) -> jax.Array:
    """`hist` plus the histogram of `inputs` over `levels`.

    Args:
        hist: Rank-1 float32 counts so far, `len(levels) + 1` of them.
        inputs: Rank-1 float16 or float32 new values.
        levels: Rank-1 float16 or float32 ascending bin boundaries.
        absolute_of_input: Bin the magnitudes `|inputs|`.

    Returns:
        The updated float32 counts.

    Raises:
        ValueError: When `hist` is not float32 or does not have
            `len(levels) + 1` entries, or for arrays that are not rank-1
            float16 or float32.

    Example:

    >>> hist = histogram_update(hist, batch, levels)
    """
    arrays = _rank_one_floats("histogram_update", hist=hist, inputs=inputs, levels=levels)
    hist, levels = arrays["hist"], arrays["levels"]
    if hist.dtype != jnp.float32:
        raise ValueError(f"histogram_update: hist must be float32, got {hist.dtype}.")
    if hist.shape[0] != levels.shape[0] + 1:
        raise ValueError(f"histogram_update: for {levels.shape[0]} levels hist must have "
                         f"{levels.shape[0] + 1} entries, got {hist.shape[0]}.")
    return hist + _counts(arrays["inputs"], levels, absolute_of_input)


__all__ = ["fixed_width_bins", "histogram", "histogram_update"]
