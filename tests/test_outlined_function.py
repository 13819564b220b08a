"""`ipu.outlined_function`: one copy of the function in the program, called at each use."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import keras_ipu as ipu
from keras_ipu.device import accounting


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
    np.testing.assert_allclose(_net(outlined)(x, w1, w2), _net(_block)(x, w1, w2), rtol=1e-6)
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
