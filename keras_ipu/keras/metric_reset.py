"""A model's metrics reset with one compiled call, as Keras' `reset_metrics` resets them.

Keras resets each metric variable to a zero made by an eager device operation
(`ops.zeros`, or a Python `0` converted on assignment). On a GPU each costs
0.1-0.3 ms, about a millisecond of every warm `fit`'s setup (and of every
epoch's), while the device waits (benchmarks/profile_fit_setup.py). Metrics
whose `reset_state` is one of Keras' own zeroing ones, below, get device zeros
instead, all made by one compiled call (some 10 µs); any other metric resets
itself as in Keras, and a model that overrides `reset_metrics` is left to it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from keras.src.metrics.metric import Metric
from keras.src.metrics.reduction_metrics import Mean, Sum
from keras.src.trainers.compile_utils import CompileMetrics, MetricsList
from keras.src.trainers.trainer import Trainer

# Keras' reset_state functions that only zero variables: which ones they zero.
ZEROED_VARIABLES: dict[Callable, Callable[[Any], list]] = {
    Metric.reset_state: lambda metric: metric.variables,
    Mean.reset_state: lambda metric: [metric.total, metric.count],
    Sum.reset_state: lambda metric: [metric.total],
}

# Keras' reset_state functions that only reset other metrics: which ones.
CONTAINED_METRICS: dict[Callable, Callable[[Any], list]] = {
    MetricsList.reset_state: lambda metrics: metrics.metrics,
    CompileMetrics.reset_state: lambda compiled: (
        [*compiled._flat_metrics, *compiled._flat_weighted_metrics] if compiled.built else []),
}


def reset_metrics(model: Any) -> None:
    """Resets the model's metrics to the values Keras' `model.reset_metrics()` gives them.

    Args:
        model: A compiled Keras model.

    Example:

    >>> reset_metrics(model)   # as model.reset_metrics(), with one compiled call
    """
    # Looked up on the instance, as Keras calls it: a method set on the instance counts too.
    if getattr(model.reset_metrics, "__func__", None) is not Trainer.reset_metrics:
        model.reset_metrics()
        return
    zeroed: list = []
    try:
        for metric in model.metrics:
            _reset(metric, zeroed)
    finally:
        # A custom reset that raises stops Keras' loop too: the metrics before it are reset.
        _assign_zeros(zeroed)


def _assign_zeros(variables: list) -> None:
    if not variables:
        return
    specs = tuple((tuple(v.shape), jax.dtypes.canonicalize_dtype(np.dtype(v.dtype)))
                  for v in variables)
    for variable, value in zip(variables, _zeros(specs)):
        variable.assign(value)


@functools.partial(jax.jit, static_argnums=0)
def _zeros(specs: tuple) -> list:
    # Compiled once per set of shapes and dtypes: one dispatch makes them all.
    return [jnp.zeros(shape, dtype) for shape, dtype in specs]


def _reset(metric: Any, zeroed: list) -> None:
    """Resets `metric`, or adds the variables its Keras reset would zero to `zeroed`."""
    if metric is None:  # CompileMetrics keeps a None for an output without metrics
        return
    reset = getattr(metric.reset_state, "__func__", None)
    if reset in ZEROED_VARIABLES:
        zeroed.extend(ZEROED_VARIABLES[reset](metric))
    elif reset in CONTAINED_METRICS:
        for contained in CONTAINED_METRICS[reset](metric):
            _reset(contained, zeroed)
    else:
        # Its own reset comes after the zeroing ones met so far, as in Keras' order:
        # what it sets of its variables is not zeroed afterwards.
        own = {id(v) for v in getattr(metric, "variables", ())}
        zeroed[:] = [v for v in zeroed if id(v) not in own]
        metric.reset_state()
