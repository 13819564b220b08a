"""Replication operators of `tensorflow.python.ipu.replication_ops`.

Example:

```python
from keras_ipu.ops import replication_ops

class Offset(keras.layers.Layer):
    def call(self, x):
        return x + keras.ops.cast(replication_ops.replication_index(), x.dtype)
```
"""

from __future__ import annotations

import jax

from keras_ipu.device import collectives


def replication_index(name: str | None = None) -> jax.Array:
    """This replica's index, in code traced inside a replicated program (0 elsewhere).

    Args:
        name: Accepted for compatibility.

    Returns:
        A traced int32 scalar: the replica of a model's replicated `fit`,
        `evaluate` or `predict` step that runs the code.

    Example:

    >>> replication_index()   # in a layer's call, under 2 replicas: 0 or 1
    """
    return collectives.replica_index()


__all__ = ["replication_index"]
