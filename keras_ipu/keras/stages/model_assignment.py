"""The pipeline stage assignment stored on a model, and the plan made from it.

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

`pipeline_plan(model)` is what the pipelined executor reads, and
`assignment_to_config` / `assignment_from_config` save and restore.

Deliberate differences from the reference: stages without calls are refused
when an assignment is set (and again by `pipeline_plan`); the nested
assignment classes work everywhere (`inbound_layers`, saving); `get` returns
new objects, so the stored assignment changes only through `set`; scopes are
read lazily (partial scopes raise at the first get, summary or plan, not at
construction); Sequential models ignore scopes; a subclassed model built
again drops an assignment that was set for a graph of another structure
(the reference keeps the stale list, which then fails to set or run) and
carries it over to a graph of the same structure, `keras.ops` calls
included. Known limit: a Functional model built from intermediate tensors
(Keras clones those nodes) keeps the stages of construction scopes but
loses those of call scopes.

Built on `stages.graph` (model kinds, graphs, tracing), `stages.tree` (the
assignment tree: structure, validation, expansion) and `stages.plan`.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import keras

from keras_ipu.keras import context
from keras_ipu.keras.stages.assignments import name_of
from keras_ipu.keras.stages.graph import (
    FUNCTIONAL,
    MODEL,
    SEQUENTIAL,
    TraceError,
    model_graph,
    model_kind,
    traced_graph,
)
from keras_ipu.keras.stages.plan import PipelinePlan, make_plan
from keras_ipu.keras.stages.tree import (
    AssignmentTree,
    apply_assignment,
    check_all_or_none,
    check_assigned,
    check_dependencies,
    fill_stage,
    graph_signature,
    structure,
    to_assignments,
)

logger = logging.getLogger("keras_ipu")

# --------------------------------------------------------------------------
# Stored state and the public functions.


@dataclasses.dataclass(eq=False)
class AssignmentState:
    """The pipeline stage assignment kept on a model (`context.state_of(model).assignment`).

    Args:
        level: The validated assignment tree, or `None`.
        valid: Sequential models: `False` after `add()`/`pop()`.
        use_annotations: `False` after a reset: `PipelineStage` scopes are ignored.
        pending: A saved assignment waiting for the model's graph.

    Example:

    >>> context.state_of(model).assignment.valid
    True
    """

    level: AssignmentTree | None = None
    valid: bool = False
    use_annotations: bool = True
    pending: list | None = None


def _state(model: Any) -> AssignmentState:
    state = context.state_of(model)
    if state.assignment is None:
        state.assignment = AssignmentState()
    return state.assignment


def _apply_pending(model: Any, inputs: Any = None) -> None:
    state = _state(model)
    if state.pending is None:
        return
    kind = model_kind(model)
    if kind == MODEL and traced_graph(model, inputs) is None:
        return
    items, state.pending = state.pending, None
    _restore(model, kind, items)


def _follow_graph(model: Any, state: AssignmentState, graph: Any) -> None:
    # A subclassed model is traced again when it is built again (`graph.traced_graph`).
    # The stored assignment was made for the graph it holds: on a graph of the same
    # structure (`tree.graph_signature`: the same layer calls, node indices and data
    # flow) its stages carry over call by call, onto the new graph's nodes; on a graph
    # of another structure it no longer applies and is dropped, as the reference says
    # ("invalidate"), so that `get` gives the new graph's own assignment (PipelineStage
    # scopes still count, unless reset). Functional and Sequential graphs are not traced.
    old = state.level
    if old is None or graph is None or old.graph is graph:
        return
    new = structure(model, MODEL, graph, annotate=False)
    if graph_signature(new) == graph_signature(old):
        for old_leaf, new_leaf in zip(old.leaves(), new.leaves()):
            new_leaf.stage = old_leaf.stage
        state.level = new
        return
    state.level, state.valid = None, False
    logger.warning(
        "Model %s was built again and its graph of layer calls has another structure (%d "
        "layer calls, before %d): the pipeline stage assignment set for the previous graph "
        "no longer applies and was dropped. Get the new graph's assignment with "
        "`get_pipeline_stage_assignment()`, assign its stages and set it with "
        "`set_pipeline_stage_assignment()`.",
        name_of(model),
        len(new.leaves()),
        len(old.leaves()),
    )


def get_assignment(model: Any) -> list:
    """The model's pipeline stage assignment (what `get_pipeline_stage_assignment` returns).

    Args:
        model: A Keras model.

    Returns:
        A new list of new assignment objects: the assignment set with
        `set_pipeline_stage_assignment`, else the stages of `PipelineStage`
        scopes, else one unassigned (`pipeline_stage=None`) entry per layer
        (Sequential) or layer call in post-order (Functional, subclassed).
        A subclassed model built again keeps the assignment set while its
        graph has the same structure; when the structure changed, the set
        assignment is dropped (with a warning) and the new graph's is given.

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
    if state.level is not None and kind == MODEL:
        _follow_graph(model, state, model_graph(model, kind, action="get"))
    if state.level is not None:
        if kind == SEQUENTIAL and not state.valid:
            logger.info(
                "Layers were added to or removed from Sequential model %s after its pipeline "
                "stage assignment was set: the current assignment is not valid.",
                name_of(model),
            )
        return to_assignments(state.level)
    annotate = state.use_annotations and kind != SEQUENTIAL
    level = structure(model, kind, model_graph(model, kind, action="get"), annotate)
    check_all_or_none(level)
    return to_assignments(level)


def check_scope_stages(model: Any) -> None:
    """Raises when `PipelineStage` scopes gave a stage to some of a graph's calls but not
    all, or a call uses the output of a later stage.

    The reference checks a Functional model when it is constructed; a
    subclassed model's calls are known only once it is traced.

    Raises:
        ValueError: Naming the first call without a stage, or the call that
            uses a later stage's output.

    Example:

    >>> check_scope_stages(model)   # right after keras.Model(inputs, outputs)
    """
    kind = model_kind(model)
    if kind != FUNCTIONAL or not _state(model).use_annotations:
        return
    level = structure(model, kind, model_graph(model, kind, action="get"), True)
    # As the reference's `set_pipeline_stage_assignment` from the scopes' stages; an
    # empty stage is left to the run, since a nested model may use only later stages.
    if check_all_or_none(level):
        check_dependencies(level)


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
    level = structure(model, kind, model_graph(model, kind, action="set"), annotate=False)
    apply_assignment(level, pipeline_stage_assignment)
    check_assigned(level)
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
            removed), or a pipelined model cannot be built. (A subclassed
            model built again into a graph of another structure is not an
            error: its set assignment is dropped, as `get_assignment` says.)
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
                f"The pipeline stage assignment of Sequential model {name_of(model)} is no "
                f"longer valid: layers were added or removed after it was set. Call "
                f"`set_pipeline_stage_assignment()` again (or "
                f"`reset_pipeline_stage_assignment()`)."
            )
        if getattr(model, "_functional", None) is None and inputs is not None:
            shape = tuple(keras.tree.flatten(inputs)[0].shape)
            model.build((None,) + shape[1:])
    try:
        graph = model_graph(model, kind, inputs)
    except TraceError as error:
        if state.level is None and not error.uses_pipeline_stages:
            return None  # not traceable, and nothing says it is pipelined
        raise
    if kind == MODEL:
        _follow_graph(model, state, graph)
    if graph is None:
        if state.level is None:
            return None
        raise RuntimeError(
            f"Model {name_of(model)} is pipelined but has no graph yet: build it first "
            f"(`model.build(input_shape)`) or call it on data."
        )
    if state.level is not None:
        level = structure(model, kind, graph, annotate=False)
        try:
            apply_assignment(level, to_assignments(state.level))
            expansion = check_assigned(level, runtime=True)
        except ValueError as error:
            raise RuntimeError(
                f'The pipeline stage assignments for model {name_of(model)} are no longer '
                f'valid: "{error}" This can happen if the model is invoked with shapes or '
                f"dtypes which are incompatible with those from the previous invocation, or "
                f"those passed to `model.build`. Set the assignment again with "
                f"`set_pipeline_stage_assignment()`."
            ) from error
    elif state.use_annotations and kind != SEQUENTIAL:
        level = structure(model, kind, graph, annotate=True)
        if not check_all_or_none(level):
            return None
        expansion = check_assigned(level, runtime=True)
    else:
        return None
    if not expansion[0]:
        return None  # no layer calls: nothing to pipeline
    return make_plan(model, level.graph, *expansion)


# --------------------------------------------------------------------------
# Saving and loading.


def _layer_index(model: Any, op: Any) -> int | None:
    return next((i for i, layer in enumerate(model.layers) if layer is op), None)


def _level_items(level: AssignmentTree) -> list:
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
    if state.level is not None and kind == MODEL:
        try:
            _follow_graph(model, state, model_graph(model, kind))
        except ValueError:
            pass  # not traceable as built now: saved as it was set
    level = state.level
    items: list = list(state.pending or [])
    if level is None and not items and state.use_annotations and kind != SEQUENTIAL:
        try:
            graph = model_graph(model, kind)
            candidate = None if graph is None else structure(model, kind, graph, True)
            level = candidate if candidate is not None and check_all_or_none(candidate) else None
        except ValueError:
            level = None  # not traceable, or scopes gave only some calls a stage
    if level is not None:
        items = _level_items(level)
    config: dict = {"pipeline_stage_assignment": items}
    if kind == SEQUENTIAL:
        config["pipeline_stage_assignment_valid"] = bool(items) and state.valid
    return config


def _fill_from_items(level: AssignmentTree, items: Any, model_name: str) -> None:
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
                    f"match its graph at layer call {name_of(entry.op)} (node index "
                    f"{entry.node_index}): saved {item!r}."
                )
        if entry.child is None:
            entry.stage = value
        elif isinstance(value, (list, tuple)):
            _fill_from_items(entry.child, value, name_of(entry.op))
        else:
            fill_stage(entry.child, value)


def _restore(model: Any, kind: str, items: list) -> None:
    level = structure(model, kind, model_graph(model, kind, action="set"), annotate=False)
    _fill_from_items(level, items, name_of(model))
    set_assignment(model, to_assignments(level))


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
            graph = traced_graph(model)
        except ValueError:
            graph = None  # traced again when the graph is needed
        if graph is None:
            _state(model).pending = list(items)
            return
    _restore(model, kind, list(items))


__all__ = [
    "AssignmentState",
    "assignment_from_config",
    "assignment_to_config",
    "get_assignment",
    "invalidate_sequential_assignment",
    "pipeline_plan",
    "reset_assignment",
    "set_assignment",
]
