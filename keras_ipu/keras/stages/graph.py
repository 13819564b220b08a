"""Model graphs for pipeline stage assignments: model kinds, post-order, tracing.

Finds a model's graph of layer calls and orders the calls as they execute.
Sequential and Functional models have a graph; a subclassed model's `call`
is traced on `keras.Input`s (every inner layer call records a node) and the
graph is kept on the model until it is built with other shapes.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import inspect
import numbers
from collections.abc import Callable, Mapping
from typing import Any

import keras
from keras.src.models.functional import Functional
from keras.src.models.sequential import Sequential
from keras.src.ops.node import Node
from keras.src.utils import python_utils

from keras_ipu.keras import context
from keras_ipu.keras.stages import assignments, scope

SEQUENTIAL, FUNCTIONAL, MODEL = "sequential", "functional", "model"


# --------------------------------------------------------------------------
# Model graphs: kinds, post-order, tracing subclassed models.


@dataclasses.dataclass(frozen=True, eq=False)
class Graph:
    """A model's graph: flat input/output KerasTensors and their structures.

    Args:
        inputs: The flat input `KerasTensor`s.
        outputs: The flat output `KerasTensor`s.
        inputs_struct: The inputs in the structure `call` takes.
        outputs_struct: The outputs in the structure `call` returns.
        fixed_training: Of a subclassed model's traced calls, those that keep
            the `training` they were given (by node id), as plain Keras runs
            `call` itself; the others (and a Functional model's) take the run's.

    Example:

    >>> static_graph(functional_model, FUNCTIONAL).inputs
    (<KerasTensor shape=(None, 4), ...>,)
    """

    inputs: tuple
    outputs: tuple
    inputs_struct: Any
    outputs_struct: Any
    # A traced `call`'s layer calls (by node id) that keep the `training` they were
    # given (an explicit `training=False`, or none), not the run's: see `_trace`.
    fixed_training: Mapping[int, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, eq=False)
class GraphTrace:
    """The graph traced from a subclassed model's `call`, and the build it was traced for.

    Args:
        build_key: The model's build config when it was traced (as text).
        graph: The traced graph.

    Example:

    >>> context.state_of(model).traced_graph.graph.outputs
    """

    build_key: str
    graph: Graph


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


def nested_kind(operation: Any) -> str | None:
    """The kind of a nested model whose calls are expanded, or `None`.

    Args:
        operation: A layer or op called in a model's graph.

    Returns:
        `SEQUENTIAL` or `FUNCTIONAL`; `None` for layers, ops and subclassed
        models, which stay one opaque layer call.

    Example:

    >>> nested_kind(keras.Sequential([keras.layers.Dense(1)]))
    'sequential'
    """
    if isinstance(operation, Sequential):
        return SEQUENTIAL
    if isinstance(operation, Functional):
        return FUNCTIONAL
    return None


def _functional_graph(functional: Any) -> Graph:
    # A Functional model returns a one-output list or tuple as the output itself.
    output = functional.output
    if isinstance(output, (list, tuple)) and len(output) == 1:
        output = output[0]
    return Graph(tuple(functional.inputs), tuple(functional.outputs), functional.input, output)


def static_graph(model: Any, kind: str) -> Graph | None:
    """The graph a Sequential or Functional model has without tracing.

    Args:
        model: The model.
        kind: Its `model_kind`.

    Returns:
        The graph; `None` for an unbuilt Sequential model or a subclassed one.

    Example:

    >>> static_graph(functional_model, FUNCTIONAL).outputs
    """
    if kind == SEQUENTIAL:
        functional = getattr(model, "_functional", None)
        return None if functional is None else _functional_graph(functional)
    if kind == FUNCTIONAL:
        return _functional_graph(model)
    return None


def post_order(graph: Graph) -> list[Node]:
    """The graph's non-input nodes in execution order.

    Args:
        graph: A model graph.

    Returns:
        The Keras `Node`s, by decreasing depth, ties by a depth-first walk
        from the outputs (as Keras runs a Functional graph).

    Example:

    >>> [node.operation.name for node in post_order(graph)]
    ['dense', 'dense_1']
    """
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


class TraceError(ValueError):
    """A subclassed model's `call` could not be traced into a graph of layer calls.

    Args:
        model: The model.
        uses_pipeline_stages: Whether `call` entered a `PipelineStage` scope
            before it failed (then the model is meant to be pipelined).
        error: What the trace raised.

    Example:

    >>> raise TraceError(model, False, ValueError("a NumPy op in call"))
    """

    def __init__(self, model: Any, uses_pipeline_stages: bool, error: BaseException,
                 advice: str | None = None):
        self.uses_pipeline_stages = uses_pipeline_stages
        super().__init__(
            f"Could not trace the `call` function of model "
            f"`{assignments.name_of(model)}` into a graph of layer calls, which pipeline "
            f"stage assignments need: {error} " + (advice or (
                "Every tensor operation in `call` must be a Keras layer or a `keras.ops` "
                "function. If your layers do not support float inputs, pass `keras.Input` "
                "objects with the required dtype to `model.build()`."))
        )


def _training_parameter(call: Callable) -> inspect.Parameter | None:
    try:
        return inspect.signature(call).parameters.get("training")
    except (TypeError, ValueError):
        return None


def _symbolic_inputs(specs: Any, default_dtype: str, keep_batch: bool = False) -> Any:
    # The graph should not fix its batch size: a first call's batch (a build config's)
    # stays in what `call` makes of `ops.shape(x)[0]`, wrong for other batches.
    def unbatched(shape: Any) -> tuple:
        if keep_batch:
            return tuple(shape)
        return (None, *tuple(shape)[1:]) if len(shape) else ()

    def from_spec(spec: Any) -> Any:
        dtype = keras.backend.standardize_dtype(getattr(spec, "dtype", default_dtype))
        return keras.Input(batch_shape=unbatched(spec.shape), dtype=dtype)

    flat = keras.tree.flatten(specs)
    if all(leaf is None or isinstance(leaf, numbers.Integral) for leaf in flat):
        # Plain shapes, as in a build config: tuples/lists of ints and None.
        return keras.tree.map_shape_structure(
            lambda shape: keras.Input(batch_shape=unbatched(shape), dtype=default_dtype), specs
        )
    return keras.tree.map_structure(from_spec, specs)


def _build_specs(model: Any, config: dict) -> Any:
    if "input_shape" in config:
        return _checked_build_shape(config["input_shape"])
    shapes = config.get("shapes_dict") or {}
    if len(shapes) == 1:
        return _checked_build_shape(next(iter(shapes.values())))
    raise ValueError(
        f"Model `{assignments.name_of(model)}` was built with several input arguments "
        f"({sorted(shapes)}); pipelining traces `call` with a single `inputs` argument "
        f"(use a list or dict of tensors)."
    )


def _checked_build_shape(specs: Any) -> Any:
    """`specs` when it is what `build` takes: a shape, a list or dict of them, `keras.Input`s.

    Raises:
        ValueError: The reference's, naming the type given.
    """
    def is_shape(value: Any) -> bool:
        return isinstance(value, (tuple, list)) and all(
            d is None or (isinstance(d, numbers.Integral) and not isinstance(d, bool))
            for d in value)

    def valid(value: Any) -> bool:
        if is_shape(value) or (hasattr(value, "shape") and hasattr(value, "dtype")):
            return True
        if isinstance(value, dict):
            return bool(value) and all(map(valid, value.values()))
        return isinstance(value, (tuple, list)) and bool(value) and all(map(valid, value))

    if not valid(specs):
        raise ValueError(
            f"Specified input shape is not one of the valid types. Please specify a batch "
            f"input shape of type tuple, a list of input shapes, or a `keras.Input`. User "
            f"provided input type: {type(specs)}")
    return specs


def _trace(model: Any, specs: Any) -> Graph:
    """The graph of `call` in inference; refused where training calls other layers.

    A pipeline runs the one graph for fit, evaluate and predict (the layers
    get `training` as each runs), so `call` must make the same kinds of layer
    calls, in the same order, whatever `training` is.
    """
    parameter = _training_parameter(model.call)
    required = parameter is not None and parameter.default is inspect.Parameter.empty
    # For any batch size; else (`call` needs one: `keras.random.normal(ops.shape(x))`, say)
    # for the build's, which every run must then use (`traced_batch_size`).
    try:
        keep_batch = False
        graph, staged = _traced(model, specs, {"training": False} if required else {})
    except TraceError as error:
        keep_batch = True
        try:
            graph, staged = _traced(model, specs, {"training": False} if required else {},
                                    keep_batch)
        except TraceError:
            raise error from None
    given = {id(node): _given_training(node) for node in post_order(graph)}
    if parameter is None:  # `call` never sees the run's `training`: no call does
        return dataclasses.replace(graph, fixed_training=given)
    # Traced with `training=None`, a call given True or False was given a constant.
    constants = {} if required else {k: v for k, v in given.items() if isinstance(v, bool)}
    if not staged:
        # Only a model that enters stage scopes is pipelined by its trace; another's
        # layers are not built by a training trace plain Keras would not make.
        return dataclasses.replace(graph, fixed_training=constants)
    try:
        training_graph, _ = _traced(model, specs, {"training": True}, keep_batch)
    except TraceError:
        return dataclasses.replace(graph, fixed_training=constants)
    inference, training = _layer_calls(graph), _layer_calls(training_graph)
    if [kind for kind, _ in inference] != [kind for kind, _ in training]:
        raise TraceError(model, staged, ValueError(
            f"`call` makes other layer calls in training than in inference (in training "
            f"only: {_described(training, inference)}; in inference only: "
            f"{_described(inference, training)})."), advice=(
            "A pipelined model runs one graph of layer calls for fit, evaluate and predict, "
            "each layer getting `training` as it runs: make the same calls whatever "
            "`training` is (Dropout, BatchNormalization and the augmentation layers take "
            "`training` themselves)."))
    # A call given the same `training` in both traces keeps it (`self.backbone(x,
    # training=False)`, or none); one given `call`'s own takes the run's.
    return dataclasses.replace(graph, fixed_training={
        id(a): _given_training(a) for a, b in zip(post_order(graph), post_order(training_graph))
        if _given_training(a) == _given_training(b)})


def _given_training(node: Any) -> Any:
    """The `training` a traced call was given (`None` when none)."""
    return node.arguments.kwargs.get("training")


def _layer_calls(graph: Graph) -> list[tuple[str, str]]:
    """The graph's calls in order, as `(kind, name)`: a layer's class and name, another
    operation's class (`keras.ops` make a new one, newly named, at each call)."""
    return [(type(node.operation).__name__,
             node.operation.name if isinstance(node.operation, keras.layers.Layer) else "")
            for node in post_order(graph)]


def _described(calls: list, others: list) -> str:
    """The calls of kinds `others` has fewer of, by name (or kind)."""
    left = collections.Counter(kind for kind, _ in others)
    extra = []
    for kind, name in calls:
        if left[kind]:
            left[kind] -= 1
        else:
            extra.append(f"{name} ({kind})" if name else kind)
    return ", ".join(extra) or "none"


def _advice_for(error: BaseException, model: Any = None) -> str | None:
    """What to do about an error of `call`'s trace, where the usual advice does not fit."""
    if model is not None and not model.built and not python_utils.is_default(
            type(model).build):
        # Not built here: a build that fails for some batch would leave half its layers.
        return ("The model makes its layers in `build`, which has not run: build it first "
                "(`model.build(input_shape)`, or call it on a batch).")
    if "add_loss()" in str(error):  # the model's own add_loss: no layer call to run it in
        return ("The model's own `self.add_loss(...)` in `call` is not a layer call, so no "
                "stage can run it: add the loss in a layer of the stage that computes it "
                "(with `self.add_loss` in that layer's `call`).")
    return None


def _traced(model: Any, specs: Any, kwargs: dict,
            keep_batch: bool = False) -> tuple[Graph, bool]:
    """`call`'s graph with these keyword arguments, and whether it entered stage scopes."""
    inputs = _symbolic_inputs(specs, model.input_dtype, keep_batch)
    # PipelineStage scopes in `call` need an active strategy scope.
    strategy_scope = context.model_scope(model) if context.current_strategy() is None else (
        contextlib.nullcontext())
    # Stateless: what `call` assigns while traced (a seed generator's draw, a counter) is
    # the analysis', not the model's; plain Keras never runs this trace.
    # Under the model's name, as Keras' `__call__` runs `call`: layers first built here
    # get the variable paths plain Keras gives them (`net/dense/kernel`).
    with strategy_scope, model._open_name_scope(), scope.recording() as seen, \
            keras.StatelessScope():
        try:
            outputs = model.call(inputs, **kwargs)
        except Exception as error:
            raise TraceError(model, bool(seen), error, _advice_for(error, model)) from error
    flat_outputs = keras.tree.flatten(outputs)
    if not flat_outputs or not all(
        isinstance(t, keras.KerasTensor) and hasattr(t, "_keras_history") for t in flat_outputs
    ):
        raise TraceError(
            model, bool(seen), ValueError(f"`call` returned {outputs!r}, not Keras tensors.")
        )
    return (Graph(tuple(keras.tree.flatten(inputs)), tuple(flat_outputs), inputs, outputs),
            bool(seen))


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


def traced_graph(model: Any, inputs: Any = None, action: str | None = None) -> Graph | None:
    """A subclassed model's graph, traced from `call` (kept until it is built anew).

    Args:
        model: A subclassed Keras model.
        inputs: Specs of the inputs (anything with `shape` and `dtype`),
            used when the model is not built.
        action: `"get"` or `"set"`: raise, naming the action, when the model
            is not built and no `inputs` are given; `None`: return `None`.

    Returns:
        The graph, or `None`.

    Raises:
        RuntimeError: When the model is not built and `action` is given.
        TraceError: When `call` cannot be traced.

    Example:

    >>> model.build((None, 32))
    >>> traced_graph(model).outputs
    """
    config = model.get_build_config()
    key = repr(config)
    cached = context.state_of(model).traced_graph
    # Traced again only when the model was built with other shapes.
    if cached is not None and cached.build_key == key:
        return cached.graph
    if config is not None:
        specs = _build_specs(model, config)
    elif inputs is not None:
        specs = inputs
    elif action is not None:
        raise RuntimeError(_NOT_BUILT[action].format(name=assignments.name_of(model)))
    else:
        return None
    graph = _trace(model, specs)
    context.state_of(model).traced_graph = GraphTrace(key, graph)
    return graph


def traced_batch_size(graph: Graph) -> int | None:
    """The batch size a graph was traced for, or `None` when it runs any.

    Args:
        graph: A model graph (its inputs carry the traced shapes).

    Returns:
        The batch size of the graph's first input, when fixed.

    Example:

    >>> traced_batch_size(traced_graph(model))   # built by `model(x[:4])`, batch-bound
    4
    """
    shape = graph.inputs[0].shape if graph.inputs else ()
    return shape[0] if len(shape) else None


def model_graph(
    model: Any, kind: str, inputs: Any = None, action: str | None = None
) -> Graph | None:
    """The graph of any model kind (subclassed models are traced; see `traced_graph`).

    Args:
        model: A Keras model.
        kind: Its `model_kind`.
        inputs: As `traced_graph`.
        action: As `traced_graph`.

    Returns:
        The graph, or `None` when the model has none yet.

    Raises:
        RuntimeError, TraceError: As `traced_graph`.

    Example:

    >>> model_graph(model, model_kind(model)).outputs
    """
    if kind == MODEL:
        return traced_graph(model, inputs, action)
    return static_graph(model, kind)
