"""Pipeline stage assignment: PipelineStage scopes, the assignment API, summaries, plans."""

from __future__ import annotations

import contextlib
import json
import logging

import jax.numpy as jnp
import keras
import numpy as np
import pytest

import keras_ipu as ipu
from keras_ipu.keras import stages as pa
from keras_ipu.keras import stages as ps
from keras_ipu.keras.stages import (
    FunctionalLayerPipelineStageAssignment,
    FunctionalNestedModelPipelineStageAssignment,
    ModelLayerPipelineStageAssignment,
    PipelineStage,
    SequentialLayerPipelineStageAssignment,
    SequentialNestedModelPipelineStageAssignment,
)

from conftest import configure
from models import data_for, run_plan, run_stage

ps.install()

# Keras warns that a subclassed model's default `build()` leaves its layers unbuilt;
# tracing builds them.
pytestmark = pytest.mark.filterwarnings("ignore:`build\\(\\)` was called on layer:UserWarning")

_MIXINS = {
    pa.SEQUENTIAL: pa.SequentialPipelineMixin,
    pa.FUNCTIONAL: pa.FunctionalPipelineMixin,
    pa.MODEL: pa.ModelPipelineMixin,
}


def with_mixin(model):
    """Puts the model's pipeline mixin first in its class (until extensions include it)."""
    mixin = _MIXINS[pa.model_kind(model)]
    cls = type(model)
    if not issubclass(cls, mixin):
        object.__dict__["__class__"].__set__(model, type(cls.__name__, (mixin, cls), {}))
    return model


def stages(assignments):
    result = []
    for a in assignments:
        result.append(stages(a.pipeline_stage_assignments) if a.is_nested_model else
                      a.pipeline_stage)
    return result


def names(plan):
    return [[call.operation.name for call in calls] for calls in plan.stages]


def sequential(name="seq"):
    return keras.Sequential(
        [keras.layers.Dense(8, name=f"{name}_d{i}") for i in range(4)], name=name
    )


def shared_functional():
    """Three layers, each called twice."""
    inputs = keras.Input((4,), name="x")
    a, b, c = (keras.layers.Dense(4, name=n) for n in "abc")
    y = c(b(a(inputs)))
    y = c(b(a(y)))
    return keras.Model(inputs, y, name="shared")


def residual():
    """A ResNet-like Functional model: two blocks with skip connections."""
    inputs = keras.Input((8,), name="image")
    h = keras.layers.Dense(8, name="stem")(inputs)
    r = keras.layers.Dense(8, name="block1_conv")(h)
    r = keras.layers.Dense(8, name="block1_conv2")(r)
    h = keras.layers.Add(name="block1_add")([h, r])
    r = keras.layers.Dense(8, name="block2_conv")(h)
    h = keras.layers.Add(name="block2_add")([h, r])
    outputs = keras.layers.Dense(2, name="head")(h)
    return keras.Model(inputs, outputs, name="resnet")


RESIDUAL_ORDER = [
    "stem", "block1_conv", "block1_conv2", "block1_add", "block2_conv", "block2_add", "head"
]


def split_after(assignments, name):
    stage = 0
    for assignment in assignments:
        assignment.pipeline_stage = stage
        if assignment.layer.name.startswith(name):
            stage = 1
    return assignments


class Tower(keras.Model):
    """The seed's §19.4.3 model without scopes."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense_layer_1 = keras.layers.Dense(8)
        self.dense_layer_2 = keras.layers.Dense(8)
        self.concat_layer = keras.layers.Concatenate()
        self.dense_layer_3 = keras.layers.Dense(1)

    def call(self, inputs):
        x = self.dense_layer_1(inputs)
        x1 = self.dense_layer_2(x)
        x2 = self.dense_layer_2(x)
        x1 = self.dense_layer_2(x1)
        x2 = self.dense_layer_2(x2)
        x = self.concat_layer([x1, x2])
        return self.dense_layer_3(x)


class ScopedTower(Tower):
    """The seed's §19.4.3 model with PipelineStage scopes: 4 stages."""

    def call(self, inputs):
        with PipelineStage(0):
            x = self.dense_layer_1(inputs)
        with PipelineStage(1):
            x1 = self.dense_layer_2(x)
            x2 = self.dense_layer_2(x)
        with PipelineStage(2):
            x1 = self.dense_layer_2(x1)
            x2 = self.dense_layer_2(x2)
            x = self.concat_layer([x1, x2])
        with PipelineStage(3):
            x = self.dense_layer_3(x)
        return x


def tower_assignment(model):
    """The seed's assignment of an existing Model subclass into 4 stages."""
    assignments = model.get_pipeline_stage_assignment()
    for assignment in assignments:
        if assignment.layer == model.dense_layer_1:
            assignment.pipeline_stage = 0
        elif assignment.layer == model.dense_layer_2 and assignment.node_index < 2:
            assignment.pipeline_stage = 1
        elif assignment.layer == model.dense_layer_2 and assignment.node_index < 4:
            assignment.pipeline_stage = 2
        elif assignment.layer == model.concat_layer:
            assignment.pipeline_stage = 2
        elif assignment.layer == model.dense_layer_3:
            assignment.pipeline_stage = 3
    return assignments


def nested_model():
    """A Sequential nested in a Functional model."""
    inner = keras.Sequential(
        [keras.layers.Dense(4, name="inner_a"), keras.layers.Dense(4, name="inner_b")],
        name="inner",
    )
    inputs = keras.Input((4,), name="x")
    h = keras.layers.Dense(4, name="pre")(inputs)
    h = inner(h)
    outputs = keras.layers.Dense(2, name="post")(h)
    return keras.Model(inputs, outputs, name="outer"), inner


# --------------------------------------------------------------------------
# PipelineStage


def test_pipeline_stage_needs_a_strategy_scope():
    with pytest.raises(RuntimeError, match="only be used from within an IPUStrategy context"):
        with PipelineStage(0):
            pass


def test_pipeline_stages_must_not_be_nested(strategy):
    with strategy.scope(), PipelineStage(0):
        with pytest.raises(RuntimeError, match=r"must not be nested.*PipelineStage\(1\).*"):
            with PipelineStage(1):
                pass
        assert ps.current_pipeline_stage() == 0
    assert ps.current_pipeline_stage() is None


@pytest.mark.parametrize("stage", [-1, 1.5, "1", True, None])
def test_pipeline_stage_rejects_invalid_stages(stage):
    with pytest.raises(ValueError, match=f"{stage!r} is not a valid pipeline stage"):
        PipelineStage(stage)


def test_install_is_idempotent_and_records_nothing_outside_scopes(strategy):
    from keras.src.ops.node import Node

    ps.install()
    hooked = Node.__dict__["__init__"]
    ps.uninstall()
    assert Node.__dict__["__init__"] is hooked.__wrapped__
    ps.install()
    ps.install()
    assert Node.__dict__["__init__"] is not hooked.__wrapped__
    layer = keras.layers.Dense(2)
    assert ps.recorded_stage(layer) is None
    with strategy.scope(), PipelineStage(3):
        scoped = keras.layers.Dense(2)
        output = layer(keras.Input((2,)))
    assert ps.recorded_stage(scoped) == 3
    assert ps.recorded_stage(output._keras_history.operation._inbound_nodes[0]) == 3


def test_call_scope_beats_construction_scope(strategy):
    with strategy.scope():
        inputs = keras.Input((4,), name="x")
        with PipelineStage(1):
            shared = keras.layers.Dense(4, name="shared")
        with PipelineStage(0):
            h = keras.layers.Dense(4, name="first")(inputs)
        h = shared(h)  # the layer's stage: 1
        with PipelineStage(2):
            h = shared(h)  # the call's stage beats the layer's
        model = with_mixin(keras.Model(inputs, h))
    assignments = model.get_pipeline_stage_assignment()
    assert [(a.layer.name, a.node_index, a.pipeline_stage) for a in assignments] == [
        ("first", 0, 0), ("shared", 0, 1), ("shared", 1, 2)
    ]
    assert names(pa.pipeline_plan(model)) == [["first"], ["shared"], ["shared"]]


def test_scopes_must_assign_every_call(strategy):
    message = "All layers of a pipelined model must have .* However, forgotten has not"
    with strategy.scope():
        inputs = keras.Input((4,))
        with PipelineStage(0):
            h = keras.layers.Dense(4)(inputs)
        h = keras.layers.Dense(4, name="forgotten")(h)
        with pytest.raises(ValueError, match=message):  # at construction, as the reference
            keras.Model(inputs, h)
        class Subclass(keras.Model):  # a subclass calling the functional constructor
            def __init__(self):
                super().__init__(inputs, h)

        with pytest.raises(ValueError, match=message):
            Subclass()
    # A model built outside the strategy is checked when its assignment is first used.
    model = keras.Model(inputs, h)
    with pytest.raises(ValueError, match=message):
        pa.get_assignment(model)
    with pytest.raises(ValueError, match=message):
        pa.pipeline_plan(model)


def test_scopes_using_a_later_stage_fail_at_construction(strategy):
    # As the reference, which sets the scopes' stages as the model is constructed.
    with strategy.scope():
        inputs = keras.Input((4,))
        with PipelineStage(0):
            early = keras.layers.Dense(4, name="early")
            h = early(inputs)
        with PipelineStage(1):
            h = keras.layers.Dense(4, name="late")(h)
        h = early(h)  # the layer's stage, 0, after stage 1
        with pytest.raises(ValueError, match="Layer early in pipeline stage 0 has a dependency "
                                             ".* output of layer late in pipeline stage 1"):
            keras.Model(inputs, h)


def test_functional_scopes_as_in_the_seed(strategy):
    with strategy.scope():
        input_layer = keras.layers.Input((28, 28))
        with PipelineStage(0):
            x = keras.layers.Dense(8)(input_layer)
            x = keras.layers.Dense(16)(x)
        with PipelineStage(1):
            x = keras.layers.Dense(16)(x)
            x = keras.layers.Dense(1)(x)
            x = keras.layers.GlobalAveragePooling1D()(x)
        model = keras.Model(inputs=input_layer, outputs=x)
    assert stages(pa.get_assignment(model)) == [0, 0, 1, 1, 1]
    plan = pa.pipeline_plan(model)
    assert [len(calls) for calls in plan.stages] == [2, 3]
    data = np.random.default_rng(0).normal(size=(3, 28, 28)).astype("float32")
    np.testing.assert_allclose(run_plan(plan, data), model(data), atol=1e-6)


def test_reset_forgets_scopes(strategy):
    with strategy.scope():
        inputs = keras.Input((4,))
        with PipelineStage(0):
            h = keras.layers.Dense(4)(inputs)
        with PipelineStage(1):
            h = keras.layers.Dense(4)(h)
        model = with_mixin(keras.Model(inputs, h))
    assert pa.pipeline_plan(model).num_stages == 2
    model.reset_pipeline_stage_assignment()
    assert pa.pipeline_plan(model) is None
    assert stages(model.get_pipeline_stage_assignment()) == [None, None]


# --------------------------------------------------------------------------
# Default assignments


def test_sequential_default_assignment(strategy):
    with strategy.scope():
        model = with_mixin(sequential())
    assignments = model.get_pipeline_stage_assignment()
    assert [type(a) for a in assignments] == [SequentialLayerPipelineStageAssignment] * 4
    assert [a.layer for a in assignments] == model.layers
    assert stages(assignments) == [None] * 4
    assert repr(assignments[0]) == "Layer: seq_d0 is assigned to pipeline stage: None"
    assert not assignments[0].is_nested_model
    assert pa.pipeline_plan(model) is None


def test_functional_default_assignment_is_per_call_in_post_order(strategy):
    with strategy.scope():
        model = with_mixin(shared_functional())
    assignments = model.get_pipeline_stage_assignment()
    assert len(assignments) == 6
    assert all(type(a) is FunctionalLayerPipelineStageAssignment for a in assignments)
    assert [(a.layer.name, a.node_index) for a in assignments] == [
        ("a", 0), ("b", 0), ("c", 0), ("a", 1), ("b", 1), ("c", 1)
    ]
    assert [[op.name for op in a.inbound_layers] for a in assignments] == [
        ["x"], ["a"], ["b"], ["c"], ["a"], ["b"]
    ]
    assert repr(assignments[3]) == "Layer: a (node index 1) is assigned to pipeline stage: None"
    assert pa.pipeline_plan(model) is None


def test_functional_post_order_runs_branches_before_their_join(strategy):
    with strategy.scope():
        model = residual()
    assignments = pa.get_assignment(model)
    assert [a.layer.name for a in assignments] == RESIDUAL_ORDER
    assert [op.name for op in assignments[3].inbound_layers] == ["stem", "block1_conv2"]


def test_subclassed_default_assignment(strategy):
    with strategy.scope():
        model = with_mixin(Tower(name="tower"))
    model.build((None, 32))
    assignments = model.get_pipeline_stage_assignment()
    assert all(type(a) is ModelLayerPipelineStageAssignment for a in assignments)
    assert [(a.layer.name, a.node_index) for a in assignments] == [
        (model.dense_layer_1.name, 0),
        (model.dense_layer_2.name, 0),
        (model.dense_layer_2.name, 1),
        (model.dense_layer_2.name, 2),
        (model.dense_layer_2.name, 3),
        (model.concat_layer.name, 0),
        (model.dense_layer_3.name, 0),
    ]
    assert assignments[5].inbound_layers == [model.dense_layer_2, model.dense_layer_2]
    # A second get reuses the traced graph: node indices stay 0..3.
    assert [a.node_index for a in model.get_pipeline_stage_assignment()][1:5] == [0, 1, 2, 3]


def test_subclassed_model_must_be_built(strategy):
    with strategy.scope():
        model = with_mixin(Tower(name="unbuilt"))
    with pytest.raises(RuntimeError, match=r"Cannot get .* `unbuilt` .* call `model.build\(\)`"):
        model.get_pipeline_stage_assignment()
    with pytest.raises(RuntimeError, match="Cannot set .* `unbuilt` .* PipelineStage scopes"):
        model.set_pipeline_stage_assignment([])


@pytest.mark.parametrize("shape", ["28,28", 28, None, [(None, 32), "x"]])
def test_a_subclassed_model_built_with_no_shape_is_told_what_build_takes(strategy, shape):
    with strategy.scope():
        model = with_mixin(Tower(name="badly_built"))
    model.build(shape)  # Keras marks it built whatever it is given
    with pytest.raises(ValueError, match=r"Specified input shape is not one of the valid "
                                         r"types\. .* User provided input type: <class"):
        model.get_pipeline_stage_assignment()


def test_untraceable_subclassed_model_is_not_pipelined(strategy):
    class Opaque(keras.Model):
        def call(self, inputs):
            return jnp.sin(inputs)

    with strategy.scope():
        model = Opaque(name="opaque")
    model.build((None, 3))
    assert pa.pipeline_plan(model) is None
    with pytest.raises(ValueError, match="Could not trace the `call` function of model `opaque`"):
        pa.get_assignment(model)


class TrainingBranch(keras.Model):
    """A layer applied in training only; keras.ops and Dropout whatever `training` is."""

    def __init__(self, staged: bool, **kwargs):
        super().__init__(**kwargs)
        self.staged = staged
        self.first = keras.layers.Dense(4)
        self.noise = keras.layers.Activation("tanh", name="training_only")
        self.dropout = keras.layers.Dropout(0.5)
        self.last = keras.layers.Dense(1)

    def call(self, inputs, training=False):
        with PipelineStage(0) if self.staged else contextlib.nullcontext():
            h = keras.ops.relu(self.first(inputs)) + 1.0
            if training:
                h = self.noise(h)
        with PipelineStage(1) if self.staged else contextlib.nullcontext():
            return self.last(self.dropout(h, training=training))


def test_a_pipelined_call_taking_other_layers_in_training_is_refused(strategy):
    # The pipeline runs one graph for fit and predict: the training-only layer was
    # silently left out of fit (a loss 2e5 times plain Keras').
    with strategy.scope():
        model = TrainingBranch(staged=True, name="branching")
    model.build((None, 3))
    with pytest.raises(ValueError, match=r"`call` makes other layer calls in training than in "
                                         r"inference \(in training only: training_only "
                                         r"\(Activation\); in inference only: none\)"):
        pa.get_assignment(model)
    # Unstaged, it is not pipelined: it runs as Keras runs it.
    with strategy.scope():
        plain = TrainingBranch(staged=False)
    plain.build((None, 3))
    assert pa.pipeline_plan(plain) is None


def test_keras_ops_and_layers_taking_training_make_one_graph(strategy):
    class Same(TrainingBranch):
        def call(self, inputs, training=False):
            with PipelineStage(0):
                h = keras.ops.relu(self.first(inputs)) + 1.0
            with PipelineStage(1):
                return self.last(self.dropout(h, training=training))

    with strategy.scope():
        model = Same(staged=True)
    model.build((None, 3))
    assert [type(a.layer).__name__ for a in pa.get_assignment(model)] == [
        "Dense", "Relu", "Add", "Dropout", "Dense"]


def test_a_models_own_add_loss_in_a_pipelined_call_says_where_to_add_it(strategy):
    class OwnLoss(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.first, self.last = keras.layers.Dense(4), keras.layers.Dense(1)

        def call(self, inputs):
            with PipelineStage(0):
                h = self.first(inputs)
                self.add_loss(keras.ops.mean(h ** 2))
            with PipelineStage(1):
                return self.last(h)

    with strategy.scope():
        model = OwnLoss()
    model.build((None, 3))
    with pytest.raises(ValueError, match=r"The model's own `self.add_loss\(...\)` in `call` is "
                                         r"not a layer call"):
        pa.get_assignment(model)


@pytest.mark.parametrize("masking", ["embedding", "masking"])
def test_layers_staged_where_constructed_take_their_mask_ops_along(masking, strategy):
    # Keras makes the mask ops (not_equal, any) inside the layer's call, outside any scope:
    # they were left without a stage ("not_equal has not been assigned to one").
    with strategy.scope():
        with PipelineStage(0):
            first = (keras.layers.Embedding(20, 8, mask_zero=True) if masking == "embedding"
                     else keras.layers.Masking())
            recurrent = keras.layers.LSTM(6)
        with PipelineStage(1):
            last = keras.layers.Dense(3)
        inputs = (keras.Input((6,), dtype="int32") if masking == "embedding"
                  else keras.Input((6, 4)))
        model = keras.Model(inputs, last(recurrent(first(inputs))))
    stages_of = {type(a.layer).__name__: a.pipeline_stage for a in pa.get_assignment(model)}
    assert stages_of["LSTM"] == 0 and stages_of["Dense"] == 1
    assert {stages_of[name] for name in stages_of if name not in ("LSTM", "Dense")} == {0}
    rng = np.random.default_rng(0)
    data = (rng.integers(0, 3, size=(2, 6)).astype("int32") if masking == "embedding"
            else np.where(rng.random((2, 6, 1)) < 0.3, 0.0, rng.random((2, 6, 4))))
    np.testing.assert_allclose(run_plan(pa.pipeline_plan(model), data), model(data), atol=1e-6)


def test_get_returns_new_objects(strategy):
    with strategy.scope():
        model = with_mixin(sequential())
    model.set_pipeline_stage_assignment([0, 0, 1, 1])
    first = model.get_pipeline_stage_assignment()
    first[0].pipeline_stage = 5
    assert stages(model.get_pipeline_stage_assignment()) == [0, 0, 1, 1]


# --------------------------------------------------------------------------
# Setting assignments


def test_set_sequential_ints_and_objects(strategy):
    with strategy.scope():
        model = with_mixin(sequential())
    model.set_pipeline_stage_assignment([0, 0, 1, 1])
    assignments = model.get_pipeline_stage_assignment()
    assert stages(assignments) == [0, 0, 1, 1]
    assignments[2] = 0
    assignments[3].pipeline_stage = 1
    model.set_pipeline_stage_assignment(assignments)  # objects and ints mixed
    assert stages(model.get_pipeline_stage_assignment()) == [0, 0, 0, 1]
    model.build((None, 4))
    plan = pa.pipeline_plan(model)
    assert names(plan) == [["seq_d0", "seq_d1", "seq_d2"], ["seq_d3"]]


def test_unbuilt_pipelined_sequential_builds_from_inputs(strategy):
    with strategy.scope():
        model = sequential()
    pa.set_assignment(model, [0, 0, 1, 1])
    with pytest.raises(RuntimeError, match="has no graph yet"):
        pa.pipeline_plan(model)
    plan = pa.pipeline_plan(model, inputs=keras.KerasTensor((4, 6)))
    assert plan.num_stages == 2 and model.built
    assert plan.inputs[0].shape == (None, 6)


def test_set_functional_split_after_a_named_layer(strategy):
    calls = []
    with strategy.scope():
        model = with_mixin(residual())
    type(model)._pipeline_assignment_changed = lambda self: calls.append("changed")
    assignments = split_after(model.get_pipeline_stage_assignment(), "block1_add")
    model.set_pipeline_stage_assignment(assignments)
    assert stages(model.get_pipeline_stage_assignment()) == [0, 0, 0, 0, 1, 1, 1]
    assert names(pa.pipeline_plan(model)) == [RESIDUAL_ORDER[:4], RESIDUAL_ORDER[4:]]
    model.reset_pipeline_stage_assignment()
    assert pa.pipeline_plan(model) is None
    assert calls == ["changed", "changed"]


def test_subclassed_model_with_four_stages(strategy):
    with strategy.scope():
        model = with_mixin(Tower())
    model.build((None, 32))
    model.set_pipeline_stage_assignment(tower_assignment(model))
    plan = pa.pipeline_plan(model)
    d1, d2, d3 = (model.dense_layer_1.name, model.dense_layer_2.name, model.dense_layer_3.name)
    assert names(plan) == [[d1], [d2, d2], [d2, d2, model.concat_layer.name], [d3]]
    data = np.random.default_rng(1).normal(size=(4, 32)).astype("float32")
    np.testing.assert_allclose(run_plan(plan, data), model(data), atol=1e-6)


def test_subclassed_model_with_scopes_traces_from_inputs(strategy):
    with strategy.scope():
        model = ScopedTower()
    plan = pa.pipeline_plan(model, inputs=keras.KerasTensor((4, 32)))
    assert plan.num_stages == 4
    assert [len(calls) for calls in plan.stages] == [1, 2, 3, 1]
    assert [[call.stage for call in calls] for calls in plan.stages] == [
        [0], [1, 1], [2, 2, 2], [3]
    ]
    assert stages(pa.get_assignment(model)) == [0, 1, 1, 2, 2, 2, 3]
    data = np.random.default_rng(2).normal(size=(4, 32)).astype("float32")
    with strategy.scope():
        np.testing.assert_allclose(run_plan(plan, data), model(data), atol=1e-6)


def test_nested_sequential_expands_and_is_stored_on_the_root(strategy):
    with strategy.scope():
        model, inner = nested_model()
        model = with_mixin(model)
    assignments = model.get_pipeline_stage_assignment()
    nested = assignments[1]
    assert type(nested) is FunctionalNestedModelPipelineStageAssignment
    assert nested.is_nested_model and nested.nested_model is inner and nested.node_index == 0
    assert [op.name for op in nested.inbound_layers] == ["pre"]
    children = nested.pipeline_stage_assignments
    assert [type(a) for a in children] == [SequentialLayerPipelineStageAssignment] * 2
    assert repr(nested) == (
        "Model: inner (node index 0) has the following pipeline stage assignments:\n"
        "  Layer: inner_a is assigned to pipeline stage: None\n"
        "  Layer: inner_b is assigned to pipeline stage: None"
    )
    assignments[0].pipeline_stage = 0
    children[0].pipeline_stage = 0
    children[1].pipeline_stage = 1
    assignments[2].pipeline_stage = 1
    model.set_pipeline_stage_assignment(assignments)
    assert stages(model.get_pipeline_stage_assignment()) == [0, [0, 1], 1]
    assert stages(pa.get_assignment(inner)) == [None, None]  # not pushed into `inner`
    assert pa.pipeline_plan(inner) is None
    plan = pa.pipeline_plan(model)
    assert names(plan) == [["pre", "inner_a"], ["inner_b", "post"]]
    assert [call.path for call in plan.stages[0]] == [(), ("inner",)]
    data = np.random.default_rng(3).normal(size=(5, 4)).astype("float32")
    np.testing.assert_allclose(run_plan(plan, data), model(data), atol=1e-6)


def test_nested_model_called_in_a_scope_takes_its_stage(strategy):
    with strategy.scope():
        inner = keras.Sequential([keras.layers.Dense(4), keras.layers.Dense(4)])
        inputs = keras.Input((4,))
        with PipelineStage(0):
            h = keras.layers.Dense(4)(inputs)
        with PipelineStage(1):
            h = inner(h)
        model = keras.Model(inputs, h)
    assert stages(pa.get_assignment(model)) == [0, [1, 1]]


def test_functional_nested_in_sequential(strategy):
    with strategy.scope():
        block_in = keras.Input((4,))
        block = keras.Model(
            block_in, keras.layers.Dense(4, name="b2")(keras.layers.Dense(4, name="b1")(block_in)),
            name="block",
        )
        model = with_mixin(
            keras.Sequential([keras.Input((4,)), block, keras.layers.Dense(2, name="top")])
        )
    assignments = model.get_pipeline_stage_assignment()
    assert type(assignments[0]) is SequentialNestedModelPipelineStageAssignment
    assert repr(assignments[0]).startswith("Model: block has the following")
    model.set_pipeline_stage_assignment([0, 1])  # an int for a whole nested model
    assert stages(model.get_pipeline_stage_assignment()) == [[0, 0], 1]
    assert names(pa.pipeline_plan(model)) == [["b1", "b2"], ["top"]]


def test_keras_ops_calls_are_assigned_too(strategy):
    with strategy.scope():
        inputs = keras.Input((4,), name="x")
        with PipelineStage(0):
            h = keras.layers.Dense(4, name="d")(inputs)
        with PipelineStage(1):
            h = keras.ops.relu(h) + 1.0
        model = keras.Model(inputs, h)
    assignments = pa.get_assignment(model)
    assert [type(a.layer).__name__ for a in assignments] == ["Dense", "Relu", "Add"]
    assert stages(assignments) == [0, 1, 1]
    items = pa.assignment_to_config(model)["pipeline_stage_assignment"]
    assert items == [[1, 0, 0], [None, 0, 1], [None, 0, 1]]  # ops are not in model.layers
    data = np.ones((2, 4), "float32")
    np.testing.assert_allclose(run_plan(pa.pipeline_plan(model), data), model(data))


def test_nested_model_called_twice_expands_twice(strategy):
    with strategy.scope():
        block_in = keras.Input((4,))
        block = keras.Model(block_in, keras.layers.Dense(4, name="inner")(block_in), name="b")
        inputs = keras.Input((4,))
        with PipelineStage(0):
            h = block(inputs)
        with PipelineStage(1):
            h = block(h)
        model = keras.Model(inputs, h)
    assignments = pa.get_assignment(model)
    assert [(a.nested_model.name, a.node_index) for a in assignments] == [("b", 0), ("b", 1)]
    plan = pa.pipeline_plan(model)
    assert names(plan) == [["inner"], ["inner"]]
    assert plan.stages[1][0].input_keys == plan.stages[0][0].output_keys
    data = np.ones((2, 4), "float32")
    np.testing.assert_allclose(run_plan(plan, data), model(data), atol=1e-6)


# --------------------------------------------------------------------------
# Validation errors


@pytest.fixture
def seq(strategy):
    with strategy.scope():
        return sequential()


@pytest.fixture
def res(strategy):
    with strategy.scope():
        return residual()


def test_error_not_a_list(seq, res):
    for model in (seq, res):
        with pytest.raises(ValueError, match="needs to be a list, but received tuple"):
            pa.set_assignment(model, (0, 0, 1, 1))


def test_error_wrong_length(seq, res):
    with pytest.raises(ValueError, match=r"length .* \(2\) does not match .* graph \(4\)"):
        pa.set_assignment(seq, [0, 1])
    with pytest.raises(ValueError, match=r"length .* \(6\) does not match .* graph \(7\)"):
        pa.set_assignment(res, pa.get_assignment(res)[:-1])


def test_error_functional_element_type(res):
    assignments = split_after(pa.get_assignment(res), "block1_add")
    assignments[0] = SequentialLayerPipelineStageAssignment(assignments[0].layer, 0)
    with pytest.raises(
        ValueError,
        match="layer stem in resnet must be an instance of `FunctionalLayerPipelineStage"
        "Assignment`. Instead .* of type SequentialLayerPipelineStageAssignment",
    ):
        pa.set_assignment(res, assignments)
    assignments[0] = ModelLayerPipelineStageAssignment(assignments[1].layer, 0, 0)
    with pytest.raises(ValueError, match="must be an instance of `FunctionalLayer"):
        pa.set_assignment(res, assignments)


def test_error_nested_element_type(strategy):
    with strategy.scope():
        model, _ = nested_model()
    assignments = pa.get_assignment(model)
    assignments[0].pipeline_stage = 0
    assignments[1] = FunctionalLayerPipelineStageAssignment(assignments[1].nested_model, 0, 0)
    with pytest.raises(
        ValueError,
        match="nested model inner in outer must be an instance of "
        "`FunctionalNestedModelPipelineStageAssignment`",
    ):
        pa.set_assignment(model, assignments)


def test_error_model_element_type(strategy):
    with strategy.scope():
        model = Tower(name="tower")
    model.build((None, 32))
    assignments = tower_assignment(with_mixin(model))
    assignments[0] = SequentialLayerPipelineStageAssignment(model.dense_layer_1, 0)
    with pytest.raises(ValueError, match="must be an instance of `ModelLayerPipelineStage"):
        pa.set_assignment(model, assignments)


def test_error_post_order_mismatch(res):
    assignments = split_after(pa.get_assignment(res), "block1_add")
    assignments[0], assignments[1] = assignments[1], assignments[0]
    with pytest.raises(
        ValueError, match=r"does not match the post-order .* \(block1_conv != stem at index 0\)"
    ):
        pa.set_assignment(res, assignments)


def test_error_node_index(strategy):
    with strategy.scope():
        model = shared_functional()
    assignments = [
        FunctionalLayerPipelineStageAssignment(a.layer, a.node_index, 0)
        for a in pa.get_assignment(model)
    ]
    layer_a = assignments[0].layer
    assignments[0] = FunctionalLayerPipelineStageAssignment(layer_a, 1, 0)
    with pytest.raises(ValueError, match="mismatched nodes of layer a: .* node_index 1"):
        pa.set_assignment(model, assignments)
    assignments[0] = FunctionalLayerPipelineStageAssignment(layer_a, 5, 0)
    with pytest.raises(
        ValueError, match="Layer a has 2 invocation.* assignment for node_index 5"
    ):
        pa.set_assignment(model, assignments)


def test_error_unassigned_stage(seq, res):
    assignments = split_after(pa.get_assignment(res), "block1_add")
    assignments[2].pipeline_stage = None
    with pytest.raises(
        ValueError, match="Layer block1_conv2 with node_index 0 has not been assigned"
    ):
        pa.set_assignment(res, assignments)
    assignments = pa.get_assignment(seq)
    with pytest.raises(ValueError, match="Layer seq_d0 has not been assigned a pipeline stage"):
        pa.set_assignment(seq, assignments)


def test_error_invalid_stage_value(res):
    assignments = split_after(pa.get_assignment(res), "block1_add")
    assignments[1].pipeline_stage = -1
    with pytest.raises(ValueError, match="block1_conv .* stage -1, which is not a valid"):
        pa.set_assignment(res, assignments)


def test_error_dependency_on_a_later_stage(res):
    assignments = split_after(pa.get_assignment(res), "block1_add")
    assignments[0].pipeline_stage = 1  # stem feeds block1_conv, in stage 0
    with pytest.raises(
        ValueError,
        match="Layer block1_conv in pipeline stage 0 has a dependency from a pipeline stage "
        "which has not yet been executed: it uses the output of layer stem in pipeline "
        "stage 1",
    ):
        pa.set_assignment(res, assignments)


def test_error_empty_stages_at_set_time(res):
    assignments = split_after(pa.get_assignment(res), "block1_add")
    for assignment in assignments[4:]:
        assignment.pipeline_stage = 3
    with pytest.raises(
        ValueError, match=r"highest stage .* is stage 3, however the preceding stages \[1, 2\]"
    ):
        pa.set_assignment(res, assignments)


def test_error_empty_stages_at_run_time(strategy):
    with strategy.scope():
        inputs = keras.Input((4,))
        with PipelineStage(0):
            h = keras.layers.Dense(4)(inputs)
        with PipelineStage(2):
            h = keras.layers.Dense(4)(h)
        model = keras.Model(inputs, h)
    assert stages(pa.get_assignment(model)) == [0, 2]
    with pytest.raises(RuntimeError, match=r"preceding stages \[1\] have no assignments"):
        pa.pipeline_plan(model)


def test_check_no_empty_stages():
    ps.check_no_empty_stages([])
    ps.check_no_empty_stages([1, 0, 0])
    with pytest.raises(KeyError, match=r"stages \[0\]"):
        ps.check_no_empty_stages([1], KeyError)


def test_error_sequential_element_type(seq):
    with pytest.raises(
        ValueError,
        match="must be integers, instances of `SequentialLayerPipelineStageAssignment` .* "
        "index 1 \\(for layer seq_d1\\) is '1' of type str",
    ):
        pa.set_assignment(seq, [0, "1", 1, 1])


def test_error_sequential_layer_mismatch(seq):
    other = keras.layers.Dense(1, name="stranger")
    assignments = [0, SequentialLayerPipelineStageAssignment(other, 0), 1, 1]
    with pytest.raises(
        ValueError, match="index 1 .* is for layer stranger, but .* at index 1 is seq_d1"
    ):
        pa.set_assignment(seq, assignments)


def test_error_sequential_first_stage(seq):
    with pytest.raises(ValueError, match="0th pipeline stage, however seq_d0 was assigned to 1"):
        pa.set_assignment(seq, [1, 1, 2, 2])


def test_error_sequential_stage_jump(seq):
    with pytest.raises(
        ValueError,
        match="Layer seq_d2 has been assigned to pipeline stage 2, however the previous layer "
        "in the Sequential model was assigned to pipeline stage 0",
    ):
        pa.set_assignment(seq, [0, 0, 2, 2])
    with pytest.raises(ValueError, match="Layer seq_d2 .* stage 0, however .* stage 1"):
        pa.set_assignment(seq, [0, 1, 0, 1])


def test_stale_assignment_fails_at_run_time(strategy):
    with strategy.scope():
        model, inner = nested_model()
    pa.set_assignment(model, _nested_split(pa.get_assignment(model)))
    inner.add(keras.layers.Dense(4, name="inner_c"))  # inner: 3 layers, 2 assigned
    with pytest.raises(RuntimeError, match="assignments for model outer are no longer valid"):
        pa.pipeline_plan(model)


def _nested_split(assignments):
    assignments[0].pipeline_stage = 0
    children = assignments[1].pipeline_stage_assignments
    children[0].pipeline_stage, children[1].pipeline_stage = 0, 1
    assignments[2].pipeline_stage = 1
    return assignments


class Flattening(keras.Model):
    """Flattens 3-D inputs first: building it with another rank changes its graph."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.flatten = keras.layers.Flatten()
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.out = keras.layers.Dense(3)

    def call(self, inputs):
        x = self.flatten(inputs) if len(inputs.shape) == 3 else inputs
        return self.out(keras.ops.relu(self.hidden(x)))


def _flattening_in_stages(strategy, name: str):
    """A `Flattening` built for 2-D inputs, its 3 layer calls set in stages 0, 1, 1."""
    with strategy.scope():
        model = Flattening(name=name)
    model.build((None, 6))
    assignments = model.get_pipeline_stage_assignment()
    for assignment, stage in zip(assignments, [0, 1, 1]):
        assignment.pipeline_stage = stage
    model.set_pipeline_stage_assignment(assignments)
    return model, assignments


def test_rebuild_into_another_graph_drops_the_assignment(strategy, caplog):
    model, _ = _flattening_in_stages(strategy, "flattening")
    with caplog.at_level(logging.WARNING, logger="keras_ipu"):
        model.build((None, 2, 3))  # a Flatten call first: 4 calls, not 3
        assignments = model.get_pipeline_stage_assignment()
    assert "Model flattening was built again" in caplog.text
    assert "(4 layer calls, before 3)" in caplog.text
    # The new graph's own assignment, as a fresh model built so gets: every call unassigned.
    assert [(type(a.layer).__name__, a.node_index) for a in assignments] == [
        ("Flatten", 0), ("Dense", 0), ("Relu", 0), ("Dense", 0)
    ]
    assert stages(assignments) == [None] * 4
    assert pa.pipeline_plan(model) is None
    assert pa.assignment_to_config(model) == {"pipeline_stage_assignment": []}
    with pytest.raises(ValueError, match=f"{model.flatten.name} with node_index 0 has not been "
                                         f"assigned"):
        model.set_pipeline_stage_assignment(assignments)

    for assignment, stage in zip(assignments, [0, 0, 1, 1]):
        assignment.pipeline_stage = stage
    model.set_pipeline_stage_assignment(assignments)
    assert stages(model.get_pipeline_stage_assignment()) == [0, 0, 1, 1]
    assert names(pa.pipeline_plan(model)) == [
        [model.flatten.name, model.hidden.name], [assignments[2].layer.name, model.out.name]
    ]
    configure(2)
    x, y = data_for("sequential", samples=32)
    x = x.reshape(32, 2, 3)
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", steps_per_execution=4)
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=4)
    before = [w.copy() for w in model.get_weights()]
    history = model.fit(x, y, batch_size=2, epochs=1, shuffle=False, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    assert ipu.utils.execution_report(model, "fit").pipeline.num_stages == 2
    assert not all(np.allclose(b, a) for b, a in zip(before, model.get_weights()))


def test_rebuild_into_the_same_graph_keeps_the_assignment(strategy, caplog):
    model, assignments = _flattening_in_stages(strategy, "same")
    with caplog.at_level(logging.WARNING, logger="keras_ipu"):
        model.build((None, 6))  # the same build: the same graph, not traced again
        assert model.get_pipeline_stage_assignment()[1].layer is assignments[1].layer
        for shape in [(8, 6), (None, 6)]:  # another batch size, then back
            previous = model.get_pipeline_stage_assignment()
            model.build(shape)
            # Traced anew: the calls are the new graph's (a new `relu` op each trace).
            kept = model.get_pipeline_stage_assignment()
            assert stages(kept) == [0, 1, 1]
            assert kept[1].layer is not previous[1].layer
            assert kept[2].inbound_layers == [kept[1].layer]
            model.set_pipeline_stage_assignment(kept)
            plan = pa.pipeline_plan(model)
            assert [len(calls) for calls in plan.stages] == [1, 2]
            assert plan.stages[1][0].operation is kept[1].layer
    assert "built again" not in caplog.text
    data = np.random.default_rng(6).normal(size=(8, 6)).astype("float32")
    np.testing.assert_allclose(run_plan(plan, data), model(data), atol=1e-6)
    assert [item[2] for item in pa.assignment_to_config(model)["pipeline_stage_assignment"]] \
        == [0, 1, 1]


# --------------------------------------------------------------------------
# Sequential add() and pop()


def test_add_and_pop_invalidate_the_assignment(strategy, caplog):
    with strategy.scope():
        model = with_mixin(
            keras.Sequential([keras.Input((4,)), keras.layers.Dense(4), keras.layers.Dense(4)])
        )
    model.set_pipeline_stage_assignment([0, 1])
    assert pa.assignment_to_config(model)["pipeline_stage_assignment_valid"]
    with caplog.at_level(logging.INFO, logger="keras_ipu"):
        model.add(keras.layers.Dense(2))
    assert "Adding a layer to a pipelined Sequential model has invalidated" in caplog.text
    with caplog.at_level(logging.INFO, logger="keras_ipu"):
        assert stages(model.get_pipeline_stage_assignment()) == [0, 1]
    assert "the current assignment is not valid" in caplog.text
    assert not pa.assignment_to_config(model)["pipeline_stage_assignment_valid"]
    with pytest.raises(RuntimeError, match="no longer valid: layers were added or removed"):
        pa.pipeline_plan(model)
    model.set_pipeline_stage_assignment([0, 1, 1])
    assert pa.pipeline_plan(model).num_stages == 2
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="keras_ipu"):
        model.pop()
    assert "Removing a layer from a pipelined Sequential model" in caplog.text
    with pytest.raises(RuntimeError, match="no longer valid"):
        pa.pipeline_plan(model)
    caplog.clear()
    model.reset_pipeline_stage_assignment()
    model.add(keras.layers.Dense(2))  # nothing to invalidate
    assert "invalidated" not in caplog.text


# --------------------------------------------------------------------------
# Summaries


def test_sequential_summary(strategy):
    with strategy.scope():
        model = with_mixin(keras.Sequential(
            [keras.layers.Flatten(name="flatten"), keras.layers.Dense(4, name="dense")],
            name="sequential",
        ))
    lines = []
    model.print_pipeline_stage_assignment_summary(line_length=65, print_fn=lines.append)
    assert lines == [
        'Model: "sequential"',
        "_" * 65,
        "Layer (type)                    Pipeline Stage                   ",
        "=" * 65,
        "flatten (Flatten)               None                             ",
        "_" * 65,
        "dense (Dense)                   None                             ",
        "=" * 65,
    ]
    model.set_pipeline_stage_assignment([0, 1])
    assert pa.assignment_summary(model)[4] == "flatten (Flatten)             0" + " " * 29
    assert len(pa.assignment_summary(model)[1]) == 60


class TFOpLambda(keras.layers.Layer):
    """Stands in for the reference's `tf.multiply(1.0, x)` row."""

    def call(self, inputs):
        return 1.0 * inputs


def test_functional_summary(strategy):
    with strategy.scope():
        input_a = keras.Input((32,), name="input_a")
        input_b = keras.Input((32,), name="input_b")
        a = keras.layers.Flatten(name="flatten")(input_a)
        b = keras.layers.Flatten(name="flatten_1")(input_b)
        x = keras.layers.Concatenate(name="concatenate")([a, b])
        x = keras.layers.Dense(4, name="dense")(x)
        x = TFOpLambda(name="tf.math.multiply")(x)
        model = with_mixin(keras.Model([input_a, input_b], x, name="model"))
    lines = []
    model.print_pipeline_stage_assignment_summary(line_length=85, print_fn=lines.append)
    rule = "_" * 85
    assert lines == [
        'Model: "model"',
        rule,
        "Layer (type) (node index)         Input Layers                      Pipeline Stage   ",
        "=" * 85,
        "flatten (Flatten) (0)             input_a                           None             ",
        rule,
        "flatten_1 (Flatten) (0)           input_b                           None             ",
        rule,
        "concatenate (Concatenate) (0)     flatten                           None             ",
        "                                  flatten_1                                          ",
        rule,
        "dense (Dense) (0)                 concatenate                       None             ",
        rule,
        "tf.math.multiply (TFOpLambda) (0) dense                             None             ",
        "=" * 85,
    ]
    assert all(len(line) == 89 for line in pa.assignment_summary(model)[1:])


def test_nested_summary(strategy):
    with strategy.scope():
        model, _ = nested_model()
    lines = pa.assignment_summary(model, line_length=80)
    assert [line.rstrip() for line in lines] == [
        'Model: "outer"',
        "_" * 80,
        "Layer (type) (node index)       Input Layers                    Pipeline Stage",
        "=" * 80,
        "pre (Dense) (0)                 x                               None",
        "=" * 80,
        'Nested Model: "inner"',
        "-" * 80,
        "inner_a (Dense)                                                 None",
        "_" * 80,
        "inner_b (Dense)                                                 None",
        "=" * 80,
        "post (Dense) (0)                inner                           None",
        "=" * 80,
    ]
    assert all(len(line) == 80 for line in lines[1:] if not line.startswith("Nested"))


# --------------------------------------------------------------------------
# Plans


def test_plan_of_a_two_stage_split(res):
    pa.set_assignment(res, split_after(pa.get_assignment(res), "block1_add"))
    plan = pa.pipeline_plan(res)
    assert plan.model_name == "resnet" and plan.num_stages == 2
    assert plan.input_keys == (0,) and plan.output_keys == (7,)
    assert plan.inputs == tuple(res.inputs) and plan.outputs == tuple(res.outputs)
    assert [[call.output_keys for call in calls] for calls in plan.stages] == [
        [(1,), (2,), (3,), (4,)], [(5,), (6,), (7,)]
    ]
    assert plan.stages[0][3].input_keys == (1, 3)  # block1_add([stem, block1_conv2])
    assert plan.stage_inputs == ((0,), (4,))
    assert plan.stage_outputs == ((4,), (7,))
    assert plan.live_after == ((4,), (7,))
    assert plan.tensors[4] is res.get_layer("block1_add").output
    assert [layer.name for layer in plan.stage_layers(1)] == RESIDUAL_ORDER[4:]
    data = np.random.default_rng(4).normal(size=(2, 8)).astype("float32")
    first = run_stage(plan, 0, {0: data})
    assert sorted(first) == [1, 2, 3, 4]
    second = run_stage(plan, 1, {4: first[4]}, training=False)
    np.testing.assert_allclose(second[7], res(data), atol=1e-6)


def test_plan_forwards_tensors_a_later_stage_needs(strategy):
    with strategy.scope():
        inputs = keras.Input((4,), name="x")
        with PipelineStage(0):
            h = keras.layers.Dense(4, name="h")(inputs)
            side = keras.layers.Dense(4, name="side")(inputs)
        with PipelineStage(1):
            h = keras.layers.Dense(4, name="mid")(h)
        with PipelineStage(2):
            out = keras.layers.Add(name="join")([h, side])
        model = keras.Model(inputs, [out, side])
    plan = pa.pipeline_plan(model)
    key = {call.operation.name: call.output_keys[0] for s in plan.stages for call in s}
    assert plan.output_keys == (key["join"], key["side"])
    assert set(plan.live_after[0]) == {key["h"], key["side"]}
    assert set(plan.live_after[1]) == {key["mid"], key["side"]}  # `side` passes through
    assert plan.stage_inputs[2] == tuple(sorted([key["mid"], key["side"]]))
    assert plan.stage_outputs[0] == tuple(sorted([key["h"], key["side"]]))
    data = np.random.default_rng(5).normal(size=(2, 4)).astype("float32")
    for got, want in zip(run_plan(plan, data), model(data)):
        np.testing.assert_allclose(got, want, atol=1e-6)


def test_plan_passes_the_training_flag(strategy):
    with strategy.scope():
        inputs = keras.Input((4,))
        with PipelineStage(0):
            h = keras.layers.Dense(4)(inputs)
        with PipelineStage(1):
            h = keras.layers.Dropout(0.99)(h)
        model = keras.Model(inputs, h)
    plan = pa.pipeline_plan(model)
    data = np.ones((2, 4), "float32")
    np.testing.assert_allclose(run_plan(plan, data, training=False), model(data))
    assert np.count_nonzero(run_plan(plan, data, training=True)) < 8


# --------------------------------------------------------------------------
# Saving


def roundtrip(config):
    return json.loads(json.dumps(config))


def test_config_round_trip_sequential(seq, strategy):
    pa.set_assignment(seq, [0, 0, 1, 1])
    config = roundtrip(pa.assignment_to_config(seq))
    assert config == {
        "pipeline_stage_assignment": [0, 0, 1, 1],
        "pipeline_stage_assignment_valid": True,
    }
    with strategy.scope():
        loaded = sequential()
    pa.assignment_from_config(loaded, config)
    assert stages(pa.get_assignment(loaded)) == [0, 0, 1, 1]
    assert pa.assignment_to_config(sequential())["pipeline_stage_assignment"] == []


def test_config_round_trip_functional(res, strategy):
    pa.set_assignment(res, split_after(pa.get_assignment(res), "block1_add"))
    config = roundtrip(pa.assignment_to_config(res))
    assert config == {
        "pipeline_stage_assignment": [
            [res.layers.index(res.get_layer(name)), 0, stage]
            for name, stage in zip(RESIDUAL_ORDER, [0, 0, 0, 0, 1, 1, 1])
        ]
    }
    assert config["pipeline_stage_assignment"][0] == [1, 0, 0]  # layers[0] is the input
    with strategy.scope():
        loaded = residual()
    pa.assignment_from_config(loaded, config)
    assert stages(pa.get_assignment(loaded)) == [0, 0, 0, 0, 1, 1, 1]
    config["pipeline_stage_assignment"][0][0] = 2
    with pytest.raises(ValueError, match="does not match its graph at layer call stem"):
        pa.assignment_from_config(residual(), config)


def test_config_round_trip_nested_and_scoped(strategy):
    with strategy.scope():
        model, _ = nested_model()
    assignments = pa.get_assignment(model)
    assignments[0].pipeline_stage = 0
    children = assignments[1].pipeline_stage_assignments
    children[0].pipeline_stage, children[1].pipeline_stage = 0, 1
    assignments[2].pipeline_stage = 1
    pa.set_assignment(model, assignments)
    config = roundtrip(pa.assignment_to_config(model))
    assert [item[1:] for item in config["pipeline_stage_assignment"]] == [
        [0, 0], [0, [0, 1]], [0, 1]
    ]
    with strategy.scope():
        loaded, _ = nested_model()
    pa.assignment_from_config(loaded, config)
    assert stages(pa.get_assignment(loaded)) == [0, [0, 1], 1]
    # Stages of PipelineStage scopes are saved too.
    with strategy.scope():
        inputs = keras.Input((4,))
        with PipelineStage(0):
            h = keras.layers.Dense(4)(inputs)
        with PipelineStage(1):
            h = keras.layers.Dense(4)(h)
    scoped = keras.Model(inputs, h)
    assert [item[2] for item in pa.assignment_to_config(scoped)["pipeline_stage_assignment"]] \
        == [0, 1]


def test_config_of_an_unbuilt_subclassed_model_waits_for_its_graph(strategy):
    with strategy.scope():
        model = Tower(name="saved")
    model.build((None, 32))
    pa.set_assignment(model, tower_assignment(with_mixin(model)))
    config = roundtrip(pa.assignment_to_config(model))
    assert [item[1:] for item in config["pipeline_stage_assignment"]][:3] == [
        [0, 0], [0, 1], [1, 1]
    ]
    with strategy.scope():
        loaded = Tower(name="loaded")
    assert pa.assignment_to_config(loaded) == {"pipeline_stage_assignment": []}
    pa.assignment_from_config(loaded, config)
    assert pa.assignment_to_config(loaded) == config  # still pending
    with pytest.raises(RuntimeError, match="which has not been built yet"):
        pa.get_assignment(loaded)
    loaded.build((None, 32))
    assert stages(pa.get_assignment(loaded)) == [0, 1, 1, 2, 2, 2, 3]
    assert pa.pipeline_plan(loaded).num_stages == 4


def test_public_names():
    assert pa.PipelineStage is ps.PipelineStage
    for name in pa.__all__ + ps.__all__:
        assert getattr(pa, name, None) is not None or getattr(ps, name, None) is not None
    assert ipu.ipu_strategy.IPUStrategy is not None


# --------------------------------------------------------------------------
# Contracts of the Keras internals these modules rely on (keras 3.15.x)


def test_contract_operation_and_node_init_are_the_recording_seams():
    from keras.src.ops.node import Node
    from keras.src.ops.operation import Operation

    assert "__init__" in Operation.__dict__ and "__init__" in Node.__dict__
    # Layer.__init__ calls Operation.__init__; Layer.__call__ makes a Node at its end.
    layer = keras.layers.Dense(2)
    output = layer(keras.Input((3,)))
    node = layer._inbound_nodes[0]
    assert isinstance(node, Node) and node.operation is layer and node.outputs == [output]
    assert output._keras_history.operation is layer and output._keras_history.node_index == 0


def test_contract_node_arguments():
    inputs = keras.Input((3,))
    output = keras.layers.Dense(2)(inputs)
    arguments = output._keras_history.operation._inbound_nodes[0].arguments
    assert arguments.keras_tensors == [inputs] and arguments.args == (inputs,)
    args, kwargs = arguments.fill_in({id(inputs): "value"})
    assert args == ("value",) and kwargs == {}


def test_contract_sequential_functional_and_call_context_args():
    model = keras.Sequential([keras.layers.Dense(2)])
    assert model._functional is None
    model.build((None, 3))
    assert model._functional.input is model.inputs[0]
    assert "training" in keras.layers.Dropout(0.5)._call_context_args


def test_contract_build_config_of_subclassed_models():
    model = Tower()
    with pytest.warns(UserWarning):
        model.build(keras.Input((3,), dtype="int32"))
    assert model.get_build_config()["input_shape"].dtype == "int32"
