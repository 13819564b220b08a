"""Keras optimizers applied in a graph-style program: over every replica's gradients, as
in a Keras training step.

In IPU TensorFlow a Keras optimizer applied inside `strategy.run` all-reduces
its gradients through the strategy before the update, and the IPU strategy
lowers that reduction to a `cross_replica_sum`: a custom training loop on R
replicas trains on every replica's data, and the replicas' weights stay equal.
`install` gives Keras' optimizers that rule inside the programs of
`strategy.run` and `ipu_compiler.compile` (`optimizer.apply`,
`apply_gradients` and `stateless_apply` all apply through `apply`), and applies
them there through their `stateless_apply`, as Keras' JAX training step does:
a stateful `apply` that branches on its state (`LossScaleOptimizer`'s) cannot
be traced. `fit`'s programs reduce their gradients themselves and are not such
programs.
"""
from __future__ import annotations

import contextvars
import functools
from typing import Any

import jax

from keras_ipu.device import collectives, compiled_calls
from keras_ipu.keras import assignments

# Set while an optimizer applies summed gradients: an optimizer whose `apply` calls
# another's (a wrapper's inner optimizer) does not sum them again.
_REDUCED: contextvars.ContextVar[bool] = contextvars.ContextVar("keras_ipu_reduced",
                                                                default=False)


def install() -> None:
    """Makes Keras' optimizers' `apply` sum the gradients over the replicas and apply them
    statelessly when it runs in a program of `strategy.run` or `compile` (idempotent).

    Example:

    >>> install()
    >>> strategy.run(train_step)   # its optimizer.apply trains on every replica's data
    """
    from keras.src.optimizers.base_optimizer import BaseOptimizer
    from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer

    for cls in (BaseOptimizer, LossScaleOptimizer):  # those with an `apply` of their own
        original = cls.__dict__["apply"]
        if not getattr(original, "_keras_ipu_reducing", False):
            cls.apply = _in_programs(original)


def _in_programs(original: Any) -> Any:
    @functools.wraps(original)
    def apply(self, grads: Any, trainable_variables: Any = None) -> Any:
        if _REDUCED.get() or not compiled_calls.in_compiled_program():
            return original(self, grads, trainable_variables)
        if jax.process_count() > 1:
            raise NotImplementedError(
                "An optimizer applied in `strategy.run` or `ipu_compiler.compile` sums the "
                "gradients of this instance's replicas alone: in a job of several instances "
                "their weights would part. Train with `fit`, whose programs span the "
                "instances.")
        token = _REDUCED.set(True)
        if trainable_variables is not None:  # read twice below: not an iterator
            trainable_variables = list(trainable_variables)
        try:
            summed = [None if g is None else collectives.cross_replica_sum(g) for g in grads]
            if not _applied_statelessly(self, summed, trainable_variables):
                _check_not_branching(self, trainable_variables)
                original(self, summed, trainable_variables)
        finally:
            _REDUCED.reset(token)

    apply._keras_ipu_reducing = True
    return apply


def _check_not_branching(optimizer: Any, trainable_variables: list) -> None:
    """Refuses a `LossScaleOptimizer` applied to some of its variables: its stateful
    `apply` branches on Keras variables, which a traced program cannot (JAX's
    "Computation compiled for 14 inputs but called with 2"; plain Keras fails too)."""
    from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer

    if isinstance(optimizer, LossScaleOptimizer):
        raise ValueError(
            f"A LossScaleOptimizer in a compiled program applies to all the variables it was "
            f"built for ({len(optimizer._trainable_variables)}), in their order; got "
            f"{len(trainable_variables)}. Apply it to all of them, or give each set of "
            f"variables its own optimizer.")


def _applied_statelessly(optimizer: Any, grads: list, trainable_variables: Any) -> bool:
    """Applies `grads` through `stateless_apply` and assigns the results (the program's
    stateless scope records them); False, doing nothing, for a subset of the variables
    the optimizer was built for (`stateless_apply` takes them all)."""
    if not optimizer.built:
        # Eagerly, as Keras builds it on its first apply: in the program's scope a
        # variable with a constant initial value (Nadam's, Adafactor's) is refused.
        with assignments.outside_traces():
            optimizer.build(trainable_variables)
    built_for = optimizer._trainable_variables
    if trainable_variables is not None and (
            [id(v) for v in trainable_variables] != [id(v) for v in built_for]):
        return False
    new_weights, new_state = optimizer.stateless_apply(
        [v.value for v in optimizer.variables], grads, [v.value for v in built_for])
    for variable, value in (*zip(built_for, new_weights),
                            *zip(optimizer.variables, new_state)):
        variable.assign(value)
    return True


def reduce_over_replicas(reduce_op: str, value: Any) -> Any:
    """`value` summed (`"SUM"`) or averaged (`"MEAN"`) over the replicas of the program
    being traced, as IPU TensorFlow's strategy reduces on the device; unchanged outside
    a replicated program.

    Args:
        reduce_op: `"SUM"` or `"MEAN"`.
        value: An array, or a tree of arrays.

    Returns:
        The reduced value (the same on every replica).

    Example:

    >>> strategy.run(lambda: reduce_over_replicas("SUM", replication_index() + 1))  # 1 + 2
    """
    if not compiled_calls.in_compiled_program():
        return value
    total = collectives.cross_replica_sum(value)
    if reduce_op == "SUM":
        return total
    count = collectives.replica_count()
    return jax.tree_util.tree_map(lambda v: v / count, total)


__all__ = ["install", "reduce_over_replicas"]
