#!/usr/bin/env python
"""How much two virtual CPU devices can run in parallel on this machine.

Run: `python benchmarks/probe_parallel_devices.py`. Times a chain of
[64, 1024] x [1024, 1024] matmuls (32 steps of 4 layers) on one JAX device, and
the same work on each of two devices at once (`shard_map`), with and without a
`lax.switch` around it (as in pipelined programs). On a 2-core machine one
device's matmuls already use both cores, so two devices take about twice as long:
this bounds what pipelining across virtual IPUs can gain here (see
BENCHMARKS.md).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def main() -> int:
    jax.config.update("jax_num_cpu_devices", 2)
    mesh = Mesh(np.array(jax.devices()[:2]), ("ipu",))
    weights = jnp.ones((2, 1024, 1024)) * 0.001
    x = jnp.ones((64, 1024))

    def work(w, h):
        for _ in range(4):
            h = jnp.tanh(h @ w)
        return h

    def loop(w, h):
        return jax.lax.scan(lambda c, _: (work(w, c), None), h, None, length=32)[0]

    def per_device(w, h):
        return loop(w[0], h)[None]

    def per_device_switch(w, h):
        me = jax.lax.axis_index("ipu")
        branches = [lambda c: work(w[0], c), lambda c: work(w[0], c)]
        body = lambda c, _: (jax.lax.switch(me, branches, c), None)  # noqa: E731
        return jax.lax.scan(body, h, None, length=32)[0][None]

    def spmd(f):
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("ipu"), P()),
                                     out_specs=P("ipu"), check_vma=False))

    sharded = jax.device_put(weights, NamedSharding(mesh, P("ipu")))
    cases = [
        ("one device", jax.jit(lambda w, h: loop(w[0], h)), weights),
        ("two devices, same work each", spmd(per_device), sharded),
        ("two devices, inside lax.switch", spmd(per_device_switch), sharded),
    ]
    times = {}
    for name, function, w in cases:
        jax.block_until_ready(function(w, x))
        runs = []
        for _ in range(5):
            started = time.perf_counter()
            jax.block_until_ready(function(w, x))
            runs.append(time.perf_counter() - started)
        times[name] = float(np.median(runs))
        print(f"{name:32s} {1e3 * times[name]:8.1f} ms")
    ratio = times["two devices, same work each"] / times["one device"]
    print(f"two devices / one device: {ratio:.2f} (1.0 = fully parallel, 2.0 = serial)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
