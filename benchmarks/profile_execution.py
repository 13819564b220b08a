#!/usr/bin/env python
"""Host time of one execution, end to end: where keras_ipu's per-execution overhead goes.

Run from the repository root (on the device to study; it uses JAX's default platform):

    python benchmarks/profile_execution.py                 # S=1, 3 x Dense(64), batch 32
    python benchmarks/profile_execution.py --spe 10 --top 30
    python benchmarks/profile_execution.py --resident      # data kept on the device (GPU path)

Trains the small model of `bench_single_ipu.py` for one warm epoch of `--batches` steps,
times it (microseconds per execution), then runs the same epoch under cProfile and prints
the functions with the most own time, so the per-execution cost can be attributed
(dispatch, data, bookkeeping, waiting for the device).
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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spe", type=int, default=1)
    parser.add_argument("--batches", type=int, default=2000)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--resident", action="store_true",
                        help="keep the data on the device, as on a GPU (forced on CPU devices)")
    args = parser.parse_args(argv)
    zoo.configure_ipus(1)
    import jax
    import keras
    import numpy as np

    if args.resident:
        from keras_ipu.keras import resident

        resident.fits_on = lambda *_: True
    spec = zoo.ZOO["mlp"]
    x, y = spec.data(np, args.batches * spec.batch, seed=1)
    model = zoo.single_section().make(keras, spec, None, args.spe, ipu_scope=True)
    runner = zoo.Runner(model, spec.batch, zoo.contextlib.nullcontext, jax)
    runner.fit(x, y)  # compile
    from keras_ipu.device import background

    background.wait_for_compilations()  # the loop, on accelerators
    runner.fit(x, y)
    seconds = min(runner.fit(x, y) for _ in range(3))
    executions = args.batches // args.spe
    print(f"{jax.devices()[0].device_kind}: S={args.spe}, {executions} executions, "
          f"{seconds / executions * 1e6:.1f} us per execution "
          f"({args.batches / seconds:,.0f} steps/s)")
    profile = cProfile.Profile()
    profile.enable()
    started = time.perf_counter()
    runner.fit(x, y)
    profile.disable()
    print(f"profiled epoch: {time.perf_counter() - started:.3f} s")
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(args.top)
    print(out.getvalue())


if __name__ == "__main__":
    main()
