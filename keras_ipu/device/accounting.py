"""Per-IPU memory and cycle estimates of an execution program."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np

from keras_ipu.device import cost
from keras_ipu.device.hardware import IPUHardware


@dataclasses.dataclass(frozen=True)
class MemoryUse:
    """Bytes one IPU needs to run a program.

    Args:
        state_bytes: Weights, optimizer slots and metric state (always live).
        temporary_bytes: XLA's temporaries (activations, gradients, workspace).
        io_bytes: One step's infeed and outfeed buffers; the rest of an
            execution's data streams from the host, as on an IPU.
        code_bytes: Generated code, where the backend reports it.
    """

    state_bytes: int
    temporary_bytes: int
    io_bytes: int
    code_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        """All bytes the IPU needs."""
        return self.state_bytes + self.temporary_bytes + self.io_bytes + self.code_bytes


@dataclasses.dataclass(frozen=True)
class StepCost:
    """The cost of one step, counted over the program before any backend lowers it.

    See `keras_ipu.device.cost` for what counts; the figures are per IPU and
    the same whichever platform (CPU, GPU) runs the device model.

    Args:
        flops: Floating point operations.
        transcendentals: Transcendental operations (exp, tanh, ...).
        bytes_accessed: Bytes read and written.
        half_flops: Of `flops`, matrix work on 16-bit floats, which the IPU
            runs at its fp16 rate.

    Example:

    >>> mk2 = hardware_for("ipu2")  # 32 fp32 flops per cycle on each of 1,472 tiles
    >>> StepCost(flops=4_710_400.0, transcendentals=0.0, bytes_accessed=0.0).compute_cycles(mk2)
    100.0
    """

    flops: float
    transcendentals: float
    bytes_accessed: float
    half_flops: float = 0.0

    def compute_cycles(self, hardware: IPUHardware) -> float:
        """Cycles of the arithmetic at peak rates: 16-bit matrix work at the fp16 rate.

        Args:
            hardware: The IPU whose rates count.

        Returns:
            The cycles.
        """
        single = self.flops - self.half_flops + self.transcendentals
        return (single / hardware.flops_per_cycle(half_precision=False)
                + self.half_flops / hardware.flops_per_cycle(half_precision=True))

    def work_cycles(self, hardware: IPUHardware) -> float:
        """Compute or memory cycles, whichever is larger (no sync).

        Args:
            hardware: The IPU whose rates count.

        Returns:
            The cycles.
        """
        bandwidth = hardware.memory_bytes_per_cycle_per_tile * hardware.compute_tiles
        memory = self.bytes_accessed / bandwidth
        return max(self.compute_cycles(hardware), memory)

    def cycles(self, hardware: IPUHardware) -> float:
        """Estimated IPU cycles: the slower of compute and memory, plus a sync.

        A bulk-synchronous step costs at least its compute time at peak
        flops and its memory traffic at the tiles' bandwidth; they overlap,
        so the larger one counts, plus one sync and exchange set-up.

        Args:
            hardware: The IPU whose rates count.

        Returns:
            The cycles.
        """
        return self.work_cycles(hardware) + hardware.sync_cycles

    def per_step(self, steps: int) -> StepCost:
        """This cost (of a program running `steps` steps) shared out over its steps.

        Args:
            steps: Steps the counted program runs (at least 1).

        Returns:
            The cost of one step.

        Raises:
            ValueError: For fewer than one step.
        """
        if steps < 1:
            raise ValueError(f"steps must be at least 1, got {steps}.")
        return StepCost(self.flops / steps, self.transcendentals / steps,
                        self.bytes_accessed / steps, self.half_flops / steps)

    @classmethod
    def total(cls, parts: Iterable[tuple[StepCost, float]]) -> StepCost:
        """The weighted sum of costs (`(cost, weight)` pairs).

        Args:
            parts: The costs and how many times each counts.

        Returns:
            The sum.
        """
        parts = list(parts)
        return cls(
            flops=sum(c.flops * w for c, w in parts),
            transcendentals=sum(c.transcendentals * w for c, w in parts),
            bytes_accessed=sum(c.bytes_accessed * w for c, w in parts),
            half_flops=sum(c.half_flops * w for c, w in parts),
        )

    def per_ipu(self, ipus_per_device: int) -> StepCost:
        """One IPU's share of a device program that runs `ipus_per_device` IPUs batched.

        Args:
            ipus_per_device: IPUs the program runs on one device (1 when none share).

        Returns:
            The cost with every count divided among those IPUs.

        Example:

        >>> StepCost(800.0, 0.0, 80.0).per_ipu(4).flops
        200.0
        """
        return StepCost(self.flops / ipus_per_device, self.transcendentals / ipus_per_device,
                        self.bytes_accessed / ipus_per_device,
                        self.half_flops / ipus_per_device)


def tree_bytes(tree: Any) -> int:
    """Bytes of all array leaves of a pytree (arrays or shape structs)."""
    return int(
        sum(
            int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
            for leaf in jax.tree_util.tree_leaves(tree)
        )
    )


def memory_use(compiled: Any, *, state_bytes: int, io_bytes: int,
               ipus_per_device: int = 1) -> MemoryUse:
    """The memory a compiled execution needs on one of its IPUs.

    Args:
        compiled: A `jax.stages.Compiled` execution program. XLA's memory
            analysis of a replicated program is per device already.
        state_bytes: One IPU's state (its replica's weights, slots, metrics).
        io_bytes: One IPU's infeed and outfeed buffers for one batch.
        ipus_per_device: IPUs that share each device, batched in one device
            program: each is accounted an equal share of its temporaries
            (its code, which each IPU would hold, is counted whole).

    Returns:
        The `MemoryUse` of one IPU.
    """
    analysis = compiled.memory_analysis()
    temporary = getattr(analysis, "temp_size_in_bytes", 0) if analysis else 0
    code = getattr(analysis, "generated_code_size_in_bytes", 0) if analysis else 0
    return MemoryUse(
        state_bytes=int(state_bytes),
        temporary_bytes=int(temporary) // ipus_per_device,
        io_bytes=int(io_bytes),
        code_bytes=int(code),
    )


def without_streamed_outfeed(use: MemoryUse, *, outfeed_bytes: int, steps: int,
                             replicas: int, ipus_per_device: int, platform: str,
                             batched_copy: bool = True, looped: bool = True) -> MemoryUse:
    """`use` without the copies of its execution's outfeed that XLA:CPU makes for replicas.

    A replicated program returns its outfeed stacked with a replica axis;
    XLA:CPU builds that stack, every step of every replica, in a temporary of
    each device before it copies it out (a predict of 64 steps on 2 replicas:
    8.3 MB where one replica's program holds 0.13 MB); where IPUs share a
    device (batched), the device first stacks its own replicas' too. An IPU
    streams its outfeed to the host step by step: one step of its own replica
    is its (what one replica's program holds), the rest is no IPU's.

    Args:
        use: The memory use measured on `platform`, one IPU's share.
        outfeed_bytes: The execution's outfeed, every replica's.
        steps: The steps the execution runs.
        replicas: The replicas (or IPUs) the outfeed is stacked over.
        ipus_per_device: IPUs that share each device (each has its share).
        platform: The JAX platform that compiled it.
        batched_copy: Whether a device that IPUs share stacks its own IPUs'
            outfeed first (a replicated step's does; a pipeline's program is
            not measured to).
        looped: Whether the program loops over steps: a program of one step
            (the `host` loop form's, or `steps_per_execution=1`) hands its
            replicas' outfeed out as it is, with no stack to take off.

    Returns:
        `use`, its temporaries without those copies (unchanged for one
        replica, a program of one step, or on other platforms).

    Example:

    >>> without_streamed_outfeed(use, outfeed_bytes=2**23, steps=64, replicas=2,
    ...                          ipus_per_device=1, platform="cpu").temporary_bytes
    """
    if replicas < 2 or platform != "cpu" or not looped:
        return use
    one = outfeed_bytes // (max(steps, 1) * replicas)  # a step of one replica
    held = outfeed_bytes
    if ipus_per_device > 1 and batched_copy:
        held += ipus_per_device * max(steps, 1) * one
    copied = held // ipus_per_device - one
    return dataclasses.replace(use, temporary_bytes=max(use.temporary_bytes - copied, 0))


def step_cost(lowered: Any, steps: int = 1) -> StepCost:
    """The cost of one step of a lowered program, the same on every platform.

    Counted over the program's StableHLO (`keras_ipu.device.cost`), not by
    a backend's cost analysis: XLA's analysis of a GPU-compiled program does
    not see the matrix products cuBLAS runs, and `Lowered.cost_analysis()`
    is not available on GPUs and counts a loop body once.

    Args:
        lowered: A `jax.stages.Lowered` program, or its StableHLO text.
        steps: Steps the program runs (loops are counted with their trip
            counts, so the count is shared out over these).

    Returns:
        A `StepCost`.

    Raises:
        ValueError: For fewer than one step, or text without a function.

    Example:

    >>> lowered = jax.jit(execution).lower(state, batches)  # 4 steps
    >>> step_cost(lowered, steps=4).flops
    """
    text = lowered if isinstance(lowered, str) else lowered.as_text()
    count = cost.count_stablehlo(text)
    return StepCost(
        flops=count.flops,
        transcendentals=count.transcendentals,
        bytes_accessed=count.bytes_accessed,
        half_flops=count.half_flops,
    ).per_step(steps)
