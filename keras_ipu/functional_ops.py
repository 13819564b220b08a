"""`ipu.functional_ops.outlined_function` (also `ipu.outlined_function`): one copy of reused code.

On the IPU an outlined function is compiled once and called wherever it is
used, which saves code memory at the price of copying its arguments. On the
device model it is compiled as one function of the program (`jax.jit` with
`inline=False`): the lowered program holds one copy of its code and calls it
at each use, and the cost model counts every call. Its body must be pure (a
JAX function of its arguments): Keras layers that update state when called
(dropout's seed generator, batch normalisation's statistics) belong outside.

Example:

```python
import keras_ipu as ipu

@ipu.outlined_function
def block(x, w):
    return jax.nn.gelu(x @ w)

y = block(block(x, w1), w2)   # one copy of `block` in the program
```
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


def outlined_function(func: Callable | None = None, unique_sharding: bool = False,
                      keep_input_layouts: bool | None = None,
                      name: str | None = None) -> Any:
    """Makes `func` an outlined function: compiled once, called at each use.

    Usable as `@outlined_function` or `@outlined_function(name=...)`.

    Args:
        func: A JAX function of positional array arguments, returning at
            least one array.
        unique_sharding: Accepted for compatibility (Poplar's copy of the
            inputs to one IPU before the call).
        keep_input_layouts: Accepted for compatibility (Poplar's tensor
            layouts).
        name: The function's name in the program (default: `func`'s).

    Returns:
        The outlined function, or a decorator when `func` is `None`.

    Raises:
        TypeError: When `func` is given and is not callable.

    Example:

    >>> f = outlined_function(lambda a, b: a @ b, name="matmul")
    """

    def outline(function: Callable) -> Callable:
        if not callable(function):
            raise TypeError(f"outlined_function needs a function, got {function!r}.")
        if name is not None:
            original = function

            def function(*args):
                return original(*args)

            function.__name__ = function.__qualname__ = name
        compiled = jax.jit(function, inline=False)

        @functools.wraps(function)
        def outlined(*args):
            # Objects that stand for arrays (Keras variables) are passed as their values.
            return compiled(*jax.tree_util.tree_map(_as_array, args))

        return outlined

    return outline if func is None else outline(func)


def _as_array(value: Any) -> Any:
    return jnp.asarray(value) if hasattr(value, "__jax_array__") else value


__all__ = ["outlined_function"]
