"""The seed's `ipu.horovod` names, on JAX's distributed runtime (see `keras_ipu.distributed`).

The collectives take the seed's signatures (`allreduce(tensor, op=None)`
averages by default, as Horovod does; `op` is one of `Average`, `Sum`,
`Min`, `Max`) and work on host values (NumPy arrays and trees of them; a
list of numbers is one tensor, as Horovod makes it) of every instance of a
`keras-ipu run --num-instances N` job.

Example:

```python
from keras_ipu import horovod as hvd

hvd.init()
total = hvd.allreduce(np.float32(hvd.rank()), op=hvd.Sum)
```
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from keras_ipu.distributed import runtime
from keras_ipu.distributed.runtime import instance_index as rank
from keras_ipu.distributed.runtime import num_instances as size

# Horovod's reduction operators.
Average = "average"
Sum = "sum"
Min = "min"
Max = "max"


def _as_tensor(tensor: Any) -> Any:
    """A (nested) list or tuple of Python numbers as the one tensor Horovod makes of it
    (`[5]`, `[1.0, 2.0]`), with TensorFlow's dtypes: float32, int32 (int64 past its
    range), bool; anything else as it is (an array, a tree of arrays or NumPy scalars)."""
    if not isinstance(tensor, (list, tuple)):
        return tensor
    leaves = jax.tree_util.tree_leaves(tensor)
    if not leaves or not all(type(leaf) in (bool, int, float) for leaf in leaves):
        return tensor
    array = np.asarray(tensor)
    if array.dtype.kind == "f":
        return array.astype(np.float32)
    if array.dtype.kind == "i" and np.all(np.abs(array) <= np.iinfo(np.int32).max):
        return array.astype(np.int32)
    return array


def init() -> None:
    """Joins the job's distributed runtime (Horovod's `hvd.init()`).

    Example:

    >>> hvd.init()   # under `keras-ipu run --num-instances 2`
    """
    runtime.initialize()


def allreduce(tensor: Any, op: str | None = None) -> Any:
    """Reduces a host value over all instances (every instance must call it).

    Args:
        tensor: An array-like or a tree of them, the same shape on every instance.
        op: `Average` (the default, also for `None`), `Sum`, `Min` or `Max`.

    Returns:
        The reduced value, as NumPy arrays of the same shape and dtype as
        `tensor`, on every instance; an integer `Average` is truncated toward zero.

    Raises:
        ValueError: For an unknown `op`.

    Example:

    >>> hvd.allreduce(np.float32(hvd.rank()))   # 2 instances
    0.5
    """
    return runtime.allreduce(_as_tensor(tensor), op=Average if op is None else op)


def allgather(tensor: Any, name: str | None = None) -> Any:
    """Concatenates a host value from all instances along its first axis.

    Args:
        tensor: An array-like with at least one dimension, or a tree of them;
            the first dimension may differ between instances.
        name: Accepted for compatibility.

    Returns:
        The concatenation in instance order, as NumPy arrays.

    Example:

    >>> hvd.allgather(np.full((hvd.rank() + 1,), hvd.rank()))   # 2 instances
    array([0, 1, 1])
    """
    return runtime.allgather(_as_tensor(tensor))


def broadcast(tensor: Any, root_rank: int, name: str | None = None) -> Any:
    """Instance `root_rank`'s value, on every instance (every instance must call it).

    Args:
        tensor: An array-like or a tree of them, the same shapes on every instance.
        root_rank: The instance whose value is kept.
        name: Accepted for compatibility.

    Returns:
        The root's value, as NumPy arrays.

    Raises:
        ValueError: When `root_rank` is not an instance.

    Example:

    >>> hvd.broadcast(np.float32(hvd.rank()), 0)   # 2 instances
    0.0
    """
    return runtime.broadcast(_as_tensor(tensor), root_rank)


__all__ = ["Average", "Max", "Min", "Sum", "allgather", "allreduce", "broadcast", "init",
           "ipu_horovod_strategy", "ipu_multi_replica_strategy", "rank", "size"]


def __getattr__(name: str):
    # The strategy modules import Keras: loaded when first named, as the seed's
    # `hvd.ipu_multi_replica_strategy.IPUMultiReplicaStrategy` does.
    if name in ("ipu_multi_replica_strategy", "ipu_horovod_strategy"):
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
