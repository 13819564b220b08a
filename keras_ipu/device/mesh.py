"""IPU meshes: a grid of IPUs run as one SPMD program, IPUs that share a device batched.

A replicated or pipelined program runs over a grid of IPUs with named axes
(`("replica",)`, or `("replica", "ipu")`). When every IPU has its own JAX
device the grid is a JAX `Mesh` and the program a `shard_map` over it. When
IPUs share devices (more IPUs configured than devices exist, see
`system.configure`), the devices hold contiguous blocks of the grid: each
axis of `n` IPUs splits into `n / local` device positions times `local` IPUs
on the same device. The program is then a `shard_map` over the distinct
devices of a `vmap` over each axis's local IPUs, and the collectives of the
grid (`psum`, `all_gather`, `axis_index`) span both, so a program computes
the same thing whether its IPUs share devices or not.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from keras_ipu.device.switch import one_branch_each


def local_axis(name: str) -> str:
    """The `vmap` axis name of an axis's IPUs that share one device.

    Args:
        name: A grid axis name, e.g. `"replica"`.

    Returns:
        The name of the batched axis of the IPUs on one device.

    Example:

    >>> local_axis("replica")
    'replica_local'
    """
    return f"{name}_local"


class IPUMesh:
    """A grid of IPUs with named axes, run as one SPMD program.

    Args:
        devices: The JAX device of each IPU of the grid (an object array;
            devices may repeat, in contiguous blocks along each axis).
        axis_names: One name per axis of `devices`.

    Raises:
        ValueError: When the IPUs sharing a device do not form contiguous
            blocks that tile the grid (e.g. 3 IPUs of an axis on 2 devices),
            naming the devices of the grid.

    Example:

    >>> mesh = IPUMesh(np.array([d0, d0, d1, d1], dtype=object), ("replica",))
    >>> mesh.local, mesh.mesh.devices.shape
    ((2,), (2,))
    >>> f = mesh.map(lambda x: mesh.psum(x, "replica"), (P("replica"),), P("replica"))
    """

    def __init__(self, devices: np.ndarray, axis_names: Sequence[str]):
        self.devices = np.asarray(devices, dtype=object)
        self.axis_names = tuple(axis_names)
        if self.devices.ndim != len(self.axis_names):
            raise ValueError(f"A mesh of shape {self.devices.shape} needs "
                             f"{self.devices.ndim} axis names, got {self.axis_names}.")
        self.local = _block_shape(self.devices)
        grid = self.devices[tuple(slice(None, None, n) for n in self.local)]
        expanded = grid
        for axis, n in enumerate(self.local):
            expanded = np.repeat(expanded, n, axis=axis)
        distinct = len({d for d in grid.flat}) == grid.size
        if not distinct or not np.array_equal(expanded, self.devices):
            names = np.vectorize(str, otypes=[object])(self.devices).tolist()
            raise ValueError(
                "IPUs that share a JAX device must form contiguous blocks of the "
                f"{dict(zip(self.axis_names, self.devices.shape))} grid of IPUs; its devices "
                f"are {names}. "
                "Each JAX device's block of IPUs must lie along this grid's axes: use "
                "numbers of replicas and of IPUs per replica that the IPUs per device "
                "divide (or that divide it), or one JAX device per IPU."
            )
        # The distinct devices, one per block: what `shard_map` runs over.
        self.mesh = Mesh(grid, self.axis_names)

    @property
    def shape(self) -> tuple[int, ...]:
        """IPUs along each axis."""
        return self.devices.shape

    @property
    def shared(self) -> bool:
        """Whether some IPUs of the grid share a device."""
        return any(n > 1 for n in self.local)

    def sharding(self, spec: P) -> NamedSharding:
        """Where an array whose dimensions are split as `spec` lives (IPU blocks per device).

        Args:
            spec: How the array's dimensions split over the grid's axes.

        Returns:
            A `NamedSharding` over the grid's distinct devices.

        Example:

        >>> mesh.sharding(P("replica"))  # replica r on the device of IPU r
        """
        return NamedSharding(self.mesh, spec)

    def _local_size(self, name: str) -> int:
        return self.local[self.axis_names.index(name)]

    def psum(self, tree: Any, axis: str | Sequence[str]) -> Any:
        """Inside `map`: sums over the IPUs along `axis` (one name or several).

        Args:
            tree: This IPU's values (a pytree).
            axis: The grid axis name, or several.

        Returns:
            The sum over the IPUs along `axis`, on every one of them; IPUs
            that share a device are summed as if they had their own.

        Example:

        >>> grads = mesh.psum(grads, "replica")
        """
        return jax.lax.psum(tree, self._names(axis))

    def pmax(self, tree: Any, axis: str | Sequence[str]) -> Any:
        """Inside `map`: the maximum over the IPUs along `axis`, as `psum` sums.

        Example:

        >>> scales = mesh.pmax(scales, "replica")
        """
        return jax.lax.pmax(tree, self._names(axis))

    def axis_index(self, axis: str) -> Any:
        """Inside `map`: this IPU's index along `axis`.

        Args:
            axis: A grid axis name.

        Returns:
            A traced integer: device index × IPUs per device + local index.

        Example:

        >>> replica = mesh.axis_index("replica")
        """
        local = self._local_size(axis)
        if local == 1:
            return jax.lax.axis_index(axis)
        return jax.lax.axis_index(axis) * local + jax.lax.axis_index(local_axis(axis))

    def switch(self, axis: str, index: Any, branches: Sequence[Callable], *operands: Any) -> Any:
        """Inside `map`: `lax.switch` on an index of this IPU's own along `axis`.

        IPUs that share a device along `axis` each run their own branch
        only (`switch.one_branch_each`), not every branch, as a switch
        batched over them would. That holds for the innermost axis whose
        IPUs share devices (the last such axis of the grid, e.g. `"ipu"`)
        and an index that varies along it alone; along another axis this
        is `lax.switch`, the same numbers with every branch run. The switch
        is not differentiable in reverse mode where IPUs share a device.

        Args:
            axis: The grid axis the index varies along (e.g. `"ipu"`: each
                IPU of a pipeline runs its own stage's ops).
            index: This IPU's branch.
            branches: Functions of `*operands` with outputs of one structure;
                they must not use collectives or `axis_index` along `axis`.
            *operands: The branches' arguments.

        Returns:
            The output of this IPU's branch.

        Example:

        >>> stage = mesh.axis_index("ipu")
        >>> out = mesh.switch("ipu", stage, [first_stage, second_stage], x)
        """
        if self._local_size(axis) == 1 or axis != self._innermost_shared_axis():
            # The custom batching applies to the innermost vmap only: along an
            # outer axis the switch is JAX's own (a select over the branches).
            return jax.lax.switch(index, branches, *operands)
        return one_branch_each(index, branches, *operands)

    def _innermost_shared_axis(self) -> str | None:
        """The axis whose local IPUs `map` batches innermost (`map` wraps the last first)."""
        return next((name for name, local in reversed(list(zip(self.axis_names, self.local)))
                     if local > 1), None)

    def all_gather(self, tree: Any, axis: str) -> Any:
        """Inside `map`: every IPU's value along `axis`, stacked in IPU order.

        Args:
            tree: This IPU's values (a pytree).
            axis: A grid axis name.

        Returns:
            Each leaf with a new leading axis of the IPUs along `axis`.

        Example:

        >>> messages = mesh.all_gather(message, "ipu")  # [ipus, ...]
        """
        local = self._local_size(axis)
        if local == 1:
            return jax.lax.all_gather(tree, axis)
        # JAX has no all_gather over a vmap and a shard_map axis at once:
        # gather the device's IPUs, then the devices, and flatten the two.
        gathered = jax.lax.all_gather(jax.lax.all_gather(tree, local_axis(axis)), axis)
        return jax.tree_util.tree_map(lambda a: a.reshape(-1, *a.shape[2:]), gathered)

    def _names(self, axis: str | Sequence[str]) -> tuple[str, ...]:
        names = (axis,) if isinstance(axis, str) else tuple(axis)
        return tuple(n for name in names
                     for n in ((name,) if self._local_size(name) == 1
                               else (name, local_axis(name))))

    def map(self, fn: Callable, in_specs: tuple, out_specs: Any) -> Callable:
        """`fn` on every IPU of the grid (SPMD), like `jax.shard_map` over it.

        `fn` sees one IPU's block, of size 1 along every axis its arguments
        are split over, whether or not the IPU shares its device; `in_specs`
        (one `PartitionSpec` per argument) and `out_specs` (one per output, a
        tuple matching the outputs' tuple) name the grid's axes.

        Returns:
            The mapped function (collectives in `fn` go through this mesh's
            `psum`, `all_gather` and `axis_index`).
        """
        body = fn
        for axis, local in reversed(list(zip(self.axis_names, self.local))):
            if local > 1:
                body = _batched(body, axis, local, in_specs, out_specs)
        # check_vma is off: collectives appear only on gradients after
        # differentiation, never inside a differentiated function.
        return jax.shard_map(body, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=False)


def _block_shape(devices: np.ndarray) -> tuple[int, ...]:
    """Per axis, how many IPUs from the grid's origin share the origin's device."""
    origin = devices.flat[0]
    shape = []
    for axis, n in enumerate(devices.shape):
        line = np.moveaxis(devices, axis, 0)[(slice(None),) + (0,) * (devices.ndim - 1)]
        run = next((i for i, d in enumerate(line) if d != origin), n)
        shape.append(run if n % run == 0 else n)
    return tuple(shape)


def _dims(specs: Any, axis: str) -> Any:
    """Per spec, the dimension split over `axis`, or `None`."""
    def dim(spec):
        return next((i for i, names in enumerate(spec)
                     if names == axis or (isinstance(names, tuple) and axis in names)), None)

    if isinstance(specs, P):
        return dim(specs)
    return tuple(_dims(s, axis) for s in specs)


def _batched(fn: Callable, axis: str, local: int, in_specs: tuple, out_specs: Any) -> Callable:
    """`fn` vmapped over the `local` IPUs of `axis` on a device, each seeing a block of
    size 1 there (with no argument split over `axis` too: a program without data)."""
    in_dims, out_dims = _dims(in_specs, axis), _dims(out_specs, axis)

    def expand(tree, dim):
        if dim is None:
            return tree
        return jax.tree_util.tree_map(lambda a: jnp.expand_dims(a, dim), tree)

    def squeeze(tree, dim):
        if dim is None:
            return tree
        return jax.tree_util.tree_map(lambda a: jnp.squeeze(a, dim), tree)

    def per_ipu(*args):
        out = fn(*(expand(a, d) for a, d in zip(args, in_dims)))
        if isinstance(out_dims, tuple):
            return tuple(squeeze(o, d) for o, d in zip(out, out_dims))
        return squeeze(out, out_dims)

    # An output not split over `axis` is the same on all its IPUs (as in
    # `shard_map`, which takes any one): stacked by the vmap, the first is kept.
    stacked = jax.vmap(per_ipu, in_axes=in_dims, out_axes=_stacking(out_dims),
                       axis_name=local_axis(axis), axis_size=local)

    @functools.wraps(fn)
    def batched(*args):
        out = stacked(*args)
        if isinstance(out_dims, tuple):
            return tuple(_first(o, d) for o, d in zip(out, out_dims))
        return _first(out, out_dims)

    return batched


def _stacking(dims: Any) -> Any:
    if isinstance(dims, tuple):
        return tuple(_stacking(d) for d in dims)
    return 0 if dims is None else dims


def _first(tree: Any, dim: int | None) -> Any:
    return jax.tree_util.tree_map(lambda a: a[0], tree) if dim is None else tree


__all__: Sequence[str] = ["IPUMesh", "local_axis"]
