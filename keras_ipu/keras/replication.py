"""Replication on the Keras side: the replicas a model runs on, data layouts, metric reduction."""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from keras_ipu.device import processes
from keras_ipu.device.replicate import Replicas
from keras_ipu.keras import context
from keras_ipu.keras.data import ROLES, FeedPlan
from keras_ipu.keras.options import ReplicatedMetricReductionMethod as Reduction

# The returned value of one log entry from its per-replica values `[R, ...]` (a
# metric's value may be a vector: F1Score(average=None), several thresholds).
REPLICA_REDUCTIONS = {
    Reduction.NONE: lambda values: values[-1],
    Reduction.LIST: lambda values: values,
    Reduction.SUM: lambda values: jnp.sum(values, axis=0),
    Reduction.MEAN: lambda values: jnp.mean(values, axis=0),
}


# A run's state no longer fits its program: refused, the model keeps its weights.
VARIABLES_CHANGED = (
    "The model's variables changed during the run (a callback froze or unfroze a layer, "
    "say): its compiled program trains those it started with. As in Keras, training another "
    "set of weights needs compile() again; the weights are those of the last execution.")


def resumed_state(codec: Any, parts: tuple[str, ...], keras_state: Any, previous: Any) -> Any:
    """The device state to go on from after a callback synced the model mid-run.

    Keras' variables hold one replica's metric states (the last's, what
    `NONE` reports): where they are still those the sync gave them, every
    replica goes on from its own (held in `previous`), so that reduced logs
    (`MEAN`, `SUM`, `LIST`) stay those of an unsynced run. Metrics the
    callback changed (reset, say) go to every replica.

    Args:
        codec: The run's codec (`ReplicaCodec` or the pipeline's).
        parts: The state's parts, in `keras_state`'s order.
        keras_state: The Keras variables' values, per part.
        previous: The device state before the sync (`None`: the first).

    Returns:
        The device state.

    Example:

    >>> state = resumed_state(codec, parts, model._get_jax_state(...), state)
    """
    state = codec.to_device(keras_state)
    if previous is None or "metrics_variables" not in parts:
        return state
    synced = codec.to_keras(previous)["metrics_variables"]
    now = keras_state[parts.index("metrics_variables")]
    if all(np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True)
           for a, b in zip(synced, now)):
        return codec.with_metrics_of(state, previous)
    return state


def next_power_of_two(n: int) -> int:
    """The smallest power of two ≥ n."""
    return 1 << max(n - 1, 0).bit_length()


def replicas_for(model: Any, ipus_per_replica: int = 1) -> Replicas:
    """The replicas a model runs on: `R = num_ipus // next_pow2(ipus_per_replica)`.

    Raises:
        RuntimeError: When no IPU system is configured.
        ValueError: When the model needs more IPUs than its device has.
    """
    ipus = context.device_ipus(model)
    per_replica = next_power_of_two(ipus_per_replica)
    if per_replica > len(ipus):
        raise ValueError(
            f"Current device has {len(ipus)} IPUs attached, however the current model "
            f"requires a multiple of {per_replica} IPUs."
        )
    count = len(ipus) // per_replica
    # In a multi-host job the replicas span every instance's IPUs.
    return Replicas(processes.global_ipus(tuple(ipus[i * per_replica] for i in range(count))))


def local_predictions(replicas: Replicas, outfeed: Any) -> Any:
    """This instance's predictions in its input order, from `[steps, replicas, batch, ...]`.

    Example:

    >>> local_predictions(replicas, outfeed)["dense"].shape   # 2 steps, 2 local replicas of 4
    (16, 3)
    """
    first, last = replicas.local_replicas[0], replicas.local_replicas[-1]
    return jax.tree_util.tree_map(
        lambda a: np.asarray(a)[:, first : last + 1].reshape(-1, *a.shape[3:]), outfeed)


@dataclasses.dataclass(frozen=True)
class Layout:
    """How an execution's data and outfeed are arranged for its program.

    The feed gives `[steps, (replicas,) batch, ...]`. With gradient
    accumulation (`micro_batches`), the program takes
    `[steps / micro_batches, (replicas,) micro_batches, batch, ...]`: a
    program step is a weight update. Outfeeds come back in the same shape
    and are turned into per-batch values, `[steps, (replicas,) ...]`.

    Args:
        replicas: The replication factor.
        micro_batches: Batches per program step, or `None` when a program
            step is one batch without a micro-batch axis (evaluate, predict).
    """

    replicas: int
    micro_batches: int | None = None

    def to_program(self, batches: Any) -> Any:
        """Host data of an execution, regrouped for the program (NumPy)."""
        if self.micro_batches is None:
            return batches
        return jax.tree_util.tree_map(self._group, batches)

    def _group(self, a: np.ndarray) -> np.ndarray:
        steps = a.shape[0] // self.micro_batches
        if self.replicas == 1:
            return a.reshape(steps, self.micro_batches, *a.shape[1:])
        grouped = a.reshape(steps, self.micro_batches, *a.shape[1:])
        return np.swapaxes(grouped, 1, 2)  # [updates, replicas, micro, ...]

    def per_batch(self, outfeed: Any) -> Any:
        """The outfeed as one entry per batch: `[steps, (replicas,) ...]`."""
        if self.micro_batches is None:
            return outfeed
        return jax.tree_util.tree_map(self._ungroup, outfeed)

    def _ungroup(self, a: jax.Array) -> jax.Array:
        if self.replicas > 1:
            a = jnp.swapaxes(a, 1, 2)  # [updates, micro, replicas, ...]
        return a.reshape(-1, *a.shape[2:])

    def last_logs(self, outfeed: Any, reduction: Reduction) -> Any:
        """The last batch's logs, replicas reduced by `reduction`."""
        last = jax.tree_util.tree_map(lambda a: a[-1], self.per_batch(outfeed))
        if self.replicas == 1:
            return last
        return jax.tree_util.tree_map(REPLICA_REDUCTIONS[reduction], last)

    def predictions(self, outfeed: Any) -> Any:
        """Predictions in input order: `[steps × replicas × batch, ...]`."""
        lead = 3 if self.replicas > 1 else 2
        return jax.tree_util.tree_map(lambda a: a.reshape(-1, *a.shape[lead:]), outfeed)


def instance_steps(steps: int | None, replicas: Replicas, argument: str = "steps") -> int | None:
    """This instance's share of `steps` (`steps_per_epoch`, `steps`), which count the
    batches of all replicas together, as in one process (PopDist divides them alike).

    Raises:
        ValueError: When `steps` is fewer than the replicas, or does not
            divide among the instances.

    Example:

    >>> instance_steps(8, replicas)   # 2 instances × 2 replicas: 4 batches in each
    4
    """
    if steps is None or steps == -1 or not replicas.spans_processes:
        return steps
    instances = replicas.count // replicas.local_count
    if steps > 0 and (steps < replicas.count or steps % instances):
        raise ValueError(
            f"{argument}={steps} counts the batches of all {replicas.count} replicas of the "
            f"{instances} instances together, so it must be at least {replicas.count} (one "
            f"batch per replica) and a multiple of {instances} (as many in each instance); "
            f"got {steps}.")
    return steps // instances if steps > 0 else steps


def check_instance_steps(replicas: Replicas, mode: str, plans: dict[str, FeedPlan | None],
                         epochs: tuple[int, int] = (1, 0)) -> None:
    """Across instances: raises in every instance when they would run different numbers of steps.

    Each instance feeds its own data; one with fewer batches would finish its
    executions while the others wait in a collective for it, until the job's
    shutdown timeout. Every instance must call it, before anything runs (it
    gathers each instance's plans; nothing when the replicas are in one process).

    Args:
        replicas: The run's replicas.
        mode: `"fit"`, `"evaluate"` or `"predict"`, for the message.
        plans: Per data role (`"fit"`, `"validation"`, `"evaluate"`, `"predict"`),
            this instance's feed plan, or `None` when it has no such data.
        epochs: `fit`'s `(epochs, initial_epoch)`: the passes over the data.

    Raises:
        ValueError: The same in every instance, naming each instance's batches and
            executions, when they differ for some role.

    Example:

    >>> check_instance_steps(replicas, "fit", {"fit": feed.plan, "validation": None})
    """
    if not replicas.spans_processes:
        return
    from jax.experimental import multihost_utils

    # First a digest of the same size for every call: the plans' differ by mode.
    _check_at_one_point(f"a call of `{mode}`")
    mine = np.array([[p.steps * p.replicas, p.steps // p.steps_per_execution,
                      p.steps_per_execution] if p else [0, 0, 0] for p in plans.values()]
                    + [[*epochs, replicas.count]], np.int64)
    every = np.asarray(multihost_utils.process_allgather(mine, tiled=False))
    counts = every[:, -1, 2]
    if not (counts == counts[0]).all():
        each = ", ".join(f"instance {i} counts {count} replicas"
                         for i, count in enumerate(counts.tolist()))
        raise ValueError(
            f"`{mode}` across {len(every)} instances: the instances configured different "
            f"numbers of IPUs ({each}): configure each instance's system alike "
            f"(`ipu.distributed.update_ipu_config`, or the same `auto_select_ipus`).")
    passes = every[:, -1, :2]
    if not (passes == passes[0]).all():
        each = ", ".join(f"instance {i} has epochs={e}, initial_epoch={first}"
                         for i, (e, first) in enumerate(passes.tolist()))
        raise ValueError(
            f"`{mode}` across {len(every)} instances: the instances run different epochs, so "
            f"the job would hang waiting for the instance that finished first: {each}. Give "
            f"every instance the same `epochs` and `initial_epoch`.")
    for k, role in enumerate(plans):
        counts = every[:, k]
        if (counts == counts[0]).all():
            continue
        each = ", ".join(
            f"instance {i} has {batches} batches ({executions} execution"
            f"{'s' if executions != 1 else ''} of {per_execution} steps per replica)"
            for i, (batches, executions, per_execution) in enumerate(counts.tolist()))
        argument = ROLES[role].steps_argument
        raise ValueError(
            f"`{mode}` across {len(every)} instances: {ROLES[role].subject} gives the "
            f"instances different numbers of steps, so the job would hang waiting for the "
            f"instance that finished first: {each}. Every instance must run the same number "
            f"of steps: give each instance the same number of batches (cut the data with "
            f"`ipu.distributed.shard_for_instance`), or pass `{argument}` (the batches of all "
            f"instances together).")


def check_instances_agree(replicas: Replicas, mode: str, what: str, mine: Any) -> None:
    """Across instances: raises in every instance when their `mine` differ.

    For what a callback given to some instances only changes as the run goes
    (`BackupAndRestore`'s first epoch, `EarlyStopping`'s `model.stop_training`):
    the instances would run different steps, and the job would hang in a
    collective or abort in the collective library.

    Args:
        replicas: The run's replicas (nothing is gathered within one process).
        mode: `"fit"`, for the message.
        what: What `mine` is, for the message (`"the epochs it runs"`).
        mine: This instance's value: an integer or a sequence of integers.

    Raises:
        ValueError: The same in every instance, naming each instance's value.

    Example:

    >>> check_instances_agree(replicas, "fit", "model.stop_training", [int(stop)])
    """
    if not replicas.spans_processes:
        return
    from jax.experimental import multihost_utils

    _check_at_one_point(f"`{mode}` checking {what}")
    every = np.asarray(multihost_utils.process_allgather(
        np.atleast_1d(np.asarray(mine, np.int64)), tiled=False))
    if (every == every[0]).all():
        return
    each = "; ".join(f"instance {i}: {values}" for i, values in enumerate(every.tolist()))
    raise ValueError(
        f"`{mode}` across {len(every)} instances: they disagree on {what} ({each}), so the "
        f"job would hang waiting for an instance that stopped. A callback that changes the "
        f"run (EarlyStopping, BackupAndRestore, one setting model.stop_training) must be "
        f"given to every instance, with the same settings.")


def _check_at_one_point(point: str) -> None:
    """Raises the same error in every instance when they are not at the same `point` of the
    run: one in a call the others do not make (an `evaluate` in one instance's callback)
    would pair its exchanges with theirs, of other sizes, and abort or hang the job."""
    from keras_ipu.distributed import runtime

    runtime.check_described_alike(
        [point], "The point the instances' runs are at",
        "Every instance must call `fit`, `evaluate` and `predict` in the same order (in a "
        "callback too) and be given the same callbacks.")


def any_instance(replicas: Replicas, mine: bool) -> bool:
    """Across instances: whether `mine` is true in any instance (each must call it).

    Args:
        replicas: The run's replicas (nothing is gathered within one process).
        mine: This instance's answer.

    Returns:
        Whether some instance's is true.

    Example:

    >>> any_instance(replicas, has_batch_hooks)   # instance 1 has some: True in both
    True
    """
    if not replicas.spans_processes:
        return bool(mine)
    from jax.experimental import multihost_utils

    return bool(np.asarray(multihost_utils.process_allgather(
        np.asarray([int(bool(mine))], np.int64))).any())


def agreed_executions(replicas: Replicas, executions: Iterable) -> Iterator:
    """Across instances: the executions of a feed of unknown length while every instance
    has its own; once one instance's runs out, every instance ends the pass there.

    An instance whose generator ran out ends its pass (as one process does); the
    others would wait in the next execution's collectives for ever. Each
    execution costs one gather of a flag across the instances.

    Args:
        replicas: The run's replicas (nothing is gathered within one process).
        executions: This instance's executions (an infeed).

    Returns:
        An iterator over the executions that every instance has.

    Example:

    >>> for begin, end, batches in agreed_executions(replicas, infeed):
    ...     state, logs = program(state, batches)
    """
    executions = iter(executions)
    while True:
        execution = next(executions, None)
        if any_instance(replicas, execution is None):
            if execution is not None:
                warnings.warn(
                    "The input of another instance of the job ran out of data; interrupting "
                    "the epoch in every instance (this instance's batches for the execution "
                    "are dropped). Give every instance as many batches.", stacklevel=2)
            return
        yield execution


def check_instance_programs(model: Any, mode: str, parts: tuple[str, ...], batch: Any,
                            options: Any, placement: Any) -> None:
    """Across instances: raises in every instance when they would run different programs.

    Instances whose models, batches or IPU options differ compile programs
    whose collectives do not match, and the job aborts in the collective
    library without naming why. Every instance must call it, after the model
    is built and before its state is broadcast (nothing when the replicas are
    in one process). Variables are described by position, dtype and shape:
    their names (`dense_3`) count the layers a process made before.

    Args:
        model: The built Keras model.
        mode: `"fit"`, `"evaluate"` or `"predict"`.
        parts: The state parts the mode's program takes (`steps.STATE_PARTS`).
        batch: One batch as this instance feeds it (arrays).
        options: The model's `IPUOptions`.
        placement: The run's `Placement`.

    Raises:
        ValueError: The same in every instance, naming the first difference.

    Example:

    >>> check_instance_programs(model, "fit", STATE_PARTS["fit"], feed.first_batch(),
    ...                         options_of(model), placement)
    """
    if not placement.replicas.spans_processes:
        return
    from keras_ipu.distributed import runtime

    leaves, structure = jax.tree_util.tree_flatten(batch)
    lines = [f"batch structure {structure}"]
    lines += [f"batch input {i}: {np.asarray(a).dtype}{list(np.shape(a))}"
              for i, a in enumerate(leaves)]
    for part in parts:
        variables = (model.optimizer.variables if part == "optimizer_variables"
                     else getattr(model, part))
        lines += [f"{part}[{i}]: {v.dtype}{list(v.shape)}" for i, v in enumerate(variables)]
    lines += [f"option {field.name}: {_described(getattr(options, field.name))}"
              for field in dataclasses.fields(options) if field.name not in _HOST_ONLY_OPTIONS]
    if "optimizer_variables" in parts:  # what training computes, beyond the variables
        compiled = getattr(getattr(model, "_compile_config", None), "config", {})
        lines.append(f"loss: {_loss_described(model.loss)}, weights "
                     f"{_described(compiled.get('loss_weights'))}")
        lines.append(f"optimizer: {_described(model.optimizer)}")
    if placement.plan is not None:
        lines.append(f"pipeline stages of {[len(s) for s in placement.plan.stages]} layers")
    runtime.check_described_alike(
        lines, f"`{mode}`'s program",
        "Every instance must build the same model, compile it alike and set the same IPU "
        "options, and feed batches of the same shapes and dtypes.")


# Options that only the host reads (the infeed's prefetching): instances may differ in them.
_HOST_ONLY_OPTIONS = frozenset({"infeed_kwargs"})


def _loss_described(loss: Any) -> str:
    """A compiled loss as Keras resolves it, so that its spellings agree: `"mse"`,
    `"mean_squared_error"`, `keras.losses.mean_squared_error` and `MeanSquaredError()`
    are one function, its arguments (defaults filled in), a reduction and a dtype."""
    import keras  # its losses; a process that compiled a model has Keras loaded
    from keras.src.losses.losses import LossFunctionWrapper

    if isinstance(loss, Mapping):
        return "{" + ", ".join(f"{k!r}: {_loss_described(v)}" for k, v in sorted(
            loss.items(), key=lambda item: str(item[0]))) + "}"
    if isinstance(loss, (list, tuple)):
        return "[" + ", ".join(_loss_described(v) for v in loss) + "]"
    if isinstance(loss, str):
        try:
            loss = keras.losses.get(loss)
        except ValueError:  # a name Keras resolves by the data's shapes ("crossentropy")
            return repr(loss)
    function, arguments = loss, {}
    reduction, dtype = "sum_over_batch_size", keras.backend.floatx()  # a function's wrapper's
    # A wrapper whose `call` is its own (a user's subclass) computes something else.
    if isinstance(loss, LossFunctionWrapper) and type(loss).call is LossFunctionWrapper.call:
        function, arguments = loss.fn, loss._fn_kwargs
        reduction, dtype = loss.reduction, loss.dtype
    if not inspect.isfunction(function):
        return _described(loss)
    defaults = {name: parameter.default for name, parameter in
                inspect.signature(function).parameters.items()
                if parameter.default is not parameter.empty}
    return (f"{_described(function)}{_described({**defaults, **arguments})} "
            f"reduced by {reduction!r} in {dtype}")


def _described(value: Any) -> str:
    """A value as every process writes it: objects by type, not address; Keras objects (a
    loss, an optimizer) with their config, less the names that count what a process made
    (`adam_2`); functions by name."""
    if isinstance(value, (bool, int, float, str, type(None), enum.Enum)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_described(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k!r}: {_described(v)}" for k, v in sorted(
            value.items(), key=lambda item: str(item[0])) if k != "name") + "}"
    if isinstance(value, functools.partial):
        return (f"partial({_described(value.func)}, {_described(list(value.args))}, "
                f"{_described(value.keywords)})")
    if callable(getattr(value, "get_config", None)):
        try:
            return f"{type(value).__name__}{_described(value.get_config())}"
        except Exception:  # a config that cannot be made says less, alike in every process
            pass
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '')}.{value.__qualname__}"
    return type(value).__name__


def keep_last_replica_metrics(model: Any, replica_count: int) -> None:
    """Across instances: the model's metric variables become the last global replica's.

    Each instance's Keras state holds its own last replica's metrics; the last
    global replica runs in the last instance, which sends its values to the
    others, so `get_metrics_result` is one process's in every instance. Every
    instance must call it (after an epoch of `fit` or `evaluate`).

    Example:

    >>> keep_last_replica_metrics(model, 4)   # 2 instances × 2 replicas
    """
    if replica_count > 1:
        _take_from_instance(model, model.metrics_variables, jax.process_count() - 1)


def keep_first_replica_state(model: Any, replica_count: int) -> None:
    """Across instances: the model's non-trainable variables become global replica 0's.

    Each instance's Keras state holds its own first replica's; trainable
    weights are equal on every replica, but statistics such as
    BatchNormalization's moving mean are each replica's own. Instance 0
    runs global replica 0 and sends its values to the others, so every
    instance holds what one process would. Every instance must call it
    (after an epoch of `fit`).

    Example:

    >>> keep_first_replica_state(model, 4)   # 2 instances × 2 replicas
    """
    if replica_count > 1:
        _take_from_instance(model, model.non_trainable_variables, 0)


def _take_from_instance(model: Any, variables: list, source: int) -> None:
    """Every instance's `variables` take instance `source`'s values (all must call it)."""
    if jax.process_count() == 1 or not variables:
        return
    from jax.experimental import multihost_utils

    model.jax_state_sync()
    values = multihost_utils.broadcast_one_to_all(
        [np.asarray(v.value) for v in variables], is_source=jax.process_index() == source)
    for variable, value in zip(variables, values):
        variable.assign(np.asarray(value))


class ReplicaCodec:
    """Moves state and batches between Keras and a (replicated) program.

    Args:
        replicas: The program's replicas.
        parts: The names of the state's parts, in order.
    """

    def __init__(self, replicas: Replicas, parts: tuple[str, ...]):
        self.replicas, self.parts = replicas, parts

    def to_device(self, keras_state: Any) -> Any:
        """Keras state -> one copy per replica, on the replicas' devices.

        Across instances every replica starts from instance 0's state.
        """
        if self.replicas.spans_processes:
            from jax.experimental import multihost_utils

            keras_state = multihost_utils.broadcast_one_to_all(keras_state)
        return self.replicas.replicate(keras_state)

    def spec(self, keras_state: Any) -> Any:
        """Shape structs of `to_device(keras_state)`."""
        return self.replicas.state_spec(keras_state)

    def to_keras(self, state: Any) -> dict:
        """Replica 0's weights; the last replica's metrics (what `NONE` reports).

        In a multi-host job, of this instance's replicas: the trainable
        weights are the same on all, the logs are reduced over all replicas in
        the program, and `keep_first_replica_state` and
        `keep_last_replica_metrics` then give every instance global replica 0's
        other variables and the last global replica's metrics.
        """
        first, last = self.replicas.local_replicas[0], self.replicas.local_replicas[-1]
        return {
            part: self.replicas.unreplicate(values, last if part == "metrics_variables"
                                            else first)
            for part, values in zip(self.parts, state)
        }

    def with_metrics_of(self, state: Any, previous: Any) -> Any:
        """`state` with the metric states each replica has in `previous`."""
        k = self.parts.index("metrics_variables")
        return tuple(previous[k] if i == k else part for i, part in enumerate(state))

    @property
    def lone_replica(self) -> bool:
        """Whether this instance runs one replica of several: its feed has no replica axis."""
        return self.replicas.spans_processes and self.replicas.local_count == 1

    def batch_spec(self, batches: Any) -> Any:
        """Shape structs of an execution's placed batches."""
        return self.replicas.batch_spec(batches)

    def place(self, batches: Any) -> Any:
        """An execution's batches on the replicas' devices."""
        return self.replicas.place_batches(batches)

    def weight_devices(self, model: Any) -> list[tuple[Any, list]]:
        """`(weight, devices)` for each trainable weight: every replica's devices."""
        return [(v, list(self.replicas.devices)) for v in model.trainable_variables]
