"""The assignment tree of a model: its structure, validation and expansion.

A `AssignmentTree` is one model's assignment list (the root or a nested model), with
one `Entry` per layer call; it is built from the graph (with the stages of
PipelineStage scopes, or none), filled from a user-provided assignment (which
is validated against the graph), turned back into assignment objects, and
expanded into leaf calls with tensor keys to check the pipelining rules.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Iterable
from typing import Any

import keras
from keras.src.backend.common import masking
from keras.src.ops.node import Node

from keras_ipu.keras.stages import scope
from keras_ipu.keras.stages.assignments import (
    FunctionalLayerPipelineStageAssignment,
    FunctionalNestedModelPipelineStageAssignment,
    ModelLayerPipelineStageAssignment,
    NestedModelPipelineStageAssignment,
    SequentialLayerPipelineStageAssignment,
    SequentialNestedModelPipelineStageAssignment,
    name_of,
)
from keras_ipu.keras.stages.graph import (
    FUNCTIONAL,
    MODEL,
    SEQUENTIAL,
    Graph,
    nested_kind,
    post_order,
    static_graph,
)

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
# The assignment tree of a model, with stages.


@dataclasses.dataclass(eq=False)
class Entry:
    """One element of an assignment list: a layer call or a nested model call.

    Args:
        op: The called layer, op or nested model.
        node: The call's Keras `Node` (`None` for an unbuilt Sequential layer).
        node_index: The call's index among the layer's calls in the graph
            (`None` for Sequential models).
        stage: The assigned stage (`None`: unassigned, or a nested model).
        child: The nested model's own assignment tree, if `op` is one.

    Example:

    >>> [entry.stage for entry in tree.entries]
    [0, 0, 1]
    """

    op: Any
    node: Node | None
    node_index: int | None
    stage: Any = None
    child: AssignmentTree | None = None

    def leaves(self) -> list[Entry]:
        """The layer-call entries under this one (itself, unless a nested model)."""
        return self.child.leaves() if self.child is not None else [self]


@dataclasses.dataclass(eq=False)
class AssignmentTree:
    """The assignment list of one model (the root or a nested model), with stages.

    Args:
        model: The model.
        kind: Its `graph.model_kind`.
        graph: Its graph (`None` for an unbuilt Sequential model).
        entries: One `Entry` per layer (Sequential) or layer call.

    Example:

    >>> tree = structure(model, SEQUENTIAL, graph, annotate=False)
    >>> len(tree.leaves())
    4
    """

    model: Any
    kind: str
    graph: Graph | None
    entries: list[Entry]

    def leaves(self) -> list[Entry]:
        """Every layer-call entry, nested models expanded, in order."""
        return [leaf for entry in self.entries for leaf in entry.leaves()]


def _annotated_stage(op: Any, node: Node | None, outer: int | None) -> int | None:
    # A nested model's call stage beats its inner annotations; a call's
    # stage beats the stage the layer was constructed with.
    if outer is not None:
        return outer
    stage = scope.recorded_stage(node) if node is not None else None
    return stage if stage is not None else scope.recorded_stage(op)


def structure(
    model: Any, kind: str, graph: Graph | None, annotate: bool, outer: int | None = None
) -> AssignmentTree:
    """The assignment tree of a model's graph.

    Args:
        model: The model.
        kind: Its `graph.model_kind`.
        graph: Its graph.
        annotate: Whether entries take the stages of `PipelineStage` scopes.
        outer: The stage of the scope a nested model was called in.

    Returns:
        The tree (stages unset unless `annotate`).

    Example:

    >>> structure(model, FUNCTIONAL, graph, annotate=True).leaves()[0].stage
    0
    """
    if kind == SEQUENTIAL:
        nodes = {id(n.operation): n for n in post_order(graph)} if graph is not None else {}
        calls = [(layer, nodes.get(id(layer)), None) for layer in model.layers]
    else:
        order = post_order(graph)
        in_graph = {id(n) for n in order}
        calls = []
        for node in order:
            own = [n for n in node.operation._inbound_nodes if id(n) in in_graph]
            calls.append((node.operation, node, next(i for i, n in enumerate(own) if n is node)))
    entries = []
    for op, node, node_index in calls:
        stage = _annotated_stage(op, node, outer) if annotate else None
        child_kind = nested_kind(op)
        child = None
        if child_kind is not None:
            child = structure(op, child_kind, static_graph(op, child_kind), annotate, stage)
            stage = None
        entries.append(Entry(op, node, node_index, stage, child))
    if annotate and kind != SEQUENTIAL:
        _stage_mask_ops(entries)
    return AssignmentTree(model, kind, graph, entries)


def _stage_mask_ops(entries: list[Entry]) -> None:
    """Gives Keras' own mask ops the stage of the layer whose output carries their mask.

    Keras makes them inside a layer's call (`Embedding(mask_zero=True)`'s
    `not_equal`, a merge's `logical_or`): a layer given its stage where it was
    constructed is called outside any scope, and so are they, but they are
    part of that layer's work. (Sequential models place them in
    `_graph_entries`.)
    """
    owner, consumers = {}, {}
    for entry in entries:
        for tensor in entry.node.outputs if entry.node is not None else ():
            mask = masking.get_keras_mask(tensor)
            if mask is not None:
                owner[id(mask)] = entry
        for tensor in entry.node.arguments.keras_tensors if entry.node is not None else ():
            consumers.setdefault(id(tensor), []).append(entry)
    mask_ops: set[int] = set()
    # Consumers first: `Masking`'s `not_equal` feeds the `any` that makes its mask.
    for entry in reversed(entries):
        outputs = entry.node.outputs if entry.node is not None else ()
        if entry.stage is not None or entry.child is not None or not outputs:
            continue
        if all(id(t) in owner for t in outputs):
            entry.stage = owner[id(outputs[0])].stage
        else:
            users = [user for t in outputs for user in consumers.get(id(t), [])]
            if not users or any(id(user) not in mask_ops for user in users):
                continue
            entry.stage = users[0].stage
        mask_ops.add(id(entry))


def to_assignments(level: AssignmentTree) -> list:
    """The tree as new public assignment objects (what `get_pipeline_stage_assignment` gives).

    Example:

    >>> [a.pipeline_stage for a in to_assignments(tree)]
    [0, 0, 1, 1]
    """
    result = []
    for entry in level.entries:
        if entry.child is not None:
            children = to_assignments(entry.child)
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


def graph_signature(level: AssignmentTree) -> tuple:
    """The structure of a tree's graph: what a stored assignment was made for.

    The structure is the post-order list of layer calls that an assignment
    has one entry for, each with what identifies the call and its data flow:
    the called layer (the layer itself, which a trace calls again; a
    `keras.ops` call by its type, as every trace makes a new operation),
    its `node_index`, where each of its input tensors comes from (a model
    input by position, or an earlier call by position and output index) and
    a nested model's own structure; then where the model's outputs come
    from. Shapes, dtypes and non-tensor arguments are not part of it: a
    subclassed model built again with another batch size, or with shapes
    that make `call` run the same layer calls, has the same structure, and
    its assignment carries over call by call.

    Args:
        level: An assignment tree (stages are ignored).

    Returns:
        A tuple of plain values (ints, strings, layer ids): two trees have
        the same structure when their signatures are equal (compare while
        both trees are alive, so that layer ids stay unique).

    Example:

    >>> graph_signature(structure(model, MODEL, graph_a, False)) == graph_signature(
    ...     structure(model, MODEL, graph_b, False))
    True
    """
    graph = level.graph
    inputs = {id(t): i for i, t in enumerate(graph.inputs)} if graph is not None else {}
    positions = {id(e.node): i for i, e in enumerate(level.entries) if e.node is not None}

    def source(tensor: Any) -> tuple:
        if id(tensor) in inputs:
            return ("input", inputs[id(tensor)])
        history = tensor._keras_history
        node = history.operation._inbound_nodes[history.node_index]
        return (positions.get(id(node), -1), history.tensor_index)

    calls = []
    for entry in level.entries:
        op = entry.op
        key = ("layer", id(op)) if isinstance(op, keras.layers.Layer) else (
            "op", type(op).__qualname__)
        tensors = entry.node.arguments.keras_tensors if entry.node is not None else ()
        child = graph_signature(entry.child) if entry.child is not None else None
        calls.append((key, entry.node_index, tuple(source(t) for t in tensors), child))
    outputs = tuple(source(t) for t in graph.outputs) if graph is not None else ()
    return (len(inputs), tuple(calls), outputs)


def check_all_or_none(level: AssignmentTree) -> bool:
    """Whether PipelineStage scopes gave stages; raises when only some have one."""
    leaves = level.leaves()
    unassigned = [leaf for leaf in leaves if leaf.stage is None]
    if len(unassigned) == len(leaves):
        return False
    if unassigned:
        raise ValueError(
            f"All layers of a pipelined model must have an associated pipeline stage. "
            f"However, {name_of(unassigned[0].op)} has not been assigned to one. Pipeline "
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


def fill_stage(level: AssignmentTree, stage: int) -> None:
    """Gives every layer call of the tree the same stage.

    Example:

    >>> fill_stage(nested_tree, 1)
    """
    for leaf in level.leaves():
        leaf.stage = stage


def apply_assignment(level: AssignmentTree, assignment: Any, nested_in: str | None = None) -> None:
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


def _apply_sequential_item(level: AssignmentTree, index: int, entry: Entry, item: Any) -> None:
    layers = (SequentialLayerPipelineStageAssignment, SequentialNestedModelPipelineStageAssignment)
    if isinstance(item, layers):
        target = item.nested_model if item.is_nested_model else item.layer
        if target is not entry.op:
            raise ValueError(
                f"The provided assignment at index {index} of `pipeline_stage_assignment` is "
                f"for layer {name_of(target)}, but the layer in the Sequential model "
                f"{name_of(level.model)} at index {index} is {name_of(entry.op)}."
            )
        if item.is_nested_model:
            if entry.child is None:
                raise ValueError(
                    f"Layer {name_of(entry.op)} at index {index} is not a Functional or "
                    f"Sequential model: give it a `SequentialLayerPipelineStageAssignment` "
                    f"or an int, not a `SequentialNestedModelPipelineStageAssignment`."
                )
            apply_assignment(entry.child, item.pipeline_stage_assignments, name_of(entry.op))
            return
        stage = item.pipeline_stage
        if stage is None:
            raise ValueError(f"Layer {name_of(entry.op)} has not been assigned a pipeline stage.")
    elif isinstance(item, numbers.Integral) and not isinstance(item, bool):
        stage = item
    else:
        raise ValueError(
            f"All elements of `pipeline_stage_assignment` must be integers, instances of "
            f"`SequentialLayerPipelineStageAssignment` for layers or "
            f"`SequentialNestedModelPipelineStageAssignment` for nested models. The element "
            f"at index {index} (for layer {name_of(entry.op)}) is {item!r} of type "
            f"{type(item).__name__}."
        )
    if not _valid_stage(stage):
        raise _bad_stage(f"Layer {name_of(entry.op)}", stage)
    # A stage given for a whole nested model applies to all of its calls.
    if entry.child is not None:
        fill_stage(entry.child, int(stage))
    else:
        entry.stage = int(stage)


def _apply_graph_item(level: AssignmentTree, index: int, entry: Entry, item: Any) -> None:
    nested = entry.child is not None
    expected = (_NESTED_CLASS if nested else _LAYER_CLASS)[level.kind]
    what = f"nested model {name_of(entry.op)}" if nested else f"layer {name_of(entry.op)}"
    if not isinstance(item, expected):
        raise ValueError(
            f"The pipeline stage assignment for {what} in {name_of(level.model)} must be an "
            f"instance of `{expected.__name__}`. Instead the assignment at index {index} was "
            f"of type {type(item).__name__}."
        )
    target = item.nested_model if nested else item.layer
    if target is not entry.op:
        raise ValueError(
            f"The order of `pipeline_stage_assignment` does not match the post-order "
            f"generated from the graph of {name_of(level.model)} ({name_of(target)} != "
            f"{name_of(entry.op)} at index {index})."
        )
    if item.node_index != entry.node_index:
        calls = sum(1 for other in level.entries if other.op is entry.op)
        if not (isinstance(item.node_index, int) and 0 <= item.node_index < calls):
            raise ValueError(
                f"Layer {name_of(entry.op)} has {calls} invocation(s) in the graph, but "
                f"`pipeline_stage_assignment` contains an assignment for node_index "
                f"{item.node_index!r}."
            )
        raise ValueError(
            f"The order of `pipeline_stage_assignment` does not match the post-order "
            f"generated from the graph (mismatched nodes of layer {name_of(entry.op)}: the "
            f"assignment at index {index} is for node_index {item.node_index}, but the call "
            f"at that position has node_index {entry.node_index})."
        )
    if nested:
        apply_assignment(entry.child, item.pipeline_stage_assignments, name_of(entry.op))
        return
    stage = item.pipeline_stage
    if stage is None:
        raise ValueError(
            f"Layer {name_of(entry.op)} with node_index {entry.node_index} has not been "
            f"assigned a pipeline stage in `pipeline_stage_assignment`."
        )
    if not _valid_stage(stage):
        raise _bad_stage(f"Layer {name_of(entry.op)} with node_index {entry.node_index}", stage)
    entry.stage = int(stage)


def _check_sequential_order(level: AssignmentTree) -> None:
    previous = None
    for entry in level.entries:
        stages = [leaf.stage for leaf in entry.leaves()]
        first, last = min(stages), max(stages)
        if previous is None and first != 0:
            raise ValueError(
                f"The first layer in a pipelined Sequential model needs to be assigned to the "
                f"0th pipeline stage, however {name_of(entry.op)} was assigned to {first}."
            )
        if previous is not None and first not in (previous, previous + 1):
            raise ValueError(
                f"Layer {name_of(entry.op)} has been assigned to pipeline stage {first}, however "
                f"the previous layer in the Sequential model was assigned to pipeline stage "
                f"{previous}. A layer in a Sequential model can only be assigned to the same "
                f"pipeline stage as the previous layer or to the next pipeline stage."
            )
        previous = last


# --------------------------------------------------------------------------
# Expansion into leaf calls with tensor keys (dependencies, plans).


# A call that takes the run's `training` (`Leaf.training`, `StageCall.training`).
FOLLOWS_RUN = "follows the run"


@dataclasses.dataclass(frozen=True, eq=False)
class Leaf:
    """One layer call of the expanded model, with the keys of its tensors.

    Args:
        entry: The call's entry.
        path: Names of the nested models it is inside, outermost first.
        input_keys: Keys of its input tensors.
        output_keys: Keys of its outputs.
        training: The `training` the call keeps whatever the run's
            (`FOLLOWS_RUN`: it takes the run's).

    Example:

    >>> leaves[0].input_keys, leaves[0].output_keys
    ((0,), (1,))
    """

    entry: Entry
    path: tuple[str, ...]
    input_keys: tuple[int, ...]
    output_keys: tuple[int, ...]
    training: Any = FOLLOWS_RUN


class TensorKeys:
    """Integer keys for the tensors of the expanded model graph.

    Example:

    >>> keys = TensorKeys()
    >>> keys.new(keras.Input((4,)))
    0
    """

    def __init__(self) -> None:
        self.tensors: dict[int, Any] = {}

    def new(self, tensor: Any) -> int:
        """A new key for `tensor`."""
        key = len(self.tensors)
        self.tensors[key] = tensor
        return key


def _nested_input_keys(entry: Entry, env: dict[int, int]) -> list[int]:
    node = entry.node
    arguments = node.arguments
    first = arguments.args[0] if arguments.args else arguments.kwargs.get("inputs")
    graph = entry.child.graph
    if (isinstance(first, dict) and graph is not None and not isinstance(graph.inputs_struct, dict)
            and {t.name for t in graph.inputs} <= set(first)):
        # As Keras' Functional binds a dict to a list of named inputs: by name.
        first = [first[t.name] for t in graph.inputs]
    flat = [t for t in keras.tree.flatten(first) if isinstance(t, keras.KerasTensor)]
    if len(flat) != len(arguments.keras_tensors):
        raise ValueError(
            f"Nested model {name_of(entry.op)} is called with tensors outside its `inputs` "
            f"argument (for example a mask); pipelining runs nested models as their layer "
            f"calls and supports only their inputs."
        )
    wanted = len(graph.inputs) if graph is not None else len(flat)
    if len(flat) != wanted:
        raise ValueError(
            f"Nested model {name_of(entry.op)} has {wanted} input(s) but is called with "
            f"{len(flat)} tensor(s)."
        )
    return [env[id(t)] for t in flat]


def _expand(
    level: AssignmentTree, input_keys: list[int], keys: TensorKeys, path: tuple,
    leaves: list[Leaf], training: Any = FOLLOWS_RUN,
) -> list[int]:
    """Appends `level`'s leaf calls to `leaves`; returns the keys of its outputs.

    `training` is what a nested model's call was given, when it keeps it: its
    calls keep it too.
    """
    if level.graph is None:  # a Sequential model that is not built: a chain
        current = list(input_keys)
        for entry in level.entries:
            if entry.child is not None:
                wanted = len(entry.child.graph.inputs) if entry.child.graph else len(current)
                bound = current if len(current) == wanted else [current[0]] * wanted
                current = _expand(entry.child, bound, keys, path + (name_of(entry.op),), leaves,
                                  training)
            else:
                output = keys.new(None)
                leaves.append(Leaf(entry, path, tuple(current), (output,), training))
                current = [output]
        return current
    env = {id(t): key for t, key in zip(level.graph.inputs, input_keys)}
    fixed = level.graph.fixed_training
    for entry in _graph_entries(level):
        node = entry.node
        kept = fixed.get(id(node), FOLLOWS_RUN) if training == FOLLOWS_RUN else training
        if entry.child is not None:
            inner = _nested_input_keys(entry, env)
            outputs = _expand(entry.child, inner, keys, path + (name_of(entry.op),), leaves,
                              kept)
            if len(outputs) != len(node.outputs):
                raise ValueError(
                    f"Nested model {name_of(entry.op)} returns {len(outputs)} tensor(s) but its "
                    f"call recorded {len(node.outputs)}."
                )
            env.update({id(t): key for t, key in zip(node.outputs, outputs)})
        else:
            inputs = tuple(env[id(t)] for t in node.arguments.keras_tensors)
            outputs = tuple(keys.new(t) for t in node.outputs)
            env.update({id(t): key for t, key in zip(node.outputs, outputs)})
            leaves.append(Leaf(entry, path, inputs, outputs, kept))
    return [env[id(t)] for t in level.graph.outputs]


def _graph_entries(level: AssignmentTree) -> list[Entry]:
    """The level's entries, with a built Sequential model's implicit ops in their place.

    A Sequential model's assignment lists its layers, but its graph also holds
    the ops Keras adds between them (a mask: `Embedding(mask_zero=True)`'s
    `not_equal`, which the next layer takes as its `mask`). Each runs in the
    stage of the first layer that uses what it makes.
    """
    if level.kind != SEQUENTIAL or level.graph is None:
        return level.entries
    by_node = {id(entry.node): entry for entry in level.entries if entry.node is not None}
    order = post_order(level.graph)
    implicit = [node for node in order if id(node) not in by_node]
    if not implicit:
        return level.entries
    in_graph = {id(n) for n in order}
    for node in reversed(order):  # consumers come later: their stages are known first
        if id(node) in by_node:
            continue
        made = {id(t) for t in node.outputs}
        stages = [by_node[id(n)].stage for n in order if id(n) in by_node
                  and by_node[id(n)].stage is not None
                  and made & {id(t) for t in n.arguments.keras_tensors}]
        own = [n for n in node.operation._inbound_nodes if id(n) in in_graph]
        by_node[id(node)] = Entry(node.operation, node, own.index(node),
                                  min(stages, default=level.entries[-1].stage))
    return [by_node[id(node)] for node in order]


def _expand_root(level: AssignmentTree) -> tuple[list[Leaf], list[int], list[int], TensorKeys]:
    keys = TensorKeys()
    inputs = level.graph.inputs if level.graph is not None else (None,)
    input_keys = [keys.new(t) for t in inputs]
    leaves: list[Leaf] = []
    output_keys = _expand(level, input_keys, keys, (), leaves)
    return leaves, input_keys, output_keys, keys


def _check_dependencies(leaves: list[Leaf]) -> None:
    producer: dict[int, Leaf] = {}
    for leaf in leaves:
        stage = leaf.entry.stage
        for key in leaf.input_keys:
            source = producer.get(key)
            if source is not None and source.entry.stage > stage:
                raise ValueError(
                    f"Layer {name_of(leaf.entry.op)} in pipeline stage {stage} has a dependency "
                    f"from a pipeline stage which has not yet been executed: it uses the "
                    f"output of layer {name_of(source.entry.op)} in pipeline stage "
                    f"{source.entry.stage}. Layers can only use outputs from current or "
                    f"previous pipeline stages."
                )
        for key in leaf.output_keys:
            producer[key] = leaf


def check_dependencies(level: AssignmentTree) -> None:
    """Raises `ValueError` when a call of `level` (all assigned) uses a later stage's output.

    Example:

    >>> check_dependencies(tree)   # PipelineStage scopes, as the model is constructed
    """
    _check_dependencies(_expand_root(level)[0])


def check_assigned(
    level: AssignmentTree, runtime: bool = False
) -> tuple[list[Leaf], list[int], list[int], TensorKeys]:
    """Checks the rules every complete assignment must satisfy.

    Args:
        level: A tree with every layer call assigned.
        runtime: Raise `RuntimeError` instead of `ValueError` for empty
            stages (the model is running, not being assigned).

    Returns:
        The expansion `(leaves, input keys, output keys, keys)` that
        `plan.make_plan` takes.

    Raises:
        ValueError: For a Sequential order, dependency or empty-stage violation.
        RuntimeError: For empty stages when `runtime`.

    Example:

    >>> plan.make_plan(model, tree.graph, *check_assigned(tree, runtime=True))
    """
    if level.kind == SEQUENTIAL:
        _check_sequential_order(level)
    expansion = _expand_root(level)
    _check_dependencies(expansion[0])
    check_no_empty_stages(
        (leaf.entry.stage for leaf in expansion[0]), RuntimeError if runtime else ValueError
    )
    return expansion


def check_no_empty_stages(
    stages: Iterable[int], error: type[Exception] = ValueError
) -> None:
    """Raises when a stage below the highest used stage has no layer call.

    Args:
        stages: The stage of every layer call.
        error: The exception type to raise (`ValueError` when an assignment
            is set, `RuntimeError` when a model runs).

    Raises:
        error: Naming the highest stage and the empty ones.

    Example:

    >>> check_no_empty_stages([0, 0, 1])
    >>> check_no_empty_stages([0, 2])
    Traceback (most recent call last):
    ValueError: All stages in a pipeline must have at least one layer assigned ...
    """
    used = set(stages)
    if not used:
        return
    highest = max(used)
    missing = [s for s in range(highest) if s not in used]
    if missing:
        raise error(
            f"All stages in a pipeline must have at least one layer assigned to them. "
            f"The highest stage with an assignment is stage {highest}, however the "
            f"preceding stages {missing} have no assignments. Renumber the stages so "
            f"that they run from 0 to {len(used) - 1} without gaps."
        )
