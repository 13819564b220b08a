"""Cross-replica operators of `tensorflow.python.ipu.cross_replica_ops`.

Example:

```python
from keras_ipu.ops import cross_replica_ops

total = cross_replica_ops.cross_replica_sum(x)   # in a replicated step
```
"""

from __future__ import annotations

from typing import Any

from keras_ipu.device import collectives
from keras_ipu.ops import symbolic


def cross_replica_sum(x: Any, replica_group_size: int | None = None,
                      name: str | None = None) -> Any:
    """Sums `x` over the replicas (in groups of `replica_group_size` consecutive ones).

    In code traced inside a replicated program; elsewhere there is one
    replica and `x` comes back as it is.

    Args:
        x: An array (or a tree of arrays), the same shape on every replica.
        replica_group_size: Replicas per group; `None` sums over all.
        name: Accepted for compatibility.

    Returns:
        The sum, on every replica of the group.

    Raises:
        ValueError: When `replica_group_size` does not divide the replicas.

    Example:

    >>> cross_replica_sum(x)   # under 2 replicas: x of replica 0 + x of replica 1
    """
    return symbolic.collective(collectives.cross_replica_sum, replica_group_size, x,
                               replica_group_size)


def assume_equal_across_replicas(tensors: Any, inplace: bool = False) -> Any:
    """Marks values as equal on every replica; they come back unchanged.

    On the IPU this lets Poplar skip checks for divergent control flow; the
    device model needs no such hint.

    Args:
        tensors: An array or a structure of arrays.
        inplace: Accepted for compatibility.

    Returns:
        `tensors`.

    Example:

    >>> flag = assume_equal_across_replicas(flag)
    """
    return tensors


__all__ = ["assume_equal_across_replicas", "cross_replica_sum"]
