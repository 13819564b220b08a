#!/usr/bin/env python
"""Pipelined training throughput of keras_ipu: 2 IPUs (2 stages) against 1 IPU.

Run from the repository root:

    python benchmarks/bench_pipeline.py            # full run (~3-4 min)
    python benchmarks/bench_pipeline.py --quick    # smoke run (<60 s)

Model: Input(1024) -> Dense(1024, relu) x3 -> Dense(1024), SGD(0.01), MSE,
synthetic float32 data, micro-batch 64, gradient accumulation 16 (MEAN),
steps_per_execution 64 (4 weight updates per execution), `shuffle=False`,
`verbose=0`. Measured in one process:

    single       keras_ipu `fit` on 1 IPU, no stage assignment,
                 `set_gradient_accumulation_options(16, "mean")`.
    pipe_grouped keras_ipu `fit` pipelined over 2 IPUs, stages [0, 0, 1, 1],
                 `set_pipelining_options(16, "mean", Grouped)`.
    pipe_interleaved, pipe_sequential
                 the same with the Interleaved and Sequential schedules (extra rows,
                 not targets; `--schedules` picks which run; they are timed in the
                 first `--extra-repeats` rounds only, and get no separate second fit).

The IPU system is global, so `configure_ipu_system` is called with the variant's IPU
count before each of its fits (that call is outside the timing). A measurement is one
`fit` epoch over the same data for every variant: a whole number of executions, chosen
so that the warm single-IPU fit lasts at least `--target-seconds`; after `fit` the
weights are waited for. The variants are interleaved for `--repeats` rounds and the
MEDIAN samples/s is reported.

Recompiles: the XLA backend compilations (JAX's monitoring events) are counted during
the timed rounds and the long run, the library's program object and `compile_seconds`
are compared before and after, and the second fit of every model (after the system was
reconfigured for another variant) is timed against its first.

No hang: the Grouped model then trains `--hang-steps` micro-batches (default 2,000,
rounded up to a whole number of executions, as IPU Keras needs `steps_per_execution`
to divide the steps) in ONE `fit` call; its wall time is reported. A watchdog dumps the
Python stacks to stderr if that fit is still running after `--hang-timeout` seconds.

Predicted Mk2 throughput, from the execution report: samples/s =
steps_per_execution x micro-batch / report.estimated_seconds.

Results go to benchmarks/results/bench_pipeline.json. Exits 0 whatever the targets say.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import keras_ipu as ipu  # noqa: E402  (selects Keras' JAX backend before keras loads)

# Compile counts must be real: never read a persistent compilation cache.
os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)

UNITS, LAYERS, MICRO, GA, UPDATES_PER_EXECUTION = 1024, 4, 64, 16, 4
SPE = GA * UPDATES_PER_EXECUTION
STAGES = [0, 0, 1, 1]
SCHEDULES = ("Grouped", "Interleaved", "Sequential")
TARGET_RATIO = 0.8
CORE = ("single", "pipe_grouped")  # timed in every round; the other schedules are extras


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run (<60 s)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="interleaved rounds (default 3; quick 1)")
    parser.add_argument("--target-seconds", type=float, default=None,
                        help="least duration of the single-IPU measurement "
                        "(default 1.0; quick 0.3)")
    parser.add_argument("--extra-repeats", type=int, default=1,
                        help="rounds (of --repeats) that also time the extra schedules "
                        "Interleaved and Sequential (default 1, to keep the run short)")
    parser.add_argument("--schedules", default=None,
                        help="comma list of pipeline schedules to run "
                        "(default Grouped,Interleaved,Sequential; quick Grouped)")
    parser.add_argument("--hang-steps", type=int, default=None,
                        help="micro-batches of the one-fit no-hang run (default 2000; "
                        "quick 192), rounded up to a multiple of steps_per_execution")
    parser.add_argument("--hang-timeout", type=float, default=300.0,
                        help="seconds after which the no-hang run's stacks are dumped")
    parser.add_argument("--output", default=os.path.join(ROOT, "benchmarks", "results",
                                                         "bench_pipeline.json"))
    args = parser.parse_args(argv)
    quick = args.quick
    if args.repeats is None:
        args.repeats = 1 if quick else 3
    if args.target_seconds is None:
        args.target_seconds = 0.3 if quick else 1.0
    if args.schedules is None:
        args.schedules = "Grouped" if quick else ",".join(SCHEDULES)
    args.schedules = [s.strip().capitalize() for s in args.schedules.split(",") if s.strip()]
    for s in args.schedules:
        if s not in SCHEDULES:
            parser.error(f"unknown schedule {s!r}; choose from {', '.join(SCHEDULES)}")
    if "Grouped" not in args.schedules:
        args.schedules.insert(0, "Grouped")  # the target and the no-hang run need it
    if args.hang_steps is None:
        args.hang_steps = 192 if quick else 2000
    args.hang_steps = max(SPE, math.ceil(args.hang_steps / SPE) * SPE)
    return args


def configure(num_ipus):
    config = ipu.config.IPUConfig()
    config.auto_select_ipus = num_ipus
    config.configure_ipu_system()


def build(keras):
    layers = [keras.Input((UNITS,))]
    layers += [keras.layers.Dense(UNITS, activation="relu") for _ in range(LAYERS - 1)]
    layers.append(keras.layers.Dense(UNITS))
    return keras.Sequential(layers)


class CompileCounter:
    """Counts XLA backend compilations, from JAX's monitoring events."""

    def __init__(self, jax):
        self.count = 0
        try:
            from jax._src.dispatch import BACKEND_COMPILE_EVENT as event
        except ImportError:  # JAX internals move; this is its name in recent releases
            event = "/jax/core/compile/backend_compile_duration"
        self.event = event

        def listener(name, *_args, **_kwargs):
            if name == event:
                self.count += 1

        try:
            jax.monitoring.register_event_duration_secs_listener(listener)
            self.available = True
        except AttributeError:
            self.available = False


class FitRunner:
    """One keras_ipu model, its IPU count, and its timed `fit`."""

    def __init__(self, name, keras, jax, weights, *, ipus, schedule=None):
        self.name, self.keras, self.jax, self.ipus, self.schedule = name, keras, jax, ipus, schedule
        configure(ipus)
        with ipu.IPUStrategy().scope():
            self.model = build(keras)
        self.model.set_weights(weights)
        self.model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse",
                           steps_per_execution=SPE)
        if schedule is None:
            self.model.set_gradient_accumulation_options(GA, "mean")
        else:
            self.model.set_pipeline_stage_assignment(STAGES)
            self.model.set_pipelining_options(
                gradient_accumulation_steps_per_replica=GA,
                gradient_accumulation_reduction_method="mean",
                pipeline_schedule=getattr(ipu.pipelining_ops.PipelineSchedule, schedule))

    def fit(self, x, y, epochs=1):
        """Wall seconds of one `fit` (the IPU system is configured first, untimed)."""
        configure(self.ipus)
        started = time.perf_counter()
        self.model.fit(x, y, batch_size=MICRO, epochs=epochs, shuffle=False, verbose=0)
        self.jax.block_until_ready([v.value for v in self.model.trainable_variables])
        return time.perf_counter() - started

    def program(self):
        try:
            from keras_ipu.keras import run

            return run.program_for(self.model, "fit")
        except Exception:  # the library's internals may move
            return None

    def report(self):
        try:
            return ipu.utils.execution_report(self.model, mode="fit")
        except Exception:
            return None


def describe_report(report):
    """The execution report's prediction as plain data (None-safe)."""
    if report is None:
        return None
    out = {
        "estimated_seconds": getattr(report, "estimated_seconds", None),
        "steps_per_execution": getattr(report, "steps_per_execution", None),
        "compile_seconds": getattr(report, "compile_seconds", None),
        "ipus": len(getattr(report, "ipus", ()) or ()),
        "replicas": getattr(report, "replicas", None),
        "text": str(report),
    }
    if out["estimated_seconds"] and out["steps_per_execution"]:
        out["predicted_samples_per_s"] = (
            out["steps_per_execution"] * MICRO / out["estimated_seconds"])
    else:
        out["predicted_samples_per_s"] = None
    pipeline = getattr(report, "pipeline", None)
    out["utilisation"] = getattr(pipeline, "utilisation", None) if pipeline else None
    return out


def make_data(np, batches, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batches * MICRO, UNITS), dtype=np.float32)
    y = rng.standard_normal((batches * MICRO, UNITS), dtype=np.float32)
    return x, y


def _loadavg():
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def _git_state():
    import subprocess

    def git(*cmd):
        return subprocess.run(["git", "-C", ROOT, *cmd], capture_output=True, text=True,
                              timeout=10).stdout.strip()

    try:
        return {"commit": git("rev-parse", "--short", "HEAD") or None,
                "keras_ipu_dirty": bool(git("status", "--porcelain", "--", "keras_ipu"))}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "keras_ipu_dirty": None}


def main(argv=None):
    args = parse_args(argv)
    started = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - started:6.1f}s] {msg}", flush=True)

    import jax
    import keras
    import numpy as np

    counter = CompileCounter(jax)
    configure(2)
    log(f"keras {keras.__version__}, jax {jax.__version__}, {len(jax.devices())} x "
        f"{jax.devices()[0].platform} devices, {os.cpu_count()} CPUs; schedules "
        f"{', '.join(args.schedules)}; {args.repeats} rounds")
    results = {
        "meta": {
            "keras": keras.__version__, "jax": jax.__version__,
            "python": platform.python_version(), "cpus": os.cpu_count(),
            "platform": platform.platform(), "quick": args.quick, "repeats": args.repeats,
            "target_seconds": args.target_seconds,
            "model": f"Input({UNITS})->Dense({UNITS},relu)x{LAYERS - 1}->Dense({UNITS}); "
                     "SGD(0.01); MSE",
            "micro_batch": MICRO, "gradient_accumulation": GA, "steps_per_execution": SPE,
            "stages": STAGES, "statistic": "median over interleaved repeats",
            "compile_counter": counter.available, "loadavg_start": _loadavg(),
            "git": _git_state(),
        },
        "variants": {}, "errors": {},
    }
    keras.utils.set_random_seed(0)
    weights = build(keras).get_weights()
    warm_x, warm_y = make_data(np, SPE, seed=1)  # one execution

    # ---- Build, compile (first fit) and time the second fit of every variant.
    specs = [("single", 1, None)] + [(f"pipe_{s.lower()}", 2, s) for s in args.schedules]
    runners = {}
    for name, ipus, schedule in specs:
        try:
            runner = FitRunner(name, keras, jax, weights, ipus=ipus, schedule=schedule)
            before = counter.count
            first = runner.fit(warm_x, warm_y)
            runners[name] = runner
            results["variants"][name] = {
                "ipus": ipus, "schedule": schedule, "first_fit_s": first,
                "first_fit_backend_compiles": counter.count - before,
            }
            log(f"{name}: first fit (compile + 1 execution) {first:.2f} s, "
                f"{counter.count - before} XLA compile(s)")
        except Exception as exc:  # report, keep going
            results["errors"][name] = traceback.format_exc()
            log(f"{name}: FAILED at build/first fit: {exc!r}")
    # Second fits, each after the system was reconfigured for another variant (the extra
    # schedules skip it to save time: their timed rounds count their compiles too).
    for name, runner in list(runners.items()):
        if name not in CORE:
            continue
        entry = results["variants"][name]
        try:
            program = runner.program()
            before = counter.count
            entry["second_fit_s"] = runner.fit(warm_x, warm_y)
            entry["second_fit_backend_compiles"] = counter.count - before
            entry["second_fit_same_program"] = (
                program is not None and runner.program() is program)
            log(f"{name}: second fit {entry['second_fit_s']:.2f} s, "
                f"{entry['second_fit_backend_compiles']} XLA compile(s), same program "
                f"{entry['second_fit_same_program']}")
        except Exception as exc:
            results["errors"][name] = traceback.format_exc()
            runners.pop(name)
            log(f"{name}: FAILED at second fit: {exc!r}")

    # ---- Measurement size: executions so that the warm single-IPU fit lasts long enough.
    single_second = results["variants"].get("single", {}).get("second_fit_s")
    executions = (max(1, math.ceil(args.target_seconds / single_second))
                  if single_second else 2)
    x, y = make_data(np, executions * SPE, seed=2)
    samples = len(x)
    results["meta"]["batches_per_measurement"] = executions * SPE
    results["meta"]["samples_per_measurement"] = samples
    log(f"measurement: {executions} execution(s) = {executions * SPE} micro-batches = "
        f"{samples} samples per fit")

    # ---- Interleaved rounds.
    programs = {name: r.program() for name, r in runners.items()}
    compile_seconds = {name: getattr(r.report(), "compile_seconds", None)
                       for name, r in runners.items()}
    measured = {name: [] for name in runners}
    compiles_in_rounds = {name: 0 for name in runners}
    for round_ in range(args.repeats):
        for name, runner in list(runners.items()):
            if name not in runners or (name not in CORE and round_ >= args.extra_repeats):
                continue
            try:
                before = counter.count
                elapsed = runner.fit(x, y)
                compiles_in_rounds[name] += counter.count - before
                measured[name].append(samples / elapsed)
            except Exception as exc:
                results["errors"][name] = traceback.format_exc()
                runners.pop(name)
                log(f"{name}: FAILED during the rounds: {exc!r}")
        log(f"round {round_ + 1}/{args.repeats}: " + ", ".join(
            f"{n} {v[-1]:.0f}" for n, v in measured.items() if len(v) > round_)
            + " samples/s")

    for name, runner in runners.items():
        entry = results["variants"][name]
        entry["samples_per_s_all"] = measured[name]
        entry["samples_per_s_median"] = (statistics.median(measured[name])
                                         if measured[name] else None)
        entry["backend_compiles_in_rounds"] = compiles_in_rounds[name]
        entry["same_program_after_rounds"] = (
            programs[name] is not None and runner.program() is programs[name])
        report = runner.report()
        entry["report"] = describe_report(report)
        entry["compile_seconds_unchanged"] = (
            compile_seconds[name] is not None
            and getattr(report, "compile_seconds", None) == compile_seconds[name])

    # ---- No hang: many steps in one fit on the Grouped model.
    hang = {"steps": args.hang_steps, "completed": False}
    grouped = runners.get("pipe_grouped")
    if grouped is not None:
        del x, y
        hx = np.random.default_rng(3).standard_normal((args.hang_steps * MICRO, UNITS),
                                                       dtype=np.float32)
        log(f"no-hang run: {args.hang_steps} micro-batches "
            f"({args.hang_steps // SPE} executions, {args.hang_steps // GA} weight updates) "
            f"in one fit of pipe_grouped")
        faulthandler.dump_traceback_later(args.hang_timeout, repeat=False, exit=False)
        try:
            before = counter.count
            hang["wall_s"] = grouped.fit(hx, hx)
            hang["backend_compiles"] = counter.count - before
            hang["samples_per_s"] = len(hx) / hang["wall_s"]
            hang["completed"] = True
            weights_now = grouped.model.get_weights()
            hang["weights_finite"] = bool(all(np.isfinite(w).all() for w in weights_now))
            log(f"no-hang run completed in {hang['wall_s']:.1f} s "
                f"({hang['samples_per_s']:.0f} samples/s, {hang['backend_compiles']} XLA "
                f"compile(s), weights finite {hang['weights_finite']})")
        except Exception as exc:
            hang["error"] = traceback.format_exc()
            log(f"no-hang run FAILED: {exc!r}")
        finally:
            faulthandler.cancel_dump_traceback_later()
    else:
        hang["error"] = "pipe_grouped did not build or run"
    results["no_hang"] = hang

    # ---- Targets.
    variants = results["variants"]
    single = variants.get("single", {}).get("samples_per_s_median")
    for entry in variants.values():
        med = entry.get("samples_per_s_median")
        entry["ratio_vs_single"] = med / single if med and single else None
        pred = (entry.get("report") or {}).get("predicted_samples_per_s")
        pred_single = ((variants.get("single", {}).get("report") or {})
                       .get("predicted_samples_per_s"))
        entry["predicted_ratio_vs_single"] = (pred / pred_single
                                              if pred and pred_single else None)
    ratio = variants.get("pipe_grouped", {}).get("ratio_vs_single")
    verdicts = [
        {"target": "pipelined_vs_single",
         "description": f"pipelined (2 IPUs, Grouped) >= {TARGET_RATIO}x single IPU samples/s",
         "threshold": TARGET_RATIO, "value": ratio,
         "verdict": "SKIPPED" if ratio is None else
         ("PASS" if ratio >= TARGET_RATIO else "MISS")},
        {"target": "no_hang",
         "description": f"pipelined fit of {args.hang_steps} micro-batches completes",
         "threshold": None, "value": hang.get("wall_s"),
         "verdict": "PASS" if hang["completed"] else "MISS"},
    ]
    results["targets"] = verdicts
    results["meta"]["total_seconds"] = time.perf_counter() - started
    results["meta"]["loadavg_end"] = _loadavg()

    print_report(results, verdicts, counter)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(results, f, indent=2, default=str)
    log(f"wrote {args.output} (load average at start {results['meta']['loadavg_start']}, "
        f"at end {results['meta']['loadavg_end']})")
    return 0


def _fmt(value, spec, missing="n/a"):
    return missing if value is None else format(value, spec)


def print_report(results, verdicts, counter):
    out = print
    meta = results["meta"]
    out(f"\nPipelined training, {LAYERS} x Dense({UNITS}), micro-batch {MICRO}, GA {GA}, "
        f"steps_per_execution {SPE}, {meta.get('samples_per_measurement')} samples per fit; "
        "samples/s, median")
    header = (f"{'variant':<17} | {'IPUs':>4} | {'measured':>9} | {'vs 1 IPU':>8} | "
              f"{'Mk2 pred.':>10} | {'vs 1 IPU':>8} | {'util.':>6} | {'1st fit s':>9} | "
              f"{'2nd fit s':>9} | {'XLA compiles':>12}")
    out(header)
    out("-" * len(header))
    for name, e in results["variants"].items():
        rep = e.get("report") or {}
        util = rep.get("utilisation")
        compiles = (f"{e.get('second_fit_backend_compiles', '-')}/"
                    f"{e.get('backend_compiles_in_rounds', '-')}")
        out(f"{name:<17} | {e['ipus']:>4} | {_fmt(e.get('samples_per_s_median'), '9.0f'):>9} | "
            f"{_fmt(e.get('ratio_vs_single'), '8.3f'):>8} | "
            f"{_fmt(rep.get('predicted_samples_per_s'), '10.0f'):>10} | "
            f"{_fmt(e.get('predicted_ratio_vs_single'), '8.3f'):>8} | "
            f"{_fmt(util, '6.1%'):>6} | "
            f"{_fmt(e.get('first_fit_s'), '9.2f'):>9} | "
            f"{_fmt(e.get('second_fit_s'), '9.2f', '-'):>9} | "
            f"{compiles:>12}")
    out("(XLA compiles: in the 2nd fit / in all timed rounds; 0/0 means no recompiles; "
        "'-' = not run. Mk2 pred. = steps_per_execution x micro-batch / "
        "report.estimated_seconds"
        + ("" if counter.available else "; counter unavailable") + ")")
    for name, e in results["variants"].items():
        flags = [k for k in ("second_fit_same_program", "same_program_after_rounds",
                             "compile_seconds_unchanged") if e.get(k) is False]
        if flags:
            out(f"  note: {name}: {', '.join(flags)} is False (program may have been rebuilt)")
    hang = results["no_hang"]
    if hang["completed"]:
        out(f"\nNo-hang run: {hang['steps']} micro-batches in one fit completed in "
            f"{hang['wall_s']:.1f} s ({hang['samples_per_s']:.0f} samples/s, "
            f"{hang['backend_compiles']} XLA compile(s))")
    else:
        out(f"\nNo-hang run: {hang['steps']} micro-batches did NOT complete")
    for name, tb in results["errors"].items():
        out(f"\nERROR in {name}:\n{tb}")
    if hang.get("error"):
        out(f"\nERROR in the no-hang run:\n{hang['error']}")
    out("\nTargets:")
    for v in verdicts:
        value = "n/a" if v["value"] is None else f"{v['value']:.3f}"
        out(f"  [{v['verdict']:>7}] {v['description']:<58} measured {value}")


if __name__ == "__main__":
    try:
        main()
    except Exception:  # never fail the caller: the targets are the verdict
        traceback.print_exc()
    sys.exit(0)
