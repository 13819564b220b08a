"""Fits the cases of `fit_cases.py` on 2 instances × 2 IPUs; each instance saves its results."""

import sys

import numpy as np
from fit_cases import CASES, instance_data, run_case
from job import say, start

out = sys.argv[1]
strategy, index = start()
x, y = instance_data(index)
results = {}
for name, kind, accumulation in CASES:
    case = run_case(strategy, name, kind, accumulation, x, y)
    results.update({f"{name}/{key}": value for key, value in case.items()})
np.savez(f"{out}/instance{index}.npz", **results)
say("done", index)
