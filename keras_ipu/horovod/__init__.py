"""The seed's `ipu.horovod` names, on JAX's distributed runtime (see `keras_ipu.distributed`)."""

from keras_ipu.distributed.runtime import allgather, allreduce, broadcast
from keras_ipu.distributed.runtime import instance_index as rank
from keras_ipu.distributed.runtime import num_instances as size

__all__ = ["allgather", "allreduce", "broadcast", "rank", "size"]
