#!/usr/bin/env python
"""The serving batcher's delivery of one request's pieces: time per piece against its count.

Run from the repository root:

    python benchmarks/bench_batcher_delivery.py

`keras-ipu serve` splits a request of many rows into batch-sized pieces and
hands each piece's outputs to the request as it comes
(`keras_ipu.serving.server._deliver`). Before 2026-11-28 each piece summed the
rows of every piece delivered so far, so a request of N pieces cost O(N²)
(40,000 pieces: 14.7 s). This times the delivery alone for requests of 5,000
to 40,000 one-row pieces (median of 5 runs each) and prints the time per piece
and its ratio, largest request to smallest. Goal: the ratio stays below 2
(linear time; the quadratic form gave about 15).
"""

from __future__ import annotations

import asyncio
import statistics
import time

import numpy as np

from keras_ipu.serving import server

COUNTS = (5_000, 10_000, 20_000, 40_000)


async def _per_piece(count: int) -> float:
    pending = server._Pending({}, asyncio.get_running_loop().create_future(), count)
    part = {"y": np.zeros((1, 2), np.float32)}
    start = time.perf_counter()
    for row in range(count):
        server._deliver(pending, row, 1, part)
    seconds = time.perf_counter() - start
    assert pending.future.done() and len(pending.future.result()["y"]) == count
    return seconds / count


def main() -> None:
    medians = {count: statistics.median(asyncio.run(_per_piece(count)) for _ in range(5))
               for count in COUNTS}
    for count, seconds in medians.items():
        print(f"{count:6d} pieces: {seconds * 1e6:6.2f} µs a piece")
    ratio = medians[COUNTS[-1]] / medians[COUNTS[0]]
    print(f"per-piece time, {COUNTS[-1]:,} against {COUNTS[0]:,} pieces: {ratio:.2f}x "
          f"(goal < 2)")


if __name__ == "__main__":
    main()
