"""Graphcore utility operators of `tensorflow.python.ipu.internal_ops`.

Example:

```python
from keras_ipu.ops import internal_ops

def my_net(v):
    print_op = internal_ops.print_tensor(v, name="v")
    return v + 1, print_op
```
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import jax
import numpy as np

from keras_ipu.device.queues import Operation


def _print(name: str, value: np.ndarray) -> None:
    print(f"{name}: {value}" if name else value, file=sys.stderr, flush=True)


def print_tensor(input: Any, name: str = "") -> Operation:  # noqa: A002 - the seed's name
    """Prints `input` to standard error when the program runs.

    The print is part of the program being traced (`jax.debug.callback`):
    inside `ipu_compiler.compile`, a loop body or a layer's `call` it prints
    at each run, with the values of that run; outside any program it prints
    at once.

    Args:
        input: The array (or structure of arrays) to print.
        name: A label printed before the value.

    Returns:
        An `Operation`: returned from a computation, `compile` drops it
        from the outputs, as IPU TensorFlow drops the print op.

    Example:

    >>> with ipu.scopes.ipu_scope("/device:IPU:0"):
    ...     [out] = ipu.ipu_compiler.compile(
    ...         lambda v: (v + 1, print_tensor(v, "v")), inputs=[np.ones(2)])
    """
    jax.debug.callback(functools.partial(_print, name), input)
    return Operation()


__all__ = ["print_tensor"]
