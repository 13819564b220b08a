#!/usr/bin/env python
"""Serving latency and throughput: the export's runtime, and `keras-ipu serve`.

Run from the repository root:

    python benchmarks/bench_serving.py            # ~1 min
    python benchmarks/bench_serving.py --quick    # smoke run

(a) Latency of one batch-1 call, 3 × Dense(64) (the small model of
    `bench_single_ipu.py`), medians of `--calls` calls after warming up,
    interleaved in `--rounds` rounds:

    predict_on_batch  plain Keras 3 `model.predict_on_batch(x)` (host array in, NumPy out);
    limit             a bare `jax.jit` of the model's stateless call with its weights
                      already on the device, from a host array, result read back
                      (`np.asarray`); also with the input already on the device;
    runtime           `keras_ipu.serving.load(export)(x)` (host array in, NumPy out).

    The process runs CPU programs inline, as `keras-ipu run` and `serve` do
    (`keras_ipu.serving.runtime.run_inline_on_cpu`): all three variants alike.
    `--async-cpu` keeps JAX's default (worker threads) for comparison.

    Goals (issue 10): runtime >= 5x faster than predict_on_batch, <= 1.3x the limit.

(b) The server (`keras-ipu serve`, a subprocess on loopback): 32 concurrent
    clients (aiohttp), each sending `--requests` requests of one row; throughput
    (requests/s) and p50/p99 latency, for an export of batch size 32 (dynamic
    batching) against one of batch size 1 (batch-1 serving), both servers up
    for the whole section and loaded in `--server-rounds` interleaved rounds
    (medians). Goal: >= 3x the requests/s. Two models: the small one of (a),
    whose device call (~15 µs) is small next to the HTTP work of a request,
    and a wide one, Input(64) -> Dense(2048, relu) x 2 -> Dense(10) (17 MB of
    weights, read once per device call whatever the batch: inference bound by
    memory, where batching pays).

Results go to benchmarks/results/bench_serving.json; the script exits 0
whatever the goals say.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
try:
    import keras_ipu as ipu  # must come before keras: it selects the JAX backend
except ImportError:
    sys.path.insert(0, _REPO)
    import keras_ipu as ipu

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

UNITS = 64


def _model(scope, hidden=UNITS, outputs=UNITS):
    keras.utils.set_random_seed(0)
    with scope:
        return keras.Sequential([
            keras.Input((UNITS,)),
            keras.layers.Dense(hidden, activation="relu"),
            keras.layers.Dense(hidden, activation="relu"),
            keras.layers.Dense(outputs),
        ])


# The server's models: name -> (hidden units, outputs).
SERVED = {"small": (UNITS, UNITS), "wide": (2048, 10)}


def _median_us(fn, calls):
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def latency(args, export_root):
    plain = _model(_null())
    strategy = ipu.ipu_strategy.IPUStrategy()
    on_ipu = _model(strategy.scope())
    on_ipu.set_weights(plain.get_weights())
    runtime = on_ipu.export_for_ipu_serving(os.path.join(export_root, "b1"), batch_size=1)
    x = np.random.default_rng(0).normal(size=(1, UNITS)).astype("float32")
    # Copies on the device: plain Keras' predict purges its variables' buffers.
    weights = [jax.device_put(v.numpy()) for v in plain.trainable_variables], [
        jax.device_put(v.numpy()) for v in plain.non_trainable_variables]
    bare = jax.jit(lambda t, n, x: plain.stateless_call(t, n, x)[0])
    x_device = jax.device_put(x)
    variants = {
        "predict_on_batch": lambda: plain.predict_on_batch(x),
        "limit_host": lambda: np.asarray(bare(*weights, x)),
        "limit_device": lambda: bare(*weights, x_device).block_until_ready(),
        "runtime": lambda: runtime(x),
    }
    np.testing.assert_allclose(runtime(x), plain.predict_on_batch(x), atol=1e-6)
    for fn in variants.values():
        for _ in range(50):
            fn()
    rounds = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, fn in variants.items():
            rounds[name].append(_median_us(fn, args.calls))
    median = {name: statistics.median(values) for name, values in rounds.items()}
    return {
        "median_us": median,
        "rounds_us": rounds,
        "predict_on_batch_over_runtime": median["predict_on_batch"] / median["runtime"],
        "runtime_over_limit_host": median["runtime"] / median["limit_host"],
        "goals": {"predict_on_batch_over_runtime": 5.0, "runtime_over_limit_host": 1.3},
    }


def _null():
    import contextlib

    return contextlib.nullcontext()


def server(args, export_root):
    strategy = ipu.ipu_strategy.IPUStrategy()
    results = {"goal_throughput_ratio": 3.0}
    for name, (hidden, outputs) in SERVED.items():
        model = _model(strategy.scope(), hidden, outputs)
        urls, processes = {}, []
        try:
            for label, batch in (("batch_1", 1), ("dynamic_32", 32)):
                directory = os.path.join(export_root, f"{name}_{label}")
                model.export_for_ipu_serving(directory, batch_size=batch)
                process, urls[label] = _start_server(directory)
                processes.append(process)
            results[name] = _load_rounds(urls, args)
        finally:
            for process in processes:
                process.terminate()
                process.wait()
    return results


def _start_server(directory):
    """`(process, predict URL)` of `keras-ipu serve` on a free loopback port."""
    env = {k: v for k, v in os.environ.items() if k not in ("KERAS_BACKEND", "XLA_FLAGS")}
    env["PYTHONPATH"] = _REPO + os.pathsep + env.get("PYTHONPATH", "")
    process = subprocess.Popen(
        [sys.executable, "-m", "keras_ipu", "serve", "--dir", directory, "--port", "0",
         "--model_name", "m"], env=env, stdout=subprocess.PIPE, text=True)
    port = re.search(r":(\d+)/v1", process.stdout.readline()).group(1)
    return process, f"http://127.0.0.1:{port}/v1/models/m:predict"


def _load_rounds(urls, args):
    """Load tests of each server in interleaved rounds (order swapped each round); medians."""
    runs = {label: [] for label in urls}
    for round_ in range(args.server_rounds):
        labels = list(urls) if round_ % 2 == 0 else list(urls)[::-1]
        for label in labels:
            runs[label].append(asyncio.run(_clients(urls[label], args.clients, args.requests)))
    section = {}
    for label, measured in runs.items():
        section[label] = {key: statistics.median(m[key] for m in measured)
                          for key in measured[0]}
        section[label]["rounds_requests_per_s"] = [m["requests_per_s"] for m in measured]
    section["throughput_ratio"] = (section["dynamic_32"]["requests_per_s"]
                                   / section["batch_1"]["requests_per_s"])
    section["rounds_ratio"] = [d["requests_per_s"] / b["requests_per_s"]
                               for b, d in zip(runs["batch_1"], runs["dynamic_32"])]
    return section


async def _clients(url, clients, requests):
    import aiohttp

    # One request body, encoded once: the clients share the server's CPUs, so
    # the less each spends per request, the more the measurement is the server's.
    body = json.dumps({"instances": [[0.5] * UNITS]}).encode()
    headers = {"Content-Type": "application/json"}
    latencies = []

    async def client(session):
        for _ in range(requests):
            started = time.perf_counter()
            async with session.post(url, data=body, headers=headers) as response:
                await response.read()
                assert response.status == 200
            latencies.append(time.perf_counter() - started)

    connector = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(client(session) for _ in range(5)))  # warm
        latencies.clear()
        started = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(clients)))
        seconds = time.perf_counter() - started
    latencies.sort()
    return {
        "requests_per_s": clients * requests / seconds,
        "p50_ms": latencies[len(latencies) // 2] * 1e3,
        "p99_ms": latencies[int(len(latencies) * 0.99)] * 1e3,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--server-rounds", type=int, default=3,
                        help="interleaved load tests per server (medians are reported)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--async-cpu", action="store_true",
                        help="keep JAX's asynchronous CPU dispatch for the latency section")
    args = parser.parse_args()
    if not args.async_cpu:
        from keras_ipu.serving import runtime

        runtime.run_inline_on_cpu()
    if args.quick:
        args.calls, args.rounds, args.requests, args.server_rounds = 200, 2, 20, 1
    config = ipu.config.IPUConfig()
    config.auto_select_ipus = 1
    config.configure_ipu_system()
    with tempfile.TemporaryDirectory() as export_root:
        result = {"latency": latency(args, export_root), "server": server(args, export_root)}
    result.update(args=vars(args),
                  machine=f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
                  versions={"keras": keras.__version__, "jax": jax.__version__})
    lat, srv = result["latency"], result["server"]
    for name, value in lat["median_us"].items():
        print(f"{name:18s} {value:9.1f} µs")
    print(f"predict_on_batch / runtime = {lat['predict_on_batch_over_runtime']:.1f}x (goal >= 5)")
    print(f"runtime / limit (host)     = {lat['runtime_over_limit_host']:.2f}x (goal <= 1.3)")
    for name in SERVED:
        section = srv[name]
        for label in ("batch_1", "dynamic_32"):
            s = section[label]
            print(f"server {name:5s} {label:10s} {s['requests_per_s']:8.0f} req/s, "
                  f"p50 {s['p50_ms']:.1f} ms, p99 {s['p99_ms']:.1f} ms")
        rounds = ", ".join(f"{r:.2f}" for r in section["rounds_ratio"])
        print(f"  dynamic / batch-1 throughput = {section['throughput_ratio']:.2f}x (goal >= 3; "
              f"rounds {rounds})")
    out = os.path.join(_REPO, "benchmarks", "results", "bench_serving.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
