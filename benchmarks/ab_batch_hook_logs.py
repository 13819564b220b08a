#!/usr/bin/env python
"""A/B: `fit` with a synchronous per-batch hook at `steps_per_execution=1`, two checkouts.

keras_ipu fetches a batch hook's logs before Keras converts them (a Ctrl-C
during that wait is then not swallowed by Keras' bare `except`); this measures
what the fetch costs per execution against another checkout. Alternate the two
in one session, e.g.:

    KIPU_ROOT=/path/to/old/checkout python benchmarks/ab_batch_hook_logs.py old
    KIPU_ROOT=$PWD python benchmarks/ab_batch_hook_logs.py new

Each run prints the median steps/s of 3 fits of 2,000 steps (Input(64) ->
Dense(64, relu) -> Dense(64), batch 32, SGD, MSE, one virtual IPU).
"""

from __future__ import annotations

import os
import sys

if os.environ.get("KIPU_ROOT"):  # that checkout's keras_ipu, not the installed one
    sys.meta_path = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
    sys.path.insert(0, os.environ["KIPU_ROOT"])

os.environ.setdefault("KERAS_BACKEND", "jax")

import statistics  # noqa: E402
import time  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_ipu as ipu  # noqa: E402

STEPS, BATCH = 2000, 32


def main() -> None:
    config = ipu.config.IPUConfig()
    config.auto_select_ipus = 1
    config.configure_ipu_system()
    x = np.random.rand(STEPS * BATCH, 64).astype("float32")
    y = np.random.rand(STEPS * BATCH, 64).astype("float32")
    with ipu.ipu_strategy.IPUStrategy().scope():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(64)])
        model.compile("sgd", "mse", steps_per_execution=1)
    hook = [keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: None)]
    model.fit(x[:100 * BATCH], y[:100 * BATCH], batch_size=BATCH, verbose=0, callbacks=hook)
    seconds = []
    for _ in range(3):
        started = time.perf_counter()
        model.fit(x, y, batch_size=BATCH, verbose=0, shuffle=False, callbacks=hook)
        seconds.append(time.perf_counter() - started)
    label = sys.argv[1] if len(sys.argv) > 1 else "run"
    print(label, "steps/s", round(STEPS / statistics.median(seconds)), ipu.__file__)


if __name__ == "__main__":
    main()
