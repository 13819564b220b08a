"""The public pipeline stage assignment classes (as in `keras.ipu`).

One object per layer (Sequential) or layer call (Functional, subclassed)
holds that call's pipeline stage; nested Functional and Sequential models
hold their own assignment lists. `stages.model_assignment` builds and reads
them.
"""

from __future__ import annotations

from typing import Any

from keras.src.ops.node import Node

# --------------------------------------------------------------------------
# The six assignment classes (public, as in `keras.ipu`).


def name_of(obj: Any) -> str:
    """The name used for a model, layer or op in messages: its `name`, else its repr.

    Example:

    >>> name_of(keras.layers.Dense(1, name="head"))
    'head'
    """
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
        return f"Layer: {name_of(self._layer)} is assigned to pipeline stage: {self.pipeline_stage}"


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
            f"Layer: {name_of(self._layer)} (node index {self._node_index}) is assigned to "
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
            f"Model: {name_of(self._nested_model)} (node index {self._node_index}) has the "
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
        head = f"Model: {name_of(self._nested_model)} has the following pipeline stage assignments:"
        return head + "".join(_indented(repr(a)) for a in self._assignments)
