"""The XLA options keras_ipu compiles its programs with (`keras_ipu.device.compiler`)."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_ipu as ipu
from keras_ipu.device import compiler

from conftest import assert_weights_close, configure


def test_the_rule_tunes_optimizer_steps_on_cpus_only():
    tuned = compiler.choose_options(compiler.OPTIMIZER, "cpu", "tuned")
    assert tuned.options == {"xla_cpu_use_fusion_emitters": False}
    assert "optimizer step" in tuned.reason
    assert compiler.choose_options(compiler.STEP, "cpu", "tuned").options == {}
    assert compiler.choose_options(compiler.OPTIMIZER, "gpu", "tuned").options == {}
    forced = compiler.choose_options(compiler.OPTIMIZER, "cpu", "default")
    assert forced == compiler.CompilerOptions({}, "forced (--xla_compiler_options=default)")
    assert forced.describe() == "XLA's defaults (forced (--xla_compiler_options=default))"
    with pytest.raises(ValueError, match="Unknown program kind 'loop'"):
        compiler.choose_options("loop", "cpu")
    with pytest.raises(ValueError, match="Unknown compiler options 'fast'"):
        compiler.choose_options(compiler.STEP, "cpu", "fast")


def test_a_bad_flag_names_the_valid_choices(monkeypatch):
    monkeypatch.setenv("KERAS_IPU_FLAGS", "--xla_compiler_options=fast")
    with pytest.raises(ValueError, match="--xla_compiler_options=fast.*tuned, default"):
        configure(1)


def _convnet() -> keras.Model:
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((8, 8, 2)),
        keras.layers.Conv2D(4, 3, activation="relu"),
        keras.layers.BatchNormalization(),
        keras.layers.Conv2D(4, 3, padding="same"),
        keras.layers.Flatten(),
        keras.layers.Dense(3),
    ])


def _train_dispatched(strategy, monkeypatch, choice: str):
    monkeypatch.setenv("KERAS_IPU_FLAGS",
                       f"--execution_loop=host --xla_compiler_options={choice}")
    configure(2)
    with strategy.scope():
        model = _convnet()
    model.set_pipeline_stage_assignment([0, 0, 1, 1, 1])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", steps_per_execution=8)
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=4)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(64, 8, 8, 2)).astype("float32")
    y = rng.normal(size=(64, 3)).astype("float32")
    history = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    return model.get_weights(), history.history["loss"], ipu.utils.execution_report(model, "fit")


def test_tuned_optimizer_steps_train_the_same_model(strategy, monkeypatch):
    tuned_weights, tuned_loss, tuned = _train_dispatched(strategy, monkeypatch, "tuned")
    weights, loss, default = _train_dispatched(strategy, monkeypatch, "default")
    # Elementwise updates: the same arithmetic whichever emitter compiles them
    # (the Adam step's powers may round in the last place).
    assert_weights_close(weights, tuned_weights, atol=1e-7, rtol=1e-6)
    np.testing.assert_allclose(tuned_loss, loss, rtol=1e-6)
    assert tuned.loop == default.loop == "host"
    assert "optimizer steps: xla_cpu_use_fusion_emitters=False" in tuned.compiler
    assert "stage ops: XLA's defaults" in tuned.compiler
    assert "xla_cpu_use_fusion_emitters" not in default.compiler
    assert "xla_cpu_use_fusion_emitters=False" in str(tuned)


def test_a_model_fitted_again_after_configuring_another_choice_compiles_with_it(
        strategy, monkeypatch):
    # A notebook re-runs its configuration cell with another flag, then the fit cell:
    # the model's programs are compiled again with the new options, not reused.
    monkeypatch.setenv("KERAS_IPU_FLAGS", "--execution_loop=host --xla_compiler_options=default")
    configure(2)
    with strategy.scope():
        model = _convnet()
    model.set_pipeline_stage_assignment([0, 0, 1, 1, 1])
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=8)
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=4)
    x, y = np.ones((32, 8, 8, 2), "float32"), np.ones((32, 3), "float32")
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert "xla_cpu_use_fusion_emitters" not in ipu.utils.execution_report(model, "fit").compiler
    monkeypatch.setenv("KERAS_IPU_FLAGS", "--execution_loop=host --xla_compiler_options=tuned")
    configure(2)
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    report = ipu.utils.execution_report(model, "fit")
    assert "optimizer steps: xla_cpu_use_fusion_emitters=False" in report.compiler
