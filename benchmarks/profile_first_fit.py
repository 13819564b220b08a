#!/usr/bin/env python
"""Where the first `fit` of a fresh model spends its time: keras_ipu and plain Keras.

Run from the repository root:

    python benchmarks/profile_first_fit.py                   # ResNet50 32x32, batch 128, spe 20
    python benchmarks/profile_first_fit.py --model mlp --top 30

Builds the model (random weights) once in plain Keras and once in `IPUStrategy().scope()`,
runs the first `fit` of one execution of each under cProfile and prints the wall time and
the functions with the most cumulative time (tracing, lowering, XLA compilation, keras_ipu's
own preparation), so a first-fit gap can be attributed before anything is changed.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_zoo as zoo  # noqa: E402

SIZES = {"resnet50": (128, 20), "mlp": (32, 100), "convnet": (64, 64)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet50", choices=sorted(SIZES))
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    zoo.configure_ipus(1)
    import jax
    import keras
    import numpy as np

    jax.config.update("jax_enable_compilation_cache", False)
    spec = zoo.ZOO[args.model]
    batch, spe = SIZES[args.model]
    zoo.warm_up_process(keras, jax, np)
    x, y = spec.data(np, batch * spe, seed=1)
    section = zoo.single_section()
    weights = zoo.build_model(keras, spec, None, ipu_scope=False,
                              place=section.plain_place).get_weights()
    for variant in ("plain", "ipu"):
        model = section.make(keras, spec, weights, spe, ipu_scope=variant == "ipu")
        profile = cProfile.Profile()
        started = time.perf_counter()
        profile.enable()
        model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
        jax.block_until_ready([v.value for v in model.trainable_variables])
        profile.disable()
        print(f"\n=== {variant}: first fit {time.perf_counter() - started:.2f} s")
        out = io.StringIO()
        stats = pstats.Stats(profile, stream=out).sort_stats("cumulative")
        stats.print_stats(args.top)
        if variant == "ipu":  # keras_ipu's own functions, by cumulative time
            stats.print_stats("keras_ipu", args.top)
        print("\n".join(line for line in out.getvalue().splitlines() if line.strip()))


if __name__ == "__main__":
    main()
