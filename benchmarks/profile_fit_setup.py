#!/usr/bin/env python
"""Host time of a warm `fit` before its first execution runs and after its last, by part.

Run from the repository root (on the device to study; it uses JAX's default platform):

    python benchmarks/profile_fit_setup.py                # the GA 8 model of bench_ga_replication
    python benchmarks/profile_fit_setup.py --executions 4 --fits 30

A warm `fit` (its program compiled) spends its first milliseconds on the host: checks, the
data feed, the program's lookup, the metrics' reset, the callbacks, the state's move to the
device and the first execution's data. The device idles meanwhile, so on short fits this fixed
cost weighs on throughput (bench_ga_replication.py's `--timeline` shows its share). This script
times the model of `bench_ga_replication.py` (GA 8, micro-batch 32, 64 steps per execution)
for `--fits` warm fits and prints the median time from the call to the first dispatch and the
mean time per fit inside each part (the parts are the trainer's own functions, wrapped; what
no part covers is the rest); then the same from the last dispatch's return to the fit's (the
device's last executions, which the epoch's logs wait for, and what follows). "first
execution's data" is the wait for the infeed's first item; on an accelerator "first dispatch"
may also wait for its copy to reach the device.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import keras_ipu as ipu  # noqa: E402  (selects Keras' JAX backend before keras loads)

UNITS, MICRO, GA, SPE = 512, 32, 8, 64


class PartTimer:
    """Wraps functions so that each call's wall time adds to its part's total."""

    def __init__(self):
        self.totals: dict[str, float] = collections.defaultdict(float)
        self._undo: list = []

    def wrap(self, owner, name: str, part: str, first_only: bool = False) -> None:
        original = getattr(owner, name)
        calls = {"since_reset": 0}
        totals = self.totals

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                calls["since_reset"] += 1
                if not first_only or calls["since_reset"] == 1:
                    totals[part] += time.perf_counter() - started

        timed.reset = lambda: calls.update(since_reset=0)
        setattr(owner, name, timed)
        self._undo.append((owner, name, original, timed))

    def new_fit(self) -> None:
        for *_, timed in self._undo:
            timed.reset()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--executions", type=int, default=16, help="executions per fit")
    parser.add_argument("--fits", type=int, default=20, help="warm fits timed")
    args = parser.parse_args(argv)
    import jax
    import keras
    import numpy as np

    from keras_ipu.device import infeed
    from keras_ipu.device.program import ExecutionProgram
    from keras_ipu.keras import data, infeeds, metric_reset, programs, replication, trainer

    config = ipu.config.IPUConfig()
    config.auto_select_ipus = 1
    config.configure_ipu_system()
    with ipu.IPUStrategy().scope():
        model = keras.Sequential([keras.Input((UNITS,))] + [
            keras.layers.Dense(UNITS, activation=a) for a in ("relu", "relu", None)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", steps_per_execution=SPE)
    model.set_gradient_accumulation_options(GA, "mean")
    rng = np.random.default_rng(0)
    samples = args.executions * SPE * MICRO
    x = rng.normal(size=(samples, UNITS)).astype("float32")
    y = rng.normal(size=(samples, UNITS)).astype("float32")

    def fit():
        model.fit(x, y, batch_size=MICRO, epochs=1, shuffle=False, verbose=0)

    fit()  # compile
    from keras_ipu.device import background

    background.wait_for_compilations()
    fit()
    timer = PartTimer()
    for owner, name, part in (
            (trainer, "_placement", "checks and placement"),
            (data, "make_feed", "data feed"),
            (programs, "prepare", "program lookup"),
            (trainer, "_callback_list", "callbacks"),
            (trainer, "_check_train_step", "checks and placement"),
            (trainer, "_check_accumulation", "checks and placement"),
            (type(model), "_symbolic_build", "symbolic build"),
            (trainer, "_log_plan", "plan logged"),
            (metric_reset, "reset_metrics", "metrics reset"),
            (keras.callbacks.CallbackList, "on_train_begin", "callbacks"),
            (keras.callbacks.CallbackList, "on_epoch_begin", "callbacks"),
            (infeeds, "open_infeed", "infeed opened"),
            (type(model), "_get_jax_state", "state from the variables"),
            (replication.ReplicaCodec, "to_device", "state to the device")):
        timer.wrap(owner, name, part)
    timer.wrap(infeed.Infeed, "__next__", "first execution's data", first_only=True)
    dispatches = []
    timer.wrap(ExecutionProgram, "__call__", "first dispatch", first_only=True)
    original_call = ExecutionProgram.__call__

    def marked(program, state, batches):
        dispatches.append(time.perf_counter())
        result = original_call(program, state, batches)
        dispatches.append(time.perf_counter())
        return result

    ExecutionProgram.__call__ = marked
    tail = PartTimer()
    for owner, name, part in (
            (trainer, "_epoch_logs", "epoch logs (waits for the device)"),
            (type(model), "jax_state_sync", "state to the variables"),
            (keras.callbacks.CallbackList, "on_epoch_end", "callbacks"),
            (keras.callbacks.CallbackList, "on_train_end", "callbacks"),
            (type(model.optimizer), "finalize_variable_values", "optimizer's finalize"),
            (data.ArrayFeed, "close", "feed closed")):
        tail.wrap(owner, name, part)
    setups, tails = [], []
    for _ in range(args.fits):
        timer.new_fit()
        dispatches.clear()
        started = time.perf_counter()
        fit()
        setups.append(dispatches[0] - started)
        tails.append(time.perf_counter() - dispatches[-1])
    print(f"{jax.devices()[0].device_kind}: {args.fits} warm fits of {args.executions} "
          f"executions")
    _print_parts("call -> first dispatch", setups, timer.totals, args.fits,
                 uncovered=("first dispatch",))
    _print_parts("last dispatch -> return (with the device's last executions)", tails,
                 tail.totals, args.fits)
    return 0


def _print_parts(phase, durations, totals, fits, uncovered=()):
    print(f"{phase}: median {1e3 * statistics.median(durations):.2f} ms, "
          f"mean {1e3 * statistics.mean(durations):.2f} ms")
    covered = 0.0
    for part, seconds in sorted(totals.items(), key=lambda item: -item[1]):
        if part not in uncovered:
            covered += seconds
        print(f"  {part:34s} {seconds * 1e3 / fits:6.3f} ms")
    print(f"  {'the rest':34s} {1e3 * (statistics.mean(durations) - covered / fits):6.3f} ms")


if __name__ == "__main__":
    raise SystemExit(main())
