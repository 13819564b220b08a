"""The pipeline stage assignment methods that the extension classes gain (as in `keras.ipu`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from keras_ipu.keras.stages.model_assignment import (
    get_assignment,
    invalidate_sequential_assignment,
    reset_assignment,
    set_assignment,
)
from keras_ipu.keras.stages.summary import assignment_summary


def _notify_changed(model: Any) -> None:
    # Extensions drop their compiled programs when the assignment changes.
    hook = getattr(model, "_pipeline_assignment_changed", None)
    if callable(hook):
        hook()


class _PipelineAssignmentMixin:
    """The four pipeline stage assignment methods shared by the extensions."""

    def get_pipeline_stage_assignment(self) -> list:
        """Returns the pipeline stage assignment of all the layer calls in the model.

        If `set_pipeline_stage_assignment()` was called, a copy of that
        assignment; otherwise the stages of `PipelineStage` scopes, or one
        unassigned entry per layer (Sequential) or per layer call in
        post-order, the order the calls execute in (Functional, subclassed;
        input layers excluded). Nested models give one nested assignment
        holding the nested model's own list. Modify the returned objects and
        pass the list to `set_pipeline_stage_assignment()`.

        Returns:
            A new list of new assignment objects.

        Raises:
            RuntimeError: For a subclassed model that is not built.
            ValueError: When PipelineStage scopes assigned only some calls.

        Example:

        >>> assignments = model.get_pipeline_stage_assignment()
        >>> for assignment in assignments:
        ...     assignment.pipeline_stage = 0
        """
        return get_assignment(self)

    def set_pipeline_stage_assignment(self, pipeline_stage_assignment: list) -> None:
        """Sets the pipeline stage assignment of all the layer calls in the model.

        The assignment is used to run the model pipelined (model-parallel)
        in `fit()`, `evaluate()` and `predict()`; `call()` ignores it. It is
        validated immediately.

        Args:
            pipeline_stage_assignment: Sequential models: one int or
                `SequentialLayerPipelineStageAssignment` per layer (nested
                models: a `SequentialNestedModelPipelineStageAssignment` or an
                int for all their calls). Functional and subclassed models:
                the list from `get_pipeline_stage_assignment()` with stages
                set, in post-order.

        Raises:
            ValueError: When the assignment does not match the model or
                breaks a pipelining rule.
            RuntimeError: For a subclassed model that is not built.

        Example:

        >>> model.set_pipeline_stage_assignment([0, 0, 1, 1])
        """
        set_assignment(self, pipeline_stage_assignment)
        _notify_changed(self)

    def reset_pipeline_stage_assignment(self) -> None:
        """Resets the pipeline stage assignment so that the model is no longer pipelined.

        Stages from PipelineStage scopes are forgotten too.

        Example:

        >>> model.reset_pipeline_stage_assignment()
        """
        reset_assignment(self)
        _notify_changed(self)

    def print_pipeline_stage_assignment_summary(
        self, line_length: int | None = None, print_fn: Callable[[str], Any] | None = None
    ) -> None:
        """Prints a summary of the pipeline stage assignment of the model.

        Args:
            line_length: Total length of the printed lines (default 60 for
                Sequential models, 89 otherwise).
            print_fn: Called once per line (default `print`).

        Raises:
            RuntimeError, ValueError: As `get_pipeline_stage_assignment`.

        Example:

        >>> model.print_pipeline_stage_assignment_summary(line_length=65)
        """
        print_fn = print if print_fn is None else print_fn
        for line in assignment_summary(self, line_length):
            print_fn(line)


class SequentialPipelineMixin(_PipelineAssignmentMixin):
    """Pipeline stage assignment methods of Sequential models.

    `add()` and `pop()` invalidate a set assignment (it must be set again
    before the model runs pipelined).

    Example:

    >>> model.set_pipeline_stage_assignment([0, 1])
    >>> model.add(keras.layers.Dense(1))  # the assignment is now invalid
    """

    def add(self, layer: Any, rebuild: bool = True) -> None:
        """Adds a layer on top of the stack; invalidates a pipeline stage assignment.

        Args:
            layer: The layer to add.
            rebuild: Whether to rebuild the model (as `keras.Sequential.add`).

        Example:

        >>> model.add(keras.layers.Dense(1))
        """
        super().add(layer, rebuild=rebuild)
        if invalidate_sequential_assignment(
            self,
            "Adding a layer to a pipelined Sequential model has invalidated the pipeline "
            "stage assignment. You need to call `set_pipeline_stage_assignment()` before "
            "executing again.",
        ):
            _notify_changed(self)

    def pop(self, rebuild: bool = True) -> Any:
        """Removes the last layer; invalidates a pipeline stage assignment.

        Args:
            rebuild: Whether to rebuild the model (as `keras.Sequential.pop`).

        Returns:
            The removed layer.

        Example:

        >>> layer = model.pop()
        """
        layer = super().pop(rebuild=rebuild)
        if invalidate_sequential_assignment(
            self,
            "Removing a layer from a pipelined Sequential model has invalidated the pipeline "
            "stage assignment. You need to call `set_pipeline_stage_assignment()` before "
            "executing again.",
        ):
            _notify_changed(self)
        return layer


class FunctionalPipelineMixin(_PipelineAssignmentMixin):
    """Pipeline stage assignment methods of Functional models (per layer call).

    Example:

    >>> assignments = model.get_pipeline_stage_assignment()
    """


class ModelPipelineMixin(_PipelineAssignmentMixin):
    """Pipeline stage assignment methods of subclassed models (traced `call`).

    The model must be built (`model.build(shape)`, `keras.Input`s for other
    dtypes, or a call on data) before getting or setting an assignment.

    Example:

    >>> model.build((None, 32))
    >>> assignments = model.get_pipeline_stage_assignment()
    """


__all__ = ["FunctionalPipelineMixin", "ModelPipelineMixin", "SequentialPipelineMixin"]
