"""Neural network operators of `tensorflow.python.ipu.nn_ops`, on JAX arrays.

For a layer's `call` (Keras' JAX backend) or any JAX function.

Example:

```python
from keras_ipu.ops import nn_ops

y = nn_ops.gelu(x)
```
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def gelu(x: Any, approximate: bool = True, name: str | None = None) -> jax.Array:
    """The GELU activation: `x * Φ(x)`.

    Args:
        x: The input.
        approximate: Use the tanh-based approximation (`True`, the default)
            or the exact erf-based form.
        name: Accepted for compatibility.

    Returns:
        An array of the input's shape and type.

    Example:

    >>> gelu(jnp.array([0.0, 1.0]))
    Array([0.       , 0.8411920], dtype=float32)
    """
    return jax.nn.gelu(x, approximate=approximate)


def hard_sigmoid(x: Any, name: str | None = None) -> jax.Array:
    """The hard sigmoid, as Poplar computes it: `clip(0.2 * x + 0.5, 0, 1)`.

    Args:
        x: The input.
        name: Accepted for compatibility.

    Returns:
        An array of the input's shape and type.

    Example:

    >>> hard_sigmoid(jnp.array([-3.0, 0.0, 1.0]))
    Array([0. , 0.5, 0.7], dtype=float32)
    """
    x = jnp.asarray(x)
    return jnp.clip(x * 0.2 + 0.5, 0, 1).astype(x.dtype)


def swish(x: Any, name: str | None = None) -> jax.Array:
    """The swish activation: `x * sigmoid(x)`.

    Args:
        x: The input.
        name: Accepted for compatibility.

    Returns:
        An array of the input's shape and type.

    Example:

    >>> swish(jnp.array([0.0]))
    Array([0.], dtype=float32)
    """
    return jax.nn.swish(x)


__all__ = ["gelu", "hard_sigmoid", "swish"]
