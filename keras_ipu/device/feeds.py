"""IPU TensorFlow's loop-level programming interface on JAX: scopes, loops, infeeds, outfeeds.

Code written against `ipu.scopes`, `ipu.ipu_compiler`, `ipu.loops`,
`ipu.ipu_infeed_queue` and `ipu.ipu_outfeed_queue` keeps its shape here,
with JAX functions for TensorFlow's graph code:

- `ipu_scope(device)` and `ipu_shard(index)` (in `keras_ipu.device.scopes`)
  say which IPU device `compile` compiles for.
- `compile(computation, inputs)` compiles `computation` with `jax.jit` for
  that device and runs it at once (IPU TensorFlow builds an op that a
  session runs later; `ipu.ipu_compiler.compile` also applies the Keras
  variable assignments made inside, `keras_ipu.keras.assignments`);
  outfeeds enqueued inside come back with it. The
  program is kept: calling it again with arrays of the same shapes does not
  retrace. It is replicated as on the IPU: a device of N IPUs running a
  computation of S shards (one unless it enters `ipu_shard`) runs N / S
  replicas; each loop's infeed is dealt round-robin to the replicas
  (iteration k of replica r gets element k × R + r), outfeeds gain a replica
  axis second (`[iterations, R, ...]`, or `[R, ...]` with
  `IPUOutfeedMode.LAST`; none for one replica), and the result is replica
  0's (see `keras_ipu.device.compiled_calls`).
- `repeat(n, body, inputs, infeed_queue)` is an on-device loop (`lax.scan`):
  each iteration takes the next element of the infeed, if any, after the
  loop-carried values; values `enqueue`d on an outfeed in the body are
  stacked per iteration and handed to the queue when the loop has run.
- `while_loop(condition, body, inputs, infeed_queue)` is `lax.while_loop`;
  each iteration takes its infeed element from the host as it runs (its
  count is known only on the device).

Inside `compile` (and `strategy.run`) the infeeds' elements are the
program's inputs, taken on the host each time it runs; a loop run eagerly
takes them when it is built, as constants. The queues themselves are in
`keras_ipu.device.queues`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from keras_ipu.device import (
    collectives,
    compiled_calls,
    elements,
    feed_reads,
    integers,
    loop_state,
    program_outfeeds,
    queues,
    scopes,
    system,
)

_INT32_MAX = int(np.iinfo(np.int32).max)  # a while loop's iteration counter is an int32


def compile(computation: Callable, inputs: Any = None) -> list:  # noqa: A001 - the seed's name
    """Compiles `computation(*inputs)` for the current IPU device and runs it, replicated.

    The compiled program is kept: another call of the same `computation`
    with inputs of the same shapes runs it again without tracing, its
    loops taking the infeeds' next elements.

    As on the IPU, the computation runs once per replica: the device's IPUs
    divided by the shards it uses (one unless it enters `ipu_shard`, or
    `compile` is called inside one). Every replica gets `inputs`; a loop
    over an infeed takes iterations × replicas elements, iteration k of
    replica r element k × replicas + r; outfeeds gain a replica axis second
    (none with one replica). The result is replica 0's: replicas hold equal
    values after cross-replica reductions, and the outfeeds show every
    replica's.

    Args:
        computation: A JAX-traceable function of `len(inputs)` arguments.
        inputs: A list of arguments (arrays or structures of them), or `None`.

    Returns:
        The outputs as a list: `[]` for `None`, `[value]` for a single
        value, the values of a tuple or list (replica 0's). Outfeeds
        enqueued inside get their values.

    Raises:
        RuntimeError: Outside an `ipu_scope`: the computation is compiled for
            the scope's IPU device.
        ValueError: When an infeed has fewer elements than the loops need
            (none is taken), or the device's IPUs are not a multiple of the
            computation's shards.

    Example:

    >>> with ipu_scope("/device:IPU:0"):
    ...     [total] = compile(lambda x: x.sum(), inputs=[np.ones(4)])
    """
    scope = scopes.current_scope()
    if scope is None:
        raise RuntimeError("ipu_compiler.compile must be called inside "
                           "ipu.scopes.ipu_scope('/device:IPU:N'): the computation is "
                           "compiled for that IPU device.")
    device, shard = scope
    ipus = system.require().ipus_of_device(device)
    return compiled_calls.call_compiled(computation, ipus, _as_list(inputs), outputs=output_list,
                                        shard=shard, name="ipu_compiler.compile")


def _deliver(queue: queues.IPUOutfeedQueue, values: Any) -> None:
    """Sends a finished loop's stacked values on: the enclosing body, program, or the queue."""
    enclosing = queues.current_enqueues()
    outfed = program_outfeeds.program_outfeeds()
    if enclosing is not None:  # a loop nested in a body: a block of that iteration's values
        enclosing.add(queue, values, block=True)
    elif outfed is not None:  # inside `call_compiled`: the values leave with its outputs
        outfed.append((queue, values))
    elif any(isinstance(v, jax.core.Tracer) for v in jax.tree_util.tree_leaves(values)):
        # A JAX transformation of the caller's own (`jax.jit`, say) traces the loop: its
        # values exist only inside that program, which has no way to hand them out.
        raise RuntimeError(
            "A loop filled an IPUOutfeedQueue inside a JAX transformation of your own "
            "(jax.jit, say): its values exist only inside that program and cannot reach the "
            "queue. Run the loop inside ipu.ipu_compiler.compile or strategy.run instead: "
            "they compile the function and hand its outfeed values out.")
    else:
        queue.receive(values)


def repeat(n: int, body: Callable, inputs: Any = None,
           infeed_queue: queues.IPUInfeedQueue | None = None, use_while_v1: bool = True) -> Any:
    """Runs `body` `n` times on the device, carrying `inputs` from one iteration to the next.

    Args:
        n: The number of iterations, an integer of at least 0 (0, as IPU
            TensorFlow's loop of no iteration: the inputs, nothing taken or
            outfed).
        body: `body(*carried, *element)` (a dict element by keyword) returning
            the new carried values, in the order of `inputs`; outfeed
            `enqueue` markers among them are dropped.
        inputs: The initial carried values (a list), or `None`.
        infeed_queue: Where each iteration's element comes from, or `None`.
            In a replicated program (`compile` on a device of R replicas)
            the loop takes n × R elements: iteration k of replica r gets
            element k × R + r.
        use_while_v1: Accepted for compatibility.

    Returns:
        The final carried values: one value, a tuple of several, or `None`.

    Raises:
        TypeError: For an `infeed_queue` that is no `IPUInfeedQueue`.
        ValueError: For `n` below 0 or not an integer, an infeed that runs
            out (nothing is taken from it), an infeed read by a loop inside
            another loop's body, a body that returns another number of
            values than `inputs` has, or one that enqueues twice on an
            outfeed.

    Example:

    >>> repeat(10, lambda x: x + 1, [np.float32(0)])
    Array(10., dtype=float32)
    """
    n = _iterations(n)
    _check_queue(infeed_queue)
    if infeed_queue is not None and queues.current_enqueues() is not None:
        # Traced once, it would read the same elements at every outer iteration.
        raise ValueError("A loop inside another loop's body cannot read an infeed: it is "
                         "traced once, so every outer iteration would get the same "
                         "elements. Read the infeed in the outer loop and pass the values "
                         "in.")
    carried = tuple(jax.tree_util.tree_map(jnp.asarray, _as_list(inputs)))
    if n == 0:
        return _unpacked(carried)
    feeds, taken, data = feed_reads.current(), None, None
    if infeed_queue is not None and feeds is not None:  # inside `call_compiled`: its inputs
        data = feeds.take(infeed_queue, n)
    elif infeed_queue is not None:  # eager, or in another trace: the elements as constants
        replicas = collectives.replica_count()  # in a replicated program: dealt to each
        if replicas > 1 and len(infeed_queue.peek(n * replicas)) < n * replicas:
            raise ValueError(feed_reads.ran_out(len(infeed_queue.peek(n * replicas)), n,
                                                    replicas))
        taken = infeed_queue.take(n * replicas)
        try:
            data = _own_elements(elements.stacked(taken), replicas)
        except BaseException:  # elements of another shape: they stay in the queue
            infeed_queue.put_back(taken)
            raise
    layout: list = []  # (outfeed, whether its values are a nested loop's block), per record

    def scan(keys: tuple, initial: list) -> tuple[Any, list]:
        def step(carry, element):
            carry, extra = carry
            loop_state.enter_body(keys, extra)
            with queues.collect_enqueues() as enqueued, loop_state.body_trace():
                new = _called(body, carry, element)
            layout[:] = [(queue, block) for queue, _, block in enqueued.records]
            return ((_carried(new, len(carry)), loop_state.leave_body(keys)),
                    [values for _, values, _ in enqueued.records])

        (final, extra), outfed = jax.lax.scan(step, (carried, initial), data, length=n)
        return (final, outfed), extra

    try:
        final, outfed = loop_state.run_loop(scan)
    except BaseException:
        if taken is not None:  # the loop did not run: its elements stay in the queue
            infeed_queue.put_back(taken)
        raise
    if taken is not None:  # traced: an enclosing trace may yet undo it (`reads_undoable`)
        feed_reads.taken_in_trace(infeed_queue, taken)
    for (queue, block), values in zip(layout, outfed):
        if block:  # [n, inner iterations, ...] -> one value per inner iteration, in order
            values = jax.tree_util.tree_map(lambda a: a.reshape((-1, *a.shape[2:])), values)
        _deliver(queue, values)
    return _unpacked(final)


def _called(body: Callable, carry: tuple, element: Any) -> Any:
    """`body` on the carried values, then the infeed element: a dict by keyword."""
    if element is None:
        return body(*carry)
    if isinstance(element, dict):
        return body(*carry, **element)
    return body(*carry, *(element if isinstance(element, (tuple, list)) else (element,)))


def _check_queue(infeed_queue: Any) -> None:
    """Refuses an `infeed_queue` that is no `IPUInfeedQueue` (the data itself, say)."""
    if infeed_queue is not None and not isinstance(infeed_queue, queues.IPUInfeedQueue):
        raise TypeError(
            f"infeed_queue must be an ipu.ipu_infeed_queue.IPUInfeedQueue or None, got "
            f"{type(infeed_queue).__name__}: wrap the data, IPUInfeedQueue(data).")


def _streamed(infeed_queue: queues.IPUInfeedQueue) -> Callable[[jax.Array], Any]:
    """A while loop's element for an iteration, taken from the infeed on the host as it runs.

    The loop's iteration count is known only on the device, so its elements
    are not staged as a `repeat`'s are: each iteration takes the next one, as
    an IPU's infeed stream does, and a loop that stops early leaves the rest.
    """
    reads = feed_reads.current()
    abstract = reads is not None and reads.abstract  # the probe acts as every IPU's replica
    if collectives.replica_count() > 1 and not abstract:
        raise ValueError(
            "ipu.loops.while_loop over an infeed runs on one replica here: its replicas "
            "would stop after different iterations, and the infeed deals its elements to "
            "the replicas in turn. Use ipu.loops.repeat(n, body, inputs, infeed_queue) on "
            "a replicated device.")
    if reads is not None:
        reads.stream(infeed_queue)
    ahead = infeed_queue.peek(1)
    if not ahead:
        raise ValueError("The infeed of an ipu.loops.while_loop is empty: the loop needs its "
                         "next element to know the shapes of the elements it reads.")
    specs = _element_specs(ahead[0])

    def take(count: np.ndarray) -> Any:
        left = infeed_queue.peek(1)
        if not left:
            raise ValueError(f"The infeed ran out at iteration {int(count)} of a while_loop "
                             f"whose condition still held (the elements of the iterations "
                             f"before it were read).")
        if _element_specs(left[0]) != specs:  # checked before it is taken: it stays
            raise ValueError(f"The infeed's element for iteration {int(count)} of a "
                             f"while_loop is {_element_specs(left[0])}, not {specs} as the "
                             f"loop was compiled for; it is left in the queue.")
        element = elements.stacked(infeed_queue.take(1))
        return jax.tree_util.tree_map(lambda a, spec: np.asarray(a[0], spec.dtype),
                                      element, specs)

    return lambda count: io_callback(take, specs, count)


def _element_specs(element: Any) -> Any:
    """An infeed element's shapes and dtypes, as the device holds them (no 64-bit types
    unless JAX enables them)."""
    return jax.tree_util.tree_map(
        lambda leaf: jax.ShapeDtypeStruct(
            np.shape(leaf), jax.dtypes.canonicalize_dtype(np.asarray(leaf).dtype)), element)


def _own_elements(data: Any, replicas: int) -> Any:
    """This replica's elements of `[n × R, ...]`: iteration k gets element k × R + r."""
    if replicas == 1:
        return data
    index = collectives.replica_index()
    return jax.tree_util.tree_map(
        lambda a: jnp.asarray(a).reshape((-1, replicas, *a.shape[1:]))[:, index], data)


def _iterations(n: Any) -> int:
    count = integers.integer_of(n)
    if count is None or count < 0:
        raise ValueError(f"repeat needs n >= 0 iterations, a Python or NumPy integer, got {n!r}.")
    return count


def _iteration_limit(maximum_iterations: Any) -> int:
    """The loop's bound on its iteration count (its counter is an int32)."""
    if maximum_iterations is None:
        return _INT32_MAX
    count = integers.integer_of(maximum_iterations)
    if count is None or not 0 <= count <= _INT32_MAX:
        raise ValueError(f"while_loop needs maximum_iterations from 0 to {_INT32_MAX}, a "
                         f"Python or NumPy integer (or None), got {maximum_iterations!r}.")
    return count


def _holds(condition: Callable, carry: tuple) -> Any:
    """`condition(*carry)`, which must be a boolean scalar (as `tf.while_loop` requires)."""
    holds = condition(*carry)
    if jnp.shape(holds) != () or jnp.result_type(holds) != jnp.bool_:
        raise TypeError(f"while_loop's condition must return a boolean scalar, got "
                        f"{jnp.result_type(holds)}{list(jnp.shape(holds))}: compare its value "
                        f"(`x < 10`), or reduce it (`jnp.all(...)`).")
    return holds


def while_loop(condition: Callable, body: Callable, inputs: Any = None,
               infeed_queue: queues.IPUInfeedQueue | None = None,
               maximum_iterations: int | None = None, use_while_v1: bool = True) -> Any:
    """Runs `body` while `condition` holds, carrying `inputs` (at most `maximum_iterations`).

    Args:
        condition: `condition(*carried)` returning a boolean scalar.
        body: `body(*carried)` returning the new carried values.
        inputs: The initial carried values (a list), or `None`.
        infeed_queue: Where each iteration's element comes from (after the
            carried values, a dict element by keyword), or `None`. The
            iteration count is known only on the device, so each iteration
            takes its element from the host as it runs (a loop that stops
            early leaves the rest in the queue); on one replica only.
        maximum_iterations: Stop after this many iterations, or `None`.
        use_while_v1: Accepted for compatibility.

    Returns:
        The final carried values: one value, a tuple of several, or `None`.

    Raises:
        TypeError: For an `infeed_queue` that is no `IPUInfeedQueue`.
        ValueError: With an `infeed_queue` that is empty when the loop is
            traced, or on a replicated device; an `infeed_queue` that runs out
            while the condition holds (a kept program's included) fails the
            run, `JaxRuntimeError` naming the iteration (inside `compile` and
            `strategy.run`, raised by the call).
        RuntimeError: When the body enqueues on an outfeed, for the same
            reason: enqueue in the body of `repeat`.

    Example:

    >>> while_loop(lambda x: x < 10, lambda x: x + 3, [np.int32(0)])
    Array(12, dtype=int32)
    """
    limit = _iteration_limit(maximum_iterations)
    _check_queue(infeed_queue)
    element = None if infeed_queue is None else _streamed(infeed_queue)
    carried = tuple(jax.tree_util.tree_map(jnp.asarray, _as_list(inputs)))

    def loop(keys: tuple, initial: list) -> tuple[Any, list]:
        def keep_going(values):
            count, carry, extra = values
            loop_state.enter_body(keys, extra)  # the condition may read them too
            return (count < limit) & _holds(condition, carry)

        def step(values):
            count, carry, extra = values
            loop_state.enter_body(keys, extra)
            with (queues.collect_enqueues(refusal=_WHILE_LOOP_ENQUEUE),
                  loop_state.body_trace()):
                new = _called(body, carry, None if element is None else element(count))
            return count + 1, _carried(new, len(carry)), loop_state.leave_body(keys)

        _, final, extra = jax.lax.while_loop(keep_going, step, (0, carried, initial))
        return final, extra

    return _unpacked(loop_state.run_loop(loop))


_WHILE_LOOP_ENQUEUE = (
    "IPUOutfeedQueue.enqueue cannot be called in the body of ipu.loops.while_loop: its "
    "iteration count is known only on the device, so the outfeed's size is not. Enqueue in "
    "the body of ipu.loops.repeat(n, ...) instead.")


def _as_list(inputs: Any) -> list:
    """Loop or computation inputs as a list: `None` is none, a lone value is one.

    IPU TensorFlow's examples pass a lone tensor as `(x)`, which is not a tuple.
    """
    if inputs is None:
        return []
    return list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]


def output_list(values: Any) -> list:
    """A computation's or a body's values as a list, operations dropped.

    Args:
        values: What the computation returned: `None`, one value, or a
            tuple or list of values (outfeed markers among them).

    Returns:
        The values as a list, without the operations.

    Example:

    >>> output_list((x, outfeed.enqueue(x)))
    [x]
    """
    if values is None:
        return []
    values = values if isinstance(values, (tuple, list)) else (values,)
    return [value for value in values if not isinstance(value, queues.Operation)]


def _carried(new: Any, count: int) -> tuple:
    """A body's result as the tuple of carried values."""
    values = tuple(output_list(new))
    if len(values) != count:
        raise ValueError(f"The loop body returned {len(values)} values for {count} "
                         f"loop-carried inputs.")
    return values


def _unpacked(values: tuple) -> Any:
    if not values:
        return None
    return values[0] if len(values) == 1 else values
