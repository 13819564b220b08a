"""Device programs: one execution = `steps` steps with the state on the device.

An execution takes the program state (weights, optimizer slots, metric
state, ...) and the stacked batches of `steps` steps (the infeed), runs the
step function `steps` times, and gives back the new state and the outfeed.
The steps run in the loop form `loops.choose_loop` picks for the program and
platform: an on-device `lax.scan`, or one compiled step dispatched per step
without waiting (see `device/loops.py`). Each distinct input signature is
compiled once, measured, and checked against the IPU's memory before it
first runs; the report says which loop form ran and why.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax

from keras_ipu.device import (
    accounting,
    attachment,
    background,
    compiler,
    convolutions,
    floating_point,
    loops,
    lowering,
    precision,
)
from keras_ipu.device.dispatch import DispatchedExecution
from keras_ipu.device.hardware import IPUHardware
from keras_ipu.device.outfeed import StepStream
from keras_ipu.device.replicate import Replicas, all_reduce_cycles
from keras_ipu.device.report import ExecutionReport, IPUReport
from keras_ipu.device.system import VirtualIPU

State = Any
Batch = Any
Outputs = Any
StepFn = Callable[[State, Batch], tuple[Outputs, State]]

# XLA:CPU can deadlock with many multi-device executions queued; an IPU runs
# one execution at a time anyway. A few in flight keep the device busy.
DEFAULT_MAX_IN_FLIGHT = 4

_STEP_FIRST_REASON = ("the step dispatched per step, while the on-device loop compiles on a "
                      "host thread (--background_loop_compile)")


class _Traced(NamedTuple):
    """A program traced and lowered, and the batches it takes."""

    traced: Any
    lowered: Any
    batches: Batch


class _Successor(NamedTuple):
    """The executable that takes over from another once ready (the loop after the step)."""

    ready: Callable[[], bool]
    take: Callable[[], _Executable]


class _Executable:
    """A compiled execution, and its report, worked out when first read.

    The report's cycle estimate can take seconds (a pipeline's cost model
    traces each stage again), and nothing in a run reads it; memory is
    checked when compiling, before anything runs.
    """

    def __init__(self, compiled: Any, make_report: Callable[[], ExecutionReport],
                 loop: loops.LoopChoice, dispatched: bool = False):
        self.compiled = compiled  # `(state, batches) -> (state, outfeed)`
        self.loop = loop
        self.dispatched = dispatched  # compiled is a `DispatchedExecutable.run`
        self._make_report = make_report
        self.successor: _Successor | None = None  # set while a better one compiles
        self.memory: tuple[accounting.MemoryUse, ...] = ()  # per IPU, as checked

    @functools.cached_property
    def report(self) -> ExecutionReport:
        return self._make_report()


class ExecutionProgram:
    """Runs `steps` steps of a step function per call, on each replica's IPU.

    Args:
        step_fn: A pure function `(state, batch) -> (outputs, new_state)`,
            per replica; it may use `replicas.sum` for cross-replica sums.
        mode: The program's name in reports and errors (`"fit"`, ...).
        replicas: The IPUs that run the program, one replica each. With one
            replica, state and batches have no replica axis; with more, the
            state has a leading replica axis and the batches
            `[steps, replicas, ...]` (see `Replicas`).
        hardware: The hardware description used for the accounting.
        exchange_bytes_per_step: Bytes of gradients each replica all-reduces
            per step (one weight update), for the cycle estimate; for a
            pipeline, the most any of its IPUs all-reduces (they sum their
            stages' gradients side by side).
        micro_batches_per_step: Batches one step consumes (gradient
            accumulation); the report counts steps in batches.
        finalize: Applied to the stacked outfeed inside the compiled program
            (e.g. to keep only the last step's logs), so the host gets what
            it needs without further device calls.
        execution: A whole execution `(state, batches) -> (state, outfeed)`
            to compile instead of the step loop (pipelined programs bring
            their own); `step_fn` is then unused.
        pipeline: For pipelined programs, a function
            `(hardware, batches) -> (cycles per program step, PipelineReport)`
            of an execution's batches (or their shape structs); the estimate
            then follows the schedule instead of the program's count, and
            each executable's report describes the program for its batches.
        replica_count: The replication factor to report, when the program's
            IPUs are not one replica each (pipelines).
        max_in_flight: Executions dispatched but not finished, at most.
        loop: The loop form: `"auto"` (by `loops.choose_loop`), `"scan"`
            or `"host"`. Programs that bring their own `execution` keep it,
            unless they bring a `dispatched` form too.
        dispatched: For programs that bring their own `execution`, the same
            execution as separately compiled programs the host dispatches;
            its `choose` decides which of the two runs.
        stream: Where each step's outputs go while the execution runs (a
            `StepStream`, see `device/outfeed.py`): the step loop sends them
            from inside, in chunks. Programs that bring their own
            `execution` are dispatched one leading slice (a weight update)
            at a time instead, their `finalize` returning `(outfeed,
            streamed)`; `streamed`, `[slices, replicas, ...]`, goes to the
            stream as each dispatch is queued.
        schedule_reason: Why a program that brings its own `execution` runs
            it as its loop (the report's loop reason), when no `dispatched`
            form was chosen instead.
        last_outputs_only: The on-device loop returns only its last step's
            outputs (a leading axis of 1) instead of every step's, for a
            `finalize` that reads only those (fit and evaluate logs): XLA
            then compiles no buffer of every step's outputs, nor its fill
            and slice (on CPUs, two kernels of ~8 ms each fewer).
        state_bytes: Per IPU (in `replicas` order), the state it holds of its
            own, when the IPUs hold different state in one program (a
            pipeline's stages, padded to the largest there); by default each
            IPU's share of the program's state. `None` for an IPU that runs
            nothing of the program (a pipeline's `device_mapping` skipping
            it): it holds nothing.
        io_split: `(batches, outfeed) -> bytes per IPU` (in `replicas` order)
            of an execution's data and outfeed, where IPUs stream different
            parts (a pipeline's stages); by default an equal share each.
        floating_point_checks: The floating point exceptions each execution
            traps (`floating_point.checks_for`); the first one raises
            `IPUFloatingPointError` as the execution returns, and its results
            are dropped (the state given to it is then not consumed).

    Example:

    >>> program = ExecutionProgram(step, mode="fit", replicas=Replicas(system.ipus[:1]),
    ...                            hardware=system.hardware)
    >>> state, outfeed = program(state, stacked_batches)  # one execution
    >>> program.report.ipus[0].memory_bytes
    """

    def __init__(
        self,
        step_fn: StepFn | None = None,
        *,
        mode: str,
        replicas: Replicas,
        hardware: IPUHardware,
        exchange_bytes_per_step: float = 0.0,
        micro_batches_per_step: int = 1,
        finalize: Callable[[Outputs], Any] | None = None,
        execution: Callable[[State, Batch], tuple[State, Outputs]] | None = None,
        pipeline: Callable[[IPUHardware, Batch], tuple[float, Any]] | None = None,
        replica_count: int | None = None,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        loop: str = loops.AUTO,
        dispatched: DispatchedExecution | None = None,
        stream: StepStream | None = None,
        schedule_reason: str = "the pipeline schedule is the loop",
        last_outputs_only: bool = False,
        state_bytes: Sequence[int | None] | None = None,
        io_split: Callable[[Batch, Outputs], Sequence[int]] | None = None,
        floating_point_checks: frozenset = frozenset(),
    ):
        self._step_fn = step_fn
        self._checks = floating_point_checks
        self.mode = mode
        self.replicas = replicas
        self.hardware = hardware
        self.exchange_bytes_per_step = exchange_bytes_per_step
        self._state_bytes = None if state_bytes is None else tuple(state_bytes)
        self._io_split = io_split
        self.micro_batches_per_step = micro_batches_per_step
        self._pipeline = pipeline
        self.replica_count = replica_count or replicas.count
        self._loop_request = loops.check_request(loop)
        self._own_execution = execution is not None
        # The stages' separately dispatched programs carry no checks: the schedule runs.
        self._dispatched = None if floating_point_checks else dispatched
        self.stream = stream
        self._schedule_reason = schedule_reason
        self.last_outputs_only = last_outputs_only
        replicated = execution or replicas.map(self._loop)
        finalize = finalize or (lambda outfeed: outfeed)
        self._finalize = jax.jit(finalize)

        # Checked, the outfeed is `(outfeed, error)`; `finalize` is not: checkify cannot join
        # its reduction over the replicas to their error, which has a shape per replica.
        checked = floating_point_checks and floating_point.checked(replicated,
                                                                   floating_point_checks)

        def execution(state, batches):
            state, out = (checked or replicated)(state, batches)
            return state, (finalize(out[0]), out[1]) if checked else finalize(out)
        self._jitted = jax.jit(execution, donate_argnums=0 if self.donates_state else ())
        self._executables: dict[Any, _Executable] = {}
        self._in_flight: collections.deque = collections.deque()
        self._max_in_flight = max_in_flight
        self._current: _Executable | None = None

    @property
    def donates_state(self) -> bool:
        """Whether an execution consumes the state it is given.

        Not when it streams from inside its loop: the host may read the
        previous state while it runs. Nor when it traps floating point
        exceptions: the state stays the previous one when an execution fails.
        """
        return (self.stream is None or self._own_execution) and not self._checks

    @property
    def ipu(self) -> VirtualIPU:
        """The first replica's IPU."""
        return self.replicas.ipus[0]

    @property
    def device(self) -> jax.Device:
        """The first replica's JAX device."""
        return self.ipu.device

    def _loop(self, state: State, batches: Batch) -> tuple[State, Outputs]:
        # A replica's block of its batches keeps a size-1 axis after the steps' (one
        # micro-batch per step), which XLA:CPU lays out as it likes and then copies whole
        # for the loop: the loop takes its batches without it, each step gets it back.
        single = jax.tree_util.tree_map(lambda a: a.ndim > 1 and a.shape[1] == 1, batches)
        batches = jax.tree_util.tree_map(
            lambda a, one: a.reshape(a.shape[:1] + a.shape[2:]) if one else a, batches, single)

        def body(carry, batch):
            batch = jax.tree_util.tree_map(lambda a, one: a[None] if one else a, batch, single)
            outputs, carry = self._step_fn(carry, batch)
            return carry, outputs

        if self.stream is not None:
            return self._streamed_loop(body, state, batches)
        if _leading(batches) == 1:  # the step alone: a loop of one costs XLA compile time
            new_state, outputs = body(state, jax.tree_util.tree_map(lambda a: a[0], batches))
            loops.check_carried(state, new_state)
            state = new_state
            # As a loop's outputs, arrays (a step may give a Python number in its logs).
            return state, jax.tree_util.tree_map(lambda a: jax.numpy.asarray(a)[None], outputs)
        if self.last_outputs_only:
            return _last_outputs_loop(body, state, batches)
        return jax.lax.scan(body, state, batches)

    def _streamed_loop(self, body: Callable, state: State, batches: Batch):
        """The step loop as chunks of steps, each sent to the stream once done."""
        steps = _leading(batches)
        length = self.stream.chunk_length(steps)

        def chunk_body(carry, chunk):
            carry, outputs = jax.lax.scan(body, carry, chunk)
            self.stream.emit(self.replicas.index(), outputs)
            return carry, outputs

        chunks = jax.tree_util.tree_map(
            lambda a: a.reshape(steps // length, length, *a.shape[1:]), batches)
        state, outputs = jax.lax.scan(chunk_body, state, chunks)
        return state, jax.tree_util.tree_map(
            lambda a: a.reshape(steps, *a.shape[2:]), outputs)

    @property
    def report(self) -> ExecutionReport | None:
        """The report of the last execution prepared or run (`None` before any)."""
        return self._current.report if self._current is not None else None

    def prepare(self, state: State | Callable[[], State], batches: Batch) -> None:
        """Compiles the program for these inputs (cached) and checks its memory.

        Its report becomes the program's `report`.

        Args:
            state: The state (or its shape structs), or a function that gives
                it: called only when the program compiles for these batches,
                so that a warm run does not gather the state to find nothing
                to compile.
            batches: The execution's batches (or their shape structs).

        Raises:
            IPUOutOfMemoryError: When the program does not fit an IPU.
        """
        self._current = self._executable(state, batches)

    def __call__(self, state: State, batches: Batch) -> tuple[State, Outputs]:
        """Runs one execution (asynchronously) and returns state and outfeed."""
        if self.stream is not None and self._own_execution:
            return self._streamed_slices(state, batches)
        executable = self._current = self._executable(state, batches)
        if executable.dispatched:
            state, outfeed = executable.compiled(state, batches)
            outfeed = self._finalize(outfeed)
            self._bound_in_flight(outfeed)
            return state, outfeed
        if executable.loop.form != loops.HOST:
            return self._dispatch(executable, state, batches)
        outfeeds = []
        for step in range(_leading(batches)):
            state, outfeed = self._dispatch(executable, state, _step_slice(batches, step))
            outfeeds.append(outfeed)
        return state, self._joined(outfeeds)

    def unattached(self, state: State, batches: Batch) -> tuple[State, Outputs]:
        """An execution on a system that never attaches to its IPUs (`PRE_COMPILE`).

        The program is compiled and its memory checked as for a run, but
        nothing runs: as on an IPU system that pre-compiles, everything the
        device would have returned is zeros.

        Args:
            state: The state an execution would take.
            batches: The execution's batches (arrays or shape structs).

        Returns:
            `(state, outfeed)`: the state as it was given (committed to its
            devices, as a run returns it), and an outfeed of
            the run's structure, shapes and dtypes holding zeros (host arrays).

        Raises:
            IPUOutOfMemoryError: When the program does not fit an IPU.

        Example:

        >>> state, logs = program.unattached(state, batches)  # logs are zeros
        """
        self._current = self._executable(state, batches)
        outfeed = jax.eval_shape(self._jitted, state, self._compiled_batches(batches))[1]
        outfeed = outfeed[0] if self._checks else outfeed  # without its error
        if self.stream is not None and self._own_execution:
            outfeed = outfeed[0]  # dispatched a slice at a time: (outfeed, streamed)
        # As a run's would be, the state that comes back is committed to its devices.
        return _committed(state), attachment.zeros_like(outfeed)

    def _streamed_slices(self, state: State, batches: Batch) -> tuple[State, Outputs]:
        """An own execution, one leading slice per dispatch, each slice's outputs streamed."""
        executable = self._current = self._executable(state, batches)
        outfeed = None
        for index in range(_leading(batches)):
            state, finalized = executable.compiled(state, _step_slice(batches, index))
            if executable.dispatched:
                finalized = self._finalize(finalized)
            outfeed, streamed = self._trapped(finalized)
            self._bound_in_flight(outfeed)
            self.stream.send_replicated(streamed)
        return state, outfeed

    def _dispatch(self, executable: _Executable, state: State, batches: Batch):
        """One call of the compiled program, keeping the calls in flight bounded."""
        state, outfeed = executable.compiled(state, batches)
        outfeed = self._trapped(outfeed)
        self._bound_in_flight(outfeed if jax.tree_util.tree_leaves(outfeed) else state)
        return state, outfeed

    def _trapped(self, outfeed: Outputs) -> Outputs:
        """The outfeed, once a checked execution is known to have raised no exception."""
        if not self._checks:
            return outfeed
        outfeed, error = outfeed
        floating_point.raise_first(error, self.mode)
        return outfeed

    def _joined(self, outfeeds: list) -> Any:
        """One execution's outfeed from its steps': predictions in order, else the last logs."""
        if self.mode != "predict":
            return outfeeds[-1]
        return jax.tree_util.tree_map(lambda *parts: jax.numpy.concatenate(parts), *outfeeds)

    def wait(self) -> None:
        """Blocks until every dispatched execution has finished."""
        while self._in_flight:
            jax.block_until_ready(self._in_flight.popleft())

    def _bound_in_flight(self, marker: Any) -> None:
        self._in_flight.append(jax.tree_util.tree_leaves(marker)[0])
        while len(self._in_flight) > self._max_in_flight:
            jax.block_until_ready(self._in_flight.popleft())

    def _executable(self, state: State, batches: Batch) -> _Executable:
        # Keyed by the batches alone: a program's state keeps its structure
        # (the Keras side makes a new program when the model changes).
        key = _signature(batches)
        executable = self._executables.get(key)
        if executable is None:
            executable = self._compile(state() if callable(state) else state, batches)
            self._executables[key] = executable
        elif executable.successor is not None and executable.successor.ready():
            # The loop compiled in the background: it runs from this execution on.
            # Its memory check or compile error raises here, before this execution
            # runs; as any failed compilation, it is not kept: the next call compiles anew.
            try:
                executable = self._executables[key] = executable.successor.take()
            except BaseException:
                del self._executables[key]
                raise
        return executable

    def _compiled_batches(self, batches: Batch) -> Batch:
        """What an own execution is compiled for: one leading slice when it streams."""
        if self.stream is not None and self._own_execution:
            return jax.tree_util.tree_map(_one_step_spec, batches)
        return batches

    def _trace(self, state: State, batches: Batch,
               choice: loops.LoopChoice | None = None) -> tuple[Any, Batch, loops.LoopChoice]:
        """Traces the program in its loop form: `(traced, batches it takes, choice)`."""
        if self._own_execution:
            choice = choice or loops.LoopChoice(loops.SCHEDULE, self._schedule_reason)
            compiled_batches = self._compiled_batches(batches)
            return self._traced(state, compiled_batches), compiled_batches, choice
        traced = None
        if self._loop_request != loops.HOST:
            # Decided on the whole execution's trace, which the on-device
            # loop then compiles: one trace in the common case.
            traced = self._traced(state, batches)
        jaxpr = traced.jaxpr if traced is not None else None
        choice = loops.choose_loop(jaxpr, self.device.platform, self._loop_request)
        if choice.form != loops.HOST:
            return traced, batches, choice
        one_step = jax.tree_util.tree_map(_one_step_spec, batches)
        return self._traced(state, one_step), one_step, choice

    def _traced(self, state: State, batches: Batch) -> Any:
        """The program traced; on CPUs with convolutions that keep XLA:CPU's fast path in loops.

        Convolutions the rewrite could not take stay as they are: the loop rule sees them.
        """
        return convolutions.trace_for(self.device.platform, self._jitted, state, batches)

    def _compile(self, state: State, batches: Batch) -> _Executable:
        started = time.perf_counter()
        choice = None
        if self._dispatched is not None:
            choice = self._dispatched.choose(state, batches, self.device.platform,
                                             self._loop_request)
            if choice.form == loops.HOST:
                executable = self._dispatched.compile(state, self._compiled_batches(batches))()
                if executable.cost is None and self._pipeline is None:
                    raise ValueError("A dispatched execution without a pipeline table must "
                                     "give its cost (DispatchedExecutable.cost).")
                return self._checked(executable.run, batches, executable.memory, executable.cost,
                                     choice, started, executable.compiler, dispatched=True)
        if choice is None and self._compiles_loop_in_background(batches):
            return self._step_first(state, batches, started)
        traced, compiled_batches, loop = self._trace(state, batches, choice)
        lowered = lowering.lower_for(self.device.platform, traced)
        options = compiler.choose_options(compiler.STEP, self.device.platform)
        compiled = compiler.compile_lowered(lowered, options)
        return self._measured(compiled, _Traced(traced, lowered, compiled_batches), options,
                              state, batches, loop, started)

    def _compiles_loop_in_background(self, batches: Batch) -> bool:
        """Whether the step runs alone while the on-device loop compiles (`background.py`).

        Not across processes: each would hand over when its own compilation
        ends, and their programs' collectives would no longer pair up. Not for
        every step's logs: the step form keeps only the last's (`_joined`).
        """
        return (not self._own_execution and self.stream is None
                and (self.last_outputs_only or self.mode == "predict")
                and not self.replicas.spans_processes
                and self._loop_request == loops.AUTO and _leading(batches) > 1
                and background.enabled(self.device.platform))

    def _step_first(self, state: State, batches: Batch, started: float) -> _Executable:
        """The step alone, compiled now; the on-device loop, compiled on a host thread.

        The step's executable runs the first executions (the `host` form) and
        hands over to the loop's once that has compiled (`_executable`).
        """
        platform = self.device.platform
        options = compiler.choose_options(compiler.STEP, platform)
        one_step = jax.tree_util.tree_map(_one_step_spec, batches)
        step_traced = self._traced(state, one_step)
        step = _Traced(step_traced, lowering.lower_for(platform, step_traced), one_step)
        step_compile = background.Compilation(compiler.compile_lowered, step.lowered, options)
        # XLA compiles the step without Python's lock: meanwhile the loop is traced.
        loop_started = time.perf_counter()
        traced = self._traced(state, batches)
        choice = loops.choose_loop(traced.jaxpr, platform, self._loop_request)
        if choice.form == loops.HOST:  # the step alone is the program
            return self._measured(step_compile.result(), step, options, state, batches, choice,
                                  started)
        loop = _Traced(traced, lowering.lower_for(platform, traced), batches)
        trace_seconds = time.perf_counter() - loop_started
        first = self._measured(step_compile.result(), step, options, state, batches,
                               loops.LoopChoice(loops.HOST, _STEP_FIRST_REASON), started)
        if not self._loop_surely_fits(first, batches, one_step):
            # The IPU refuses a program that does not fit before it runs: check the loop now.
            compiled = compiler.compile_lowered(loop.lowered, options)
            return self._measured(compiled, loop, options, state, batches, choice, started)
        # Only now: XLA's autotuning results for the step (its convolutions,
        # say) are then the loop's too, and the two compilations never time
        # kernels on the device at once.
        loop_compile = background.Compilation(compiler.compile_lowered, loop.lowered, options)
        specs = jax.tree_util.tree_map(_spec, (state, batches))

        def handover() -> _Executable:
            # Its report's compile time: the loop's tracing, lowering and compiling.
            seconds = trace_seconds + loop_compile.seconds
            return self._measured(loop_compile.result(), loop, options, *specs, choice,
                                  time.perf_counter() - seconds)

        first.successor = _Successor(loop_compile.done, handover)
        return first

    def _loop_surely_fits(self, step: _Executable, batches: Batch, one_step: Batch) -> bool:
        """Whether the loop fits an IPU with room to spare, judged by the step's memory.

        Beyond the step a loop holds the execution's other batches, and its
        temporaries differ little from the step's (ResNet50, 20 steps: 3.2 MB
        more of 630 MB, on CPU): a tenth of them is the margin.
        """
        other_batches = accounting.tree_bytes(batches) - accounting.tree_bytes(one_step)
        more = other_batches // self.replicas.count
        capacity = self.hardware.memory_capacity_bytes
        return all(use.total_bytes + more + use.temporary_bytes // 10 <= capacity
                   for use in step.memory)

    def _measured(self, compiled: Any, traced: _Traced, options: compiler.CompilerOptions,
                  state: State, batches: Batch, loop: loops.LoopChoice,
                  started: float) -> _Executable:
        """The executable of a compiled program, its memory checked and its cost counted."""
        compiled_batches, lowered = traced.batches, traced.lowered
        count = self.replicas.count
        compiled_steps = _leading(compiled_batches) * self.micro_batches_per_step
        # Per IPU: its replica's share of the state, and one batch in and out.
        execution_io = accounting.tree_bytes((compiled_batches, lowered.out_info[1]))
        # IPUs that share a device run batched in its program: each gets its share.
        sharing = self.replicas.ipus_per_device
        memory = accounting.memory_use(
            compiled, state_bytes=accounting.tree_bytes(state) // count,
            io_bytes=execution_io // (compiled_steps * count), ipus_per_device=sharing)
        # An IPU keeps 16-bit values in 16 bits, and streams its outfeed out; XLA:CPU does not.
        memory = precision.held_in_16_bits(memory, traced.traced.jaxpr, self.device.platform)
        memory = accounting.without_streamed_outfeed(
            memory, outfeed_bytes=accounting.tree_bytes(lowered.out_info[1]),
            steps=compiled_steps, replicas=count, ipus_per_device=sharing,
            platform=self.device.platform, batched_copy=self._pipeline is None,
            looped=_leading(compiled_batches) > 1)
        per_ipu = (memory,) * count
        if self._state_bytes is not None:  # IPUs that hold different state (a pipeline's)
            per_ipu = tuple(accounting.MemoryUse(0, 0, 0) if b is None
                            else dataclasses.replace(memory, state_bytes=b)
                            for b in self._state_bytes)
        if self._io_split is not None:  # IPUs that stream different data (a pipeline's)
            io = self._io_split(compiled_batches, lowered.out_info[1])
            per_ipu = tuple(use if not use.total_bytes else
                            dataclasses.replace(use, io_bytes=b // compiled_steps)
                            for use, b in zip(per_ipu, io, strict=True))
        # Counted over the program before XLA lowers it for this platform, its
        # loops with their trip counts: the execution's cost over its steps,
        # each IPU's share where IPUs share a device. Only the report needs
        # it, so it is counted when the report is read.
        def cost():
            return accounting.step_cost(lowered, steps=compiled_steps).per_ipu(sharing)

        return self._checked(compiled, batches, per_ipu, cost, loop, started,
                             options.describe())

    def _checked(self, compiled: Any, batches: Batch, memory: Sequence[accounting.MemoryUse],
                 cost: accounting.StepCost | Callable[[], accounting.StepCost] | None,
                 loop: loops.LoopChoice, started: float,
                 options: str = "", dispatched: bool = False) -> _Executable:
        """The executable, once each IPU's memory is checked; its report comes when read."""
        seconds = time.perf_counter() - started
        attachment.check_fits([(ipu.index, use) for ipu, use in zip(self.replicas.ipus, memory)],
                              self.mode, pipelined=self._pipeline is not None,
                              capacity=self.hardware.memory_capacity_bytes)
        report = functools.partial(self._report, batches, memory, cost, loop, seconds, options)
        executable = _Executable(compiled, report, loop, dispatched)
        executable.memory = tuple(memory)
        return executable

    def _report(self, batches: Batch, memory: Sequence[accounting.MemoryUse],
                cost: accounting.StepCost | Callable[[], accounting.StepCost] | None,
                loop: loops.LoopChoice, seconds: float, options: str) -> ExecutionReport:
        """The execution report, from each IPU's memory and the cost of a step."""
        # The cost is one batch's: each batch of the execution costs it. The replicas
        # sum their gradients once per step (weight update), after its micro-batches.
        micro = self.micro_batches_per_step
        steps = _leading(batches) * micro
        all_reduce = all_reduce_cycles(self.exchange_bytes_per_step, self.replica_count,
                                       self.hardware)
        pipeline_report = None
        if self._pipeline is not None:
            # The schedule's stage ops give cycles and flops alike, whether the
            # schedule program or the host-dispatched ops run them: the
            # program's own count is not needed.
            per_pass, pipeline_report = self._pipeline(self.hardware, batches)
            step_cycles = (per_pass + all_reduce) / micro
            flops = pipeline_report.flops_per_micro_batch
        else:
            cost = cost() if callable(cost) else cost
            step_cycles = cost.cycles(self.hardware) + all_reduce / micro
            flops = cost.flops
        cycles = int(round(step_cycles * steps))
        report = ExecutionReport(
            mode=self.mode,
            hardware=f"{self.hardware.name} ({self.hardware.version})",
            clock_hz=self.hardware.clock_hz,
            steps_per_execution=steps,
            ipus=tuple(
                IPUReport(
                    index=ipu.index,
                    memory_bytes=use.total_bytes,
                    memory_capacity_bytes=self.hardware.memory_capacity_bytes,
                    estimated_cycles=cycles,
                    state_bytes=use.state_bytes,
                    temporary_bytes=use.temporary_bytes + use.code_bytes,
                    io_bytes=use.io_bytes,
                    device=str(ipu.device),
                )
                for ipu, use in zip(self.replicas.ipus, memory)
            ),
            flops_per_step=flops,
            compile_seconds=seconds,
            replicas=self.replica_count,
            pipeline=pipeline_report,
            loop=loop.form,
            loop_reason=loop.reason,
            compiler=options,
        )
        return report


def _leading(batches: Batch) -> int:
    return jax.tree_util.tree_leaves(batches)[0].shape[0]


def _step_slice(batches: Batch, step: int) -> Batch:
    """The batches of one step, keeping the leading steps axis (length 1)."""
    return jax.tree_util.tree_map(lambda a: a[step : step + 1], batches)


def _spec(leaf: Any) -> jax.ShapeDtypeStruct:
    """A leaf's shape and dtype (an array the next execution may consume, or a spec)."""
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)


def _one_step_spec(leaf: Any) -> jax.ShapeDtypeStruct:
    """The shape of one step's slice of a stacked leaf (array or shape struct)."""
    sharding = getattr(leaf, "sharding", None)
    return jax.ShapeDtypeStruct((1, *leaf.shape[1:]), leaf.dtype, sharding=sharding)


def _signature(tree: Any) -> Sequence[Any]:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return (treedef, tuple((leaf.shape, leaf.dtype) for leaf in leaves))


def _last_outputs_loop(body: Callable, state: State, batches: Batch) -> tuple[State, Outputs]:
    """`lax.scan(body, state, batches)` that carries the last step's outputs, `[1, ...]`.

    The carry needs the outputs' shapes before the loop: the step is traced
    once under `jit`, whose trace cache the loop's own trace then hits.
    """
    step = jax.jit(body)
    one = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), batches)
    _, shapes = jax.eval_shape(step, state, one)
    last = jax.tree_util.tree_map(lambda s: jax.numpy.zeros((1, *s.shape), s.dtype), shapes)

    def carried(carry, batch):
        state, outputs = step(carry[0], batch)
        return (state, jax.tree_util.tree_map(lambda a: a[None], outputs)), None

    (state, last), _ = jax.lax.scan(carried, (state, last), batches)
    return state, last


def _committed(tree: Any) -> Any:
    """`tree` with its arrays committed to the devices they are on."""
    return jax.tree_util.tree_map(
        lambda a: a if not isinstance(a, jax.Array) or a.committed
        else jax.device_put(a, a.sharding), tree)
