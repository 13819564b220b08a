"""`ipu.outlined_function`: one copy of the function in the program, called at each use."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import keras_ipu as ipu
from keras_ipu.device import accounting

from conftest import configure


def _block(x, w):
    return jnp.tanh(x @ w)


def _net(block):
    def net(x, w1, w2):
        return block(block(x, w1), w2).sum()

    return net


def test_one_copy_called_twice_with_the_same_numbers_and_cost():
    rng = np.random.default_rng(0)
    x, w1, w2 = (rng.normal(size=(8, 8)).astype(np.float32) for _ in range(3))
    outlined = ipu.outlined_function(name="block")(_block)
    lowered = jax.jit(_net(outlined)).lower(x, w1, w2)
    text = lowered.as_text()
    assert text.count("func.func private @block") == 1 and text.count("call @block") == 2
    inlined = jax.jit(_net(_block)).lower(x, w1, w2)
    assert "call @" not in inlined.as_text()
    # The same value and gradients; the cost model counts both calls.
    # (Up to float32 rounding: XLA:CPU may split the matrix products differently in a call.)
    np.testing.assert_allclose(_net(outlined)(x, w1, w2), _net(_block)(x, w1, w2), rtol=1e-5)
    grads = jax.grad(_net(outlined), argnums=(1, 2))(x, w1, w2)
    expected = jax.grad(_net(_block), argnums=(1, 2))(x, w1, w2)
    for got, want in zip(grads, expected):
        np.testing.assert_allclose(got, want, rtol=1e-5)
    assert accounting.step_cost(lowered).flops == accounting.step_cost(inlined).flops > 2 * 8**3


def test_the_decorator_forms_and_bad_input():
    @ipu.functional_ops.outlined_function
    def double(x):
        return x * 2

    assert float(double(jnp.float32(2))) == 4.0
    with pytest.raises(TypeError, match="needs a function"):
        ipu.outlined_function(3)
    # Before: the outlined call returned None.
    with pytest.raises(ValueError, match="'<lambda>' must return at least one array, got None"):
        ipu.outlined_function(lambda x: None)(jnp.float32(2))


def test_layers_calling_one_outlined_function_train_on_an_ipu_as_in_plain_keras():
    import keras

    @ipu.outlined_function
    def projected(x, kernel):
        return jnp.tanh(x @ kernel)

    class Projection(keras.layers.Layer):
        def __init__(self, function, **kwargs):
            super().__init__(**kwargs)
            self.function = function

        def build(self, shape):
            self.kernel = self.add_weight(shape=(shape[-1], 6), initializer="glorot_uniform")

        def call(self, x):
            return self.function(x, self.kernel)

    def model(function, scope):
        keras.utils.set_random_seed(1)
        with scope:
            built = keras.Sequential([keras.Input((6,)), Projection(function),
                                      Projection(function), keras.layers.Dense(2)])
            built.compile(optimizer="sgd", loss="mse", steps_per_execution=4)
        return built

    rng = np.random.default_rng(2)
    x, y = rng.random((16, 6), np.float32), rng.random((16, 2), np.float32)
    plain = model(projected, keras.utils.custom_object_scope({}))
    outlined = model(projected, ipu.ipu_strategy.IPUStrategy().scope())
    inlined = model(lambda x, k: jnp.tanh(x @ k), ipu.ipu_strategy.IPUStrategy().scope())
    for trained in (plain, outlined, inlined):
        trained.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    for a, b in zip(plain.get_weights(), outlined.get_weights()):
        np.testing.assert_allclose(b, a, atol=1e-6)
    flops = [ipu.utils.execution_report(m, "fit").flops_per_step for m in (outlined, inlined)]
    assert flops[0] == flops[1] > 0


def test_values_read_through_closures_are_current_and_get_gradients():
    # The seed: "IPU functions can access TensorFlow variables" through closures.
    import keras

    w = keras.Variable(np.ones((2, 2), np.float32))
    times_w = ipu.outlined_function(lambda a: a @ w)
    x = np.ones((1, 2), np.float32)
    np.testing.assert_array_equal(times_w(x), [[2.0, 2.0]])
    w.assign(2 * np.ones((2, 2), np.float32))
    np.testing.assert_array_equal(times_w(x), [[4.0, 4.0]])

    class Closing(keras.layers.Layer):
        def build(self, shape):
            self.w = self.add_weight(shape=(shape[-1], 1), initializer="ones")
            self.project = ipu.outlined_function(lambda a: a @ self.w)

        def call(self, a):
            return self.project(a)

    def trained(scope):
        with scope:
            model = keras.Sequential([keras.Input((3,)), Closing()])
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        x, y = np.ones((8, 3), np.float32), np.zeros((8, 1), np.float32)
        return model.fit(x, y, batch_size=4, epochs=2, verbose=0).history["loss"], model

    plain_losses, plain = trained(keras.utils.custom_object_scope({}))
    losses, on_ipu = trained(ipu.ipu_strategy.IPUStrategy().scope())
    assert losses[1] < losses[0]
    np.testing.assert_allclose(losses, plain_losses, rtol=1e-6)
    np.testing.assert_allclose(on_ipu.get_weights()[0], plain.get_weights()[0], rtol=1e-6)


def test_a_stateful_function_is_inlined_and_its_state_moves():
    # The seed: "If the provided function contains any stateful operations, such as stateful
    # random number generation, then the function cannot be reused and it will be inlined".
    import keras

    dropout = keras.layers.Dropout(0.5, seed=1)
    dropped = ipu.outlined_function(name="dropped")(lambda a: dropout(a, training=True))
    x = np.ones((4, 8), np.float32)
    first, second = dropped(x), dropped(x)
    assert not np.array_equal(first, second)  # the seed generator moved between the calls
    np.testing.assert_array_equal(dropout.seed_generator.state.numpy()[1], 2)
    dropout(x, training=True)  # and the layer is still usable outside
    text = jax.jit(lambda a: dropped(a) + 0).lower(x).as_text()
    assert "@dropped" not in text  # inlined, not outlined


def test_calls_with_the_same_trace_share_one_function_and_a_new_trace_gets_its_own():
    scale = {"by": 2.0}
    scaled = ipu.outlined_function(name="scaled")(lambda a: a * scale["by"])
    x = np.ones((3,), np.float32)

    def twice(a):
        return scaled(scaled(a))

    assert jax.jit(twice).lower(x).as_text().count("func.func private @scaled") == 1
    np.testing.assert_array_equal(twice(x), 4 * x)
    scale["by"] = 3.0  # a Python number read through the closure: a new trace
    np.testing.assert_array_equal(twice(x), 9 * x)


def test_a_stateful_function_in_a_training_step_draws_as_plain_keras():
    import keras

    class Noisy(keras.layers.Layer):
        def build(self, shape):
            self.dense = keras.layers.Dense(4)
            self.dropout = keras.layers.Dropout(0.5, seed=3)
            self.block = ipu.outlined_function(
                lambda a: self.dropout(self.dense(a), training=True))

        def call(self, a):
            return self.block(a)

    def trained(scope):
        keras.utils.set_random_seed(2)
        with scope:
            model = keras.Sequential([keras.Input((3,)), Noisy()])
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", steps_per_execution=2)
        x = np.random.default_rng(0).random((8, 3), np.float32)
        model.fit(x, np.zeros((8, 4), np.float32), batch_size=2, shuffle=False, verbose=0)
        return model.get_weights()

    plain = trained(keras.utils.custom_object_scope({}))
    for a, b in zip(plain, trained(ipu.ipu_strategy.IPUStrategy().scope())):
        np.testing.assert_allclose(b, a, atol=1e-6)


def test_functions_called_inside_key_the_kept_calls_too():
    # The printed jaxpr does not show a host callback's function or a custom_vjp's backward:
    # a closure value they read that changes makes a new call, as in plain JAX.
    state = {"k": 1.0, "scale": 1.0}

    @ipu.outlined_function
    def scaled(x):
        k = state["k"]
        return jax.pure_callback(lambda v: np.asarray(v) * k,
                                 jax.ShapeDtypeStruct(x.shape, x.dtype), x)

    @ipu.outlined_function
    def summed(x):
        @jax.custom_vjp
        def identity(v):
            return v

        scale = state["scale"]
        identity.defvjp(lambda v: (v, None), lambda _, g: (g * scale,))
        return identity(x).sum()

    x = jnp.ones(3)
    np.testing.assert_array_equal(scaled(x), [1.0, 1.0, 1.0])
    np.testing.assert_array_equal(jax.grad(summed)(x), [1.0, 1.0, 1.0])
    state.update(k=7.0, scale=5.0)
    np.testing.assert_array_equal(scaled(x), [7.0, 7.0, 7.0])
    np.testing.assert_array_equal(jax.grad(summed)(x), [5.0, 5.0, 5.0])
    with pytest.raises(jax.errors.TracerBoolConversionError, match="tracing the function <lambda>"):
        ipu.outlined_function(lambda a, s: a if s else -a)(x, False)  # the user's name


def test_a_function_that_enqueues_to_an_outfeed_is_inlined_and_its_values_arrive():
    # Before: the outlined trace's enqueue was kept, a value of another trace, and the
    # program failed ("Computation compiled for 2 inputs but called with 1").
    configure(1)
    outfeed = ipu.ipu_outfeed_queue.IPUOutfeedQueue()

    @ipu.outlined_function
    def body(x):
        outfeed.enqueue(x * 2)
        return x + 1

    strategy = ipu.ipu_strategy.IPUStrategy()
    with strategy.scope():
        looped = strategy.run(lambda x: ipu.loops.repeat(3, body, [x]), args=(jnp.ones(2),))
        np.testing.assert_array_equal(looped, [4.0, 4.0])
        np.testing.assert_array_equal(outfeed.dequeue(), [[2.0, 2.0], [4.0, 4.0], [6.0, 6.0]])
        once = strategy.run(body, args=(jnp.ones(2),))  # one element per run of a program
        np.testing.assert_array_equal(once, [2.0, 2.0])
        np.testing.assert_array_equal(outfeed.dequeue(), [[2.0, 2.0]])
