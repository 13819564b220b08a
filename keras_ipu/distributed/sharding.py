"""`shard_for_instance`: an instance's share of in-memory data."""

from __future__ import annotations

from typing import Any

import numpy as np

from keras_ipu.distributed import runtime


def shard_for_instance(data: Any, batch_size: int, local_replicas: int | None = None,
                       instance: int | None = None, instances: int | None = None) -> Any:
    """The batches of `data` this instance's replicas get when all data is dealt globally.

    Deals batch `i` of the whole data set to global replica `i % R` (as one
    process with `R` replicas would) and keeps the batches of this
    instance's replicas, in the order its feed deals them back: so that
    instances training on their shards reach the weights one process
    training on all of `data` with `R` replicas reaches. Batches that do not
    fill a step of all replicas are dropped.

    Args:
        data: An array, or a tree (tuples, lists, dicts, nested) of arrays
            with the same first dimension.
        batch_size: The batch size given to `fit`.
        local_replicas: Replicas per instance (default: the configured
            IPUs, the launcher's `--ipus-per-replica` (else 1) per replica:
            a pipeline's stages are one replica).
        instance: This instance's index (default: `instance_index()`).
        instances: The number of instances (default: `num_instances()`).

    Returns:
        The instance's share, with the same structure as `data`.

    Raises:
        ValueError: For an `instance` that is not an index below `instances`.

    Example:

    >>> x_local, y_local = shard_for_instance((x, y), batch_size=8)
    """
    instance = runtime.instance_index() if instance is None else instance
    instances = runtime.num_instances() if instances is None else instances
    if local_replicas is None:  # of the launcher's `--ipus-per-replica` each
        local_replicas = runtime.num_local_replicas()
    if not 0 <= instance < instances:
        raise ValueError(f"instance must be an instance index in 0..{instances - 1}, got "
                         f"{instance!r}.")
    local = local_replicas
    replicas = instances * local

    def shard(array):
        array = np.asarray(array)
        steps = array.shape[0] // (batch_size * replicas)
        batches = array[: steps * batch_size * replicas].reshape(
            steps, replicas, batch_size, *array.shape[1:])
        mine = batches[:, instance * local : (instance + 1) * local]
        return mine.reshape(-1, *array.shape[1:])

    return _each_array(shard, data)


def _each_array(function, data: Any) -> Any:
    """`function` of each array of a tree of dicts, tuples and lists (nested too)."""
    if isinstance(data, dict):
        return {key: _each_array(function, value) for key, value in data.items()}
    if isinstance(data, (tuple, list)):
        return type(data)(_each_array(function, value) for value in data)
    return function(data)
