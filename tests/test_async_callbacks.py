"""Asynchronous callbacks: every step's results reach the batch hooks while the device runs."""

from __future__ import annotations

import functools
import threading
import time

import keras
import numpy as np
import pytest

import keras_ipu as ipu

from conftest import assert_weights_close, configure
from models import data_for, twin, two_stage_mlp

SPE, BATCHES, BATCH = 16, 64, 4


class Recorder(keras.callbacks.Callback):
    """Records every batch hook: (hook, index, logs)."""

    def __init__(self):
        super().__init__()
        self.calls: list = []

    def _record(self, hook, batch, logs):
        self.calls.append((hook, batch, dict(logs or {})))

    def on_train_batch_begin(self, batch, logs=None):
        self._record("train_begin", batch, logs)

    def on_train_batch_end(self, batch, logs=None):
        self._record("train_end", batch, logs)

    def on_test_batch_end(self, batch, logs=None):
        self._record("test_end", batch, logs)

    def on_predict_batch_end(self, batch, logs=None):
        self._record("predict_end", batch, logs)

    def indices(self, hook):
        return [batch for name, batch, _ in self.calls if name == hook]

    def logs(self, hook):
        return [logs for name, _, logs in self.calls if name == hook]


def _run_all(model, x, y, asynchronous):
    model.set_asynchronous_callbacks(asynchronous)
    recorder = Recorder()
    history = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                        callbacks=[recorder])
    evaluated = model.evaluate(x, y, batch_size=BATCH, verbose=0, callbacks=[recorder])
    predicted = model.predict(x, batch_size=BATCH, verbose=0, callbacks=[recorder])
    return recorder, history.history, evaluated, predicted


def test_every_step_reaches_the_hooks_in_order_with_the_synchronous_results(strategy):
    x, y = data_for("sequential", samples=BATCHES * BATCH)
    results = {}
    for asynchronous in (False, True):
        _, model = twin("sequential", strategy, steps_per_execution=SPE)
        results[asynchronous] = _run_all(model, x, y, asynchronous)
    sync, streamed = results[False][0], results[True][0]
    assert sync.indices("train_end") == [15, 31, 47, 63]
    assert sync.indices("test_end") == sync.indices("predict_end") == [15, 31, 47, 63]
    every = list(range(BATCHES))
    assert streamed.indices("train_begin") == streamed.indices("train_end") == every
    assert streamed.indices("test_end") == streamed.indices("predict_end") == every
    # The final logs, evaluation and predictions are the synchronous run's.
    assert results[True][1] == results[False][1]
    np.testing.assert_allclose(results[True][2], results[False][2], rtol=1e-6)
    np.testing.assert_allclose(results[True][3], results[False][3], rtol=1e-6)
    # The last step's logs are the execution's; each step has its own loss.
    assert streamed.logs("train_end")[-1] == pytest.approx(sync.logs("train_end")[-1])
    losses = [logs["loss"] for logs in streamed.logs("train_end")]
    assert len(set(losses)) > BATCHES // 2
    # Each predict hook gets that step's predictions.
    steps = np.concatenate([logs["outputs"] for logs in streamed.logs("predict_end")])
    np.testing.assert_allclose(steps, results[True][3], rtol=1e-6)


def test_replicas_report_each_step_once_each_with_the_reduced_logs(strategy):
    configure(2)
    x, y = data_for("sequential", samples=BATCHES * BATCH)
    _, model = twin("sequential", ipu.ipu_strategy.IPUStrategy(), steps_per_execution=SPE // 2)
    model.set_replication_options("mean")
    recorder, history, _, predicted = _run_all(model, x, y, True)
    # The reference's counts: 32 steps per replica, each reported by both.
    pairs = [i for i in range(BATCHES // 2) for _ in range(2)]
    assert recorder.indices("train_end") == recorder.indices("test_end") == pairs
    assert recorder.indices("predict_end") == pairs
    logs = recorder.logs("train_end")
    assert all(logs[i] == logs[i + 1] for i in range(0, len(logs), 2))
    assert logs[-1]["loss"] == pytest.approx(history["loss"][-1], rel=1e-6)
    # Replica r's step s holds input batch 2s + r: the predictions in order.
    steps = np.concatenate([logs["outputs"] for logs in recorder.logs("predict_end")])
    np.testing.assert_allclose(steps, predicted, rtol=1e-6)


@pytest.mark.parametrize("accumulate_outfeed", [False, True])
def test_a_pipelined_model_reports_every_micro_batch(accumulate_outfeed, strategy):
    configure(2)
    x, y = data_for("sequential", samples=BATCHES * BATCH)
    with strategy.scope():
        model = two_stage_mlp()
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"], steps_per_execution=SPE)
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=SPE // 2,
                                 accumulate_outfeed=accumulate_outfeed)
    recorder, history, _, predicted = _run_all(model, x, y, True)
    every = list(range(BATCHES))
    # As in the reference, accumulated logs are reported once per execution.
    expected = [15, 31, 47, 63] if accumulate_outfeed else every
    assert recorder.indices("train_end") == recorder.indices("test_end") == expected
    assert recorder.indices("predict_end") == every
    if not accumulate_outfeed:
        assert recorder.logs("train_end")[-1]["loss"] == pytest.approx(history["loss"][-1])
    steps = np.concatenate([logs["outputs"] for logs in recorder.logs("predict_end")])
    np.testing.assert_allclose(steps, predicted, rtol=1e-6)


def test_steps_arrive_while_the_execution_runs(strategy):
    # A model whose 64-step execution takes well over half a second here (Dense(512)
    # layers took 0.43 s on an unloaded 2-core CI run).
    with strategy.scope():
        model = keras.Sequential([keras.Input((256,))] + [
            keras.layers.Dense(1024, activation="tanh") for _ in range(4)] + [
            keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=64)
    model.set_asynchronous_callbacks(True)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64 * 384, 256)).astype("float32")
    y = rng.normal(size=(64 * 384, 1)).astype("float32")
    model.fit(x, y, batch_size=384, epochs=1, verbose=0)  # compiled

    arrivals: list = []
    stamps = keras.callbacks.LambdaCallback(
        on_epoch_begin=lambda epoch, logs: arrivals.append(time.perf_counter()),
        on_train_batch_end=lambda batch, logs: arrivals.append(time.perf_counter()),
        on_epoch_end=lambda epoch, logs: arrivals.append(time.perf_counter()))
    model.fit(x, y, batch_size=384, epochs=1, verbose=0, callbacks=[stamps])
    begin, first, end = arrivals[0], arrivals[1], arrivals[-1]
    assert len(arrivals) == 64 + 2
    assert end - begin >= 0.5, "the execution is too fast to show streaming"
    assert first - begin < 0.6 * (end - begin)


class RaiseAt(keras.callbacks.Callback):
    def __init__(self, step, error=ValueError):
        super().__init__()
        self.step, self.error = step, error

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.step:
            raise self.error(f"stop at {batch}")


def _callback_threads():
    return [t for t in threading.enumerate() if t.name == "keras_ipu-callbacks"]


def test_an_exception_in_a_hook_stops_the_run_and_leaves_the_model_usable(strategy):
    x, y = data_for("sequential", samples=BATCHES * BATCH)
    _, model = twin("sequential", strategy, steps_per_execution=SPE, optimizer="sgd")
    _, reference = twin("sequential", strategy, steps_per_execution=SPE, optimizer="sgd")
    model.set_asynchronous_callbacks(True)
    started = time.perf_counter()
    with pytest.raises(ValueError, match="stop at 21") as raised:
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                  callbacks=[RaiseAt(SPE + 5)])
    assert time.perf_counter() - started < 5
    assert raised.traceback[-1].name == "on_train_batch_end"  # the original traceback
    assert _callback_threads() == []
    # The weights are those after the last execution whose hooks all ran.
    reference.fit(x[: SPE * BATCH], y[: SPE * BATCH], batch_size=BATCH, epochs=1,
                  shuffle=False, verbose=0)
    assert_weights_close(reference.get_weights(), model.get_weights(), atol=1e-6)
    assert model.predict(x, batch_size=BATCH, verbose=0).shape == (BATCHES * BATCH, 3)
    history = model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[Recorder()])
    assert np.isfinite(history.history["loss"][-1])


class EvaluateInHook(keras.callbacks.Callback):
    """Runs the model's own evaluate (or a batch method) from its first batch hook."""

    def __init__(self, x, y, method="evaluate"):
        super().__init__()
        self.x, self.y, self.method, self.result = x, y, method, None

    def on_train_batch_end(self, batch, logs=None):
        if self.result is None:
            kwargs = {"batch_size": BATCH, "verbose": 0} if self.method == "evaluate" else {}
            self.result = getattr(self.model, self.method)(self.x, self.y, **kwargs)


@pytest.mark.parametrize("method", ["evaluate", "train_on_batch"])
@pytest.mark.parametrize("replicas", [1, 2])
def test_a_run_of_the_model_from_its_own_asynchronous_hook_is_refused(replicas, method,
                                                                       strategy):
    # With 2 replicas the run waited for the devices the running execution held, for
    # ever; with one, it started from the device's state and what the hook had
    # assigned was lost. train_on_batch's step landed after the running execution, over
    # its steps (SGD: 7 iterations where plain Keras counts 9). The other batch methods
    # run there.
    configure(replicas)
    x, y = data_for("sequential", samples=BATCHES * BATCH)
    _, model = twin("sequential", strategy, steps_per_execution=SPE, optimizer="sgd")
    model.set_asynchronous_callbacks(True)
    with pytest.raises(RuntimeError, match=rf"model.{method}\(\) was called from an "
                                           r"asynchronous batch hook of the model's own run"):
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0,
                  callbacks=[EvaluateInHook(x[:BATCH], y[:BATCH], method)])
    assert _callback_threads() == []
    assert int(model.optimizer.iterations) == 0  # no execution's hooks all ran
    hook = EvaluateInHook(x[:BATCH], y[:BATCH], method="test_on_batch")
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[hook])
    assert np.all(np.isfinite(hook.result))


class PredictOtherInHook(keras.callbacks.Callback):
    """Runs another model's predict from the first batch hook."""

    def __init__(self, other, x):
        super().__init__()
        self.other, self.x, self.result = other, x, None

    def on_train_batch_end(self, batch, logs=None):
        if self.result is None:
            self.result = self.other.predict(self.x, batch_size=BATCH, verbose=0)


@pytest.mark.parametrize("replicas", [1, 2])
def test_another_models_run_from_an_asynchronous_hook_runs_unless_the_run_is_replicated(
        replicas, strategy):
    # With 2 replicas it waited for the IPUs the running execution held, for ever.
    configure(replicas)
    x, y = data_for("sequential", samples=BATCHES * BATCH)
    _, model = twin("sequential", strategy, steps_per_execution=SPE, optimizer="sgd")
    _, other = twin("sequential", strategy, steps_per_execution=SPE, optimizer="sgd")
    model.set_asynchronous_callbacks(True)
    hook = PredictOtherInHook(other, x[:BATCH * replicas])
    fit = functools.partial(model.fit, x, y, batch_size=BATCH, epochs=1, verbose=0,
                            callbacks=[hook])
    if replicas == 1:
        fit()
        alone = other.predict(x[:BATCH], batch_size=BATCH, verbose=0)
        np.testing.assert_allclose(hook.result, alone)
        return
    with pytest.raises(RuntimeError, match=r"model.predict\(\) was called from an "
                                           r"asynchronous batch hook of a replicated run"):
        fit()
    assert _callback_threads() == []


class TestOnBatchInHook(keras.callbacks.Callback):
    """Evaluates a batch at each execution's last step (Keras resets the metrics first)."""

    def __init__(self, x, y):
        super().__init__()
        self.x, self.y, self.results = x, y, []

    def on_train_batch_end(self, batch, logs=None):
        if batch % SPE == SPE - 1:
            self.results.append(self.model.test_on_batch(self.x, self.y))


def test_the_metrics_a_hooks_test_on_batch_leaves_are_the_epochs_logs(strategy):
    # As in plain Keras (and with synchronous hooks), the epoch's logs are what the last
    # hook's test_on_batch left in the metrics. Before: its total landed, but its count
    # (equal to the one it read) did not: the loss mixed the two states (0.10 for 0.51).
    x, y = data_for("sequential", samples=BATCHES * BATCH)
    _, model = twin("sequential", strategy, steps_per_execution=SPE, optimizer="sgd")
    model.set_asynchronous_callbacks(True)
    hook = TestOnBatchInHook(x[:BATCH], y[:BATCH])
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                        callbacks=[hook]).history
    assert len(hook.results) == 2 * BATCHES // SPE
    last_of_epoch = [hook.results[i] for i in (BATCHES // SPE - 1, -1)]
    np.testing.assert_allclose(history["loss"], [r[0] for r in last_of_epoch], rtol=1e-6)


class AboveThreshold(keras.metrics.Metric):
    """The fraction of predictions above a threshold a callback moves (kept by resets)."""

    def __init__(self, name="above"):
        super().__init__(name=name)
        self.threshold = self.add_variable((), initializer="zeros", name="threshold")
        self.hits = self.add_variable((), initializer="zeros", name="hits")
        self.seen = self.add_variable((), initializer="zeros", name="seen")

    def update_state(self, y_true, y_pred, sample_weight=None):
        above = keras.ops.cast(y_pred > self.threshold, "float32")
        self.hits.assign_add(keras.ops.sum(above))
        self.seen.assign_add(keras.ops.cast(keras.ops.size(above), "float32"))

    def result(self):
        return self.hits / keras.ops.maximum(self.seen, 1.0)

    def reset_state(self):
        self.hits.assign(0.0)
        self.seen.assign(0.0)


class RaiseThreshold(keras.callbacks.Callback):
    """Raises the threshold of an `AboveThreshold` at the end of each epoch's 2nd execution."""

    def __init__(self, metric):
        super().__init__()
        self.metric = metric

    def on_train_batch_end(self, batch, logs=None):
        if batch == 2 * SPE - 1:
            self.model.get_weights()  # the variables synced, as Keras' hooks need them
            self.metric.threshold.assign(self.metric.threshold + 0.1)


def test_a_metric_variable_a_hook_assigns_lands_alone(strategy):
    # The metric's other variables keep what the running execution added, as with
    # synchronous hooks (a first form landed them all, an execution's counts lost).
    x, y = data_for("sequential", samples=BATCHES * BATCH)
    logs = {}
    for asynchronous in (False, True):
        above = AboveThreshold()
        _, model = twin("sequential", strategy, steps_per_execution=SPE, optimizer="sgd",
                        metrics=[above])
        model.set_asynchronous_callbacks(asynchronous)
        logs[asynchronous] = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False,
                                       verbose=0, callbacks=[RaiseThreshold(above)]).history
    assert logs[True].keys() == logs[False].keys()
    for key in logs[False]:
        np.testing.assert_allclose(logs[True][key], logs[False][key], rtol=1e-6)
    assert 0 < logs[True]["above"][1] < logs[True]["above"][0] < 1  # the threshold moved


def _autoencoder():
    inputs = keras.Input((6,))
    code = keras.layers.Dense(3, activation="tanh")(inputs)
    return keras.Model(inputs, keras.layers.Dense(6)(code)), keras.Model(inputs, code)


class PredictEncoderInHook(keras.callbacks.Callback):
    """Predicts with a sub-model sharing the running model's layers, each execution."""

    def __init__(self, encoder, x, method):
        super().__init__()
        self.encoder, self.x, self.method, self.predicted = encoder, x, method, []

    def on_train_batch_end(self, batch, logs=None):
        if batch % SPE == SPE - 1:
            self.model.get_weights()  # synced, as plain Keras' hook reads them
            self.predicted.append(
                self.encoder.predict_on_batch(self.x) if self.method == "predict_on_batch"
                else self.encoder.predict(self.x, batch_size=BATCH, verbose=0))


@pytest.mark.parametrize("method", ["predict", "predict_on_batch"])
def test_a_sub_model_sharing_the_layers_predicts_from_an_asynchronous_hook(method, strategy):
    # Before: its program consumed the arrays it shares with the running model's synced
    # state: "Array has been deleted", and the run's training lost.
    x, _ = data_for("sequential", samples=BATCHES * BATCH)
    keras.utils.set_random_seed(0)
    plain, plain_encoder = _autoencoder()
    with strategy.scope():
        on_ipu, encoder = _autoencoder()
    on_ipu.set_weights(plain.get_weights())
    for model in (plain, on_ipu):
        model.compile(keras.optimizers.Adam(0.01), "mse", steps_per_execution=SPE)
    on_ipu.set_asynchronous_callbacks(True)
    hooks = [PredictEncoderInHook(plain_encoder, x[:BATCH], method),
             PredictEncoderInHook(encoder, x[:BATCH], method)]
    for model, hook in zip((plain, on_ipu), hooks):
        model.fit(x, x, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[hook])
    assert_weights_close(plain.get_weights(), on_ipu.get_weights(), atol=1e-5)
    # An asynchronous hook reads the weights one execution back (the docs' rule).
    assert len(hooks[1].predicted) == BATCHES // SPE
    for expected, predicted in zip(hooks[0].predicted[:-1], hooks[1].predicted[1:]):
        np.testing.assert_allclose(predicted, expected, atol=1e-5)


class ReadWeights(keras.callbacks.Callback):
    """Reads the model's weights in the first batch hook of each mode (a state sync)."""

    def __init__(self, raise_in=None):
        super().__init__()
        self.read: dict = {}
        self.raise_in = raise_in

    def _read(self, mode, batch):
        if batch == 0:
            self.read[mode] = self.model.get_weights()
            if mode == self.raise_in:
                raise ValueError(f"stop in {mode}")

    def on_train_batch_end(self, batch, logs=None):
        self._read("fit", batch)

    def on_test_batch_end(self, batch, logs=None):
        self._read("evaluate", batch)

    def on_predict_batch_end(self, batch, logs=None):
        self._read("predict", batch)


def test_a_hook_reading_the_model_in_the_first_execution_gets_its_initial_weights(strategy):
    x, y = data_for("sequential", samples=BATCHES * BATCH)
    plain, model = twin("sequential", strategy, steps_per_execution=SPE, optimizer="sgd")
    model.set_asynchronous_callbacks(True)
    initial = model.get_weights()
    reader = ReadWeights()
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[reader])
    trained = model.get_weights()
    model.evaluate(x, y, batch_size=BATCH, verbose=0, callbacks=[reader])
    model.predict(x, batch_size=BATCH, verbose=0, callbacks=[reader])
    assert_weights_close(initial, reader.read["fit"], atol=0)
    assert_weights_close(trained, reader.read["evaluate"], atol=0)
    assert_weights_close(trained, reader.read["predict"], atol=0)
    plain.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert_weights_close(plain.get_weights(), model.get_weights(), atol=1e-6)


@pytest.mark.parametrize("mode", ["fit", "evaluate", "predict"])
def test_a_hook_raising_in_the_first_execution_keeps_the_weights(mode, strategy):
    x, y = data_for("sequential", samples=BATCHES * BATCH)
    plain, model = twin("sequential", strategy, steps_per_execution=SPE, optimizer="sgd")
    model.set_asynchronous_callbacks(True)
    initial = model.get_weights()
    calls = {"fit": lambda cb: model.fit(x, y, batch_size=BATCH, verbose=0, callbacks=cb),
             "evaluate": lambda cb: model.evaluate(x, y, batch_size=BATCH, verbose=0,
                                                   callbacks=cb),
             "predict": lambda cb: model.predict(x, batch_size=BATCH, verbose=0, callbacks=cb)}
    with pytest.raises(ValueError, match=f"stop in {mode}"):
        calls[mode]([ReadWeights(raise_in=mode)])
    assert_weights_close(initial, model.get_weights(), atol=0)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    plain.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert_weights_close(plain.get_weights(), model.get_weights(), atol=1e-6)


def test_stop_training_ends_at_the_next_execution_boundary(strategy):
    x, y = data_for("sequential", samples=BATCHES * BATCH)
    _, model = twin("sequential", strategy, steps_per_execution=SPE, optimizer="sgd")
    _, reference = twin("sequential", strategy, steps_per_execution=SPE, optimizer="sgd")
    model.set_asynchronous_callbacks(True)
    recorder = Recorder()

    def stop(batch, logs):
        if batch == SPE + 5:
            model.stop_training = True

    model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0,
              callbacks=[recorder, keras.callbacks.LambdaCallback(on_train_batch_end=stop)])
    assert recorder.indices("train_end") == list(range(2 * SPE))
    reference.fit(x[: 2 * SPE * BATCH], y[: 2 * SPE * BATCH], batch_size=BATCH, epochs=1,
                  shuffle=False, verbose=0)
    assert_weights_close(reference.get_weights(), model.get_weights(), atol=1e-6)


def test_the_option_is_saved_and_checked(strategy, tmp_path):
    with strategy.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
        with pytest.raises(TypeError, match="must be a bool"):
            model.set_asynchronous_callbacks("yes")
        model.set_asynchronous_callbacks(np.True_)  # refused before; saved as a bool
        model.save(tmp_path / "m.keras")
        loaded = keras.models.load_model(tmp_path / "m.keras")
    from keras_ipu.keras import options

    assert options.options_of(loaded).asynchronous_callbacks is True


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("pipelined", [False, True], ids=["one_stage", "pipelined"])
def test_the_references_counts(pipelined, replicas):
    """The reference's test: batch 12, 64 steps per epoch, 2 epochs, spe = GA = 16 / R."""
    configure(replicas * (2 if pipelined else 1))
    spe = 16 // replicas
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64 * 12, 6)).astype("float32")
    y = rng.normal(size=(64 * 12, 3)).astype("float32")
    with ipu.ipu_strategy.IPUStrategy().scope():
        model = two_stage_mlp() if pipelined else keras.Sequential(
            [keras.Input((6,)), keras.layers.Dense(8), keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=spe)
    if pipelined:
        model.set_pipelining_options(gradient_accumulation_steps_per_replica=spe)
    else:
        model.set_gradient_accumulation_options(gradient_accumulation_steps_per_replica=spe)
    model.set_asynchronous_callbacks(True)
    recorder = Recorder()
    model.fit(x, y, batch_size=12, steps_per_epoch=64, epochs=2, verbose=0,
              callbacks=[recorder])
    model.evaluate(x, y, batch_size=12, steps=64, verbose=0, callbacks=[recorder])
    model.predict(x, batch_size=12, steps=64, verbose=0, callbacks=[recorder])
    assert len(recorder.indices("train_begin")) == len(recorder.indices("train_end")) == 128
    assert len(recorder.indices("test_end")) == len(recorder.indices("predict_end")) == 64


def test_accumulated_pipeline_logs_are_reported_per_execution():
    """The reference: R=2, spe=8, accumulate_outfeed -> evaluate hooks 64 // (spe × R) = 4."""
    configure(4)
    x, y = data_for("sequential", samples=64 * 4)
    with ipu.ipu_strategy.IPUStrategy().scope():
        model = two_stage_mlp()
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=8)
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=8,
                                 accumulate_outfeed=True)
    model.set_asynchronous_callbacks(True)
    recorder = Recorder()
    model.evaluate(x, y, batch_size=4, steps=64, verbose=0, callbacks=[recorder])
    assert len(recorder.indices("test_end")) == 4


def _two_stages(asynchronous: bool, steps_per_execution: int, accumulation: int):
    """A 2-stage pipelined MLP on 2 IPUs, its callbacks asynchronous or not."""
    configure(2)
    with ipu.ipu_strategy.IPUStrategy().scope():
        keras.utils.set_random_seed(1)
        model = two_stage_mlp()
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=steps_per_execution)
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=accumulation)
    model.set_asynchronous_callbacks(asynchronous)
    return model


@pytest.mark.parametrize("form", ["scan", "host"])
def test_a_pipeline_streams_each_weight_update_and_trains_the_same(form, monkeypatch):
    """Both pipeline forms (schedule program, host-dispatched ops) stream per update."""
    monkeypatch.setenv("KERAS_IPU_FLAGS", f"--execution_loop={form}")
    x, y = data_for("sequential", samples=BATCHES * BATCH)
    weights = {}
    for asynchronous in (False, True):
        model = _two_stages(asynchronous, SPE, accumulation=4)
        recorder = Recorder()
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                  callbacks=[recorder])
        weights[asynchronous] = model.get_weights()
    assert recorder.indices("train_end") == list(range(BATCHES))
    assert_weights_close(weights[False], weights[True], atol=0)
    from keras_ipu.keras import run

    program = run.program_for(model, "fit")
    assert program.stream is not None and program.report.steps_per_execution == SPE
    assert program.report.loop == {"scan": "schedule", "host": "host"}[form]


class ReadEveryBatch(keras.callbacks.Callback):
    """Reads the model's weights at the end of every training batch (a state sync each)."""

    def __init__(self):
        super().__init__()
        self.read: list = []

    def on_train_batch_end(self, batch, logs=None):
        self.read.append(self.model.get_weights())


@pytest.mark.parametrize("form", ["scan", "host"])
def test_hooks_reading_a_pipelined_model_while_it_trains_read_whole_weights(form, monkeypatch):
    # A pipeline's execution consumes the state it starts from, while its hooks read the
    # model: they read a copy (before, "Array has been deleted").
    monkeypatch.setenv("KERAS_IPU_FLAGS", f"--execution_loop={form}")
    x, y = data_for("sequential", samples=BATCHES * BATCH)
    weights = {}
    for asynchronous in (False, True):
        model = _two_stages(asynchronous, 8, accumulation=2)
        initial, reader = model.get_weights(), ReadEveryBatch()
        model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[reader])
        weights[asynchronous] = model.get_weights()
        # Asynchronous hooks run at every step, synchronous ones once per execution.
        assert len(reader.read) == 2 * BATCHES // (1 if asynchronous else 8)
        if asynchronous:  # while the first execution runs: the weights it started from
            assert_weights_close(initial, reader.read[0], atol=0)
    assert_weights_close(weights[False], weights[True], atol=0)


def test_a_cancelled_callback_thread_calls_no_more_hooks():
    # A run stopped by an error or a Ctrl-C: the steps still queued reach no hook.
    from keras_ipu.keras.options import ReplicatedMetricReductionMethod
    from keras_ipu.keras.step_callbacks import CallbackThread, StepDelivery

    called, first = [], threading.Event()

    def on_end(index, logs):
        called.append(index)
        first.set()
        time.sleep(0.05)

    delivery = StepDelivery("fit", 1, None, ReplicatedMetricReductionMethod.NONE,
                            lambda index: None, on_end)
    hooks = CallbackThread(delivery, lambda: None)
    hooks.submit(0, [[{"loss": np.arange(100, dtype=np.float32)}]])  # 100 steps
    assert first.wait(10)
    hooks.cancel()
    hooks.close()
    assert 1 <= len(called) < 10


class _Assigns(keras.callbacks.Callback):
    """At batch `at`, sets the learning rate to 0 and the first kernel to zeros (then
    calls `then(model)`, a batch method, say)."""

    def __init__(self, at, then=lambda model: None):
        super().__init__()
        self.at, self.then = at, then

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.at:
            self.model.optimizer.learning_rate = 0.0
            kernel = self.model.layers[0].kernel
            kernel.assign(np.zeros(kernel.shape, kernel.dtype))
            self.then(self.model)


@pytest.mark.parametrize("then", ["nothing", "predict_on_batch", "test_on_batch"])
def test_what_a_hook_assigns_lands_when_its_execution_ends(then, strategy):
    # Before: the device's state was kept over it: the learning rate and the kernel a
    # hook set were lost for good. Now as a hook at the execution's end in plain Keras.
    # A batch method called after the assignments (to log a prediction) lost them too.
    x, y = data_for("sequential", samples=BATCHES * BATCH)
    plain, on_ipu = twin("sequential", strategy, steps_per_execution=SPE, optimizer="sgd")
    on_ipu.set_asynchronous_callbacks(True)
    calls = {"nothing": lambda model: None,
             "predict_on_batch": lambda model: model.predict_on_batch(x[:BATCH]),
             "test_on_batch": lambda model: model.test_on_batch(x[:BATCH], y[:BATCH])}
    for model, at in ((plain, SPE - 1), (on_ipu, 1)):
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                  callbacks=[_Assigns(at, calls[then])])
    assert float(on_ipu.optimizer.learning_rate) == 0.0
    assert_weights_close(plain.get_weights(), on_ipu.get_weights(), atol=1e-6)


class ClipPredictions(keras.callbacks.Callback):
    """Edits each batch's predictions in place, as a post-processing hook may."""

    def on_predict_batch_end(self, batch, logs=None):
        np.clip(logs["outputs"], -0.01, 0.01, out=logs["outputs"])


@pytest.mark.parametrize("asynchronous", [False, True])
def test_predict_hooks_get_writable_copies_of_the_outputs(asynchronous, strategy):
    # As Keras' hooks: writable arrays, whose edits do not reach the returned predictions.
    # Before, the hooks got read-only views of the device's buffers.
    x, _ = data_for("sequential", samples=4 * BATCH)
    plain, model = twin("sequential", strategy, steps_per_execution=2)
    model.set_asynchronous_callbacks(asynchronous)
    predicted = model.predict(x, batch_size=BATCH, verbose=0, callbacks=[ClipPredictions()])
    expected = plain.predict(x, batch_size=BATCH, verbose=0, callbacks=[ClipPredictions()])
    assert np.abs(expected).max() > 0.01
    np.testing.assert_allclose(predicted, expected, rtol=1e-6)
