"""Array data kept on the device for a run: the same batches, in the same order, as the host feed.

On CPU devices keras_ipu never keeps data resident (the dispatch reads host
arrays directly); these tests force it with `resident.fits_on`, as an
accelerator with room for the data would decide.
"""

from __future__ import annotations

import types

import keras
import numpy as np
import pytest

import keras_ipu as ipu
from keras_ipu.keras import resident

from conftest import assert_history_close, assert_weights_close


def _model(strategy, ga=None):
    keras.utils.set_random_seed(3)
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)])
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"],
                      steps_per_execution=4)
        if ga:
            model.set_gradient_accumulation_options(gradient_accumulation_steps_per_replica=ga)
    return model


def _data():
    rng = np.random.default_rng(0)
    return rng.random((96, 6), np.float32), rng.random((96, 3), np.float32)


def _train(strategy, monkeypatch, keep_on_device, *, shuffle, ga=None, steps=None):
    """fit (3 epochs), evaluate and predict; returns the results and the passes cut."""
    cut = []
    if keep_on_device:
        monkeypatch.setattr(resident, "fits_on", lambda *_: True)
        new_pass = resident.ResidentPasses.new_pass
        monkeypatch.setattr(resident.ResidentPasses, "new_pass",
                            lambda self, order: (cut.append(order), new_pass(self, order))[1])
    x, y = _data()
    model = _model(strategy, ga)
    np.random.seed(7)  # the shuffle order comes from NumPy's global generator
    history = model.fit(x, y, batch_size=8, epochs=3, shuffle=shuffle, steps_per_epoch=steps,
                        verbose=0).history
    results = (model.get_weights(), history, model.evaluate(x, y, batch_size=8, verbose=0),
               model.predict(x, batch_size=8, verbose=0))
    monkeypatch.undo()
    return results, cut


@pytest.mark.parametrize(
    "shuffle, ga, steps",
    [(True, None, None), ("batch", 2, None), (True, None, 4), (False, None, None)],
    ids=["shuffled", "batch-shuffled-ga2", "epochs-within-a-pass", "in-order"],
)
def test_resident_data_trains_as_the_host_feed(strategy, monkeypatch, shuffle, ga, steps):
    expected, _ = _train(strategy, monkeypatch, False, shuffle=shuffle, ga=ga, steps=steps)
    actual, cut = _train(strategy, monkeypatch, True, shuffle=shuffle, ga=ga, steps=steps)
    # fit, evaluate and predict each cut their passes on the device.
    passes = 3 if steps is None else 1  # 12 batches: 3 epochs of 4 steps are one pass
    assert len(cut) == passes + 2
    assert (cut[0] is not None) == bool(shuffle)
    assert_weights_close(expected[0], actual[0], atol=0)
    assert_history_close(expected[1], actual[1], atol=0)
    np.testing.assert_array_equal(actual[2], expected[2])
    np.testing.assert_array_equal(actual[3], expected[3])


def _device(platform, limit=None, in_use=0):
    stats = None if limit is None else {"bytes_limit": limit, "bytes_in_use": in_use}
    return types.SimpleNamespace(platform=platform, memory_stats=lambda: stats)


def test_only_accelerators_with_room_keep_small_executions_resident():
    gib = 1 << 30
    assert resident.fits_on(_device("gpu", 80 * gib), 1 * gib, 16_384)
    # CPU devices read host arrays directly; a device without memory figures is not trusted.
    assert not resident.fits_on(_device("cpu", 80 * gib), 1 * gib, 16_384)
    assert not resident.fits_on(_device("gpu"), 1 * gib, 16_384)
    # Three copies must fit in a quarter of what is free.
    assert not resident.fits_on(_device("gpu", 80 * gib, in_use=70 * gib), 1 * gib, 16_384)
    # Large executions keep the threaded host infeed, which overlaps their copies.
    assert not resident.fits_on(_device("gpu", 80 * gib), 1 * gib,
                                resident.MAX_EXECUTION_BYTES + 1)


def test_replicated_programs_keep_the_host_feed(monkeypatch):
    from conftest import configure

    configure(2)
    cut = []
    monkeypatch.setattr(resident, "fits_on", lambda *_: True)
    monkeypatch.setattr(resident.ResidentPasses, "new_pass", lambda self, order: cut.append(1))
    x, y = _data()
    model = _model(ipu.ipu_strategy.IPUStrategy())
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)  # 24 batches: 3 executions of 2 x 4
    assert cut == []


def _as_program(batches):
    """A layout's regrouping that keeps an execution's batches as they are."""
    return batches


@pytest.mark.parametrize("executions", [3, 8, 13, 17])
@pytest.mark.parametrize("shuffled", [False, True], ids=["in-order", "shuffled"])
def test_a_pass_is_cut_into_the_host_feeds_executions(executions, shuffled):
    # Cuts of `EXECUTIONS_PER_CUT` executions, the last overlapping the one before.
    import jax

    steps, batch = 2, 4
    rows = executions * steps * batch
    rng = np.random.default_rng(executions)
    data = {"x": rng.random((rows + 5, 3), np.float32), "y": np.arange(rows + 5)}
    passes = resident.ResidentPasses(data, jax.devices()[0], (steps,), batch, executions,
                                     _as_program)
    order = rng.permutation(rows + 5) if shuffled else None
    passes.new_pass(order)
    taken = np.arange(rows) if order is None else order[:rows]
    for index in range(executions):
        expected = taken[index * steps * batch:(index + 1) * steps * batch]
        got = passes.execution(index)
        np.testing.assert_array_equal(got["x"], data["x"][expected].reshape(steps, batch, 3))
        np.testing.assert_array_equal(got["y"], data["y"][expected].reshape(steps, batch))
    with pytest.raises(IndexError):
        passes.execution(executions)
