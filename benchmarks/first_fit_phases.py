#!/usr/bin/env python
"""Where a first `fit` goes: plain Keras against keras_ipu, phase by phase.

Run from the repository root (on the device to study; JAX's default platform):

    python benchmarks/first_fit_phases.py                       # ResNet50 32x32, 2 rounds
    python benchmarks/first_fit_phases.py --model dense64 --rounds 3 --json out.json
    XLA_FLAGS=... python benchmarks/first_fit_phases.py         # an XLA option's effect

The models and data are `bench_accelerator.py`'s. Both variants first fit once, untimed,
so the process-wide caches (XLA's autotuning results, the optimizer's slot programs) are
warm for both; then `--rounds` fresh models per variant, order alternating, each time
the first `fit` of one execution. For every fit: its wall time, and JAX's own durations
of the programs it prepared (monitoring events, summed over the fit): tracing to a
jaxpr, lowering to MLIR, XLA's compilation. What is left is the run itself and the host
work around it. Medians are printed; `--json` writes every sample.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_accelerator as accelerator  # noqa: E402
import bench_zoo as zoo  # noqa: E402

PHASES = {
    "trace_s": "/jax/core/compile/jaxpr_trace_duration",
    "lower_s": "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "compile_s": "/jax/core/compile/backend_compile_duration",
}


class PhaseTimes:
    """Sums JAX's monitoring durations per phase while `collecting`."""

    def __init__(self, jax):
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.compiles = 0
        by_event = {event: phase for phase, event in PHASES.items()}

        def add(event, duration, **_kwargs):
            phase = by_event.get(event)
            if phase is not None:
                self.totals[phase] += duration
                self.compiles += phase == "compile_s"

        jax.monitoring.register_event_duration_secs_listener(add)

    def reset(self):
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.compiles = 0


def first_fit(case, variant, phases):
    """One fresh model's first fit: wall seconds, phase seconds and compilations.

    A loop compiling in the background once the fit has returned is waited for
    and shown apart (`background_compile_s`).
    """
    from keras_ipu.device import background

    runner = case.runner(variant)
    phases.reset()
    seconds = runner.fit(case.first_x, case.first_y)
    sample = {"wall_s": seconds, **phases.totals, "compiles": phases.compiles}
    sample["rest_s"] = seconds - sum(phases.totals.values())
    background.wait_for_compilations()
    sample["background_compile_s"] = phases.totals["compile_s"] - sample["compile_s"]
    del runner
    gc.collect()
    return sample


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet50", choices=sorted(accelerator.MODELS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", help="write every sample here")
    args = parser.parse_args(argv)
    zoo.configure_ipus(1)
    import jax
    import keras
    import numpy as np

    jax.config.update("jax_enable_compilation_cache", False)
    phases = PhaseTimes(jax)
    zoo_args = zoo.parse_args([], zoo=accelerator.MODELS)
    case = zoo.Case(accelerator.accelerator_section(), accelerator.MODELS[args.model], zoo_args,
                    keras, jax, np, zoo.CompileCounter(jax))
    started = time.perf_counter()
    cold = {variant: first_fit(case, variant, phases) for variant in case.VARIANTS}
    samples = {variant: [] for variant in case.VARIANTS}
    for round_ in range(args.rounds):
        for variant in case.order(round_):
            samples[variant].append(first_fit(case, variant, phases))
    keys = ("wall_s", *PHASES, "rest_s", "compiles", "background_compile_s")
    medians = {v: {k: statistics.median(s[k] for s in samples[v]) for k in keys}
               for v in case.VARIANTS}
    print(f"{jax.devices()[0].device_kind}, {args.model}, XLA_FLAGS="
          f"{os.environ.get('XLA_FLAGS', '')!r}, KERAS_IPU_FLAGS="
          f"{os.environ.get('KERAS_IPU_FLAGS', '')!r}; {args.rounds} rounds, medians "
          f"({time.perf_counter() - started:.0f} s)")
    print(f"{'variant':<8}" + "".join(f"{k.replace('background_', 'bg_'):>13}" for k in keys)
          + f"{'cold wall_s':>13}")
    for variant in case.VARIANTS:
        print(f"{variant:<8}" + "".join(f"{medians[variant][k]:>13.3f}" for k in keys)
              + f"{cold[variant]['wall_s']:>13.3f}")
    ratio = medians["ipu"]["wall_s"] / medians["plain"]["wall_s"]
    print(f"first fit keras_ipu / plain: {ratio:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "device": jax.devices()[0].device_kind,
                       "xla_flags": os.environ.get("XLA_FLAGS", ""), "cold": cold,
                       "samples": samples, "medians": medians}, f, indent=2)


if __name__ == "__main__":
    main()
