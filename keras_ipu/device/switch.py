"""A `lax.switch` whose index is per IPU, for IPUs batched on one device.

IPUs that share a JAX device run batched: a `vmap` over them (`mesh.py`).
Under a `vmap`, a `lax.switch` whose index differs along the batch becomes
a `select` over the outputs of every branch, each run for every IPU. A
pipeline picks each IPU's ops of a tick this way (its stage's forward,
backward or nothing), so on a shared device every IPU would run every
stage's ops: the work of all stages, times the IPUs sharing it, where an
IPU of its own runs one.

`one_branch_each` is that switch with its own batching rule: when its index
is batched, the IPUs of the batch run their own branch in turn (a
`lax.map` over them, each a `lax.switch` with one index), so a device runs
each IPU's ops once, and the program's counted flops, divided among the
IPUs that share it, are what each would run alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp


def one_branch_each(index: Any, branches: Sequence[Callable], *operands: Any) -> Any:
    """`lax.switch(index, branches, *operands)`, batched one branch per element.

    Args:
        index: The branch to run (a scalar integer; under a `vmap`, one per IPU).
        branches: Functions of `*operands` with outputs of one structure.
        *operands: The branches' arguments (pytrees).

    Returns:
        The output of branch `index` (of each element's branch, under a `vmap`).

    Raises:
        TypeError: When the branches' outputs differ in structure or type
            (as `lax.switch` raises).

    The branches must not use collectives or `axis_index` of the `vmap`
    that batches `index` (they run outside it, one element at a time); the
    names of outer `vmap`s and of `shard_map` keep their meaning. Only the
    innermost `vmap` that batches `index` runs its elements in turn: an
    outer one that batches it too selects over the branches, as JAX's own
    rule does. Reverse-mode differentiation through the switch is not
    supported (`custom_vmap` has no transpose); a program differentiates
    inside its branches.

    Example:

    >>> def per_ipu(i, x):
    ...     return one_branch_each(i, [jnp.sin, lambda v: v @ v.T @ v], x)
    >>> jax.vmap(per_ipu)(jnp.arange(2), jnp.ones((2, 4, 4))).shape  # 1 product, not 2
    (2, 4, 4)
    """
    # A custom batching rule cannot close over batched values: what the
    # branches close over becomes arguments.
    hoisted = [_hoisted(branch, operands) for branch in branches]
    closed = [function for function, _ in hoisted]
    captured = [values for _, values in hoisted]
    return _switch(closed)(index, captured, operands)


def _hoisted(branch: Callable, operands: tuple) -> tuple[Callable, list]:
    """`branch` as a function of `(captured, *operands)`, and the values it captures."""
    traced = jax.make_jaxpr(branch, return_shape=True)(*operands)
    jaxpr, shapes = traced
    out_tree = jax.tree_util.tree_structure(shapes)

    def run(captured: list, *args):
        leaves = jax.tree_util.tree_leaves(args)
        outputs = jex.jaxpr_as_fun(jex.ClosedJaxpr(jaxpr.jaxpr, captured))(*leaves)
        return jax.tree_util.tree_unflatten(out_tree, outputs)

    return run, list(jaxpr.consts)


def _switch(closed: list[Callable]) -> Callable:
    """The switch over the hoisted branches, with its batching rule."""

    def switch(index, captured, operands):
        branches = [lambda c, o, i=i: closed[i](c[i], *o) for i in range(len(closed))]
        return jax.lax.switch(index, branches, captured, operands)

    @jax.custom_batching.custom_vmap
    def batched_switch(index, captured, operands):
        return switch(index, captured, operands)

    @batched_switch.def_vmap
    def rule(axis_size, in_batched, index, captured, operands):
        index_batched, *flags = in_batched
        args = (captured, operands)
        if not any(jax.tree_util.tree_leaves(in_batched)):
            # Nothing batched (forward-mode differentiation asks so): one switch.
            out = switch(index, *args)
            return out, jax.tree_util.tree_map(lambda _: False, out)
        if not index_batched:  # every element runs the same branch: JAX's own rule
            axes = jax.tree_util.tree_map(lambda b: 0 if b else None, tuple(flags))
            out = jax.vmap(lambda c, o: switch(index, c, o), in_axes=axes)(*args)
        else:
            out = _in_turn(switch, axis_size, index, args, flags)
        return out, jax.tree_util.tree_map(lambda _: True, out)

    return batched_switch


def _in_turn(switch: Callable, axis_size: int, index, args: tuple, flags: list) -> Any:
    """`switch` for each element of the batch in turn (a `lax.map`).

    Only the batched arguments are mapped over; the others are closed over,
    not copied once per element. (Each element's slice of a batched one is
    a copy: a pipeline's inbox and stash rows per IPU, small next to the
    stage ops that a select over every branch would run for every IPU.)
    """
    leaves, tree = jax.tree_util.tree_flatten(args)
    batched = jax.tree_util.tree_leaves(flags)
    mapped = [leaf for leaf, b in zip(leaves, batched) if b]

    def one(element):
        i, values = element
        values = iter(values)
        full = [next(values) if b else leaf for leaf, b in zip(leaves, batched)]
        return switch(i, *jax.tree_util.tree_unflatten(tree, full))

    del axis_size  # lax.map takes it from the index
    return jax.lax.map(one, (jnp.asarray(index), mapped))


__all__ = ["one_branch_each"]
