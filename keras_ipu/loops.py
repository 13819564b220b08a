"""`ipu.loops`: on-device loops (`repeat`, `while_loop`); see `keras_ipu.device.feeds`."""

from keras_ipu.device.feeds import repeat, while_loop

__all__ = ["repeat", "while_loop"]
