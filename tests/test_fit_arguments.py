"""`fit`'s arguments and Keras' settings around it behave as in plain Keras 3.

Each test runs the same call on a plain Keras model and an IPU model with the
same initial weights and compares what comes out.
"""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest

from keras_ipu.keras.options import options_of

from conftest import assert_history_close, assert_weights_close
from models import ArrayBatches, data_for, twin

BATCH = 8


class Batches(ArrayBatches):
    """Array batches of `BATCH` rows as a `PyDataset`, in order."""

    def __init__(self, x, y):
        super().__init__(x, y, BATCH)


def _both(plain, on_ipu, call):
    """`call(model)` on each model: (plain's result, the IPU model's)."""
    return call(plain), call(on_ipu)


@pytest.mark.parametrize("shuffle", [True, "batch"])
def test_the_first_shuffled_fit_of_a_fresh_model_sees_plain_kerases_order(shuffle, strategy):
    # Keras builds the metrics from a shuffled pass of its own first: its draw counts.
    plain, on_ipu = twin("sequential", strategy, steps_per_execution=2)
    x, y = data_for("sequential", samples=96)
    results = []
    for model in (plain, on_ipu):
        keras.utils.set_random_seed(7)
        results.append(model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=shuffle, verbose=0))
    assert_weights_close(plain.get_weights(), on_ipu.get_weights(), atol=1e-6)
    assert_history_close(results[0].history, results[1].history)


def test_backup_and_restore_resumes_at_the_backed_up_epoch(strategy, tmp_path):
    plain, on_ipu = twin("sequential", strategy, steps_per_execution=2)
    x, y = data_for("sequential", samples=64)

    class Interrupt(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 2:
                raise RuntimeError("interrupted")

    histories = []
    for name, model in (("plain", plain), ("ipu", on_ipu)):
        backup = str(tmp_path / name)
        with pytest.raises(RuntimeError, match="interrupted"):
            model.fit(x, y, batch_size=BATCH, epochs=5, shuffle=False, verbose=0,
                      callbacks=[keras.callbacks.BackupAndRestore(backup), Interrupt()])
        histories.append(model.fit(x, y, batch_size=BATCH, epochs=5, shuffle=False, verbose=0,
                                   callbacks=[keras.callbacks.BackupAndRestore(backup)]))
    assert histories[1].epoch == histories[0].epoch == [3, 4]
    assert int(on_ipu.optimizer.iterations) == int(plain.optimizer.iterations) == 5 * 8
    assert_weights_close(plain.get_weights(), on_ipu.get_weights(), atol=1e-6)


@pytest.mark.parametrize("source", ["arrays", "py_dataset"])
def test_validation_steps_read_the_same_batches_every_epoch(source, strategy):
    plain, on_ipu = twin("sequential", strategy, steps_per_execution=2)
    x, y = data_for("sequential", samples=64)
    val_x, val_y = data_for("sequential", samples=6 * BATCH, seed=1)
    validation = (val_x, val_y) if source == "arrays" else Batches(val_x, val_y)
    expected, actual = _both(plain, on_ipu, lambda model: model.fit(
        x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0,
        validation_data=validation, validation_steps=2))
    assert_history_close(expected.history, actual.history)
    # Every epoch's validation: the first two batches, with that epoch's weights.
    first_two = on_ipu.evaluate(val_x[: 2 * BATCH], val_y[: 2 * BATCH], batch_size=BATCH,
                                verbose=0)
    np.testing.assert_allclose(actual.history["val_loss"][-1], first_two[0], rtol=1e-6)


def test_a_py_dataset_validates_arrays_trained_with_a_batch_size(strategy):
    plain, on_ipu = twin("sequential", strategy, steps_per_execution=2)
    x, y = data_for("sequential", samples=64)
    validation = Batches(*data_for("sequential", samples=32, seed=1))
    expected, actual = _both(plain, on_ipu, lambda model: model.fit(
        x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
        validation_data=validation))
    assert_history_close(expected.history, actual.history)
    np.testing.assert_allclose(
        *_both(plain, on_ipu, lambda model: model.evaluate(validation, batch_size=BATCH,
                                                           verbose=0)), rtol=1e-6)


def test_the_batch_size_is_inferred_from_the_steps_as_in_keras(strategy):
    plain, on_ipu = twin("sequential", strategy, steps_per_execution=2)
    x, y = data_for("sequential", samples=64)
    expected, actual = _both(plain, on_ipu, lambda model: model.fit(
        x, y, steps_per_epoch=4, epochs=2, shuffle=False, verbose=0))
    assert_history_close(expected.history, actual.history)
    assert_weights_close(plain.get_weights(), on_ipu.get_weights(), atol=1e-6)
    assert int(on_ipu.optimizer.iterations) == 8  # batches of 16, not 32
    np.testing.assert_allclose(
        *_both(plain, on_ipu, lambda model: model.evaluate(x, y, steps=4, verbose=0)),
        rtol=1e-6)
    np.testing.assert_allclose(
        *_both(plain, on_ipu, lambda model: model.predict(x, steps=4, verbose=0)),
        rtol=1e-6, atol=1e-6)


@pytest.fixture
def capped():
    """Keras' debugging caps on epochs and steps, reset after the test."""
    yield keras.config
    keras.config.set_max_epochs(None)
    keras.config.set_max_steps_per_epoch(None)


def test_kerases_caps_on_epochs_and_steps_per_epoch_hold(capped, strategy):
    plain, on_ipu = twin("sequential", strategy, steps_per_execution=2)
    x, y = data_for("sequential", samples=64)
    capped.set_max_epochs(2)
    capped.set_max_steps_per_epoch(4)
    with pytest.warns(UserWarning, match="Limiting epochs to 2"):
        expected, actual = _both(plain, on_ipu, lambda model: model.fit(
            x, y, batch_size=BATCH, epochs=5, shuffle=False, verbose=0))
    assert actual.epoch == expected.epoch == [0, 1]
    assert int(on_ipu.optimizer.iterations) == int(plain.optimizer.iterations) == 2 * 4
    assert_weights_close(plain.get_weights(), on_ipu.get_weights(), atol=1e-6)
    assert_history_close(expected.history, actual.history)


class ShuffledBatches(Batches):
    """`Batches` that records which batch each training step took."""

    def __init__(self, x, y, seen):
        super().__init__(x, y)
        self.seen = seen

    def __getitem__(self, index):
        self.seen.append(index)
        return super().__getitem__(index)


def test_a_shuffled_py_dataset_gives_plain_kerases_order_from_the_first_fit(strategy):
    # Keras builds the loss and metrics from a pass of its own: its shuffle counts.
    plain, on_ipu = twin("sequential", strategy, steps_per_execution=2)
    x, y = data_for("sequential", samples=64)
    seen, histories = {}, []
    for name, model in (("plain", plain), ("ipu", on_ipu)):
        seen[name] = []
        keras.utils.set_random_seed(11)
        data = ShuffledBatches(x, y, seen[name])
        data.shuffle = True
        histories.append(model.fit(data, epochs=2, shuffle=True, verbose=0))
    # keras_ipu reads the last batch once more after the first (refusing a partial batch).
    assert seen["ipu"].pop(1) == 7
    assert seen["ipu"] == seen["plain"] and len(seen["ipu"]) == 1 + 2 * 8
    assert_history_close(histories[0].history, histories[1].history)
    assert_weights_close(plain.get_weights(), on_ipu.get_weights(), atol=1e-6)


def test_a_layer_frozen_after_compile_predicts_and_evaluates_as_in_keras(strategy):
    plain, on_ipu = twin("sequential", strategy, steps_per_execution=2)
    x, y = data_for("sequential", samples=32)
    before = _both(plain, on_ipu, lambda model: model.predict(x, batch_size=BATCH, verbose=0))
    for model in (plain, on_ipu):
        model.layers[0].trainable = False  # no compile(): the state's structure changes
    after = _both(plain, on_ipu, lambda model: model.predict(x, batch_size=BATCH, verbose=0))
    np.testing.assert_allclose(after[1], before[1], atol=1e-6)
    np.testing.assert_allclose(after[1], after[0], atol=1e-6)
    np.testing.assert_allclose(
        *_both(plain, on_ipu, lambda model: model.evaluate(x, y, batch_size=BATCH, verbose=0)),
        rtol=1e-6)
    # Training it takes compile(), as in Keras: its error, and the weights are kept.
    weights, errors = on_ipu.get_weights(), []
    for model in (plain, on_ipu):
        model.layers[0].trainable = True
        model.layers[1].trainable = False
        with pytest.raises(ValueError) as raised:
            model.fit(x, y, batch_size=BATCH, verbose=0)
        errors.append(str(raised.value).splitlines()[0])
    for error in errors:  # Keras' own error: the optimizer's slots fit the old variables
        assert error.startswith("Invalid variable value in StatelessScope") and "(8, 3)" in error
    assert_weights_close(weights, on_ipu.get_weights(), atol=0)
    on_ipu.compile(optimizer="sgd", loss="mse", steps_per_execution=2)
    assert np.isfinite(on_ipu.fit(x, y, batch_size=BATCH, verbose=0).history["loss"][0])


def test_the_plan_is_logged_with_the_pipelines_accumulation(caplog):
    import logging

    import keras_ipu as ipu

    from conftest import configure
    from models import two_stage_mlp

    configure(4)
    x, y = data_for("sequential", samples=64)
    with ipu.ipu_strategy.IPUStrategy().scope():
        model = two_stage_mlp()
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=8)
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=4)
    with caplog.at_level(logging.INFO, logger="keras_ipu"):
        model.fit(x, y, batch_size=2, verbose=0)
    assert ("Training is distributed and accumulating 4 batches per optimizer step across 2 "
            "replicas, your effective batch size is 16.") in caplog.text
    assert ("Doing 2 weight updates per execution per replica, which is 4 per epoch per "
            "replica.") in caplog.text


class _ArrayLike:
    """A container NumPy reads through `__array__` (an h5py dataset, an xarray)."""

    def __init__(self, array):
        self.array, self.shape, self.dtype = array, array.shape, array.dtype

    def __array__(self, dtype=None, copy=None):
        return self.array if dtype is None else self.array.astype(dtype)

    def __len__(self):
        return len(self.array)


def test_array_likes_keras_slices_take_the_batch_size(strategy):
    plain, on_ipu = twin("sequential", strategy)
    x, y = data_for("sequential", samples=64)
    expected, actual = _both(plain, on_ipu, lambda model: model.fit(
        _ArrayLike(x), _ArrayLike(y), batch_size=BATCH, epochs=1, shuffle=False, verbose=0))
    assert int(on_ipu.optimizer.iterations) == 64 // BATCH  # not batches of 32
    assert_history_close(expected.history, actual.history)
    assert_weights_close(plain.get_weights(), on_ipu.get_weights(), atol=1e-6)
    np.testing.assert_allclose(
        *_both(plain, on_ipu, lambda model: model.predict(_ArrayLike(x[:40]), batch_size=BATCH,
                                                           verbose=0)), rtol=1e-6, atol=1e-6)


def test_an_unknown_keyword_raises_as_in_keras(strategy):
    plain, on_ipu = twin("sequential", strategy)
    x, y = data_for("sequential", samples=16)
    calls = {"fit": lambda m: m.fit(x, y, batch_size=BATCH, verbose=0, bad=1),
             "evaluate": lambda m: m.evaluate(x, y, batch_size=BATCH, verbose=0, bad=1),
             "predict": lambda m: m.predict(x, batch_size=BATCH, verbose=0, bad=1)}
    for name, call in calls.items():
        errors = []
        for model in (plain, on_ipu):
            with pytest.raises((TypeError, ValueError)) as raised:
                call(model)
            errors.append((type(raised.value), str(raised.value)))
        assert errors[1] == errors[0], name


class _Rotating(Batches):
    """Validation batches whose order turns by one in `on_epoch_end`; records the hooks."""

    def __init__(self, x, y):
        super().__init__(x, y)
        self.shift, self.hooks = 0, []

    def __getitem__(self, index):
        return super().__getitem__((index + self.shift) % len(self))

    def on_epoch_begin(self):
        self.hooks.append("begin")

    def on_epoch_end(self):
        self.hooks.append("end")
        self.shift += 1


def test_a_validation_py_datasets_epoch_hooks_run_before_each_validation_as_in_keras(strategy):
    # Keras resets its validation iterator before each validation (on_epoch_end): before,
    # keras_ipu did not, and with validation_steps the val_loss read other batches.
    plain, on_ipu = twin("sequential", strategy, steps_per_execution=2)
    x, y = data_for("sequential", samples=64)
    val_x, val_y = data_for("sequential", samples=8 * BATCH, seed=1)
    datasets = [_Rotating(val_x, val_y), _Rotating(val_x, val_y)]
    expected, actual = (model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0,
                                  validation_data=dataset, validation_steps=2)
                        for model, dataset in zip((plain, on_ipu), datasets))
    assert_history_close(expected.history, actual.history)
    # keras_ipu begins a pass once more, before training, to compile the validation program.
    assert datasets[1].hooks == ["begin", *datasets[0].hooks]


@pytest.mark.parametrize("frequency", [0, "2", 1.0])
def test_a_bad_validation_freq_is_refused_before_any_epoch(frequency, strategy):
    # Keras raises after the first epoch (0: ZeroDivisionError); nothing trains here.
    _, on_ipu = twin("sequential", strategy, steps_per_execution=2)
    x, y = data_for("sequential", samples=32)
    before = on_ipu.get_weights()
    with pytest.raises(ValueError, match=rf"`validation_freq` must be .* got {frequency!r}"):
        on_ipu.fit(x, y, batch_size=BATCH, verbose=0, validation_data=(x, y),
                   validation_freq=frequency)
    assert_weights_close(before, on_ipu.get_weights(), atol=0)
    assert int(on_ipu.optimizer.iterations) == 0


@pytest.mark.parametrize("split", [-0.1, 1.5])
def test_a_validation_split_outside_zero_to_one_is_refused_before_any_epoch(split, strategy):
    # Keras makes an empty part and trains on ("Your input ran out of data").
    _, on_ipu = twin("sequential", strategy, steps_per_execution=2)
    x, y = data_for("sequential", samples=32)
    before = on_ipu.get_weights()
    with pytest.raises(ValueError, match=rf"`validation_split` .* between 0 and 1: received "
                                         rf"{split}"):
        on_ipu.fit(x, y, batch_size=BATCH, verbose=0, validation_split=split)
    assert_weights_close(before, on_ipu.get_weights(), atol=0)


class _Freezes(keras.callbacks.Callback):
    def __init__(self, hook: str):
        super().__init__()
        setattr(self, hook, self._freeze)

    def _freeze(self, index=None, logs=None):
        self.model.layers[0].trainable = False  # at the first call


@pytest.mark.parametrize("hook, asynchronous", [
    ("on_train_begin", False), ("on_epoch_end", False), ("on_train_batch_end", False),
    ("on_train_batch_end", True)])
def test_a_callback_freezing_a_layer_mid_fit_stops_it_with_the_weights_kept(
        hook, asynchronous, strategy):
    # Before: JAX's pytree mismatch (plain Keras fails too, and loses the model); from an
    # asynchronous hook, Keras' "shape of the target variable" error, the weights back
    # at the start.
    plain, on_ipu = twin("sequential", strategy, steps_per_execution=2)
    on_ipu.set_asynchronous_callbacks(asynchronous)
    x, y = data_for("sequential", samples=32)
    with pytest.raises(ValueError, match="The model's variables changed during the run"):
        on_ipu.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                   callbacks=[_Freezes(hook)])
    # The weights are those of the last execution: none, one epoch, or its first execution.
    if hook != "on_train_begin":
        steps = None if hook == "on_epoch_end" else 2
        plain.fit(x, y, batch_size=BATCH, steps_per_epoch=steps, shuffle=False, verbose=0)
    assert_weights_close(plain.get_weights(), on_ipu.get_weights(), atol=1e-6)


class _Recompiles(keras.callbacks.Callback):
    def __init__(self, hook: str):
        super().__init__()
        setattr(self, hook, self._recompile)

    def _recompile(self, index=None, logs=None):
        self.model.compile(keras.optimizers.Adam(0.01), "mae", steps_per_execution=2)


@pytest.mark.parametrize("asynchronous", [False, True])
@pytest.mark.parametrize("hook", ["on_epoch_end", "on_train_batch_end"])
def test_a_callback_compiling_the_model_mid_fit_stops_it_with_the_weights_kept(
        hook, asynchronous, strategy):
    # Before: the run trained on with the old optimizer rule and loss, and the new
    # optimizer got the old one's learning rate (plain Keras: "'NoneType' object is not
    # callable").
    plain, on_ipu = twin("sequential", strategy, steps_per_execution=2)
    on_ipu.set_asynchronous_callbacks(asynchronous)
    x, y = data_for("sequential", samples=32)
    with pytest.raises(RuntimeError, match="The model was compiled again .* while it runs"):
        on_ipu.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                   callbacks=[_Recompiles(hook)])
    # The weights the model had when compiled: after one epoch, after the first
    # execution, or (an asynchronous hook runs while its execution does) the initial ones.
    if hook == "on_epoch_end" or not asynchronous:
        steps = None if hook == "on_epoch_end" else 2
        plain.fit(x, y, batch_size=BATCH, steps_per_epoch=steps, shuffle=False, verbose=0)
    assert_weights_close(plain.get_weights(), on_ipu.get_weights(), atol=1e-6)
    # The new compile holds: the next fit trains with Adam on the MAE, as plain Keras.
    plain.compile(keras.optimizers.Adam(0.01), "mae", steps_per_execution=2)
    histories = _both(plain, on_ipu, lambda m: m.fit(x, y, batch_size=BATCH, shuffle=False,
                                                     verbose=0).history)
    assert_history_close(*histories)
    assert_weights_close(plain.get_weights(), on_ipu.get_weights(), atol=1e-6)


def test_a_callback_compiling_the_model_at_the_last_batch_stops_fit_at_its_end(strategy):
    # Before (as plain Keras): "Cannot get result() since the metric has not yet been
    # built" from the epoch's logs, with no next execution to stop at.
    plain, on_ipu = twin("sequential", strategy, steps_per_execution=2)
    x, y = data_for("sequential", samples=32)
    last = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: (
        batch == 3 and on_ipu.compile(keras.optimizers.Adam(0.01), "mae")))
    with pytest.raises(RuntimeError, match="The model was compiled again .* while it runs"):
        on_ipu.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                   callbacks=[last])
    plain.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert_weights_close(plain.get_weights(), on_ipu.get_weights(), atol=1e-6)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_callback_compiling_the_model_at_the_last_predict_batch_gets_the_predictions(
        asynchronous, strategy):
    # predict reads no metrics: its results stand, as in plain Keras.
    plain, on_ipu = twin("sequential", strategy, steps_per_execution=2)
    on_ipu.set_asynchronous_callbacks(asynchronous)
    x, _ = data_for("sequential", samples=32)
    results = []
    for model in (plain, on_ipu):
        last = keras.callbacks.LambdaCallback(on_predict_batch_end=lambda batch, logs, m=model: (
            batch == 3 and m.compile(keras.optimizers.Adam(0.01), "mae")))
        results.append(model.predict(x, batch_size=BATCH, verbose=0, callbacks=[last]))
    np.testing.assert_allclose(results[1], results[0], rtol=1e-6)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_an_option_set_by_a_callback_mid_fit_stops_it_at_the_next_execution(strategy,
                                                                           asynchronous):
    # Set through the callback's closure (the model not synced), the run went on with its
    # old program to the end of the epoch. Set by an asynchronous hook, the execution it
    # ran beside was thrown away (the weights went back one execution).
    plain, on_ipu = twin("sequential", strategy, steps_per_execution=2)
    on_ipu.set_asynchronous_callbacks(asynchronous)
    x, y = data_for("sequential", samples=32)
    calls = []

    def set_option(batch, logs):
        calls.append(batch)
        on_ipu.set_gradient_accumulation_options(gradient_accumulation_steps_per_replica=2)

    with pytest.raises(RuntimeError, match="compiled again \\(or an IPU option of it set\\)"):
        on_ipu.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                   callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=set_option)])
    # The first execution's hooks (asynchronous ones see every step), then the next refused.
    assert calls == ([0, 1] if asynchronous else [1])
    plain.fit(x, y, batch_size=BATCH, steps_per_epoch=2, shuffle=False, verbose=0)
    assert_weights_close(plain.get_weights(), on_ipu.get_weights(), atol=1e-6)


def test_an_accumulation_option_set_during_evaluate_lets_it_run_to_the_end(strategy):
    # Before: evaluate, which ignores accumulation, stopped after its first execution
    # with the RuntimeError meant for fit.
    plain, on_ipu = twin("sequential", strategy, steps_per_execution=2)
    _evaluate_setting_at_each_batch(plain, on_ipu, lambda model: (
        model.set_gradient_accumulation_options(gradient_accumulation_steps_per_replica=2)))
    assert options_of(on_ipu).gradient_accumulation_steps_per_replica == 2


def _evaluate_setting_at_each_batch(plain, on_ipu, set_option) -> None:
    """`on_ipu.evaluate`, `set_option(on_ipu)` in each batch hook, equals `plain`'s."""
    x, y = data_for("sequential", samples=32)
    hook = keras.callbacks.LambdaCallback(on_test_batch_end=lambda batch, logs: (
        set_option(on_ipu)))
    evaluated = on_ipu.evaluate(x, y, batch_size=BATCH, verbose=0, callbacks=[hook])
    np.testing.assert_allclose(evaluated, plain.evaluate(x, y, batch_size=BATCH, verbose=0),
                               rtol=1e-5)


def test_the_pipelines_accumulation_set_during_evaluate_lets_it_run_to_the_end(strategy):
    # Before: only set_gradient_accumulation_options counted as fit's alone; a
    # pipeline's, which its inference ignores too, stopped evaluate after one execution.
    from conftest import configure
    from models import two_stage_mlp

    configure(2)
    keras.utils.set_random_seed(0)
    plain = keras.Sequential([keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)])
    plain.build((None, 6))
    with strategy.scope():
        on_ipu = two_stage_mlp()
    on_ipu.set_weights(plain.get_weights())
    for model in (plain, on_ipu):
        model.compile(optimizer="sgd", loss="mse", steps_per_execution=4)
    on_ipu.set_pipelining_options(gradient_accumulation_steps_per_replica=4)
    _evaluate_setting_at_each_batch(plain, on_ipu, lambda model: (
        model.set_pipelining_options(gradient_accumulation_steps_per_replica=8)))
    assert options_of(on_ipu).pipelining_gradient_accumulation_steps_per_replica == 8


_SAME_AGAIN = {
    "accumulation": lambda m: m.set_gradient_accumulation_options(
        gradient_accumulation_steps_per_replica=2),
    "pipelining": lambda m: m.set_pipelining_options(gradient_accumulation_steps_per_replica=2),
    "infeed": lambda m: m.set_infeed_queue_options(prefetch_depth=2),
    "outfeed": lambda m: m.set_outfeed_queue_options(buffer_depth=2),
    "replication": lambda m: m.set_replication_options("MEAN"),
    "asynchronous": lambda m: m.set_asynchronous_callbacks(False),
}


def test_an_option_holding_an_array_can_be_set_again(strategy):
    # Before: NumPy's "truth value of an array ... is ambiguous" comparing the options.
    _, on_ipu = twin("sequential", strategy, steps_per_execution=2)
    for _ in range(2):
        on_ipu.set_pipelining_options(2, offload_weights=np.array([True, False]))
    from keras_ipu.keras import options

    kept = options.options_of(on_ipu)
    assert kept.pipelining_gradient_accumulation_steps_per_replica == 2
    assert kept.pipelining_kwargs["offload_weights"].tolist() == [True, False]


@pytest.mark.parametrize("setter", sorted(_SAME_AGAIN))
def test_an_option_set_again_to_its_value_mid_fit_lets_the_run_go_on(setter, strategy):
    # Before: the accumulation, pipelining and feed setters dropped the programs whatever
    # the value, so a callback setting what was already set stopped the run.
    _, on_ipu = twin("sequential", strategy, steps_per_execution=2)
    _SAME_AGAIN[setter](on_ipu)
    _fit_setting_at_each_epoch(on_ipu, _SAME_AGAIN[setter])


def _fit_setting_at_each_epoch(model, set_option) -> None:
    """Fits 3 epochs, `set_option(model)` at each epoch's end: all run, on one program."""
    from keras_ipu.keras import run

    x, y = data_for("sequential", samples=32)
    programs = []

    def set_again(epoch, logs):
        programs.append(run.program_for(model, "fit"))
        set_option(model)

    history = model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0,
                        callbacks=[keras.callbacks.LambdaCallback(on_epoch_end=set_again)])
    assert len(history.history["loss"]) == 3
    assert programs[0] is not None and all(p is programs[0] for p in programs)


_EQUAL_IN_MEANING = {
    # (set before fit, set again mid-fit): what the programs read is the same.
    "prefetch_default": (lambda m: m.set_infeed_queue_options(),
                         lambda m: m.set_infeed_queue_options(prefetch_depth=2)),
    "buffer_none": (lambda m: m.set_outfeed_queue_options(),
                    lambda m: m.set_outfeed_queue_options(buffer_depth=None)),
    "feed_name": (lambda m: m.set_infeed_queue_options(prefetch_depth=3),
                  lambda m: m.set_infeed_queue_options(prefetch_depth=3, feed_name="a")),
}


@pytest.mark.parametrize("case", sorted(_EQUAL_IN_MEANING))
def test_a_feed_option_equal_in_meaning_mid_fit_lets_the_run_go_on(case, strategy):
    # Before: a depth left out against its default spelt out (or a key without effect)
    # counted as a change and stopped the run with a RuntimeError.
    from keras_ipu.keras import options

    _, on_ipu = twin("sequential", strategy, steps_per_execution=2)
    first, again = _EQUAL_IN_MEANING[case]
    first(on_ipu)
    _fit_setting_at_each_epoch(on_ipu, again)
    kept = options.options_of(on_ipu)  # stored as given, for saving
    assert {**kept.infeed_kwargs, **kept.outfeed_kwargs} == {
        "prefetch_default": {"prefetch_depth": 2}, "buffer_none": {"buffer_depth": None},
        "feed_name": {"prefetch_depth": 3, "feed_name": "a"}}[case]


def test_a_feed_depth_changed_mid_fit_still_stops_the_run(strategy):
    _, on_ipu = twin("sequential", strategy, steps_per_execution=2)
    x, y = data_for("sequential", samples=32)
    hook = keras.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: on_ipu.set_infeed_queue_options(prefetch_depth=3))
    with pytest.raises(RuntimeError, match="compiled again \\(or an IPU option of it set\\)"):
        on_ipu.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[hook])


@pytest.mark.parametrize("start", [False, True])
def test_asynchronous_callbacks_switched_mid_fit_stop_it_as_any_option(strategy, start):
    # Before: switched on at an epoch's end it was ignored (the run's program streams no
    # steps), switched off it took effect: now both stop the run, as any option setter.
    _, on_ipu = twin("sequential", strategy, steps_per_execution=2)
    on_ipu.set_asynchronous_callbacks(start)
    x, y = data_for("sequential", samples=32)
    ends = []

    def toggle(epoch, logs):
        ends.append(epoch)
        on_ipu.set_asynchronous_callbacks(not start)

    with pytest.raises(RuntimeError, match="compiled again \\(or an IPU option of it set\\)"):
        on_ipu.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                   callbacks=[keras.callbacks.LambdaCallback(on_epoch_end=toggle)])
    assert ends == [0]
    on_ipu.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)  # the new setting
    from keras_ipu.keras import run

    kept = run.program_for(on_ipu, "fit")
    on_ipu.set_asynchronous_callbacks(not start)  # the same value again: the program is kept
    assert kept is not None and run.program_for(on_ipu, "fit") is kept


class _Forwarding:
    """A callback wrapper (as tracking libraries make) forwarding every attribute."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)


def test_a_callback_wrapper_that_forwards_its_hooks_runs_them(strategy):
    # Before: AttributeError: type object '_Forwarding' has no attribute 'on_train_batch_begin'.
    _, on_ipu = twin("sequential", strategy, steps_per_execution=4)
    x, y = data_for("sequential", samples=64)
    seen = []
    wrapped = _Forwarding(keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: seen.append((batch, sorted(logs)))))
    on_ipu.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[wrapped])
    assert seen == [(3, ["loss", "mae"]), (7, ["loss", "mae"])]


def test_validation_runs_the_models_own_evaluate_as_in_keras(strategy):
    # Keras' fit validates through `self.evaluate`: an override of it runs (it was skipped).
    class WithExtra(keras.Sequential):
        def evaluate(self, *args, **kwargs):
            logs = super().evaluate(*args, **kwargs)
            return {**logs, "extra": 42.0} if kwargs.get("return_dict") else logs

    x, y = data_for("sequential", samples=32)
    plain = WithExtra([keras.Input((x.shape[1],)), keras.layers.Dense(y.shape[1])])
    with strategy.scope():
        on_ipu = WithExtra([keras.Input((x.shape[1],)), keras.layers.Dense(y.shape[1])])
    on_ipu.set_weights(plain.get_weights())
    for model in (plain, on_ipu):
        model.compile("sgd", "mse", steps_per_execution=2)
    histories = [m.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                       validation_data=(x[:16], y[:16])).history for m in (plain, on_ipu)]
    assert histories[1]["val_extra"] == [42.0, 42.0]
    assert_history_close(histories[0], histories[1])


def test_weights_for_several_outputs_are_checked_and_shared_as_in_keras(strategy):
    plain, on_ipu = twin("functional", strategy, steps_per_execution=2)
    x, y = data_for("functional", samples=32)
    w = np.linspace(0.1, 2.0, 32).astype("float32")
    bad = {
        "a weight too many": ([w, w, w], "one `sample_weight` array per output"),
        "another structure": ({"out_a": w}, "one `sample_weight` array per output"),
        "one array of vectors": (np.stack([w, w], 1), "one scalar score per sample"),
    }
    for weights, message in bad.values():
        for model in (plain, on_ipu):
            with pytest.raises(ValueError, match=message):
                model.fit(x, y, sample_weight=weights, batch_size=BATCH, verbose=0)
    with pytest.raises(ValueError, match="only supported for Models with a single output"):
        on_ipu.fit(x, y, class_weight={0: 1.0}, batch_size=BATCH, verbose=0)
    assert int(on_ipu.optimizer.iterations) == 0
    # One per-sample array weighs every output.
    expected, actual = _both(plain, on_ipu, lambda model: model.fit(
        x, y, sample_weight=w, batch_size=BATCH, shuffle=False, verbose=0))
    assert_history_close(expected.history, actual.history)
    assert_weights_close(plain.get_weights(), on_ipu.get_weights(), atol=1e-6)


def test_sample_weights_without_targets_are_dropped_as_in_keras(strategy):
    # Not taken for the targets: a model whose loss needs none trains as in Keras, one
    # that needs them is refused.
    class LossOfItsOwn(keras.layers.Layer):
        def call(self, outputs):
            self.add_loss(keras.ops.mean(outputs ** 2))
            return outputs

    keras.utils.set_random_seed(0)
    plain = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3), LossOfItsOwn()])
    with strategy.scope():
        on_ipu = keras.models.clone_model(plain)
    on_ipu.set_weights(plain.get_weights())
    x, _ = data_for("sequential", samples=32)
    w = np.linspace(0.1, 2.0, 32).astype("float32")
    for model in (plain, on_ipu):
        model.compile(keras.optimizers.SGD(0.1), steps_per_execution=2)
    expected, actual = _both(plain, on_ipu, lambda model: model.fit(
        x, sample_weight=w, batch_size=BATCH, shuffle=False, verbose=0))
    assert_history_close(expected.history, actual.history)
    assert_weights_close(plain.get_weights(), on_ipu.get_weights(), atol=1e-6)
    # A compiled loss has no targets to compare with: refused, as in Keras, not trained.
    for model in (plain, on_ipu):
        model.compile(keras.optimizers.SGD(0.1), loss="mse", steps_per_execution=2)
        with pytest.raises(ValueError, match="None"):
            model.fit(x, sample_weight=w, batch_size=BATCH, verbose=0)
    with pytest.raises(ValueError, match="give the targets"):  # it was ignored
        on_ipu.fit(x, class_weight={0: 2.0}, batch_size=BATCH, verbose=0)
    assert_weights_close(plain.get_weights(), on_ipu.get_weights(), atol=1e-6)


@pytest.mark.parametrize("call", ["fit", "evaluate", "predict"])
def test_a_users_mistake_shows_the_users_frames_as_in_keras(call, strategy):
    # Before: keras_ipu's and Keras' frames made the traceback 3-5x plain Keras'.
    import os

    import keras_ipu

    _, on_ipu = twin("sequential", strategy, steps_per_execution=2)
    x, y = data_for("sequential", samples=32)
    run = {"fit": lambda: on_ipu.fit(x[:, :2], y, batch_size=BATCH, verbose=0),
           "evaluate": lambda: on_ipu.evaluate(x[:, :2], y, batch_size=BATCH, verbose=0),
           "predict": lambda: on_ipu.predict(x[:, :2], batch_size=BATCH, verbose=0)}[call]
    library = (os.path.dirname(keras_ipu.__file__), os.path.dirname(keras.__file__))

    def library_frames():
        with pytest.raises(ValueError, match="incompatible with the layer") as raised:
            run()
        return [str(entry.path) for entry in raised.traceback
                if str(entry.path).startswith(library)]

    # The re-raise, and the line that raised.
    assert [os.path.basename(path) for path in library_frames()] == ["tracebacks.py",
                                                                     "input_spec.py"]
    keras.config.disable_traceback_filtering()
    try:
        assert any("trainer.py" in path for path in library_frames())
    finally:
        keras.config.enable_traceback_filtering()


def test_steps_on_one_batch_train_and_test_as_in_keras(strategy):
    plain, on_ipu = twin("sequential", strategy, optimizer="sgd")
    x, y = data_for("sequential", samples=BATCH)
    for model in (plain, on_ipu):
        model.train_on_batch(x, y)
    assert_weights_close(plain.get_weights(), on_ipu.get_weights(), atol=1e-6)
    np.testing.assert_allclose(*_both(plain, on_ipu, lambda m: m.test_on_batch(x, y)),
                               rtol=1e-6)


def test_epochs_after_the_data_ran_out_end_with_the_last_logs_as_in_keras(strategy):
    # Before: on_epoch_end got {} and History missed the epoch's loss.
    plain, on_ipu = twin("sequential", strategy)
    x, y = data_for("sequential", samples=64)

    def batches():
        for i in range(0, 64, BATCH):
            yield x[i:i + BATCH], y[i:i + BATCH]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Your input ran out of data"
        expected, actual = _both(plain, on_ipu, lambda model: model.fit(
            batches(), steps_per_epoch=4, epochs=3, verbose=0))
    assert len(actual.history["loss"]) == 3 and actual.history.keys() == expected.history.keys()
    assert actual.history["loss"][2] == actual.history["loss"][1] > 0  # not the reset metrics
    assert_history_close(expected.history, actual.history)
    assert_weights_close(plain.get_weights(), on_ipu.get_weights(), atol=1e-6)


@pytest.mark.parametrize("call", ["fit", "validation", "evaluate", "predict"])
def test_a_source_too_short_for_one_execution_is_refused_and_the_model_kept(call, strategy):
    # Before: {} from evaluate, a History without loss or val_loss, and predict's
    # "Expect x to be a non-empty array": the 3 batches read were dropped unseen.
    plain, on_ipu = twin("sequential", strategy, steps_per_execution=4)
    x, y = data_for("sequential", samples=64)

    def batches(count, targets=True):
        for i in range(0, count * BATCH, BATCH):
            yield (x[i:i + BATCH], y[i:i + BATCH]) if targets else (x[i:i + BATCH],)

    calls = {
        "fit": lambda: on_ipu.fit(batches(3), steps_per_epoch=8, verbose=0),
        "validation": lambda: on_ipu.fit(batches(8), steps_per_epoch=8, verbose=0,
                                         validation_data=batches(3), validation_steps=8),
        "evaluate": lambda: on_ipu.evaluate(batches(3), steps=8, verbose=0),
        "predict": lambda: on_ipu.predict(batches(3, targets=False), steps=8, verbose=0),
    }
    subject = "validation data" if call == "validation" else "set of data"
    with pytest.raises(ValueError, match=rf"The provided {subject} ran out after 3 batches, "
                                         rf"fewer than one execution takes .* = 4 batches\)"):
        calls[call]()
    # Untouched, or trained on the full epoch alone; then a fit as plain Keras'.
    for model in (plain, on_ipu):
        if call == "validation" and model is plain:
            model.fit(batches(8), steps_per_epoch=8, verbose=0)
        model.fit(batches(8), steps_per_epoch=8, verbose=0)
    assert_weights_close(plain.get_weights(), on_ipu.get_weights(), atol=1e-6)
