"""IPU operators, as `tensorflow.python.ipu.ops`: `ipu.ops.pipelining_ops` and friends.

Each module is also `ipu.<module>` (`ipu.nn_ops`, ...), as in IPU TensorFlow.

Submodules load on first use.

Example:

```python
import keras_ipu as ipu

schedule = ipu.ops.pipelining_ops.PipelineSchedule.Interleaved
```
"""

from __future__ import annotations

import importlib

_SUBMODULES = (
    "all_to_all_op",
    "cross_replica_ops",
    "embedding_ops",
    "image_ops",
    "internal_ops",
    "math_ops",
    "nn_ops",
    "normalization_ops",
    "pipelining_ops",
    "rand_ops",
    "reduce_scatter_op",
    "replication_ops",
    "rnn_ops",
    "slicing_ops",
    "statistics_ops",
)

__all__ = list(_SUBMODULES)


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"keras_ipu.ops.{name}")
    raise AttributeError(f"module 'keras_ipu.ops' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
