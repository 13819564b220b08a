"""`ipu.ipu_infeed_queue`: `IPUInfeedQueue`, a loop's data; see `keras_ipu.device.feeds`."""

from keras_ipu.device.queues import IPUInfeedQueue

__all__ = ["IPUInfeedQueue"]
