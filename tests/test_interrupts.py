"""Interrupts during fit: the weights are those after the last completed execution."""

from __future__ import annotations

import contextlib

import keras
import numpy as np
import pytest

import keras_ipu as ipu

from conftest import assert_weights_close, configure
from models import data_for

SPE, BATCH, DONE = 4, 4, 3  # interrupted after 3 executions


def _model(setup: str):
    configure(2 if setup != "one_ipu" else 1)
    keras.utils.set_random_seed(0)
    with ipu.ipu_strategy.IPUStrategy().scope():
        model = keras.Sequential([
            keras.Input((6,)),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dense(3),
        ])
        if setup == "pipelined":
            model.set_pipeline_stage_assignment([0, 1])
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse",
                  steps_per_execution=SPE)
    if setup == "pipelined":
        model.set_pipelining_options(gradient_accumulation_steps_per_replica=SPE)
    return model


def _batches_per_execution(setup: str) -> int:
    return SPE * (2 if setup == "replicated" else 1)


class _Interrupt(keras.callbacks.Callback):
    def __init__(self, at):
        super().__init__()
        self.at = at

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.at:
            raise KeyboardInterrupt  # what Ctrl-C raises in a notebook


class _FailingBatches(keras.utils.PyDataset):
    def __init__(self, x, y, fail_at):
        super().__init__()
        self.x, self.y, self.fail_at = x, y, fail_at

    def __len__(self):
        return len(self.x) // BATCH

    def __getitem__(self, index):
        if index == self.fail_at:
            raise OSError(f"batch {index} could not be read")
        rows = slice(index * BATCH, (index + 1) * BATCH)
        return self.x[rows], self.y[rows]


@pytest.mark.parametrize("source", ["callback", "data"])
@pytest.mark.parametrize("setup", ["one_ipu", "replicated", "pipelined"])
def test_weights_after_an_interrupt_are_the_last_completed_executions(setup, source, tmp_path):
    x, y = data_for("sequential", samples=16 * _batches_per_execution(setup) * BATCH)
    completed = DONE * _batches_per_execution(setup) * BATCH
    expected_model = _model(setup)
    expected_model.fit(x[:completed], y[:completed], batch_size=BATCH, epochs=1,
                       shuffle=False, verbose=0)
    expected = expected_model.get_weights()

    model = _model(setup)
    if source == "callback":
        with pytest.raises(KeyboardInterrupt):
            model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                      callbacks=[_Interrupt(DONE * SPE - 1)])
    else:
        # The first batch of execution DONE + 1 cannot be made.
        with pytest.raises(OSError, match="could not be read"):
            model.fit(_FailingBatches(x, y, completed // BATCH + 1), epochs=1, verbose=0,
                      shuffle=False)
    assert_weights_close(expected, model.get_weights(), atol=1e-6)

    # The model is usable: it saves, evaluates, and trains on like the other.
    with ipu.ipu_strategy.IPUStrategy().scope():
        model.save(tmp_path / "interrupted.keras")
        reloaded = keras.models.load_model(tmp_path / "interrupted.keras")
    assert_weights_close(expected, reloaded.get_weights(), atol=0)
    np.testing.assert_allclose(model.evaluate(x, y, batch_size=BATCH, verbose=0),
                               expected_model.evaluate(x, y, batch_size=BATCH, verbose=0),
                               rtol=1e-5)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    expected_model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert_weights_close(expected_model.get_weights(), model.get_weights(), atol=1e-5)


def test_a_ctrl_c_inside_a_deferred_block_is_raised_as_it_ends():
    # An execution and the keeping of its state are not cut in two by a KeyboardInterrupt.
    import os
    import signal

    from keras_ipu.device import interrupts

    done = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts.deferred():
            os.kill(os.getpid(), signal.SIGINT)
            done.append("the block ran to its end")
    assert done == ["the block ran to its end"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored
    with interrupts.deferred():  # nothing arrived: nothing raised
        done.append("again")


@pytest.mark.parametrize("setup", ["one_ipu", "pipelined"])
def test_an_interrupt_in_an_asynchronous_hook_keeps_the_executions_whose_hooks_all_ran(setup):
    # docs/semantics.md: with asynchronous callbacks, the weights are those after the
    # last execution whose hooks all ran, also when the program consumes its state (a
    # pipeline's): the interrupted execution's weights are not kept.
    x, y = data_for("sequential", samples=16 * SPE * BATCH)
    completed = DONE * SPE * BATCH
    expected_model = _model(setup)
    expected_model.fit(x[:completed], y[:completed], batch_size=BATCH, epochs=1,
                       shuffle=False, verbose=0)

    model = _model(setup)
    model.set_asynchronous_callbacks(True)
    with pytest.raises(KeyboardInterrupt):
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                  callbacks=[_Interrupt(DONE * SPE + 1)])  # mid-way through execution DONE + 1
    assert_weights_close(expected_model.get_weights(), model.get_weights(), atol=1e-6)
    assert int(model.optimizer.iterations.numpy()) == int(
        expected_model.optimizer.iterations.numpy())


def test_a_ctrl_c_while_the_epochs_logs_are_fetched_is_not_swallowed():
    # Keras' log conversion wraps each value's fetch in a bare `except`: a Ctrl-C that
    # arrived while it waited for the device was dropped, and `fit` trained on. The
    # value stands for a device array whose host copy is being waited for.
    from keras_ipu.keras import trainer

    class Waited:
        def __array__(self, dtype=None, copy=None):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        trainer._python_logs({"loss": Waited()})
    assert trainer._python_logs({"loss": np.float32(1.5), "val": {"acc": 2}}) == {
        "loss": 1.5, "acc": 2.0}


class _LongExecution(keras.layers.Layer):
    """Keeps the device busy for a while each step (a long execution on a small model)."""

    def call(self, inputs):
        from keras import ops

        # Started from the inputs: not folded away nor hoisted out of the step loop.
        start = ops.ones((400, 400)) * ops.mean(inputs)
        busy = ops.fori_loop(0, 160, lambda _, z: ops.tanh(z @ z), start)
        return inputs + 0.0 * ops.mean(busy)


def test_a_ctrl_c_while_a_batch_hook_waits_for_the_logs_stops_fit():
    # Keras converts the logs for batch hooks inside a bare `except`: a Ctrl-C that
    # arrived while that conversion waited for the device was dropped, and `fit` ran on.
    import os
    import signal
    import threading

    configure(1)
    x, y = data_for("sequential", samples=6 * SPE * BATCH)
    with ipu.ipu_strategy.IPUStrategy().scope():
        model = keras.Sequential([keras.Input((6,)), _LongExecution(), keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=SPE)
    ends, running, timers = [], threading.Event(), []

    def press_ctrl_c():
        if running.is_set():  # never after fit returned: it would hit another test
            os.kill(os.getpid(), signal.SIGINT)

    def press_ctrl_c_during_the_second_execution(batch, logs):
        # Early in the execution (each takes ~0.5 s on a CPU, more under load): the
        # host has dispatched it and waits for its logs.
        if batch == SPE:
            timers.append(threading.Timer(0.1, press_ctrl_c))
            timers[0].start()

    hooks = keras.callbacks.LambdaCallback(
        on_train_batch_begin=press_ctrl_c_during_the_second_execution,
        on_train_batch_end=lambda batch, logs: ends.append(batch))
    running.set()
    try:
        with pytest.raises(KeyboardInterrupt):
            model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[hooks])
    finally:
        running.clear()
        for timer in timers:
            timer.cancel()
    assert len(ends) < 6  # stopped before its last execution


class _Reshuffling(keras.utils.PyDataset):
    """Reshuffles its batches at each `on_epoch_end`, counting them."""

    def __init__(self, x, y):
        super().__init__()
        self.x, self.y = x, y
        self.order, self.rng, self.epoch_ends = np.arange(len(x) // BATCH), None, 0

    def __len__(self):
        return len(self.order)

    def __getitem__(self, index):
        rows = slice(self.order[index] * BATCH, (self.order[index] + 1) * BATCH)
        return self.x[rows], self.y[rows]

    def on_epoch_end(self):
        self.epoch_ends += 1
        self.order = np.random.default_rng(self.epoch_ends).permutation(len(self.order))


class _StopIn(keras.callbacks.Callback):
    def __init__(self, epoch, batch, how):
        super().__init__()
        self.at, self.how = (epoch, batch), how

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            if self.how == "raise":
                raise RuntimeError("stopped")
            self.model.stop_training = True


@pytest.mark.parametrize("how", ["raise", "stop_training"])
def test_an_epoch_that_did_not_end_does_not_end_the_pydatasets_epoch(how, tmp_path):
    # Keras' epoch iterator never reaches the adapter's `on_epoch_end` for an epoch left
    # by an error or `stop_training`: a self-reshuffling PyDataset keeps its order, and a
    # BackupAndRestore resume reads what plain Keras reads. keras_ipu's input thread
    # reached the pass's end ahead of the device and ended it.
    x, y = data_for("sequential", samples=16 * BATCH)
    results = {}
    for kind in ("plain", "ipu"):
        configure(1)
        data = _Reshuffling(x, y)
        backup = keras.callbacks.BackupAndRestore(str(tmp_path / kind))
        scope = ipu.ipu_strategy.IPUStrategy().scope() if kind == "ipu" else None
        with scope or contextlib.nullcontext():
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
            model.compile(optimizer="adam", loss="mse", steps_per_execution=SPE)
            try:
                model.fit(data, epochs=3, verbose=0, callbacks=[backup, _StopIn(1, SPE - 1, how)])
            except RuntimeError:
                pass
            ends = data.epoch_ends
            model.fit(data, epochs=3, verbose=0, callbacks=[backup])
        results[kind] = ends, model.get_weights()
    assert results["ipu"][0] == results["plain"][0]
    assert_weights_close(results["plain"][1], results["ipu"][1], atol=1e-6)


def _ctrl_c_on_entering(function_name: str):
    """A profiler that presses Ctrl-C as this thread enters keras_ipu's `function_name`."""
    import os
    import signal

    armed = [True]

    def profile(frame, event, arg):
        code = frame.f_code
        if (event == "call" and armed[0] and code.co_name == function_name
                and "keras_ipu" in code.co_filename):
            armed[0] = False
            os.kill(os.getpid(), signal.SIGINT)

    return profile


@pytest.mark.parametrize("setup", ["one_ipu", "replicated"])
@pytest.mark.parametrize("where, call", [
    ("to_device", "fit"), ("to_keras", "fit"), ("to_device", "evaluate"),
    ("to_keras", "predict"),
    # As the state is handed back, before the sync holds Ctrl-C back: the variables
    # stayed purged, and the next evaluate threw the held state away.
    ("jax_state_sync", "evaluate"), ("jax_state_sync", "predict"),
])
def test_a_ctrl_c_while_the_state_moves_keeps_the_weights(setup, where, call):
    # The state moves to the device from purged Keras variables, and back at the
    # end: a Ctrl-C in either move left every variable None (the model lost).
    import sys

    x, y = data_for("sequential", samples=4 * _batches_per_execution(setup) * BATCH)
    expected = _model(setup)
    expected.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    model = _model(setup)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    run = {"fit": lambda: model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False,
                                    verbose=0),
           "evaluate": lambda: model.evaluate(x, y, batch_size=BATCH, verbose=0),
           "predict": lambda: model.predict(x, batch_size=BATCH, verbose=0)}[call]
    sys.setprofile(_ctrl_c_on_entering(where))
    try:
        with pytest.raises(KeyboardInterrupt):
            run()
    finally:
        sys.setprofile(None)
    if call == "fit" and where == "to_keras":  # at the epoch's end: that epoch is kept
        expected.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert_weights_close(expected.get_weights(), model.get_weights(), atol=1e-6)
    np.testing.assert_allclose(model.evaluate(x, y, batch_size=BATCH, verbose=0),
                               expected.evaluate(x, y, batch_size=BATCH, verbose=0), rtol=1e-6)


def test_a_ctrl_c_while_a_thread_starts_leaves_no_thread(monkeypatch):
    # The callbacks' and the infeed's threads start in their constructors: a Ctrl-C
    # there left a running thread that nobody could close.
    import threading
    import time

    from keras_ipu.device.infeed import Infeed
    from keras_ipu.keras import step_callbacks

    class Interrupted(threading.Thread):
        def start(self):
            super().start()
            raise KeyboardInterrupt

    monkeypatch.setattr(threading, "Thread", Interrupted)
    before = set(threading.enumerate())
    with pytest.raises(KeyboardInterrupt):
        step_callbacks.CallbackThread(delivery=None, on_error=lambda: None)
    with pytest.raises(KeyboardInterrupt):
        Infeed(iter(range(10**6)), place=lambda item: item, depth=2, threaded=True)
    deadline = time.monotonic() + 5
    while set(threading.enumerate()) - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert set(threading.enumerate()) - before == set()


def test_a_ctrl_c_stops_the_reading_of_a_slow_data_source_at_its_batch():
    # Before: the input thread read the rest of the execution's batches after a Ctrl-C
    # (a slow source delayed it by all of them), went on after fit returned, and the next
    # fit on the same generator raised "generator already executing".
    import os
    import signal
    import threading

    configure(1)
    x, y = data_for("sequential", samples=8 * BATCH)
    reads, release = [], threading.Event()

    def batches():
        for index in range(10**6):
            reads.append(index)
            if index == 2 * SPE + 1:  # inside the third execution's batches: slow
                os.kill(os.getpid(), signal.SIGINT)
                release.wait(10)
            start = (index % 8) * BATCH
            yield x[start:start + BATCH], y[start:start + BATCH]

    with ipu.ipu_strategy.IPUStrategy().scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=SPE)
    source = batches()
    # The slow read ends after 3 s: time for the main thread to take the Ctrl-C, also on a
    # loaded machine (with 0.5 s a busy CI run once let the reader go on first).
    timer = threading.Timer(3.0, release.set)
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            model.fit(source, steps_per_epoch=8 * SPE, epochs=1, verbose=0)
    finally:
        release.set()
        timer.cancel()
    assert reads[-1] == 2 * SPE + 1  # the batch being read when the Ctrl-C came, no more
    history = model.fit(source, steps_per_epoch=SPE, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])


@pytest.mark.parametrize("mode", ["ALL", "LAST"])
def test_a_ctrl_c_as_a_graph_programs_values_come_back_loses_none(mode):
    # The run took its infeed elements: its outfed values must reach the queue and stay
    # there until a dequeue returns them (a Ctrl-C lost a run's 50 values, or the last).
    import sys

    import jax.numpy as jnp

    import keras_ipu as ipu

    infeed = ipu.ipu_infeed_queue.IPUInfeedQueue(np.arange(8, dtype=np.float32).reshape(8, 1))
    outfeed = ipu.ipu_outfeed_queue.IPUOutfeedQueue(
        outfeed_mode=ipu.ipu_outfeed_queue.IPUOutfeedMode[mode])

    def body(total, x):
        total = total + jnp.sum(x)
        return total, outfeed.enqueue(total)

    totals = np.cumsum(np.arange(8, dtype=np.float32))
    where = "receive" if mode == "LAST" else "_runs_that_stack"
    sys.setprofile(_ctrl_c_on_entering(where))
    try:
        with pytest.raises(KeyboardInterrupt):
            with ipu.scopes.ipu_scope("/device:IPU:0"):
                ipu.ipu_compiler.compile(lambda: ipu.loops.repeat(8, body, [0.0], infeed))
            outfeed.dequeue()
    finally:
        sys.setprofile(None)
    np.testing.assert_array_equal(outfeed.dequeue(), totals[-1] if mode == "LAST" else totals)


def test_a_ctrl_c_while_the_first_fit_builds_the_optimizer_leaves_it_whole(monkeypatch):
    # Keras marks the optimizer built before it makes its slots: a Ctrl-C between two
    # slots left SGD without its momentums, and every later fit raised AttributeError.
    import signal

    from keras.src.optimizers import base_optimizer

    x, y = data_for("sequential", samples=4 * SPE * BATCH)
    expected = _model("one_ipu")
    expected.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    model = _model("one_ipu")
    made = base_optimizer.BaseOptimizer.add_variable_from_reference
    slots = []

    def ctrl_c_at_the_second_slot(self, *args, **kwargs):
        slots.append(1)
        if len(slots) == 2:
            signal.raise_signal(signal.SIGINT)
        return made(self, *args, **kwargs)

    monkeypatch.setattr(base_optimizer.BaseOptimizer, "add_variable_from_reference",
                        ctrl_c_at_the_second_slot)
    with pytest.raises(KeyboardInterrupt):
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    monkeypatch.undo()
    assert len(slots) == 4 and int(model.optimizer.iterations.numpy()) == 0  # 4 momentums
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert_weights_close(expected.get_weights(), model.get_weights(), atol=1e-6)
