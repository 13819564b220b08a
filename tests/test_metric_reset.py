"""keras_ipu.keras.metric_reset: a model's metrics reset as Keras' `reset_metrics` resets them."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from keras_ipu.keras.metric_reset import reset_metrics


class _Lowest(keras.metrics.Metric):
    """A metric whose reset is not a zero: it must reset itself."""

    def __init__(self):
        super().__init__(name="lowest")
        self.low = self.add_variable(shape=(), initializer="zeros", name="low")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.low.assign(keras.ops.minimum(self.low.value, keras.ops.min(y_pred)))

    def reset_state(self):
        self.low.assign(np.inf)

    def result(self):
        return keras.ops.convert_to_tensor(self.low)


class _MeanWithExtra(keras.metrics.MeanMetricWrapper):
    """Keras' Mean reset zeroes `total` and `count` only: `extra` keeps its value."""

    def __init__(self):
        super().__init__(fn=keras.losses.mean_absolute_error, name="mean_with_extra")
        self.extra = self.add_variable(shape=(2,), initializer="ones", name="extra")


def _model():
    inputs = keras.Input((4,))
    outputs = [keras.layers.Dense(3, name="a")(inputs), keras.layers.Dense(2, name="b")(inputs)]
    model = keras.Model(inputs, outputs)
    model.compile("sgd", loss=["mse", "mse"],
                  metrics=[["mae", keras.metrics.AUC(), _Lowest()], None],
                  weighted_metrics=[["mae"], ["mse", _MeanWithExtra()]])
    x = np.random.default_rng(0).random((16, 4), dtype="float32")
    y = [np.ones((16, 3), "float32"), np.zeros((16, 2), "float32")]
    model.fit(x, y, sample_weight=np.ones(16), verbose=0)
    return model


def _values(model):
    return [(np.asarray(v.value).copy(), v.value.dtype) for v in model.metrics_variables]


def test_the_metrics_get_the_values_keras_resets_them_to():
    model = _model()
    trained = _values(model)
    assert sum(np.abs(np.nan_to_num(value)).sum() for value, _ in trained) > 0
    reset_metrics(model)
    ours = _values(model)
    for variable, (value, _) in zip(model.metrics_variables, trained):
        variable.assign(value)
    model.reset_metrics()
    theirs = _values(model)
    assert len(ours) == len(theirs) == len(model.metrics_variables)
    for (mine, my_dtype), (keras_value, keras_dtype) in zip(ours, theirs):
        np.testing.assert_array_equal(mine, keras_value)
        assert my_dtype == keras_dtype
    # The checks above compare something: a custom reset and an untouched extra variable.
    lowest = next(m for m in model._compile_metrics._flat_metrics[0].metrics
                  if isinstance(m, _Lowest))
    assert float(lowest.low.value) == np.inf
    extra = next(m for m in model._compile_metrics._flat_weighted_metrics[1].metrics
                 if isinstance(m, _MeanWithExtra))
    np.testing.assert_array_equal(np.asarray(extra.extra.value), [1.0, 1.0])


def test_a_model_that_overrides_reset_metrics_is_left_to_it():
    class Counting(keras.Sequential):
        resets = 0

        def reset_metrics(self):
            type(self).resets += 1
            super().reset_metrics()

    model = Counting([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    model.fit(np.ones((4, 2)), np.ones((4, 1)), verbose=0)
    before = Counting.resets
    reset_metrics(model)
    assert Counting.resets == before + 1
    assert float(model.metrics[0].count.value) == 0.0


@pytest.mark.parametrize("compiled", [False, True])
def test_an_unbuilt_or_uncompiled_model_resets_nothing_it_does_not_have(compiled):
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    if compiled:
        model.compile("sgd", "mse", metrics=["mae"])  # the compiled metrics are not built yet
    reset_metrics(model)
    assert all(float(np.sum(v.value)) == 0.0 for v in model.metrics_variables)


def _compiled(metrics=("mae",)):
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse", metrics=list(metrics))
    model.fit(np.ones((4, 2)), np.ones((4, 1)), verbose=0)
    return model


def test_resets_set_on_an_instance_are_called_as_keras_calls_them():
    model = _compiled()
    calls = []
    model.reset_metrics = lambda: calls.append("model")  # as mock.patch.object sets it
    reset_metrics(model)
    assert calls == ["model"] and float(model.metrics[0].count.value) > 0
    del model.reset_metrics
    tracker = model.metrics[0]
    tracker.reset_state = lambda: tracker.total.assign(7.0)
    reset_metrics(model)
    assert float(tracker.total.value) == 7.0


class _Holding(keras.metrics.Metric):
    """Keras' zeroing reset, over a sub-metric that is also compiled on its own."""

    def __init__(self, inner):
        super().__init__(name="holding")
        self.inner = inner

    def update_state(self, y_true, y_pred, sample_weight=None):
        pass

    def result(self):
        return self.inner.result()


def test_a_custom_reset_after_a_zeroing_one_of_the_same_variable_wins_as_in_keras():
    lowest = _Lowest()
    model = _compiled([_Holding(lowest), lowest])
    reset_metrics(model)  # Keras' order: the holder's zeros, then the inner metric's reset
    assert float(lowest.low.value) == np.inf


def test_a_custom_reset_that_raises_leaves_the_metrics_before_it_reset_as_keras_does():
    class Failing(_Lowest):
        fails = False

        def reset_state(self):
            if self.fails:
                raise RuntimeError("cannot reset")
            super().reset_state()

    failing = Failing()
    model = _compiled([failing])
    assert float(model.metrics[0].count.value) > 0
    failing.fails = True
    with pytest.raises(RuntimeError, match="cannot reset"):
        reset_metrics(model)
    assert float(model.metrics[0].count.value) == 0.0  # the loss tracker comes first
