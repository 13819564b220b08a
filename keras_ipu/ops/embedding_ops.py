"""Embedding operators of `tensorflow.python.ipu.embedding_ops`, on JAX arrays.

`embedding_lookup` is here; the host embeddings (`HostEmbedding`,
`create_host_embedding` and the optimizer specs) are implemented in
`keras_ipu.ops.host_embedding`.

Example:

```python
from keras_ipu.ops import embedding_ops

vectors = embedding_ops.embedding_lookup(table, ids)
```
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from keras_ipu.ops import math_ops
from keras_ipu.ops.host_embedding import (
    HostEmbedding,
    HostEmbeddingOptimizerSpec,
    HostEmbeddingSGDGAOptimizerSpec,
    create_host_embedding,
)


def embedding_lookup(params: Any, ids: Any, name: str | None = None,
                     serialization_factor: int = 1) -> jax.Array:
    """The rows of `params` at `ids` (`tf.nn.embedding_lookup` of one table).

    Args:
        params: The embedding table, `[vocabulary, ...]`.
        ids: Integer indices into its first dimension, any shape.
        name: Accepted for compatibility.
        serialization_factor: Look up in this many slices of the table, one
            after the other, and add them (each index is in one slice): the
            same result with smaller intermediate values. It must divide the
            vocabulary.

    Returns:
        `[*ids.shape, *params.shape[1:]]`, of `params`' type.

    Raises:
        ValueError: When `serialization_factor` does not divide the vocabulary.
        TypeError: For `ids` that are not integers.

    Example:

    >>> embedding_lookup(jnp.eye(3), jnp.array([2, 0]))
    Array([[0., 0., 1.], [1., 0., 0.]], dtype=float32)
    """
    params, ids = jnp.asarray(params), jnp.asarray(ids)
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"ids must be integer indices of the table's rows, got {ids.dtype}.")
    rows = params.shape[0]
    serialization_factor = math_ops.checked_factor(serialization_factor, rows,
                                                   "the embedding table's rows")
    size = rows // serialization_factor
    result = jnp.zeros((*ids.shape, *params.shape[1:]), params.dtype)
    for part in range(serialization_factor):
        local = ids - part * size
        inside = (local >= 0) & (local < size)
        rows_of = jnp.take(params[part * size:(part + 1) * size], jnp.where(inside, local, 0),
                           axis=0)
        mask = inside.reshape(*ids.shape, *(1,) * (params.ndim - 1))
        result = result + jnp.where(mask, rows_of, 0)
    return result


__all__ = ["HostEmbedding", "HostEmbeddingOptimizerSpec", "HostEmbeddingSGDGAOptimizerSpec",
           "create_host_embedding", "embedding_lookup"]
