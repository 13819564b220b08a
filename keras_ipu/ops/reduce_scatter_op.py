"""`tensorflow.python.ipu.reduce_scatter_op`: reduce over a replica group, scatter the result.

Example:

```python
from keras_ipu.ops import reduce_scatter_op

mine = reduce_scatter_op.reduce_scatter(gradient, replication_factor=2)
```
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from keras_ipu.device import collectives
from keras_ipu.ops import symbolic

# How a group's values combine (`[group, n]` -> `[n]`); LOCAL keeps the replica's own.
_REDUCTIONS: dict[str, Callable[[jax.Array, jax.Array], jax.Array]] = {
    "COLLECTIVE_OP_ADD": lambda values, own: jnp.sum(values, axis=0),
    "COLLECTIVE_OP_MUL": lambda values, own: jnp.prod(values, axis=0),
    "COLLECTIVE_OP_MIN": lambda values, own: jnp.min(values, axis=0),
    "COLLECTIVE_OP_MAX": lambda values, own: jnp.max(values, axis=0),
    "COLLECTIVE_OP_LOGICAL_AND": lambda values, own: jnp.all(values, axis=0),
    "COLLECTIVE_OP_LOGICAL_OR": lambda values, own: jnp.any(values, axis=0),
    "COLLECTIVE_OP_SQUARE_ADD": lambda values, own: jnp.sum(values * values, axis=0),
    "COLLECTIVE_OP_LOCAL": lambda values, own: own,
}


def reduce_scatter(x: Any, replication_factor: int, op: str = "COLLECTIVE_OP_ADD",
                   name: str | None = None) -> jax.Array:
    """Reduces `x` over this replica's group; each replica keeps its slice of the result.

    For `[n]` inputs each replica gets `ceil(n / replication_factor)`
    elements, replica `p` of the group the `p`-th of them, zero-padded at
    the end.

    Args:
        x: A rank-1 array, the same shape on every replica.
        replication_factor: Replicas per group (consecutive); it must divide
            the replicas.
        op: `COLLECTIVE_OP_ADD` (default), `_MUL`, `_MIN`, `_MAX`,
            `_LOGICAL_AND`, `_LOGICAL_OR`, `_SQUARE_ADD` or `_LOCAL` (no
            reduction).
        name: Accepted for compatibility.

    Returns:
        This replica's part of the reduction, of `x`'s type.

    Raises:
        ValueError: For an input that is not rank 1, an unknown `op`, or a
            group size that does not divide the replicas.

    Example:

    >>> reduce_scatter(jnp.array([1.0, 2.0, 3.0]), 2)   # 2 replicas: [2, 4] and [6, 0]
    """
    x = jnp.asarray(x)
    if x.ndim != 1:
        raise ValueError(f"reduce_scatter needs a rank-1 input, got shape {x.shape}.")
    if op not in _REDUCTIONS:
        raise ValueError(f"Unknown op {op!r}; valid: {', '.join(_REDUCTIONS)}.")
    return symbolic.collective(_scattered, replication_factor, x, replication_factor, op)


def _scattered(x: jax.Array, replication_factor: int, op: str) -> jax.Array:
    size, position = collectives.group_of(replication_factor)
    reduced = _REDUCTIONS[op](collectives.all_gather(x, size), x).astype(x.dtype)
    part = -(-x.shape[0] // size)
    padded = jnp.pad(reduced, (0, part * size - x.shape[0]))
    return jax.lax.dynamic_slice_in_dim(padded, position * part, part)


__all__ = ["reduce_scatter"]
