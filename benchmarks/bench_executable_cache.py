#!/usr/bin/env python
"""The first `fit` of a fresh process, without and with `--executable_cache_path`.

Run from the repository root:

    python benchmarks/bench_executable_cache.py                  # resnet50 and mlp, 3 rounds
    python benchmarks/bench_executable_cache.py --models mlp --rounds 5
    python benchmarks/bench_executable_cache.py --json out.json --check   # exit 1 on a miss

Each measurement is a fresh Python process (this file with `--child MODEL`) that imports
keras_ipu, configures 1 IPU, creates the model in `IPUStrategy().scope()`, compiles it and
times its first `fit`: one epoch of one execution (`steps_per_execution` steps), `verbose=0`,
the weights waited for. Models (random weights, synthetic data, no downloads):

    resnet50  keras.applications.ResNet50(weights=None), 32x32x3, 10 classes, batch 32,
              steps_per_execution 8, SGD with momentum
    mlp       Input(64) + 3 x Dense(64), MSE, batch 32, steps_per_execution 100, SGD

Per model:

    cold   a process without the flag (and without any JAX compilation cache: the
           environment's JAX_COMPILATION_CACHE_DIR is dropped): everything compiles.
    warm   a process with KERAS_IPU_FLAGS=--executable_cache_path=DIR, where DIR was
           filled by one earlier process with the flag (the "priming" run, reported too:
           the cost of writing the cache): every program should load from the cache.

The priming run comes first, then `--rounds` rounds of one cold and one warm process each
(interleaved, so a load that comes and goes on a shared machine falls on both); the MEDIAN of
each is reported, with the ratio cold / warm of the first fit and of the whole process (its
wall time as seen from here: start-up and imports included, which no cache removes). Each
child also counts the compilations of its fit that asked JAX's persistent cache and those the
cache answered (JAX monitoring events): in a warm process they should be equal. A second
table splits the first fit: tracing to jaxprs, lowering to MLIR, compiling (cold) or loading
from the cache (warm), summed over the fit's programs (a jit inside another is counted in
both, so trace and lower are indicative), and a second `fit` of the same model
right after, which only runs the execution: the part of the first fit no cache can remove.

Target: the first fit of a warm process at least 3x faster than a cold one's (the issue's
acceptance figure). The children run on whatever platform JAX picks in this environment: on a
GPU machine they use the GPU (nothing here forces the CPU), with JAX_PLATFORMS=cpu they use the
CPU. The script exits 0 whatever the figures say; with `--check` it exits 1 when a target
fails, a warm fit compiled anything, or a child failed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = 3.0
SEED = 0

# name: (input shape, batch, steps_per_execution)
MODELS = {
    "resnet50": ((32, 32, 3), 32, 8),
    "mlp": ((64,), 32, 100),
}

_REQUEST_EVENT = "/jax/compilation_cache/compile_requests_use_cache"
_HIT_EVENT = "/jax/compilation_cache/cache_hits"
# Where a fit's preparation goes (JAX monitoring durations, summed over the fit): tracing to
# jaxprs, lowering to MLIR, and compiling (or, from the cache, loading) the executables.
_PHASES = {
    "trace_s": "/jax/core/compile/jaxpr_trace_duration",
    "lower_s": "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "compile_s": "/jax/core/compile/backend_compile_duration",
}


# --------------------------------------------------------------------------
# The child: one fresh process, one first fit.


def _build(keras, name: str):
    """The model `name`, compiled for its first fit."""
    shape, _, spe = MODELS[name]
    if name == "resnet50":
        model = keras.applications.ResNet50(weights=None, input_shape=shape, classes=10)
        model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"],
                      steps_per_execution=spe)
    else:
        model = keras.Sequential([keras.Input(shape)] + [
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(64),
        ])
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", steps_per_execution=spe)
    return model


def child(name: str) -> dict:
    """Runs one first fit of `name` in this (fresh) process and returns its figures.

    Args:
        name: A key of `MODELS`.

    Returns:
        `startup_s` (imports and configuring), `build_s` (model creation and
        compile), `first_fit_s`, the fit's cache `requests` and `hits`, the
        cache directory in effect (None without the flag) and the platform.
    """
    started = time.perf_counter()
    from jax import monitoring

    counts = {"requests": 0, "hits": 0}

    def count(event: str, **kwargs) -> None:
        if event == _REQUEST_EVENT:
            counts["requests"] += 1
        elif event == _HIT_EVENT:
            counts["hits"] += 1

    phases = dict.fromkeys(_PHASES, 0.0)

    def add(event: str, duration: float, **kwargs) -> None:
        for phase, name in _PHASES.items():
            if event == name:
                phases[phase] += duration

    monitoring.register_event_listener(count)
    monitoring.register_event_duration_secs_listener(add)
    import jax
    import keras  # The JAX backend: _child_env sets KERAS_BACKEND.
    import numpy as np

    import keras_ipu as ipu
    from keras_ipu.device import executable_cache

    config = ipu.config.IPUConfig()
    config.auto_select_ipus = 1
    config.configure_ipu_system()
    configured = time.perf_counter()

    keras.utils.set_random_seed(SEED)
    shape, batch, spe = MODELS[name]
    rng = np.random.default_rng(SEED)
    x = rng.random((batch * spe, *shape), dtype=np.float32)
    y = (rng.integers(0, 10, batch * spe).astype(np.int32) if name == "resnet50"
         else rng.random((batch * spe, 64), dtype=np.float32))
    with ipu.ipu_strategy.IPUStrategy().scope():
        model = _build(keras, name)
    built = time.perf_counter()

    before, phases_before = dict(counts), dict(phases)
    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    jax.block_until_ready([v.value for v in model.trainable_variables])
    fitted = time.perf_counter()
    first_fit_phases = {k: phases[k] - phases_before[k] for k in phases}
    # A second fit: the same execution with nothing left to prepare, the floor under the
    # first fit that no cache removes.
    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    jax.block_until_ready([v.value for v in model.trainable_variables])
    second = time.perf_counter() - fitted
    return {
        "startup_s": configured - started,
        "build_s": built - configured,
        "first_fit_s": fitted - built,
        "requests": counts["requests"] - before["requests"],
        "hits": counts["hits"] - before["hits"],
        **first_fit_phases,
        "second_fit_s": second,
        "cache": executable_cache.directory(),
        "platform": jax.devices()[0].platform,
        "jax": jax.__version__,
        "keras": keras.__version__,
    }


# --------------------------------------------------------------------------
# The parent: fresh processes, interleaved.


def _child_env(cache: str | None) -> dict:
    """This environment, less any compilation cache, plus the flag when `cache` is given."""
    env = dict(os.environ)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    env["KERAS_BACKEND"] = "jax"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_REPO, env.get("PYTHONPATH")]))
    for variable in ("TF_POPLAR_FLAGS", "KERAS_IPU_FLAGS"):
        # Other flags stay (e.g. --execution_loop); the cache is ours to set.
        kept = [t for t in shlex.split(env.get(variable, ""))
                if not t.startswith("--executable_cache_path")]
        env[variable] = shlex.join(kept)
    if cache is not None:
        env["KERAS_IPU_FLAGS"] = shlex.join(
            [*shlex.split(env["KERAS_IPU_FLAGS"]), f"--executable_cache_path={cache}"])
    return env


def run_child(name: str, cache: str | None, timeout: float) -> dict:
    """One fresh process's first fit of `name`, with the cache in `cache` or none."""
    started = time.perf_counter()
    result = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", name],
                            env=_child_env(cache), capture_output=True, text=True,
                            timeout=timeout, cwd=_REPO)
    if result.returncode != 0:
        raise RuntimeError(f"{name} child failed:\n{result.stderr[-3000:]}")
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    figures["process_s"] = time.perf_counter() - started
    return figures


def measure(name: str, rounds: int, timeout: float) -> dict:
    """The priming run, then `rounds` interleaved cold and warm processes of `name`."""
    cache = tempfile.mkdtemp(prefix=f"keras_ipu_cache_{name}_")
    try:
        priming = run_child(name, cache, timeout)
        print(f"  {name}: priming {priming['first_fit_s']:.2f} s, "
              f"{len(os.listdir(cache))} executables saved", flush=True)
        cold, warm = [], []
        for index in range(rounds):
            # Alternate which goes first, so neither always follows the other.
            order = [("cold", None), ("warm", cache)][:: 1 if index % 2 == 0 else -1]
            for kind, directory in order:
                figures = run_child(name, directory, timeout)
                (cold if kind == "cold" else warm).append(figures)
                print(f"  {name}: round {index + 1} {kind}: first fit "
                      f"{figures['first_fit_s']:.2f} s, process {figures['process_s']:.2f} s, "
                      f"cache hits {figures['hits']}/{figures['requests']}", flush=True)
    finally:
        shutil.rmtree(cache, ignore_errors=True)

    def median(runs: list[dict], key: str) -> float:
        return statistics.median(run[key] for run in runs)

    row = {"model": name, "rounds": rounds, "priming": priming, "cold": cold, "warm": warm}
    for key in ("first_fit_s", "build_s", "process_s", *_PHASES, "second_fit_s"):
        row[f"cold_{key}"] = median(cold, key)
        row[f"warm_{key}"] = median(warm, key)
    row["fit_ratio"] = row["cold_first_fit_s"] / row["warm_first_fit_s"]
    row["process_ratio"] = row["cold_process_s"] / row["warm_process_s"]
    row["warm_all_hits"] = all(r["hits"] == r["requests"] > 0 for r in warm)
    row["passed"] = row["fit_ratio"] >= TARGET and row["warm_all_hits"]
    return row


def report(rows: list[dict], machine: dict) -> str:
    """The results as a Markdown table."""
    lines = [
        "| model | first fit, cold | first fit, warm cache | ratio | process, cold | "
        "process, warm | ratio | warm fit cache hits | target >= 3x |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    phases = [
        "| model | process | trace | lower | compile / load from cache | second fit (runs only) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        hits = "all" if r["warm_all_hits"] else "NOT all"
        lines.append(
            f"| {r['model']} | {r['cold_first_fit_s']:.2f} s | {r['warm_first_fit_s']:.2f} s | "
            f"{r['fit_ratio']:.1f}x | {r['cold_process_s']:.1f} s | {r['warm_process_s']:.1f} s | "
            f"{r['process_ratio']:.1f}x | {hits} | {'pass' if r['passed'] else 'FAIL'} |")
        for kind in ("cold", "warm"):
            phases.append(
                f"| {r['model']} | {kind} | {r[f'{kind}_trace_s']:.2f} s | "
                f"{r[f'{kind}_lower_s']:.2f} s | {r[f'{kind}_compile_s']:.2f} s | "
                f"{r[f'{kind}_second_fit_s']:.2f} s |")
    lines += ["", "Where the first fit goes (medians; the rest of it is running the execution):",
              "", *phases]
    lines.append(
        f"\nMedians of {rows[0]['rounds'] if rows else 0} rounds; {machine['platform']} "
        f"({machine['device']}), Python {machine['python']}, jax {machine['jax']}, "
        f"keras {machine['keras']}, {machine['cpus']} CPUs.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark (or, with `--child`, one measurement) and prints the results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet50,mlp",
                        help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=900, help="seconds per child")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--check", action="store_true", help="exit 1 when a target fails")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child)))
        return 0

    names = [n for n in args.models.split(",") if n]
    unknown = sorted(set(names) - set(MODELS))
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {list(MODELS)}")
    rows, failed = [], False
    for name in names:
        try:
            rows.append(measure(name, args.rounds, args.timeout))
        except (RuntimeError, subprocess.TimeoutExpired) as error:
            print(f"  {name}: {error}", file=sys.stderr)
            failed = True
    first = (rows[0]["cold"][0] if rows and rows[0]["cold"] else {})
    machine = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "device": first.get("platform", "?"),
        "jax": first.get("jax", "?"),
        "keras": first.get("keras", "?"),
        "cpus": os.cpu_count(),
    }
    print(report(rows, machine))
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"machine": machine, "rows": rows}, file, indent=1)
    if args.check and (failed or not all(r["passed"] for r in rows)):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
