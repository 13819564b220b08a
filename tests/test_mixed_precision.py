"""Mixed precision: Keras' mixed policies and loss scaling on IPUs equal plain Keras.

Under `mixed_float16` Keras wraps the optimizer in a `LossScaleOptimizer`;
on IPUs it takes one step per weight update (as in the reference, where the
loss scale counts `apply_gradients` calls), so a run equals plain Keras on
the combined batch, the loss scale's skips and growth included.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_ipu as ipu
from keras_ipu.device import precision
from keras_ipu.device.report import ExecutionReport

from conftest import assert_weights_close, configure
from models import data_for

POLICIES = ["mixed_float16", "mixed_bfloat16"]
# Half-precision rounding differs with the batch split; float16 keeps 10
# mantissa bits, bfloat16 7.
ATOL = {"mixed_float16": 1e-3, "mixed_bfloat16": 4e-3}
MICRO, GA = 4, 4  # plain Keras: batch 16


@pytest.fixture
def policy(request):
    """Sets the global dtype policy for the test, and float32 again after it."""
    keras.mixed_precision.set_global_policy(request.param)
    try:
        yield request.param
    finally:
        keras.mixed_precision.set_global_policy("float32")


def with_policies(policies=POLICIES):
    return pytest.mark.parametrize("policy", policies, indirect=True)


def _mlp(stop_gradient: bool = False) -> keras.Model:
    layers = [keras.Input((6,)), keras.layers.Dense(8, activation="relu")]
    if stop_gradient:  # the first layer then gets zero gradients
        layers.append(keras.layers.Lambda(keras.ops.stop_gradient))
    return keras.Sequential([*layers, keras.layers.Dense(3)])


def _pair(strategy, stop_gradient: bool = False):
    """A plain model and an IPU model with the same initial weights."""
    keras.utils.set_random_seed(0)
    plain = _mlp(stop_gradient)
    with strategy.scope():
        on_ipu = _mlp(stop_gradient)
    on_ipu.set_weights(plain.get_weights())
    return plain, on_ipu


def _sgd(learning_rate: float = 0.05, loss_scale: dict | None = None, **kwargs):
    """SGD with momentum; wrapped in a `LossScaleOptimizer` when `loss_scale` is given."""
    optimizer = keras.optimizers.SGD(learning_rate, momentum=0.9, **kwargs)
    if loss_scale is None:
        return optimizer
    return keras.optimizers.LossScaleOptimizer(optimizer, **loss_scale)


def _fit(model, x, y, batch_size: int, epochs: int = 2):
    return model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)


def _assert_same_training(plain, on_ipu, atol: float) -> None:
    """Equal weights, and under loss scaling the same loss-scale state."""
    assert_weights_close(plain.get_weights(), on_ipu.get_weights(), atol=atol)
    assert all(w.dtype == np.float32 for w in on_ipu.get_weights())  # mixed: float32 variables
    assert type(on_ipu.optimizer) is type(plain.optimizer)
    assert int(on_ipu.optimizer.iterations) == int(plain.optimizer.iterations)
    if isinstance(plain.optimizer, keras.optimizers.LossScaleOptimizer):
        for name in ("dynamic_scale", "step_counter"):
            assert float(getattr(on_ipu.optimizer, name)) == float(getattr(plain.optimizer, name))


def _pipelined(model, micro_batches: int = GA) -> None:
    model.set_pipeline_stage_assignment([0] * (len(model.layers) - 1) + [1])
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=micro_batches,
                                 gradient_accumulation_reduction_method="mean")


# --------------------------------------------------------------------------- equal to Keras


@with_policies()
def test_one_ipu_equals_plain_keras(policy, strategy):
    plain, on_ipu = _pair(strategy)
    plain.compile(optimizer=_sgd(), loss="mse")
    on_ipu.compile(optimizer=_sgd(), loss="mse", steps_per_execution=4)
    assert on_ipu.layers[0].compute_dtype == policy.removeprefix("mixed_")
    # Keras wraps the optimizer for loss scaling under mixed_float16 only.
    assert isinstance(on_ipu.optimizer, keras.optimizers.LossScaleOptimizer) == (
        policy == "mixed_float16")
    x, y = data_for("sequential", samples=64)
    expected, actual = _fit(plain, x, y, 8), _fit(on_ipu, x, y, 8)
    _assert_same_training(plain, on_ipu, ATOL[policy])
    np.testing.assert_allclose(actual.history["loss"], expected.history["loss"], rtol=1e-3)


@with_policies()
def test_replicas_equal_the_combined_batch(policy, strategy):
    configure(2)
    plain, on_ipu = _pair(strategy)
    plain.compile(optimizer=_sgd(0.05), loss="mse")
    # Replicas sum their gradients: half the learning rate for the mean.
    on_ipu.compile(optimizer=_sgd(0.025), loss="mse", steps_per_execution=4)
    x, y = data_for("sequential", samples=64)
    _fit(plain, x, y, 2 * MICRO)
    _fit(on_ipu, x, y, MICRO)
    _assert_same_training(plain, on_ipu, ATOL[policy])


@with_policies()
def test_gradient_accumulation_equals_the_big_batch(policy, strategy):
    plain, on_ipu = _pair(strategy)
    plain.compile(optimizer=_sgd(), loss="mse")
    on_ipu.compile(optimizer=_sgd(), loss="mse", steps_per_execution=8)
    on_ipu.set_gradient_accumulation_options(GA, "mean")
    x, y = data_for("sequential", samples=64)
    expected, actual = _fit(plain, x, y, MICRO * GA), _fit(on_ipu, x, y, MICRO)
    _assert_same_training(plain, on_ipu, ATOL[policy])
    # The big batch's mean loss is the mean of its micro-batches' losses.
    np.testing.assert_allclose(actual.history["loss"], expected.history["loss"], rtol=1e-3)
    # Keras' own accumulation gives the same weights; its loss scale steps
    # per micro-batch, the IPU's per update (see docs/performance.md).
    keras_accumulating = _pair(strategy)[0]
    keras_accumulating.compile(optimizer=_sgd(gradient_accumulation_steps=GA), loss="mse")
    _fit(keras_accumulating, x, y, MICRO)
    assert_weights_close(keras_accumulating.get_weights(), on_ipu.get_weights(),
                         atol=ATOL[policy])
    if policy == "mixed_float16":
        assert int(keras_accumulating.optimizer.step_counter) == 2 * 64 // MICRO
        assert int(on_ipu.optimizer.step_counter) == 2 * 64 // (MICRO * GA)


@pytest.mark.parametrize("policy, form", [("mixed_float16", "scan"), ("mixed_float16", "host"),
                                          ("mixed_bfloat16", "scan")], indirect=["policy"])
def test_two_stage_pipeline_equals_the_big_batch(policy, form, monkeypatch):
    """Both pipeline forms: the schedule program and the host-dispatched ops."""
    monkeypatch.setenv("KERAS_IPU_FLAGS", f"--execution_loop={form}")
    configure(2)
    plain, on_ipu = _pair(ipu.ipu_strategy.IPUStrategy())
    # Without a LossScaleOptimizer, a fixed `loss_scale_factor` scales the
    # last stage's loss and each IPU unscales its gradients, as in Keras.
    scaling = {"loss_scale_factor": 256.0} if policy == "mixed_bfloat16" else {}
    plain.compile(optimizer=_sgd(**scaling), loss="mse")
    on_ipu.compile(optimizer=_sgd(**scaling), loss="mse", steps_per_execution=8)
    _pipelined(on_ipu)
    x, y = data_for("sequential", samples=64)
    expected, actual = _fit(plain, x, y, MICRO * GA), _fit(on_ipu, x, y, MICRO)
    # The loss scale, its counter and the inner optimizer's state came back.
    _assert_same_training(plain, on_ipu, ATOL[policy])
    np.testing.assert_allclose(actual.history["loss"], expected.history["loss"], rtol=1e-3)
    report = ipu.utils.execution_report(on_ipu, "fit")
    assert report.pipeline.num_stages == 2


@pytest.mark.parametrize("policy, form", [("mixed_float16", "host"), ("mixed_bfloat16", "scan")],
                         indirect=["policy"])
def test_16_bit_messages_carry_masks_and_regularization_as_plain_keras(policy, form, monkeypatch):
    # 16-bit activations and their mask cross the boundary; the first stage's L2 term,
    # most of the loss, crosses exactly (16 bits would round the logged loss).
    monkeypatch.setenv("KERAS_IPU_FLAGS", f"--execution_loop={form}")
    configure(2)

    def make():
        return keras.Sequential([
            keras.Input((7,), dtype="int32"), keras.layers.Embedding(20, 8, mask_zero=True),
            keras.layers.Dense(8, activation="tanh", kernel_regularizer=keras.regularizers.L2(0.5)),
            keras.layers.LSTM(6), keras.layers.Dense(3)])

    keras.utils.set_random_seed(0)
    plain = make()
    with ipu.ipu_strategy.IPUStrategy().scope():
        on_ipu = make()
    on_ipu.set_weights(plain.get_weights())
    rng = np.random.default_rng(0)
    ids, y = rng.integers(0, 20, size=(64, 7)), rng.normal(size=(64, 3)).astype("float32")
    ids[:, 5:] = 0
    plain.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    on_ipu.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", steps_per_execution=4)
    on_ipu.set_pipeline_stage_assignment([0, 0, 1, 1])  # the LSTM reads the mask
    on_ipu.set_pipelining_options(gradient_accumulation_steps_per_replica=GA,
                                  gradient_accumulation_reduction_method="mean")
    expected, actual = _fit(plain, ids, y, MICRO * GA), _fit(on_ipu, ids, y, MICRO)
    np.testing.assert_allclose(actual.history["loss"], expected.history["loss"], rtol=1e-5)
    assert_weights_close(plain.get_weights(), on_ipu.get_weights(), atol=ATOL[policy] / 10)


@pytest.mark.parametrize("form", ["scan", "host"])
@with_policies(["mixed_float16"])
def test_a_loss_scale_past_float16s_range_reaches_an_early_stages_regularizer(policy, form,
                                                                            monkeypatch):
    # The first stage's L2 term's gradient crosses back scaled by the loss scale: before, in
    # float16 it overflowed from 2**16 on, and the updates were skipped (4 of 8 here).
    monkeypatch.setenv("KERAS_IPU_FLAGS", f"--execution_loop={form}")
    configure(2)

    def make():
        keras.utils.set_random_seed(0)
        return keras.Sequential([
            keras.Input((6,)), keras.layers.Dense(8, activation="tanh",
                                                  kernel_regularizer=keras.regularizers.L2(0.01)),
            keras.layers.Dense(3)])

    plain = make()
    with ipu.ipu_strategy.IPUStrategy().scope():
        on_ipu = make()
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 6)).astype("float32"), 0.1 * rng.normal(size=(64, 3))
    for model, steps in ((plain, 1), (on_ipu, 4)):
        # Small loss weights: the activations' gradients stay far from overflowing.
        model.compile(optimizer=_sgd(0.01, {"dynamic_growth_steps": 1}), loss="mse",
                      loss_weights=1e-3, steps_per_execution=steps)
    on_ipu.set_pipeline_stage_assignment([0, 1])
    on_ipu.set_pipelining_options(gradient_accumulation_steps_per_replica=GA,
                                  gradient_accumulation_reduction_method="mean")
    _fit(plain, x, y, MICRO * GA), _fit(on_ipu, x, y, MICRO)
    assert float(plain.optimizer.dynamic_scale) == 2.0**23  # grown at each of 8 updates
    _assert_same_training(plain, on_ipu, 1e-6)


# --------------------------------------------------------------------------- non-finite gradients


def _overflowing_data():
    """64 samples; sample 37 (in the third update of 16) overflows float16 gradients.

    Its target is so far off that the loss's gradient, scaled and cast to
    float16, is infinite whatever the batch it is in: the update holding it
    is skipped, in plain Keras as on IPUs. The loss itself stays finite
    (float32).
    """
    x, y = data_for("sequential", samples=64)
    y[37] = 1e9
    return x, y


# A small scale, so that no other update overflows; growth after 3 steps.
LOSS_SCALE = {"initial_scale": 16.0, "dynamic_growth_steps": 3}


# Pipelines of one replica: `test_a_stage_with_non_finite_gradients_skips_every_stages_update`.
@pytest.mark.parametrize("setup", ["accumulation", "replicas", "replicated_pipeline"])
@with_policies(["mixed_float16"])
def test_non_finite_gradients_skip_the_update_as_in_keras(policy, setup, strategy):
    configure({"accumulation": 1, "replicas": 2, "replicated_pipeline": 4}[setup])
    replicated = setup != "accumulation"
    plain, on_ipu = _pair(strategy)
    plain.compile(optimizer=_sgd(loss_scale=LOSS_SCALE), loss="mse")
    # Two replicas sum their gradients: half the learning rate for the mean.
    on_ipu.compile(optimizer=_sgd(0.025 if replicated else 0.05, loss_scale=LOSS_SCALE),
                   loss="mse", steps_per_execution=4)
    micro_batches = GA // 2 if replicated else GA
    if setup == "replicated_pipeline":
        _pipelined(on_ipu, micro_batches)
    else:
        on_ipu.set_gradient_accumulation_options(micro_batches, "mean")
    x, y = _overflowing_data()
    expected = _fit(plain, x, y, MICRO * GA)
    actual = _fit(on_ipu, x, y, MICRO)
    # Plain Keras skipped the third of each epoch's 4 updates, halving the
    # scale (16 -> 8), and doubled it after 3 finite updates (8 -> 16 -> 8).
    assert int(plain.optimizer.iterations) == 6
    assert float(plain.optimizer.dynamic_scale) == 8.0
    assert int(plain.optimizer.step_counter) == 1
    _assert_same_training(plain, on_ipu, ATOL[policy])
    if not replicated:  # replicated logs are the last step's, not the epoch's
        np.testing.assert_allclose(actual.history["loss"], expected.history["loss"], rtol=1e-3)


@pytest.mark.parametrize("form", ["scan", "host"])
@with_policies(["mixed_float16"])
def test_a_stage_with_non_finite_gradients_skips_every_stages_update(policy, form, monkeypatch):
    # The first stage's gradients are zero (finite) when the last stage's
    # overflow: Keras' one optimizer skips the whole update, so each IPU's
    # optimizer clone must skip it too. Weight decay shows whether the first
    # stage's weights were updated.
    monkeypatch.setenv("KERAS_IPU_FLAGS", f"--execution_loop={form}")
    configure(2)
    plain, on_ipu = _pair(ipu.ipu_strategy.IPUStrategy(), stop_gradient=True)
    for model in (plain, on_ipu):
        model.compile(optimizer=_sgd(weight_decay=0.5, loss_scale=LOSS_SCALE), loss="mse",
                      steps_per_execution=1 if model is plain else 4)
    _pipelined(on_ipu)
    x, y = _overflowing_data()
    _fit(plain, x, y, MICRO * GA)
    _fit(on_ipu, x, y, MICRO)
    assert int(plain.optimizer.iterations) == 6
    _assert_same_training(plain, on_ipu, ATOL[policy])


@pytest.mark.parametrize("form", ["scan", "host"])
def test_a_weightless_last_stage_scales_the_loss_as_the_others_skip(form, monkeypatch):
    # The last stage (an Activation) holds no weights: its optimizer clone, which scales
    # the loss, sees no gradient, so must halve its scale with the others on an overflow.
    monkeypatch.setenv("KERAS_IPU_FLAGS", f"--execution_loop={form}")
    configure(2)
    x, y = data_for("sequential", samples=64)
    y[37] = np.inf  # one update's gradients are not finite: skipped, the scale halves

    def make():
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                                 keras.layers.Dense(3), keras.layers.Activation("linear")])

    def optimizer():
        return keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05, momentum=0.9),
                                                   initial_scale=16.0, dynamic_growth_steps=3)

    plain = make()
    with ipu.ipu_strategy.IPUStrategy().scope():
        on_ipu = make()
    plain.compile(optimizer=optimizer(), loss="mse")
    on_ipu.compile(optimizer=optimizer(), loss="mse", steps_per_execution=4)
    on_ipu.set_pipeline_stage_assignment([0, 0, 1])
    on_ipu.set_pipelining_options(gradient_accumulation_steps_per_replica=4,
                                  gradient_accumulation_reduction_method="mean")
    plain.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    on_ipu.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert float(on_ipu.optimizer.dynamic_scale) == float(plain.optimizer.dynamic_scale) == 8
    assert_weights_close(plain.get_weights(), on_ipu.get_weights(), atol=1e-5)


# --------------------------------------------------------------------------- the report


def _report(policy: str, pipelined: bool = False) -> ExecutionReport:
    """The fit report of a narrow MLP on big batches (activations dominate its memory).

    Pipelined: 64 wide throughout, stage 1 from the second layer, 4 micro-batches of 256.
    """
    keras.mixed_precision.set_global_policy(policy)
    width, targets = (64, 64) if pipelined else (16, 4)
    with ipu.ipu_strategy.IPUStrategy().scope():
        model = keras.Sequential([keras.Input((width,)), keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(targets)])
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=4 if pipelined else 2)
    if pipelined:
        model.set_pipeline_stage_assignment([0, 1, 1])
        model.set_pipelining_options(gradient_accumulation_steps_per_replica=4)
    x = np.random.default_rng(0).normal(size=(1024, width)).astype("float32")
    model.fit(x, x[:, :targets], batch_size=256 if pipelined else 512, verbose=0)
    return ipu.utils.execution_report(model, "fit")


@with_policies(["mixed_bfloat16"])
def test_the_report_counts_16_bit_activations_and_the_16_bit_rate(policy):
    # Few tiles: compute dominates the cycles, not the syncs between steps.
    configure(1, tiles_per_ipu=4)
    half, single = _report(policy).ipus[0], _report("float32").ipus[0]
    # Mixed precision keeps float32 variables, and 16-bit activations.
    assert half.state_bytes == single.state_bytes
    assert half.temporary_bytes < 0.7 * single.temporary_bytes
    assert half.memory_bytes < single.memory_bytes
    # Its matrix work runs at 4x the float32 rate (flops are alike).
    assert half.estimated_cycles < 0.5 * single.estimated_cycles


@pytest.mark.parametrize("form", ["scan", "host"])
@with_policies()
def test_a_pipeline_sends_16_bit_activations_and_reports_less_memory(policy, form, monkeypatch):
    # Before: every message between stages crossed as float32, and those buffers set the
    # peak: a mixed pipeline reported more temporaries than float32's (scan: 1.10x, 1.13x).
    monkeypatch.setenv("KERAS_IPU_FLAGS", f"--execution_loop={form}")
    configure(2)
    half, single = _report(policy, pipelined=True), _report("float32", pipelined=True)
    assert half.pipeline.num_stages == 2
    temporaries = [sum(ipu.temporary_bytes for ipu in r.ipus) for r in (half, single)]
    assert temporaries[0] < 0.9 * temporaries[1]  # 0.62-0.87 since


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_16_bit_bundle_carries_the_additional_loss_exactly_with_its_gradient(dtype):
    import jax
    import jax.numpy as jnp

    from keras_ipu.keras.pipelined import boundary

    # Far past float16's range, digits 16 bits would round away, and float32 bits that
    # split in two would make 16-bit NaN patterns (0x7FFF), which XLA:CPU may rewrite.
    losses = np.array([0.1, 123456.789, -1e30, np.inf], np.float32)
    losses = np.append(losses, np.array([0x40A07FFF, 0x477FFC01], np.uint32).view(np.float32))
    rows = jax.jit(jax.vmap(lambda loss: boundary.carry_loss(loss, 6, dtype)))(losses)
    assert rows.dtype == jnp.dtype(dtype) and rows.shape == (len(losses), 1, 6)
    carried = jax.jit(jax.vmap(boundary.carried_loss))(rows)
    np.testing.assert_array_equal(np.asarray(carried).view(np.uint32), losses.view(np.uint32))
    # The gradient crosses back exactly too: a loss scale past float16's range (before, the
    # carrier overflowed and the update was skipped), a factor bfloat16 rounds (1e4: 9,984).
    def carried(v, scale):
        bundle = jnp.concatenate([jnp.ones((3, 6), dtype), boundary.carry_loss(3 * v, 6, dtype)])
        return boundary.carried_loss(bundle) * scale

    for scale in (2.0**16, 2.0**24, 1e4, 0.1):
        assert float(jax.grad(carried)(jnp.float32(5.0), jnp.float32(scale))) == (
            np.float32(3) * np.float32(scale))
    assert boundary.bundle_dtype([dtype, "bool"]) == jnp.dtype(dtype)
    assert boundary.bundle_dtype([dtype, "int32"]) == jnp.float32  # int32 crosses as bits
    assert boundary.bundle_dtype(["float16", "bfloat16"]) == jnp.float32


def test_half_precision_is_read_from_the_programs_matrix_work():
    import jax
    import jax.numpy as jnp

    def step(w, x, dtype):
        return jnp.tanh(x.astype(dtype) @ w.astype(dtype)).astype(jnp.float32).sum()

    w, x = jnp.ones((64, 32)), jnp.ones((128, 64))
    jaxprs = {dtype: jax.make_jaxpr(jax.grad(lambda w, x, d=dtype: step(w, x, d)))(w, x)
              for dtype in (jnp.float32, jnp.bfloat16, jnp.float16)}
    # Two matrix products: the forward one and the kernel's gradient.
    assert precision.matrix_flops(jaxprs[jnp.float32]) == (0.0, 2 * 2 * 128 * 64 * 32)
    assert precision.is_half_precision(jaxprs[jnp.bfloat16])
    assert precision.is_half_precision(jaxprs[jnp.float16])
    assert not precision.is_half_precision(jaxprs[jnp.float32])
    # XLA:CPU holds 16-bit values in 32 bits: an IPU's temporaries are fewer.
    assert precision.temporary_scale(jaxprs[jnp.float32], "cpu") == 1.0
    assert 0.4 < precision.temporary_scale(jaxprs[jnp.bfloat16], "cpu") < 0.8
    assert precision.temporary_scale(jaxprs[jnp.bfloat16], "gpu") == 1.0


def test_xla_cpus_float32_copies_of_16_bit_weights_are_not_an_ipus_temporaries():
    # XLA:CPU converts a float16 model's weights to float32 up front: 3 x Dense(256) at
    # batch 16 has 819,200 temporary bytes there, the copies and two float32 activations.
    import jax
    import jax.numpy as jnp

    def forward(weights, x):
        for w in weights:
            x = jax.nn.relu(x @ w)
        return x

    weights = [jnp.ones((256, 256), jnp.float16)] * 3
    jaxpr = jax.make_jaxpr(forward)(weights, jnp.ones((16, 256), jnp.float16))
    measured = jax.jit(forward).lower(weights, jnp.ones((16, 256), jnp.float16)).compile()
    modelled = precision.peak_live_bytes(jaxpr, precision._upcast_itemsize,
                                         matrix_input_copies=True)
    assert modelled == measured.memory_analysis().temp_size_in_bytes == 819_200
    # An IPU holds two float16 activations (the scale brings XLA's figure there).
    assert precision.temporary_scale(jaxpr, "cpu") * 819_200 == 2 * 16 * 256 * 2


@with_policies(["float16"])
def test_a_float16_model_whose_weights_fit_is_not_refused_as_out_of_memory(policy):
    # 2,099,200 bytes of float16 weights on an IPU of 4 tiles (2,555,904 bytes): before,
    # the float32 copies XLA:CPU makes counted, and predict was refused needing 4,360,192.
    configure(1, tiles_per_ipu=4)
    keras.mixed_precision.set_global_policy(policy)
    with ipu.ipu_strategy.IPUStrategy().scope():
        model = keras.Sequential([keras.Input((1024,)), keras.layers.Dense(1024)])
    model.compile(optimizer="sgd", loss="mse")
    model.predict(np.ones((16, 1024), "float32"), batch_size=16, verbose=0)
    report = ipu.utils.execution_report(model, "predict").ipus[0]
    assert report.state_bytes == 2 * 1024 * 1025
    assert report.temporary_bytes < 4 * 16 * 1024 * 2  # a few float16 activations
