"""fit steps/s fed by a generator of NumPy batches: a small MLP, so the feed's cost shows.

Run it under two checkouts in turn (a git worktree of the base, then this one) and
compare the medians; the label names the run in its line:

    python benchmarks/ab_generator_feed.py base   # PYTHONPATH=<worktree of the base>
    python benchmarks/ab_generator_feed.py head
"""

import sys
import time

import keras_ipu as ipu  # first: it selects Keras' JAX backend
import keras
import numpy as np

cfg = ipu.config.IPUConfig(); cfg.auto_select_ipus = 1; cfg.configure_ipu_system()
B, W, STEPS = 32, 256, 400
rng = np.random.default_rng(0)
xs = rng.normal(size=(STEPS, B, W)).astype("float32"); ys = rng.normal(size=(STEPS, B, 1)).astype("float32")
def gen():
    while True:
        for i in range(STEPS):
            yield xs[i], ys[i]
with ipu.ipu_strategy.IPUStrategy().scope():
    m = keras.Sequential([keras.Input((W,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(1)])
    m.compile("sgd", "mse", steps_per_execution=20)
m.fit(gen(), steps_per_epoch=STEPS, verbose=0)  # compile
times = []
for _ in range(5):
    t = time.perf_counter(); m.fit(gen(), steps_per_epoch=STEPS, verbose=0); times.append(time.perf_counter() - t)
print(sys.argv[1] if len(sys.argv) > 1 else "run", "steps/s median", round(STEPS / float(np.median(times))), [round(STEPS / t) for t in times])
