"""Gradient accumulation: how micro-batch gradients are reduced into one update."""

from __future__ import annotations

import enum
from typing import Any


class GradientAccumulationReductionMethod(enum.Enum):
    """How the gradients of the micro-batches of one weight update are combined.

    - `SUM`: the sum of the gradients.
    - `MEAN`: the sum, each gradient scaled by `1 / num_mini_batches`.
    - `RUNNING_MEAN`: a running mean, `acc * n / (n + 1) + grad / (n + 1)` for
      the n-th micro-batch; the same mean as `MEAN` with smaller partial sums,
      which helps 16-bit accumulators.

    Example:

    >>> GradientAccumulationReductionMethod.parse("running_mean")
    <GradientAccumulationReductionMethod.RUNNING_MEAN: 2>
    """

    SUM = 0
    MEAN = 1
    RUNNING_MEAN = 2

    @classmethod
    def parse(cls, value: Any) -> GradientAccumulationReductionMethod:
        """A member from itself or its name in any case.

        Raises:
            ValueError: For anything else, listing the valid values.
        """
        return parse_enum(cls, value, "one of GradientAccumulationReductionMethod")


def parse_enum(cls: type[enum.Enum], value: Any, what: str) -> Any:
    """Parses an enum member or a case-insensitive member name."""
    if isinstance(value, cls):
        return value
    if isinstance(value, str) and value.upper() in cls.__members__:
        return cls[value.upper()]
    raise ValueError(
        f"Cannot parse {value!r} as {what}. Valid values are: "
        f"{', '.join(cls.__members__)}."
    )


__all__ = ["GradientAccumulationReductionMethod"]
