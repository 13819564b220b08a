"""Cross-replica operations for code inside a replicated program (a layer's `call`).

A replicated keras_ipu program runs its step once per replica, over the
replica axis of its IPU grid (`Replicas.map`, or a pipeline's mesh): a
`shard_map` axis, and, for IPUs that share a device, a `vmap` axis inside it
(`mesh.local_axis`). These operations find which of the two are bound where
they are traced, so they work in any replicated program and, outside one,
act as the single replica they then are: index 0, sums of one.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from keras_ipu.device import integers
from keras_ipu.device.mesh import local_axis
from keras_ipu.device.replicate import REPLICA_AXIS


class ReplicaGroupError(ValueError):
    """A replica group size that does not divide the replicas where it is traced.

    Example:

    >>> try:
    ...     cross_replica_sum(x, 2)   # traced outside a replicated program
    ... except ReplicaGroupError:
    ...     ...
    """


def _bound(name: str) -> bool:
    try:
        jax.lax.axis_index(name)
    except NameError:
        return False
    return True


def _replica_axes() -> tuple[str, ...]:
    """The bound replica axes, outermost first: the devices', then a device's IPUs."""
    return tuple(name for name in (REPLICA_AXIS, local_axis(REPLICA_AXIS)) if _bound(name))


def replica_index() -> jax.Array:
    """This replica's index where it is traced (0 outside a replicated program).

    Returns:
        A traced int32 scalar.

    Example:

    >>> offset = replica_index() * rows_per_replica
    """
    index = jnp.int32(0)
    for name in _replica_axes():
        index = index * jax.lax.psum(1, name) + jax.lax.axis_index(name)
    return index


def replica_count() -> int:
    """The number of replicas where it is traced (1 outside a replicated program).

    Returns:
        A Python integer (the bound axes' sizes are static).

    Example:

    >>> mean = cross_replica_sum(x) / replica_count()
    """
    count = 1
    for name in _replica_axes():
        count *= jax.lax.psum(1, name)
    return count


def cross_replica_sum(values: Any, group_size: int | None = None) -> Any:
    """Sums values over the replicas, or over consecutive groups of `group_size` of them.

    Args:
        values: An array, or a tree of arrays, the same shapes on every replica.
        group_size: Replicas per group (groups of consecutive indices); `None`
            sums over all.

    Returns:
        The sums, on every replica of the group.

    Raises:
        ValueError: When `group_size` does not divide the number of replicas.

    Example:

    >>> total = cross_replica_sum(partial)
    """
    group_size = checked_group_size(group_size)  # a 0-d integer array too
    if group_size is None or group_size == replica_count():
        axes = _replica_axes()
        return jax.lax.psum(values, axes) if axes else values
    group_of(group_size)  # checks the size before anything is traced
    return jax.tree_util.tree_map(lambda v: jnp.sum(all_gather(v, group_size), axis=0), values)


def as_first_of(size: int, op: Any, *args: Any) -> Any:
    """`op(*args)` as replica 0 of `size` replicas that all hold `args` computes it.

    For code traced outside any replicated program that still needs a
    group's result shapes (Keras inferring a layer's output before the
    replicated step exists): the replicas are a `vmap` axis here.

    Args:
        size: The number of replicas to act as.
        op: A collective operation of this module (or built on them).
        *args: Its arguments; arrays are the same on every replica.

    Returns:
        Replica 0's result.

    Example:

    >>> as_first_of(2, all_gather, x).shape   # (2, *x.shape)
    """
    replicated = jax.vmap(lambda *a: op(*a), axis_name=REPLICA_AXIS, axis_size=size,
                          in_axes=None)
    return jax.tree_util.tree_map(lambda v: v[0], replicated(*args))


def group_of(group_size: int | None) -> tuple[int, jax.Array]:
    """`(size, position)`: the size of this replica's group and its place in it.

    Args:
        group_size: Replicas per group (consecutive ones); `None` is one
            group of all.

    Returns:
        The group's size (an integer) and this replica's place (traced).

    Raises:
        ReplicaGroupError: When `group_size` does not divide the number of
            replicas (a `ValueError`).

    Example:

    >>> size, position = group_of(2)   # under 4 replicas: 2, and 0 or 1
    """
    count = replica_count()
    size = count if group_size is None else checked_group_size(group_size)
    if count % size:
        raise ReplicaGroupError(_group_message(group_size, count, known=True))
    return size, replica_index() % size


def checked_group_size(group_size: Any) -> int | None:
    """`group_size` as an int (any integer kind, NumPy's and 0-d arrays' too).

    Args:
        group_size: Replicas per group, or `None` (one group of all).

    Returns:
        The size as a Python int, or `None` for `None`.

    Raises:
        ReplicaGroupError: For anything but a positive integer or None (a
            float such as `R / 2`, 0, a negative size), wherever it is traced.

    Example:

    >>> checked_group_size(np.int64(2))
    2
    """
    if group_size is None:
        return None
    size = integers.integer_of(group_size)
    if size is None or size < 1:
        raise ReplicaGroupError(_group_message(group_size, replica_count()))
    return size


def _group_message(group_size: Any, count: int, known: bool = False) -> str:
    """Why `group_size` cannot group `count` replicas (`known`: the program runs on them;
    otherwise one may be a Keras build, outside a replicated program)."""
    if count == 1 and not known:
        return (f"A replica group size must be a positive integer (or None, for one group "
                f"of all replicas); got {group_size!r}.")
    valid = ", ".join(str(n) for n in range(1, count + 1) if count % n == 0)
    replicas = ("1 replica (the program is not replicated: replicas run `strategy.run` or "
                "a step of a model made in an `IPUStrategy` scope, on a system of more IPUs "
                "than one replica takes)" if count == 1 else f"{count} replicas")
    return (f"A replica group size must be a positive integer that divides the {replicas} "
            f"(or None, for one group of all); got {group_size!r}. Valid sizes: {valid}.")


def all_gather(value: jax.Array, group_size: int | None = None) -> jax.Array:
    """The values of this replica's group, stacked in replica order: `[group size, ...]`.

    Args:
        value: An array, the same shape on every replica.
        group_size: Replicas per group; `None` gathers all.

    Returns:
        The same stacked array on every replica of the group.

    Raises:
        ValueError: When `group_size` does not divide the number of replicas.

    Example:

    >>> everyone = all_gather(x)   # the same on every replica
    """
    size, position = group_of(group_size)
    first = replica_index() - position
    return jax.lax.dynamic_slice_in_dim(_gathered(jnp.asarray(value)), first, size)


def group_moments(
    mean: jax.Array,
    variance: jax.Array,
    group_size: int,
    count: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The mean and variance of a replica group's batches together, from each replica's own.

    The group's mean is the mean of the replicas' means, its variance the
    mean of their variances plus the variance of their means: the same as
    the mean of `E[x^2]` minus the mean squared, without the cancellation.
    With `count`, each replica's moments weigh by its number of values (a
    masked batch). Both are differentiable: the gradients of a replica's
    loss reach the values of every replica of its group.

    Args:
        mean: This replica's mean (any shape, the same on every replica).
        variance: This replica's (biased) variance, shaped as `mean`.
        group_size: Replicas per group (consecutive indices).
        count: The number of values this replica's moments are of,
            broadcastable to `mean`; `None` when every replica has as many.

    Returns:
        `(mean, variance)` of the group, the same on each of its replicas; the
        arguments as they are outside a replicated program or for groups of one.

    Raises:
        ValueError: When `group_size` does not divide the number of replicas.

    Example:

    >>> mean, variance = group_moments(jnp.mean(x, 0), jnp.var(x, 0), 2)
    """
    if replica_count() == 1 or group_size == 1:
        return mean, variance
    if count is None:
        gathered = all_gather(jnp.stack([mean, variance]), group_size)
        means, variances = gathered[:, 0], gathered[:, 1]
        group_mean = jnp.mean(means, axis=0)
        spread = jnp.mean(jnp.square(means - group_mean), axis=0)
        return group_mean, jnp.mean(variances, axis=0) + spread
    count = jnp.broadcast_to(jnp.asarray(count, mean.dtype), mean.shape)
    gathered = all_gather(jnp.stack([mean, variance, count]), group_size)
    means, variances, counts = gathered[:, 0], gathered[:, 1], gathered[:, 2]
    # As Keras' masked moments: an empty group's statistics are 0, not NaN.
    total = jnp.sum(counts, axis=0) + jnp.finfo(mean.dtype).eps
    group_mean = jnp.sum(counts * means, axis=0) / total
    spread = jnp.square(means - group_mean)
    return group_mean, jnp.sum(counts * (variances + spread), axis=0) / total


def _gathered(value: jax.Array) -> jax.Array:
    """Every replica's `value`, stacked in replica order."""
    gathered = value[None]
    for name in reversed(_replica_axes()):
        # Innermost axis first: a device's IPUs, then the devices.
        gathered = jax.lax.all_gather(gathered, name)
        gathered = gathered.reshape(-1, *value.shape)
    return gathered
