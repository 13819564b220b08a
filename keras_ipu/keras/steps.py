"""Step functions of the IPU programs, built from the model's stateless Keras steps.

A training step is one weight update: it runs the model on the step's
micro-batches (gradient accumulation) in an inner on-device loop, reduces
their gradients, sums them over replicas, and applies the optimizer once.
Non-trainable state and metrics update every micro-batch, as in Keras.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from keras import StatelessScope
from keras.src.trainers.data_adapters import data_adapter_utils

from keras_ipu.device import collectives
from keras_ipu.device.replicate import Replicas
from keras_ipu.gradient_accumulation import GradientAccumulationReductionMethod as Reduction

Step = Callable[[Any, Any], tuple[Any, Any]]

# The state each mode's step function takes, in Keras' order.
STATE_PARTS = {
    "fit": (
        "trainable_variables",
        "non_trainable_variables",
        "optimizer_variables",
        "metrics_variables",
    ),
    "evaluate": ("trainable_variables", "non_trainable_variables", "metrics_variables"),
    "predict": ("trainable_variables", "non_trainable_variables"),
}

# acc <- accumulate(acc, grad, n, count) for the n-th (0-based) of `count`
# micro-batches; the reference's accumulation scales, as data.
ACCUMULATE = {
    Reduction.SUM: lambda acc, grad, n, count: acc + grad,
    Reduction.MEAN: lambda acc, grad, n, count: acc + grad / count,
    Reduction.RUNNING_MEAN: lambda acc, grad, n, count: acc * (n / (n + 1)) + grad / (n + 1),
}
# The update of a weight several pipeline stages use (a tied embedding): their parts of a
# micro-batch's gradient arrive in no fixed order with other micro-batches', which a running
# mean (rescaling what it holds at each micro-batch) would weigh wrongly: added as the mean
# adds them, they give the same result.
ACCUMULATE_SHARED = {**ACCUMULATE, Reduction.RUNNING_MEAN: ACCUMULATE[Reduction.MEAN]}


def train_step(
    model: Any,
    *,
    micro_batches: int,
    reduction: Reduction,
    accumulator_dtypes: Sequence[str],
    replicas: Replicas,
    every_micro_batch_logs: bool = True,
) -> Step:
    """One weight update over `micro_batches` stacked micro-batches.

    Args:
        model: The Keras model (its stateless `compute_loss_and_updates`,
            metrics update and optimizer are used, as Keras' own train step).
        micro_batches: Micro-batches per update (the leading axis of a step's data).
        reduction: How their gradients are combined.
        accumulator_dtypes: Per trainable variable, the dtype its gradients
            accumulate in (`options.accumulator_dtypes`).
        replicas: Gradients are summed over these replicas before the update.
        every_micro_batch_logs: Whether every micro-batch's logs are returned
            (for callbacks that see each batch). Without, only the last
            micro-batch's logs are, worked out once after the loop from the
            metrics' final state: the model's `compute_metrics` and
            `get_metrics_result` must then be Keras' own, whose logs are the
            metrics' results. Accelerators pay per kernel: that is one kernel
            fewer per micro-batch (the logs' copy into the stacked buffer).

    Returns:
        `step(state, data) -> (logs, state)`, with logs per micro-batch
        (a leading axis of `micro_batches`, or of 1 with only the last's).
    """
    accumulate = ACCUMULATE[reduction]
    # Variables Keras overwrites with their gradient (float8 scales and amax
    # histories): their micro-batches' and replicas' values combine by their
    # maximum, as Keras' own gradient accumulation combines them.
    overwritten = tuple(bool(getattr(v, "overwrite_with_gradient", False))
                        for v in model.trainable_variables)

    def combined(a, g, n, overwrite: bool):
        g = g.astype(a.dtype)
        if overwrite:
            return jnp.where(n == 0, g, jnp.maximum(a, g))
        # In the accumulator's type: a float32 count would promote a 16-bit one.
        return accumulate(a, g, n.astype(a.dtype), micro_batches).astype(a.dtype)

    def step(state, data):
        trainable, non_trainable, optimizer_vars, metrics_vars = state

        def gradients(non_trainable, metrics_vars, batch):
            x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(batch)
            (_, aux), grads = jax.value_and_grad(model.compute_loss_and_updates, has_aux=True)(
                trainable,
                non_trainable,
                metrics_vars,
                x,
                y,
                sample_weight,
                training=True,
                optimizer_variables=optimizer_vars,
            )
            unscaled_loss, y_pred, non_trainable, metrics_vars = aux
            logs, metrics_vars = model._update_metrics_variables(
                metrics_vars, unscaled_loss, x, y, y_pred, sample_weight
            )
            return grads, non_trainable, metrics_vars, (
                logs if every_micro_batch_logs else None)

        def micro_step(carry, batch):
            non_trainable, metrics_vars, acc, n = carry
            grads, non_trainable, metrics_vars, logs = gradients(
                non_trainable, metrics_vars, batch)
            acc = [combined(a, g, n, over) for a, g, over in zip(acc, grads, overwritten)]
            return (non_trainable, metrics_vars, acc, n + 1), logs

        if micro_batches == 1:
            # No loop of one: a loop costs compile time, and on XLA:CPU keeps
            # convolutions off their fast path (see device/loops.py). Every
            # reduction of one gradient is that gradient: none is combined
            # with zeros (ResNet50: 650 operations fewer for XLA to compile).
            # Nor is it held in an accumulator's dtype: as in the reference,
            # one micro-batch is no accumulation.
            acc, non_trainable, metrics_vars, logs = gradients(
                non_trainable, metrics_vars, jax.tree_util.tree_map(lambda a: a[0], data))
            logs = _stacked_one(logs)
        else:
            zeros = [jnp.zeros(v.shape, dtype)
                     for v, dtype in zip(trainable, accumulator_dtypes)]
            carry = (non_trainable, metrics_vars, zeros, jnp.float32(0))
            (non_trainable, metrics_vars, acc, _), logs = jax.lax.scan(micro_step, carry, data)
        if logs is None:
            logs = _stacked_one(metrics_logs(model, metrics_vars))
        grads = [g.astype(v.dtype) for g, v in zip(_over_replicas(replicas, acc, overwritten),
                                                     trainable)]
        trainable, optimizer_vars = model.optimizer.stateless_apply(
            optimizer_vars, grads, trainable
        )
        return logs, (trainable, non_trainable, optimizer_vars, metrics_vars)

    return step


def _over_replicas(replicas: Replicas, acc: list, overwritten: Sequence[bool]) -> list:
    """The gradients summed over the replicas (one all-reduce), the overwritten
    variables' values their maximum."""
    summed = iter(replicas.sum([g for g, over in zip(acc, overwritten) if not over]))
    maxed = iter(replicas.max([g for g, over in zip(acc, overwritten) if over]))
    return [next(maxed) if over else next(summed) for over in overwritten]


def metrics_logs(model: Any, metrics_vars: Any) -> dict:
    """The logs Keras' own `compute_metrics` returns once the metrics hold `metrics_vars`."""
    mapping = list(zip(model.metrics_variables, metrics_vars))
    with StatelessScope(state_mapping=mapping):
        return model.get_metrics_result()


def keras_train_step(model: Any) -> Step:
    """The model's own (possibly overridden) Keras train step, one batch per step."""

    def step(state, data):
        logs, new_state = model.train_step(state, jax.tree_util.tree_map(lambda a: a[0], data))
        return _stacked_one(logs), _like(state, new_state, "train_step")

    return step


def test_step(model: Any) -> Step:
    """The model's Keras test step."""

    def step(state, data):
        logs, new_state = model.test_step(state, data)
        return logs, _like(state, new_state, "test_step")

    return step


def predict_step(model: Any) -> Step:
    """The model's Keras predict step, keeping the trainable state."""

    def step(state, data):
        outputs, non_trainable = model.predict_step(state, data)
        return outputs, (state[0], _like(state[1], non_trainable, "predict_step"))

    return step


def _stacked_one(logs: Any) -> Any:
    """One step's logs with a leading axis of 1 (a Python number in them too, as Keras
    logs it)."""
    return jax.tree_util.tree_map(lambda a: jnp.asarray(a)[None], logs)


def _like(state: Any, new_state: Any, method: str) -> Any:
    """`new_state` in the containers of `state`: Keras takes a step's state back as lists
    or tuples alike, the program's loop needs the structure it started with.

    Raises:
        ValueError: When `new_state` holds another number of values.
    """
    leaves, structure = jax.tree_util.tree_flatten(state)
    new_leaves = jax.tree_util.tree_leaves(new_state)
    if len(new_leaves) != len(leaves):
        raise ValueError(
            f"{method} returned a state of {len(new_leaves)} values, but it was given "
            f"{len(leaves)}: return one new value per variable of the state it got, in "
            f"its order.")
    return jax.tree_util.tree_unflatten(structure, new_leaves)


def distinct_random_streams(model: Any, step: Step) -> Step:
    """`step` with each replica drawing its own random numbers, as IPU replicas do by default.

    Keras' seed generators advance only the second word of their state
    (`[seed, counter]`); each replica's seeds get the first word XORed with
    a mask of its index for the step, and back after it. Replica 0 draws
    what one IPU would, the others their own numbers, and every replica
    still ends the step with the same state.

    Args:
        model: The Keras model whose seed generators' states are among its
            non-trainable variables (the state's second part).
        step: `step(state, data) -> (outputs, state)`, run per replica.

    Returns:
        The step with per-replica random streams.

    Example:

    >>> step = distinct_random_streams(model, steps.train_step(model, ...))
    """
    seeds = seed_state_indices(model.non_trainable_variables)
    if not seeds:
        return step

    def masked(state, mask):
        non_trainable = xor_seed_words(list(state[1]), seeds, mask)
        return (state[0], non_trainable, *state[2:])

    def replicated(state, data):
        mask = replica_seed_mask(collectives.replica_index())
        outputs, state = step(masked(state, mask), data)
        return outputs, masked(state, mask)

    return replicated


def seed_state_indices(variables: Any) -> list[int]:
    """Positions of Keras seed generators' `[seed, counter]` states among `variables`."""
    return [i for i, v in enumerate(variables) if is_seed_state(v)]


def is_seed_state(variable: Any) -> bool:
    """Whether `variable` is a Keras seed generator's `[seed, counter]` state.

    Example:

    >>> is_seed_state(keras.random.SeedGenerator(1).state)
    True
    """
    return variable.name == _SEED_STATE_NAME and tuple(variable.shape) == (2,)


def replica_seed_mask(replica: Any) -> jax.Array:
    """The word a replica's seeds are XORed with: 0 for replica 0, distinct for the others."""
    return jnp.asarray(replica).astype(jnp.uint32) * jnp.uint32(0x9E3779B9)


def xor_seed_words(values: Any, positions: Any, mask: Any) -> Any:
    """`values` (a list or a dict) with the seed word of the states at `positions` XORed.

    XOR is its own inverse: applied twice with one mask, the states are back.
    """
    for i in positions:
        word = values[i][0] ^ mask.astype(values[i].dtype)
        values[i] = values[i].at[0].set(word)
    return values


# The name Keras gives a `SeedGenerator`'s state variable.
_SEED_STATE_NAME = "seed_generator_state"
