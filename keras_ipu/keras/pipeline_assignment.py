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
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import numbers
from collections.abc import Callable
from typing import Any

import keras
from keras.src.models.functional import Functional
from keras.src.models.sequential import Sequential
from keras.src.ops.node import Node

from keras_ipu.keras import pipeline_stage as stage_lib
from keras_ipu.keras.pipeline_stage import (
    PipelinePlan,
    PipelineStage,
    StageCall,
    check_no_empty_stages,
)
from keras_ipu.keras.strategy import current_strategy

logger = logging.getLogger("keras_ipu")

SEQUENTIAL, FUNCTIONAL, MODEL = "sequential", "functional", "model"
DEFAULT_LINE_LENGTH = {SEQUENTIAL: 60, FUNCTIONAL: 89, MODEL: 89}
_COLUMNS = {
    SEQUENTIAL: (("Layer (type)", "Pipeline Stage"), (0.5, 1.0)),
    FUNCTIONAL: (("Layer (type) (node index)", "Input Layers", "Pipeline Stage"), (0.4, 0.8, 1.0)),
}
_STATE_ATTRIBUTE = "_ipu_pipeline_assignment"
_TRACE_ATTRIBUTE = "_ipu_traced_graph"
# Set by keras_ipu.keras.injection on models created in a strategy scope.
_STRATEGY_ATTRIBUTE = "_ipu_strategy"


# --------------------------------------------------------------------------
# The six assignment classes (public, as in `keras.ipu`).


def _name(obj: Any) -> str:
    return getattr(obj, "name", repr(obj))


def _inbound_operations(node: Node | None) -> list:
    if node is None:
        return []
    histories = (getattr(t, "_keras_history", None) for t in node.arguments.keras_tensors)
    return [h.operation for h in histories if h is not None and h.operation is not None]


def _indented(lines: str) -> str:
    return "".join(f"\n  {line}" for line in lines.splitlines())


class SequentialLayerPipelineStageAssignment:
    """The pipeline stage of one layer of a Sequential model.

    Args:
        layer: The Keras layer this assignment applies to.
        pipeline_stage: The stage the layer runs in; `None` leaves it
            unassigned.

    Example:

    >>> assignment = SequentialLayerPipelineStageAssignment(model.layers[0], 0)
    >>> assignment
    Layer: dense is assigned to pipeline stage: 0
    """

    is_nested_model = False

    def __init__(self, layer: Any, pipeline_stage: int | None = None):
        self._layer = layer
        self.pipeline_stage = pipeline_stage

    @property
    def layer(self) -> Any:
        """The Keras layer this assignment applies to."""
        return self._layer

    @property
    def pipeline_stage(self) -> int | None:
        """The stage the layer runs in (`None`: unassigned)."""
        return self._pipeline_stage

    @pipeline_stage.setter
    def pipeline_stage(self, value: int | None) -> None:
        self._pipeline_stage = value

    def __repr__(self) -> str:
        return f"Layer: {_name(self._layer)} is assigned to pipeline stage: {self.pipeline_stage}"


class ModelLayerPipelineStageAssignment:
    """The pipeline stage of one layer call in a subclassed model's traced graph.

    Args:
        layer: The Keras layer (or op) this assignment applies to.
        node_index: Which call of `layer` in the model's graph: 0 for its
            first call, 1 for its second, ...
        pipeline_stage: The stage the call runs in; `None` leaves it
            unassigned.

    Example:

    >>> assignments = model.get_pipeline_stage_assignment()
    >>> assignments[1]
    Layer: dense_1 (node index 0) is assigned to pipeline stage: None
    >>> assignments[1].pipeline_stage = 1
    """

    is_nested_model = False

    def __init__(self, layer: Any, node_index: int, pipeline_stage: int | None = None):
        self._layer = layer
        self._node_index = node_index
        self.pipeline_stage = pipeline_stage
        # The call in the model graph; attached to the assignments the model
        # returns, so `inbound_layers` does not depend on Keras' node numbering.
        self._node: Node | None = None

    @property
    def layer(self) -> Any:
        """The Keras layer this assignment applies to."""
        return self._layer

    @property
    def node_index(self) -> int:
        """Which call of the layer in the model's graph (0 for the first)."""
        return self._node_index

    @property
    def inbound_layers(self) -> list:
        """The layers whose outputs this call takes, one per input tensor.

        Useful to tell the calls of a shared layer apart.
        """
        node = self._node
        if node is None:
            nodes = getattr(self._layer, "_inbound_nodes", [])
            node = nodes[self._node_index] if 0 <= self._node_index < len(nodes) else None
        return _inbound_operations(node)

    @property
    def pipeline_stage(self) -> int | None:
        """The stage the call runs in (`None`: unassigned)."""
        return self._pipeline_stage

    @pipeline_stage.setter
    def pipeline_stage(self, value: int | None) -> None:
        self._pipeline_stage = value

    def __repr__(self) -> str:
        return (
            f"Layer: {_name(self._layer)} (node index {self._node_index}) is assigned to "
            f"pipeline stage: {self.pipeline_stage}"
        )


class FunctionalLayerPipelineStageAssignment(ModelLayerPipelineStageAssignment):
    """The pipeline stage of one layer call in a Functional model.

    A layer called several times (shared weights) has one assignment per
    call; the calls may run in different stages, which must then be mapped to
    the same IPU.

    Args:
        layer: The Keras layer (or op) this assignment applies to.
        node_index: Which call of `layer` in the model's graph: 0 for its
            first call, 1 for its second, ...
        pipeline_stage: The stage the call runs in; `None` leaves it
            unassigned.

    Example:

    >>> for assignment in model.get_pipeline_stage_assignment():
    ...     assignment.pipeline_stage = 0 if assignment.layer.name == "dense" else 1
    """


class _NestedAssignment:
    is_nested_model = True

    def __init__(self, nested_model: Any, pipeline_stage_assignments: list):
        self._nested_model = nested_model
        self._assignments = list(pipeline_stage_assignments)

    @property
    def nested_model(self) -> Any:
        """The nested Keras model this assignment applies to."""
        return self._nested_model

    @property
    def pipeline_stage_assignments(self) -> list:
        """The nested model's own assignments (a new list of the same objects)."""
        return list(self._assignments)


class NestedModelPipelineStageAssignment(_NestedAssignment):
    """The assignments of a nested model called in a subclassed model's graph.

    Args:
        nested_model: The nested Functional or Sequential model.
        node_index: Which call of the nested model in the graph (from 0).
        pipeline_stage_assignments: The nested model's own assignment list,
            one entry per layer (Sequential) or layer call (Functional).

    Example:

    >>> nested = model.get_pipeline_stage_assignment()[1]
    >>> for inner in nested.pipeline_stage_assignments:
    ...     inner.pipeline_stage = 1
    """

    def __init__(self, nested_model: Any, node_index: int, pipeline_stage_assignments: list):
        super().__init__(nested_model, pipeline_stage_assignments)
        self._node_index = node_index
        self._node: Node | None = None

    @property
    def node_index(self) -> int:
        """Which call of the nested model in the graph (0 for the first)."""
        return self._node_index

    @property
    def inbound_layers(self) -> list:
        """The layers whose outputs this call of the nested model takes."""
        node = self._node
        if node is None:
            nodes = getattr(self._nested_model, "_inbound_nodes", [])
            node = nodes[self._node_index] if 0 <= self._node_index < len(nodes) else None
        return _inbound_operations(node)

    def __repr__(self) -> str:
        head = (
            f"Model: {_name(self._nested_model)} (node index {self._node_index}) has the "
            f"following pipeline stage assignments:"
        )
        return head + "".join(_indented(repr(a)) for a in self._assignments)


class FunctionalNestedModelPipelineStageAssignment(NestedModelPipelineStageAssignment):
    """The assignments of a nested model called in a Functional model.

    Args:
        nested_model: The nested Functional or Sequential model.
        node_index: Which call of the nested model in the graph (from 0).
        pipeline_stage_assignments: The nested model's own assignment list.

    Example:

    >>> nested = model.get_pipeline_stage_assignment()[2]
    >>> nested.nested_model.name, nested.inbound_layers[0].name
    ('backbone', 'input_layer')
    """


class SequentialNestedModelPipelineStageAssignment(_NestedAssignment):
    """The assignments of a model nested in a Sequential model.

    Args:
        nested_model: The nested Functional or Sequential model.
        pipeline_stage_assignments: The nested model's own assignment list.

    Example:

    >>> nested = sequential.get_pipeline_stage_assignment()[0]
    >>> [a.pipeline_stage for a in nested.pipeline_stage_assignments]
    [None, None]
    """

    def __repr__(self) -> str:
        head = f"Model: {_name(self._nested_model)} has the following pipeline stage assignments:"
        return head + "".join(_indented(repr(a)) for a in self._assignments)


_LAYER_CLASS = {
    SEQUENTIAL: SequentialLayerPipelineStageAssignment,
    FUNCTIONAL: FunctionalLayerPipelineStageAssignment,
    MODEL: ModelLayerPipelineStageAssignment,
}
_NESTED_CLASS = {
    SEQUENTIAL: SequentialNestedModelPipelineStageAssignment,
    FUNCTIONAL: FunctionalNestedModelPipelineStageAssignment,
    MODEL: NestedModelPipelineStageAssignment,
}


# --------------------------------------------------------------------------
# Model graphs: kinds, post-order, tracing subclassed models.


@dataclasses.dataclass(frozen=True, eq=False)
class _Graph:
    """A model's graph: flat input/output KerasTensors and their structures."""

    inputs: tuple
    outputs: tuple
    inputs_struct: Any
    outputs_struct: Any


@dataclasses.dataclass(frozen=True, eq=False)
class _Trace:
    build_key: str
    graph: _Graph


def model_kind(model: Any) -> str:
    """The assignment kind of a model: `"sequential"`, `"functional"` or `"model"`.

    Args:
        model: A Keras model.

    Returns:
        `"sequential"` for `keras.Sequential`, `"functional"` for models
        built from inputs and outputs, `"model"` for subclassed models.

    Raises:
        TypeError: When `model` is not a Keras model.

    Example:

    >>> model_kind(keras.Sequential([keras.layers.Dense(1)]))
    'sequential'
    """
    if isinstance(model, Sequential):
        return SEQUENTIAL
    if isinstance(model, Functional):
        return FUNCTIONAL
    if isinstance(model, keras.Model):
        return MODEL
    raise TypeError(f"Expected a Keras model, got {model!r} of type {type(model).__name__}.")


def _nested_kind(operation: Any) -> str | None:
    # Subclassed models nested in a graph stay one opaque layer call.
    if isinstance(operation, Sequential):
        return SEQUENTIAL
    if isinstance(operation, Functional):
        return FUNCTIONAL
    return None


def _functional_graph(functional: Any) -> _Graph:
    return _Graph(
        tuple(functional.inputs), tuple(functional.outputs), functional.input, functional.output
    )


def _static_graph(model: Any, kind: str) -> _Graph | None:
    if kind == SEQUENTIAL:
        functional = getattr(model, "_functional", None)
        return None if functional is None else _functional_graph(functional)
    if kind == FUNCTIONAL:
        return _functional_graph(model)
    return None


def _post_order(graph: _Graph) -> list[Node]:
    """The graph's non-input nodes in execution order."""
    input_ids = {id(t) for t in graph.inputs}

    def producer(tensor: Any) -> Node | None:
        if id(tensor) in input_ids:
            return None
        history = getattr(tensor, "_keras_history", None)
        if history is None or history.operation is None:
            raise ValueError(f"Tensor {tensor} is not connected to the model inputs.")
        node = history.operation._inbound_nodes[history.node_index]
        if node.is_input:
            raise ValueError(
                f"Tensor {tensor} comes from input {history.operation.name}, which is not "
                f"one of the model inputs."
            )
        return node

    order: list[Node] = []
    done: set[int] = set()
    visiting: set[int] = set()
    parents: dict[int, list[Node]] = {}
    # Iterative depth-first walk (deep models exceed Python's recursion limit).
    for output in graph.outputs:
        root = producer(output)
        if root is None or id(root) in done:
            continue
        stack = [(root, iter(root.arguments.keras_tensors))]
        visiting.add(id(root))
        while stack:
            node, pending = stack[-1]
            for tensor in pending:
                parent = producer(tensor)
                if parent is None:
                    continue
                parents.setdefault(id(node), []).append(parent)
                if id(parent) in done:
                    continue
                if id(parent) in visiting:
                    raise ValueError(f"The layer call {parent} is part of a cycle.")
                visiting.add(id(parent))
                stack.append((parent, iter(parent.arguments.keras_tensors)))
                break
            else:
                stack.pop()
                visiting.discard(id(node))
                done.add(id(node))
                order.append(node)
    # Depth = longest path to an output; deeper calls run first.
    depth = {id(node): 0 for node in order}
    for node in reversed(order):
        for parent in parents.get(id(node), ()):
            depth[id(parent)] = max(depth[id(parent)], depth[id(node)] + 1)
    position = {id(node): i for i, node in enumerate(order)}
    return sorted(order, key=lambda node: (-depth[id(node)], position[id(node)]))


class _TraceError(ValueError):
    def __init__(self, model: Any, uses_pipeline_stages: bool, error: BaseException):
        self.uses_pipeline_stages = uses_pipeline_stages
        super().__init__(
            f"Could not trace the `call` function of model `{_name(model)}` into a graph of "
            f"layer calls, which pipeline stage assignments need: {error} Every tensor "
            f"operation in `call` must be a Keras layer or a `keras.ops` function. If your "
            f"layers do not support float inputs, pass `keras.Input` objects with the "
            f"required dtype to `model.build()`."
        )


def _requires_training(call: Callable) -> bool:
    try:
        parameter = inspect.signature(call).parameters.get("training")
    except (TypeError, ValueError):
        return False
    return parameter is not None and parameter.default is inspect.Parameter.empty


def _symbolic_inputs(specs: Any, default_dtype: str) -> Any:
    def from_spec(spec: Any) -> Any:
        # Specs describe data: the graph must not fix its batch size.
        shape = (None, *tuple(spec.shape)[1:]) if len(spec.shape) else ()
        dtype = keras.backend.standardize_dtype(getattr(spec, "dtype", default_dtype))
        return keras.Input(batch_shape=shape, dtype=dtype)

    flat = keras.tree.flatten(specs)
    if all(leaf is None or isinstance(leaf, numbers.Integral) for leaf in flat):
        # Plain shapes, as in a build config: tuples/lists of ints and None.
        return keras.tree.map_shape_structure(
            lambda shape: keras.Input(batch_shape=tuple(shape), dtype=default_dtype), specs
        )
    return keras.tree.map_structure(from_spec, specs)


def _build_specs(model: Any, config: dict) -> Any:
    if "input_shape" in config:
        return config["input_shape"]
    shapes = config.get("shapes_dict") or {}
    if len(shapes) == 1:
        return next(iter(shapes.values()))
    raise ValueError(
        f"Model `{_name(model)}` was built with several input arguments "
        f"({sorted(shapes)}); pipelining traces `call` with a single `inputs` argument "
        f"(use a list or dict of tensors)."
    )


def _trace(model: Any, specs: Any) -> _Graph:
    inputs = _symbolic_inputs(specs, model.input_dtype)
    kwargs = {"training": False} if _requires_training(model.call) else {}
    # PipelineStage scopes in `call` need an active strategy scope.
    strategy = vars(model).get(_STRATEGY_ATTRIBUTE)
    scope = (
        strategy.scope()
        if current_strategy() is None and strategy is not None
        else contextlib.nullcontext()
    )
    with scope, stage_lib.recording() as seen:
        try:
            outputs = model.call(inputs, **kwargs)
        except Exception as error:
            raise _TraceError(model, bool(seen), error) from error
    flat_outputs = keras.tree.flatten(outputs)
    if not flat_outputs or not all(
        isinstance(t, keras.KerasTensor) and hasattr(t, "_keras_history") for t in flat_outputs
    ):
        raise _TraceError(
            model, bool(seen), ValueError(f"`call` returned {outputs!r}, not Keras tensors.")
        )
    return _Graph(tuple(keras.tree.flatten(inputs)), tuple(flat_outputs), inputs, outputs)


def trace_model(model: Any, inputs: Any = None) -> None:
    """Traces a subclassed model's `call` into a graph of layer calls.

    The graph is kept on the model (not tracked by Keras) and reused until
    the model is built with other shapes. Get, set and `pipeline_plan` trace
    on demand; call this from `build` to trace eagerly.

    Args:
        model: A subclassed Keras model.
        inputs: A structure of data specs (anything with `shape` and
            `dtype`: `keras.Input`, arrays; the first dimension is the batch,
            left unknown in the graph), used when the model is not built;
            otherwise the shapes the model was built with (and the
            `keras.Input`s passed to `build`) are used.

    Raises:
        RuntimeError: When `inputs` is `None` and the model is not built.
        ValueError: When `call` cannot be traced symbolically.

    Example:

    >>> model.build((None, 32))
    >>> trace_model(model)
    """
    vars(model).pop(_TRACE_ATTRIBUTE, None)
    _traced_graph(model, inputs, action="get")


_NOT_BUILT = {
    "get": (
        "Cannot get pipeline stage assignments for model `{name}` which has not been built "
        "yet. Please call `model.build()` first."
    ),
    "set": (
        "Cannot set pipeline stage assignments for model `{name}` which has not been built "
        "yet. Please call `model.build()` first, or assign pipeline stages in your graph "
        "definition using PipelineStage scopes."
    ),
}


def _traced_graph(model: Any, inputs: Any = None, action: str | None = None) -> _Graph | None:
    config = model.get_build_config()
    key = repr(config)
    cached = vars(model).get(_TRACE_ATTRIBUTE)
    # Traced again only when the model was built with other shapes.
    if cached is not None and cached.build_key == key:
        return cached.graph
    if config is not None:
        specs = _build_specs(model, config)
    elif inputs is not None:
        specs = inputs
    elif action is not None:
        raise RuntimeError(_NOT_BUILT[action].format(name=_name(model)))
    else:
        return None
    graph = _trace(model, specs)
    vars(model)[_TRACE_ATTRIBUTE] = _Trace(key, graph)
    return graph


def _graph(model: Any, kind: str, inputs: Any = None, action: str | None = None) -> _Graph | None:
    if kind == MODEL:
        return _traced_graph(model, inputs, action)
    return _static_graph(model, kind)


# --------------------------------------------------------------------------
# The assignment tree of a model, with stages.


@dataclasses.dataclass(eq=False)
class _Entry:
    """One element of an assignment list: a layer call or a nested model call."""

    op: Any
    node: Node | None
    node_index: int | None
    stage: Any = None
    child: _Level | None = None

    def leaves(self) -> list[_Entry]:
        return self.child.leaves() if self.child is not None else [self]


@dataclasses.dataclass(eq=False)
class _Level:
    """The assignment list of one model (the root or a nested model)."""

    model: Any
    kind: str
    graph: _Graph | None
    entries: list[_Entry]

    def leaves(self) -> list[_Entry]:
        return [leaf for entry in self.entries for leaf in entry.leaves()]


def _annotated_stage(op: Any, node: Node | None, outer: int | None) -> int | None:
    # A nested model's call stage beats its inner annotations; a call's
    # stage beats the stage the layer was constructed with.
    if outer is not None:
        return outer
    stage = stage_lib.recorded_stage(node) if node is not None else None
    return stage if stage is not None else stage_lib.recorded_stage(op)


def _structure(
    model: Any, kind: str, graph: _Graph | None, annotate: bool, outer: int | None = None
) -> _Level:
    if kind == SEQUENTIAL:
        nodes = {id(n.operation): n for n in _post_order(graph)} if graph is not None else {}
        calls = [(layer, nodes.get(id(layer)), None) for layer in model.layers]
    else:
        order = _post_order(graph)
        in_graph = {id(n) for n in order}
        calls = []
        for node in order:
            own = [n for n in node.operation._inbound_nodes if id(n) in in_graph]
            calls.append((node.operation, node, next(i for i, n in enumerate(own) if n is node)))
    entries = []
    for op, node, node_index in calls:
        stage = _annotated_stage(op, node, outer) if annotate else None
        child_kind = _nested_kind(op)
        child = None
        if child_kind is not None:
            child = _structure(op, child_kind, _static_graph(op, child_kind), annotate, stage)
            stage = None
        entries.append(_Entry(op, node, node_index, stage, child))
    return _Level(model, kind, graph, entries)


def _to_assignments(level: _Level) -> list:
    result = []
    for entry in level.entries:
        if entry.child is not None:
            children = _to_assignments(entry.child)
            if level.kind == SEQUENTIAL:
                assignment = SequentialNestedModelPipelineStageAssignment(entry.op, children)
            else:
                assignment = _NESTED_CLASS[level.kind](entry.op, entry.node_index, children)
        elif level.kind == SEQUENTIAL:
            assignment = SequentialLayerPipelineStageAssignment(entry.op, entry.stage)
        else:
            assignment = _LAYER_CLASS[level.kind](entry.op, entry.node_index, entry.stage)
        if level.kind != SEQUENTIAL:
            assignment._node = entry.node
        result.append(assignment)
    return result


def _check_all_or_none(level: _Level) -> bool:
    """Whether PipelineStage scopes gave stages; raises when only some have one."""
    leaves = level.leaves()
    unassigned = [leaf for leaf in leaves if leaf.stage is None]
    if len(unassigned) == len(leaves):
        return False
    if unassigned:
        raise ValueError(
            f"All layers of a pipelined model must have an associated pipeline stage. "
            f"However, {_name(unassigned[0].op)} has not been assigned to one. Pipeline "
            f"stages can be assigned when a layer is constructed, or each time a layer is "
            f"called (within a `PipelineStage` scope). Different pipeline stages can be "
            f"assigned to each call."
        )
    return True


# --------------------------------------------------------------------------
# Validation of a user-provided assignment.


def _valid_stage(stage: Any) -> bool:
    return isinstance(stage, numbers.Integral) and not isinstance(stage, bool) and stage >= 0


def _bad_stage(what: str, stage: Any) -> ValueError:
    return ValueError(
        f"{what} has been assigned to pipeline stage {stage!r}, which is not a valid pipeline "
        f"stage: pipeline stages are non-negative integers."
    )


def _fill(level: _Level, stage: int) -> None:
    for leaf in level.leaves():
        leaf.stage = stage


def _apply(level: _Level, assignment: Any, nested_in: str | None = None) -> None:
    """Copies the stages of `assignment` into `level`, validating it against the graph."""
    if not isinstance(assignment, list):
        raise ValueError(
            f"`pipeline_stage_assignment` needs to be a list, but received "
            f"{type(assignment).__name__}."
        )
    if len(assignment) != len(level.entries):
        where = f" of nested model {nested_in}" if nested_in else ""
        raise ValueError(
            f"The length of the provided `pipeline_stage_assignment`{where} "
            f"({len(assignment)}) does not match the number of layers in the graph "
            f"({len(level.entries)}). Each layer needs to be assigned a pipeline stage "
            f"(excluding input layers)."
        )
    apply_item = _apply_sequential_item if level.kind == SEQUENTIAL else _apply_graph_item
    for index, (entry, item) in enumerate(zip(level.entries, assignment)):
        apply_item(level, index, entry, item)


def _apply_sequential_item(level: _Level, index: int, entry: _Entry, item: Any) -> None:
    layers = (SequentialLayerPipelineStageAssignment, SequentialNestedModelPipelineStageAssignment)
    if isinstance(item, layers):
        target = item.nested_model if item.is_nested_model else item.layer
        if target is not entry.op:
            raise ValueError(
                f"The provided assignment at index {index} of `pipeline_stage_assignment` is "
                f"for layer {_name(target)}, but the layer in the Sequential model "
                f"{_name(level.model)} at index {index} is {_name(entry.op)}."
            )
        if item.is_nested_model:
            if entry.child is None:
                raise ValueError(
                    f"Layer {_name(entry.op)} at index {index} is not a Functional or "
                    f"Sequential model: give it a `SequentialLayerPipelineStageAssignment` "
                    f"or an int, not a `SequentialNestedModelPipelineStageAssignment`."
                )
            _apply(entry.child, item.pipeline_stage_assignments, _name(entry.op))
            return
        stage = item.pipeline_stage
        if stage is None:
            raise ValueError(f"Layer {_name(entry.op)} has not been assigned a pipeline stage.")
    elif isinstance(item, numbers.Integral) and not isinstance(item, bool):
        stage = item
    else:
        raise ValueError(
            f"All elements of `pipeline_stage_assignment` must be integers, instances of "
            f"`SequentialLayerPipelineStageAssignment` for layers or "
            f"`SequentialNestedModelPipelineStageAssignment` for nested models. The element "
            f"at index {index} (for layer {_name(entry.op)}) is {item!r} of type "
            f"{type(item).__name__}."
        )
    if not _valid_stage(stage):
        raise _bad_stage(f"Layer {_name(entry.op)}", stage)
    # A stage given for a whole nested model applies to all of its calls.
    if entry.child is not None:
        _fill(entry.child, int(stage))
    else:
        entry.stage = int(stage)


def _apply_graph_item(level: _Level, index: int, entry: _Entry, item: Any) -> None:
    nested = entry.child is not None
    expected = (_NESTED_CLASS if nested else _LAYER_CLASS)[level.kind]
    what = f"nested model {_name(entry.op)}" if nested else f"layer {_name(entry.op)}"
    if not isinstance(item, expected):
        raise ValueError(
            f"The pipeline stage assignment for {what} in {_name(level.model)} must be an "
            f"instance of `{expected.__name__}`. Instead the assignment at index {index} was "
            f"of type {type(item).__name__}."
        )
    target = item.nested_model if nested else item.layer
    if target is not entry.op:
        raise ValueError(
            f"The order of `pipeline_stage_assignment` does not match the post-order "
            f"generated from the graph of {_name(level.model)} ({_name(target)} != "
            f"{_name(entry.op)} at index {index})."
        )
    if item.node_index != entry.node_index:
        calls = sum(1 for other in level.entries if other.op is entry.op)
        if not (isinstance(item.node_index, int) and 0 <= item.node_index < calls):
            raise ValueError(
                f"Layer {_name(entry.op)} has {calls} invocation(s) in the graph, but "
                f"`pipeline_stage_assignment` contains an assignment for node_index "
                f"{item.node_index!r}."
            )
        raise ValueError(
            f"The order of `pipeline_stage_assignment` does not match the post-order "
            f"generated from the graph (mismatched nodes of layer {_name(entry.op)}: the "
            f"assignment at index {index} is for node_index {item.node_index}, but the call "
            f"at that position has node_index {entry.node_index})."
        )
    if nested:
        _apply(entry.child, item.pipeline_stage_assignments, _name(entry.op))
        return
    stage = item.pipeline_stage
    if stage is None:
        raise ValueError(
            f"Layer {_name(entry.op)} with node_index {entry.node_index} has not been "
            f"assigned a pipeline stage in `pipeline_stage_assignment`."
        )
    if not _valid_stage(stage):
        raise _bad_stage(f"Layer {_name(entry.op)} with node_index {entry.node_index}", stage)
    entry.stage = int(stage)


def _check_sequential_order(level: _Level) -> None:
    previous = None
    for entry in level.entries:
        stages = [leaf.stage for leaf in entry.leaves()]
        first, last = min(stages), max(stages)
        if previous is None and first != 0:
            raise ValueError(
                f"The first layer in a pipelined Sequential model needs to be assigned to the "
                f"0th pipeline stage, however {_name(entry.op)} was assigned to {first}."
            )
        if previous is not None and first not in (previous, previous + 1):
            raise ValueError(
                f"Layer {_name(entry.op)} has been assigned to pipeline stage {first}, however "
                f"the previous layer in the Sequential model was assigned to pipeline stage "
                f"{previous}. A layer in a Sequential model can only be assigned to the same "
                f"pipeline stage as the previous layer or to the next pipeline stage."
            )
        previous = last


# --------------------------------------------------------------------------
# Expansion into leaf calls with tensor keys (dependencies, plans).


@dataclasses.dataclass(frozen=True, eq=False)
class _Leaf:
    entry: _Entry
    path: tuple[str, ...]
    input_keys: tuple[int, ...]
    output_keys: tuple[int, ...]


class _Keys:
    def __init__(self) -> None:
        self.tensors: dict[int, Any] = {}

    def new(self, tensor: Any) -> int:
        key = len(self.tensors)
        self.tensors[key] = tensor
        return key


def _nested_input_keys(entry: _Entry, env: dict[int, int]) -> list[int]:
    node = entry.node
    arguments = node.arguments
    first = arguments.args[0] if arguments.args else arguments.kwargs.get("inputs")
    flat = [t for t in keras.tree.flatten(first) if isinstance(t, keras.KerasTensor)]
    if len(flat) != len(arguments.keras_tensors):
        raise ValueError(
            f"Nested model {_name(entry.op)} is called with tensors outside its `inputs` "
            f"argument (for example a mask); pipelining runs nested models as their layer "
            f"calls and supports only their inputs."
        )
    wanted = len(entry.child.graph.inputs) if entry.child.graph is not None else len(flat)
    if len(flat) != wanted:
        raise ValueError(
            f"Nested model {_name(entry.op)} has {wanted} input(s) but is called with "
            f"{len(flat)} tensor(s)."
        )
    return [env[id(t)] for t in flat]


def _expand(
    level: _Level, input_keys: list[int], keys: _Keys, path: tuple, leaves: list[_Leaf]
) -> list[int]:
    """Appends `level`'s leaf calls to `leaves`; returns the keys of its outputs."""
    if level.graph is None:  # a Sequential model that is not built: a chain
        current = list(input_keys)
        for entry in level.entries:
            if entry.child is not None:
                wanted = len(entry.child.graph.inputs) if entry.child.graph else len(current)
                bound = current if len(current) == wanted else [current[0]] * wanted
                current = _expand(entry.child, bound, keys, path + (_name(entry.op),), leaves)
            else:
                output = keys.new(None)
                leaves.append(_Leaf(entry, path, tuple(current), (output,)))
                current = [output]
        return current
    env = {id(t): key for t, key in zip(level.graph.inputs, input_keys)}
    for entry in level.entries:
        node = entry.node
        if entry.child is not None:
            inner = _nested_input_keys(entry, env)
            outputs = _expand(entry.child, inner, keys, path + (_name(entry.op),), leaves)
            if len(outputs) != len(node.outputs):
                raise ValueError(
                    f"Nested model {_name(entry.op)} returns {len(outputs)} tensor(s) but its "
                    f"call recorded {len(node.outputs)}."
                )
            env.update({id(t): key for t, key in zip(node.outputs, outputs)})
        else:
            inputs = tuple(env[id(t)] for t in node.arguments.keras_tensors)
            outputs = tuple(keys.new(t) for t in node.outputs)
            env.update({id(t): key for t, key in zip(node.outputs, outputs)})
            leaves.append(_Leaf(entry, path, inputs, outputs))
    return [env[id(t)] for t in level.graph.outputs]


def _expand_root(level: _Level) -> tuple[list[_Leaf], list[int], list[int], _Keys]:
    keys = _Keys()
    inputs = level.graph.inputs if level.graph is not None else (None,)
    input_keys = [keys.new(t) for t in inputs]
    leaves: list[_Leaf] = []
    output_keys = _expand(level, input_keys, keys, (), leaves)
    return leaves, input_keys, output_keys, keys


def _check_dependencies(leaves: list[_Leaf]) -> None:
    producer: dict[int, _Leaf] = {}
    for leaf in leaves:
        stage = leaf.entry.stage
        for key in leaf.input_keys:
            source = producer.get(key)
            if source is not None and source.entry.stage > stage:
                raise ValueError(
                    f"Layer {_name(leaf.entry.op)} in pipeline stage {stage} has a dependency "
                    f"from a pipeline stage which has not yet been executed: it uses the "
                    f"output of layer {_name(source.entry.op)} in pipeline stage "
                    f"{source.entry.stage}. Layers can only use outputs from current or "
                    f"previous pipeline stages."
                )
        for key in leaf.output_keys:
            producer[key] = leaf


def _check_assigned(
    level: _Level, runtime: bool = False
) -> tuple[list[_Leaf], list[int], list[int], _Keys]:
    """The rules every complete assignment must satisfy; returns its expansion."""
    if level.kind == SEQUENTIAL:
        _check_sequential_order(level)
    expansion = _expand_root(level)
    _check_dependencies(expansion[0])
    check_no_empty_stages(
        (leaf.entry.stage for leaf in expansion[0]), RuntimeError if runtime else ValueError
    )
    return expansion


# --------------------------------------------------------------------------
# Stored state and the public functions.


@dataclasses.dataclass(eq=False)
class _PipelineState:
    level: _Level | None = None  # the validated assignment
    valid: bool = False  # Sequential: False after add()/pop()
    use_annotations: bool = True  # False after reset: PipelineStage scopes are ignored
    pending: list | None = None  # a saved assignment waiting for the model's graph


def _state(model: Any) -> _PipelineState:
    # Plain dict write: Keras must not track this attribute.
    return vars(model).setdefault(_STATE_ATTRIBUTE, _PipelineState())


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
    state = vars(model).get(_STATE_ATTRIBUTE)
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


def _make_plan(
    model: Any,
    graph: _Graph,
    leaves: list[_Leaf],
    input_keys: list[int],
    output_keys: list[int],
    keys: _Keys,
) -> PipelinePlan:
    num_stages = max(leaf.entry.stage for leaf in leaves) + 1
    stages: list[list[StageCall]] = [[] for _ in range(num_stages)]
    produced_in: dict[int, int] = {}
    last_use: dict[int, int] = {key: num_stages for key in output_keys}
    for leaf in leaves:
        stage = leaf.entry.stage
        stages[stage].append(
            StageCall(leaf.entry.node, stage, leaf.input_keys, leaf.output_keys, leaf.path)
        )
        for key in leaf.input_keys:
            last_use[key] = max(last_use.get(key, -1), stage)
        produced_in.update({key: stage for key in leaf.output_keys})
    stage_inputs = [
        sorted({k for c in calls for k in c.input_keys if produced_in.get(k) != s})
        for s, calls in enumerate(stages)
    ]
    stage_outputs = [
        sorted(k for k, p in produced_in.items() if p == s and last_use.get(k, -1) > s)
        for s in range(num_stages)
    ]
    live_after = [
        sorted(k for k, p in produced_in.items() if p <= s < last_use.get(k, -1))
        for s in range(num_stages)
    ]
    return PipelinePlan(
        model_name=_name(model),
        num_stages=num_stages,
        stages=tuple(tuple(calls) for calls in stages),
        input_keys=tuple(input_keys),
        output_keys=tuple(output_keys),
        inputs=graph.inputs,
        outputs=graph.outputs,
        inputs_struct=graph.inputs_struct,
        outputs_struct=graph.outputs_struct,
        tensors=dict(keys.tensors),
        stage_inputs=tuple(map(tuple, stage_inputs)),
        stage_outputs=tuple(map(tuple, stage_outputs)),
        live_after=tuple(map(tuple, live_after)),
    )


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
