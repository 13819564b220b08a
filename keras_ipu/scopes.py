"""`ipu.scopes`: where computations run, and options for them; see `keras_ipu.device.scopes`."""

from keras_ipu.device.scopes import (
    frontend_attribute,
    ipu_jit_scope,
    ipu_scope,
    ipu_shard,
    outside_compilation_scope,
    partials_type,
    stochastic_rounding,
)

__all__ = ["frontend_attribute", "ipu_jit_scope", "ipu_scope", "ipu_shard",
           "outside_compilation_scope", "partials_type", "stochastic_rounding"]
