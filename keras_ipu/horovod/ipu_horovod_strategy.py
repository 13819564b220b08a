"""`IPUHorovodStrategy` under the seed's Horovod module name."""

from keras_ipu.distributed.strategy import IPUHorovodStrategy

__all__ = ["IPUHorovodStrategy"]
