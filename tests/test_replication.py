"""Replication: data parallelism over the configured IPUs, one replica per IPU."""

from __future__ import annotations

import logging

import keras
import numpy as np
import pytest

import keras_ipu as ipu
from keras_ipu.keras import context, options

from conftest import assert_trees_close, assert_weights_close, configure
from models import compile_args, data_for, pair

BATCH, GLOBAL_ACCUMULATION = 4, 4  # plain Keras: batch 16


@pytest.mark.parametrize("replicas", [2, 4])
@pytest.mark.parametrize("kind", ["sequential", "functional", "subclassed_no_norm"])
def test_replicas_with_scaled_learning_rate_equal_the_big_batch(kind, replicas, strategy):
    configure(replicas)
    plain, on_ipu = pair(kind, strategy)
    lr = 0.05
    plain.compile(**compile_args(kind, 1, "sgd", lr))
    on_ipu.compile(**compile_args(kind, 4, "sgd", lr / replicas))
    on_ipu.set_gradient_accumulation_options(GLOBAL_ACCUMULATION // replicas, "mean")
    x, y = data_for(kind, samples=128)
    plain.fit(x, y, batch_size=BATCH * GLOBAL_ACCUMULATION, epochs=2, shuffle=False, verbose=0)
    history = on_ipu.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    assert_weights_close(plain.get_weights(), on_ipu.get_weights(), atol=1e-5)
    assert len(history.history["loss"]) == 2
    report = ipu.utils.execution_report(on_ipu, "fit")
    assert report.replicas == replicas and len(report.ipus) == replicas
    assert [r.index for r in report.ipus] == list(range(replicas))


def test_replica_weights_are_bit_identical_and_live_on_their_ipus(strategy):
    configure(4)
    with strategy.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                                  keras.layers.BatchNormalization(), keras.layers.Dense(3)])
    model.compile(optimizer="adam", loss="mse", steps_per_execution=2)
    snapshots = []

    class Snapshot(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            state, codec = context.state_of(self._model).pending_state
            snapshots.append((state, codec.replicas))

    callback = Snapshot()
    callback._model = model
    x, y = data_for("sequential", samples=64)
    model.fit(x, y, batch_size=4, epochs=2, verbose=0, callbacks=[callback])
    state, replicas = snapshots[-1]
    trainable = state[0]
    devices = [ipu.device for ipu in replicas.ipus]
    for leaf in trainable:
        assert leaf.shape[0] == 4
        assert [s.device for s in sorted(leaf.addressable_shards,
                                         key=lambda s: s.index[0].start)] == devices
    per_replica = replicas.replica_slices(trainable)
    for other in per_replica[1:]:
        for a, b in zip(per_replica[0], other):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Batch statistics are per replica: each saw different batches.
    moving = replicas.replica_slices(state[1])
    assert not np.array_equal(np.asarray(moving[0][0]), np.asarray(moving[1][0]))


def test_replicated_predict_equals_plain_predict_row_for_row(strategy):
    configure(4)
    plain, on_ipu = pair("functional", strategy)
    for model in (plain, on_ipu):
        model.compile(**compile_args("functional", 2))
    x, _ = data_for("functional", samples=64)
    expected = plain.predict(x, batch_size=4, verbose=0)
    actual = on_ipu.predict(x, batch_size=4, verbose=0)
    assert actual["out_a"].shape == (64, 2)
    assert_trees_close(expected, actual, atol=1e-6)
    np.testing.assert_allclose(on_ipu.evaluate(x, {"out_a": expected["out_a"],
                                                   "out_b": expected["out_b"]},
                                               batch_size=4, verbose=0)[0], 0.0, atol=1e-6)


def _zero_model():
    return keras.Sequential(
        [keras.Input((1,)), keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")]
    )


@pytest.mark.parametrize(
    "method, expected",
    [
        ("NONE", [3, 10]),
        ("list", [[2, 3], [5, 10]]),
        (ipu.keras.ReplicatedMetricReductionMethod.SUM, [5, 15]),
        ("Mean", [2.5, 7.5]),
    ],
)
def test_metric_reduction_gives_the_reference_numbers(method, expected, strategy):
    configure(2)
    with strategy.scope():
        model = _zero_model()
    model.compile(loss="mae", metrics=["mse"], steps_per_execution=2)
    model.set_replication_options(method)
    x = np.zeros((4, 1), "float32")
    y = np.array([[1], [2], [3], [4]], "float32")
    result = model.evaluate(x, y, batch_size=1, verbose=0)
    np.testing.assert_allclose(np.array(result, dtype=float), np.array(expected, dtype=float))


def test_fit_history_follows_the_reduction(strategy):
    configure(2)
    with strategy.scope():
        model = _zero_model()
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mae", steps_per_execution=2)
    model.set_replication_options("MEAN")
    x, y = np.zeros((4, 1), "float32"), np.array([[1], [2], [3], [4]], "float32")
    history = model.fit(x, y, batch_size=1, shuffle=False, verbose=0)
    assert history.history["loss"] == [pytest.approx(2.5)]


def test_the_reduction_set_by_a_callback_mid_fit_stops_it_as_any_option(strategy):
    # Before: the run went on with its old reduction to its end, silently (the program
    # reduces the replicas' logs), and the new one held from the next fit.
    configure(2)
    with strategy.scope():
        model = _zero_model()
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mae", steps_per_execution=2)
    x, y = np.zeros((8, 1), "float32"), np.arange(1, 9, dtype="float32")[:, None]
    calls = []

    def set_reduction(batch, logs):
        calls.append(batch)
        model.set_replication_options("SUM")

    with pytest.raises(RuntimeError, match="compiled again \\(or an IPU option of it set\\)"):
        model.fit(x, y, batch_size=1, shuffle=False, verbose=0,
                  callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=set_reduction)])
    assert calls == [1]  # the first execution's hook, then the next execution refused
    history = model.fit(x, y, batch_size=1, shuffle=False, verbose=0)
    assert history.history["loss"] == [pytest.approx(4.0 + 5.0)]  # replicas' means summed


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_vector_metric_is_reduced_over_the_replicas_not_its_own_axis(pipelined, strategy):
    # F1Score(average=None) logs one value per class: MEAN and SUM keep the vector
    # (before, it became one number); LIST stacks the replicas' vectors.
    configure(4 if pipelined else 2)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 6)).astype("float32")
    y = np.eye(3, dtype="float32")[rng.integers(0, 3, 32)]
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                                  keras.layers.Dense(3, activation="softmax")])
    model.compile(loss="categorical_crossentropy", steps_per_execution=4,
                  metrics=[keras.metrics.F1Score(average=None, name="f1")])
    if pipelined:
        model.set_pipeline_stage_assignment([0, 1])
    results = {}
    for method in ("LIST", "MEAN", "SUM"):
        model.set_replication_options(method)
        results[method] = model.evaluate(x, y, batch_size=4, verbose=0, return_dict=True)["f1"]
    per_replica = np.asarray(results["LIST"])
    assert per_replica.shape == (2, 3)
    np.testing.assert_allclose(results["MEAN"], per_replica.mean(axis=0), rtol=1e-6)
    np.testing.assert_allclose(results["SUM"], per_replica.sum(axis=0), rtol=1e-6)


class _TouchesTheModel(keras.callbacks.Callback):
    """Reads `self.model` mid-epoch: Keras' property syncs the variables (as
    ModelCheckpoint(save_freq=N) and BackupAndRestore(save_freq=N) do)."""

    def on_train_batch_end(self, batch, logs=None):
        if batch == 1:
            assert self.model is not None

    on_test_batch_end = on_train_batch_end


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_callback_reading_the_model_leaves_the_reduced_logs_alone(pipelined, strategy):
    # Before: every replica went on from the last one's metric states, and the epoch's
    # MEAN loss and evaluate's changed (1.306 for 1.294).
    configure(4 if pipelined else 2)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 6)).astype("float32"), rng.normal(size=(64, 1)).astype("float32")
    results = []
    for callbacks in ([], [_TouchesTheModel()]):
        keras.utils.set_random_seed(0)
        with strategy.scope():
            model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4, "relu"),
                                      keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.025), loss="mse", metrics=["mae"],
                      steps_per_execution=2)
        model.set_replication_options("MEAN")
        if pipelined:
            model.set_pipeline_stage_assignment([0, 1])
            model.set_pipelining_options(gradient_accumulation_steps_per_replica=2)
        history = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0,
                            callbacks=callbacks)
        results.append((history.history, model.evaluate(x, y, batch_size=4, verbose=0,
                                                         callbacks=callbacks)))
    assert results[1] == results[0]


class _ResetsAtTheLastBatch(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == self.params["steps"] - 1:
            self.model.reset_metrics()

    on_test_batch_end = on_train_batch_end


@pytest.mark.parametrize("pipelined, asynchronous", [(False, False), (True, False),
                                                      (False, True)])
def test_metrics_a_hook_resets_after_the_last_batch_read_as_in_keras(pipelined, asynchronous,
                                                                    strategy):
    # Keras' epoch logs are its metric results: a reset in the last batch hook gives
    # zeros. Before, replicated runs reported the last step's device logs instead.
    configure(4 if pipelined else 2)
    x, y = data_for("sequential", samples=32)
    with strategy.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4),
                                  keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"], steps_per_execution=2)
    model.set_replication_options("MEAN")
    model.set_asynchronous_callbacks(asynchronous)
    if pipelined:
        model.set_pipeline_stage_assignment([0, 1])
        model.set_pipelining_options(gradient_accumulation_steps_per_replica=2)
    history = model.fit(x, y, batch_size=4, epochs=2, verbose=0,
                        callbacks=[_ResetsAtTheLastBatch()]).history
    assert history == {"loss": [0.0, 0.0], "mae": [0.0, 0.0]}
    assert model.evaluate(x, y, batch_size=4, verbose=0,
                          callbacks=[_ResetsAtTheLastBatch()]) == [0.0, 0.0]
    history = model.fit(x, y, batch_size=4, epochs=1, verbose=0).history
    assert history["loss"][0] > 0  # without the hook, the device's logs again


@pytest.mark.parametrize("callback", [keras.callbacks.EarlyStopping("loss"),
                                      keras.callbacks.ReduceLROnPlateau("loss"),
                                      keras.callbacks.TerminateOnNaN()])
def test_list_reduction_refuses_callbacks_that_compare_one_number(callback, strategy):
    # Before: NumPy's "truth value of an array is ambiguous" after the first epoch.
    configure(2)
    x, y = data_for("sequential", samples=16)
    with strategy.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss="mse")
    model.set_replication_options("LIST")
    before = model.get_weights()
    with pytest.raises(ValueError, match=rf"{type(callback).__name__} compares a log value as "
                                         r"one number.*array of the 2 replicas.*MEAN, SUM or "
                                         r"NONE"):
        model.fit(x, y, batch_size=4, verbose=0, callbacks=[callback])
    assert_trees_close(before, model.get_weights(), atol=0)
    model.set_replication_options("MEAN")
    assert len(model.fit(x, y, batch_size=4, verbose=0, callbacks=[callback]).history["loss"])


class _MeanEarlyStopping(keras.callbacks.EarlyStopping):
    def get_monitor_value(self, logs):
        return float(np.mean(logs[self.monitor]))


def test_list_reduction_takes_a_subclass_that_reduces_the_values_itself(strategy):
    configure(2)
    x, y = data_for("sequential", samples=16)
    with strategy.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    model.set_replication_options("LIST")
    stopping = _MeanEarlyStopping("loss", patience=0, min_delta=1.0)
    history = model.fit(x, y, batch_size=4, epochs=5, verbose=0, callbacks=[stopping])
    assert len(history.history["loss"]) == 2  # no improvement of 1.0 after the first epoch
    assert np.shape(history.history["loss"][0]) == (2,)


def test_bad_reduction_method(strategy):
    with strategy.scope():
        model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.set_replication_options("sum")
    with pytest.raises(ValueError, match=r"Cannot parse 'AVERAGE' as a "
                                         r"ReplicatedMetricReductionMethod\. Valid values are: "
                                         r"NONE, LIST, SUM, MEAN\."):
        model.set_replication_options("AVERAGE")
    assert options.options_of(model).replicated_metric_reduction_method.name == "SUM"


def test_steps_count_global_batches_and_drop_the_remainder(strategy):
    configure(4)
    _, on_ipu = pair("sequential", strategy)
    on_ipu.compile(**compile_args("sequential", 1))
    x, y = data_for("sequential", samples=28)  # 7 batches of 4: 1 step per replica
    seen = []

    class Count(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(batch)

    with pytest.warns(UserWarning, match=r"Dataset of length 7 is being evenly distributed "
                                         r"between 4 replicas\. The remaining 3 batches"):
        on_ipu.fit(x, y, batch_size=4, verbose=0, callbacks=[Count()])
    assert seen == [0]


def test_steps_that_the_replicas_round_down_are_named_in_the_remedy(strategy):
    # Before: "choose `steps_per_epoch` dividing 10" when 5 did: 2 replicas run 4 of them.
    configure(2)
    _, on_ipu = pair("sequential", strategy)
    on_ipu.compile(**compile_args("sequential", 1))
    x, y = data_for("sequential", samples=40)  # 10 batches of 4
    with pytest.warns(UserWarning, match=r"`steps_per_epoch` \(5\) is being evenly distributed"):
        with pytest.raises(ValueError, match=r"choose `steps_per_epoch` a multiple of 2 \(2 "
                                             r"replicas\) that divides 10 \(2 or 10; 5 runs 4 "
                                             r"batches an epoch on 2 replicas\)\.$"):
            on_ipu.fit(x, y, batch_size=4, steps_per_epoch=5, epochs=3, verbose=0)
    # Whole executions of every replica: 2 x 2 steps (before: 2 was named, and refused).
    on_ipu.compile(**compile_args("sequential", 2))
    x, y = data_for("sequential", samples=48)  # 12 batches of 4
    with pytest.raises(ValueError, match=r"a multiple of 4 \(2 replicas x `steps_per_execution`"
                                         r" 2\) that divides 12 \(4 or 12; 9 runs 8"):
        on_ipu.fit(x, y, batch_size=4, steps_per_epoch=9, epochs=2, verbose=0)


def test_too_little_data_for_all_replicas(strategy):
    configure(4)
    _, on_ipu = pair("sequential", strategy)
    on_ipu.compile(**compile_args("sequential", 1))
    x, y = data_for("sequential", samples=12)  # 3 batches for 4 replicas
    before = [w.copy() for w in on_ipu.get_weights()]
    with pytest.raises(ValueError, match=r"contains 3 items, but all 4 replicas are requested "
                                         r"to run 1 steps each\. Make sure the dataset contains "
                                         r"at least 4 items"):
        on_ipu.fit(x, y, batch_size=4, verbose=0)
    for arguments, name in (({"steps_per_epoch": 2}, "steps_per_epoch"),
                            ({"validation_data": data_for("sequential", samples=16),
                              "validation_steps": 3},
                             "validation_steps")):  # the data has enough: the count does not
        with pytest.raises(ValueError, match=rf"`{name}` \(\d\) counts the batches of all 4 "
                                             r"replicas together.*Set it to 4 or more"):
            on_ipu.fit(*data_for("sequential", samples=16), batch_size=4, verbose=0,
                       **arguments)
    # Too little data and a count given: the data's message (the count's sent the user to
    # set 4, whereupon the data could give only 2 batches).
    with pytest.raises(ValueError, match=r"dataset contains 3 items, but all 4 replicas"):
        on_ipu.fit(x, y, batch_size=4, steps_per_epoch=3, verbose=0)
    with pytest.raises(ValueError, match=r"validation data contains 2 items, but all 4 "
                                         r"replicas.*validation data contains at least 4 items "
                                         r"\(batches of `validation_batch_size`\)"):
        on_ipu.fit(*data_for("sequential", samples=16), batch_size=4,
                   validation_data=(x[:8], y[:8]), verbose=0)
    assert_weights_close(before, on_ipu.get_weights(), atol=0)


def test_effective_batch_size_is_logged(strategy, caplog):
    configure(2)
    _, on_ipu = pair("sequential", strategy)
    on_ipu.compile(**compile_args("sequential", 4))
    on_ipu.set_gradient_accumulation_options(2)
    x, y = data_for("sequential", samples=64)
    with caplog.at_level(logging.INFO, logger="keras_ipu"):
        on_ipu.fit(x, y, batch_size=4, verbose=0)
    assert ("Training is distributed and accumulating 2 batches per optimizer step across "
            "2 replicas, your effective batch size is 16.") in caplog.text


def test_options_survive_save_and_load_inside_the_scope(strategy, tmp_path):
    with strategy.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
        model.compile(optimizer="sgd", loss="mse")
        model.set_gradient_accumulation_options(4, "running_mean", dtype="bfloat16")
        model.set_replication_options("list")
        model.save(tmp_path / "m.keras")
        loaded = keras.models.load_model(tmp_path / "m.keras")
    restored = options.options_of(loaded)
    assert restored.gradient_accumulation_steps_per_replica == 4
    assert restored.gradient_accumulation_reduction_method.name == "RUNNING_MEAN"
    assert restored.replicated_metric_reduction_method.name == "LIST"
    assert restored.gradient_accumulation_optimizer_kwargs == {}  # kwargs are not saved
    config = restored.to_config()
    assert config["gradient_accumulation_reduction_method"] == 2
    assert config["replicated_metric_reduction_method"] == 2
    plain = keras.models.load_model(tmp_path / "m.keras")  # outside: a plain model
    assert not isinstance(plain, ipu.keras.extensions.SequentialExtension)


class _Noise(keras.layers.Layer):
    """Adds uniform noise from its own seed generator, in training and inference alike."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(7)

    def call(self, x):
        return x + keras.random.uniform(keras.ops.shape(x), seed=self.seed_generator)


@pytest.mark.parametrize("identical", [False, True])
def test_replicas_draw_their_own_random_numbers_unless_told_otherwise(identical):
    # The reference's default (experimental_identical_replicas=False): each replica its own.
    configure(2)
    ipu.utils.reset_ipu_seed(1, experimental_identical_replicas=identical)
    x = np.zeros((4, 3), np.float32)
    plain = keras.Sequential([keras.Input((3,)), _Noise()])
    with ipu.ipu_strategy.IPUStrategy().scope():
        on_ipu = keras.Sequential([keras.Input((3,)), _Noise()])
        on_ipu.compile(steps_per_execution=2)
    noise = on_ipu.predict(x, batch_size=1, verbose=0)  # rows 0, 2: replica 0; 1, 3: replica 1
    first = plain.predict(x[:1], batch_size=1, verbose=0)
    np.testing.assert_array_equal(noise[0], first[0])  # replica 0 draws what one IPU would
    assert np.array_equal(noise[0], noise[1]) == identical
    assert not np.array_equal(noise[0], noise[2])  # the next step draws anew
    # Every replica ends with the one state: 2 steps drawn, as by one IPU.
    np.testing.assert_array_equal(on_ipu.layers[0].seed_generator.state, [7, 2])
    ipu.utils.reset_ipu_seed(1)


@pytest.mark.parametrize("identical", [False, True])
def test_pipelined_replicas_draw_their_own_random_numbers_unless_told_otherwise(identical):
    configure(4)  # 2 stages × 2 replicas
    ipu.utils.reset_ipu_seed(1, experimental_identical_replicas=identical)
    x = np.zeros((4, 3), np.float32)
    plain = keras.Sequential([keras.Input((3,)), _Noise(), _Noise()])
    with ipu.ipu_strategy.IPUStrategy().scope():
        on_ipu = keras.Sequential([keras.Input((3,)), _Noise(), _Noise()])
        on_ipu.set_pipeline_stage_assignment([0, 1])
        on_ipu.compile(steps_per_execution=2)
    noise = on_ipu.predict(x, batch_size=1, verbose=0)  # rows 0, 2: replica 0; 1, 3: replica 1
    first = plain.predict(x[:1], batch_size=1, verbose=0)
    np.testing.assert_array_equal(noise[0], first[0])  # replica 0 draws what one pipeline would
    assert np.array_equal(noise[0], noise[1]) == identical
    assert not np.array_equal(noise[0], noise[2])
    for layer in on_ipu.layers:  # one state after the run, as one pipeline's
        np.testing.assert_array_equal(layer.seed_generator.state, [7, 2])
    ipu.utils.reset_ipu_seed(1)


@pytest.mark.parametrize("recompute", [False, True])
def test_pipelined_replicas_drop_out_as_replicas_of_one_ipu_do(recompute):
    # Each replica its own masks, micro-batch by micro-batch, in the schedule's forward ops
    # and in a recomputing backward op alike.
    x, y = data_for("sequential", samples=64)

    def fit(pipelined: bool):
        configure(4 if pipelined else 2, allow_recompute=recompute)
        keras.utils.set_random_seed(4)
        with ipu.ipu_strategy.IPUStrategy().scope():
            model = keras.Sequential([
                keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                keras.layers.Dropout(0.5), keras.layers.Dense(3)])
        if pipelined:
            model.set_pipeline_stage_assignment([0, 0, 1])
            mode = ipu.pipelining_ops.RecomputationMode.RecomputeThenBackpropagate
            model.set_pipelining_options(
                4, gradient_accumulation_reduction_method="mean",
                **({"recomputation_mode": mode} if recompute else {}))
        else:
            model.set_gradient_accumulation_options(4, "mean")
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", steps_per_execution=8)
        model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
        return model.get_weights()

    assert_weights_close(fit(pipelined=False), fit(pipelined=True), atol=1e-6)


def _fit_report(replicas, steps_per_execution):
    configure(replicas)
    with ipu.ipu_strategy.IPUStrategy().scope():
        model = keras.Sequential([keras.Input((1024,)), keras.layers.Dense(8),
                                  keras.layers.Dense(2)])
    model.compile("sgd", "mse", steps_per_execution=steps_per_execution)
    x = np.zeros((steps_per_execution * replicas * 32, 1024), "float32")
    model.fit(x, x[:, :2], batch_size=32, verbose=0)
    return ipu.utils.execution_report(model, "fit").ipus[0]


def test_a_replicas_temporaries_do_not_hold_a_copy_of_its_executions_batches():
    # XLA:CPU used to copy a replica's whole execution of batches (here 64 x 128 KiB)
    # before the loop, which the memory check counted against the IPU.
    one, two = _fit_report(1, 64), _fit_report(2, 64)
    batches_per_replica = 64 * 32 * 1024 * 4
    assert two.temporary_bytes < one.temporary_bytes + batches_per_replica // 8


def _predict_report(replicas, steps_per_execution):
    configure(replicas)
    with ipu.ipu_strategy.IPUStrategy().scope():
        model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(256)])
    model.compile(steps_per_execution=steps_per_execution)
    model.predict(np.zeros((steps_per_execution * replicas * 64, 256), "float32"),
                  batch_size=64, verbose=0)
    return ipu.utils.execution_report(model, "predict").ipus[0]


def test_a_replicated_predicts_temporaries_do_not_hold_its_executions_predictions():
    # XLA:CPU builds a replicated program's stacked outputs in a temporary: 2 replicas
    # counted 2 x steps x 64 KiB of predictions (8 MiB at 64 steps), and small IPUs
    # refused a predict that one replica ran. An IPU streams them out step by step.
    one_replica = _predict_report(1, 64).temporary_bytes
    few, many = _predict_report(2, 4).temporary_bytes, _predict_report(2, 64).temporary_bytes
    one_batch = 64 * 256 * 4
    assert many < few + one_batch and many < one_replica + 2 * one_batch


def test_an_ipus_predict_temporaries_do_not_grow_with_the_replicas():
    # Each replica runs the same program: its IPU holds as much with 8 replicas as with 2.
    # Before, one step of every replica's predictions stayed (8 replicas: 8 x 64 KiB), and
    # a predict that one replica ran was refused on small IPUs at 8.
    two, eight = _predict_report(2, 4).temporary_bytes, _predict_report(8, 4).temporary_bytes
    assert eight == two
    # 16 and 32 IPUs share the 8 devices, which stack their own replicas' outputs first:
    # those grew with the replicas and the steps too (16 x 16 steps: 1 MiB each, not 64 KiB).
    for replicas, steps in ((16, 4), (16, 16), (32, 4)):
        shared = _predict_report(replicas, steps).temporary_bytes
        assert abs(shared - two) <= 64, (replicas, steps, shared, two)


def test_a_one_step_replicated_predict_keeps_its_temporaries():
    # A program of one step hands its replicas' predictions out as they are: the stack
    # that a loop builds was taken off anyway, and 2 replicas reported 0 bytes, where
    # one replica holds its hidden activations (64 x 256 float32).
    def temporaries(replicas):
        configure(replicas)
        with ipu.ipu_strategy.IPUStrategy().scope():
            model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(256, "relu"),
                                      keras.layers.Dense(256)])
        model.compile(steps_per_execution=1)
        model.predict(np.zeros((replicas * 64, 256), "float32"), batch_size=64, verbose=0)
        return ipu.utils.execution_report(model, "predict").ipus[0].temporary_bytes

    one = temporaries(1)
    assert one >= 64 * 256 * 4
    assert temporaries(2) == one


def test_a_replicated_fit_whose_state_is_not_donated_keeps_its_temporaries():
    # With floating-point traps the state is not donated: its new values were taken off
    # the temporaries as if they were the outfeed's copy (2 replicas: less than one).
    def fit_temporaries(replicas):
        config = ipu.config.IPUConfig()
        config.auto_select_ipus = replicas
        config.floating_point_behaviour.inv = True
        config.configure_ipu_system()
        with ipu.ipu_strategy.IPUStrategy().scope():
            model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(256)])
        model.compile("adam", "mse", steps_per_execution=16)
        x = np.zeros((16 * replicas * 8, 256), "float32")
        model.fit(x, x, batch_size=8, verbose=0)
        return ipu.utils.execution_report(model, "fit").ipus[0].temporary_bytes

    assert fit_temporaries(2) >= fit_temporaries(1)


def test_list_reduction_gives_batch_hooks_arrays_with_or_without_asynchronous_callbacks(
        strategy):
    # A hook doing logs["loss"].mean() works in both modes (before: a list when asynchronous).
    configure(2)
    seen = {}
    for asynchronous in (False, True):
        with strategy.scope():
            model = _zero_model()
        model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mae", steps_per_execution=2)
        model.set_replication_options("LIST")
        model.set_asynchronous_callbacks(asynchronous)
        losses = seen[asynchronous] = []
        x, y = np.zeros((8, 1), "float32"), np.arange(1, 9, dtype="float32")[:, None]
        model.fit(x, y, batch_size=1, shuffle=False, verbose=0, callbacks=[
            keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs, losses=losses:
                                           losses.append(logs["loss"]))])
        assert all(isinstance(loss, np.ndarray) and loss.shape == (2,) for loss in losses)
    for sync, asynchronous in zip(seen[False], seen[True]):
        if len(seen[False]) == len(seen[True]):  # async reports every step
            np.testing.assert_allclose(asynchronous, sync)
    # Every replica's running mean: replica r gets samples 2k + r.
    np.testing.assert_allclose(seen[True][-1], [np.mean([1, 3, 5, 7]), np.mean([2, 4, 6, 8])])
