#!/usr/bin/env python
"""Device-resident data: what cutting a pass into executions costs, and what `fit` gains.

Run from the repository root (it uses JAX's default platform: run it on the GPU to study):

    python benchmarks/bench_resident_cut.py              # ~2 min on 2 vCPUs
    python benchmarks/bench_resident_cut.py --quick

On accelerators, array data that fits stays on the device for a run and each pass over it
is cut into the executions' batches there (`keras_ipu/keras/resident.py`). Two ways to cut,
A/B in one process, interleaved rounds, medians:

    unstacked   the pass cut by one program into `[executions, steps, batch, ...]`, then
                unstacked by iterating each device array (JAX's own way: an eager slice and
                an eager unstack per 100 rows, each compiled per leaf shape); keras_ipu's
                way until this benchmark was written.
    cut         keras_ipu's way now: one program per data shape takes `EXECUTIONS_PER_CUT`
                executions' rows of the pass order and returns them as separate arrays.

Parts:

    cut   the 3 x Dense(64) model's data (batch 32, 2,000 batches): the first pass in a
          process (compiles included; JAX's caches are cleared before it) and a warm pass,
          per execution, at S = 1 and 10.
    fit   keras_ipu `fit` of that model with its data kept on the device (forced on CPU
          devices, where keras_ipu would read host arrays instead), steps/s, each cut.

Results go to benchmarks/results/bench_resident_cut.json. Exits 0 whatever the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_zoo as zoo  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WAYS = ("unstacked", "cut")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds")
    parser.add_argument("--batches", type=int, default=2000, help="batches in the data")
    parser.add_argument("--output", default=os.path.join(ROOT, "benchmarks", "results",
                                                         "bench_resident_cut.json"))
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (1 if args.quick else 5)
    if args.quick:
        args.batches = 200
    return args


def unstacked_passes(resident, jax, np):
    """The cut before: the whole pass by one program, then iterated per device array."""

    class UnstackedPasses(resident.ResidentPasses):
        def new_pass(self, order):
            self._executions = []
            shape = (self._executions_per_pass, *self._cut.keywords["shape"][1:])
            regroup = self._cut.keywords["regroup"]
            rows = self._executions_per_pass * self._rows_per_execution
            if order is not None:
                order = jax.device_put(np.asarray(order[:rows], np.int32), self.device)
            stacked = _whole_pass(self._data, order, shape=shape, rows=rows, regroup=regroup)
            leaves, treedef = jax.tree_util.tree_flatten(stacked)
            columns = [list(leaf) for leaf in leaves]
            self._executions = [treedef.unflatten(parts) for parts in zip(*columns)]

    @functools.partial(jax.jit, static_argnames=("shape", "rows", "regroup"))
    def _whole_pass(data, order, *, shape, rows, regroup):
        def take(a):
            a = a[:rows] if order is None else a[order]
            return a.reshape(*shape, *a.shape[1:])

        return jax.vmap(regroup)(jax.tree_util.tree_map(take, data))

    return UnstackedPasses


def _regroup(batches):
    return batches


def bench_cut(args, classes, jax, np, log):
    spec = zoo.ZOO["mlp"]
    x, y = spec.data(np, args.batches * spec.batch, seed=1)
    device = jax.devices()[0]
    results = {}
    for spe in (1, 10):
        executions = args.batches // spe
        samples = {way: {"first_s": [], "warm_us": []} for way in WAYS}
        for _ in range(args.rounds):
            for way in WAYS:
                jax.clear_caches()
                passes = classes[way]((x, y), device, (spe,), spec.batch, executions, _regroup)
                started = time.perf_counter()
                passes.new_pass(np.random.permutation(len(x)))  # fit shuffles by default
                jax.block_until_ready(passes._executions)
                samples[way]["first_s"].append(time.perf_counter() - started)
                started = time.perf_counter()
                passes.new_pass(np.random.permutation(len(x)))
                jax.block_until_ready(passes._executions)
                warm = time.perf_counter() - started
                samples[way]["warm_us"].append(warm / executions * 1e6)
                del passes
        entry = {way: {k: statistics.median(v) for k, v in samples[way].items()} for way in WAYS}
        entry["samples"] = samples
        results[str(spe)] = entry
        log(f"cut S={spe:>3} ({executions} executions): first pass "
            f"{entry['unstacked']['first_s']:.2f} s -> {entry['cut']['first_s']:.2f} s; warm "
            f"{entry['unstacked']['warm_us']:.1f} -> {entry['cut']['warm_us']:.1f} us/execution")
    return results


def bench_fit(args, classes, resident, jax, keras, np, log):
    spec = zoo.ZOO["mlp"]
    x, y = spec.data(np, args.batches * spec.batch, seed=1)
    results = {}
    from keras_ipu.keras import data

    original_fits, original_class = resident.fits_on, data.ResidentPasses
    resident.fits_on = lambda *_: True
    try:
        for spe in (1, 10):
            model = zoo.single_section().make(keras, spec, None, spe, ipu_scope=True)
            runner = zoo.Runner(model, spec.batch, contextlib.nullcontext, jax)
            samples = {way: [] for way in WAYS}
            for way in WAYS:  # compiled, and each way's cut once
                data.ResidentPasses = classes[way]
                runner.fit(x, y)
            for _ in range(args.rounds):
                for way in WAYS:
                    data.ResidentPasses = classes[way]
                    samples[way].append(args.batches / runner.fit(x, y))
            entry = {way: statistics.median(samples[way]) for way in WAYS}
            entry["ratio"] = entry["cut"] / entry["unstacked"]
            entry["samples"] = samples
            results[str(spe)] = entry
            log(f"fit S={spe:>3}: {entry['unstacked']:,.0f} -> {entry['cut']:,.0f} steps/s "
                f"({entry['ratio']:.2f}x)")
    finally:
        resident.fits_on, data.ResidentPasses = original_fits, original_class
    return results


def main(argv=None):
    args = parse_args(argv)
    zoo.configure_ipus(1)
    import jax
    import keras
    import numpy as np

    from keras_ipu.keras import resident

    def log(message):
        print(message, flush=True)

    device = jax.devices()[0]
    log(f"{device.platform} ({device.device_kind}), jax {jax.__version__}, "
        f"keras {keras.__version__}, {args.rounds} rounds, {args.batches} batches")
    classes = {"unstacked": unstacked_passes(resident, jax, np), "cut": resident.ResidentPasses}
    results = {
        "device": f"{device.platform} ({device.device_kind})",
        "executions_per_cut": resident.EXECUTIONS_PER_CUT,
        "cut": bench_cut(args, classes, jax, np, log),
        "fit": bench_fit(args, classes, resident, jax, keras, np, log),
    }
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(results, f, indent=2)
    log(f"results: {args.output}")


if __name__ == "__main__":
    main()
