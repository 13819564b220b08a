"""The loop form of an execution: chosen per program and platform, the same numbers either way."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

import keras_ipu as ipu
from keras_ipu.device import convolutions, loops

from conftest import assert_weights_close, configure

NHWC = ("NHWC", "HWIO", "NHWC")


def _conv_loss(kernel, x):
    return jnp.sum(jax.lax.conv_general_dilated(x, kernel, (1, 1), "SAME",
                                                dimension_numbers=NHWC) ** 2)


def _conv_grad_jaxpr():
    return jax.make_jaxpr(jax.grad(_conv_loss))(jnp.ones((3, 3, 2, 4)), jnp.ones((1, 6, 6, 2)))


def test_gradients_of_a_convolution_are_slow_in_loops_and_its_forward_is_not():
    forward = jax.make_jaxpr(_conv_loss)(jnp.ones((3, 3, 2, 4)), jnp.ones((1, 6, 6, 2)))
    assert loops.slow_in_loops(forward) == 0
    assert loops.slow_in_loops(_conv_grad_jaxpr()) >= 1
    # Found inside nested jaxprs too (a scan body).
    scanned = jax.make_jaxpr(
        lambda k, x: jax.lax.scan(lambda c, _: (c, jax.grad(_conv_loss)(k, x)), 0.0, None,
                                  length=2))(jnp.ones((3, 3, 2, 4)), jnp.ones((1, 6, 6, 2)))
    assert loops.slow_in_loops(scanned) == loops.slow_in_loops(_conv_grad_jaxpr())
    # keras_ipu's own convolutions stay canonical in every dtype it issues, bfloat16 too.
    with convolutions.canonical_convolutions():
        routed = jax.make_jaxpr(jax.grad(_conv_loss))(jnp.ones((3, 3, 2, 4), jnp.bfloat16),
                                                      jnp.ones((1, 6, 6, 2), jnp.bfloat16))
    assert loops.convolution_count(routed) >= 3 and loops.slow_in_loops(routed) == 0


def test_the_rule_keeps_the_device_loop_except_for_slow_convolutions_on_cpu():
    mlp = jax.make_jaxpr(jax.grad(lambda w, x: jnp.sum(jnp.tanh(x @ w))))(
        jnp.ones((4, 4)), jnp.ones((2, 4)))
    assert loops.choose_loop(mlp, "cpu").form == loops.SCAN
    assert loops.choose_loop(_conv_grad_jaxpr(), "gpu").form == loops.SCAN
    choice = loops.choose_loop(_conv_grad_jaxpr(), "cpu")
    assert choice.form == loops.HOST and "convolution" in choice.reason
    forced = loops.choose_loop(_conv_grad_jaxpr(), "cpu", "scan")
    assert forced == loops.LoopChoice("scan", "forced (--execution_loop=scan)")
    with pytest.raises(ValueError, match="Unknown execution loop 'unrolled'; valid: auto, scan"):
        loops.choose_loop(mlp, "cpu", "unrolled")


def test_a_bad_flag_names_the_valid_forms(monkeypatch):
    monkeypatch.setenv("KERAS_IPU_FLAGS", "--execution_loop=fast")
    with pytest.raises(ValueError, match="--execution_loop=fast.*auto, scan, host"):
        configure(1)


def _convnet(seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((8, 8, 2)),
        keras.layers.Conv2D(4, 3, activation="relu"),
        keras.layers.BatchNormalization(),
        keras.layers.DepthwiseConv2D(3, padding="same"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(3),
    ])


def _train(strategy, form: str, monkeypatch, accumulation: int = 1):
    monkeypatch.setenv("KERAS_IPU_FLAGS", f"--execution_loop={form}")
    configure(1)
    with strategy.scope():
        model = _convnet()
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", steps_per_execution=4)
    if accumulation > 1:
        model.set_gradient_accumulation_options(
            gradient_accumulation_steps_per_replica=accumulation,
            gradient_accumulation_reduction_method="mean")
    rng = np.random.default_rng(1)
    x = rng.normal(size=(64, 8, 8, 2)).astype("float32")
    y = rng.normal(size=(64, 3)).astype("float32")
    history = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    report = ipu.utils.execution_report(model, mode="fit")
    outputs = model.predict(x, batch_size=4, verbose=0)
    loss = model.evaluate(x, y, batch_size=4, verbose=0)
    return model.get_weights(), history.history["loss"], outputs, loss, report


@pytest.mark.parametrize("accumulation", [1, 2])
def test_every_loop_form_gives_the_same_model(strategy, monkeypatch, accumulation):
    runs = {form: _train(strategy, form, monkeypatch, accumulation)
            for form in ("scan", "host", "auto")}
    weights, losses, outputs, loss, _ = runs["scan"]
    for form in ("host", "auto"):
        other_weights, other_losses, other_outputs, other_loss, _ = runs[form]
        assert_weights_close(weights, other_weights, atol=1e-6, rtol=1e-5)
        np.testing.assert_allclose(other_losses, losses, rtol=1e-5)
        np.testing.assert_allclose(other_outputs, outputs, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(other_loss, loss, rtol=1e-5)
    # The report says which form ran, and why; its figures come from one step either way.
    scan_report, host_report = runs["scan"][4], runs["host"][4]
    assert (scan_report.loop, host_report.loop) == ("scan", "host")
    assert "forced" in host_report.loop_reason
    assert host_report.steps_per_execution == scan_report.steps_per_execution == 4
    assert host_report.flops_per_step == pytest.approx(scan_report.flops_per_step, rel=0.05)
    assert host_report.estimated_cycles == pytest.approx(scan_report.estimated_cycles, rel=0.05)
    assert runs["auto"][4].loop in ("scan", "host") and runs["auto"][4].loop_reason


def test_the_pipeline_rule_dispatches_convolutional_stages_on_cpu_only():
    conv = _conv_grad_jaxpr()
    mlp = jax.make_jaxpr(lambda w, x: jnp.tanh(x @ w))(jnp.ones((4, 4)), jnp.ones((2, 4)))
    choice = loops.choose_pipeline_loop([mlp, conv], "cpu")
    assert choice.form == loops.HOST and "convolutions compile much faster" in choice.reason
    assert loops.choose_pipeline_loop([mlp, mlp], "cpu").form == loops.SCHEDULE
    assert loops.choose_pipeline_loop([conv], "gpu").form == loops.SCHEDULE
    assert loops.choose_pipeline_loop([mlp], "cpu", "host").form == loops.HOST
    assert loops.choose_pipeline_loop([conv], "cpu", "scan").form == loops.SCHEDULE
    with pytest.raises(ValueError, match="valid: auto, scan, host"):
        loops.choose_pipeline_loop([conv], "cpu", "fast")


def _train_pipelined(strategy, form: str, monkeypatch, build=_convnet, recompute=False):
    monkeypatch.setenv("KERAS_IPU_FLAGS", f"--execution_loop={form}")
    configure(2)
    if recompute:
        config = ipu.config.IPUConfig()
        config.auto_select_ipus = 2
        config.allow_recompute = True
        config.configure_ipu_system()
    with strategy.scope():
        model = build()
    model.set_pipeline_stage_assignment([0] * 2 + [1] * (len(model.layers) - 2))
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"],
                  steps_per_execution=8)
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=4,
                                 gradient_accumulation_reduction_method="running_mean")
    rng = np.random.default_rng(1)
    x = rng.normal(size=(64, *model.input_shape[1:])).astype("float32")
    y = rng.normal(size=(64, 3)).astype("float32")
    history = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    report = ipu.utils.execution_report(model, mode="fit")
    return model.get_weights(), history.history, model.predict(x, batch_size=4, verbose=0), report


@pytest.mark.parametrize("recompute", [False, True], ids=["stash", "recompute"])
def test_a_pipeline_gives_the_same_model_in_every_loop_form(strategy, monkeypatch, recompute):
    runs = {form: _train_pipelined(strategy, form, monkeypatch, recompute=recompute)
            for form in ("scan", "host", "auto")}
    weights, history, outputs, _ = runs["scan"]
    for form in ("host", "auto"):
        other_weights, other_history, other_outputs, _ = runs[form]
        assert_weights_close(weights, other_weights, atol=1e-6, rtol=1e-5)
        for name, values in history.items():
            np.testing.assert_allclose(other_history[name], values, rtol=1e-5)
        np.testing.assert_allclose(other_outputs, outputs, rtol=1e-5, atol=1e-6)
    reports = {form: run[3] for form, run in runs.items()}
    assert (reports["scan"].loop, reports["host"].loop) == ("schedule", "host")
    assert reports["auto"].loop == "host" and "convolution" in reports["auto"].loop_reason
    # Cycles follow the schedule in both forms; each IPU holds its own state in both.
    assert reports["host"].estimated_cycles == reports["scan"].estimated_cycles
    assert reports["host"].pipeline == reports["scan"].pipeline
    for host_ipu, scan_ipu in zip(reports["host"].ipus, reports["scan"].ipus):
        assert host_ipu.state_bytes == scan_ipu.state_bytes
        assert 0 < host_ipu.memory_bytes <= host_ipu.memory_capacity_bytes


def _dense_model() -> keras.Model:
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                             keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)])


def test_a_dense_pipeline_keeps_its_schedule_on_the_device(strategy, monkeypatch):
    report = _train_pipelined(strategy, "auto", monkeypatch, build=_dense_model)[3]
    assert report.loop == "schedule" and "no per-op dispatch" in report.loop_reason


def test_an_ordered_debug_callback_in_a_model_runs_in_step_order(strategy):
    # `jax.debug.print(..., ordered=True)` carries an effect token out of the program,
    # which the memory check once read as an output (an AssertionError in JAX).
    seen = {"plain": [], "ipu": []}
    x = np.repeat(np.arange(8, dtype="float32"), 4)[:, None] * np.ones((1, 3), "float32")
    y = np.zeros((32, 1), "float32")
    for name in seen:
        def tap(inputs, record=seen[name]):
            jax.debug.callback(lambda v: record.append(int(v[0])), inputs[:, 0], ordered=True)
            return inputs

        def build():
            return keras.Sequential([keras.Input((3,)), keras.layers.Lambda(tap),
                                     keras.layers.Dense(1)])

        if name == "ipu":
            with strategy.scope():
                model = build()
        else:
            model = build()
        model.compile(optimizer="sgd", loss="mse", steps_per_execution=2)
        model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
        model.predict(x, batch_size=4, verbose=0)
        jax.effects_barrier()
    assert seen["ipu"] == seen["plain"] == list(range(8)) * 2
