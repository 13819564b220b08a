"""IPU TensorFlow's infeed and outfeed queues: where loops take their data and put their results.

- `IPUInfeedQueue(dataset)` hands a loop one element per iteration. Its
  elements are taken on the host when a loop needs them and enter the
  program as its data; a loop that needs more than the queue has left takes
  nothing.
- `IPUOutfeedQueue(outfeed_mode)` receives what a loop's body `enqueue`s:
  every iteration's value stacked (`ALL`) or the last one (`LAST`), given
  back by `dequeue` once the program has run.

Each iteration of a body may enqueue once on a queue (IPU TensorFlow: "An
outfeed can only be enqueued once"); a loop nested in a body passes its
stacked values on to the enclosing loop, which returns them in iteration
order.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import enum
import itertools
import warnings
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from keras_ipu.device import program_outfeeds, system
from keras_ipu.device.deprecated_arguments import deprecated_arguments


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


class Enqueues:
    """What one iteration of a loop body enqueues: per queue, one value or one block of values.

    Args:
        refusal: Why this body may not enqueue (a `while_loop`'s), or `None`.
        probe: Whether it only learns whether a trace enqueues (an outlined
            function's): then values of any trace are taken.

    Example:

    >>> with collect_enqueues() as enqueued:
    ...     outfeed.enqueue(x)
    >>> [queue for queue, _, _ in enqueued.records]
    """

    def __init__(self, refusal: str | None = None, probe: bool = False):
        self.refusal = refusal
        self.records: list[tuple[Any, Any, bool]] = []  # (queue, value, is a block)
        self.trace = None if probe else program_outfeeds.trace_state()  # the body's

    def add(self, queue: IPUOutfeedQueue, value: Any, block: bool) -> None:
        """Adds `queue`'s value for this iteration (`block`: a nested loop's stacked values).

        Args:
            queue: The outfeed.
            value: Its value: what `enqueue` got, or a nested loop's values
                stacked per inner iteration.
            block: Whether `value` is a nested loop's stacked values.

        Raises:
            RuntimeError: When this body may not enqueue, or `value` is of a
                JAX transformation inside the body (`jax.grad`).
            ValueError: When `queue` already has this iteration's value.

        Example:

        >>> enqueued.add(outfeed, {"loss": loss}, block=False)
        """
        if self.refusal is not None:
            raise RuntimeError(self.refusal)
        if self.trace is not None:
            program_outfeeds.check_in_trace(self.trace)
        if any(known is queue for known, _, _ in self.records):
            raise ValueError("An outfeed can only be enqueued once in an iteration of a loop's "
                             "body (as on the IPU); enqueue one structure of values, such as "
                             "a tuple or a dict, instead.")
        self.records.append((queue, value, block))


# Trace-time context, not global state: the enqueues of the loop body being traced.
_ENQUEUES: contextvars.ContextVar = contextvars.ContextVar("enqueues", default=None)
# Trace-time context: the infeed queues made while a compiled function is traced.
_MADE_INFEEDS: contextvars.ContextVar = contextvars.ContextVar("made_infeeds", default=None)


class _MadeInfeeds:
    """The infeed queues made in one trace, and what earlier traces' queues looked at."""

    def __init__(self, unread: list):
        self.made: list = []
        self.unread = unread  # [source, elements]: looked at, not taken, by a queue gone


@contextlib.contextmanager
def recording_made_infeeds(unread: list) -> Iterator[list]:
    """Records the infeed queues made inside the block (a function being traced).

    A queue a function makes for itself is new in every trace. What one
    trace's queue looked at from a one-shot source (an iterator, such as a
    generator) and did not take is kept in `unread`, and the next queue
    made over that source starts with it: no element is lost between traces.

    Args:
        unread: Where the elements looked at and not taken wait, from one
            block to the next (the compiled program's list).

    Example:

    >>> with recording_made_infeeds(program_unread) as made:
    ...     fn()
    >>> infeed in made
    """
    record = _MadeInfeeds(unread)
    token = _MADE_INFEEDS.set(record)
    try:
        yield record.made
    finally:
        _MADE_INFEEDS.reset(token)
        for queue in record.made:
            if queue._ahead and queue._elements is queue._dataset:
                unread.append([queue._dataset, list(queue._ahead)])


def made_in_this_trace(queue: IPUInfeedQueue) -> bool:
    """Whether `queue` was made inside the innermost `recording_made_infeeds` block.

    Example:

    >>> made_in_this_trace(infeed)
    False
    """
    record = _MADE_INFEEDS.get()
    return record is not None and any(queue is other for other in record.made)


def _register_made(queue: IPUInfeedQueue) -> None:
    """Adds a queue made in a trace to its record, with its source's unread elements."""
    record = _MADE_INFEEDS.get()
    if record is None:
        return
    record.made.append(queue)
    for entry in record.unread:
        if entry[0] is queue._dataset:
            record.unread.remove(entry)
            queue._ahead.extend(entry[1])
            return


@contextlib.contextmanager
def collect_enqueues(refusal: str | None = None, probe: bool = False) -> Iterator[Enqueues]:
    """Collects what the loop body traced inside enqueues.

    Args:
        refusal: Why the body may not enqueue, or `None` when it may.
        probe: See `Enqueues`.

    Example:

    >>> with collect_enqueues() as enqueued:
    ...     body(x)
    """
    enqueued = Enqueues(refusal, probe)
    token = _ENQUEUES.set(enqueued)
    try:
        yield enqueued
    finally:
        _ENQUEUES.reset(token)


def current_enqueues() -> Enqueues | None:
    """The enqueues of the loop body being traced.

    Returns:
        The innermost body's `Enqueues`, or `None` outside any body.

    Example:

    >>> current_enqueues() is None   # outside every loop
    True
    """
    return _ENQUEUES.get()


def synthetic_data() -> bool:
    """Whether `--use_synthetic_data` is on: no data moves between host and device.

    Returns:
        True when the configured system has the option.

    Example:

    >>> synthetic_data()   # KERAS_IPU_FLAGS=--use_synthetic_data
    True
    """
    configured = system.current()
    return configured is not None and bool(configured.option("use_synthetic_data"))


_NAMED = "no change needed, feed names are generated."
_REPLICATED = "no change needed, the replication factor is set from the program."


class IPUInfeedQueue:
    """The elements a loop's iterations take, one each, from a data source.

    Args:
        dataset: An iterable of elements: arrays, or tuples or dicts of
            them (a tuple's parts reach the body positionally, a dict's by
            keyword).
        feed_name: Accepted for compatibility.
        device_ordinal: Accepted for compatibility.
        replication_factor: Accepted for compatibility: as in IPU TensorFlow
            it is set from the program (`compile` deals the elements to
            the replicas, iteration k of replica r getting element
            k × replicas + r).
        data_to_prefetch: Accepted for compatibility.
        prefetch_depth: Accepted for compatibility, checked as in IPU
            TensorFlow: `None` or an integer from 1 to 255.

    Raises:
        TypeError: When `dataset` is not iterable.
        ValueError: For a `prefetch_depth` outside 1 to 255.

    Example:

    >>> infeed = IPUInfeedQueue(zip(images, labels))
    >>> repeat(10, body, [0.0], infeed)
    """

    @deprecated_arguments(feed_name=_NAMED, replication_factor=_REPLICATED,
                          data_to_prefetch="use prefetch_depth instead.")
    def __init__(self, dataset: Any, feed_name: str | None = None, device_ordinal: int = 0,
                 replication_factor: int = 1, data_to_prefetch: int = 1,
                 prefetch_depth: int | None = None):
        _check_depth("prefetch_depth", prefetch_depth)
        self._dataset = dataset
        try:
            self._elements = iter(dataset)
        except TypeError:
            raise TypeError(f"IPUInfeedQueue needs an iterable of elements, got "
                            f"{type(dataset).__name__}.") from None
        self._ahead: collections.deque = collections.deque()  # peeked, not yet taken
        self._dequeued = False
        self._arguments: int | None = None  # of the first element seen
        self._recordings: list[list] = []  # open `recorded` lists
        _register_made(self)

    @property
    def dataset(self) -> Any:
        """The data source the queue takes its elements from, as it was given.

        Example:

        >>> IPUInfeedQueue([1, 2]).dataset
        [1, 2]
        """
        return self._dataset

    @property
    def initializer(self) -> None:
        """IPU TensorFlow's initialiser op: nothing to run here (`None`), the queue is ready.

        Example:

        >>> IPUInfeedQueue([1, 2]).initializer is None
        True
        """
        return None

    @property
    def deleter(self) -> None:
        """IPU TensorFlow's op freeing the queue: nothing to run here (`None`).

        The queue holds only a host iterator, which Python frees with it.

        Example:

        >>> IPUInfeedQueue([1, 2]).deleter is None
        True
        """
        return None

    @property
    def dequeued(self) -> bool:
        """Whether a loop has taken elements from the queue.

        Example:

        >>> IPUInfeedQueue([1, 2]).dequeued
        False
        """
        return self._dequeued

    @property
    def number_of_tuple_elements(self) -> int:
        """The values each iteration's body receives after the carried ones: a tuple's
        or list's parts, a dict's entries, or 1 (0 before any element was seen).

        Example:

        >>> IPUInfeedQueue([(np.ones(2), (np.zeros(1), np.zeros(1)))]).number_of_tuple_elements
        2
        """
        if self._arguments is None:
            first = self.peek(1)
            if not first:
                return 0
            element = first[0]
            self._arguments = len(element) if isinstance(element, (tuple, list, dict)) else 1
        return self._arguments

    def elements(self) -> Iterator[Any]:
        """The queue's elements in order, each taken as it is reached (those looked at first).

        Returns:
            An iterator over them; it ends where the queue does.

        Example:

        >>> next(IPUInfeedQueue([1, 2]).elements())
        1
        """
        while True:
            if not self.peek(1):
                return
            yield self.take(1)[0]

    def get_next(self) -> Any:
        """Obsolete, as in IPU TensorFlow: loops take the queue's elements themselves.

        Raises:
            ValueError: Always.

        Example:

        >>> IPUInfeedQueue([1, 2]).get_next()
        Traceback (most recent call last):
        ValueError: get_next() is obsolete: ...
        """
        raise ValueError("get_next() is obsolete: pass the IPUInfeedQueue to "
                         "ipu.loops.repeat(n, body, inputs, infeed_queue), which hands each "
                         "iteration its element.")

    def peek(self, count: int) -> list:
        """Up to `count` next elements, left in the queue.

        Args:
            count: How many to look at.

        Returns:
            The next elements, fewer where the queue has fewer.

        Example:

        >>> IPUInfeedQueue([1, 2]).peek(5)
        [1, 2]
        """
        self._ahead.extend(itertools.islice(self._elements, max(0, count - len(self._ahead))))
        return list(itertools.islice(self._ahead, count))

    def take(self, count: int) -> list:
        """The next `count` elements, taken from the queue.

        Args:
            count: How many to take.

        Returns:
            The elements, a list of `count`.

        Raises:
            ValueError: When fewer than `count` are left; none is taken.

        Example:

        >>> IPUInfeedQueue([1, 2, 3]).take(2)
        [1, 2]
        """
        ahead = self.peek(count)
        if len(ahead) < count:
            raise ValueError(f"The infeed ran out: {len(ahead)} elements left for a loop "
                             f"of {count} iterations.")
        for _ in ahead:
            self._ahead.popleft()
        self._dequeued = True
        for recording in self._recordings:
            recording.extend(ahead)
        return ahead

    @contextlib.contextmanager
    def recorded(self) -> Iterator[list]:
        """Records the elements taken while open, on any thread (a while loop's program
        takes them as it runs), to put back should the program's results be dropped.

        Example:

        >>> with infeed.recorded() as taken:
        ...     program()
        >>> infeed.put_back(taken)   # it trapped a floating point exception
        """
        taken: list = []
        self._recordings.append(taken)
        try:
            yield taken
        finally:  # by identity: another recording may hold equal elements
            self._recordings = [r for r in self._recordings if r is not taken]

    def put_back(self, elements: list) -> None:
        """Returns taken `elements` to the front of the queue (their program did not run).

        Args:
            elements: What `take` returned, in its order.

        Example:

        >>> infeed.put_back(infeed.take(2))   # the queue is as it was
        """
        self._ahead.extendleft(reversed(elements))


def _check_depth(name: str, depth: Any) -> None:
    """A queue's buffer depth: `None` or an integer from 1 to 255, as IPU TensorFlow takes it."""
    if depth is None:
        return
    if (isinstance(depth, bool) or not isinstance(depth, (int, np.integer))
            or not 0 < depth < 256):
        raise ValueError(f"{name} must be an integer from 1 to 255, got {depth!r}.")


class IPUOutfeedMode(enum.Enum):
    """What an outfeed's `dequeue` returns: every enqueued element, or the last.

    Example:

    >>> IPUOutfeedQueue(outfeed_mode=IPUOutfeedMode.LAST)
    """

    # IPU TensorFlow's values: `IPUOutfeedMode("get_last")` is `LAST`.
    ALL = "all"
    LAST = "get_last"


class IPUOutfeedQueue:
    """Values a loop's body enqueues, returned to the host by `dequeue`.

    Args:
        feed_name: Accepted for compatibility.
        outfeed_mode: `IPUOutfeedMode.ALL` (default: every enqueued value,
            stacked) or `LAST`.
        device_ordinal: Accepted for compatibility.
        replication_factor: Accepted for compatibility: as in IPU TensorFlow
            it is set from the program (a replicated one's values have a
            replica axis second).
        io_batch_size: Accepted for compatibility.
        buffer_depth: Accepted for compatibility (IPU TensorFlow's later
            releases), checked: an integer from 1 to 255.
        optimise_latency: Accepted for compatibility.

    Raises:
        ValueError: For an `outfeed_mode` that is not an `IPUOutfeedMode`
            (or one's value).

    Example:

    >>> outfeed = IPUOutfeedQueue()
    >>> def body(x):
    ...     x = x + 1
    ...     return x, outfeed.enqueue(x)
    >>> repeat(20, body, [np.zeros(4)])
    Array([20., 20., 20., 20.], dtype=float32)
    >>> outfeed.dequeue().shape
    (20, 4)
    """

    @deprecated_arguments(feed_name=_NAMED, replication_factor=_REPLICATED,
                          io_batch_size="accumulate the results yourself, or use "
                                        "accumulate_outfeed when pipelining.")
    def __init__(self, feed_name: str | None = None, outfeed_mode: IPUOutfeedMode | None = None,
                 device_ordinal: int = 0, replication_factor: int | None = None,
                 io_batch_size: int = 1, buffer_depth: int = 3, optimise_latency: bool = False):
        _check_depth("buffer_depth", buffer_depth)
        self.outfeed_mode = _outfeed_mode(outfeed_mode)
        self._received: list = []

    @property
    def deleter(self) -> None:
        """IPU TensorFlow's op freeing the queue: nothing to run here (`None`).

        Example:

        >>> IPUOutfeedQueue().deleter is None
        True
        """
        return None

    def enqueue(self, tensors: Any) -> _Enqueued:
        """Enqueues values: one element per iteration of a loop, or per run of a program.

        Inside the body of `ipu.loops.repeat` each iteration enqueues one
        element; directly in a compiled computation (`ipu_compiler.compile`,
        `strategy.run`), outside any loop, each run enqueues one, as the op
        IPU TensorFlow's computation returns does.

        Args:
            tensors: An array, or a tuple, list or dict of arrays.

        Returns:
            An `Operation` the loop or the computation drops from its outputs.

        Raises:
            RuntimeError: Outside a compiled computation and a loop's body, and
                in the body of a `while_loop` (its iteration count is known
                only on the device).
            ValueError: When the queue was already enqueued in this
                iteration of a loop.

        Example:

        >>> def body(x):
        ...     return x + 1, outfeed.enqueue({"x": x})
        """
        enqueued = current_enqueues()
        program = program_outfeeds.program_outfeeds()
        if enqueued is not None:
            enqueued.add(self, jax.tree_util.tree_map(jnp.asarray, tensors), block=False)
        elif program is not None:
            program.append((self, jax.tree_util.tree_map(lambda a: jnp.asarray(a)[None], tensors)))
        else:
            raise RuntimeError("IPUOutfeedQueue.enqueue must be called inside a compiled "
                               "computation (ipu_compiler.compile, strategy.run) or the body "
                               "of ipu.loops.repeat. A Keras layer cannot enqueue in fit, "
                               "evaluate or predict, nor while its model is built: return "
                               "the values as model outputs, or run the model in "
                               "strategy.run.")
        return _Enqueued()

    def receive(self, values: Any) -> None:
        """Takes a finished program's values for this queue (stacked per iteration).

        Args:
            values: The enqueued structure, each array `[iterations, ...]`
                (`[iterations, replicas, ...]` from a replicated program).

        Example:

        >>> outfeed.receive(np.arange(3))
        >>> outfeed.dequeue()
        array([0, 1, 2])
        """
        if synthetic_data():  # nothing returns to the host: empty arrays of the structure
            values = jax.tree_util.tree_map(
                lambda a: np.zeros((0, *np.shape(a)[1:]), np.asarray(a).dtype), values)
        if self.outfeed_mode == IPUOutfeedMode.LAST:
            # "Only the last enqueued element is stored" (a run of no iteration has none).
            if all(np.shape(a)[0] for a in jax.tree_util.tree_leaves(values)):
                self._received = [jax.tree_util.tree_map(lambda a: np.array(a[-1:]), values)]
            return
        self._received.append(values)

    def dequeue(self, wait_for_completion: bool = False) -> Any:
        """The values enqueued by the loops run since the last `dequeue`.

        Args:
            wait_for_completion: Accepted for compatibility: the values are
                there once their program has run.

        Returns:
            With `ALL`, every enqueued value stacked on a leading axis (in
            order, over loops); with `LAST`, the last one. Values of a
            replicated program (`compile` on a device of several IPUs) have
            the replicas' values stacked after that: `[iterations, replicas,
            ...]` with `ALL`, `[replicas, ...]` with `LAST`.

        With `--use_synthetic_data` nothing returns to the host: `ALL` gives
        empty arrays of the enqueued structure, `LAST` raises. Runs whose
        values do not stack with the first's (another replication, another
        structure) are left for the next `dequeue`, with a warning.

        Raises:
            ValueError: With `LAST` when nothing was enqueued (or returned).

        Example:

        >>> outfeed.dequeue()
        """
        # The values leave the queue once they are the host's: a Ctrl-C while they
        # are fetched from the device leaves them for the next dequeue.
        received = self._received
        if self.outfeed_mode == IPUOutfeedMode.LAST:
            self._received = []
            if synthetic_data():
                raise ValueError("The outfeed has no last element: --use_synthetic_data "
                                 "returns no data to the host.")
            if not received:
                raise ValueError("The outfeed has no last element: nothing was enqueued.")
            try:
                return jax.tree_util.tree_map(lambda a: np.asarray(a[-1]), received[-1])
            except BaseException:
                self._received = received
                raise
        if not received:
            return []
        stacking = _runs_that_stack(received)
        values = jax.tree_util.tree_map(lambda *parts: np.concatenate(parts),
                                        *received[:stacking])
        # Nothing is lost: the values of another shape wait for the next dequeue.
        self._received = received[stacking:]
        if stacking < len(received):
            warnings.warn(
                f"The outfeed holds values of {len(received) - stacking} more run(s) whose "
                f"shapes differ from those before them ({_shapes(received[0])} per "
                f"iteration, then {_shapes(received[stacking])}: a program of another "
                f"replication, or another enqueued structure). This dequeue returns the "
                f"first {stacking} run(s)' values; the next dequeue() returns the rest.",
                stacklevel=2)
        return values

    def __iter__(self) -> Iterator[Any]:
        """Takes the values enqueued since the last `dequeue` and yields them one by one,
        as IPU TensorFlow's outfeed iterator: each iteration's (with `LAST`, the last).

        Example:

        >>> for loss in outfeed_queue:
        ...     print(loss)
        """
        if not self._received:  # nothing enqueued (LAST's dequeue would raise)
            return
        values = self.dequeue()
        if self.outfeed_mode == IPUOutfeedMode.LAST:
            yield values
            return
        leaves = jax.tree_util.tree_leaves(values)
        for index in range(leaves[0].shape[0] if leaves else 0):
            yield jax.tree_util.tree_map(lambda a, index=index: a[index], values)


def _shapes(values: Any) -> Any:
    """A run's values as their structure, with each array's shape after the iterations."""
    return jax.tree_util.tree_map(lambda a: f"{np.dtype(a.dtype).name}{list(np.shape(a)[1:])}",
                                  values)


def _runs_that_stack(received: list) -> int:
    """How many runs' values, from the first, stack on the iteration axis with the first's."""
    first = _shapes(received[0])
    return next((k for k, values in enumerate(received) if _shapes(values) != first),
                len(received))


def _outfeed_mode(mode: Any) -> IPUOutfeedMode:
    if mode is None:
        return IPUOutfeedMode.ALL
    try:
        return IPUOutfeedMode(mode)
    except ValueError:
        raise ValueError(
            f"outfeed_mode must be IPUOutfeedMode.ALL or IPUOutfeedMode.LAST (or their values "
            f"'all', 'get_last'), got {mode!r}.") from None
