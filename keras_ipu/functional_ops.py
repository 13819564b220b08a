"""`ipu.functional_ops.outlined_function` (also `ipu.outlined_function`): one copy of reused code.

On the IPU an outlined function is compiled once and called wherever it is
used, which saves code memory at the price of copying its arguments. On the
device model it is compiled as one function of the program (`jax.jit` with
`inline=False`): the lowered program holds one copy of its code and calls it
at each use, and the cost model counts every call.

Each call traces the function where it is called, so what it reads through
Python closures (a Keras variable, a layer's weight inside a training step)
is its current value, and gradients reach it: those values become the
outlined function's extra arguments. Calls whose traces are the same share
one compiled function. A function with stateful operations (drawing from a
Keras seed generator, updating batch-normalisation statistics, adding a
loss) cannot be reused, and is inlined, as on the IPU.

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

import collections
import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jax_core

from keras_ipu.device import feed_reads, loop_state, program_outfeeds, queues

# The compiled functions an outlined function keeps, one per distinct trace.
_KEPT_TRACES = 32


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
        ValueError: When the outlined function, called, returns no array.

    Example:

    >>> f = outlined_function(lambda a, b: a @ b, name="matmul")
    """

    def outline(function: Callable) -> Callable:
        if not callable(function):
            raise TypeError(f"outlined_function needs a function, got {function!r}.")
        label = name or getattr(function, "__name__", "outlined")
        compiled: collections.OrderedDict = collections.OrderedDict()

        @functools.wraps(function)
        def outlined(*args):
            # Objects that stand for arrays (Keras variables) are passed as their values.
            args = jax.tree_util.tree_map(_as_array, args)
            traced = _pure_trace(function, args)
            if traced is None:  # stateful: not reusable, so inlined
                return function(*args)
            closed, out_tree = traced
            if not closed.out_avals:  # IPU TensorFlow's outlined functions return tensors
                raise ValueError(f"The outlined function {label!r} must return at least one "
                                 f"array, got {out_tree.unflatten([])!r}.")
            flat_args, in_tree = jax.tree_util.tree_flatten(args)
            # The printed jaxpr does not show the Python functions its equations
            # call (a custom_vjp's backward, a host callback): they key it too.
            key = (in_tree, out_tree, str(closed.jaxpr), tuple(_called(closed.jaxpr)))
            if key not in compiled:
                compiled[key] = _compiled_call(closed.jaxpr, label)
                if len(compiled) > _KEPT_TRACES:
                    compiled.popitem(last=False)
            compiled.move_to_end(key)
            outputs = compiled[key](closed.consts, *flat_args)
            return jax.tree_util.tree_unflatten(out_tree, outputs)

        return outlined

    return outline if func is None else outline(func)


def _pure_trace(function: Callable, args: tuple) -> tuple[Any, Any] | None:
    """`(closed jaxpr, output tree)` of `function(*args)` traced here, or None if it is stateful.

    Stateful means that it updated a Keras variable or added a loss: in a
    Keras stateless scope (a training step) the scope's records are put
    back as they were, outside one a scope of its own keeps the variables.
    """
    from keras.src.backend.common import stateless_scope

    # A new function each time: JAX keeps traces by function, and this one must read
    # the closure's values as they are now. It bears the user's name in JAX's errors.
    @functools.wraps(function)
    def fresh(*a):
        return function(*a)

    outer = stateless_scope.get_stateless_scope()
    with _enqueues_set_aside() as enqueued, feed_reads.reads_undoable() as undo_reads:
        if outer is None:
            with stateless_scope.StatelessScope(initialize_variables=False) as own:
                closed, shapes = jax.make_jaxpr(fresh, return_shape=True)(*args)
            stateful = bool(own.state_mapping) or bool(own.losses)
        else:
            closed, shapes, stateful = _traced_in_scope(fresh, args, outer)
        stateful = stateful or enqueued()
        if stateful:  # traced again, inlined: its loops read their infeeds there
            undo_reads()
    return None if stateful else (closed, jax.tree_util.tree_structure(shapes))


def _traced_in_scope(fresh: Callable, args: tuple, outer: Any) -> tuple[Any, Any, bool]:
    """`fresh` traced in the step's stateless scope, which is put back as it was."""
    records, losses = dict(outer.state_mapping), len(outer.losses)
    try:
        with loop_state.looking():  # what it assigns is put back: any trace may
            closed, shapes = jax.make_jaxpr(fresh, return_shape=True)(*args)
    finally:
        changed = outer.state_mapping.keys() != records.keys() or any(
            outer.state_mapping[k] is not v for k, v in records.items())
        stateful = changed or len(outer.losses) != losses
        outer.state_mapping.clear()
        outer.state_mapping.update(records)
        del outer.losses[losses:]
    return closed, shapes, stateful


@contextlib.contextmanager
def _enqueues_set_aside() -> Iterator[Callable[[], bool]]:
    """Keeps what a trace enqueues to outfeeds from the loop or program being traced;
    yields whether it enqueued.

    An enqueue records the traced value with the loop or program being
    traced: one from the outlined trace would be a value of another trace.
    """
    body = queues.current_enqueues()
    with contextlib.ExitStack() as stack:
        probe = (stack.enter_context(queues.collect_enqueues(body.refusal, probe=True))
                 if body else None)
        program = stack.enter_context(program_outfeeds.set_aside())
        yield lambda: bool(probe and probe.records) or bool(program)


def _called(jaxpr: Any) -> Iterator[int]:
    """Identities of the Python callables the equations of `jaxpr` (and inner jaxprs) hold.

    The compiled call that is kept holds the jaxpr, so these stay alive and an
    identity is not reused while its entry is kept.
    """
    for equation in jaxpr.eqns:
        for value in equation.params.values():
            for item in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(item, "jaxpr", item)  # a ClosedJaxpr's jaxpr
                if isinstance(inner, jax_core.Jaxpr):
                    yield from _called(inner)
                elif callable(item) and not isinstance(item, type):
                    yield id(item)


def _compiled_call(jaxpr: Any, label: str) -> Callable:
    """One compiled function of the program evaluating `jaxpr`, its captured values arguments."""

    def call(consts, *flat_args):
        return jax.core.eval_jaxpr(jaxpr, consts, *flat_args)

    call.__name__ = call.__qualname__ = label
    return jax.jit(call, inline=False)


def _as_array(value: Any) -> Any:
    return jnp.asarray(value) if hasattr(value, "__jax_array__") else value


__all__ = ["outlined_function"]
