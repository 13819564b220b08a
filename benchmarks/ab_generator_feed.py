"""fit steps/s fed by a generator of NumPy batches: a small MLP, so the feed's cost shows.

Run it under two checkouts in turn (a git worktree of the base, then this one) and
compare the medians; the label names the run in its line:

    PYTHONPATH=<worktree of the base> python benchmarks/ab_generator_feed.py base
    python benchmarks/ab_generator_feed.py head
"""

from __future__ import annotations

import sys
import time

import keras
import numpy as np

import keras_ipu as ipu

BATCH, WIDTH, STEPS, STEPS_PER_EXECUTION, FITS = 32, 256, 400, 20, 5


def batches(xs: np.ndarray, ys: np.ndarray):
    """The batches, in order, for ever."""
    while True:
        yield from zip(xs, ys)


def steps_per_second() -> list[float]:
    """Steps/s of `FITS` fits of `STEPS` steps each, after one that compiles."""
    config = ipu.config.IPUConfig()
    config.auto_select_ipus = 1
    config.configure_ipu_system()
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(STEPS, BATCH, WIDTH)).astype("float32")
    ys = rng.normal(size=(STEPS, BATCH, 1)).astype("float32")
    with ipu.ipu_strategy.IPUStrategy().scope():
        model = keras.Sequential([keras.Input((WIDTH,)),
                                  keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(1)])
        model.compile("sgd", "mse", steps_per_execution=STEPS_PER_EXECUTION)
    model.fit(batches(xs, ys), steps_per_epoch=STEPS, verbose=0)  # compiles
    rates = []
    for _ in range(FITS):
        started = time.perf_counter()
        model.fit(batches(xs, ys), steps_per_epoch=STEPS, verbose=0)
        rates.append(STEPS / (time.perf_counter() - started))
    return rates


if __name__ == "__main__":
    label = sys.argv[1] if len(sys.argv) > 1 else "run"
    rates = steps_per_second()
    print(label, "steps/s median", round(float(np.median(rates))),
          [round(rate) for rate in rates])
