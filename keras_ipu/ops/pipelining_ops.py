"""Pipelining operators under their IPU TensorFlow path, `ipu.ops.pipelining_ops`.

The same names as `keras_ipu.pipelining_ops`.
"""

from keras_ipu.pipelining_ops import (
    PipelineSchedule,
    PipelineStageOptions,
    RecomputationMode,
    recomputation_checkpoint,
)

__all__ = ["PipelineSchedule", "PipelineStageOptions", "RecomputationMode",
           "recomputation_checkpoint"]
