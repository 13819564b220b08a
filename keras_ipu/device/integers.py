"""Integer arguments as IPU TensorFlow code passes them: any integer kind, not a bool.

Counts, factors and sizes arrive as Python ints, NumPy integers or 0-d
integer arrays (a data set's `cardinality()`); a float such as `R / 2` or a
bool is no integer, even where Python would take it as one.

Example:

```python
from keras_ipu.device import integers

size = integers.integer_of(np.int64(2))   # 2; integer_of(2.0) is None
```
"""

from __future__ import annotations

import operator
from typing import Any


def integer_of(value: Any) -> int | None:
    """The Python int `value` stands for, or `None` when it is no integer.

    Args:
        value: An int, a NumPy integer or a 0-d integer array.

    Returns:
        The int; `None` for a bool, a float, a string, an array of more
        than one element, or anything else.

    Example:

    >>> integer_of(np.int64(3)), integer_of(True), integer_of(2.0)
    (3, None, None)
    """
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


__all__ = ["integer_of"]
