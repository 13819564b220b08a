"""Prints the distributed helpers' values in each instance."""

import jax
import numpy as np

import keras_ipu as ipu

config = ipu.config.IPUConfig()
ipu.distributed.update_ipu_config(config)
config.configure_ipu_system()
dist = ipu.distributed
i = dist.instance_index()
print("index", i, "of", dist.num_instances(), "global", dist.num_global_replicas())
print("sum", dist.allreduce(np.float32(i + 1), op="sum"))
print("mean", dist.allreduce(np.array([i, 2.0 * i])))
print("gather", dist.allgather(np.full((i + 1,), i)).tolist())
print("bcast", dist.broadcast(np.float32(i + 5)), dist.broadcast(np.float32(i + 5), root_rank=1))
print("devices", len(jax.devices()), len(jax.local_devices()))
