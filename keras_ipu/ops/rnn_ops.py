"""Popnn recurrent layers of `tensorflow.python.ipu.rnn_ops`: time-major, returning their state.

Implemented in `keras_ipu.keras.recurrent_ops`; see there.

Example:

```python
from keras_ipu.ops import rnn_ops

outputs, state = rnn_ops.PopnnGRU(32)(inputs)   # inputs: [time, batch, features]
```
"""

from keras_ipu.keras.recurrent_ops import (
    AttentionGRUCell,
    LSTMStateTuple,
    PopnnAUGRU,
    PopnnDynamicGRU,
    PopnnGRU,
    PopnnLSTM,
)

__all__ = ["AttentionGRUCell", "LSTMStateTuple", "PopnnAUGRU", "PopnnDynamicGRU", "PopnnGRU",
           "PopnnLSTM"]
