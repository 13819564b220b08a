#!/usr/bin/env python
"""What the floating point traps cost: first fit, warm epochs and predict, traps off against on.

Run from the repository root:

    python benchmarks/bench_fp_traps.py                 # 2 rounds
    python benchmarks/bench_fp_traps.py --rounds 3

An IPU traps `inv`, `div0` and `oflo` in hardware, for nothing; keras_ipu checks every
operation of the program instead (`IPUConfig.floating_point_behaviour.set_all`), which
costs compile time, device time and memory. A small model of the kinds the checks meet
(convolutions, batch normalization, pooling, attention, dropout; 1 IPU,
`steps_per_execution=4`) is built fresh, on the same data and weights, with the traps off
and on, the two alternating in one process, so a load that comes and goes falls on both.
Printed per mode, medians of the rounds: the first fit (compilation included), three warm
epochs, the first predict and a warm one; then the ratios on / off.
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

PHASES = ("first fit", "3 warm epochs", "first predict", "warm predict")


def _model() -> keras.Model:
    layers = keras.layers
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16, 16, 3))
    h = inputs
    for filters in (8, 16, 16):
        h = layers.Conv2D(filters, 3, padding="same")(h)
        h = layers.ReLU()(layers.BatchNormalization()(h))
        h = layers.MaxPooling2D(2, padding="same")(h)
    tokens = layers.Reshape((-1, 16))(h)
    attended = layers.MultiHeadAttention(2, 8, dropout=0.1)(tokens, tokens)
    tokens = layers.LayerNormalization()(tokens + attended)
    outputs = layers.Dense(5)(layers.Dropout(0.2)(layers.GlobalAveragePooling1D()(tokens)))
    return keras.Model(inputs, outputs)


def _times(traps: bool, x, y) -> list[float]:
    config = ipu.config.IPUConfig()
    config.auto_select_ipus = 1
    config.floating_point_behaviour.set_all = traps
    config.configure_ipu_system()
    with ipu.ipu_strategy.IPUStrategy().scope():
        model = _model()
        model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"], steps_per_execution=4)
    calls = (lambda: model.fit(x, y, batch_size=8, verbose=0),
             lambda: model.fit(x, y, batch_size=8, epochs=3, verbose=0),
             lambda: model.predict(x, batch_size=8, verbose=0),
             lambda: model.predict(x, batch_size=8, verbose=0))
    times = []
    for call in calls:
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 16, 16, 3)).astype("float32")
    y = rng.integers(0, 5, size=(64,))
    runs = {False: [], True: []}
    for _ in range(args.rounds):
        for traps in (False, True):
            runs[traps].append(_times(traps, x, y))
    medians = {traps: [statistics.median(r[i] for r in rounds) for i in range(len(PHASES))]
               for traps, rounds in runs.items()}
    for traps, label in ((False, "traps off"), (True, "traps on")):
        print(f"{label:10s}", ", ".join(f"{phase} {seconds:.2f} s"
                                        for phase, seconds in zip(PHASES, medians[traps])))
    print("on / off  ", ", ".join(f"{phase} {on / off:.1f}x" for phase, on, off
                                  in zip(PHASES, medians[True], medians[False])))


if __name__ == "__main__":
    main()
