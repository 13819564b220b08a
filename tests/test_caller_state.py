"""User code on the run's threads (the infeed's, the asynchronous hooks') sees what it would
see on the thread of `fit`: the strategy scope and Keras' per-thread state."""

from __future__ import annotations

import threading
import time

import keras
import numpy as np
import pytest

import keras_ipu as ipu

from conftest import assert_history_close, assert_weights_close, configure
from models import data_for, twin

BATCH = 8


class NoisyBatches(keras.utils.PyDataset):
    """Batches with unseeded `keras.random` noise (a random augmentation); records the
    dtype policy and thread each read saw."""

    def __init__(self, x, y):
        super().__init__()
        self.x, self.y, self.seen = x, y, []

    def __len__(self):
        return len(self.x) // BATCH

    def __getitem__(self, index):
        self.seen.append((keras.config.dtype_policy().name, threading.current_thread().name))
        rows = slice(index * BATCH, (index + 1) * BATCH)
        noise = np.asarray(keras.random.normal(self.x[rows].shape, stddev=0.1))
        return self.x[rows] + noise, self.y[rows]


def _noisy_generator(x, y, epochs):
    for _ in range(epochs):
        for start in range(0, len(x), BATCH):
            noise = np.asarray(keras.random.normal((BATCH, x.shape[1]), stddev=0.1))
            yield x[start:start + BATCH] + noise, y[start:start + BATCH]


@pytest.mark.parametrize("source", ["generator", "py_dataset"])
def test_a_seeded_random_augmentation_gives_plain_kerases_batches(source, strategy):
    # Before: the infeed thread drew from a seed generator of its own (and the PyDataset's
    # early look at its last batch drew once more): other noise, other losses.
    plain, on_ipu = twin("sequential", strategy, steps_per_execution=2, optimizer="sgd")
    x, y = data_for("sequential", samples=64)
    histories, datasets = [], []
    for model in (plain, on_ipu):
        keras.utils.set_random_seed(7)
        data = NoisyBatches(x, y) if source == "py_dataset" else _noisy_generator(x, y, 2)
        datasets.append(data)
        steps = None if source == "py_dataset" else len(x) // BATCH
        histories.append(model.fit(data, epochs=2, steps_per_epoch=steps, shuffle=False,
                                   verbose=0).history)
    assert_history_close(*histories)
    assert_weights_close(plain.get_weights(), on_ipu.get_weights())
    if source == "py_dataset":  # and it was read on the infeed thread
        assert "keras_ipu-infeed" in {thread for _, thread in datasets[1].seen}


_OWN_GENERATORS = {
    "numpy_generator": (lambda: np.random.default_rng(5),
                        lambda g, shape: g.normal(0, 0.1, shape)),
    "random_state": (lambda: np.random.RandomState(5), lambda g, shape: g.normal(0, 0.1, shape)),
    "python_random": (lambda: __import__("random").Random(5),
                      lambda g, shape: np.full(shape, g.gauss(0, 0.1))),
    "seed_generator": (lambda: keras.random.SeedGenerator(5),
                       lambda g, shape: np.asarray(keras.random.normal(shape, 0, 0.1, seed=g))),
}


class OwnNoiseBatches(keras.utils.PyDataset):
    """Batches augmented from a random generator of the dataset's own."""

    def __init__(self, x, y, kind, **options):
        super().__init__(**options)
        make, self._draw = _OWN_GENERATORS[kind]
        self.x, self.y, self.generator = x, y, make()

    def __len__(self):
        return len(self.x) // BATCH

    def __getitem__(self, index):
        rows = slice(index * BATCH, (index + 1) * BATCH)
        noise = self._draw(self.generator, self.x[rows].shape).astype("float32")
        return self.x[rows] + noise, self.y[rows]


@pytest.mark.parametrize("kind", sorted(_OWN_GENERATORS))
def test_a_datasets_own_random_generator_gives_plain_kerases_batches(kind, strategy):
    # Before: the look at the last batch before training drew from the dataset's own
    # generator, which plain Keras' first read then did not get (loss 0.196 for 0.195).
    plain, on_ipu = twin("sequential", strategy, steps_per_execution=2, optimizer="sgd")
    x, y = data_for("sequential", samples=64)
    histories = [model.fit(OwnNoiseBatches(x, y, kind), epochs=2, shuffle=False,
                           verbose=0).history for model in (plain, on_ipu)]
    assert_history_close(*histories)
    assert_weights_close(plain.get_weights(), on_ipu.get_weights())


class _SlowOwnNoiseBatches(OwnNoiseBatches):
    """Records each read's noise; prepares its order in `on_epoch_begin`, as Keras allows."""

    def on_epoch_begin(self):
        self.order, self.noise = np.arange(len(self)), getattr(self, "noise", [])

    def __getitem__(self, index):
        time.sleep(0.01)  # workers are still drawing while the last batch is looked at
        x, y = super().__getitem__(self.order[index])
        self.noise.append(float(x[0, 0] - self.x[self.order[index] * BATCH, 0]))
        return x, y


def test_a_dataset_with_workers_is_read_in_its_pass_and_no_draw_is_undone(strategy):
    # Before: putting its generator back after the look at its last batch undid the draws
    # its workers made meanwhile (two batches with the same noise); and an intermediate
    # fix read it before `on_epoch_begin`, where it made its order (AttributeError).
    plain, on_ipu = twin("sequential", strategy, steps_per_execution=2, optimizer="sgd")
    x, y = data_for("sequential", samples=64)
    histories = []
    for model in (plain, on_ipu):
        dataset = _SlowOwnNoiseBatches(x, y, "numpy_generator", workers=2)
        histories.append(model.fit(dataset, epochs=2, shuffle=False, verbose=0).history)
        assert len(set(dataset.noise)) == len(dataset.noise) > 8
    # Which batch gets which draw is the workers' timing, in plain Keras too.
    np.testing.assert_allclose(histories[0]["loss"], histories[1]["loss"], rtol=0.2)


def test_the_infeed_thread_sees_the_callers_dtype_policy(strategy):
    _, on_ipu = twin("sequential", strategy, steps_per_execution=2, optimizer="sgd")
    x, y = data_for("sequential", samples=64)
    dataset = NoisyBatches(x, y)
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        on_ipu.fit(dataset, epochs=1, shuffle=False, verbose=0)
    finally:
        keras.config.set_dtype_policy("float32")
    assert {policy for policy, _ in dataset.seen} == {"mixed_bfloat16"}


class _StagedModel(keras.Model):
    def __init__(self):
        super().__init__()
        self.hidden, self.out = keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)

    def call(self, inputs):
        with ipu.keras.PipelineStage(0):
            hidden = self.hidden(inputs)
        with ipu.keras.PipelineStage(1):
            return self.out(hidden)


def _staged_model(strategy, x, **compile_arguments):
    """A `_StagedModel` on 2 IPUs, built on `x`'s first row and compiled."""
    configure(2)
    with strategy.scope():
        model = _StagedModel()
        model(x[:1])
    model.compile("sgd", "mse", **compile_arguments)
    return model


def test_asynchronous_hooks_run_in_the_strategy_scope_of_fit(strategy):
    # Before: a hook calling a stage-scoped model raised "PipelineStage may only be used
    # from within an IPUStrategy context", and models it made were plain Keras models.
    x, y = data_for("sequential", samples=32)
    model = _staged_model(strategy, x, steps_per_execution=4)
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=4)
    seen = {}

    class Look(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.setdefault("thread", threading.current_thread().name)
            seen.setdefault("outputs", tuple(self.model(x[:4]).shape))
            seen.setdefault("ipu_model", isinstance(keras.Sequential([keras.layers.Dense(1)]),
                                                    ipu.keras.extensions.ExtensionBase))

    model.set_asynchronous_callbacks(True)
    with strategy.scope():
        model.fit(x, y, batch_size=4, verbose=0, callbacks=[Look()])
    assert seen == {"thread": "keras_ipu-callbacks", "outputs": (4, 3), "ipu_model": True}


def test_steps_on_one_batch_run_in_the_models_scope_outside_it(strategy):
    # As fit, evaluate and predict (upstream runs them in the model's strategy scope);
    # they raised "PipelineStage may only be used from within an IPUStrategy context".
    x, y = data_for("sequential", samples=8)
    model = _staged_model(strategy, x)
    with strategy.scope():
        expected_outputs = model(x)
    assert np.asarray(model.predict_on_batch(x)).shape == (8, 3)
    np.testing.assert_allclose(model.predict_on_batch(x), expected_outputs, atol=1e-6)
    expected_loss = float(np.mean((np.asarray(expected_outputs) - y) ** 2))
    assert model.test_on_batch(x, y) == pytest.approx(expected_loss, rel=1e-5)
    assert model.train_on_batch(x, y) == pytest.approx(expected_loss, rel=1e-5)


def test_a_run_thread_writes_back_only_what_its_function_set():
    # The caller set a seed while the infeed thread read a batch: the thread's write-back
    # put the caller's old seed back.
    from keras_ipu.keras.thread_state import CallersState

    keras.utils.set_random_seed(1)
    state = CallersState()
    reading, changed = threading.Event(), threading.Event()

    def read():
        reading.set()
        changed.wait(10)
        keras.config.set_dtype_policy("mixed_bfloat16")  # the function's own change

    worker = threading.Thread(target=state.run, args=(read,))
    worker.start()
    reading.wait(10)
    keras.utils.set_random_seed(123)  # the caller's, while the function runs
    changed.set()
    worker.join()
    try:
        from keras.src.backend.common import global_state

        assert global_state.get_global_attribute("global_random_seed") == 123
        assert keras.config.dtype_policy().name == "mixed_bfloat16"
    finally:
        keras.config.set_dtype_policy("float32")
