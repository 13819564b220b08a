"""`IPUMultiWorkerStrategy`: replicas over all instances of a multi-host job."""

from keras_ipu.distributed.strategy import IPUMultiWorkerStrategy

__all__ = ["IPUMultiWorkerStrategy"]
