"""Distributed batch normalisation: `BatchNormalization`'s batch statistics over replica groups.

IPUConfig's `norms.experimental.distributed_batch_norm_replica_group_size`
(G) makes every training batch normalisation of a replicated `fit` compute its
batch mean and variance over the G consecutive replicas of its group (replicas
0..G-1, G..2G-1, ...), as the statistics of the group's batches together:
they normalise the batch and move the moving statistics, the same on every
replica of a group. G = 1, the default, changes nothing: the step is not
wrapped and `BatchNormalization` is left as it is.

The statistics are reduced where Keras computes them: `BatchNormalization._moments`
is replaced, once a step with G > 1 is built, by a function that asks Keras'
own for this replica's moments and, only while a grouped step is traced (in the
tracing thread's context), reduces them over the group with
`collectives.group_moments`. Keras' own `Group`/`Layer`/`InstanceNormalization`
and keras_ipu's have no batch statistics, so nothing changes for them.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

from keras import ops
from keras.src.layers.normalization.batch_normalization import BatchNormalization

from keras_ipu.device import collectives
from keras_ipu.device import system as ipu_system
from keras_ipu.device.replicate import Replicas

Step = Callable[[Any, Any], tuple[Any, Any]]

OPTION = "distributed_batch_norm_replica_group_size"
CONFIG_NAME = f"norms.experimental.{OPTION}"

# The group size of the grouped step being traced in this context (thread), or None.
_GROUP: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "keras_ipu_batch_norm_group", default=None)
_INSTALL_LOCK = threading.Lock()
_KERAS_MOMENTS: Callable[..., tuple[Any, Any]] | None = None


def group_size() -> int:
    """The configured system's replica group size for batch statistics (1: none).

    Raises:
        RuntimeError: When no IPU system is configured.

    Example:

    >>> group_size()   # after config.norms.experimental.distributed_batch_norm_... = 2
    2
    """
    return int(ipu_system.require().option(OPTION, 1))


def has_batch_norm(model: Any) -> bool:
    """Whether the model (or a model inside it) holds a Keras `BatchNormalization` layer."""
    return any(isinstance(layer, BatchNormalization)
               for layer in model._flatten_layers(include_self=False, recursive=True))


def check(model: Any, replicas: Replicas, pipelined: bool, group: int | None = None) -> None:
    """Refuses, before anything runs, a group size the model's `fit` cannot honour.

    Nothing is checked for G = 1 or a model without `BatchNormalization`
    (the option then has nothing to act on).

    Args:
        model: The model about to train.
        replicas: Its replicas.
        pipelined: Whether it is a pipelined model.
        group: The group size; by default the configured system's.

    Raises:
        ValueError: When the replication factor is not a multiple of the
            group size (naming both and the sizes that divide it), or for a
            pipelined model.

    Example:

    >>> check(model, placement.replicas, placement.plan is not None)
    """
    group = group_size() if group is None else group
    if group == 1 or not has_batch_norm(model):
        return
    if pipelined:
        raise ValueError(
            f"{CONFIG_NAME} is {group}, but the model {model.name} is pipelined: distributed "
            f"batch normalisation is not supported with pipelining (as the reference says, "
            f"it should not be used with model parallelism). Set {CONFIG_NAME} to 1, or "
            f"train the model without pipeline stages.")
    count = replicas.count
    if count % group:
        valid = [size for size in range(1, count + 1) if count % size == 0]
        raise ValueError(
            f"{CONFIG_NAME} ({group}) must divide the replication factor ({count}) of the "
            f"model {model.name}: its batch normalisation statistics are reduced over groups "
            f"of {group} consecutive replicas. Valid group sizes for {count} replica"
            f"{'s' if count != 1 else ''}: {', '.join(map(str, valid))}; or configure a "
            f"number of IPUs that is a multiple of {group}.")


def grouped(step: Step, group: int) -> Step:
    """`step` with `BatchNormalization`'s batch statistics reduced over replica groups.

    Args:
        step: A replicated step function `step(state, data) -> (outputs, state)`.
        group: Replicas per group; 1 returns `step` itself.

    Returns:
        The step, which sets the group for the statistics while it is traced.

    Example:

    >>> step = grouped(steps.train_step(model, ...), group_size())
    """
    if group == 1:
        return step
    _install()

    @functools.wraps(step)
    def in_groups(state, data):
        token = _GROUP.set(group)
        try:
            return step(state, data)
        finally:
            _GROUP.reset(token)

    return in_groups


@contextlib.contextmanager
def system_groups() -> Iterator[None]:
    """Batch statistics over the configured replica groups while a computation is traced.

    For the computations of `strategy.run` and `ipu_compiler.compile`, whose
    replicas `fit`'s checks never see: the option is the system's, for every
    training batch normalisation. Nothing changes for G = 1.

    Raises:
        RuntimeError: When no IPU system is configured.

    Example:

    >>> with system_groups():
    ...     outputs = model(x, training=True)   # traced inside the replicated program
    """
    group = group_size()
    if group == 1:
        yield
        return
    _install()
    token = _GROUP.set(group)
    try:
        yield
    finally:
        _GROUP.reset(token)


def _install() -> None:
    """Replaces `BatchNormalization._moments` by `_moments` (once)."""
    global _KERAS_MOMENTS
    with _INSTALL_LOCK:
        if _KERAS_MOMENTS is None:
            _KERAS_MOMENTS = BatchNormalization._moments
            BatchNormalization._moments = _moments


def _moments(self: BatchNormalization, inputs: Any, mask: Any) -> tuple[Any, Any]:
    """Keras' moments of `inputs`, reduced over the replica group of a grouped step."""
    mean, variance = _KERAS_MOMENTS(self, inputs, mask)
    group = _GROUP.get()
    if group is None:
        return mean, variance
    replicas = collectives.replica_count()
    if replicas % group:  # in a computation of its own (`fit` checked before it ran)
        raise ValueError(
            f"{CONFIG_NAME} ({group}) must divide the {replicas} replicas of the computation "
            f"that runs {self.name} in training: its batch statistics are reduced over groups "
            f"of {group} consecutive replicas. Set it to a size that divides {replicas}.")
    count = None
    if mask is not None:
        # The values each channel's moments are of, shaped as Keras shapes the moments.
        weights = ops.broadcast_to(ops.expand_dims(ops.cast(mask, inputs.dtype), -1),
                                   ops.shape(inputs))
        count = ops.squeeze(ops.sum(weights, self._reduction_axes, keepdims=True))
    return collectives.group_moments(mean, variance, group, count)
