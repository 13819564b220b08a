"""The cost model: flops and bytes counted over StableHLO, the same on every platform.

The execution report's flops per step come from `keras_ipu.device.cost`, a
count over the program JAX lowers to before a backend compiles it. These
tests check the count on module text written here (so nothing about the
platform that runs the tests enters it), on programs lowered for CPU and
exported for CUDA and TPU from this CPU-only machine, against XLA's own
analysis where XLA is exact (convolutions), and, through `fit` and
`predict`, against the analytic count of Dense stacks
(`benchmarks/cost_check.py`, which also runs on GPUs).
"""

from __future__ import annotations

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest
from jax import export, lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import keras_ipu as ipu
from keras_ipu.device import accounting, cost, hardware

from conftest import configure

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _cost_check():
    path = ROOT / "benchmarks" / "cost_check.py"
    spec = importlib.util.spec_from_file_location("cost_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# A module as `Lowered.as_text()` prints it: a 5-trip loop (JAX's scan form)
# calling a function, a two-way case, a convolution and a reduction.
MODULE = """
module @jit_step attributes {mhlo.num_partitions = 1 : i32, mhlo.num_replicas = 1 : i32} {
  func.func public @main(%arg0: tensor<8x64xf32>, %arg1: tensor<64x32xf32>, %arg2: tensor<i32>, %arg3: tensor<2x16x16x3xbf16>, %arg4: tensor<3x3x3x8xbf16>) -> (tensor<8x32xf32>, tensor<2x8x8x8xbf16>, tensor<8xf32>) {
    %0 = stablehlo.dot_general %arg0, %arg1, contracting_dims = [1] x [0], precision = [DEFAULT, DEFAULT] : (tensor<8x64xf32>, tensor<64x32xf32>) -> tensor<8x32xf32>
    %1 = stablehlo.tanh %0 : tensor<8x32xf32>
    %2 = stablehlo.reshape %1 : (tensor<8x32xf32>) -> tensor<256xf32>
    %c = stablehlo.constant dense<0> : tensor<i32>
    %3:2 = stablehlo.while(%iterArg = %c, %iterArg_0 = %1) : tensor<i32>, tensor<8x32xf32>
    cond {
      %c_1 = stablehlo.constant dense<5> : tensor<i32>
      %7 = stablehlo.compare  LT, %iterArg, %c_1,  SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
      stablehlo.return %7 : tensor<i1>
    } do {
      %7 = func.call @body(%iterArg_0) : (tensor<8x32xf32>) -> tensor<8x32xf32>
      %c_1 = stablehlo.constant dense<1> : tensor<i32>
      %8 = stablehlo.add %iterArg, %c_1 : tensor<i32>
      stablehlo.return %8, %7 : tensor<i32>, tensor<8x32xf32>
    }
    %4 = "stablehlo.case"(%arg2) ({
      stablehlo.return %3#1 : tensor<8x32xf32>
    }, {
      %7 = stablehlo.exponential %3#1 : tensor<8x32xf32>
      %8 = stablehlo.multiply %7, %7 : tensor<8x32xf32>
      stablehlo.return %8 : tensor<8x32xf32>
    }) : (tensor<i32>) -> tensor<8x32xf32>
    %5 = stablehlo.convolution(%arg3, %arg4) dim_numbers = [b, 0, 1, f]x[0, 1, i, o]->[b, 0, 1, f], window = {stride = [2, 2], pad = [[0, 1], [0, 1]], lhs_dilate = [1, 1], rhs_dilate = [1, 1], reverse = [false, false]} {batch_group_count = 1 : i64, feature_group_count = 1 : i64, precision_config = [#stablehlo<precision DEFAULT>, #stablehlo<precision DEFAULT>]} : (tensor<2x16x16x3xbf16>, tensor<3x3x3x8xbf16>) -> tensor<2x8x8x8xbf16>
    %cst = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %6 = stablehlo.reduce(%4 init: %cst) applies stablehlo.add across dimensions = [1] : (tensor<8x32xf32>, tensor<f32>) -> tensor<8xf32>
    return %4, %5, %6 : tensor<8x32xf32>, tensor<2x8x8x8xbf16>, tensor<8xf32>
  }
  func.func private @body(%arg0: tensor<8x32xf32>) -> tensor<8x32xf32> {
    %cst = stablehlo.constant dense<1.500000e+00> : tensor<f32>
    %0 = stablehlo.broadcast_in_dim %cst, dims = [] : (tensor<f32>) -> tensor<8x32xf32>
    %1 = stablehlo.multiply %arg0, %0 : tensor<8x32xf32>
    return %1 : tensor<8x32xf32>
  }
}
"""  # noqa: E501  (MLIR prints an op a line)


def test_the_count_of_a_module_text():
    count = cost.count_stablehlo(MODULE)
    elements, tile = 8 * 32, 8 * 32 * 4  # of the loop's and the case's tensors
    dot = 2 * 8 * 32 * 64
    # Every kernel tap of a stride-2 3x3 window that lands on the 16x16 input:
    # per dimension 8 outputs x 3 taps, less the last output's tap on the padding.
    conv = 2 * 2 * 8 * 3 * (8 * 3 - 1) ** 2
    loop = 5 * elements  # five trips of one multiply
    case = elements  # the expensive branch: exponential (transcendental) and multiply
    reduce = 8 * 31
    assert count.flops == dot + conv + loop + case + reduce
    assert count.half_flops == conv  # bf16 operands
    assert count.transcendentals == elements + elements  # tanh, and exp in the case
    conv_bytes = 2 * (2 * 16 * 16 * 3 + 3 * 3 * 3 * 8 + 2 * 8 * 8 * 8)
    assert count.bytes_accessed == (
        4 * (8 * 64 + 64 * 32 + 8 * 32)  # dot
        + 2 * tile  # tanh; the reshape is a view
        + 5 * (3 * tile + 12 + 9)  # the loop's multiplies (the broadcast is a view), counter

        + 2 * tile + 3 * tile  # exp, multiply
        + conv_bytes
        + tile + 4 + 8 * 4  # reduce
    )
    assert count.uncounted == frozenset()


def test_a_loop_whose_trip_count_is_unknown_counts_once_and_says_so():
    def f(x):
        return lax.while_loop(lambda c: jnp.sum(c) < 100.0, lambda c: c * 2.0, x)

    count = cost.count_lowered(jax.jit(f).lower(jnp.ones(16)))
    assert count.flops == 16 + 15 + 1  # body multiply, condition sum and compare
    assert any("trip count unknown" in note for note in count.uncounted)


@pytest.mark.parametrize("steps", [1, 3, 8])
def test_loops_count_with_their_trip_count(steps):
    def execution(w, xs):
        def step(w, x):
            loss = lambda w: jnp.mean(jnp.tanh(x @ w) ** 2)  # noqa: E731
            return w - 0.1 * jax.grad(loss)(w), None

        w, _ = lax.scan(step, w, xs)
        return lax.fori_loop(0, 3, lambda i, w: w * 0.5, w)

    w = jax.ShapeDtypeStruct((64, 64), jnp.float32)
    count = cost.count_lowered(jax.jit(execution).lower(
        w, jax.ShapeDtypeStruct((steps, 16, 64), jnp.float32)))
    one = cost.count_lowered(jax.jit(execution).lower(
        w, jax.ShapeDtypeStruct((1, 16, 64), jnp.float32)))
    fori = 3 * 64 * 64
    # Forward, input and weight gradient products; the scan is counted `steps` times.
    matmul = 2 * 16 * 64 * 64 * 2
    assert count.flops - fori == pytest.approx(steps * (one.flops - fori))
    # Besides: the update (2 flops a weight) and a few flops per activation (tanh's gradient).
    update, activations = 2 * 64 * 64, 16 * 64
    assert matmul + update < one.flops - fori < matmul + update + 8 * activations
    assert count.transcendentals == steps * 16 * 64
    assert count.uncounted == frozenset()


def test_the_count_is_the_same_for_every_platform():
    """The program exported for CUDA and TPU, on this CPU-only machine, counts the same."""

    def execution(w, xs):
        def step(w, x):
            y = jax.nn.relu(x @ w)
            g = jax.grad(lambda w: jnp.mean((jax.nn.relu(x @ w) - y) ** 2))(w)
            return w - 0.01 * g, jnp.sum(y)

        return lax.scan(step, w, xs)

    args = (jax.ShapeDtypeStruct((128, 128), jnp.float32),
            jax.ShapeDtypeStruct((4, 32, 128), jnp.float32))
    counts = {platform: cost.count_stablehlo(
        export.export(jax.jit(execution), platforms=[platform])(*args).mlir_module())
        for platform in ("cpu", "cuda", "tpu")}
    assert counts["cpu"] == counts["cuda"] == counts["tpu"]
    assert counts["cuda"].uncounted == frozenset()  # the loop's trip count was read
    assert cost.count_lowered(jax.jit(execution).lower(*args)) == counts["cuda"]
    assert counts["cuda"].flops >= 4 * 3 * 2 * 32 * 128 * 128


@pytest.mark.parametrize("case", [
    dict(x=(2, 16, 16, 3), k=(3, 3, 3, 8), strides=(1, 1), padding="SAME"),
    dict(x=(2, 15, 15, 3), k=(5, 5, 3, 8), strides=(2, 2), padding="VALID"),
    dict(x=(2, 7, 7, 8), k=(3, 3, 1, 8), strides=(1, 1), padding="SAME", groups=8),
    dict(x=(2, 8, 8, 4), k=(3, 3, 4, 6), strides=(1, 1), padding=((2, 2), (2, 2)),
         rhs_dilation=(2, 2)),
    dict(x=(2, 8, 8, 4), k=(3, 3, 4, 6), strides=(1, 1), padding=((1, 1), (1, 1)),
         lhs_dilation=(2, 2)),
], ids=["same", "valid-stride", "depthwise", "atrous", "transposed"])
def test_convolutions_count_as_xla_does(case):
    """Convolutions and their gradients: XLA's exact count, taps on padding excluded."""

    def conv(x, k):
        return lax.conv_general_dilated(
            x, k, case["strides"], case["padding"], lhs_dilation=case.get("lhs_dilation"),
            rhs_dilation=case.get("rhs_dilation"), dimension_numbers=("NHWC", "HWIO", "NHWC"),
            feature_group_count=case.get("groups", 1))

    specs = (jax.ShapeDtypeStruct(case["x"], jnp.float32),
             jax.ShapeDtypeStruct(case["k"], jnp.float32))
    grads = jax.grad(lambda x, k: jnp.sum(conv(x, k)), argnums=(0, 1))
    for fn in (conv, grads):
        lowered = jax.jit(fn).lower(*specs)
        # XLA analyses the lowered program on the host platform (not on GPUs).
        assert cost.count_lowered(lowered).flops == lowered.cost_analysis()["flops"]


def test_windows_and_what_the_count_does_not_model():
    def pool(x):
        return lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")

    count = cost.count_lowered(jax.jit(pool).lower(jnp.ones((2, 8, 8, 3))))
    assert count.flops == 2 * 4 * 4 * 3 * (4 - 1)  # three comparisons per 2x2 window
    assert count.bytes_accessed == 4 * (2 * 8 * 8 * 3 + 1 + 2 * 4 * 4 * 3)
    grads = cost.count_lowered(jax.jit(jax.grad(lambda x: jnp.sum(pool(x)))).lower(
        jnp.ones((2, 8, 8, 3))))
    assert grads.flops > count.flops and grads.uncounted == frozenset()
    # Window taps on padding are no work: 3x3 SAME max pooling of 8x8 compares 484 taps
    # of input elements less one per output (before: 8 per output, 512).
    same = cost.count_lowered(jax.jit(lambda x: lax.reduce_window(
        x, -jnp.inf, lax.max, (1, 3, 3, 1), (1, 1, 1, 1), "SAME")).lower(jnp.ones((1, 8, 8, 1))))
    assert same.flops == 22 * 22 - 64
    # A cumulative sum (a window over the whole axis) adds each element to the prefix
    # before it: 1,023 additions a row (before: 1,024 x 1,023, padding included).
    for scan in (lambda x: jnp.cumsum(x, axis=1), lambda x: lax.cummax(x, axis=1, reverse=True)):
        assert cost.count_lowered(jax.jit(scan).lower(jnp.ones((4, 1024)))).flops == 4 * 1023
    # A platform's kernel (LAPACK here, cuSOLVER on GPUs) is named, not guessed.
    solver = cost.count_lowered(jax.jit(jnp.linalg.cholesky).lower(jnp.eye(4)))
    assert any(note.startswith("custom_call @") for note in solver.uncounted)


def test_half_precision_matrix_work_uses_the_fp16_rate():
    def mixed(x16, w16, x32, w32):
        return (x16 @ w16).astype(jnp.float32) + x32 @ w32

    m, k, n = 32, 256, 128
    specs = [jax.ShapeDtypeStruct(s, d) for s, d in [
        ((m, k), jnp.bfloat16), ((k, n), jnp.bfloat16), ((m, k), jnp.float32),
        ((k, n), jnp.float32)]]
    count = cost.count_lowered(jax.jit(mixed).lower(*specs))
    product = 2 * m * k * n
    assert count.half_flops == product
    assert count.flops == 2 * product + m * n  # and the add
    step = accounting.step_cost(jax.jit(mixed).lower(*specs))
    mk2 = hardware.hardware_for("ipu2")
    assert step.compute_cycles(mk2) == pytest.approx(
        product / mk2.flops_per_cycle(True) + (product + m * n) / mk2.flops_per_cycle(False))
    float16 = cost.count_lowered(jax.jit(jnp.matmul).lower(*[
        jax.ShapeDtypeStruct(s.shape, jnp.float16) for s in specs[:2]]))
    assert float16.half_flops == float16.flops == product


def test_a_replicated_program_counts_one_ipu():
    devices = jax.devices()[:2]
    mesh = Mesh(np.array(devices), ("replica",))

    def per_replica(w, x):
        return jnp.tanh(x[0] @ w[0])[None], jnp.sum(x)

    replicated = jax.shard_map(per_replica, mesh=mesh, in_specs=(P("replica"), P("replica")),
                               out_specs=(P("replica"), P()), check_vma=False)
    replicated_count = cost.count_lowered(jax.jit(replicated).lower(
        jax.ShapeDtypeStruct((2, 64, 64), jnp.float32),
        jax.ShapeDtypeStruct((2, 16, 64), jnp.float32)))
    single = cost.count_lowered(jax.jit(per_replica).lower(
        jax.ShapeDtypeStruct((1, 64, 64), jnp.float32),
        jax.ShapeDtypeStruct((1, 16, 64), jnp.float32)))
    assert replicated_count.flops == single.flops
    assert replicated_count.transcendentals == single.transcendentals


def test_text_without_a_function_is_refused():
    with pytest.raises(ValueError, match="no function"):
        cost.count_stablehlo("module @empty {\n}\n")
    with pytest.raises(ValueError, match="at least 1"):
        accounting.StepCost(1.0, 0.0, 0.0).per_step(0)


# The acceptance: the report's flops per step of Dense stacks, fit and predict,
# within 5% of the analytic count (`benchmarks/cost_check.py` documents it).

@pytest.mark.parametrize("width, layers, batch", [(64, 3, 32), (4096, 4, 8)],
                         ids=["3xDense64", "4xDense4096"])
def test_report_flops_of_dense_stacks_match_the_analytic_count(width, layers, batch):
    results = _cost_check().measure(width, layers, batch)
    assert set(results) == {"fit", "predict"}
    for mode, result in results.items():
        assert result["ratio"] == pytest.approx(1.0, abs=0.05), (mode, result)


@pytest.mark.parametrize("loop", ["schedule", "host"])
def test_a_pipelines_flops_per_step_are_the_analytic_count_in_both_forms(loop, monkeypatch):
    # The schedule program and the host-dispatched stage ops count alike: one
    # micro-batch through every stage op, as one IPU running the whole model.
    if loop == "host":
        monkeypatch.setenv("KERAS_IPU_FLAGS", "--execution_loop=host")
    check = _cost_check()
    for stages in (2, 4):
        results = check.measure(64, 4, 32, steps=4, stages=stages)
        assert results["fit"]["loop"] == loop
        for mode, result in results.items():
            assert result["ratio"] == pytest.approx(1.0, abs=0.05), (stages, mode, result)


def test_the_report_does_not_use_the_backend_cost_analysis(monkeypatch):
    """As on a GPU: compiled analysis that misses the products, no lowered analysis.

    The report's figures stay the analytic count, and they are the count of
    the same execution program lowered for CUDA.
    """
    from keras_ipu.device import program as program_module

    monkeypatch.setattr(jax.stages.Compiled, "cost_analysis",
                        lambda self: {"flops": 1.0, "bytes accessed": 1.0})
    monkeypatch.setattr(jax.stages.Lowered, "cost_analysis", lambda self: None)
    compiled = []
    original = program_module.ExecutionProgram._compile

    def recording(self, state, batches):
        compiled.append((self, state, batches))
        return original(self, state, batches)

    monkeypatch.setattr(program_module.ExecutionProgram, "_compile", recording)
    check = _cost_check()
    results = check.measure(64, 3, 32, steps=4)
    for result in results.values():
        assert result["ratio"] == pytest.approx(1.0, abs=0.05)

    program, state, batches = compiled[0]
    assert program.mode == "fit"
    specs = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                                   (state, batches))
    module = export.export(program._jitted, platforms=["cuda"])(*specs).mlir_module()
    steps = jax.tree_util.tree_leaves(batches)[0].shape[0]
    assert cost.count_stablehlo(module).flops / steps == pytest.approx(results["fit"]["flops"])


def test_flops_per_step_do_not_depend_on_the_steps_per_execution():
    check = _cost_check()
    one, four = check.measure(64, 3, 32, steps=1), check.measure(64, 3, 32, steps=4)
    for mode in ("fit", "predict"):
        assert four[mode]["flops"] == pytest.approx(one[mode]["flops"], rel=0.01)
        assert four[mode]["cycles_per_step"] == pytest.approx(one[mode]["cycles_per_step"],
                                                              rel=0.01)


def _evaluate_and_predict_flops(pipelined: bool) -> tuple[float, float]:
    configure(2 if pipelined else 1)
    with ipu.ipu_strategy.IPUStrategy().scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8),
                                  keras.layers.Dense(512)])
        if pipelined:
            model.set_pipeline_stage_assignment([0, 1])
        model.compile(loss="huber", metrics=["mae", "mse"], steps_per_execution=4)
    x, y = np.ones((16, 8), np.float32), np.ones((16, 512), np.float32)
    model.evaluate(x, y, batch_size=4, verbose=0)
    model.predict(x, batch_size=4, verbose=0)
    return tuple(ipu.utils.execution_report(model, mode).flops_per_step
                 for mode in ("evaluate", "predict"))


def test_a_pipelines_last_stage_counts_the_loss_and_the_metrics():
    # Its stages were counted as the model's outputs alone: evaluate reported predict's.
    evaluate, predict = _evaluate_and_predict_flops(pipelined=True)
    one_ipu = _evaluate_and_predict_flops(pipelined=False)
    assert evaluate == pytest.approx(one_ipu[0], rel=0.01)
    assert predict == pytest.approx(one_ipu[1], rel=0.01)
    assert evaluate > 1.5 * predict  # the loss and three metrics over 512 values a sample


def _pipeline_backward_flops(widths, stages, batch=8):
    """Each stage's backward flops in the fit report of Dense layers without activation."""
    configure(2)
    with ipu.ipu_strategy.IPUStrategy().scope():
        model = keras.Sequential([keras.Input((widths[0],))]
                                 + [keras.layers.Dense(w) for w in widths[1:]])
        model.set_pipeline_stage_assignment(stages)
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", steps_per_execution=4)
        model.set_pipelining_options(gradient_accumulation_steps_per_replica=4)
    x = np.ones((4 * batch, widths[0]), np.float32)
    model.fit(x, np.ones((4 * batch, widths[-1]), np.float32), batch_size=batch, verbose=0)
    return ipu.utils.execution_report(model, "fit").pipeline.stage_backward_flops


def test_a_pipeline_stages_backward_flops_are_its_own_gradients():
    # Linear stages (JAX leaves the forward product out of their gradient: it was taken
    # off anyway, and a 4-stage linear stack counted 0.73x the analytic flops); the
    # first stage takes no gradient for the data; and a stage's count does not grow with
    # another IPU's weights (the flat vectors are padded to the largest IPU's).
    batch, width = 8, 64
    product = 2 * batch * width * width
    first, second = _pipeline_backward_flops([width] * 3, [0, 1], batch)
    assert first == pytest.approx(product, rel=0.1)  # its weights' gradient only
    assert second == pytest.approx(2 * product, rel=0.1)  # weights and inputs
    small = _pipeline_backward_flops([16, 16, 100, 1], [0, 1, 1], batch)[0]
    assert _pipeline_backward_flops([16, 16, 5000, 1], [0, 1, 1], batch)[0] == small
    # Nor with its own number of weights: gathering each weight's gradient into the flat
    # vector that stores them counted an addition over the vector per weight (+22% here).
    deep = _pipeline_backward_flops([width] * 6, [0, 1, 1, 1, 1], batch)[1]
    assert deep == pytest.approx(4 * 2 * product, rel=0.02)


class _GroupMean(keras.layers.Layer):
    """Adds the mean over a group of replicas (all of them with `group_size=None`)."""

    def __init__(self, group_size=None, **kwargs):
        super().__init__(**kwargs)
        self.group_size = group_size

    def call(self, x):
        from keras_ipu.ops import cross_replica_ops

        mean = keras.ops.mean(x, 0, keepdims=True)
        return x + 0.1 * cross_replica_ops.cross_replica_sum(mean, self.group_size)


@pytest.mark.parametrize("mode", ["fit", "predict"])
def test_a_replicated_pipeline_with_a_grouped_collective_reports_one_replicas_work(mode):
    # Its stages are costed alone, where a group of 2 replicas cannot form: before, the
    # report raised 'A replica group of 2 must divide the 1 replicas' after fit ran.
    configure(4)  # 2 stages x 2 replicas
    flops = {}
    for group_size in (None, 2):
        with ipu.ipu_strategy.IPUStrategy().scope():
            model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(64),
                                      _GroupMean(group_size), keras.layers.Dense(2)])
            model.set_pipeline_stage_assignment([0, 0, 1])
            model.compile(optimizer="sgd", loss="mse", steps_per_execution=4)
            model.set_pipelining_options(gradient_accumulation_steps_per_replica=4)
        x = np.ones((32, 6), np.float32)
        model.fit(x, x[:, :2], batch_size=4, verbose=0) if mode == "fit" else model.predict(
            x, batch_size=4, verbose=0)
        flops[group_size] = ipu.utils.execution_report(model, mode).flops_per_step
    assert flops[2] == pytest.approx(flops[None], rel=0.05)


@pytest.mark.parametrize("case", [
    dict(x=(8, 2, 2, 64), k=(3, 3, 64, 64), strides=(1, 1), padding="SAME"),
    dict(x=(2, 7, 7, 8), k=(3, 3, 8, 8), strides=(2, 2), padding="SAME"),
    dict(x=(2, 8, 8, 4), k=(3, 3, 4, 6), strides=(1, 1), padding=((1, 1), (1, 1)),
         lhs_dilation=(2, 2)),
], ids=["small-same", "strided", "transposed"])
def test_a_padding_materialized_on_cpus_counts_as_the_convolutions_own(case):
    # keras_ipu's CPU convolutions pad explicitly behind a barrier where XLA would swap the
    # operands (device/convolutions.py): the taps on that padding are not work either
    # (before, a 2x2 SAME convolution counted 9 taps per output, 2.25x the analytic count).
    from keras_ipu.device import convolutions

    def ours(x, k):
        return convolutions.conv_general_dilated(
            x, k, case["strides"], case["padding"], lhs_dilation=case.get("lhs_dilation"),
            dimension_numbers=("NHWC", "HWIO", "NHWC"))

    def xlas(x, k):
        return lax.conv_general_dilated(
            x, k, case["strides"], case["padding"], lhs_dilation=case.get("lhs_dilation"),
            dimension_numbers=("NHWC", "HWIO", "NHWC"))

    specs = (jax.ShapeDtypeStruct(case["x"], jnp.float32),
             jax.ShapeDtypeStruct(case["k"], jnp.float32))
    for fn, reference in ((ours, xlas), (jax.grad(lambda x, k: jnp.sum(ours(x, k)), (0, 1)),
                                         jax.grad(lambda x, k: jnp.sum(xlas(x, k)), (0, 1)))):
        expected = cost.count_lowered(jax.jit(reference).lower(*specs)).flops
        assert cost.count_lowered(jax.jit(fn).lower(*specs)).flops == pytest.approx(
            expected, rel=0.01)
    if case["x"] == (8, 2, 2, 64):  # this one takes the CPU path with the barrier
        assert "optimization_barrier" in jax.jit(ours).lower(*specs).as_text()
