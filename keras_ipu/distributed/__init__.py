"""Multi-host training: instances on JAX's distributed runtime, their strategies and launcher.

    # keras-ipu run --num-instances 2 --num-replicas 4 train.py
    import keras_ipu as ipu

    config = ipu.config.IPUConfig()
    ipu.distributed.update_ipu_config(config)       # 2 IPUs in each instance
    config.configure_ipu_system()                    # joins the job
    strategy = ipu.distributed.IPUMultiReplicaStrategy()
    with strategy.scope():
        ...                                          # model.fit on 4 global replicas

See docs/multi_host.md.
"""

from keras_ipu.distributed.config import update_ipu_config
from keras_ipu.distributed.runtime import (
    allgather,
    allreduce,
    barrier,
    broadcast,
    initialize,
    instance_index,
    num_global_replicas,
    num_instances,
    num_local_replicas,
)
from keras_ipu.distributed.sharding import shard_for_instance

# The strategies import the Keras integration: loaded on first use, so that
# `configure_ipu_system` can join the job without importing Keras.
_STRATEGIES = ("IPUHorovodStrategy", "IPUMultiReplicaStrategy", "IPUMultiWorkerStrategy")


def __getattr__(name: str):
    if name in _STRATEGIES:
        from keras_ipu.distributed import strategy

        return getattr(strategy, name)
    raise AttributeError(f"module 'keras_ipu.distributed' has no attribute {name!r}")


__all__ = [
    "IPUHorovodStrategy",
    "IPUMultiReplicaStrategy",
    "IPUMultiWorkerStrategy",
    "allgather",
    "allreduce",
    "barrier",
    "broadcast",
    "initialize",
    "instance_index",
    "num_global_replicas",
    "num_instances",
    "num_local_replicas",
    "shard_for_instance",
    "update_ipu_config",
]
