"""Replica exchanges of `tensorflow.python.ipu.all_to_all_op`, in a replicated step.

Example:

```python
from keras_ipu.ops import all_to_all_op

everyone = all_to_all_op.all_gather(x, replication_factor=2)
```
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from keras_ipu.device import collectives, integers
from keras_ipu.ops import symbolic


def all_gather(x: Any, replication_factor: int, name: str | None = None) -> jax.Array:
    """Every replica's `x` in this replica's group, stacked: `[replication_factor, ...]`.

    Groups are consecutive replicas (`{0..k-1}`, `{k..2k-1}`, ...). Outside a
    replicated program there is one replica.

    Args:
        x: The array to gather, the same shape on every replica.
        replication_factor: Replicas per group; it must divide the replicas.
        name: Accepted for compatibility.

    Returns:
        The same array on every replica of the group.

    Raises:
        ValueError: When `replication_factor` does not divide the replicas.

    Example:

    >>> all_gather(x, 2)   # under 2 replicas: [x of replica 0, x of replica 1]
    """
    return symbolic.collective(collectives.all_gather, replication_factor, x, replication_factor)


def all_to_all(x: Any, split_dimension: int, concat_dimension: int, replication_factor: int,
               name: str | None = None) -> jax.Array:
    """XLA's all-to-all over a group: replica `p` gets every replica's `p`-th block.

    `x` is split into `replication_factor` blocks along `split_dimension`;
    replica `p` of the group receives block `p` of each replica of the group
    and concatenates them, in replica order, along `concat_dimension`.

    Args:
        x: The array, the same shape on every replica.
        split_dimension: The dimension split into blocks; `replication_factor`
            must divide it.
        concat_dimension: The dimension the received blocks are joined along.
        replication_factor: Replicas per group; it must divide the replicas.
        name: Accepted for compatibility.

    Returns:
        This replica's blocks.

    Raises:
        ValueError: When `replication_factor` is not a positive int or does
            not divide the replicas or the split dimension, or a dimension is
            not one of `x`'s.

    Example:

    >>> all_to_all(x, 0, 0, 2)   # under 2 replicas, x of 4 rows: rows 0-1 / 2-3 exchanged
    """
    x = jnp.asarray(x)
    split = _dimension(split_dimension, x, "split_dimension")
    concat = _dimension(concat_dimension, x, "concat_dimension")
    factor = integers.integer_of(replication_factor)  # a NumPy or 0-d JAX integer too
    if factor is None or factor < 1:
        raise ValueError(f"all_to_all's replication_factor must be a positive int (replicas per "
                         f"group), got {replication_factor!r}.")
    replication_factor = factor
    size = x.shape[split]
    if not isinstance(size, (int, np.integer)):  # a Keras build's unknown batch size
        if split == concat and symbolic.in_keras_symbolic_build():
            return x  # blocks exchanged along one axis keep its shape: all the build needs
        raise ValueError(f"all_to_all cannot split dimension {split_dimension} of {x.shape}, "
                         f"whose size is unknown, into {replication_factor} blocks: give the "
                         f"model's inputs a batch size (keras.Input(..., batch_size=...)), or "
                         f"concatenate along the dimension it splits.")
    if size % replication_factor:
        raise ValueError(f"replication_factor {replication_factor} must divide dimension "
                         f"{split_dimension} of {x.shape}.")
    return symbolic.collective(_exchanged, replication_factor, x, split, concat,
                               replication_factor)


def _dimension(dimension: Any, x: jax.Array, argument: str) -> int:
    """`dimension` of `x` as a non-negative index (negative ones count from the end)."""
    if isinstance(dimension, bool) or not isinstance(dimension, (int, np.integer)) \
            or not -x.ndim <= dimension < x.ndim:
        raise ValueError(f"all_to_all's {argument} must be a dimension of the input's shape "
                         f"{x.shape}, from {-x.ndim} to {x.ndim - 1}; got {dimension!r}.")
    return int(dimension) % x.ndim


def _exchanged(x: jax.Array, split: int, concat: int, group: int) -> jax.Array:
    gathered = collectives.all_gather(x, group)  # [group, ...]
    _, position = collectives.group_of(group)
    blocks = jnp.stack(jnp.split(gathered, group, axis=split + 1))
    mine = blocks[position]  # [group, ...block]: block `position` of each replica
    return jnp.concatenate(list(mine), axis=concat)

__all__ = ["all_gather", "all_to_all"]
