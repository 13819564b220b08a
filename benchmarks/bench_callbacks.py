#!/usr/bin/env python
"""Per-batch callbacks: asynchronous keras_ipu against plain Keras 3 and keras_ipu without them.

Run from the repository root:

    python benchmarks/bench_callbacks.py            # ~1-2 min
    python benchmarks/bench_callbacks.py --quick    # smoke run

The small model of `bench_single_ipu.py` (Input(64) -> Dense(64, relu) ->
Dense(64, relu) -> Dense(64), batch 32, SGD(0.01), MSE), one virtual IPU,
`steps_per_execution=100`, a fixed data set of `--batches` batches per epoch:

    plain        plain Keras 3 `fit` with a per-batch callback that does
                 nothing, at `steps_per_execution=1`: plain Keras calls
                 batch callbacks once per execution, so this is how it
                 calls one every step;
    ipu_async    keras_ipu `fit` with `set_asynchronous_callbacks(True)` and
                 the same callback: it gets every step too, streamed out of
                 the on-device loop;
    ipu_off      keras_ipu `fit` without callbacks (one execution of 100
                 steps per device call, no host work per step).

Every variant is compiled first; then they are interleaved for `--repeats`
rounds, each measurement one `fit` of `--epochs` epochs, and the MEDIAN
steps/s is reported. Goals (issue 9): ipu_async >= 1.5x plain and
>= 0.5x ipu_off. Results go to benchmarks/results/bench_callbacks.json; the
script exits 0 whatever the goals say.
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

import keras  # noqa: E402
import numpy as np  # noqa: E402

UNITS, BATCH, SPE = 64, 32, 100


class CountBatches(keras.callbacks.Callback):
    """A per-batch callback that does (almost) nothing: it counts its calls."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def on_train_batch_end(self, batch, logs=None):
        self.calls += 1


def _model(steps_per_execution=SPE):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((UNITS,)),
        keras.layers.Dense(UNITS, activation="relu"),
        keras.layers.Dense(UNITS, activation="relu"),
        keras.layers.Dense(UNITS),
    ])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse",
                  steps_per_execution=steps_per_execution)
    return model


def _variants(strategy):
    plain = _model(steps_per_execution=1)
    with strategy.scope():
        streamed = _model()
        streamed.set_asynchronous_callbacks(True)
        off = _model()
    return {
        "plain": (plain, True),
        "ipu_async": (streamed, True),
        "ipu_off": (off, False),
    }


def _measure(model, with_callback, x, y, epochs):
    callback = CountBatches()
    started = time.perf_counter()
    model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0,
              callbacks=[callback] if with_callback else None)
    seconds = time.perf_counter() - started
    steps = epochs * len(x) // BATCH
    if with_callback and callback.calls != steps:
        raise AssertionError(f"the callback ran {callback.calls} times for {steps} steps")
    return steps / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--batches", type=int, default=2000)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.batches, args.epochs, args.repeats = 400, 1, 2
    config = ipu.config.IPUConfig()
    config.auto_select_ipus = 1
    config.configure_ipu_system()
    strategy = ipu.ipu_strategy.IPUStrategy()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batches * BATCH, UNITS)).astype("float32")
    y = rng.normal(size=(args.batches * BATCH, UNITS)).astype("float32")
    variants = _variants(strategy)
    for model, with_callback in variants.values():  # compile
        _measure(model, with_callback, x[: SPE * BATCH], y[: SPE * BATCH], 1)
    rates: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, (model, with_callback) in variants.items():
            rates[name].append(_measure(model, with_callback, x, y, args.epochs))
    median = {name: statistics.median(values) for name, values in rates.items()}
    result = {
        "steps_per_second": median,
        "runs": rates,
        "async_over_plain": median["ipu_async"] / median["plain"],
        "async_over_off": median["ipu_async"] / median["ipu_off"],
        "goals": {"async_over_plain": 1.5, "async_over_off": 0.5},
        "args": vars(args),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
        "versions": {"keras": keras.__version__, "jax": __import__("jax").__version__},
    }
    for name, value in median.items():
        print(f"{name:10s} {value:10.0f} steps/s")
    print(f"ipu_async / plain   = {result['async_over_plain']:.2f}x (goal >= 1.5)")
    print(f"ipu_async / ipu_off = {result['async_over_off']:.2f}x (goal >= 0.5)")
    out = os.path.join(_REPO, "benchmarks", "results", "bench_callbacks.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
