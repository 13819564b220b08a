"""Collectives while Keras infers a layer's output, before any replicated step exists.

Keras builds a model by tracing each layer's `call` once outside the
program that will run it (`compute_output_spec`, in its symbolic scope).
There the code sees one replica, so a collective over a group of several
would refuse the group; `collective` computes it as the first replica of
such a group instead, which gives the shapes the replicated step will have.

Example:

```python
from keras_ipu.device import collectives
from keras_ipu.ops import symbolic

gathered = symbolic.collective(collectives.all_gather, 2, x, 2)
```
"""

from __future__ import annotations

import sys
from typing import Any

import jax

from keras_ipu.device import collectives


def in_keras_symbolic_build() -> bool:
    """Whether Keras is tracing a layer only for its output's shape (its symbolic scope).

    Returns:
        True inside Keras' `compute_output_spec` (building a model from
        `keras.Input`s), False when the layer computes values.

    Example:

    >>> in_keras_symbolic_build()   # outside any layer
    False
    """
    from keras.src.backend.common.symbolic_scope import in_symbolic_scope

    return in_symbolic_scope()


def collective(op: Any, group_size: int | None, *args: Any) -> Any:
    """`op(*args)`; in Keras' symbolic build outside replication, as a group's first replica.

    Args:
        op: The collective operation.
        group_size: Its replicas per group (`None`: all of them).
        *args: Its arguments.

    Returns:
        `op(*args)`, with the shapes a group of `group_size` gives.

    Raises:
        ValueError: For a group size that is not a positive integer (or
            None); from `op`, for a group that does not divide the replicas of
            a real (not symbolic) call; for a Keras tensor of a model being
            built (the collective would not be in the model).

    Example:

    >>> collective(collectives.all_gather, 2, x, 2)
    """
    _refuse_keras_tensors(args)
    group_size = collectives.checked_group_size(group_size)
    if (group_size is not None and group_size > 1 and collectives.replica_count() == 1
            and in_keras_symbolic_build()):
        return collectives.as_first_of(group_size, op, *args)
    return op(*args)


def _refuse_keras_tensors(args: Any) -> None:
    keras = sys.modules.get("keras")  # no Keras tensor without Keras
    if keras is None or not any(isinstance(leaf, keras.KerasTensor)
                                for leaf in jax.tree_util.tree_leaves(args)):
        return
    raise ValueError(
        "The IPU's cross-replica operations take arrays, in a layer's `call` or a step, not "
        "a KerasTensor of a model being built: there they would not be part of the model. "
        "Wrap the operation in a layer, e.g. "
        "`keras.layers.Lambda(lambda x: cross_replica_ops.cross_replica_sum(x))(inputs)`.")
