"""Float8 training (`model.quantize("float8")`) with gradient accumulation and replicas.

Keras overwrites a float8 layer's scales and amax histories with their
"gradient" (their new value) and, accumulating gradients itself, takes the
maximum over the micro-batches: so do keras_ipu's accumulation and replicas,
which then equal plain Keras' big batch.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

from conftest import configure

BATCH = 16  # plain Keras' batch


def _data():
    rng = np.random.default_rng(0)
    return (rng.normal(size=(64, 6)).astype("float32"),
            rng.normal(size=(64, 3)).astype("float32"))


def _quantized(weights=None) -> keras.Model:
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(3)])
    if weights is not None:
        model.set_weights(weights)
    model.quantize("float8")
    return model


def _scales(model) -> list:
    return [(v.name, v.numpy()) for v in model.trainable_variables
            if v.path.endswith(("inputs_scale", "kernel_scale"))]


def _kernels(model) -> list:
    return [v.numpy() for v in model.trainable_variables
            if v.path.endswith(("kernel", "bias"))]


@pytest.mark.parametrize("setup", ["accumulated", "replicated"])
def test_float8_scales_combine_as_in_keras(setup, strategy):
    x, y = _data()
    keras.utils.set_random_seed(0)
    weights = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8),
                                keras.layers.Dense(3)]).get_weights()
    plain = _quantized(weights)
    plain.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    plain.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)

    configure(1 if setup == "accumulated" else 2)
    with strategy.scope():
        model = _quantized(weights)
    if setup == "accumulated":  # 4 micro-batches of 4, their mean
        model.set_gradient_accumulation_options(
            gradient_accumulation_steps_per_replica=4,
            gradient_accumulation_reduction_method="mean")
        batch, learning_rate = 4, 0.1
    else:  # 2 replicas of 8, their gradients summed
        batch, learning_rate = 8, 0.05
    model.compile(optimizer=keras.optimizers.SGD(learning_rate), loss="mse",
                  steps_per_execution=4)
    model.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0)

    # Before: the scales were summed over micro-batches or replicas (1.21 for 0.0069).
    for (name, value), (_, expected) in zip(_scales(model), _scales(plain), strict=True):
        np.testing.assert_allclose(value, expected, rtol=1e-5, err_msg=name)
    # The weights: up to float8's rounding of gradients scaled per micro-batch.
    for ours, theirs in zip(_kernels(model), _kernels(plain)):
        np.testing.assert_allclose(ours, theirs, atol=2e-3)


def test_a_pipelined_float8_model_is_refused_before_any_step(strategy):
    configure(2)
    x, y = _data()
    with strategy.scope():
        model = _quantized()
    model.set_pipeline_stage_assignment([0, 1])
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=4)
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=4)
    weights = model.get_weights()
    with pytest.raises(NotImplementedError, match="cannot train float8 layers"):
        model.fit(x, y, batch_size=4, verbose=0)
    for before, after in zip(weights, model.get_weights()):
        np.testing.assert_array_equal(before, after)
    # Inference needs no accumulation: it runs.
    assert model.predict(x, batch_size=4, verbose=0).shape == (64, 3)
