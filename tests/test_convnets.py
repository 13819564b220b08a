"""Convolutional models equal plain Keras 3, on one IPU and pipelined (keras.applications)."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_ipu as ipu

from conftest import assert_weights_close, configure

MICRO, GA = 16, 4


def _data(shape, classes, samples=32, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, *shape)).astype("float32")
    y = rng.integers(0, classes, size=(samples,)).astype("int32")
    return x, y


def _mobilenet():
    keras.utils.set_random_seed(3)
    # MobileNet (v1) at width 0.25: keras.applications' smallest convnet, compiled in half
    # the time of MobileNetV2 (ResNet50 runs pipelined in the seed's example).
    return keras.applications.MobileNet(weights=None, input_shape=(32, 32, 3), alpha=0.25,
                                        classes=4)


def _twin(build, strategy):
    plain = build()
    with strategy.scope():
        on_ipu = build()
    on_ipu.set_weights(plain.get_weights())
    return plain, on_ipu


def test_a_keras_applications_convnet_pipelined_equals_plain_keras_accumulating(strategy):
    configure(2)
    # Micro batches of 16: at 32 x 32 the last blocks see 1 x 1 maps, which batch
    # normalization over 4 samples makes chaotic (plain Keras against itself with
    # its weights perturbed by 1e-7 differs by 7e-5 in its predictions; by 3e-7 here).
    x, y = _data((32, 32, 3), 4, samples=128)
    plain, model = _twin(_mobilenet, strategy)
    assignment = model.get_pipeline_stage_assignment()
    for i, entry in enumerate(assignment):
        entry.pipeline_stage = 0 if i < len(assignment) // 2 else 1
    model.set_pipeline_stage_assignment(assignment)
    plain.compile(optimizer=keras.optimizers.SGD(0.01, gradient_accumulation_steps=GA),
                  loss="sparse_categorical_crossentropy")
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy",
                  steps_per_execution=GA)
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=GA,
                                 gradient_accumulation_reduction_method="mean")
    expected = plain.fit(x, y, batch_size=MICRO, shuffle=False, verbose=0)
    actual = model.fit(x, y, batch_size=MICRO, shuffle=False, verbose=0)
    assert ipu.utils.execution_report(model, "fit").pipeline.num_stages == 2
    np.testing.assert_allclose(actual.history["loss"], expected.history["loss"], rtol=1e-4)
    np.testing.assert_allclose(model.predict(x, batch_size=MICRO, verbose=0),
                               plain.predict(x, batch_size=MICRO, verbose=0), atol=1e-6)
    # Two updates of batch statistics over 16 samples still grow rounding differences
    # (5e-5 in the first kernels, measured) while the predictions agree to 3e-8.
    assert_weights_close(plain.get_weights(), model.get_weights(), atol=5e-4)


def _convnet():
    keras.utils.set_random_seed(4)
    inputs = keras.Input((12, 12, 3))
    h = keras.layers.Conv2D(8, 3, strides=2, padding="same")(inputs)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.ReLU()(h)
    skip = h
    h = keras.layers.DepthwiseConv2D(3, padding="same", depth_multiplier=2)(h)
    h = keras.layers.Conv2D(8, 1)(h)
    h = keras.layers.Add()([h, skip])
    h = keras.layers.SeparableConv2D(6, 3, dilation_rate=2, padding="same")(h)
    h = keras.layers.Conv1D(4, 2)(keras.layers.Reshape((36, 6))(h))
    outputs = keras.layers.Dense(3)(keras.layers.GlobalAveragePooling1D()(h))
    return keras.Model(inputs, outputs)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_a_convnet_on_one_ipu_equals_plain_keras(strategy, accumulation):
    x, y = _data((12, 12, 3), 3, samples=64, seed=1)
    plain, model = _twin(_convnet, strategy)
    optimizer = keras.optimizers.SGD
    plain.compile(optimizer=optimizer(0.05, gradient_accumulation_steps=accumulation
                                      if accumulation > 1 else None),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.compile(optimizer=optimizer(0.05), steps_per_execution=8,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    if accumulation > 1:
        model.set_gradient_accumulation_options(
            gradient_accumulation_steps_per_replica=accumulation,
            gradient_accumulation_reduction_method="mean")
    expected = plain.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    actual = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    report = ipu.utils.execution_report(model, "fit")
    assert report.loop == "scan" and "convolution" in report.loop_reason
    np.testing.assert_allclose(actual.history["loss"], expected.history["loss"], rtol=1e-5)
    assert_weights_close(plain.get_weights(), model.get_weights(), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(model.predict(x, batch_size=4, verbose=0),
                               plain.predict(x, batch_size=4, verbose=0), atol=1e-5)


def _decoder():
    keras.utils.set_random_seed(4)
    return keras.Sequential([
        keras.Input((6, 6, 3)),
        keras.layers.Conv2DTranspose(4, 3, strides=2, padding="same", activation="relu"),
        keras.layers.Conv2DTranspose(2, 2, strides=1, padding="valid", dilation_rate=1),
        keras.layers.Reshape((13 * 13, 2)),
        keras.layers.Conv1DTranspose(2, 3, strides=2),
        keras.layers.GlobalAveragePooling1D(),
        keras.layers.Dense(3),
    ])


def test_transposed_convolutions_keep_the_device_loop_and_equal_plain_keras(strategy):
    # Keras' Conv*Transpose reach lax.conv_transpose, which bypassed the CPU convolutions:
    # the execution ran in the host loop.
    configure(1)
    x, y = _data((6, 6, 3), 3, samples=32, seed=2)
    plain, model = _twin(_decoder, strategy)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    plain.compile(optimizer=keras.optimizers.SGD(0.05), loss=loss)
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss=loss, steps_per_execution=4)
    expected = plain.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    actual = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert ipu.utils.execution_report(model, "fit").loop == "scan"
    np.testing.assert_allclose(actual.history["loss"], expected.history["loss"], rtol=1e-5)
    assert_weights_close(plain.get_weights(), model.get_weights(), atol=1e-5, rtol=1e-5)
