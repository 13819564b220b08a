"""Gradient accumulation: one weight update per N micro-batches, inside the on-device loop."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_ipu as ipu
from keras_ipu.gradient_accumulation import GradientAccumulationReductionMethod
from keras_ipu.keras import options

from conftest import assert_weights_close
from models import compile_args, data_for, pair, sequential

MICRO_BATCH, ACCUMULATION = 4, 4  # plain Keras: batch 16


def _fit_both(kind, strategy, reduction, optimizer="sgd", lr=0.05, plain_lr=None, epochs=2,
              plain_optimizer=None, ipu_optimizer=None):
    plain, on_ipu = pair(kind, strategy)
    plain.compile(**{**compile_args(kind, 1, optimizer, plain_lr or lr),
                     **({"optimizer": plain_optimizer} if plain_optimizer else {})})
    on_ipu.compile(**{**compile_args(kind, 8, optimizer, lr),
                      **({"optimizer": ipu_optimizer} if ipu_optimizer else {})})
    on_ipu.set_gradient_accumulation_options(
        gradient_accumulation_steps_per_replica=ACCUMULATION,
        gradient_accumulation_reduction_method=reduction,
    )
    x, y = data_for(kind, samples=128)
    plain.fit(x, y, batch_size=MICRO_BATCH * ACCUMULATION, epochs=epochs, shuffle=False,
              verbose=0)
    on_ipu.fit(x, y, batch_size=MICRO_BATCH, epochs=epochs, shuffle=False, verbose=0)
    return plain, on_ipu


@pytest.mark.parametrize("reduction", ["mean", "RUNNING_MEAN",
                                       GradientAccumulationReductionMethod.MEAN])
@pytest.mark.parametrize("kind", ["sequential", "functional", "subclassed_no_norm"])
def test_sgd_mean_reductions_equal_the_big_batch(kind, reduction, strategy):
    plain, on_ipu = _fit_both(kind, strategy, reduction)
    assert_weights_close(plain.get_weights(), on_ipu.get_weights(), atol=1e-5)
    updates = 2 * 128 // (MICRO_BATCH * ACCUMULATION)
    assert int(on_ipu.optimizer.iterations.numpy()) == updates


def test_sgd_sum_equals_the_big_batch_with_a_larger_learning_rate(strategy):
    plain, on_ipu = _fit_both("sequential", strategy, "sum", lr=0.01,
                              plain_lr=0.01 * ACCUMULATION)
    assert_weights_close(plain.get_weights(), on_ipu.get_weights(), atol=1e-5)


def test_adam_mean_equals_the_big_batch(strategy):
    plain, on_ipu = _fit_both("functional", strategy, "mean", optimizer="adam", lr=0.01)
    assert_weights_close(plain.get_weights(), on_ipu.get_weights(), atol=1e-5)


def test_schedule_weight_decay_and_clipping_apply_per_update(strategy):
    def optimizer():
        schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=1,
                                                               decay_rate=0.5)
        return keras.optimizers.SGD(schedule, weight_decay=0.1, clipnorm=0.05)

    plain, on_ipu = _fit_both("sequential", strategy, "mean", plain_optimizer=optimizer(),
                              ipu_optimizer=optimizer())
    assert_weights_close(plain.get_weights(), on_ipu.get_weights(), atol=1e-5)
    # The schedule advanced once per update: 16 updates, lr 0.1 * 0.5**16.
    assert int(on_ipu.optimizer.iterations.numpy()) == 16
    np.testing.assert_allclose(float(on_ipu.optimizer.learning_rate), 0.1 * 0.5**16,
                               rtol=1e-5)


def test_batch_norm_statistics_update_every_micro_batch(strategy):
    # Keras' own accumulation (optimizer gradient_accumulation_steps) runs a
    # step per micro-batch, as the IPU does: statistics and weights agree.
    plain, on_ipu = pair("subclassed", strategy)
    plain.compile(optimizer=keras.optimizers.SGD(0.05, gradient_accumulation_steps=ACCUMULATION),
                  loss="mse")
    on_ipu.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", steps_per_execution=8)
    on_ipu.set_gradient_accumulation_options(ACCUMULATION, "mean")
    x, y = data_for("subclassed", samples=64)
    plain.fit(x, y, batch_size=MICRO_BATCH, shuffle=False, verbose=0)
    on_ipu.fit(x, y, batch_size=MICRO_BATCH, shuffle=False, verbose=0)
    moving = [w.path for w in on_ipu.non_trainable_weights]
    assert any("moving_mean" in path for path in moving)
    assert_weights_close(plain.get_weights(), on_ipu.get_weights(), atol=1e-5)


def test_accumulator_dtype_follows_the_kwargs(strategy):
    # As in the reference: by default each variable's own type; a dtype for all; or a
    # function of the variable. One weight update (16 micro-batches), so each weight's
    # update depends on its own accumulator only.
    def bias_in_bfloat16(variable):
        return "bfloat16" if variable.path.endswith("bias") else np.float32

    results = {}
    for dtype in (None, "float32", "bfloat16", bias_in_bfloat16):
        keras.utils.set_random_seed(0)
        with strategy.scope():
            model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3, dtype="bfloat16")])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", steps_per_execution=16)
        kwargs = {} if dtype is None else {"dtype": dtype}
        model.set_gradient_accumulation_options(16, "sum", **kwargs)
        x, y = data_for("sequential", samples=64)
        model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
        results[dtype] = [w.astype("float32") for w in model.get_weights()]
    assert_weights_close(results[None], results["bfloat16"], atol=0)  # the variables' type
    (kernel32, bias32), (kernel16, bias16) = results["float32"], results["bfloat16"]
    assert not np.array_equal(kernel32, kernel16) and not np.array_equal(bias32, bias16)
    kernel, bias = results[bias_in_bfloat16]
    np.testing.assert_array_equal(kernel, kernel32)
    np.testing.assert_array_equal(bias, bias16)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_one_micro_batch_is_no_accumulation_whatever_the_dtype(dtype, strategy):
    # As in the reference, which accumulates only over more than one: the gradients
    # were rounded to the accumulator's dtype (2e-4 off plain Keras with bfloat16).
    plain, on_ipu = pair("sequential", strategy)
    plain.compile(**compile_args("sequential", 1, "adam", 0.01))
    on_ipu.compile(**compile_args("sequential", 4, "adam", 0.01))
    on_ipu.set_gradient_accumulation_options(1, dtype=dtype)
    x, y = data_for("sequential", samples=64)
    for model in (plain, on_ipu):
        model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert_weights_close(plain.get_weights(), on_ipu.get_weights(), atol=1e-7)


def test_an_accumulator_function_giving_no_float_type_raises_before_training(strategy):
    with strategy.scope():
        model = sequential()
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=4)
    x, y = data_for("sequential", samples=16)
    before = [w.copy() for w in model.get_weights()]
    for wrong, shown in (("int8", "'int8'"), (lambda: "float32", "<function")):
        model.set_gradient_accumulation_options(4, dtype=lambda variable, wrong=wrong: wrong)
        with pytest.raises(ValueError, match=r"accumulation dtype the function gives "
                                             r"'[a-z_0-9/]*/kernel' must be one of "
                                             r"\['float32', 'float16', 'bfloat16'\], got "
                                             + shown):
            model.fit(x, y, batch_size=4, verbose=0)
    assert_weights_close(before, model.get_weights(), atol=0)


def test_evaluate_and_predict_ignore_accumulation(strategy):
    plain, on_ipu = pair("sequential", strategy)
    for model in (plain, on_ipu):
        model.compile(**compile_args("sequential", 2))
    on_ipu.set_gradient_accumulation_options(gradient_accumulation_steps_per_replica=8)
    x, y = data_for("sequential", samples=16)
    np.testing.assert_allclose(on_ipu.evaluate(x, y, batch_size=4, verbose=0),
                               plain.evaluate(x, y, batch_size=4, verbose=0), atol=1e-6)
    np.testing.assert_allclose(on_ipu.predict(x, batch_size=4, verbose=0),
                               plain.predict(x, batch_size=4, verbose=0), atol=1e-6)


@pytest.mark.parametrize("samples", [96, 16])
def test_steps_per_execution_must_be_divisible_before_training(samples, strategy):
    # With 16 samples (4 batches) the run's steps_per_execution is truncated to 4, which
    # divides: the value compile() got must divide too, as the reference checks (before:
    # that fit ran).
    _, on_ipu = pair("sequential", strategy)
    on_ipu.compile(**compile_args("sequential", 6))
    on_ipu.set_gradient_accumulation_options(gradient_accumulation_steps_per_replica=4)
    x, y = data_for("sequential", samples=samples)
    before = [w.copy() for w in on_ipu.get_weights()]
    with pytest.raises(RuntimeError, match=r"set to 6\) is not divisible by "
                                           r"`gradient_accumulation_steps_per_replica` \(4\)"):
        on_ipu.fit(x, y, batch_size=4, verbose=0)
    assert_weights_close(before, on_ipu.get_weights(), atol=0)
    on_ipu.set_gradient_accumulation_options(gradient_accumulation_steps_per_replica=2)
    on_ipu.fit(x, y, batch_size=4, verbose=0)  # usable after the failure


@pytest.mark.parametrize("steps", [0, -2, 1.5, True, "4"])
def test_bad_step_counts(steps, strategy):
    with strategy.scope():
        model = sequential()
    with pytest.raises(ValueError, match="Expected `gradient_accumulation_steps_per_replica` "
                                         "to be a positive integer"):
        model.set_gradient_accumulation_options(steps)


def test_bad_reduction_method_lists_the_valid_ones(strategy):
    with strategy.scope():
        model = sequential()
    with pytest.raises(ValueError, match=r"Cannot parse 'median' as one of "
                                         r"GradientAccumulationReductionMethod\. Valid values "
                                         r"are: SUM, MEAN, RUNNING_MEAN\."):
        model.set_gradient_accumulation_options(4, "median")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"opt": None}, "Found `opt` key"),
        ({"num_mini_batches": 4}, "Found `num_mini_batches` key"),
        ({"experimental_normalize_gradients": True}, "Found `experimental_normalize_gradients`"),
        ({"learning_rate": 1.0}, r"Unknown `gradient_accumulation_optimizer_kwargs` "
                                 r"\['learning_rate'\]"),
        ({"dtype": "int8"}, r"must be one of \['float32', 'float16', 'bfloat16'\]"),
    ],
)
def test_refused_kwargs(kwargs, message, strategy):
    with strategy.scope():
        model = sequential()
    model.set_gradient_accumulation_options(2, "mean")
    with pytest.raises(ValueError, match=message):
        model.set_gradient_accumulation_options(4, "sum", **kwargs)
    # A failed call changes nothing.
    current = options.options_of(model)
    assert current.gradient_accumulation_steps_per_replica == 2
    assert current.gradient_accumulation_reduction_method.name == "MEAN"


def test_kwargs_must_be_a_mapping():
    with pytest.raises(TypeError, match="must be a dictionary"):
        options.gradient_accumulation_options(options.IPUOptions(), 2, "sum", False, [("a", 1)])


def test_setter_semantics(strategy):
    with strategy.scope():
        model = sequential()
    model.set_gradient_accumulation_options(4, "mean", dtype="bfloat16",
                                            offload_weight_update_variables=False)
    model.set_gradient_accumulation_options()  # None keeps 4; the method resets to SUM
    current = options.options_of(model)
    assert current.gradient_accumulation_steps_per_replica == 4
    assert current.gradient_accumulation_reduction_method is GradientAccumulationReductionMethod.SUM
    assert current.accumulator_dtype is None  # each variable's own type
    assert ipu.gradient_accumulation.GradientAccumulationReductionMethod is (
        GradientAccumulationReductionMethod
    )


def test_overridden_train_step_cannot_accumulate(strategy):
    class Custom(keras.Sequential):
        def train_step(self, state, data):
            return super().train_step(state, data)

    with strategy.scope():
        model = Custom([keras.Input((6,)), keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=2)
    model.set_gradient_accumulation_options(2)
    x, y = data_for("sequential", samples=16)
    with pytest.raises(RuntimeError, match="`train_step` .* has been overridden"):
        model.fit(x, y, batch_size=4, verbose=0)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_running_mean_accumulates_in_16_bits(dtype, strategy):
    # The reference's reason for RUNNING_MEAN: 16-bit accumulators stay in range.
    results = {}
    for accumulator in ("float32", dtype):
        keras.utils.set_random_seed(0)
        with strategy.scope():
            model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", steps_per_execution=4)
        model.set_gradient_accumulation_options(4, "running_mean", dtype=accumulator)
        x, y = data_for("sequential", samples=32)
        model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
        results[accumulator] = model.get_weights()
    assert_weights_close(results["float32"], results[dtype], atol=2e-2)
    assert any(not np.array_equal(a, b) for a, b in zip(results["float32"], results[dtype]))


class _LastPredictionMean(keras.Sequential):
    """Logs a value of the last batch's predictions besides its metrics'."""

    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        logs = super().compute_metrics(x, y, y_pred, sample_weight)
        return {**logs, "last_prediction_mean": keras.ops.mean(y_pred)}


@pytest.mark.parametrize("model_class", [keras.Sequential, _LastPredictionMean])
def test_logs_are_the_last_micro_batchs_as_in_keras(model_class, strategy):
    # Keras' own accumulation runs a step per micro-batch: its logs are the
    # last micro-batch's. keras_ipu works them out once after the loop from
    # the metrics (Keras' own compute_metrics), or per micro-batch when the
    # model brings its own.
    def build():
        keras.utils.set_random_seed(3)
        return model_class([keras.Input((6,)), keras.layers.Dense(3)])

    plain = build()
    with strategy.scope():
        on_ipu = build()
    plain.compile(optimizer=keras.optimizers.SGD(0.05, gradient_accumulation_steps=ACCUMULATION),
                  loss="mse", metrics=["mae"])
    on_ipu.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"],
                   steps_per_execution=8)
    on_ipu.set_gradient_accumulation_options(ACCUMULATION, "mean")
    x, y = data_for("sequential", samples=64)
    expected = plain.fit(x, y, batch_size=MICRO_BATCH, epochs=2, shuffle=False, verbose=0)
    history = on_ipu.fit(x, y, batch_size=MICRO_BATCH, epochs=2, shuffle=False, verbose=0)
    assert sorted(history.history) == sorted(expected.history)
    for name, values in expected.history.items():
        np.testing.assert_allclose(history.history[name], values, rtol=1e-5, err_msg=name)
    assert_weights_close(plain.get_weights(), on_ipu.get_weights(), atol=1e-5)
