"""IPU TensorFlow's loop-level programming interface on JAX: scopes, loops, infeeds, outfeeds.

Code written against `ipu.scopes`, `ipu.ipu_compiler`, `ipu.loops`,
`ipu.ipu_infeed_queue` and `ipu.ipu_outfeed_queue` keeps its shape here,
with JAX functions for TensorFlow's graph code:

- `ipu_scope(device)` places what runs inside it on the device's first
  IPU (`jax.default_device`); `ipu_shard(index)` on its IPU `index`.
- `compile(computation, inputs)` compiles `computation` with `jax.jit` for
  that IPU and runs it at once (IPU TensorFlow builds an op that a session
  runs later); outfeeds enqueued inside come back with it.
- `repeat(n, body, inputs, infeed_queue)` is an on-device loop (`lax.scan`):
  each iteration takes the next element of the infeed, if any, after the
  loop-carried values; values `enqueue`d on an outfeed in the body are
  stacked per iteration and handed to the queue when the loop has run.
- `while_loop(condition, body, inputs)` is `lax.while_loop`.

The infeed's elements are taken on the host when the loop is built and enter
the program as its data.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from keras_ipu.device import system

# Trace-time context, not global state: the scope a computation is built in,
# and the outfeed values enqueued by the loops of a `compile` being traced.
_SCOPE: contextvars.ContextVar = contextvars.ContextVar("ipu_scope", default=None)
_OUTFED: contextvars.ContextVar = contextvars.ContextVar("outfed", default=None)
# The values a loop body being traced enqueues on outfeeds.
_ENQUEUES: contextvars.ContextVar = contextvars.ContextVar("enqueues", default=None)


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
        ValueError: When the device has no IPU `index`.

    Example:

    >>> with ipu_scope("/device:IPU:0"), ipu_shard(1):
    ...     result = compile(stage, inputs=[x])
    """
    device = (_SCOPE.get() or ("/device:IPU:0", 0))[0]
    ipus = system.require().ipus_of_device(device)
    if not 0 <= index < len(ipus):
        raise ValueError(f"ipu_shard({index}): {device} has IPUs 0-{len(ipus) - 1}.")
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
        TypeError: When `override` is not a bool.

    Example:

    >>> with stochastic_rounding(False):
    ...     y = compile(net, inputs=[x])
    """
    if not isinstance(override, bool):
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


def compile(computation: Callable, inputs: Any = None) -> list:  # noqa: A001 - the seed's name
    """Compiles `computation(*inputs)` for the current IPU and runs it.

    Args:
        computation: A JAX-traceable function of `len(inputs)` arguments.
        inputs: A list of arguments (arrays or structures of them), or `None`.

    Returns:
        The outputs as a list: `[]` for `None`, `[value]` for a single
        value, the values of a tuple or list. Outfeeds enqueued inside get
        their values.

    Raises:
        RuntimeError: Outside an `ipu_scope`, as on the IPU ("not compiled
            for an IPU device").

    Example:

    >>> with ipu_scope("/device:IPU:0"):
    ...     [total] = compile(lambda x: x.sum(), inputs=[np.ones(4)])
    """
    scope = _SCOPE.get()
    if scope is None:
        raise RuntimeError("ipu_compiler.compile must be called inside "
                           "ipu.scopes.ipu_scope('/device:IPU:N'): the computation is "
                           "compiled for that IPU device.")
    device, shard = scope
    target = system.require().ipus_of_device(device)[shard].device
    return call_compiled(lambda *args: _outputs(computation(*args)), target,
                         _as_list(inputs))


def call_compiled(fn: Callable, device: Any, args: Any = (), kwargs: Any = None) -> Any:
    """Runs `fn(*args, **kwargs)` under `jax.jit` on `device`; outfeeds get what it enqueues.

    The values a loop inside enqueues leave the program with its outputs and
    reach their queues once it has run (inside another such call, they leave
    with the outer program's). Operations `fn` returns (outfeed markers) come
    back as `None`.

    Args:
        fn: A JAX-traceable function.
        device: The JAX device to run on; array arguments are copied there.
        args: Its positional arguments.
        kwargs: Its keyword arguments, or `None`.

    Returns:
        `fn`'s result.

    Example:

    >>> call_compiled(lambda x: x * 2, jax.devices()[0], (np.ones(3),))
    Array([2., 2., 2.], dtype=float32)
    """
    outer = _OUTFED.get()
    queues: list = []

    def traced(args, kwargs):
        token = _OUTFED.set([])
        try:
            result = fn(*args, **kwargs)
            outfed = _OUTFED.get()
        finally:
            _OUTFED.reset(token)
        queues.extend(queue for queue, _ in outfed)
        result = jax.tree_util.tree_map(
            lambda v: None if isinstance(v, Operation) else v, result)
        return result, [value for _, value in outfed]

    args, kwargs = jax.device_put((tuple(args), dict(kwargs or {})), device)
    result, outfed = jax.jit(traced)(args, kwargs)
    for queue, value in zip(queues, outfed):
        if outer is not None:
            outer.append((queue, value))
        else:
            queue._receive(value)
    return result


class IPUOutfeedMode(enum.Enum):
    """What an outfeed's `dequeue` returns: every enqueued element, or the last.

    Example:

    >>> IPUOutfeedQueue(outfeed_mode=IPUOutfeedMode.LAST)
    """

    # IPU TensorFlow's values: `IPUOutfeedMode("get_last")` is `LAST`.
    ALL = "all"
    LAST = "get_last"


class Operation:
    """A side effect a computation returns, as IPU TensorFlow returns an op.

    `compile` and the loops drop it from a computation's or a body's
    outputs, as IPU TensorFlow drops operations after the tensors; the
    effect itself (an outfeed's `enqueue`, a `print_tensor`) is already in
    the program.

    Example:

    >>> def body(x):
    ...     return x + 1, outfeed.enqueue(x)   # an Operation: dropped
    """


class _Enqueued(Operation):
    """What `enqueue` returns."""


class IPUInfeedQueue:
    """The elements a loop's iterations take, one each, from a data source.

    Args:
        dataset: An iterable of elements: arrays, or tuples or dicts of
            them (a tuple's parts reach the body positionally, a dict's by
            keyword).
        feed_name: Accepted for compatibility.
        device_ordinal: Accepted for compatibility.
        replication_factor: Accepted for compatibility.
        data_to_prefetch: Accepted for compatibility.
        prefetch_depth: Accepted for compatibility.

    Raises:
        TypeError: When `dataset` is not iterable.

    Example:

    >>> infeed = IPUInfeedQueue(zip(images, labels))
    >>> repeat(10, body, [0.0], infeed)
    """

    def __init__(self, dataset: Any, feed_name: str | None = None, device_ordinal: int = 0,
                 replication_factor: int = 1, data_to_prefetch: int = 1,
                 prefetch_depth: int | None = None):
        self._dataset = dataset
        try:
            self._elements = iter(dataset)
        except TypeError:
            raise TypeError(f"IPUInfeedQueue needs an iterable of elements, got "
                            f"{type(dataset).__name__}.") from None
        self.initializer = None  # IPU TensorFlow's session initializer: nothing to run

    @property
    def dataset(self) -> Any:
        """The data source the queue takes its elements from, as it was given.

        Example:

        >>> IPUInfeedQueue([1, 2]).dataset
        [1, 2]
        """
        return self._dataset

    def _take(self, count: int) -> Any:
        """The next `count` elements, stacked on a leading axis."""
        elements = list(itertools.islice(self._elements, count))
        if len(elements) < count:
            raise ValueError(f"The infeed ran out: {len(elements)} elements left for a loop "
                             f"of {count} iterations.")
        stacked = jax.tree_util.tree_map(lambda *parts: np.stack(parts), *elements)
        if _synthetic_data():  # no host data reaches the device: it gets zeros
            return jax.tree_util.tree_map(np.zeros_like, stacked)
        return stacked


class IPUOutfeedQueue:
    """Values a loop's body enqueues, returned to the host by `dequeue`.

    Args:
        feed_name: Accepted for compatibility.
        outfeed_mode: `IPUOutfeedMode.ALL` (default: every enqueued value,
            stacked) or `LAST`.
        device_ordinal: Accepted for compatibility.
        replication_factor: Accepted for compatibility.
        io_batch_size: Accepted for compatibility.

    Raises:
        ValueError: For an `outfeed_mode` that is not an `IPUOutfeedMode`
            (or one's value).

    Example:

    >>> outfeed = IPUOutfeedQueue()
    >>> def body(x):
    ...     x = x + 1
    ...     return x, outfeed.enqueue(x)
    >>> repeat(20, body, [np.zeros(4)])
    >>> outfeed.dequeue().shape
    (20, 4)
    """

    def __init__(self, feed_name: str | None = None, outfeed_mode: IPUOutfeedMode | None = None,
                 device_ordinal: int = 0, replication_factor: int | None = None,
                 io_batch_size: int = 1):
        self.outfeed_mode = _outfeed_mode(outfeed_mode)
        self._pending: list = []
        self._received: list = []

    def enqueue(self, tensors: Any) -> _Enqueued:
        """Enqueues values inside a loop's body; returns a marker the loop drops.

        Raises:
            RuntimeError: Outside a loop's body.
        """
        collector = _ENQUEUES.get()
        if collector is None:
            raise RuntimeError("IPUOutfeedQueue.enqueue must be called inside the body of "
                               "ipu.loops.repeat.")
        collector.append((self, tensors))
        return _Enqueued()

    def _receive(self, stacked: Any) -> None:
        if _synthetic_data():  # nothing returns to the host: empty arrays of the structure
            stacked = jax.tree_util.tree_map(
                lambda a: np.zeros((0, *np.shape(a)[1:]), np.asarray(a).dtype), stacked)
        self._received.append(stacked)

    def dequeue(self, wait_for_completion: bool = False) -> Any:
        """The values enqueued by the loops run since the last `dequeue`.

        Returns:
            With `ALL`, every enqueued value stacked on a leading axis (in
            order, over loops); with `LAST`, the last one.

        With `--use_synthetic_data` nothing returns to the host: `ALL` gives
        empty arrays of the enqueued structure, `LAST` raises.

        Raises:
            ValueError: With `LAST` when nothing was enqueued (or returned).
        """
        received, self._received = self._received, []
        if self.outfeed_mode == IPUOutfeedMode.LAST:
            if _synthetic_data():
                raise ValueError("The outfeed has no last element: --use_synthetic_data "
                                 "returns no data to the host.")
            if not received:
                raise ValueError("The outfeed has no last element: nothing was enqueued.")
            return jax.tree_util.tree_map(lambda a: np.asarray(a[-1]), received[-1])
        if not received:
            return []
        return jax.tree_util.tree_map(lambda *parts: np.concatenate(parts), *received)



def _synthetic_data() -> bool:
    """Whether `--use_synthetic_data` is on: no data moves between host and device."""
    configured = system.current()
    return configured is not None and bool(configured.option("use_synthetic_data"))


def _outfeed_mode(mode: Any) -> IPUOutfeedMode:
    if mode is None:
        return IPUOutfeedMode.ALL
    try:
        return IPUOutfeedMode(mode)
    except ValueError:
        raise ValueError(
            f"outfeed_mode must be IPUOutfeedMode.ALL or IPUOutfeedMode.LAST (or their values "
            f"'all', 'get_last'), got {mode!r}.") from None


def repeat(n: int, body: Callable, inputs: Any = None,
           infeed_queue: IPUInfeedQueue | None = None, use_while_v1: bool = True) -> Any:
    """Runs `body` `n` times on the device, carrying `inputs` from one iteration to the next.

    Args:
        n: The number of iterations, at least 1.
        body: `body(*carried, *element)` (a dict element by keyword) returning
            the new carried values, in the order of `inputs`; outfeed
            `enqueue` markers among them are dropped.
        inputs: The initial carried values (a list), or `None`.
        infeed_queue: Where each iteration's element comes from, or `None`.
        use_while_v1: Accepted for compatibility.

    Returns:
        The final carried values: one value, a tuple of several, or `None`.

    Raises:
        ValueError: For `n` below 1, an infeed that runs out, or a body that
            returns another number of values than `inputs` has.

    Example:

    >>> repeat(10, lambda x: x + 1, [0.0])
    Array(10., dtype=float32)
    """
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"repeat needs n >= 1 iterations, got {n!r}.")
    carried = tuple(jax.tree_util.tree_map(jnp.asarray, _as_list(inputs)))
    data = infeed_queue._take(n) if infeed_queue is not None else None
    queues: list = []

    def step(carry, element):
        token = _ENQUEUES.set([])
        try:
            if element is None:
                new = body(*carry)
            elif isinstance(element, dict):
                new = body(*carry, **element)
            else:
                new = body(*carry, *(element if isinstance(element, tuple) else (element,)))
            enqueued = _ENQUEUES.get()
        finally:
            _ENQUEUES.reset(token)
        queues[:] = [queue for queue, _ in enqueued]
        new = _carried(new, len(carry))
        return new, [value for _, value in enqueued]

    final, outfed = jax.lax.scan(step, carried, data, length=n)
    collector = _OUTFED.get()
    for queue, stacked in zip(queues, outfed):
        if collector is not None:  # inside `compile`: the values leave with its outputs
            collector.append((queue, stacked))
        else:
            queue._receive(stacked)
    return _unpacked(final)


def while_loop(condition: Callable, body: Callable, inputs: Any = None,
               infeed_queue: IPUInfeedQueue | None = None,
               maximum_iterations: int | None = None, use_while_v1: bool = True) -> Any:
    """Runs `body` while `condition` holds, carrying `inputs` (at most `maximum_iterations`).

    Args:
        condition: `condition(*carried)` returning a boolean scalar.
        body: `body(*carried)` returning the new carried values.
        inputs: The initial carried values (a list), or `None`.
        infeed_queue: Not supported: a while loop's iteration count is known
            only on the device; use `repeat`.
        maximum_iterations: Stop after this many iterations, or `None`.
        use_while_v1: Accepted for compatibility.

    Returns:
        The final carried values: one value, a tuple of several, or `None`.

    Raises:
        ValueError: With an `infeed_queue`.

    Example:

    >>> while_loop(lambda x: x < 10, lambda x: x + 3, [0])
    Array(12, dtype=int32)
    """
    if infeed_queue is not None:
        raise ValueError("while_loop takes no infeed_queue here: its iteration count is known "
                         "only on the device. Use ipu.loops.repeat(n, body, inputs, "
                         "infeed_queue).")
    carried = tuple(jax.tree_util.tree_map(jnp.asarray, _as_list(inputs)))
    limit = np.iinfo(np.int32).max if maximum_iterations is None else maximum_iterations

    def keep_going(state):
        count, carry = state
        return (count < limit) & condition(*carry)

    def step(state):
        count, carry = state
        return count + 1, _carried(body(*carry), len(carry))

    _, final = jax.lax.while_loop(keep_going, step, (0, carried))
    return _unpacked(final)


def _as_list(inputs: Any) -> list:
    """Loop or computation inputs as a list: `None` is none, a lone value is one.

    IPU TensorFlow's examples pass a lone tensor as `(x)`, which is not a tuple.
    """
    if inputs is None:
        return []
    return list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]


def _outputs(values: Any) -> list:
    """A computation's or a body's values as a list, operations dropped."""
    if values is None:
        return []
    values = values if isinstance(values, (tuple, list)) else (values,)
    return [value for value in values if not isinstance(value, Operation)]


def _carried(new: Any, count: int) -> tuple:
    """A body's result as the tuple of carried values."""
    values = tuple(_outputs(new))
    if len(values) != count:
        raise ValueError(f"The loop body returned {len(values)} values for {count} "
                         f"loop-carried inputs.")
    return values


def _unpacked(values: tuple) -> Any:
    if not values:
        return None
    return values[0] if len(values) == 1 else values
