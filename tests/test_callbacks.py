"""Callbacks during fit: which batch hooks run, and when (issue 9's defects)."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from conftest import assert_weights_close, configure
from models import data_for, twin


def _batch_ends(model, x, y):
    ends = []
    callback = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: ends.append(batch))
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[callback])
    return ends


def test_a_lambda_callback_alone_gets_the_batch_hooks_plain_keras_calls(strategy):
    plain, model = twin("sequential", strategy, steps_per_execution=4)
    x, y = data_for("sequential", samples=64)
    expected = _batch_ends(plain, x, y)
    assert expected == [3, 7]
    assert _batch_ends(model, x, y) == expected


def _shuffled_fit(model, x, y, seed: int, shuffle):
    keras.utils.set_random_seed(seed)
    return model.fit(x, y, batch_size=8, epochs=3, shuffle=shuffle, verbose=0).history["loss"]


def test_seeded_shuffled_fits_repeat_each_other(strategy):
    x, y = data_for("sequential", samples=64)
    runs = {}
    for shuffle in (True, "batch"):
        first, second = (twin("sequential", strategy, steps_per_execution=4)[1]
                         for _ in range(2))
        losses = [_shuffled_fit(m, x, y, 7, shuffle) for m in (first, second)]
        assert losses[0] == losses[1]
        assert_weights_close(first.get_weights(), second.get_weights(), atol=0)
        runs[shuffle] = losses[0]
    # Another seed, another order.
    third = twin("sequential", strategy, steps_per_execution=4)[1]
    assert _shuffled_fit(third, x, y, 8, True) != runs[True]


def _rows_seen(batches) -> list[int]:
    return [int(v) for batch in batches for v in np.asarray(batch).ravel()]


def test_the_shuffled_order_is_plain_kerases_for_the_same_seed():
    from keras.src.trainers.data_adapters.array_data_adapter import ArrayDataAdapter

    from keras_ipu.keras import data

    x = np.arange(64, dtype="float32")[:, None]
    for shuffle in (True, "batch"):
        expected = []
        keras.utils.set_random_seed(3)
        adapter = ArrayDataAdapter(x, x, batch_size=8, shuffle=shuffle)
        for _ in range(2):  # two epochs, one iterator each (as Keras' epoch iterator)
            expected += _rows_seen(batch[0] for batch in adapter.get_numpy_iterator())
        keras.utils.set_random_seed(3)
        feed = data.make_feed(x, x, batch_size=8, shuffle=shuffle, steps_per_execution=4,
                              epochs=2)
        actual = [row for _ in range(2)
                  for _, _, chunk in feed.executions() for row in _rows_seen(chunk[0])]
        assert actual == expected


def test_a_callbacks_strategy_run_may_read_the_model_inside_its_function(strategy):
    # On 2 IPUs the function is traced twice (its shards first): the model's sync inside
    # the first trace left the variables purged, and the fit failed at its next execution.
    configure(2)
    x, y = np.ones((32, 4), np.float32), np.zeros((32, 1), np.float32)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
    seen = []

    class Reads(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            ran = strategy.run(lambda a: self.model(a), args=(x[:1],))
            kernel, bias = self.model.get_weights()
            seen.append((np.asarray(ran), x[:1] @ kernel + bias))

    before = model.get_weights()
    model.fit(x, y, batch_size=4, verbose=0, callbacks=[Reads()])
    assert len(seen) == 4  # 2 replicas: 4 steps of 8 samples
    for ran, expected in seen:
        np.testing.assert_allclose(ran, expected, atol=1e-6)
    assert not np.allclose(before[0], model.get_weights()[0])  # and it trained on


def test_batch_logs_are_fetched_only_for_a_batch_hook(strategy, monkeypatch):
    # A fetch waits for the device at every execution: without a batch hook it halved the
    # steps per second of a small model at steps_per_execution=1 (BENCHMARKS.md).
    from keras_ipu.keras import trainer

    fetched = []
    fetch = trainer._batch_logs
    monkeypatch.setattr(trainer, "_batch_logs", lambda logs: fetched.append(1) or fetch(logs))
    model = twin("sequential", strategy, steps_per_execution=2)[1]
    x, y = data_for("sequential", samples=64)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[keras.callbacks.History()])
    assert fetched == []
    assert _batch_ends(model, x, y) == [1, 3, 5, 7]
    assert len(fetched) == 4


class _RunsAtBatch1(keras.callbacks.Callback):
    """At batch 1, runs `call(model, x, y)` on the model (another program of it)."""

    def __init__(self, call, x, y):
        super().__init__()
        self.call, self.x, self.y = call, x, y

    def on_train_batch_end(self, batch, logs=None):
        if batch == 1:
            self.call(self.model, self.x, self.y)


_NESTED_CALLS = {
    "read": lambda m, x, y: m.get_weights(),
    "predict": lambda m, x, y: m.predict(x[:16], batch_size=8, verbose=0),
    "evaluate": lambda m, x, y: m.evaluate(x[:16], y[:16] * 10, batch_size=8, verbose=0),
    "fit": lambda m, x, y: m.fit(x[:16], y[:16], batch_size=8, epochs=3, verbose=0,
                                 shuffle=False),
    "predict_on_batch": lambda m, x, y: m.predict_on_batch(x[:8]),
    "train_on_batch": lambda m, x, y: m.train_on_batch(x[:8], y[:8]),
}


@pytest.mark.parametrize("call", sorted(_NESTED_CALLS))
def test_a_batch_hook_that_runs_the_model_trains_on_as_plain_keras(call, strategy):
    # A hook that only reads lets the device's state go on; one that runs another of the
    # model's programs (which consumed and replaced that state) must not: the fit crashed
    # on donated buffers, or went on from stale weights.
    x, y = data_for("sequential", samples=64)
    plain, on_ipu = twin("sequential", strategy, steps_per_execution=1, optimizer="sgd")
    histories = [model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
                           callbacks=[_RunsAtBatch1(_NESTED_CALLS[call], x, y)]).history
                 for model in (plain, on_ipu)]
    np.testing.assert_allclose(histories[1]["loss"], histories[0]["loss"], rtol=1e-5)
    assert_weights_close(plain.get_weights(), on_ipu.get_weights(), atol=1e-6)
