"""Contracts of the Keras private APIs keras_ipu relies on (keras pinned to 3.15.x).

Each test pins one private API: if a Keras upgrade changes it, the test that
names it fails, and the code that uses it is the place to look.
"""

from __future__ import annotations

import inspect

import keras
import numpy as np
import pytest
from keras.src.backend.jax.trainer import JAXTrainer


def _params(function) -> list[str]:
    return list(inspect.signature(function).parameters)


def test_keras_version_is_the_pinned_minor():
    assert keras.__version__.startswith("3.15.")


def test_model_new_is_the_seam_for_every_model_kind():
    # keras_ipu.keras.extensions replaces Model.__new__.
    from keras.src.models.model import Model

    assert "__new__" in Model.__dict__
    assert _params(Model.__dict__["__new__"].__func__) == ["cls", "args", "kwargs"]
    for kind in (keras.Sequential, keras.Model):
        assert kind.__new__ is Model.__new__ or issubclass(kind, Model)


def test_functional_init_arguments():
    from keras.src.models.model import functional_init_arguments

    inputs = keras.Input((2,))
    assert functional_init_arguments((inputs, inputs), {})
    assert not functional_init_arguments((), {})


def test_stateless_steps_take_state_and_data():
    # The on-device loop calls these inside lax.scan.
    for name in ("train_step", "test_step", "predict_step"):
        assert _params(getattr(JAXTrainer, name)) == ["self", "state", "data"]


def test_jax_state_helpers():
    assert _params(JAXTrainer._get_jax_state) == [
        "self",
        "trainable_variables",
        "non_trainable_variables",
        "optimizer_variables",
        "metrics_variables",
        "purge_model_variables",
    ]
    assert _params(JAXTrainer.jax_state_sync) == ["self"]
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model._jax_state = {"trainable_variables": [np.ones((2, 1)), np.zeros((1,))]}
    model._jax_state_synced = False
    model.jax_state_sync()
    np.testing.assert_array_equal(model.get_weights()[0], np.ones((2, 1)))
    assert model._jax_state_synced


def test_trainer_helpers_used_by_the_ipu_loop():
    from keras.src.trainers.trainer import Trainer

    assert _params(Trainer._symbolic_build) == ["self", "iterator", "data_batch"]
    assert _params(Trainer._assert_compile_called) == ["self", "method_name"]
    assert _params(Trainer._get_metrics_result_or_logs) == ["self", "logs"]
    assert _params(Trainer._flatten_metrics_in_order) == ["self", "logs"]
    assert _params(Trainer._should_eval) == ["self", "epoch", "validation_freq"]
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    assert model._initial_epoch is None
    assert model.steps_per_execution == 1
    for name in ("make_train_function", "make_test_function", "make_predict_function"):
        assert hasattr(JAXTrainer, name)


def test_the_symbolic_build_pulls_a_batch_only_for_what_is_unbuilt():
    # trainer._BuildPass: Keras' fit draws a shuffled pass for its build only when it
    # builds; it takes the first batch of a list its epoch iterator yields.
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    pulled = []

    def iterator():
        pulled.append(True)
        yield 0, 0, [(np.zeros((4, 2), "float32"), np.zeros((4, 1), "float32"))]

    model._symbolic_build(iterator=iterator())
    assert pulled == [True] and model._compile_metrics.built
    model._symbolic_build(iterator=iterator())
    assert pulled == [True]  # everything built: no batch, no draw


def test_data_adapter_functions():
    from keras.src.trainers.data_adapters import (
        array_slicing,
        data_adapter_utils,
        get_data_adapter,
    )

    assert _params(get_data_adapter) == [
        "x", "y", "sample_weight", "batch_size", "steps_per_epoch", "shuffle", "class_weight"
    ]
    weights = data_adapter_utils.class_weight_to_sample_weights(np.array([0, 1, 1]), {1: 2.0})
    np.testing.assert_array_equal(weights, [1.0, 2.0, 2.0])
    assert data_adapter_utils.unpack_x_y_sample_weight((1, 2)) == (1, 2, None)
    (train, validation) = array_slicing.train_validation_split(
        (np.arange(10), np.arange(10), None), validation_split=0.2
    )
    assert len(train[0]) == 8 and len(validation[0]) == 2


def test_callback_list_and_logs():
    from keras.src.utils.python_utils import pythonify_logs

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    callbacks = keras.callbacks.CallbackList(
        None, add_history=True, add_progbar=True, verbose=0, epochs=2, steps=5, model=model
    )
    assert callbacks.params == {"verbose": 0, "epochs": 2, "steps": 5}
    assert any(isinstance(c, keras.callbacks.History) for c in callbacks.callbacks)
    assert pythonify_logs({"a": np.float32(1.5)}) == {"a": 1.5}


def test_pickling_and_saving_helpers():
    import keras.src.saving.saving_lib as saving_lib

    assert _params(saving_lib._save_model_to_fileobj) == ["model", "fileobj", "weights_format"]
    assert hasattr(keras.Model, "_unpickle_model")


def test_backend_floatx_helpers():
    from keras.src import backend

    assert backend.is_float_dtype("float64") and not backend.is_float_dtype("int32")
    assert backend.floatx() == "float32"


def test_loss_and_metrics_pieces_of_the_train_step():
    # keras_ipu.keras.steps rebuilds Keras' train step from these pieces to
    # accumulate gradients and sum them over replicas before the optimizer.
    assert _params(JAXTrainer.compute_loss_and_updates) == [
        "self",
        "trainable_variables",
        "non_trainable_variables",
        "metrics_variables",
        "x",
        "y",
        "sample_weight",
        "training",
        "optimizer_variables",
    ]
    assert _params(JAXTrainer._update_metrics_variables) == [
        "self", "metrics_variables", "unscaled_loss", "x", "y", "y_pred", "sample_weight"
    ]
    optimizer = keras.optimizers.SGD(0.5)
    variable = keras.Variable(np.ones(2, "float32"))
    optimizer.build([variable])
    new_vars, new_opt = optimizer.stateless_apply(
        [v.value for v in optimizer.variables], [np.ones(2, "float32")], [variable.value]
    )
    np.testing.assert_allclose(new_vars[0], [0.5, 0.5])
    assert int(new_opt[0]) == 1  # iterations


def test_saving_calls_the_asset_hooks(tmp_path):
    # IPU options travel in the .keras file through save_assets/load_assets.
    calls = []

    class WithAssets(keras.Sequential):
        def save_assets(self, dir_path):
            calls.append("save")
            open(f"{dir_path}/marker.txt", "w").write("ipu")

        def load_assets(self, dir_path):
            calls.append(open(f"{dir_path}/marker.txt").read())

    model = WithAssets([keras.Input((2,)), keras.layers.Dense(1)])
    model.save(tmp_path / "m.keras")
    keras.models.load_model(
        tmp_path / "m.keras", custom_objects={"WithAssets": WithAssets}
    )
    assert calls == ["save", "ipu"]


def test_pieces_the_pipelined_executor_uses():
    # keras_ipu.keras.pipelined runs stages with these.
    from keras.src.layers.layer import Layer
    from keras.src.trainers.trainer import Trainer

    assert _params(Trainer.stateless_compute_loss) == [
        "self", "trainable_variables", "non_trainable_variables", "metrics_variables",
        "x", "y", "y_pred", "sample_weight", "training",
    ]
    assert "return_losses" in _params(Layer.stateless_call)
    flatten, dropout = keras.layers.Flatten(), keras.layers.Dropout(0.5)
    assert not flatten._call_has_training_arg and dropout._call_has_training_arg
    # Optimizer slots are named after their variable, so per-IPU clones map back.
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    optimizer = keras.optimizers.Adam()
    optimizer.build(model.trainable_variables)
    clone = keras.optimizers.Adam.from_config(optimizer.get_config())
    clone.build(model.trainable_variables[1:])
    names = {v.name for v in optimizer.variables}
    assert {v.name for v in clone.variables} <= names
    assert len(clone.variables) == 2 + 2  # iteration, learning rate, bias momentum/velocity


def test_loss_scale_optimizer_pieces_the_pipelined_executor_uses():
    # keras_ipu.keras.pipelined clones a LossScaleOptimizer per IPU, maps each
    # clone's k-th variable of a name to the optimizer's k-th of that name,
    # and asks the last stage's clone for the loss scale (`scale_loss` in a
    # StatelessScope, as Keras' JAX train step does).
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1),
                                                    initial_scale=8.0)
    optimizer.build(model.trainable_variables)
    clone = keras.optimizers.LossScaleOptimizer.from_config(optimizer.get_config())
    clone.build(model.trainable_variables[1:])
    names = [v.name for v in optimizer.variables]
    assert names[:4] == ["iteration", "learning_rate", "step_counter", "dynamic_scale"]
    assert names.count("iteration") == 2  # its own, then the inner optimizer's
    assert [v.name for v in clone.variables] == names  # SGD without momentum: no slots
    values = [np.asarray(v.value) for v in clone.variables]
    values[3] = np.float32(32.0)
    with keras.StatelessScope(state_mapping=list(zip(clone.variables, values))):
        assert float(clone.scale_loss(np.float32(1.0))) == 32.0
    # Non-finite gradients skip the update and halve the scale (stateless).
    weights = [np.asarray(v.value) for v in model.trainable_variables[1:]]
    new_weights, new_values = clone.stateless_apply(values, [np.full((2,), np.inf)], weights)
    np.testing.assert_array_equal(new_weights[0], weights[0])
    assert float(new_values[3]) == 16.0


def test_losses_override_and_stateless_loss_collection():
    # keras_ipu.keras.pipelined: `_losses_override` feeds the stages' additional
    # losses to `compute_loss` of the last stage (as Keras' own JAX train step
    # does); a layer called in a `StatelessScope(collect_losses=True)` leaves
    # its `add_loss` values in `scope.losses`.
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(loss="mse")
    assert model._losses_override == []
    model._losses_override = [keras.ops.convert_to_tensor(2.5)]
    assert float(model.losses[0]) == 2.5
    total = model.compute_loss(y=np.zeros((1, 1)), y_pred=np.zeros((1, 1)))
    assert float(total) == 2.5
    model._losses_override = []

    class Penalty(keras.layers.Layer):
        def call(self, x):
            self.add_loss(keras.ops.sum(x))
            return x

    layer = Penalty()
    with keras.StatelessScope(collect_losses=True) as scope:
        layer(np.ones((2, 2), "float32"))
    assert [float(loss) for loss in scope.losses] == [4.0]


def test_keras_convolutions_look_up_lax_convolution_when_they_run():
    # keras_ipu.device.convolutions replaces `jax.lax.conv_general_dilated` while
    # programs are traced on CPUs: Keras' JAX backend must look it up at call time.
    import jax

    from keras_ipu.device import convolutions, loops

    layers = [keras.layers.Conv2D(2, 3), keras.layers.DepthwiseConv2D(3),
              keras.layers.SeparableConv2D(2, 3), keras.layers.Conv1D(2, 2)]
    inputs = [np.ones((1, 6, 6, 2), "float32")] * 3 + [np.ones((1, 6, 2), "float32")]
    for layer, x in zip(layers, inputs):
        layer.build(x.shape)
        weights = [v.value for v in layer.trainable_variables]

        def loss(weights, x, layer=layer):
            outputs, _ = layer.stateless_call(weights, [], x)
            return (outputs ** 2).sum()

        plain = jax.make_jaxpr(jax.grad(loss))(weights, x)
        with convolutions.canonical_convolutions():
            routed = jax.make_jaxpr(jax.grad(loss))(weights, x)
        assert loops.slow_in_loops(plain) > 0, layer.name
        assert loops.slow_in_loops(routed) == 0, layer.name
        assert loops.convolution_count(routed) > 0, layer.name


def test_a_built_subclassed_model_records_its_build_shape():
    # keras_ipu.keras.export reads `_build_shapes_dict` for the input signature of a
    # subclassed model built with `model.build(input_shape)`.
    class Small(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(2)

        def call(self, x):
            return self.dense(x)

    model = Small()
    model.build((3, 4))
    assert model._build_shapes_dict == {"input_shape": (3, 4)}


def test_optimizer_slots_built_in_a_stateless_scope_wait_for_values():
    # keras_ipu.keras.pipelined.flat_optimizer builds clones that allocate
    # nothing, and parses slot names `<variable name>_<slot>`.
    from keras.src.backend.common import global_state

    optimizer = keras.optimizers.Adam()
    pending = list(global_state.get_global_attribute("uninitialized_variables") or [])
    with keras.StatelessScope(initialize_variables=False):
        optimizer.build([keras.Variable(initializer="zeros", shape=(5,), dtype="float32",
                                        name="w")])
    waiting = global_state.get_global_attribute("uninitialized_variables")
    assert [v.name for v in waiting[len(pending):]] == ["w", "w_momentum", "w_velocity"]
    assert [v.name for v in optimizer.variables] == ["iteration", "learning_rate",
                                                     "w_momentum", "w_velocity"]
    assert optimizer.variables[2]._value is None
    global_state.set_global_attribute("uninitialized_variables", pending)


def test_weight_decay_exclusions_are_asked_per_variable():
    # keras_ipu.keras.pipelined.model copies exclusions to each IPU's optimizer
    # clone (they are not in the config), asking `_use_weight_decay`.
    optimizer = keras.optimizers.AdamW(weight_decay=0.1)
    optimizer.exclude_from_weight_decay(var_names=["bias"])
    assert "exclude" not in str(optimizer.get_config())
    bias = keras.Variable(np.zeros(3, "float32"), name="bias")
    kernel = keras.Variable(np.zeros((2, 3), "float32"), name="kernel")
    assert optimizer._use_weight_decay(bias) is False
    assert optimizer._use_weight_decay(kernel) is True


def test_a_layers_output_is_inferred_in_the_symbolic_scope():
    # keras_ipu.ops.symbolic: collectives computed as a group's first replica there.
    from keras.src.backend.common.symbolic_scope import in_symbolic_scope

    seen = []

    class Probe(keras.layers.Layer):
        def call(self, x):
            seen.append(in_symbolic_scope())
            return x

    keras.Sequential([keras.Input((2,)), Probe()])
    Probe()(np.ones((1, 2), "float32"))
    assert seen == [True, False]


def test_array_likes_are_recognised_by_the_array_adapter():
    # keras_ipu.keras.data passes the batch size for what Keras slices.
    from keras.src.trainers.data_adapters import array_data_adapter

    class ArrayLike:
        def __array__(self, dtype=None, copy=None):
            return np.zeros((4, 2))

    assert array_data_adapter.can_convert_arrays((ArrayLike(), None, None))
    assert not array_data_adapter.can_convert_arrays((iter([1]), None, None))


def test_fit_evaluate_and_predict_are_the_jax_trainers():
    # keras_ipu.keras.extensions routes them to the IPUs for IPU models (overrides' super()).
    from keras_ipu.keras import extensions

    extensions.install()
    for name in ("fit", "evaluate", "predict"):
        owners = [k for k in keras.Model.__mro__ if name in k.__dict__]
        assert owners[0] is JAXTrainer
        assert getattr(JAXTrainer, name).__wrapped__ is extensions._original_trainer_methods[name]


def test_loss_scale_optimizers_handle_finite_and_non_finite_updates_statelessly():
    # keras_ipu.keras.pipelined.update: a weightless IPU's clone moves its scale by
    # every IPU's finiteness through these two.
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1),
                                                    initial_scale=8.0)
    optimizer.build([])
    values = [v.value for v in optimizer.variables]
    names = [v.name for v in optimizer.variables]
    _, halved = optimizer._stateless_handle_non_finite_grads(values, [])
    _, kept = optimizer._stateless_handle_finite_grads(values, [], [])
    assert float(halved[names.index("dynamic_scale")]) == 4.0
    assert float(kept[names.index("dynamic_scale")]) == 8.0
    assert int(kept[names.index("step_counter")]) == 1


def test_model_classes_define_from_config_and_ignore_keys_they_do_not_know():
    # keras_ipu.keras.model_config wraps `Model.from_config` (which Functional inherits) and
    # `Sequential.from_config`, and puts the IPU options in Functional and Sequential configs.
    from keras.src.models.functional import Functional
    from keras.src.models.model import Model
    from keras.src.models.sequential import Sequential

    assert isinstance(Model.__dict__["from_config"], classmethod)
    assert isinstance(Sequential.__dict__["from_config"], classmethod)
    assert "from_config" not in Functional.__dict__
    inputs = keras.Input((3,))
    functional = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    sequential = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    for model in (functional, sequential):
        config = {**model.get_config(), "a_key_keras_does_not_know": {"x": 1}}
        assert type(type(model).from_config(config)) is type(model)


def test_keras_masks_are_tensor_attributes():
    # keras_ipu.keras.pipelined.model sends a tensor's mask across stages with it.
    from keras.src.backend.common import masking

    inputs = keras.Input((3, 2))
    masked = keras.layers.Masking()(inputs)
    assert tuple(masking.get_keras_mask(masked).shape) == (None, 3)
    value = keras.ops.ones((1, 3, 2))
    masking.set_keras_mask(value, keras.ops.array([[True, False, True]]))
    assert keras.ops.convert_to_numpy(masking.get_keras_mask(value)).tolist() == [
        [True, False, True]]


def test_the_metric_resets_keras_ipu_replaces_zero_what_it_says():
    # keras_ipu.keras.metric_reset: these reset_state functions only zero these variables,
    # and these containers only reset the metrics it lists.
    from keras.src.trainers.compile_utils import CompileMetrics, MetricsList

    from keras_ipu.keras.metric_reset import CONTAINED_METRICS, ZEROED_VARIABLES

    class Plain(keras.metrics.Metric):
        def __init__(self):
            super().__init__()
            self.a = self.add_variable(shape=(2,), initializer="ones", name="a")

    for metric in (Plain(), keras.metrics.Mean(), keras.metrics.Sum()):
        for variable in metric.variables:
            variable.assign(np.ones(variable.shape))
        zeroed = {id(v) for v in ZEROED_VARIABLES[type(metric).reset_state](metric)}
        metric.reset_state()
        assert zeroed and all((np.asarray(v.value) == 0).all() == (id(v) in zeroed)
                              for v in metric.variables)
    inner = keras.metrics.Mean()
    assert CONTAINED_METRICS[MetricsList.reset_state](MetricsList([inner])) == [inner]
    compiled = CompileMetrics(["mae"], ["mse"])
    compiled.build(np.ones((2, 1)), np.ones((2, 1)))
    listed = CONTAINED_METRICS[CompileMetrics.reset_state](compiled)
    assert [type(m) for m in listed] == [MetricsList, MetricsList]
    assert {id(v) for m in listed for v in m.variables} == {id(v) for v in compiled.variables}


def test_batch_normalization_takes_its_training_statistics_from_moments(monkeypatch):
    # keras_ipu.keras.batch_norm_groups replaces `BatchNormalization._moments(inputs, mask)`,
    # from which `call` in training takes the statistics that normalise the batch and move
    # the moving ones; it reads `_reduction_axes` (the axes they reduce), and finds the
    # layers with `_flatten_layers(include_self=False, recursive=True)`.
    from keras.src.layers.normalization.batch_normalization import BatchNormalization

    from keras_ipu.keras import batch_norm_groups

    # Keras' own, also once an earlier test installed keras_ipu's in its place.
    keras_moments = batch_norm_groups._KERAS_MOMENTS or BatchNormalization._moments
    assert keras_moments.__module__.startswith("keras.")
    assert _params(keras_moments) == ["self", "inputs", "mask"]
    masks = []

    def moments(self, inputs, mask):
        masks.append(mask)
        return keras.ops.full((3,), 2.0), keras.ops.full((3,), 4.0)

    monkeypatch.setattr(BatchNormalization, "_moments", moments)
    layer = BatchNormalization(momentum=0.0, epsilon=0.0, axis=-1)
    outputs = layer(np.zeros((2, 5, 3), "float32"), training=True)
    assert masks == [None] and layer._reduction_axes == [0, 1]
    np.testing.assert_allclose(keras.ops.convert_to_numpy(outputs), np.full((2, 5, 3), -1.0))
    np.testing.assert_allclose(layer.moving_mean.numpy(), np.full(3, 2.0))
    np.testing.assert_allclose(layer.moving_variance.numpy(), np.full(3, 4.0))
    inner = keras.Sequential([keras.Input((3,)), BatchNormalization()])
    outer = keras.Sequential([keras.Input((3,)), inner, keras.layers.Dense(1)])
    flattened = outer._flatten_layers(include_self=False, recursive=True)
    assert any(isinstance(layer, BatchNormalization) for layer in flattened)


def test_flatten_layers_lists_a_models_layers_and_a_layers_direct_children():
    # keras_ipu.keras.pipelined.program sets the trainable flags the report traces with,
    # holders first: it lists the model's layers with `_flatten_layers(include_self=True,
    # recursive=True)` (each once, a shared layer too) and each layer's held ones with
    # `_flatten_layers(include_self=False, recursive=False)`; a holder's flag overwrites
    # the flags of the layers and variables it holds.
    embedding = keras.layers.Embedding(10, 4)

    class Head(keras.layers.Layer):
        def __init__(self, held):
            super().__init__()
            self.held = held

        def call(self, x):
            return keras.ops.matmul(x, keras.ops.transpose(self.held.embeddings))

    ids = keras.Input((2,), dtype="int32")
    head = Head(embedding)
    model = keras.Model(ids, head(embedding(ids)))
    every = list(model._flatten_layers(include_self=True, recursive=True))
    assert every[0] is model and every.count(embedding) == 1 and head in every
    assert list(head._flatten_layers(include_self=False, recursive=False)) == [embedding]
    embedding.trainable = False
    head.trainable = True  # the holder's flag reaches the held layer and its variables
    assert embedding.trainable and embedding.embeddings.trainable


def test_a_stateless_scope_passes_every_assignment_through_add_update():
    # keras_ipu.keras.assignments records the variables a compiled computation assigns by
    # overriding StatelessScope.add_update, and nests in an enclosing scope it finds with
    # get_stateless_scope; functional_ops reads state_mapping.
    from keras.src.backend.common import stateless_scope

    seen = []

    class Recording(stateless_scope.StatelessScope):
        def add_update(self, update):
            seen.append(update[0])
            super().add_update(update)

    variable = keras.Variable(np.zeros(2, np.float32))
    generator = keras.random.SeedGenerator(1)
    assert stateless_scope.get_stateless_scope() is None
    with Recording(initialize_variables=False) as scope:
        assert stateless_scope.get_stateless_scope() is scope
        variable.assign_add(np.ones(2, np.float32))
        keras.random.uniform((2,), seed=generator)
    assert seen == [variable, generator.state] and id(variable) in scope.state_mapping
    np.testing.assert_array_equal(scope.get_current_value(variable), [1, 1])
    np.testing.assert_array_equal(variable.numpy(), [0, 0])


def test_variables_made_in_a_stateless_scope_wait_for_initialize_all_variables():
    # keras_ipu.keras.assignments: a computation may make variables (optimizer slots)
    # in its scope, made with initialize_variables=False; they are initialized after it
    # runs, and a scope collecting losses gives them to `layer.losses` inside.
    from keras.src.backend.common import stateless_scope, variables

    layer = keras.layers.Dense(1, activity_regularizer=keras.regularizers.L2(1.0))
    layer.build((None, 2))
    with stateless_scope.StatelessScope(collect_losses=True,
                                        initialize_variables=False) as scope:
        made = keras.Variable(initializer="ones", shape=(2,))
        layer(np.ones((1, 2), np.float32))
        assert len(layer.losses) == 1 and len(scope.losses) == 1
    variables.initialize_all_variables()
    np.testing.assert_array_equal(made.numpy(), [1, 1])
    with keras.StatelessScope():  # nothing left waiting
        pass


def test_model_save_and_save_weights_are_keras_models_own():
    # keras_ipu.keras.saving routes them for IPU models (an override's super() included).
    from keras.src.models.model import Model

    from keras_ipu.keras import extensions, saving

    extensions.install()
    for name in ("save", "save_weights"):
        owners = [k for k in keras.Sequential.__mro__ if name in k.__dict__]
        assert owners[0] is Model
        assert getattr(Model, name).__wrapped__ is saving._KERAS_SAVES[name]
        assert _params(saving._KERAS_SAVES[name])[:3] == ["self", "filepath", "overwrite"]


def test_a_pydataset_adapter_runs_its_workers_with_an_enqueuer():
    # keras_ipu.keras.data stops it for a pass left under way, without `on_epoch_end`.
    from keras.src.trainers.data_adapters.py_dataset_adapter import PyDatasetAdapter

    class Batches(keras.utils.PyDataset):
        def __init__(self):
            super().__init__(workers=2)

        def __len__(self):
            return 2

        def __getitem__(self, index):
            return np.zeros((2, 1)), np.zeros((2, 1))

    adapter = PyDatasetAdapter(Batches(), shuffle=False)
    adapter.on_epoch_begin()
    next(iter(adapter.get_numpy_iterator()))
    assert adapter.enqueuer is not None and adapter.enqueuer.is_running()
    adapter.enqueuer.stop()
    assert not adapter.enqueuer.is_running()


def test_an_optimizer_keeps_its_learning_rate_in_learning_rate_attribute():
    # keras/pipelined/rebuilt_optimizer.py hides a schedule from `get_config` by
    # setting `_learning_rate` to None (Keras then writes 0.5), and gives the copy
    # the schedule through the `learning_rate` setter.
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
    optimizer = keras.optimizers.Adam(schedule)
    assert optimizer._learning_rate is schedule
    assert isinstance(keras.optimizers.Adam(0.1)._learning_rate, keras.Variable)
    optimizer._learning_rate = None
    assert optimizer.get_config()["learning_rate"] == 0.5
    copy = keras.optimizers.Adam(0.5)
    copy.learning_rate = schedule
    assert copy._learning_rate is schedule
    assert not any(isinstance(v, keras.Variable) and "learning_rate" in v.name
                   for v in copy.variables)  # the float's variable is let go


def test_an_optimizer_lists_the_variables_it_was_built_with():
    # keras/pipelined/model.py refuses to train other variables than those.
    variables = [keras.Variable(np.ones((2,)), name="a"), keras.Variable(np.ones((3,)), name="b")]
    optimizer = keras.optimizers.Adam()
    optimizer.build(variables)
    assert [id(v) for v in optimizer._trainable_variables] == [id(v) for v in variables]


def test_a_variables_path_is_its_path_attribute_and_optimizer_slots_are_named_by_it():
    # keras/pipelined/flat_optimizer.stand_in_variable sets `_path`, keeping the name
    # apart: Muon chooses by `path`, slots take their names from it.
    variable = keras.Variable(np.ones((2, 2)), name="kernel_w3")
    variable._path = "model/head/kernel"
    assert variable.path == "model/head/kernel" and variable.name == "kernel_w3"
    optimizer = keras.optimizers.Muon(exclude_layers=["head/kernel$"])
    optimizer.build([variable])
    assert optimizer._should_use_adamw(variable)
    assert any(v.name.startswith("model_head_kernel_") for v in optimizer.variables)


def test_a_loss_computed_in_a_scope_reads_weights_through_its_get_current_value():
    # keras/pipelined/loss.py: `model._compute_loss` inside a StatelessScope subclass
    # whose `get_current_value` answers (or refuses) every variable read.
    class Penalized(keras.Model):
        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None):
            return keras.ops.sum(self.layers[-1].kernel)

    inputs = keras.Input((2,))
    model = Penalized(inputs, keras.layers.Dense(1, kernel_initializer="ones")(inputs))
    model.compile(loss="mse")
    seen = []

    class Watching(keras.StatelessScope):
        def get_current_value(self, variable):
            seen.append(variable.path)
            return super().get_current_value(variable)

    kernel = model.layers[-1].kernel
    with Watching(state_mapping=[(kernel, np.full((2, 1), 3.0, "float32"))]):
        loss = model._compute_loss(x=None, y=None, y_pred=None, training=True)
    assert float(loss) == 6.0 and kernel.path in seen


def test_a_stateless_scope_knows_the_scope_it_was_entered_in_and_variables_their_value():
    # keras/assignments.py: a seed state first read in a computation is masked from its
    # own value: the enclosing scope's (`original_scope`), else the variable's `_value`
    # (`variable.value` would ask the scope again).
    variable = keras.Variable(np.ones((2,), "uint32"))
    with keras.StatelessScope(state_mapping=[(variable, np.zeros((2,), "uint32"))]) as outer:
        with keras.StatelessScope() as inner:
            assert inner.original_scope is outer
            np.testing.assert_array_equal(outer.get_current_value(variable), [0, 0])
    np.testing.assert_array_equal(np.asarray(variable._value), [1, 1])


def test_kerases_global_state_is_per_thread_under_the_carried_names():
    # keras_ipu.keras.thread_state hands these attributes of the caller's thread to the
    # infeed and callback threads; host_data.random_state_kept puts the generator back.
    import threading

    from keras.src.backend.common import global_state
    from keras.src.random.seed_generator import GLOBAL_SEED_GENERATOR

    from keras_ipu.keras.thread_state import CARRIED_KERAS_STATE

    assert isinstance(global_state.GLOBAL_STATE_TRACKER, threading.local)
    keras.utils.set_random_seed(3)
    keras.random.normal((1,))  # makes the global seed generator
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        here = vars(global_state.GLOBAL_STATE_TRACKER)
        assert GLOBAL_SEED_GENERATOR == "global_seed_generator"
        assert {"global_random_seed", GLOBAL_SEED_GENERATOR, "dtype_policy"} <= set(here)
        assert set(CARRIED_KERAS_STATE) >= {"global_random_seed", GLOBAL_SEED_GENERATOR,
                                            "dtype_policy"}
        generator = here[GLOBAL_SEED_GENERATOR]
        assert isinstance(generator.state, keras.Variable)
        elsewhere = []
        thread = threading.Thread(target=lambda: elsewhere.append(
            (global_state.get_global_attribute(GLOBAL_SEED_GENERATOR),
             keras.config.dtype_policy().name)))
        thread.start()
        thread.join()
        assert elsewhere == [(None, "float32")]  # another thread starts without them
    finally:
        keras.config.set_dtype_policy(previous)


def test_the_active_stateless_scope_is_kerases_global_attribute():
    # keras_ipu.keras.assignments.outside_traces clears and restores it around a sync.
    from keras.src.backend.common import global_state, stateless_scope

    with keras.StatelessScope() as scope:
        assert global_state.get_global_attribute("stateless_scope") is scope
        assert stateless_scope.get_stateless_scope() is scope
    assert stateless_scope.get_stateless_scope() is None


def test_optimizers_keep_the_variables_they_were_built_for_and_loss_scaling_its_apply():
    # keras_ipu.keras.replica_gradients applies through `stateless_apply` the variables
    # `_trainable_variables` lists, and wraps the `apply` of BaseOptimizer and of
    # LossScaleOptimizer (which has its own).
    from keras.src.optimizers.base_optimizer import BaseOptimizer
    from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer

    variables = [keras.Variable(np.ones(2, "float32")), keras.Variable(np.ones(3, "float32"))]
    optimizer = keras.optimizers.SGD(0.1)
    optimizer.build(variables)
    assert [id(v) for v in optimizer._trainable_variables] == [id(v) for v in variables]
    assert "apply" in BaseOptimizer.__dict__ and "apply" in LossScaleOptimizer.__dict__
    new_weights, _ = optimizer.stateless_apply(
        [v.value for v in optimizer.variables], [np.ones(2, "float32"), np.ones(3, "float32")],
        [v.value for v in variables])
    np.testing.assert_allclose(new_weights[0], [0.9, 0.9])


def test_the_on_batch_methods_call_the_step_function_set_on_the_model():
    # keras_ipu.keras.batch_steps sets `train_function` (and its kin) to a checked program:
    # Keras' method keeps a function that is set, and calls it with (state, an iterator of
    # the one batch); it marks the state unsynced before the call.
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((4, 2), "float32"), np.ones((4, 1), "float32")
    calls = []

    def step(function_state, iterator, kind):
        calls.append((kind, model._jax_state_synced, next(iterator)))
        outputs = np.zeros((4, 1), "float32") if kind == "predict" else {"loss": 0.0}
        return outputs, function_state

    for kind in ("train", "test", "predict"):
        setattr(model, f"{kind}_function", lambda s, i, kind=kind: step(s, i, kind))
    model.train_on_batch(x, y)
    model.test_on_batch(x, y)
    model.predict_on_batch(x)
    assert [(kind, synced) for kind, synced, _ in calls] == [
        ("train", False), ("test", False), ("predict", False)]
    np.testing.assert_array_equal(calls[0][2][0], x)  # (x, y, sample_weight)
    np.testing.assert_array_equal(calls[2][2][0], x)  # (x,)
    for name in ("make_train_function", "make_test_function", "make_predict_function"):
        assert _params(getattr(JAXTrainer, name)) == ["self", "force"]


def test_random_crop_draws_offsets_and_crops_in_transform_images():
    # keras_ipu.keras.traceable_layers wraps RandomCrop.transform_images: it takes the
    # `(top, left)` offsets get_random_transformation draws, and Keras runs it eagerly.
    from keras_ipu.keras import traceable_layers

    traceable_layers.install()
    crop = keras.layers.RandomCrop(2, 3, seed=1)
    assert crop.supports_jit is False
    assert _params(keras.layers.RandomCrop.transform_images) == [
        "self", "images", "transformation", "training"]
    images = np.arange(2 * 4 * 5 * 1, dtype="float32").reshape(2, 4, 5, 1)
    top, left = crop.get_random_transformation(images, training=True)
    assert int(top) in range(3) and int(left) in range(3)
    np.testing.assert_array_equal(crop.transform_images(images, (top, left)),
                                  images[:, int(top):int(top) + 2, int(left):int(left) + 3])


def test_a_layers_default_build_is_marked_and_name_scopes_take_a_caller():
    # keras_ipu.keras.stages.graph advises a build when a subclassed model's class
    # overrides `build` (Keras marks its own with `_is_default`), and traces `call` under
    # `model._open_name_scope()`, as `Layer.__call__` does.
    from keras.src.utils import python_utils

    assert python_utils.is_default(keras.Model.build)

    class Built(keras.Model):
        def build(self, input_shape):
            super().build(input_shape)

    assert not python_utils.is_default(Built.build)
    layer = keras.layers.Dense(2, name="inner")
    with keras.name_scope("outer"):
        with layer._open_name_scope():
            assert keras.Variable(1.0, name="v").path == "outer/inner/v"
    assert layer._parent_path == "outer"


def test_a_layers_inbound_node_holds_its_call_arguments_and_fills_them_in():
    # keras_ipu.keras.stages.plan and keras_ipu.keras.convert call a layer as its model
    # does: `_inbound_nodes[i].arguments`, its Keras tensors (a mask too) and `fill_in`.
    tokens = keras.Input((3,), dtype="int32")
    embedded = keras.layers.Embedding(5, 2, mask_zero=True)(tokens)
    attention, lstm = keras.layers.MultiHeadAttention(1, 2), keras.layers.LSTM(2)
    lstm(attention(embedded, embedded))
    arguments = attention._inbound_nodes[0].arguments
    assert len(arguments.keras_tensors) == 2  # the query and the value
    args, kwargs = arguments.fill_in({id(t): "x" for t in arguments.keras_tensors})
    assert [*args, *kwargs.values()].count("x") == 2
    arguments = lstm._inbound_nodes[0].arguments
    assert len(arguments.keras_tensors) == 2  # the sequence and its mask, a keyword
    args, kwargs = arguments.fill_in({id(t): i for i, t in enumerate(arguments.keras_tensors)})
    assert args == (0,) and kwargs["mask"] == 1


def test_a_compiled_loss_is_held_in_compile_loss_and_none_without_one():
    # keras_ipu.keras.fit_checks.check_targets: array data without targets for a compiled loss.
    def compiled(**loss):
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", **loss)
        return model

    assert compiled(loss="mse")._compile_loss is not None
    assert compiled()._compile_loss is None
    assert "self._compile_loss(y, y_pred, sample_weight)" in inspect.getsource(
        JAXTrainer.compute_loss)


def test_model_checkpoint_decides_each_save_in_should_save_model(tmp_path):
    # keras_ipu.keras.fit_checks.check_callbacks takes a ModelCheckpoint(save_best_only=True)
    # with the LIST reduction when a subclass overrides this method (it reduces the values).
    class Never(keras.callbacks.ModelCheckpoint):
        def _should_save_model(self, epoch, batch, logs, filepath):
            return False

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    x = np.ones((4, 2), np.float32)
    for kind, saved in ((Never, False), (keras.callbacks.ModelCheckpoint, True)):
        path = tmp_path / f"{kind.__name__}.keras"
        model.fit(x, x[:, :1], verbose=0, callbacks=[kind(str(path), monitor="loss",
                                                          save_best_only=True)])
        assert path.exists() == saved


def test_model_checkpoint_names_its_file_by_formatting_the_logs_into_filepath():
    # keras_ipu.keras.fit_checks refuses, with LIST-reduced logs (arrays), a file name
    # with a format spec for a log value: Keras formats `filepath` with the logs, in
    # `_get_file_path`, and NumPy refuses a spec for an array.
    checkpoint = keras.callbacks.ModelCheckpoint("m-{epoch:02d}-{loss:.2f}.keras")
    assert checkpoint.filepath == "m-{epoch:02d}-{loss:.2f}.keras"
    assert checkpoint._get_file_path(0, None, {"loss": 0.5}) == "m-01-0.50.keras"
    with pytest.raises(TypeError, match="unsupported format string"):
        checkpoint._get_file_path(0, None, {"loss": np.array([0.5, 0.25])})


def test_a_layers_added_losses_are_cleared_at_each_of_the_models_own_calls_of_it():
    # keras_ipu.keras.stages.plan.counted_losses counts a pipelined model's added losses so:
    # each call of a layer from the model itself (stateless_call runs `call`) starts anew;
    # the calls inside one call of a nested model add up.
    class Penalty(keras.layers.Layer):
        def call(self, x):
            self.add_loss(keras.ops.sum(x))
            return x

    penalty, inputs = Penalty(), keras.Input((1,))
    top = keras.Model(inputs, penalty(penalty(inputs) * 2.0))
    inner_inputs = keras.Input((1,))
    inner = keras.Model(inner_inputs, penalty(penalty(inner_inputs) * 2.0))
    nested = keras.Model(inputs, inner(inputs))
    x = np.ones((1, 1), np.float32)
    for model, counted in ((top, 2.0), (nested, 1.0 + 2.0)):
        _, _, losses = model.stateless_call([], [], x, return_losses=True)
        assert float(sum(losses)) == counted


def test_a_variable_made_in_a_stateless_scope_waits_and_takes_a_value_by_initialize():
    # keras_ipu.keras.assignments: a variable made inside a computation (a layer first
    # built there) has no `_value`, waits in `uninitialized_variables`, draws with
    # `_initializer(_shape, dtype=_dtype)`; `_initialize(value)` gives it the program's draw.
    from keras.src.backend.common import global_state

    pending = list(global_state.get_global_attribute("uninitialized_variables") or [])
    with keras.StatelessScope(initialize_variables=False):
        variable = keras.Variable(initializer="ones", shape=(2,), dtype="float32", name="v")
    waiting = global_state.get_global_attribute("uninitialized_variables")
    assert variable._value is None and waiting[len(pending):] == [variable]
    drawn = variable._initializer(variable._shape, dtype=variable._dtype)
    np.testing.assert_array_equal(drawn, [1.0, 1.0])
    global_state.set_global_attribute("uninitialized_variables", pending)
    variable._initialize(np.array([3.0, 4.0], np.float32))
    np.testing.assert_array_equal(variable.numpy(), [3.0, 4.0])


def test_compile_keeps_its_loss_weights_in_compile_config():
    # keras_ipu.keras.replication compares them across the instances of a job.
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse", loss_weights=[10.0])
    assert model._compile_config.config["loss_weights"] == [10.0]


def test_a_loss_class_wraps_its_function_with_arguments_and_reduction():
    # Instances compare compiled losses as function, arguments and reduction
    # (replication._loss_described), whichever way the user spelt them.
    from keras.src.losses.losses import LossFunctionWrapper

    loss = keras.losses.Huber(delta=2.0, reduction="sum")
    assert isinstance(loss, LossFunctionWrapper)
    assert loss.fn is keras.losses.huber and loss._fn_kwargs == {"delta": 2.0}
    assert loss.reduction == "sum" and loss.dtype == "float32"
    assert type(loss).call is LossFunctionWrapper.call  # a subclass may override it
    assert keras.losses.get("mse") is keras.losses.mean_squared_error
