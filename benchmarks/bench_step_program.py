#!/usr/bin/env python
"""What XLA compiles for one training step: keras_ipu's program against plain Keras' step.

Run from the repository root (on the device to study; JAX's default platform):

    python benchmarks/bench_step_program.py                    # ResNet50 32x32, 4 rounds
    python benchmarks/bench_step_program.py --model dense4096 --rounds 6 --json out.json
    python benchmarks/bench_step_program.py --cpu-form         # on CPUs: keras_ipu's CPU form

A first `fit` waits for XLA to compile its step; keras_ipu's must cost no more than plain
Keras'. The models are `bench_accelerator.py`'s, compiled with `steps_per_execution=1`:
plain Keras' step is its `train_step` under `jax.jit`, lowered for the model's state and
one batch (what its `fit` compiles); keras_ipu's is the program its first `fit` lowers
(recorded as it is handed to XLA). Both lowered programs are then compiled `--rounds`
times each, alternating, and the medians compared; their StableHLO operations are counted
by name, and the names whose counts differ are printed.

On CPUs keras_ipu rewrites a program's convolutions and unrolls its random bits
(`keras_ipu/device/convolutions.py`, `lowering.py`): by default the benchmark lowers
keras_ipu's program as on an accelerator, without those, so that the two programs differ
only by what keras_ipu adds; `--cpu-form` keeps them.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_accelerator as accelerator  # noqa: E402
import bench_zoo as zoo  # noqa: E402

TARGET = 1.05  # keras_ipu's compile time / plain Keras', at most


class _Recorded(Exception):
    """keras_ipu's program was recorded."""


def operations(text: str) -> collections.Counter:
    """StableHLO operations of a lowered program's text, counted by name."""
    return collections.Counter(re.findall(r"stablehlo\.[a-z_]+", text))


def compile_seconds(jax, text: str) -> float:
    """Seconds XLA takes to compile a lowered program's text for the first device.

    Through the backend itself: `Lowered.compile()` keeps its executable, and
    each round must compile anew.
    """
    from jax._src import compiler  # benchmark only: the options `jax.jit` compiles with

    options = compiler.get_compile_options(num_replicas=1, num_partitions=1)
    device = jax.devices()[0]
    started = time.perf_counter()
    device.client.compile_and_load(text, [device], options)
    return time.perf_counter() - started


def plain_step(keras, jax, spec, weights, x, y):
    """Plain Keras' step lowered for one batch (the model built on one fit of it)."""
    model = zoo.single_section().make(keras, spec, weights, 1, ipu_scope=False)
    model.fit(x, y, batch_size=spec.batch, epochs=1, shuffle=False, verbose=0)
    state = tuple([v.value for v in variables] for variables in (
        model.trainable_variables, model.non_trainable_variables,
        model.optimizer.variables, model.metrics_variables))
    return jax.jit(model.train_step, donate_argnums=0).lower(state, (x, y))


def ipu_step(keras, spec, weights, x, y, cpu_form: bool):
    """keras_ipu's one-step program, as its first fit lowers it."""
    from keras_ipu.device import compiler, program

    lowered = []

    def record(low, options):
        lowered.append(low)
        raise _Recorded  # nothing to run: only the program is wanted

    compile_lowered = compiler.compile_lowered
    trace_for, lower_for = program.convolutions.trace_for, program.lowering.lower_for
    compiler.compile_lowered = record
    if not cpu_form:  # the accelerator form: no CPU rewrite
        program.convolutions.trace_for = lambda platform, jitted, *args: jitted.trace(*args)
        program.lowering.lower_for = lambda platform, traced: traced.lower()
    try:
        model = zoo.single_section().make(keras, spec, weights, 1, ipu_scope=True)
        model.fit(x, y, batch_size=spec.batch, epochs=1, shuffle=False, verbose=0)
    except _Recorded:
        pass
    finally:
        compiler.compile_lowered = compile_lowered
        program.convolutions.trace_for, program.lowering.lower_for = trace_for, lower_for
    return lowered[0]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet50", choices=sorted(accelerator.MODELS))
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--cpu-form", action="store_true",
                        help="on CPUs, lower keras_ipu's program as keras_ipu does there")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    os.environ.setdefault("KERAS_IPU_FLAGS", "--background_loop_compile=false")
    zoo.configure_ipus(1)
    import jax
    import keras
    import numpy as np

    jax.config.update("jax_enable_compilation_cache", False)
    spec = accelerator.MODELS[args.model]
    x, y = spec.data(np, spec.batch, seed=1)
    weights = zoo.build_model(keras, spec, None, ipu_scope=False,
                              place=zoo.single_section().plain_place).get_weights()
    lowered = {"plain": plain_step(keras, jax, spec, weights, x, y),
               "ipu": ipu_step(keras, spec, weights, x, y, args.cpu_form)}
    texts = {variant: low.as_text() for variant, low in lowered.items()}
    counts = {variant: operations(text) for variant, text in texts.items()}
    seconds = {variant: [] for variant in lowered}
    for round_ in range(args.rounds):
        for variant in (("plain", "ipu") if round_ % 2 == 0 else ("ipu", "plain")):
            seconds[variant].append(compile_seconds(jax, texts[variant]))
    medians = {variant: statistics.median(s) for variant, s in seconds.items()}
    ratio = medians["ipu"] / medians["plain"]
    device = jax.devices()[0].device_kind
    print(f"{device}, {args.model}, {'CPU' if args.cpu_form else 'accelerator'} form, "
          f"{args.rounds} rounds")
    for variant in lowered:
        print(f"{variant:<6} compile median {medians[variant]:.3f} s "
              f"{[round(s, 3) for s in seconds[variant]]}, "
              f"{sum(counts[variant].values())} operations")
    differing = {name: (counts["ipu"][name], counts["plain"][name])
                 for name in sorted(set(counts["ipu"]) | set(counts["plain"]))
                 if counts["ipu"][name] != counts["plain"][name]}
    print("operations keras_ipu / plain where they differ:",
          ", ".join(f"{name[10:]} {a}/{b}" for name, (a, b) in differing.items()) or "none")
    verdict = "PASS" if ratio <= TARGET else "MISS"
    print(f"compile keras_ipu / plain: {ratio:.3f} ({verdict}, target <= {TARGET})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "device": device, "cpu_form": args.cpu_form,
                       "seconds": seconds, "medians": medians, "ratio": ratio,
                       "differing_operations": differing}, f, indent=2)


if __name__ == "__main__":
    main()
