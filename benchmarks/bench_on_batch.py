#!/usr/bin/env python
"""Keras' batch methods on IPU models: time per call against plain Keras 3.

Run from the repository root:

    python benchmarks/bench_on_batch.py                  # 5 rounds of 200 calls
    python benchmarks/bench_on_batch.py --rounds 9 --calls 500

`train_on_batch`, `test_on_batch` and `predict_on_batch` of a model made in an
`IPUStrategy` run Keras' own step on one batch as an IPU program: compiled once per
input signature and memory-checked, then run as the device connection allows. Each call
pays that program's dispatch and the signature lookup on top of Keras' own work. The same
MLP (32 -> 64 -> 1, Adam, batch 32) is built twice with the same weights, once plain and
once on 1 IPU; rounds alternate the two (so a load that comes and goes falls on both)
and the median time per call of each, and their ratio, are printed per method. The
figure: keras_ipu / plain per call (lower is better; 1.0 is parity).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")

import keras  # noqa: E402
import numpy as np  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import keras_ipu as ipu  # noqa: E402

METHODS = ("train_on_batch", "test_on_batch", "predict_on_batch")


def _model() -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    return model


def _per_call(model: keras.Model, method: str, calls: int, x, y) -> float:
    args = (x,) if method == "predict_on_batch" else (x, y)
    call = getattr(model, method)
    started = time.perf_counter()
    for _ in range(calls):
        call(*args)
    return (time.perf_counter() - started) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    config = ipu.config.IPUConfig()
    config.auto_select_ipus = 1
    config.configure_ipu_system()
    plain = _model()
    with ipu.ipu_strategy.IPUStrategy().scope():
        on_ipu = _model()
    rng = np.random.default_rng(0)
    x, y = rng.random((32, 32), np.float32), rng.random((32, 1), np.float32)
    times: dict = {(kind, method): [] for kind in ("plain", "ipu") for method in METHODS}
    for model in (plain, on_ipu):  # warm-up: compile every method's step
        for method in METHODS:
            _per_call(model, method, 2, x, y)
    for _ in range(args.rounds):
        for method in METHODS:
            for kind, model in (("plain", plain), ("ipu", on_ipu)):
                times[kind, method].append(_per_call(model, method, args.calls, x, y))
    print(f"per call, median of {args.rounds} rounds of {args.calls} calls:")
    for method in METHODS:
        p, i = (statistics.median(times[kind, method]) for kind in ("plain", "ipu"))
        print(f"  {method:17s} plain {1e6 * p:7.1f} us  keras_ipu {1e6 * i:7.1f} us  "
              f"keras_ipu / plain {i / p:5.2f}")


if __name__ == "__main__":
    main()
