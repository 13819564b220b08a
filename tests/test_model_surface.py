"""The Keras model API around fit on IPU models: names, builds, overrides, as plain Keras."""

from __future__ import annotations

import contextlib

import keras
import numpy as np
import pytest

import keras_ipu as ipu

from conftest import assert_weights_close, configure


class _Net(keras.Model):
    """A subclassed model whose layers are built by their first call."""

    def __init__(self, stage=lambda _: contextlib.nullcontext(), **kwargs):
        super().__init__(name="net", **kwargs)
        self.stage = stage
        self.body = keras.layers.Dense(4, activation="tanh", name="body")
        self.head = keras.layers.Dense(1, name="head")

    def call(self, x):
        with self.stage(0):
            h = self.body(x)
        with self.stage(1):
            return self.head(h)


class _BuildsLayers(keras.Model):
    """A pipelined subclassed model that makes a layer in `build`, sized from its input."""

    def __init__(self, **kwargs):
        super().__init__(name="net", **kwargs)
        self.head = keras.layers.Dense(1, name="head")

    def build(self, input_shape):
        self.body = keras.layers.Dense(input_shape[-1], activation="tanh", name="body")
        super().build(input_shape)

    def call(self, x):
        with ipu.keras.PipelineStage(0):
            h = self.body(x)
        with ipu.keras.PipelineStage(1):
            return self.head(h)


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 4)).astype("float32")
    return x, x.sum(1, keepdims=True)


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_subclassed_model_built_by_fit_has_plain_keras_paths_and_weights(strategy, pipelined):
    # Built by fit's trace of `call`, its layers lost the model's name (`body/kernel`
    # for `net/body/kernel`), and path-keyed APIs (MultiOptimizer, set_state_tree)
    # matched nothing.
    configure(2 if pipelined else 1)
    x, y = _data()
    keras.utils.set_random_seed(1)
    plain = _Net()
    plain.compile(optimizer="sgd", loss="mse")
    plain.fit(x[:16], y[:16], batch_size=16, verbose=0)  # builds it; then a copy starts equal
    start = plain.get_weights()
    with ipu.ipu_strategy.IPUStrategy().scope():
        model = _Net(stage=ipu.keras.PipelineStage if pipelined else _Net().stage)
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=4)
    if pipelined:
        model.set_pipelining_options(gradient_accumulation_steps_per_replica=4,
                                     gradient_accumulation_reduction_method="mean")
    model.predict(x, batch_size=4, verbose=0)  # the first build: by the trace
    paths = [v.path for v in model.weights]
    assert paths == [v.path for v in plain.weights] and "net/body/kernel" in paths
    model.set_weights(start)
    plain.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=4 if pipelined else 16, shuffle=False, verbose=0)
    assert_weights_close(plain.get_weights(), model.get_weights())


def test_a_pipelined_model_making_layers_in_build_is_told_to_build_first(strategy):
    # The trace's error told to use Keras layers and ops, which the model did.
    configure(2)
    x, y = _data()
    with ipu.ipu_strategy.IPUStrategy().scope():
        model = _BuildsLayers()
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=4)
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=4)
    with pytest.raises(Exception, match=r"makes its layers in `build`, which has not run"):
        model.fit(x, y, batch_size=4, verbose=0)
    model.build((None, 4))
    model.fit(x, y, batch_size=4, verbose=0)
    assert [v.path for v in model.weights][-2:] == ["net/body/kernel", "net/body/bias"]


def test_overrides_keras_functions_are_refused_for_fit_validation_too(strategy):
    # fit's validation silently skipped an override of make_test_function that
    # evaluate refuses.
    class Overriding(keras.Sequential):
        def make_test_function(self, force=False):
            return super().make_test_function(force)

    x, y = _data()
    with strategy.scope():
        model = Overriding([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    before = model.get_weights()
    with pytest.raises(RuntimeError, match="`make_test_function` for the model"):
        model.fit(x, y, batch_size=4, validation_data=(x, y), verbose=0)
    assert_weights_close(before, model.get_weights(), atol=0)
    model.fit(x, y, batch_size=4, verbose=0)  # without validation it trains


def test_a_model_compiled_to_run_eagerly_is_refused_by_the_batch_methods_as_by_fit(strategy):
    # The batch methods silently ran the step compiled.
    x, y = _data()
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse", run_eagerly=True)
    before = model.get_weights()
    for call in (lambda: model.fit(x, y, verbose=0), lambda: model.train_on_batch(x, y),
                 lambda: model.test_on_batch(x, y), lambda: model.predict_on_batch(x)):
        with pytest.raises(RuntimeError, match="cannot run eagerly when using `IPUStrategy`"):
            call()
    assert_weights_close(before, model.get_weights(), atol=0)
