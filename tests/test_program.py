"""Device programs: one compiled on-device loop per execution, bounded in flight."""

from __future__ import annotations

import collections
import re

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

from keras_ipu.device import hardware, program, system
from keras_ipu.device.replicate import Replicas
from keras_ipu.keras import run

from models import data_for, twin


def _sgd_step(w, x):
    loss = jnp.mean((x @ w) ** 2)
    return loss, w - 0.1 * jax.grad(lambda w: jnp.mean((x @ w) ** 2))(w)


def _program(max_in_flight=2):
    configured = system.current()
    return program.ExecutionProgram(
        _sgd_step, mode="fit", replicas=Replicas(configured.ipus[:1]),
        hardware=configured.hardware, max_in_flight=max_in_flight,
    )


def test_an_execution_runs_all_its_steps_in_one_call():
    run = _program()
    w = jnp.eye(3)
    xs = jnp.asarray(np.random.default_rng(0).normal(size=(5, 4, 3)), jnp.float32)
    w_device, losses = run(w, xs)
    expected_w, expected_losses = jnp.eye(3), []
    for x in xs:
        loss, expected_w = _sgd_step(expected_w, x)
        expected_losses.append(loss)
    np.testing.assert_allclose(w_device, expected_w, rtol=1e-6)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-6)  # the outfeed: every step
    assert run.report.steps_per_execution == 5


def test_a_loop_that_keeps_only_its_last_outputs_equals_the_stacked_loop():
    configured = system.current()
    kept = program.ExecutionProgram(
        _sgd_step, mode="fit", replicas=Replicas(configured.ipus[:1]),
        hardware=configured.hardware, last_outputs_only=True,
    )
    xs = jnp.asarray(np.random.default_rng(1).normal(size=(6, 4, 3)), jnp.float32)
    w_kept, last = kept(jnp.eye(3), xs)
    w_stacked, losses = _program()(jnp.eye(3), xs)
    assert last.shape == (1,)  # no buffer of every step's outputs
    np.testing.assert_array_equal(w_kept, w_stacked)
    np.testing.assert_array_equal(last, losses[-1:])


def test_executions_in_flight_are_bounded():
    run = _program(max_in_flight=2)
    w, xs = jnp.eye(3), jnp.ones((2, 4, 3))
    for _ in range(10):
        w, _ = run(w, xs)
        assert len(run._in_flight) <= 2
    run.wait()
    assert not run._in_flight


def test_programs_run_on_their_ipus_device():
    configured = system.configure((2,), hardware.hardware_for("ipu2"))
    second = configured.ipus[1]
    run = program.ExecutionProgram(
        _sgd_step, mode="fit", replicas=Replicas((second,)), hardware=configured.hardware
    )
    w = jax.device_put(jnp.eye(3), second.device)
    w, losses = run(w, jax.device_put(jnp.ones((2, 4, 3)), second.device))
    assert w.devices() == {second.device} and losses.devices() == {second.device}
    assert run.report.ipus[0].index == 1


def test_fit_compiles_once_and_calls_the_device_once_per_execution(strategy, monkeypatch):
    _, model = twin("sequential", strategy, steps_per_execution=4)
    x, y = data_for("sequential", samples=64)  # 8 batches: 2 executions per epoch
    calls = []
    original = program.ExecutionProgram.__call__

    def counting_call(self, state, batches):
        calls.append(jax.tree_util.tree_leaves(batches)[0].shape[0])
        return original(self, state, batches)

    monkeypatch.setattr(program.ExecutionProgram, "__call__", counting_call)
    model.fit(x, y, batch_size=8, epochs=3, verbose=0)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert calls == [4] * 8
    assert len(run.program_for(model, "fit")._executables) == 1


def test_one_replicas_state_keeps_arrays_on_its_device_and_moves_the_rest():
    configured = system.configure((2,), hardware.hardware_for("ipu2"))
    device = configured.ipus[0].device
    replicas = Replicas(configured.ipus[:1])
    placed = jax.device_put(jnp.ones(3), device)  # committed there: passed through
    uncommitted = jnp.zeros(2)  # on the default device, which is the IPU's: passed too
    elsewhere = jax.device_put(jnp.ones(1), configured.ipus[1].device)
    state = replicas.replicate({"a": placed, "b": uncommitted, "c": elsewhere, "d": np.ones(4)})
    assert state["a"] is placed and state["b"] is uncommitted
    for name in "cd":
        assert state[name].committed and state[name].devices() == {device}
    np.testing.assert_array_equal(state["d"], np.ones(4))


def _operations(text: str) -> collections.Counter:
    return collections.Counter(re.findall(r"stablehlo\.[a-z_]+", text))


def test_a_one_step_program_is_plain_kerases_step_for_xla(strategy, monkeypatch):
    # What XLA compiles for one step is what plain Keras gives it, and no more: no loop of
    # one, no gradient combined with zeros (ResNet50's first fit on a GPU, BENCHMARKS.md).
    from keras_ipu.device import compiler

    plain, model = twin("sequential", strategy, steps_per_execution=1)
    x, y = data_for("sequential", samples=8)
    plain.fit(x, y, batch_size=8, epochs=1, verbose=0)
    state = tuple([v.value for v in variables] for variables in (
        plain.trainable_variables, plain.non_trainable_variables,
        plain.optimizer.variables, plain.metrics_variables))
    expected = _operations(jax.jit(plain.train_step).lower(state, (x, y)).as_text())
    lowered = []
    compile_lowered = compiler.compile_lowered
    monkeypatch.setattr(compiler, "compile_lowered",
                        lambda low, options: lowered.append(low) or compile_lowered(low, options))
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    (program_text,) = [low.as_text() for low in lowered]
    operations = _operations(program_text)
    assert operations["stablehlo.while"] == 0
    for name in ("add", "multiply", "divide", "dot_general"):
        name = f"stablehlo.{name}"
        assert operations[name] == expected[name], name


class _ConstantInLogs(keras.Model):
    """A `compute_metrics` whose logs hold a Python number."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(2)

    def call(self, inputs):
        return self.dense(inputs)

    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        return {**super().compute_metrics(x, y, y_pred, sample_weight), "constant": 3.0}


def test_a_one_step_program_returns_a_python_number_in_its_logs(strategy):
    # Without a loop of one, nothing made the step's Python numbers arrays: evaluate raised.
    x = np.random.default_rng(0).normal(size=(16, 3)).astype("float32")
    y = np.random.default_rng(1).normal(size=(16, 2)).astype("float32")
    plain = _ConstantInLogs()
    with strategy.scope():
        model = _ConstantInLogs()
    for each in (plain, model):
        each.compile(optimizer="sgd", loss="mse")
        each(x[:1])  # built
    model.set_weights(plain.get_weights())
    expected = plain.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
    logs = model.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
    assert logs["constant"] == expected["constant"] == 3.0
    np.testing.assert_allclose(logs["loss"], expected["loss"], rtol=1e-6)


def test_a_one_step_program_refuses_a_state_of_other_types_as_a_loop_does():
    def halving(w, x):  # gives its state back in float16
        return jnp.sum(x), (w * 0.5).astype(jnp.float16)

    configured = system.current()
    w = jnp.ones(3)
    for steps in (1, 2):
        run = program.ExecutionProgram(halving, mode="fit", replicas=Replicas(
            configured.ipus[:1]), hardware=configured.hardware)
        with pytest.raises(TypeError, match=r"float16|float32"):
            run(w, jnp.ones((steps, 4, 3)))
    with pytest.raises(TypeError, match=r"returns its state as float16\[3\], and takes it as "
                                        r"float32\[3\]"):
        program.ExecutionProgram(halving, mode="fit", replicas=Replicas(configured.ipus[:1]),
                                 hardware=configured.hardware)(w, jnp.ones((1, 4, 3)))
