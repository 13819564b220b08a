"""Pipeline schedules as data: which IPU runs which stage's pass for which micro-batch, when.

A pipelined model splits into `p` stages; stage `s` runs on IPU `device_mapping[s]`.
One execution pushes `m` micro-batches through the stages. Each micro-batch `k`
needs the forward pass `F(s, k)` of every stage in order and, when training, the
backward pass `B(s, k)` of every stage in reverse order. A schedule places these
ops on a grid of *ticks* (bulk-synchronous supersteps): in a tick each IPU runs at
most one op, then all IPUs sync and exchange. An op may only use results of
earlier ticks, so every schedule obeys

* `F(s, k)` strictly after `F(s - 1, k)`;
* `B(p - 1, k)` strictly after `F(p - 1, k)`, and `B(s, k)` strictly after `B(s + 1, k)`;
* one op per IPU per tick, and every op exactly once.

Ticks in which no IPU has work are left out of the table: they would last no time.

The three schedules of IPU TensorFlow's `PipelineSchedule`, as built here:

* **Sequential** ("as if it were a sharded model", a debug mode): one op in the
  whole system per tick, micro-batch after micro-batch: `F(0..p-1, k)` and, when
  training, `B(p-1..0, k)`, then micro-batch `k + 1`. `T = 2pm` ticks (`pm` for
  inference). Only one IPU works at a time, so the utilisation is
  `1 / num_ipus`, whatever the costs.
* **Grouped** (the default; "the forward and backward stages are grouped together
  on each IPU; all IPUs alternate between executing a forward pass and then a
  backward pass"): when training, ticks alternate between forward-only and
  backward-only ticks. In pipeline step `j` the forward tick runs `F(s, j - s)` on
  every stage and the backward tick runs `B(s, j - (2p - 2 - s))`, where those are
  valid micro-batches; the last stage therefore runs the backward of the
  micro-batch it forwarded in the same step. There are `m + 2p - 2` steps, but the
  first `p - 1` steps have no backward work and the last `p - 1` no forward work,
  so `T = 2(m + p - 1)` ticks: `m + p - 1` forward ticks and as many backward
  ticks. Stage `s` stashes `min(m, 2(p - 1 - s) + 1)` activations. Inference
  runs the forward ticks only, `F(s, j - s)`, `T = m + p - 1`.
* **Interleaved** ("backward passes are scheduled whenever the forward passes have
  just generated some activations; fewer activations are stored"): 1F1B, also
  called PipeDream-Flush. In every tick each IPU runs one ready op, a ready
  backward before a forward and the lowest micro-batch first, with at most
  `p - s` micro-batches in flight on stage `s` (forward done, backward not), so
  stage `s` stashes `min(m, p - s)` activations. `T = 2(m + p - 1)` ticks, like
  Grouped, but most ticks mix forward and backward ops, and a bulk-synchronous
  tick lasts as long as its slowest op: with unequal forward and backward costs
  Interleaved is slower than Grouped, as the reference warns. Unlike IPU
  TensorFlow, it also trains with several stages on one IPU (see
  `build_schedule`). Inference is the same as Grouped inference.

One greedy list scheduler builds all three, parameterised by the rules above:
phase alternation (Grouped training), backward-first with an in-flight cap
(Interleaved training), one op per tick (Sequential). When several stages share
an IPU the same rules apply per IPU. See `closed_form_utilisation` for the
utilisation formulas the tables reproduce.

Pure Python and NumPy; executors read `ScheduleTable.ticks`.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

FORWARD = "F"
BACKWARD = "B"
# A backward pass costs about twice its forward pass (two matmuls per matmul).
DEFAULT_BACKWARD_FACTOR = 2.0


class PipelineSchedule(enum.Enum):
    """How stages are interleaved on the IPUs that serve the pipeline.

    The forward and backward passes of each stage execute on the same IPUs. So,
    in the core of the pipeline there is a choice as to whether to run the
    forward stages together, or the backward stages and the forward stages
    together.

    * `Grouped`: groups the forward passes on multiple IPUs. This requires more
      memory since activations need to be stored until the backward stages run
      together. However, since forward passes tend to be smaller than backward
      passes, Grouped tends to improve the speed of the execution, as different
      IPUs don't spend so much time waiting for each other.
    * `Interleaved`: schedules the backward passes whenever the forward passes
      have just generated some activations. Consequently fewer activations are
      required to be stored between the forward and backward pipeline stages, so
      less memory is required. However, since forward and backward stages tend to
      be very different in terms of execution cycles, the overall performance of
      the pipeline tends to be slower.
    * `Sequential`: a debug mode, where the pipeline is scheduled in the same
      way as if it were a sharded model.

    Example:

    >>> build_schedule(PipelineSchedule.Interleaved, 2, 4).num_ticks
    10
    """

    Grouped = 0
    Interleaved = 1
    Sequential = 2


class RecomputationMode(enum.Enum):
    """How activations are recomputed in the backward passes of a training pipeline.

    Recomputation reduces the number of activations stored on the device at any
    given time. It is switched on with the IPU configuration; this mode selects
    the implementation:

    * `Auto`: automatically try and select the best recomputation strategy based
      on the provided model and pipeline schedule.
    * `RecomputeThenBackpropagate`: first recompute all the activations and then
      perform backpropagation. This mode allows for better code reuse as the
      forward propagation and the recomputation share the exact same code.
      Supported by the Grouped and Interleaved schedules, and their default.
    * `RecomputeAndBackpropagateInterleaved`: recompute and backpropagate
      operations are interleaved together. This can reduce the maximum liveness
      compared to `RecomputeThenBackpropagate`, as the backpropagation operations
      can be scheduled as soon as possible, but less code can be reused.
      Supported by the Grouped and Sequential schedules, and the default of
      Sequential.

    The device model does not change the schedule tables for a mode. Under
    `RecomputeAndBackpropagateInterleaved` (and `Auto` with the Sequential
    schedule) a stage also keeps its recomputation checkpoints and
    recomputes only what follows them (`keras_ipu.device.checkpoints`).

    Example:

    >>> RecomputationMode.Auto.value
    0
    """

    Auto = 0
    RecomputeThenBackpropagate = 1
    RecomputeAndBackpropagateInterleaved = 2


class Op(NamedTuple):
    """One pass of one stage on one micro-batch.

    Args:
        stage: The pipeline stage, `0..num_stages - 1`.
        micro_batch: The micro-batch within the execution, `0..num_micro_batches - 1`.
        phase: `"F"` for the forward pass, `"B"` for the backward pass.

    Example:

    >>> str(Op(0, 3, "F"))
    'F0.3'
    """

    stage: int
    micro_batch: int
    phase: str

    def __str__(self) -> str:
        return f"{self.phase}{self.stage}.{self.micro_batch}"


Tick = tuple[Op | None, ...]


@dataclasses.dataclass(frozen=True)
class ScheduleTable:
    """The timetable of one execution of a pipeline: what each IPU runs at each tick.

    Args:
        schedule: The `PipelineSchedule` it follows.
        num_stages: `p`, the number of pipeline stages.
        num_micro_batches: `m`, the micro-batches of one execution.
        device_mapping: The IPU of each stage (`device_mapping[s]`).
        training: Whether backward passes are scheduled.
        ticks: Per tick, per IPU (index = IPU), the `Op` it runs or `None` (idle).

    Example:

    >>> table = build_schedule(PipelineSchedule.Grouped, 2, 2)
    >>> print(table.to_text())
    Grouped training: 2 stages on 2 IPUs, 2 micro-batches, 6 ticks
    IPU0 | F0.0 F0.1 .    .    B0.0 B0.1
    IPU1 | .    F1.0 B1.0 F1.1 B1.1 .
    >>> table.stash_counts()
    (2, 1)
    """

    schedule: PipelineSchedule
    num_stages: int
    num_micro_batches: int
    device_mapping: tuple[int, ...]
    training: bool
    ticks: tuple[Tick, ...]

    @property
    def num_ipus(self) -> int:
        """IPUs the pipeline occupies: `max(device_mapping) + 1`."""
        return max(self.device_mapping) + 1

    @property
    def num_ticks(self) -> int:
        """Ticks (bulk-synchronous supersteps) of one execution."""
        return len(self.ticks)

    def ops_of(self, ipu: int) -> tuple[Op, ...]:
        """The ops IPU `ipu` runs, in order.

        Args:
            ipu: An IPU index, `0..num_ipus - 1`.

        Returns:
            A tuple of `Op`, idle ticks left out.

        Raises:
            ValueError: If `ipu` is not one of the pipeline's IPUs.
        """
        if not 0 <= ipu < self.num_ipus:
            raise ValueError(
                f"IPU {ipu} is not in this pipeline; valid IPUs are 0..{self.num_ipus - 1}."
            )
        return tuple(tick[ipu] for tick in self.ticks if tick[ipu] is not None)

    def stash_counts(self) -> tuple[int, ...]:
        """Per stage, the most micro-batches whose activations it holds at once.

        A stage stashes a micro-batch's activations from the end of its forward
        pass until its backward pass has run. Inference stashes nothing.

        Returns:
            A tuple of `num_stages` ints.
        """
        peak = [0] * self.num_stages
        if not self.training:
            return tuple(peak)
        live = [0] * self.num_stages
        for tick in self.ticks:
            for op in tick:
                if op is not None:
                    live[op.stage] += 1 if op.phase == FORWARD else -1
            peak = [max(a, b) for a, b in zip(peak, live, strict=True)]
        return tuple(peak)

    def exchange_blocks(self, max_size: int = 2) -> tuple[tuple[int | None, ...], ...]:
        """Groups of consecutive ticks between which IPUs exchange messages.

        An op that takes another stage's output (a forward op of stage `s > 0`
        takes stage `s - 1`'s activations, a backward op of stage `s < p - 1`
        takes stage `s + 1`'s gradients) must not share a block with the op
        that produced it; everything else may, so an executor can run a
        block's ticks back to back and exchange messages once per block.
        Blocks are filled greedily up to `max_size` ticks, then padded with
        `None` (an idle tick) to that size.

        Args:
            max_size: The most ticks in a block (1: one exchange per tick).

        Returns:
            A tuple of blocks, each a tuple of `max_size` tick indices or `None`.

        Example:

        >>> build_schedule(PipelineSchedule.Grouped, 2, 3).exchange_blocks()
        ((0, None), (1, 2), (3, 4), (5, 6), (7, None))
        """
        producer = {}
        last = self.num_stages - 1
        for t, tick in enumerate(self.ticks):
            for op in tick:
                if op is not None:
                    producer[op] = t
        blocks: list[list[int]] = [[]]
        for t, tick in enumerate(self.ticks):
            needs = [
                producer[Op(op.stage - 1 if op.phase == FORWARD else op.stage + 1,
                            op.micro_batch, op.phase)]
                for op in tick
                if op is not None and ((op.phase == FORWARD and op.stage > 0)
                                       or (op.phase == BACKWARD and op.stage < last))
            ]
            if len(blocks[-1]) == max_size or any(n in blocks[-1] for n in needs):
                blocks.append([])
            blocks[-1].append(t)
        return tuple(tuple(block) + (None,) * (max_size - len(block)) for block in blocks)

    def tick_cycles(
        self,
        forward_cycles: float | Sequence[float],
        backward_cycles: float | Sequence[float] | None = None,
    ) -> tuple[float, ...]:
        """How long each tick lasts: the cost of its slowest op.

        Args:
            forward_cycles: The cycles of each stage's forward pass: one number
                for all stages or one per stage.
            backward_cycles: The same for backward passes; default `None` means
                twice the forward cycles.

        Returns:
            A tuple of `num_ticks` floats.

        Raises:
            ValueError: If a cost is negative or there is not one per stage.
        """
        costs = self._op_costs(forward_cycles, backward_cycles)
        return tuple(
            max((costs[op.phase][op.stage] for op in tick if op is not None), default=0.0)
            for tick in self.ticks
        )

    def total_cycles(
        self,
        forward_cycles: float | Sequence[float],
        backward_cycles: float | Sequence[float] | None = None,
    ) -> float:
        """Cycles of one execution: the sum of the tick durations (see `tick_cycles`)."""
        return float(sum(self.tick_cycles(forward_cycles, backward_cycles)))

    def stage_busy_cycles(
        self,
        forward_cycles: float | Sequence[float],
        backward_cycles: float | Sequence[float] | None = None,
    ) -> tuple[float, ...]:
        """Per IPU, the cycles it spends running ops (arguments as in `tick_cycles`).

        Returns:
            A tuple of `num_ipus` floats (index = IPU).
        """
        costs = self._op_costs(forward_cycles, backward_cycles)
        busy = [0.0] * self.num_ipus
        for tick in self.ticks:
            for ipu, op in enumerate(tick):
                if op is not None:
                    busy[ipu] += costs[op.phase][op.stage]
        return tuple(busy)

    def utilisation(
        self,
        forward_cycles: float | Sequence[float] = 1.0,
        backward_cycles: float | Sequence[float] | None = None,
    ) -> float:
        """The fraction of IPU time spent running ops.

        Busy time is the sum of all op costs; total time is `num_ipus` times the
        sum of the tick durations, a tick lasting as long as its slowest op.

        Args:
            forward_cycles: As in `tick_cycles`; default 1 cycle per stage.
            backward_cycles: As in `tick_cycles`; default twice the forward cycles.

        Returns:
            A float in `[0, 1]`; 0 when all costs are 0.

        Example:

        >>> build_schedule(PipelineSchedule.Grouped, 2, 4).utilisation(1.0, 2.0)
        0.8
        """
        total = self.num_ipus * self.total_cycles(forward_cycles, backward_cycles)
        if total == 0:
            return 0.0
        return sum(self.stage_busy_cycles(forward_cycles, backward_cycles)) / total

    def to_text(self) -> str:
        """A readable grid: one row per IPU, one column per tick.

        Cells read `F0.3` (forward of stage 0 on micro-batch 3), `B1.0`
        (backward of stage 1 on micro-batch 0) or `.` (idle).
        """
        mode = "training" if self.training else "inference"
        lines = [
            f"{self.schedule.name} {mode}: {self.num_stages} stages on {self.num_ipus} IPUs, "
            f"{self.num_micro_batches} micro-batches, {self.num_ticks} ticks"
        ]
        cells = [[str(op) if op is not None else "." for op in tick] for tick in self.ticks]
        width = max((len(cell) for tick in cells for cell in tick), default=1)
        label = len(f"IPU{self.num_ipus - 1}")
        for ipu in range(self.num_ipus):
            row = " ".join(tick[ipu].ljust(width) for tick in cells)
            lines.append(f"{f'IPU{ipu}'.ljust(label)} | {row}".rstrip())
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.to_text()

    def _op_costs(
        self,
        forward_cycles: float | Sequence[float],
        backward_cycles: float | Sequence[float] | None,
    ) -> dict[str, tuple[float, ...]]:
        forward = _per_stage(forward_cycles, self.num_stages, "forward_cycles")
        if backward_cycles is None:
            backward = tuple(DEFAULT_BACKWARD_FACTOR * cost for cost in forward)
        else:
            backward = _per_stage(backward_cycles, self.num_stages, "backward_cycles")
        return {FORWARD: forward, BACKWARD: backward}


def build_schedule(
    schedule: PipelineSchedule | int | str,
    num_stages: int,
    num_micro_batches: int,
    device_mapping: Sequence[int] | None = None,
    training: bool = True,
) -> ScheduleTable:
    """The timetable of one execution of `m` micro-batches through `p` stages.

    See the module docstring for the rules of each schedule.

    Args:
        schedule: A `PipelineSchedule` (or its value or name).
        num_stages: `p >= 1`. The public pipeline API needs 2 or more; one stage
            is allowed here so a single-stage program has a table too.
        num_micro_batches: `m >= 1`, micro-batches per execution (the gradient
            accumulation count when training).
        device_mapping: The IPU of each stage; default `None` maps stage `i` to
            IPU `i`. IPUs `0..max(device_mapping)` take part.
        training: Whether to schedule backward passes.

    Returns:
        A `ScheduleTable`.

    Raises:
        ValueError: For an unknown schedule, fewer than 1 stage or micro-batch, or
            a device mapping that is not one non-negative int per stage.

    Unlike the reference, Interleaved training with several stages on one
    IPU is supported: its rules (backward first, at most p - s micro-batches
    in flight on stage s) apply per IPU, one op per tick.

    Example:

    >>> table = build_schedule(PipelineSchedule.Interleaved, 2, 4)
    >>> [str(op) for op in table.ops_of(0)]
    ['F0.0', 'F0.1', 'B0.0', 'F0.2', 'B0.1', 'F0.3', 'B0.2', 'B0.3']
    """
    schedule = _parse_schedule(schedule)
    p = _check_count(num_stages, "num_stages")
    m = _check_count(num_micro_batches, "num_micro_batches")
    mapping = _check_mapping(device_mapping, p)
    training = bool(training)
    ticks = _list_schedule(schedule, p, m, mapping, training)
    return ScheduleTable(
        schedule=schedule,
        num_stages=p,
        num_micro_batches=m,
        device_mapping=mapping,
        training=training,
        ticks=ticks,
    )


def minimum_micro_batches(schedule: PipelineSchedule | int | str, num_stages: int) -> int:
    """The fewest micro-batches per execution for which the schedule fills the pipeline.

    Grouped and Interleaved need `p` micro-batches: only then is there a tick in
    which every stage works (Grouped's steady state; for Interleaved, stage 0
    reaches its in-flight cap of `p` and the one-forward-one-backward phase
    starts). Sequential never overlaps stages, so 1 micro-batch suffices. The
    runtime rejects a smaller `steps_per_execution` (or gradient accumulation
    count), naming this minimum. The reference tutorial's divisibility advice
    (a multiple of `2p` for Grouped, of `p` for Interleaved) is not a requirement
    of these tables and is not enforced.

    Args:
        schedule: A `PipelineSchedule` (or its value or name).
        num_stages: `p >= 1`.

    Returns:
        `p` for Grouped and Interleaved, 1 for Sequential.

    Raises:
        ValueError: For an unknown schedule or fewer than 1 stage.

    Example:

    >>> minimum_micro_batches(PipelineSchedule.Grouped, 4)
    4
    """
    schedule = _parse_schedule(schedule)
    p = _check_count(num_stages, "num_stages")
    return 1 if schedule is PipelineSchedule.Sequential else p


def closed_form_utilisation(
    schedule: PipelineSchedule | int | str,
    p: int,
    m: int,
    forward: float = 1.0,
    backward: float | None = None,
    training: bool = True,
) -> float:
    """The utilisation of a schedule with equal stages, one stage per IPU, by formula.

    Every stage's forward pass costs `f` and its backward pass `b`; a tick lasts
    as long as its slowest op. Then for `p` stages and `m` micro-batches:

    * Sequential: `1 / p` (one IPU works at a time), training or inference.
    * Grouped training: `m / (m + p - 1)` for any `f`, `b`: there are `m + p - 1`
      forward-only ticks and as many backward-only ticks, and each IPU runs
      `m` of each: `m (f + b) / ((m + p - 1)(f + b))`.
    * Interleaved training: also `2(m + p - 1)` ticks, but of three kinds. For
      `p >= 2` and `m >= 2`, `p` ticks are forward-only (the ramp-up), `p + 1`
      backward-only (the first backward, alone on the last stage, and the
      ramp-down) and the other `2m - 3` mix both, lasting `max(f, b)`:
      `m (f + b) / (p f + (p + 1) b + (2m - 3) max(f, b))`.
      With `f = b` this is `m / (m + p - 1)`, as for Grouped; with `b = 2f` it
      is `3m / (4m + 3p - 4)`, which tends to `3/4`, not 1: the mixed ticks
      wait for the backward. With `m = 1` nothing overlaps: `1 / p`.
    * Inference (Grouped or Interleaved): `m / (m + p - 1)`.
    * One stage (`p = 1`): 1 for every schedule.

    Args:
        schedule: A `PipelineSchedule` (or its value or name).
        p: Stages (`>= 1`), one per IPU.
        m: Micro-batches (`>= 1`).
        forward: `f`, cycles of one forward pass.
        backward: `b`, cycles of one backward pass; default `None` means `2 f`.
        training: Whether backward passes run.

    Returns:
        The utilisation, a float in `(0, 1]`.

    Raises:
        ValueError: For an unknown schedule, `p` or `m` below 1, or a cost that
            is not positive.

    Example:

    >>> closed_form_utilisation(PipelineSchedule.Grouped, 4, 16)
    0.8421052631578947
    """
    schedule = _parse_schedule(schedule)
    p = _check_count(p, "p")
    m = _check_count(m, "m")
    f = float(forward)
    b = DEFAULT_BACKWARD_FACTOR * f if backward is None else float(backward)
    if not (f > 0 and b > 0):
        raise ValueError(f"Pass costs must be positive, got forward={f} and backward={b}.")
    if p == 1:
        return 1.0
    if schedule is PipelineSchedule.Sequential or m == 1:
        return 1.0 / p
    if not training or schedule is PipelineSchedule.Grouped:
        return m / (m + p - 1)
    # Interleaved training: forward-only, backward-only and mixed ticks.
    total = p * f + (p + 1) * b + (2 * m - 3) * max(f, b)
    return m * (f + b) / total


def _list_schedule(
    schedule: PipelineSchedule,
    p: int,
    m: int,
    mapping: tuple[int, ...],
    training: bool,
) -> tuple[Tick, ...]:
    """Greedy list scheduling of the micro-batches' op chains onto ticks."""
    num_ipus = max(mapping) + 1
    chain_length = 2 * p if training else p
    interleaved = schedule is PipelineSchedule.Interleaved and training
    sequential = schedule is PipelineSchedule.Sequential
    # Grouped training alternates forward-only and backward-only ticks.
    phases: tuple[str | None, ...] = (
        (FORWARD, BACKWARD) if schedule is PipelineSchedule.Grouped and training else (None,)
    )

    def op_at(micro_batch: int, position: int) -> Op:
        if position < p:
            return Op(position, micro_batch, FORWARD)
        return Op(chain_length - 1 - position, micro_batch, BACKWARD)

    # Each micro-batch's ops form a chain, so at most one op per micro-batch is
    # ready at a time: position[k] is micro-batch k's next op. A tick picks from
    # the chains' next ops before advancing any chain, so an op always runs in a
    # later tick than its predecessor.
    position = [0] * m
    in_flight = [0] * p
    active: list[int] = []  # started, not finished, ascending
    next_new = 0  # lowest micro-batch not started yet
    remaining = m * chain_length
    ticks: list[Tick] = []
    step = 0
    empty_in_a_row = 0
    while remaining:
        phase = phases[step % len(phases)]
        step += 1
        now = len(ticks)
        # Only the lowest unstarted micro-batch can compete: later ones start on
        # the same IPU with lower priority.
        candidates = active + ([next_new] if next_new < m else [])
        ready = []
        for k in candidates:
            op = op_at(k, position[k])
            if phase is not None and op.phase != phase:
                continue
            if interleaved and op.phase == FORWARD and in_flight[op.stage] >= p - op.stage:
                continue
            ready.append(op)
        if interleaved:
            # With one stage per IPU the cap alone already keeps a stage from
            # having both a ready backward and an allowed forward; preferring the
            # backward states the rule rather than relying on that.
            ready.sort(key=lambda op: (op.phase != BACKWARD, op.micro_batch))
        else:
            ready.sort(key=lambda op: op.micro_batch)
        tick: list[Op | None] = [None] * num_ipus
        for op in ready:
            ipu = mapping[op.stage]
            if tick[ipu] is None:
                tick[ipu] = op
                if sequential:
                    break
        chosen = [op for op in tick if op is not None]
        if not chosen:
            empty_in_a_row += 1
            if empty_in_a_row >= len(phases):  # pragma: no cover - a bug, not a user error
                raise RuntimeError(f"{schedule.name} schedule made no progress at tick {now}.")
            continue
        empty_in_a_row = 0
        for op in chosen:
            k = op.micro_batch
            if position[k] == 0:
                active.append(k)
                next_new += 1
            position[k] += 1
            if training:
                in_flight[op.stage] += 1 if op.phase == FORWARD else -1
            if position[k] == chain_length:
                active.remove(k)
        remaining -= len(chosen)
        ticks.append(tuple(tick))
    return tuple(ticks)


def _parse_schedule(schedule: Any) -> PipelineSchedule:
    if isinstance(schedule, PipelineSchedule):
        return schedule
    if isinstance(schedule, str) and schedule in PipelineSchedule.__members__:
        return PipelineSchedule[schedule]
    if isinstance(schedule, (int, np.integer)) and not isinstance(schedule, bool):
        for member in PipelineSchedule:
            if member.value == schedule:
                return member
    raise ValueError(
        f"Unknown pipeline schedule {schedule!r}. Valid schedules are "
        f"{', '.join(f'PipelineSchedule.{name}' for name in PipelineSchedule.__members__)}."
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _check_count(value: Any, name: str) -> int:
    if not _is_int(value) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}.")
    return int(value)


def _check_mapping(device_mapping: Sequence[int] | None, p: int) -> tuple[int, ...]:
    if device_mapping is None:
        return tuple(range(p))
    mapping = tuple(device_mapping)
    if len(mapping) != p:
        raise ValueError(
            f"Each stage must be mapped to an IPU: {len(mapping)} mappings != {p} stages "
            f"(device_mapping={list(mapping)})."
        )
    bad = [ipu for ipu in mapping if not _is_int(ipu) or ipu < 0]
    if bad:
        raise ValueError(
            f"device_mapping entries must be non-negative int IPU indices, got "
            f"{bad} in {list(mapping)}."
        )
    return tuple(int(ipu) for ipu in mapping)


def _per_stage(cycles: float | Sequence[float], p: int, name: str) -> tuple[float, ...]:
    values = np.asarray(cycles, dtype=float)
    if values.ndim == 0:
        values = np.full(p, float(values))
    if values.shape != (p,):
        raise ValueError(
            f"{name} must be one number or one per stage ({p} stages), got {values.tolist()}."
        )
    if (values < 0).any():
        raise ValueError(f"{name} must be non-negative, got {values.tolist()}.")
    return tuple(float(v) for v in values)


__all__ = [
    "Op",
    "PipelineSchedule",
    "RecomputationMode",
    "ScheduleTable",
    "build_schedule",
    "closed_form_utilisation",
    "minimum_micro_batches",
]
