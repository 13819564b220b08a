"""`ipu.ipu_compiler`: `compile(computation, inputs)` for the scope's IPU (`device.feeds`)."""

from keras_ipu.device.feeds import compile  # noqa: A004 - the seed's name

__all__ = ["compile"]
