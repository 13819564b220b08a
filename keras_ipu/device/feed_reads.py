"""The infeed reads of a program being traced (`compile`, `strategy.run`): its loops' data.

A compiled program takes its loops' infeed elements on the host before it
runs and gets them as inputs. Its trace records what each loop reads, in
order (the program's plan: `(queue, iterations)` per read); an abstract
trace (`FeedProbe`) learns the plan, a real one (`FeedInputs`) hands each
loop its planned data; `take_all` takes a plan's elements from the queues
and `put_back` returns them should the program not run.

A trace whose reads must not count (an outlined function traced once to
see whether it is pure, then again inlined) runs in `reads_undoable`.

Example:

```python
taken = take_all(plan, replicas)
with reading(FeedInputs(plan, data)):
    traced = fn()        # each loop's `current().take(queue, n)` gets its data
```
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from keras_ipu.device import queues

# Trace-time context, not global state: the infeed reads of the program being traced.
_READS: contextvars.ContextVar = contextvars.ContextVar("feed_reads", default=None)
# Trace-time context: what loops traced in a `reads_undoable` block took from their queues.
_TAKEN: contextvars.ContextVar = contextvars.ContextVar("taken_in_trace", default=None)


class MissingFeed(Exception):
    """A loop being traced reads an infeed the program does not take yet."""

    def __init__(self, plan: list):
        super().__init__("a loop reads an infeed the program does not take yet")
        self.plan = plan


class UnreadFeed(Exception):
    """A trace read fewer of the planned infeeds than were taken for it (a loop of
    another call's shapes that it skips)."""

    def __init__(self, read: int):
        super().__init__("a program's trace left planned infeed reads unread")
        self.read = read


class MadeInTrace(Exception):
    """A loop being traced reads an infeed its function made: the program is of one trace."""


class EmptyFeed(Exception):
    """A loop being traced abstractly reads an infeed with no element left to shape its data."""


_STAGED_AND_STREAMED = (
    "An infeed is read by an ipu.loops.while_loop and by an ipu.loops.repeat of one "
    "program: the repeat's elements are taken before the program runs and the while_loop's "
    "as it runs, so they would be read out of program order. Read it in loops of one kind, "
    "or give each loop an infeed of its own.")


class FeedReads:
    """The infeed reads of a program being traced: staged (`take`) or streamed (`stream`)."""

    # Whether the trace is abstract (the replicas not known yet: the probe).
    abstract = False

    def __init__(self, plan: list):
        self.plan = plan
        self.streamed: list = []  # the queues while loops read as they run

    def stream(self, queue: queues.IPUInfeedQueue) -> None:
        """Records a while loop reading `queue` element by element as the program runs.

        Raises:
            ValueError: When a loop of the program stages elements of `queue`.
        """
        if any(queue is planned for planned, _ in self.plan):
            raise ValueError(_STAGED_AND_STREAMED)
        self.streamed.append(queue)

    def mark(self) -> tuple:
        """Where the reads stand, for `rewind`."""
        return len(self.plan), len(self.streamed)

    def rewind(self, mark: tuple) -> None:
        """Forgets the reads made since `mark`."""
        del self.plan[mark[0]:]
        del self.streamed[mark[1]:]

    def _check_staged(self, queue: queues.IPUInfeedQueue) -> None:
        if any(queue is streamed for streamed in self.streamed):
            raise ValueError(_STAGED_AND_STREAMED)


class FeedInputs(FeedReads):
    """The infeed data of a program being traced: its inputs, in the order its loops read them."""

    def __init__(self, plan: list, data: list):
        super().__init__(plan)
        self.data, self.read = data, 0

    def take(self, queue: queues.IPUInfeedQueue, count: int) -> Any:
        self._check_staged(queue)
        if queues.made_in_this_trace(queue):
            raise MadeInTrace()
        index = self.read
        if index < len(self.plan) and self.plan[index] == (queue, count):
            self.read += 1
            return self.data[index]
        raise MissingFeed([*self.plan[:index], (queue, count)])

    def mark(self) -> tuple:
        return self.read, len(self.streamed)

    def rewind(self, mark: tuple) -> None:
        self.read = mark[0]
        del self.streamed[mark[1]:]

    def check_all_read(self) -> None:
        """Raises `UnreadFeed` when the trace read fewer of the planned reads than were taken."""
        if self.read < len(self.plan):
            raise UnreadFeed(self.read)


class FeedProbe(FeedReads):
    """Infeed data for an abstract trace: zeros shaped as the queues' next elements.

    Records the reads (the program's plan); nothing is taken from the queues.
    """

    abstract = True

    def __init__(self):
        super().__init__([])
        self.made_infeed = False  # a loop reads an infeed the function makes

    def take(self, queue: queues.IPUInfeedQueue, count: int) -> Any:
        self._check_staged(queue)
        if queues.made_in_this_trace(queue):  # new in each trace: not part of the plan
            self.made_infeed = True
        else:
            self.plan.append((queue, count))
        ahead = queue.peek(1)
        if not ahead:
            raise EmptyFeed()

        def zeros(leaf: Any) -> jax.Array:
            dtype = jax.dtypes.canonicalize_dtype(np.asarray(leaf).dtype)
            return jnp.zeros((count, *np.shape(leaf)), dtype)

        return jax.tree_util.tree_map(zeros, ahead[0])


def current() -> FeedReads | None:
    """The reads of the program being traced here.

    Returns:
        Its `FeedReads`, or `None` (eagerly, or in a program traced for one
        call, whose loops take their elements themselves).

    Example:

    >>> reads = current()
    >>> data = reads.take(infeed, 10) if reads is not None else None
    """
    return _READS.get()


@contextlib.contextmanager
def reading(reads: FeedReads | None) -> Iterator[None]:
    """Makes `reads` the program's reads while its function is traced in the block.

    Args:
        reads: The program's reads, or `None` (its loops take their own).

    Example:

    >>> with reading(FeedInputs(plan, data)):
    ...     traced = fn()
    """
    token = _READS.set(reads)
    try:
        yield
    finally:
        _READS.reset(token)


def taken_in_trace(queue: queues.IPUInfeedQueue, taken: list) -> None:
    """Records elements a loop traced in a `reads_undoable` block took from `queue` itself.

    Args:
        queue: The loop's infeed.
        taken: The elements it took (constants of the trace), in order.

    Example:

    >>> taken_in_trace(infeed, infeed.take(4))   # after the loop traced
    """
    record = _TAKEN.get()
    if record is not None:
        record.append((queue, taken))


@contextlib.contextmanager
def reads_undoable() -> Iterator[Callable[[], bool]]:
    """A trace whose infeed reads can be undone: yields `undo`, which undoes them.

    `undo()` forgets the program's reads made in the block and puts back
    the elements loops took themselves, and returns whether there were any.

    Example:

    >>> with reads_undoable() as undo:
    ...     jax.make_jaxpr(fn)(x)       # to see whether `fn` is pure
    >>> undo()                          # it was not: it is traced again, inlined
    """
    reads, taken = current(), []
    mark = reads.mark() if reads is not None else None
    token = _TAKEN.set(taken)

    def undo() -> bool:
        read = reads is not None and reads.mark() != mark
        if reads is not None:
            reads.rewind(mark)
        for queue, elements in reversed(taken):
            queue.put_back(elements)
        read, taken[:] = read or bool(taken), []
        return read

    try:
        yield undo
    finally:
        _TAKEN.reset(token)
        outer = _TAKEN.get()
        if outer is not None:  # kept here: an enclosing block may still undo them
            outer.extend(taken)


def take_all(plan: list, replicas: int = 1) -> list:
    """Each planned read's elements (R per iteration), taken once every read has them all.

    Args:
        plan: The program's `(queue, iterations)` reads, in order.
        replicas: The replicas, each taking its own element per iteration.

    Returns:
        Per read, its elements in order.

    Raises:
        ValueError: When a queue has too few for its reads (nothing is taken).

    Example:

    >>> taken = take_all([(infeed, 4)], replicas=2)   # 8 elements
    """
    needed: dict = {}
    for queue, count in plan:
        elements = count * replicas
        already = needed.get(queue, 0)
        available = len(queue.peek(already + elements))
        if available - already < elements:
            raise ValueError(ran_out(available - already, count, replicas, already))
        needed[queue] = already + elements
    return [queue.take(count * replicas) for queue, count in plan]


def ran_out(left: int, iterations: int, replicas: int = 1, before: int = 0) -> str:
    """The message of an infeed with too few elements for a loop.

    Args:
        left: The elements the infeed has left for the loop.
        iterations: The loop's iterations.
        replicas: The replicas running the loop, each taking its own elements.
        before: The elements the program's earlier loops read from it.

    Returns:
        The message, with the counts.

    Example:

    >>> print(ran_out(6, 4, 2))  # doctest: +NORMALIZE_WHITESPACE
    The infeed ran out: 6 elements left for a loop of 4 iterations on 2 replicas, which
    takes 8 (iteration k of replica r takes element k * 2 + r).
    """
    takes = iterations * replicas
    message = f"The infeed ran out: {left} elements left for a loop of {iterations} iterations"
    if replicas > 1:
        message += (f" on {replicas} replicas, which takes {takes} (iteration k of replica r "
                    f"takes element k * {replicas} + r)")
    if before:
        message += (f". The program's earlier loops read {before} of its {before + left} "
                    f"elements first: it needs {before + takes}, and none is taken")
    return message + "."


def put_back(plan: list, taken: list) -> None:
    """Returns `take_all`'s elements to their queues (the program did not run).

    Args:
        plan: The plan they were taken for.
        taken: What `take_all` returned.

    Example:

    >>> put_back(plan, take_all(plan))   # the queues are as they were
    """
    for (queue, _), taken_elements in reversed(list(zip(plan, taken))):
        queue.put_back(taken_elements)
