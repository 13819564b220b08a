"""What a pipelined model runs: its layer calls split into stages, and how one call runs.

`PipelinePlan` is what a pipelined executor reads: the layer calls (Keras
`Node`s) of each stage in execution order, with the tensors flowing between
stages named by integer keys. `make_plan` builds it from a checked
assignment tree (`stages.tree`); `call_arguments` is the one rule for the
arguments a stage passes to a layer call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from keras import tree as keras_tree
from keras.src.models.functional import Functional
from keras.src.ops.node import Node
from keras.src.ops.operation import Operation

from keras_ipu.keras.stages import assignments, graph, tree

TensorKey = int  # names one tensor of the (nested-model-expanded) model graph


@dataclasses.dataclass(frozen=True, eq=False)
class StageCall:
    """One layer (or op) call that a pipeline stage executes.

    Args:
        node: The Keras `Node` of the call: `node.operation` is the layer,
            `node.arguments` its recorded arguments.
        stage: The pipeline stage that runs the call.
        input_keys: Keys of the call's input tensors, one per entry of
            `node.arguments.keras_tensors` (same order).
        output_keys: Keys of the call's outputs, one per `node.outputs`.
        training: The `training` the call keeps whatever the run's (a
            subclassed model's `self.backbone(x, training=False)`), or
            `tree.FOLLOWS_RUN`.
        path: Names of the nested models the call is inside, outermost
            first (`()` for a call of the model itself).

    Example:

    >>> call = plan.stages[0][0]
    >>> call.operation.name, call.input_keys, call.output_keys
    ('dense', (0,), (1,))
    """

    node: Node
    stage: int
    input_keys: tuple[TensorKey, ...]
    output_keys: tuple[TensorKey, ...]
    path: tuple[str, ...] = ()
    training: Any = tree.FOLLOWS_RUN

    @property
    def operation(self) -> Operation:
        """The called layer or op."""
        return self.node.operation


@dataclasses.dataclass(frozen=True, eq=False)
class PipelinePlan:
    """What a pipelined model runs: its layer calls split into stages.

    Tensors are named by integer keys: a key names one tensor of the model
    graph in which nested models have been replaced by their own layer calls
    (a nested model called twice gives two sets of keys).

    Args:
        model_name: The model's name.
        num_stages: The number of stages, `max stage + 1` (every stage below
            it has at least one call).
        stages: For each stage, its calls in execution order.
        input_keys: Keys of the model inputs, in the order of `inputs`.
        output_keys: Keys of the model outputs, in the order of `outputs`.
        inputs: The model's flat input `KerasTensor`s (`keras.tree.flatten`
            order of `inputs_struct`).
        outputs: The model's flat output `KerasTensor`s.
        inputs_struct: The nested structure of the inputs (data given to
            the model has this structure).
        outputs_struct: The nested structure of the outputs (predictions are
            packed into it).
        tensors: For every key, a `KerasTensor` with its shape and dtype.
        stage_inputs: For each stage, the keys it reads that it does not
            produce (model inputs or outputs of earlier stages), sorted.
        stage_outputs: For each stage, the keys it produces that later
            stages read or that are model outputs, sorted.
        live_after: For each stage `s`, the keys produced by stages `<= s`
            that stages `> s` read or that are model outputs, sorted: the
            bundle stage `s` forwards to stage `s + 1` (model inputs are not
            in it; every stage can read them from the infeed).
        standardize_inputs: A Functional model's own standardization of the
            data it is given (`None` for a subclassed model, which takes it
            as it comes).
        loss_calls: The calls (by `id`) whose added losses (`add_loss`, activity
            regularizers) count, as Keras counts them (`counted_losses`).

    Example:

    >>> plan = pipeline_plan(model)
    >>> plan.num_stages, [len(calls) for calls in plan.stages]
    (2, [2, 2])
    """

    model_name: str
    num_stages: int
    stages: tuple[tuple[StageCall, ...], ...]
    input_keys: tuple[TensorKey, ...]
    output_keys: tuple[TensorKey, ...]
    inputs: tuple[Any, ...]
    outputs: tuple[Any, ...]
    inputs_struct: Any
    outputs_struct: Any
    tensors: Mapping[TensorKey, Any]
    stage_inputs: tuple[tuple[TensorKey, ...], ...]
    stage_outputs: tuple[tuple[TensorKey, ...], ...]
    live_after: tuple[tuple[TensorKey, ...], ...]
    standardize_inputs: Any = None
    loss_calls: frozenset = frozenset()

    def flat_inputs(self, x: Any) -> list:
        """The values of the model inputs in `input_keys` order, as the model takes them.

        A Functional model standardizes what it is given as Keras does: a
        dict binds to a list of named inputs by name, a structure it cannot
        bind is refused, each value becomes its input's dtype, and a rank off
        by a trailing axis of 1 is adjusted.

        Raises:
            ValueError: For a structure the model's inputs cannot take.

        Example:

        >>> plan.flat_inputs({"z": z, "a": a})   # keras.Model([z_input, a_input], ...)
        [z, a]
        """
        if self.standardize_inputs is not None:
            return list(self.standardize_inputs(x))
        return keras_tree.flatten(x)

    def stage_layers(self, stage: int) -> list[Operation]:
        """The distinct layers and ops a stage calls, in first-call order.

        Args:
            stage: The stage, `0..num_stages - 1`.

        Returns:
            The operations (their variables are the stage's weights).

        Example:

        >>> [layer.name for layer in plan.stage_layers(0)]
        ['dense', 'dense_1']
        """
        seen: dict[int, Operation] = {}
        for call in self.stages[stage]:
            seen.setdefault(id(call.operation), call.operation)
        return list(seen.values())


def call_arguments(
    call: StageCall, values: Mapping[TensorKey, Any], training: bool | None
) -> tuple[tuple, dict]:
    """The positional and keyword arguments of one layer call on concrete values.

    The call's recorded arguments with its input tensors replaced by
    `values`; as in a Functional model's `call`, a non-`None` `training`
    overrides the recorded `training` argument of layers that take one.

    Args:
        call: The layer call.
        values: Values for (at least) `call.input_keys`.
        training: The training flag, or `None` to keep the recorded one.

    Returns:
        `(args, kwargs)` for `call.operation(*args, **kwargs)`.

    Raises:
        KeyError: When `values` lacks one of the call's inputs.

    Example:

    >>> args, kwargs = call_arguments(call, {call.input_keys[0]: x}, training=True)
    >>> y = call.operation(*args, **kwargs)
    """
    node = call.node
    by_id = {id(t): values[k] for t, k in zip(node.arguments.keras_tensors, call.input_keys)}
    args, kwargs = node.arguments.fill_in(by_id)
    # Every Keras layer takes `training` in `__call__`, whether or not its `call` does: it
    # reaches the layers inside through the call context (a BatchNormalization in a block).
    if training is not None and "training" in getattr(call.operation, "_call_context_args", ()):
        kwargs = {**kwargs, "training": training if call.training == tree.FOLLOWS_RUN
                  else call.training}
    return args, kwargs


def make_plan(
    model: Any,
    model_graph: graph.Graph,
    leaves: list[tree.Leaf],
    input_keys: list[int],
    output_keys: list[int],
    keys: tree.TensorKeys,
) -> PipelinePlan:
    """The plan of a checked assignment tree (the expansion `tree.check_assigned` returns).

    Args:
        model: The model.
        model_graph: Its graph.
        leaves: The layer calls with their stages and tensor keys, in order.
        input_keys: Keys of the model inputs.
        output_keys: Keys of the model outputs.
        keys: The tensor keys and their tensors.

    Returns:
        The `PipelinePlan`.

    Example:

    >>> plan = make_plan(model, model_graph, *tree.check_assigned(level, runtime=True))
    """
    num_stages = max(leaf.entry.stage for leaf in leaves) + 1
    stages: list[list[StageCall]] = [[] for _ in range(num_stages)]
    produced_in: dict[int, int] = {}
    last_use: dict[int, int] = {key: num_stages for key in output_keys}
    ordered: list[tuple[tree.Leaf, StageCall]] = []
    for leaf in leaves:
        stage = leaf.entry.stage
        ordered.append((leaf, StageCall(leaf.entry.node, stage, leaf.input_keys,
                                        leaf.output_keys, leaf.path, leaf.training)))
        stages[stage].append(ordered[-1][1])
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
        model_name=assignments.name_of(model),
        num_stages=num_stages,
        stages=tuple(tuple(calls) for calls in stages),
        input_keys=tuple(input_keys),
        output_keys=tuple(output_keys),
        inputs=model_graph.inputs,
        outputs=model_graph.outputs,
        inputs_struct=model_graph.inputs_struct,
        outputs_struct=model_graph.outputs_struct,
        tensors=dict(keys.tensors),
        stage_inputs=tuple(map(tuple, stage_inputs)),
        stage_outputs=tuple(map(tuple, stage_outputs)),
        live_after=tuple(map(tuple, live_after)),
        standardize_inputs=_standardization_of(model),
        loss_calls=counted_losses(ordered),
    )


def counted_losses(ordered: list[tuple[tree.Leaf, StageCall]]) -> frozenset:
    """The calls (by `id`) whose added losses count, as Keras counts them.

    Keras clears a layer's losses at each of its calls from the model itself
    (`stateless_call` runs `call`: each top-level layer or nested model call
    is an entry call). So a layer's calls inside one top-level call all count,
    and those of an earlier top-level call than its last do not (a shared
    layer, a nested model called twice).

    Args:
        ordered: The leaf calls in the model's order, with their `StageCall`s.

    Returns:
        The `id`s of the calls that count.

    Example:

    >>> id(plan.stages[0][0]) in counted_losses(ordered)   # a layer called once
    True
    """
    groups: list[tuple[Any, list]] = []  # per top-level call: (nested model or None, calls)
    for leaf, call in ordered:
        top = leaf.path[0] if leaf.path else None
        if (top is None or not groups or groups[-1][0] != top
                or any(seen.node is call.node for _, seen in groups[-1][1])):
            groups.append((top, []))  # a nested model's node again: its next call
        groups[-1][1].append((leaf, call))
    counted, later = set(), set()
    for _, calls in reversed(groups):
        counted.update(id(call) for _, call in calls if id(call.operation) not in later)
        later.update(id(call.operation) for _, call in calls)
    return frozenset(counted)


def _standardization_of(model: Any) -> Any:
    """The Functional model's `_standardize_inputs` (a Sequential's inner one's), or None."""
    functional = model if isinstance(model, Functional) else getattr(model, "_functional", None)
    return functional._standardize_inputs if isinstance(functional, Functional) else None


__all__ = ["PipelinePlan", "StageCall", "TensorKey", "call_arguments", "make_plan"]
