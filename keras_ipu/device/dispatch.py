"""Executions the host strings together from separately compiled programs.

Most executions are one compiled program (`device.program`). A pipelined
execution can also run as several small programs, one per stage op, that
the host dispatches to their IPUs in the order of the schedule table without
waiting for them (JAX dispatches asynchronously, so the IPUs still work at
the same time). This module holds what such an execution gives the
execution program: how to run it, and what each of its IPUs needs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

from keras_ipu.device.accounting import MemoryUse, StepCost
from keras_ipu.device.loops import LoopChoice


@dataclasses.dataclass(frozen=True)
class DispatchedExecutable:
    """A compiled dispatched execution.

    Args:
        run: `(state, batches) -> (state, outfeed)`: dispatches one
            execution's programs (asynchronously) and returns at once.
        memory: Per IPU of the execution (in the order of its IPUs), the
            memory its programs need: its state, the largest temporaries of
            its programs plus what it keeps between them, its io.
        cost: The cost of one step, or a function that counts it (when the
            report is read); `None` for an execution program whose pipeline
            table gives it (a pipeline's stage ops are counted there, the same
            for either form of the execution).
        compiler: The XLA options its programs were compiled with, and why,
            in words (`keras_ipu.device.compiler`).

    Example:

    >>> executable = execution.compile(state_spec, batches_spec)()
    >>> state, outfeed = executable.run(state, batches)
    """

    run: Callable[[Any, Any], tuple[Any, Any]]
    memory: tuple[MemoryUse, ...]
    cost: StepCost | Callable[[], StepCost] | None = None
    compiler: str = ""


class DispatchedExecution(Protocol):
    """What an execution program needs of an execution the host strings together.

    Example:

    >>> choice = execution.choose(state_spec, batches_spec, "cpu", "auto")
    >>> if choice.form == "host":
    ...     finish = execution.compile(state_spec, batches_spec)  # compiling in the background
    ...     executable = finish()
    """

    def choose(self, state: Any, batches: Any, platform: str, request: str) -> LoopChoice:
        """Whether to run dispatched (`"host"`) or as the one-program alternative."""

    def compile(self, state: Any, batches: Any) -> Callable[[], DispatchedExecutable]:
        """Starts compiling every program of the execution for these inputs.

        Returns a function that waits for them and gives the executable, so
        the caller can do other work while XLA compiles.
        """


__all__ = ["DispatchedExecutable", "DispatchedExecution"]
