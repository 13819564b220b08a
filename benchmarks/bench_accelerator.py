#!/usr/bin/env python
"""keras_ipu against plain Keras 3 on an accelerator (and on CPU): Dense stacks and ResNet50.

Run from the repository root:

    python benchmarks/bench_accelerator.py                  # the table (GPU sizes)
    python benchmarks/bench_accelerator.py --quick          # smoke run, CPU-sized
    python benchmarks/bench_accelerator.py --models dense4096,resnet50 --rounds 5
    python benchmarks/bench_accelerator.py --sweep          # also bench_single_ipu.py

Models (the issue's table; synthetic NumPy data, no downloads):

    dense64    Input(64) + 3 x Dense(64), batch 32, steps_per_execution 100, SGD, MSE
    dense1024  Input(1024) + 3 x Dense(1024), batch 256, spe 50, SGD, MSE
    dense4096  Input(4096) + 4 x Dense(4096), batch 512, spe 4, SGD, MSE (compute-bound:
               about 206 GFLOP a step)
    resnet50   keras.applications.ResNet50(weights=None), 32x32x3, 10 classes, batch 128,
               spe 20, SGD with momentum

Each model is measured as `benchmarks/bench_zoo.py` measures its zoo (same process, same
weights and data, interleaved rounds, medians; see its docstring): warm steps/s and the
time of the first `fit` of a fresh model, compilation included. Targets (issue
"Accelerators"): warm keras_ipu / plain >= 1.0 for every model; first fit <= 1.1x plain.

`--sweep` then runs `benchmarks/bench_single_ipu.py` (keras_ipu against the hand-written
limit for S = 1, 10, 100) in a subprocess on the same device. The report's flops against
the analytic count are checked by `benchmarks/cost_check.py`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)

import bench_zoo as zoo  # noqa: E402  (selects the JAX backend through keras_ipu first)


def dense_stack(width, layers):
    """A builder of Input(width) + `layers` x Dense(width) (relu between)."""

    def build(keras):
        stack = [keras.Input((width,))]
        stack += [keras.layers.Dense(width, activation="relu") for _ in range(layers - 1)]
        return keras.Sequential([*stack, keras.layers.Dense(width)])

    return build


def regression(width):
    """A data maker: standard-normal inputs and targets of `width`."""

    def make(np, rows, seed):
        rng = np.random.default_rng(seed)
        return (
            rng.standard_normal((rows, width), dtype=np.float32),
            rng.standard_normal((rows, width), dtype=np.float32),
        )

    return make


def build_resnet50(keras):
    """ResNet50 from keras.applications, random weights, 32x32 inputs, 10 classes."""
    return keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=10)


Spec = zoo.Spec
MODELS = {
    s.name: s
    # name, build, data, batch, spe, steps, quick spe, quick steps, optimizer[, loss, metrics]
    for s in (
        Spec("dense64", dense_stack(64, 3), regression(64), 32, 100, 5000, 10, 1000, zoo.sgd,
             "mse", ()),
        Spec("dense1024", dense_stack(1024, 3), regression(1024), 256, 50, 500, 5, 20, zoo.sgd,
             "mse", ()),
        Spec("dense4096", dense_stack(4096, 4), regression(4096), 512, 4, 40, 1, 2, zoo.sgd,
             "mse", ()),
        Spec("resnet50", build_resnet50, zoo.float_inputs((32, 32, 3)), 128, 20, 100, 2, 4,
             zoo.sgd_momentum),
    )
}


def parse_args(argv=None):
    """bench_zoo's options, with this script's models, plus `--sweep`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = zoo.parse_args([a for a in argv if a != "--sweep"], zoo=MODELS)
    args.sweep = "--sweep" in argv
    return args


def accelerator_section():
    """keras_ipu on 1 IPU against plain Keras, with this issue's first-fit target."""
    return zoo.Section("single", 1, "steps/s", 1.0, 1.1, pipelined=False)


def main(argv=None):
    """Runs the table (and the sweep); prints it; returns the exit code."""
    args = parse_args(argv)
    started = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - started:6.1f}s] {msg}", flush=True)

    zoo.configure_ipus(1)
    import jax
    import keras
    import numpy as np

    jax.config.update("jax_enable_compilation_cache", False)
    counter = zoo.CompileCounter(jax)
    results = {"meta": zoo.meta(args, keras, jax, counter), "cases": {}, "errors": {},
               "notes": []}
    log(f"keras {keras.__version__}, jax {jax.__version__}, {jax.devices()[0].device_kind}")
    zoo.warm_up_process(keras, jax, np)
    zoo.run_section(accelerator_section(), args.models, args, (keras, jax, np, counter),
                    results, log, zoo=MODELS)
    results["meta"]["total_seconds"] = time.perf_counter() - started
    zoo.print_table(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=str)
    if args.sweep:
        sweep = [sys.executable, os.path.join(_HERE, "bench_single_ipu.py")]
        if args.quick:
            sweep.append("--quick")
        subprocess.run(sweep, check=False)
    failed = results["errors"] or any(
        "FAIL" in (r["warm_verdict"], r["first_verdict"]) for r in results["cases"].values()
    )
    return 1 if args.check and failed else 0


if __name__ == "__main__":
    sys.exit(main())
