"""IPUStrategy: which models gain extensions, and that Keras' model life cycle still works."""

from __future__ import annotations

import pickle

import jax
import keras
import numpy as np
import pytest

import keras_ipu as ipu
from keras_ipu.device import system
from keras_ipu.keras import extensions

from conftest import assert_weights_close, configure
from models import SubclassedMLP, data_for, functional_two_in_two_out, sequential

EXT = ipu.keras.extensions


class _FunctionalSubclass(keras.Model):
    def __init__(self, **kwargs):
        inputs = keras.Input((4,))
        super().__init__(inputs, keras.layers.Dense(2)(inputs), **kwargs)


@pytest.mark.parametrize(
    "build, extension",
    [
        (sequential, EXT.SequentialExtension),
        (functional_two_in_two_out, EXT.FunctionalExtension),
        (lambda: SubclassedMLP(), EXT.ModelExtension),
        (_FunctionalSubclass, EXT.FunctionalExtension),
    ],
)
def test_models_created_in_scope_gain_their_extension(build, extension, strategy):
    with strategy.scope():
        model = build()
    assert isinstance(model, extension)
    others = {EXT.SequentialExtension, EXT.FunctionalExtension, EXT.ModelExtension} - {extension}
    assert not any(isinstance(model, other) for other in others)
    # Keras sees the user's class (serialization records it).
    assert model.__class__ is type(model)._ipu_base_class
    outside = build()
    assert not isinstance(outside, extensions.ExtensionBase)


def test_public_names():
    assert ipu.IPUStrategy is ipu.ipu_strategy.IPUStrategy
    assert ipu.ipu_strategy.IPUStrategyV1 is ipu.ipu_strategy.IPUStrategy
    assert ipu.IPUStrategy().num_replicas_in_sync == 1
    with pytest.raises(ValueError, match="/device:IPU:0"):
        ipu.IPUStrategy(ipu_device="/device:GPU:0")


def test_nested_models_are_extended_too(strategy):
    with strategy.scope():
        inner = sequential(6, 8, 4)
        inputs = keras.Input((6,))
        outer = keras.Model(inputs, keras.layers.Dense(2)(inner(inputs)))
    assert isinstance(inner, EXT.SequentialExtension)
    assert isinstance(outer, EXT.FunctionalExtension)


def test_extensions_can_be_disabled():
    with ipu.IPUStrategy(enable_keras_extensions=False).scope():
        model = sequential()
    assert not isinstance(model, extensions.ExtensionBase)


@pytest.mark.parametrize("value", ["False", "no", None, 2, 1])
def test_a_strategy_flag_that_is_no_bool_is_refused(value):
    # "False" was read as true: models were extended. (As the option setters: a bool.)
    with pytest.raises(TypeError, match=rf"`enable_keras_extensions` must be a bool, got "
                                        rf"{value!r}"):
        ipu.ipu_strategy.IPUStrategy(enable_keras_extensions=value)
    assert not ipu.ipu_strategy.IPUStrategy(enable_keras_extensions=np.False_
                                            ).enable_keras_extensions


def test_compiled_and_fitted_outside_the_scope_still_runs_on_ipu(strategy):
    with strategy.scope():
        model = sequential()
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=2)
    x, y = data_for("sequential", samples=32)
    model.fit(x, y, batch_size=8, verbose=0)
    assert ipu.utils.execution_report(model, "fit").steps_per_execution == 2


def test_fit_before_configuring_says_what_to_call(strategy):
    with strategy.scope():
        model = sequential()
        model.compile(optimizer="sgd", loss="mse")
    x, y = data_for("sequential", samples=16)
    ipu.config.reset_ipu_configuration()
    assert system.current() is None
    expected = r"(?s)No IPU system is configured.*configure_ipu_system"
    with pytest.raises(RuntimeError, match=expected):
        model.fit(x, y, batch_size=8, verbose=0)
    with pytest.raises(RuntimeError, match="configure_ipu_system"):
        model.predict(x, batch_size=8, verbose=0)


def test_save_and_load_keeps_weights_and_extension(strategy, tmp_path):
    x, y = data_for("sequential", samples=32)
    with strategy.scope():
        model = sequential()
        model.compile(optimizer="adam", loss="mse", steps_per_execution=2)
        model.fit(x, y, batch_size=8, verbose=0)
        path = tmp_path / "model.keras"
        model.save(path)
        loaded_inside = keras.models.load_model(path)
    loaded_outside = keras.models.load_model(path)
    assert isinstance(loaded_inside, EXT.SequentialExtension)
    assert not isinstance(loaded_outside, extensions.ExtensionBase)
    assert_weights_close(model.get_weights(), loaded_inside.get_weights(), atol=0)
    np.testing.assert_allclose(
        loaded_inside.predict(x, batch_size=8, verbose=0),
        loaded_outside.predict(x, batch_size=8, verbose=0),
        atol=1e-6,
    )
    # Keras' config, with the IPU options inside the scope (as the reference's get_config).
    inside = loaded_inside.get_config()
    assert inside.pop("gradient_accumulation_steps_per_replica") is None  # at the top level
    assert {k: v for k, v in inside.items() if k in loaded_outside.get_config()} == \
        loaded_outside.get_config()
    serialized = keras.saving.serialize_keras_object(model)
    assert (serialized["module"], serialized["class_name"]) == ("keras", "Sequential")


def test_registered_subclass_saves_under_its_registered_name(strategy, tmp_path):
    @keras.saving.register_keras_serializable(package="keras_ipu_tests")
    class Registered(SubclassedMLP):
        pass

    with strategy.scope():
        model = Registered()
        model(np.zeros((1, 6), "float32"))
        model.save(tmp_path / "sub.keras")
        loaded = keras.models.load_model(tmp_path / "sub.keras")
    assert isinstance(loaded, EXT.ModelExtension) and isinstance(loaded, Registered)
    assert_weights_close(model.get_weights(), loaded.get_weights(), atol=0)


def test_clone_and_pickle(strategy):
    with strategy.scope():
        model = sequential()
        clone = keras.models.clone_model(model)
    assert isinstance(clone, EXT.SequentialExtension)
    model.compile(optimizer="sgd", loss="mse")
    restored = pickle.loads(pickle.dumps(model))
    assert isinstance(restored, EXT.SequentialExtension)
    assert_weights_close(model.get_weights(), restored.get_weights(), atol=0)
    x, y = data_for("sequential", samples=16)
    restored.fit(x, y, batch_size=8, verbose=0)


def test_make_train_function_override_is_refused(strategy):
    class Custom(keras.Sequential):
        def make_train_function(self, force=False):
            return super().make_train_function(force)

    with strategy.scope():
        model = Custom([keras.Input((6,)), keras.layers.Dense(3)])
        model.compile(optimizer="sgd", loss="mse")
    x, y = data_for("sequential", samples=16)
    with pytest.raises(RuntimeError, match=r"`make_train_function` for the model .* overridden"):
        model.fit(x, y, batch_size=8, verbose=0)


def test_custom_stateless_train_step_runs_on_device(strategy):
    class HalfLoss(keras.Sequential):
        def train_step(self, state, data):
            logs, state = super().train_step(state, data)
            return {**logs, "half_loss": logs["loss"] / 2}, state

    with strategy.scope():
        model = HalfLoss([keras.Input((6,)), keras.layers.Dense(3)])
        model.compile(optimizer="sgd", loss="mse", steps_per_execution=2)
    x, y = data_for("sequential", samples=16)
    seen = {}

    class Spy(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.update(logs)

    model.fit(x, y, batch_size=8, verbose=0, callbacks=[Spy()])
    assert float(seen["half_loss"]) == pytest.approx(float(seen["loss"]) / 2, rel=1e-6)


class _ListsAndNumbers(keras.Sequential):
    """Steps that give their state back in other containers and log a Python number:
    plain Keras takes both."""

    def train_step(self, state, data):
        logs, state = super().train_step(state, data)
        return {**logs, "scale": 0.5}, tuple(tuple(part) for part in state)

    def test_step(self, state, data):
        logs, state = super().test_step(state, data)
        return logs, list(state)

    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        return {**super().compute_metrics(x, y, y_pred, sample_weight), "constant": 1.5}


def test_custom_steps_may_return_other_containers_and_python_numbers(strategy):
    x, y = data_for("sequential", samples=16)
    keras.utils.set_random_seed(0)
    plain = _ListsAndNumbers([keras.Input((6,)), keras.layers.Dense(3)])
    with strategy.scope():
        model = _ListsAndNumbers([keras.Input((6,)), keras.layers.Dense(3)])
    model.set_weights(plain.get_weights())
    for each in (plain, model):
        each.compile(optimizer="sgd", loss="mse", steps_per_execution=2)
    expected = plain.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0).history
    history = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0).history
    assert history["scale"] == [0.5, 0.5]
    np.testing.assert_allclose(history["loss"], expected["loss"], rtol=1e-6)
    assert_weights_close(plain.get_weights(), model.get_weights(), atol=1e-6)
    assert model.evaluate(x, y, batch_size=4, verbose=0, return_dict=True) == pytest.approx(
        plain.evaluate(x, y, batch_size=4, verbose=0, return_dict=True), rel=1e-6)


def test_strategy_runs_on_the_named_logical_device():
    config = ipu.config.IPUConfig()
    config.auto_select_ipus = [1, 1]
    config.configure_ipu_system()
    with ipu.IPUStrategy(ipu_device="/device:IPU:1").scope():
        model = sequential()
        model.compile(optimizer="sgd", loss="mse", steps_per_execution=2)
    x, y = data_for("sequential", samples=16)
    model.fit(x, y, batch_size=8, verbose=0)
    report = ipu.utils.execution_report(model, "fit")
    second = system.current().ipus[1]
    assert report.ipus[0].index == 1 and report.ipus[0].device == str(second.device)
    assert all(v.value.devices() == {second.device} for v in model.trainable_variables)


class _BatchValues(keras.callbacks.Callback):
    """Records every batch hook's logs (or predictions)."""

    def __init__(self):
        super().__init__()
        self.values: list = []

    def _record(self, batch, logs):
        self.values.extend(np.ravel(v) for v in jax.tree_util.tree_leaves(logs))

    on_train_batch_end = on_test_batch_end = on_predict_batch_end = _record


@pytest.mark.parametrize("pipelined", [False, True])
def test_synthetic_data_flag_gives_asynchronous_batch_hooks_zeros(pipelined, strategy,
                                                                   monkeypatch):
    # They got the device's values (loss 0.85 ...) while the epoch's logs were zeros.
    monkeypatch.setenv("KERAS_IPU_FLAGS", "--use_synthetic_data")
    configure(2 if pipelined else 1)
    with strategy.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8),
                                  keras.layers.Dense(3, bias_initializer="ones")])
    if pipelined:
        model.set_pipeline_stage_assignment([0, 1])
        model.set_pipelining_options(gradient_accumulation_steps_per_replica=2)
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=2)
    model.set_asynchronous_callbacks(True)
    x, y = data_for("sequential", samples=16)
    hook = _BatchValues()
    model.fit(x, y, batch_size=4, verbose=0, callbacks=[hook])
    model.evaluate(x, y, batch_size=4, verbose=0, callbacks=[hook])
    model.predict(x, batch_size=4, verbose=0, callbacks=[hook])
    assert len(hook.values) >= 3 and not np.concatenate(hook.values).any()


def test_synthetic_data_flag_moves_no_data(strategy, monkeypatch):
    monkeypatch.setenv("KERAS_IPU_FLAGS", "--use_synthetic_data")
    config = ipu.config.IPUConfig()
    config.auto_select_ipus = 1
    config.configure_ipu_system()
    with strategy.scope():
        # Its outputs on zeros are not zeros: the device's loss on them is not 0.
        model = keras.Sequential([keras.Input((6,)),
                                  keras.layers.Dense(3, bias_initializer="ones")])
        model.compile(optimizer="sgd", loss="mse", steps_per_execution=2)
    x, y = data_for("sequential", samples=16)
    x[:] = np.nan  # never reaches the device
    initial = model.get_weights()
    history = model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    assert all(np.isfinite(w).all() for w in model.get_weights())
    assert not np.allclose(initial[1], model.get_weights()[1])  # trained, on zeros
    # Nothing comes back to the host: the epochs' logs and evaluate() are zeros too.
    assert history.history["loss"] == [0.0, 0.0]
    assert model.evaluate(x, y, batch_size=8, verbose=0) == 0.0
    assert not model.predict(x, batch_size=8, verbose=0).any()
    # Keras' batch methods too: they train on zeros, and give zeros.
    trained = model.get_weights()
    assert model.train_on_batch(x[:8], y[:8]) == 0.0
    assert all(np.isfinite(w).all() for w in model.get_weights())
    assert not np.allclose(trained[1], model.get_weights()[1])
    assert model.test_on_batch(x[:8], y[:8]) == 0.0
    assert not model.predict_on_batch(x[:8]).any()
    # Configured again without the flag, the same model's batch methods read the data.
    monkeypatch.delenv("KERAS_IPU_FLAGS")
    config.configure_ipu_system()
    x[:] = 0.0
    expected = model.predict(x[:8], batch_size=8, verbose=0)
    assert expected.any()
    np.testing.assert_array_equal(model.predict_on_batch(x[:8]), expected)


def test_run_compiles_a_function_for_the_ipu_device_and_reduce_sums_or_averages():
    configure([1, 2])  # /device:IPU:0 with one IPU, /device:IPU:1 with two
    second = ipu.ipu_strategy.IPUStrategy(ipu_device="/device:IPU:1")
    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    result = second.run(lambda a, scale: keras.ops.tanh(a) * scale, args=(x,),
                        kwargs={"scale": 2.0})
    np.testing.assert_allclose(result, np.tanh(x) * 2, rtol=1e-6)
    assert result.devices() == {system.require().ipus_of_device(1)[0].device}
    np.testing.assert_allclose(second.reduce("SUM", x, axis=0), [6, 9])
    np.testing.assert_allclose(second.reduce("MEAN", {"x": x}, axis=1)["x"], [0.5, 2.5, 4.5])
    assert second.reduce("SUM", x) is x  # one replica in sync: nothing to reduce
    with pytest.raises(ValueError, match="valid: SUM, MEAN"):
        second.reduce("MAX", x)
    with pytest.raises(ValueError, match="IPU:2"):
        ipu.ipu_strategy.IPUStrategy(ipu_device="/device:IPU:2").run(lambda: 1)


_UNBUILT_GLOBAL = None  # set by the test below: a notebook's model is a global


def test_run_builds_an_unbuilt_model_or_layer_as_plain_keras_does(strategy):
    # The layers build at their first call, inside the program, and their weights are made
    # eagerly once it has run (strategy.run refused them, weightless layers too).
    global _UNBUILT_GLOBAL
    configure(2)
    x = np.ones((1, 3), np.float32)
    with strategy.scope():
        _UNBUILT_GLOBAL = keras.Sequential([keras.layers.Dense(2)])
        closed = keras.Sequential([keras.layers.Dense(2)])
    given = keras.Sequential([keras.layers.Dense(2)])
    concatenate, flatten = keras.layers.Concatenate(), keras.layers.Flatten()
    calls = [(lambda a: _UNBUILT_GLOBAL(a), (x,)), (lambda a: closed(a), (x,)),
             (lambda model, a: model(a), (given, x)),
             (lambda a: flatten(concatenate([a, a])), (x[:, None],))]
    for call, args in calls:
        results = [strategy.run(call, args=args) for _ in range(2)]  # the kept program too
        expected = keras.ops.convert_to_numpy(call(*args))  # eagerly, the same weights
        for result in results:
            np.testing.assert_allclose(result, expected, rtol=1e-6)
    assert all(layer.built for layer in (_UNBUILT_GLOBAL, closed, given, concatenate))

def _bn_dropout_model(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((4,)), keras.layers.BatchNormalization(),
                             keras.layers.Dropout(0.5, seed=seed)])


def _bn_dropout_twins(strategy, seed, batch_count):
    """An IPU model, its plain twin (same weights and seed), and `batch_count` batches."""
    batches = [np.random.default_rng(i).normal(size=(8, 4)).astype(np.float32)
               for i in range(batch_count)]
    with strategy.scope():
        model = _bn_dropout_model(seed)
    return model, _bn_dropout_model(seed), batches


def test_run_and_compile_apply_the_keras_variable_updates_of_a_training_call(strategy):
    # BatchNormalization's moving statistics and Dropout's seed generator, assigned inside
    # the compiled program, take their new values after it (before: the trace's
    # placeholders stayed in the variables and the model failed at its next use).
    configure(1)
    x = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)
    with strategy.scope():
        model = _bn_dropout_model(3)
    eager = _bn_dropout_model(3)  # the same weights and seed, run by Keras itself
    runs = [lambda: strategy.run(lambda a: model(a, training=True), args=(x,)),
            lambda: _compiled_on_ipu0(lambda a: model(a, training=True), x)]
    for run in runs * 2:  # the kept program too
        expected = keras.ops.convert_to_numpy(eager(x, training=True))
        np.testing.assert_allclose(run(), expected, rtol=1e-6, atol=1e-6)
        assert_weights_close(eager.get_weights(), model.get_weights())
    np.testing.assert_allclose(model(x), eager(x), rtol=1e-6)  # usable after, eagerly
    # rand_ops.dropout with a seed generator, as its docstring advises in a compiled step.
    generator = keras.random.SeedGenerator(1)
    masks = [np.asarray(_compiled_on_ipu0(
        lambda a: ipu.rand_ops.dropout(a, rate=0.5, seed=generator), np.ones((2, 8))))
        for _ in range(2)]
    assert not np.array_equal(*masks)
    assert int(keras.ops.convert_to_numpy(generator.state)[1]) == 2


@pytest.mark.parametrize("optimizer", ["Adam", "Nadam", "Adafactor"])
def test_a_custom_step_builds_its_optimizer_and_reads_model_losses_as_plain_keras(optimizer,
                                                                                  strategy):
    # Before: Nadam and Adafactor built at their first apply inside the program raised
    # "attempting to create a variable while in a stateless scope", and `model.losses`
    # with a weight regularizer "'NoneType' object has no attribute 'dtype'".
    configure(1)
    x, y = data_for("sequential", samples=8)

    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(
            3, kernel_regularizer=keras.regularizers.L2(0.1))])
        return model, getattr(keras.optimizers, optimizer)(0.01)

    def step_of(model, opt):
        def step(x, y):
            def loss(weights):
                out, _, losses = model.stateless_call(weights, [], x, return_losses=True)
                return keras.ops.mean((out - y) ** 2) + sum(losses)
            value, grads = jax.value_and_grad(loss)([v.value for v in model.trainable_variables])
            regularization = sum(model.losses)  # in the program's scope, before any assign
            opt.apply(grads, model.trainable_variables)
            return value, regularization
        return step

    plain, plain_opt = build()
    expected = [[float(v) for v in step_of(plain, plain_opt)(x, y)] for _ in range(2)]
    with strategy.scope():
        model, opt = build()
    got = [[float(v) for v in strategy.run(step_of(model, opt), args=(x, y))]
           for _ in range(2)]
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    assert_weights_close(plain.get_weights(), model.get_weights(), atol=1e-6)
    assert_weights_close([v.numpy() for v in plain_opt.variables],
                         [v.numpy() for v in opt.variables], atol=1e-6)


@pytest.mark.parametrize("initializer", [
    "glorot_uniform",
    # Each call draws anew: the program's draw must be the one every read and the
    # variable get (before: model.losses read another draw, or the variable did).
    lambda: keras.initializers.RandomNormal(seed=keras.random.SeedGenerator(3)),
    lambda: lambda shape, dtype=None: np.random.normal(size=shape).astype("float32"),
])
def test_model_losses_of_a_layer_first_built_inside_the_computation(initializer, strategy):
    # Before: a regularized layer built by its first call inside `strategy.run` had no
    # value yet, and `model.losses` raised "'NoneType' object has no attribute 'dtype'".
    configure(1)
    x, _ = data_for("sequential", samples=4)
    with strategy.scope():
        model = keras.Sequential([keras.layers.Dense(
            3, kernel_initializer=initializer if isinstance(initializer, str)
            else initializer(), kernel_regularizer=keras.regularizers.L2(0.1))])

        def step(x):
            return keras.ops.sum(model(x)), sum(model.losses)

        output, regularization = strategy.run(step, args=(x,))
    # The program read the initial weights the variables were given after it ran.
    kernel = model.layers[0].kernel.numpy()
    assert float(regularization) > 0
    np.testing.assert_allclose(float(regularization), 0.1 * np.sum(kernel ** 2), rtol=1e-5)
    np.testing.assert_allclose(float(regularization), float(sum(model.losses)), rtol=1e-5)
    np.testing.assert_allclose(float(output), float(keras.ops.sum(model(x))), rtol=1e-5)


def test_replicas_compute_with_the_one_draw_a_variable_built_inside_takes():
    # Before: with a SeedGenerator initializer each replica drew from its own stream, and
    # only replica 0's draw became the weight: the replicas' gradients were of other weights.
    configure(2)
    x, _ = data_for("sequential", samples=4)
    strategy = ipu.ipu_strategy.IPUStrategy()
    with strategy.scope():
        model = keras.Sequential([keras.layers.Dense(3, kernel_initializer=(
            keras.initializers.RandomNormal(seed=keras.random.SeedGenerator(3))))])

        def step(x):
            out = keras.ops.sum(model(x))  # every replica has the same x
            mean = ipu.ops.cross_replica_ops.cross_replica_sum(out) / 2
            return out, mean

        out, mean = strategy.run(step, args=(x,))
    np.testing.assert_allclose(float(mean), float(out), rtol=1e-6)
    np.testing.assert_allclose(float(out), float(keras.ops.sum(model(x))), rtol=1e-5)


@pytest.mark.parametrize("ipus", [1, 2])
def test_a_host_initializer_of_a_layer_built_inside_draws_once(ipus):
    # Before: once per trace (the replicas' abstract trace too) and once more when the
    # variable was initialized: NumPy's global stream moved on, the weights differed.
    configure(ipus)
    x, _ = data_for("sequential", samples=4)

    def initializer(shape, dtype=None):
        return np.random.normal(size=shape).astype("float32")

    np.random.seed(5)
    expected_kernel = np.random.normal(size=(6, 3)).astype("float32")
    expected_next = np.random.normal()
    np.random.seed(5)
    strategy = ipu.ipu_strategy.IPUStrategy()
    with strategy.scope():
        model = keras.Sequential([keras.layers.Dense(3, kernel_initializer=initializer)])
        out = strategy.run(lambda x: keras.ops.sum(model(x)), args=(x,))
    assert np.random.normal() == expected_next
    np.testing.assert_array_equal(model.layers[0].kernel.numpy(), expected_kernel)
    np.testing.assert_allclose(float(out), float(keras.ops.sum(model(x))), rtol=1e-5)


def _compiled_on_ipu0(fn, x):
    with ipu.scopes.ipu_scope("/device:IPU:0"):
        [result] = ipu.ipu_compiler.compile(fn, [x])
    return result


def test_the_loops_of_a_computation_carry_the_keras_variables_it_assigns(strategy):
    # A training loop over an infeed calling a Keras model (BatchNormalization, Dropout):
    # each iteration starts from the last one's moving statistics and seed (before: the
    # loop body's tracers leaked, 'Computation compiled for 7 inputs but called with 1').
    configure(1)
    model, eager, batches = _bn_dropout_twins(strategy, 5, 4)
    infeed = ipu.ipu_infeed_queue.IPUInfeedQueue(batches)
    outfeed = ipu.ipu_outfeed_queue.IPUOutfeedQueue()
    strategy.run(lambda: ipu.loops.repeat(
        4, lambda x: outfeed.enqueue(model(x, training=True)), [], infeed))
    expected = [keras.ops.convert_to_numpy(eager(x, training=True)) for x in batches]
    np.testing.assert_allclose(outfeed.dequeue(), expected, rtol=1e-5, atol=1e-6)
    assert_weights_close(eager.get_weights(), model.get_weights())
    # A while loop too; its condition reads a carried value.
    count = strategy.run(lambda x: ipu.loops.while_loop(
        lambda i: i < 3, lambda i: (model(x, training=True), i + 1)[1], [0]),
        args=(batches[0],))
    for _ in range(3):
        eager(batches[0], training=True)
    assert int(count) == 3
    assert_weights_close(eager.get_weights(), model.get_weights())


def test_a_custom_training_step_in_run_trains_as_eagerly_and_leaves_keras_usable(strategy):
    # jax.value_and_grad + optimizer.apply: the optimizer makes its slots inside the
    # program, initialized after it (before: a later fit raised 'already initialized').
    configure(1)
    x, y = np.ones((8, 4), np.float32), np.zeros((8, 2), np.float32)

    def make():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(
            2, activity_regularizer=keras.regularizers.L2(0.1))])
        return model, keras.optimizers.Adam(0.1)

    def step_for(model, optimizer):
        def step(a, b):
            variables = model.trainable_variables

            def loss(weights):
                out, _ = model.stateless_call(weights, [], a)
                return keras.ops.mean((out - b) ** 2)

            value, grads = jax.value_and_grad(loss)([v.value for v in variables])
            optimizer.apply(grads, variables)
            model(a)  # the activity regularizer's loss, read inside (collected)
            return value, keras.ops.sum(model.losses)
        return step

    eager, eager_optimizer = make()
    expected = [step_for(eager, eager_optimizer)(x, y) for _ in range(3)]
    with strategy.scope():
        model, optimizer = make()
    step = step_for(model, optimizer)
    for want in expected:
        got = strategy.run(step, args=(x, y))
        np.testing.assert_allclose(got, want, rtol=1e-4)
    assert_weights_close(eager.get_weights(), model.get_weights(), atol=1e-5)
    assert int(optimizer.iterations.numpy()) == 3
    plain = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    plain.compile(optimizer="sgd", loss="mse")
    plain.fit(x, y, verbose=0)  # a stateless scope closes: nothing left to initialize


_ASSIGNED = None  # the variable the function below assigns, rebound by the test


def test_a_kept_program_assigns_the_variable_its_function_names_now(strategy):
    configure(1)
    first, second = (keras.Variable(np.zeros(3, np.float32)) for _ in range(2))
    global _ASSIGNED

    def step(a):
        _ASSIGNED.assign(a * 2)
        return a

    for target, value in ((first, 1.0), (second, 5.0)):
        _ASSIGNED = target
        strategy.run(step, args=(np.full(3, value, np.float32),))
    np.testing.assert_array_equal(first.numpy(), [2, 2, 2])
    np.testing.assert_array_equal(second.numpy(), [10, 10, 10])


def test_an_eager_loop_applies_the_keras_variable_updates_of_its_body(strategy):
    # ipu.loops.repeat called outside compile and strategy.run is traced by lax.scan all the
    # same: before, BatchNormalization's statistics kept the loop's tracers.
    configure(1)
    model, eager, batches = _bn_dropout_twins(strategy, 7, 3)

    def body(x):
        model(x, training=True)

    ipu.loops.repeat(3, body, [], ipu.ipu_infeed_queue.IPUInfeedQueue(batches))
    for x in batches:
        eager(x, training=True)
    assert_weights_close(eager.get_weights(), model.get_weights())
    assert ipu.loops.repeat.__doc__ == ipu.loops.repeat.__wrapped__.__doc__


def test_a_loss_scale_optimizer_applied_to_some_of_its_variables_is_refused(strategy):
    # Its stateful `apply` branches on Keras variables, which a program cannot trace
    # (plain Keras fails too); before, JAX's "compiled for 4 inputs but called with 2".
    import jax

    configure(1)
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, use_bias=False),
                                  keras.layers.Dense(1, use_bias=False)])
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    optimizer.build(model.trainable_variables)
    head = model.layers[-1].trainable_variables
    before = [w.copy() for w in model.get_weights()]

    def step(x):
        grads = jax.grad(lambda w: keras.ops.sum(x @ model.layers[0].kernel.value @ w[0]))(
            [v.value for v in head])
        optimizer.apply(grads, head)

    with pytest.raises(ValueError, match=r"LossScaleOptimizer in a compiled program applies to "
                                         r"all the variables it was built for \(2\).*got 1"):
        strategy.run(step, args=(np.ones((4, 3), "float32"),))
    assert_weights_close(before, model.get_weights(), atol=0)
