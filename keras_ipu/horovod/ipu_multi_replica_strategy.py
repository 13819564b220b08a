"""`IPUMultiReplicaStrategy` under the seed's Horovod module name."""

from keras_ipu.distributed.strategy import IPUMultiReplicaStrategy

__all__ = ["IPUMultiReplicaStrategy"]
