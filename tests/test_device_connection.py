"""`DeviceConnectionType`: PRE_COMPILE compiles and returns zeros; NEVER compiles, then refuses.

The seed: "PRE_COMPILE will never try to attach to a device and anything
which is meant to be executed on the device will return all zeros"; "NEVER
will never try to attach to a device".
"""

from __future__ import annotations

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
