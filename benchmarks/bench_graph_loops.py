#!/usr/bin/env python
"""The graph-style API's repeated calls: a kept program against one traced at every call.

Run from the repository root:

    python benchmarks/bench_graph_loops.py                 # 5 rounds of 20 calls
    python benchmarks/bench_graph_loops.py --rounds 9 --calls 50

IPU TensorFlow's custom loops call the same compiled loop again and again (`sess.run` of
one `ipu_compiler.compile` op, or `strategy.run` of one function), each call taking the
infeed's next elements. Here the same computation, `ipu.loops.repeat(8, body, [0.0],
infeed)` over 8 elements of 256 x 256 float32 and an outfeed, runs `--calls` times per
round two ways in this process:

    kept      `ipu_compiler.compile(my_net)`, the same `my_net` each call: traced and
              compiled once, then run with each call's infeed elements as its inputs.
    retraced  a new function object each call (`lambda: my_net()`): traced and compiled
              at every call, the infeed's elements constants of each trace (what every
              call cost before programs were kept).

Rounds alternate the two (so a load that comes and goes falls on both); the median per call
of each and their ratio are printed. The figure: retraced / kept per call (higher is better).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")

import numpy as np  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import keras_ipu as ipu  # noqa: E402


def _per_call(make_net, calls: int) -> float:
    """Seconds per call of `calls` compiles of `make_net()`, infeed and outfeed included."""
    elements = [np.full((256, 256), i, np.float32) for i in range(8 * calls)]
    infeed = ipu.ipu_infeed_queue.IPUInfeedQueue(elements)
    outfeed = ipu.ipu_outfeed_queue.IPUOutfeedQueue()

    def body(total, x):
        total = total + x.sum()
        return total, outfeed.enqueue(total)

    def my_net():
        return ipu.loops.repeat(8, body, [np.float32(0)], infeed)

    started = time.perf_counter()
    with ipu.scopes.ipu_scope("/device:IPU:0"):
        for _ in range(calls):
            [total] = ipu.ipu_compiler.compile(make_net(my_net))
            total.block_until_ready()
    seconds = (time.perf_counter() - started) / calls
    assert outfeed.dequeue().shape == (8 * calls,)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    config = ipu.config.IPUConfig()
    config.auto_select_ipus = 1
    config.configure_ipu_system()
    kept, retraced = [], []
    _per_call(lambda net: net, 2)  # warm-up: imports, first compilations
    for _ in range(args.rounds):
        kept.append(_per_call(lambda net: net, args.calls))
        retraced.append(_per_call(lambda net: (lambda: net()), args.calls))
    k, r = statistics.median(kept), statistics.median(retraced)
    print(f"per call, median of {args.rounds} rounds of {args.calls} calls:")
    print(f"  kept program     {1e3 * k:8.2f} ms")
    print(f"  retraced         {1e3 * r:8.2f} ms")
    print(f"  retraced / kept  {r / k:8.1f}x")


if __name__ == "__main__":
    main()
