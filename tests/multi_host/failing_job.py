"""An instance that dies after the first collective: instance 1 exits with status 3."""

import os
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
    os._exit(3)
time.sleep(1)
ipu.distributed.allreduce(np.float32(1))
say("unreachable")
