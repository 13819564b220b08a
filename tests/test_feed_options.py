"""Infeed and outfeed queue options: checked, saved, and acting on the data path."""

from __future__ import annotations

import threading
import time

import jax.numpy as jnp
import keras
import numpy as np
import pytest

from keras_ipu.keras import options

from conftest import assert_weights_close
from models import data_for, twin


def _model(strategy):
    with strategy.scope():
        return keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])


@pytest.mark.parametrize(
    "setter, key, message",
    [
        ("set_infeed_queue_options", "dataset", "automatically set by Keras"),
        ("set_infeed_queue_options", "infeed_spec", "automatically set by Keras"),
        ("set_infeed_queue_options", "element_spec", "automatically set by Keras"),
        ("set_outfeed_queue_options", "outfeed_mode", "not compatible with Keras"),
        ("set_outfeed_queue_options", "device_ordinal", "not compatible with Keras"),
        ("set_infeed_queue_options", "prefetch_dept", "Did you mean `prefetch_depth`"),
        ("set_outfeed_queue_options", "bufer_depth", "Did you mean `buffer_depth`"),
    ],
)
def test_refused_and_unknown_keys_raise(setter, key, message, strategy):
    model = _model(strategy)
    with pytest.raises(ValueError, match=message):
        getattr(model, setter)(**{key: 1})
    assert options.options_of(model).infeed_kwargs == {}
    assert options.options_of(model).outfeed_kwargs == {}


@pytest.mark.parametrize("setter, key, value, kind", [
    ("set_infeed_queue_options", "device_ordinal", jnp.int32(0), "an integer"),
    ("set_infeed_queue_options", "feed_name", b"x", "a string"),
    ("set_infeed_queue_options", "optimise_latency", "no", "a bool"),
    ("set_outfeed_queue_options", "io_batch_size", True, "an integer"),
])
def test_keys_without_effect_take_the_references_types(setter, key, value, kind, strategy):
    # They are saved with the model: a value JSON cannot hold failed the save at the end
    # of a fit (ModelCheckpoint), naming no option.
    model = _model(strategy)
    with pytest.raises(ValueError, match=f"`{key}` must be {kind} or None"):
        getattr(model, setter)(**{key: value})
    assert options.options_of(model).infeed_kwargs == {}
    assert options.options_of(model).outfeed_kwargs == {}
    model.set_infeed_queue_options(device_ordinal=np.int64(0), feed_name=None)
    assert options.options_of(model).infeed_kwargs == {"device_ordinal": 0, "feed_name": None}


@pytest.mark.parametrize("value", [0, -1, 256, 1.5, True, "2"])
def test_depths_must_be_small_positive_integers(value, strategy):
    model = _model(strategy)
    with pytest.raises(ValueError, match="integer from 1 to 255"):
        model.set_infeed_queue_options(prefetch_depth=value)
    with pytest.raises(ValueError, match="integer from 1 to 255"):
        model.set_outfeed_queue_options(buffer_depth=value)


def test_options_are_saved_and_the_accepted_ones_kept(strategy, tmp_path):
    model = _model(strategy)
    model.set_infeed_queue_options(prefetch_depth=3, feed_name="ignored")
    model.set_outfeed_queue_options(buffer_depth=2, io_batch_size=1, optimise_latency=True)
    with strategy.scope():
        model.save(tmp_path / "m.keras")
        loaded = keras.models.load_model(tmp_path / "m.keras")
    restored = options.options_of(loaded)
    assert restored.infeed_kwargs == {"prefetch_depth": 3, "feed_name": "ignored"}
    # `optimise_latency`, as the queues take it: accepted, no effect (it was refused).
    assert restored.outfeed_kwargs == {"buffer_depth": 2, "io_batch_size": 1,
                                       "optimise_latency": True}


@pytest.mark.parametrize("asynchronous", [False, True])
def test_depths_do_not_change_the_numbers(asynchronous, strategy):
    x, y = data_for("sequential", samples=256)
    weights = []
    for depth in (1, 3):
        _, model = twin("sequential", strategy, steps_per_execution=8)
        model.set_asynchronous_callbacks(asynchronous)
        model.set_infeed_queue_options(prefetch_depth=depth)
        model.set_outfeed_queue_options(buffer_depth=depth)
        model.fit(_Batches(x, y, 0.0), epochs=2, verbose=0,
                  callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: 0)])
        weights.append(model.get_weights())
    assert_weights_close(weights[0], weights[1], atol=0)


class _Batches(keras.utils.PyDataset):
    """Batches of `batch` rows; each takes `delay` seconds to make (a slow input pipeline)."""

    def __init__(self, x, y, delay, batch=8):
        super().__init__()
        self.x, self.y, self.delay, self.batch = x, y, delay, batch
        self.threads: list[str] = []  # the thread that made each batch, in order

    def __len__(self):
        return len(self.x) // self.batch

    def __getitem__(self, index):
        self.threads.append(threading.current_thread().name)
        time.sleep(self.delay)
        rows = slice(index * self.batch, (index + 1) * self.batch)
        return self.x[rows], self.y[rows]


def test_a_slow_input_pipeline_runs_ahead_of_the_device(strategy):
    """The data pipeline runs on the infeed thread, `prefetch_depth` executions ahead.

    Checked by what was made when, not by timing (this machine is shared): each
    execution's end (its logs waited for) finds batches of later executions made.
    """
    batches, batch, spe = 16, 64, 4
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batches * batch, 16)).astype("float32")
    y = rng.normal(size=(batches * batch, 1)).astype("float32")
    with strategy.scope():
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=spe)
    model.set_infeed_queue_options(prefetch_depth=2)
    data = _Batches(x, y, 0.02, batch)
    made_at_end = []
    ended = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda step, logs: made_at_end.append(len(data.threads)))
    model.fit(data, epochs=1, verbose=0, callbacks=[ended])
    # The first batch is read up front (to build the model), then the last (to refuse a
    # partial batch before training), the rest on the thread.
    assert data.threads[:2] == ["MainThread"] * 2
    assert set(data.threads[2:]) == {"keras_ipu-infeed"}
    # After execution k (batches up to 4k + 4), the thread had made more.
    assert any(made > spe * (k + 1) for k, made in enumerate(made_at_end[:-1])), made_at_end
