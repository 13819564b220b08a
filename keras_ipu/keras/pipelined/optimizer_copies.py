"""One copy of the model's optimizer per IPU of a pipeline, and where its variables go.

Each IPU steps its own variables with its own copy of the optimizer, built
from the optimizer's config (`rebuilt_optimizer`) on those variables alone. `positions` says where
each of a copy's variables is in the model's optimizer, so the packed state
moves between the two (`model.PipelineState`).
"""

from __future__ import annotations

import collections
import re
from collections.abc import Sequence
from typing import Any

import keras

from keras_ipu.keras.pipelined import flat_optimizer, rebuilt_optimizer, split_probe


def copy_for(optimizer, variables: Sequence) -> Any:
    """A copy of `optimizer` built on `variables`, clipping nothing by the global norm.

    The copy excludes from weight decay the variables the optimizer excludes
    (`exclude_from_weight_decay` is not in an optimizer's config). The
    pipeline clips by the norm over every IPU's gradients before the copies
    step, so they do not clip again.

    Args:
        optimizer: The model's (built) optimizer.
        variables: One IPU's trainable variables.

    Returns:
        The built copy.

    Raises:
        ValueError: When the optimizer's config does not keep one of its
            settings (`rebuilt_optimizer.rebuilt`).

    Example:

    >>> copy_for(model.optimizer, model.layers[0].trainable_variables).variables
    """
    copy = rebuilt_optimizer.rebuilt(optimizer, without_global_clipnorm=True)
    _exclude_from_weight_decay_as(optimizer, copy, variables)
    copy.build(variables)
    return copy


def global_clipnorm(optimizer) -> float | None:
    """The optimizer's `global_clipnorm` (a `LossScaleOptimizer`'s inner optimizer's).

    Example:

    >>> global_clipnorm(keras.optimizers.SGD(global_clipnorm=1.0))
    1.0
    """
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    return getattr(inner, "global_clipnorm", None) or None


def check_pipelined(optimizer) -> None:
    """Refuses what the pipeline's optimizer copies cannot do as Keras does.

    The pipeline clips each optimizer call's gradients by their norm over
    every IPU; an optimizer accumulating gradients itself
    (`gradient_accumulation_steps`) clips their average once per update.

    Raises:
        ValueError: For `global_clipnorm` with the optimizer's own
            `gradient_accumulation_steps`.
        NotImplementedError: For a `MultiOptimizer`, or a custom optimizer
            whose copies would not step as it does (`split_probe`).

    Example:

    >>> check_pipelined(keras.optimizers.SGD(global_clipnorm=1.0))   # fine
    """
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if isinstance(inner, keras.optimizers.MultiOptimizer):
        raise NotImplementedError(_NOT_SPLIT.format(name=type(inner).__name__))
    split_probe.check(inner, _named_clone)
    steps = getattr(inner, "gradient_accumulation_steps", None)
    if global_clipnorm(optimizer) and steps and steps > 1:
        raise ValueError(
            f"A pipelined model cannot use an optimizer with both global_clipnorm "
            f"({global_clipnorm(optimizer)}) and its own gradient_accumulation_steps ({steps}): "
            f"the pipeline clips each call's gradients over every IPU, Keras their average. "
            f"Accumulate with `model.set_pipelining_options("
            f"gradient_accumulation_steps_per_replica=...)` instead, or clip with clipnorm.")


def _exclude_from_weight_decay_as(optimizer, copy, variables) -> None:
    """Excludes from `copy`'s weight decay the variables `optimizer` excludes.

    `exclude_from_weight_decay(...)` is not part of an optimizer's config, so
    a copy made from the config would decay every variable.
    """
    # A LossScaleOptimizer decays through the optimizer it wraps (and so does its copy).
    while hasattr(optimizer, "inner_optimizer") and hasattr(copy, "inner_optimizer"):
        optimizer, copy = optimizer.inner_optimizer, copy.inner_optimizer
    if optimizer.weight_decay is None:
        return
    excluded = [v for v in variables if not optimizer._use_weight_decay(v)]
    if excluded:
        copy.exclude_from_weight_decay(var_list=excluded)


def positions(optimizer, copy, trainable: Sequence, ids: Sequence[int]) -> list[int]:
    """Where each variable of `copy` (built on `trainable[i] for i in ids`) is in `optimizer`.

    Keras names a slot after its variable's path (most optimizers), after its
    variable's name (Adafactor: `kernel` for every kernel), or not at all
    (Nadam's `u_product`, auto-named with a process-wide counter). So both
    are built again, allocating nothing, over stand-ins named after their
    index in the model: each slot's name then says its variable. Names still
    repeat where optimizers nest (a `LossScaleOptimizer` and the optimizer it
    wraps each have an `iteration`): the k-th variable of a name is matched
    with the k-th, as every build creates its variables in the same order.

    Args:
        optimizer: The model's optimizer, built on all of `trainable`.
        copy: The IPU's copy (`copy_for`), built on the `ids` variables.
        trainable: The model's trainable variables.
        ids: The indices of the clone's variables in `trainable`.

    Returns:
        For each of `copy.variables`, its index in `optimizer.variables`.

    Raises:
        NotImplementedError: When the optimizer's variables cannot be split
            between IPUs this way.

    Example:

    >>> ids = [2, 3]   # the second Dense layer's kernel and bias
    >>> copy = copy_for(model.optimizer, [model.trainable_variables[i] for i in ids])
    >>> positions(model.optimizer, copy, model.trainable_variables, ids)
    """
    # Each at its variable's path (an optimizer may choose by it: Muon's
    # `exclude_layers`), named apart (some name slots by the variable's name alone,
    # Keras by the path: a path two variables share is told apart too).
    paths = collections.Counter(v.path for v in trainable)

    def stand_ins(indices):
        return [(trainable[i].path if paths[trainable[i].path] == 1
                 else f"{trainable[i].path}_w{i}", tuple(trainable[i].shape),
                 trainable[i].dtype, f"{trainable[i].name}_w{i}") for i in indices]

    whole = _named_clone(optimizer, stand_ins(range(len(trainable))))
    part = _named_clone(optimizer, stand_ins(ids))
    index_of = _occurrences(whole.variables)
    keys = list(_occurrences(part.variables))
    if not (_same_shapes(whole.variables, optimizer.variables)
            and _same_shapes(part.variables, copy.variables)
            and all(key in index_of for key in keys)):
        raise NotImplementedError(_NOT_SPLIT.format(name=type(optimizer).__name__))
    return [index_of[key] for key in keys]


_NOT_SPLIT = ("The variables of {name} cannot be split between the pipeline's IPUs (its "
              "slots are not named after their variables). Train with another optimizer, or "
              "without pipelining.")


def check_overwritten(variables: Sequence) -> None:
    """Refuses variables Keras overwrites with their gradient (float8 training).

    A float8 layer's scales and amax histories take their "gradient" as their
    new value, the maximum over the micro-batches of an update: the
    pipeline's per-IPU accumulation sums gradients.

    Raises:
        NotImplementedError: Naming the first such variable.

    Example:

    >>> check_overwritten(model.trainable_variables)   # a model not quantized: fine
    """
    overwritten = [v.path for v in variables if getattr(v, "overwrite_with_gradient", False)]
    if overwritten:
        raise NotImplementedError(
            f"A pipelined model cannot train float8 layers (`model.quantize(\"float8\")`): "
            f"their scales ({overwritten[0]}, ...) take the maximum of the micro-batches' "
            f"values, which the pipeline's accumulation does not. Train them without "
            f"pipelining (gradient accumulation and replication combine them as Keras does).")


def _named_clone(optimizer, stand_ins: list) -> Any:
    """A clone of `optimizer` built over stand-ins `(path, shape, dtype)`, for its names.

    Allocating nothing where it can; an optimizer that makes variables from
    values (Nadam, Adafactor) refuses a stateless scope and gets zeros.
    """
    try:
        return flat_optimizer.unallocated_clone(optimizer, stand_ins)
    except ValueError:
        clone = rebuilt_optimizer.rebuilt(optimizer)
        clone.build([flat_optimizer.stand_in_variable(*entry) for entry in stand_ins])
        return clone


def _same_shapes(variables, others) -> bool:
    return [(tuple(v.shape), str(v.dtype)) for v in variables] == [
        (tuple(v.shape), str(v.dtype)) for v in others]


# Keras' automatic variable names (`variable`, `variable_3`): the number
# counts variables made in the process, not in one optimizer.
_AUTOMATIC_NAME = re.compile(r"^variable(_\d+)?$")


def _occurrences(variables) -> dict[tuple[str, int], int]:
    """`(name, k) -> index` of the k-th variable called `name` in `variables`."""
    seen: dict[str, int] = {}
    keys = {}
    for i, variable in enumerate(variables):
        name = "variable" if _AUTOMATIC_NAME.match(variable.name) else variable.name
        k = seen[name] = seen.get(name, -1) + 1
        keys[(name, k)] = i
    return keys


__all__ = ["check_overwritten", "check_pipelined", "copy_for", "global_clipnorm",
           "positions"]
