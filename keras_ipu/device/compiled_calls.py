"""Functions compiled and run as IPU programs (`compile`, `strategy.run`): kept, and replicated.

`call_compiled(fn, ipus, args)` compiles `fn` with `jax.jit` for the IPUs of
a logical device and runs it at once; the program is kept in the configured
system and runs again without tracing. The infeeds its loops read are its
inputs, taken on the host at each call; the values its loops enqueue on
outfeeds (and those it enqueues outside any loop, one element per run) leave
with its outputs and reach their queues once it has run.

As in IPU TensorFlow, where "replication_factor is now set automatically
based on the model", the computation is replicated over the device's IPUs:
a device of N IPUs running a computation of S shards (`ipu_shard(i)` entered
for i < S, or the scope's shard; one when it enters none) runs R = N / S
replicas, replica r on IPU r * S (plus the scope's shard). keras_ipu runs a
sharded computation on one IPU per replica, but its shards still take IPUs:
2 IPUs and `ipu_shard(0)`, `ipu_shard(1)` are one replica. The shards are
learnt from an abstract trace of the computation (`jax.eval_shape`), paid
once per kept program and only on devices of more than one IPU. Then:

- every replica gets the array arguments unchanged;
- a loop of n iterations over an infeed takes n × R elements: iteration k
  of replica r gets element k × R + r (the convention of `replicate.py`:
  batch i of a stream is step i // R of replica i % R);
- outfeeds gain a replica axis second: `[iterations, R, ...]` with
  `IPUOutfeedMode.ALL`, `[R, ...]` with `LAST` (none when R is 1);
- the computation's result is replica 0's (keras_ipu's choice: replicas
  hold equal values after cross-replica reductions; the outfeeds show every
  replica's, as the seed's examples do);
- `replication_ops.replication_index()`, `cross_replica_ops` and the other
  collectives see the replicas, also where IPUs share a JAX device.

Inside another JAX transformation (a `jax.jit` of the caller's own) the
computation is part of that program and runs once, unreplicated.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify
from jax.sharding import PartitionSpec as P

from keras_ipu.device import (
    attachment,
    closures,
    collectives,
    elements,
    feed_reads,
    floating_point,
    interrupts,
    program_outfeeds,
    queues,
    scopes,
    system,
)
from keras_ipu.device.replicate import REPLICA_AXIS, Replicas


def in_compiled_program() -> bool:
    """Whether a `call_compiled` program (`compile`, `strategy.run`) is being traced here.

    Returns:
        True inside the trace of its computation (its infeeds taken as inputs
        or not), False elsewhere.

    Example:

    >>> strategy.run(lambda: in_compiled_program())   # True while it traces
    """
    return program_outfeeds.program_outfeeds() is not None


def without_operations(result: Any) -> Any:
    """`result` with the operations it holds (outfeed markers) as `None`.

    Args:
        result: A computation's result (a tree).

    Returns:
        The same tree, each `queues.Operation` replaced by `None`.

    Example:

    >>> without_operations((x, outfeed.enqueue(x)))
    (x, None)
    """
    return jax.tree_util.tree_map(
        lambda v: None if isinstance(v, queues.Operation) else v, result)


def call_compiled(fn: Callable, ipus: Sequence[system.VirtualIPU], args: Any = (),
                  kwargs: Any = None, outputs: Callable = lambda result: result,
                  shard: int = 0, name: str = "compiled") -> Any:
    """Runs `fn(*args, **kwargs)` under `jax.jit` on a logical device's IPUs, replicated.

    Array arguments (NumPy, JAX, or anything with `__jax_array__`) are the
    program's inputs, copied to every replica's device; every other argument
    (a Python number, a queue, a model) is fixed in the program, as
    TensorFlow's `tf.function` fixes Python values. The program is kept in the
    configured system: a later call with the same `fn`, the same fixed
    arguments and arrays of the same shapes runs it again without tracing. The
    infeeds its loops read are inputs too: each call takes their next
    elements. The numbers and strings `fn` reads from its closure and globals
    are part of the program's key, and so are the queues it reads there (by
    identity: a queue made again gets a new program), the device's IPUs and
    the shard (with `fn` they fix the replication factor, which the program
    records at its first run: a system configured again keeps programs of its
    own); a program whose trace captured arrays (`fn` closing over weights,
    a Keras variable's value) is traced again at each call, so that it sees
    their values then. Values read from objects' attributes stay those of the
    trace, as in `tf.function`.

    The computation runs once per replica (see the module docstring): R =
    `len(ipus)` / the shards it uses, the infeeds dealt round-robin, the
    outfeeds with a replica axis second, the result replica 0's.

    A function wrapped in `jax.jit` (the port of `@tf.function(jit_compile=True)`)
    is compiled as the function it wraps: the program is one compiled whole.

    The values a loop inside enqueues leave the program with its outputs and
    reach their queues once it has run (inside another such call, `fn` is
    part of the outer program, in each of its replicas). Operations `fn`
    returns (outfeed markers) come back as `None`.

    The floating point exceptions the system traps (`floating_point_behaviour`)
    are checked: the first stops the call with `IPUFloatingPointError`; its
    outfed values are dropped and the infeed elements it took are put back.

    Args:
        fn: A JAX-traceable function.
        ipus: The IPUs of the logical device it runs on.
        args: Its positional arguments.
        kwargs: Its keyword arguments, or `None`.
        outputs: Applied to `fn`'s result inside the program.
        shard: The IPU of the device a replica runs on (`ipu_shard` around
            the call); it counts among the shards the computation uses.
        name: The program's name in a floating point exception's message.

    Returns:
        `fn`'s result, through `outputs` (replica 0's).

    Raises:
        ValueError: When an infeed has fewer elements than the loops need
            (none is taken), or the device's IPUs are not a multiple of the
            shards the computation uses.
        RuntimeError: When no IPU system is configured.
        IPUFloatingPointError: When an operation raised a floating point
            exception that the system traps.

    Example:

    >>> configure_ipu_system()   # e.g. an IPUConfig with one IPU
    >>> call_compiled(lambda x: x * 2, system.require().ipus, (np.ones(3),))
    Array([2., 2., 2.], dtype=float32)
    """
    fn = unwrapped(fn)
    if program_outfeeds.program_outfeeds() is not None:  # inside another program: part of it
        return without_operations(outputs(fn(*args, **(kwargs or {}))))
    ipus = tuple(ipus)
    arrays, fixed, treedef = _split_arguments((tuple(args), dict(kwargs or {})))
    programs = system.require().programs
    # `1`, `1.0` and `True` are equal keys, and so are `0.0` and `-0.0`: not as host keys.
    typed = tuple(leaf if leaf is _ARRAY else closures.host_key(leaf) for leaf in fixed)
    traced_with = (ipus, shard, treedef, typed, closures.host_values(fn))
    key = (fn, outputs, *traced_with)
    try:
        program = programs.pop(key, None)
    except TypeError:  # an unhashable fixed argument: a program for this call only
        key, program = None, None
    if program is None:
        # Learnt per program: other fixed values or host values may use other shards.
        program = _Program(fn, outputs, treedef, fixed, ipus, shard,
                           _ShardMemo(system.require().shard_counts,
                                      getattr(fn, "computation", fn), traced_with),
                           name=name)
    if key is not None:
        programs[key] = program  # most recently used last
        while len(programs) > _PROGRAMS_KEPT:
            programs.pop(next(iter(programs)))
    result = program.run(arrays)
    if not program.reusable and key is not None:
        programs.pop(key, None)
    return result


# Programs `call_compiled` keeps per configured system (the least recently used go first).
_PROGRAMS_KEPT = 64

def _is_array(leaf: Any) -> bool:
    return isinstance(leaf, (np.ndarray, np.generic, jax.Array)) or hasattr(leaf, "__jax_array__")


def unwrapped(fn: Callable) -> Callable:
    """`fn` without the `jax.jit` around it: the function a compiled call traces.

    `@jax.jit` ports `@tf.function(jit_compile=True)`; the program is compiled
    whole anyway, and a loop traced inside the inner jit could not hand its
    infeed data in and its outfeed values out of it.

    Args:
        fn: A function, maybe wrapped in `jax.jit` (once or more).

    Returns:
        The innermost function.

    Example:

    >>> unwrapped(jax.jit(f)) is f
    True
    """
    while isinstance(fn, jax.stages.Wrapped) and hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


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


# Shard counts kept per function, for its calls with different fixed and host values.
_SHARD_COUNTS_KEPT = 16


class _ShardMemo:
    """The shards a computation uses, learnt once for a program that is not kept.

    The system's table (`IPUSystem.shard_counts`) holds the user's function
    (a wrapper's `computation`) weakly, so not the models its closure holds;
    a callable made at each use (a bound method) is probed at each call.
    """

    def __init__(self, counts: Any, computation: Callable, key: Any):
        self.counts, self.computation, self.key = counts, computation, key

    def get(self) -> int | None:
        try:
            return self.counts.get(self.computation, {}).get(self.key)
        except TypeError:  # not weakly referable
            return None

    def put(self, shards: int) -> None:
        try:
            table = self.counts.setdefault(self.computation, {})
            table[self.key] = shards
        except TypeError:
            return
        while len(table) > _SHARD_COUNTS_KEPT:  # keys of objects since gone never match
            table.pop(next(iter(table)))


class _Program:
    """One compiled function: its jitted program, its replicas, the infeeds and outfeeds it uses."""

    def __init__(self, fn: Callable, outputs: Callable, treedef: Any, fixed: tuple,
                 ipus: tuple, shard: int, shards: _ShardMemo | None = None,
                 name: str = "compiled"):
        self.fn, self.outputs, self.treedef, self.fixed = fn, outputs, treedef, fixed
        self.ipus, self.shard, self.name = ipus, shard, name
        # The floating point exceptions it traps: the system's, which keeps the program.
        self.checks = floating_point.system_checks()
        self.plan: list = []  # (infeed, iterations) its loops read, in order
        self.outfeeds: list = []  # the queues its outfed values go to, in order
        # The infeeds its last trace's while loops read as they run (host callbacks).
        self.streams: tuple = ()
        self.unread: list = []  # elements its traces' own infeeds looked at, not took
        self.executables: dict = {}  # per plan and input shapes
        # Whether another call may run it: not when its trace captured arrays (a closure
        # over weights or a Keras variable), whose values of that trace it would keep.
        self.reusable = True
        # Whether the loops' infeed data are the program's inputs; otherwise (a queue the
        # function makes itself, a call inside another JAX trace) constants of one trace.
        self.feeds_as_inputs = True
        # The replicas it runs on: at once for a one-IPU device, else from its first run's
        # abstract trace (the shards the computation uses).
        self.replicas: Replicas | None = None
        self.jitted: Any = None
        self.shards = shards
        known = shards.get() if shards is not None else None
        if len(ipus) == 1:
            self._settle(Replicas((ipus[shard],)))
        elif known is not None:
            self._settle(self._replicas(known))

    def _settle(self, replicas: Replicas) -> None:
        """Fixes the replicas and the jitted program.

        The plan is static: a program compiled for one plan never gets another's data.
        """
        self.replicas = replicas
        self.jitted = jax.jit(self._function(replicas), static_argnums=2)

    def _function(self, replicas: Replicas, checked: bool = True) -> Callable:
        """`(arrays, feed_data, plan) -> ((result, outfed), error)`: the floating point
        exceptions' checkify error, or `None` when the system traps none."""
        function = (self._traced if replicas.count == 1
                    else functools.partial(self._replicated, replicas))
        checks = self.checks if checked else frozenset()

        def run(arrays: list, feed_data: list, plan: tuple) -> tuple[tuple[Any, list], Any]:
            if not checks:
                return function(arrays, feed_data, plan), None
            # The plan (queues) is static: checkify traces the arrays only.
            error, out = checkify.checkify(lambda a, f: function(a, f, plan),
                                           errors=checks)(arrays, feed_data)
            return out, error

        return run

    def _raise_trapped(self, error: Any, streamed: Sequence = ()) -> None:
        if error is None:
            return
        try:
            floating_point.raise_first(error, self.name)
        except floating_point.IPUFloatingPointError:
            for queue, taken in streamed:  # its while loops' (the staged go back below)
                queue.put_back(taken)
            raise

    def _traced(self, arrays: list, feed_data: list, plan: tuple) -> tuple[Any, list]:
        reads = feed_reads.FeedInputs(list(plan), feed_data) if self.feeds_as_inputs else None
        traced = self._trace(arrays, reads)
        if reads is not None:
            reads.check_all_read()  # its elements were taken: a loop it skips may not have them
        self.streams = tuple(reads.streamed) if reads is not None else ()
        return traced

    def _trace(self, arrays: list, feeds: Any) -> tuple[Any, list]:
        supplied = iter(arrays)
        leaves = [next(supplied) if leaf is _ARRAY else leaf for leaf in self.fixed]
        args, kwargs = jax.tree_util.tree_unflatten(self.treedef, leaves)
        with (feed_reads.reading(feeds), queues.recording_made_infeeds(self.unread),
              program_outfeeds.collect_program_outfeeds() as outfed):
            result = self.outputs(self.fn(*args, **kwargs))
        self.outfeeds = [queue for queue, _ in outfed]  # this trace's
        return without_operations(result), [values for _, values in outfed]

    def _replicated(self, replicas: Replicas, arrays: list, feed_data: list,
                    plan: tuple) -> tuple[Any, list]:
        """`_traced` on every replica: the arrays for all, the infeed data `[n, R, ...]` dealt.

        Returns the results with a replica axis first, the outfed values with
        one second (`[n, R, ...]`).
        """
        def per_replica(arrays: list, feed_data: list) -> tuple[Any, list]:
            own = jax.tree_util.tree_map(lambda a: a[:, 0], feed_data)
            result, outfed = self._traced(arrays, own, plan)
            return (jax.tree_util.tree_map(lambda a: jnp.asarray(a)[None], result),
                    jax.tree_util.tree_map(lambda a: a[:, None], outfed))

        mapped = replicas.grid.map(per_replica, in_specs=(P(), P(None, REPLICA_AXIS)),
                                   out_specs=(P(REPLICA_AXIS), P(None, REPLICA_AXIS)))
        return mapped(arrays, feed_data)

    def run(self, arrays: list) -> Any:
        if any(isinstance(a, jax.core.Tracer) for a in jax.tree_util.tree_leaves(arrays)):
            # Inside another JAX trace: part of it, once (unchecked: its error could
            # not reach the host before that program's results).
            return self._run_once(arrays, Replicas((self.ipus[self.shard],)), checked=False)
        replicas = self.replicas or self._probe(arrays)
        arrays = _placed(arrays, replicas, P())
        if not self.feeds_as_inputs:  # its loops read an infeed it makes
            return self._run_once(arrays, replicas)
        while True:
            taken = feed_reads.take_all(self.plan, replicas.count)
            try:
                feed_data = _placed([_dealt(elements.stacked(t), replicas.count) for t in taken],
                                    replicas, P(None, REPLICA_AXIS))
                executable, outfeeds, streams = self._executable(arrays, feed_data, replicas)
                with contextlib.ExitStack() as recording:
                    # Once per queue: two loops may read one.
                    streamed = [(queue, recording.enter_context(queue.recorded()))
                                for queue in {id(queue): queue for queue in streams}.values()]
                    (result, outfed), error = attachment.run_checked(executable, self.name,
                                                                     arrays, feed_data)
                    if not attachment.runs_programs():  # nothing ran: nothing was taken
                        feed_reads.put_back(self.plan, taken)
                    if streams or any(len(elements) for elements in taken):
                        # It took infeed elements (its while loops, as they run): whether
                        # it ran, and so whether they are gone, is known when it returns,
                        # as a session's run (a replicated run is dispatched before it
                        # runs, and a failure there would lose them).
                        jax.block_until_ready((result, outfed))
                self._raise_trapped(error, streamed)  # the elements it took go back
            except feed_reads.MadeInTrace:
                feed_reads.put_back(self.plan, taken)
                return self._run_once(arrays, replicas)
            except feed_reads.MissingFeed as missing:
                feed_reads.put_back(self.plan, taken)
                if len(missing.plan) <= len(self.plan):  # an infeed made in each trace
                    return self._run_once(arrays, replicas)
                self.plan = missing.plan  # trace again, reading that infeed too
                continue
            except feed_reads.UnreadFeed as unread:  # these shapes' trace reads fewer
                feed_reads.put_back(self.plan, taken)
                self.plan = self.plan[:unread.read]
                continue
            except BaseException:
                feed_reads.put_back(self.plan, taken)
                raise
            return self._delivered(replicas, result, outfed, outfeeds)

    def _probe(self, arrays: list) -> Replicas:
        """The replicas, from an abstract trace that records the shards and the infeed reads.

        When a loop reads an empty infeed the trace stops there: the replicas
        then count the shards seen so far and are not kept (the run fails
        taking that infeed's elements, and the next call traces again). An
        infeed the function makes itself is new in each trace, so the program
        is then traced for each call.
        """
        probe = feed_reads.FeedProbe()
        complete = True

        def traced(arrays: list) -> tuple[Any, list]:
            # As the first of as many replicas as IPUs, so that collectives and their
            # groups trace (a group valid for the real replicas divides them all).
            return collectives.as_first_of(len(self.ipus), lambda a: self._trace(a, probe),
                                           arrays)

        with scopes.recording_shards() as shards:
            try:
                jax.eval_shape(traced, arrays)
            except feed_reads.EmptyFeed:
                complete = False
        if probe.made_infeed:
            self.feeds_as_inputs = False
        self.plan = self.plan or probe.plan
        count = max(shards | {self.shard}) + 1
        replicas = self._replicas(count)
        if complete:
            self._settle(replicas)
            if self.shards is not None:
                self.shards.put(count)
        return replicas

    def _replicas(self, shards: int) -> Replicas:
        """One replica per `shards` IPUs of the device, each on its first IPU (plus the shard)."""
        count = len(self.ipus)
        if count % shards:
            multiples = ", ".join(str(shards * k) for k in range(1, 4))
            divisors = ", ".join(str(d) for d in range(1, count + 1) if count % d == 0)
            raise ValueError(
                f"The computation uses {shards} IPU shards (ipu_shard(0) to "
                f"ipu_shard({shards - 1})) but its device has {count} IPUs, not a multiple "
                f"of {shards}: the device's IPUs hold whole replicas of the computation. "
                f"Configure a device of {multiples}, ... IPUs, or use {divisors} shards.")
        return Replicas(tuple(self.ipus[r * shards + self.shard]
                              for r in range(count // shards)))

    def _run_once(self, arrays: list, replicas: Replicas, checked: bool = True) -> Any:
        """Traced for this call only, its loops' infeed data constants of the trace; inside
        another JAX trace (`checked` False) part of that program."""
        self.reusable = self.feeds_as_inputs = False
        function = jax.jit(self._function(replicas, checked), static_argnums=2)
        if not checked:
            return self._delivered(replicas, *function(arrays, [], ())[0], self.outfeeds)
        # Its loops take their elements as they are traced: back they go should it not run.
        with feed_reads.reads_undoable() as undo_reads:
            try:
                executable = _checked(function.trace(arrays, [], ()).lower().compile(),
                                      replicas, self.name)
                (result, outfed), error = attachment.run_checked(executable, self.name,
                                                                 arrays, [])
                self._raise_trapped(error)
            except BaseException:
                undo_reads()
                raise
            if not attachment.runs_programs():  # nothing ran: nothing was taken
                undo_reads()
        return self._delivered(replicas, result, outfed, self.outfeeds)

    @staticmethod
    def _delivered(replicas: Replicas, result: Any, outfed: list, outfeeds: list) -> Any:
        # A Ctrl-C waits: the run took its infeed elements, its values reach their queues.
        with interrupts.deferred():
            for queue, values in zip(outfeeds, outfed, strict=True):
                queue.receive(values)
            return replicas.unreplicate(result)  # replica 0's, on its device

    def _executable(self, arrays: list, feed_data: list,
                    replicas: Replicas) -> tuple[Any, list, bool]:
        """The compiled program for these inputs (its memory checked on the replicas' IPUs),
        the queues its outfed values go to, and whether its while loops stream infeeds.

        The queues are its trace's: a function traced for other shapes may
        enqueue elsewhere.
        """
        plan = tuple(self.plan)
        leaves, structure = jax.tree_util.tree_flatten((arrays, feed_data))
        signature = (plan, structure, tuple((a.shape, str(a.dtype)) for a in leaves))
        executable = self.executables.get(signature)
        if executable is None:
            traced = self.jitted.trace(arrays, feed_data, plan)
            self.reusable = self.reusable and not traced.jaxpr.consts
            compiled = _checked(traced.lower().compile(), replicas, self.name)
            executable = self.executables[signature] = (compiled, list(self.outfeeds),
                                                        self.streams)
        return executable


def _checked(compiled: Any, replicas: Replicas, name: str) -> Any:
    """`compiled`, once it is known to fit each replica's IPU (IPUs sharing a device each
    take their share of its memory)."""
    use = attachment.program_memory(compiled, replicas.ipus_per_device)
    attachment.check_fits([(ipu.index, use) for ipu in replicas.ipus], name)
    return compiled


def _placed(tree: Any, replicas: Replicas, spec: P) -> Any:
    """`tree` on the replicas' devices: on the one device, or split over the grid by `spec`."""
    if replicas.count == 1:
        return jax.device_put(tree, replicas.devices[0])
    return jax.device_put(tree, replicas.grid.sharding(spec))


def _dealt(data: Any, replicas: int) -> Any:
    """A read's stacked elements `[n × R, ...]` as `[n, R, ...]`: element k × R + r to `[k, r]`."""
    if replicas == 1:
        return data
    return jax.tree_util.tree_map(
        lambda a: a.reshape((a.shape[0] // replicas, replicas, *a.shape[1:])), data)
