#!/usr/bin/env python
"""A zoo of untuned Keras models: plain Keras 3 `fit` against keras_ipu `fit`.

Run from the repository root:

    python benchmarks/bench_zoo.py                    # full run (all models, pipelined too)
    python benchmarks/bench_zoo.py --quick            # smoke run: few steps, 1 round of each
    python benchmarks/bench_zoo.py --models convnet,lstm --no-pipeline --rounds 3
    python benchmarks/bench_zoo.py --json out.json --check   # exit 1 when a target fails

Models (nobody tuned them for keras_ipu), synthetic NumPy data, no downloads:

    convnet      the seed tutorial's MNIST convnet (Conv2D 32/64, max-pooling, dropout,
                 softmax), 28x28x1, batch 64, steps_per_execution 64, Adam
    mobilenetv2  keras.applications.MobileNetV2(weights=None), 64x64x3, 10 classes,
                 batch 8, spe 4, Adam
    resnet50     keras.applications.ResNet50(weights=None), 32x32x3, 10 classes, batch 32,
                 spe 8, SGD with momentum
    resnet_bn    a small residual convnet: 3 blocks of Conv2D + BatchNormalization + ReLU,
                 32x32x3, batch 32, spe 8, SGD with momentum
    decoder      an upsampling decoder: 2 strided Conv2DTranspose (8x8x16 -> 32x32) +
                 pooling + Dense, batch 32, spe 8, Adam
    lstm         Embedding(1000, 32) + LSTM(64) + Dense, sequences of 40, batch 32, spe 8, Adam
    transformer  one encoder block (MultiHeadAttention, LayerNormalization, FFN, residuals)
                 on 32 tokens x 64 dims + pooling + Dense, batch 32, spe 8, Adam
    mlp          Input(64) + 3 x Dense(64), MSE, batch 32, spe 100, SGD

Single IPU (every model): *plain* is `fit` of the model created outside any strategy;
*keras_ipu* is `fit` of the same architecture created in `IPUStrategy().scope()` on 1 IPU.
Both start from the same weights (built once, copied with `set_weights`) and the same random
seed, train on the same data with the same optimizer, loss, metrics and `steps_per_execution`.

Pipelined (mobilenetv2 and resnet50; `--no-pipeline` skips it): keras_ipu on 2 IPUs, a 2-stage
pipeline (the layer calls of `get_pipeline_stage_assignment()` split in half by index),
`set_pipelining_options(gradient_accumulation_steps_per_replica=4, "mean")`, against plain
Keras with `SGD(..., gradient_accumulation_steps=4)` (the same update), same micro-batch and
`steps_per_execution`. ResNet50's micro-batch is 16 there: at 32 its fit program needs more
than IPU 0's memory in the device model, and keras_ipu refuses it. The IPU system is
reconfigured (2 IPUs) for this section, in the same process, as benchmarks/bench_pipeline.py
does; the single-IPU section runs first with 1 IPU (with 2 IPUs a model without stages would be
replicated twice). When keras_ipu's 2 IPUs cannot get one accelerator each (a machine with one
GPU), they run on CPU devices, and plain Keras is then run on a CPU device too, so that both
sides use the same kind of device (noted in the output).

Measured, per model and section (sizes: the ZOO table below; `--quick` cuts them):

    warm        after a first (compiling) fit and one untimed warm fit, `fit` of one epoch of
                a fixed number of steps (a multiple of steps_per_execution), `shuffle=False`,
                `verbose=0`, the weights waited for afterwards; plain and keras_ipu alternate in
                `--rounds` interleaved rounds (the order swaps every round); the MEDIAN
                steps/s (samples/s for pipelined rows) is reported.
    first step  the wall time of the very first `fit` (one execution: steps_per_execution
                steps) of a freshly created and compiled model, tracing and XLA compilation
                included; `--first-rounds` fresh models per variant, order alternating, median.
                Before any of it an optimizer is built once on a throwaway model, so the small
                per-shape compilations of its slot variables, which every later model of the
                process reuses, land on neither side. JAX's persistent compilation cache is
                never enabled. XLA compilations during each fit are counted (JAX monitoring)
                and saved with `--json`.

`--quick` (a smoke run): one execution or two per measurement, 1 round, no untimed warm fit,
and the first fits of the two warm models stand in for the fresh-model rounds
(`--first-rounds 0`). On a 2-core CPU machine the big models alone take minutes: MobileNetV2 and
ResNet50 compile for 20-90 s per model there, so `--quick` stays under 2 minutes only for the
small models (convnet, resnet_bn, lstm, transformer, mlp).

Targets, keras_ipu / plain:
    single IPU    warm steps/s ratio   >= 1.0      first-step time ratio  <= 1.3
    pipelined     warm samples/s ratio >= 0.8      first-fit time ratio   <= 1.5

The script exits 0 whatever the targets say (it is a measurement); with `--check` it exits 1
when a target fails or a model errors.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Compile times must be real: never read a persistent compilation cache (main() also turns
# JAX's switch for it off).
os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
try:
    import keras_ipu as ipu  # must come before keras: it selects the JAX backend
except ImportError:
    sys.path.insert(0, _REPO)
    import keras_ipu as ipu

SEED = 0
PIPELINE_GA = 4
PIPELINE_MODELS = ("mobilenetv2", "resnet50")
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


# --------------------------------------------------------------------------
# The zoo


def build_convnet(keras):
    """The seed tutorial's MNIST convnet."""
    layers = keras.layers
    return keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            layers.Conv2D(32, 3, activation="relu"),
            layers.MaxPooling2D(),
            layers.Conv2D(64, 3, activation="relu"),
            layers.MaxPooling2D(),
            layers.Flatten(),
            layers.Dropout(0.5),
            layers.Dense(10, activation="softmax"),
        ]
    )


def build_mobilenetv2(keras):
    """MobileNetV2 from keras.applications, random weights, 64x64 inputs, 10 classes."""
    return keras.applications.MobileNetV2(weights=None, input_shape=(64, 64, 3), classes=10)


def build_resnet50(keras):
    """ResNet50 from keras.applications, random weights, 32x32 inputs, 10 classes."""
    return keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=10)


def _conv_bn(keras, x, filters, relu=True):
    """Conv2D(3x3, same) + BatchNormalization (+ ReLU)."""
    x = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False)(x)
    x = keras.layers.BatchNormalization()(x)
    return keras.layers.ReLU()(x) if relu else x


def build_resnet_bn(keras, blocks=3, filters=32):
    """A small residual convnet with BatchNormalization, 32x32x3 inputs."""
    inputs = keras.Input((32, 32, 3))
    x = _conv_bn(keras, inputs, filters)
    for _ in range(blocks):
        y = _conv_bn(keras, x, filters)
        y = _conv_bn(keras, y, filters, relu=False)
        x = keras.layers.ReLU()(keras.layers.Add()([x, y]))
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(10, activation="softmax")(x))


def build_decoder(keras):
    """An upsampling decoder: two strided Conv2DTranspose (8x8 -> 32x32) + pooling + Dense."""
    layers = keras.layers
    return keras.Sequential(
        [
            keras.Input((8, 8, 16)),
            layers.Conv2DTranspose(32, 3, strides=2, padding="same", activation="relu"),
            layers.Conv2DTranspose(16, 3, strides=2, padding="same", activation="relu"),
            layers.GlobalAveragePooling2D(),
            layers.Dense(10, activation="softmax"),
        ]
    )


def build_lstm(keras):
    """Embedding(1000, 32) + LSTM(64) + a Dense classifier over sequences of 40 tokens."""
    return keras.Sequential(
        [
            keras.Input((40,), dtype="int32"),
            keras.layers.Embedding(1000, 32),
            keras.layers.LSTM(64),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )


def build_transformer(keras, tokens=32, dims=64, heads=4, ffn=128):
    """One transformer encoder block on (tokens x dims) + pooling + Dense."""
    layers = keras.layers
    inputs = keras.Input((tokens, dims))
    attention = layers.MultiHeadAttention(num_heads=heads, key_dim=dims // heads)(inputs, inputs)
    x = layers.LayerNormalization()(layers.Add()([inputs, layers.Dropout(0.1)(attention)]))
    y = layers.Dense(ffn, activation="relu")(x)
    y = layers.Dense(dims)(y)
    x = layers.LayerNormalization()(layers.Add()([x, layers.Dropout(0.1)(y)]))
    x = layers.GlobalAveragePooling1D()(x)
    return keras.Model(inputs, layers.Dense(10, activation="softmax")(x))


def build_mlp(keras, units=64):
    """Input(64) -> Dense(64, relu) -> Dense(64, relu) -> Dense(64)."""
    return keras.Sequential(
        [
            keras.Input((units,)),
            keras.layers.Dense(units, activation="relu"),
            keras.layers.Dense(units, activation="relu"),
            keras.layers.Dense(units),
        ]
    )


def float_inputs(shape):
    """A data maker: random float32 inputs of `shape` (per sample) and labels 0..9."""

    def make(np, rows, seed):
        rng = np.random.default_rng(seed)
        x = rng.random((rows, *shape), dtype=np.float32)
        return x, rng.integers(0, 10, rows).astype(np.int32)

    return make


def token_sequences(np, rows, seed):
    """Random token ids in [0, 1000), sequences of 40, labels 0..9."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 1000, (rows, 40)).astype(np.int32)
    return x, rng.integers(0, 10, rows).astype(np.int32)


def regression(np, rows, seed):
    """Standard-normal float32 inputs and targets of width 64."""
    rng = np.random.default_rng(seed)
    return (
        rng.standard_normal((rows, 64), dtype=np.float32),
        rng.standard_normal((rows, 64), dtype=np.float32),
    )


def adam(keras, **kwargs):
    """Adam(1e-3)."""
    return keras.optimizers.Adam(1e-3, **kwargs)


def sgd_momentum(keras, **kwargs):
    """SGD(0.01, momentum 0.9)."""
    return keras.optimizers.SGD(0.01, momentum=0.9, **kwargs)


def sgd(keras, **kwargs):
    """SGD(0.01)."""
    return keras.optimizers.SGD(0.01, **kwargs)


@dataclasses.dataclass(frozen=True)
class Spec:
    """One model of the zoo: how to build it, its data, and its run sizes.

    `steps` is the number of steps of one warm measurement (a multiple of `spe`); the
    `quick_` fields replace `spe` and `steps` with `--quick`; `pipeline_batch`, when given,
    is the micro-batch of the pipelined section.
    """

    name: str
    build: Callable
    data: Callable
    batch: int
    spe: int
    steps: int
    quick_spe: int
    quick_steps: int
    optimizer: Callable
    loss: str = "sparse_categorical_crossentropy"
    metrics: tuple = ("accuracy",)
    pipeline_batch: int | None = None

    def sizes(self, quick):
        """(steps_per_execution, steps per warm measurement)."""
        return (self.quick_spe, self.quick_steps) if quick else (self.spe, self.steps)

    def batch_in(self, section):
        """The (micro-)batch size in `section`."""
        return (self.pipeline_batch or self.batch) if section.pipelined else self.batch


ZOO = {
    s.name: s
    # name, build, data, batch, spe, steps, quick spe, quick steps, optimizer[, loss, metrics]
    for s in (
        Spec("convnet", build_convnet, float_inputs((28, 28, 1)), 64, 64, 256, 8, 8, adam),
        Spec("mobilenetv2", build_mobilenetv2, float_inputs((64, 64, 3)), 8, 4, 16, 4, 4, adam),
        # Pipelined at micro-batch 32, IPU 0 of the device model runs out of memory.
        Spec(
            "resnet50",
            build_resnet50,
            float_inputs((32, 32, 3)),
            32,
            8,
            16,
            4,
            4,
            sgd_momentum,
            pipeline_batch=16,
        ),
        Spec(
            "resnet_bn", build_resnet_bn, float_inputs((32, 32, 3)), 32, 8, 64, 4, 8, sgd_momentum
        ),
        Spec("decoder", build_decoder, float_inputs((8, 8, 16)), 32, 8, 64, 4, 8, adam),
        Spec("lstm", build_lstm, token_sequences, 32, 8, 64, 4, 8, adam),
        Spec("transformer", build_transformer, float_inputs((32, 64)), 32, 8, 64, 4, 8, adam),
        Spec("mlp", build_mlp, regression, 32, 100, 5000, 10, 1000, sgd, "mse", ()),
    )
}


# --------------------------------------------------------------------------
# Sections: single IPU and pipelined


def configure_ipus(count):
    """Configures the IPU system with `count` IPUs (before any JAX computation the first time)."""
    config = ipu.config.IPUConfig()
    config.auto_select_ipus = count
    config.configure_ipu_system()


def build_model(keras, spec, weights, *, ipu_scope, place):
    """The spec's model, seeded, on `place`, optionally in the IPU strategy, with `weights`."""
    keras.utils.set_random_seed(SEED)
    scope = ipu.ipu_strategy.IPUStrategy().scope() if ipu_scope else contextlib.nullcontext()
    with place(), scope:
        model = spec.build(keras)
        if weights is not None:
            model.set_weights(weights)
    return model


def split_in_two(model):
    """Stage 0 for the first half of the model's layer calls (by index), stage 1 for the rest."""
    assignments = model.get_pipeline_stage_assignment()
    half = len(assignments) // 2
    for index, assignment in enumerate(assignments):
        assignment.pipeline_stage = 0 if index < half else 1
    model.set_pipeline_stage_assignment(assignments)


@dataclasses.dataclass
class Section:
    """How one comparison builds its two models, and its targets."""

    name: str
    ipus: int
    unit: str
    warm_target: float  # keras_ipu / plain warm throughput, at least
    first_target: float  # keras_ipu / plain first-fit time, at most
    pipelined: bool
    plain_place: Callable = contextlib.nullcontext
    note: str = ""

    def optimizer(self, spec):
        """The optimizer factory of `spec` in this section."""
        return sgd_momentum if self.pipelined else spec.optimizer

    def make(self, keras, spec, weights, spe, *, ipu_scope):
        """A compiled model of this section: plain Keras, or keras_ipu when `ipu_scope`."""
        place = contextlib.nullcontext if ipu_scope else self.plain_place
        model = build_model(keras, spec, weights, ipu_scope=ipu_scope, place=place)
        pipelined_ipu = self.pipelined and ipu_scope
        accumulation = {}
        if self.pipelined and not ipu_scope:  # plain Keras accumulates in the optimizer
            accumulation["gradient_accumulation_steps"] = PIPELINE_GA
        if pipelined_ipu:
            split_in_two(model)
        with place():
            model.compile(
                optimizer=self.optimizer(spec)(keras, **accumulation),
                loss=spec.loss,
                metrics=list(spec.metrics),
                steps_per_execution=spe,
            )
        if pipelined_ipu:
            model.set_pipelining_options(
                gradient_accumulation_steps_per_replica=PIPELINE_GA,
                gradient_accumulation_reduction_method="mean",
            )
        return model


def single_section():
    """keras_ipu on 1 IPU against plain Keras."""
    return Section("single", 1, "steps/s", 1.0, 1.3, pipelined=False)


def pipelined_section(jax):
    """keras_ipu, 2 stages on 2 IPUs, against plain Keras with the same accumulation.

    With fewer than 2 accelerators but at least 1, keras_ipu's 2 IPUs map to CPU devices;
    plain Keras then runs on CPU device 0 too.
    """
    section = Section("pipelined", 2, "samples/s", 0.8, 1.5, pipelined=True)
    accelerators = [d for d in jax.devices() if d.platform != "cpu"]
    if 0 < len(accelerators) < 2:
        cpu = jax.devices("cpu")[0]
        section.plain_place = lambda: jax.default_device(cpu)
        section.note = (
            f"only {len(accelerators)} accelerator: keras_ipu's 2 IPUs run on CPU devices, "
            "so plain Keras runs on a CPU device too"
        )
    return section


# --------------------------------------------------------------------------
# Timing


class CompileCounter:
    """Counts XLA backend compilations, from JAX's monitoring events."""

    def __init__(self, jax):
        self.count = 0
        self.available = True

        def listener(name, *_args, **_kwargs):
            if name == COMPILE_EVENT:
                self.count += 1

        try:
            jax.monitoring.register_event_duration_secs_listener(listener)
        except AttributeError:
            self.available = False


@dataclasses.dataclass
class Runner:
    """One compiled model and its timed `fit`."""

    model: object
    batch: int
    place: Callable
    jax: object

    def fit(self, x, y):
        """Wall seconds of one `fit` epoch over (x, y), the weights waited for."""
        started = time.perf_counter()
        with self.place():
            self.model.fit(x, y, batch_size=self.batch, epochs=1, shuffle=False, verbose=0)
        self.jax.block_until_ready([v.value for v in self.model.trainable_variables])
        return time.perf_counter() - started


class Case:
    """One model in one section: makes the plain and keras_ipu runners, times them."""

    VARIANTS = ("plain", "ipu")

    def __init__(self, section, spec, args, keras, jax, np, counter):
        self.section, self.spec, self.keras, self.jax = section, spec, keras, jax
        self.counter = counter
        self.spe, self.steps = spec.sizes(args.quick)
        self.batch = spec.batch_in(section)
        self.x, self.y = spec.data(np, self.steps * self.batch, seed=1)
        rows = self.spe * self.batch
        self.first_x, self.first_y = self.x[:rows], self.y[:rows]
        reference = build_model(keras, spec, None, ipu_scope=False, place=section.plain_place)
        self.weights = reference.get_weights()
        self._warm_shared_caches(reference)

    def _warm_shared_caches(self, reference):
        """Builds an optimizer on the reference model, untimed.

        Its slot variables are made eagerly, one small XLA compilation per variable shape,
        cached for the whole process: now neither variant's first fit pays for them.
        """
        with self.section.plain_place():
            self.section.optimizer(self.spec)(self.keras).build(reference.trainable_variables)

    def runner(self, variant):
        """A freshly built and compiled runner of `variant` ("plain" or "ipu")."""
        ipu_scope = variant == "ipu"
        model = self.section.make(
            self.keras, self.spec, self.weights, self.spe, ipu_scope=ipu_scope
        )
        place = contextlib.nullcontext if ipu_scope else self.section.plain_place
        return Runner(model, self.batch, place, self.jax)

    def first_fit(self, runner):
        """(seconds, XLA compilations) of the runner's first fit of one execution.

        An on-device loop still compiling in the background (keras_ipu on
        accelerators: `keras_ipu/device/background.py`) is then waited for,
        untimed, so that it shares the host with no later measurement.
        """
        from keras_ipu.device import background

        before = self.counter.count
        seconds = runner.fit(self.first_x, self.first_y)
        background.wait_for_compilations()
        return seconds, self.counter.count - before

    def order(self, round_):
        """The variants in the order of round `round_` (swapped every round)."""
        return self.VARIANTS if round_ % 2 == 0 else self.VARIANTS[::-1]


def run_case(case, args, log):
    """Warm and first-step measurements of one case, as a result dict."""
    result = {"unit": case.section.unit, "spe": case.spe, "batch": case.batch}
    result["steps_per_measurement"] = case.steps
    warm = {v: case.runner(v) for v in Case.VARIANTS}
    for variant, runner in warm.items():
        seconds, compiles = case.first_fit(runner)
        result[f"{variant}_cold_first_fit_s"] = seconds
        result[f"{variant}_cold_first_fit_compiles"] = compiles
        if not args.quick:
            runner.fit(case.x, case.y)  # one untimed warm epoch
    result.update(ipu_report(warm["ipu"].model))
    log(
        f"  {case.spec.name}: compiled and warm (cold first fits: plain "
        f"{result['plain_cold_first_fit_s']:.2f} s, "
        f"keras_ipu {result['ipu_cold_first_fit_s']:.2f} s)"
    )
    result.update(measure_warm(case, warm, args.rounds))
    del warm
    gc.collect()
    result.update(measure_first(case, args.first_rounds, result))
    add_ratios(result, case.section)
    log(
        f"  {case.spec.name}: warm ratio {result['warm_ratio']:.3f}, "
        f"first-step ratio {result['first_ratio']:.3f}"
    )
    return result


def measure_warm(case, runners, rounds):
    """Median throughput of each variant over interleaved rounds of one warm epoch each."""
    per_second = case.steps * (case.batch if case.section.pipelined else 1)
    samples = {v: [] for v in Case.VARIANTS}
    compiles_before = case.counter.count
    for round_ in range(rounds):
        for variant in case.order(round_):
            samples[variant].append(per_second / runners[variant].fit(case.x, case.y))
    out = {"warm_compiles_in_rounds": case.counter.count - compiles_before}
    for variant, values in samples.items():
        out[f"{variant}_warm"] = statistics.median(values)
        out[f"{variant}_warm_all"] = values
    return out


def measure_first(case, rounds, result):
    """Median first-fit time of each variant over `rounds` fresh models per variant.

    With no rounds, the cold first fits of the warm models (in `result`) stand in.
    """
    if rounds:
        times, compiles = fresh_first_fits(case, rounds)
    else:
        times = {v: [result[f"{v}_cold_first_fit_s"]] for v in Case.VARIANTS}
        compiles = {v: [result[f"{v}_cold_first_fit_compiles"]] for v in Case.VARIANTS}
    out = {}
    for variant in Case.VARIANTS:
        out[f"{variant}_first_s"] = statistics.median(times[variant])
        out[f"{variant}_first_all"] = times[variant]
        out[f"{variant}_first_compiles"] = compiles[variant]
    return out


def fresh_first_fits(case, rounds):
    """First-fit seconds and XLA compilations of fresh models, variants alternating."""
    times = {v: [] for v in Case.VARIANTS}
    compiles = {v: [] for v in Case.VARIANTS}
    for round_ in range(rounds):
        for variant in case.order(round_):
            seconds, count = case.first_fit(case.runner(variant))
            times[variant].append(seconds)
            compiles[variant].append(count)
            gc.collect()
    return times, compiles


def add_ratios(result, section):
    """keras_ipu / plain ratios and their verdicts against the section's targets."""
    result["warm_ratio"] = result["ipu_warm"] / result["plain_warm"]
    result["first_ratio"] = result["ipu_first_s"] / result["plain_first_s"]
    result["warm_target"] = section.warm_target
    result["first_target"] = section.first_target
    result["warm_verdict"] = "PASS" if result["warm_ratio"] >= section.warm_target else "FAIL"
    result["first_verdict"] = "PASS" if result["first_ratio"] <= section.first_target else "FAIL"


def ipu_report(model):
    """Per IPU: its JAX device and the memory the fit program needs (execution report)."""
    try:
        ipus = ipu.utils.execution_report(model, mode="fit").ipus
    except Exception:  # a report is optional for the measurement
        return {"ipu_devices": None, "ipu_memory_bytes": None, "ipu_memory_fraction": None}
    return {
        "ipu_devices": [getattr(r, "device", "?") for r in ipus],
        "ipu_memory_bytes": [getattr(r, "memory_bytes", None) for r in ipus],
        "ipu_memory_fraction": [getattr(r, "memory_fraction", None) for r in ipus],
    }


# --------------------------------------------------------------------------
# Driver


def parse_args(argv=None, zoo=None):
    """Command-line options (models from `zoo`, default ZOO); fills the --quick defaults."""
    zoo = zoo or ZOO
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: few steps, 1 round")
    parser.add_argument(
        "--models", default=",".join(zoo), help=f"comma list of models (default {','.join(zoo)})"
    )
    parser.add_argument("--rounds", type=int, default=None, help="warm rounds (default 5; quick 1)")
    parser.add_argument(
        "--first-rounds",
        type=int,
        default=None,
        help="fresh models per variant for the first-step time (default 3; quick 0: "
        "the first fits of the warm models instead)",
    )
    parser.add_argument(
        "--pipeline",
        action=argparse.BooleanOptionalAction,
        default=True,
        help=f"also run the pipelined section ({', '.join(PIPELINE_MODELS)}; default on)",
    )
    parser.add_argument(
        "--single",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the single-IPU section (default on; --no-single runs the pipelines alone)",
    )
    parser.add_argument("--json", default=None, help="write the results to this JSON file")
    parser.add_argument("--check", action="store_true", help="exit 1 when a target fails")
    args = parser.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in args.models if m not in zoo]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(zoo)}")
    if args.rounds is None:
        args.rounds = 1 if args.quick else 5
    if args.first_rounds is None:
        args.first_rounds = 0 if args.quick else 3
    if args.rounds < 1 or args.first_rounds < 0:
        parser.error("--rounds must be at least 1 and --first-rounds at least 0")
    return args


def warm_up_process(keras, jax, np):
    """One tiny plain and keras_ipu fit, so one-time process costs land on neither side."""
    spec = ZOO["mlp"]
    section = single_section()
    x, y = spec.data(np, spec.batch, seed=9)
    for ipu_scope in (False, True):
        model = section.make(keras, spec, None, 1, ipu_scope=ipu_scope)
        Runner(model, spec.batch, contextlib.nullcontext, jax).fit(x, y)


def run_section(section, names, args, modules, results, log, zoo=None):
    """Configures the section's IPUs and runs each named model of `zoo` (default ZOO).

    Errors are recorded in `results` and the next model runs.
    """
    zoo = zoo or ZOO
    keras, jax, np, counter = modules
    configure_ipus(section.ipus)
    log(f"section {section.name}: {section.ipus} IPU(s); models {', '.join(names)}")
    if section.note:
        log(f"  note: {section.note}")
    for name in names:
        key = f"{name}/{section.name}"
        try:
            case = Case(section, zoo[name], args, keras, jax, np, counter)
            results["cases"][key] = run_case(case, args, log)
        except Exception as exc:  # report and go on with the next model
            results["errors"][key] = traceback.format_exc()
            log(f"  {name}: ERROR {exc!r}")
        gc.collect()


def run_sections(args, modules, results, log):
    """The single-IPU section, then the pipelined one when asked for and it has models."""
    if args.single:
        run_section(single_section(), args.models, args, modules, results, log)
    piped = [name for name in args.models if name in PIPELINE_MODELS]
    if args.pipeline and piped:
        section = pipelined_section(modules[1])
        if section.note:
            results["notes"].append(section.note)
        run_section(section, piped, args, modules, results, log)


def meta(args, keras, jax, counter):
    """Machine, versions and settings of the run."""
    device = jax.devices()[0]
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "keras": keras.__version__,
        "keras_ipu": getattr(ipu, "__version__", None),
        "backend": keras.backend.backend(),
        "device": str(device),
        "device_kind": device.device_kind,
        "devices": len(jax.devices()),
        "cpus": os.cpu_count(),
        "quick": args.quick,
        "rounds": args.rounds,
        "first_rounds": args.first_rounds,
        "compile_counter": counter.available,
        "persistent_compilation_cache": jax.config.jax_enable_compilation_cache,
        "statistic": "median over interleaved rounds",
        "loadavg_start": _loadavg(),
    }


def _loadavg():
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def print_table(results):
    """The one results table, the notes, and any errors."""
    m = results["meta"]
    print(
        f"\n{m['platform']}, Python {m['python']}, jax {m['jax']}, keras {m['keras']}, "
        f"keras_ipu {m['keras_ipu']}; device {m['device_kind']} ({m['device']}), "
        f"{m['devices']} JAX devices, {m['cpus']} CPUs; rounds {m['rounds']}, "
        f"first-step rounds {m['first_rounds'] or '0 (first fits of the warm models)'}"
        f"{', QUICK' if m['quick'] else ''}"
    )
    header = (
        f"{'model':<22} | {'batch/spe':>9} | {'unit':<9} | {'plain':>9} | {'keras_ipu':>9} | "
        f"{'ratio':>6} | {'warm':>10} | {'plain 1st s':>11} | {'ipu 1st s':>9} | "
        f"{'ratio':>6} | {'1st step':>10}"
    )
    print(header)
    print("-" * len(header))
    for key, r in results["cases"].items():
        sizes = f"{r['batch']}/{r['spe']}"
        warm = f"{r['warm_verdict']} >={r['warm_target']:g}"
        first = f"{r['first_verdict']} <={r['first_target']:g}"
        print(
            f"{key:<22} | {sizes:>9} | {r['unit']:<9} | {r['plain_warm']:>9.2f} | "
            f"{r['ipu_warm']:>9.2f} | {r['warm_ratio']:>6.3f} | {warm:>10} | "
            f"{r['plain_first_s']:>11.2f} | {r['ipu_first_s']:>9.2f} | "
            f"{r['first_ratio']:>6.3f} | {first:>10}"
        )
    for key in results["errors"]:
        print(f"{key:<22} | ERROR (traceback below)")
    print(
        "ratio = keras_ipu / plain; warm: median throughput of one fit epoch after compiling "
        "(higher is better); 1st step: wall time of the first fit of one execution on a "
        "fresh model, compilation included (lower is better)."
    )
    for line in notes(results):
        print(f"note: {line}")
    for key, text in results["errors"].items():
        print(f"\nERROR in {key}:\n{text}")


def notes(results):
    """Things worth a second look: recompiles in warm rounds, cache hits, device mismatch."""
    out = list(results.get("notes", []))
    devices = {}
    for key, r in results["cases"].items():
        devices.setdefault(key.split("/")[1], set()).add(", ".join(r["ipu_devices"] or ["?"]))
    for section, found in devices.items():
        out.append(f"{section}: keras_ipu's IPUs ran on JAX device(s) {' | '.join(sorted(found))}")
    for key, r in results["cases"].items():
        if r.get("warm_compiles_in_rounds"):
            out.append(f"{key}: {r['warm_compiles_in_rounds']} XLA compile(s) in the warm rounds")
        for variant in Case.VARIANTS:
            if results["meta"]["compile_counter"] and 0 in r[f"{variant}_first_compiles"]:
                out.append(f"{key}: a fresh {variant} model's first fit compiled nothing")
    return out


def main(argv=None):
    """Runs the sections, prints the table, writes the JSON; returns the exit code."""
    args = parse_args(argv)
    started = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - started:6.1f}s] {msg}", flush=True)

    configure_ipus(1)  # before any JAX computation: keras_ipu picks the JAX devices
    import jax
    import keras
    import numpy as np

    jax.config.update("jax_enable_compilation_cache", False)
    counter = CompileCounter(jax)
    results = {"meta": meta(args, keras, jax, counter), "cases": {}, "errors": {}, "notes": []}
    log(
        f"keras {keras.__version__}, jax {jax.__version__}, {len(jax.devices())} x "
        f"{jax.devices()[0].device_kind} devices; warming up the process"
    )
    warm_up_process(keras, jax, np)
    run_sections(args, (keras, jax, np, counter), results, log)
    results["meta"]["total_seconds"] = time.perf_counter() - started
    results["meta"]["loadavg_end"] = _loadavg()
    print_table(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=str)
        log(f"wrote {args.json}")
    failed = results["errors"] or any(
        "FAIL" in (r["warm_verdict"], r["first_verdict"]) for r in results["cases"].values()
    )
    return 1 if args.check and failed else 0


if __name__ == "__main__":
    try:
        code = main()
    except Exception:  # a measurement never fails its caller, unless --check asked
        traceback.print_exc()
        code = 1 if "--check" in sys.argv else 0
    sys.exit(code)
