"""Replicas: one copy of a program per IPU, and the collectives between them.

A replicated program's state carries a leading replica axis that is sharded
over the replicas' IPUs, so each replica's weights live on its own IPU. An
execution's batches carry the replica axis second (`[steps, replicas, ...]`):
batch `i` of the input stream is step `i // R` of replica `i % R`.

Replicas whose IPUs share a JAX device (more IPUs than devices, see
`system.configure`) run batched on it: the program is the same, over an
`IPUMesh` whose collectives span the devices and each device's replicas.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from keras_ipu.device.mesh import IPUMesh
from keras_ipu.device.system import VirtualIPU

REPLICA_AXIS = "replica"


@dataclasses.dataclass(frozen=True)
class Replicas:
    """The IPUs of a replicated program, one replica each.

    Args:
        ipus: One virtual IPU per replica.

    Example:

    >>> replicas = Replicas(tuple(system.ipus))
    >>> state = replicas.replicate(state)          # one copy per IPU
    >>> grads = replicas.sum(grads)                # inside a step: all-reduce
    """

    ipus: tuple[VirtualIPU, ...]

    def __post_init__(self):
        if not self.ipus:
            raise ValueError("Replicas need at least one IPU.")

    @property
    def count(self) -> int:
        """The replication factor."""
        return len(self.ipus)

    @functools.cached_property
    def spans_processes(self) -> bool:
        """Whether some replicas run in other processes (a multi-host job)."""
        return any(ipu.device.process_index != jax.process_index() for ipu in self.ipus)

    @functools.cached_property
    def local_replicas(self) -> tuple[int, ...]:
        """The indices of the replicas this process runs, in order."""
        here = jax.process_index()
        return tuple(r for r, ipu in enumerate(self.ipus) if ipu.device.process_index == here)

    @property
    def local_count(self) -> int:
        """The replicas this process runs (`count` in a single process)."""
        return len(self.local_replicas)

    @property
    def devices(self) -> list[jax.Device]:
        """The replicas' JAX devices, in replica order."""
        return [ipu.device for ipu in self.ipus]

    @functools.cached_property
    def grid(self) -> IPUMesh:
        """The replicas' IPUs as a one-axis (`"replica"`) grid, shared devices batched."""
        return IPUMesh(np.array(self.devices, dtype=object), (REPLICA_AXIS,))

    @property
    def mesh(self) -> Mesh:
        """A one-axis mesh (`"replica"`) over the replicas' distinct devices."""
        return self.grid.mesh

    @property
    def ipus_per_device(self) -> int:
        """IPUs on each of their devices (1 unless IPUs share devices)."""
        return self.count // len(set(self.devices))

    def sum(self, tree: Any) -> Any:
        """Sums over replicas (inside a replicated step); identity for one."""
        if self.count == 1:
            return tree
        return self.grid.psum(tree, REPLICA_AXIS)

    def max(self, tree: Any) -> Any:
        """The maximum over replicas (inside a replicated step); identity for one.

        Example:

        >>> scales = replicas.max(scales)   # float8 scales, combined as Keras combines them
        """
        if self.count == 1:
            return tree
        return self.grid.pmax(tree, REPLICA_AXIS)

    def replicate(self, tree: Any) -> Any:
        """One copy of every leaf per replica, on the replica's device.

        With one replica the leaves are moved to its device unchanged; with
        more they gain a leading replica axis.
        """
        if self.count == 1:
            return _on_device(tree, self.devices[0])
        sharding = NamedSharding(self.mesh, P(REPLICA_AXIS))
        local = self.ipus_per_device

        def block(leaf):
            if local == 1:
                return leaf[None]
            return np.broadcast_to(np.asarray(leaf)[None], (local, *np.shape(leaf)))

        # Each process places the copies of its own devices only.
        here = [d for d in self.mesh.devices.flat if d.process_index == jax.process_index()]

        def copies(leaf):
            shards = [jax.device_put(block(leaf), device) for device in here]
            return jax.make_array_from_single_device_arrays(
                (self.count, *leaf.shape), sharding, shards
            )

        return jax.tree_util.tree_map(copies, tree)

    def state_spec(self, tree: Any) -> Any:
        """Shape structs of `replicate(tree)`, without copying anything."""
        if self.count == 1:
            sharding = jax.sharding.SingleDeviceSharding(self.devices[0])
            return jax.tree_util.tree_map(
                lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree
            )
        sharding = NamedSharding(self.mesh, P(REPLICA_AXIS))
        return jax.tree_util.tree_map(
            lambda a: jax.ShapeDtypeStruct((self.count, *a.shape), a.dtype, sharding=sharding),
            tree,
        )

    def unreplicate(self, tree: Any, replica: int = 0) -> Any:
        """One replica's copy of a replicated tree (no cross-device traffic)."""
        if self.count == 1:
            return tree
        return jax.tree_util.tree_map(lambda leaf: _shard_of(leaf, replica)[0], tree)

    def replica_slices(self, tree: Any) -> list[Any]:
        """Every replica's copy of a replicated tree, as a list."""
        return [self.unreplicate(tree, r) for r in range(self.count)]

    @functools.cached_property
    def batch_sharding(self) -> jax.sharding.Sharding:
        """Where an execution's batches go: `[steps, replicas, ...]` split by replica."""
        if self.count == 1:
            return jax.sharding.SingleDeviceSharding(self.devices[0])
        return NamedSharding(self.mesh, P(None, REPLICA_AXIS))

    def place_batches(self, batches: Any) -> Any:
        """Moves an execution's batches to the replicas' devices ahead of use.

        On CPU devices the host arrays are returned as they are: the
        program's dispatch copies them into device buffers in C++, which
        costs less than a separate transfer (about 60 µs per array).
        """
        if self.spans_processes:
            return self._global_batches(batches)
        if all(device.platform == "cpu" for device in self.devices):
            return batches
        return jax.device_put(batches, self.batch_sharding)

    def _global_batches(self, batches: Any) -> Any:
        """This process's batches `[steps, local replicas, ...]` as part of the global ones.

        The replicas of a process are consecutive (see `processes.global_ipus`),
        so its block of the replica axis is its local data.
        """
        def assemble(local):
            local = np.asarray(local)
            shape = (local.shape[0], self.count, *local.shape[2:])
            return jax.make_array_from_process_local_data(self.batch_sharding, local, shape)

        return jax.tree_util.tree_map(assemble, batches)

    def batch_spec(self, batches: Any) -> Any:
        """Shape structs of an execution's batches, placed as `place_batches` places them."""
        return jax.tree_util.tree_map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=self.batch_sharding),
            batches,
        )

    def index(self) -> Any:
        """Inside `map`: this replica's index (0 with one replica)."""
        if self.count == 1:
            return 0
        return self.grid.axis_index(REPLICA_AXIS)

    def map(self, per_replica: Callable[[Any, Any], tuple[Any, Any]]) -> Callable:
        """Runs `per_replica(state, batches)` on every replica (SPMD).

        `per_replica` sees its replica's state without the replica axis and
        batches as `[steps, ...]`, and returns `(state, outfeed)`; the result
        has the replica axis back: state leading, outfeed second.
        """
        if self.count == 1:
            return per_replica

        def body(state, batches):
            local_state = jax.tree_util.tree_map(lambda a: a[0], state)
            local_batches = jax.tree_util.tree_map(lambda a: a[:, 0], batches)
            new_state, outfeed = per_replica(local_state, local_batches)
            return (
                jax.tree_util.tree_map(lambda a: a[None], new_state),
                jax.tree_util.tree_map(lambda a: a[:, None], outfeed),
            )

        return self.grid.map(
            body,
            in_specs=(P(REPLICA_AXIS), P(None, REPLICA_AXIS)),
            out_specs=(P(REPLICA_AXIS), P(None, REPLICA_AXIS)),
        )


def _shard_of(leaf: jax.Array, replica: int) -> jax.Array:
    """Replica `replica`'s block `[1, ...]` of a replicated leaf."""
    for shard in leaf.addressable_shards:
        start = shard.index[0].start or 0
        if start <= replica < start + shard.data.shape[0]:
            data = shard.data
            return data if data.shape[0] == 1 else data[replica - start : replica - start + 1]
    raise ValueError(f"Replica {replica} has no shard on this host.")


def all_reduce_cycles(bytes_per_replica: float, replicas: int, hardware: Any) -> float:
    """Cycles a ring all-reduce of `bytes_per_replica` takes over IPU-Links."""
    if replicas <= 1 or not bytes_per_replica:
        return 0.0
    moved = 2.0 * bytes_per_replica * (replicas - 1) / replicas
    return moved / hardware.link_bytes_per_second * hardware.clock_hz


def _on_device(tree: Any, device: jax.Device) -> Any:
    """`jax.device_put(tree, device)`, passing arrays already there through.

    A fit starts with the state its last execution left on the device: JAX's
    `device_put` would still cost some 10 µs per leaf (and 0.2 ms a call on a
    GPU host) to find nothing to move. Arrays on the device but not committed
    to it (a metric reset to zeros) pass too: the program takes them as they
    are, and returns its state committed.
    """
    placed = jax.sharding.SingleDeviceSharding(device)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    moving = [i for i, leaf in enumerate(leaves)
              if not (isinstance(leaf, jax.Array) and leaf.sharding == placed)]
    if moving:
        moved = jax.device_put([leaves[i] for i in moving], device)
        for i, leaf in zip(moving, moved):
            leaves[i] = leaf
    # A program donates its state: an array in two places (a metric listed twice) would
    # be donated twice, which XLA refuses. The second place gets a copy.
    seen: set[int] = set()
    for i, leaf in enumerate(leaves):
        if id(leaf) in seen:
            leaves[i] = jnp.array(leaf, copy=True)
        seen.add(id(leaves[i]))
    return jax.tree_util.tree_unflatten(treedef, leaves)


__all__: Sequence[str] = ["REPLICA_AXIS", "Replicas", "all_reduce_cycles"]
