"""fit/evaluate/predict on one IPU equal plain Keras 3 on the same data and weights."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_ipu as ipu

from conftest import assert_history_close, assert_trees_close, assert_weights_close
from models import data_for, twin


@pytest.mark.parametrize("steps_per_execution", [1, 8])
@pytest.mark.parametrize("kind", ["sequential", "functional", "subclassed"])
def test_fit_matches_plain_keras(kind, steps_per_execution, strategy):
    plain, on_ipu = twin(kind, strategy, steps_per_execution)
    x, y = data_for(kind)
    args = dict(batch_size=8, epochs=2, shuffle=False, verbose=0)

    expected = plain.fit(x, y, **args)
    actual = on_ipu.fit(x, y, **args)

    assert_weights_close(plain.get_weights(), on_ipu.get_weights())
    assert_history_close(expected.history, actual.history)
    np.testing.assert_allclose(
        on_ipu.evaluate(x, y, batch_size=8, verbose=0),
        plain.evaluate(x, y, batch_size=8, verbose=0),
        atol=1e-6,
    )
    expected_pred = plain.predict(x, batch_size=8, verbose=0)
    actual_pred = on_ipu.predict(x, batch_size=8, verbose=0)
    assert_trees_close(expected_pred, actual_pred)


def test_fit_runs_one_program_per_execution(strategy):
    plain, on_ipu = twin("sequential", strategy, steps_per_execution=4)
    x, y = data_for("sequential", samples=64)
    seen = []

    class Recorder(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append((batch, round(float(logs["loss"]), 6)))

    history = on_ipu.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
                         callbacks=[Recorder()])
    # 8 batches, 4 per execution: callbacks once per execution, at its last step.
    assert [batch for batch, _ in seen] == [3, 7]
    report = ipu.utils.execution_report(on_ipu, mode="fit")
    assert report.steps_per_execution == 4
    assert history.history["loss"][0] == pytest.approx(seen[-1][1], abs=1e-5)


def test_validation_data_and_split_match_plain_keras(strategy):
    plain, on_ipu = twin("sequential", strategy, steps_per_execution=2)
    x, y = data_for("sequential", samples=80)
    args = dict(batch_size=8, epochs=2, shuffle=False, verbose=0)
    expected = plain.fit(x[:64], y[:64], validation_data=(x[64:], y[64:]), **args)
    actual = on_ipu.fit(x[:64], y[:64], validation_data=(x[64:], y[64:]), **args)
    assert "val_loss" in actual.history
    assert_history_close(expected.history, actual.history)

    plain, on_ipu = twin("sequential", strategy, steps_per_execution=2)
    expected = plain.fit(x, y, validation_split=0.2, **args)
    actual = on_ipu.fit(x, y, validation_split=0.2, **args)
    assert_history_close(expected.history, actual.history)
    assert_weights_close(plain.get_weights(), on_ipu.get_weights())


def test_sample_and_class_weights_match_plain_keras(strategy):
    x, _ = data_for("sequential", samples=64)
    rng = np.random.default_rng(3)
    weights = rng.uniform(0.1, 2.0, size=64).astype("float32")
    plain, on_ipu = twin("sequential", strategy, steps_per_execution=4)
    y = rng.normal(size=(64, 3)).astype("float32")
    args = dict(batch_size=8, epochs=1, shuffle=False, verbose=0)
    plain.fit(x, y, sample_weight=weights, **args)
    on_ipu.fit(x, y, sample_weight=weights, **args)
    assert_weights_close(plain.get_weights(), on_ipu.get_weights())


    labels = rng.integers(0, 3, size=64).astype("int32")
    plain, on_ipu = twin(
        "sequential", strategy, steps_per_execution=4, optimizer="sgd",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=[],
    )
    class_weight = {0: 0.5, 1: 2.0, 2: 1.0}
    plain.fit(x, labels, class_weight=class_weight, **args)
    on_ipu.fit(x, labels, class_weight=class_weight, **args)
    assert_weights_close(plain.get_weights(), on_ipu.get_weights())


def test_uint8_and_float64_inputs_match_plain_keras(strategy):
    rng = np.random.default_rng(1)
    x8 = rng.integers(0, 255, size=(32, 6)).astype("uint8")
    x64 = rng.normal(size=(32, 6))  # float64
    y = rng.normal(size=(32, 3))
    for x in (x8, x64):
        plain, on_ipu = twin("sequential", strategy, steps_per_execution=2)
        args = dict(batch_size=8, epochs=1, shuffle=False, verbose=0)
        plain.fit(x, y, **args)
        on_ipu.fit(x, y, **args)
        assert_weights_close(plain.get_weights(), on_ipu.get_weights(), atol=1e-5)


def test_evaluate_before_fit_and_predict_without_compile(strategy):

    from models import sequential

    keras.utils.set_random_seed(0)
    plain = sequential()
    with strategy.scope():
        on_ipu = sequential()
    on_ipu.set_weights(plain.get_weights())
    x, y = data_for("sequential", samples=32)
    np.testing.assert_allclose(
        on_ipu.predict(x, batch_size=8, verbose=0), plain.predict(x, batch_size=8, verbose=0),
        atol=1e-6,
    )
    plain.compile(loss="mse", metrics=["mae"], steps_per_execution=4)
    on_ipu.compile(loss="mse", metrics=["mae"], steps_per_execution=4)
    np.testing.assert_allclose(
        on_ipu.evaluate(x, y, batch_size=8, verbose=0),
        plain.evaluate(x, y, batch_size=8, verbose=0),
        atol=1e-6,
    )
    assert on_ipu.evaluate(x, y, batch_size=8, verbose=0, return_dict=True).keys() == {
        "loss", "mae"
    }


def _noisy(seed):
    return keras.Sequential([
        keras.Input((6,)),
        keras.layers.Dense(16, activation="relu"),
        keras.layers.Dropout(0.3, seed=seed),
        keras.layers.GaussianNoise(0.1, seed=seed + 1),
        keras.layers.Dense(3),
    ])


@pytest.mark.parametrize("steps_per_execution", [1, 4])
def test_dropout_and_noise_draw_plain_keras_random_bits(steps_per_execution, strategy):
    # keras_ipu lowers JAX's random-bits hash unrolled on CPUs
    # (device/lowering.py): the masks and the noise must be Keras' own.
    x, y = data_for("sequential", samples=64)
    keras.utils.set_random_seed(3)
    plain = _noisy(7)
    with strategy.scope():
        on_ipu, other_masks = _noisy(7), _noisy(8)
    initial = plain.get_weights()
    for m, spe in ((plain, 1), (on_ipu, steps_per_execution), (other_masks, steps_per_execution)):
        m.set_weights(initial)
        m.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", steps_per_execution=spe)
        m.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert_weights_close(plain.get_weights(), on_ipu.get_weights(), atol=1e-6)
    # Other masks end elsewhere: the comparison can fail.
    assert np.max(np.abs(other_masks.get_weights()[0] - plain.get_weights()[0])) > 1e-3


class _Sampling(keras.Model):
    """Draws from its own seed generator and counts its calls in `call` (a VAE's sampling)."""

    def __init__(self):
        super().__init__()
        self.encoder, self.decoder = keras.layers.Dense(4), keras.layers.Dense(4)
        self.seed_generator = keras.random.SeedGenerator(1337)
        self.calls = self.add_weight(shape=(), initializer="zeros", trainable=False)

    def call(self, x):
        self.calls.assign_add(1.0)
        h = self.encoder(x)
        noise = keras.random.normal(keras.ops.shape(h), seed=self.seed_generator)
        return self.decoder(h + noise)


def _built_twins(model_class, optimizer: str, strategy, x):
    """A plain and an IPU `model_class()`, compiled, built by a call on `x[:1]`, same weights."""
    keras.utils.set_random_seed(0)
    plain = model_class()
    plain.compile(optimizer, "mse")
    with strategy.scope():
        on_ipu = model_class()
        on_ipu.compile(optimizer, "mse")
    for model in (plain, on_ipu):
        model(x[:1])  # builds the layers (a call of its own on each model)
    on_ipu.set_weights(plain.get_weights())
    return plain, on_ipu


def test_state_a_subclassed_call_changes_moves_as_in_plain_keras(strategy):
    # keras_ipu traces `call` to find pipeline stages; that trace must change nothing.
    x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
    plain, on_ipu = _built_twins(_Sampling, "adam", strategy, x)
    for model in (plain, on_ipu):
        model.fit(x, x, batch_size=8, epochs=2, shuffle=False, verbose=0)
        model.evaluate(x, x, batch_size=8, verbose=0)
        model.predict(x, batch_size=8, verbose=0)
    np.testing.assert_array_equal(on_ipu.seed_generator.state, plain.seed_generator.state)
    assert float(on_ipu.calls) == float(plain.calls)
    assert_weights_close(plain.get_weights(), on_ipu.get_weights(), atol=1e-6)


class _Overriding(keras.Model):
    """Overrides fit, evaluate and predict, each reaching Keras' through `super()`."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(2)
        self.overrides = []

    def call(self, x):
        return self.dense(x)

    def fit(self, *args, **kwargs):
        self.overrides.append("fit")
        kwargs.setdefault("epochs", 3)
        return super().fit(*args, **kwargs)

    def evaluate(self, *args, **kwargs):
        self.overrides.append("evaluate")
        return super().evaluate(*args, **kwargs)

    def predict(self, x, **kwargs):
        self.overrides.append("predict")
        return super().predict(x, **kwargs) + 100.0


def test_a_models_own_fit_evaluate_and_predict_run_and_reach_the_ipus(strategy):
    x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
    y = x[:, :2] * 2.0
    plain, on_ipu = _built_twins(_Overriding, "sgd", strategy, x)
    histories = [m.fit(x, y, batch_size=8, shuffle=False, verbose=0) for m in (plain, on_ipu)]
    assert len(histories[1].history["loss"]) == 3  # the override's default epochs
    assert_history_close(histories[0].history, histories[1].history)
    np.testing.assert_allclose(on_ipu.evaluate(x, y, batch_size=8, verbose=0),
                               plain.evaluate(x, y, batch_size=8, verbose=0), rtol=1e-6)
    np.testing.assert_allclose(on_ipu.predict(x, batch_size=8, verbose=0),
                               plain.predict(x, batch_size=8, verbose=0), rtol=1e-6)
    assert on_ipu.overrides == plain.overrides == ["fit", "evaluate", "predict"]
    assert int(on_ipu.optimizer.iterations) == 12
    from keras_ipu.keras import run  # the IPU programs ran, not Keras' own loop

    assert all(run.program_for(on_ipu, mode) is not None for mode in ("fit", "evaluate",
                                                                      "predict"))


@pytest.mark.parametrize("data_format", ["channels_last", "channels_first"])
def test_random_crop_which_keras_runs_eagerly_trains_as_plain_keras(strategy, data_format):
    # RandomCrop (supports_jit=False) sliced at traced offsets: fit raised "Slice entries
    # must be static integers". It crops at the offsets Keras draws, as Keras' eager step.
    rng = np.random.default_rng(0)
    shape = (8, 8, 3) if data_format == "channels_last" else (3, 8, 8)
    x = rng.uniform(size=(32, *shape)).astype("float32")
    y = rng.normal(size=(32, 1)).astype("float32")

    def make():
        keras.utils.set_random_seed(3)
        return keras.Sequential([
            keras.Input(shape), keras.layers.RandomCrop(6, 5, seed=7, data_format=data_format),
            keras.layers.Conv2D(2, 3, data_format=data_format),
            keras.layers.GlobalAveragePooling2D(data_format=data_format), keras.layers.Dense(1)])

    plain = make()
    plain.compile(optimizer="sgd", loss="mse")
    with strategy.scope():
        on_ipu = make()
        on_ipu.compile(optimizer="sgd", loss="mse", steps_per_execution=4)
    args = dict(batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert_history_close(plain.fit(x, y, **args).history, on_ipu.fit(x, y, **args).history)
    assert_weights_close(plain.get_weights(), on_ipu.get_weights())
    # Inference crops the centre, as in Keras.
    assert_trees_close(plain.predict(x, batch_size=4, verbose=0),
                       on_ipu.predict(x, batch_size=4, verbose=0))


def test_one_metric_object_compiled_twice_trains_as_plain_keras(strategy):
    # One Metric in two places: its variables are in the state twice, and the program
    # donated one buffer twice ("Attempt to donate the same buffer twice").
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 6)).astype("float32"), rng.normal(size=(32, 2)).astype("float32")

    def make():
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((6,)), keras.layers.Dense(2)])

    plain = make()
    with strategy.scope():
        on_ipu = make()
    for model, spe in ((plain, 1), (on_ipu, 4)):
        mae = keras.metrics.MeanAbsoluteError()
        model.compile(optimizer="sgd", loss="mse", metrics=[mae, mae], steps_per_execution=spe)
    args = dict(batch_size=4, shuffle=False, verbose=0)
    assert_history_close(plain.fit(x, y, **args).history, on_ipu.fit(x, y, **args).history)
    assert_weights_close(plain.get_weights(), on_ipu.get_weights())
    np.testing.assert_allclose(on_ipu.evaluate(x, y, batch_size=4, verbose=0),
                               plain.evaluate(x, y, batch_size=4, verbose=0), rtol=1e-6)
    np.testing.assert_allclose(on_ipu.train_on_batch(x[:4], y[:4]),
                               plain.train_on_batch(x[:4], y[:4]), rtol=1e-6)
