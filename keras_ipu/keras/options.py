"""IPU options of a model: what the `set_*_options` methods store, and how it is saved.

The options are plain data (`IPUOptions`, frozen); each setter validates its
arguments first and then replaces the model's options as a whole, so a
failed call changes nothing.
"""

from __future__ import annotations

import dataclasses
import enum
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from keras_ipu.device import schedules
from keras_ipu.gradient_accumulation import GradientAccumulationReductionMethod, parse_enum
from keras_ipu.keras import context, feed_options
from keras_ipu.pipelining_ops import PipelineStageOptions


class ReplicatedMetricReductionMethod(enum.Enum):
    """How the loss and metrics of the replicas are returned.

    Each replica keeps its own metric state (running values over its own
    batches). Predictions are never reduced.

    - `NONE`: the values of the last replica.
    - `LIST`: for each metric, a list with every replica's value (the progress
      bar shows their mean).
    - `SUM`: the sum over replicas.
    - `MEAN`: the mean over replicas.

    Example:

    >>> model.set_replication_options(ReplicatedMetricReductionMethod.MEAN)
    """

    NONE = 1
    LIST = 2
    SUM = 3
    MEAN = 4

    @classmethod
    def parse(cls, value: Any) -> ReplicatedMetricReductionMethod:
        """A member from itself or its name in any case.

        Raises:
            ValueError: For anything else, listing the valid values.
        """
        return parse_enum(cls, value, "a ReplicatedMetricReductionMethod")


# Keys `set_gradient_accumulation_options` accepts in its **kwargs, and what
# they do on the device model.
GRADIENT_ACCUMULATION_KWARGS = {
    "dtype": "the accumulator dtype: each variable's own by default, one dtype for all, or "
             "a function of the variable",
    "offload_weight_update_variables": "accepted; no effect on the device model",
    "replicated_optimizer_state_sharding": "accepted; no effect on the device model",
    "name": "accepted; no effect on the device model",
}
_ACCUMULATOR_DTYPES = ("float32", "float16", "bfloat16")
# An accumulator dtype option: a name, a function of the variable, or None (the variable's).
AccumulatorDtype = str | Callable[[Any], Any] | None

_REFUSED_KWARGS = {
    "opt": "Found `opt` key in `gradient_accumulation_optimizer_kwargs`. This is not "
    "supported as the optimizer which the model has been compiled with is "
    "automatically wrapped.",
    "num_mini_batches": "Found `num_mini_batches` key in "
    "`gradient_accumulation_optimizer_kwargs`. Set the "
    "`gradient_accumulation_steps_per_replica` argument to "
    "`set_gradient_accumulation_options` instead.",
    "experimental_normalize_gradients": "Found `experimental_normalize_gradients` argument "
    "to `set_gradient_accumulation_options`. This argument has now been removed, use "
    "`gradient_accumulation_reduction_method` instead.",
}


@dataclasses.dataclass(frozen=True)
class IPUOptions:
    """The IPU options of one model.

    Args:
        gradient_accumulation_steps_per_replica: Micro-batches per weight
            update on each replica (`None`: no accumulation).
        gradient_accumulation_reduction_method: How micro-batch gradients
            are combined.
        gradient_accumulation_optimizer_kwargs: Extra accumulation options
            (not saved with the model).
        use_v2_gradient_accumulation_optimizer: Accepted; no effect.
        replicated_metric_reduction_method: How replica metrics are returned.
        asynchronous_callbacks: Whether batch callbacks run per step.
        pipelining_gradient_accumulation_steps_per_replica: Micro-batches
            per weight update of a pipelined model (`None`: not set).
        pipelining_device_mapping: Stage -> IPU (`None`: stage i on IPU i).
        pipelining_accumulate_outfeed: Accumulate metrics on the device.
        pipelining_kwargs: The pass-through pipeline options (not saved).
        infeed_kwargs: The infeed queue options (`feed_options`).
        outfeed_kwargs: The outfeed queue options (`feed_options`).
    """

    gradient_accumulation_steps_per_replica: int | None = None
    gradient_accumulation_reduction_method: GradientAccumulationReductionMethod = (
        GradientAccumulationReductionMethod.SUM
    )
    gradient_accumulation_optimizer_kwargs: Mapping[str, Any] = dataclasses.field(
        default_factory=dict
    )
    use_v2_gradient_accumulation_optimizer: bool = False
    replicated_metric_reduction_method: ReplicatedMetricReductionMethod = (
        ReplicatedMetricReductionMethod.NONE
    )
    asynchronous_callbacks: bool = False
    pipelining_gradient_accumulation_steps_per_replica: int | None = None
    pipelining_device_mapping: tuple[int, ...] | None = None
    pipelining_accumulate_outfeed: bool | None = None
    pipelining_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    infeed_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    outfeed_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per weight update (1 without accumulation)."""
        return self.gradient_accumulation_steps_per_replica or 1

    @property
    def accumulator_dtype(self) -> AccumulatorDtype:
        """The dtype gradients accumulate in: a name, a function of the variable, or `None`
        (each variable's own; see `accumulator_dtypes`)."""
        return self.gradient_accumulation_optimizer_kwargs.get("dtype")

    @property
    def pipelined_accumulator_dtype(self) -> AccumulatorDtype:
        """The dtype a pipeline accumulates gradients in (its own option, else the above)."""
        return self.pipelining_kwargs.get("gradient_accumulation_dtype", self.accumulator_dtype)

    def to_config(self) -> dict[str, Any]:
        """The saved form (the reference's keys; kwargs are not saved)."""
        return {
            "gradient_accumulation_steps_per_replica": (
                self.gradient_accumulation_steps_per_replica
            ),
            "gradient_accumulation_reduction_method": (
                self.gradient_accumulation_reduction_method.value
            ),
            "replicated_metric_reduction_method": self.replicated_metric_reduction_method.value,
            "asynchronous_callbacks": self.asynchronous_callbacks,
            "pipelining_gradient_accumulation_steps_per_replica": (
                self.pipelining_gradient_accumulation_steps_per_replica
            ),
            "pipelining_device_mapping": (
                list(self.pipelining_device_mapping)
                if self.pipelining_device_mapping is not None
                else None
            ),
            "pipelining_accumulate_outfeed": self.pipelining_accumulate_outfeed,
            "infeed_kwargs": dict(self.infeed_kwargs),
            "outfeed_kwargs": dict(self.outfeed_kwargs),
        }

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> IPUOptions:
        """Options from their saved form (unknown keys are ignored), checked as the
        options' setters check them.

        Raises:
            ValueError, TypeError: For a value its setter refuses (a hand-edited
                config), noting that it is a saved option.
        """
        method = _saved_member(GradientAccumulationReductionMethod,
                               config.get("gradient_accumulation_reduction_method", 0))
        try:
            options = gradient_accumulation_options(
                cls(), config.get("gradient_accumulation_steps_per_replica"), method, False, {})
            options = pipelining_options(
                options, config.get("pipelining_gradient_accumulation_steps_per_replica"),
                config.get("pipelining_device_mapping"),
                config.get("pipelining_accumulate_outfeed"), method, {})
            metric_method = config.get("replicated_metric_reduction_method", 1)
            options = replication_options(
                options, _saved_member(ReplicatedMetricReductionMethod, metric_method))
            options = asynchronous_callbacks_option(  # None (unset) loads as False
                options, config.get("asynchronous_callbacks") or False)
            return feed_queue_options(options, config.get("infeed_kwargs") or {},
                                      config.get("outfeed_kwargs") or {})
        except (TypeError, ValueError) as error:
            error.add_note("It is an IPU option saved with the model (its config, or the "
                           "ipu_options.json asset of its .keras file).")
            raise


def _saved_member(enum_class: Any, value: Any) -> Any:
    # Saved as the member's value (the reference's layout); a name parses as in the setters.
    members = {member.value: member for member in enum_class}
    return members.get(value, value) if _is_integer(value) else value

def gradient_accumulation_options(
    options: IPUOptions,
    gradient_accumulation_steps_per_replica: Any,
    gradient_accumulation_reduction_method: Any,
    use_v2_gradient_accumulation_optimizer: Any,
    gradient_accumulation_optimizer_kwargs: Any,
) -> IPUOptions:
    """Validated new options from `set_gradient_accumulation_options` arguments.

    Raises:
        ValueError: For a non-positive or non-integer step count, an unknown
            reduction method, refused or unknown kwargs, a bad dtype.
        TypeError: When the kwargs are not a mapping.
    """
    steps = _check_steps(gradient_accumulation_steps_per_replica)
    method = GradientAccumulationReductionMethod.parse(gradient_accumulation_reduction_method)
    use_v2 = checked_flag("use_v2_gradient_accumulation_optimizer",
                   use_v2_gradient_accumulation_optimizer)
    kwargs = _accumulation_kwargs(gradient_accumulation_optimizer_kwargs)
    return dataclasses.replace(
        options,
        gradient_accumulation_steps_per_replica=(
            steps if steps is not None else options.gradient_accumulation_steps_per_replica
        ),
        gradient_accumulation_reduction_method=method,
        use_v2_gradient_accumulation_optimizer=use_v2,
        gradient_accumulation_optimizer_kwargs=kwargs,
    )


def _is_integer(value: Any) -> bool:
    """Python and NumPy integers, not bools."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_steps(steps: Any) -> int | None:
    if steps is not None and (not _is_integer(steps) or steps < 1):
        raise ValueError(
            f"Expected `gradient_accumulation_steps_per_replica` to be a positive "
            f"integer, but got {steps!r} instead."
        )
    return None if steps is None else int(steps)  # NumPy integers saved as JSON numbers


# `set_pipelining_options(**pipelining_kwargs)`: keys that have arguments of
# their own, keys Keras sets, keys that cannot work with Keras.
_PIPELINING_OWN_ARGUMENTS = {
    "gradient_accumulation_count": "gradient_accumulation_steps_per_replica",
    "device_mapping": "device_mapping",
    "accumulate_outfeed": "accumulate_outfeed",
}
_PIPELINING_AUTOMATIC = (
    "computational_stages", "repeat_count", "inputs", "infeed_queue", "outfeed_queue",
    "optimizer_function",
)
_PIPELINING_INCOMPATIBLE = ("outfeed_loss", "outfeed_mask", "batch_serialization_iterations")

# The pass-through keys of `pipelining_ops.pipeline` that keras_ipu takes,
# with what each does on the device model.
PIPELINING_KWARGS = {
    "pipeline_schedule": "the schedule (Grouped, Interleaved, Sequential)",
    "recomputation_mode": "how stage activations are recomputed in the backward pass",
    "gradient_accumulation_dtype": "the accumulator dtype",
    "accumulate_outfeed_dtype": "accepted; no effect on the device model",
    "forward_propagation_stages_poplar_options": "accepted; no effect on the device model",
    "backward_propagation_stages_poplar_options": "accepted; no effect on the device model",
    "weight_update_poplar_options": "accepted; no effect on the device model",
    "offload_weight_update_variables": "accepted; no effect on the device model",
    "replicated_optimizer_state_sharding": "accepted; no effect on the device model",
    "offload_activations": "accepted; no effect on the device model",
    "offload_gradient_accumulation_buffers": "accepted; no effect on the device model",
    "replicated_weight_sharding": "accepted; no effect on the device model",
    "offload_weights": "accepted; no effect on the device model",
    "continuous_weight_updates": "must be False (not implemented, as in the reference)",
    "gradient_accumulation_for_captured_grads": "accepted; no effect on the device model",
    "name": "accepted; no effect on the device model",
}


def pipelining_options(
    options: IPUOptions,
    gradient_accumulation_steps_per_replica: Any,
    device_mapping: Any,
    accumulate_outfeed: Any,
    gradient_accumulation_reduction_method: Any,
    pipelining_kwargs: Any,
) -> IPUOptions:
    """Validated new options from `set_pipelining_options` arguments.

    `None` keeps the current steps, mapping and `accumulate_outfeed`; the
    reduction method and the kwargs are replaced on every call.

    Raises:
        ValueError: For bad steps, mapping, reduction method, refused or
            unknown kwargs, or bad kwarg values.
        TypeError: When the kwargs are not a mapping, `accumulate_outfeed`
            is not a bool, or a Poplar option is not a `PipelineStageOptions`
            (a list or tuple of them for the per-stage ones).
        NotImplementedError: For `continuous_weight_updates=True`.
    """
    steps = _check_steps(gradient_accumulation_steps_per_replica)
    if device_mapping is not None and (
        not isinstance(device_mapping, (list, tuple))
        or not all(_is_integer(i) and i >= 0 for i in device_mapping)
    ):
        raise ValueError(
            f"Expected `device_mapping` to be a list of non-negative integers, got "
            f"{device_mapping!r}."
        )
    if device_mapping is not None:
        device_mapping = [int(i) for i in device_mapping]
    if accumulate_outfeed is not None:
        accumulate_outfeed = checked_flag("accumulate_outfeed", accumulate_outfeed)
    method = GradientAccumulationReductionMethod.parse(gradient_accumulation_reduction_method)
    kwargs = _pipelining_kwargs(pipelining_kwargs)
    return dataclasses.replace(
        options,
        pipelining_gradient_accumulation_steps_per_replica=(
            steps
            if steps is not None
            else options.pipelining_gradient_accumulation_steps_per_replica
        ),
        pipelining_device_mapping=(
            tuple(device_mapping)
            if device_mapping is not None
            else options.pipelining_device_mapping
        ),
        pipelining_accumulate_outfeed=(
            accumulate_outfeed
            if accumulate_outfeed is not None
            else options.pipelining_accumulate_outfeed
        ),
        gradient_accumulation_reduction_method=method,
        pipelining_kwargs=kwargs,
    )


def _pipelining_kwargs(kwargs: Any) -> dict[str, Any]:
    if not isinstance(kwargs, Mapping):
        raise TypeError("`pipelining_kwargs` must be a dictionary.")
    for key, argument in _PIPELINING_OWN_ARGUMENTS.items():
        if key in kwargs:
            raise ValueError(
                f"Found `{key}` key in `pipelining_kwargs`. Set the `{argument}` argument "
                f"to `set_pipelining_options` instead."
            )
    for key in _PIPELINING_AUTOMATIC:
        if key in kwargs:
            raise ValueError(
                f"Found `{key}` key in `pipelining_kwargs`. This argument is automatically "
                f"set by Keras."
            )
    for key in _PIPELINING_INCOMPATIBLE:
        if key in kwargs:
            raise ValueError(
                f"Found `{key}` key in `pipelining_kwargs`. This argument is not compatible "
                f"with Keras."
            )
    if "experimental_normalize_gradients" in kwargs:
        raise ValueError(
            "Found `experimental_normalize_gradients` argument to `set_pipelining_options`. "
            "This argument has now been removed, use `gradient_accumulation_reduction_method` "
            "instead."
        )
    unknown = sorted(set(kwargs) - set(PIPELINING_KWARGS))
    if unknown:
        raise ValueError(
            f"Unknown `pipelining_kwargs` {unknown}; valid keys are {sorted(PIPELINING_KWARGS)}."
        )
    # The reference's default `None`s: as if the key were not given.
    kwargs = {key: value for key, value in kwargs.items()
              if not (value is None and key in _PIPELINING_NONE_IS_DEFAULT)}
    checks = {
        "pipeline_schedule": (lambda v: isinstance(v, schedules.PipelineSchedule),
                              _members(schedules.PipelineSchedule)),
        "recomputation_mode": (lambda v: isinstance(v, schedules.RecomputationMode),
                               _members(schedules.RecomputationMode)),
        "continuous_weight_updates": (lambda v: isinstance(v, (bool, np.bool_)), "a bool"),
    }
    for key, (check, valid) in checks.items():
        if key in kwargs and not check(kwargs[key]):
            raise ValueError(
                f"Invalid `{key}` in `pipelining_kwargs`: {kwargs[key]!r}; "
                f"expected {PIPELINING_KWARGS[key]}: {valid}."
            )
    _check_recomputation_schedule(kwargs)
    if kwargs.get("continuous_weight_updates"):
        raise NotImplementedError(
            "`continuous_weight_updates=True` is not implemented: pipelined models "
            "accumulate gradients and update the weights once per accumulation."
        )
    if "gradient_accumulation_dtype" in kwargs:
        kwargs["gradient_accumulation_dtype"] = _accumulator_dtype(
            kwargs["gradient_accumulation_dtype"], "`gradient_accumulation_dtype`")
    _check_stage_poplar_options(kwargs)
    # Stored in one form, so that setting an equal value again changes nothing (`run.py`).
    for name in STAGE_POPLAR_OPTIONS:
        if kwargs.get(name) is not None:
            kwargs[name] = tuple(kwargs[name])
    if "accumulate_outfeed_dtype" in kwargs:
        kwargs["accumulate_outfeed_dtype"] = _outfeed_dtype(kwargs["accumulate_outfeed_dtype"])
    return kwargs


# The schedules each recomputation mode supports (the reference's documentation
# of `RecomputationMode`); `Auto` picks the schedule's own default.
_RECOMPUTATION_SCHEDULES = {
    schedules.RecomputationMode.RecomputeThenBackpropagate:
        (schedules.PipelineSchedule.Grouped, schedules.PipelineSchedule.Interleaved),
    schedules.RecomputationMode.RecomputeAndBackpropagateInterleaved:
        (schedules.PipelineSchedule.Grouped, schedules.PipelineSchedule.Sequential),
}


def _check_recomputation_schedule(kwargs: Mapping[str, Any]) -> None:
    """Refuses a recomputation mode with a schedule that does not support it."""
    mode = kwargs.get("recomputation_mode", schedules.RecomputationMode.Auto)
    schedule = kwargs.get("pipeline_schedule", schedules.PipelineSchedule.Grouped)
    supported = _RECOMPUTATION_SCHEDULES.get(mode)
    if supported is not None and schedule not in supported:
        names = " and ".join(f"PipelineSchedule.{s.name}" for s in supported)
        raise ValueError(
            f"`recomputation_mode` RecomputationMode.{mode.name} is supported by the "
            f"{names} pipeline schedules, not PipelineSchedule.{schedule.name}; use one of "
            f"those or RecomputationMode.Auto (the schedule's default mode).")


def _outfeed_dtype(dtype: Any) -> Any:
    """`accumulate_outfeed_dtype`, as the reference reads it: `None`, a dtype (kept as its
    name), or a per-tensor function (it has no effect here, but a bad value fails there)."""
    if dtype is None or (callable(dtype) and not isinstance(dtype, type)):
        return dtype
    try:
        return np.dtype(dtype).name
    except TypeError:
        raise TypeError(
            f"Invalid `accumulate_outfeed_dtype` in `pipelining_kwargs`: {dtype!r}; expected "
            f"None, a dtype or a function of the outfeed tensor that returns one.") from None


# Per-stage Poplar options: one `PipelineStageOptions` per stage (their number
# is checked against the stages when a run is prepared, `check_stage_poplar_options`).
STAGE_POPLAR_OPTIONS = ("forward_propagation_stages_poplar_options",
                        "backward_propagation_stages_poplar_options")


def _check_stage_poplar_options(kwargs: Mapping[str, Any]) -> None:
    """The reference's type checks of the Poplar options (they have no effect, but
    ported code that passes something else fails there, so it fails here too)."""
    for name in STAGE_POPLAR_OPTIONS:
        stage_options = kwargs.get(name)
        if stage_options is None:
            continue
        if not isinstance(stage_options, (list, tuple)):
            raise TypeError(f"{name} must be a list or a tuple of PipelineStageOptions objects.")
        for item in stage_options:
            if not isinstance(item, PipelineStageOptions):
                raise TypeError(f"Expected all elements of {name} to be of type "
                                f"PipelineStageOptions, but got {item} instead.")
    update = kwargs.get("weight_update_poplar_options")
    if update is not None and not isinstance(update, PipelineStageOptions):
        raise TypeError(f"weight_update_poplar_options to be of type PipelineStageOptions, "
                        f"but got {update} instead.")


def check_stage_poplar_options(options: IPUOptions, num_stages: int, training: bool) -> None:
    """Checks that the per-stage Poplar options give one entry per pipeline stage.

    As in the reference's `pipeline`, the backward stages' options are only
    checked when training.

    Raises:
        ValueError: When a list has another length than the stages.
    """
    for name in STAGE_POPLAR_OPTIONS[:2 if training else 1]:
        stage_options = options.pipelining_kwargs.get(name)
        if stage_options is not None and len(stage_options) != num_stages:
            raise ValueError(
                f"{name} must be a list or a tuple of PipelineStageOptions objects of "
                f"length {num_stages} (same number as the number of computational stages) "
                f"but is {len(stage_options)}.")


# Keys whose `None` is the reference's default (Grouped, Auto, the variables' type).
_PIPELINING_NONE_IS_DEFAULT = ("pipeline_schedule", "recomputation_mode",
                               "gradient_accumulation_dtype")


def _members(enum_class: Any) -> str:
    return "one of " + ", ".join(f"{enum_class.__name__}.{m.name}" for m in enum_class)


def accumulator_dtypes(option: AccumulatorDtype, variables: Sequence[Any]) -> tuple[str, ...]:
    """Per variable, the dtype its gradients accumulate in, as the reference reads the option.

    Args:
        option: `None` (each variable's own dtype), a dtype name, or a
            function of a variable that returns its accumulator's dtype.
        variables: The trainable variables (Keras variables).

    Returns:
        A dtype name per variable.

    Raises:
        ValueError: When the function gives a dtype that cannot accumulate,
            naming the variable.

    Example:

    >>> accumulator_dtypes(None, model.trainable_variables)
    ('float32', 'float32')
    """
    if option is None:
        return tuple(getattr(v.dtype, "name", v.dtype) for v in variables)
    if not callable(option) or isinstance(option, type):
        return (option,) * len(variables)
    return tuple(_dtype_name(option(v), f"dtype the function gives {v.path!r}")
                 for v in variables)


def _accumulator_dtype(dtype: Any, argument: str) -> AccumulatorDtype:
    """A validated accumulator dtype's name (NumPy and JAX types and dtypes, or names), or
    a per-variable function (checked on each variable when a run is prepared)."""
    if callable(dtype) and not isinstance(dtype, type):
        return dtype
    return _dtype_name(dtype, argument)


def _dtype_name(dtype: Any, argument: str) -> str:
    """The name of an accumulator dtype, one of `_ACCUMULATOR_DTYPES`."""
    try:
        name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    except TypeError:
        name = None
    if name not in _ACCUMULATOR_DTYPES:
        raise ValueError(f"The gradient accumulation {argument} must be one of "
                         f"{list(_ACCUMULATOR_DTYPES)}, got {dtype!r}.")
    return name


def _accumulation_kwargs(kwargs: Any) -> dict[str, Any]:
    if not isinstance(kwargs, Mapping):
        raise TypeError("`gradient_accumulation_optimizer_kwargs` must be a dictionary.")
    for key, message in _REFUSED_KWARGS.items():
        if key in kwargs:
            raise ValueError(message)
    unknown = sorted(set(kwargs) - set(GRADIENT_ACCUMULATION_KWARGS))
    if unknown:
        raise ValueError(
            f"Unknown `gradient_accumulation_optimizer_kwargs` {unknown}; valid keys "
            f"are {sorted(GRADIENT_ACCUMULATION_KWARGS)}."
        )
    kwargs = dict(kwargs)
    if kwargs.get("dtype", ...) is None:  # the reference's default: the variables' type
        del kwargs["dtype"]  # (what `accumulator_dtypes` makes of no option)
    if "dtype" in kwargs:
        kwargs["dtype"] = _accumulator_dtype(kwargs["dtype"], "`dtype`")
    return kwargs


def replication_options(options: IPUOptions, method: Any) -> IPUOptions:
    """Validated new options from `set_replication_options`.

    Raises:
        ValueError: For an unknown reduction method.
    """
    return dataclasses.replace(
        options, replicated_metric_reduction_method=ReplicatedMetricReductionMethod.parse(method)
    )


def options_of(model: Any) -> IPUOptions:
    """A model's IPU options (defaults when none were set)."""
    return context.state_of(model).options or IPUOptions()


def set_options(model: Any, options: IPUOptions) -> None:
    """Replaces a model's IPU options."""
    context.state_of(model).options = options


def asynchronous_callbacks_option(options: IPUOptions, asynchronous: Any) -> IPUOptions:
    """Validated new options from `set_asynchronous_callbacks`.

    Raises:
        TypeError: When `asynchronous` is not a bool.
    """
    asynchronous = checked_flag("asynchronous", asynchronous)
    return dataclasses.replace(options, asynchronous_callbacks=asynchronous)


def checked_flag(name: str, value: Any) -> bool:
    """`value` as a Python bool: a NumPy bool counts (read from an array, or a config).

    Args:
        name: The argument's name, for the error.
        value: Its value.

    Returns:
        The bool.

    Raises:
        TypeError: For anything else (a string such as `"False"`, an int).

    Example:

    >>> checked_flag("asynchronous", np.True_)
    True
    """
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"`{name}` must be a bool, got {value!r}.")
    return bool(value)


def feed_queue_options(options: IPUOptions, infeed: Any = None, outfeed: Any = None) -> IPUOptions:
    """Validated new options from `set_infeed_queue_options` / `set_outfeed_queue_options`.

    Each call replaces that queue's options, as in the reference.

    Raises:
        ValueError, TypeError: See `feed_options.infeed_options`.
    """
    if infeed is not None:
        options = dataclasses.replace(options, infeed_kwargs=feed_options.infeed_options(infeed))
    if outfeed is not None:
        options = dataclasses.replace(
            options, outfeed_kwargs=feed_options.outfeed_options(outfeed)
        )
    return options
