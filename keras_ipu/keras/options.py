"""IPU options of a model: what the `set_*_options` methods store, and how it is saved.

The options are plain data (`IPUOptions`, frozen); each setter validates its
arguments first and then replaces the model's options as a whole, so a
failed call changes nothing.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

from keras_ipu.gradient_accumulation import GradientAccumulationReductionMethod, parse_enum


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
    "dtype": "the accumulator dtype (float32 by default)",
    "offload_weight_update_variables": "accepted; no effect on the device model",
    "replicated_optimizer_state_sharding": "accepted; no effect on the device model",
    "name": "accepted; no effect on the device model",
}
_ACCUMULATOR_DTYPES = ("float32", "float16", "bfloat16")

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

    @property
    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per weight update (1 without accumulation)."""
        return self.gradient_accumulation_steps_per_replica or 1

    @property
    def accumulator_dtype(self) -> str:
        """The dtype gradients are accumulated in."""
        return self.gradient_accumulation_optimizer_kwargs.get("dtype", "float32")

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
            "pipelining_gradient_accumulation_steps_per_replica": None,
            "pipelining_device_mapping": None,
            "pipelining_accumulate_outfeed": None,
            "infeed_kwargs": {},
            "outfeed_kwargs": {},
        }

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> IPUOptions:
        """Options from their saved form (unknown keys are ignored)."""
        return cls(
            gradient_accumulation_steps_per_replica=config.get(
                "gradient_accumulation_steps_per_replica"
            ),
            gradient_accumulation_reduction_method=GradientAccumulationReductionMethod(
                config.get("gradient_accumulation_reduction_method", 0)
            ),
            replicated_metric_reduction_method=ReplicatedMetricReductionMethod(
                config.get("replicated_metric_reduction_method", 1)
            ),
            asynchronous_callbacks=bool(config.get("asynchronous_callbacks", False)),
        )


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
    steps = gradient_accumulation_steps_per_replica
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ValueError(
            f"Expected `gradient_accumulation_steps_per_replica` to be a positive "
            f"integer, but got {steps!r} instead."
        )
    method = GradientAccumulationReductionMethod.parse(gradient_accumulation_reduction_method)
    if not isinstance(use_v2_gradient_accumulation_optimizer, bool):
        raise TypeError(
            f"`use_v2_gradient_accumulation_optimizer` must be a bool, got "
            f"{use_v2_gradient_accumulation_optimizer!r}."
        )
    kwargs = _accumulation_kwargs(gradient_accumulation_optimizer_kwargs)
    return dataclasses.replace(
        options,
        gradient_accumulation_steps_per_replica=(
            steps if steps is not None else options.gradient_accumulation_steps_per_replica
        ),
        gradient_accumulation_reduction_method=method,
        use_v2_gradient_accumulation_optimizer=use_v2_gradient_accumulation_optimizer,
        gradient_accumulation_optimizer_kwargs=kwargs,
    )


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
    dtype = kwargs.get("dtype", "float32")
    dtype = getattr(dtype, "name", dtype)  # numpy/jax dtypes
    if str(dtype) not in _ACCUMULATOR_DTYPES:
        raise ValueError(
            f"The gradient accumulation `dtype` must be one of {list(_ACCUMULATOR_DTYPES)}, "
            f"got {kwargs['dtype']!r}."
        )
    return {**kwargs, **({"dtype": str(dtype)} if "dtype" in kwargs else {})}


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
    return vars(model).get("_ipu_options") or IPUOptions()


def set_options(model: Any, options: IPUOptions) -> None:
    """Replaces a model's IPU options."""
    # A plain instance-dict entry: Keras would track the attribute.
    vars(model)["_ipu_options"] = options
