"""Pipeline stage assignments: which pipeline stage runs each layer call of a model.

A Sequential model is assigned per layer (`model.layers` order); Functional
models and subclassed models per layer *call* (Keras `Node`), in post-order:
the order the calls execute in. Nested Functional and Sequential models are
expanded into their own assignment lists; all of them are stored on the root
model. Subclassed models are traced first (their `call` is run on
`keras.Input`s, so every inner layer call records a node); a nested
subclassed model is one layer call.

Stages come from `set_pipeline_stage_assignment`, or, for Functional and
subclassed models, from `PipelineStage` scopes (read when the assignment is
first needed: `get_pipeline_stage_assignment`, the summary, `pipeline_plan`).
Post-order: calls sorted by decreasing depth (longest path to a model
output), ties broken by a depth-first walk from the outputs, as Keras runs a
Functional graph. `node_index` counts the calls of a layer *within the
model's graph*, in call order, from 0.

The mixins give extension classes the four public methods;
`pipeline_plan(model)` is what the pipelined executor reads, and
`assignment_to_config` / `assignment_from_config` save and restore.

Deliberate differences from the reference: stages without calls are refused
when an assignment is set (and again by `pipeline_plan`); the nested
assignment classes work everywhere (`inbound_layers`, saving); `get` returns
new objects, so the stored assignment changes only through `set`; scopes are
read lazily (partial scopes raise at the first get, summary or plan, not at
construction); Sequential models ignore scopes. Known limit: a Functional
model built from intermediate tensors (Keras clones those nodes) keeps the
stages of construction scopes but loses those of call scopes.

This module is the model-facing side: the assignment stored on a model, the
public functions, saving and the mixins. It is built on
`pipeline_assignment_classes` (the public assignment classes),
`pipeline_graph` (model kinds, graphs, post-order, tracing),
`pipeline_levels` (the assignment tree: structure, validation, expansion) and
`pipeline_plan` (the `PipelinePlan` of a checked assignment), and re-exports
the names the package and its tests import from here.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import keras

from keras_ipu.keras import context

# Some of these names are only re-exported (`__all__`, the package, the tests).
from keras_ipu.keras.pipeline_assignment_classes import (
    FunctionalLayerPipelineStageAssignment,
    FunctionalNestedModelPipelineStageAssignment,
    ModelLayerPipelineStageAssignment,
    NestedModelPipelineStageAssignment,
    SequentialLayerPipelineStageAssignment,
    SequentialNestedModelPipelineStageAssignment,
    _name,
)
from keras_ipu.keras.pipeline_graph import (
    FUNCTIONAL,
    MODEL,
    SEQUENTIAL,
    _graph,
    _traced_graph,
    _TraceError,
    model_kind,
    trace_model,
)
from keras_ipu.keras.pipeline_graph import _Trace as _Trace  # re-exported for tests
from keras_ipu.keras.pipeline_levels import (
    _apply,
    _check_all_or_none,
    _check_assigned,
    _fill,
    _Level,
    _structure,
    _to_assignments,
)
from keras_ipu.keras.pipeline_plan import _make_plan
from keras_ipu.keras.pipeline_stage import PipelinePlan, PipelineStage

logger = logging.getLogger("keras_ipu")

DEFAULT_LINE_LENGTH = {SEQUENTIAL: 60, FUNCTIONAL: 89, MODEL: 89}
_COLUMNS = {
    SEQUENTIAL: (("Layer (type)", "Pipeline Stage"), (0.5, 1.0)),
    FUNCTIONAL: (("Layer (type) (node index)", "Input Layers", "Pipeline Stage"), (0.4, 0.8, 1.0)),
}


# --------------------------------------------------------------------------
# Stored state and the public functions.


@dataclasses.dataclass(eq=False)
class _PipelineState:
    level: _Level | None = None  # the validated assignment
    valid: bool = False  # Sequential: False after add()/pop()
    use_annotations: bool = True  # False after reset: PipelineStage scopes are ignored
    pending: list | None = None  # a saved assignment waiting for the model's graph


def _state(model: Any) -> _PipelineState:
    state = context.state_of(model)
    if state.assignment is None:
        state.assignment = _PipelineState()
    return state.assignment


def _apply_pending(model: Any, inputs: Any = None) -> None:
    state = _state(model)
    if state.pending is None:
        return
    kind = model_kind(model)
    if kind == MODEL and _traced_graph(model, inputs) is None:
        return
    items, state.pending = state.pending, None
    _restore(model, kind, items)


def get_assignment(model: Any) -> list:
    """The model's pipeline stage assignment (what `get_pipeline_stage_assignment` returns).

    Args:
        model: A Keras model.

    Returns:
        A new list of new assignment objects: the assignment set with
        `set_pipeline_stage_assignment`, else the stages of `PipelineStage`
        scopes, else one unassigned (`pipeline_stage=None`) entry per layer
        (Sequential) or layer call in post-order (Functional, subclassed).

    Raises:
        RuntimeError: For a subclassed model that is not built.
        ValueError: When PipelineStage scopes assigned only some layer calls,
            or a subclassed model's `call` cannot be traced.

    Example:

    >>> [a.pipeline_stage for a in get_assignment(model)]
    [None, None, None]
    """
    kind = model_kind(model)
    _apply_pending(model)
    state = _state(model)
    if state.level is not None:
        if kind == SEQUENTIAL and not state.valid:
            logger.info(
                "Layers were added to or removed from Sequential model %s after its pipeline "
                "stage assignment was set: the current assignment is not valid.",
                _name(model),
            )
        return _to_assignments(state.level)
    annotate = state.use_annotations and kind != SEQUENTIAL
    level = _structure(model, kind, _graph(model, kind, action="get"), annotate)
    _check_all_or_none(level)
    return _to_assignments(level)


def set_assignment(model: Any, pipeline_stage_assignment: Any) -> None:
    """Validates and stores a pipeline stage assignment (`set_pipeline_stage_assignment`).

    Args:
        model: A Keras model.
        pipeline_stage_assignment: A list with one entry per layer
            (Sequential: ints or `SequentialLayerPipelineStageAssignment`s,
            nested models as `SequentialNestedModelPipelineStageAssignment`s
            or one int for the whole nested model) or per layer call in
            post-order (Functional/subclassed: the assignment objects of
            `get_pipeline_stage_assignment`). The objects are copied.

    Raises:
        ValueError: For an assignment that does not match the model or
            breaks a pipelining rule (see the reference's error catalogue):
            not a list, wrong length or element type, wrong order, an
            unassigned call, a call that uses a later stage's output, a
            Sequential stage that is not the previous stage or the next one,
            a first Sequential stage other than 0, or a stage without calls.
        RuntimeError: For a subclassed model that is not built.

    Example:

    >>> set_assignment(sequential_model, [0, 0, 1, 1])
    """
    kind = model_kind(model)
    if not isinstance(pipeline_stage_assignment, list):
        raise ValueError(
            f"`pipeline_stage_assignment` needs to be a list, but received "
            f"{type(pipeline_stage_assignment).__name__}."
        )
    level = _structure(model, kind, _graph(model, kind, action="set"), annotate=False)
    _apply(level, pipeline_stage_assignment)
    _check_assigned(level)
    state = _state(model)
    state.level, state.valid, state.pending = level, True, None


def reset_assignment(model: Any) -> None:
    """Forgets the assignment, and PipelineStage scopes: the model is no longer pipelined.

    Args:
        model: A Keras model.

    Example:

    >>> reset_assignment(model)
    >>> pipeline_plan(model) is None
    True
    """
    state = _state(model)
    state.level, state.valid, state.pending, state.use_annotations = None, False, None, False


def invalidate_sequential_assignment(model: Any, message: str) -> bool:
    """Marks a Sequential model's assignment invalid after its layers changed.

    Args:
        model: A Sequential model.
        message: The info log explaining why.

    Returns:
        Whether there was a valid assignment to invalidate.

    Example:

    >>> invalidate_sequential_assignment(model, "A layer was added.")
    True
    """
    state = context.state_of(model).assignment
    if state is None or state.level is None or not state.valid:
        return False
    state.valid = False
    logger.info(message)
    return True


def _summary_row(fields: list, positions: list[int]) -> str:
    line = ""
    for i, field in enumerate(fields):
        if i > 0:
            line = line[:-1] + " "
        line += str(field)
        line = line[: positions[i]]
        line += " " * (positions[i] - len(line))
    return line


def _summary_rows(assignment: Any, columns: int) -> list[list]:
    layer = assignment.layer
    label = f"{_name(layer)} ({layer.__class__.__name__})"
    node_index = getattr(assignment, "node_index", None)
    if node_index is not None:
        label += f" ({node_index})"
    stage = str(assignment.pipeline_stage)
    if columns == 2:
        return [[label, stage]]
    inbound = [_name(op) for op in getattr(assignment, "inbound_layers", [])]
    rows = [[label, inbound[0] if inbound else "", stage]]
    rows.extend(["", name, ""] for name in inbound[1:])
    return rows


def assignment_summary(model: Any, line_length: int | None = None) -> list[str]:
    """The lines of `print_pipeline_stage_assignment_summary`.

    Columns: `Layer (type)` and `Pipeline Stage` (Sequential, default width
    60), or `Layer (type) (node index)`, `Input Layers` and `Pipeline Stage`
    (Functional and subclassed, default 89); extra input layers go on
    continuation rows. A nested model prints `Nested Model: "<name>"`, a `-`
    rule and its own rows.

    Args:
        model: A Keras model.
        line_length: Total width; the default depends on the model kind.

    Returns:
        The lines, without line breaks.

    Raises:
        RuntimeError, ValueError: As `get_assignment`.

    Example:

    >>> assignment_summary(model, 65)[0]
    'Model: "sequential"'
    """
    kind = model_kind(model)
    length = line_length or DEFAULT_LINE_LENGTH[kind]
    headers, widths = _COLUMNS[SEQUENTIAL if kind == SEQUENTIAL else FUNCTIONAL]
    positions = [int(length * width) for width in widths]
    lines = [f'Model: "{_name(model)}"', "_" * length, _summary_row(headers, positions)]
    lines.append("=" * length)

    def emit(assignments: list) -> None:
        for i, assignment in enumerate(assignments):
            if assignment.is_nested_model:
                lines.append(f'Nested Model: "{_name(assignment.nested_model)}"')
                lines.append("-" * length)
                emit(assignment.pipeline_stage_assignments)
                continue
            for fields in _summary_rows(assignment, len(headers)):
                lines.append(_summary_row(fields, positions))
            last = i + 1 == len(assignments) or assignments[i + 1].is_nested_model
            lines.append(("=" if last else "_") * length)

    emit(get_assignment(model))
    return lines


def pipeline_plan(model: Any, inputs: Any = None) -> PipelinePlan | None:
    """The stages a pipelined model runs, or `None` when it is not pipelined.

    A model is pipelined when an assignment was set (and, for Sequential
    models, not invalidated by `add`/`pop`), or when PipelineStage scopes
    assigned its layer calls (Functional and subclassed models, until
    `reset`). The assignment is re-validated against the current graph.

    Args:
        model: A Keras model.
        inputs: Specs of the model inputs (anything with `shape` and
            `dtype`, such as the data arrays, in the structure `call` takes;
            the first dimension is the batch and is left unknown). Used only
            to build an unbuilt pipelined Sequential model or to trace a
            subclassed model that is not built.

    Returns:
        The plan, or `None`.

    Raises:
        RuntimeError: When a stage below the highest has no layer call, the
            stored assignment no longer matches the graph (layers added or
            removed, a subclassed model rebuilt with other shapes), or a
            pipelined model cannot be built.
        ValueError: When PipelineStage scopes assign only some calls or give
            a call an input from a later stage.

    Example:

    >>> plan = pipeline_plan(model)
    >>> [[call.operation.name for call in calls] for calls in plan.stages]
    [['dense', 'dense_1'], ['dense_2', 'dense_3']]
    """
    kind = model_kind(model)
    _apply_pending(model, inputs)
    state = _state(model)
    if kind == SEQUENTIAL:
        if state.level is None:
            return None
        if not state.valid:
            raise RuntimeError(
                f"The pipeline stage assignment of Sequential model {_name(model)} is no "
                f"longer valid: layers were added or removed after it was set. Call "
                f"`set_pipeline_stage_assignment()` again (or "
                f"`reset_pipeline_stage_assignment()`)."
            )
        if getattr(model, "_functional", None) is None and inputs is not None:
            shape = tuple(keras.tree.flatten(inputs)[0].shape)
            model.build((None,) + shape[1:])
    try:
        graph = _graph(model, kind, inputs)
    except _TraceError as error:
        if state.level is None and not error.uses_pipeline_stages:
            return None  # not traceable, and nothing says it is pipelined
        raise
    if graph is None:
        if state.level is None:
            return None
        raise RuntimeError(
            f"Model {_name(model)} is pipelined but has no graph yet: build it first "
            f"(`model.build(input_shape)`) or call it on data."
        )
    if state.level is not None:
        level = _structure(model, kind, graph, annotate=False)
        try:
            _apply(level, _to_assignments(state.level))
            expansion = _check_assigned(level, runtime=True)
        except ValueError as error:
            raise RuntimeError(
                f'The pipeline stage assignments for model {_name(model)} are no longer '
                f'valid: "{error}" This can happen if the model is invoked with shapes or '
                f"dtypes which are incompatible with those from the previous invocation, or "
                f"those passed to `model.build`. Set the assignment again with "
                f"`set_pipeline_stage_assignment()`."
            ) from error
    elif state.use_annotations and kind != SEQUENTIAL:
        level = _structure(model, kind, graph, annotate=True)
        if not _check_all_or_none(level):
            return None
        expansion = _check_assigned(level, runtime=True)
    else:
        return None
    if not expansion[0]:
        return None  # no layer calls: nothing to pipeline
    return _make_plan(model, level.graph, *expansion)


# --------------------------------------------------------------------------
# Saving and loading.


def _layer_index(model: Any, op: Any) -> int | None:
    return next((i for i, layer in enumerate(model.layers) if layer is op), None)


def _level_items(level: _Level) -> list:
    items = []
    for entry in level.entries:
        value = _level_items(entry.child) if entry.child is not None else entry.stage
        if level.kind == SEQUENTIAL:
            items.append(value)
        else:
            items.append([_layer_index(level.model, entry.op), entry.node_index, value])
    return items


def assignment_to_config(model: Any) -> dict:
    """The model's assignment as JSON-friendly config entries.

    Keys: `pipeline_stage_assignment` for every model kind, plus
    `pipeline_stage_assignment_valid` for Sequential models. Sequential: one
    int stage per layer. Functional/subclassed: one
    `[layer index in model.layers, node_index, stage]` per layer call in
    post-order (index `None` for `keras.ops` calls, which are not layers).
    A nested model's stage is replaced by the nested model's own list, in
    the form of its kind. Stages of PipelineStage scopes are saved too (a
    reloaded Functional model loses them).

    Args:
        model: A Keras model.

    Returns:
        The config entries (an empty list when the model is not pipelined).

    Example:

    >>> assignment_to_config(sequential_model)
    {'pipeline_stage_assignment': [0, 0, 1, 1], 'pipeline_stage_assignment_valid': True}
    """
    kind = model_kind(model)
    state = _state(model)
    level = state.level
    items: list = list(state.pending or [])
    if level is None and not items and state.use_annotations and kind != SEQUENTIAL:
        try:
            graph = _graph(model, kind)
            candidate = None if graph is None else _structure(model, kind, graph, True)
            level = candidate if candidate is not None and _check_all_or_none(candidate) else None
        except ValueError:
            level = None  # not traceable, or scopes gave only some calls a stage
    if level is not None:
        items = _level_items(level)
    config: dict = {"pipeline_stage_assignment": items}
    if kind == SEQUENTIAL:
        config["pipeline_stage_assignment_valid"] = bool(items) and state.valid
    return config


def _fill_from_items(level: _Level, items: Any, model_name: str) -> None:
    if not isinstance(items, (list, tuple)) or len(items) != len(level.entries):
        raise ValueError(
            f"The saved pipeline stage assignment of model {model_name} does not match its "
            f"graph: {len(level.entries)} layer calls, saved {items!r}."
        )
    for entry, item in zip(level.entries, items):
        value = item
        if level.kind != SEQUENTIAL:
            index, node_index, value = item
            if (index is not None and index != _layer_index(level.model, entry.op)) or (
                node_index != entry.node_index
            ):
                raise ValueError(
                    f"The saved pipeline stage assignment of model {model_name} does not "
                    f"match its graph at layer call {_name(entry.op)} (node index "
                    f"{entry.node_index}): saved {item!r}."
                )
        if entry.child is None:
            entry.stage = value
        elif isinstance(value, (list, tuple)):
            _fill_from_items(entry.child, value, _name(entry.op))
        else:
            _fill(entry.child, value)


def _restore(model: Any, kind: str, items: list) -> None:
    level = _structure(model, kind, _graph(model, kind, action="set"), annotate=False)
    _fill_from_items(level, items, _name(model))
    set_assignment(model, _to_assignments(level))


def assignment_from_config(model: Any, config: dict) -> None:
    """Restores an assignment saved by `assignment_to_config`.

    A subclassed model whose graph is not known yet (not built) keeps the
    saved assignment pending; it is applied when the graph is first needed.
    A Sequential assignment saved after `add`/`pop` invalidated it is not
    restored (it no longer matches the layers).

    Args:
        model: The loaded model.
        config: A dict with the keys `assignment_to_config` writes (other
            keys are ignored; a missing or empty assignment changes nothing).

    Raises:
        ValueError: When the saved assignment does not match the model.

    Example:

    >>> assignment_from_config(model, {"pipeline_stage_assignment": [0, 1]})
    """
    items = config.get("pipeline_stage_assignment") or []
    kind = model_kind(model)
    if not items or (
        kind == SEQUENTIAL and not config.get("pipeline_stage_assignment_valid", True)
    ):
        return
    if kind == MODEL:
        try:
            graph = _traced_graph(model)
        except ValueError:
            graph = None  # traced again when the graph is needed
        if graph is None:
            _state(model).pending = list(items)
            return
    _restore(model, kind, list(items))


# --------------------------------------------------------------------------
# Mixins for the extension classes.


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


__all__ = [
    "FunctionalLayerPipelineStageAssignment",
    "FunctionalNestedModelPipelineStageAssignment",
    "FunctionalPipelineMixin",
    "ModelLayerPipelineStageAssignment",
    "ModelPipelineMixin",
    "NestedModelPipelineStageAssignment",
    "PipelineStage",
    "SequentialLayerPipelineStageAssignment",
    "SequentialNestedModelPipelineStageAssignment",
    "SequentialPipelineMixin",
    "assignment_from_config",
    "assignment_summary",
    "assignment_to_config",
    "get_assignment",
    "invalidate_sequential_assignment",
    "model_kind",
    "pipeline_plan",
    "reset_assignment",
    "set_assignment",
    "trace_model",
]
