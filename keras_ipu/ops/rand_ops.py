"""Random operators of `tensorflow.python.ipu.rand_ops`.

Example:

```python
from keras_ipu.ops import rand_ops

y = rand_ops.dropout(x, rate=0.1, seed=[1, 2])
```
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def dropout(x: Any, rate: float = 0.5, noise_shape: Any = None, seed: Any = None,
            name: str | None = None, **kwargs: Any) -> Any:
    """Zeroes elements with probability `rate`, scaling the rest by `1 / (1 - rate)`.

    Args:
        x: The input.
        rate: The probability that an element is zeroed, in [0, 1).
        noise_shape: The shape of the mask, or `None` (`x`'s): as long as
            `x`'s shape, each entry 1 (the mask is shared along that axis)
            or `x`'s.
        seed: An integer, IPU TensorFlow's pair of 32-bit integers, or a
            `keras.random.SeedGenerator`. A fixed seed gives the same mask at
            every call; inside a compiled step, pass a `SeedGenerator` (a
            layer's own) to draw a new mask each step, as Keras requires.
        name: Accepted for compatibility.
        **kwargs: Accepted for compatibility.

    Returns:
        The input with some elements zeroed.

    Raises:
        ValueError: For a malformed `seed`, no seed inside a compiled program,
            a `rate` outside [0, 1), or a `noise_shape` of another length than
            `x`'s shape or an entry neither 1 nor `x`'s.

    Example:

    >>> y = dropout(np.ones((4, 4), "float32"), rate=0.5, seed=[1, 2])
    """
    import keras

    if isinstance(rate, bool) or not isinstance(rate, (int, float, np.floating, np.integer)) \
            or not 0 <= rate < 1:
        raise ValueError(f"dropout's rate is the probability that an element is zeroed, a "
                         f"number in [0, 1); got {rate!r}.")

    _check_noise_shape(noise_shape, tuple(keras.ops.shape(x)))
    if seed is None and isinstance(x, jax.core.Tracer):
        # Keras draws an unseeded mask from its global generator, which a trace cannot
        # advance (its error names neither this function nor its seed).
        raise ValueError(
            "rand_ops.dropout without a seed cannot draw inside a compiled program (a step "
            "of fit, strategy.run, a loop): pass seed= a keras.random.SeedGenerator made "
            "with the layer that calls it (a new mask each step), or a seed pair (the same "
            "mask at each call), or use keras_ipu.keras.layers.Dropout.")
    from keras_ipu.keras.layers import keras_seed

    return keras.random.dropout(x, rate, noise_shape=noise_shape, seed=keras_seed(seed))


def _check_noise_shape(noise_shape: Any, shape: tuple) -> None:
    """IPU TensorFlow's checks: one entry per axis of `x`, each 1 or `x`'s."""
    if noise_shape is None:
        return
    noise_shape = tuple(noise_shape)
    if len(noise_shape) != len(shape):
        raise ValueError(f"The length of noise_shape must equal the rank of x: noise_shape "
                         f"{noise_shape} for x of shape {shape}.")
    for axis, (noise, size) in enumerate(zip(noise_shape, shape)):
        if noise is not None and size is not None and noise not in (1, size):
            raise ValueError(f"Dimension mismatch: noise_shape {noise_shape} has {noise} on "
                             f"axis {axis}, where x of shape {shape} has {size}; use 1 (the mask "
                             f"is shared along the axis) or {size}.")


__all__ = ["dropout"]
