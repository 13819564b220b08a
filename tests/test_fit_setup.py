"""A fit's setup: the first epoch's infeed opens before the callbacks when that is safe, and a
setup that fails closes what it opened."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from keras_ipu.keras import data, infeeds, programs

from conftest import assert_weights_close


class _Events(keras.callbacks.Callback):
    def __init__(self, events, fail=False):
        super().__init__()
        self.events, self.fail = events, fail

    def on_train_begin(self, logs=None):
        self.events.append("train_begin")
        if self.fail:
            raise RuntimeError("on_train_begin failed")

    def on_epoch_begin(self, epoch, logs=None):
        self.events.append("epoch_begin")


def _model(strategy):
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="relu"),
                                  keras.layers.Dense(2)])
        model.compile(optimizer="adam", loss="mse", steps_per_execution=2)
    return model


def _fit(strategy, monkeypatch, *, shuffle, fail=False, ahead=True):
    """Two epochs with the infeed on its thread (as on an accelerator); returns what happened."""
    events, opened = [], []
    open_infeed = infeeds.open_infeed

    def recording(*args, **kwargs):
        opened.append(open_infeed(*args, **kwargs))
        events.append("infeed")
        return opened[-1]

    monkeypatch.setattr(infeeds, "open_infeed", recording)
    monkeypatch.setattr(data.ArrayFeed, "prefetch_in_thread", True)
    if not ahead:
        monkeypatch.setattr(infeeds, "open_ahead", lambda *_: None)
    model = _model(strategy)
    rng = np.random.default_rng(0)
    x, y = rng.random((32, 5), np.float32), rng.random((32, 2), np.float32)
    np.random.seed(3)
    try:
        model.fit(x, y, batch_size=4, epochs=2, shuffle=shuffle, verbose=0,
                  callbacks=[_Events(events, fail)])
    except RuntimeError:
        pass
    monkeypatch.undo()
    return model, events, opened


def test_arrays_in_order_start_moving_before_the_callbacks_and_train_the_same(
        strategy, monkeypatch):
    model, events, _ = _fit(strategy, monkeypatch, shuffle=False)
    assert events == ["infeed", "train_begin", "epoch_begin", "epoch_begin", "infeed"]
    reference, events, _ = _fit(strategy, monkeypatch, shuffle=False, ahead=False)
    assert events == ["train_begin", "epoch_begin", "infeed", "epoch_begin", "infeed"]
    assert_weights_close(reference.get_weights(), model.get_weights(), atol=0)


@pytest.mark.parametrize("shuffle", [True, "batch"])
def test_shuffled_arrays_draw_their_order_after_the_callbacks(strategy, monkeypatch, shuffle):
    _, events, _ = _fit(strategy, monkeypatch, shuffle=shuffle)
    assert events == ["train_begin", "epoch_begin", "infeed", "epoch_begin", "infeed"]


def test_a_failing_on_train_begin_closes_the_infeed_and_changes_no_weight(
        strategy, monkeypatch):
    model, events, opened = _fit(strategy, monkeypatch, shuffle=False, fail=True)
    assert events == ["infeed", "train_begin"]
    assert len(opened) == 1 and opened[0]._stop.is_set() and not opened[0]._thread.is_alive()
    untrained = _model(strategy).get_weights()
    assert_weights_close(untrained, model.get_weights(), atol=0)
    model.fit(np.ones((8, 5), "float32"), np.ones((8, 2), "float32"), batch_size=4, verbose=0)


class _Batches(keras.utils.PyDataset):
    def __len__(self):
        return 4

    def __getitem__(self, index):
        return np.full((4, 5), index, "float32"), np.ones((4, 2), "float32")


@pytest.mark.parametrize("call", ["fit", "evaluate", "predict"])
def test_a_setup_that_fails_closes_the_feed_and_leaves_the_model_usable(
        strategy, monkeypatch, call):
    model = _model(strategy)
    before = model.get_weights()
    closed = []
    close = data.AdapterFeed.close
    monkeypatch.setattr(data.AdapterFeed, "close", lambda feed: (closed.append(feed),
                                                                   close(feed))[1])

    def failing(*args, **kwargs):
        raise RuntimeError("the program could not be prepared")

    monkeypatch.setattr(programs, "prepare", failing)
    with pytest.raises(RuntimeError, match="could not be prepared"):
        getattr(model, call)(_Batches(), verbose=0)
    assert len(closed) == 1
    monkeypatch.undo()
    assert_weights_close(before, model.get_weights(), atol=0)
    model.fit(_Batches(), verbose=0)
