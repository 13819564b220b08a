"""`DeviceConnectionType`: PRE_COMPILE compiles and returns zeros; NEVER compiles, then refuses.

The seed: "PRE_COMPILE will never try to attach to a device and anything
which is meant to be executed on the device will return all zeros"; "NEVER
will never try to attach to a device".
"""

from __future__ import annotations

import jax.numpy as jnp
import keras
import numpy as np
import pytest

import keras_ipu as ipu
from keras_ipu.config import DeviceConnectionType
from keras_ipu.errors import IPUNotAttachedError

from conftest import assert_weights_close


def _configure(connection: str, num_ipus: int = 1) -> None:
    config = ipu.config.IPUConfig()
    config.auto_select_ipus = num_ipus
    config.device_connection.type = DeviceConnectionType[connection]
    if connection in ("PRE_COMPILE", "NEVER"):  # the hardware to compile for
        config.device_connection.version = "ipu2"
    config.configure_ipu_system()


def _model(layout: str = "single", asynchronous: bool = False) -> keras.Model:
    keras.utils.set_random_seed(5)
    with ipu.ipu_strategy.IPUStrategy().scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                                  keras.layers.Dense(3)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"],
                      steps_per_execution=4)
    if layout == "pipelined":
        model.set_pipeline_stage_assignment([0, 1])
        model.set_pipelining_options(gradient_accumulation_steps_per_replica=4)
    model.set_asynchronous_callbacks(asynchronous)
    return model


def _data():
    rng = np.random.default_rng(1)
    return rng.random((32, 6), np.float32), rng.random((32, 3), np.float32)


def _fit_logged(model, x, y) -> tuple[dict, list]:
    """Two epochs of `fit`; returns the history and the logs each batch hook got."""
    batch_logs: list = []
    hook = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: batch_logs.append(dict(logs)))
    history = model.fit(x, y, batch_size=2, epochs=2, shuffle=False, verbose=0,
                        callbacks=[hook])
    return history.history, batch_logs


def _report(model, mode):
    report = ipu.utils.execution_report(model, mode)
    return [(r.memory_bytes, r.estimated_cycles) for r in report.ipus], report.flops_per_step


@pytest.mark.parametrize(
    "layout, num_ipus, asynchronous",
    [("single", 1, False), ("replicated", 2, False), ("pipelined", 2, True)],
    ids=["single", "2-replicas", "pipelined-async"],
)
def test_pre_compile_compiles_every_program_and_returns_zeros(layout, num_ipus, asynchronous):
    x, y = _data()
    _configure("ALWAYS", num_ipus)
    attached = _model(layout, asynchronous)
    initial = attached.get_weights()
    attached.fit(x, y, batch_size=2, epochs=1, shuffle=False, verbose=0)
    attached.predict(x, batch_size=2, verbose=0)
    trained = attached.get_weights()

    _configure("PRE_COMPILE", num_ipus)
    model = _model(layout, asynchronous)
    history, batch_logs = _fit_logged(model, x, y)
    # Nothing ran: the weights and the optimizer are as they were, every log is zero.
    assert_weights_close(initial, model.get_weights(), atol=0)
    assert not any(np.allclose(a, b) for a, b in zip(trained, model.get_weights()))
    assert int(model.optimizer.iterations) == 0
    assert history == {"loss": [0.0, 0.0], "mae": [0.0, 0.0]}
    assert batch_logs and all(logs == {"loss": 0.0, "mae": 0.0} for logs in batch_logs)
    assert model.evaluate(x, y, batch_size=2, verbose=0) == [0.0, 0.0]
    predictions = model.predict(x, batch_size=2, verbose=0)
    assert predictions.shape == (32, 3) and predictions.dtype == np.float32
    assert not predictions.any()
    # The programs were compiled and measured as for a run.
    for mode in ("fit", "predict"):
        assert _report(model, mode) == _report(attached, mode)


def test_never_compiles_then_refuses_to_run_and_loses_nothing():
    x, y = _data()
    _configure("NEVER")
    model = _model()
    initial = model.get_weights()
    for run in (lambda: model.fit(x, y, batch_size=2, verbose=0),
                lambda: model.evaluate(x, y, batch_size=2, verbose=0),
                lambda: model.predict(x, batch_size=2, verbose=0)):
        with pytest.raises(IPUNotAttachedError, match="DeviceConnectionType.NEVER"):
            run()
    assert ipu.utils.execution_report(model, "fit").ipus[0].memory_bytes > 0
    assert_weights_close(initial, model.get_weights(), atol=0)

    # The same model trains once the system attaches, as a fresh one does.
    _configure("ALWAYS")
    model.fit(x, y, batch_size=2, shuffle=False, verbose=0)
    fresh = _model()
    fresh.fit(x, y, batch_size=2, shuffle=False, verbose=0)
    assert_weights_close(fresh.get_weights(), model.get_weights(), atol=0)


def test_the_on_batch_methods_compile_and_give_zeros_on_a_pre_compile_system():
    # Keras' own methods run Keras' step on one batch: a program like fit's executions.
    x, y = _data()
    _configure("PRE_COMPILE")
    model = _model()
    initial = model.get_weights()
    assert model.train_on_batch(x, y) == [0.0, 0.0]
    assert model.train_on_batch(x, y, return_dict=True) == {"loss": 0.0, "mae": 0.0}
    assert model.test_on_batch(x, y) == [0.0, 0.0]
    predictions = model.predict_on_batch(x)
    assert predictions.shape == (32, 3) and predictions.dtype == np.float32
    assert not predictions.any()
    assert_weights_close(initial, model.get_weights(), atol=0)
    assert int(model.optimizer.iterations) == 0


def test_the_on_batch_methods_refuse_to_run_on_a_system_that_never_attaches():
    x, y = _data()
    _configure("NEVER")
    model = _model()
    initial = model.get_weights()
    for run, name in ((lambda: model.train_on_batch(x, y), "train_on_batch"),
                      (lambda: model.test_on_batch(x, y), "test_on_batch"),
                      (lambda: model.predict_on_batch(x), "predict_on_batch")):
        with pytest.raises(IPUNotAttachedError, match=f"The {name} program was compiled"):
            run()
    assert_weights_close(initial, model.get_weights(), atol=0)

    # Once the system attaches, the same model trains on a batch as plain Keras does.
    _configure("ALWAYS")
    keras.utils.set_random_seed(5)
    plain = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(3)])
    plain.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"])
    assert_weights_close(plain.get_weights(), initial, atol=0)
    for _ in range(2):
        np.testing.assert_allclose(model.train_on_batch(x, y), plain.train_on_batch(x, y),
                                   rtol=1e-6)
    assert_weights_close(plain.get_weights(), model.get_weights())
    np.testing.assert_allclose(model.predict_on_batch(x), plain.predict_on_batch(x), atol=1e-6)


def _loop_program(infeed, outfeed, variable):
    """`ipu_compiler.compile`'s seed form: a loop over an infeed, enqueuing, assigning."""
    def body(total, x):
        total = total + jnp.sum(x)
        return total, outfeed.enqueue(total)

    def net():
        variable.assign_add(np.ones(3, np.float32))
        return ipu.loops.repeat(4, body, [0.0], infeed)

    with ipu.scopes.ipu_scope("/device:IPU:0"):
        return ipu.ipu_compiler.compile(net)


@pytest.mark.parametrize("num_ipus", [1, 2], ids=["1-IPU", "2-replicas"])
def test_strategy_run_and_compile_give_zeros_and_change_nothing_on_a_pre_compile_system(
        num_ipus):
    # "anything which is meant to be executed on the device will return all zeros".
    _configure("PRE_COMPILE", num_ipus)
    strategy = ipu.ipu_strategy.IPUStrategy()
    with strategy.scope():
        result = strategy.run(lambda a: a @ a + 1, args=(np.ones((4, 4), np.float32),))
        variable = keras.Variable(np.ones(3, np.float32))
    assert result.shape == (4, 4) and result.dtype == np.float32 and not np.asarray(result).any()
    infeed = ipu.ipu_infeed_queue.IPUInfeedQueue(np.ones((4 * num_ipus, 2), np.float32))
    outfeed = ipu.ipu_outfeed_queue.IPUOutfeedQueue()
    [total] = _loop_program(infeed, outfeed, variable)
    assert float(np.asarray(total)) == 0.0
    # The outfeed gets zeros of what the device would have enqueued; nothing is assigned.
    enqueued = np.asarray(outfeed.dequeue())
    assert enqueued.shape == ((4,) if num_ipus == 1 else (4, num_ipus))
    assert not enqueued.any()
    np.testing.assert_array_equal(variable.numpy(), np.ones(3))
    # Nothing ran, so nothing was taken: the infeed still holds its elements.
    _loop_program(infeed, outfeed, variable)


def test_strategy_run_and_compile_refuse_to_run_on_a_system_that_never_attaches():
    _configure("NEVER")
    strategy = ipu.ipu_strategy.IPUStrategy()
    with strategy.scope():
        with pytest.raises(IPUNotAttachedError, match="The strategy.run program was compiled"):
            strategy.run(lambda a: a * 2, args=(np.ones(3, np.float32),))
        variable = keras.Variable(np.ones(3, np.float32))
    infeed = ipu.ipu_infeed_queue.IPUInfeedQueue(np.arange(8, dtype=np.float32).reshape(4, 2))
    outfeed = ipu.ipu_outfeed_queue.IPUOutfeedQueue()
    with pytest.raises(IPUNotAttachedError, match="The ipu_compiler.compile program"):
        _loop_program(infeed, outfeed, variable)
    np.testing.assert_array_equal(variable.numpy(), np.ones(3))
    assert outfeed.dequeue() == []

    # Nothing was taken from the infeed: the program runs over all of it once attached.
    _configure("ALWAYS")
    [total] = _loop_program(infeed, outfeed, variable)
    np.testing.assert_allclose(total, 28.0)
    np.testing.assert_array_equal(variable.numpy(), np.full(3, 2.0))
