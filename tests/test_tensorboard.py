"""TensorBoard logs without TensorFlow, read back with TensorBoard's own reader."""

from __future__ import annotations

import os
import re

import keras
import numpy as np
import pytest
from tensorboard.backend.event_processing import event_accumulator

import keras_ipu as ipu

from conftest import configure
from models import data_for


def _read(run_dir, purge_orphaned_data=True):
    accumulator = event_accumulator.EventAccumulator(
        str(run_dir), size_guidance={event_accumulator.SCALARS: 0,
                                     event_accumulator.HISTOGRAMS: 0},
        purge_orphaned_data=purge_orphaned_data)
    accumulator.Reload()
    return accumulator


def _values(accumulator, tag):
    return [event.value for event in accumulator.Scalars(tag)]


@pytest.mark.parametrize("pipelined", [False, True])
def test_event_files_hold_the_epoch_logs_and_each_ipus_memory(pipelined, strategy, tmp_path):
    configure(2 if pipelined else 1)
    x, y = data_for("sequential", samples=64)
    with ipu.ipu_strategy.IPUStrategy().scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                                  keras.layers.Dense(3)])
        if pipelined:
            model.set_pipeline_stage_assignment([0, 1])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"],
                  steps_per_execution=4)
    if pipelined:
        model.set_pipelining_options(gradient_accumulation_steps_per_replica=4)
    board = ipu.keras.callbacks.TensorBoard(tmp_path, histogram_freq=1, update_freq="batch",
                                            write_steps_per_second=True)
    history = model.fit(x, y, batch_size=4, epochs=3, verbose=0, callbacks=[board],
                        validation_data=(x, y)).history
    train, validation = _read(tmp_path / "train"), _read(tmp_path / "validation")
    np.testing.assert_allclose(_values(train, "epoch_loss"), history["loss"], rtol=1e-6)
    np.testing.assert_allclose(_values(train, "epoch_mae"), history["mae"], rtol=1e-6)
    np.testing.assert_allclose(_values(validation, "epoch_loss"), history["val_loss"], rtol=1e-6)
    # Each validation's results at the optimizer's step, as Keras' TensorBoard writes them
    # (before: never written).
    written = validation.Scalars("evaluation_mae_vs_iterations")
    np.testing.assert_allclose([e.value for e in written], history["val_mae"], rtol=1e-6)
    steps = 4 if pipelined else 16  # weight updates an epoch
    assert [e.step for e in written] == [steps, 2 * steps, 3 * steps]
    np.testing.assert_allclose(_values(train, "epoch_learning_rate"), [0.05] * 3, rtol=1e-6)
    assert len(_values(train, "epoch_steps_per_second")) == 3
    # Batch logs once per execution (4 per epoch), as the callbacks get them, each at its
    # last batch's number since training began (16 batches an epoch).
    assert [e.step for e in train.Scalars("batch_loss")] == list(range(4, 49, 4))
    report = ipu.utils.execution_report(model, "fit")
    for ipu_report in report.ipus:
        memory = _values(train, f"ipu/memory_bytes/ipu_{ipu_report.index}")
        assert memory == [float(ipu_report.memory_bytes)] * 3 and memory[0] > 0
        cycles = _values(train, f"ipu/estimated_cycles/ipu_{ipu_report.index}")
        assert cycles == pytest.approx([float(ipu_report.estimated_cycles)] * 3, rel=1e-6)
    assert len(report.ipus) == (2 if pipelined else 1)
    assert any("kernel" in tag for tag in train.Tags()["histograms"])
    assert all(name.startswith("events.out.tfevents") for name in os.listdir(tmp_path / "train"))


@pytest.mark.parametrize("replicas", [1, 2])
def test_asynchronous_callbacks_log_every_step(replicas, tmp_path):
    # Each batch once, at its number, however many replicas report it.
    configure(replicas)
    x, y = data_for("sequential", samples=64 * replicas)
    with ipu.ipu_strategy.IPUStrategy().scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=8)
    model.set_asynchronous_callbacks(True)
    board = ipu.keras.callbacks.TensorBoard(tmp_path, update_freq=2)
    for _ in range(2):  # a second fit counts from 0 again, as Keras' TensorBoard does
        model.fit(x, y, batch_size=4, epochs=2, verbose=0, callbacks=[board])
    # (The reader would drop the first fit's events as orphaned by the restart.)
    written = _read(tmp_path / "train", purge_orphaned_data=False)
    steps = [e.step for e in written.Scalars("batch_loss")]
    assert steps == list(range(2, 33, 2)) * 2  # 16 steps an epoch, each of `replicas` batches


def test_a_frequency_that_is_not_the_executions_logs_at_the_execution_reaching_it(strategy,
                                                                                  tmp_path):
    x, y = data_for("sequential", samples=64)
    with strategy.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=4)
    model.fit(x, y, batch_size=4, epochs=1, verbose=0,
              callbacks=[ipu.keras.callbacks.TensorBoard(tmp_path, update_freq=6)])
    steps = [e.step for e in _read(tmp_path / "train").Scalars("batch_loss")]
    assert steps == [8, 12]  # the executions that pass batches 6 and 12 (16 passes none)


def test_the_learning_rate_is_written_once_an_epoch_after_a_rate_callback(strategy, tmp_path):
    # ReduceLROnPlateau (reducing from epoch 1 on) puts the rate it replaces in the logs;
    # as in Keras' TensorBoard, the event file holds the optimizer's rate alone, not both.
    x, y = data_for("sequential", samples=32)
    with strategy.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", steps_per_execution=2)
    reduce = keras.callbacks.ReduceLROnPlateau("loss", factor=0.5, patience=0, min_delta=100)
    model.fit(x, y, batch_size=8, epochs=3, verbose=0,
              callbacks=[reduce, ipu.keras.callbacks.TensorBoard(tmp_path)])
    events = _read(tmp_path / "train", purge_orphaned_data=False).Scalars(
        "epoch_learning_rate")
    assert [e.step for e in events] == [0, 1, 2]
    np.testing.assert_allclose([e.value for e in events], [0.1, 0.05, 0.025], rtol=1e-6)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="update_freq"):
        ipu.keras.callbacks.TensorBoard(update_freq="sometimes")
    with pytest.raises(ValueError, match="histogram_freq"):
        ipu.keras.callbacks.TensorBoard(histogram_freq=-1)


def test_the_list_reduction_writes_each_replicas_scalars_and_refuses_best_only_saves(
        tmp_path):
    # Before: no loss or metric at all (arrays were skipped, silently), and
    # ModelCheckpoint(save_best_only=True) saved every epoch's model as the best.
    configure(2)
    x, y = data_for("sequential", samples=32)
    with ipu.ipu_strategy.IPUStrategy().scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"], steps_per_execution=2)
    model.set_replication_options("LIST")
    best = keras.callbacks.ModelCheckpoint(str(tmp_path / "best.keras"), monitor="loss",
                                           save_best_only=True)
    with pytest.raises(ValueError, match=r"ModelCheckpoint compares a log value as one number"
                                         r".*`save_best_only=False`"):
        model.fit(x, y, batch_size=4, verbose=0, callbacks=[best])

    # Before: NumPy's "unsupported format string passed to numpy.ndarray.__format__"
    # after the first epoch, naming the file.
    for field in ("loss:.3f", "top-err:.2f"):  # a metric's name need not be an identifier
        named = keras.callbacks.ModelCheckpoint(str(tmp_path / f"m-{{epoch}}-{{{field}}}.keras"))
        with pytest.raises(ValueError, match=r"ModelCheckpoint's file name formats a log "
                                             rf"value as one number \({{{re.escape(field)}}}\)"):
            model.fit(x, y, batch_size=4, epochs=2, verbose=0, callbacks=[named])
    assert not list(tmp_path.glob("m-*"))
    # Fields that format numbers: an element, a conversion, a scheduler's learning rate.
    # (The first form refused them all.)
    names = ("m-{epoch:02d}-{loss}", "a-{loss[0]:.3f}", "s-{loss!s:.6}", "r-{learning_rate:.3f}")
    model.fit(x, y, batch_size=4, verbose=0, callbacks=[
        keras.callbacks.LearningRateScheduler(lambda epoch, rate: 0.01), *(
            keras.callbacks.ModelCheckpoint(str(tmp_path / f"{name}.keras")) for name in names)])
    assert sorted(path.name[:2] for path in tmp_path.glob("*.keras")) == ["a-", "m-", "r-", "s-"]
    assert (tmp_path / "r-0.010.keras").exists()

    class MeanCheckpoint(keras.callbacks.ModelCheckpoint):  # reduces the values itself
        def _should_save_model(self, epoch, batch, logs, filepath):
            return super()._should_save_model(
                epoch, batch, {k: float(np.mean(v)) for k, v in logs.items()}, filepath)

    model.fit(x, y, batch_size=4, verbose=0, callbacks=[MeanCheckpoint(
        str(tmp_path / "mean.keras"), monitor="loss", save_best_only=True)])
    assert (tmp_path / "mean.keras").exists()
    board = ipu.keras.callbacks.TensorBoard(tmp_path / "logs", update_freq="batch")
    history = model.fit(x, y, batch_size=4, epochs=2, verbose=0, validation_data=(x, y),
                        callbacks=[board]).history
    train, validation = _read(tmp_path / "logs" / "train"), _read(tmp_path / "logs" /
                                                                   "validation")
    for replica in range(2):
        np.testing.assert_allclose(_values(train, f"epoch_loss/replica_{replica}"),
                                   [epoch[replica] for epoch in history["loss"]], rtol=1e-6)
        np.testing.assert_allclose(_values(validation, f"epoch_mae/replica_{replica}"),
                                   [epoch[replica] for epoch in history["val_mae"]], rtol=1e-6)
        assert len(_values(train, f"batch_loss/replica_{replica}")) == 4  # 2 executions x 2
    assert not (tmp_path / "best.keras").exists()


def test_only_numbers_become_scalars():
    from keras_ipu.keras.callbacks import _scalars

    logs = {"acc": np.float32(0.5), "none": None, "name": "x", "steps": 3, "flag": True,
            "per_replica": np.array([1.0, 2.0])}
    assert _scalars(logs) == {"acc": 0.5, "steps": 3.0, "flag": 1.0}  # None was NaN
    assert _scalars(logs, per_replica=True)["per_replica/replica_1"] == 2.0
