"""State a traced computation keeps beside its loops' carried values, carried through them.

A loop body traced by `lax.scan` or `lax.while_loop` may update state that
the computation keeps outside the loop's own carried values: Keras variables
a layer assigns in a stateless scope (BatchNormalization's moving
statistics, a seed generator's state). Assigned inside the body's trace,
such values would leak the body's tracers out of the loop. A `LoopState`
installed around the computation's trace (`carrying(state)`) names its
entries, and the loops (`keras_ipu.device.feeds`) carry them as extra loop
values: each iteration starts from the previous one's values, and after the
loop the state holds the last iteration's. An entry the body assigns for
the first time is found by tracing the loop once more, carrying it too.

This module knows nothing of Keras: the state is any object with the
`LoopState` methods.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any, Protocol

from keras_ipu.device import program_outfeeds


class LoopState(Protocol):
    """What a loop needs of the state it carries: its entries, by hashable key."""

    def keys(self) -> tuple[Hashable, ...]:
        """The entries the state holds values for, in order."""

    def snapshot(self) -> Any:
        """An opaque copy of the state, for `restore`."""

    def restore(self, snapshot: Any) -> None:
        """Puts back the state `snapshot` copied (a trace abandoned)."""

    def read(self, keys: Sequence[Hashable]) -> list[Any]:
        """The current values of the entries `keys` (an entry not held: its own value)."""

    def write(self, keys: Sequence[Hashable], values: Sequence[Any]) -> None:
        """Sets the values of the entries `keys`."""


# Trace-time context, not global state: the state the loops of the computation being
# traced carry.
_STATE: contextvars.ContextVar = contextvars.ContextVar("loop_state", default=None)


@contextlib.contextmanager
def carrying(state: LoopState) -> Iterator[LoopState]:
    """Makes the loops traced inside the block carry `state`'s entries.

    Args:
        state: The state (a Keras stateless scope's record, say).

    Yields:
        `state`.

    Example:

    >>> with carrying(recording_scope):
    ...     result = computation(*args)   # its loops carry the assigned variables
    """
    token = _STATE.set(state)
    try:
        yield state
    finally:
        _STATE.reset(token)


# Trace-time context: the trace of the loop body being traced (what it assigns is carried),
# or `_LOOKING` while a trace looks at what a function assigns and puts the state back.
_BODY_TRACE: contextvars.ContextVar = contextvars.ContextVar("loop_body_trace", default=None)
_LOOKING = object()


@contextlib.contextmanager
def _marked(trace: object) -> Iterator[None]:
    token = _BODY_TRACE.set(trace)
    try:
        yield
    finally:
        _BODY_TRACE.reset(token)


def body_trace() -> contextlib.AbstractContextManager:
    """Marks the block as a loop body's trace: the state it assigns is carried by the loop.

    Returns:
        The context manager.

    Example:

    >>> with body_trace():
    ...     new = body(*carry)
    """
    return _marked(program_outfeeds.trace_state())


def looking() -> contextlib.AbstractContextManager:
    """Marks the block as a trace that only looks at what a function assigns (and puts
    the state back after it): any trace may assign in it.

    Returns:
        The context manager.

    Example:

    >>> with looking():
    ...     jaxpr = jax.make_jaxpr(fn)(x)
    """
    return _marked(_LOOKING)


def carried_here(computation_trace: object, value: Any) -> bool:
    """Whether `value`, assigned to state now, can leave the trace: it is not made by a JAX
    transformation inside the computation (`jax.grad`, `jax.vmap`, an inner `jax.jit`) or
    a loop body, whose values exist only there.

    Inside one, a value JAX computed in the enclosing trace (no tangent or batch axis: a
    seed generator's next state, a count) is the enclosing trace's, and can.

    Args:
        computation_trace: The computation's trace (`program_outfeeds.trace_state()`
            when it began).
        value: The value assigned.

    Returns:
        Whether the assignment can stand.

    Example:

    >>> carried_here(program_outfeeds.trace_state(), x + 1)   # in the computation itself
    True
    """
    body = _BODY_TRACE.get()
    now = program_outfeeds.trace_state()
    if body is _LOOKING or now == (computation_trace if body is None else body):
        return True
    return program_outfeeds.trace_of(value) != now


class _NewEntries(Exception):
    """A loop body assigned entries its loop does not carry yet."""

    def __init__(self, keys: tuple):
        super().__init__("a loop body assigned state its loop does not carry yet")
        self.keys = keys


def run_loop(loop: Callable[[tuple, list], tuple[Any, list]]) -> Any:
    """Traces `loop` carrying the state's entries, again with more when its body assigns more.

    Args:
        loop: `loop(keys, initial)` traces the loop with the entries `keys`
            carried from the values `initial` (its body calling
            `enter_body` and `leave_body`), and returns `(result, final
            values of the entries)`.

    Returns:
        The loop's result; the state then holds the entries' final values.

    Example:

    >>> def loop(keys, initial):
    ...     final, extra = jax.lax.scan(step, (carried, initial), data)
    ...     return final, extra
    >>> run_loop(loop)
    """
    state = _STATE.get()
    if state is None:
        return loop((), [])[0]
    keys = state.keys()
    while True:
        snapshot = state.snapshot()
        try:
            result, final = loop(keys, state.read(keys))
        except _NewEntries as new:
            state.restore(snapshot)  # the abandoned trace's values are its tracers
            keys = new.keys
            continue
        state.write(keys, final)
        return result


def enter_body(keys: tuple, values: Sequence[Any]) -> None:
    """Starts an iteration's trace: the carried entries take the iteration's values.

    Args:
        keys: The entries the loop carries.
        values: Their values at the start of the iteration (loop values).

    Example:

    >>> enter_body(keys, extra)
    """
    state = _STATE.get()
    if state is not None and keys:
        state.write(keys, values)


def leave_body(keys: tuple) -> list[Any]:
    """Ends an iteration's trace: the carried entries' new values.

    Args:
        keys: The entries the loop carries.

    Returns:
        Their values at the end of the iteration.

    When the body assigned entries the loop does not carry, it stops the
    trace; `run_loop` then traces the loop again, carrying them.

    Example:

    >>> extra = leave_body(keys)
    """
    state = _STATE.get()
    if state is None:
        return []
    now = state.keys()
    if set(now) - set(keys):
        raise _NewEntries((*keys, *(key for key in now if key not in keys)))
    return state.read(keys)
