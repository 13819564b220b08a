"""`PipelineStage` scopes, where their stages are recorded, and what a stage runs.

A layer constructed inside `PipelineStage(s)` takes stage `s` for all of its
calls; a layer call made inside a scope takes that scope's stage, which beats
the layer's. `install()` hooks Keras so both are recorded: `Operation.__new__`
(every layer and op) and `Node.__init__` (every symbolic call).

`PipelinePlan` is what a pipelined executor reads: the layer calls (Keras
`Node`s) of each stage in execution order, with the tensors flowing between
stages named by integer keys. `run_stage` evaluates one stage.
`keras_ipu.keras.pipeline_assignment.pipeline_plan(model)` builds the plan.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import numbers
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import keras
from keras.src.ops.node import Node
from keras.src.ops.operation import Operation

from keras_ipu.keras import context

# Private attribute holding the stage on a layer (constructed in a scope) or a
# node (called in a scope). Written into the instance `__dict__` so Keras'
# attribute tracking never sees it.
STAGE_ATTRIBUTE = "_ipu_pipeline_stage"

_current_stage: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "keras_ipu_pipeline_stage", default=None
)
# Lists that collect every stage entered while they are active (tracing uses
# them to tell a model that uses PipelineStage from one that does not).
_recorders: contextvars.ContextVar[tuple[list[int], ...]] = contextvars.ContextVar(
    "keras_ipu_pipeline_stage_recorders", default=()
)
# The Keras functions `install` replaced, by (class, attribute name).
_originals: dict[tuple[type, str], Any] = {}


class PipelineStage:
    """A scope that assigns Keras layers and layer calls to a pipeline stage.

    Layers constructed inside the scope are assigned to `stage` for every
    call; layer calls made inside the scope are assigned to `stage` for that
    call only, which takes precedence over the stage of the layer's
    construction. Calling a nested model inside a scope assigns every layer
    call of that nested model to the scope's stage. Scopes only work inside an
    `IPUStrategy` scope and cannot be nested. Sequential models ignore them:
    use `set_pipeline_stage_assignment` instead.

    Args:
        stage: The pipeline stage (a non-negative integer) that Keras layers
            created and/or called within this scope are assigned to.

    Raises:
        ValueError: On construction, when `stage` is not a non-negative integer.
        RuntimeError: On entry, outside an `IPUStrategy` scope or inside
            another `PipelineStage` scope.

    Example:

    >>> with keras_ipu.IPUStrategy().scope():
    ...     inputs = keras.Input((4,))
    ...     with PipelineStage(0):
    ...         x = keras.layers.Dense(8)(inputs)
    ...     with PipelineStage(1):
    ...         x = keras.layers.Dense(1)(x)
    ...     model = keras.Model(inputs, x)
    """

    def __init__(self, stage: int):
        if isinstance(stage, bool) or not isinstance(stage, numbers.Integral) or stage < 0:
            raise ValueError(
                f"{stage!r} is not a valid pipeline stage. Pipeline stages are "
                f"non-negative integers (0 for the first stage)."
            )
        self._stage = int(stage)
        self._tokens: list[contextvars.Token] = []

    @property
    def stage(self) -> int:
        """The pipeline stage this scope assigns."""
        return self._stage

    def __enter__(self) -> PipelineStage:
        if context.current_strategy() is None:
            raise RuntimeError(
                "PipelineStage may only be used from within an IPUStrategy context: "
                "use it inside `with keras_ipu.ipu_strategy.IPUStrategy().scope():`."
            )
        if _current_stage.get() is not None:
            raise RuntimeError(
                f"Pipeline stages must not be nested: PipelineStage({self._stage}) was "
                f"entered inside PipelineStage({_current_stage.get()})."
            )
        self._tokens.append(_current_stage.set(self._stage))
        for recorder in _recorders.get():
            recorder.append(self._stage)
        return self

    def __exit__(self, exc_type, exc_value, traceback) -> None:
        _current_stage.reset(self._tokens.pop())

    def __repr__(self) -> str:
        return f"PipelineStage({self._stage})"


def current_pipeline_stage() -> int | None:
    """The stage of the innermost active `PipelineStage` scope, or `None`.

    Returns:
        The stage, or `None` outside every scope.

    Example:

    >>> with strategy.scope(), PipelineStage(2):
    ...     current_pipeline_stage()
    2
    """
    return _current_stage.get()


def recorded_stage(obj: Any) -> int | None:
    """The stage recorded on a layer, op or `Node` by a `PipelineStage` scope.

    Args:
        obj: A layer or operation (stage of its construction) or a Keras
            `Node` (stage of that call).

    Returns:
        The stage, or `None` when none was recorded.

    Example:

    >>> with strategy.scope(), PipelineStage(1):
    ...     layer = keras.layers.Dense(2)
    >>> recorded_stage(layer)
    1
    """
    return getattr(obj, "__dict__", {}).get(STAGE_ATTRIBUTE)


@contextlib.contextmanager
def recording() -> Iterator[list[int]]:
    """Collects the stages of the `PipelineStage` scopes entered inside it.

    Returns:
        A context manager yielding the list the stages are appended to.

    Example:

    >>> with recording() as seen:
    ...     model.call(inputs)
    >>> bool(seen)  # True when `call` uses PipelineStage scopes
    """
    seen: list[int] = []
    token = _recorders.set(_recorders.get() + (seen,))
    try:
        yield seen
    finally:
        _recorders.reset(token)


def _record(obj: Any) -> None:
    stage = _current_stage.get()
    if stage is not None:
        vars(obj)[STAGE_ATTRIBUTE] = stage


def _recording_new(original: Callable[..., Any]) -> Callable[..., Any]:
    # `__new__`, not `__init__`: Keras reads `inspect.getfullargspec(cls.__init__)`
    # for auto-configs, which a wrapped `__init__` would change.
    @functools.wraps(original)
    def new(cls, *args, **kwargs):
        instance = original(cls, *args, **kwargs)
        _record(instance)
        return instance

    return new


def _recording_init(original: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original)
    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        _record(self)

    return init


def install() -> None:
    """Hooks Keras so that `PipelineStage` scopes record stages (idempotent).

    Wraps `keras.src.ops.operation.Operation.__new__` (layers and ops
    constructed in a scope) and `keras.src.ops.node.Node.__init__` (symbolic
    calls made in a scope). Outside every scope the hooks record nothing.

    Example:

    >>> install()
    >>> install()  # a second call changes nothing
    """
    if (Operation, "__new__") not in _originals:
        original_new = Operation.__dict__["__new__"]
        _originals[(Operation, "__new__")] = original_new
        Operation.__new__ = staticmethod(_recording_new(original_new.__func__))
    if (Node, "__init__") not in _originals:
        original_init = Node.__dict__["__init__"]
        _originals[(Node, "__init__")] = original_init
        Node.__init__ = _recording_init(original_init)


def uninstall() -> None:
    """Removes the hooks `install` added; recorded stages stay where they are.

    Example:

    >>> uninstall()
    """
    for (cls, name), original in list(_originals.items()):
        setattr(cls, name, original)
        del _originals[(cls, name)]


# --------------------------------------------------------------------------
# The plan a pipelined executor runs.

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


def run_stage(
    plan: PipelinePlan,
    stage: int,
    values: Mapping[TensorKey, Any],
    training: bool | None = None,
) -> dict[TensorKey, Any]:
    """Evaluates the calls of one stage on concrete tensors.

    Each call runs `node.operation(*args, **kwargs)` with the node's recorded
    arguments, its tensors replaced by values. As in a Functional model's
    `call`, a non-`None` `training` overrides the recorded `training`
    argument of layers that take one. Layers read their variables as usual:
    run inside `keras.StatelessScope(state_mapping=...)` to supply them
    functionally under `jax.jit`.

    Args:
        plan: The model's plan.
        stage: The stage to run.
        values: Values for (at least) `plan.stage_inputs[stage]`.
        training: The training flag for layers that take one, or `None`
            to keep the recorded arguments.

    Returns:
        The values of every key the stage produces.

    Raises:
        KeyError: When `values` lacks a key the stage reads.

    Example:

    >>> out = run_stage(plan, 0, {plan.input_keys[0]: x})
    >>> out = run_stage(plan, 1, {k: out[k] for k in plan.live_after[0]})
    """
    env = dict(values)
    produced: dict[TensorKey, Any] = {}
    for call in plan.stages[stage]:
        node = call.node
        by_id = {id(t): env[key] for t, key in zip(node.arguments.keras_tensors, call.input_keys)}
        args, kwargs = node.arguments.fill_in(by_id)
        if training is not None and "training" in getattr(
            call.operation, "_call_context_args", ()
        ):
            kwargs = {**kwargs, "training": training}
        outputs = keras.tree.flatten(call.operation(*args, **kwargs))
        for key, value in zip(call.output_keys, outputs):
            env[key] = produced[key] = value
    return produced


def run_plan(plan: PipelinePlan, inputs: Any, training: bool | None = None) -> Any:
    """Runs every stage in order: the reference semantics of a pipelined call.

    Args:
        plan: The model's plan.
        inputs: Data with the structure of `plan.inputs_struct` (a single
            array for a single-input model).
        training: As for `run_stage`.

    Returns:
        The outputs, packed into `plan.outputs_struct`.

    Example:

    >>> numpy.allclose(run_plan(pipeline_plan(model), x), model(x))
    True
    """
    flat = keras.tree.flatten(inputs)
    if len(flat) != len(plan.inputs):
        raise ValueError(
            f"Model {plan.model_name} takes {len(plan.inputs)} input(s), got {len(flat)}."
        )
    values: dict[TensorKey, Any] = {
        key: keras.ops.convert_to_tensor(x, dtype=spec.dtype)
        for key, x, spec in zip(plan.input_keys, flat, plan.inputs)
    }
    for stage in range(plan.num_stages):
        values.update(run_stage(plan, stage, values, training))
    return keras.tree.pack_sequence_as(
        plan.outputs_struct, [values[key] for key in plan.output_keys]
    )


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


__all__ = [
    "PipelinePlan",
    "PipelineStage",
    "StageCall",
    "check_no_empty_stages",
    "current_pipeline_stage",
    "install",
    "recorded_stage",
    "recording",
    "run_plan",
    "run_stage",
    "uninstall",
]
