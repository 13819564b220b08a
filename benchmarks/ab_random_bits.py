#!/usr/bin/env python
"""A/B of JAX's random-bits hash lowered unrolled (keras_ipu on CPUs) against JAX's own loop.

Run from the repository root:

    python benchmarks/ab_random_bits.py --models transformer,convnet

For each zoo model (`bench_zoo.py`, single IPU), in one process: plain Keras,
keras_ipu as it is (`device/lowering.py`: the hash unrolled) and keras_ipu
lowering the hash as JAX does on CPUs (a loop of 5 rounds). First fits of fresh
models (`--first-rounds`, order swapped each round), then warm epochs of the
first round's models (`--rounds`, interleaved), medians; ratios against plain
Keras. Both keras_ipu variants must end with the same weights (the same bits):
the script says so.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_zoo as zoo  # noqa: E402

VARIANTS = ("plain", "unrolled", "jax_loop")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="transformer,convnet")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--first-rounds", type=int, default=3)
    args = parser.parse_args(argv)
    zoo.configure_ipus(1)
    import jax
    import keras
    import numpy as np

    from keras_ipu.device import lowering

    zoo.warm_up_process(keras, jax, np)
    unrolled = lowering._CPU_PARAMETERS
    settings = argparse.Namespace(quick=False)
    for name in args.models.split(","):
        case = zoo.Case(zoo.single_section(), zoo.ZOO[name], settings, keras, jax, np,
                        zoo.CompileCounter(jax))

        def runner(variant, case=case):
            # Programs are lowered at their first fit, with the rule in force then.
            lowering._CPU_PARAMETERS = None if variant == "jax_loop" else unrolled
            return case.runner("plain" if variant == "plain" else "ipu")

        first, runners = {v: [] for v in VARIANTS}, {}
        for round_ in range(args.first_rounds):
            for variant in VARIANTS if round_ % 2 == 0 else VARIANTS[::-1]:
                run = runner(variant)
                gc.collect()
                first[variant].append(case.first_fit(run)[0])
                runners.setdefault(variant, run)
        lowering._CPU_PARAMETERS = unrolled
        for run in runners.values():
            run.fit(case.x, case.y)
        warm = {v: [] for v in VARIANTS}
        for round_ in range(args.rounds):
            for variant in VARIANTS if round_ % 2 == 0 else VARIANTS[::-1]:
                warm[variant].append(case.steps / runners[variant].fit(case.x, case.y))
        plain_warm, plain_first = (statistics.median(warm["plain"]),
                                   statistics.median(first["plain"]))
        for variant in VARIANTS:
            w, f = statistics.median(warm[variant]), statistics.median(first[variant])
            print(f"{name:12s} {variant:9s} warm {w:8.1f} steps/s ({w / plain_warm:.3f}x plain)"
                  f"  first fit {f:.3f} s ({f / plain_first:.3f}x plain)")
        same = all(np.array_equal(a, b) for a, b in zip(
            runners["unrolled"].model.get_weights(), runners["jax_loop"].model.get_weights()))
        print(f"{name:12s} the two keras_ipu variants' weights are identical: {same}")
        del runners
        gc.collect()


if __name__ == "__main__":
    main()
