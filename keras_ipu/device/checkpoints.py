"""Recomputation checkpoints: values a recomputing pipeline stage keeps for its backward op.

Under `RecomputationMode.RecomputeAndBackpropagateInterleaved` (the
Sequential schedule's default) a stage's backward op recomputes its forward
pass from what the forward op kept: the stage's input and the values marked
with `checkpoint`. The stage runs under `jax.checkpoint` with a policy that
saves only those values, so its pullback's residuals are exactly them; the
pipeline stashes them as it stashes activations without recomputation.
Under `RecomputeThenBackpropagate` (the Grouped and Interleaved schedules'
default) the marks have no effect: the stage is recomputed from its input.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.ad_checkpoint import checkpoint_name

from keras_ipu.device.schedules import PipelineSchedule, RecomputationMode

NAME = "keras_ipu_recomputation_checkpoint"


def checkpoint(values: Any) -> Any:
    """Marks values (a tree of arrays) as recomputation checkpoints; returns them.

    Args:
        values: A JAX array, or a tree of them.

    Returns:
        The same values, marked (outside a recomputing stage the mark is
        inert).

    Example:

    >>> hidden = checkpoint(jnp.tanh(x))
    """
    return jax.tree_util.tree_map(lambda value: checkpoint_name(value, NAME), values)


def recomputed_from_checkpoints(stage: Callable) -> Callable:
    """`stage`, differentiated so that its backward pass keeps only the checkpoints.

    Args:
        stage: A JAX-traceable function.

    Returns:
        The function under `jax.checkpoint`, saving only values marked by
        `checkpoint` (its inputs are kept by the caller).

    Example:

    >>> out, pullback = jax.vjp(recomputed_from_checkpoints(f), weights, inputs)
    """
    policy = jax.checkpoint_policies.save_only_these_names(NAME)
    return jax.checkpoint(stage, policy=policy)


def keeps_checkpoints(mode: RecomputationMode, schedule: PipelineSchedule) -> bool:
    """Whether a recomputing pipeline's backward ops start from its checkpoints.

    Args:
        mode: The pipelining `recomputation_mode` (`Auto` by default).
        schedule: The pipeline schedule; `Auto` resolves to its default mode.

    Returns:
        `True` for `RecomputeAndBackpropagateInterleaved`, given or as the
        Sequential schedule's `Auto`.

    Example:

    >>> keeps_checkpoints(RecomputationMode.Auto, PipelineSchedule.Sequential)
    True
    """
    if mode == RecomputationMode.Auto:
        return schedule == PipelineSchedule.Sequential
    return mode == RecomputationMode.RecomputeAndBackpropagateInterleaved
