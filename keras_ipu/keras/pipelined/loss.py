"""The loss of a pipelined model, computed on its last stage's IPU.

`stage_loss` is `model.stateless_compute_loss` for a pipeline: the last
stage's weights are the values the stage runs with (so a `compute_loss`
override reading one differentiates through it), the stages' additional
losses arrive with the bundle, and a weight of another stage, which is not on
this IPU, cannot be read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import keras


def stage_loss(model, metrics_values, batch, y_pred, extra_loss, training: bool,
               weights: Mapping[int, Any]):
    """The model's loss on a micro-batch, its additional losses included.

    As `model.stateless_compute_loss`, on the last stage's IPU: a
    `compute_loss` override reads the last stage's weights as `weights` (and
    differentiates through them); reading another stage's raises.

    Args:
        weights: The last stage's trainable variables' values, by index in
            `model.trainable_variables`.

    Returns:
        `(loss, new metrics values)`; `extra_loss` counts as `model.losses`
        (the stages' regularizers and `add_loss` values, computed where their
        layers run); `None` where the stages have none (`model.losses` is
        then empty, so a loss of `reduction="none"` evaluates as in Keras).

    Raises:
        ValueError: When the loss reads a weight of another stage.

    Example:

    >>> loss, metrics = stage_loss(model, metrics, batch, y_pred, extra, True, {3: kernel})
    """
    x, y, sample_weight = batch
    trainable = model.trainable_variables
    mapping = [(trainable[i], value) for i, value in weights.items()]
    mapping += list(zip(model.metrics_variables, metrics_values))
    elsewhere = {id(v): v for i, v in enumerate(trainable) if i not in weights}
    previous = model._losses_override
    model._losses_override = [] if extra_loss is None else [extra_loss]
    try:
        with _LastStageScope(mapping, elsewhere) as scope:
            loss = model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,
                                       training=training)
    finally:
        model._losses_override = previous
    return loss, [scope.get_current_value(v) for v in model.metrics_variables]


class _LastStageScope(keras.StatelessScope):
    """The loss's variables: the last stage's weights and the metrics; another stage's
    weight is not on this IPU (its Keras value would be stale and get no gradient)."""

    def __init__(self, mapping: list, elsewhere: dict):
        super().__init__(state_mapping=mapping)
        self.elsewhere = elsewhere

    def get_current_value(self, variable):
        value = super().get_current_value(variable)
        if value is None and id(variable) in self.elsewhere:
            raise ValueError(
                f"The loss reads `{variable.path}`, a weight of a pipeline stage other than "
                f"the last: a pipelined model computes its loss (`compute_loss`) on the last "
                f"stage's IPU, which holds the last stage's weights only. Compute the term "
                f"where its weight is, in a layer of that stage (`self.add_loss(...)` in its "
                f"`call`, or a regularizer): it reaches the loss as `self.losses`.")
        return value


__all__ = ["stage_loss"]
