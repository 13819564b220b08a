#!/usr/bin/env python
"""Single-IPU training throughput and compile time of keras_ipu.

Run from the repository root:

    python benchmarks/bench_single_ipu.py            # full run (~2-3 min)
    python benchmarks/bench_single_ipu.py --quick    # smoke run (<30 s)

What is measured, all in one process and on one virtual IPU (JAX device 0):

Small model ("latency-bound"), for steps_per_execution S in {1, 10, 100}:
    Input(64) -> Dense(64, relu) -> Dense(64, relu) -> Dense(64),
    batch 32, synthetic float32 data, SGD(lr=0.01), MSE loss, no extra metrics.

    plain   Keras 3 `model.fit` on a model created outside any strategy,
            `compile(steps_per_execution=S)`.
    ipu     keras_ipu `fit` on the same architecture created inside
            `IPUStrategy().scope()`, same S.
    limit   a hand-written `jax.jit` of `lax.scan` over S calls of the Keras
            model's own stateless `model.train_step(state, (x, y))`, state
            donated, with ALL the data already on the device, pre-stacked as
            [batches / S, S, 32, 64]; call k trains on chunk k mod (batches / S),
            so the limit walks through the data as a training run does.

    plain and ipu are timed as one `fit(x, y, batch_size=32, epochs=E,
    shuffle=False, verbose=0)` call over a fixed data set of
    `--batches-per-epoch` batches (default 5000 = 160000 samples, so an epoch
    is 5000 steps: 50 executions at S=100; each epoch end waits for the
    device, as Keras' epoch logs need the values); E is calibrated per
    variant after the warm-up so that one measurement lasts about
    `--target-seconds` (or fixed with `--steps`).
    limit is timed as a whole number of such epoch-sized blocks, in calls of S
    steps. After every measurement the weights are waited for
    (`block_until_ready`), so asynchronous dispatch cannot hide work.
    steps/s = steps of the measurement / its wall time (so per-fit and
    per-epoch overheads count, as they do for a user).

Compute-bound model: Input(1024) -> Dense(1024, relu) x2 -> Dense(1024),
    batch 256, SGD, MSE, S = `--compute-spe` (default 10): plain vs ipu,
    each measurement one `fit` epoch of `--compute-batches` (default 40) steps.

Compile time of keras_ipu, for S in {1, 1000}:
    compile time(S) = wall time of the first `fit` of ONE execution (S
    batches, epochs=1) on a freshly created and compiled model
    - the median wall time of the same `fit` once warm.
    So it contains tracing, lowering, XLA compilation and every other
    first-call cost keras_ipu adds (model build, program preparation). The
    library's own `compile_seconds` (lower + compile, from the execution
    report) is printed next to it when available.

Methodology: everything is warmed up (compiled) first; the variants are
interleaved (plain, ipu, limit, plain, ipu, limit, ... over all S) for
`--repeats` rounds and the MEDIAN is reported. The persistent compilation
cache is not enabled. Results go to benchmarks/results/bench_single_ipu.json.
The script exits 0 whatever the targets say.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
try:
    import keras_ipu as ipu  # must come before keras: it selects the JAX backend
except ImportError:
    sys.path.insert(0, _REPO)
    import keras_ipu as ipu

# Compile times must be real: never read a persistent compilation cache.
os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)

SMALL_UNITS = 64
SMALL_BATCH = 32
BIG_UNITS = 1024
BIG_BATCH = 256
SPES = (1, 10, 100)
COMPILE_SPES = (1, 1000)
VARIANTS = ("plain", "ipu", "limit")

TARGETS = (
    # (name, description, threshold, function of results -> measured ratio)
    (
        "ipu_vs_limit_S100",
        "keras_ipu >= 0.9x limit at S=100",
        0.9,
        lambda r: r["small"]["100"]["ratio_ipu_limit"],
    ),
    (
        "ipu_vs_plain_S100",
        "keras_ipu >= 1.3x plain Keras at S=100",
        1.3,
        lambda r: r["small"]["100"]["ratio_ipu_plain"],
    ),
    (
        "ipu_vs_plain_S1",
        "keras_ipu >= 1.0x plain Keras at S=1",
        1.0,
        lambda r: r["small"]["1"]["ratio_ipu_plain"],
    ),
    (
        "ipu_vs_plain_S10",
        "keras_ipu >= 1.0x plain Keras at S=10",
        1.0,
        lambda r: r["small"]["10"]["ratio_ipu_plain"],
    ),
    (
        "compile_S1000_vs_S1",
        "compile(S=1000) <= 1.5x compile(S=1)",
        1.5,
        lambda r: r["compile"]["ratio_1000_1"],
    ),
    (
        "compute_ipu_vs_plain",
        "compute-bound: keras_ipu >= 0.95x plain Keras",
        0.95,
        lambda r: r["compute"]["ratio_ipu_plain"],
    ),
)
_UPPER_BOUND_TARGETS = {"compile_S1000_vs_S1"}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: few repeats, short measurements (<30 s)"
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="interleaved rounds per measurement (default 7; quick 2)",
    )
    parser.add_argument(
        "--target-seconds",
        type=float,
        default=None,
        help="duration of one timed measurement (default 0.6; quick 0.1)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="fixed steps per small-model measurement (a multiple of "
        "--batches-per-epoch) instead of calibrating",
    )
    parser.add_argument(
        "--batches-per-epoch",
        type=int,
        default=None,
        help="batches in the small model's data set, i.e. steps per "
        "epoch (multiple of 100; default 1000; quick 200)",
    )
    parser.add_argument(
        "--compile-repeats",
        type=int,
        default=None,
        help="fresh models per S in the compile-time test (default 3; quick 1)",
    )
    parser.add_argument(
        "--compute-spe", type=int, default=10, help="steps_per_execution of the compute-bound case"
    )
    parser.add_argument(
        "--compute-batches",
        type=int,
        default=None,
        help="batches per compute-bound measurement, one epoch (default 40; quick 10)",
    )
    parser.add_argument(
        "--output", default=os.path.join(_REPO, "benchmarks", "results", "bench_single_ipu.json")
    )
    parser.add_argument(
        "--resident",
        action="store_true",
        help="keep keras_ipu's data on the device, as on a GPU (forced on CPU devices)",
    )
    parser.add_argument(
        "--skip", default="", help="comma list of parts to skip: small,compile,compute"
    )
    args = parser.parse_args(argv)
    quick = args.quick
    if args.repeats is None:
        args.repeats = 2 if quick else 7
    if args.target_seconds is None:
        args.target_seconds = 0.1 if quick else 0.6
    if args.compile_repeats is None:
        args.compile_repeats = 1 if quick else 3
    if args.compute_batches is None:
        args.compute_batches = 10 if quick else 40
    if args.batches_per_epoch is None:
        args.batches_per_epoch = 200 if quick else 5000
    if args.batches_per_epoch % max(SPES):
        parser.error(f"--batches-per-epoch must be a multiple of {max(SPES)}")
    if args.compute_batches % args.compute_spe:
        parser.error("--compute-batches must be a multiple of --compute-spe")
    if args.steps is not None and args.steps % args.batches_per_epoch:
        parser.error("--steps must be a multiple of --batches-per-epoch")
    args.skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    return args


def configure_ipu():
    try:
        cfg = ipu.config.IPUConfig()
        cfg.auto_select_ipus = 1
        cfg.configure_ipu_system()
        return "IPUConfig"
    except AttributeError:
        from keras_ipu.device import hardware, system

        system.configure((1,), hardware.hardware_for("ipu2"))
        return "device.system.configure (fallback)"


# --------------------------------------------------------------------------
# Models and data


def make_model(units, keras, *, inside_ipu_scope, spe, seed=0, weights=None):
    def build():
        return keras.Sequential(
            [
                keras.Input((units,)),
                keras.layers.Dense(units, activation="relu"),
                keras.layers.Dense(units, activation="relu"),
                keras.layers.Dense(units),
            ]
        )

    keras.utils.set_random_seed(seed)
    if inside_ipu_scope:
        with ipu.ipu_strategy.IPUStrategy().scope():
            model = build()
    else:
        model = build()
    if weights is not None:
        model.set_weights(weights)
    model.compile(
        optimizer=keras.optimizers.SGD(learning_rate=0.01), loss="mse", steps_per_execution=spe
    )
    return model


def make_data(np, rows, units, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, units), dtype=np.float32)
    y = rng.standard_normal((rows, units), dtype=np.float32)
    return x, y


def _ipu0_device(jax):
    """The JAX device of IPU 0 (where keras_ipu runs), else JAX's default device."""
    try:
        from keras_ipu.device import system

        return system.current().ipus[0].device
    except Exception:  # the library's internals may move; the default is the same device
        return jax.devices()[0]


def wait_for(model, jax):
    jax.block_until_ready([v.value for v in model.trainable_variables])


class FitRunner:
    """Times `fit` of one model over a fixed data set."""

    def __init__(self, model, x, y, batch, jax):
        self.model, self.x, self.y, self.batch, self.jax = model, x, y, batch, jax
        self.batches_per_epoch = len(x) // batch

    def run(self, epochs):
        started = time.perf_counter()
        self.model.fit(
            self.x, self.y, batch_size=self.batch, epochs=epochs, shuffle=False, verbose=0
        )
        wait_for(self.model, self.jax)
        return time.perf_counter() - started

    def steps(self, epochs):
        return epochs * self.batches_per_epoch


class LimitRunner:
    """jit(lax.scan over S train steps), device-resident data, donated state."""

    def __init__(self, model, x, y, spe, batch, jax, jnp):
        self.jax = jax
        self.spe = spe
        # Build the optimizer (and metric) state exactly as Keras would.
        model.fit(
            x[: spe * batch], y[: spe * batch], batch_size=batch, epochs=1, shuffle=False, verbose=0
        )
        self.state = (
            [v.value for v in model.trainable_variables],
            [v.value for v in model.non_trainable_variables],
            [v.value for v in model.optimizer.variables],
            [v.value for v in model.metrics_variables],
        )
        device = _ipu0_device(jax)
        # Private copies: the donated state must not be the model's own buffers.
        self.state = jax.tree_util.tree_map(jnp.copy, jax.device_put(self.state, device))
        chunks = len(x) // (spe * batch)
        shape = (chunks, spe, batch, x.shape[1])
        rows = chunks * spe * batch
        stacked = (
            jax.device_put(jnp.asarray(x[:rows].reshape(shape)), device),
            jax.device_put(jnp.asarray(y[:rows].reshape(shape)), device),
        )
        # One device array per execution, all resident before timing starts.
        self.chunks = [tuple(part[k] for part in stacked) for k in range(chunks)]
        jax.block_until_ready(self.chunks)
        self.next_chunk = 0

        def execution(state, data):
            def body(carry, batch_data):
                _logs, carry = model.train_step(carry, batch_data)
                return carry, None

            state, _ = jax.lax.scan(body, state, data)
            return state

        self.fn = jax.jit(execution, donate_argnums=0)
        self.run_calls(1)

    def run_calls(self, calls):
        state = self.state
        for _ in range(calls):
            state = self.fn(state, self.chunks[self.next_chunk])
            self.next_chunk = (self.next_chunk + 1) % len(self.chunks)
        self.jax.block_until_ready(state)
        self.state = state

    def run(self, steps):
        calls = steps // self.spe
        started = time.perf_counter()
        self.run_calls(calls)
        return time.perf_counter() - started


# --------------------------------------------------------------------------
# Parts


def calibrate(run, target_s, limit=10_000):
    """The count n (epochs, or blocks of steps) for which run(n) lasts ~target_s."""
    n = 1
    while True:
        elapsed = run(n)
        if elapsed >= target_s * 0.5 or n >= limit:
            break
        n *= 2
    return max(1, int(round(target_s * n / elapsed)))


def bench_small(args, keras, jax, jnp, np, log):
    bpe = args.batches_per_epoch
    x, y = make_data(np, bpe * SMALL_BATCH, SMALL_UNITS, seed=1)
    reference = make_model(SMALL_UNITS, keras, inside_ipu_scope=False, spe=1)
    weights = reference.get_weights()
    runners = {}
    units = {}
    for spe in SPES:
        t0 = time.perf_counter()
        plain = make_model(SMALL_UNITS, keras, inside_ipu_scope=False, spe=spe, weights=weights)
        ipu_model = make_model(SMALL_UNITS, keras, inside_ipu_scope=True, spe=spe, weights=weights)
        limit_model = make_model(
            SMALL_UNITS, keras, inside_ipu_scope=False, spe=spe, weights=weights
        )
        runners[spe] = {
            "plain": FitRunner(plain, x, y, SMALL_BATCH, jax),
            "ipu": FitRunner(ipu_model, x, y, SMALL_BATCH, jax),
            "limit": LimitRunner(limit_model, x, y, spe, SMALL_BATCH, jax, jnp),
        }
        # Warm-up (compile) and calibration.
        for name in ("plain", "ipu"):
            runners[spe][name].run(1)
            settle()
            runners[spe][name].run(1)
        for name in VARIANTS:
            runner = runners[spe][name]
            if args.steps is not None:
                units[(spe, name)] = args.steps if name == "limit" else args.steps // bpe
            elif name == "limit":
                # The limit's unit is a block of `bpe` steps, like an epoch.
                blocks = calibrate(lambda n, r=runner: r.run(n * bpe), args.target_seconds)
                units[(spe, name)] = blocks * bpe
            else:
                units[(spe, name)] = calibrate(runner.run, args.target_seconds)
        log(
            f"  S={spe}: warmed up and calibrated in {time.perf_counter() - t0:.1f} s "
            f"(steps per measurement: "
            + ", ".join(f"{n}={_steps_of(units[(spe, n)], n, bpe)}" for n in VARIANTS)
            + ")"
        )

    samples = {(spe, n): [] for spe in SPES for n in VARIANTS}
    for rep in range(args.repeats):
        for spe in SPES:
            for name in VARIANTS:
                u = units[(spe, name)]
                elapsed = runners[spe][name].run(u)
                samples[(spe, name)].append(_steps_of(u, name, bpe) / elapsed)
        log(f"  round {rep + 1}/{args.repeats} done")

    result = {}
    for spe in SPES:
        entry = {}
        for name in VARIANTS:
            values = samples[(spe, name)]
            entry[name] = {
                "steps_per_s_median": statistics.median(values),
                "steps_per_s_all": values,
                "steps_per_measurement": _steps_of(units[(spe, name)], name, bpe),
            }
        med = {n: entry[n]["steps_per_s_median"] for n in VARIANTS}
        entry["ratio_ipu_limit"] = med["ipu"] / med["limit"]
        entry["ratio_ipu_plain"] = med["ipu"] / med["plain"]
        entry["ratio_plain_limit"] = med["plain"] / med["limit"]
        result[str(spe)] = entry
    return result


def _steps_of(units, name, bpe):
    return units if name == "limit" else units * bpe


def settle():
    """Waits for keras_ipu's loops compiling in the background (accelerators), untimed:
    a measurement then runs the loop, and shares the host with no compilation."""
    from keras_ipu.device import background

    background.wait_for_compilations()


def bench_compile(args, keras, jax, np, log):
    from keras_ipu.keras import run as ipu_run

    data = {spe: make_data(np, spe * SMALL_BATCH, SMALL_UNITS, seed=2) for spe in COMPILE_SPES}
    first = {spe: [] for spe in COMPILE_SPES}
    steady = {spe: [] for spe in COMPILE_SPES}
    lib = {spe: [] for spe in COMPILE_SPES}
    for rep in range(args.compile_repeats):
        for spe in COMPILE_SPES:
            x, y = data[spe]
            model = make_model(SMALL_UNITS, keras, inside_ipu_scope=True, spe=spe, seed=100 + rep)
            runner = FitRunner(model, x, y, SMALL_BATCH, jax)
            first[spe].append(runner.run(1))
            settle()
            program = getattr(ipu_run, "program_for", lambda *a: None)(model, "fit")
            report = getattr(program, "report", None)
            seconds = getattr(report, "compile_seconds", None)
            if seconds is not None:
                lib[spe].append(seconds)
            for _ in range(max(3, args.repeats)):
                steady[spe].append(runner.run(1))
        log(f"  compile round {rep + 1}/{args.compile_repeats} done")
    result = {}
    for spe in COMPILE_SPES:
        f = statistics.median(first[spe])
        s = statistics.median(steady[spe])
        result[str(spe)] = {
            "first_fit_s_median": f,
            "first_fit_s_all": first[spe],
            "steady_fit_s_median": s,
            "compile_s": f - s,
            "library_compile_seconds_median": statistics.median(lib[spe]) if lib[spe] else None,
        }
    result["ratio_1000_1"] = result["1000"]["compile_s"] / result["1"]["compile_s"]
    return result


def bench_compute(args, keras, jax, np, log):
    spe = args.compute_spe
    x, y = make_data(np, args.compute_batches * BIG_BATCH, BIG_UNITS, seed=3)
    plain = make_model(BIG_UNITS, keras, inside_ipu_scope=False, spe=spe)
    weights = plain.get_weights()
    ipu_model = make_model(BIG_UNITS, keras, inside_ipu_scope=True, spe=spe, weights=weights)
    runners = {
        "plain": FitRunner(plain, x, y, BIG_BATCH, jax),
        "ipu": FitRunner(ipu_model, x, y, BIG_BATCH, jax),
    }
    for runner in runners.values():
        runner.run(1)
        settle()
        runner.run(1)
    samples = {n: [] for n in runners}
    for _ in range(args.repeats):
        for name, runner in runners.items():
            samples[name].append(runner.steps(1) / runner.run(1))
    log(f"  compute-bound: {args.repeats} rounds done")
    result = {
        "steps_per_execution": spe,
        "batch": BIG_BATCH,
        "units": BIG_UNITS,
        "steps_per_measurement": args.compute_batches,
    }
    for name, values in samples.items():
        result[name] = {"steps_per_s_median": statistics.median(values), "steps_per_s_all": values}
    result["ratio_ipu_plain"] = (
        result["ipu"]["steps_per_s_median"] / result["plain"]["steps_per_s_median"]
    )
    return result


# --------------------------------------------------------------------------
# Report


def check_targets(results):
    verdicts = []
    for key, text, threshold, get in TARGETS:
        try:
            value = get(results)
        except (KeyError, TypeError):
            verdicts.append(
                {
                    "target": key,
                    "description": text,
                    "threshold": threshold,
                    "value": None,
                    "verdict": "SKIPPED",
                }
            )
            continue
        ok = value <= threshold if key in _UPPER_BOUND_TARGETS else value >= threshold
        verdicts.append(
            {
                "target": key,
                "description": text,
                "threshold": threshold,
                "value": value,
                "verdict": "PASS" if ok else "MISS",
            }
        )
    return verdicts


def print_report(results, verdicts):
    out = print
    small = results.get("small")
    if small:
        out("\nSmall model (3 x Dense(64), batch 32, SGD, MSE): training steps/s, median")
        out(
            f"{'S':>5} | {'plain Keras':>12} | {'keras_ipu':>12} | {'limit':>12} | "
            f"{'ipu/limit':>9} | {'ipu/plain':>9} | {'plain/limit':>11}"
        )
        out("-" * 88)
        for spe in SPES:
            e = small[str(spe)]
            out(
                f"{spe:>5} | {e['plain']['steps_per_s_median']:>12.0f} | "
                f"{e['ipu']['steps_per_s_median']:>12.0f} | "
                f"{e['limit']['steps_per_s_median']:>12.0f} | "
                f"{e['ratio_ipu_limit']:>9.2f} | {e['ratio_ipu_plain']:>9.2f} | "
                f"{e['ratio_plain_limit']:>11.2f}"
            )
    comp = results.get("compile")
    if comp:
        out(
            "\nkeras_ipu compile time (first fit of 1 execution on a fresh model "
            "minus the warm fit), median"
        )
        out(
            f"{'S':>5} | {'first fit s':>11} | {'warm fit s':>10} | {'compile s':>9} | "
            f"{'lib compile_seconds':>19}"
        )
        out("-" * 66)
        for spe in COMPILE_SPES:
            e = comp[str(spe)]
            libc = e["library_compile_seconds_median"]
            out(
                f"{spe:>5} | {e['first_fit_s_median']:>11.3f} | "
                f"{e['steady_fit_s_median']:>10.4f} | {e['compile_s']:>9.3f} | "
                f"{(f'{libc:.3f}' if libc is not None else 'n/a'):>19}"
            )
        out(f"compile(S=1000) / compile(S=1) = {comp['ratio_1000_1']:.2f}")
    compute = results.get("compute")
    if compute:
        out(
            f"\nCompute-bound (3 x Dense(1024), batch 256, SGD, MSE, "
            f"S={compute['steps_per_execution']}): steps/s, median"
        )
        out(
            f"  plain Keras {compute['plain']['steps_per_s_median']:.2f}   "
            f"keras_ipu {compute['ipu']['steps_per_s_median']:.2f}   "
            f"ipu/plain {compute['ratio_ipu_plain']:.3f}"
        )
    out("\nTargets:")
    for v in verdicts:
        value = "n/a" if v["value"] is None else f"{v['value']:.3f}"
        rel = ""
        if v["value"] is not None:
            rel = f" ({(v['value'] / v['threshold'] - 1) * 100:+.1f}% vs threshold)"
        out(f"  [{v['verdict']:>7}] {v['description']:<48} measured {value}{rel}")


def _git_state():
    """The commit benchmarked and whether keras_ipu/ had uncommitted changes."""
    import subprocess

    def git(*cmd):
        return subprocess.run(
            ["git", "-C", _REPO, *cmd], capture_output=True, text=True, timeout=10
        ).stdout.strip()

    try:
        return {
            "commit": git("rev-parse", "--short", "HEAD") or None,
            "keras_ipu_dirty": bool(git("status", "--porcelain", "--", "keras_ipu")),
        }
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "keras_ipu_dirty": None}


def _loadavg():
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def main(argv=None):
    args = parse_args(argv)
    started = time.perf_counter()
    how = configure_ipu()

    import jax
    import jax.numpy as jnp
    import keras
    import numpy as np

    if args.resident:
        from keras_ipu.keras import resident

        resident.fits_on = lambda *_: True

    def log(msg):
        print(f"[{time.perf_counter() - started:6.1f}s] {msg}", flush=True)

    log(
        f"IPU system configured with {how}; keras {keras.__version__}, jax {jax.__version__}, "
        f"backend {keras.backend.backend()}, devices {len(jax.devices())} x "
        f"{jax.devices()[0].platform}, {os.cpu_count()} CPUs"
    )
    results = {
        "meta": {
            "keras": keras.__version__,
            "jax": jax.__version__,
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "device": str(jax.devices()[0]),
            "quick": args.quick,
            "repeats": args.repeats,
            "target_seconds": args.target_seconds,
            "batches_per_epoch": args.batches_per_epoch,
            "compile_repeats": args.compile_repeats,
            "model_small": "Input(64)->Dense(64,relu)->Dense(64,relu)->Dense(64); "
            "batch 32; SGD(0.01); MSE",
            "model_compute": "Input(1024)->Dense(1024,relu)x2->Dense(1024); batch 256; "
            "SGD(0.01); MSE",
            "compile_time_definition": "wall time of the first fit of one execution on a "
            "fresh model minus the median warm time of that fit",
            "statistic": "median over interleaved repeats",
            "loadavg_start": _loadavg(),
            "git": _git_state(),
        }
    }
    if "small" not in args.skip:
        log("small model: warm-up, calibration, interleaved measurements")
        results["small"] = bench_small(args, keras, jax, jnp, np, log)
    if "compile" not in args.skip:
        log("compile time (fresh models)")
        results["compile"] = bench_compile(args, keras, jax, np, log)
    if "compute" not in args.skip:
        log("compute-bound model")
        results["compute"] = bench_compute(args, keras, jax, np, log)
    verdicts = check_targets(results)
    results["targets"] = verdicts
    results["meta"]["total_seconds"] = time.perf_counter() - started
    results["meta"]["loadavg_end"] = _loadavg()
    print_report(results, verdicts)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(results, f, indent=2)
    log(
        f"wrote {args.output} (load average at start {results['meta']['loadavg_start']}, "
        f"at end {results['meta']['loadavg_end']})"
    )
    return 0


if __name__ == "__main__":
    main()
    sys.exit(0)
