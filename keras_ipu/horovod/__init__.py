"""The seed's `ipu.horovod` names, on JAX's distributed runtime (see `keras_ipu.distributed`)."""

from keras_ipu.distributed.runtime import allgather, allreduce, broadcast
from keras_ipu.distributed.runtime import instance_index as rank
from keras_ipu.distributed.runtime import num_instances as size

__all__ = ["allgather", "allreduce", "broadcast", "ipu_multi_replica_strategy", "rank", "size"]


def __getattr__(name: str):
    # The strategy module imports Keras: loaded when first named, as the seed's
    # `hvd.ipu_multi_replica_strategy.IPUMultiReplicaStrategy` does.
    if name == "ipu_multi_replica_strategy":
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
