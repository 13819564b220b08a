"""IPU TensorFlow's scopes: where a computation runs, and options for the operations inside.

- `ipu_scope(device)` places what runs inside it on the device's first IPU
  (`jax.default_device`); `ipu_shard(index)` on its IPU `index`; `compile`
  compiles for that device (`current_scope`), and learns which shards a
  computation uses (`recording_shards`) to replicate it over the rest.
- `outside_compilation_scope` places eager work on the host CPU.
- `ipu_jit_scope`, `partials_type`, `stochastic_rounding` and
  `frontend_attribute` steer the Poplar compiler: their arguments are
  checked, and the program computes what it did.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from keras_ipu.device import system

# Trace-time context, not global state: the scope a computation is built in.
_SCOPE: contextvars.ContextVar = contextvars.ContextVar("ipu_scope", default=None)
# Trace-time context: the shards `ipu_shard` entered while a computation is traced.
_SHARDS: contextvars.ContextVar = contextvars.ContextVar("ipu_shards", default=None)


def current_scope() -> tuple[str, int] | None:
    """`(device, shard)` of the innermost `ipu_scope` / `ipu_shard`, or `None` outside one.

    Returns:
        The logical device's name and the IPU of it, or `None`.

    Example:

    >>> with ipu_scope("/device:IPU:0"):
    ...     current_scope()
    ('/device:IPU:0', 0)
    """
    return _SCOPE.get()


@contextlib.contextmanager
def recording_shards() -> Iterator[set[int]]:
    """Records the shards (`ipu_shard` indices) that the code run inside enters.

    A computation traced inside tells `compile` how many IPUs one copy of
    it uses, so that the device's other IPUs hold replicas.

    Yields:
        The set of shard indices, filled as `ipu_shard` is entered.

    Example:

    >>> with recording_shards() as shards, ipu_scope("/device:IPU:0"), ipu_shard(1):
    ...     pass
    >>> shards
    {1}
    """
    shards: set[int] = set()
    token = _SHARDS.set(shards)
    try:
        yield shards
    finally:
        _SHARDS.reset(token)


@contextlib.contextmanager
def ipu_scope(device: str) -> Iterator[None]:
    """Places what is computed inside on the first IPU of `device`.

    Args:
        device: A logical device of the configured system, `/device:IPU:N`.

    Raises:
        ValueError: When the system has no such device.
        RuntimeError: When no IPU system is configured.

    Example:

    >>> with ipu_scope("/device:IPU:0"):
    ...     result = compile(my_net, inputs=[x])
    """
    ipus = system.require().ipus_of_device(device)
    token = _SCOPE.set((device, 0))
    try:
        with jax.default_device(ipus[0].device):
            yield
    finally:
        _SCOPE.reset(token)


@contextlib.contextmanager
def ipu_shard(index: int) -> Iterator[None]:
    """Places what is computed inside on IPU `index` of the enclosing `ipu_scope`'s device.

    Args:
        index: The IPU of the device (its shard).

    Raises:
        TypeError: When `index` is not an integer (one shard: a list of
            shards has no meaning here).
        ValueError: When the device has no IPU `index`.

    Example:

    >>> with ipu_scope("/device:IPU:0"), ipu_shard(1):
    ...     result = compile(stage, inputs=[x])
    """
    if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
        raise TypeError(f"ipu_shard takes the integer index of one IPU of the device, got "
                        f"{index!r}.")
    device = (_SCOPE.get() or ("/device:IPU:0", 0))[0]
    ipus = system.require().ipus_of_device(device)
    if not 0 <= index < len(ipus):
        raise ValueError(f"ipu_shard({index}): {device} has IPUs 0-{len(ipus) - 1}.")
    recorded = _SHARDS.get()
    if recorded is not None:
        recorded.add(index)
    token = _SCOPE.set((device, index))
    try:
        with jax.default_device(ipus[index].device):
            yield
    finally:
        _SCOPE.reset(token)


@contextlib.contextmanager
def ipu_jit_scope(ipu_scope: Any) -> Iterator[None]:
    """Groups operations to compile together, named by `ipu_scope`.

    A JAX program is already compiled as one (`compile`, a `fit` step), so
    the scope only checks its name and adds no boundary.

    Args:
        ipu_scope: A name (a string or an int) telling JIT scopes apart.

    Raises:
        TypeError: For a name that is neither a string nor an int.

    Example:

    >>> with ipu_jit_scope("encoder"):
    ...     y = compile(encoder, inputs=[x])
    """
    if isinstance(ipu_scope, bool) or not isinstance(ipu_scope, (str, int)):
        raise TypeError(f"ipu_jit_scope takes a name (a string or an int), got {ipu_scope!r}.")
    yield


@contextlib.contextmanager
def outside_compilation_scope(name: str = "outside") -> Iterator[None]:
    """Places operations on the host CPU instead of the IPU.

    Eager JAX operations inside run on the host's CPU device. Inside a
    function being compiled (`compile`, a `fit` step) JAX cannot move part
    of the program to the host: those operations stay in the program and
    compute the same values on the IPU's device.

    Args:
        name: A name for the scope.

    Raises:
        TypeError: For a name that is not a string.

    Example:

    >>> with outside_compilation_scope():
    ...     c = b + 2   # eager: on the host
    """
    if not isinstance(name, str):
        raise TypeError(f"outside_compilation_scope takes a name string, got {name!r}.")
    with jax.default_device(jax.devices("cpu")[0]):
        yield


@contextlib.contextmanager
def partials_type(override_type: Any) -> Iterator[None]:
    """Asks for the type of convolutions' and matmuls' partial sums (experimental).

    As the reference says, nothing guarantees the type is used: the device
    model sums in each operation's own type. The type is checked.

    Args:
        override_type: `numpy.float16` or `numpy.float32` (or their names).

    Raises:
        ValueError: For any other type.

    Example:

    >>> with partials_type(np.float16):
    ...     y = compile(net, inputs=[x])
    """
    try:
        valid = np.dtype(override_type) in (np.float16, np.float32)
    except TypeError:
        valid = False
    if not valid:
        raise ValueError(f"partials_type takes float16 or float32, got {override_type!r}.")
    yield


@contextlib.contextmanager
def stochastic_rounding(override: bool) -> Iterator[None]:
    """Turns stochastic rounding on or off for the operations inside (experimental).

    As the reference says, nothing guarantees it is used: the device model
    rounds to nearest, as JAX does. The switch is checked.

    Args:
        override: Whether to round stochastically.

    Raises:
        TypeError: When `override` is not a bool (Python's or NumPy's).

    Example:

    >>> with stochastic_rounding(False):
    ...     y = compile(net, inputs=[x])
    """
    if not isinstance(override, (bool, np.bool_)):
        raise TypeError(f"stochastic_rounding takes a bool, got {override!r}.")
    yield


@contextlib.contextmanager
def frontend_attribute(attribute_name: str, attribute_value: str,
                       restore_to: str | None = None) -> Iterator[None]:
    """Sets a Poplar frontend attribute on the operations inside.

    Frontend attributes steer the Poplar compiler; the device model has no
    such compiler, so the attribute is checked and has no effect.

    Args:
        attribute_name: The attribute's name.
        attribute_value: Its value, a string.
        restore_to: The value to restore afterwards, or None.

    Raises:
        TypeError: When the name, value or `restore_to` is not a string.

    Example:

    >>> with frontend_attribute("PARTIALS_TYPE", "DT_HALF"):
    ...     y = compile(net, inputs=[x])
    """
    for argument, value in (("attribute_name", attribute_name),
                            ("attribute_value", attribute_value)):
        if not isinstance(value, str):
            raise TypeError(f"frontend_attribute's {argument} must be a string, got {value!r}.")
    if restore_to is not None and not isinstance(restore_to, str):
        raise TypeError(f"frontend_attribute's restore_to must be a string, got {restore_to!r}.")
    yield
