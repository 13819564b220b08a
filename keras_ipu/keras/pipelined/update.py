"""Each IPU's optimizer step, and what the IPUs tell each other before it.

A pipeline's weights are spread over its IPUs, each updated by its own clone
of the model's optimizer. Two things an optimizer decides over *all* its
variables need every IPU's gradients, so each IPU first reports a summary of
its accumulated gradients (`gradient_summary`) and every IPU combines all of
them (`combine_summaries`):

- a `LossScaleOptimizer` skips an update whose gradients are not all finite:
  one IPU's non-finite gradients skip every IPU's update (`skipped_unless`);
- `global_clipnorm` scales the gradients by their norm over all variables:
  each IPU scales its own by the norm over every IPU's (`clipped_by_global_norm`),
  and its clone, built without `global_clipnorm`, does not clip again.

The schedule program sums the summaries across IPUs with `psum`; the
host-dispatched ops copy each IPU's summary to every IPU.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import keras

from keras_ipu.keras.pipelined import flat_optimizer
from keras_ipu.keras.pipelined.gradients import GradientLayout
from keras_ipu.keras.pipelined.model import PipelinedModel, PipelineState


def loss_scale(pipelined: PipelinedModel, state: PipelineState, optimizer_flats,
               ipu: int | None = None):
    """What the optimizer multiplies the loss by before differentiating it (a scalar).

    An IPU's optimizer clone says, as Keras' train step asks its optimizer
    to `scale_loss`: a `LossScaleOptimizer`'s dynamic scale, an optimizer's
    `loss_scale_factor`, else 1. The clone divides its gradients by the same
    factor when it applies them. All clones hold the same factor.

    Args:
        pipelined: The model's stages and their IPUs.
        state: The packed state layout.
        optimizer_flats: The IPU's packed optimizer variables.
        ipu: Whose clone (default: the last stage's IPU's, which scales the loss).

    Returns:
        The factor, a float32 scalar.

    Example:

    >>> loss_scale(pipe, state, optimizer_flats)   # mixed_float16, at first
    Array(32768., dtype=float32)
    """
    ipu = pipelined.last_ipu if ipu is None else ipu
    optimizer = pipelined.optimizers[ipu]
    values = flat_optimizer.in_clone_order(
        state.layouts["optimizer_variables"][ipu].unpack(optimizer_flats),
        pipelined.optimizer_storage[ipu])
    with keras.StatelessScope(state_mapping=list(zip(optimizer.variables, values))):
        # The loss is a multiple of itself: scaling 1 gives the factor.
        return jnp.asarray(optimizer.scale_loss(jnp.ones((), jnp.float32)), jnp.float32)


def all_finite(tree: Any) -> Any:
    """Whether every value of a pytree of arrays is finite.

    Args:
        tree: A pytree of (traced) float arrays, e.g. an IPU's accumulator.

    Returns:
        A bool scalar.

    Example:

    >>> all_finite({"float32": jnp.array([1.0, jnp.inf])})
    Array(False, dtype=bool)
    """
    leaves = jax.tree_util.tree_leaves(tree)
    # No gradient at all (every weight frozen) is finite, as Keras' check of none.
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(leaf)) for leaf in leaves]
                             or [jnp.bool_(True)]))


def squared_norm(tree: Any) -> Any:
    """The sum of the squares of every value of a pytree of arrays (float32).

    An IPU's accumulator holds zeros where it has no gradient (padding,
    other IPUs' slots): the sum is that of its own gradients.

    Example:

    >>> squared_norm({"float32": jnp.array([3.0, 4.0])})
    Array(25., dtype=float32)
    """
    leaves = jax.tree_util.tree_leaves(tree)
    return sum(jnp.sum(jnp.square(leaf.astype(jnp.float32))) for leaf in leaves)


def skipped_unless(finite: Any, acc: Any) -> Any:
    """`acc`, or NaNs where `finite` is false (every IPU's gradients being finite).

    A `LossScaleOptimizer` skips an update whose gradients are not all finite.
    Each IPU applies its own clone to its own gradients: making an update's
    gradients non-finite on every IPU when they are on one skips it on all,
    as Keras' one optimizer over all the variables does.

    Args:
        finite: A bool scalar: whether the gradients of every IPU are finite.
        acc: This IPU's accumulated gradients (a pytree).

    Returns:
        `acc` when `finite`, else the same structure filled with NaN.

    Example:

    >>> finite = jax.lax.psum((~all_finite(acc)).astype(jnp.int32), IPU_AXIS) == 0
    >>> acc = skipped_unless(finite, acc)
    """
    return jax.tree_util.tree_map(lambda a: jnp.where(finite, a, jnp.nan).astype(a.dtype), acc)


def clipped_by_global_norm(acc: Any, squared: Any, clipnorm: float, scale: Any) -> Any:
    """`acc` scaled as Keras' `global_clipnorm` scales gradients, by the norm over every IPU.

    Keras clips the gradients it applies (unscaled by the loss scale) by
    `clipnorm * min(1 / norm, 1 / clipnorm)`, NaN when the norm is not
    finite; `acc` holds the scaled gradients, whose norm is `scale` times
    theirs.

    Args:
        acc: This IPU's accumulated (loss-scaled) gradients.
        squared: The squared norm of every IPU's accumulated gradients.
        clipnorm: The optimizer's `global_clipnorm`.
        scale: The loss scale (`loss_scale`; 1 without one).

    Returns:
        `acc`, scaled.

    Example:

    >>> acc = clipped_by_global_norm(acc, jax.lax.psum(squared_norm(acc), IPU_AXIS), 1.0, 1.0)
    """
    norm = jnp.sqrt(squared) / scale
    factor = clipnorm * jnp.minimum(1.0 / norm, 1.0 / clipnorm)
    factor = factor + (norm - norm)
    return jax.tree_util.tree_map(lambda a: (a * factor).astype(a.dtype), acc)


def gradient_summary(pipelined: PipelinedModel, acc: Any) -> tuple:
    """What an IPU tells the others of its accumulated gradients before the optimizer steps.

    Returns:
        `(finite,)` with a `LossScaleOptimizer`, then `(squared norm,)` with
        `global_clipnorm`: an empty tuple when neither needs anything.

    Example:

    >>> gradient_summary(pipe, acc)   # SGD(global_clipnorm=1.0)
    (Array(0.25, dtype=float32),)
    """
    summary = ()
    if pipelined.loss_scaled:
        summary += (all_finite(acc),)
    if pipelined.global_clipnorm:
        summary += (squared_norm(acc),)
    return summary


def combine_summaries(pipelined: PipelinedModel, summaries: tuple) -> tuple[Any, Any]:
    """`(all finite, squared norm)` over every IPU's `gradient_summary` (`None` where unused).

    Example:

    >>> finite, squared = combine_summaries(pipe, tuple(summaries))
    """
    finite = squared = None
    if pipelined.loss_scaled:
        finite = jnp.all(jnp.stack([summary[0] for summary in summaries]))
    if pipelined.global_clipnorm:
        squared = sum(summary[-1] for summary in summaries)
    return finite, squared


def optimizer_update(pipelined: PipelinedModel, state: PipelineState,
                     grads_layout: GradientLayout, ipu: int):
    """`apply(trainable, optimizer_vars, acc, squared=None, finite=None) -> (trainable, ...)`.

    One IPU's step: its optimizer clone applied to its packed variables with
    the summed gradients of an accumulator (`grads_layout`); an elementwise
    optimizer's flat form (`flat_optimizer`) to all of them at once. With
    `global_clipnorm`, `squared` is the squared norm of every IPU's
    accumulated gradients, which clips them first. With a
    `LossScaleOptimizer`, `finite` says whether every IPU's gradients are
    finite: an IPU holding no weights moves its loss scale by it (its clone
    would see no gradient, never skip, and scale the loss wrongly when it is
    the last stage's).
    """
    t_layout = state.layouts["trainable_variables"][ipu]
    o_layout = state.layouts["optimizer_variables"][ipu]
    optimizer, flat = pipelined.optimizers[ipu], pipelined.flat_optimizers[ipu]
    order = pipelined.optimizer_storage[ipu]

    def apply(trainable, optimizer_vars, acc, squared=None, finite=None):
        if finite is not None and not pipelined.trainable_of[ipu]:
            return trainable, _loss_scale_only(optimizer, optimizer_vars, finite)
        if squared is not None:
            scale = loss_scale(pipelined, state, optimizer_vars, ipu)
            acc = clipped_by_global_norm(acc, squared, pipelined.global_clipnorm, scale)
        if flat is not None:
            return flat.apply(o_layout, trainable, optimizer_vars,
                              grads_layout.flat(ipu, acc, flat.dtype))
        variables = t_layout.unpack(trainable)
        grads = [g.astype(v.dtype) for g, v in zip(grads_layout.unpack(ipu, acc), variables)]
        variables, optimizer_values = optimizer.stateless_apply(
            flat_optimizer.in_clone_order(o_layout.unpack(optimizer_vars), order), grads,
            variables)
        return (t_layout.pack(variables, state.lengths["trainable_variables"]),
                o_layout.pack(flat_optimizer.in_storage_order(optimizer_values, order),
                              state.lengths["optimizer_variables"]))

    def _loss_scale_only(optimizer, optimizer_vars, finite):
        # An IPU without weights: its clone sees no gradient, so would never skip;
        # it follows every IPU's finiteness instead, as Keras' one optimizer does.
        values = flat_optimizer.in_clone_order(o_layout.unpack(optimizer_vars), order)
        values = jax.lax.cond(
            finite, lambda v: optimizer._stateless_handle_finite_grads(v, [], [])[1],
            lambda v: optimizer._stateless_handle_non_finite_grads(v, [])[1], values)
        return o_layout.pack(flat_optimizer.in_storage_order(values, order),
                             state.lengths["optimizer_variables"])

    return apply


__all__ = ["all_finite", "clipped_by_global_norm", "combine_summaries", "gradient_summary",
           "loss_scale", "optimizer_update", "skipped_unless", "squared_norm"]
