"""IPU TensorFlow's loop-level programming interface on JAX: scopes, loops, infeeds, outfeeds.

Code written against `ipu.scopes`, `ipu.ipu_compiler`, `ipu.loops`,
`ipu.ipu_infeed_queue` and `ipu.ipu_outfeed_queue` keeps its shape here,
with JAX functions for TensorFlow's graph code:

- `ipu_scope(device)` and `ipu_shard(index)` (in `keras_ipu.device.scopes`)
  say which IPU `compile` compiles for.
- `compile(computation, inputs)` compiles `computation` with `jax.jit` for
  that IPU and runs it at once (IPU TensorFlow builds an op that a session
  runs later); outfeeds enqueued inside come back with it. The program is
  kept: calling it again with arrays of the same shapes does not retrace.
- `repeat(n, body, inputs, infeed_queue)` is an on-device loop (`lax.scan`):
  each iteration takes the next element of the infeed, if any, after the
  loop-carried values; values `enqueue`d on an outfeed in the body are
  stacked per iteration and handed to the queue when the loop has run.
- `while_loop(condition, body, inputs)` is `lax.while_loop`.

Inside `compile` (and `strategy.run`) the infeeds' elements are the
program's inputs, taken on the host each time it runs; a loop run eagerly
takes them when it is built, as constants. The queues themselves are in
`keras_ipu.device.queues`.
"""

from __future__ import annotations

import contextvars
import functools
import operator
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from keras_ipu.device import queues, scopes, system

# Trace-time context, not global state: the outfeed values enqueued by the loops
# of a `compile` being traced.
_OUTFED: contextvars.ContextVar = contextvars.ContextVar("outfed", default=None)


def compile(computation: Callable, inputs: Any = None) -> list:  # noqa: A001 - the seed's name
    """Compiles `computation(*inputs)` for the current IPU and runs it.

    The compiled program is kept: another call of the same `computation`
    with inputs of the same shapes runs it again without tracing, its
    loops taking the infeeds' next elements.

    Args:
        computation: A JAX-traceable function of `len(inputs)` arguments.
        inputs: A list of arguments (arrays or structures of them), or `None`.

    Returns:
        The outputs as a list: `[]` for `None`, `[value]` for a single
        value, the values of a tuple or list. Outfeeds enqueued inside get
        their values.

    Raises:
        RuntimeError: Outside an `ipu_scope`: the computation is compiled for
            the scope's IPU.

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
    target = system.require().ipus_of_device(device)[shard].device
    return call_compiled(computation, target, _as_list(inputs), outputs=_outputs)


def call_compiled(fn: Callable, device: Any, args: Any = (), kwargs: Any = None,
                  outputs: Callable = lambda result: result) -> Any:
    """Runs `fn(*args, **kwargs)` under `jax.jit` on `device`; outfeeds get what it enqueues.

    Array arguments (NumPy, JAX, or anything with `__jax_array__`) are the
    program's inputs, copied to `device`; every other argument (a Python
    number, a queue, a model) is fixed in the program, as TensorFlow's
    `tf.function` fixes Python values. The program is kept in the configured
    system: a later call with the same `fn`, the same fixed arguments and
    arrays of the same shapes runs it again without tracing. The infeeds its
    loops read are inputs too: each call takes their next elements. The
    numbers and strings `fn` reads from its closure and globals are part of
    the program's key, and so are the queues it reads there (by identity: a
    queue made again gets a new program); a program whose trace captured arrays (`fn` closing
    over weights, a Keras variable's value) is traced again at each call,
    so that it sees their values then. Values read from objects' attributes
    stay those of the trace, as in `tf.function`.

    A function wrapped in `jax.jit` (the port of `@tf.function(jit_compile=True)`)
    is compiled as the function it wraps: the program is one compiled whole.

    The values a loop inside enqueues leave the program with its outputs and
    reach their queues once it has run (inside another such call, `fn` is
    part of the outer program). Operations `fn` returns (outfeed markers)
    come back as `None`.

    Args:
        fn: A JAX-traceable function.
        device: The JAX device to run on.
        args: Its positional arguments.
        kwargs: Its keyword arguments, or `None`.
        outputs: Applied to `fn`'s result inside the program.

    Returns:
        `fn`'s result, through `outputs`.

    Raises:
        ValueError: When an infeed has fewer elements than the loops need
            (none is taken).
        RuntimeError: When no IPU system is configured.

    Example:

    >>> configure_ipu_system()   # e.g. an IPUConfig with one IPU
    >>> call_compiled(lambda x: x * 2, jax.devices()[0], (np.ones(3),))
    Array([2., 2., 2.], dtype=float32)
    """
    # `@jax.jit` ports `@tf.function(jit_compile=True)`; the program is compiled whole
    # anyway, and a loop traced inside the inner jit could not hand its infeed data in
    # and its outfeed values out of it.
    while isinstance(fn, jax.stages.Wrapped) and hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    if _OUTFED.get() is not None:  # inside another program's trace: part of it
        return _without_operations(outputs(fn(*args, **(kwargs or {}))))
    arrays, fixed, treedef = _split_arguments((tuple(args), dict(kwargs or {})))
    programs = system.require().programs
    # `1`, `1.0` and `True` are equal keys: their types tell them apart.
    typed = tuple(leaf if leaf is _ARRAY else (type(leaf), leaf) for leaf in fixed)
    key = (fn, outputs, device, treedef, typed, _host_values(fn))
    try:
        program = programs.pop(key, None)
    except TypeError:  # an unhashable fixed argument: a program for this call only
        key, program = None, None
    if program is None:
        program = _Program(fn, outputs, treedef, fixed)
    if key is not None:
        programs[key] = program  # most recently used last
        while len(programs) > _PROGRAMS_KEPT:
            programs.pop(next(iter(programs)))
    result = program.run(device, arrays)
    if not program.reusable and key is not None:
        programs.pop(key, None)
    return result


# Programs `call_compiled` keeps per configured system (the least recently used go first).
_PROGRAMS_KEPT = 64

# Host values a traced function may read and fix in its program: a kept program is run
# again only while those it reads from its closure and globals are unchanged.
_HOST_SCALARS = (bool, int, float, complex, str, bytes, type(None), np.generic)
# The queues a traced function may read: its program takes from and fills those of its trace.
_QUEUES = (queues.IPUInfeedQueue, queues.IPUOutfeedQueue)
# Whose functions' globals are their own constants: not walked.
_LIBRARIES = frozenset({"jax", "jaxlib", "keras", "keras_ipu", "numpy", "ml_dtypes", "optree"})


def _host_values(fn: Callable, depth: int = 4) -> tuple:
    """The numbers, strings and queues `fn` (and what it calls) reads from closures and globals.

    Values read from objects' attributes are not seen: a kept program keeps
    those of its trace, as `tf.function` does.
    """
    values: list = []
    seen: set = set()

    def visit(function: Any, depth: int) -> None:
        if isinstance(function, functools.partial):
            function = function.func
        function = getattr(function, "__func__", function)  # a bound method's function
        code = getattr(function, "__code__", None)
        library = getattr(function, "__module__", None) or ""
        if (code is None or depth < 0 or id(function) in seen
                or library.partition(".")[0] in _LIBRARIES):
            return
        seen.add(id(function))
        cells = []
        for cell in function.__closure__ or ():
            try:
                cells.append(cell.cell_contents)
            except ValueError:  # a cell not filled yet
                continue
        names = _global_names(code)
        found = function.__globals__
        for value in cells + [found[name] for name in names if name in found]:
            if isinstance(value, _HOST_SCALARS):
                values.append((type(value), value))
            elif isinstance(value, _QUEUES):
                # By identity: a queue made again (a notebook cell run again) is another
                # program's; the kept one would take from, and fill, the old queue.
                values.append((type(value), value))
            elif callable(value) and not isinstance(value, type):
                visit(value, depth - 1)

    visit(fn, depth)
    return tuple(values)


def _global_names(code: Any) -> set:
    """The global names a code object and the functions defined in it use."""
    names = set(code.co_names)
    for constant in code.co_consts:
        if hasattr(constant, "co_names"):
            names |= _global_names(constant)
    return names


def _is_array(leaf: Any) -> bool:
    return isinstance(leaf, (np.ndarray, np.generic, jax.Array)) or hasattr(leaf, "__jax_array__")


def _split_arguments(arguments: Any) -> tuple[list, tuple, Any]:
    """The arguments' arrays (the program's inputs) and the fixed values, with their structure."""
    leaves, treedef = jax.tree_util.tree_flatten(arguments)
    arrays = [jnp.asarray(leaf) if hasattr(leaf, "__jax_array__") else leaf
              for leaf in leaves if _is_array(leaf)]
    fixed = tuple(_ARRAY if _is_array(leaf) else leaf for leaf in leaves)
    return arrays, fixed, treedef


class _ArraySlot:
    """Marks where an array argument goes among the fixed ones."""


_ARRAY = _ArraySlot()


class _MissingFeed(Exception):
    """A loop being traced reads an infeed the program does not take yet."""

    def __init__(self, plan: list):
        super().__init__("a loop reads an infeed the program does not take yet")
        self.plan = plan


class _FeedInputs:
    """The infeed data of a program being traced: its inputs, in the order its loops read them."""

    def __init__(self, plan: list, data: list):
        self.plan, self.data, self.read = plan, data, 0

    def take(self, queue: queues.IPUInfeedQueue, count: int) -> Any:
        index = self.read
        if index < len(self.plan) and self.plan[index] == (queue, count):
            self.read += 1
            return self.data[index]
        raise _MissingFeed([*self.plan[:index], (queue, count)])


# Trace-time context: the infeed inputs of the `call_compiled` program being traced.
_FEEDS: contextvars.ContextVar = contextvars.ContextVar("feeds", default=None)


class _Program:
    """One compiled function: its jitted program, the infeeds it reads and the outfeeds it fills."""

    def __init__(self, fn: Callable, outputs: Callable, treedef: Any, fixed: tuple):
        self.fn, self.outputs, self.treedef, self.fixed = fn, outputs, treedef, fixed
        self.plan: list = []  # (infeed, elements) its loops read, in order
        self.outfeeds: list = []  # the queues its outfed values go to, in order
        self.executables: dict = {}  # per plan and input shapes
        # Whether another call may run it: not when its trace captured arrays (a closure
        # over weights or a Keras variable), whose values of that trace it would keep.
        self.reusable = True
        # Whether the loops' infeed data are the program's inputs; otherwise (a queue the
        # function makes itself, a call inside another JAX trace) constants of one trace.
        self.feeds_as_inputs = True
        # The plan is static: a program compiled for one plan never gets another's data.
        self.jitted = jax.jit(self._traced, static_argnums=2)

    def _traced(self, arrays: list, feed_data: list, plan: tuple) -> tuple[Any, list]:
        supplied = iter(arrays)
        leaves = [next(supplied) if leaf is _ARRAY else leaf for leaf in self.fixed]
        args, kwargs = jax.tree_util.tree_unflatten(self.treedef, leaves)
        outfed_token = _OUTFED.set([])
        feeds_token = _FEEDS.set(_FeedInputs(list(plan), feed_data) if self.feeds_as_inputs
                                 else None)
        try:
            result = self.outputs(self.fn(*args, **kwargs))
            outfed = _OUTFED.get()
        finally:
            _FEEDS.reset(feeds_token)
            _OUTFED.reset(outfed_token)
        self.outfeeds = [queue for queue, _ in outfed]
        return _without_operations(result), [values for _, values in outfed]

    def run(self, device: Any, arrays: list) -> Any:
        if any(isinstance(a, jax.core.Tracer) for a in jax.tree_util.tree_leaves(arrays)):
            return self._run_once(arrays)  # inside another JAX trace: part of it
        arrays = jax.device_put(arrays, device)
        while True:
            taken = _take_all(self.plan)
            try:
                feed_data = jax.device_put([queues.stacked(t) for t in taken], device)
                result, outfed = self._executable(arrays, feed_data)(arrays, feed_data)
            except _MissingFeed as missing:
                _put_back(self.plan, taken)
                if len(missing.plan) <= len(self.plan):  # an infeed made in each trace
                    return self._run_once(arrays)
                self.plan = missing.plan  # trace again, reading that infeed too
                continue
            except BaseException:
                _put_back(self.plan, taken)
                raise
            return self._delivered(result, outfed)

    def _run_once(self, arrays: list) -> Any:
        """Traced for this call only, its loops' infeed data constants of the trace."""
        self.reusable = self.feeds_as_inputs = False
        result, outfed = jax.jit(self._traced, static_argnums=2)(arrays, [], ())
        return self._delivered(result, outfed)

    def _delivered(self, result: Any, outfed: list) -> Any:
        for queue, values in zip(self.outfeeds, outfed):
            queue.receive(values)
        return result

    def _executable(self, arrays: list, feed_data: list) -> Any:
        plan = tuple(self.plan)
        leaves, structure = jax.tree_util.tree_flatten((arrays, feed_data))
        signature = (plan, structure, tuple((a.shape, str(a.dtype)) for a in leaves))
        executable = self.executables.get(signature)
        if executable is None:
            traced = self.jitted.trace(arrays, feed_data, plan)
            self.reusable = self.reusable and not traced.jaxpr.consts
            executable = self.executables[signature] = traced.lower().compile()
        return executable


def _take_all(plan: list) -> list:
    """Each planned read's elements, taken only once every read is known to have them all."""
    needed: dict = {}
    for queue, count in plan:
        already = needed.get(queue, 0)
        left = len(queue.peek(already + count)) - already
        if left < count:
            raise ValueError(f"The infeed ran out: {left} elements left for a loop of "
                             f"{count} iterations.")
        needed[queue] = already + count
    return [queue.take(count) for queue, count in plan]


def _put_back(plan: list, taken: list) -> None:
    for (queue, _), elements in reversed(list(zip(plan, taken))):
        queue.put_back(elements)


def _without_operations(result: Any) -> Any:
    return jax.tree_util.tree_map(
        lambda v: None if isinstance(v, queues.Operation) else v, result)


def _deliver(queue: queues.IPUOutfeedQueue, values: Any) -> None:
    """Sends a finished loop's stacked values on: the enclosing body, program, or the queue."""
    enclosing = queues.current_enqueues()
    outfed = _OUTFED.get()
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
        n: The number of iterations, an integer of at least 1.
        body: `body(*carried, *element)` (a dict element by keyword) returning
            the new carried values, in the order of `inputs`; outfeed
            `enqueue` markers among them are dropped.
        inputs: The initial carried values (a list), or `None`.
        infeed_queue: Where each iteration's element comes from, or `None`.
        use_while_v1: Accepted for compatibility.

    Returns:
        The final carried values: one value, a tuple of several, or `None`.

    Raises:
        ValueError: For `n` below 1 or not an integer, an infeed that runs
            out (nothing is taken from it), an infeed read by a loop inside
            another loop's body, a body that returns another number of
            values than `inputs` has, or one that enqueues twice on an
            outfeed.

    Example:

    >>> repeat(10, lambda x: x + 1, [np.float32(0)])
    Array(10., dtype=float32)
    """
    n = _iterations(n)
    if infeed_queue is not None and queues.current_enqueues() is not None:
        # Traced once, it would read the same elements at every outer iteration.
        raise ValueError("A loop inside another loop's body cannot read an infeed: it is "
                         "traced once, so every outer iteration would get the same "
                         "elements. Read the infeed in the outer loop and pass the values "
                         "in.")
    carried = tuple(jax.tree_util.tree_map(jnp.asarray, _as_list(inputs)))
    feeds, taken, data = _FEEDS.get(), None, None
    if infeed_queue is not None and feeds is not None:  # inside `call_compiled`: its inputs
        data = feeds.take(infeed_queue, n)
    elif infeed_queue is not None:  # eager, or in another trace: the elements as constants
        taken = infeed_queue.take(n)
        data = queues.stacked(taken)
    layout: list = []  # (outfeed, whether its values are a nested loop's block), per record

    def step(carry, element):
        with queues.collect_enqueues() as enqueued:
            if element is None:
                new = body(*carry)
            elif isinstance(element, dict):
                new = body(*carry, **element)
            else:
                new = body(*carry, *(element if isinstance(element, tuple) else (element,)))
        layout[:] = [(queue, block) for queue, _, block in enqueued.records]
        return _carried(new, len(carry)), [values for _, values, _ in enqueued.records]

    try:
        final, outfed = jax.lax.scan(step, carried, data, length=n)
    except BaseException:
        if taken is not None:  # the loop did not run: its elements stay in the queue
            infeed_queue.put_back(taken)
        raise
    for (queue, block), values in zip(layout, outfed):
        if block:  # [n, inner iterations, ...] -> one value per inner iteration, in order
            values = jax.tree_util.tree_map(lambda a: a.reshape((-1, *a.shape[2:])), values)
        _deliver(queue, values)
    return _unpacked(final)


def _iterations(n: Any) -> int:
    try:
        count = operator.index(n)
    except TypeError:
        count = None
    if count is None or isinstance(n, bool) or count < 1:
        raise ValueError(f"repeat needs n >= 1 iterations, a Python or NumPy integer, got {n!r}.")
    return count


def while_loop(condition: Callable, body: Callable, inputs: Any = None,
               infeed_queue: queues.IPUInfeedQueue | None = None,
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
        RuntimeError: When the body enqueues on an outfeed, for the same
            reason: enqueue in the body of `repeat`.

    Example:

    >>> while_loop(lambda x: x < 10, lambda x: x + 3, [np.int32(0)])
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
        with queues.collect_enqueues(refusal=_WHILE_LOOP_ENQUEUE):
            new = body(*carry)
        return count + 1, _carried(new, len(carry))

    _, final = jax.lax.while_loop(keep_going, step, (0, carried))
    return _unpacked(final)


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


def _outputs(values: Any) -> list:
    """A computation's or a body's values as a list, operations dropped."""
    if values is None:
        return []
    values = values if isinstance(values, (tuple, list)) else (values,)
    return [value for value in values if not isinstance(value, queues.Operation)]


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
