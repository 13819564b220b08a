"""Histogram operators of `tensorflow.python.ipu.statistics_ops`, on JAX arrays.

A histogram over `levels` (ascending bin boundaries) has `len(levels) + 1`
bins: bin 0 counts the values below `levels[0]`, bin `i` those in
`[levels[i-1], levels[i])`, the last those at or above `levels[-1]` (the
rule of `numpy.digitize`). `fixed_width_bins(inputs, n_bins)` gives the
`n_bins - 1` boundaries that split `[min(inputs), max(inputs)]` into
`n_bins` bins of equal width, so that the two together make an `n_bins`-bin
histogram of everything. Counts are floats, as Poplar's are.

Example:

```python
from keras_ipu.ops import statistics_ops

levels = statistics_ops.fixed_width_bins(activations, 10)
hist = statistics_ops.histogram(activations, levels)
```
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def _values(inputs: Any, absolute_of_input: bool = False) -> jax.Array:
    values = jnp.ravel(jnp.asarray(inputs))
    if not jnp.issubdtype(values.dtype, jnp.floating):
        values = values.astype(jnp.float32)
    return jnp.abs(values) if absolute_of_input else values


def fixed_width_bins(inputs: Any, n_bins: int) -> jax.Array:
    """The boundaries of `n_bins` equal-width bins over the range of `inputs`.

    Args:
        inputs: The values (a rank-1 array; other ranks are flattened).
        n_bins: The number of bins, a Python int of at least 1.

    Returns:
        A rank-1 array of `n_bins - 1` ascending boundaries.

    Raises:
        ValueError: For `n_bins` below 1, or no values.

    Example:

    >>> fixed_width_bins(jnp.array([0.0, 4.0, 1.0]), 4)
    Array([1., 2., 3.], dtype=float32)
    """
    if isinstance(n_bins, bool) or not isinstance(n_bins, (int, np.integer)) or n_bins < 1:
        raise ValueError(f"n_bins must be an int of at least 1, got {n_bins!r}.")
    values = _values(inputs)
    if values.size == 0:
        raise ValueError("fixed_width_bins needs at least one value.")
    low, high = values.min(), values.max()
    return low + (high - low) * (jnp.arange(1, n_bins, dtype=values.dtype) / n_bins)


def histogram(inputs: Any, levels: Any, absolute_of_input: bool = False) -> jax.Array:
    """Counts `inputs` in the bins `levels` bounds.

    Args:
        inputs: The values (rank-1; other ranks are flattened).
        levels: Ascending bin boundaries, rank 1.
        absolute_of_input: Bin the magnitudes `|inputs|`.

    Returns:
        A rank-1 array of `len(levels) + 1` counts, in the inputs' float
        dtype (float32 for integer inputs).

    Raises:
        ValueError: When `levels` is not rank 1.

    Example:

    >>> histogram(jnp.array([0.5, 1.0, 2.5, 9.0]), jnp.array([1.0, 2.0, 3.0]))
    Array([1., 1., 1., 1.], dtype=float32)
    """
    values = _values(inputs, absolute_of_input)
    levels = jnp.asarray(levels)
    if levels.ndim != 1:
        raise ValueError(f"levels must be rank 1, got shape {levels.shape}.")
    bins = jnp.searchsorted(levels.astype(values.dtype), values, side="right")
    return jnp.zeros(levels.shape[0] + 1, values.dtype).at[bins].add(1)


def histogram_update(hist: Any, inputs: Any, levels: Any,
                     absolute_of_input: bool = False) -> jax.Array:
    """`hist` plus the histogram of `inputs` over `levels`.

    Args:
        hist: The counts so far, `len(levels) + 1` of them.
        inputs: The new values.
        levels: Ascending bin boundaries, rank 1.
        absolute_of_input: Bin the magnitudes `|inputs|`.

    Returns:
        The updated counts, `hist`'s dtype.

    Raises:
        ValueError: When `hist` does not have `len(levels) + 1` entries.

    Example:

    >>> hist = histogram_update(hist, batch, levels)
    """
    hist = jnp.asarray(hist)
    levels = jnp.asarray(levels)
    if hist.shape != (levels.shape[0] + 1,):
        raise ValueError(f"hist must have len(levels) + 1 = {levels.shape[0] + 1} entries, got "
                         f"shape {hist.shape}.")
    return hist + histogram(inputs, levels, absolute_of_input).astype(hist.dtype)


__all__ = ["fixed_width_bins", "histogram", "histogram_update"]
