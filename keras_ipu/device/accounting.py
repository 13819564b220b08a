"""Per-IPU memory and cycle estimates from a compiled XLA program."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

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
    """XLA's cost analysis of one step.

    XLA counts a loop body once, so the analysis of an execution's
    on-device loop is the cost of one of its steps.

    Args:
        flops: Floating point operations.
        transcendentals: Transcendental operations (exp, tanh, ...).
        bytes_accessed: Bytes read and written.
    """

    flops: float
    transcendentals: float
    bytes_accessed: float

    def work_cycles(self, hardware: IPUHardware, half_precision: bool = False) -> float:
        """Compute or memory cycles, whichever is larger (no sync)."""
        compute = (self.flops + self.transcendentals) / hardware.flops_per_cycle(half_precision)
        memory = self.bytes_accessed / (hardware.memory_bytes_per_cycle_per_tile * hardware.tiles)
        return max(compute, memory)

    def cycles(self, hardware: IPUHardware, half_precision: bool = False) -> float:
        """Estimated IPU cycles: the slower of compute and memory, plus a sync.

        A bulk-synchronous step costs at least its compute time at peak
        flops and its memory traffic at the tiles' bandwidth; they overlap,
        so the larger one counts, plus one sync and exchange set-up.
        """
        return self.work_cycles(hardware, half_precision) + hardware.sync_cycles

    def per_ipu(self, ipus_per_device: int) -> StepCost:
        """One IPU's share of a device program that runs `ipus_per_device` IPUs batched.

        Example:

        >>> StepCost(800.0, 0.0, 80.0).per_ipu(4).flops
        200.0
        """
        return StepCost(self.flops / ipus_per_device, self.transcendentals / ipus_per_device,
                        self.bytes_accessed / ipus_per_device)


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


def step_cost(compiled: Any) -> StepCost:
    """The cost of one step of a compiled (or lowered) execution program."""
    analysis = compiled.cost_analysis() or {}
    if isinstance(analysis, (list, tuple)):  # older JAX: one dict per device
        analysis = analysis[0] if analysis else {}
    return StepCost(
        flops=float(analysis.get("flops", 0.0)),
        transcendentals=float(analysis.get("transcendentals", 0.0)),
        bytes_accessed=float(analysis.get("bytes accessed", 0.0)),
    )
