"""IPU system configuration: `IPUConfig`, `configure_ipu_system` and friends.

Mirrors `tensorflow.python.ipu.config`:

```python
from keras_ipu import config

cfg = config.IPUConfig()
cfg.auto_select_ipus = 2
cfg.selection_order = config.SelectionOrder.SNAKE
cfg.configure_ipu_system()
```
"""

from keras_ipu.config.attributes import AttributeMetadata
from keras_ipu.config.enums import (
    DeviceConnectionType,
    ExecutionProfileType,
    KeyId,
    MergeRemoteBuffersBehaviour,
    SchedulingAlgorithm,
    SelectionOrder,
    StochasticRoundingBehaviour,
    VerificationOptions,
)
from keras_ipu.config.schema import IPUConfig
from keras_ipu.config.system import (
    configure_ipu_system,
    get_ipu_config,
    reset_ipu_configuration,
)

__all__ = [
    "AttributeMetadata",
    "DeviceConnectionType",
    "ExecutionProfileType",
    "IPUConfig",
    "KeyId",
    "MergeRemoteBuffersBehaviour",
    "SchedulingAlgorithm",
    "SelectionOrder",
    "StochasticRoundingBehaviour",
    "VerificationOptions",
    "configure_ipu_system",
    "get_ipu_config",
    "reset_ipu_configuration",
]
