"""The on-device loop compiled on a host thread while the first executions run the step alone."""

from __future__ import annotations

import threading

import keras
import numpy as np
import pytest

import keras_ipu as ipu
from keras_ipu.device import background, compiler

from conftest import assert_weights_close, configure


def _model(strategy) -> keras.Model:
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                                  keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"],
                  steps_per_execution=4)
    return model


def _data():
    rng = np.random.default_rng(1)
    return rng.normal(size=(64, 6)).astype("float32"), rng.normal(size=(64, 3)).astype("float32")


def _flag(monkeypatch, value: str = "true", **ipu_model) -> None:
    """Configures one IPU with `--background_loop_compile=value` (`ipu_model` attributes)."""
    monkeypatch.setenv("KERAS_IPU_FLAGS", f"--background_loop_compile={value}".rstrip("="))
    configure(1, **ipu_model)


def _watch_compilations(monkeypatch, before=lambda count: None) -> list:
    """keras_ipu's compilations, listed; `before(count)` runs ahead of each (it may wait
    or raise)."""
    compiled, real = [], compiler.compile_lowered

    def compile_lowered(lowered, options):
        compiled.append(lowered)
        before(len(compiled))
        return real(lowered, options)

    monkeypatch.setattr(compiler, "compile_lowered", compile_lowered)
    return compiled


@pytest.fixture
def gated_loop(monkeypatch):
    """keras_ipu's compilations, the second of each program (its loop) held until `open`."""
    gate = threading.Event()

    def hold_loops(count):
        if count % 2 == 0:
            assert gate.wait(timeout=120)

    compiled = _watch_compilations(monkeypatch, hold_loops)
    yield gate, compiled
    gate.set()
    background.wait_for_compilations()


def _run(strategy, monkeypatch, flag: str, gate: threading.Event | None = None):
    _flag(monkeypatch, flag)
    model = _model(strategy)
    x, y = _data()
    first = model.fit(x, y, batch_size=4, shuffle=False, verbose=0).history
    reports = [ipu.utils.execution_report(model)]
    if gate is not None:
        gate.set()
    background.wait_for_compilations()
    second = model.fit(x, y, batch_size=4, shuffle=False, verbose=0).history
    reports.append(ipu.utils.execution_report(model))
    outputs = model.predict(x, batch_size=4, verbose=0)
    background.wait_for_compilations()
    evaluated = model.evaluate(x, y, batch_size=4, verbose=0)
    return model.get_weights(), (first, second), outputs, evaluated, reports


def test_the_first_executions_run_the_step_until_the_loop_has_compiled(
        strategy, monkeypatch, gated_loop):
    gate, compiled = gated_loop
    weights, histories, outputs, evaluated, reports = _run(strategy, monkeypatch, "true", gate)
    # The whole first fit ran the step alone (its loop was held back), the second the loop.
    assert [report.loop for report in reports] == ["host", "scan"]
    assert "compiles on a host thread" in reports[0].loop_reason
    assert reports[0].steps_per_execution == reports[1].steps_per_execution == 4
    assert reports[0].flops_per_step == pytest.approx(reports[1].flops_per_step, rel=0.05)
    assert len(compiled) == 6  # fit, predict, evaluate: a step and a loop each
    # The same numbers as the loop from the start.
    expected = _run(strategy, monkeypatch, "false")
    assert [report.loop for report in expected[4]] == ["scan", "scan"]
    assert_weights_close(expected[0], weights, atol=1e-6, rtol=1e-5)
    for got, want in zip(histories, expected[1]):
        for name, values in want.items():
            np.testing.assert_allclose(got[name], values, rtol=1e-5, err_msg=name)
    np.testing.assert_allclose(outputs, expected[2], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(evaluated, expected[3], rtol=1e-5)


def test_a_failed_loop_compilation_raises_at_the_next_execution_and_loses_nothing(
        strategy, monkeypatch):
    gate = threading.Event()

    def fail_the_loop(count):
        if count == 2:  # the fit's loop, once the first fit has run
            assert gate.wait(timeout=120)
            raise RuntimeError("XLA could not compile the loop")

    _watch_compilations(monkeypatch, fail_the_loop)
    _flag(monkeypatch)
    model = _model(strategy)
    x, y = _data()
    model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    gate.set()
    background.wait_for_compilations()
    trained = model.get_weights()
    with pytest.raises(RuntimeError, match="could not compile the loop"):
        model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    assert_weights_close(trained, model.get_weights(), atol=0)
    np.testing.assert_allclose(model.predict(x[:16], batch_size=4, verbose=0),
                               keras.ops.convert_to_numpy(model(x[:16])), rtol=1e-5, atol=1e-6)
    background.wait_for_compilations()
    # A failed compilation is not kept: the next fit compiles anew, and its loop takes over.
    model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    background.wait_for_compilations()
    model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    assert ipu.utils.execution_report(model).loop == "scan"


def test_one_step_executions_and_cpus_compile_no_loop_in_the_background(
        strategy, monkeypatch):
    compiled = _watch_compilations(monkeypatch)
    model = _model(strategy)  # auto: not on CPU devices
    x, y = _data()
    model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    assert ipu.utils.execution_report(model).loop == "scan" and len(compiled) == 1
    _flag(monkeypatch, "")  # bare: true
    model = _model(strategy)
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=1)
    model.fit(x, y, batch_size=4, shuffle=False, verbose=0)  # one step: nothing to loop
    assert len(compiled) == 2


def test_the_flag_decides_per_platform(monkeypatch):
    assert (background.enabled("gpu"), background.enabled("cpu")) == (True, False)
    for value, expected in (("false", False), ("true", True), ("auto", False)):
        _flag(monkeypatch, value)
        assert background.enabled("cpu") is expected
        assert background.enabled("gpu") is (value != "false")
    monkeypatch.setenv("KERAS_IPU_FLAGS", "--background_loop_compile=later")
    with pytest.raises(ValueError, match="--background_loop_compile=later.*auto, true or false"):
        configure(1)


def test_a_compilation_thread_hands_over_its_result_or_error_and_is_waited_for_at_exit():
    release = threading.Event()
    compilation = background.Compilation(lambda value: release.wait(30) and value, 7)
    thread = next(t for t in threading.enumerate() if t.name == background.THREAD_NAME)
    assert not thread.daemon and not compilation.done()
    release.set()
    assert compilation.result() == 7 and compilation.done()

    def fails():
        raise ValueError("no such program")

    with pytest.raises(ValueError, match="no such program"):
        background.Compilation(fails).result()
    background.wait_for_compilations()
    assert not any(t.name == background.THREAD_NAME for t in threading.enumerate())


def test_programs_across_processes_compile_their_loop_first(strategy, monkeypatch):
    # Every process must run the same program at each execution: their
    # collectives pair up. A handover at each process's own time would break that.
    from types import SimpleNamespace

    from keras_ipu.keras import run

    _flag(monkeypatch)
    model = _model(strategy)
    x, y = _data()
    model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    background.wait_for_compilations()
    program = run.program_for(model, "fit")
    batches = np.zeros((4, 4, 6), "float32")
    assert program._compiles_loop_in_background(batches)
    monkeypatch.setattr(program, "replicas", SimpleNamespace(spans_processes=True))
    assert not program._compiles_loop_in_background(batches)


def _too_big_a_loop(strategy):
    """A model whose one-step program fits a 3-tile IPU and whose 64-step loop does not."""
    with strategy.scope():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(4096)])
    model.compile(steps_per_execution=64)
    return model, np.ones((64 * 32, 64), "float32")


def test_a_loop_that_might_not_fit_is_checked_before_anything_runs(strategy, monkeypatch):
    _flag(monkeypatch, tiles_per_ipu=3)
    model, x = _too_big_a_loop(strategy)
    with pytest.raises(ipu.errors.IPUOutOfMemoryError, match="predict program needs 2,1"):
        model.predict(x, batch_size=32, verbose=0)
    background.wait_for_compilations()
    # The step alone would have fitted: its one-step program is well under the capacity.
    model.compile(steps_per_execution=1)
    model.predict(x[:32], batch_size=32, verbose=0)
    report = ipu.utils.execution_report(model, "predict")
    assert report.ipus[0].memory_bytes < report.ipus[0].memory_capacity_bytes


def test_systems_that_never_run_compile_check_and_report_the_loop(strategy, monkeypatch):
    monkeypatch.setenv("KERAS_IPU_FLAGS", "--background_loop_compile=true")
    config = ipu.config.IPUConfig()
    config.auto_select_ipus = 1
    config.device_connection.type = ipu.config.DeviceConnectionType.PRE_COMPILE
    config.device_connection.version = "ipu2"
    config.configure_ipu_system()
    model = _model(strategy)
    x, y = _data()
    model.fit(x, y, batch_size=4, verbose=0)
    assert ipu.utils.execution_report(model).loop == "scan"
    assert not background.enabled("gpu")


@pytest.mark.parametrize("last_outputs_only", [False, True])
def test_a_program_that_returns_every_steps_outputs_compiles_its_loop_first(
        monkeypatch, last_outputs_only):
    # The step form returns only the last step's outputs.
    import jax.numpy as jnp

    from keras_ipu.device import program, system
    from keras_ipu.device.replicate import Replicas

    _flag(monkeypatch)
    configured = system.current()

    def step(w, x):
        return jnp.mean((x @ w) ** 2), w * 0.9

    run = program.ExecutionProgram(step, mode="fit", replicas=Replicas(configured.ipus[:1]),
                                   hardware=configured.hardware,
                                   last_outputs_only=last_outputs_only)
    _, losses = run(jnp.eye(3), jnp.ones((5, 4, 3)))
    assert losses.shape == ((1,) if last_outputs_only else (5,))
    assert run.report.loop == ("host" if last_outputs_only else "scan")
    background.wait_for_compilations()
