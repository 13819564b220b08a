"""Splitting a chain of layers into pipeline stages that balance a cost (the `auto` converter).

Given each layer's cost (estimated cycles, or memory bytes) in execution
order, `balanced_split` cuts the chain into `stages` contiguous runs that
minimise the largest run's cost (an exact linear partition by dynamic
programming); `fewest_stages` searches from a minimum to a maximum number of
stages for the fewest whose every stage fits a memory capacity.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class Split:
    """Layers per stage of a chain, and each stage's cost and memory.

    Args:
        stage_of_layer: The stage of each layer, in chain order.
        stage_costs: The balanced cost of each stage.
        stage_memory: The memory bytes of each stage.

    Example:

    >>> balanced_split([1, 1, 1, 1], [8, 8, 8, 8], 2).stage_of_layer
    (0, 0, 1, 1)
    """

    stage_of_layer: tuple[int, ...]
    stage_costs: tuple[float, ...]
    stage_memory: tuple[int, ...]

    @property
    def imbalance(self) -> float:
        """Largest stage cost over the smallest (1.0: perfectly balanced)."""
        smallest = min(self.stage_costs)
        return max(self.stage_costs) / smallest if smallest else float("inf")


def balanced_split(costs: Sequence[float], memory: Sequence[int], stages: int) -> Split:
    """The contiguous split of a chain into `stages` runs with the smallest largest cost.

    Args:
        costs: Each layer's cost, in chain order.
        memory: Each layer's memory bytes, in chain order.
        stages: The number of stages (at most the number of layers).

    Returns:
        The `Split`.

    Raises:
        ValueError: When there are fewer layers than stages, or none.

    Example:

    >>> balanced_split([3, 1, 1, 1], [0] * 4, 2).stage_of_layer
    (0, 1, 1, 1)
    """
    count = len(costs)
    if not 1 <= stages <= count:
        raise ValueError(f"Cannot split {count} layers into {stages} pipeline stages.")
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    infinity = float("inf")
    # best[k][i]: the smallest largest cost of the first i layers in k runs.
    best = [[infinity] * (count + 1) for _ in range(stages + 1)]
    cut = [[0] * (count + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, count + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    bounds, i = [], count
    for k in range(stages, 0, -1):
        bounds.append((cut[k][i], i))
        i = cut[k][i]
    bounds.reverse()
    stage_of_layer = tuple(s for s, (start, stop) in enumerate(bounds) for _ in range(start, stop))
    return Split(
        stage_of_layer,
        tuple(prefix[stop] - prefix[start] for start, stop in bounds),
        tuple(int(sum(memory[start:stop])) for start, stop in bounds),
    )


def fewest_stages(costs: Sequence[float], memory: Sequence[int], capacity_bytes: int,
                  minimum: int = 2, maximum: int = 64) -> Split:
    """The balanced split with the fewest stages, from `minimum` up, whose stages all fit.

    Args:
        costs: Each layer's cost, in chain order (what is balanced).
        memory: Each layer's memory bytes (what must fit).
        capacity_bytes: One IPU's memory.
        minimum: The fewest stages to try.
        maximum: The most stages to try (capped at the number of layers).

    Returns:
        The `Split`.

    Raises:
        ValueError: When no number of stages in the range fits, naming the
            largest stage of the best split tried.

    Example:

    >>> fewest_stages([1] * 6, [10] * 6, capacity_bytes=30).stage_of_layer
    (0, 0, 0, 1, 1, 1)
    """
    if minimum < 1 or maximum < minimum:
        raise ValueError(f"Invalid IPU range: min {minimum}, max {maximum}.")
    if minimum > len(costs):
        raise ValueError(f"The model has {len(costs)} layer(s): too few for {minimum} pipeline "
                         f"stages (each holds a layer or more); ask for at most {len(costs)} "
                         f"IPU(s).")
    split = None
    for stages in range(minimum, min(maximum, len(costs)) + 1):
        split = balanced_split(costs, memory, stages)
        if max(split.stage_memory) <= capacity_bytes:
            return split
    largest = max(split.stage_memory) if split else max(memory, default=0)
    raise ValueError(
        f"No split into {minimum}-{maximum} pipeline stages fits an IPU's "
        f"{capacity_bytes} bytes (the largest stage needs {largest} bytes)."
    )


__all__ = ["Split", "balanced_split", "fewest_stages"]
