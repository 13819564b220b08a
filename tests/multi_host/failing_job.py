"""An instance that fails after the first collective: instance 1 exits with status 3.

`failing_job.py`: it dies (`os._exit`); `failing_job.py raise`: it raises
`SystemExit(3)`, so Python's exit handlers would run (JAX's shutdown barrier);
`failing_job.py exception`: it raises a `RuntimeError` (status 1), in a job started
without the launcher.
"""

import os
import sys
import time

import numpy as np
from job import say

import keras_ipu as ipu

config = ipu.config.IPUConfig()
config.auto_select_ipus = 1
config.configure_ipu_system()
i = ipu.distributed.instance_index()
ipu.distributed.allreduce(np.float32(1))
if i == 1:
    say("dying")
    if sys.argv[1:] == ["raise"]:
        raise SystemExit(3)
    if sys.argv[1:] == ["exception"]:
        raise RuntimeError("instance 1 gives up")
    os._exit(3)
time.sleep(1)
ipu.distributed.allreduce(np.float32(1))
say("unreachable")
