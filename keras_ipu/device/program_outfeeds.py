"""The outfeed values of the `call_compiled` program being traced (`compile`, `strategy.run`).

A loop's stacked values and an `enqueue` made outside any loop land here, and
leave the program with its outputs (`compiled_calls.py`).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

# Trace-time context: the outfeed values of the compiled program being traced (`compile`,
# `strategy.run`), `(queue, values stacked per element)` in the order they were enqueued.
_PROGRAM_OUTFED: contextvars.ContextVar = contextvars.ContextVar("program_outfed", default=None)


@contextlib.contextmanager
def collect_program_outfeeds() -> Iterator[list]:
    """Collects the outfeed values of a compiled program being traced, in order.

    A loop's stacked values and an `enqueue` made outside any loop (one
    element per run, as IPU TensorFlow's enqueue op returned by the
    computation; each such `enqueue` adds one) both land here; they leave the
    program with its outputs.

    Yields:
        The list of `(queue, values)` pairs, filled as the block traces.

    Example:

    >>> with collect_program_outfeeds() as outfed:
    ...     result = fn(x)
    >>> [queue for queue, _ in outfed]
    """
    outfed = _ProgramOutfeeds()
    token = _PROGRAM_OUTFED.set(outfed)
    try:
        yield outfed
    finally:
        _PROGRAM_OUTFED.reset(token)


@contextlib.contextmanager
def set_aside() -> Iterator[list | None]:
    """While the block traces something other than the program, its enqueues go to a list
    of their own, not to the program's.

    Yields:
        That list, or `None` outside a compiled program's trace (where
        `enqueue` raises, as without it).

    Example:

    >>> with set_aside() as probed:
    ...     jax.make_jaxpr(fn)(x)
    >>> bool(probed)   # whether `fn` enqueues
    """
    probed = [] if _PROGRAM_OUTFED.get() is not None else None
    token = _PROGRAM_OUTFED.set(probed)
    try:
        yield probed
    finally:
        _PROGRAM_OUTFED.reset(token)


class _ProgramOutfeeds(list):
    """A traced program's outfeed values: only those of its own trace, as a value made
    inside a transformation of the computation (`jax.grad`, an inner `jax.jit`) exists
    only there."""

    def __init__(self):
        super().__init__()
        self.trace = trace_state()

    def append(self, entry: tuple) -> None:
        check_in_trace(self.trace)
        super().append(entry)


def trace_state() -> object:
    """JAX's identity of the trace now running (compared by `check_in_trace`)."""
    from jax._src import core

    return core.get_opaque_trace_state(convention="nnx")


def trace_of(value: object) -> object | None:
    """JAX's identity of the trace that made `value` (as `trace_state`), or `None` for a
    value of no trace (a concrete array)."""
    from jax._src import core

    if not isinstance(value, core.Tracer):
        return None
    return core.OpaqueTraceState(value._trace._weakref)


def check_in_trace(trace: object) -> None:
    """Refuses an outfeed value made in another trace than `trace` (the program's or loop
    body's): one of a JAX transformation inside it exists only there.

    Raises:
        RuntimeError: Saying where to enqueue instead.

    Example:

    >>> check_in_trace(trace_state())   # the trace now running: fine
    """
    if trace_state() != trace:
        raise RuntimeError(
            "An IPUOutfeedQueue was filled inside a JAX transformation within the "
            "computation (jax.grad, jax.vmap, an inner jax.jit): its values exist only "
            "inside that transformation and cannot reach the queue. Enqueue outside it "
            "(return the values from the differentiated function with has_aux=True, "
            "say).")


def program_outfeeds() -> list | None:
    """The outfeed values of the compiled program being traced.

    Returns:
        A list of `(queue, values)` pairs (each array stacked on a leading
        axis), or `None` outside a compiled program's trace.

    Example:

    >>> program_outfeeds() is None   # outside `compile` and `strategy.run`
    True
    """
    return _PROGRAM_OUTFED.get()


__all__ = ["collect_program_outfeeds", "program_outfeeds"]
