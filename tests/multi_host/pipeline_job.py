"""Fits `pipeline_cases` on 2 instances × 2 IPUs (one 2-stage pipeline each); saves the results."""

import sys

import numpy as np
from job import say, start
from pipeline_cases import BATCH, FEEDS, data, instance_data, run_case

import keras_ipu as ipu

out = sys.argv[1]
strategy, index = start()
x, y = ipu.distributed.shard_for_instance(data(), BATCH)  # --ipus-per-replica 2: 1 replica
assert (x == instance_data(index)[0]).all()
results = {}
for feed in FEEDS:
    # Each instance initialises its own weights: training starts from instance 0's.
    case = run_case(strategy, x, y, feed, seed=1 + index)
    results.update({f"{feed}/{key}": value for key, value in case.items()})
np.savez(f"{out}/instance{index}.npz", **results)
say("done", index)
