"""Prints the distributed helpers' values in each instance."""

import jax
import numpy as np
from job import say

import keras_ipu as ipu
from keras_ipu.device import processes, system

config = ipu.config.IPUConfig()
ipu.distributed.update_ipu_config(config)
config.configure_ipu_system()
dist = ipu.distributed
i = dist.instance_index()
say("index", i, "of", dist.num_instances(), "global", dist.num_global_replicas())
say("sum", dist.allreduce(np.float32(i + 1), op="sum"))
say("mean", dist.allreduce(np.array([i, 2.0 * i])))
ints = dist.allreduce(np.array([3 + i, -3 - i], "int32"))  # [3, -3] and [4, -4]
say("int mean", ints.tolist(), ints.dtype, dist.allreduce(np.int32(i + 1), op="sum").dtype)
say("gather", dist.allgather(np.full((i + 1,), i)).tolist())
say("bcast", dist.broadcast(np.float32(i + 5)), dist.broadcast(np.float32(i + 5), root_rank=1))
say("devices", len(jax.devices()), len(jax.local_devices()))
say("ipus", [v.index for v in processes.global_ipus(system.require().ipus)])
hvd = ipu.horovod  # the seed's names and signatures
hvd.init()
say("hvd", hvd.allreduce(tensor=np.float32(i + 1)), hvd.allreduce(np.float32(i + 1), op=hvd.Sum),
    hvd.allgather(tensor=np.full((i + 1,), i), name="g").tolist(),
    hvd.broadcast(np.float32(i + 5), 1, name="b"), hvd.rank(), hvd.size())
# A list of numbers is one tensor, as Horovod makes it (before: a tree of scalars, refused).
say("hvd lists", hvd.allgather([i]).tolist(), hvd.allreduce([1.0, 2.0 + i]).tolist(),
    hvd.broadcast([i, i + 1], 1).tolist())
# 64-bit values keep their width across instances (JAX without x64 would cut them).
wide = dist.allreduce(np.int64(2**40 + i), op="sum")
say("wide", int(wide), wide.dtype, dist.broadcast(np.float64(0.1)).dtype,
    dist.allgather(np.array([2**40 + i], np.int64)).tolist(),
    abs(float(dist.allreduce(np.float64(1 + 1e-12 * (i + 1)), op="sum")) - 2.000000000003)
    < 1e-15)
# Values that differ between instances are refused in every instance, not mixed or waited for.
for name, call in (("dtype", lambda: dist.allreduce(np.ones(2, "float32" if i == 0 else "int32"))),
                   ("shape", lambda: dist.broadcast(np.ones(2 + i, "float32")))):
    try:
        call()
        say("mismatch", name, "passed")
    except ValueError as error:
        say("mismatch", name, str(error).split(";")[0])
say("bf16 mean", float(dist.allreduce(np.array([1.0 + i], jax.numpy.bfloat16))[0]))
try:  # a scalar in one instance only: refused in both, none waits for the other
    dist.allgather(np.float32(i) if i == 0 else np.ones(1, "float32"))
except ValueError as error:
    say("scalar gather", str(error).split(";")[0])
# The seed's multi-worker strategy reduces a per-worker value across the workers.
strategy = ipu.ipu_multi_worker_strategy.IPUMultiWorkerStrategy(None)
say("strategy reduce", float(strategy.reduce("SUM", np.float32(i + 1))),
    float(strategy.reduce("MEAN", np.float32(i + 1))))
import keras  # noqa: E402 - after the system is configured, as a job's script may

with strategy.scope():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
optimizer = keras.optimizers.SGD(0.1)
optimizer.build(model.trainable_variables)
try:  # an apply in a computation of one instance's replicas: the weights would part
    strategy.run(lambda: optimizer.apply([v.value * 0 for v in model.trainable_variables],
                                         model.trainable_variables))
    say("run apply passed")
except NotImplementedError as error:
    say("run apply", str(error).split(":")[0])
