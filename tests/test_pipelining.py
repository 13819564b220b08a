"""Pipelined execution across IPUs equals plain Keras with the same effective batch."""

from __future__ import annotations

import contextlib
import dataclasses

import keras
import numpy as np
import pytest

import keras_ipu as ipu
from keras_ipu.keras import context

import models
from conftest import assert_trees_close, assert_weights_close, configure
from models import compile_args, data_for, pair

SCHEDULES = list(ipu.pipelining_ops.PipelineSchedule)
MICRO, GA = 4, 4  # plain Keras: batch 16


_mlp = models.four_layer_mlp


class FourStages(keras.Model):
    """A subclassed model whose call puts one layer in each of 4 stages."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.d = [keras.layers.Dense(8, activation="tanh") for _ in range(3)]
        self.out = keras.layers.Dense(3)

    def call(self, x):
        for stage, layer in enumerate(self.d):
            with ipu.keras.PipelineStage(stage):
                x = layer(x)
        with ipu.keras.PipelineStage(3):
            return self.out(x)


def _functional_with_scopes():
    inputs = keras.Input((6,))
    with ipu.keras.PipelineStage(0):
        h = keras.layers.Dense(8, activation="relu")(inputs)
        skip = keras.layers.Dense(8)(inputs)
    with ipu.keras.PipelineStage(1):
        h = keras.layers.Add()([keras.layers.Dense(8, activation="tanh")(h), skip])
        out = keras.layers.Dense(3)(h)
    return keras.Model(inputs, out)


def _fit_pipelined(on_ipu, schedule, *, mapping=None, spe=8, replicas=1):
    on_ipu.compile(optimizer=keras.optimizers.SGD(0.05 / replicas), loss="mse",
                   metrics=["mae"], steps_per_execution=spe)
    on_ipu.set_pipelining_options(gradient_accumulation_steps_per_replica=GA // replicas,
                                  device_mapping=mapping,
                                  gradient_accumulation_reduction_method="mean",
                                  pipeline_schedule=schedule)


def _plain_twin(model, x):
    """A plain Keras copy of `model` (same weights) trained with the big batch."""
    plain = keras.Sequential.from_config(model.get_config())
    plain.set_weights(model.get_weights())
    plain.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    return plain


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: s.name)
def test_sequential_pipeline_equals_the_big_batch(schedule, strategy):
    configure(2)
    x, y = data_for("sequential", samples=128)
    with strategy.scope():
        model = _mlp()
    model.set_pipeline_stage_assignment([0, 0, 1, 1])
    plain = _plain_twin(model, x)
    _fit_pipelined(model, schedule)
    plain.fit(x, y, batch_size=MICRO * GA, epochs=2, shuffle=False, verbose=0)
    history = model.fit(x, y, batch_size=MICRO, epochs=2, shuffle=False, verbose=0)
    assert_weights_close(plain.get_weights(), model.get_weights(), atol=1e-6)
    assert len(history.history["loss"]) == 2
    np.testing.assert_allclose(model.evaluate(x, y, batch_size=MICRO, verbose=0),
                               plain.evaluate(x, y, batch_size=MICRO, verbose=0), rtol=1e-5)
    np.testing.assert_allclose(model.predict(x, batch_size=MICRO, verbose=0),
                               plain.predict(x, batch_size=MICRO, verbose=0), atol=1e-6)


def _fit_against_plain(scope, ipu_optimizer, plain_optimizers):
    """A 2-stage pipeline (GA 4, mean) and plain Keras copies of it, all fitted on the same data.

    Returns the pipelined model and one plain copy per optimizer of `plain_optimizers`
    (big batches of `MICRO * GA`), each starting from the pipeline's initial weights.
    """
    configure(2)
    x, y = data_for("sequential", samples=64)
    keras.utils.set_random_seed(0)  # the same initial weights whatever ran before
    with scope:
        model = _mlp()
    model.set_pipeline_stage_assignment([0, 0, 1, 1])
    model.compile(optimizer=ipu_optimizer, loss="mse", steps_per_execution=4)
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=GA,
                                 gradient_accumulation_reduction_method="mean")
    copies = []
    for optimizer in plain_optimizers:
        copy = keras.Sequential.from_config(model.get_config())
        copy.set_weights(model.get_weights())
        copy.compile(optimizer=optimizer, loss="mse")
        copy.fit(x, y, batch_size=MICRO * GA, epochs=2, shuffle=False, verbose=0)
        copies.append(copy)
    model.fit(x, y, batch_size=MICRO, epochs=2, shuffle=False, verbose=0)
    return model, copies


@pytest.mark.parametrize("loss_scaled", [False, True])
def test_weight_decay_exclusions_reach_every_ipu(loss_scaled, strategy):
    # Keras keeps `exclude_from_weight_decay` out of the optimizer's config:
    # each IPU's optimizer copy must still skip the same variables (also when a
    # LossScaleOptimizer wraps the one that decays).
    def excluding_biases():
        optimizer = keras.optimizers.AdamW(0.05, weight_decay=0.5)
        optimizer.exclude_from_weight_decay(var_names=["bias"])
        return keras.optimizers.LossScaleOptimizer(optimizer) if loss_scaled else optimizer

    model, (plain, decayed) = _fit_against_plain(
        strategy.scope(), excluding_biases(),
        [excluding_biases(), keras.optimizers.AdamW(0.05, weight_decay=0.5)])
    # AdamW's normalised steps carry float32 rounding (up to 2e-6 seen) in 2 epochs.
    assert_weights_close(plain.get_weights(), model.get_weights(), atol=1e-5)
    # Decaying the biases too would end elsewhere: the comparison can fail.
    bias = model.layers[0].bias.numpy()
    assert np.max(np.abs(decayed.layers[0].bias.numpy() - bias)) > 1e-3


@pytest.mark.parametrize("optimizer", ["Nadam", "Adafactor"])
def test_optimizers_with_slots_not_named_by_path_split_between_ipus(optimizer, strategy):
    # Nadam keeps an unnamed `u_product`; Adafactor names its factors after the
    # variable's bare name (`kernel` for every kernel) and the stages' shapes differ.
    def make():
        return getattr(keras.optimizers, optimizer)(0.05)

    model, (plain,) = _fit_against_plain(strategy.scope(), make(), [make()])
    assert_weights_close(plain.get_weights(), model.get_weights(), atol=1e-6)
    assert_weights_close([v.numpy() for v in plain.optimizer.variables],
                         [v.numpy() for v in model.optimizer.variables], atol=1e-6)


@pytest.mark.parametrize("first_stage", ["frozen", "weightless"])
def test_a_first_ipu_without_trainable_weights_keeps_the_iterations(first_stage, strategy):
    configure(2)
    x, y = data_for("sequential", samples=64)
    first = {"frozen": lambda: keras.layers.Dense(6, trainable=False),
             "weightless": lambda: keras.layers.Activation("tanh")}[first_stage]
    keras.utils.set_random_seed(3)
    plain = keras.Sequential([keras.Input((6,)), first(), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(3)])
    with strategy.scope():
        model = keras.Sequential.from_config(plain.get_config())
    model.set_weights(plain.get_weights())
    model.set_pipeline_stage_assignment([0, 1, 1])
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse", steps_per_execution=4)
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=GA,
                                 gradient_accumulation_reduction_method="mean")
    plain.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    for _ in range(2):  # Adam's bias correction reads the iterations kept between fits
        plain.fit(x, y, batch_size=MICRO * GA, epochs=1, shuffle=False, verbose=0)
        model.fit(x, y, batch_size=MICRO, epochs=1, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations) == int(plain.optimizer.iterations) == 8
    assert_weights_close(plain.get_weights(), model.get_weights(), atol=1e-6)


def _clipping(kind):
    sgd = keras.optimizers.SGD(0.05, global_clipnorm=0.05)
    return keras.optimizers.LossScaleOptimizer(sgd, initial_scale=64.0) if kind == "lso" else sgd


@pytest.mark.parametrize("form", ["scan", "host"])
@pytest.mark.parametrize("kind", ["sgd", "lso"])
def test_global_clipnorm_clips_by_the_norm_over_every_ipu(kind, form, monkeypatch):
    # Keras clips by the norm of all the gradients; each IPU holds some of
    # them: every IPU must scale its own by the norm over all of them.
    monkeypatch.setenv("KERAS_IPU_FLAGS", f"--execution_loop={form}")
    model, (plain, unclipped) = _fit_against_plain(
        ipu.ipu_strategy.IPUStrategy().scope(), _clipping(kind),
        [_clipping(kind), keras.optimizers.SGD(0.05)])
    assert_weights_close(plain.get_weights(), model.get_weights(), atol=1e-6)
    # The clipping was active: without it the weights end elsewhere.
    assert np.max(np.abs(unclipped.get_weights()[0] - model.get_weights()[0])) > 1e-3
    assert ipu.utils.execution_report(model, "fit").loop == (
        "host" if form == "host" else "schedule")


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: s.name)
def test_functional_with_pipeline_stage_scopes(schedule, strategy):
    configure(2)
    x, y = data_for("sequential", samples=64)
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = _functional_with_scopes()
    plain = keras.Model.from_config(model.get_config())
    plain.set_weights(model.get_weights())
    plain.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    _fit_pipelined(model, schedule)
    plain.fit(x, y, batch_size=MICRO * GA, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=MICRO, shuffle=False, verbose=0)
    assert_weights_close(plain.get_weights(), model.get_weights(), atol=1e-6)


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: s.name)
def test_existing_functional_split_by_assignment(schedule, strategy):
    configure(2)
    x, y = data_for("functional", samples=64)
    plain, model = pair("functional", strategy)
    assignment = model.get_pipeline_stage_assignment()
    for i, entry in enumerate(assignment):  # concatenate + hidden dense | both heads
        entry.pipeline_stage = 0 if i < 2 else 1
    model.set_pipeline_stage_assignment(assignment)
    plain.compile(**compile_args("functional", 1, "sgd", 0.05))
    model.compile(**compile_args("functional", 8, "sgd", 0.05))
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=GA,
                                 gradient_accumulation_reduction_method="mean",
                                 pipeline_schedule=schedule)
    plain.fit(x, y, batch_size=MICRO * GA, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=MICRO, shuffle=False, verbose=0)
    assert_weights_close(plain.get_weights(), model.get_weights(), atol=1e-6)
    assert_trees_close(plain.predict(x, batch_size=MICRO, verbose=0),
                       model.predict(x, batch_size=MICRO, verbose=0))


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: s.name)
def test_subclassed_four_stages_on_two_ipus(schedule, strategy):
    configure(2)
    x, y = data_for("sequential", samples=64)
    keras.utils.set_random_seed(2)
    with strategy.scope():
        model = FourStages()
        model(x[:1])
    plain = _mlp_like_four_stages(model)
    _fit_pipelined(model, schedule, mapping=[0, 1, 1, 0])
    plain.fit(x, y, batch_size=MICRO * GA, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=MICRO, shuffle=False, verbose=0)
    assert_weights_close(plain.get_weights(), model.get_weights(), atol=1e-6)


def _mlp_like_four_stages(model):
    plain = keras.Sequential([keras.Input((6,))] + [
        keras.layers.Dense(8, activation="tanh") for _ in range(3)] + [keras.layers.Dense(3)])
    plain.set_weights(model.get_weights())
    plain.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    return plain


def test_two_stages_times_two_replicas(strategy):
    configure(4)
    x, y = data_for("sequential", samples=128)
    with strategy.scope():
        model = _mlp()
    model.set_pipeline_stage_assignment([0, 0, 1, 1])
    plain = _plain_twin(model, x)
    _fit_pipelined(model, ipu.pipelining_ops.PipelineSchedule.Grouped, spe=4, replicas=2)
    plain.fit(x, y, batch_size=MICRO * GA, epochs=2, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=MICRO, epochs=2, shuffle=False, verbose=0)
    assert_weights_close(plain.get_weights(), model.get_weights(), atol=1e-6)
    report = ipu.utils.execution_report(model, "fit")
    assert [i.index for i in report.ipus] == [0, 1, 2, 3]
    np.testing.assert_allclose(model.predict(x, batch_size=MICRO, verbose=0),
                               plain.predict(x, batch_size=MICRO, verbose=0), atol=1e-6)


def test_fit_needs_pipelining_accumulation(strategy):
    configure(2)
    with strategy.scope():
        model = _mlp()
    model.set_pipeline_stage_assignment([0, 0, 1, 1])
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=8)
    x, y = data_for("sequential", samples=32)
    with pytest.raises(ValueError, match="has not been set through `set_pipelining_options"):
        model.fit(x, y, batch_size=4, verbose=0)
    # Inference runs the pipeline without it.
    assert model.predict(x, batch_size=4, verbose=0).shape == (32, 3)


def test_the_sequential_schedule_trains_without_accumulation(strategy):
    # The seed: accumulation "is optional when using the Sequential schedule"; each
    # batch is then one weight update, as plain Keras' fit with that batch.
    configure(2)
    x, y = data_for("sequential", samples=32)
    with strategy.scope():
        model = _mlp()
    model.set_pipeline_stage_assignment([0, 0, 1, 1])
    model.set_pipelining_options(pipeline_schedule=ipu.pipelining_ops.PipelineSchedule.Sequential)
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"],
                  steps_per_execution=4)
    plain = _plain_twin(model, x)
    model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    plain.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert_weights_close(plain.get_weights(), model.get_weights(), atol=1e-6)


def test_too_few_micro_batches_names_the_minimum(strategy):
    configure(2)
    with strategy.scope():
        model = _mlp()
    model.set_pipeline_stage_assignment([0, 0, 1, 1])
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=8)
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=1)
    x, y = data_for("sequential", samples=32)
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(ValueError, match=r"\(1\) is too small for the Grouped schedule of 2 "
                                         r"pipeline stages: the minimum is 2"):
        model.fit(x, y, batch_size=4, verbose=0)
    assert_weights_close(before, model.get_weights(), atol=0)
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=1)
    with pytest.raises(ValueError, match=r"`steps_per_execution` \(1\) is too small.*set it "
                                         r"with `compile\(steps_per_execution=\.\.\.\)`"):
        model.predict(x, batch_size=4, verbose=0)


def _staged_mlp_and_twin(strategy, optimizer):
    """A 2-stage MLP pipeline (GA 4) and its plain twin (the same weights), with data."""
    configure(2)
    x, y = data_for("sequential", samples=32)
    with strategy.scope():
        model = _mlp()
    plain = _plain_twin(model, x)
    model.set_pipeline_stage_assignment([0, 0, 1, 1])
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=GA)
    model.compile(optimizer=optimizer, loss="mse", metrics=["mae"], steps_per_execution=GA)
    return model, plain, x, y


def test_data_shorter_than_the_schedules_minimum_still_predicts_and_evaluates(strategy):
    # One batch cuts steps_per_execution to 1, below the Grouped schedule's 2 for 2
    # stages: inference runs it (before: the minimum's error, also for a fit's validation).
    model, plain, x, y = _staged_mlp_and_twin(strategy, keras.optimizers.SGD(0.05))
    np.testing.assert_allclose(model.predict(x[:MICRO], batch_size=MICRO, verbose=0),
                               plain.predict(x[:MICRO], batch_size=MICRO, verbose=0), atol=1e-6)
    assert model.evaluate(x[:MICRO], y[:MICRO], batch_size=MICRO, verbose=0) == pytest.approx(
        plain.evaluate(x[:MICRO], y[:MICRO], batch_size=MICRO, verbose=0), rel=1e-6)
    history = model.fit(x, y, batch_size=MICRO, validation_data=(x[:MICRO], y[:MICRO]),
                        verbose=0)
    assert history.history["val_loss"][0] == pytest.approx(
        model.evaluate(x[:MICRO], y[:MICRO], batch_size=MICRO, verbose=0)[0], rel=1e-6)


def test_mapping_must_cover_the_stages_and_shared_layers_one_ipu(strategy):
    configure(2)
    with strategy.scope():
        model = _mlp()
    model.set_pipeline_stage_assignment([0, 0, 1, 1])
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=8)
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=4,
                                 device_mapping=[0, 1, 1])
    x, y = data_for("sequential", samples=32)
    with pytest.raises(ValueError, match=r"3 mappings != 2 stages"):
        model.fit(x, y, batch_size=4, verbose=0)

    shared = keras.layers.Dense(6, activation="tanh")
    inputs = keras.Input((6,))
    with strategy.scope():
        with ipu.keras.PipelineStage(0):
            h = shared(inputs)
        with ipu.keras.PipelineStage(1):
            h = shared(h)
            out = keras.layers.Dense(3)(h)
        reused = keras.Model(inputs, out)
    reused.compile(optimizer="sgd", loss="mse", steps_per_execution=8)
    reused.set_pipelining_options(gradient_accumulation_steps_per_replica=4)
    with pytest.raises(ValueError, match=r"used by pipeline stages 0 and 1, on IPUs 0 and 1"):
        reused.fit(x, y, batch_size=4, verbose=0)
    reused.set_pipelining_options(device_mapping=[0, 0])
    reused.fit(x, y, batch_size=4, verbose=0)  # one IPU holds the shared layer


def test_a_layer_without_state_may_be_called_by_stages_on_different_ipus(strategy):
    # The reference's rule is for shared weights: a ReLU called in two stages on two
    # IPUs was refused. A Dropout holds its seed generator's state: refused, saying so.
    configure(2)
    x, y = data_for("sequential", samples=32)

    def build(middle, stage=ipu.keras.PipelineStage):
        keras.utils.set_random_seed(5)
        inputs = keras.Input((6,))
        with stage(0):
            h = middle(keras.layers.Dense(8)(inputs))
        with stage(1):
            out = keras.layers.Dense(3)(middle(keras.layers.Dense(8)(h)))
        return keras.Model(inputs, out)

    plain = build(keras.layers.ReLU(), stage=lambda _: contextlib.nullcontext())
    plain.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    with strategy.scope():
        shared = build(keras.layers.ReLU())
        stateful = build(keras.layers.Dropout(0.5))
    shared.set_weights(plain.get_weights())
    for model in (shared, stateful):
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", steps_per_execution=8)
        model.set_pipelining_options(gradient_accumulation_steps_per_replica=4,
                                     gradient_accumulation_reduction_method="mean")
    args = dict(batch_size=4, shuffle=False, verbose=0)
    plain.fit(x, y, **{**args, "batch_size": 16})  # 4 micro-batches of 4
    shared.fit(x, y, **args)
    assert_weights_close(plain.get_weights(), shared.get_weights())
    with pytest.raises(ValueError, match=r"used by pipeline stages 0 and 1, on IPUs 0 and 1, "
                                         r"and holds state \(seed_generator"):
        stateful.fit(x, y, **args)


def test_a_dict_for_list_inputs_binds_by_name_and_one_output_lists_unwrap(strategy):
    # Keras binds a dict to a list of named inputs by name and returns a one-output list
    # as the output; pipelined, the dict went in sorted-key order (z got a's values,
    # silently) and predict returned [array].
    configure(2)
    rng = np.random.default_rng(2)
    xz, xa = rng.normal(size=(16, 3)).astype("float32"), rng.normal(size=(16, 5)).astype("float32")
    y = rng.normal(size=(16, 1)).astype("float32")

    def build(stage):
        keras.utils.set_random_seed(1)
        z, a = keras.Input((3,), name="z"), keras.Input((5,), name="a")
        with stage(0):
            h = keras.layers.Dense(4)(keras.layers.Concatenate()([z, a]))
        with stage(1):
            out = keras.layers.Dense(1)(h)
        return keras.Model([z, a], [out])

    plain = build(lambda _: contextlib.nullcontext())
    plain.compile(optimizer="sgd", loss="mse")
    with strategy.scope():
        model = build(ipu.keras.PipelineStage)
    model.set_weights(plain.get_weights())
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=4)
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=4,
                                 gradient_accumulation_reduction_method="mean")
    x = {"z": xz, "a": xa}
    expected = plain.predict(x, batch_size=4, verbose=0)
    predicted = model.predict(x, batch_size=4, verbose=0)
    assert isinstance(predicted, np.ndarray) and predicted.shape == (16, 1)
    np.testing.assert_allclose(predicted, expected, atol=1e-6)
    np.testing.assert_allclose(model.evaluate(x, y, batch_size=4, verbose=0),
                               plain.evaluate(x, y, batch_size=4, verbose=0), rtol=1e-6)
    plain.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    assert_weights_close(plain.get_weights(), model.get_weights())


class _Block(keras.layers.Layer):
    """A layer whose `call` takes no `training`: it reaches its BatchNormalization through
    Keras' call context."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense, self.norm = keras.layers.Dense(4), keras.layers.BatchNormalization()

    def call(self, x):
        return self.norm(self.dense(x))


def test_layers_without_a_training_argument_train_their_inner_layers(strategy):
    # The pipeline passed `training` only to layers whose `call` takes it: the block's
    # BatchNormalization ran in inference (its statistics never moved; loss 2118 for 2.5).
    configure(2)
    x, y = data_for("sequential", samples=32)

    def build(stage):
        keras.utils.set_random_seed(3)
        inputs = keras.Input((6,))
        with stage(0):
            h = _Block()(inputs)
        with stage(1):
            out = keras.layers.Dense(3)(h)
        return keras.Model(inputs, out)

    plain = build(lambda _: contextlib.nullcontext())
    plain.compile(optimizer=keras.optimizers.SGD(0.05, gradient_accumulation_steps=4),
                  loss="mse")
    with strategy.scope():
        model = build(ipu.keras.PipelineStage)
    model.set_weights(plain.get_weights())
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", steps_per_execution=8)
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=4,
                                 gradient_accumulation_reduction_method="mean")
    args = dict(batch_size=4, shuffle=False, verbose=0)
    assert_history_close_to(plain.fit(x, y, **args).history, model.fit(x, y, **args).history)
    assert_weights_close(plain.get_weights(), model.get_weights(), atol=1e-5)


def assert_history_close_to(expected, actual):
    for key in expected:
        np.testing.assert_allclose(actual[key], expected[key], rtol=1e-5)


def test_pipelined_inputs_are_standardized_as_keras_functional_does(strategy):
    # A nested model's dict went in sorted-key order; inputs kept the data's dtype and
    # rank (an int32 Input fed floats computed in floats; (N,) data for Input((1,))
    # raised); a dict Keras cannot bind was bound by sorted key instead of refused.
    configure(2)
    rng = np.random.default_rng(4)
    data = {"n": rng.uniform(0, 4, size=(16,)).astype("float32"),
            "v": rng.normal(size=(16, 3)).astype("float32")}

    def build(stage):
        keras.utils.set_random_seed(2)
        n, v = keras.Input((1,), name="n", dtype="int32"), keras.Input((3,), name="v")
        q, p = keras.Input((3,), name="q"), keras.Input((3,), name="p")
        inner = keras.Model([q, p], keras.layers.Subtract()([q, p]), name="inner")
        with stage(0):
            h = keras.layers.Dense(3)(keras.ops.cast(n * 3, "float32"))
        with stage(1):
            out = keras.layers.Dense(2)(inner({"p": h, "q": v}))
        return keras.Model([n, v], out)

    plain = build(lambda _: contextlib.nullcontext())
    with strategy.scope():
        model = build(ipu.keras.PipelineStage)
    model.set_weights(plain.get_weights())
    model.compile(steps_per_execution=4)
    np.testing.assert_allclose(model.predict(data, batch_size=4, verbose=0),
                               plain.predict(data, batch_size=4, verbose=0), atol=1e-5)
    with pytest.raises(ValueError, match="doesn't match the expected structure"):
        model.predict({"n": data["n"], "w": data["v"]}, batch_size=4, verbose=0)


def test_a_replaced_head_trains_on_without_compile_as_in_plain_keras(strategy):
    # pop() + add() of a layer of the same shapes: Keras' optimizer goes on by position;
    # the pipeline refused ("a layer was frozen or unfrozen since").
    configure(2)
    x, y = data_for("sequential", samples=32)

    def run(model, batch_size):
        model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9), loss="mse",
                      steps_per_execution=8 if batch_size == 4 else 1)
        if batch_size == 4:
            model.set_pipelining_options(gradient_accumulation_steps_per_replica=4,
                                         gradient_accumulation_reduction_method="mean")
        model.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0)
        model.pop()
        keras.utils.set_random_seed(1)
        model.add(keras.layers.Dense(3))
        if batch_size == 4:
            model.set_pipeline_stage_assignment([0, 1])
        model.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0)
        return model.get_weights()

    keras.utils.set_random_seed(0)
    plain = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8), keras.layers.Dense(3)])
    with strategy.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8), keras.layers.Dense(3)])
    model.set_weights(plain.get_weights())
    model.set_pipeline_stage_assignment([0, 1])
    assert_weights_close(run(plain, 16), run(model, 4), atol=1e-6)
    # Still refused: the same shapes, but a weight the model still holds went out of
    # training and another came in (a layer frozen and another unfrozen).
    with strategy.scope():
        swapped = keras.Sequential([keras.Input((6,)), keras.layers.Dense(6),
                                    keras.layers.Dense(6), keras.layers.Dense(3)])
    swapped.layers[0].trainable = False
    swapped.compile(optimizer="sgd", loss="mse", steps_per_execution=8)
    swapped.set_pipeline_stage_assignment([0, 0, 1])
    swapped.set_pipelining_options(gradient_accumulation_steps_per_replica=4)
    swapped.fit(x, y, batch_size=4, verbose=0)
    swapped.layers[0].trainable, swapped.layers[1].trainable = True, False
    with pytest.raises(ValueError, match="a layer was frozen or unfrozen since"):
        swapped.fit(x, y, batch_size=4, verbose=0)


class _FineTuned(keras.Model):
    """Keras' fine-tuning pattern: a frozen backbone called with `training=False`, and a
    Dropout always on (`training=True`, Monte Carlo dropout)."""

    def __init__(self, stage, **kwargs):
        super().__init__(**kwargs)
        self.stage = stage
        inputs = keras.Input((6,))
        self.backbone = keras.Model(
            inputs, keras.layers.BatchNormalization()(keras.layers.Dense(6)(inputs)))
        self.drop = keras.layers.Dropout(0.5, seed=3)
        self.head = keras.layers.Dense(3)

    def call(self, x, training=None):
        with self.stage(0):
            h = self.backbone(x, training=False)
        with self.stage(1):
            return self.head(self.drop(h, training=True))


def test_a_subclassed_models_explicit_training_values_are_kept(strategy):
    # The pipeline gave every call the run's `training`: the frozen backbone's
    # BatchNormalization trained (loss 1.60 for 4.56) and predict dropped nothing.
    configure(2)
    x, y = data_for("sequential", samples=32)
    keras.utils.set_random_seed(0)
    plain = _FineTuned(lambda _: contextlib.nullcontext())
    plain(x[:4])
    plain.compile(optimizer=keras.optimizers.SGD(0.05, gradient_accumulation_steps=4),
                  loss="mse")
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = _FineTuned(ipu.keras.PipelineStage)
        model(x[:4])
    model.set_weights(plain.get_weights())
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", steps_per_execution=8)
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=4,
                                 gradient_accumulation_reduction_method="mean")
    args = dict(batch_size=4, shuffle=False, verbose=0)
    np.testing.assert_allclose(model.fit(x, y, **args).history["loss"],
                               plain.fit(x, y, **args).history["loss"], rtol=1e-5)
    assert_weights_close(plain.get_weights(), model.get_weights(), atol=1e-5)
    moving_mean = [w for w in model.weights if "moving_mean" in w.path][0]
    np.testing.assert_array_equal(moving_mean.numpy(), 0.0)  # frozen: never moved
    np.testing.assert_allclose(model.evaluate(x, y, batch_size=4, verbose=0),
                               plain.evaluate(x, y, batch_size=4, verbose=0), rtol=1e-5)


class _TiedOutput(keras.layers.Layer):
    """Logits from an `Embedding`'s matrix, which it holds (a tied embedding)."""

    def __init__(self, embedding, **kwargs):
        super().__init__(**kwargs)
        self.embedding = embedding

    def call(self, h):
        return keras.ops.matmul(h, keras.ops.transpose(self.embedding.embeddings))


def _tied_embedding_model(staged: bool):
    stage = _stage_scope(staged)
    keras.utils.set_random_seed(5)
    inputs = keras.Input((5,), dtype="int32")
    embedding = keras.layers.Embedding(12, 6, name="emb")
    with stage(0):
        h = keras.layers.GlobalAveragePooling1D()(embedding(inputs))
    with stage(1):
        out = _TiedOutput(embedding, name="tied")(keras.layers.Dense(6, activation="tanh")(h))
    return keras.Model(inputs, out)


def test_a_variable_stages_on_two_ipus_share_is_named_with_its_layers(strategy):
    # The last stage's layer reads the first stage's Embedding matrix: each IPU would update
    # its own copy (before, an error that named nothing: "Every trainable variable must
    # belong to a layer of a pipeline stage"). On one IPU it trains as plain Keras.
    configure(2)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 12, (32, 5)).astype(np.int32)
    y = rng.normal(size=(32, 12)).astype(np.float32)
    plain = _tied_embedding_model(staged=False)
    with strategy.scope():
        model = _tied_embedding_model(staged=True)
    _compile_twins(plain, model, accumulation=4, steps_per_execution=4, learning_rate=0.1)
    # Both stages on IPU 0, a pipeline takes one IPU: the 2 IPUs run 2 replicas, which sum
    # their gradients (plain Keras: both replicas' batches at twice the rate).
    plain.compile(optimizer=keras.optimizers.SGD(0.2), loss="mse")
    before = model.get_weights()
    message = (r"Variable emb/embeddings \(`embeddings` of layer `emb`\) is used by pipeline "
               r"stages on IPUs 0 and 1: layer `emb` in stage 0 \(IPU 0\), layer `tied` in "
               r"stage 1 \(IPU 1\)\. .* set `device_mapping` so that stages 0 and 1 share an "
               r"IPU \(the mapping is \[0, 1\]\)")
    for run in (lambda: model.fit(x, y, batch_size=2, verbose=0),
                lambda: model.predict(x, batch_size=2, verbose=0)):
        with pytest.raises(ValueError, match=message):
            run()
    assert_weights_close(before, model.get_weights(), atol=0)
    model.set_pipelining_options(device_mapping=[0, 0],
                                 gradient_accumulation_reduction_method="mean")
    plain.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=2, shuffle=False, verbose=0)
    assert_weights_close(plain.get_weights(), model.get_weights(), atol=1e-6)


def test_stage_weights_live_on_their_ipus(strategy):
    configure(2)
    with strategy.scope():
        model = _mlp()
    model.set_pipeline_stage_assignment([0, 0, 1, 1])
    _fit_pipelined(model, ipu.pipelining_ops.PipelineSchedule.Grouped)
    x, y = data_for("sequential", samples=32)
    captured = []

    class Capture(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            captured.append(context.state_of(self._owner).pending_state)

    capture = Capture()
    capture._owner = model
    model.fit(x, y, batch_size=MICRO, verbose=0, callbacks=[capture])
    devices = [i.device for i in ipu.device.system.current().ipus[:2]]
    placement = ipu.utils.weight_placement(model, "fit")
    for layer, stage in zip(model.layers, [0, 0, 1, 1]):
        for weight in layer.trainable_weights:
            assert placement[weight.path] == [devices[stage]]
    # Each IPU's shard of the packed state holds exactly its stage's weights.
    state, codec = captured[-1]
    for ipu_index, stage_layers in enumerate([model.layers[:2], model.layers[2:]]):
        shards = {
            dtype: next(s for s in array.addressable_shards
                        if s.index[1].start == ipu_index)
            for dtype, array in state["trainable_variables"].items()
        }
        assert all(s.device == devices[ipu_index] for s in shards.values())
        layout = codec.state.layouts["trainable_variables"][ipu_index]
        held = layout.unpack({k: np.asarray(s.data)[0, 0] for k, s in shards.items()})
        expected = [w for layer in stage_layers for w in layer.get_weights()]
        assert_weights_close(expected, held, atol=0)


def test_a_model_too_big_for_one_ipu_trains_pipelined_over_four(strategy):
    x = np.random.default_rng(0).normal(size=(64, 256)).astype("float32")
    y = np.random.default_rng(1).normal(size=(64, 256)).astype("float32")

    def model():
        with strategy.scope():
            return keras.Sequential([keras.Input((256,))] + [
                keras.layers.Dense(256, activation="relu") for _ in range(4)])

    configure(1, tiles_per_ipu=5)  # 5 × 624 KiB per IPU
    single = model()
    single.compile(optimizer="adam", loss="mse", steps_per_execution=8)
    single.set_gradient_accumulation_options(8)
    with pytest.raises(ipu.errors.IPUOutOfMemoryError, match="IPU 0"):
        single.fit(x, y, batch_size=8, verbose=0)

    configure(4, tiles_per_ipu=5)
    pipelined = model()
    pipelined.set_pipeline_stage_assignment([0, 1, 2, 3])
    pipelined.compile(optimizer="adam", loss="mse", steps_per_execution=8)
    pipelined.set_pipelining_options(gradient_accumulation_steps_per_replica=8)
    history = pipelined.fit(x, y, batch_size=8, epochs=2, verbose=0)
    assert history.history["loss"][1] < history.history["loss"][0]
    report = ipu.utils.execution_report(pipelined, "fit")
    assert len(report.ipus) == 4
    assert all(i.memory_bytes <= i.memory_capacity_bytes for i in report.ipus)
    # Each IPU holds a quarter of the weights and optimizer state.
    params = sum(int(np.prod(w.shape)) for w in pipelined.trainable_weights)
    assert all(i.state_bytes < 4 * 3 * params // 4 * 1.1 for i in report.ipus)


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: s.name)
@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("micro_batches", [4, 16])
def test_reported_utilisation_matches_the_closed_form(schedule, stages, micro_batches, strategy):
    from keras_ipu.device.schedules import build_schedule, closed_form_utilisation

    configure(stages)  # one replica
    # Wide enough that a stage's layer outweighs the bundle's bookkeeping.
    with strategy.scope():
        model = keras.Sequential([keras.Input((128,))] + [
            keras.layers.Dense(128, activation="relu") for _ in range(stages)])
    model.set_pipeline_stage_assignment(list(range(stages)))
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=micro_batches)
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=micro_batches,
                                 pipeline_schedule=schedule)
    x = np.ones((micro_batches * 2, 128), "float32")
    model.fit(x, x, batch_size=2, verbose=0)
    pipeline = ipu.utils.execution_report(model, "fit").pipeline
    assert pipeline.schedule == schedule.name and pipeline.num_stages == stages
    forward = np.mean(pipeline.stage_forward_cycles)
    backward = np.mean(pipeline.stage_backward_cycles[1:])
    # Equal stages: costs agree to a few percent, but the last stage computes the loss too
    # (more), and the first stage's backward pass takes no gradient for the data (its
    # weights' gradient only): it costs less.
    forwards = pipeline.stage_forward_cycles
    assert np.ptp(forwards[:-1]) <= 0.05 * forward
    assert forwards[-1] > forwards[0] and forwards[-1] <= 1.15 * forwards[0]
    assert np.ptp(pipeline.stage_backward_cycles[1:]) <= 0.05 * backward
    assert 0.3 < pipeline.stage_backward_cycles[0] / backward < 0.9
    table = build_schedule(schedule, stages, micro_batches)
    assert pipeline.utilisation == pytest.approx(
        table.utilisation(pipeline.stage_forward_cycles, pipeline.stage_backward_cycles))
    # With the first stage's backward pass as the others', the closed form's figure.
    alike = [forward] * stages, [backward] * stages
    assert table.utilisation(*alike) == pytest.approx(
        closed_form_utilisation(schedule, stages, micro_batches, forward, backward), rel=0.02)


def test_utilisation_grows_with_micro_batches_and_interleaved_stashes_less(strategy):
    configure(2)
    reports = {}
    for schedule in SCHEDULES[:2]:  # Grouped, Interleaved
        for micro_batches in (4, 16):
            with strategy.scope():
                model = _mlp()
            model.set_pipeline_stage_assignment([0, 0, 1, 1])
            model.compile(optimizer="sgd", loss="mse", steps_per_execution=micro_batches)
            model.set_pipelining_options(gradient_accumulation_steps_per_replica=micro_batches,
                                         pipeline_schedule=schedule)
            x, y = data_for("sequential", samples=micro_batches * 2)
            model.fit(x, y, batch_size=2, verbose=0)
            reports[schedule.name, micro_batches] = ipu.utils.execution_report(model).pipeline
    for name in ("Grouped", "Interleaved"):
        assert reports[name, 16].utilisation > reports[name, 4].utilisation
    assert reports["Interleaved", 16].stash_counts == (2, 1)
    assert reports["Grouped", 16].stash_counts == (3, 1)
    # Activation memory follows: stash count x micro-batch (2) x float32 x what a stage keeps
    # without recomputation: its input and its activations (stage 0: 6 + 8 + 8, stage 1:
    # 8 + 8 + 3).
    assert reports["Grouped", 16].stash_bytes == (3 * 2 * 4 * 22, 1 * 2 * 4 * 19)
    assert reports["Interleaved", 16].stash_bytes == (2 * 2 * 4 * 22, 1 * 2 * 4 * 19)
    assert not reports["Grouped", 16].recomputation
    assert "Pipeline: Interleaved schedule" in str(ipu.utils.execution_report(model))


@pytest.mark.parametrize("how", ["config", "config and recomputation_mode"])
def test_recomputation_keeps_only_stage_inputs(how, strategy):
    configure(2, allow_recompute=True)
    with strategy.scope():
        model = _mlp()
    model.set_pipeline_stage_assignment([0, 0, 1, 1])
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=16)
    kwargs = ({"recomputation_mode": ipu.pipelining_ops.RecomputationMode.Auto}
              if how.endswith("recomputation_mode") else {})
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=16, **kwargs)
    x, y = data_for("sequential", samples=32)
    model.fit(x, y, batch_size=2, verbose=0)
    pipeline = ipu.utils.execution_report(model).pipeline
    assert pipeline.recomputation
    assert pipeline.stash_bytes == (3 * 2 * 4 * 6, 1 * 2 * 4 * 8)  # inputs only


def test_a_recomputation_mode_alone_does_not_recompute(strategy):
    # As on the IPU, the mode applies only once `allow_recompute` turns recomputation on.
    configure(2)
    with strategy.scope():
        model = _mlp()
    model.set_pipeline_stage_assignment([0, 0, 1, 1])
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=16)
    model.set_pipelining_options(
        gradient_accumulation_steps_per_replica=16,
        recomputation_mode=ipu.pipelining_ops.RecomputationMode.RecomputeThenBackpropagate)
    x, y = data_for("sequential", samples=32)
    with pytest.warns(UserWarning, match=r"`recomputation_mode` has no effect while "
                                         r"recomputation is off.*allow_recompute = True"):
        model.fit(x, y, batch_size=2, verbose=0)
    pipeline = ipu.utils.execution_report(model).pipeline
    assert not pipeline.recomputation
    assert pipeline.stash_bytes[0] > 3 * 2 * 4 * 6  # activations stashed too


@pytest.mark.parametrize("reduction, recompute", [
    ("sum", None), ("running_mean", None), ("mean", "config"),
    ("mean", "config and recomputation_mode"),
])
def test_reductions_and_recomputation_train_like_the_big_batch(reduction, recompute, strategy):
    configure(2, allow_recompute=recompute is not None)
    x, y = data_for("sequential", samples=64)
    with strategy.scope():
        model = _mlp()
    model.set_pipeline_stage_assignment([0, 0, 1, 1])
    plain = keras.Sequential.from_config(model.get_config())
    plain.set_weights(model.get_weights())
    # Summed micro-batch gradients are GA times the big batch's mean gradient.
    plain.compile(optimizer=keras.optimizers.SGD(0.05 * (GA if reduction == "sum" else 1)),
                  loss="mse")
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", steps_per_execution=8)
    kwargs = ({"recomputation_mode": ipu.pipelining_ops.RecomputationMode.Auto}
              if recompute and recompute.endswith("recomputation_mode") else {})
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=GA,
                                 gradient_accumulation_reduction_method=reduction, **kwargs)
    plain.fit(x, y, batch_size=MICRO * GA, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=MICRO, shuffle=False, verbose=0)
    assert_weights_close(plain.get_weights(), model.get_weights(), atol=1e-6)
    assert ipu.utils.execution_report(model).pipeline.recomputation == (recompute is not None)


class _Penalty(keras.layers.Layer):
    """Adds a loss from its input with `add_loss`."""

    def call(self, x):
        self.add_loss(0.01 * keras.ops.mean(keras.ops.square(x)))
        return x


def _regularized():
    l2 = keras.regularizers.L2(0.01)
    return keras.Sequential([
        keras.Input((6,)),
        keras.layers.Dense(8, activation="relu", kernel_regularizer=l2),
        _Penalty(),
        keras.layers.Dense(8, activation="tanh", activity_regularizer=keras.regularizers.L2(0.001)),
        keras.layers.Dense(3, kernel_regularizer=l2, bias_regularizer=l2),
    ])


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: s.name)
def test_regularizers_and_added_losses_count_in_every_stage(schedule, strategy):
    """Weight and activity regularizers and `add_loss` in both stages, as on one IPU."""
    x, y = data_for("sequential", samples=64)
    keras.utils.set_random_seed(3)
    with strategy.scope():
        single = _regularized()
        model = _regularized()
    model.set_weights(single.get_weights())
    model.set_pipeline_stage_assignment([0, 0, 1, 1])
    for m in (single, model):
        m.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", steps_per_execution=8)
    single.set_gradient_accumulation_options(GA, "mean")
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=GA,
                                 gradient_accumulation_reduction_method="mean",
                                 pipeline_schedule=schedule)
    configure(1)
    expected = single.fit(x, y, batch_size=MICRO, shuffle=False, verbose=0).history["loss"]
    expected_eval = single.evaluate(x, y, batch_size=MICRO, verbose=0)
    configure(2)
    history = model.fit(x, y, batch_size=MICRO, shuffle=False, verbose=0).history["loss"]
    assert_weights_close(single.get_weights(), model.get_weights(), atol=1e-6)
    np.testing.assert_allclose(history, expected, rtol=1e-5)
    np.testing.assert_allclose(model.evaluate(x, y, batch_size=MICRO, verbose=0), expected_eval,
                               rtol=1e-5)


def _shared_penalty_model(kind, stage=lambda s: contextlib.nullcontext()):
    """Layers that add losses, called more than once: at the top level in both stages; twice
    inside a nested model whose calls span both stages; in a nested model called twice."""
    inputs = keras.Input((6,))
    penalty, shared = _Penalty(), keras.layers.Dense(
        6, activation="tanh", activity_regularizer=keras.regularizers.L1(0.01))
    if kind == "top_level":
        with stage(0):
            h = shared(penalty(keras.layers.Dense(6)(inputs)))
        with stage(1):
            outputs = keras.layers.Dense(3)(shared(penalty(keras.layers.Dense(6)(h))))
        return keras.Model(inputs, outputs)
    inner_inputs = keras.Input((6,))
    if kind == "inside_nested":  # one call of the nested model: both inner calls count
        with stage(0):
            h = shared(penalty(inner_inputs))
        with stage(1):
            inner_outputs = shared(h)
        features = keras.Model(inner_inputs, inner_outputs)(inputs)  # its layers' stages
        with stage(1):
            return keras.Model(inputs, keras.layers.Dense(3)(features))
    inner = keras.Model(inner_inputs, shared(penalty(inner_inputs)))  # "siamese"
    with stage(0):
        first, second = inner(inputs), inner(keras.layers.Dense(6)(inputs))
    with stage(1):
        return keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Subtract()(
            [first, second])))


@pytest.mark.parametrize("kind", ["top_level", "inside_nested", "siamese"])
def test_a_layer_called_again_adds_the_losses_keras_counts(kind, strategy):
    # Keras clears a layer's added losses at each of the model's own calls of it (or of a
    # nested model holding it): the pipeline counted every call's.
    x, y = data_for("sequential", samples=64)
    keras.utils.set_random_seed(2)
    plain = _shared_penalty_model(kind)
    with strategy.scope():
        model = _shared_penalty_model(kind, ipu.keras.PipelineStage)
    model.set_weights(plain.get_weights())
    for m in (plain, model):
        m.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", steps_per_execution=8)
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=GA,
                                 gradient_accumulation_reduction_method="mean",
                                 device_mapping=[0, 0])  # the stages share the Dense
    configure(1)
    np.testing.assert_allclose(model.evaluate(x, y, batch_size=MICRO, verbose=0),
                               plain.evaluate(x, y, batch_size=MICRO * GA, verbose=0), rtol=1e-5)
    expected = plain.fit(x, y, batch_size=MICRO * GA, shuffle=False, verbose=0).history["loss"]
    history = model.fit(x, y, batch_size=MICRO, shuffle=False, verbose=0).history["loss"]
    np.testing.assert_allclose(history, expected, rtol=1e-5)
    assert_weights_close(plain.get_weights(), model.get_weights(), atol=1e-6)


@pytest.mark.parametrize("penalty, reduction", [(False, "none"), (True, "sum_over_batch_size")])
def test_evaluate_counts_the_stages_losses_only_when_they_add_one(penalty, reduction, strategy):
    # Without additional losses `model.losses` is empty, so a per-sample loss
    # (reduction="none") evaluates, as in plain Keras; an `add_loss` alone still counts.
    x, y = data_for("sequential", samples=32)

    def build():
        return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                                 *([_Penalty()] if penalty else []), keras.layers.Dense(3)])

    keras.utils.set_random_seed(1)
    plain = build()
    with strategy.scope():
        model = build()
    model.set_weights(plain.get_weights())
    model.set_pipeline_stage_assignment([0, 1, 1] if penalty else [0, 1])
    for m in (plain, model):
        m.compile(loss=keras.losses.MeanSquaredError(reduction=reduction), steps_per_execution=4)
    configure(2)
    np.testing.assert_allclose(model.evaluate(x, y, batch_size=MICRO, verbose=0),
                               plain.evaluate(x, y, batch_size=MICRO, verbose=0), rtol=1e-5)
    assert ipu.utils.execution_report(model, "evaluate").flops_per_step > 0  # counted alike


def test_the_stash_keeps_activations_not_weights():
    import jax

    from keras_ipu.keras.pipelined.training import join_residuals, split_residuals

    layer = keras.layers.Dense(32, activation="relu")
    layer.build((4, 16))
    weights = [np.asarray(w) for w in layer.trainable_variables]
    x = np.random.default_rng(0).standard_normal((4, 16)).astype("float32")
    g = np.ones((4, 32), "float32")

    def stage(weights, h):
        return layer.stateless_call(weights, [], h)[0]

    shapes = []

    @jax.jit  # as in the pipelined program: residuals and inputs are traced values
    def grads_from_the_stash(weights, h):
        _, pullback = jax.vjp(stage, weights, h)
        kept, treedef, source = split_residuals(pullback, (weights, h))
        shapes.extend(k.shape for k in kept)
        return join_residuals(treedef, source, kept, (weights, h))(g)

    grads = grads_from_the_stash(weights, x)
    assert shapes and (16, 32) not in shapes and (4, 16) not in shapes  # activations only
    expected = jax.grad(lambda w, h: (stage(w, h) * g).sum(), argnums=(0, 1))(weights, x)
    assert_trees_close(grads, expected, atol=1e-6)


def test_pipelining_options_survive_save_and_load(strategy, tmp_path):
    configure(2)
    with strategy.scope():
        model = _mlp()
        model.set_pipeline_stage_assignment([0, 0, 1, 1])
        model.set_pipelining_options(gradient_accumulation_steps_per_replica=4,
                                     device_mapping=[1, 0], accumulate_outfeed=True)
        model.save(tmp_path / "pipelined.keras")
        loaded = keras.models.load_model(tmp_path / "pipelined.keras")
    assert [a.pipeline_stage for a in loaded.get_pipeline_stage_assignment()] == [0, 0, 1, 1]
    from keras_ipu.keras import options

    restored = options.options_of(loaded)
    assert restored.pipelining_gradient_accumulation_steps_per_replica == 4
    assert restored.pipelining_device_mapping == (1, 0)
    assert restored.pipelining_accumulate_outfeed is True


def test_nested_model_stages_split_inside_the_nested_model(strategy):
    configure(2)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        inner = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                                  keras.layers.Dense(8, activation="relu")])
        inputs = keras.Input((6,))
        model = keras.Model(inputs, keras.layers.Dense(3)(inner(inputs)))
    assignment = model.get_pipeline_stage_assignment()
    assignment[0].pipeline_stage_assignments[0].pipeline_stage = 0
    assignment[0].pipeline_stage_assignments[1].pipeline_stage = 1
    assignment[1].pipeline_stage = 1
    model.set_pipeline_stage_assignment(assignment)
    plain = keras.Model.from_config(model.get_config())
    plain.set_weights(model.get_weights())
    plain.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", steps_per_execution=8)
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=GA,
                                 gradient_accumulation_reduction_method="mean")
    x, y = data_for("sequential", samples=64)
    plain.fit(x, y, batch_size=MICRO * GA, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=MICRO, shuffle=False, verbose=0)
    assert_weights_close(plain.get_weights(), model.get_weights(), atol=1e-6)
    placement = ipu.utils.weight_placement(model)
    devices = [i.device for i in ipu.device.system.current().ipus[:2]]
    assert placement[inner.layers[0].kernel.path] == [devices[0]]
    assert placement[inner.layers[1].kernel.path] == [devices[1]]


def test_a_second_fit_reuses_the_compiled_pipeline(strategy):
    configure(2)
    with strategy.scope():
        model = _mlp()
    model.set_pipeline_stage_assignment([0, 0, 1, 1])
    _fit_pipelined(model, ipu.pipelining_ops.PipelineSchedule.Grouped)
    x, y = data_for("sequential", samples=32)
    model.fit(x, y, batch_size=MICRO, verbose=0)
    from keras_ipu.keras import run

    program = run.program_for(model, "fit")
    model.fit(x, y, batch_size=MICRO, verbose=0)
    assert run.program_for(model, "fit") is program
    assert len(program._executables) == 1
    model.set_pipeline_stage_assignment([0, 1, 1, 1])  # a new plan: a new program
    model.fit(x, y, batch_size=MICRO, verbose=0)
    assert run.program_for(model, "fit") is not program


@pytest.mark.parametrize("form", ["scan", "host"])
def test_the_report_describes_the_batch_size_that_last_ran(form, monkeypatch):
    # Each batch size is its own executable of the one pipelined program, with its own report
    # (before, every report was the first batch size's but for the memory column).
    monkeypatch.setenv("KERAS_IPU_FLAGS", f"--execution_loop={form}")
    configure(2)
    x, y = data_for("sequential", samples=64)

    def fitted(*batch_sizes):
        with ipu.ipu_strategy.IPUStrategy().scope():
            model = _mlp()
        model.set_pipeline_stage_assignment([0, 0, 1, 1])
        _fit_pipelined(model, ipu.pipelining_ops.PipelineSchedule.Grouped, spe=4)
        for batch_size in batch_sizes:
            model.fit(x, y, batch_size=batch_size, verbose=0)
        return model

    def report(model):  # all of it but the compile time
        return dataclasses.replace(ipu.utils.execution_report(model, "fit"), compile_seconds=0)

    from keras_ipu.keras import run

    model = fitted(8)
    program = run.program_for(model, "fit")
    model.fit(x, y, batch_size=2, verbose=0)
    assert run.program_for(model, "fit") is program  # not built again
    assert report(model) == report(fitted(2))
    model.fit(x, y, batch_size=8, verbose=0)  # its executable again, not compiled again
    assert len(program._executables) == 2
    assert report(model) == report(fitted(8))


class _LossRecorder(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs["loss"]))


def test_accumulate_outfeed_averages_the_micro_batches_of_a_pass(strategy):
    configure(2)
    x, y = data_for("sequential", samples=32)
    for accumulate in (False, True):
        with strategy.scope():
            model = _mlp()
        model.set_pipeline_stage_assignment([0, 0, 1, 1])
        model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mae", steps_per_execution=4)
        model.set_pipelining_options(gradient_accumulation_steps_per_replica=4,
                                     accumulate_outfeed=accumulate)
        recorder = _LossRecorder()
        model.fit(x, y, batch_size=2, shuffle=False, verbose=0, callbacks=[recorder])
        batch_logs = recorder.losses
        # The learning rate is 0: the losses are the model's per-batch MAE.
        predictions = model.predict(x, batch_size=2, verbose=0)
        per_batch = np.abs(predictions - y).reshape(16, -1).mean(axis=1)
        running = np.cumsum(per_batch) / np.arange(1, 17)
        expected = running.reshape(4, 4).mean(axis=1) if accumulate else running[3::4]
        np.testing.assert_allclose(batch_logs, expected, rtol=1e-5)
        # The epoch's logs and evaluate() are the last logs the callbacks got, with one
        # replica as with several (the reference's "logs of the last step").
        history = model.fit(x, y, batch_size=2, shuffle=False, verbose=0,
                            callbacks=[recorder := _LossRecorder()])
        assert history.history["loss"][-1] == pytest.approx(recorder.losses[-1], rel=1e-6)
        tested = _LossRecorder()
        tested.on_test_batch_end = tested.on_train_batch_end
        evaluated = model.evaluate(x, y, batch_size=2, verbose=0, callbacks=[tested])
        assert evaluated == pytest.approx(tested.losses[-1], rel=1e-6)


def test_accumulate_outfeed_averages_a_vector_metric_over_the_micro_batches(strategy):
    # F1Score(average=None) logs one value per class: the average over the pass's
    # micro-batches keeps the classes (before, it averaged the classes instead).
    configure(2)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 6)).astype("float32")
    y = np.eye(3, dtype="float32")[rng.integers(0, 3, 16)]
    with strategy.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, "relu"),
                                  keras.layers.Dense(3, "softmax")])
    model.compile(loss="categorical_crossentropy", steps_per_execution=4,
                  metrics=[keras.metrics.F1Score(average=None, name="f1")])
    model.set_pipeline_stage_assignment([0, 1])
    model.set_pipelining_options(accumulate_outfeed=True)
    result = model.evaluate(x, y, batch_size=4, verbose=0, return_dict=True)
    # One pass of 4 micro-batches: the mean of the metric after each of them.
    predictions = model.predict(x, batch_size=4, verbose=0)
    running = []
    for end in (4, 8, 12, 16):
        f1 = keras.metrics.F1Score(average=None)
        f1.update_state(y[:end], predictions[:end])
        running.append(np.asarray(f1.result()))
    assert np.shape(result["f1"]) == (3,)
    np.testing.assert_allclose(result["f1"], np.mean(running, axis=0), rtol=1e-5)


@pytest.mark.parametrize("refrozen", [False, True])
def test_a_pipeline_frozen_after_fit_predicts_and_evaluates_and_refuses_to_train(
        refrozen, strategy):
    # Inference needs no optimizer (before, Adam's copies failed to split); training
    # another set of weights takes compile(), as in Keras, the weights kept.
    model, plain, x, y = _staged_mlp_and_twin(strategy, "adam")
    model.fit(x, y, batch_size=MICRO, verbose=0)
    plain.set_weights(model.get_weights())
    for each in (model, plain):
        each.layers[0].trainable = False
        if refrozen:  # as many trainable variables as before, other ones
            each.layers[0].trainable, each.layers[1].trainable = True, False
    np.testing.assert_allclose(model.predict(x, batch_size=MICRO, verbose=0),
                               plain.predict(x, batch_size=MICRO, verbose=0), atol=1e-6)
    assert model.evaluate(x, y, batch_size=MICRO, verbose=0) == pytest.approx(
        plain.evaluate(x, y, batch_size=MICRO, verbose=0), rel=1e-6)
    weights = model.get_weights()
    with pytest.raises(ValueError, match="was built with 8 variables|compile\\(\\) again"):
        model.fit(x, y, batch_size=MICRO, verbose=0)
    assert_weights_close(weights, model.get_weights(), atol=0)


@pytest.mark.parametrize("form", ["scan", "host"])
def test_recomputation_draws_the_forward_ops_dropout_masks(form, monkeypatch):
    # The backward op recomputes the stage with the seed state its forward op found: later
    # forward ops have moved it. Plain Keras' accumulation draws the same masks.
    monkeypatch.setenv("KERAS_IPU_FLAGS", f"--execution_loop={form}")
    configure(2, allow_recompute=True)
    x, y = data_for("sequential", samples=32)

    def build():
        keras.utils.set_random_seed(4)
        return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                                 keras.layers.Dropout(0.5), keras.layers.Dense(3)])

    plain = build()
    plain.compile(optimizer=keras.optimizers.SGD(0.05, gradient_accumulation_steps=4),
                  loss="mse")
    plain.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    with ipu.ipu_strategy.IPUStrategy().scope():
        model = build()
    model.set_pipeline_stage_assignment([0, 0, 1])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", steps_per_execution=8)
    model.set_pipelining_options(
        4, gradient_accumulation_reduction_method="mean",
        recomputation_mode=ipu.pipelining_ops.RecomputationMode.RecomputeThenBackpropagate)
    model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    assert_weights_close(plain.get_weights(), model.get_weights(), atol=1e-6)
    assert ipu.utils.execution_report(model, "fit").pipeline.recomputation


@pytest.mark.parametrize("form", ["scan", "host"])
def test_each_ipu_reports_the_state_of_its_own_stages(form, monkeypatch):
    # The program holds every IPU's state padded to the largest; an IPU holds its own.
    monkeypatch.setenv("KERAS_IPU_FLAGS", f"--execution_loop={form}")
    configure(2)
    with ipu.ipu_strategy.IPUStrategy().scope():
        model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(32),
                                  keras.layers.Dense(2)])
    model.set_pipeline_stage_assignment([0, 1])
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=4)
    model.compile(optimizer="adam", loss="mse", steps_per_execution=4)
    x = np.ones((16, 32), np.float32)
    model.fit(x, x[:, :2], batch_size=2, verbose=0)
    first, second = ipu.utils.execution_report(model, "fit").ipus
    # Weights and Adam's two slots, 4 bytes each; the optimizer's iteration counters.
    assert 3 * 4 * (32 * 32 + 32) <= first.state_bytes < 3 * 4 * (32 * 32 + 32) + 64
    assert 3 * 4 * (32 * 2 + 2) <= second.state_bytes < 3 * 4 * (32 * 2 + 2) + 64
    # Its io is the data its stages stream: the first stage's a micro-batch of inputs, the
    # last's its targets and the loss. Before, the host form gave each IPU all of it (twice
    # the data), the schedule form an equal share.
    assert first.io_bytes == 2 * 32 * 4
    assert 2 * 2 * 4 <= second.io_bytes <= 2 * 2 * 4 + 4


def test_a_recomputing_stage_stashes_its_non_trainable_values_too():
    # Its backward op recomputes with the values its forward op found (BatchNorm's moving
    # statistics here): the report's stash counts them once per micro-batch held.
    configure(2, allow_recompute=True)
    with ipu.ipu_strategy.IPUStrategy().scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8),
                                  keras.layers.BatchNormalization(), keras.layers.Dense(3)])
    model.set_pipeline_stage_assignment([0, 0, 1])
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=4)
    model.set_pipelining_options(
        gradient_accumulation_steps_per_replica=4,
        recomputation_mode=ipu.pipelining_ops.RecomputationMode.RecomputeThenBackpropagate)
    x, y = data_for("sequential", samples=16)
    model.fit(x, y, batch_size=2, verbose=0)
    pipeline = ipu.utils.execution_report(model, "fit").pipeline
    counts = pipeline.stash_counts
    # Stage 0: its 6 float32 inputs per sample and BatchNorm's 2 x 8 moving statistics.
    assert pipeline.stash_bytes[0] == counts[0] * (2 * 4 * 6 + 4 * 16)
    assert pipeline.stash_bytes[1] == counts[1] * 2 * 4 * 8  # no non-trainable values


def _stage_scope(staged: bool):
    """`PipelineStage`, or a scope that stages nothing (the plain twin of a staged model)."""
    return ipu.keras.PipelineStage if staged else (lambda stage: contextlib.nullcontext())


def _compile_twins(plain, model, accumulation: int, steps_per_execution: int,
                   learning_rate: float) -> None:
    """Plain Keras with SGD, and the pipeline accumulating the mean of `accumulation` batches."""
    plain.compile(optimizer=keras.optimizers.SGD(learning_rate), loss="mse")
    model.compile(optimizer=keras.optimizers.SGD(learning_rate), loss="mse",
                  steps_per_execution=steps_per_execution)
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=accumulation,
                                 gradient_accumulation_reduction_method="mean")


class _AddTwo(keras.layers.Layer):
    """`t + 2`, typed as its input (a `Lambda`'s output is float32 in Keras' graph)."""

    def call(self, t):
        return t + 2

    def compute_output_spec(self, t):
        return keras.KerasTensor(t.shape, t.dtype)


def _int_crossing_model(staged: bool):
    stage = _stage_scope(staged)
    keras.utils.set_random_seed(2)
    a, ids = keras.Input((4,)), keras.Input((1,), dtype="int32")
    with stage(0):
        h = keras.layers.Dense(3)(a)
        shifted = _AddTwo()(ids)
    with stage(1):
        out = keras.layers.Lambda(
            lambda t: t[0] + keras.ops.cast(t[1] % 1000, "float32"))([h, shifted])
    return keras.Model([a, ids], out)


def test_32_bit_integers_cross_stages_exactly(strategy):
    # A float32 cast rounds integers above 2**24: they cross as their bits.
    configure(2)
    x = np.random.default_rng(0).random((8, 4), np.float32)
    ids = (2**24 + 1 + np.arange(8) * 12345).reshape(8, 1).astype(np.int32)
    y = np.zeros((8, 3), np.float32)
    plain = _int_crossing_model(staged=False)
    with strategy.scope():
        model = _int_crossing_model(staged=True)
    _compile_twins(plain, model, accumulation=2, steps_per_execution=2, learning_rate=0.01)
    np.testing.assert_array_equal(model.predict([x, ids], batch_size=2, verbose=0),
                                  plain.predict([x, ids], batch_size=2, verbose=0))
    plain.fit([x, ids], y, batch_size=4, shuffle=False, verbose=0)
    model.fit([x, ids], y, batch_size=2, shuffle=False, verbose=0)
    assert_weights_close(plain.get_weights(), model.get_weights(), atol=1e-6)


def _typed_outputs_model(staged: bool):
    stage = _stage_scope(staged)
    keras.utils.set_random_seed(3)
    inputs = keras.Input((3,))
    with stage(0):
        h = keras.layers.Dense(4)(inputs)
        # int32 when it runs, float32 in Keras' graph (a Lambda's compute dtype).
        big = keras.layers.Lambda(
            lambda t: keras.ops.cast(t[:, :1] * 0, "int32") + 2**24 + 1, name="big")(h)
        early = keras.ops.greater(h[:, :1], 0)
    with stage(1):
        out = keras.layers.Dense(1)(h)
        late = keras.ops.greater(out, 0)
    return keras.Model(inputs, {"out": out, "big": big, "early": early, "late": late})


def test_predictions_keep_the_types_the_layers_give_them(strategy):
    # Before: a Lambda's int32 output crossed stages as float32 (2**24 + 1 rounded), and
    # booleans came back int32.
    configure(2)
    x = np.random.default_rng(0).normal(size=(8, 3)).astype("float32")
    plain = _typed_outputs_model(staged=False)
    with strategy.scope():
        model = _typed_outputs_model(staged=True)
    model.compile(steps_per_execution=2)
    expected = plain.predict(x, batch_size=2, verbose=0)
    predicted = model.predict(x, batch_size=2, verbose=0)
    for name, value in expected.items():
        assert predicted[name].dtype == value.dtype, name
        np.testing.assert_array_equal(predicted[name], value)


class _Penalized(keras.Model):
    """A compute_loss override reading a layer's weight (a hand-written penalty)."""

    penalized = "head"

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        kernel = self.get_layer(self.penalized).kernel
        return keras.ops.mean((y_pred - y) ** 2) + 5.0 * keras.ops.sum(kernel ** 2)


def _penalized(penalized: str, staged: bool = True) -> keras.Model:
    stage = _stage_scope(staged)
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    with stage(0):
        hidden = keras.layers.Dense(8, activation="relu", name="body")(inputs)
    with stage(1):
        outputs = keras.layers.Dense(3, name="head")(hidden)
    model = _Penalized(inputs, outputs)
    model.penalized = penalized
    return model


def test_a_loss_reading_the_last_stages_weights_trains_as_in_keras(strategy):
    # Before: the penalty read the weight's stale Keras value and got no gradient.
    configure(2)
    x, y = data_for("sequential", samples=32)
    plain = _penalized("head", staged=False)
    with strategy.scope():
        model = _penalized("head")
    _compile_twins(plain, model, accumulation=GA, steps_per_execution=GA, learning_rate=0.05)
    plain.fit(x, y, batch_size=MICRO * GA, epochs=2, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=MICRO, epochs=2, shuffle=False, verbose=0)
    assert_weights_close(plain.get_weights(), model.get_weights(), atol=1e-6)
    assert model.evaluate(x, y, batch_size=MICRO, verbose=0) == pytest.approx(
        plain.evaluate(x, y, batch_size=MICRO, verbose=0), rel=1e-5)


def test_a_loss_reading_another_stages_weights_is_refused_before_any_step(strategy):
    configure(2)
    x, y = data_for("sequential", samples=32)
    with strategy.scope():
        model = _penalized("body")
    model.compile(optimizer="sgd", steps_per_execution=GA)
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=GA)
    weights = model.get_weights()
    with pytest.raises(ValueError, match="The loss reads `body/kernel`, a weight of a pipeline "
                                         "stage other than the last"):
        model.fit(x, y, batch_size=MICRO, verbose=0)
    assert_weights_close(weights, model.get_weights(), atol=0)


def _masked_tagger(staged: bool) -> keras.Model:
    stage = _stage_scope(staged)
    keras.utils.set_random_seed(0)
    tokens = keras.Input((6,), dtype="int32")
    with stage(0):
        embedded = keras.layers.Embedding(20, 8, mask_zero=True)(tokens)
    with stage(1):
        tags = keras.layers.Dense(5)(embedded)
    return keras.Model(tokens, tags)


@pytest.mark.parametrize("form", ["scan", "host"])
def test_training_metrics_see_the_predictions_as_in_keras_without_their_mask(form, monkeypatch):
    # Keras' JAX train step gives its metrics `y_pred` from value_and_grad, without its
    # Keras mask (the loss masks): the pipeline's accuracy was the masked one (0.1875).
    monkeypatch.setenv("KERAS_IPU_FLAGS", f"--execution_loop={form}")
    configure(2)
    rng = np.random.default_rng(28)
    tokens = rng.integers(1, 20, size=(64, 6))
    tokens[:, -3:] = 0
    labels = rng.integers(0, 5, size=(64, 6))
    plain = _masked_tagger(staged=False)
    with ipu.ipu_strategy.IPUStrategy().scope():
        model = _masked_tagger(staged=True)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    plain.compile(keras.optimizers.SGD(0.1), loss, metrics=["accuracy"])
    model.compile(keras.optimizers.SGD(0.1), loss, metrics=["accuracy"], steps_per_execution=8)
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=4,
                                 gradient_accumulation_reduction_method="mean")
    expected = plain.fit(tokens, labels, batch_size=16, shuffle=False, verbose=0).history
    history = model.fit(tokens, labels, batch_size=4, shuffle=False, verbose=0).history
    np.testing.assert_allclose(history["accuracy"], expected["accuracy"], rtol=1e-6)
    np.testing.assert_allclose(history["loss"], expected["loss"], rtol=1e-5)


def test_a_tensor_without_the_batch_axis_cannot_cross_stages(strategy):
    configure(2)
    with strategy.scope():
        inputs = keras.Input((4,))
        with ipu.keras.PipelineStage(0):
            h = keras.layers.Dense(6)(inputs)
            mean = keras.layers.Lambda(lambda t: keras.ops.mean(t, axis=0, keepdims=True))(h)
        with ipu.keras.PipelineStage(1):
            out = keras.layers.Add()([h, mean])
        model = keras.Model(inputs, out)
        model.compile(steps_per_execution=2)
    with pytest.raises(ValueError, match=r"stage 0 sends .* of shape \(1, 6\) .* the batch \(2 "):
        model.predict(np.ones((4, 4), np.float32), batch_size=2, verbose=0)


class _TwiceCall(keras.Model):
    def call(self, inputs, training=None, mask=None):
        return super().call(inputs, training=training, mask=mask) * 2.0


class _OwnSteps(keras.Model):
    def test_step(self, state, data):
        logs, state = super().test_step(state, data)
        return {**logs, "extra": logs["loss"] * 2}, state

    def predict_step(self, state, data):
        outputs, non_trainable = super().predict_step(state, data)
        return {"y": outputs}, non_trainable


@pytest.mark.parametrize("cls, mode, name", [
    (_TwiceCall, "fit", "call"), (_TwiceCall, "evaluate", "call"),
    (_TwiceCall, "predict", "call"), (_OwnSteps, "evaluate", "test_step"),
    (_OwnSteps, "predict", "predict_step"), (_OwnSteps, "validate", "test_step"),
    (_OwnSteps, "split", "test_step")])
def test_overrides_a_pipeline_would_ignore_are_refused(cls, mode, name, strategy):
    # As the reference: the stages are the graph's calls and the step the schedule's.
    configure(2)
    with strategy.scope():
        inputs = keras.Input((5,))
        with ipu.keras.PipelineStage(0):
            h = keras.layers.Dense(8)(inputs)
        with ipu.keras.PipelineStage(1):
            out = keras.layers.Dense(2)(h)
        model = cls(inputs, out)
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=4)
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=4)
    x, y = np.ones((16, 5), np.float32), np.ones((16, 2), np.float32)
    before = model.get_weights()
    run = {"fit": lambda: model.fit(x, y, batch_size=1, verbose=0),
           "evaluate": lambda: model.evaluate(x, y, batch_size=1, verbose=0),
           "predict": lambda: model.predict(x, batch_size=1, verbose=0),
           # fit's validation runs test_step too (before, the override was dropped silently)
           "validate": lambda: model.fit(x, y, batch_size=1, verbose=0, validation_data=(x, y)),
           "split": lambda: model.fit(x, y, batch_size=1, verbose=0, validation_split=0.5),
           }[mode]
    with pytest.raises(RuntimeError, match=f"`{name}` for the model .* has been overridden"):
        run()
    assert_weights_close(before, model.get_weights(), atol=0)


def _masked_sequential():
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((6,), dtype="int32"),
                             keras.layers.Embedding(10, 4, mask_zero=True),
                             keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)])


def test_a_sequential_model_with_a_mask_pipelines_as_plain_keras_trains(strategy):
    # Keras puts the mask op (`not_equal`) between the layers of the Sequential's graph: it
    # runs in the stage of the layer that takes the mask (before, a KeyError).
    configure(2)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 10, (32, 6)).astype(np.int32)
    x[:, 4:] = 0
    y = rng.random((32, 1)).astype(np.float32)
    plain = _masked_sequential()
    with strategy.scope():
        model = _masked_sequential()
    model.set_pipeline_stage_assignment([0, 1, 1])
    _compile_twins(plain, model, accumulation=4, steps_per_execution=4, learning_rate=0.1)
    np.testing.assert_allclose(model.predict(x, batch_size=2, verbose=0),
                               plain.predict(x, batch_size=2, verbose=0), atol=1e-6)
    plain.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=2, shuffle=False, verbose=0)
    assert_weights_close(plain.get_weights(), model.get_weights(), atol=1e-6)


def _masked_attention(staged: bool):
    stage = _stage_scope(staged)
    keras.utils.set_random_seed(1)
    inputs = keras.Input((6, 4))
    with stage(0):
        masked = keras.layers.Masking()(inputs)
    with stage(1):
        attended = keras.layers.MultiHeadAttention(2, 2)(masked, masked)
        outputs = keras.layers.Dense(1)(attended)
    return keras.Model(inputs, outputs)


@pytest.mark.parametrize("form", ["scan", "host"])
def test_a_mask_on_a_tensor_crosses_stages_with_it(form, strategy, monkeypatch):
    # A mask Keras keeps on the tensor (Masking's) reaches the attention in the next stage
    # and masks the loss, as in plain Keras (before, it was dropped at the boundary).
    monkeypatch.setenv("KERAS_IPU_FLAGS", f"--execution_loop={form}")
    configure(2)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 6, 4)).astype(np.float32)
    x[:, 3:] = 0
    y = rng.normal(size=(16, 6, 1)).astype(np.float32)
    plain = _masked_attention(staged=False)
    with strategy.scope():
        model = _masked_attention(staged=True)
    _compile_twins(plain, model, accumulation=4, steps_per_execution=4, learning_rate=0.1)
    np.testing.assert_allclose(model.predict(x, batch_size=1, verbose=0),
                               plain.predict(x, batch_size=1, verbose=0), atol=1e-6)
    assert model.evaluate(x, y, batch_size=1, verbose=0) == pytest.approx(
        plain.evaluate(x, y, batch_size=1, verbose=0), rel=1e-6)
    plain.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=1, shuffle=False, verbose=0)
    assert_weights_close(plain.get_weights(), model.get_weights(), atol=1e-6)


class _Unchanged(keras.layers.Layer):
    """Returns its input: the graph drops its mask (no `supports_masking`), the value not."""

    def call(self, x):
        return x


@pytest.mark.parametrize("form", ["scan", "host"])
def test_a_mask_the_value_keeps_past_the_graph_crosses_stages_and_the_export(form, strategy,
                                                                            monkeypatch, tmp_path):
    # Before: sent only where the graph's tensor had a mask, so the LSTM in the next stage
    # (and in the export's) ran over the padding: plain Keras' model without the mask.
    monkeypatch.setenv("KERAS_IPU_FLAGS", f"--execution_loop={form}")
    configure(2)

    def make():
        keras.utils.set_random_seed(0)
        return keras.Sequential([
            keras.Input((7,), dtype="int32"), keras.layers.Embedding(20, 8, mask_zero=True),
            _Unchanged(), keras.layers.LSTM(6), keras.layers.Dense(3)])

    plain = make()
    with strategy.scope():
        model = make()
    model.set_pipeline_stage_assignment([0, 0, 1, 1])  # the unchanged tensor crosses
    _compile_twins(plain, model, accumulation=4, steps_per_execution=4, learning_rate=0.1)
    rng = np.random.default_rng(0)
    x, y = rng.integers(1, 20, size=(16, 7)).astype("int32"), rng.normal(size=(16, 3))
    x[:, 4:] = 0
    np.testing.assert_allclose(model.predict(x, batch_size=4, verbose=0),
                               plain.predict(x, batch_size=4, verbose=0), atol=1e-6)
    runtime = model.export_for_ipu_serving(tmp_path / "e", batch_size=4)
    np.testing.assert_allclose(runtime(x[:4]), plain.predict(x[:4], verbose=0), atol=1e-6)
    plain.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=1, shuffle=False, verbose=0)
    assert_weights_close(plain.get_weights(), model.get_weights(), atol=1e-6)


def _open_axis_model(kind: str):
    """A model whose tensor crossing stages 0 | 1 has an axis the graph leaves `None`."""
    keras.utils.set_random_seed(3)
    if kind == "dense":  # (batch, None, 8) crosses
        return keras.Sequential([keras.Input((None, 4)), keras.layers.Dense(8, activation="relu"),
                                 keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(3)])
    return keras.Sequential([keras.Input((None,), dtype="int32"),  # (batch, None, 6) crosses
                             keras.layers.Embedding(20, 6), keras.layers.LSTM(8),
                             keras.layers.Dense(3)])


def _open_axis_data(kind: str, length: int, rng):
    if kind == "dense":
        x = rng.normal(size=(32, length, 4)).astype(np.float32)
    else:
        x = rng.integers(1, 20, size=(32, length)).astype(np.int32)
    return x, rng.normal(size=(32, 3)).astype(np.float32)


@pytest.mark.parametrize("form", ["scan", "host"])
@pytest.mark.parametrize("kind", ["dense", "lstm"])
def test_an_axis_the_graph_leaves_open_crosses_stages_at_the_datas_length(kind, form, strategy,
                                                                           monkeypatch):
    # The bundle between stages takes the axis' length from the data each program is built
    # for, as plain Keras trains on fixed-length data (before, a TypeError on `None * int`).
    monkeypatch.setenv("KERAS_IPU_FLAGS", f"--execution_loop={form}")
    configure(2)
    rng = np.random.default_rng(0)
    plain = _open_axis_model(kind)
    with strategy.scope():
        model = _open_axis_model(kind)
    model.set_pipeline_stage_assignment([0, 1, 1])
    _compile_twins(plain, model, accumulation=4, steps_per_execution=4, learning_rate=0.1)
    for length in (7, 5):  # another length: another program, another bundle
        x, y = _open_axis_data(kind, length, rng)
        np.testing.assert_allclose(model.predict(x, batch_size=2, verbose=0),
                                   plain.predict(x, batch_size=2, verbose=0), atol=1e-6)
        expected = plain.fit(x, y, batch_size=8, shuffle=False, verbose=0).history["loss"]
        losses = model.fit(x, y, batch_size=2, shuffle=False, verbose=0).history["loss"]
        np.testing.assert_allclose(losses, expected, rtol=1e-5)
        assert_weights_close(plain.get_weights(), model.get_weights(), atol=1e-6)
        assert model.evaluate(x, y, batch_size=2, verbose=0) == pytest.approx(
            plain.evaluate(x, y, batch_size=2, verbose=0), rel=1e-5)
    stash = ipu.utils.execution_report(model, "fit").pipeline.stash_bytes
    assert all(b > 0 for b in stash)


def test_global_clipnorm_with_the_optimizers_own_accumulation_is_refused(strategy):
    # The pipeline clips each call's gradients over every IPU; Keras clips their average.
    configure(2)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(2)])
    model.set_pipeline_stage_assignment([0, 1])
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=4)
    model.compile(keras.optimizers.SGD(1.0, gradient_accumulation_steps=2, global_clipnorm=0.05),
                  "mse", steps_per_execution=4)
    before = model.get_weights()
    x = np.ones((16, 4), np.float32)
    with pytest.raises(ValueError, match=r"global_clipnorm \(0.05\) and its own "
                                         r"gradient_accumulation_steps \(2\)"):
        model.fit(x, np.ones((16, 2), np.float32), batch_size=1, verbose=0)
    assert_weights_close(before, model.get_weights(), atol=0)
    assert model.predict(x, batch_size=1, verbose=0).shape == (16, 2)  # still usable


@pytest.mark.parametrize("loop", ["schedule", "host"])
def test_ipus_the_device_mapping_skips_hold_nothing_in_the_report(loop, strategy, monkeypatch):
    # device_mapping [0, 3]: IPUs 1 and 2 run no stage (before, the schedule form gave them
    # the program's temporaries, the host form its padded optimizer step's).
    if loop == "host":
        monkeypatch.setenv("KERAS_IPU_FLAGS", "--execution_loop=host")
    configure(4)
    with strategy.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8),
                                  keras.layers.Dense(3)])
        model.set_pipeline_stage_assignment([0, 1])
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=4)
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=4,
                                 device_mapping=[0, 3])
    x, y = data_for("sequential", samples=16)
    model.fit(x, y, batch_size=4, verbose=0)
    report = ipu.utils.execution_report(model, "fit")
    assert report.loop == loop and len(report.ipus) == 4
    assert [ipu_report.memory_bytes == 0 for ipu_report in report.ipus] == [
        False, True, True, False]


@pytest.mark.parametrize("mode", ["fit", "predict"])
def test_an_unbuilt_subclass_with_stage_scopes_fed_a_generator_is_refused_until_built(
        mode, strategy):
    # Before: it ran unpipelined, as data-parallel replicas, silently (other weights).
    configure(4)
    x, y = data_for("sequential", samples=64)

    def batches():
        for i in range(0, 64, MICRO):
            yield (x[i:i + MICRO], y[i:i + MICRO]) if mode == "fit" else (x[i:i + MICRO],)

    with strategy.scope():
        model = FourStages()
    _fit_pipelined(model, ipu.ops.pipelining_ops.PipelineSchedule.Grouped)
    run = {"fit": lambda: model.fit(batches(), steps_per_epoch=16, verbose=0),
           "predict": lambda: model.predict(batches(), steps=16, verbose=0)}[mode]
    with pytest.raises(RuntimeError, match="enters `PipelineStage` scopes, but it was not built"):
        run()
    assert int(model.optimizer.iterations) == 0
    run()  # built now: pipelined
    assert ipu.utils.execution_report(model, mode).pipeline.num_stages == 4


class _WithStateNoStageHolds(keras.Model):
    """Two stages; an unused Dropout (its seed state in no stage), and optionally a weight
    or seed generator of the model's own, read by the last stage."""

    def __init__(self, staged=True, own=None):
        super().__init__()
        self.staged, self.own = staged, own
        self.hidden, self.out = keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)
        self.spare = keras.layers.Dropout(0.5)
        if own == "seed":
            self.seed = keras.random.SeedGenerator(7)
        elif own is not None:
            self.scale = self.add_weight(shape=(), initializer="ones", name="scale",
                                         trainable=own == "trainable")

    def call(self, inputs):
        with ipu.keras.PipelineStage(0) if self.staged else contextlib.nullcontext():
            hidden = self.hidden(inputs)
        with ipu.keras.PipelineStage(1) if self.staged else contextlib.nullcontext():
            outputs = self.out(hidden)
            if self.own == "seed":
                return outputs + keras.random.normal(keras.ops.shape(outputs), seed=self.seed)
            return outputs * self.scale if self.own else outputs


def test_the_state_of_a_layer_no_stage_calls_stays_on_the_host(strategy):
    # Before: fit and predict failed ("None is not a valid value for jnp.array") after the
    # weights had changed, and the variables were left empty: the model was unusable.
    configure(2)
    x, y = data_for("sequential", samples=32)
    plain = _WithStateNoStageHolds(staged=False)
    plain(x[:2])
    with strategy.scope():
        on_ipu = _WithStateNoStageHolds()
        on_ipu(x[:2])
    on_ipu.set_weights(plain.get_weights())
    on_ipu.set_pipelining_options(gradient_accumulation_steps_per_replica=4,
                                  gradient_accumulation_reduction_method="mean")
    for model, spe in ((plain, 1), (on_ipu, 4)):
        model.compile(keras.optimizers.SGD(0.05), "mse", steps_per_execution=spe)
    seed = on_ipu.spare.seed_generator.state.numpy().copy()
    plain.fit(x, y, batch_size=16, shuffle=False, verbose=0)  # 4 micro-batches of 4
    on_ipu.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    assert_weights_close(plain.get_weights(), on_ipu.get_weights(), atol=1e-6)
    np.testing.assert_allclose(on_ipu.predict(x, batch_size=4, verbose=0),
                               plain.predict(x, batch_size=4, verbose=0), atol=1e-6)
    np.testing.assert_array_equal(on_ipu.spare.seed_generator.state.numpy(), seed)


@pytest.mark.parametrize("own", ["trainable", "untrainable", "seed"])
def test_variables_of_the_models_own_are_refused_by_name(own, strategy):
    # A stage would read them as its trace's constants: a seed generator's noise frozen,
    # a weight not trained (before: an unnamed refusal, or a crash that emptied them).
    configure(2)
    x, _ = data_for("sequential", samples=8)
    with strategy.scope():
        model = _WithStateNoStageHolds(own=own)
        model(x[:4])  # the batch of the run: the noise's shape needs it
    model.compile("sgd", "mse", steps_per_execution=2)
    before = model.get_weights()
    name = "seed_generator_state" if own == "seed" else "scale"
    with pytest.raises(ValueError, match=rf"\['[^]]*{name}'\] belong to none .* `add_weight`"):
        model.predict(x, batch_size=4, verbose=0)
    assert_weights_close(before, model.get_weights(), atol=0)  # nothing lost


class _UsesTheBatchSize(keras.Model):
    def __init__(self, staged=True):
        super().__init__()
        self.staged = staged
        self.hidden, self.out = keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)

    def call(self, inputs):
        with ipu.keras.PipelineStage(0) if self.staged else contextlib.nullcontext():
            hidden = self.hidden(inputs)
        with ipu.keras.PipelineStage(1) if self.staged else contextlib.nullcontext():
            rows = keras.ops.shape(hidden)[0]
            offsets = keras.ops.cast(keras.ops.arange(rows), "float32")[:, None]
            return self.out(keras.ops.reshape(hidden, (-1, 4, 2))[:, 0] + offsets)


def test_a_pipelined_functional_model_with_a_fixed_input_batch_runs_any_batch(strategy):
    # The seed: "Always set batch_size if model has explicit input layers". Other batch
    # sizes were refused ("traced for batches of 4"); Keras runs the layers on any batch.
    configure(2)

    def build(stage):
        inputs = keras.Input((6,), batch_size=4)
        with stage(0):
            hidden = keras.layers.Dense(8, activation="tanh")(inputs)
        with stage(1):
            return keras.Model(inputs, keras.layers.Dense(1)(hidden))

    x, y = data_for("sequential", samples=32)
    y = y[:, :1]
    plain = build(lambda stage: contextlib.nullcontext())
    with strategy.scope():
        model = build(ipu.keras.PipelineStage)
    model.set_weights(plain.get_weights())
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=2,
                                 gradient_accumulation_reduction_method="mean")
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", steps_per_execution=2)
    plain.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    np.testing.assert_allclose(model.predict(x, batch_size=8, verbose=0),
                               plain.predict(x, batch_size=8, verbose=0), atol=1e-6)
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    plain.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    assert_weights_close(plain.get_weights(), model.get_weights(), atol=1e-6)


class _FlattensThreeDimensions(keras.Model):
    """A subclassed model whose `call` branches on its input's rank."""

    def __init__(self):
        super().__init__()
        self.flatten, self.hidden, self.out = (keras.layers.Flatten(), keras.layers.Dense(4),
                                               keras.layers.Dense(1))

    def call(self, x):
        if len(x.shape) == 3:
            x = self.flatten(x)
        with ipu.keras.PipelineStage(0):
            hidden = self.hidden(x)
        with ipu.keras.PipelineStage(1):
            return self.out(hidden)


def test_a_subclassed_pipeline_given_inputs_of_another_shape_than_traced_says_so(strategy):
    # Its graph was traced for (None, 6): Keras' shape error from the Dense layer, which
    # the traced graph (without the Flatten) fed the (2, 2, 3) batch.
    configure(2)
    with strategy.scope():
        model = _FlattensThreeDimensions()
        model(np.ones((2, 6), "float32"))
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=2)
    model.compile("sgd", "mse", steps_per_execution=2)
    before = model.get_weights()
    with pytest.raises(ValueError, match=r"traced for inputs of shapes \[\(None, 6\)\], and "
                                         r"this run's are \[\(None, 2, 3\)\]"):
        model.fit(np.ones((8, 2, 3)), np.ones((8, 1)), batch_size=2, verbose=0)
    assert_weights_close(before, model.get_weights(), atol=0)
    model.fit(np.ones((8, 6)), np.ones((8, 1)), batch_size=2, verbose=0)  # as traced


def test_a_subclassed_pipeline_bound_to_its_first_calls_batch_size_runs_only_that(strategy):
    # Built by a call on 1 row, the graph kept that batch size: `arange(rows)` was the
    # constant [0] and the predictions of 4-row batches were silently wrong. A graph that
    # needs a batch size is traced for the build's, and other batch sizes are refused.
    configure(2)
    x, _ = data_for("sequential", samples=16)
    plain = _UsesTheBatchSize(staged=False)
    plain(x[:4])
    for rows in (1, 4):
        with strategy.scope():
            model = _UsesTheBatchSize()
            model(x[:rows])
        model.set_weights(plain.get_weights())
        model.compile(steps_per_execution=4)
        if rows == 1:
            with pytest.raises(ValueError, match="traced for batches of 1 .* have 4 samples"):
                model.predict(x, batch_size=4, verbose=0)
    np.testing.assert_allclose(model.predict(x, batch_size=4, verbose=0),
                               plain.predict(x, batch_size=4, verbose=0), atol=1e-6)


def test_the_report_of_a_fit_is_read_after_a_layer_was_frozen_since(strategy):
    # The report is worked out when first read: before, a layer frozen after the fit (a
    # fine-tuning step) made it fail with a KeyError from the stage tracer.
    configure(2)
    x = np.random.default_rng(0).random((32, 16), "float32")
    reports = []
    for freeze in (False, True):
        keras.utils.set_random_seed(0)
        with strategy.scope():
            model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(16),
                                      keras.layers.Dense(16)])
        model.set_pipeline_stage_assignment([0, 1])
        model.set_pipelining_options(gradient_accumulation_steps_per_replica=4)
        model.compile("sgd", "mse", steps_per_execution=8)
        model.fit(x, x, batch_size=4, verbose=0)
        model.layers[0].trainable = not freeze
        reports.append(ipu.utils.execution_report(model, "fit"))
        # The program's weights, where they live (an IndexError after the freeze).
        assert list(ipu.utils.weight_placement(model, "fit")) == [
            v.path for layer in model.layers for v in (layer.kernel, layer.bias)]
        # The model keeps the flags it was given.
        assert len(model.trainable_variables) == (2 if freeze else 4)
        assert model.layers[0].kernel.trainable is not freeze
    assert reports[1].flops_per_step == reports[0].flops_per_step > 0
    assert reports[1].estimated_cycles == reports[0].estimated_cycles


class _TiedHead(keras.layers.Layer):
    """Logits from an embedding's matrix (a GPT's tied input and output embedding)."""

    def __init__(self, embedding, **kwargs):
        super().__init__(**kwargs)
        self.embedding = embedding

    def call(self, h):
        return keras.ops.matmul(h, keras.ops.transpose(self.embedding.embeddings))


@pytest.mark.parametrize("form", ["scan", "host"])
def test_a_running_mean_accumulates_a_weight_two_stages_use_as_the_big_batch(form,
                                                                             monkeypatch):
    # Each stage's backward op rescaled the running mean for its own part of a micro-batch's
    # gradient: a tied embedding's was weighed twice (2.4e-3 off plain Keras).
    monkeypatch.setenv("KERAS_IPU_FLAGS", f"--execution_loop={form}")
    configure(1)

    def build(staged):
        stage = ipu.keras.PipelineStage if staged else (lambda s: contextlib.nullcontext())
        ids = keras.Input((4,), dtype="int32")
        with stage(0):
            embedding = keras.layers.Embedding(20, 8)
            h = keras.layers.Dense(8, activation="tanh")(embedding(ids))
        with stage(1):
            logits = _TiedHead(embedding)(h)
        return keras.Model(ids, logits)

    rng = np.random.default_rng(0)
    x = rng.integers(0, 20, (16, 4)).astype("int32")
    y = np.roll(x, -1, 1)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    keras.utils.set_random_seed(0)
    plain = build(False)
    plain.compile(optimizer=keras.optimizers.SGD(0.5), loss=loss)
    with ipu.ipu_strategy.IPUStrategy().scope():
        model = build(True)
    model.set_weights(plain.get_weights())
    plain.fit(x, y, batch_size=8, shuffle=False, verbose=0)  # 4 micro-batches of 2
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=4, device_mapping=[0, 0],
                                 gradient_accumulation_reduction_method="running_mean")
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss=loss, steps_per_execution=4)
    model.fit(x, y, batch_size=2, shuffle=False, verbose=0)
    assert_weights_close(plain.get_weights(), model.get_weights(), atol=1e-6)
    assert ipu.utils.execution_report(model, "fit").loop == (
        "host" if form == "host" else "schedule")


@pytest.mark.parametrize("schedule", ["Sequential", None])
def test_an_uncompiled_pipelined_model_predicts_as_plain_keras(schedule, strategy):
    # Keras predicts without compile(); a pipelined model raised AttributeError ('optimizer'),
    # and under the default (Grouped) schedule said steps_per_execution (1) was too small.
    configure(2)

    def build(staged):
        stage = ipu.keras.PipelineStage if staged else (lambda s: contextlib.nullcontext())
        inputs = keras.Input((4,))
        with stage(0):
            h = keras.layers.Dense(8, activation="relu")(inputs)
        with stage(1):
            outputs = keras.layers.Dense(2)(h)
        return keras.Model(inputs, outputs)

    plain = build(False)
    with strategy.scope():
        model = build(True)
    model.set_weights(plain.get_weights())
    if schedule is not None:
        model.set_pipelining_options(
            pipeline_schedule=ipu.pipelining_ops.PipelineSchedule[schedule])
    x = np.random.default_rng(0).normal(size=(8, 4)).astype("float32")
    np.testing.assert_allclose(model.predict(x, batch_size=2, verbose=0),
                               plain.predict(x, batch_size=2, verbose=0), atol=1e-6)


class _TwoStages(keras.Model):
    def __init__(self, encoder, head):
        super().__init__()
        self.encoder, self.head = encoder, head

    def call(self, x):
        with ipu.keras.PipelineStage(0):
            h = self.encoder(x)
        with ipu.keras.PipelineStage(1):
            return self.head(h)


def test_weight_placement_lists_weights_of_one_path_each(strategy):
    # Layers of one name (both "dense" when made either side of clear_session()) have
    # weights that share paths. Before, stage 0's entries were overwritten by stage 1's.
    configure(2)
    encoder = keras.layers.Dense(8, activation="relu", name="dense")
    head = keras.layers.Dense(1, name="dense")
    with strategy.scope():
        model = _TwoStages(encoder, head)
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=4)
    model.compile("sgd", "mse", steps_per_execution=8)
    model.fit(np.ones((32, 4), "float32"), np.ones((32, 1), "float32"), batch_size=4, verbose=0)
    devices = [i.device for i in ipu.device.system.current().ipus[:2]]
    path = encoder.kernel.path
    assert path == head.kernel.path
    placement = ipu.utils.weight_placement(model)
    assert len(placement) == 4
    assert placement[path] == [devices[0]] and placement[f"{path} (2)"] == [devices[1]]


def test_reading_the_report_leaves_a_shared_layers_flag_as_it_was(strategy):
    # The report traces with the flags the program was built with and puts them back:
    # a frozen embedding that a tied head also holds was unfrozen by the head's flag.
    configure(2)
    with strategy.scope():
        ids = keras.Input((4,), dtype="int32")
        with ipu.keras.PipelineStage(0):
            embedding = keras.layers.Embedding(20, 8)
            h = keras.layers.Dense(8)(embedding(ids))
        with ipu.keras.PipelineStage(1):
            head = keras.layers.Dense(8)
            logits = _TiedHead(embedding)(head(h))
        model = keras.Model(ids, logits)
    embedding.trainable = False
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=2)
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  steps_per_execution=2)
    x = np.random.default_rng(0).integers(0, 20, (8, 4)).astype("int32")
    model.fit(x, x, batch_size=2, verbose=0)
    head.trainable = False  # and one frozen since the fit
    assert ipu.utils.execution_report(model, "fit").flops_per_step > 0
    assert not embedding.trainable and not embedding.get_config()["trainable"]
    assert not head.trainable and not head.kernel.trainable
    assert len(model.trainable_variables) == 2  # the first stage's Dense


def test_a_stage_whose_shapes_depend_on_training_sends_its_training_shapes(strategy):
    # RandomCrop crops in training only: the boundary was laid out for its inference
    # shape (12 x 12), and the next stage read the 8 x 8 crop as 12 x 12 (0.031 off).
    configure(2)

    def build():
        inputs = keras.Input((12, 12, 3))
        h = keras.layers.RandomCrop(8, 8, seed=1)(inputs)
        h = keras.layers.GlobalAveragePooling2D()(keras.layers.Conv2D(4, 3)(h))
        return keras.Model(inputs, keras.layers.Dense(3)(h))

    rng = np.random.default_rng(0)
    x = rng.uniform(size=(8, 12, 12, 3)).astype("float32")
    y = rng.normal(size=(8, 3)).astype("float32")
    keras.utils.set_random_seed(0)
    plain = build()
    initial = plain.get_weights()
    plain.compile(keras.optimizers.SGD(0.1, gradient_accumulation_steps=2), "mse")
    plain.fit(x, y, batch_size=4, verbose=0, shuffle=False)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = build()
    model.set_weights(initial)
    assignment = model.get_pipeline_stage_assignment()
    for index, entry in enumerate(assignment):
        entry.pipeline_stage = min(index, 1)  # the crop alone in stage 0
    model.set_pipeline_stage_assignment(assignment)
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=2,
                                 gradient_accumulation_reduction_method="mean")
    model.compile(keras.optimizers.SGD(0.1), "mse", steps_per_execution=2)
    model.fit(x, y, batch_size=4, verbose=0, shuffle=False)
    assert_weights_close(plain.get_weights(), model.get_weights(), atol=1e-6)
    assert model.predict(x, batch_size=4, verbose=0).shape == (8, 3)  # inference: uncropped
