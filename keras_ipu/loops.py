"""`ipu.loops`: on-device loops (`repeat`, `while_loop`); see `keras_ipu.device.feeds`.

Called eagerly, outside `ipu_compiler.compile` and `strategy.run`, a loop
still applies the Keras variable assignments of its body (BatchNormalization's
moving statistics, a seed generator's state) once it has run, as those do
(`keras_ipu.keras.assignments`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from keras_ipu.device import feeds
from keras_ipu.keras import assignments


@functools.wraps(feeds.repeat)
def repeat(n: int, body: Callable, inputs: Any = None, infeed_queue: Any = None,
           use_while_v1: bool = True) -> Any:
    return assignments.assigning(
        lambda: feeds.repeat(n, body, inputs, infeed_queue, use_while_v1))


@functools.wraps(feeds.while_loop)
def while_loop(condition: Callable, body: Callable, inputs: Any = None,
               infeed_queue: Any = None, maximum_iterations: int | None = None,
               use_while_v1: bool = True) -> Any:
    return assignments.assigning(
        lambda: feeds.while_loop(condition, body, inputs, infeed_queue, maximum_iterations,
                                 use_while_v1))


__all__ = ["repeat", "while_loop"]
