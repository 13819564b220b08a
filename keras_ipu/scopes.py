"""`ipu.scopes`: where computations run (`ipu_scope`, `ipu_shard`); see `keras_ipu.device.feeds`."""

from keras_ipu.device.feeds import ipu_scope, ipu_shard

__all__ = ["ipu_scope", "ipu_shard"]
