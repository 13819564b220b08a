"""`ipu.ipu_outfeed_queue`: `IPUOutfeedQueue` and its modes; see `keras_ipu.device.feeds`."""

from keras_ipu.device.queues import IPUOutfeedMode, IPUOutfeedQueue

__all__ = ["IPUOutfeedMode", "IPUOutfeedQueue"]
