"""Pipelined state and batches on a `("replica", "ipu")` mesh that spans instances.

In a multi-host job each instance pipelines over its own IPUs and the
replicas are the instances' pipelines: global replica `instance × local
replicas + local replica` (see `device.processes`). A process can only
create and read the shards of its own devices, so packed state is placed
from each process's own blocks (the same host values everywhere, after a
broadcast from instance 0), batches are assembled from each instance's own
data, and the state is read back from a local replica's shards.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from keras_ipu.device.mesh import IPUMesh


def spans_processes(mesh: IPUMesh) -> bool:
    """Whether some IPUs of `mesh` belong to other processes (a multi-host job).

    Example:

    >>> spans_processes(state.mesh)   # 2 instances × 2 IPUs
    True
    """
    here = jax.process_index()
    return any(device.process_index != here for device in mesh.devices.flat)


def local_replicas(mesh: IPUMesh) -> tuple[int, ...]:
    """The replicas (rows of a `("replica", "ipu")` mesh) whose IPUs are this process's.

    Example:

    >>> local_replicas(state.mesh)   # instance 1 of 2, one pipeline each
    (1,)
    """
    here = jax.process_index()
    return tuple(r for r, row in enumerate(mesh.devices)
                 if all(device.process_index == here for device in row))


def from_instance_zero(tree: Any) -> Any:
    """Instance 0's value of a host tree, on every instance (all must call it).

    The initial weights may differ between instances (their own random
    initialisation); every replica starts from instance 0's.
    """
    from jax.experimental import multihost_utils

    return multihost_utils.broadcast_one_to_all(tree)


def place(host: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """A global array from the same host value in every process, each placing its own shards.

    Args:
        host: The whole array (identical in every process).
        sharding: Where it goes; may span processes.

    Returns:
        The global array; only this process's shards were copied.

    Example:

    >>> place(np.zeros((2, 2, 10)), mesh.sharding(P("replica", "ipu"))).shape
    (2, 2, 10)
    """
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def replica_row(array: jax.Array, replica: int) -> np.ndarray:
    """Replica `replica`'s slice `array[replica]` of a packed state array, from local shards.

    Args:
        array: A packed state array `[replicas, ipus, length]`.
        replica: A replica whose IPUs are this process's (`local_replicas`).

    Returns:
        `[ipus, length]` as NumPy, with no cross-process traffic.

    Raises:
        ValueError: When this process holds no shard of the replica.
    """
    ipus = array.shape[1]
    row: list[Any] = [None] * ipus
    for shard in array.addressable_shards:
        r0 = shard.index[0].start or 0
        i0 = shard.index[1].start or 0
        data = shard.data
        if not r0 <= replica < r0 + data.shape[0]:
            continue
        # On the host: indexing the device array would compile a program.
        block = np.asarray(data)[replica - r0]
        for k in range(block.shape[0]):
            row[i0 + k] = block[k]
    if any(part is None for part in row):
        raise ValueError(f"Replica {replica} has no complete set of shards on this process.")
    return np.stack(row)


def global_batches(batches: Any, sharding: jax.sharding.Sharding, replicas: int) -> Any:
    """This instance's batches `[updates, local replicas, ...]` as part of the global ones.

    The replicas of an instance are consecutive, so its block of the replica
    axis is its own data (see `device.processes`).

    Args:
        batches: A tree of host arrays, the replica axis second.
        sharding: The batches' sharding (split over the replica axis).
        replicas: The global replica count.

    Returns:
        The tree of global arrays `[updates, replicas, ...]`.
    """
    def assemble(local):
        local = np.asarray(local)
        shape = (local.shape[0], replicas, *local.shape[2:])
        return jax.make_array_from_process_local_data(sharding, local, shape)

    return jax.tree_util.tree_map(assemble, batches)


__all__ = ["from_instance_zero", "global_batches", "local_replicas", "place", "replica_row",
           "spans_processes"]
